"""Global loss denominators over a ``torch.distributed`` process group.

On data-parallel rank k, a loss normalised by the *local* token count weighs a token of a short micro-batch
more than one of a long micro-batch; the mean over ranks is then not the loss of the whole batch. Passing
the global counts from :func:`global_denominators` to :func:`rolloutopt.losses.policy_loss` (or
:func:`rolloutopt.losses.aggregate`) makes the per-rank losses sum to the global loss; ``world_size`` in the
result then compensates DDP's gradient averaging (verl's ``dp_size`` factor in ``agg_loss``).

Also here: :func:`rank_seed` / :func:`rank_generator` (per-rank seeds where sampling must differ across
ranks) and :class:`GlobalBatchTrust` (a trust region whose batch statistic — M2PO's second moment, SAT's
quantile — is computed over the global batch instead of each rank's micro-batch).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.losses.aggregation import Denominators
from rolloutopt.losses.policy import TrustStage
from rolloutopt.ratios import StageContext, TrustOutput
from rolloutopt.typing import BoolBT, FloatB, FloatBT, FloatBTb, IntB

__all__ = ["GlobalBatchTrust", "gather_rewards", "global_denominators", "rank_generator", "rank_seed", "request_shard"]


def global_denominators(
    mask: BoolBT,
    *,
    group: Groups | IntB | None = None,
    seq_weight: FloatB | None = None,
    process_group: Any = None,
) -> Denominators:
    r"""Token, sequence and group counts of the global batch, summed over ``process_group`` with one all-reduce.

    .. math::  N_{tok} = \sum_{k}\sum_{i,t} m^{(k)}_{i,t}, \quad
               N_{seq} = \sum_k \#\{i : \textstyle\sum_t m^{(k)}_{i,t} > 0\}, \quad
               N_{grp} = \sum_k \#\{g : \textstyle\sum_{i \in g, t} m^{(k)}_{i,t} > 0\}

    Args:
        mask: this rank's loss mask ``[B, T]``.
        group: this rank's group ids ``[B]``, to count groups (``prompt-mean``); without it ``groups`` is None.
            A prompt whose rollouts are split over ranks is counted once per rank that holds some of them;
            keep a group on one rank (verl and TRL do) for the exact prompt mean.
        seq_weight: per-sequence weights ``[B]``; a row with weight 0 leaves every count, as in ``policy_loss``.
        process_group: the data-parallel group (default: the world). Without an initialised
            ``torch.distributed`` the local counts are returned with ``world_size=1``.

    Returns:
        :class:`~rolloutopt.losses.Denominators` with fp32 0-d tensors on the mask's device and the group's
        ``world_size``. The all-reduce is a collective: every rank must call it.

    Exactness (tested on two gloo ranks in ``tests/integration/test_distributed_grad.py``): with these
    denominators the mean over ranks of the per-rank gradients (DDP's average) equals the single-process
    gradient of the concatenated batch for every aggregation mode and every per-token or per-sequence preset.
    Not exact: trust regions with a batch statistic (M2PO's second moment, SAT's quantile; wrap them in
    :class:`GlobalBatchTrust`), and ``policy_loss(..., removed_in_denominator=False)``, whose denominator
    drops the tokens a trust region or correction masks — the counts here are taken before those masks.
    """
    dims = Dims()
    m = as_mask(mask, "mask", dims, "B T")
    if seq_weight is not None:
        m = m & (as_float(seq_weight, "seq_weight", dims, "B", device=m.device) != 0)[:, None]
    lengths = m.sum(-1)
    counts = [lengths.sum(), (lengths > 0).sum()]
    if group is not None:
        g = as_groups(group, dims)
        counts.append((g.sum(lengths.to(torch.float32)) > 0).sum())
    stacked = torch.stack(counts).to(torch.float32)
    world_size = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stacked, group=process_group)
        world_size = torch.distributed.get_world_size(process_group)
    return Denominators(
        tokens=stacked[0],
        sequences=stacked[1],
        groups=stacked[2] if group is not None else None,
        world_size=world_size,
    )


def _dist_ready() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def rank_seed(seed: int, rank: int | None = None) -> int:
    r"""A deterministic per-rank seed, different on every data-parallel rank, for sampling that must differ.

    .. math::  s_k = \operatorname{BLAKE2b}_{64}\big(\text{"rolloutopt-rank-seed"},\ s,\ k\big) \bmod 2^{63}

    Use it where each rank must draw differently (prompt sampling of a rank's own shard, exploration noise,
    dropout of rollouts); keep the plain ``seed`` where every rank must draw the same (allocators planning
    identically, shared shuffles). A hash, unlike ``seed + rank``, gives no overlap between neighbouring base
    seeds (``(seed=0, rank=1)`` and ``(seed=1, rank=0)`` differ) and is stable across Python processes and
    versions (no ``hash()`` randomisation). No paper: an engineering helper.

    Args:
        seed: the run's base seed (any Python int).
        rank: the data-parallel rank; ``None`` reads ``torch.distributed.get_rank()`` when the default process
            group is initialised, else 0 (a single process).

    Returns:
        an int in ``[0, 2^63)``, accepted by ``torch.manual_seed``, ``torch.Generator.manual_seed``,
        ``random.seed`` and ``numpy.random.default_rng`` (take ``% 2**32`` for the legacy ``np.random.seed``).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InputError("seed", "an int", repr(seed), "pass the run's base seed, e.g. seed=0")
    if rank is None:
        rank = int(torch.distributed.get_rank()) if _dist_ready() else 0
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise InputError("rank", "an int >= 0 (or None to read torch.distributed)", repr(rank), "pass rank=0, 1, ...")
    digest = hashlib.blake2b(f"rolloutopt-rank-seed:{seed}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rank_generator(seed: int, rank: int | None = None, device: str | torch.device = "cpu") -> torch.Generator:
    r"""A ``torch.Generator`` on ``device`` seeded with :func:`rank_seed` (``seed``, ``rank``).

    .. math::  g_k = \text{Generator}(\text{seed}=s_k), \quad s_k = \text{rank\_seed}(s, k)

    Args:
        seed: the run's base seed; rank: as in :func:`rank_seed`; device: the generator's device.
    """
    return torch.Generator(device=device).manual_seed(rank_seed(seed, rank))


def _world(process_group: Any = None) -> tuple[int, int]:
    if not _dist_ready():
        return 0, 1
    return int(torch.distributed.get_rank(process_group)), int(torch.distributed.get_world_size(process_group))


def request_shard(total: int, *, rank: int | None = None, world_size: int | None = None) -> slice:
    """This rank's contiguous share of a request's ``total`` rollouts, for data-parallel generation.

    Allocators plan identically on every rank (same prompts, same plain ``seed``, same history); each rank
    generates the rollouts ``request_shard(request.total)`` of the request's flattened rollout list
    (``request.prompt_ids.repeat_interleave(request.counts)``), then :func:`gather_rewards` gives every rank all
    the rewards, so every rank observes, finishes and updates with the same data and stays identical. Shares
    differ by at most one rollout; the first ``total % world_size`` ranks take one more.

    Args:
        total: rollouts in the request (``request.total``).
        rank, world_size: default from ``torch.distributed`` (0 and 1 without it).
    """
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise InputError("total", "an int >= 0 (request.total)", repr(total), "pass request.total")
    r, w = _world()
    rank = r if rank is None else rank
    world_size = w if world_size is None else world_size
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InputError("rank", f"0 <= rank < world_size ({world_size})", repr(rank), "pass the data-parallel rank")
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def gather_rewards(local: FloatB, total: int, *, process_group: Any = None) -> Float[Tensor, " total"]:
    """All ranks' shares of a request's rewards, in rank order: the full ``[total]`` reward vector on every rank.

    The counterpart of :func:`request_shard` (rank ``k`` passes the rewards of ``request_shard(total)[k]``).
    One all-gather of fixed-size padded buffers (shares differ by at most one), gloo and NCCL alike; without
    ``torch.distributed`` it returns ``local``. Float64 on the input's device.

    Args:
        local: this rank's rewards ``[len(request_shard(total))]``.
        total: ``request.total``.
        process_group: the data-parallel group (default: the world).
    """
    if not isinstance(local, Tensor) or not local.is_floating_point() or local.ndim != 1:
        raise InputError("local", "a 1-d float tensor of this rank's rewards", repr(local), "pass this shard's rewards")
    rank, world = _world(process_group)
    share = request_shard(total, rank=rank, world_size=world)
    if local.numel() != share.stop - share.start:
        raise InputError(
            "local",
            f"{share.stop - share.start} rewards (this rank's request_shard of {total})",
            f"{local.numel()} rewards",
            "generate exactly request_shard(request.total) of the request",
        )
    if world == 1:
        return local.to(torch.float64)
    size = -(-total // world)
    buf = torch.zeros(size, dtype=torch.float64, device=local.device)
    buf[: local.numel()] = local.to(torch.float64)
    parts = [torch.empty_like(buf) for _ in range(world)]
    torch.distributed.all_gather(parts, buf, group=process_group)
    lengths = [request_shard(total, rank=k, world_size=world) for k in range(world)]
    return torch.cat([part[: sl.stop - sl.start] for part, sl in zip(parts, lengths, strict=True)])


# Inputs a trust stage may read from the StageContext, gathered row-wise; "token" fields are padded over T too.
_TOKEN_FIELDS = ("old_logp", "behav_logp", "versions", "topk_logp", "topk_behav_logp")


@dataclass(frozen=True)
class GlobalBatchTrust:
    r"""Run a batch-statistic trust region on the global batch: each rank gathers every rank's inputs.

    .. math::  L^{(k)}_{i,t} = L^{trust}\big(r^{(k)}_{i,t}, A^{(k)}_{i,t};\ S(\{r^{(j)}, A^{(j)}, m^{(j)},
               \dots\}_{j=1}^{W})\big)

    A trust region such as :class:`~rolloutopt.ratios.M2POClip`, :class:`~rolloutopt.ratios.M2POMask` (M2PO's
    second moment, arXiv 2510.01161) or :class:`~rolloutopt.ratios.SATClip` (SAT's staleness quantile,
    arXiv 2607.18722) computes a batch statistic :math:`S`; on a data-parallel rank it sees only that rank's
    micro-batch, so the per-rank losses do not sum to the single-process loss. This wrapper all-gathers the
    stage's inputs (``ratio``, ``log_ratio``, ``advantages``, ``logp`` and the context's ``mask``,
    ``old_logp``, ``behav_logp``, ``versions``, ``topk_*``, ``confidence``; rows and tokens padded with a
    false mask), calls ``trust`` on the concatenated batch, and returns this rank's rows. Other ranks' rows are
    detached, so the result is exact when ``trust`` uses the other rows only through detached statistics —
    true of M2POClip, M2POMask and SATClip, whose statistics are detached. Without an initialised
    ``torch.distributed`` it calls ``trust`` unchanged.

    Args (dataclass fields):
        trust: the wrapped trust stage.
        process_group: the data-parallel group (default: the world).

    Called as a trust stage: ``ratio``, ``log_ratio``, ``logp`` ``[B, T]``, ``advantages`` ``[B, 1]`` or
    ``[B, T]``, ``ctx`` required (``policy_loss`` passes it). ``B`` and ``T`` may differ between ranks.

    Edge cases and costs: a rank with no loss token takes part with an all-false mask; the call is a collective
    (every rank must call it, the same number of times) costing one all-reduce of the shapes (a host
    synchronisation) and one all-gather per input; ``stage_inputs`` (``ctx.extra``) cannot be gathered
    generically and raise an :class:`InputError`; every rank must pass the same optional inputs. The
    trust region's metrics (e.g. ``m2po_m2``) are then global; its indicators are this rank's rows.
    """

    trust: TrustStage
    process_group: Any = None

    def __post_init__(self) -> None:
        if not callable(self.trust):
            raise InputError(
                "GlobalBatchTrust.trust", "a trust stage (callable)", repr(self.trust), "pass e.g. M2POClip()"
            )

    @property
    def requires(self) -> tuple[str, ...]:
        """The wrapped stage's required inputs (it is the stage that reads them)."""
        return tuple(getattr(self.trust, "requires", ()))

    @property
    def accepts(self) -> tuple[str, ...]:
        """The wrapped stage's optional inputs."""
        return tuple(getattr(self.trust, "accepts", ()))

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        if not _dist_ready():
            return self.trust(ratio, log_ratio, advantages, logp, ctx=ctx)
        if ctx is None:
            raise InputError(
                "ctx", "the StageContext (GlobalBatchTrust gathers the mask from it)", "None", "call it via policy_loss"
            )
        if ctx.extra:
            raise InputError(
                "stage_inputs",
                "no stage_inputs with GlobalBatchTrust (they cannot be gathered across ranks)",
                f"keys {sorted(ctx.extra)}",
                "pass the inputs the trust stage needs through policy_loss's named arguments",
            )
        pg = self.process_group
        world = int(torch.distributed.get_world_size(pg))
        rank = int(torch.distributed.get_rank(pg))
        b, t = ratio.shape
        present = [getattr(ctx, f) is not None for f in (*_TOKEN_FIELDS, "confidence")]
        k = ctx.topk_logp.shape[-1] if ctx.topk_logp is not None else 0
        token_adv = advantages.shape[-1] != 1
        local = torch.tensor([b, t, k, int(token_adv), *map(int, present)], dtype=torch.int64, device=ratio.device)
        both = torch.cat([local, -local])
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=pg)
        hi, lo = both[: local.numel()].tolist(), (-both[local.numel() :]).tolist()
        b_max, t_max, _, any_token_adv = hi[:4]
        names = (*_TOKEN_FIELDS, "confidence")
        differ = [n for n, h, lw in zip(names, hi[4:], lo[4:], strict=True) if h != lw]
        if hi[2] != lo[2]:
            differ.append("the top-K width K")
        if differ:
            raise InputError(
                "ctx",
                "the same optional inputs (and top-K width) on every data-parallel rank",
                f"a difference between ranks in {', '.join(differ)}",
                "pass the same policy_loss inputs on every rank",
            )

        def gather(x: Tensor, token: bool, fill: float = 0.0) -> Tensor:
            shape = (b_max, t_max, *x.shape[2:]) if token else (b_max, *x.shape[1:])
            padded = torch.full(shape, fill, dtype=x.dtype, device=x.device)
            if token:
                padded[:b, :t] = x
            else:
                padded[:b] = x
            wire = padded.detach().to(torch.uint8) if x.dtype == torch.bool else padded.detach()
            parts = [torch.empty_like(wire) for _ in range(world)]
            torch.distributed.all_gather(parts, wire.contiguous(), group=pg)
            parts = [p.to(x.dtype) for p in parts]
            parts[rank] = padded  # this rank's rows keep their autograd graph
            return torch.cat(parts)

        adv = advantages.expand(b, t) if any_token_adv else advantages
        g_ratio, g_log_ratio, g_logp = gather(ratio, True, 1.0), gather(log_ratio, True), gather(logp, True)
        g_ctx = replace(
            ctx,
            logp=g_logp,
            mask=gather(ctx.mask, True),
            advantages=gather(adv, bool(any_token_adv)),
            confidence=None if ctx.confidence is None else gather(ctx.confidence, False),
        )
        tokens: dict[str, Any] = {
            f: gather(getattr(ctx, f), True) for f in _TOKEN_FIELDS if getattr(ctx, f) is not None
        }
        g_ctx = replace(g_ctx, **tokens)
        out = self.trust(g_ratio, g_log_ratio, g_ctx.advantages, g_logp, ctx=g_ctx)
        rows = slice(rank * b_max, rank * b_max + b)

        def mine(x: Tensor) -> Tensor:
            return x[rows][:, :t]

        return TrustOutput(
            mine(out.loss),
            None if out.keep is None else mine(out.keep),
            {name: mine(v) for name, v in out.indicators.items()},
            out.metrics,
        )
