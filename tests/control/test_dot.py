"""DOT (dynamic outlier truncation): hand oracles and a hypothesis property against a per-group numpy loop
written from the formulas (our reconstruction, see docs/methods/length_rules.md)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rolloutopt.control import (
    dot,
)
from rolloutopt.groups import Groups

from .length_rules_helpers import PROPS, X, assert_permutes, batches, ids, permuted, prefix, t


def test_dot_oracle_iqr() -> None:
    # our DOT reconstruction: numpy linear quantiles Q1 = 107.5, Q3 = 340, fence 340 + 1.5 * 232.5 = 688.75; only
    # 1000 is cut, at floor(688.75) = 688 tokens. The second group has an incorrect response: untouched.
    rewards = t([1, 1, 1, 1, 1, 0, 1, 1])
    lengths = ids([100, 110, 120, 1000, 100, 110, 120, 1000])
    group = ids([0, 0, 0, 0, 1, 1, 1, 1])
    out = dot(rewards, lengths, group, **X)
    assert out.truncated.tolist() == [False, False, False, True, False, False, False, False]
    assert out.lengths.tolist() == [100, 110, 120, 688, 100, 110, 120, 1000]
    assert out.rewards.tolist() == [1, 1, 1, 0, 1, 0, 1, 1]  # rescore: the cut answer earns 0
    assert out.mask.sum(-1).tolist() == [100, 110, 120, 688, 100, 110, 120, 1000]
    assert out.mask.shape == (8, 1000)
    assert float(out.metrics["truncated_frac"]) == pytest.approx(1 / 8)
    assert float(out.metrics["eligible_group_frac"]) == pytest.approx(0.5)
    assert float(out.metrics["tokens_removed"]) == pytest.approx(312.0)
    assert np.quantile([100, 110, 120, 1000], [0.25, 0.75]).tolist() == [107.5, 340.0]  # the numbers used above


def test_dot_mode_mask_keeps_reward_and_cuts_loss() -> None:
    mask = prefix([100, 110, 120, 1000], width=1200)
    out = dot(t([1, 1, 1, 1]), ids([100, 110, 120, 1000]), ids([5, 5, 5, 5]), mask=mask, mode="mask", **X)
    assert out.rewards.tolist() == [1, 1, 1, 1]
    assert out.mask.shape == (4, 1200)
    assert out.mask[3].nonzero().max().item() == 687 and int(out.mask[3].sum()) == 688
    assert torch.equal(out.mask[:3], mask[:3])
    assert float(out.metrics["reward_changed_frac"]) == 0.0


def test_dot_z_rule() -> None:
    # mean 250, population std sqrt((5 * 150^2 + 750^2) / 6) = sqrt(112500) = 335.41; fence 920.82 -> cut at 920
    out = dot(t([1] * 6), ids([100] * 5 + [1000]), ids([0] * 6), rule="z", truncated_reward=-1.0, **X)
    assert out.truncated.tolist() == [False] * 5 + [True]
    assert out.lengths.tolist() == [100] * 5 + [920]
    assert out.rewards.tolist() == [1] * 5 + [-1]
    # Bessel: std sqrt(675000 / 5) = 367.42, fence 984.85 -> cut at 984
    out = dot(t([1] * 6), ids([100] * 5 + [1000]), ids([0] * 6), rule="z", unbiased=True, **X)
    assert out.lengths.tolist() == [100] * 5 + [984]


def test_dot_skips_small_groups_and_threshold() -> None:
    # size 3 [100, 100, 1000]: Q1 = 100, Q3 = 550; with k = 0 the fence is 550 -> cut at 550, unless skipped
    out = dot(t([1, 1, 1]), ids([100, 100, 1000]), ids([0, 0, 0]), k=0.0, **X)
    assert not out.truncated.any()  # groups of size < 4 are skipped
    out = dot(t([1, 1, 1]), ids([100, 100, 1000]), ids([0, 0, 0]), k=0.0, min_group_size=3, **X)
    assert out.truncated.tolist() == [False, False, True] and out.lengths.tolist() == [100, 100, 550]
    # rewards of 0.9 count as correct only with correct=0.9
    r = t([0.9, 1, 1, 1])
    assert not dot(r, ids([100, 110, 120, 1000]), ids([0] * 4), **X).truncated.any()
    assert dot(r, ids([100, 110, 120, 1000]), ids([0] * 4), correct=0.9, **X).truncated.tolist()[3]


def naive_dot(
    rewards: list[float], lengths: list[int], group: list[int], rule: str, k: float, z: float
) -> tuple[list[int], list[bool]]:
    """Per-group loop with numpy of our DOT rule: the new length of every row, and which rows were cut."""
    out = list(lengths)
    cut = [False] * len(lengths)
    for gid in set(group):
        rows = [i for i, x in enumerate(group) if x == gid]
        if len(rows) < 4 or any(rewards[i] < 1 for i in rows):
            continue
        ls = np.array([lengths[i] for i in rows], dtype=np.float64)
        if rule == "iqr":
            q1, q3 = np.quantile(ls, [0.25, 0.75])
            fence = q3 + k * (q3 - q1)
        else:
            fence = ls.mean() + z * ls.std()
        for i in rows:
            if lengths[i] > fence:
                out[i] = math.floor(fence)
                cut[i] = True
    return out, cut


@PROPS
@given(batches(), st.sampled_from(["iqr", "z"]), st.randoms(use_true_random=False))
def test_dot_matches_per_group_numpy_and_is_permutation_invariant(
    data: tuple[list[float], list[int], list[int]], rule: str, rnd: Any
) -> None:
    rewards, lengths, group = data
    out = dot(t(rewards), ids(lengths), ids(group), rule=rule, **X)
    expect, cut = naive_dot(rewards, lengths, group, rule, 1.5, 2.0)
    assert out.lengths.tolist() == expect
    assert out.truncated.tolist() == cut
    assert out.rewards.tolist() == [0.0 if c else r for r, c in zip(rewards, cut, strict=True)]
    old = prefix(lengths)
    assert not (out.mask & ~old).any()  # never un-stops a token
    assert (out.lengths <= ids(lengths)).all()
    # rows of groups with an incorrect response are untouched
    bad = {g for g, r in zip(group, rewards, strict=True) if r < 1}
    for i, g in enumerate(group):
        if g in bad:
            assert not out.truncated[i] and out.rewards[i] == rewards[i]
    # bounded: a truncated row keeps at least as much as every untruncated row of its group
    for i, g in enumerate(group):
        if out.truncated[i]:
            assert all(
                out.lengths[i] >= lengths[j] for j in range(len(group)) if group[j] == g and not out.truncated[j]
            )
    # permutation of rows (with their ids) and relabelling of ids
    perm = list(range(len(group)))
    rnd.shuffle(perm)
    r2, l2, g2 = permuted(perm, rewards, lengths, group)
    other = dot(t(r2), ids(l2), Groups(ids([7 * x - 11 for x in g2])), rule=rule, mask=prefix(l2, old.shape[1]), **X)
    assert_permutes(out, other, perm)


def test_dot_edge_cases() -> None:
    empty = dot(t([]), ids([]), ids([]), **X)
    assert empty.rewards.numel() == 0 and empty.mask.shape == (0, 0)
    none = dot(t([1, 1, 1, 1]), ids([0, 0, 0, 0]), ids([1, 1, 1, 1]), mask=torch.zeros(4, 3, dtype=torch.bool), **X)
    assert not none.truncated.any() and not none.mask.any() and none.rewards.tolist() == [1, 1, 1, 1]
    same = dot(t([1] * 4), ids([50] * 4), ids([0] * 4), **X)
    assert not same.truncated.any()
