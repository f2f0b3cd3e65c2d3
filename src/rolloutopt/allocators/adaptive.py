r"""Adaptive within-step allocators: :class:`AR3PO` (staged rollout + response reuse), :class:`AERO` (Beta
posterior, selective rejection) and :class:`V05Budget` (the allocator side of V_{0.5}'s extra-budget request).

All three speak the protocol of :mod:`rolloutopt.allocators._base` (``plan`` -> ``next``/``observe`` ->
``finish`` -> ``update``), keep their per-prompt state in sorted int64 id tables (``torch.searchsorted``
look-ups, no Python loop over prompts or rollouts) and checkpoint it with ``state_dict``/``load_state_dict``.

Provenance (``docs/methods/adaptive_alloc.md``): none of the three papers has public
code; only their abstracts and public summaries were available. Every stage size, threshold, buffer policy and
default below is **[reconstructed]** by this project and is a keyword. Following the project rule (as
:mod:`rolloutopt.allocators.gdro` resolved it), each class raises an :class:`~rolloutopt.errors.InputError`
naming ``experimental`` unless it is constructed with ``experimental=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._validation import check_bool as _bool
from rolloutopt._validation import check_state, describe, require_experimental
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    _argsort_stable,
    _check_result,
    _choice,
    _insert,
    _int,
    _lookup,
    _real,
    _sort_ids,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators.topup import _Tracked
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatB, FloatP, IntB, IntP

__all__ = ["AERO", "AR3PO", "ReusedResponses", "V05Budget", "dead_zone_probability", "response_key"]

_SHIFT = 32
_ROW_MASK = (1 << _SHIFT) - 1


def _success(x: Any) -> float:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(float(x)):
        raise InputError("success", "a finite number (reward threshold of a success)", describe(x), "pass 1.0")
    return float(x)


def _budget_prefix(want: Tensor, by_id: Tensor, remaining: int) -> Tensor:
    """Give ``want`` (int64 ``[P]``) to whole prompts in increasing-id order while the cumulative total fits."""
    w = want[by_id]
    fits = torch.cumsum(w, 0) <= remaining
    give = torch.zeros_like(want)
    give[by_id] = torch.where(fits, w, 0)
    return give


def _segment_order(seg: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
    """The permutation that sorts by ``(seg, key, position)`` and the sorted segments.

    For non-negative segments and keys in ``[0, 1)`` (seeded uniforms) one stable int64 sort of
    ``seg * 2**32 + floor(key * 2**32)`` (exact: a power-of-two scale; torch's radix sort needs fewer passes for
    fewer bits) gives that order unless two keys of one segment agree in their first 32 bits without being equal
    (about once in a thousand calls at 100,000 prompts), which is checked (then, as otherwise, two stable sorts:
    by key, then by segment)."""
    n = seg.numel()
    if n and key.dtype == torch.float64 and seg.dtype == torch.long:
        lo, hi = torch.aminmax(seg)
        kmin, kmax = torch.aminmax(key)
        bits = 32
        if int(lo) >= 0 and int(hi).bit_length() + bits <= 62 and float(kmin) >= 0 and float(kmax) < 1:
            comp = (key * float(2**bits)).long().add_(seg, alpha=1 << bits)
            ordered, order = torch.sort(comp, stable=True)
            same = ordered[1:] == ordered[:-1]
            if not bool(same.any()):
                return order, ordered >> bits
            ks = key[order]
            if not bool((ks[1:] != ks[:-1])[same].any()):
                return order, ordered >> bits
    order = torch.sort(key, stable=True).indices
    order = order[torch.sort(seg[order], stable=True).indices]
    return order, seg.index_select(0, order)


def _rank_in_sorted(s: Tensor) -> Tensor:
    """Position of each element of the sorted segments ``s`` within its segment (0, 1, ...)."""
    first = torch.ones_like(s, dtype=torch.bool)
    first[1:] = s[1:] != s[:-1]
    starts = first.nonzero().squeeze(1)
    return torch.arange(s.numel()) - starts.index_select(0, torch.cumsum(first, 0) - 1)


def _within_rank(seg: Tensor, key: Tensor) -> Tensor:
    """Rank ``0, 1, ...`` of each element within its segment ``seg`` when ordered by ``key``, ties by position:
    the lexicographic order by ``(seg, key, position)`` (:func:`_segment_order`)."""
    order, s = _segment_order(seg, key)
    within = _rank_in_sorted(s)
    return torch.empty_like(within).scatter_(0, order, within)


def _beyond_limit(seg: Tensor, key: Tensor, limit: Tensor) -> tuple[Tensor, Tensor]:
    """The elements whose :func:`_within_rank` is ``>= limit[seg]``: their indices and their segments (in
    sorted order), without mapping the ranks back."""
    order, s = _segment_order(seg, key)
    hit = (_rank_in_sorted(s) >= limit.index_select(0, s)).nonzero().squeeze(1)
    return order.index_select(0, hit), s.index_select(0, hit)


def _cut_beyond_limit(seg: Tensor, key: Tensor, size: Tensor, limit: Tensor) -> Tensor:
    """What :func:`_beyond_limit` selects for the segments ``0 .. S-1`` (``S = size.numel()``), without exact ranks.

    ``seg`` (int ``[K]``, values in ``[0, S]``; ``S`` marks an element of no segment), ``key`` (float64 ``[K]`` in
    ``[0, 1)``), ``size[s]`` = how many elements have ``seg == s`` and ``1 <= limit[s] < size[s]``. Returns the
    indices (in no particular order) of the elements whose rank within their segment, by ``(key, index)``, is
    ``>= limit[seg]``.

    One stable sort of ``seg * 2**kb + floor(key * 2**kb)``, in int32 while ``kb >= 12`` bits of key fit (torch
    sorts int32 about twice as fast as int64): segment ``s`` fills sorted positions ``a[s] .. a[s] + size[s] - 1``
    (``a`` the exclusive cumsum of ``size``), ordered by the truncated key and then by index. Truncation is monotone,
    so keys of equal truncation are adjacent in both that order and the exact one, and only their order among
    themselves can differ: the first ``limit[s]`` positions hold exactly the elements of rank ``< limit[s]`` unless
    the two positions at the boundary, ``a[s] + limit[s] - 1`` and ``a[s] + limit[s]``, hold equal truncations.
    The few segments where they do are ranked exactly (:func:`_beyond_limit` on their elements, in index order)."""
    s_n = size.numel()
    bits = s_n.bit_length()
    dtype, kb = (torch.int32, 31 - bits) if bits <= 19 else (torch.long, 62 - bits)
    comp = (key * float(1 << kb)).to(dtype).add_(seg.to(dtype), alpha=1 << kb)
    ordered, order = torch.sort(comp, stable=True)
    start = torch.cumsum(size, 0) - size
    bound = start + limit
    tied = ordered.index_select(0, bound - 1) == ordered.index_select(0, bound)
    cut_n = torch.where(tied, 0, size - limit)
    cut_end = torch.cumsum(cut_n, 0)
    total = int(cut_end[-1]) if s_n else 0
    at = torch.repeat_interleave(bound - (cut_end - cut_n), cut_n, output_size=total).add_(torch.arange(total))
    cut = order.index_select(0, at)
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        rs = size.index_select(0, rows)
        re = torch.cumsum(rs, 0)
        first = start.index_select(0, rows) - (re - rs)
        at = torch.repeat_interleave(first, rs, output_size=int(re[-1])).add_(torch.arange(int(re[-1])))
        members = order.index_select(0, at).sort().values
        exact, _ = _beyond_limit(seg.index_select(0, members).long(), key.index_select(0, members), limit)
        cut = torch.cat([cut, members.index_select(0, exact)])
    return cut


def response_key(step: int | Int[Tensor, " ..."], row: int | Int[Tensor, " ..."]) -> Int[Tensor, " ..."]:
    """The int64 key :class:`AR3PO` gives a generated rollout: ``step * 2**32 + row``.

    ``step`` is the allocator step the plan was made at (``result.metrics["step"]``) and ``row`` the rollout's
    row in that step's :class:`~rolloutopt.allocators.AllocationResult` (rows ``0 .. counts.sum() - 1`` are the
    generated rollouts, in the order they were observed). A trainer that keeps a response under this key can
    hand it back when :class:`AR3PO` reuses it (:meth:`_AR3POPlan.reused`).
    """
    return torch.as_tensor(step, dtype=torch.long) * (1 << _SHIFT) + torch.as_tensor(row, dtype=torch.long)


@dataclass(frozen=True)
class ReusedResponses:
    """The replayed responses an :class:`AR3PO` plan appended to its result.

    Attributes:
        rows: int64 ``[M]``, their rows in the result (all ``>= result.counts.sum()``: after the generated ones).
        prompt_ids: int64 ``[M]``, the prompt each belongs to.
        keys: int64 ``[M]``, the stored responses' :func:`response_key` (``keys >> 32`` is the step they were
            generated at, ``keys & (2**32 - 1)`` their row in that step's result).
    """

    rows: IntB
    prompt_ids: IntB
    keys: IntB


# -- AR3PO --------------------------------------------------------------------------------------------------------
_AR_NAMES = ("solved", "all_correct", "unsolved_reused", "unsolved_dropped", "cut_reused", "cut_dropped", "no_budget")


class _AR3POPlan(_Tracked):
    reason_names = _AR_NAMES
    track_extremes = False  # only successes are read

    def __init__(self, prompt_ids: Tensor, budget: int, owner: AR3PO) -> None:
        super().__init__(prompt_ids, budget)
        self.o = owner
        self.success_threshold = owner.success
        self.step = owner._step
        p = prompt_ids.numel()
        self.stage = 0
        self.active = torch.ones(p, dtype=torch.bool)
        self.cut = torch.zeros(p, dtype=torch.bool)
        self._buf_pos, self._buf_found = _lookup(owner._buf_ids, prompt_ids)
        self._reuse = torch.zeros(p, dtype=torch.bool)
        self._reused: ReusedResponses | None = None

    def decide(self) -> Request | None:
        o = self.o
        cand = self.active & (self._succ == 0) & (self._n < o._cap)
        if self.stage >= o.stages or not bool(cand.any()):
            self.active = torch.zeros_like(cand)
            return None
        want = torch.where(cand, (o._cap - self._n).clamp(max=o.k), 0)
        give = _budget_prefix(want, self._order, self.budget - self.spent)
        self.cut |= cand & (give == 0)
        self.active = give > 0
        self.stage += 1
        if not bool(self.active.any()):
            return None
        return self.request(self.active, give[self.active])

    def select(self) -> tuple[FloatB, IntP]:
        o = self.o
        n, succ = self._n, self._succ
        played = n > 0
        unsolved = played & (succ == 0)
        all_correct = played & (succ == n.double())
        reuse = unsolved & self._buf_found & o.reuse
        cut = self.cut & played
        reasons = torch.where(
            ~played,
            6,
            torch.where(
                all_correct,
                1,
                torch.where(~unsolved, 0, torch.where(cut, torch.where(reuse, 4, 5), torch.where(reuse, 2, 3))),
            ),
        )
        drop = (all_correct | (unsolved & ~reuse)) if o.drop_flat else torch.zeros_like(played)
        pos, _ = self.rollouts()
        self._reuse = reuse
        return (~drop).double().index_select(0, pos), reasons

    def finish(self) -> AllocationResult:
        res = super().finish()
        o = self.o
        rpos = self._reuse.nonzero().squeeze(1)
        bpos = self._buf_pos[rpos]
        keys = o._buf_key[bpos] if rpos.numel() else torch.zeros(0, dtype=torch.long)
        rew = o._buf_reward[bpos] if rpos.numel() else torch.zeros(0, dtype=torch.float64)
        n_gen = res.rewards.numel()
        self._reused = ReusedResponses(torch.arange(n_gen, n_gen + rpos.numel()), self.prompt_ids[rpos], keys)
        played = self._n > 0
        return replace(
            res,
            prompt_ids=torch.cat([res.prompt_ids, self.prompt_ids[rpos]]),
            group=torch.cat([res.group, rpos]),
            rewards=torch.cat([res.rewards, rew.to(res.rewards.dtype)]),
            weight=torch.cat([res.weight, torch.full((rpos.numel(),), o.reuse_weight, dtype=res.weight.dtype)]),
            metrics={
                **res.metrics,
                "step": torch.tensor(float(self.step), dtype=torch.float64),
                "stages": torch.tensor(float(self.stage), dtype=torch.float64),
                "reused": torch.tensor(float(rpos.numel()), dtype=torch.float64),
                "rollouts_per_prompt": (self._n.double().sum() / played.double().sum().clamp(min=1)),
            },
        )

    def reused(self) -> ReusedResponses:
        """The replayed responses appended to this plan's result (after :meth:`finish`)."""
        if self._reused is None:
            raise InputError("plan.reused", "a finished plan", "finish() not called yet", "call plan.finish() first")
        return self._reused


