r"""AERO: Beta posterior, selective rejection (:class:`AERO`, :func:`dead_zone_probability`).

Speaks the protocol of :mod:`rolloutopt.allocators._base` (``plan`` -> ``next``/``observe`` -> ``finish`` ->
``update``), keeps its per-prompt state in a :class:`~rolloutopt.allocators.PromptTable` (``torch.searchsorted``
look-ups, no Python loop over prompts or rollouts) and checkpoints it with ``state_dict``/``load_state_dict``.

Provenance (``docs/methods/adaptive_alloc.md``): the paper has no public code; only its abstract and public
summaries were available. Every stage size, threshold, buffer policy and default below is **[reconstructed]** by
this project and is a keyword. Following the project rule (as :mod:`rolloutopt.allocators.gdro` resolved it), the
class raises an :class:`~rolloutopt.errors.InputError` naming ``experimental`` unless it is constructed with
``experimental=True``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_bool as _bool
from rolloutopt._validation import describe, require_experimental
from rolloutopt.allocators._base import (
    AllocationResult,
    Request,
    _int,
    _real,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._ids import _argsort_stable, _sort_ids
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._tracked import _success, _Tracked
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatB, FloatP, IntP

__all__ = ["AERO", "dead_zone_probability"]


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


class AERO(TableOwner):
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
        capacity: prompts kept in a private table (default None: 1,000,000; least recently updated evicted, and
            then back to the prior).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); AERO registers
            ``a`` and ``b`` (the posteriors, the prior for a prompt it has not seen) as owner ``"aero"``, and the
            caller saves a shared table once.

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
        capacity: int | None = None,
        table: PromptTable | None = None,
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
        # the fill of a row is the prior: a prompt this owner has not seen (or that a shared table's other owner
        # added) reads as never seen, with no seen mask needed
        self._cols = open_table(
            table,
            capacity,
            "aero",
            {
                "a": Column("float", fill=self.prior[0], checks=("nonneg",)),
                "b": Column("float", fill=self.prior[1], checks=("nonneg",)),
            },
        )

    def posterior(self, prompt_ids: IntP) -> tuple[FloatP, FloatP]:
        """The Beta ``(a, b)`` of each prompt (float64 ``[P]``; the prior for unseen ones)."""
        ids = as_prompt_ids(prompt_ids)
        if self._cols.empty:
            return (
                torch.full((ids.numel(),), self.prior[0], dtype=torch.float64),
                torch.full((ids.numel(),), self.prior[1], dtype=torch.float64),
            )
        pos, seen = self._cols.find(ids)
        a, b = self._cols["a"].index_select(0, pos), self._cols["b"].index_select(0, pos)
        return torch.where(seen, a, self.prior[0]), torch.where(seen, b, self.prior[1])

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

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> _AEROPlan:
        """Size each prompt's group from its posterior (class docstring), one request."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        # everything per prompt in increasing-id order (the order that breaks priority ties): the posterior look-up
        # of sorted ids needs no scatter back, and one scatter at the end places counts and reasons
        q, by_id = _sort_ids(ids)
        if self._cols.empty:
            a = torch.full((p,), self.prior[0], dtype=torch.float64)
            b = torch.full((p,), self.prior[1], dtype=torch.float64)
        else:
            # a stored row this owner has not seen holds the prior (the fill): only the row's existence matters
            t_ids = self._cols.table.prompt_ids
            at = torch.searchsorted(t_ids, q).clamp_(max=t_ids.numel() - 1)
            found = t_ids.index_select(0, at) == q
            a = torch.where(found, self._cols["a"].index_select(0, at), self.prior[0])
            b = torch.where(found, self._cols["b"].index_select(0, at), self.prior[1])
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
        pos, order = self._cols.add(ids)  # new rows hold the prior
        cs, ns = c[seen][order], n[seen][order]
        a, b = self._cols["a"], self._cols["b"]
        a.index_copy_(0, pos, self.forget * a.index_select(0, pos) + cs)
        b.index_copy_(0, pos, self.forget * b.index_select(0, pos) + ns - cs)

    STATE: ClassVar[dict[str, Field]] = {
        "table": TableColumns.FIELD,
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`; the table validates its
    columns: the posteriors ``a`` and ``b`` are non-negative)."""

    def state_dict(self) -> dict[str, Any]:
        """The table (per-prompt posteriors ``a``, ``b``; the rows only when the table is private) and the generator
        state (copies)."""
        return dump_state({"table": self._cols.state(), "generator": self._gen.get_state()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "AERO")
        cols, at = self._cols.incoming(s["table"])
        for name, prior in zip(("a", "b"), self.prior, strict=True):
            # a row this AERO has not seen must read as its prior (the plan reads rows without the seen mask)
            if bool((~cols["seen"] & (cols[name] != prior)).any()):
                raise InputError(
                    f"{at}[{self._cols.owner + '/' + name!r}]",
                    f"the prior {prior} for every prompt the allocator has not seen",
                    "other values",
                    "pass the state_dict() of an AERO with this prior",
                )
        self._cols.load(s["table"])
        self._gen.set_state(s["generator"])
