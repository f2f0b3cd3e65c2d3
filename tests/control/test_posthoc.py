"""Post-hoc truncation and length rules (DOT, T-PPO's EGAE, JET, SIRI; DLER and soft compression from their
abstracts): hand oracles, hypothesis properties against per-group float64/numpy loops written from the formulas,
and one test per class of bad input.

JET's oracles are computed by hand following ``JinyiHan99/Just-Enough-Think``
(``EasyR1/examples/reward_function/math.py``, ``EasyR1/verl/workers/rollout/vllm_rollout_spmd.py``); the other
rules' oracles are our reconstruction (see docs/methods/length_rules.md)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    TruncationOutput,
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
from rolloutopt.groups import Groups

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


# ----------------------------------------------------------------------------------------------------- DOT


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


# ----------------------------------------------------------------------------------------------------- JET


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


# ---------------------------------------------------------------------------------------------------- DLER


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


# -------------------------------------------------------------------------------------------- soft compression


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


# ---------------------------------------------------------------------------------------------------- SIRI


def test_siri_oracle() -> None:
    kw = {"l_lo": 1000, "l_hi": 5000, "period": 8, **X}
    assert siri_max_length(0, **kw) == 1000
    assert siri_max_length(4, **kw) == 5000
    assert siri_max_length(8, **kw) == 1000
    assert siri_max_length(2, **kw) == 3000  # (1 - cos(pi/2)) / 2 = 1/2
    assert siri_max_length(12, **kw) == 5000  # periodic


@PROPS
@given(st.integers(1, 4000), st.integers(0, 4000), st.integers(1, 40))
def test_siri_bounded_periodic_monotone(lo: int, extra: int, period: int) -> None:
    hi = lo + extra
    seq = [siri_max_length(s, l_lo=lo, l_hi=hi, period=period, **X) for s in range(2 * period + 1)]
    assert all(lo <= x <= hi for x in seq)
    assert seq[: period + 1] == seq[period:]
    half, back = period // 2, (period + 1) // 2
    assert all(a <= b for a, b in itertools.pairwise(seq[: half + 1]))  # expansion: rising to L_hi
    assert all(a >= b for a, b in itertools.pairwise(seq[back : period + 1]))  # compression: falling to L_lo


# ---------------------------------------------------------------------------------------------------- EGAE


def naive_egae(
    values: np.ndarray, rewards: list[float], lengths: list[int], finished: list[bool], gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row backward loop of EGAE (our reconstruction) in float64; outcome rewards on finished rows' last token."""
    b, t1 = values.shape
    adv = np.zeros((b, t1 - 1))
    ret = np.zeros((b, t1 - 1))
    for i in range(b):
        n = lengths[i]
        r = np.zeros(n)
        if n and finished[i]:
            r[n - 1] = rewards[i]
        gae, g_ret = 0.0, 0.0 if finished[i] else values[i, n]
        for k in range(n - 1, -1, -1):
            nxt = values[i, k + 1] if (k + 1 < n or not finished[i]) else 0.0
            delta = r[k] + gamma * nxt - values[i, k]
            gae = delta + gamma * lam * gae
            g_ret = r[k] + gamma * g_ret
            adv[i, k], ret[i, k] = gae, g_ret
    return adv, ret


def test_egae_oracle() -> None:
    # gamma = lambda = 1, zero intermediate rewards: unfinished -> V(s_l) - V(s_t); finished -> R - V(s_t)
    values = t([[0.1, 0.2, 0.3, 0.9, 7.0], [0.5, -0.5, 2.0, 0.0, 0.0]], torch.float64)
    mask = prefix([3, 2], width=4)
    out = egae(values, t([5.0, 2.0], torch.float64), mask, torch.tensor([False, True]), **X)
    torch.testing.assert_close(out.advantages[0, :3], 0.9 - values[0, :3])
    torch.testing.assert_close(out.advantages[1, :2], 2.0 - values[1, :2])
    assert (out.advantages[0, 3:] == 0).all() and (out.advantages[1, 2:] == 0).all()
    assert out.value_mask.tolist() == [[False] * 4, [True, True, False, False]]
    torch.testing.assert_close(out.returns[1, :2], t([2.0, 2.0], torch.float64))  # Monte-Carlo return
    # [B, T] values with bootstrap = V(s_l) give the same numbers
    same = egae(values[:, :4], t([5.0, 2.0], torch.float64), mask, torch.tensor([False, True]),
                bootstrap=t([0.9, 123.0], torch.float64), **X)  # fmt: skip
    torch.testing.assert_close(same.advantages, out.advantages)
    torch.testing.assert_close(same.returns, out.returns)
    lam_ret = egae(values, t([5.0, 2.0], torch.float64), mask, torch.tensor([False, True]), returns="lambda", **X)
    torch.testing.assert_close(lam_ret.returns[0, :3], t([0.9, 0.9, 0.9], torch.float64))


