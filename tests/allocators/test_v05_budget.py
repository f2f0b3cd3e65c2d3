"""V05Budget: hand oracles of our reconstruction (see docs/methods/adaptive_alloc.md), hypothesis properties
(budget, caps, determinism, permutation), state round trips and bad input."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.advantages.v05 import v05
from rolloutopt.allocators.table import PromptTable
from rolloutopt.allocators.v05_budget import V05Budget
from rolloutopt.errors import InputError

from .adaptive_helpers import (
    FACTORIES,
    _steps,
    aero,
    check_bad_hyperparameters,
    check_bad_protocol_input,
    check_budget_caps_and_determinism,
    check_experimental_flag_required,
    check_permutation_permutes_the_plan,
    check_shared_table_equals_private,
    check_state_dict_round_trip_mid_run,
    reasons,
    v05b,
)
from .helpers import run, table


# -- V05Budget oracle -------------------------------------------------------------------------------------------------
def _osla(nbar: float, prior: float, n: int, cost: float = 1e-3, max_extra: int = 4) -> int:
    """v05's extra-rollout rule by hand (Bernoulli variance, prior fallback, threshold 1)."""
    v = nbar * (1 - nbar) or prior * (1 - prior)
    d = max(0.0, (nbar - prior) ** 2 - v / n)

    def mse(m: int) -> float:
        return 0.0 if d == 0 or v == 0 else d * v / (m * d + v)

    return next((k for k in range(max_extra + 1) if mse(n + k) - mse(n + k + 1) < cost), max_extra)


def test_v05budget_oracle() -> None:
    vb = v05b()
    vb.set_prior(torch.tensor([0, 1, 2]), torch.tensor([0.5, 0.5, 0.0]))
    t = {0: [0.0], 1: [1.0, 0.0], 2: [0.0]}
    res, reqs = run(vb.plan(torch.tensor([0, 1, 2]), 100), table(t))
    k0, k1, k2 = _osla(0.0, 0.5, 4), _osla(0.5, 0.5, 4), _osla(0.0, 0.0, 4)
    assert k0 > 0 and k1 == 0 and k2 == 0
    assert res.counts.tolist() == [4 + k0, 4, 4]
    assert reqs == [([0, 1, 2], [4, 4, 4]), ([0], [k0])]
    assert reasons(res) == {0: "extra", 1: "initial", 2: "initial"}
    # caps: n_max = 5 clips the request
    vb = v05b(n_max=5)
    vb.set_prior(torch.tensor([0]), torch.tensor([0.5]))
    res, _ = run(vb.plan(torch.tensor([0]), 100), table(t))
    assert res.counts.tolist() == [5] and reasons(res) == {0: "capped"}


def test_v05budget_consumes_trainer_output_and_prior_fallback() -> None:
    vb = v05b()
    plan = vb.plan(torch.tensor([3, 9]), 100)
    req = plan.next()
    assert req is not None and req.counts.tolist() == [4, 4]
    r = torch.tensor([0.0] * 4 + [1.0, 0, 0, 0], dtype=torch.float64)
    out = v05(r, req.prompt_ids.repeat_interleave(4), torch.full((8,), 0.9, dtype=torch.float64), experimental=True)
    plan.observe(req, r)
    plan.consume(out)
    req2 = plan.next()
    assert req2 is not None
    got = dict(zip(req2.prompt_ids.tolist(), req2.counts.tolist(), strict=True))
    want = {int(i): int(k) for i, k in zip(out.group_ids, out.extra_rollouts, strict=True) if k > 0}
    assert got == want and want
    plan.observe(req2, torch.zeros(req2.total, dtype=torch.float64))
    assert plan.next() is None
    res = plan.finish()
    vb.update(res)
    # no value-model prior: the mean reward of past steps; unseen ids: 0.5
    m3 = float(res.rewards[res.prompt_ids == 3].mean())
    m9 = float(res.rewards[res.prompt_ids == 9].mean())
    assert vb.prior(torch.tensor([3, 9, 4])).tolist() == pytest.approx([m3, m9, 0.5])


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(["v05"]),
    st.lists(st.integers(0, 10**9), min_size=0, max_size=12, unique=True),
    st.integers(0, 120),
    st.integers(0, 50),
)
def test_budget_caps_and_determinism(name: str, ids: list[int], budget: int, seed: int) -> None:
    check_budget_caps_and_determinism(name, ids, budget, seed)


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(["v05"]),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=10, unique=True),
    st.integers(0, 100),
    st.randoms(use_true_random=False),
)
def test_permutation_permutes_the_plan(name: str, ids: list[int], budget: int, rnd: Any) -> None:
    check_permutation_permutes_the_plan(name, ids, budget, rnd)


@pytest.mark.parametrize("name", ["v05"])
def test_state_dict_round_trip_mid_run(name: str) -> None:
    check_state_dict_round_trip_mid_run(name)


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [V05Budget])
def test_experimental_flag_required(cls: Any) -> None:
    check_experimental_flag_required(cls)


