"""Step-GRPO (control/step_grpo.py): the dynamic truncated rollout, the step-aware relative reward, count_steps.

Hand oracles, the step-aware reward's invariant (a correct response with the group's minimum step count gets the
maximum reward), the stop-rule properties (truncation_helpers: never un-stops, all-inactive no-op, row
permutation, determinism, state round trip) and bad input.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    StepGRPOTruncation,
    count_steps,
    replay,
    step_aware_reward,
)
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

from .truncation_helpers import check_empty_batch, check_state_round_trip, check_stop_rule_contract


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


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 7), st.integers(1, 9), st.integers(0, 10_000))
def test_prop_stop_rule_contract(n: int, t: int, seed: int) -> None:
    check_stop_rule_contract("step_grpo", n, t, seed)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(2, 9), st.integers(0, 10_000))
def test_prop_state_round_trip(n: int, t: int, seed: int) -> None:
    check_state_round_trip("step_grpo", n, t, seed)


def test_empty_batch() -> None:
    check_empty_batch("step_grpo")


def test_experimental_flag_required() -> None:
    with pytest.raises(InputError, match="experimental"):
        StepGRPOTruncation(markers=[1])
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
    out = step_aware_reward(
        torch.tensor([1e30, 1e30, 0.0]),
        torch.tensor([0.0, 1e30, 5.0]),
        torch.zeros(3, dtype=torch.long),
        lam=1.0,
        experimental=True,
    )
    assert torch.isfinite(out.rewards).all()
