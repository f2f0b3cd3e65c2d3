"""Abstention (arXiv 2604.18419): hand oracles of our reconstruction (see docs/methods/early_stop.md), bad input."""

from __future__ import annotations

import math

import pytest
import torch

from rolloutopt.control import Abstention, SoftValue, StepInputs, replay, soft_value
from rolloutopt.errors import InputError

from .checkpoint_rule_helpers import EXP, NAN


def test_soft_value_by_hand() -> None:
    r = torch.tensor([[0.0, 1.0], [0.3, 0.3], [2.0, 2.0]])
    assert soft_value(r).tolist() == pytest.approx([math.log((1 + math.e) / 2), 0.3, 2.0])
    # beta = 0.5: 0.5 * log((1 + e^2) / 2)
    assert float(soft_value(r[:1], beta=0.5)[0]) == pytest.approx(0.5 * math.log((1 + math.e**2) / 2))
    assert soft_value(torch.tensor([[0.7]])).tolist() == pytest.approx([0.7])  # J = 1: the reward itself
    assert soft_value(torch.zeros(0, 3)).shape == (0,)


def test_abstention_oracle_values() -> None:
    # our reconstruction: r_abs 0.3, V at the checkpoints [0.6, 0.5, 0.25, 0.7]: abstain at the third (t = 6 with K = 2,
    # position 5); the fourth is never read (NaN there and between checkpoints raises nothing)
    rule = Abstention(r_abs=0.3, every=2, **EXP)
    v = torch.tensor([[NAN, 0.6, NAN, 0.5, NAN, 0.25, NAN, NAN, NAN, NAN]])
    state = rule.init(1)
    for t in range(v.shape[1]):
        state, _ = rule.step(state, values=v[:, t])
    res = rule.finalize(state)
    assert res.reasons() == ["abstain"] and res.position.tolist() == [5]
    assert state.extra["checks"].tolist() == [3] and state.extra["value"].tolist() == [0.25]
    assert res.rewards(torch.tensor([1.0])).tolist() == [pytest.approx(0.3)]
    assert rule.finalize(rule.init(1)).rewards(torch.tensor([1.0])).tolist() == [1.0]


def test_abstention_result_fields_by_hand() -> None:
    # rows 0 and 2 abstain (V = 0.1 and 0.2 < r_abs = 0.3 at their first checkpoint, t = 2), row 1 never does (0.5),
    # row 3 is inactive: terminal reward r_abs on the abstained rows only, no weights
    rule = Abstention(r_abs=0.3, every=2, **EXP)
    v = torch.tensor([[NAN, 0.1, NAN], [NAN, 0.5, NAN], [NAN, 0.2, NAN], [NAN, NAN, NAN]])
    active = torch.ones(4, 3, dtype=torch.bool)
    active[3] = False
    res = replay(rule, values=v, mask=active)
    assert res.reasons() == ["abstain", "running", "abstain", "running"]
    assert res.terminal_rows is not None and res.terminal_reward is not None
    assert res.terminal_rows.tolist() == [True, False, True, False]
    assert res.terminal_reward[res.terminal_rows].tolist() == [pytest.approx(0.3)] * 2
    assert res.row_weight is None and res.token_weight is None
    assert res.rewards(torch.tensor([1.0, 0.0, -2.0, 0.5])).tolist() == pytest.approx([0.3, 0.0, 0.3, 0.5])
    # the loss weights: the truncated mask (the abstained rows keep their first 2 tokens)
    assert res.loss_weights(torch.ones(4, 3, dtype=torch.bool)).tolist() == [
        [1.0, 1.0, 0.0],
        [1.0, 1.0, 1.0],
        [1.0, 1.0, 0.0],
        [1.0, 1.0, 1.0],
    ]


