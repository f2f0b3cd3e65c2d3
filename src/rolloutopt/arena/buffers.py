r"""Partial-rollout buffers in the arena: :class:`~rolloutopt.control.APRILBuffer` and
:class:`~rolloutopt.control.CoPRISScheduler` decide which requests run, when a round stops and what is resumed, while
the policy really generates, continuing a resumed rollout from its prefix.

**Time.** The schedulers act on the order in which requests finish, so a round is simulated in decoding steps
(*ticks*): the engine decodes every running request at once, one token per tick (continuous batching without a
throughput limit). A request started at tick :math:`s` that generates :math:`m` new tokens finishes at
:math:`s + m` (a request with ``max_new_tokens = 0`` finishes at once, with no token: truncated). Finish events are
handed to the scheduler in time order (ties: in request order); after the finishes of a tick, the requests the
scheduler starts begin at that tick (one generation batch per tick). When the scheduler's stop event fires at tick
:math:`\tau`, the requests finishing at :math:`\tau` still finish, and every other running request is aborted with the :math:`\tau - s` tokens it had generated (fewer than
its :math:`m`, so never its ``<eos>``). Each request is generated in full when it starts (rows are independent,
:func:`~rolloutopt.testbed.policy.sample_from`); the tokens after an abort count as never generated, the tokens
before it are kept by the scheduler and resumed later with the weights of that later round.

**Sizes.** A step trains on ``groups`` groups of ``group_size`` samples (the other scenarios' 16 prompts × 8):

- ``april``: APRIL's over-provisioning at its launch script's ratio (``rollout_batch_size=32``,
  ``over_sampling_batch_size=64``): ``rollout_batch_size = groups``, ``over_sampling_batch_size = 2 * groups``;
  ``2 * groups`` fresh prompts a round (buffered groups are taken first; unused fresh prompts are dropped, the next
  round draws new ones); ``partial_rollout=True``.
- ``copris``: the reference script's ratio (``train_batch_size=64``, ``gen_batch_size=128``):
  ``train_batch_size = groups``, a gen batch of ``2 * groups`` fresh prompts every round; ``pool_size = groups *
  group_size // 4`` requests in flight (the reference code's default 128 against its 64 x 8 batch). Without
  dynamic-sampling filtering (the arena's GRPO baseline has none) the request queue grows by ``groups`` prompts a
  round, as the reference's would; a queued request that never started holds no token, so waiting makes it no
  staler. After each round the trainer's recompute of the held partial rollouts is recorded
  (``record_recompute``), so a resumed rollout's behaviour log-probs are per segment those of the version that
  generated it, as CoPRIS's cross-stage importance sampling reads them.

The engine holds the trained policy of the round (version = the step): every off-policy token is a resumed prefix.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rolloutopt.arena.replay import map_roll
from rolloutopt.control import APRILBuffer, CoPRISScheduler, Requests
from rolloutopt.control.partial import PartialScheduler
from rolloutopt.errors import InputError
from rolloutopt.testbed.engine import ScenarioEngine
from rolloutopt.testbed.policy import Rollouts, TinyPolicy
from rolloutopt.testbed.task import PAD
from rolloutopt.typing import IntP

__all__ = [
    "BUFFERS",
    "BUFFER_METRICS",
    "BufferRound",
    "BufferedEngine",
    "Segment",
    "Segments",
    "drive_round",
    "make_scheduler",
]

BUFFERS = ("april", "copris")
"""The partial-rollout buffers the arena's loss family runs as scenarios."""
BUFFER_METRICS = ("off_policy_fraction", "resumed_rollouts", "aborted_requests", "held_rollouts", "staleness_max",
                  "ticks")  # fmt: skip
"""The round metrics a buffered run records per step (``ticks``: the round's length in decoding steps; the others
are the scheduler's ``end_round`` metrics)."""


