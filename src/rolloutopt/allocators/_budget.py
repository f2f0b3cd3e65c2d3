"""Pieces CoBA and Knapsack share (``docs/methods/budget.md``).

Both greedy/DP solvers reduce to "take the ``R`` largest marginal gains of a ``[E, L]`` table whose rows are
non-increasing" (:func:`_top_units`): one ``torch.kthvalue`` and a cumulative tie cut, no loop over prompts.
Every plan works on the prompts sorted by id, so "the first prompts" of the codes' remainder rules and the
heap's tie-breaking by index mean *smallest prompt id first*: a permutation of ``prompt_ids`` permutes the plan
and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rolloutopt.allocators._base import Conversation, Request
from rolloutopt.typing import FloatB, IntP

_F64 = torch.float64


# -- validation helpers -------------------------------------------------------------------------------------------
# -- shared vectorised pieces -------------------------------------------------------------------------------------
def _top_units(gains: Tensor, r: int) -> Tensor:
    """Units per row taken by a heap greedy on ``gains`` ``[E, L]`` (rows non-increasing), ``r`` units in all.

    The heap pops the largest gain, ties by smaller row, and pushes the row's next gain; with non-increasing rows
    it takes exactly the ``r`` largest entries, ties in row-major order. Here: the ``r``-th largest value ``t``
    (``torch.kthvalue``), every entry ``> t``, and the first ``r - #(> t)`` entries ``== t`` in row-major order.
    Returns int64 ``[E]`` (each in ``[0, L]``, summing to ``min(r, E * L)``).
    """
    e, length = gains.shape
    total = e * length
    if r <= 0 or total == 0:
        return torch.zeros(e, dtype=torch.long)
    if r >= total:
        return torch.full((e,), length, dtype=torch.long)
    flat = gains.reshape(-1)
    t = torch.kthvalue(flat, total - r + 1).values
    above = flat > t
    tie = flat == t
    need = r - above.sum()
    take = above | (tie & (torch.cumsum(tie, 0) <= need))
    return take.view(e, length).sum(1)


def _top_units_lazy(gain_fn: Callable[[int], Tensor], length: int, r: int, first: int = 16) -> Tensor:
    """:func:`_top_units` on ``gain_fn(L')`` (the first ``L'`` columns of the full ``[E, length]`` table), with
    ``L'`` doubled until no row takes all ``L'`` columns (or ``L' = length``). Exact: a row that stops before
    column ``L'`` has every later gain ``<=`` its first untaken one, which the cut already rejected."""
    cols = min(length, first)
    while True:
        counts = _top_units(gain_fn(cols), r)
        if cols >= length or not bool((counts >= cols).any()):
            return counts
        cols = min(length, 2 * cols)


def _top_units_grouped(g: Tensor, inv: Tensor, mult: Tensor, r: int) -> Tensor:
    """:func:`_top_units` on the ``[E, L]`` table whose row ``i`` is ``g[inv[i]]`` (``g`` ``[U, L]``, ``mult[u]``
    rows equal to ``g[u]``), without building it: the cut value from a weighted sort of the ``U * L`` entries,
    then per row the entries above it and, in row order, as many entries equal to it as ``r`` still allows
    (the row-major tie rule of :func:`_top_units`: only how many ties each row takes matters). Same result as
    :func:`_top_units` on the expanded table, whatever the rows (no monotonicity needed)."""
    e, length = inv.numel(), g.shape[1]
    total = e * length
    if r <= 0 or total == 0:
        return torch.zeros(e, dtype=torch.long)
    if r >= total:
        return torch.full((e,), length, dtype=torch.long)
    vals, order = g.reshape(-1).sort(descending=True)
    weight = mult.repeat_interleave(length)[order]
    t = vals[torch.searchsorted(torch.cumsum(weight, 0), r)]  # the r-th largest entry of the expanded table
    above = (g > t).sum(1)
    tie = (g == t).sum(1)
    need = r - int((above * mult).sum())
    tie_rows = tie[inv]
    before = torch.cumsum(tie_rows, 0) - tie_rows
    return above[inv] + torch.minimum((need - before).clamp(min=0), tie_rows)


def _top_units_by_key(key: Tensor, gain_fn: Callable[[Tensor, int], Tensor], length: int, r: int) -> Tensor:
    """:func:`_top_units_lazy` on the table whose row ``i`` is ``gain_fn(key, L')[i]``, a function of ``key[i]``
    alone (elementwise torch ops whose result does not depend on the element's position: exp, log, expm1,
    arithmetic; not ``torch.pow``, whose vectorised and scalar paths can differ), evaluated once per distinct key: success rates take few distinct values, so
    the table has a few hundred rows instead of one per prompt. Identical counts (the rows of equal keys are the
    same floats); with many distinct keys (over a quarter of the rows) the expanded table is cheaper and used."""
    e = key.numel()
    if e == 0 or r <= 0:
        return torch.zeros(e, dtype=torch.long)
    if key.dtype == _F64:  # group by bit pattern: an int64 unique is faster, and splitting -0.0 from 0.0 is harmless
        bits, inv, mult = torch.unique(key.contiguous().view(torch.int64), return_inverse=True, return_counts=True)
        uniq = bits.view(_F64)
    else:
        uniq, inv, mult = torch.unique(key, return_inverse=True, return_counts=True)
    if 4 * uniq.numel() > e or bool(uniq.isnan().any()):
        return _top_units_lazy(lambda cols: gain_fn(key, cols), length, r)
    cols = min(length, 16)
    while True:
        g = gain_fn(uniq, cols)
        if bool(g.isnan().any()):
            return _top_units_lazy(lambda cols: gain_fn(key, cols), length, r)
        counts = _top_units_grouped(g, inv, mult, r)
        if cols >= length or not bool((counts >= cols).any()):
            return counts
        cols = min(length, 2 * cols)


def _spread(amount: int, mask: Tensor, room: Tensor) -> Tensor:
    """The codes' uniform split of ``amount`` over ``mask`` (``amount // k`` each, the first ``amount % k`` in
    order one more), each capped by ``room``; int64 ``[P]`` (0 outside ``mask``). One pass, as in the codes."""
    k = int(mask.sum())
    out = torch.zeros(mask.shape, dtype=torch.long)
    if k == 0 or amount <= 0:
        return out
    rank = torch.cumsum(mask.long(), 0) - 1
    give = amount // k + (rank < amount % k).long()
    return torch.where(mask, torch.minimum(give, room), out)


def _short(budget: int, p: int, n_min: int, n_max: int) -> Tensor:
    """A budget below ``p * n_min``: the first ``budget // n_min`` prompts get ``n_min``, the rest of the budget is
    spread one by one over them (capped at ``n_max``). Every non-zero count is in ``[n_min, n_max]``."""
    k = min(p, budget // n_min)
    counts = torch.zeros(p, dtype=torch.long)
    counts[:k] = n_min
    chosen = torch.arange(p) < k
    return counts + _spread(budget - k * n_min, chosen, torch.full((p,), n_max - n_min, dtype=torch.long))


class _OneShot(Conversation):
    """One request with precomputed counts; reasons fixed at plan time; every rollout kept (weight 1)."""

    def __init__(
        self, prompt_ids: Tensor, budget: int, counts: Tensor, reasons: Tensor, names: tuple[str, ...]
    ) -> None:
        super().__init__(prompt_ids, budget)
        self.counts = counts
        self._reasons = reasons
        self.reason_names = names
        self._sent = False

    def decide(self) -> Request | None:
        if self._sent:
            return None
        self._sent = True
        keep = self.counts > 0
        if not bool(keep.any()):
            return None
        return self.request(keep, self.counts[keep])

    def select(self) -> tuple[FloatB, IntP]:
        return torch.ones(self.spent_observed, dtype=torch.float64), self._reasons


def _unsort(values: Tensor, order: Tensor) -> Tensor:
    out = torch.empty_like(values)
    out[order] = values
    return out