def test_abstention_oracle_estimator_not_called_after_stop() -> None:
    # the default estimator (soft value, J = 1: V = r) driven the way an engine would: continuation rewards are
    # computed only when rule.due() says a row needs them
    rule = Abstention(r_abs=0.3, every=2, **EXP)
    at_checkpoints = iter([0.6, 0.5, 0.25, 0.7])
    state, computed = rule.init(1), 0
    for _ in range(12):
        due = rule.due(state)
        cont = None
        if bool(due.any()):
            computed += 1
            cont = torch.tensor([[next(at_checkpoints)]])
        state, _ = rule.step(state, continuation_rewards=cont)
    assert computed == 3 and rule.finalize(state).position.tolist() == [5]

    # a custom estimator sees `due`; a stopped row is never due again
    seen: list[list[bool]] = []

    def estimator(x: StepInputs, due: torch.Tensor) -> torch.Tensor:
        seen.append(due.tolist())
        return x.need("v", "test")

    rule = Abstention(r_abs=0.3, every=2, estimator=estimator, estimator_inputs={"v": ("N", "float")}, **EXP)
    v = torch.tensor([[NAN, 0.6, NAN, 0.5, NAN, 0.25, NAN, 0.7], [NAN, 0.9, NAN, 0.9, NAN, 0.9, NAN, 0.9]])
    res = replay(rule, v=v)
    assert res.position.tolist() == [5, -1]
    assert [d[0] for d in seen] == [False, True, False, True, False, True, False, False]
    assert [d[1] for d in seen] == [False, True] * 4
    # V = r_abs does not abstain (strict inequality)
    assert not replay(Abstention(r_abs=0.3, every=1, **EXP), values=torch.full((1, 3), 0.3)).stopped.any()


def test_abstention_missing_value_at_checkpoint() -> None:
    rule = Abstention(r_abs=0.3, every=2, **EXP)
    state, _ = rule.step(rule.init(2))  # t = 1: no row due, nothing needed
    with pytest.raises(InputError, match="values"):
        rule.step(state)
    # an inactive row is not due: nothing needed
    state, stop = rule.step(state, active=torch.tensor([False, False]))
    assert not stop.any() and state.steps.tolist() == [1, 1]
    with pytest.raises(InputError, match="values"):  # NaN at a due row
        rule.step(state, values=torch.tensor([NAN, 0.5]))


# -- bad input -------------------------------------------------------------------------------------------------------
def test_abstention_bad_input() -> None:
    with pytest.raises(InputError, match="experimental"):
        Abstention(r_abs=0.3)
    for kwargs, name in (
        ({"r_abs": NAN}, "r_abs"),
        ({"r_abs": 0.3, "every": 0}, "every"),
        ({"r_abs": 0.3, "estimator": 3}, "estimator"),
        ({"r_abs": 0.3, "estimator_inputs": {"h": "N"}}, "estimator_inputs"),
        ({"r_abs": 0.3, "estimator_inputs": {"values": ("N", "float")}}, "estimator_inputs"),
        ({"r_abs": 0.3, "beta": 0.0}, "beta"),
    ):
        with pytest.raises(InputError, match=name):
            Abstention(**kwargs, **EXP)
    with pytest.raises(TypeError):
        Abstention(**EXP)  # type: ignore[call-arg]  # r_abs has no default
    rule = Abstention(r_abs=0.3, every=1, **EXP)
    state = rule.init(2)
    with pytest.raises(InputError, match="values"):
        rule.step(state, values=torch.zeros(3))
    with pytest.raises(InputError, match="continuation_rewards"):
        rule.step(state, continuation_rewards=torch.zeros(2, 0))
    with pytest.raises(InputError, match="typo"):
        rule.step(state, values=torch.zeros(2), typo=torch.zeros(2))
    with pytest.raises(InputError, match="group"):
        rule.init(2, group=torch.zeros(2, dtype=torch.long))
    with pytest.raises(InputError, match="state"):
        rule.due("nope")  # type: ignore[arg-type]
    bad = Abstention(r_abs=0.3, every=1, estimator=lambda x, due: torch.zeros(3), **EXP)
    with pytest.raises(InputError, match="estimator"):
        bad.step(bad.init(2))
    with pytest.raises(InputError, match="rewards"):
        rule.finalize(state).rewards(torch.zeros(3))
    with pytest.raises(InputError, match="rewards"):
        soft_value(torch.zeros(2, 0))
    with pytest.raises(InputError, match="rewards"):
        soft_value(torch.tensor([[NAN]]))
    with pytest.raises(InputError, match="beta"):
        SoftValue(beta=-1.0)