class AR3PO:
    r"""AR3PO: adaptive multi-stage rollout plus reuse of a buffered correct response (arXiv 2509.25808).

    See ``docs/methods/adaptive_alloc.md``. Verified (abstract, summaries): rollout is multi-stage, a prompt stops
    receiving rollouts once a stage yields a correct response, so hard prompts get more; when every rollout of a
    prompt is wrong, a previously generated correct response for it is taken from a replay buffer and put into the
    group so that its advantage is not zero. Stage :math:`s = 1..S` gives :math:`k` rollouts to every still-active
    prompt:

    .. math::

        \text{active}_{s+1}(x) = \text{active}_s(x) \wedge \textstyle\sum_{j \le s k} \mathbb 1[r_j \ge
        \text{success}] = 0, \qquad n(x) \le \min(kS, n_{max}).

    After the last stage, a prompt with no correct response gets its buffered response appended (reason
    ``"unsolved_reused"``; the training group has :math:`n + 1` members) or is dropped (weight 0,
    ``"unsolved_dropped"``); a prompt whose stage-1 group is all correct carries no signal and is dropped
    (``"all_correct"``); ``drop_flat=False`` keeps both with weight 1 (zero advantage downstream).

    **Reconstructed** (all keywords): ``k=4`` and ``stages=4`` (our choices), the budget rule (a stage
    goes to the active prompts in increasing-id order while the budget lasts; the rest are ``"cut_*"``, prompts
    that cannot get stage 1 are ``"no_budget"``), the buffer (per prompt, the ``"latest"`` or a ``"random"``
    correct generated response of the latest step that had one; at most ``buffer_size`` prompts, the most
    recently stored kept, ties to the lower id; entries older than ``max_age`` steps dropped; a reused entry
    stays), ``reuse_weight`` (1.0) and ``success`` (1.0, the exact-1 rule of verifiable rewards).

    Budget: AR3PO spends *at most* ``budget`` (it stops solved prompts early, which is its point; a budget of
    ``k * stages * P`` never binds). ``result.counts`` and ``metrics["rollouts"]`` count generated rollouts only.

    Reused responses (how a trainer gets them): the result holds them as extra rows *after* the generated ones
    (``result.rewards.numel() = counts.sum() + metrics["reused"]``), with their prompt's ``group``, the stored
    reward and weight ``reuse_weight``. ``plan.reused()`` gives their rows and :func:`response_key` keys. A
    trainer stores the response (tokens and behaviour log-probs: it is off-policy) of every generated rollout
    whose key is in :meth:`replay` after :meth:`update`, may free the
    others, and pastes the stored response in at each reused row.

    Args:
        k: rollouts per prompt per stage (>= ``n_min``).
        stages: maximum number of stages :math:`S`.
        reuse: append buffered correct responses to unsolved groups (False: plain adaptive rollout).
        reuse_weight: weight of a reused row in the result.
        buffer: ``"latest"`` or ``"random"`` (seeded) choice of the stored correct response.
        buffer_size: maximum number of prompts in the buffer.
        max_age: drop entries stored more than this many steps ago (None: never).
        drop_flat: weight 0 for groups without signal (stage-1 all correct, unsolved without a reuse).
        success: reward threshold of a correct response.
        n_min, n_max: caps: a prompt gets 0 or between ``k >= n_min`` and ``n_max`` generated rollouts
            (``n_max=None``: ``k * stages``; the last stage is shortened to fit ``n_max``).
        seed: seeds the generator of ``buffer="random"``.
        experimental: must be True (see the module docstring).

    Edge cases: an empty plan or a zero budget requests nothing (every prompt ``"no_budget"``); rewards need not
    be binary (correct means ``reward >= success``).
    """

    reference: ClassVar[str] = "arXiv 2509.25808 (AR3PO: adaptive rollout and response reuse)"
    experimental: ClassVar[str | None] = (
        "the stages, the budget rule and the reuse buffer are reconstructed from the abstract"
    )

    def __init__(
        self,
        *,
        k: int = 4,
        stages: int = 4,
        reuse: bool = True,
        reuse_weight: float = 1.0,
        buffer: Literal["latest", "random"] = "latest",
        buffer_size: int = 1_000_000,
        max_age: int | None = None,
        drop_flat: bool = True,
        success: float = 1.0,
        n_min: int = 1,
        n_max: int | None = None,
        seed: int = 0,
        experimental: bool = False,
    ) -> None:
        require_experimental(
            experimental, "AR3PO's stages, budget rule and replay buffer", "docs/methods/adaptive_alloc.md"
        )
        _int(k, "k", 1)
        _int(stages, "stages", 1)
        _bool(reuse, "reuse")
        _real(reuse_weight, "reuse_weight", 0.0, math.inf)
        _choice(buffer, "buffer", ("latest", "random"))
        _int(buffer_size, "buffer_size", 0)
        _int(max_age, "max_age", 0, none=True)
        _bool(drop_flat, "drop_flat")
        self.success = _success(success)
        _int(n_min, "n_min", 1)
        _int(n_max, "n_max", 1, none=True)
        if n_min > k:
            raise InputError("n_min", f"n_min <= k = {k} (stage 1 gives k rollouts)", repr(n_min), "lower n_min")
        if n_max is not None and n_max < k:
            raise InputError("n_max", f"n_max >= k = {k}", repr(n_max), "raise n_max or lower k")
        _int(seed, "seed", 0)
        self.k, self.stages, self.reuse, self.reuse_weight = k, stages, reuse, float(reuse_weight)
        self.buffer, self.buffer_size, self.max_age, self.drop_flat = buffer, buffer_size, max_age, drop_flat
        self.n_min, self.n_max, self.seed = n_min, n_max, seed
        self._cap = k * stages if n_max is None else min(n_max, k * stages)
        self._gen = torch.Generator().manual_seed(seed)
        self._step = 0
        self._buf_ids = torch.zeros(0, dtype=torch.long)
        self._buf_key = torch.zeros(0, dtype=torch.long)
        self._buf_reward = torch.zeros(0, dtype=torch.float64)
        self._buf_step = torch.zeros(0, dtype=torch.long)

    def plan(self, prompt_ids: IntP, budget: int) -> _AR3POPlan:
        """Stages of ``k`` rollouts over ``prompt_ids`` until each is solved or out of stages (class docstring)."""
        return _AR3POPlan(as_prompt_ids(prompt_ids), check_budget(budget), self)

    def replay(self) -> tuple[IntP, IntP, FloatP]:
        """The buffer, sorted by prompt id: ``(prompt_ids, keys, rewards)`` (copies; keys: :func:`response_key`)."""
        return self._buf_ids.clone(), self._buf_key.clone(), self._buf_reward.clone()

    def update(self, result: AllocationResult) -> None:
        """Store, per prompt with a correct generated rollout, one of them (``buffer``); bound the buffer."""
        result = _check_result(result, "AR3PO", _AR_NAMES)
        step = int(result.metrics["step"])
        gen = int(result.counts.sum())
        r, g = result.rewards[:gen], result.group[:gen]
        p = result.plan_prompt_ids.numel()
        ok = r >= self.success
        rows = torch.arange(gen)
        score = rows.double() if self.buffer == "latest" else torch.rand(gen, generator=self._gen, dtype=torch.float64)
        score = torch.where(ok, score, -math.inf)
        best = torch.full((p,), -math.inf, dtype=torch.float64).scatter_reduce(0, g, score, "amax")
        hit = ok & (score == best[g])
        row_of = torch.full((p,), -1, dtype=torch.long).scatter_reduce(0, g[hit], rows[hit], "amax")
        has = row_of >= 0
        new_ids = result.plan_prompt_ids[has]
        new_rows = row_of[has]
        keep = ~torch.isin(self._buf_ids, new_ids)
        ids = torch.cat([self._buf_ids[keep], new_ids])
        key = torch.cat([self._buf_key[keep], response_key(step, new_rows)])
        rew = torch.cat([self._buf_reward[keep], result.rewards[new_rows].double()])
        stp = torch.cat([self._buf_step[keep], torch.full((new_ids.numel(),), step, dtype=torch.long)])
        if self.max_age is not None:
            fresh = step - stp <= self.max_age
            ids, key, rew, stp = ids[fresh], key[fresh], rew[fresh], stp[fresh]
        if ids.numel() > self.buffer_size:  # keep the most recently stored, ties to the lower id
            o = torch.sort(ids).indices
            o = o[_argsort_stable(stp[o], descending=True)][: self.buffer_size]
            ids, key, rew, stp = ids[o], key[o], rew[o], stp[o]
        o = torch.sort(ids).indices
        self._buf_ids, self._buf_key, self._buf_reward, self._buf_step = ids[o], key[o], rew[o], stp[o]
        self._step = max(self._step, step + 1)

    def state_dict(self) -> dict[str, Any]:
        """Step counter, buffer (ids, keys, rewards, steps stored) and generator state (copies)."""
        return {
            "step": self._step,
            "buffer_ids": self._buf_ids.clone(),
            "buffer_keys": self._buf_key.clone(),
            "buffer_rewards": self._buf_reward.clone(),
            "buffer_steps": self._buf_step.clone(),
            "generator": self._gen.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        keys = {"step", "buffer_ids", "buffer_keys", "buffer_rewards", "buffer_steps", "generator"}
        s = check_state(state, keys, "AR3PO")
        self._step = int(s["step"])
        self._buf_ids = s["buffer_ids"].clone().long()
        self._buf_key = s["buffer_keys"].clone().long()
        self._buf_reward = s["buffer_rewards"].clone().double()
        self._buf_step = s["buffer_steps"].clone().long()
        self._gen.set_state(s["generator"])


# -- AERO ---------------------------------------------------------------------------------------------------------
def dead_zone_probability(a: FloatAny, b: FloatAny, n: Int[Tensor, " ..."] | int) -> FloatAny:
    r"""Probability that a group of ``n`` Bernoulli rollouts is all-equal under a Beta(a, b) success rate.

    .. math::  P_0(n) = \frac{B(a + n, b) + B(a, b + n)}{B(a, b)} = \mathbb E_{p \sim \mathrm{Beta}(a,b)}
               \big[p^n + (1-p)^n\big]

    (AERO arXiv 2602.14338, ``docs/methods/adaptive_alloc.md``; exact mathematics of the reconstructed posterior.)
    Computed in log space with ``lgamma``. Uniform prior: :math:`P_0(n) = 2/(n+1)`. ``a``, ``b`` > 0 broadcast
    with ``n`` (>= 1); float64 out.
    """
    a, b = a.double(), b.double()
    nn = torch.as_tensor(n, dtype=torch.float64)

    def lbeta(x: Tensor, y: Tensor) -> Tensor:
        return torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)

    base = lbeta(a, b)
    return torch.exp(lbeta(a + nn, b) - base) + torch.exp(lbeta(a, b + nn) - base)


