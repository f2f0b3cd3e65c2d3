"""Shared helpers of the post-hoc length-rule tests (DOT, JET, soft compression, SIRI, EGAE)."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st

from rolloutopt.control import (
    TruncationOutput,
)

X = {"experimental": True}
PROPS = settings(max_examples=20, deadline=None)


def t(x: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def ids(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def prefix(lengths: list[int], width: int | None = None) -> torch.Tensor:
    w = max(lengths, default=0) if width is None else width
    return torch.arange(w)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]


# ----------------------------------------------------------------------------------------------- strategies


@st.composite
def batches(draw: Any, min_rows: int = 1, max_rows: int = 14) -> tuple[list[float], list[int], list[int]]:
    """(rewards 0/1, lengths, group ids) with ragged groups and mostly-correct rewards."""
    n = draw(st.integers(min_rows, max_rows))
    group = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    rewards = draw(st.lists(st.sampled_from([1.0, 1.0, 1.0, 0.0]), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    return rewards, lengths, group


def permuted(perm: list[int], *xs: list[Any]) -> list[list[Any]]:
    return [[x[i] for i in perm] for x in xs]


def assert_permutes(a: TruncationOutput, b: TruncationOutput, perm: list[int]) -> None:
    p = torch.tensor(perm, dtype=torch.long)
    assert torch.equal(a.truncated[p], b.truncated)
    assert torch.equal(a.lengths[p], b.lengths)
    assert torch.equal(a.mask[p], b.mask)
    torch.testing.assert_close(a.rewards[p], b.rewards)


def assert_same(a: TruncationOutput, b: TruncationOutput) -> None:
    assert_permutes(a, b, list(range(a.rewards.numel())))
