"""The sample-level soft compression penalty (from its abstract): a hand oracle and hypothesis properties."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rolloutopt.control import (
    soft_compression_penalty,
)

from .length_rules_helpers import PROPS, X, assert_permutes, batches, ids, permuted, prefix, t


def test_soft_compression_by_hand() -> None:
    rewards = t([1, 1, 1, 1, 1, 0, 1, 0])
    lengths = ids([100, 150, 300, 100, 100, 200, 300, 50])
    group = ids([0, 0, 0, 0, 1, 1, 1, 1])
    out = soft_compression_penalty(rewards, lengths, group, **X)
    # group 0: pass rate 1, shortest correct 100: 150 -> 0.5 * 0.5 = 0.25, 300 -> min(0.5 * 2, 0.5) = 0.5
    # group 1: pass rate 0.5 < 0.75: untouched
    torch.testing.assert_close(out.rewards, t([1, 0.75, 0.5, 1, 1, 0, 1, 0]))
    assert out.truncated.tolist() == [False, True, True, False] + [False] * 4
    assert torch.equal(out.mask, prefix(lengths.tolist()))
    assert float(out.metrics["penalty_mean"]) == pytest.approx(0.375)
    # penalise="all": a long incorrect rollout of a mastered group is penalised too (pass rate 3/4 >= 0.75)
    out = soft_compression_penalty(t([1, 1, 1, 0]), ids([100, 200, 100, 400]), ids([0] * 4), penalise="all", **X)
    torch.testing.assert_close(out.rewards, t([1, 0.5, 1, -0.5]))
    out = soft_compression_penalty(t([1, 1, 1, 0]), ids([100, 200, 100, 400]), ids([0] * 4), relative=False, **X)
    torch.testing.assert_close(out.rewards, t([1, 0.5, 1, 0]))  # 0.5 * 100 tokens, capped at 0.5


@PROPS
@given(batches(), st.randoms(use_true_random=False))
def test_soft_compression_properties(data: tuple[list[float], list[int], list[int]], rnd: Any) -> None:
    rewards, lengths, group = data
    out = soft_compression_penalty(t(rewards), ids(lengths), ids(group), **X)
    pen = t(rewards) - out.rewards
    assert ((pen >= 0) & (pen <= 0.5 + 1e-6)).all()
    for gid in set(group):
        rows = [i for i, g in enumerate(group) if g == gid]
        ok = [i for i in rows if rewards[i] == 1]
        if len(ok) / len(rows) < 0.75:
            assert all(pen[i] == 0 for i in rows)  # not mastered: untouched
        if ok:
            shortest = min(lengths[i] for i in ok)
            assert all(pen[i] == 0 for i in ok if lengths[i] == shortest)
        assert all(pen[i] == 0 for i in rows if rewards[i] == 0)
    perm = list(range(len(group)))
    rnd.shuffle(perm)
    r2, l2, g2 = permuted(perm, rewards, lengths, group)
    other = soft_compression_penalty(
        t(r2), ids(l2), ids([x + 100 for x in g2]), mask=prefix(l2, out.mask.shape[1]), **X
    )
    assert_permutes(out, other, perm)