_AE_NAMES = ("allocated", "rejected_surplus", "flat_dropped", "partial", "skipped", "no_budget")


class _AEROPlan(_Tracked):
    reason_names = _AE_NAMES
    track_extremes = False
    track_successes = False  # counted once at finish, from the rollouts (select)

    def __init__(self, prompt_ids: Tensor, budget: int, owner: AERO, counts: Tensor, reasons: Tensor) -> None:
        super().__init__(prompt_ids, budget)
        self.o = owner
        self._counts, self._plan_reasons = counts, reasons
        self._sent = False
        self._observed = 0

    def decide(self) -> Request | None:
        if self._sent:
            return None
        self._sent = True
        keep = self._counts > 0
        return self.request(keep, self._counts[keep]) if bool(keep.any()) else None

    def observed(self, pos: Tensor, r: Tensor) -> None:
        self._observed += 1

    def _successes(self, pos: Tensor, y: Tensor) -> Tensor:
        """Successes per planned prompt (int64 ``[P]``) from the per-rollout outcomes ``y``."""
        n = self._n
        if self._observed == 1 and pos.numel() < 2**31:
            # the plan's one request (rows in increasing position, each repeated its count), observed at once: the
            # rollouts of position i are rows end[i] - n[i] .. end[i] - 1, so a prefix sum gives every count
            end = torch.cumsum(n, 0)
            up = torch.zeros(pos.numel() + 1, dtype=torch.int32)
            torch.cumsum(y, 0, dtype=torch.int32, out=up[1:])
            return (up.index_select(0, end) - up.index_select(0, end - n)).long()
        return torch.zeros(n.numel(), dtype=torch.long).index_add_(0, pos, y.long())

    def select(self) -> tuple[FloatB, IntP]:
        o = self.o
        pos, r = self.rollouts()
        n = self._n
        y = r >= o.success
        c = self._successes(pos, y)
        m = torch.minimum(c, n - c)  # minority size per prompt
        flat = (n > 0) & (m == 0)
        if o.drop_flat:  # weight 0 for a flat group's rollouts (and, below, for the rejected ones)
            weight = (~flat).to(torch.float64).index_select(0, pos)
        else:
            weight = torch.ones(pos.numel(), dtype=torch.float64)
        rejected = torch.zeros_like(flat)
        if o.reject_ratio is not None and pos.numel():
            # per prompt, the majority outcome: 1 success, 0 failure, 2 none (a tie or a flat group); a rollout is
            # of the majority iff its outcome equals its prompt's code
            code = torch.where((2 * c == n) | flat, 2, (2 * c > n).long()).to(torch.int8)
            major = code.index_select(0, pos) == y.view(torch.int8)
            idx = major.nonzero().squeeze(1)
            if idx.numel():
                # one seeded uniform key per majority rollout, in observation order; a prompt keeps the `limit`
                # majority rollouts of smallest key (ties by order) and every other one gets weight 0
                key = torch.rand(idx.numel(), generator=o._gen, dtype=torch.float64)
                limit = torch.maximum(torch.ceil(o.reject_ratio * m.double()).long(), o.n_min - m)
                major_n = torch.maximum(c, n - c)
                rejected = (major_n > limit) & (code < 2)  # only these lose any (limit >= 1: m >= 1 here)
                rows = rejected.nonzero().squeeze(1)
                if rows.numel():
                    s_n = rows.numel()
                    row_of = torch.full((n.numel(),), s_n, dtype=torch.int32)
                    row_of.index_copy_(0, rows, torch.arange(s_n, dtype=torch.int32))
                    seg = row_of.index_select(0, pos.index_select(0, idx))
                    size, lim = major_n.index_select(0, rows), limit.index_select(0, rows)
                    if 2 * int(size.sum()) < idx.numel():  # rank the losing prompts' keys alone
                        sel = (seg < s_n).nonzero().squeeze(1)
                        idx, key, seg = idx.index_select(0, sel), key.index_select(0, sel), seg.index_select(0, sel)
                    weight.index_fill_(0, idx.index_select(0, _cut_beyond_limit(seg, key, size, lim)), 0.0)
        # a prompt planned "skipped"/"no_budget" (4, 5) got no rollouts: it is neither flat nor rejected
        reasons = torch.where(flat, 2, torch.where(rejected, 1, self._plan_reasons))
        return weight, reasons