def make_scheduler(kind: str, *, groups: int, group_size: int, response_limit: int) -> PartialScheduler:
    """The scheduler of ``kind`` at the arena's sizes (module docstring)."""
    if kind == "april":
        return APRILBuffer(rollout_batch_size=groups, over_sampling_batch_size=2 * groups,
                           n_samples_per_prompt=group_size, max_new_tokens=response_limit)  # fmt: skip
    if kind == "copris":
        return CoPRISScheduler(train_batch_size=groups, gen_batch_size=2 * groups, n_samples_per_prompt=group_size,
                               pool_size=max(1, groups * group_size // 4), max_new_tokens=response_limit)  # fmt: skip
    raise InputError("kind", f"one of {BUFFERS}", repr(kind), "pick a buffer")


def fresh_per_round(kind: str, groups: int) -> int:
    """Fresh prompts offered to a round: ``2 * groups`` (APRIL's over-provisioning, CoPRIS's gen batch)."""
    return 2 * groups


@dataclass(frozen=True)
class Segment:
    """What one request generates when it runs to its end: ``tokens`` and ``logp`` ``[m]`` (the new tokens and
    their behaviour log-probs), the ``reward`` of the whole rollout (prefix + new tokens), and ``extra`` per-token
    tensors ``[m, ...]`` the caller keeps beside the scheduler (entropies, top-K)."""

    tokens: Int[Tensor, " m"]
    logp: Float[Tensor, " m"]
    reward: float
    extra: dict[str, Tensor]


Segments = Callable[[Requests], list[Segment]]
"""Generates the requests of one start (one :class:`Segment` per request, in order)."""


@dataclass(frozen=True)
class BufferRound:
    """What :func:`drive_round` did: the scheduler's ``end_round`` result, the tokens generated this round (finished
    segments plus the kept part of aborted ones), each rollout's kept ``extra`` segments in order (for the rollouts
    that got tokens this round), and the ticks the round lasted."""

    result: Any
    generated: int
    extra: dict[int, list[dict[str, Tensor]]]
    ticks: int


def drive_round(sched: PartialScheduler, fresh: IntP, version: int, generate: Segments) -> BufferRound:
    """One round of ``sched`` (fresh prompt ids ``[P]``, engine weights ``version``) in ticks (module docstring):
    ``generate(requests)`` runs each started request to its end; the scheduler gets each finish at its tick and,
    at its stop event, every other running request aborted with the tokens it had by then."""
    sched.begin_round(fresh, policy_version=version)
    heap: list[tuple[int, int, int, Segment]] = []  # (finish tick, request id, start tick, segment)
    now = generated = 0
    extra: dict[int, list[dict[str, Tensor]]] = {}
    rollout_of: dict[int, int] = {}

    def start() -> None:
        reqs = sched.next_requests()
        if len(reqs) == 0:
            return
        segs = generate(reqs)
        if len(segs) != len(reqs):
            raise InputError("generate", f"{len(reqs)} segments", f"{len(segs)}", "one segment per request")
        for q, r, cap, seg in zip(reqs.request_ids.tolist(), reqs.rollout_ids.tolist(),
                                  reqs.max_new_tokens.tolist(), segs, strict=True):  # fmt: skip
            if seg.tokens.numel() > cap:
                n = str(seg.tokens.numel())
                raise InputError("generate", f"at most {cap} new tokens for request {q}", n, "cap it")
            rollout_of[q] = r
            heapq.heappush(heap, (now + seg.tokens.numel(), q, now, seg))

    def keep(q: int, seg: Segment, k: int) -> None:
        nonlocal generated
        generated += k
        if k:
            extra.setdefault(rollout_of[q], []).append({n: v[:k] for n, v in seg.extra.items()})

    start()
    while heap and not sched.done:
        now = heap[0][0]
        while heap and heap[0][0] == now:  # every request finishing at this tick, then the starts they free
            _, q, _, seg = heapq.heappop(heap)
            sched.finish(q, seg.tokens, seg.logp, reward=seg.reward)
            keep(q, seg, seg.tokens.numel())
        if not sched.done:
            start()
    for _, q, s, seg in sorted(heap, key=lambda e: e[1]):  # the stop event: abort what runs, in request order
        k = now - s
        sched.abort(q, seg.tokens[:k], seg.logp[:k])
        keep(q, seg, k)
    return BufferRound(sched.end_round(), generated, extra, now)


class BufferedEngine:
    """A loss-family run's rollouts under the partial-rollout buffer ``kind`` (module docstring): :meth:`step`
    returns what the arena's training step reads (the batch, rewards and groups)."""

    def __init__(self, kind: str, suite: Any, scenario: ScenarioEngine, *, groups: int, group_size: int) -> None:
        self.kind, self.suite, self.scenario = kind, suite, scenario
        self.groups = groups
        self.sched = make_scheduler(kind, groups=groups, group_size=group_size, response_limit=suite.response_limit)
        self.kept: dict[int, list[dict[str, Tensor]]] = {}  # rollout id -> extra segments held by the scheduler
        self.gen_seconds = 0.0

    @property
    def fresh(self) -> int:
        """Fresh prompts a round takes (:func:`fresh_per_round`)."""
        return fresh_per_round(self.kind, self.groups)

    def _generate(self, policy: TinyPolicy, gen: torch.Generator) -> Segments:
        dev = next(policy.parameters()).device

        def generate(reqs: Requests) -> list[Segment]:
            start = time.perf_counter()
            try:
                return _segments(reqs)
            finally:
                self.gen_seconds += time.perf_counter() - start

        def _segments(reqs: Requests) -> list[Segment]:
            plen = torch.tensor([p.numel() for p in reqs.prefix], dtype=torch.long)
            run = reqs.max_new_tokens > 0
            segs: list[Segment | None] = [None] * len(reqs)
            if bool(run.any()):
                idx = run.nonzero().squeeze(1)
                width = max(1, int(plen[idx].max()))
                prefix = torch.full((idx.numel(), width), PAD, dtype=torch.long)
                for j, i in enumerate(idx.tolist()):
                    prefix[j, : plen[i]] = reqs.prefix[i]
                ids = reqs.prompt_ids[idx]
                prompts = self.suite.prompts(ids).to(dev)
                roll, _ = self.scenario.sample(prompts, self.suite.response_limit, gen, prefix=prefix.to(dev),
                                               prefix_len=plen[idx].to(dev))  # fmt: skip
                roll = map_roll(roll, lambda t: t.cpu())
                rewards = self.suite.reward(ids, roll.tokens, roll.mask)
                lengths = roll.mask.sum(1)
                for j, i in enumerate(idx.tolist()):
                    a, b = int(plen[i]), int(lengths[j])
                    extra = {"entropy": roll.entropy[j, a:b]}
                    if roll.topk_ids is not None and roll.topk_logp is not None:
                        extra.update(topk_ids=roll.topk_ids[j, a:b], topk_logp=roll.topk_logp[j, a:b])
                    segs[i] = Segment(roll.tokens[j, a:b], roll.logp[j, a:b], float(rewards[j]), extra)
            for i in (~run).nonzero().squeeze(1).tolist():  # at the length cap: score the prefix, no new token
                toks = reqs.prefix[i][None]
                reward = float(
                    self.suite.reward(reqs.prompt_ids[i : i + 1], toks, torch.ones_like(toks, dtype=torch.bool))
                )
                segs[i] = Segment(torch.zeros(0, dtype=torch.long), torch.zeros(0), reward, {})
            return [s for s in segs if s is not None]

        return generate

    def step(self, policy: TinyPolicy, fresh: IntP, version: int, gen: torch.Generator) -> dict[str, Any]:
        """One round at ``version`` over ``fresh`` prompt ids: ``ids``, ``roll`` (tokens, mask, behaviour log-probs,
        entropies and top-K of every batch row, prefix included), ``versions``, ``generated`` (tokens generated this
        round), ``rewards``, ``group`` (0-based), ``metrics`` (the round's, floats); ``roll`` is None when the round
        returned no group; ``seconds`` the time spent in the scheduler and CoPRIS's recompute (not generating)."""
        t0, self.gen_seconds = time.perf_counter(), 0.0
        rnd = drive_round(self.sched, fresh, version, self._generate(policy, gen))
        for r, segs in rnd.extra.items():
            self.kept.setdefault(r, []).extend(segs)
        res = rnd.result
        batch = res.batch
        rows = [self.kept.pop(r, []) for r in batch.rollout_ids.tolist()]
        for r in res.removed.rollout_ids.tolist():
            self.kept.pop(r, None)
        if isinstance(self.sched, CoPRISScheduler):
            self._recompute(policy, version)
        metrics = {k: float(v) for k, v in res.metrics.items()}
        metrics["ticks"] = float(rnd.ticks)
        out: dict[str, Any] = {"generated": rnd.generated, "metrics": metrics, "roll": None, "seq_weight": None,
                               "token_weight": None, "seconds": time.perf_counter() - t0 - self.gen_seconds}  # fmt: skip
        if len(batch) == 0:
            return out
        mask = batch.mask
        width = mask.shape[1]

        def cat(name: str, fill: float) -> Tensor | None:
            if not all(segs and name in segs[0] for segs in rows):
                return None
            parts = [torch.cat([s[name] for s in segs]) for segs in rows]
            full = torch.full((len(parts), width, *parts[0].shape[1:]), fill, dtype=parts[0].dtype)
            for i, p in enumerate(parts):
                full[i, : p.shape[0]] = p
            return full

        roll = Rollouts(
            tokens=torch.where(mask, batch.tokens, PAD), mask=mask,
            logp=torch.where(mask, batch.behav_logp, 0.0), entropy=_or_zeros(cat("entropy", 0.0), mask),
            topk_ids=cat("topk_ids", PAD), topk_logp=cat("topk_logp", 0.0),
        )  # fmt: skip
        out.update(
            ids=batch.prompt_ids, roll=roll, versions=torch.where(mask, batch.versions, version),
            rewards=batch.rewards.float(), group=torch.unique(batch.group, return_inverse=True)[1],
        )  # fmt: skip
        return out

    @torch.no_grad()
    def _recompute(self, policy: TinyPolicy, version: int) -> None:
        """CoPRIS: the trainer's log-probs of every held partial rollout, recorded as its segment's behaviour."""
        todo = self.sched.needs_recompute()
        if len(todo) == 0:
            return
        dev = next(policy.parameters()).device
        prompts = self.suite.prompts(todo.prompt_ids).to(dev)
        tokens = torch.where(todo.mask, todo.tokens, PAD).to(dev)
        logp, _ = policy.log_probs(prompts, tokens, temperature=self.scenario.temperature)
        self.sched.record_recompute(todo.rollout_ids, logp.cpu().float(), policy_version=version)


def _or_zeros(x: Tensor | None, mask: Tensor) -> Tensor:
    return torch.zeros(mask.shape) if x is None else x
