"""Confidence- and marker-gated truncation: Step-GRPO, DEER self-truncation, DUET abort, ECHO pruning.

Hand oracles, the step-aware reward's invariant (a correct response with the group's minimum step count gets the maximum
reward), the stop-rule properties (never un-stops, all-inactive no-op, row permutation, determinism, state
round trip) and bad input.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    DEER,
    DUETAbort,
    ECHOPruning,
    StepGRPOTruncation,
    StopRule,
    StopState,
    count_steps,
    replay,
    step_aware_reward,
)
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

MARK = 1  # the marker token id of the random tests (vocabulary 0..4)


# ----------------------------------------------------------------------------------------- hand oracles
def test_step_confidence_truncation_by_hand() -> None:
    rule = StepGRPOTruncation(markers=[7], threshold=0.9, min_steps=2, experimental=True)
    tokens = torch.tensor(
        [[1, 7, 2, 7, 3, 7], [7, 7, 1, 1, 7, 1], [7, 1, 7, 1, 1, 1], [7, 7, 7, 7, 7, 7]],
    )
    conf = torch.zeros(4, 6)
    conf[0, 3] = 0.95  # 2nd boundary of row 0: probed, confident -> stop at token 3
    conf[1, 1], conf[1, 4] = 0.5, 0.9  # row 1: probed at its 2nd boundary (continue), at its 3rd (0.9 >= 0.9: stop)
    conf[2, 2] = 0.89  # row 2: probed once, below the threshold
    conf[0, 1] = conf[2, 0] = 1.0  # first boundaries: before min_steps, never read
    active = torch.ones(4, 6, dtype=torch.bool)
    active[3] = False
    res = replay(rule, tokens=tokens, confidence=conf, mask=active)
    assert res.stopped.tolist() == [True, True, False, False]
    assert res.position.tolist() == [3, 4, -1, -1]
    assert res.length.tolist() == [4, 5, 6, 0]
    assert res.reasons() == ["confident", "confident", "running", "running"]
    # markers counted while live: 2 + 3 + 2 + 0; probes 1 + 2 + 1 + 0
    assert float(res.metrics["markers_mean"]) == pytest.approx(7 / 4)
    assert float(res.metrics["probes_mean"]) == pytest.approx(1.0)


def test_probe_rows_and_confidence_read_only_at_probes() -> None:
    rule = StepGRPOTruncation(markers=(7, 8), threshold=0.5, min_steps=1, experimental=True)
    state = rule.init(3)
    tok = torch.tensor([7, 2, 8])
    probe = rule.probe_rows(state, tokens=tok, active=torch.tensor([True, True, False]))
    assert probe.tolist() == [True, False, False]
    # values outside [0, 1] at rows that are not probed are ignored
    act = torch.tensor([True, True, False])
    state, stop = rule.step(state, tokens=tok, confidence=torch.tensor([0.7, 5.0, -3.0]), active=act)
    assert stop.tolist() == [True, False, False]
    # no probe point this step: confidence may be omitted
    state, stop = rule.step(state, tokens=torch.tensor([2, 2, 2]))
    assert stop.tolist() == [True, False, False]
    with pytest.raises(InputError, match="confidence"):
        rule.step(state, tokens=torch.tensor([2, 8, 2]))
    with pytest.raises(InputError, match="confidence"):
        rule.step(state, tokens=torch.tensor([2, 8, 2]), confidence=torch.tensor([0.0, 1.5, 0.0]))


def test_self_truncation_by_hand() -> None:
    rule = DEER(markers=[9], threshold=0.8, min_tokens=3, experimental=True)
    tokens = torch.tensor([[9, 1, 9, 1], [1, 9, 1, 9], [9, 9, 9, 9]])
    conf = torch.tensor([[0.99, 0.0, 0.85, 0.0], [0.0, 0.99, 0.0, 0.5], [0.99, 0.2, 0.8, 0.99]])
    res = replay(rule, tokens=tokens, confidence=conf)
    # row 0: the marker at t=0 is inside the warm-up (1 token < 3); probed at t=2 (3 tokens), 0.85 >= 0.8
    # row 1: t=1 inside the warm-up; t=3 probed, 0.5 < 0.8;  row 2: t=2 probed, 0.8 >= 0.8 (inclusive)
    assert res.position.tolist() == [2, -1, 2]
    assert res.reasons() == ["early_exit", "running", "early_exit"]
    assert res.reason_names == ("running", "early_exit")


def test_count_steps_by_hand() -> None:
    tokens = torch.tensor([[7, 1, 7, 2], [1, 1, 1, 1], [7, 7, 0, 0], [7, 7, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert count_steps(tokens, mask, markers=[7]).tolist() == [3, 1, 3, 0]
    assert count_steps(tokens, mask, markers=torch.tensor([7, 2])).tolist() == [4, 1, 3, 0]


def test_step_aware_reward_by_hand() -> None:
    # group 0: correct with 3, 5, 7 steps and an incorrect one; group 1: no correct; group 2: singleton;
    # group 3: the incorrect response is the longest (span matters)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    steps = torch.tensor([3, 5, 7, 2, 1, 9, 4, 2, 4, 10])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3, 3, 3])
    out = step_aware_reward(rewards, steps, group, lam=0.5, eps=1e-6, experimental=True)
    eps = 1e-6
    expect = [
        1.0,
        1 - 0.5 * 2 / (4 + eps),
        1 - 0.5 * 4 / (4 + eps),
        0.0,
        0.0,
        0.0,
        1.0,
        1.0,
        1 - 0.5 * 2 / (2 + eps),
        0,
    ]
    assert out.rewards.tolist() == pytest.approx(expect, abs=1e-6)
    assert out.correct.tolist() == [True, True, True, False, False, False, True, True, True, False]
    assert out.penalty[3:6].tolist() == [0.0, 0.0, 0.0] and float(out.penalty[9]) == 0.0
    assert float(out.metrics["correct_frac"]) == pytest.approx(0.6)
    assert float(out.metrics["penalized_frac"]) == pytest.approx(0.3)
    # span="all": group 3's max runs over the incorrect 10-step response
    out_all = step_aware_reward(rewards, steps, group, lam=0.5, span="all", experimental=True)
    assert float(out_all.rewards[8]) == pytest.approx(1 - 0.5 * 2 / 8, abs=1e-6)
    # group 0's max over all responses is still 7, so its rewards do not change
    assert out_all.rewards[:4].tolist() == pytest.approx(out.rewards[:4].tolist())
    # +-1 rewards: the incorrect -1 keeps -1; a Groups object works like ids
    pm = step_aware_reward(rewards * 2 - 1, steps, Groups(group), lam=0.5, experimental=True)
    assert pm.rewards[3].item() == -1.0 and pm.rewards[0].item() == 1.0
    # lam = 0 is the identity
    assert torch.equal(step_aware_reward(rewards, steps, group, lam=0.0, experimental=True).rewards, rewards)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 12), st.integers(0, 10_000))
def test_prop_step_reward_oracle(b: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(b, generator=g) < 0.6).float()
    steps = torch.randint(1, 20, (b,), generator=g)
    group = torch.randint(0, 3, (b,), generator=g)
    out = step_aware_reward(rewards, steps, group, lam=0.7, experimental=True)
    for gid in group.unique():
        rows = group == gid
        correct = rows & (rewards == 1)
        if not bool(correct.any()):
            assert torch.equal(out.rewards[rows], rewards[rows])
            continue
        shortest = correct & (steps == steps[correct].min())
        # the shortest correct responses get the maximum reward of their group
        assert bool((out.rewards[shortest] == out.rewards[rows].max()).all())
        assert bool((out.rewards[rows & ~correct] == rewards[rows & ~correct]).all())  # no length term
        assert bool((out.rewards[correct] >= 1 - 0.7 - 1e-6).all())
    perm = torch.randperm(b, generator=g)
    out_p = step_aware_reward(rewards[perm], steps[perm], group[perm] * 7 + 100, lam=0.7, experimental=True)
    assert torch.allclose(out_p.rewards, out.rewards[perm])


def test_marker_gated_abort_by_hand() -> None:
    tokens = torch.tensor([[1, 4, 2, 3, 5], [1, 2, 3, 4, 5], [4, 2, 2, 2, 2], [1, 1, 1, 1, 1]])
    active = torch.ones(4, 5, dtype=torch.bool)
    active[3] = False
    kw: dict[str, Any] = {"markers": [4], "horizon": 3, "answer_tail": 1, "experimental": True}
    # keep_prob = 1: the gate keeps every marker-less row (survivor, weight 1/1); row 1 then answers at t=3
    rule = DUETAbort(keep_prob=1.0, **kw)
    state = rule.init(4)
    for t in range(5):
        state, _ = rule.step(state, tokens=tokens[:, t], active=active[:, t])
    res = rule.finalize(state)
    assert res.position.tolist() == [2, 4, 1, -1]
    assert res.reasons() == ["answered", "answered", "answered", "running"]
    assert rule.weights(state).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert float(res.metrics["survived_frac"]) == pytest.approx(0.25)
    # keep_prob tiny: row 1 (no marker in its first 3 tokens) is aborted at its 3rd token, weight 0
    rule = DUETAbort(keep_prob=1e-9, **kw)
    state = rule.init(4)
    assert bool((state.extra["u"] >= 1e-9).all())  # the draws (multiples of 2**-24) are not 0 for this seed
    for t in range(5):
        state, _ = rule.step(state, tokens=tokens[:, t], active=active[:, t])
    res = rule.finalize(state)
    assert res.position.tolist() == [2, 2, 1, -1]
    assert res.reasons() == ["answered", "aborted", "answered", "running"]
    assert rule.weights(state).tolist() == [1.0, 0.0, 1.0, 1.0]
    # answer_tail=None: markers never stop a row; only the gate does
    rule = DUETAbort(keep_prob=1e-9, markers=[4], horizon=3, answer_tail=None, experimental=True)
    res = replay(rule, tokens=tokens, mask=active)
    assert res.position.tolist() == [-1, 2, -1, -1]


def test_marker_gated_abort_weights_self_normalised_by_hand() -> None:
    rule = DUETAbort(markers=[4], keep_prob=0.25, self_normalize=True, aborted_weight=0.0, experimental=True)
    n = 6
    state = StopState(
        stopped=torch.tensor([False, True, False, False, True, True]),
        position=torch.tensor([-1, 2, -1, -1, 2, 2]),
        reason=torch.tensor([0, 2, 0, 0, 2, 2]),
        steps=torch.full((n,), 3),
        extra={
            "u": torch.zeros(n),
            "first_marker": torch.full((n,), -1),
            "survived": torch.tensor([False, False, True, False, False, False]),
        },
    )
    # raw weights [1, 0, 4, 1, 0, 0]; groups {0, 1}, {2, 3}, {4, 5}: sums 1, 5, 0
    w = rule.weights(state, group=torch.tensor([0, 0, 1, 1, 2, 2]))
    assert w.tolist() == pytest.approx([2.0, 0.0, 8 / 5, 2 / 5, 0.0, 0.0])
    raw = DUETAbort(markers=[4], keep_prob=0.25, aborted_weight=0.5, experimental=True).weights(state)
    assert raw.tolist() == [1.0, 0.5, 4.0, 1.0, 0.5, 0.5]


def test_marker_gated_abort_survival_rate_and_unbiased_weights() -> None:
    n, p = 20_000, 0.2
    rule = DUETAbort(markers=[4], horizon=2, keep_prob=p, seed=123, experimental=True)
    state = rule.init(n)
    for _ in range(3):
        state, _ = rule.step(state, tokens=torch.zeros(n, dtype=torch.long))
    survived = state.extra["survived"].float().mean().item()
    assert abs(survived - p) < 0.02  # binomial sd 0.003
    assert abs(rule.weights(state).mean().item() - 1.0) < 0.1  # E[w] = 1 over gated rows
    u = state.extra["u"]
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0 and abs(u.mean().item() - 0.5) < 0.01


def test_confidence_pruning_by_hand() -> None:
    rule = ECHOPruning(threshold=0.5, window=2, min_tokens=2, min_branches=1, experimental=True)
    probs = torch.tensor(
        [
            [0.3, 0.3, 0.3, 0.3],  # tree 0
            [0.2, 0.2, 0.2, 0.2],  # tree 0
            [0.4, 0.4, 0.4, 0.4],  # tree 0
            [0.9, 0.9, 0.9, 0.9],  # tree 1
            [0.9, 0.9, 0.2, 0.2],  # tree 1: low over the window only at t=3 (the running mean would be 0.55)
            [0.1, 0.1, 0.1, 0.1],  # tree 2, a singleton
        ]
    )
    group = torch.tensor([0, 0, 0, 1, 1, 2])
    res = replay(rule, logp=probs.log(), init={"group": group})
    # t=1: tree 0 has 3 candidates and 3 branches, 2 may go: the two lowest (rows 1, 0); row 2 is the last branch
    assert res.position.tolist() == [1, 1, -1, -1, 3, -1]
    assert res.reasons() == ["low_confidence", "low_confidence", "running", "running", "low_confidence", "running"]
    # min_branches=2: only the lowest of tree 0 goes, row 4 stays (its tree would drop to 1)
    rule2 = ECHOPruning(threshold=0.5, window=2, min_tokens=2, min_branches=2, experimental=True)
    res2 = replay(rule2, logp=probs.log(), init={"group": group})
    assert res2.position.tolist() == [-1, 1, -1, -1, -1, -1]
    # patience=3: candidates only once 3 consecutive window means are low (t=2)
    rule3 = ECHOPruning(threshold=0.5, window=2, min_tokens=2, patience=3, experimental=True)
    res3 = replay(rule3, logp=probs.log(), init={"group": group})
    assert res3.position.tolist() == [2, 2, -1, -1, -1, -1]
    # min_tokens defaults to the window: with window=4 nothing can go before t=3
    rule4 = ECHOPruning(threshold=0.5, window=4, experimental=True)
    res4 = replay(rule4, logp=probs.log(), init={"group": group})
    assert res4.position.tolist() == [3, 3, -1, -1, -1, -1]


def test_confidence_pruning_ties_signals_and_readout() -> None:
    lp = torch.full((2, 3), math.log(0.2))
    group = torch.tensor([5, 5])
    kw: dict[str, Any] = {"threshold": 0.5, "window": 1, "experimental": True}
    res = replay(ECHOPruning(**kw), logp=lp, init={"group": group})
    assert res.position.tolist() == [0, -1]  # equal confidence: the smaller row_id (row index) goes
    res = replay(ECHOPruning(**kw), logp=lp, init={"group": group, "row_id": torch.tensor([9, 3])})
    assert res.position.tolist() == [-1, 0]
    # exp(-entropy) and the mean top-k probability
    ent = torch.tensor([[2.0], [0.1]])  # exp(-2) = 0.135 < 0.5 < exp(-0.1)
    res = replay(ECHOPruning(signal="exp_neg_entropy", min_branches=0, **kw), entropy=ent, init={"group": group})
    assert res.stopped.tolist() == [True, False]
    topk = torch.tensor([[[math.log(0.9), math.log(0.05)]], [[math.log(0.5), math.log(0.4)]]])  # means .475, .45
    rule = ECHOPruning(signal="topk_mean_prob", min_branches=0, **{**kw, "threshold": 0.46})
    res = replay(rule, topk_logp=topk, init={"group": group})
    assert res.stopped.tolist() == [False, True]
    rule = ECHOPruning(threshold=0.1, window=2, experimental=True)
    state = rule.init(2, group=group)
    assert rule.confidence(state).tolist() == [1.0, 1.0]
    state, _ = rule.step(state, logp=torch.log(torch.tensor([0.5, 0.25])))
    state, _ = rule.step(state, logp=torch.log(torch.tensor([0.25, 0.25])), active=torch.tensor([True, False]))
    assert rule.confidence(state).tolist() == pytest.approx([0.375, 0.25])


# ----------------------------------------------------------------------------------------- properties
def _inputs(n: int, t: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_token = {
        "tokens": torch.randint(0, 5, (n, t), generator=g),
        "confidence": torch.rand(n, t, generator=g),
        "logp": torch.log(torch.rand(n, t, generator=g).clamp(min=1e-3)),
    }
    active = torch.rand(n, t, generator=g) < 0.85
    group = torch.randint(0, 3, (n,), generator=g)
    return per_token, active, group


_RULES: dict[str, tuple[Callable[[], StopRule], tuple[str, ...], bool]] = {
    # name: (factory, per-token inputs it reads, whether init takes group/row_id)
    "step_grpo": (
        lambda: StepGRPOTruncation(markers=[MARK], threshold=0.6, min_steps=2, experimental=True),
        ("tokens", "confidence"),
        False,
    ),
    "self_trunc": (
        lambda: DEER(markers=[MARK, 3], threshold=0.7, min_tokens=2, experimental=True),
        ("tokens", "confidence"),
        False,
    ),
    "duet": (
        lambda: DUETAbort(markers=[MARK], horizon=3, keep_prob=0.4, answer_tail=1, seed=7, experimental=True),
        ("tokens",),
        True,
    ),
    "echo": (
        lambda: ECHOPruning(threshold=0.4, window=3, min_tokens=2, min_branches=1, experimental=True),
        ("logp",),
        True,
    ),
}


def _init_kw(name: str, group: torch.Tensor, row_id: torch.Tensor) -> dict[str, Any]:
    if name == "echo":
        return {"group": group, "row_id": row_id}
    if name == "duet":
        return {"row_id": row_id}
    return {}


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(_RULES)), st.integers(1, 7), st.integers(1, 9), st.integers(0, 10_000))
def test_prop_stop_rule_contract(name: str, n: int, t: int, seed: int) -> None:
    factory, reads, _ = _RULES[name]
    per_token, active, group = _inputs(n, t, seed)
    x = {k: per_token[k] for k in reads}
    row_id = torch.arange(n) * 3 + 11
    init = _init_kw(name, group, row_id)
    # never un-stops; inactive rows' state is frozen
    rule = factory()
    state = rule.init(n, **init)
    prev = state.stopped
    for k in range(t):
        before = state
        state, stop = rule.step(state, active=active[:, k], **{key: v[:, k] for key, v in x.items()})
        assert not bool((prev & ~stop).any())
        frozen = ~active[:, k] | before.stopped
        for key, v in state.extra.items():
            if key not in ("tree", "tie_order", "u"):
                assert torch.equal(v[frozen], before.extra[key][frozen]), key
        prev = stop
    res = rule.finalize(state)
    # determinism: a fresh rule with the same arguments (and seed) decides the same
    again = replay(factory(), mask=active, init=init, **x)
    assert torch.equal(again.position, res.position) and torch.equal(again.reason, res.reason)
    # permutation of rows (with group ids and row ids permuted alike) permutes the decisions
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    init_p = _init_kw(name, group[perm] * 5 - 2, row_id[perm])
    res_p = replay(factory(), mask=active[perm], init=init_p, **{k: v[perm] for k, v in x.items()})
    assert torch.equal(res_p.position, res.position[perm]) and torch.equal(res_p.reason, res.reason[perm])
    # an all-inactive batch is a no-op
    none = replay(factory(), mask=torch.zeros(n, t, dtype=torch.bool), init=init, **x)
    assert not bool(none.stopped.any()) and bool((none.length == 0).all())


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(sorted(_RULES)), st.integers(1, 6), st.integers(2, 9), st.integers(0, 10_000))
def test_prop_state_round_trip(name: str, n: int, t: int, seed: int) -> None:
    factory, reads, _ = _RULES[name]
    per_token, active, group = _inputs(n, t, seed)
    x = {k: per_token[k] for k in reads}
    init = _init_kw(name, group, torch.arange(n))
    cut = t // 2
    rule = factory()
    rule.init(n, **init)  # a previous generation: the DUET draws depend on how many came before
    state = rule.init(n, **init)
    for k in range(t):
        if k == cut:
            saved_rule, saved_state = rule.state_dict(), state.state_dict()
        state, _ = rule.step(state, active=active[:, k], **{key: v[:, k] for key, v in x.items()})
    full = rule.finalize(state)
    fresh = factory()
    fresh.load_state_dict(saved_rule)
    resumed = StopState.from_state_dict(saved_state)
    for k in range(cut, t):
        resumed, _ = fresh.step(resumed, active=active[:, k], **{key: v[:, k] for key, v in x.items()})
    res = fresh.finalize(resumed)
    assert torch.equal(res.position, full.position) and torch.equal(res.reason, full.reason)
    for key in state.extra:
        assert torch.equal(resumed.extra[key], state.extra[key])
    # the next generation draws the same as well
    nxt_a, nxt_b = rule.init(n, **init), fresh.init(n, **init)
    for key in nxt_a.extra:
        assert torch.equal(nxt_a.extra[key], nxt_b.extra[key])


def test_duet_seed_and_generation_change_draws() -> None:
    a = DUETAbort(markers=[4], seed=1, experimental=True)
    b = DUETAbort(markers=[4], seed=2, experimental=True)
    ua, ub = a.init(64).extra["u"], b.init(64).extra["u"]
    assert not torch.equal(ua, ub)
    assert not torch.equal(ua, a.init(64).extra["u"])  # a new generation, new draws
    assert a.state_dict() == {"seed": 1, "epoch": 2}
    # huge and negative row ids hash fine
    u = a.init(3, row_id=torch.tensor([-1, 2**40 + 5, 2**62])).extra["u"]
    assert bool(((u >= 0) & (u < 1)).all())


def test_empty_batch() -> None:
    for name, (factory, reads, _) in _RULES.items():
        init = _init_kw(name, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        x = {
            "tokens": torch.zeros(0, 3, dtype=torch.long),
            "confidence": torch.zeros(0, 3),
            "logp": torch.zeros(0, 3),
        }
        res = replay(factory(), init=init, **{k: x[k] for k in reads})
        assert res.stopped.shape == (0,), name


# ------------------------------------------------------------------------------------------------ bad input
def test_experimental_flag_required() -> None:
    with pytest.raises(InputError, match="experimental"):
        StepGRPOTruncation(markers=[1])
    with pytest.raises(InputError, match="experimental"):
        DEER(markers=[1], experimental="yes")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="experimental"):
        DUETAbort(markers=[1])
    with pytest.raises(InputError, match="experimental"):
        ECHOPruning()
    with pytest.raises(InputError, match="experimental"):
        step_aware_reward(torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize(
    ("cls", "kwargs", "arg"),
    [
        (StepGRPOTruncation, {"markers": []}, "markers"),
        (StepGRPOTruncation, {"markers": "Wait"}, "markers"),
        (StepGRPOTruncation, {"markers": [1, -2]}, "markers"),
        (StepGRPOTruncation, {"markers": [1.0]}, "markers"),
        (StepGRPOTruncation, {"markers": torch.tensor([1.0])}, "markers"),
        (StepGRPOTruncation, {"markers": [1], "threshold": 0.0}, "threshold"),
        (StepGRPOTruncation, {"markers": [1], "threshold": 1.5}, "threshold"),
        (StepGRPOTruncation, {"markers": [1], "min_steps": 0}, "min_steps"),
        (DEER, {"markers": [1], "threshold": float("nan")}, "threshold"),
        (DEER, {"markers": [1], "min_tokens": -1}, "min_tokens"),
        (DUETAbort, {"markers": [1], "horizon": 0}, "horizon"),
        (DUETAbort, {"markers": [1], "keep_prob": 0.0}, "keep_prob"),
        (DUETAbort, {"markers": [1], "answer_tail": -1}, "answer_tail"),
        (DUETAbort, {"markers": [1], "aborted_weight": 2.0}, "aborted_weight"),
        (DUETAbort, {"markers": [1], "self_normalize": 1}, "self_normalize"),
        (DUETAbort, {"markers": [1], "seed": 1.5}, "seed"),
        (ECHOPruning, {"threshold": -0.1}, "threshold"),
        (ECHOPruning, {"window": 0}, "window"),
        (ECHOPruning, {"patience": 0}, "patience"),
        (ECHOPruning, {"min_tokens": -1}, "min_tokens"),
        (ECHOPruning, {"min_branches": -1}, "min_branches"),
        (ECHOPruning, {"signal": "margin"}, "signal"),
    ],
)
def test_bad_hyper_parameters(cls: type, kwargs: dict[str, Any], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        cls(experimental=True, **kwargs)


def test_bad_step_and_init_inputs() -> None:
    rule = StepGRPOTruncation(markers=[1], experimental=True)
    state = rule.init(2)
    with pytest.raises(InputError, match="tokens"):
        rule.step(state, confidence=torch.zeros(2))
    with pytest.raises(InputError, match="tokens"):
        rule.step(state, tokens=torch.zeros(2))
    with pytest.raises(InputError, match="tokens"):
        rule.probe_rows(state, tokens=torch.zeros(3, dtype=torch.long))
    with pytest.raises(InputError, match="confidence"):
        rule.step(state, tokens=torch.zeros(2, dtype=torch.long), confidence=torch.zeros(3))
    with pytest.raises(InputError, match="confidence"):
        rule.step(state, tokens=torch.zeros(2, dtype=torch.long), confidence=torch.tensor([0.0, float("nan")]))
    with pytest.raises(InputError, match="state"):
        rule.probe_rows("state", tokens=torch.zeros(2, dtype=torch.long))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="group"):
        rule.init(2, group=torch.zeros(2, dtype=torch.long))

    duet = DUETAbort(markers=[1], experimental=True)
    with pytest.raises(InputError, match="row_id"):
        duet.init(2, row_id=torch.zeros(3, dtype=torch.long))
    with pytest.raises(InputError, match="row_id"):
        duet.init(2, row_id=torch.zeros(2))
    with pytest.raises(InputError, match="group"):
        duet.weights(duet.init(2), group=torch.zeros(2, dtype=torch.long))
    with pytest.raises(InputError, match="state"):
        duet.weights("state")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="state"):
        duet.load_state_dict({"seed": 1})
    with pytest.raises(InputError, match="state"):
        duet.load_state_dict([1, 2])  # type: ignore[arg-type]
    norm = DUETAbort(markers=[1], self_normalize=True, experimental=True)
    with pytest.raises(InputError, match="group"):
        norm.weights(norm.init(2))
    with pytest.raises(InputError, match="group"):
        norm.weights(norm.init(2), group=torch.zeros(3, dtype=torch.long))

    echo = ECHOPruning(experimental=True)
    with pytest.raises(InputError, match="group"):
        echo.init(2)
    with pytest.raises(InputError, match="group"):
        echo.init(2, group=torch.zeros(3, dtype=torch.long))
    with pytest.raises(InputError, match="group"):
        echo.init(2, group=torch.zeros(2))
    with pytest.raises(InputError, match="parent"):
        echo.init(2, group=torch.zeros(2, dtype=torch.long), parent=torch.zeros(2, dtype=torch.long))
    state = echo.init(2, group=torch.zeros(2, dtype=torch.long))
    with pytest.raises(InputError, match="logp"):
        echo.step(state, entropy=torch.zeros(2))
    with pytest.raises(InputError, match="logp"):
        echo.step(state, logp=torch.tensor([0.0, float("-inf")]))
    with pytest.raises(InputError, match="state"):
        echo.confidence("state")  # type: ignore[arg-type]


def test_bad_reward_inputs() -> None:
    r, s, g = torch.ones(3), torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.long)
    with pytest.raises(InputError, match="steps"):
        step_aware_reward(r, torch.ones(4), g, experimental=True)
    with pytest.raises(InputError, match="steps"):
        step_aware_reward(r, torch.tensor([1, -1, 2]), g, experimental=True)
    with pytest.raises(InputError, match="steps"):
        step_aware_reward(r, torch.ones(3, dtype=torch.bool), g, experimental=True)
    with pytest.raises(InputError, match="rewards"):
        step_aware_reward(torch.tensor([1.0, float("nan"), 0.0]), s, g, experimental=True)
    with pytest.raises(InputError, match="rewards"):
        step_aware_reward(torch.ones(3, 1), s, g, experimental=True)
    with pytest.raises(InputError, match="group"):
        step_aware_reward(r, s, torch.zeros(2, dtype=torch.long), experimental=True)
    with pytest.raises(InputError, match="lam"):
        step_aware_reward(r, s, g, lam=-1.0, experimental=True)
    with pytest.raises(InputError, match="span"):
        step_aware_reward(r, s, g, span="some", experimental=True)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="eps"):
        step_aware_reward(r, s, g, eps=0.0, experimental=True)
    with pytest.raises(InputError, match="correct_threshold"):
        step_aware_reward(r, s, g, correct_threshold=float("inf"), experimental=True)
    with pytest.raises(InputError, match="tokens"):
        count_steps(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), markers=[1])
    with pytest.raises(InputError, match="mask"):
        count_steps(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool), markers=[1])
    with pytest.raises(InputError, match="markers"):
        count_steps(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), markers=[])


def test_checks_off_and_extreme_inputs() -> None:
    import rolloutopt

    rule = StepGRPOTruncation(markers=[1], min_steps=1, experimental=True)
    with rolloutopt.checks(False):
        # a probe point without confidence: validation off, the row simply does not stop
        state, stop = rule.step(rule.init(2), tokens=torch.tensor([1, 1]))
        assert stop.tolist() == [False, False] and state.extra["probes"].tolist() == [1, 1]
    # huge negative log-probs and entropies give confidence 0, finite state
    echo = ECHOPruning(window=2, min_tokens=1, min_branches=0, experimental=True)
    res = replay(echo, logp=torch.full((2, 3), -1e30), init={"group": torch.tensor([0, 1])})
    assert res.position.tolist() == [0, 0]
    echo = ECHOPruning(signal="exp_neg_entropy", window=2, experimental=True)
    state = echo.init(1, group=torch.tensor([0]))
    state, _ = echo.step(state, entropy=torch.tensor([1e30]))
    assert torch.isfinite(state.extra["buf"]).all() and echo.confidence(state).tolist() == [0.0]
    out = step_aware_reward(
        torch.tensor([1e30, 1e30, 0.0]),
        torch.tensor([0.0, 1e30, 5.0]),
        torch.zeros(3, dtype=torch.long),
        lam=1.0,
        experimental=True,
    )
    assert torch.isfinite(out.rewards).all()
