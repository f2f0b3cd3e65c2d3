"""DEER-style self-truncation (control/deer.py): hand oracle, the stop-rule properties (truncation_helpers) and
bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    DEER,
    replay,
)
from rolloutopt.errors import InputError

from .truncation_helpers import check_empty_batch, check_state_round_trip, check_stop_rule_contract


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


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 7), st.integers(1, 9), st.integers(0, 10_000))
def test_prop_stop_rule_contract(n: int, t: int, seed: int) -> None:
    check_stop_rule_contract("deer", n, t, seed)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(2, 9), st.integers(0, 10_000))
def test_prop_state_round_trip(n: int, t: int, seed: int) -> None:
    check_state_round_trip("deer", n, t, seed)


def test_empty_batch() -> None:
    check_empty_batch("deer")


def test_experimental_flag_required() -> None:
    with pytest.raises(InputError, match="experimental"):
        DEER(markers=[1], experimental="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cls", "kwargs", "arg"),
    [
        (DEER, {"markers": [1], "threshold": float("nan")}, "threshold"),
        (DEER, {"markers": [1], "min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_hyper_parameters(cls: type, kwargs: dict[str, Any], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        cls(experimental=True, **kwargs)