@PROPS
@given(
    st.integers(1, 5),
    st.integers(0, 9),
    st.floats(0, 1),
    st.floats(0, 1),
    st.integers(0, 2**31 - 1),
)
def test_egae_matches_backward_loop(b: int, t_len: int, gamma: float, lam: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t_len + 1, (b,), generator=gen).tolist()
    finished = (torch.rand(b, generator=gen) < 0.5).tolist()
    values = torch.randn(b, t_len + 1, generator=gen, dtype=torch.float64)
    rewards = torch.randn(b, generator=gen, dtype=torch.float64)
    out = egae(
        values, rewards, prefix(lengths, t_len), torch.tensor(finished, dtype=torch.bool), gamma=gamma, lam=lam, **X
    )
    adv, ret = naive_egae(values.numpy(), rewards.tolist(), lengths, finished, gamma, lam)
    np.testing.assert_allclose(out.advantages.numpy(), adv, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.returns.numpy(), ret, rtol=1e-9, atol=1e-9)


def test_egae_long_sequences_use_chunks() -> None:
    # gamma * lam = 0.01: chunks of 140 tokens; 400 tokens cross two chunk boundaries
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 401, generator=gen, dtype=torch.float64)
    lengths, finished = [400, 333, 141], [False, True, False]
    out = egae(values, t([1.0, 2.0, 3.0], torch.float64), prefix(lengths, 400), torch.tensor(finished),
               gamma=0.1, lam=0.1, **X)  # fmt: skip
    adv, ret = naive_egae(values.numpy(), [1.0, 2.0, 3.0], lengths, finished, 0.1, 0.1)
    np.testing.assert_allclose(out.advantages.numpy(), adv, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out.returns.numpy(), ret, rtol=1e-9, atol=1e-12)
    f32 = egae(values.float(), t([1.0, 2.0, 3.0]), prefix(lengths, 400), torch.tensor(finished), gamma=0.99, **X)
    assert f32.advantages.dtype == torch.float32 and torch.isfinite(f32.advantages).all()


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


def test_egae_bad_input() -> None:
    v, r, fin = torch.zeros(2, 4), t([1.0, 1.0]), torch.tensor([True, False])
    with pytest.raises(InputError, match=r"^mask"):
        egae(v, r, torch.tensor([[True, False, True], [True, True, True]]), fin, **X)
    with pytest.raises(InputError, match="values"):
        egae(torch.zeros(2, 6), r, prefix([2, 3], 3), fin, **X)
    with pytest.raises(InputError, match="bootstrap"):
        egae(v[:, :3], r, prefix([2, 3], 3), fin, **X)
    with pytest.raises(InputError, match="bootstrap"):
        egae(v, r, prefix([2, 3], 3), fin, bootstrap=t([0.0, 0.0]), **X)
    with pytest.raises(InputError, match="values"):
        egae(t([[0.0, float("inf"), 0, 0], [0, 0, 0, 0]]), r, prefix([2, 3], 3), fin, **X)
    with pytest.raises(InputError, match="gamma"):
        egae(v, r, prefix([2, 3], 3), fin, gamma=1.5, **X)
    with pytest.raises(InputError, match=r"^returns"):
        egae(v, r, prefix([2, 3], 3), fin, returns="td", **X)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="finished"):
        egae(v, r, prefix([2, 3], 3), torch.tensor([True]), **X)
