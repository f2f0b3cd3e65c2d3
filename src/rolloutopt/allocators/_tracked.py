"""Pieces the within-step allocator families share: :class:`_Tracked` (a conversation that keeps per-prompt
reward extremes and successes, for VIGOR, Pilot-Commit, AR3PO, AERO and V05Budget), the ``n_min``/``n_max`` check
:func:`_caps`, the tie-broken ranking :func:`_rank` (VIGOR, DOTS, XRPO) and the AR3PO/AERO/V05Budget helpers
:func:`_success` and :func:`_budget_prefix`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rolloutopt._validation import describe
from rolloutopt.allocators._base import Conversation, _int
from rolloutopt.allocators._ids import _argsort_stable
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, IntB

_BIG = 1 << 62


# -- validation helpers -------------------------------------------------------------------------------------------


def _caps(n_min: Any, n_max: Any) -> None:
    _int(n_min, "n_min", 1)
    _int(n_max, "n_max", 1, none=True)
    if n_max is not None and n_max < n_min:
        raise InputError("n_max", f"n_max >= n_min = {n_min}", repr(n_max), "raise n_max or lower n_min")


class _Tracked(Conversation):
    """A conversation that also tracks, per planned prompt, the min and max reward (when ``track_extremes``, for
    :meth:`group_stats`) and the successes so far (when ``track_successes``), updated from each observed request
    only, so a round never re-reads every rollout."""

    success_threshold = 1.0
    track_extremes = True
    track_successes = True

    def __init__(self, prompt_ids: Tensor, budget: int) -> None:
        super().__init__(prompt_ids, budget)
        p = prompt_ids.numel()
        self._hi = torch.full((p,), -math.inf, dtype=torch.float64)
        self._lo = torch.full((p,), math.inf, dtype=torch.float64)
        self._succ = torch.zeros(p, dtype=torch.float64)
        self._stats: tuple[Tensor, Tensor, Tensor] | None = None  # group_stats() since the last observe

    def on_observe(self, pos: IntB, r: FloatB) -> None:
        """Update the per-prompt extremes and successes from the request just observed."""
        self._stats = None
        if self.track_extremes:
            self._hi.scatter_reduce_(0, pos, r, "amax")
            self._lo.scatter_reduce_(0, pos, r, "amin")
        if self.track_successes:
            self._succ.index_add_(0, pos, (r >= self.success_threshold).double())
        self.observed(pos, r)

    def observed(self, pos: Tensor, r: Tensor) -> None:
        """Hook: the rollouts of the request just observed (prompt positions, rewards)."""

    def group_stats(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per planned prompt: count, mean, population variance (exactly 0 where every reward is equal); computed
        once per observed request (read-only tensors)."""
        if self._stats is not None:
            return self._stats
        n, s, ss = self.totals()
        nf = n.double().clamp(min=1)
        mean = s / nf
        assert self.track_extremes, "group_stats needs track_extremes"
        flat = (n == 0) | (self._hi == self._lo)
        var = torch.where(flat, 0.0, (ss / nf - mean * mean).clamp(min=0.0))
        self._stats = (n, mean, var)
        return n, mean, var


def _rank(score: Tensor, by_id: Tensor) -> Tensor:
    """Positions sorted by ``score`` descending, ties toward the lower prompt id (``by_id``: positions by id)."""
    return by_id.index_select(0, _argsort_stable(score.index_select(0, by_id), descending=True))


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
