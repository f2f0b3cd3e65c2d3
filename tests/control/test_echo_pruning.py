"""ECHO's confidence-based branch pruning (control/echo_pruning.py): hand oracles, ties, signals and the readout,
the stop-rule properties (truncation_helpers) and bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    ECHOPruning,
    replay,
)
from rolloutopt.errors import InputError

from .truncation_helpers import check_empty_batch, check_state_round_trip, check_stop_rule_contract


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


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 7), st.integers(1, 9), st.integers(0, 10_000))
def test_prop_stop_rule_contract(n: int, t: int, seed: int) -> None:
    check_stop_rule_contract("echo", n, t, seed)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(2, 9), st.integers(0, 10_000))
def test_prop_state_round_trip(n: int, t: int, seed: int) -> None:
    check_state_round_trip("echo", n, t, seed)


def test_empty_batch() -> None:
    check_empty_batch("echo")


def test_experimental_flag_required() -> None:
    with pytest.raises(InputError, match="experimental"):
        ECHOPruning()


@pytest.mark.parametrize(
    ("cls", "kwargs", "arg"),
    [
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


def test_checks_off_and_extreme_inputs() -> None:
    # huge negative log-probs and entropies give confidence 0, finite state
    echo = ECHOPruning(window=2, min_tokens=1, min_branches=0, experimental=True)
    res = replay(echo, logp=torch.full((2, 3), -1e30), init={"group": torch.tensor([0, 1])})
    assert res.position.tolist() == [0, 0]
    echo = ECHOPruning(signal="exp_neg_entropy", window=2, experimental=True)
    state = echo.init(1, group=torch.tensor([0]))
    state, _ = echo.step(state, entropy=torch.tensor([1e30]))
    assert torch.isfinite(state.extra["buf"]).all() and echo.confidence(state).tolist() == [0.0]
