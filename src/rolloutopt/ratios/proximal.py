r"""Proximal policies for off-policy and asynchronous PPO: A-3PO interpolation, PPO-EWMA, CoPRIS.

Decoupled PPO (AReaL, arXiv 2505.24298) separates three policies: the behaviour policy that generated the
tokens (``behav_logp``), a *proximal* policy the PPO ratio is clipped against (``old_logp``), and the current
policy (``logp``). The loss is

.. math::  \mathcal L = \operatorname{sg}(w)\,\max\big(-A u,\ -A\operatorname{clip}(u, 1-\epsilon, 1+\epsilon_{high})\big),
           \qquad u = e^{\ell^\theta - \ell^{prox}}, \quad w = e^{\ell^{prox} - \ell^{beh}}

which :func:`rolloutopt.losses.policy_loss` composes from a ratio stage, :class:`~rolloutopt.ratios.PPOClip` and
a behaviour-weight correction. This module supplies the proximal log-probs when the trainer has none to give:

- :class:`A3POProximal` / :func:`a3po_proximal_logp`: AReaL's version interpolation (A-3PO), no forward pass;
- :class:`EWMAProximal`: an exponentially weighted moving average of each rollout's log-probs (PPO-EWMA's
  proximal policy, [reconstructed] revision), with :func:`factorise_log_ratio` for the discrepancy × staleness
  split of the total ratio;
- :class:`CoPRISProximal` / :func:`copris_old_logp`: CoPRIS's cross-stage concatenation for partial rollouts.

Proximal stages are called by ``policy_loss(..., proximal=...)`` with the validated
:class:`~rolloutopt.ratios.StageContext` and return detached ``[B, T]`` log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_index,
    as_mask,
    checks_enabled,
    choice,
    describe,
    finite,
    require_experimental,
)
from rolloutopt.errors import InputError
from rolloutopt.ratios.context import StageContext
from rolloutopt.typing import BoolBT, FloatBT, IntB, IntBT

__all__ = [
    "A3POProximal",
    "CoPRISProximal",
    "EWMAProximal",
    "a3po_alpha",
    "a3po_proximal_logp",
    "copris_old_logp",
    "factorise_log_ratio",
]

A3POMethod = Literal["loglinear", "linear"]
_A3PO_METHODS = ("loglinear", "linear")
_VERSIONS_FIX = "pass versions=versions.to({device!r}) to policy_loss (or the preset), on the log-probs' device"


def _on_device(x: Tensor, name: str, device: torch.device, fix: str) -> None:
    """Raise an InputError naming ``name`` unless ``x`` is on ``device`` (skipped while checks are off)."""
    if checks_enabled() and x.device != device:
        raise InputError(name, f"a tensor on {device} (the device of the log-probs)", describe(x), fix)


def _int_version(v: Any, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise InputError(name, "an int (a policy version)", describe(v), f"pass {name} as a Python int, e.g. the step")
    return v


# ----------------------------------------------------------------------------------------------------- A-3PO


def a3po_alpha(versions: IntBT, policy_version: int, *, dtype: torch.dtype = torch.float32) -> FloatBT:
    r"""A-3PO's per-token interpolation weight between the behaviour and the current policy.

    .. math::  \alpha_{i,t} = \operatorname{clip}\Big(\frac{v_{prox} - v^{beh}_{i,t}}{v_\theta - v^{beh}_{i,t}},
               0, 1\Big), \qquad v_{prox} = v_\theta - 1

    0 where :math:`v_\theta = v^{beh}` (or :math:`v^{beh} > v_\theta`) and for prompt tokens (``versions < 0``,
    AReaL's marker). :math:`v^{beh} = v_\theta - 1` gives 0 (the behaviour policy *is* the proximal one);
    :math:`v^{beh} = v_\theta - 3` gives 2/3. Reference: AReaL arXiv 2505.24298, ``areal/trainer/ppo/actor.py``
    ``compute_prox_logp_approximations``.

    Args:
        versions: behaviour version of each token, integer ``[B, T]``.
        policy_version: :math:`v_\theta`, the version of the policy being trained.
        dtype: floating dtype of the result.

    Returns:
        ``[B, T]`` weights in ``[0, 1]``.
    """
    v = as_index(versions, "versions", Dims(), "B T")
    vt = _int_version(policy_version, "policy_version")
    # Integer differences first (exact), then one division in the requested dtype.
    diff = vt - v
    gap = diff - 1
    ok = (diff > 0) & (v >= 0)
    a = gap.to(dtype) / diff.clamp(min=1).to(dtype)
    return torch.where(ok, a, torch.zeros_like(a)).clamp(0.0, 1.0)


def _a3po(lp: Tensor, behav: Tensor, alpha: Tensor, m: Tensor | None, method: str) -> Tensor:
    lp = lp.detach()
    if method == "loglinear":
        out = behav + alpha * (lp - behav)
    else:
        # log((1-a) e^beh + a e^theta) in log space: exact (AReaL adds 1e-10 inside the log), finite for finite
        # inputs; log(0) = -inf terms drop out of logaddexp at a = 0 or a = 1.
        out = torch.logaddexp(torch.log1p(-alpha) + behav, torch.log(alpha) + lp)
    return out if m is None else torch.where(m, out, torch.zeros_like(out))


def a3po_proximal_logp(
    logp: FloatBT,
    behav_logp: FloatBT,
    versions: IntBT,
    policy_version: int,
    *,
    method: A3POMethod = "loglinear",
    mask: BoolBT | None = None,
) -> FloatBT:
    r"""A-3PO: approximate the proximal policy's log-probs by interpolating behaviour and current policy.

    .. math::  \text{loglinear:}\quad \ell^{prox} = \ell^{beh} + \alpha\,(\operatorname{sg}\ell^\theta - \ell^{beh})
    .. math::  \text{linear:}\quad \ell^{prox} = \log\big((1-\alpha)\,e^{\ell^{beh}} + \alpha\,e^{\operatorname{sg}\ell^\theta}\big)

    with :math:`\alpha` from :func:`a3po_alpha` (:math:`v_{prox} = v_\theta - 1`). It saves the proximal forward
    pass of decoupled PPO (AReaL reports ~1.8× faster steps). Reference: AReaL arXiv 2505.24298,
    ``prox_logp_method="loglinear"`` (default there; ``"linear"`` is its probability-space alternative).

    Args:
        logp: current log-probs ``[B, T]``; detached here (the proximal policy carries no gradient).
        behav_logp: behaviour (rollout-engine) log-probs ``[B, T]``.
        versions: behaviour version of each token, integer ``[B, T]``; negative = prompt token (α = 0).
        policy_version: :math:`v_\theta`.
        method: ``"loglinear"`` (default, AReaL's) or ``"linear"`` (computed exactly in log space; AReaL adds
            1e-10 inside the log, a relative difference of at most 1e-10/p).
        mask: optional loss mask ``[B, T]``; positions outside it are set to 0.

    Returns:
        Detached proximal log-probs ``[B, T]``. Edge cases: every token one version behind (α ≡ 0) gives
        ``behav_logp`` exactly; an all-masked row is all 0 with ``mask``.
    """
    choice(method, "method", _A3PO_METHODS)
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    behav = as_float(behav_logp, "behav_logp", dims, "B T", device=lp.device)
    v = as_index(versions, "versions", dims, "B T")
    _on_device(v, "versions", lp.device, f"move versions with .to({str(lp.device)!r})")
    m = None if mask is None else as_mask(mask, "mask", dims, "B T", device=lp.device)
    finite(lp, "logp", m)
    finite(behav, "behav_logp", m)
    alpha = a3po_alpha(v, policy_version, dtype=lp.dtype)
    return _a3po(lp, behav, alpha, m, method)


@dataclass(frozen=True)
class A3POProximal:
    r"""Proximal stage: A-3PO's version interpolation (:func:`a3po_proximal_logp`) from the stage context.

    .. math::  \ell^{prox} = \ell^{beh} + \alpha\,(\operatorname{sg}\ell^\theta - \ell^{beh}),
               \qquad \alpha = \operatorname{clip}\Big(\frac{v_\theta - 1 - v^{beh}}{v_\theta - v^{beh}}, 0, 1\Big)

    (``method="linear"`` mixes probabilities instead.) Reads ``ctx.logp`` (detached), ``ctx.behav_logp``,
    ``ctx.versions`` (behaviour version per token) and ``ctx.policy_version`` (:math:`v_\theta`); all three
    optional inputs are required (:attr:`requires`; an ``InputError`` names a missing one, or ``versions`` on
    another device than the log-probs). ``old_logp`` passed to ``policy_loss`` is ignored (may be None).
    Default ``method="loglinear"`` (AReaL's). Edge cases: prompt tokens (``versions < 0``) and tokens one
    version behind get ``behav_logp``; 0 outside ``ctx.mask``; ``B = 0`` and ``T = 0`` give empty log-probs.
    Reference: AReaL arXiv 2505.24298.
    """

    method: A3POMethod = "loglinear"
    requires: ClassVar[tuple[str, ...]] = ("behav_logp", "versions", "policy_version")
    accepts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        choice(self.method, "A3POProximal.method", _A3PO_METHODS)

    def __call__(self, ctx: StageContext) -> FloatBT:
        """Proximal log-probs ``[B, T]``, detached, 0 outside ``ctx.mask``."""
        behav: Tensor = ctx.need("behav_logp", "A3POProximal")
        versions: Tensor = ctx.need("versions", "A3POProximal")
        vt: int = ctx.need("policy_version", "A3POProximal")
        _on_device(versions, "versions", ctx.logp.device, _VERSIONS_FIX.format(device=str(ctx.logp.device)))
        alpha = a3po_alpha(versions, vt, dtype=ctx.logp.dtype)
        return _a3po(ctx.logp, behav, alpha, ctx.mask, self.method).detach()


# ---------------------------------------------------------------------------------------------------- CoPRIS


def copris_old_logp(
    buffered: FloatBT, buffered_len: IntB, recomputed: FloatBT, *, mask: BoolBT | None = None
) -> FloatBT:
    r"""CoPRIS's cross-stage old log-probs: keep the buffered prefix, append the newly recomputed suffix.

    .. math::  \ell^{old}_{i,t} = \begin{cases} \text{buffered}_{i,t} & t < L^{prev}_i \\
               \text{recomputed}_{i,t} & t \ge L^{prev}_i \end{cases}

    After each rollout stage the trainer recomputes old log-probs of every (possibly partial) response under
    the current policy; the prefix generated in earlier stages keeps the log-probs stored then and is never
    overwritten, so each token's old log-prob is that of the policy version that generated it. The result is
    also the next stage's buffer. Reference: CoPRIS arXiv 2511.05589, ``777pomingzi/CoPRIS@43ee8c7``
    ``verl/trainer/ppo/ray_trainer.py`` (``uid2old_log_prob``).

    Args:
        buffered: stored old log-probs ``[B, T]`` (0-padded; the first ``buffered_len`` entries are used).
        buffered_len: stored length :math:`L^{prev}_i` per response, integer ``[B]`` in ``[0, T]``; 0 for a
            response started this stage (then the result is the plain recompute).
        recomputed: this stage's recompute ``[B, T]`` (only positions ``≥ buffered_len`` are used).
        mask: optional response mask ``[B, T]``; positions outside it are set to 0 (CoPRIS pads with 0).

    Returns:
        ``[B, T]`` old log-probs. Edge cases: ``buffered_len = 0`` gives ``recomputed``; ``buffered_len = T``
        gives ``buffered``.
    """
    dims = Dims()
    buf = as_float(buffered, "buffered", dims, "B T")
    rec = as_float(recomputed, "recomputed", dims, "B T", device=buf.device)
    n = as_index(buffered_len, "buffered_len", dims, "B")
    m = None if mask is None else as_mask(mask, "mask", dims, "B T", device=buf.device)
    if checks_enabled():
        if n.device != buf.device:
            raise InputError(
                "buffered_len", f"a tensor on {buf.device}", describe(n), f"move it with .to({str(buf.device)!r})"
            )
        if rec.dtype != buf.dtype:
            raise InputError(
                "recomputed", f"the dtype of buffered ({buf.dtype})", describe(rec), "cast both to one dtype"
            )
        T = buf.shape[-1]
        if bool(((n < 0) | (n > T)).any()):
            raise InputError(
                "buffered_len",
                f"stored lengths in [0, T={T}]",
                f"min {int(n.min())}, max {int(n.max())}",
                "pass the number of buffered positions of each response",
            )
        pos = torch.arange(T, device=buf.device)
        prefix = pos[None, :] < n[:, None]
        finite(buf, "buffered", prefix if m is None else prefix & m)
        finite(rec, "recomputed", ~prefix if m is None else ~prefix & m)
    pos = torch.arange(buf.shape[-1], device=buf.device)
    out = torch.where(pos[None, :] < n[:, None], buf, rec)
    return out if m is None else torch.where(m, out, torch.zeros_like(out))


@dataclass(frozen=True)
class CoPRISProximal:
    """Proximal stage: CoPRIS's per-segment old log-probs, selected by generating version.

    .. math::  \\ell^{old}_{i,t} = \\begin{cases} \\ell^{beh}_{i,t} & v_{i,t} < V \\\\
               \\ell^{recompute}_{i,t} & v_{i,t} \\ge V \\end{cases}

    Reads ``ctx.versions`` (the version that generated each token), ``ctx.behav_logp`` (the buffered log-probs
    recorded when each earlier segment was generated, i.e. the trainer's recompute at that stage),
    ``ctx.old_logp`` (this stage's recompute under the current version V) and ``ctx.policy_version`` (V; when
    None, the newest version among the loss tokens). Tokens from earlier stages keep their buffered value;
    tokens generated under V take the recompute. Equivalent to :func:`copris_old_logp` when each response's
    versions increase along it. Staleness metrics (``staleness_mean``...) come from ``policy_loss``.
    Inputs (:attr:`requires`, :attr:`accepts`): ``behav_logp`` and ``versions`` are required, ``policy_version``
    is read when given; ``versions`` on another device than the log-probs is an ``InputError`` naming it.
    Edge cases: ``B = 0``, ``T = 0`` and all-masked rows give 0 everywhere (no version is read).
    Reference: CoPRIS arXiv 2511.05589 (script defaults: clip 0.2/0.28, dual clip 10, token-mean).
    """

    requires: ClassVar[tuple[str, ...]] = ("behav_logp", "versions")
    accepts: ClassVar[tuple[str, ...]] = ("policy_version",)

    def __call__(self, ctx: StageContext) -> FloatBT:
        """Old log-probs ``[B, T]``, detached, 0 outside ``ctx.mask``."""
        versions: Tensor = ctx.need("versions", "CoPRISProximal")
        behav: Tensor = ctx.need("behav_logp", "CoPRISProximal")
        recompute: Tensor = ctx.need("old_logp", "CoPRISProximal")
        _on_device(versions, "versions", behav.device, _VERSIONS_FIX.format(device=str(behav.device)))
        m = ctx.mask
        if ctx.policy_version is None:
            low = torch.full_like(versions, torch.iinfo(versions.dtype).min)
            newest = torch.where(m, versions, low).amax() if versions.numel() else versions.sum()
        else:
            newest = torch.tensor(ctx.policy_version, dtype=versions.dtype, device=versions.device)
        out = torch.where(versions < newest, behav, recompute)
        return torch.where(m, out, torch.zeros_like(out)).detach()


# -------------------------------------------------------------------------------------------------- PPO-EWMA


def factorise_log_ratio(
    logp: FloatBT, old_logp: FloatBT, behav_logp: FloatBT, mask: BoolBT | None = None
) -> tuple[FloatBT, FloatBT]:
    r"""Split the total log-ratio into a training–inference discrepancy and a staleness term.

    .. math::  \underbrace{\ell^\theta - \ell^{beh}}_{\text{total}}
               = \underbrace{(\ell^{old} - \ell^{beh})}_{\text{discrepancy}}
               + \underbrace{(\ell^\theta - \ell^{old})}_{\text{staleness}}

    ``old_logp`` is the trainer-side log-prob at the behaviour's weights version (or its substitute, e.g. the
    :class:`EWMAProximal` average); the discrepancy term is then an engine mismatch (same weights, different
    numerics) and the staleness term the policy drift since. The sum is exactly ``logp - behav_logp`` in log
    space (the two differences share ``old_logp``; the identity holds to rounding of one subtraction).
    Reference: "Missing old logits", arXiv 2605.12070 (problem statement); background PPO-EWMA arXiv 2110.00641.

    Args:
        logp: current log-probs ``[B, T]`` (the staleness term carries its gradient).
        old_logp: proximal / old-train log-probs ``[B, T]``.
        behav_logp: behaviour log-probs ``[B, T]``.
        mask: optional mask ``[B, T]``; both terms are 0 outside it.

    Returns:
        ``(discrepancy_log_ratio, staleness_log_ratio)``, each ``[B, T]``, unclamped (clamp before ``exp``).
    """
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    old = as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    beh = as_float(behav_logp, "behav_logp", dims, "B T", device=lp.device)
    m = None if mask is None else as_mask(mask, "mask", dims, "B T", device=lp.device)
    for x, name in ((lp, "logp"), (old, "old_logp"), (beh, "behav_logp")):
        finite(x, name, m)
    disc, stale = old - beh, lp - old
    if m is None:
        return disc, stale
    return torch.where(m, disc, torch.zeros_like(disc)), torch.where(m, stale, torch.zeros_like(stale))


class EWMAProximal:
    r"""PPO-EWMA proximal log-probs: an exponentially weighted moving average of each rollout's log-probs.

    .. math::  \bar\ell_{i,t} \leftarrow \beta\,\bar\ell_{i,t} + (1-\beta)\,\ell_{i,t},
               \qquad \bar\ell_{i,t} = \ell_{i,t} \text{ at a position's first update}

    PPO-EWMA (arXiv 2110.00641) keeps an EWMA of the *parameters* and uses that policy as the proximal one;
    rolloutopt owns no weights, so this helper keeps the EWMA of the *log-probs* of the sampled tokens, keyed by
    stable int64 rollout ids, updated once per optimiser step with the trainer's log-probs of that step. This,
    and its use as the substitute "old logits" of the decoupled factorisation (:func:`factorise_log_ratio`), is
    the **[reconstructed]** revision of arXiv 2605.12070 (no code found; the named ROLL fork predates it), so
    ``experimental=True`` is required. A log-prob EWMA equals the log-probs of the parameter EWMA only to first
    order in the parameter drift. β = 0 gives the current log-probs (u ≡ 1).

    Memory is bounded: at most ``capacity`` rollouts are stored; when a step brings new ids beyond it, the
    least recently updated rollouts are evicted first (ties: smallest id first). Rollouts of the current
    update are never evicted by it. State is data (``state_dict`` / ``load_state_dict`` round-trip exactly).

    Args:
        beta: decay :math:`\beta \in [0, 1)`. Default 0.9 — an assumption: PPO-EWMA's batch-size-invariance
            rule sets β per experiment (proximal "age" held fixed); no default is given for the revision.
        capacity: maximum number of stored rollouts (default 65,536).
        experimental: must be True (see above).
    """

    def __init__(self, beta: float = 0.9, capacity: int = 65_536, *, experimental: bool = False) -> None:
        require_experimental(
            experimental,
            "the PPO-EWMA revision (an EWMA of the log-probs used as the missing old logits, from the abstract of "
            "arXiv 2605.12070)",
            "docs/methods/offpolicy.md",
        )
        ok = isinstance(beta, (int, float)) and not isinstance(beta, bool) and 0 <= beta < 1
        if not ok:
            raise InputError("beta", "a decay in [0, 1)", describe(beta), "use e.g. beta=0.9 (0: no averaging)")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise InputError("capacity", "a positive int", describe(capacity), "use e.g. capacity=65536")
        self.beta = float(beta)
        self.capacity = capacity
        self._ids = torch.empty(0, dtype=torch.long)  # sorted ascending
        self._values = torch.empty(0, 0)
        self._seen = torch.empty(0, 0, dtype=torch.bool)
        self._last = torch.empty(0, dtype=torch.long)  # step of last update, for eviction
        self._step = 0

    def __len__(self) -> int:
        """Number of stored rollouts."""
        return int(self._ids.numel())

    def update(self, ids: IntB, logp: FloatBT, mask: BoolBT) -> FloatBT:
        r"""Fold this step's log-probs into the average and return the averaged log-probs ``[B, T]``.

        Args:
            ids: stable rollout ids, integer ``[B]``, distinct within a call.
            logp: this step's log-probs of the sampled tokens ``[B, T]`` (detached here).
            mask: ``[B, T]``; a position seen for the first time (a new rollout, or a partial rollout that
                grew) starts at its log-prob; positions outside ``mask`` are not updated and read 0.

        Returns:
            The EWMA log-probs ``[B, T]`` (detached, 0 outside ``mask``), to pass as ``old_logp``.
        """
        dims = Dims()
        idx = as_index(ids, "ids", dims, "B")
        lp = as_float(logp, "logp", dims, "B T").detach()
        m = as_mask(mask, "mask", dims, "B T", device=lp.device)
        finite(lp, "logp", m)
        B, T = lp.shape
        if checks_enabled():
            if lp.shape[0] > self.capacity:
                raise InputError(
                    "ids", f"at most capacity={self.capacity} rollouts per update", f"{B}", "raise capacity"
                )
            if idx.numel() and bool((idx.sort().values.diff() == 0).any()):
                raise InputError("ids", "distinct rollout ids", "repeated ids", "pass each rollout once per update")
        idx = idx.to(lp.device)
        self._to(lp.device, lp.dtype, T)
        self._step += 1

        # Locate the ids in the sorted store (vectorised; no loop over rows).
        n = self._ids.numel()
        W = self._values.shape[1]
        if n:
            pos = torch.searchsorted(self._ids, idx).clamp(max=n - 1)
            found = self._ids[pos] == idx
            stored_v = torch.where(found[:, None], self._values[pos], torch.zeros_like(self._values[pos]))
            stored_s = self._seen[pos] & found[:, None]
        else:
            pos = torch.zeros_like(idx)
            found = torch.zeros(B, dtype=torch.bool, device=lp.device)
            stored_v = lp.new_zeros(B, W)
            stored_s = m.new_zeros(B, W)
        old_v, old_s = stored_v[:, :T], stored_s[:, :T]
        ewma = torch.where(old_s, self.beta * old_v + (1 - self.beta) * lp, lp)
        ewma = torch.where(m, ewma, old_v)  # positions outside mask keep their stored value (0 if never seen)
        full_v = torch.cat([ewma, stored_v[:, T:]], 1)
        full_s = torch.cat([old_s | m, stored_s[:, T:]], 1)

        # Write back: stored rows in place, new rows appended; then evict and re-sort by id.
        rows = pos[found]
        self._values[rows] = full_v[found]
        self._seen[rows] = full_s[found]
        self._last[rows] = self._step
        nf = ~found
        ids_all = torch.cat([self._ids, idx[nf]])
        vals_all = torch.cat([self._values, full_v[nf]])
        seen_all = torch.cat([self._seen, full_s[nf]])
        last_all = torch.cat([self._last, torch.full_like(idx[nf], self._step)])
        keep = self._evict(ids_all, last_all)
        order = ids_all[keep].argsort()
        sel = keep[order]
        self._ids, self._values, self._seen, self._last = ids_all[sel], vals_all[sel], seen_all[sel], last_all[sel]
        return torch.where(m, ewma, torch.zeros_like(ewma))

    def _evict(self, ids: Tensor, last: Tensor) -> Tensor:
        """Indices of the rows to keep: the ``capacity`` most recently updated (ties: larger id kept)."""
        if ids.numel() <= self.capacity:
            return torch.arange(ids.numel(), device=ids.device)
        # Lexicographic (last, id): sort by id, then stable sort by last; keep the tail.
        by_id = ids.argsort()
        by_last = last[by_id].argsort(stable=True)
        return by_id[by_last][-self.capacity :]

    def _to(self, device: torch.device, dtype: torch.dtype, width: int) -> None:
        if self._values.numel() == 0 and self._values.dtype != dtype:
            self._values = self._values.to(dtype)
        self._ids, self._last = self._ids.to(device), self._last.to(device)
        self._values, self._seen = self._values.to(device=device, dtype=dtype), self._seen.to(device)
        W = self._values.shape[1]
        if width > W:
            n = self._values.shape[0]
            self._values = torch.cat([self._values, self._values.new_zeros(n, width - W)], 1)
            self._seen = torch.cat([self._seen, self._seen.new_zeros(n, width - W)], 1)

    def state_dict(self) -> dict[str, Any]:
        """The full state as tensors and numbers (copies): ids, values, seen mask, last-update steps, step."""
        return {
            "beta": self.beta,
            "capacity": self.capacity,
            "step": self._step,
            "ids": self._ids.clone(),
            "values": self._values.clone(),
            "seen": self._seen.clone(),
            "last": self._last.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` exactly (``beta`` and ``capacity`` must match this object's)."""
        keys = ("beta", "capacity", "step", "ids", "values", "seen", "last")
        missing = [k for k in keys if k not in state]
        if missing:
            raise InputError("state", f"a state_dict with keys {', '.join(keys)}", f"missing {missing}", "pass one")
        for k in ("beta", "capacity"):
            if state[k] != getattr(self, k):
                raise InputError(
                    f"state[{k!r}]",
                    f"{k}={getattr(self, k)} (this object's)",
                    repr(state[k]),
                    f"construct EWMAProximal with {k}={state[k]!r}",
                )
        ids, values, seen, last = (state[k] for k in ("ids", "values", "seen", "last"))
        n = ids.shape[0] if isinstance(ids, Tensor) and ids.ndim == 1 else -1
        shapes_ok = (
            n >= 0
            and isinstance(values, Tensor)
            and values.ndim == 2
            and values.shape[0] == n
            and isinstance(seen, Tensor)
            and seen.shape == values.shape
            and isinstance(last, Tensor)
            and last.shape == (n,)
        )
        if not shapes_ok:
            raise InputError(
                "state", "ids [n], values [n, W], seen [n, W], last [n]", "inconsistent shapes", "pass a state_dict"
            )
        self._step = int(state["step"])
        self._ids, self._values = ids.clone().long(), values.clone()
        self._seen, self._last = seen.clone().bool(), last.clone().long()
