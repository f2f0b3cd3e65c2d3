"""What every post-hoc length rule shares (``rolloutopt._length_rules``): empty batches, the ``experimental``
flag, and one test per class of bad input, across DOT, JET, DLER, soft compression, SIRI and EGAE."""

from __future__ import annotations

import pytest
import torch

from rolloutopt.control import (
    dler_difficulty_budget,
    dler_difficulty_penalty,
    dler_truncation_penalty,
    dot,
    egae,
    jet_group_layout,
    jet_reward,
    jet_truncation_points,
    siri_max_length,
    soft_compression_penalty,
)
from rolloutopt.errors import InputError

from .length_rules_helpers import X, ids, prefix, t


def test_empty_batches() -> None:
    e, el = torch.zeros(0), torch.zeros(0, dtype=torch.long)
    outs = [
        dler_truncation_penalty(e, el, max_len=3, **X),
        dler_difficulty_penalty(e, el, el, max_len=3, **X),
        soft_compression_penalty(e, el, el, **X),
        jet_reward(e, e, el, el),
        jet_reward(e, e, el, None, baseline="batch"),
    ]
    for out in outs:
        assert out.rewards.numel() == 0 and out.mask.shape == (0, 0) and out.truncated.numel() == 0
        assert all(float(v) == 0.0 for v in out.metrics.values())
    assert dler_difficulty_budget(e, el, max_len=3, **X).numel() == 0
    assert jet_truncation_points(el).shape == (0, 5)
    res = egae(torch.zeros(0, 1), e, torch.zeros(0, 0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool), **X)
    assert res.advantages.shape == (0, 0) and res.value_mask.shape == (0, 0)


# ------------------------------------------------------------------------------------------------ bad input


def test_experimental_is_required() -> None:
    r, length, g = t([1, 1, 1, 1]), ids([1, 2, 3, 4]), ids([0, 0, 0, 0])
    calls = [
        lambda: dot(r, length, g),
        lambda: dler_truncation_penalty(r, length, max_len=2),
        lambda: dler_difficulty_budget(r, g, max_len=2),
        lambda: dler_difficulty_penalty(r, length, g, max_len=2),
        lambda: soft_compression_penalty(r, length, g),
        lambda: siri_max_length(0, l_lo=1, l_hi=2, period=2),
        lambda: egae(torch.zeros(1, 2), t([1.0]), prefix([1], 1), torch.tensor([True])),
    ]
    for call in calls:
        with pytest.raises(InputError, match="experimental"):
            call()


def test_bad_tensors() -> None:
    r, length, g = t([1, 1, 1, 1]), ids([1, 2, 3, 4]), ids([0, 0, 0, 0])
    with pytest.raises(InputError, match="rewards"):
        dot(t([1, 1, 1]), length, g, **X)
    with pytest.raises(InputError, match="rewards"):
        dot(t([1, float("nan"), 1, 1]), length, g, **X)
    with pytest.raises(InputError, match="lengths"):
        dot(r, ids([1, -2, 3, 4]), g, **X)
    with pytest.raises(InputError, match="lengths"):
        dot(r, torch.ones(4, dtype=torch.bool), g, **X)
    with pytest.raises(InputError, match="mask"):
        dot(r, length, g, mask=torch.ones(3, 5, dtype=torch.bool), **X)
    with pytest.raises(InputError, match="mask"):
        soft_compression_penalty(r, length, g, mask=torch.full((4, 5), 2.0), **X)
    with pytest.raises(InputError, match="group"):
        dot(r, length, ids([0, 0, 0]), **X)
    with pytest.raises(InputError, match="group"):
        jet_reward(r, r, length, None)
    with pytest.raises(InputError, match="has_format"):
        jet_reward(r, t([0.5, 1, 1, 1]), length, g)
    with pytest.raises(InputError, match="max_len"):
        dler_truncation_penalty(r, length, max_len=ids([1, 0, 1, 1]), **X)


def test_bad_hyper_parameters() -> None:
    r, length, g = t([1, 1, 1, 1]), ids([1, 2, 3, 4]), ids([0, 0, 0, 0])
    with pytest.raises(InputError, match=r"^rule"):
        dot(r, length, g, rule="mad", **X)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^mode"):
        dot(r, length, g, mode="drop", **X)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^k"):
        dot(r, length, g, k=-1.0, **X)
    with pytest.raises(InputError, match="min_group_size"):
        dot(r, length, g, min_group_size=0, **X)
    with pytest.raises(InputError, match=r"^delta"):
        jet_reward(r, r, length, g, delta=2.0)
    with pytest.raises(InputError, match=r"^baseline"):
        jet_reward(r, r, length, g, baseline="prompt")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="ratios"):
        jet_truncation_points(length, (0.5, 1.5))
    with pytest.raises(InputError, match="ratios"):
        jet_truncation_points(length, ())
    with pytest.raises(InputError, match=r"^n:"):
        jet_group_layout(13)
    with pytest.raises(InputError, match=r"^n:"):
        jet_group_layout(0)
    with pytest.raises(InputError, match="max_len"):
        dler_truncation_penalty(r, length, max_len=0, **X)
    with pytest.raises(InputError, match="tighten"):
        dler_difficulty_budget(r, g, max_len=5, tighten=1.5, **X)
    with pytest.raises(InputError, match="easy_from"):
        dler_difficulty_penalty(r, length, g, max_len=5, easy_from=-0.1, **X)
    with pytest.raises(InputError, match="mastery"):
        soft_compression_penalty(r, length, g, mastery=0.0, **X)
    with pytest.raises(InputError, match=r"^cap"):
        soft_compression_penalty(r, length, g, cap=-1.0, **X)
    with pytest.raises(InputError, match="penalise"):
        soft_compression_penalty(r, length, g, penalise="long", **X)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="l_hi"):
        siri_max_length(0, l_lo=10, l_hi=5, period=4, **X)
    with pytest.raises(InputError, match="step"):
        siri_max_length(-1, l_lo=1, l_hi=5, period=4, **X)
    with pytest.raises(InputError, match="period"):
        siri_max_length(0, l_lo=1, l_hi=5, period=0, **X)
