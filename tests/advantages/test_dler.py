"""DLER's post-hoc length rules (``rolloutopt.advantages.dler``, re-exported by ``rolloutopt.control``): the
truncation penalty and Difficulty-Aware DLER's budget (our reconstruction from the abstract, see
docs/methods/length_rules.md). DLER's shaper and estimator are tested in test_drpo_fapo_dler.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    dler_difficulty_budget,
    dler_difficulty_penalty,
    dler_truncation_penalty,
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


def test_dler_truncation_penalty() -> None:
    mask = prefix([10, 20, 30, 25], width=32)
    out = dler_truncation_penalty(t([1, 1, 0, 1]), ids([10, 20, 30, 25]), max_len=20, mask=mask, **X)
    assert out.truncated.tolist() == [False, False, True, True]  # exactly max_len fits
    assert out.rewards.tolist() == [1, 1, 0, 0]
    assert out.lengths.tolist() == [10, 20, 20, 20]
    assert out.mask.sum(-1).tolist() == [10, 20, 20, 20] and out.mask.shape == (4, 32)
    assert float(out.metrics["truncated_correct_frac"]) == pytest.approx(1 / 3)
    kept = dler_truncation_penalty(t([1, 1, 0, 1]), ids([10, 20, 30, 25]), max_len=20, cut_mask=False, **X)
    assert kept.mask.sum(-1).tolist() == [10, 20, 30, 25] and kept.rewards.tolist() == [1, 1, 0, 0]
    per_row = dler_truncation_penalty(t([1, 1]), ids([10, 10]), max_len=ids([9, 10]), **X)
    assert per_row.rewards.tolist() == [0, 1] and per_row.lengths.tolist() == [9, 10]


def test_dler_difficulty_budget_by_hand() -> None:
    # pass rates: g0 1 -> s = 1 -> 1000 * 0.5 = 500; g1 0.75 -> s = 0.5 -> 750; g2 0.5 -> 1000; g3 0 -> 1000
    rewards = t([1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    group = ids([0] * 4 + [1] * 4 + [2] * 4 + [3] * 4)
    budget = dler_difficulty_budget(rewards, group, max_len=1000, **X)
    assert budget.tolist() == [500] * 4 + [750] * 4 + [1000] * 8
    strict = dler_difficulty_budget(rewards, group, max_len=1000, easy_from=1.0, tighten=0.25, **X)
    assert strict.tolist() == [750] * 4 + [1000] * 12
    out = dler_difficulty_penalty(rewards, ids([600, 400, 500, 10] * 4), group, max_len=1000, **X)
    assert out.truncated.tolist() == [True, False, False, False] + [False] * 12
    assert out.rewards[0] == 0 and out.lengths[0] == 500
    assert float(out.metrics["tightened_group_frac"]) == pytest.approx(0.5)


@PROPS
@given(batches(), st.integers(1, 80), st.floats(0, 1), st.floats(0, 1))
def test_dler_difficulty_budget_bounded_and_monotone(
    data: tuple[list[float], list[int], list[int]], max_len: int, tighten: float, easy_from: float
) -> None:
    rewards, lengths, group = data
    budget = dler_difficulty_budget(t(rewards), ids(group), max_len=max_len, tighten=tighten, easy_from=easy_from, **X)
    assert ((budget >= 1) & (budget <= max_len)).all()
    rate = {g: np.mean([r for r, h in zip(rewards, group, strict=True) if h == g]) for g in set(group)}
    for i in range(len(group)):
        for j in range(len(group)):
            if rate[group[i]] >= rate[group[j]]:
                assert budget[i] <= budget[j]
    out = dler_difficulty_penalty(t(rewards), ids(lengths), ids(group), max_len=max_len, **X)
    assert not (out.mask & ~prefix(lengths)).any()
    assert torch.equal(
        out.truncated, ids(lengths) > dler_difficulty_budget(t(rewards), ids(group), max_len=max_len, **X)
    )
