"""The stop-rule protocol (StopRule, replay, truncate_mask): a toy rule by hand, properties, bad input."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import StepInputs, StopResult, StopRule, StopState, replay, truncate_mask
from rolloutopt.errors import InputError


class LowProb(StopRule):
    """Stop a row when its sampled log-prob drops below ``floor`` (reason 1) or after ``cap`` tokens (reason 2)."""

    reason_names = ("running", "low_prob", "cap")
    requires = ("logp",)
    extra_inputs: ClassVar[dict[str, tuple[str, str]]] = {"bonus": ("N", "float")}

    def __init__(self, floor: float = -2.0, cap: int = 100) -> None:
        self.floor, self.cap = floor, cap

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, torch.Tensor]:
        super()._init(n, device, **inputs)
        return {"total": torch.zeros(n, device=device)}

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        lp = x.need("logp", "LowProb")
        bonus = x.extra.get("bonus", torch.zeros_like(lp))
        total = torch.where(x.live, state.extra["total"] + lp, state.extra["total"])
        low = lp + bonus < self.floor
        capped = state.steps + 1 >= self.cap
        return {"total": total}, low | capped, torch.where(low, 1, 2)


def test_hand_example() -> None:
    rule = LowProb(floor=-2.0, cap=3)
    lp = torch.tensor([[-0.1, -3.0, -0.1, -0.1], [-0.1, -0.1, -0.1, -5.0], [-0.5, -0.5, -9.0, -9.0]])
    active = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    res = replay(rule, logp=lp, mask=active)
    assert res.stopped.tolist() == [True, True, False]
    assert res.position.tolist() == [1, 2, -1]  # row 1: cap after its third token (index 2)
    assert res.length.tolist() == [2, 3, 1]
    assert res.reasons() == ["low_prob", "cap", "running"]
    assert float(res.metrics["stop_frac"]) == pytest.approx(2 / 3)
    assert float(res.metrics["stop_frac/cap"]) == pytest.approx(1 / 3)
    assert float(res.metrics["stop_position_mean"]) == pytest.approx(1.5)
    mask = torch.ones(3, 4, dtype=torch.bool)
    assert truncate_mask(mask, res).int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_stop_is_cumulative_and_inactive_rows_frozen() -> None:
    rule = LowProb()
    state = rule.init(2)
    state, stop = rule.step(state, logp=torch.tensor([-5.0, -5.0]), active=torch.tensor([True, False]))
    assert stop.tolist() == [True, False] and state.steps.tolist() == [1, 0]
    assert state.extra["total"].tolist() == [-5.0, 0.0]
    state, stop = rule.step(state, logp=torch.tensor([0.0, 0.0]))
    assert stop.tolist() == [True, False] and state.steps.tolist() == [1, 1]
    assert state.extra["total"].tolist() == [-5.0, 0.0]  # a stopped row's state no longer changes


def test_extra_inputs_and_unused_inputs() -> None:
    rule = LowProb()
    state = rule.init(1)
    _, stop = rule.step(state, logp=torch.tensor([-1.5]), bonus=torch.tensor([-1.0]), entropy=torch.tensor([1.0]))
    assert stop.tolist() == [True]


def test_state_dict_round_trip() -> None:
    rule = LowProb()
    state, _ = rule.step(rule.init(3), logp=torch.tensor([-5.0, 0.0, 0.0]))
    again = StopState.from_state_dict(state.state_dict())
    for a, b in ((state, again),):
        assert torch.equal(a.stopped, b.stopped) and torch.equal(a.position, b.position)
        assert torch.equal(a.steps, b.steps) and torch.equal(a.extra["total"], b.extra["total"])
    with pytest.raises(InputError, match="state"):
        StopState.from_state_dict({"stopped": 1})


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 10_000))
def test_prop_never_unstops_and_permutation(n: int, t: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(n, t, generator=g)
    active = torch.rand(n, t, generator=g) < 0.8
    rule = LowProb(floor=-2.5, cap=5)
    state = rule.init(n)
    prev = state.stopped
    for k in range(t):
        state, stop = rule.step(state, logp=lp[:, k], active=active[:, k])
        assert bool((prev & ~stop).any()) is False
        prev = stop
    res = rule.finalize(state)
    perm = torch.randperm(n, generator=g)
    res_p = replay(rule, logp=lp[perm], mask=active[perm])
    assert torch.equal(res_p.position, res.position[perm]) and torch.equal(res_p.reason, res.reason[perm])
    # all-inactive batch: a no-op
    none = replay(rule, logp=lp, mask=torch.zeros(n, t, dtype=torch.bool))
    assert not none.stopped.any() and (none.length == 0).all()


def test_bad_input() -> None:
    rule = LowProb()
    state = rule.init(2)
    with pytest.raises(InputError, match="logp"):
        rule.step(state)
    with pytest.raises(InputError, match="logp"):
        rule.step(state, logp=torch.zeros(3))
    with pytest.raises(InputError, match="logp"):
        rule.step(state, logp=torch.tensor([0.0, float("nan")]))
    with pytest.raises(InputError, match="active"):
        rule.step(state, logp=torch.zeros(2), active=torch.tensor([0.5, 1.0]))
    with pytest.raises(InputError, match="typo"):
        rule.step(state, logp=torch.zeros(2), typo=torch.zeros(2))
    with pytest.raises(InputError, match="bonus"):
        rule.step(state, logp=torch.zeros(2), bonus=torch.zeros(3))
    with pytest.raises(InputError, match="batch_size"):
        rule.init(-1)
    with pytest.raises(InputError, match="group"):
        rule.init(2, group=torch.zeros(2))
    with pytest.raises(InputError, match="state"):
        rule.step("nope", logp=torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="rule"):
        replay("nope", logp=torch.zeros(2, 2))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="entropy"):
        replay(rule, logp=torch.zeros(2, 3), entropy=torch.zeros(2, 4))
    res = replay(rule, logp=torch.zeros(2, 3))
    with pytest.raises(InputError, match="result"):
        truncate_mask(torch.ones(3, 3, dtype=torch.bool), res)
    assert isinstance(res, StopResult)
    # a NaN at an inactive position is fine
    rule.step(state, logp=torch.tensor([0.0, float("nan")]), active=torch.tensor([True, False]))