@pytest.mark.parametrize(
    ("factory", "kw", "arg"),
    [
        (v05b, {"n_max": 2}, "n_max"),
        (v05b, {"unseen_prior": 2.0}, "unseen_prior"),
        (v05b, {"v05_kwargs": {"experimental": False}}, "v05_kwargs"),
    ],
)
def test_bad_hyperparameters(factory: Callable[..., Any], kw: dict[str, Any], arg: str) -> None:
    check_bad_hyperparameters(factory, kw, arg)


@pytest.mark.parametrize("name", ["v05"])
def test_bad_protocol_input(name: str) -> None:
    check_bad_protocol_input(name)


def test_v05budget_bad_prior_and_output() -> None:
    vb = v05b()
    with pytest.raises(InputError, match="prior"):
        vb.set_prior(torch.tensor([1, 2]), torch.tensor([0.5]))
    with pytest.raises(InputError, match="prior"):
        vb.set_prior(torch.tensor([1]), torch.tensor([math.nan]))
    with pytest.raises(InputError, match="output"):
        vb.plan(torch.tensor([1]), 4).consume(torch.zeros(1))


def _with_column(state: dict[str, Any], key: str, value: torch.Tensor) -> dict[str, Any]:
    """A copy of a private-table V05Budget ``state`` with the column ``key`` replaced."""
    out = copy.deepcopy(state)
    out["table"]["rows"]["columns"][f"v05_budget/{key}"] = value
    return out


def test_v05budget_state_refuses_nan_and_negative_counts_naming_the_field() -> None:
    """A NaN reward sum, a negative count, a prior outside [0, 1]: an ``InputError`` naming the field; a prompt
    without a value-model prior (``has_value`` False) is valid."""
    vb = FACTORIES["v05"](0)
    ids = torch.arange(30) * 7 + 1
    _steps(vb, ids, 150, 0, 2)
    vb.set_prior(ids[:5], torch.full((5,), 0.2))
    good = vb.state_dict()
    cols = {k.removeprefix("v05_budget/"): v for k, v in good["table"]["rows"]["columns"].items()}
    assert not bool(cols["has_value"].all()) and bool(cols["has_value"].any())  # some prompts without a prior
    nan_sum = cols["sum"].clone()
    nan_sum[0] = math.nan
    at = "state['table']['rows']['columns']['v05_budget/{}']"
    cases = [
        (_with_column(good, "sum", nan_sum), at.format("sum")),
        (_with_column(good, "count", cols["count"] - 1e6), at.format("count")),
        (_with_column(good, "value", torch.where(cols["has_value"], cols["value"], 1.5)), at.format("value")),
        (_with_column(good, "value", torch.full_like(cols["value"], math.inf)), at.format("value")),
        (_with_column(good, "has_value", cols["has_value"].double()), at.format("has_value")),
    ]
    for bad, arg in cases:
        with pytest.raises(InputError) as err:
            vb.load_state_dict(bad)
        assert err.value.argument == arg
    assert torch.equal(vb.table.state_dict()["columns"]["v05_budget/sum"], cols["sum"])
    fresh = FACTORIES["v05"](0)
    fresh.load_state_dict(good)
    assert torch.equal(fresh.prior(ids), vb.prior(ids))


# -- the prompt table: capacity, sharing, checkpoints -------------------------------------------------------------
def test_v05budget_capacity_evicts_the_least_recently_updated_prompt() -> None:
    vb = v05b(capacity=2, unseen_prior=0.5)
    vb.set_prior(torch.tensor([1]), torch.tensor([0.9], dtype=torch.float64))
    res, _ = run(vb.plan(torch.tensor([2]), 4), table({2: [1.0]}))
    vb.update(res)
    assert vb.prior(torch.tensor([1, 2])).tolist() == [0.9, 1.0]
    vb.set_prior(torch.tensor([3]), torch.tensor([0.2], dtype=torch.float64))  # prompt 1, the least recent, is evicted
    assert vb.table.prompt_ids.tolist() == [2, 3]
    assert vb.prior(torch.tensor([1, 2, 3])).tolist() == [0.5, 1.0, 0.2]  # 1 is unseen again: unseen_prior


def test_v05budget_shared_table_equals_private_tables() -> None:
    """Two V05Budgets ("v05_budget", "v05_budget#2", one with value-model priors) and an AERO on one table; the
    pools overlap, so each sees rows the others added (unseen for it)."""

    def with_priors(t: PromptTable | None) -> V05Budget:
        vb = v05b(n=3, max_extra=2, n_max=6, unseen_prior=0.3, table=t)
        vb.set_prior(torch.arange(0, 40, 4), torch.linspace(0.1, 0.9, 10))
        return vb

    check_shared_table_equals_private(
        [lambda t: v05b(n_max=9, rounds=2, table=t), lambda t: aero(n_max=10, seed=1, table=t), with_priors],
        [torch.arange(30) * 7 + 1, torch.arange(25) * 5, torch.arange(20) * 2],
    )
    with pytest.raises(InputError, match="capacity"):
        v05b(capacity=5, table=PromptTable())
