"""JET (Just-Enough Thinking): oracles computed by hand following ``JinyiHan99/Just-Enough-Think``
(``EasyR1/examples/reward_function/math.py``, ``EasyR1/verl/workers/rollout/vllm_rollout_spmd.py``) and
hypothesis properties."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rolloutopt.control import (
    jet_group_layout,
    jet_reward,
    jet_truncation_points,
)

from .length_rules_helpers import PROPS, assert_permutes, batches, ids, permuted, prefix, t


def test_jet_reward_oracle() -> None:
    # JET's reward code: three correct responses of lengths 100, 200, 300 -> bonuses 0.05 + 0.95 * 1.2 * (1, 0.5, 0)
    out = jet_reward(t([1, 1, 1, 0]), torch.tensor([True, True, True, False]), ids([100, 200, 300, 50]), ids([0] * 4))
    base = [0.9 + 0.1, 0.9 + 0.1, 0.9 + 0.1, 0.0]
    bonus = [1.19, 0.62, 0.05, 0.0]
    torch.testing.assert_close(out.rewards, t([b + x for b, x in zip(base, bonus, strict=True)]))
    assert not out.truncated.any() and out.lengths.tolist() == [100, 200, 300, 50]
    assert out.mask.sum(-1).tolist() == [100, 200, 300, 50]
    assert float(out.metrics["bonus_mean"]) == pytest.approx((1.19 + 0.62 + 0.05) / 3)


def test_jet_reward_group_vs_batch_baseline() -> None:
    acc, fmt = t([1, 1, 1, 0]), t([0, 0, 0, 1])
    lengths, group = ids([100, 300, 200, 10]), ids([0, 0, 1, 1])
    grp = jet_reward(acc, fmt, lengths, group).rewards
    # group 0: L in [100, 300]; group 1: one correct -> delta only; the incorrect row earns 0.1 * format
    torch.testing.assert_close(grp, t([0.9 + 1.19, 0.9 + 0.05, 0.9 + 0.05, 0.1]))
    bat = jet_reward(acc, fmt, lengths, None, baseline="batch").rewards
    # batch: L in [100, 300]: the 200-token response gets 0.05 + 0.95 * 1.2 * 0.5 = 0.62 (the authors' code)
    torch.testing.assert_close(bat, t([0.9 + 1.19, 0.9 + 0.05, 0.9 + 0.62, 0.1]))


@PROPS
@given(batches(), st.randoms(use_true_random=False))
def test_jet_reward_bounds_and_permutation(data: tuple[list[float], list[int], list[int]], rnd: Any) -> None:
    acc, lengths, group = data
    fmt = [1.0] * len(acc)
    out = jet_reward(t(acc), t(fmt), ids(lengths), ids(group))
    bonus = out.rewards - (0.9 * t(acc) + 0.1)
    ok = t(acc) == 1
    assert (bonus[~ok].abs() < 1e-6).all()
    assert (bonus[ok] >= 0.05 - 1e-6).all() and (bonus[ok] <= 0.05 + 0.95 * 1.2 + 1e-6).all()
    perm = list(range(len(acc)))
    rnd.shuffle(perm)
    a2, l2, g2, f2 = permuted(perm, acc, lengths, group, fmt)
    other = jet_reward(t(a2), t(f2), ids(l2), ids([-x for x in g2]), mask=prefix(l2, out.mask.shape[1]))
    assert_permutes(out, other, perm)


def test_jet_layout_and_points() -> None:
    lay = jet_group_layout(12)  # JET's rollout code: 2 full responses and 10 truncated variants
    assert (lay.n_full, lay.n_truncated) == (2, 10)
    assert lay.source.tolist() == [0, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert lay.ratio_index.tolist() == [-1, -1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert lay.is_truncated.sum() == 10
    assert jet_group_layout(8, num_ratios=3).n_full == 2
    # int(len * r) with max(1, .): 10 chars -> 1, 3, 5, 7, 9; 7 chars -> max(1, 0) = 1, 2, 3, 4, 6; empty -> 0
    pts = jet_truncation_points(ids([10, 7, 0, 1]))
    assert pts.tolist() == [[1, 3, 5, 7, 9], [1, 2, 3, 4, 6], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert jet_truncation_points(ids([10]), (0.25,)).tolist() == [[2]]
