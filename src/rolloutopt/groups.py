"""Ragged group structure and vectorised segment reductions.

Rollouts of one prompt share a group id. :class:`Groups` computes the structure of a batch of ids once — the
dense index of each row's group, the group sizes, a permutation that sorts rows by group, each row's position
inside its group — and offers the segment reductions the advantage estimators need: count, sum, mean, var and
std, min, max, median, quantile, leave-one-out mean and rank within group. Every reduction is vectorised
(``index_add_``/``scatter_reduce`` for sums and extrema, one stable sort for order statistics); none loops over
groups in Python. When every group has the same size, sums, extrema and order statistics take a reshape fast
path (``[G, n]`` views) with the same numbers up to floating-point summation order.

Each reduction takes an optional ``valid`` mask ``[B]``: only valid rows enter the statistics (verl PR #6452:
rows rejected by a filter must not shift their siblings' baseline). A group with no valid row has count 0,
sum, mean, variance, extrema, median and quantiles 0 (never NaN), so that downstream arithmetic and gradients
stay finite; callers that must distinguish such groups read :meth:`Groups.count`.

Groups are ordered by increasing id: statistic ``[G]`` entry ``g`` belongs to ``unique_ids[g]``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Int, Shaped
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_index, as_mask, checks_enabled, choice
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, FloatB, FloatG, IntB

__all__ = ["Groups", "as_groups"]

MedianMode = Literal["average", "lower", "upper"]


class Groups:
    """The structure of a batch's group ids, computed once and reused by every estimator of a step.

    Args:
        ids: int tensor ``[B]`` of group ids; any values (negative, sparse, huge), any order.

    Attributes:
        ids: the ids, int64 ``[B]``.
        unique_ids: the distinct ids in increasing order, ``[G]``.
        inverse: dense group index of each row, int64 ``[B]`` in ``[0, G)``.
        sizes: rows per group, int64 ``[G]``.
        offsets: int64 ``[G + 1]``; group ``g`` occupies ``order[offsets[g]:offsets[g + 1]]``.
        first_rows: int64 ``[G]``, the row index of each group's first row (in row order).
        order: stable permutation that sorts rows by group, int64 ``[B]``.
        position: index of each row inside its group (in row order), int64 ``[B]``.
        num_rows, num_groups: ``B`` and ``G``.
        dense_size: the common group size when every group has the same size, else None.
        rows_sorted: whether the rows are already in group order (``order`` is the identity), so that a dense
            batch reshapes to ``[G, n]`` without a gather.
        min_size, max_size: smallest and largest group size.

    Construction costs one sort (skipped when ids are already sorted) and one host synchronisation; build it
    once per step and pass it wherever a ``group`` argument is accepted.
    """

    def __init__(self, ids: IntB) -> None:
        ids = as_index(ids, "group")
        if checks_enabled() and ids.ndim != 1:
            raise InputError("group", "a 1-d tensor of ids [B]", f"shape {tuple(ids.shape)}", "pass one id per rollout")
        if ids.numel() == 0:
            raise InputError("group", "at least one id", "an empty tensor", "pass one id per rollout")
        num_rows = ids.numel()
        already_sorted = num_rows == 1 or bool((ids[1:] >= ids[:-1]).all())
        if already_sorted:
            unique_ids, inverse, sizes = torch.unique_consecutive(ids, return_inverse=True, return_counts=True)
            order = torch.arange(num_rows, device=ids.device)
            sorted_inverse = inverse
        else:
            # One stable sort gives both the order and (via unique_consecutive) the inverse: half the cost of
            # torch.unique (a sort) followed by an argsort of the inverse.
            sorted_ids, order = torch.sort(ids, stable=True)
            unique_ids, sorted_inverse, sizes = torch.unique_consecutive(
                sorted_ids, return_inverse=True, return_counts=True
            )
            inverse = torch.empty_like(sorted_inverse).scatter_(0, order, sorted_inverse)
        offsets = torch.zeros(sizes.numel() + 1, dtype=torch.long, device=ids.device)
        torch.cumsum(sizes, 0, out=offsets[1:])
        position = torch.empty_like(inverse).scatter_(
            0, order, torch.arange(num_rows, device=ids.device) - offsets.index_select(0, sorted_inverse)
        )
        min_size, max_size = torch.stack([sizes.min(), sizes.max()]).tolist()

        self.ids = ids
        self.unique_ids: Tensor = unique_ids
        self.inverse: Tensor = inverse
        self.sizes: Tensor = sizes
        self.offsets = offsets
        self.first_rows: Tensor = order.index_select(0, offsets[:-1])
        self.order = order
        self.position = position
        self.num_rows = num_rows
        self.num_groups = int(sizes.numel())
        self.min_size = int(min_size)
        self.max_size = int(max_size)
        self.dense_size: int | None = self.max_size if self.min_size == self.max_size else None
        self.rows_sorted = already_sorted

    @classmethod
    def from_labels(cls, labels: Iterable[Hashable], *, device: torch.device | str | None = None) -> Groups:
        """Groups from arbitrary hashable labels, e.g. verl's ``uid`` strings (exact: labels are compared by equality).

        A label's id is the row of its last occurrence. One hash-table pass over the labels, several times faster
        than the ``np.unique`` sort that verl's vectorised estimators run on the same strings (measured in
        ``benchmarks/results/groups.md``). Labels in consecutive blocks (a trainer's ``rollout.n`` repeats) give
        increasing ids, so the result takes the identity-order fast path.

        Args:
            labels: one label per rollout (a list, tuple or 1-d numpy array of strings, ints, tuples...).
            device: where the ids live (default CPU).
        """
        items = labels.tolist() if isinstance(labels, np.ndarray) and labels.ndim == 1 else labels
        if isinstance(labels, (Tensor, str, bytes)) or (isinstance(labels, np.ndarray) and labels.ndim != 1):
            raise InputError(
                "labels",
                "a 1-d sequence of hashable labels (list, tuple or 1-d numpy array)",
                type(labels).__name__ + (f" of shape {labels.shape}" if hasattr(labels, "shape") else ""),
                "pass int64 tensors of ids to Groups(ids) directly, and other labels as a list or 1-d array",
            )
        rows = list(items)
        try:
            last = dict(zip(rows, range(len(rows)), strict=True))  # label -> row of its last occurrence
        except TypeError as exc:
            raise InputError(
                "labels",
                "hashable labels (str, int, tuple...)",
                f"an unhashable label ({exc})",
                "convert labels to str",
            ) from None
        ids = np.fromiter(map(last.__getitem__, rows), dtype=np.int64, count=len(rows))
        return cls(torch.from_numpy(ids).to(device))

    def __repr__(self) -> str:
        return f"Groups(num_rows={self.num_rows}, num_groups={self.num_groups}, sizes={self.min_size}..{self.max_size})"

    # ------------------------------------------------------------------ helpers
    def _x(self, x: Any, name: str = "x") -> Tensor:
        if checks_enabled() and isinstance(x, Tensor) and x.shape != (self.num_rows,):
            raise InputError(
                name,
                f"a tensor of shape [B] with B={self.num_rows} (from group)",
                f"shape {tuple(x.shape)}",
                "pass one value per rollout",
            )
        return as_float(x, name)

    def _valid(self, valid: Any) -> Tensor | None:
        if valid is None:
            return None
        v = as_mask(valid, "valid")
        if checks_enabled() and v.shape != (self.num_rows,):
            raise InputError(
                "valid",
                f"a mask of shape [B] with B={self.num_rows} (from group)",
                f"shape {tuple(v.shape)}",
                "pass one flag per rollout",
            )
        return v

    def _dense(self, x: Tensor) -> Tensor:
        """``x`` as a ``[G, n]`` view (a gather when rows are not sorted by group)."""
        assert self.dense_size is not None
        if not self.rows_sorted:
            x = x.index_select(0, self.order)
        return x.reshape(self.num_groups, self.dense_size)

    def broadcast(self, stat: Shaped[Tensor, " G *K"]) -> Shaped[Tensor, " B *K"]:
        """Broadcast a per-group statistic ``[G]`` (or ``[G, ...]``, of any dtype) to its rows ``[B]`` (``[B, ...]``)."""
        if checks_enabled() and (not isinstance(stat, Tensor) or stat.ndim == 0 or stat.shape[0] != self.num_groups):
            # a per-row [B] tensor passed by mistake would otherwise be gathered silently when B >= G
            raise InputError(
                "stat",
                f"a per-group tensor of shape [G] with G={self.num_groups} (from group)",
                f"shape {tuple(stat.shape)}" if isinstance(stat, Tensor) else type(stat).__name__,
                "pass one value per group, ordered as unique_ids",
            )
        return stat.index_select(0, self.inverse)  # several times faster than stat[inverse] on the CPU

    # --------------------------------------------------------------- reductions
    def count(self, valid: BoolB | None = None) -> Int[Tensor, " G"]:
        """Number of (valid) rows per group, int64 ``[G]``."""
        v = self._valid(valid)
        if v is None:
            return self.sizes
        return torch.zeros(self.num_groups, dtype=torch.long, device=v.device).index_add_(0, self.inverse, v.long())

    def sum(self, x: FloatB, valid: BoolB | None = None) -> FloatG:
        """Sum of ``x`` over the (valid) rows of each group, ``[G]``."""
        x = self._x(x)
        valid = self._valid(valid)
        if valid is None and self.dense_size is not None:
            return self._dense(x).sum(dim=1)
        if valid is not None:
            x = torch.where(valid, x, torch.zeros_like(x))
        return torch.zeros(self.num_groups, dtype=x.dtype, device=x.device).index_add(0, self.inverse, x)

    def mean(self, x: FloatB, valid: BoolB | None = None) -> FloatG:
        """Mean of ``x`` over the (valid) rows of each group, ``[G]``; 0 for a group with no valid row."""
        x = self._x(x)
        valid = self._valid(valid)
        if valid is None and self.dense_size is not None:
            return self._dense(x).mean(dim=1)
        return self.sum(x, valid) / self.count(valid).clamp(min=1).to(x.dtype)

    def var(self, x: FloatB, valid: BoolB | None = None, *, unbiased: bool = True) -> FloatG:
        """Variance per group, ``[G]``: unbiased (n-1, torch/verl/TRL default) or population (n).

        Two-pass (mean first, then squared deviations) for numerical stability. Groups with fewer rows than
        the estimator needs (1 unbiased, 0 population) have variance 0.
        """
        x = self._x(x)
        valid = self._valid(valid)
        correction = 1 if unbiased else 0
        if valid is None and self.dense_size is not None:
            if self.dense_size <= correction:
                return torch.zeros(self.num_groups, dtype=x.dtype, device=x.device)
            d = self._dense(x)
            return ((d - d.mean(dim=1, keepdim=True)) ** 2).sum(dim=1) / (self.dense_size - correction)
        n = self.count(valid)
        dev = x - self.broadcast(self.mean(x, valid))
        ss = self.sum(dev * dev, valid)
        return torch.where(n > correction, ss / (n - correction).clamp(min=1).to(x.dtype), torch.zeros_like(ss))

    def std(self, x: FloatB, valid: BoolB | None = None, *, unbiased: bool = True) -> FloatG:
        """Standard deviation per group, ``[G]``: ``sqrt(var)``, with a zero (not NaN) gradient where var = 0."""
        v = self.var(x, valid, unbiased=unbiased)
        positive = v > 0
        return torch.where(positive, v, torch.ones_like(v)).sqrt() * positive

    def _extreme(self, x: FloatB, valid: Any, reduce: Literal["amin", "amax"]) -> FloatG:
        x = self._x(x)
        valid = self._valid(valid)
        if valid is None and self.dense_size is not None:
            d = self._dense(x)
            return d.amin(dim=1) if reduce == "amin" else d.amax(dim=1)
        out = torch.zeros(self.num_groups, dtype=x.dtype, device=x.device)
        if valid is not None:
            fill = torch.full_like(x, float("inf") if reduce == "amin" else float("-inf"))
            x = torch.where(valid, x, fill)
        out = out.scatter_reduce(0, self.inverse, x, reduce=reduce, include_self=False)
        if valid is not None:
            out = torch.where(self.count(valid) > 0, out, torch.zeros_like(out))
        return out

    def min(self, x: FloatB, valid: BoolB | None = None) -> FloatG:
        """Minimum per group, ``[G]``."""
        return self._extreme(x, valid, "amin")

    def max(self, x: FloatB, valid: BoolB | None = None) -> FloatG:
        """Maximum per group, ``[G]``."""
        return self._extreme(x, valid, "amax")

    def sort(self, x: FloatB, valid: BoolB | None = None) -> tuple[IntB, Int[Tensor, " G"]]:
        """Rows sorted by (group, validity, value), ties kept in row order.

        Returns ``(perm, count)``: ``x[perm]`` lists group 0's valid values in increasing order, then its invalid
        rows, then group 1's, and so on; group ``g`` starts at ``offsets[g]`` and has ``count[g]`` valid values.
        """
        x = self._x(x)
        valid = self._valid(valid)
        key = x.detach()
        if valid is not None:
            key = torch.where(valid, key, torch.full_like(key, float("inf")))
        by_value = torch.argsort(key, stable=True)
        perm = by_value[torch.argsort(self.inverse[by_value], stable=True)]
        return perm, self.count(valid)

    def _order_stat(self, x: Tensor, valid: Tensor | None, k: Tensor) -> Tensor:
        """Value of rank ``k[g]`` (0-based, among valid rows) in each group."""
        if valid is None and self.dense_size is not None:
            srt = self._dense(x).sort(dim=1, stable=True).values
            return srt.gather(1, k.clamp(0, self.dense_size - 1)[:, None]).squeeze(1)
        perm, _ = self.sort(x, valid)
        idx = (self.offsets[:-1] + k).clamp(0, self.num_rows - 1)
        return x[perm[idx]]

    def median(self, x: FloatB, valid: BoolB | None = None, *, mode: MedianMode = "average") -> FloatG:
        """Median per group, ``[G]``.

        For an even number ``n`` of valid rows, ``mode`` picks the lower (rank ``n/2 - 1``), upper (rank
        ``n/2``) or average of the two middle values (numpy's and ``statistics.median``'s convention;
        ``torch.median`` returns the lower one).
        """
        choice(mode, "mode", ("average", "lower", "upper"))
        x = self._x(x)
        valid = self._valid(valid)
        n = self.count(valid)
        lower = self._order_stat(x, valid, torch.div(n - 1, 2, rounding_mode="floor"))
        upper = self._order_stat(x, valid, torch.div(n, 2, rounding_mode="floor"))
        out = {"lower": lower, "upper": upper, "average": (lower + upper) / 2}[mode]
        return torch.where(n > 0, out, torch.zeros_like(out))

    def quantile(self, x: FloatB, q: float, valid: BoolB | None = None) -> FloatG:
        """Quantile ``q`` in [0, 1] per group, ``[G]``, with linear interpolation (numpy's default ``linear``):
        position ``q·(n-1)`` between the sorted values ``floor`` and ``ceil`` of it."""
        if not isinstance(q, (int, float)) or isinstance(q, bool) or not 0.0 <= q <= 1.0:
            raise InputError("q", "a number in [0, 1]", repr(q), "pass the quantile as a fraction, e.g. 0.5")
        x = self._x(x)
        valid = self._valid(valid)
        n = self.count(valid)
        pos = q * (n - 1).clamp(min=0).to(x.dtype)
        lo = pos.floor().long()
        frac = pos - lo.to(x.dtype)
        v_lo = self._order_stat(x, valid, lo)
        v_hi = self._order_stat(x, valid, (lo + 1).minimum((n - 1).clamp(min=0)))
        out = v_lo + (v_hi - v_lo) * frac
        return torch.where(n > 0, out, torch.zeros_like(out))

    def loo_mean(self, x: FloatB, valid: BoolB | None = None) -> FloatB:
        """Leave-one-out mean per row, ``[B]``: the mean of the other (valid) rows of its group.

        A row with no other valid row in its group gets 0. Invalid rows get the mean of all valid rows of
        their group (they leave nothing out).
        """
        x = self._x(x)
        valid = self._valid(valid)
        total = self.broadcast(self.sum(x, valid))
        n = self.broadcast(self.count(valid)).to(x.dtype)
        if valid is None:
            own, one = x, torch.ones_like(x)
        else:
            own, one = torch.where(valid, x, torch.zeros_like(x)), valid.to(x.dtype)
        others = n - one
        return torch.where(others > 0, (total - own) / others.clamp(min=1), torch.zeros_like(x))

    def rank(self, x: FloatB, valid: BoolB | None = None, *, descending: bool = False) -> IntB:
        """Ordinal rank of each row inside its group, int64 ``[B]``: 0 for the smallest (largest with
        ``descending``) valid value; ties are broken by row position; invalid rows get -1."""
        x = self._x(x)
        valid = self._valid(valid)
        perm, _ = self.sort(-x if descending else x, valid)
        ranks = torch.empty_like(self.inverse)
        ranks[perm] = torch.arange(self.num_rows, device=x.device) - self.offsets[self.inverse[perm]]
        if valid is not None:
            ranks = torch.where(valid, ranks, torch.full_like(ranks, -1))
        return ranks


def as_groups(group: Groups | IntB, dims: Dims | None = None) -> Groups:
    """Accept either a :class:`Groups` or a tensor of ids ``[B]`` and return a :class:`Groups`.

    With ``dims``, checks that the number of rows agrees with the ``B`` bound by the other arguments.
    """
    g = group if isinstance(group, Groups) else Groups(group)
    if dims is not None and checks_enabled():
        if "B" in dims.sizes and dims["B"] != g.num_rows:
            raise InputError(
                "group",
                f"{dims['B']} ids (B from {dims.sizes['B'][1]})",
                f"{g.num_rows} ids",
                "pass one group id per rollout, in the same row order",
            )
        dims.sizes.setdefault("B", (g.num_rows, "group"))
    return g
