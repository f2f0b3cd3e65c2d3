"""The small statistics the arena's report needs: medians (``inf`` aware, NaN skipping), the seeded two-sample
bootstrap of a statistic, the ratio and difference of medians, and Spearman's rank correlation (average ranks for
ties; scipy is not a dependency)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt.errors import InputError

__all__ = ["DEFINED", "DRAWS", "bootstrap", "delta", "median", "nanmedian", "ranks", "ratio", "spearman"]

DRAWS = 2000
"""Bootstrap draws per interval."""
DEFINED = 0.9
"""An interval needs a value in at least this fraction of the bootstrap draws (else it is n/a)."""


def median(x: Float[Tensor, " n"]) -> float:
    """The median of a 1-d tensor, averaging the two middle values (``inf`` counts as larger than any value)."""
    s = x.sort().values
    n = s.numel()
    return float(s[n // 2]) if n % 2 else float((s[n // 2 - 1] + s[n // 2]) / 2)


def nanmedian(values: Sequence[float]) -> float:
    """The median of the values that are not NaN (two middle values averaged); NaN when there are none."""
    kept = [v for v in values if not math.isnan(v)]
    return median(torch.tensor(kept, dtype=torch.float64)) if kept else math.nan


def _medians(x: Float[Tensor, "d n"]) -> Float[Tensor, " d"]:
    """:func:`median` of every row of ``x`` (the same rule, row by row, in ``x``'s dtype), as float64."""
    s = x.sort(dim=1).values
    n = s.shape[1]
    m = s[:, n // 2] if n % 2 else (s[:, n // 2 - 1] + s[:, n // 2]) / 2
    return m.double()


def _ratio(num: Float[Tensor, " d"], den: Float[Tensor, " d"]) -> Float[Tensor, " d"]:
    """``num / den`` elementwise with :func:`ratio`'s rules for an infinite or zero ``den``."""
    special = torch.where(
        num.isinf() | (num == den), torch.full_like(num, math.nan),
        torch.where(den == 0, torch.full_like(num, math.inf), torch.zeros_like(num)),
    )  # fmt: skip
    return torch.where(den.isinf() | (den == 0), special, num / den)


def _delta(a: Float[Tensor, " d"], b: Float[Tensor, " d"]) -> Float[Tensor, " d"]:
    return a - b


def bootstrap(
    a: Float[Tensor, " n"], b: Float[Tensor, " m"], stat: Callable[[Tensor, Tensor], float], seed: int
) -> tuple[float, float]:
    """The 2.5 and 97.5 percentiles of ``stat(a*, b*)`` over :data:`DRAWS` draws that resample ``a`` and ``b``
    independently (generator seeded with ``seed``); draws whose statistic is NaN are left out, and the interval is
    ``(nan, nan)`` when they are more than ``1 - DEFINED`` of the draws. ``stat`` is :func:`ratio` or
    :func:`delta` (both functions of the two medians: the draws are computed at once)."""
    gen = torch.Generator().manual_seed(seed)
    ia = torch.randint(0, a.numel(), (DRAWS, a.numel()), generator=gen)
    ib = torch.randint(0, b.numel(), (DRAWS, b.numel()), generator=gen)
    of_medians: Callable[[Tensor, Tensor], Tensor]
    if stat is ratio:
        of_medians = _ratio
    elif stat is delta:
        of_medians = _delta
    else:
        raise InputError("stat", "ratio or delta", repr(stat), "pass rolloutopt.arena._stats.ratio or delta")
    values = of_medians(_medians(a[ia]), _medians(b[ib]))
    defined = ~values.isnan()  # a resample whose method and baseline both never reach the target has no ratio
    if float(defined.double().mean()) < DEFINED:
        return math.nan, math.nan
    values = values[defined]
    lo, hi = torch.quantile(values.clamp(max=1e300), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return (math.inf if lo >= 1e300 else lo), (math.inf if hi >= 1e300 else hi)


def ratio(a: Float[Tensor, " n"], b: Float[Tensor, " m"]) -> float:
    """``median(a) / median(b)``: NaN when both are infinite (or both 0), ``inf`` over 0, 0 over ``inf``."""
    num, den = median(a), median(b)
    if math.isinf(den) or den == 0:  # the baseline never reached the target, or the target is its start
        return math.nan if math.isinf(num) or num == den else math.inf if den == 0 else 0.0
    return num / den


def delta(a: Float[Tensor, " n"], b: Float[Tensor, " m"]) -> float:
    """``median(a) - median(b)``."""
    return median(a) - median(b)


def ranks(x: Sequence[float]) -> list[float]:
    """1-based ranks of ``x`` in increasing order, tied values sharing the average of their ranks (``inf`` ranks
    last; NaN is not allowed)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1  # positions i..j hold ranks i+1..j+1: their mean
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of paired values: the Pearson correlation of their average ranks
    (:func:`ranks`). NaN with fewer than 2 pairs or when either side is constant."""
    if len(x) != len(y):
        raise InputError("x, y", "paired values of equal length", f"{len(x)} and {len(y)} values", "pair them")
    if len(x) < 2:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return math.nan if vx == 0 or vy == 0 else cov / math.sqrt(vx * vy)
