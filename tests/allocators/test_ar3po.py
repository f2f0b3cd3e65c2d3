"""AR3PO: hand oracles of our reconstruction (see docs/methods/adaptive_alloc.md), hypothesis properties
(budget, caps, determinism, permutation), state round trips and bad input."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators.ar3po import AR3PO, response_key
from rolloutopt.errors import InputError

from .adaptive_helpers import (
    FACTORIES,
    _steps,
    aero,
    ar3po,
    check_bad_hyperparameters,
    check_bad_protocol_input,
    check_budget_caps_and_determinism,
    check_experimental_flag_required,
    check_permutation_permutes_the_plan,
    check_shared_table_equals_private,
    check_state_dict_round_trip_mid_run,
    per_prompt,
    reasons,
    same_state,
)
from .helpers import hashed, run, table


# -- AR3PO oracles --------------------------------------------------------------------------------------------------
def test_ar3po_spec_oracle_stage_counts_and_reuse() -> None:
    a = ar3po(k=4, stages=3)
    # step 0: prompt 1's stage-1 group is [0,0,1,0]: 4 rollouts; prompt 2 is always wrong: 12, no buffer: dropped
    res, reqs = run(a.plan(torch.tensor([1, 2]), 100), table({1: [0, 0, 1, 0], 2: [0]}))
    assert res.counts.tolist() == [4, 12]
    assert reqs == [([1, 2], [4, 4]), ([2], [4]), ([2], [4])]
    assert reasons(res) == {1: "solved", 2: "unsolved_dropped"}
    assert per_prompt(res, res.weight) == {1: 4.0, 2: 0.0}
    assert float(res.metrics["reused"]) == 0 and res.rewards.numel() == 16
    a.update(res)
    ids, keys, rew = a.replay()
    assert ids.tolist() == [1] and keys.tolist() == [int(response_key(0, 2))] and rew.tolist() == [1.0]
    # step 1: prompt 1 is always wrong now: 12 generated + the buffered correct one = a 13-member group
    plan = a.plan(torch.tensor([1, 2]), 100)
    res, _ = run(plan, table({1: [0], 2: [0]}))
    assert res.counts.tolist() == [12, 12] and float(res.metrics["rollouts"]) == 24
    assert reasons(res) == {1: "unsolved_reused", 2: "unsolved_dropped"}
    g1 = res.group == 0
    assert int(g1.sum()) == 13 and float(res.rewards[g1].sum()) == 1.0 and float(res.weight[g1].sum()) == 13.0
    reused = plan.reused()
    assert reused.rows.tolist() == [24] and reused.prompt_ids.tolist() == [1]
    assert reused.keys.tolist() == [2] and int(reused.keys[0]) >> 32 == 0 and int(reused.keys[0]) & 0xFFFFFFFF == 2
    assert float(res.rewards[24]) == 1.0 and int(res.group[24]) == 0


def test_ar3po_all_correct_dropped_or_kept() -> None:
    res, _ = run(ar3po().plan(torch.tensor([3]), 16), table({3: [1]}))
    assert res.counts.tolist() == [4] and reasons(res) == {3: "all_correct"} and res.weight.sum() == 0
    res, _ = run(ar3po(drop_flat=False).plan(torch.tensor([3]), 16), table({3: [1]}))
    assert res.weight.tolist() == [1.0] * 4


def test_ar3po_budget_cut_and_caps() -> None:
    # budget 10, k=4: stage 1 fits prompts 0 and 1 (lowest ids), prompt 2 gets nothing
    res, _ = run(ar3po(k=4, stages=3).plan(torch.tensor([2, 0, 1]), 10), table({0: [0], 1: [1], 2: [0]}))
    assert res.counts.tolist() == [0, 4, 4] and reasons(res) == {2: "no_budget", 0: "cut_dropped", 1: "all_correct"}
    # n_max=6 shortens the second stage to 2
    res, reqs = run(ar3po(k=4, stages=3, n_max=6).plan(torch.tensor([0]), 100), table({0: [0]}))
    assert res.counts.tolist() == [6] and reqs == [([0], [4]), ([0], [2])]


def test_ar3po_cut_prompt_still_reuses() -> None:
    a = ar3po(k=2, stages=2)
    a.update(run(a.plan(torch.tensor([5]), 10), table({5: [1, 0]}))[0])
    res, _ = run(a.plan(torch.tensor([5, 6]), 6), table({5: [0], 6: [0]}))  # stage 2 fits only prompt 5 (lower id)
    assert res.counts.tolist() == [4, 2]
    assert reasons(res) == {5: "unsolved_reused", 6: "cut_dropped"}
    res, _ = run(a.plan(torch.tensor([5, 4]), 4), table({5: [0], 4: [0]}))
    assert reasons(res) == {5: "cut_reused", 4: "cut_dropped"}


def test_ar3po_buffer_bounds() -> None:
    a = ar3po(k=1, stages=1, buffer_size=2)
    for step, ids in enumerate([[1, 2], [3]]):
        a.update(run(a.plan(torch.tensor(ids), 10), table({i: [1] for i in ids}))[0])
        assert a.state_dict()["step"] == step + 1
    assert a.replay()[0].tolist() == [1, 3]  # the newest (3, step 1), then ties at step 0 to the lower id (1)
    b = ar3po(k=1, stages=1, max_age=0)
    b.update(run(b.plan(torch.tensor([1]), 10), table({1: [1]}))[0])
    b.update(run(b.plan(torch.tensor([2]), 10), table({2: [0]}))[0])
    assert b.replay()[0].tolist() == []


def test_ar3po_random_buffer_keys_point_to_correct_rows() -> None:
    a = ar3po(k=8, stages=1, buffer="random", seed=3)
    res, _ = run(a.plan(torch.arange(20), 1000), hashed(1))
    a.update(res)
    ids, keys, rew = a.replay()
    rows = keys & 0xFFFFFFFF
    assert torch.equal(res.prompt_ids[rows], ids) and bool((res.rewards[rows] == 1).all()) and bool((rew == 1).all())
    solved = {int(i) for i, s in per_prompt(res, res.rewards).items() if s > 0}
    assert set(ids.tolist()) == solved


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(["ar3po", "ar3po_latest"]),
    st.lists(st.integers(0, 10**9), min_size=0, max_size=12, unique=True),
    st.integers(0, 120),
    st.integers(0, 50),
)
def test_budget_caps_and_determinism(name: str, ids: list[int], budget: int, seed: int) -> None:
    check_budget_caps_and_determinism(name, ids, budget, seed)


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(["ar3po", "ar3po_latest"]),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=10, unique=True),
    st.integers(0, 100),
    st.randoms(use_true_random=False),
)
def test_permutation_permutes_the_plan(name: str, ids: list[int], budget: int, rnd: Any) -> None:
    check_permutation_permutes_the_plan(name, ids, budget, rnd)


@pytest.mark.parametrize("name", ["ar3po", "ar3po_latest"])
def test_state_dict_round_trip_mid_run(name: str) -> None:
    check_state_dict_round_trip_mid_run(name)


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [AR3PO])
def test_experimental_flag_required(cls: Any) -> None:
    check_experimental_flag_required(cls)


@pytest.mark.parametrize(
    ("factory", "kw", "arg"),
    [
        (ar3po, {"k": 0}, "k"),
        (ar3po, {"n_min": 5}, "n_min"),
        (ar3po, {"n_max": 3}, "n_max"),
        (ar3po, {"buffer": "oldest"}, "buffer"),
        (ar3po, {"reuse": 1}, "reuse"),
        (ar3po, {"success": math.nan}, "success"),
    ],
)
def test_bad_hyperparameters(factory: Callable[..., Any], kw: dict[str, Any], arg: str) -> None:
    check_bad_hyperparameters(factory, kw, arg)


@pytest.mark.parametrize("name", ["ar3po", "ar3po_latest"])
def test_bad_protocol_input(name: str) -> None:
    check_bad_protocol_input(name)


def test_ar3po_reused_before_finish() -> None:
    with pytest.raises(InputError, match=r"plan\.reused"):
        ar3po().plan(torch.tensor([1]), 4).reused()


def test_ar3po_state_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """An infinite buffered reward, a negative key, a negative step counter and keys of a step not before it: an
    ``InputError`` naming the field, and the allocator keeps its own state."""
    a = FACTORIES["ar3po_latest"](0)
    _steps(a, torch.arange(30) * 7 + 1, 150, 0, 3)
    good = a.state_dict()
    cols = good["table"]["rows"]["columns"]
    entry = ~torch.isnan(cols["ar3po/reward"])
    assert int(entry.sum()) >= 1
    inf_r = cols["ar3po/reward"].clone()
    inf_r[entry.nonzero()[-1]] = math.inf
    late = torch.where(entry, cols["ar3po/key"] + (1 << 32), cols["ar3po/key"])  # entries of the last step: step 3

    def with_col(name: str, value: torch.Tensor) -> dict[str, Any]:
        rows = good["table"]["rows"]
        table = {**good["table"], "rows": {**rows, "columns": {**rows["columns"], name: value}}}
        return {**good, "table": table}

    at = "state['table']['rows']['columns']"
    cases = [
        (with_col("ar3po/reward", inf_r), f"{at}['ar3po/reward']"),
        (with_col("ar3po/key", torch.full_like(late, -1)), f"{at}['ar3po/key']"),
        ({**good, "step": -1}, "state['step']"),
        (with_col("ar3po/key", late), f"{at}['ar3po/key']"),
        ({**good, "step": good["step"] - 1}, f"{at}['ar3po/key']"),  # entries of step 2 under step counter 2
    ]
    for bad, arg in cases:
        with pytest.raises(InputError) as err:
            a.load_state_dict(bad)
        assert err.value.argument == arg
        assert same_state(a.state_dict(), good)


# -- the prompt table ------------------------------------------------------------------------------------------------
def test_ar3po_capacity_evicts_the_least_recently_stored() -> None:
    a = ar3po(k=1, stages=1, capacity=2)
    for ids in ([1, 2], [3]):
        a.update(run(a.plan(torch.tensor(ids), 10), table({i: [1] for i in ids}))[0])
    # 1 and 2 were stored together: the tie evicts the smaller id, 1, whose entry is gone
    assert a.replay()[0].tolist() == [2, 3] and a.table.prompt_ids.tolist() == [2, 3]
    res, _ = run(a.plan(torch.tensor([1, 2]), 10), table({1: [0], 2: [0]}))
    assert reasons(res) == {1: "unsolved_dropped", 2: "unsolved_reused"}  # 1 as a never-seen prompt


def test_ar3po_shared_table_equals_private_tables() -> None:
    """Two AR3POs ("ar3po", "ar3po#2", one with a bounded buffer and a maximum age) and an AERO on one table."""
    check_shared_table_equals_private(
        [
            lambda t: ar3po(k=3, stages=3, buffer="random", seed=1, n_max=8, table=t),
            lambda t: aero(n_max=10, seed=1, table=t),
            lambda t: ar3po(k=2, stages=2, buffer_size=6, max_age=1, table=t),
        ],
        [torch.arange(30) * 7 + 1, torch.arange(25) * 5, torch.arange(20) * 3],
    )


def test_ar3po_reused_rows_carry_nan_rollout_signals() -> None:
    """With a token budget (the tokens signal required), the reused response appended to step 1's result has no
    length (NaN, it was not generated this step): every rollout signal covers every row, and the result passes
    the update checks (ResponseLengths skips the NaN row)."""
    from rolloutopt.allocators import ResponseLengths, TokenBudget, run_step

    a, lengths = ar3po(k=4, stages=3), ResponseLengths(prior=10.0)
    plan_rewards = [{1: [0.0, 0.0, 1.0, 0.0], 2: [0.0]}, {1: [0.0], 2: [0.0]}]
    for step, rewards in enumerate(plan_rewards):
        seen: dict[int, int] = {}

        def generate(
            req: Any, rewards: dict[int, list[float]] = rewards, seen: dict[int, int] = seen
        ) -> dict[str, torch.Tensor]:
            vals = []
            for pid, c in zip(req.prompt_ids.tolist(), req.counts.tolist(), strict=True):
                for _ in range(c):
                    k = seen.get(pid, 0)
                    seen[pid] = k + 1
                    vals.append(rewards[pid][k % len(rewards[pid])])
            return {"rewards": torch.tensor(vals, dtype=torch.float64), "tokens": torch.full((req.total,), 5.0)}

        res = run_step(a, torch.tensor([1, 2]), TokenBudget(1000, torch.tensor([10.0, 10.0])), generate)
        lengths.update(res)
        n = int(res.counts.sum())
        assert res.signals["tokens"].shape == res.rewards.shape
        assert bool((res.signals["tokens"][:n] == 5.0).all()) and bool(res.signals["tokens"][n:].isnan().all())
        assert res.rewards.numel() == n + step  # step 1 appends prompt 1's stored correct response
    assert lengths.expected(torch.tensor([1, 2])).tolist() == [5.0, 5.0]
