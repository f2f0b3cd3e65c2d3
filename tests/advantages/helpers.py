"""Small helpers shared by the advantage estimator tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

D = torch.float64
SINGLETON_WARNING = "ignore:rolloutopt. a group of size 1"


def t(x: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def ids(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def close(a: torch.Tensor, b: object, atol: float = 1e-5) -> None:
    b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)
    torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=1e-5)


@st.composite
def group_ids(
    draw: st.DrawFn,
    *,
    equal: bool = False,
    max_groups: int = 5,
    min_size: int = 1,
    max_size: int = 5,
    min_equal: int = 2,
) -> list[int]:
    """Group ids in consecutive blocks with distinct random labels: ragged sizes, or one size for every group."""
    n_groups = draw(st.integers(1, max_groups))
    if equal:
        sizes = [draw(st.integers(min_equal, max_size))] * n_groups
    else:
        sizes = draw(st.lists(st.integers(min_size, max_size), min_size=n_groups, max_size=n_groups))
    labels = draw(st.lists(st.integers(-(2**40), 2**40), min_size=n_groups, max_size=n_groups, unique=True))
    return [lab for lab, k in zip(labels, sizes, strict=True) for _ in range(k)]


def relabel_map(data: st.DataObject, labels: list[int]) -> dict[int, int]:
    """An injective relabelling of ``labels`` to random int64 ids, drawn from ``data``."""
    new = data.draw(st.lists(st.integers(-(2**62), 2**62), min_size=len(labels), max_size=len(labels), unique=True))
    return dict(zip(labels, new, strict=True))