class AERO:
    r"""AERO: a Beta posterior per prompt sizes each group to avoid zero-advantage dead zones (arXiv 2602.14338).

    See ``docs/methods/adaptive_alloc.md``. Verified (abstract, summary): an adaptive rollout strategy, *selective
    rejection* of rollouts, and a per-prompt Bayesian posterior to avoid groups with zero advantage. The
    **reconstructed** rule (every part a keyword): each prompt has a Beta(a, b) posterior over its success rate
    (prior ``prior``; unseen prompts get it), and with :func:`dead_zone_probability`

    .. math::

        \text{skip if } P_0(n_{max}) > \tau_{skip}, \quad \text{else }
        n = \min\{n \in [n_{min}, n_{max}] : P_0(n) \le \varepsilon\} \ (n_{max} \text{ if none}),

    then after generation selective rejection keeps at most :math:`\max(\lceil \rho\, m \rceil, n_{min} - m)` of
    the majority outcome (:math:`m` = minority count; which ones: uniformly at random, seeded); the others get
    weight 0 (this saves training tokens, not generation). A flat group (:math:`m = 0`, a dead zone the
    posterior missed) gets weight 0 (``drop_flat``). ``update`` adds the step's successes :math:`c` of
    :math:`n` rollouts (every generated one, rejected too): :math:`a \leftarrow \lambda a + c`,
    :math:`b \leftarrow \lambda b + n - c` (``forget`` :math:`= \lambda`).

    Budget (reconstructed): when the wanted groups exceed ``budget``, prompts are served in increasing order of
    :math:`P_0(n)` (most informative first, ties to the lower id) while whole groups fit; the next one gets the
    remainder if it is at least ``n_min`` (``"partial"``); the rest are ``"no_budget"``. When they need less, the
    rest of the budget is not spent (``metrics["budget_used_frac"]``).

    Defaults (all reconstructed): ``prior=(1, 1)`` (uniform), ``n_min=2``, ``n_max=16``, ``eps=0.2`` (a fresh
    prompt gets :math:`n = 9`, the smallest with :math:`2/(n+1) \le 0.2`), ``tau_skip=0.5`` (skip a prompt once
    it is more likely flat than not even at ``n_max``), ``forget=1.0``, ``reject_ratio=2.0``, ``success=1.0``.

    Args:
        n_min, n_max: group size bounds; a prompt gets 0 or between them.
        eps: target dead-zone probability :math:`\varepsilon`.
        tau_skip: skip threshold :math:`\tau_{skip}`.
        prior: Beta pseudo-counts ``(a, b)`` of a new prompt (both > 0).
        forget: :math:`\lambda \in (0, 1]`.
        reject_ratio: :math:`\rho` (None: no rejection).
        drop_flat: weight 0 for all-equal groups.
        success: reward threshold of a success.
        seed: seeds the generator used by rejection.
        experimental: must be True (see the module docstring).

    Reasons: ``"allocated"``, ``"rejected_surplus"`` (some majority rollouts got weight 0), ``"flat_dropped"``,
    ``"partial"``, ``"skipped"`` (posterior says flat), ``"no_budget"``.
    """

    reference: ClassVar[str] = "arXiv 2602.14338 (AERO: adaptive efficient rollout optimization)"
    experimental: ClassVar[str | None] = (
        "the posterior rule, its thresholds and the rejection are reconstructed from the abstract"
    )

    def __init__(
        self,
        *,
        n_min: int = 2,
        n_max: int = 16,
        eps: float = 0.2,
        tau_skip: float = 0.5,
        prior: tuple[float, float] = (1.0, 1.0),
        forget: float = 1.0,
        reject_ratio: float | None = 2.0,
        drop_flat: bool = True,
        success: float = 1.0,
        seed: int = 0,
        experimental: bool = False,
    ) -> None:
        require_experimental(
            experimental, "AERO's posterior rule, thresholds and rejection", "docs/methods/adaptive_alloc.md"
        )
        _int(n_min, "n_min", 1)
        _int(n_max, "n_max", 1)
        if n_max < n_min:
            raise InputError("n_max", f"n_max >= n_min = {n_min}", repr(n_max), "raise n_max or lower n_min")
        _real(eps, "eps", 0.0, 1.0)
        _real(tau_skip, "tau_skip", 0.0, 1.0)
        if not (isinstance(prior, tuple) and len(prior) == 2):
            raise InputError("prior", "a tuple (a, b) of positive numbers", describe(prior), "pass prior=(1.0, 1.0)")
        _real(prior[0], "prior", 0.0, math.inf, open_low=True)
        _real(prior[1], "prior", 0.0, math.inf, open_low=True)
        _real(forget, "forget", 0.0, 1.0, open_low=True)
        _real(reject_ratio, "reject_ratio", 0.0, math.inf, none=True, open_low=True)
        _bool(drop_flat, "drop_flat")
        self.success = _success(success)
        _int(seed, "seed", 0)
        self.n_min, self.n_max, self.eps, self.tau_skip = n_min, n_max, float(eps), float(tau_skip)
        self.prior = (float(prior[0]), float(prior[1]))
        self.forget, self.drop_flat, self.seed = float(forget), drop_flat, seed
        self.reject_ratio = None if reject_ratio is None else float(reject_ratio)
        self._gen = torch.Generator().manual_seed(seed)
        self._ids = torch.zeros(0, dtype=torch.long)
        self._a = torch.zeros(0, dtype=torch.float64)
        self._b = torch.zeros(0, dtype=torch.float64)

    def posterior(self, prompt_ids: IntP) -> tuple[FloatP, FloatP]:
        """The Beta ``(a, b)`` of each prompt (float64 ``[P]``; the prior for unseen ones)."""
        ids = as_prompt_ids(prompt_ids)
        if self._ids.numel() == 0:
            return (
                torch.full((ids.numel(),), self.prior[0], dtype=torch.float64),
                torch.full((ids.numel(),), self.prior[1], dtype=torch.float64),
            )
        pos, found = _lookup(self._ids, ids)
        a, b = self._a.index_select(0, pos), self._b.index_select(0, pos)
        return torch.where(found, a, self.prior[0]), torch.where(found, b, self.prior[1])

    def _group_sizes(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per posterior ``(a, b)``: the group size wanted, its dead-zone probability (``inf`` when skipped), and
        whether it is skipped."""
        ns = torch.arange(self.n_min, self.n_max + 1)
        # P0(n) = prod_{j<n} (a+j)/(a+b+j) + prod_{j<n} (b+j)/(a+b+j): a cumulative product, no lgamma (the
        # factors lie in (0, 1), so nothing overflows); equal to dead_zone_probability.
        j = torch.arange(self.n_max, dtype=torch.float64)[None, :]
        den = a[:, None] + b[:, None] + j
        p0 = (torch.cumprod((a[:, None] + j) / den, 1) + torch.cumprod((b[:, None] + j) / den, 1))[:, self.n_min - 1 :]
        skip = p0[:, -1] > self.tau_skip
        below = p0 <= self.eps + 1e-12  # a tolerance: 2/(n+1) hits eps exactly at the defaults
        first = torch.where(below.any(1), below.to(torch.int8).argmax(1), ns.numel() - 1)
        want = torch.where(skip, 0, ns[first])
        pri = torch.where(skip, math.inf, p0.gather(1, first[:, None]).squeeze(1))
        return want, pri, skip

    def plan(self, prompt_ids: IntP, budget: int) -> _AEROPlan:
        """Size each prompt's group from its posterior (class docstring), one request."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        # everything per prompt in increasing-id order (the order that breaks priority ties): the posterior look-up
        # of sorted ids needs no scatter back, and one scatter at the end places counts and reasons
        q, by_id = _sort_ids(ids)
        if self._ids.numel() == 0:
            a = torch.full((p,), self.prior[0], dtype=torch.float64)
            b = torch.full((p,), self.prior[1], dtype=torch.float64)
        else:
            at = torch.searchsorted(self._ids, q).clamp_(max=self._ids.numel() - 1)
            found = self._ids.index_select(0, at) == q
            a = torch.where(found, self._a.index_select(0, at), self.prior[0])
            b = torch.where(found, self._b.index_select(0, at), self.prior[1])
        # The rule is a function of (a, b) alone, and posteriors take few distinct values (counts): evaluate it on
        # the grid of distinct a x distinct b (the same elementwise floats) and gather, unless the grid is large.
        # (a, b > 0: equal bit patterns are equal values, and an int64 unique is the faster one)
        ua, ia = torch.unique(a.view(torch.int64), return_inverse=True)
        ub, ib = torch.unique(b.view(torch.int64), return_inverse=True)
        if ua.numel() * ub.numel() <= max(p // 4, 1):
            ua, ub = ua.view(torch.float64), ub.view(torch.float64)
            ga, gb = ua.repeat_interleave(ub.numel()), ub.repeat(ua.numel())
            g_want, g_pri, g_skip = self._group_sizes(ga, gb)
            row = ia * ub.numel() + ib
            want, pri, skip = g_want.index_select(0, row), g_pri.index_select(0, row), g_skip.index_select(0, row)
        else:
            want, pri, skip = self._group_sizes(a, b)
        rank = _argsort_stable(pri)  # by priority, ties to the lower id
        w = want.index_select(0, rank)
        csum = torch.cumsum(w, 0)
        fits = csum <= budget
        give_o = torch.where(fits, w, 0)
        nfit = int(fits.sum()) if p else 0
        reasons_o = torch.where(skip.index_select(0, rank), 4, torch.where(give_o == 0, 5, 0))
        if nfit < p and int(w[nfit]) > 0:
            rest = budget - (int(csum[nfit - 1]) if nfit else 0)
            rest = rest if self.n_min <= rest else 0
            give_o[nfit] = rest
            reasons_o[nfit] = 3 if rest > 0 else 5
        order = by_id.index_select(0, rank)
        counts = torch.empty(p, dtype=torch.long).scatter_(0, order, give_o)
        reasons = torch.empty(p, dtype=torch.long).scatter_(0, order, reasons_o)
        return _AEROPlan(ids, budget, self, counts, reasons)

    def update(self, result: AllocationResult) -> None:
        """Posterior update from every generated rollout: :math:`a \\leftarrow \\lambda a + c`, same for b."""
        result = _check_result(result, "AERO", _AE_NAMES)
        p = result.plan_prompt_ids.numel()
        c = torch.zeros(p, dtype=torch.float64).index_add_(0, result.group, (result.rewards >= self.success).double())
        n = result.counts.double()
        seen = result.counts > 0
        ids = result.plan_prompt_ids[seen]
        self._ids, (a, b), pos, order = _insert(
            self._ids,
            ids,
            [(self._a, torch.tensor(self.prior[0])), (self._b, torch.tensor(self.prior[1]))],
        )
        cs, ns = c[seen][order], n[seen][order]
        a, b = a.clone(), b.clone()
        a[pos] = self.forget * a[pos] + cs
        b[pos] = self.forget * b[pos] + ns - cs
        self._a, self._b = a, b

    def state_dict(self) -> dict[str, Any]:
        """Per-prompt posteriors (sorted ids, a, b) and the generator state (copies)."""
        return {
            "ids": self._ids.clone(),
            "a": self._a.clone(),
            "b": self._b.clone(),
            "generator": self._gen.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        s = check_state(state, {"ids", "a", "b", "generator"}, "AERO")
        self._ids, self._a, self._b = s["ids"].clone().long(), s["a"].clone().double(), s["b"].clone().double()
        self._gen.set_state(s["generator"])


# -- V_{0.5} extra budget -------------------------------------------------------------------------------------------
_V_NAMES = ("initial", "extra", "capped", "no_budget")


class _V05Plan(Conversation):
    reason_names = _V_NAMES

    def __init__(self, prompt_ids: Tensor, budget: int, owner: V05Budget, prior: Tensor) -> None:
        super().__init__(prompt_ids, budget)
        self.o = owner
        self.prior = prior
        self.round = 0
        p = prompt_ids.numel()
        self._extra: Tensor | None = None
        self._capped = torch.zeros(p, dtype=torch.bool)
        self._got_extra = torch.zeros(p, dtype=torch.bool)

    def consume(self, output: Any) -> None:
        """Use a :class:`~rolloutopt.advantages.v05.V05Output` the trainer computed (its ``group_ids`` are this
        plan's prompt ids) for the next top-up round, instead of calling ``v05`` with the allocator's keywords."""
        from rolloutopt.advantages.v05 import V05Output

        if not isinstance(output, V05Output):
            raise InputError("output", "a V05Output (rolloutopt.advantages.v05)", describe(output), "pass v05(...)")
        extra = torch.zeros(self.prompt_ids.numel(), dtype=torch.long)
        extra[self.positions(output.group_ids.long().cpu())] = output.extra_rollouts.long().cpu()
        self._extra = extra

    def _request_from_v05(self) -> Tensor:
        from rolloutopt.advantages.v05 import v05

        o = self.o
        pos, r = self.rollouts()
        extra = torch.zeros(self.prompt_ids.numel(), dtype=torch.long)
        if pos.numel() == 0:
            return extra
        # groups labelled by plan position (each prompt's rollouts form one group either way; v05's per-group
        # request depends on the group's rewards and prior only): no id gather, no lookup of the output's ids,
        # and one request's positions come sorted, which v05's grouping takes without a sort
        out = v05(r, pos, self.prior.index_select(0, pos), experimental=True, max_extra=o.max_extra, **o.v05_kwargs)
        extra[out.group_ids] = out.extra_rollouts
        return extra

    def decide(self) -> Request | None:
        o = self.o
        if self.round == 0:
            self.round = 1
            give = _budget_prefix(torch.full_like(self._n, o.n), self._order, self.budget)
            return self.request(give > 0, give[give > 0]) if bool((give > 0).any()) else None
        if self.round > o.rounds:
            return None
        self.round += 1
        extra = self._extra if self._extra is not None else self._request_from_v05()
        self._extra = None
        extra = torch.where(self._n > 0, extra, 0)
        want = torch.minimum(extra, o._cap - self._n)
        give = _budget_prefix(want, self._order, self.budget - self.spent)
        self._capped |= (give < extra) & (extra > 0)
        self._got_extra |= give > 0
        return self.request(give > 0, give[give > 0]) if bool((give > 0).any()) else None

    def select(self) -> tuple[FloatB, IntP]:
        reasons = torch.where(self._n == 0, 3, torch.where(self._capped, 2, torch.where(self._got_extra, 1, 0)))
        return torch.ones(self.spent_observed, dtype=torch.float64), reasons


class V05Budget:
    r"""The allocator side of V_{0.5} (arXiv 2603.10848): ``n`` rollouts, then the extra rollouts ``v05`` asks for.

    ("Sequential OSLA budget allocation"; ``docs/methods/adaptive_alloc.md``). Round 0 gives every prompt ``n`` rollouts
    (the paper's group size 4); each of ``rounds`` top-up rounds then grants each prompt the one-step look-ahead
    request of :func:`rolloutopt.advantages.v05` computed on its rollouts so far,

    .. math::

        k_x = \min\{k \in [0, k_{max}] : \mathrm{MSE}(n_x + k) - \mathrm{MSE}(n_x + k + 1) < c\}, \qquad
        \mathrm{MSE}(m) = \frac{\hat\delta^2 \hat v}{m \hat\delta^2 + \hat v},

    clipped to ``n_max`` and to the budget (increasing-id order; the clipped prompts are ``"capped"``). The prior
    :math:`\hat b_0` of a prompt is the value-model prediction given with :meth:`set_prior`, else its mean reward
    over past steps (``update``), else ``unseen_prior``. A trainer with its own ``v05`` call (its own value model
    and keywords) hands the output to ``plan.consume(output)`` before the next ``plan.next()``; otherwise the plan
    calls ``v05(rewards, prompt ids, prior, experimental=True, max_extra=max_extra, **v05_kwargs)`` itself.

    **Reconstructed** (keywords): the whole budget rule (our reconstruction from the abstract and summaries),
    ``rounds=1``, the past-mean prior fallback and ``unseen_prior=0.5``; ``max_extra=4`` and ``cost=1e-3`` are
    ``v05``'s defaults. Every rollout is kept (weight 1). The budget is spent only as far as the requests go.

    Args:
        n: rollouts per prompt in round 0.
        max_extra: cap on the extra rollouts per prompt per round (``v05``'s ``max_extra``).
        rounds: top-up rounds (``v05`` is recomputed before each).
        n_min, n_max: caps: a prompt gets 0 or between ``n >= n_min`` and ``n_max`` rollouts (None: unbounded).
        unseen_prior: prior for a prompt with neither a value-model prediction nor history.
        v05_kwargs: further keywords of ``v05`` (``cost``, ``variance``, ``threshold``, ``fallback``, ...).
        experimental: must be True.

    Edge cases: a budget below ``n * P`` gives round 0 to the lowest ids (the rest ``"no_budget"``) and leaves
    nothing for top-ups; ``rounds=0`` or ``max_extra=0`` is a fixed group of ``n``; rewards outside [0, 1] need
    ``v05_kwargs={"variance": "sample"}`` (``v05`` raises otherwise).
    """

    reference: ClassVar[str] = "arXiv 2603.10848 (V_{0.5}, the allocator side)"
    experimental: ClassVar[str | None] = "the sequential extra-budget rule is reconstructed"

    def __init__(
        self,
        *,
        n: int = 4,
        max_extra: int = 4,
        rounds: int = 1,
        n_min: int = 1,
        n_max: int | None = None,
        unseen_prior: float = 0.5,
        v05_kwargs: dict[str, Any] | None = None,
        experimental: bool = False,
    ) -> None:
        require_experimental(experimental, "V_{0.5}'s sequential extra-budget rule", "docs/methods/adaptive_alloc.md")
        _int(n, "n", 1)
        _int(max_extra, "max_extra", 0)
        _int(rounds, "rounds", 0)
        _int(n_min, "n_min", 1)
        _int(n_max, "n_max", 1, none=True)
        if n_min > n:
            raise InputError("n_min", f"n_min <= n = {n}", repr(n_min), "lower n_min or raise n")
        if n_max is not None and n_max < n:
            raise InputError("n_max", f"n_max >= n = {n}", repr(n_max), "raise n_max or lower n")
        _real(unseen_prior, "unseen_prior", 0.0, 1.0)
        kw = dict(v05_kwargs or {})
        if not isinstance(v05_kwargs, (dict, type(None))) or {"experimental", "max_extra", "valid"} & set(kw):
            raise InputError(
                "v05_kwargs", "a dict of v05 keywords (not experimental/max_extra/valid)", describe(v05_kwargs), "fix"
            )
        self.n, self.max_extra, self.rounds, self.n_min, self.n_max = n, max_extra, rounds, n_min, n_max
        self.unseen_prior, self.v05_kwargs = float(unseen_prior), kw
        self._cap = n_max if n_max is not None else 1 << 62
        self._ids = torch.zeros(0, dtype=torch.long)
        self._vm = torch.zeros(0, dtype=torch.float64)  # value-model prior, NaN where none
        self._sum = torch.zeros(0, dtype=torch.float64)
        self._cnt = torch.zeros(0, dtype=torch.float64)

    def _grow(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        nan = torch.tensor(math.nan, dtype=torch.float64)
        zero = torch.tensor(0.0, dtype=torch.float64)
        self._ids, (self._vm, self._sum, self._cnt), pos, order = _insert(
            self._ids, ids, [(self._vm, nan), (self._sum, zero), (self._cnt, zero)]
        )
        return pos, order

    def set_prior(self, prompt_ids: IntP, prior: FloatP) -> None:
        """Store value-model predictions :math:`\\hat b_0` (float ``[P]``, clipped to [0, 1]) for ``prompt_ids``."""
        ids = as_prompt_ids(prompt_ids)
        if not isinstance(prior, Tensor) or not prior.is_floating_point() or prior.shape != ids.shape:
            raise InputError("prior", f"a float tensor [{ids.numel()}]", describe(prior), "one value per prompt id")
        p = prior.detach().cpu().double()
        if not bool(torch.isfinite(p).all()):
            raise InputError("prior", "finite values", describe(prior), "fix the value model's output")
        pos, order = self._grow(ids)
        vm = self._vm.clone()
        vm[pos] = p[order].clamp(0.0, 1.0)
        self._vm = vm

    def prior(self, prompt_ids: IntP) -> FloatP:
        """The prior used for each prompt (float64 ``[P]``): value model, else past mean reward, else unseen."""
        ids = as_prompt_ids(prompt_ids)
        if self._ids.numel() == 0:
            return torch.full((ids.numel(),), self.unseen_prior, dtype=torch.float64)
        pos, found = _lookup(self._ids, ids)
        vm, s, c = self._vm[pos], self._sum[pos], self._cnt[pos]
        mean = torch.where(c > 0, (s / c.clamp(min=1)).clamp(0.0, 1.0), self.unseen_prior)
        return torch.where(found, torch.where(torch.isnan(vm), mean, vm), self.unseen_prior)

    def plan(self, prompt_ids: IntP, budget: int) -> _V05Plan:
        """``n`` rollouts each, then ``rounds`` top-ups from the ``v05`` request (class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        return _V05Plan(ids, check_budget(budget), self, self.prior(ids))

    def update(self, result: AllocationResult) -> None:
        """Accumulate each prompt's reward sum and count (the prior of prompts without a value-model prediction)."""
        result = _check_result(result, "V05Budget", _V_NAMES)
        p = result.plan_prompt_ids.numel()
        s = torch.zeros(p, dtype=torch.float64).index_add_(0, result.group, result.rewards.double())
        seen = result.counts > 0
        pos, order = self._grow(result.plan_prompt_ids[seen])
        total, cnt = self._sum.clone(), self._cnt.clone()
        total[pos] += s[seen][order]
        cnt[pos] += result.counts[seen][order].double()
        self._sum, self._cnt = total, cnt

    def state_dict(self) -> dict[str, Any]:
        """Sorted ids with their value-model prior (NaN: none), reward sum and count (copies)."""
        return {
            "ids": self._ids.clone(),
            "value": self._vm.clone(),
            "sum": self._sum.clone(),
            "count": self._cnt.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        s = check_state(state, {"ids", "value", "sum", "count"}, "V05Budget")
        self._ids, self._vm = s["ids"].clone().long(), s["value"].clone().double()
        self._sum, self._cnt = s["sum"].clone().double(), s["count"].clone().double()
