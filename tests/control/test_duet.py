"""DUET's marker-gated abort (control/duet.py): hand oracles, survival rate and unbiased weights, the gate draws,
the stop-rule properties (truncation_helpers) and bad input."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    DUETAbort,
    StopState,
    replay,
)
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

from .truncation_helpers import check_empty_batch, check_state_round_trip, check_stop_rule_contract


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
    assert res.row_weight is not None and res.row_weight.tolist() == [1.0, 1.0, 1.0, 1.0]
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
    assert res.row_weight is not None and res.row_weight.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert res.terminal_reward is None and res.token_weight is None
    # the loss weights: each row's kept prefix times its weight (row 1, aborted, leaves the loss)
    assert res.loss_weights(active).tolist() == [
        [1.0, 1.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 1.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert res.rewards(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [1.0, 2.0, 3.0, 4.0]
    # answer_tail=None: markers never stop a row; only the gate does
    rule = DUETAbort(keep_prob=1e-9, markers=[4], horizon=3, answer_tail=None, experimental=True)
    res = replay(rule, tokens=tokens, mask=active)
    assert res.position.tolist() == [-1, 2, -1, -1]


def test_marker_gated_abort_weights_self_normalised_by_hand() -> None:
    rule = DUETAbort(markers=[4], keep_prob=0.25, self_normalize=True, aborted_weight=0.0, experimental=True)
    n = 6
    extra = {
        "u": torch.zeros(n),
        "first_marker": torch.full((n,), -1),
        "survived": torch.tensor([False, False, True, False, False, False]),
    }
    state = StopState(
        stopped=torch.tensor([False, True, False, False, True, True]),
        position=torch.tensor([-1, 2, -1, -1, 2, 2]),
        reason=torch.tensor([0, 2, 0, 0, 2, 2]),
        steps=torch.full((n,), 3),
        extra={**extra, "group": torch.tensor([0, 0, 1, 1, 2, 2])},  # what init(n, group=...) stores
    )
    # raw weights [1, 0, 4, 1, 0, 0]; groups {0, 1}, {2, 3}, {4, 5}: sums 1, 5, 0
    w = rule.finalize(state).row_weight
    assert w is not None and w.tolist() == pytest.approx([2.0, 0.0, 8 / 5, 2 / 5, 0.0, 0.0])
    raw = DUETAbort(markers=[4], keep_prob=0.25, aborted_weight=0.5, experimental=True)
    w_raw = raw.finalize(replace(state, extra=extra)).row_weight
    assert w_raw is not None and w_raw.tolist() == [1.0, 0.5, 4.0, 1.0, 0.5, 0.5]
    # the group ids go to init: any ids (or a Groups), stored as a dense index, the same weights after a stream
    group = torch.tensor([7, 7, -3, -3, 10, 10])
    for g in (group, Groups(group)):
        s = rule.init(n, group=g)
        assert s.extra["group"].tolist() == [1, 1, 0, 0, 2, 2]
        s = replace(s, stopped=state.stopped, position=state.position, reason=state.reason, steps=state.steps)
        s = replace(s, extra={**s.extra, "survived": extra["survived"]})
        out = rule.finalize(s).row_weight
        assert out is not None and out.tolist() == pytest.approx([2.0, 0.0, 8 / 5, 2 / 5, 0.0, 0.0])


def test_marker_gated_abort_survival_rate_and_unbiased_weights() -> None:
    n, p = 20_000, 0.2
    rule = DUETAbort(markers=[4], horizon=2, keep_prob=p, seed=123, experimental=True)
    state = rule.init(n)
    for _ in range(3):
        state, _ = rule.step(state, tokens=torch.zeros(n, dtype=torch.long))
    survived = state.extra["survived"].float().mean().item()
    assert abs(survived - p) < 0.02  # binomial sd 0.003
    w = rule.finalize(state).row_weight
    assert w is not None and abs(w.mean().item() - 1.0) < 0.1  # E[w] = 1 over gated rows
    u = state.extra["u"]
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0 and abs(u.mean().item() - 0.5) < 0.01


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 7), st.integers(1, 9), st.integers(0, 10_000))
def test_prop_stop_rule_contract(n: int, t: int, seed: int) -> None:
    check_stop_rule_contract("duet", n, t, seed)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(2, 9), st.integers(0, 10_000))
def test_prop_state_round_trip(n: int, t: int, seed: int) -> None:
    check_state_round_trip("duet", n, t, seed)


def test_empty_batch() -> None:
    check_empty_batch("duet")
    rule = DUETAbort(markers=[1], self_normalize=True, experimental=True)
    res = replay(rule, tokens=torch.zeros(0, 3, dtype=torch.long), init={"group": torch.zeros(0, dtype=torch.long)})
    assert res.row_weight is not None and res.row_weight.shape == (0,)
    assert res.loss_weights(torch.ones(0, 3, dtype=torch.bool)).shape == (0, 3)


def test_duet_seed_and_generation_change_draws() -> None:
    a = DUETAbort(markers=[4], seed=1, experimental=True)
    b = DUETAbort(markers=[4], seed=2, experimental=True)
    ua, ub = a.init(64).extra["u"], b.init(64).extra["u"]
    assert not torch.equal(ua, ub)
    assert not torch.equal(ua, a.init(64).extra["u"])  # a new generation, new draws
    assert a.state_dict() == {"seed": 1, "epoch": 2, "format": 1}  # with the format version
    # huge and negative row ids hash fine
    u = a.init(3, row_id=torch.tensor([-1, 2**40 + 5, 2**62])).extra["u"]
    assert bool(((u >= 0) & (u < 1)).all())


def test_experimental_flag_required() -> None:
    with pytest.raises(InputError, match="experimental"):
        DUETAbort(markers=[1])


@pytest.mark.parametrize(
    ("cls", "kwargs", "arg"),
    [
        (DUETAbort, {"markers": [1], "horizon": 0}, "horizon"),
        (DUETAbort, {"markers": [1], "keep_prob": 0.0}, "keep_prob"),
        (DUETAbort, {"markers": [1], "answer_tail": -1}, "answer_tail"),
        (DUETAbort, {"markers": [1], "aborted_weight": 2.0}, "aborted_weight"),
        (DUETAbort, {"markers": [1], "self_normalize": 1}, "self_normalize"),
        (DUETAbort, {"markers": [1], "seed": 1.5}, "seed"),
    ],
)
def test_bad_hyper_parameters(cls: type, kwargs: dict[str, Any], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        cls(experimental=True, **kwargs)


def test_bad_step_and_init_inputs() -> None:
    duet = DUETAbort(markers=[1], experimental=True)
    with pytest.raises(InputError, match="row_id"):
        duet.init(2, row_id=torch.zeros(3, dtype=torch.long))
    with pytest.raises(InputError, match="row_id"):
        duet.init(2, row_id=torch.zeros(2))
    with pytest.raises(InputError, match="self_normalize") as err:  # nothing reads the groups
        duet.init(2, group=torch.zeros(2, dtype=torch.long))
    assert err.value.argument == "group"
    with pytest.raises(InputError, match="state"):
        duet.finalize("state")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="state"):
        duet.load_state_dict({"seed": 1})
    with pytest.raises(InputError, match="state"):
        duet.load_state_dict([1, 2])  # type: ignore[arg-type]
    norm = DUETAbort(markers=[1], self_normalize=True, experimental=True)
    assert norm.requires == ("tokens", "group") and DUETAbort.requires == ("tokens",)
    with pytest.raises(InputError, match="group") as err:
        norm.init(2)
    assert err.value.argument == "group"
    with pytest.raises(InputError, match="group"):
        norm.init(2, group=torch.zeros(3, dtype=torch.long))
    with pytest.raises(InputError, match="group"):
        norm.init(2, group=Groups(torch.zeros(3, dtype=torch.long)))
    with pytest.raises(InputError, match="group"):
        norm.init(2, group=torch.zeros(2))  # float ids
    with pytest.raises(InputError, match="group"):  # a state that did not come from this rule's init
        norm.finalize(duet.init(2))
