"""Knapsack-RL (arXiv 2509.25849) and the shared budget greedy: oracles, transcriptions, properties, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators._budget import _top_units, _top_units_lazy
from rolloutopt.allocators.knapsack import Knapsack, knapsack_value
from rolloutopt.errors import InputError

from .budget_helpers import (
    F64,
    _refused,
    _saved,
    _with,
    check_bad_input,
    check_budget_caps_determinism_permutation,
    check_empty_pool_and_zero_budget,
    check_spends_everything_when_caps_do_not_bind,
    check_state_round_trip_mid_run,
    group_result,
    heap_greedy,
    run,
    seed_history,
)


def test_knapsack_value_and_cost_oracle() -> None:
    v = knapsack_value(torch.tensor([2, 4]), torch.tensor(0.5, dtype=F64))
    assert v.tolist() == [0.5 * 0.125, 0.875 * 0.125]
    cost = Knapsack()._costs(torch.tensor([0.5], dtype=F64))
    assert float(cost) == pytest.approx(math.log(0.1) / math.log(0.5)) and float(cost) == pytest.approx(3.32, 1e-3)
    e = Knapsack(cost="expectation")._costs(torch.tensor([0.5], dtype=F64))
    assert float(e) == pytest.approx(3.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0, 2.0]), min_size=0, max_size=5), max_size=6),
    st.integers(0, 35),
)
def test_top_units_equals_heap(rows: list[list[float]], r: int) -> None:
    length = 5
    gains = [sorted(row + [0.0] * (length - len(row)), reverse=True) for row in rows]  # ties galore
    got = _top_units(torch.tensor(gains, dtype=F64).reshape(len(gains), length), r)
    assert got.tolist() == heap_greedy(gains, r)


# -- Knapsack ---------------------------------------------------------------------------------------------------------
def dp_reference(p: list[float], min_n: int, k_max: int, budget: int, zero: bool) -> tuple[float, int]:
    """A transcription of ``solve_by_dp`` (the exact-budget table); returns (objective, units placed)."""
    e = len(p)

    def val(k: int, x: float) -> float:
        nn = k + min_n
        return (1 - x**nn - (1 - x) ** nn) * x * (1 - x) ** 2

    dp = np.full((e + 1, budget + 1), -np.inf)
    dp[0, 0] = 0.0
    for i in range(1, e + 1):
        x = p[i - 1]
        for w in range(budget + 1):
            base = 0.0 if zero else val(0, x)
            if dp[i - 1, w] + base > dp[i, w]:
                dp[i, w] = dp[i - 1, w] + base
            for k in range(1, min(k_max + 1, w + 1)):
                if dp[i - 1, w - k] == -np.inf:
                    continue
                cand = dp[i - 1, w - k] + val(k, x)
                if cand > dp[i, w]:
                    dp[i, w] = cand
    w = budget
    while w > 0 and dp[e, w] == -np.inf:
        w -= 1
    return float(dp[e, w]), w


def objective(p: list[float], extra: list[int], min_n: int, zero: bool) -> float:
    out = 0.0
    for x, k in zip(p, extra, strict=True):
        if k > 0 or not zero:
            nn = k + min_n
            out += (1 - x**nn - (1 - x) ** nn) * x * (1 - x) ** 2
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 15), min_size=1, max_size=6),
    st.integers(0, 30),
    st.sampled_from([(2, 6), (2, 10), (1, 4), (3, 3)]),
    st.sampled_from(["value", "zero"]),
)
def test_knapsack_greedy_solves_the_dp(succ16: list[int], units: int, caps: tuple[int, int], mode: str) -> None:
    n_min, n_max = caps
    k = Knapsack(n=n_min, n_min=n_min, n_max=n_max, no_extra=mode)  # type: ignore[arg-type]
    p = [s / 16 for s in succ16]
    extra = _top_units(k.gains(torch.tensor(p, dtype=F64)), units).tolist()
    best, placed = dp_reference(p, n_min, n_max - n_min, units, mode == "zero")
    assert sum(extra) == placed
    assert objective(p, extra, n_min, mode == "zero") == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert all(0 <= x <= n_max - n_min for x in extra)


def test_knapsack_quirk_changes_the_split() -> None:
    # p = 0.5 and p = 0.1, two extra units. Fix (k = 0 scored V(2, p)): marginal gains p(1-p)^2 (p^N q + q^N p):
    # p = 0.5: 0.125 * 0.25 = 0.03125, then 0.125 * 0.125 = 0.015625; p = 0.1: 0.081 * 0.09 = 0.00729.
    # -> both units to p = 0.5. Quirk (k = 0 scored 0): the first unit of p = 0.1 is worth V(3, 0.1) =
    # 0.081 * 0.27 = 0.02187 > 0.015625 -> one unit each.
    p = torch.tensor([0.5, 0.1], dtype=F64)
    g = Knapsack(no_extra="value").gains(p)
    assert g[0, :2].tolist() == pytest.approx([0.03125, 0.015625]) and float(g[1, 0]) == pytest.approx(0.00729)
    assert float(Knapsack(no_extra="zero").gains(p)[1, 0]) == pytest.approx(0.02187)
    assert _top_units(g, 2).tolist() == [2, 0]
    assert _top_units(Knapsack(no_extra="zero").gains(p), 2).tolist() == [1, 1]


def test_knapsack_hand_example() -> None:
    # ids 0 (p = 1/2, effective), 1 (p = 0), 2 (p = 1), 3 (never seen); n = 8, n_min = 2, budget 32.
    # min_rewards=1: the seeded groups have 2 rewards, below the code's default min_buffer_length = 8 (with the
    # default every prompt here would be "unseen"); this example tests the allocation, not the estimate
    k = Knapsack(n=8, n_min=2, n_max=128, min_rewards=1)
    seed_history(k, [1, 0, 2, 0], [2, 2, 2, 0])
    # base 2 + 2 + 2 + 8 = 14, leftover 18; need int(min(128, ln 0.1 / ln 0.5)) = 3 < 18: the surplus 15 goes to
    # the p = 0 prompts {1, 3} (a never-seen prompt counts, as in the code): 8 and 7; the DP places 3 on id 0.
    plan = k.plan(torch.tensor([0, 1, 2, 3]), 32)
    assert plan.counts.tolist() == [5, 10, 2, 15]
    res = run(plan, lambda r: torch.zeros(r.total, dtype=F64))
    assert [res.reason_of(i) for i in range(4)] == ["effective", "surplus", "solved", "surplus"]


def test_knapsack_no_effective_and_short_budget() -> None:
    k = Knapsack(n=4, n_min=2, n_max=16, min_rewards=1)  # groups of 3 rewards: valid only with min_rewards <= 3
    seed_history(k, [0, 3, 0], [3, 3, 3])  # p = 0, 1, 0
    # base 2 each, leftover 10 to the p = 0 prompts 0 and 2: 5 each
    assert k.plan(torch.tensor([0, 1, 2]), 16).counts.tolist() == [7, 2, 7]
    # below the base (6): the first 5 // 2 = 2 prompts by id get 2, the last unit to the first
    assert k.plan(torch.tensor([2, 1, 0]), 5).counts.tolist() == [0, 2, 3]
    # caps: the surplus stops at n_max, the rest stays unused
    c = k.plan(torch.tensor([0, 1, 2]), 100).counts
    assert c.tolist() == [16, 2, 16]


def test_knapsack_estimate_follows_the_code_by_hand() -> None:
    """The per-prompt estimate follows liziniu/KnapsackRL@ca5d5f5b7e933378d916d05d1aeb4ae9de929ee5,
    ``verl/utils/dataset/rl_dataset.py``: ``update_sample_state`` (``epoch_estimation`` and
    ``robust_epoch_estimation`` on, as ``examples/knapsack_trainer/run_knapsack_grpo_7b.sh``) sets the rate to the
    group mean when the group has >= ``reward_buffer_length`` = 16 rewards, else to the mean of the last 16 rewards
    (newest first across groups); ``get_sample_state`` marks a prompt valid once its total count is >=
    ``min_buffer_length`` = 8. ``verl/trainer/ppo/exploration_utils.py`` gives an invalid prompt ``n``."""
    k = Knapsack(n=8, n_min=2, n_max=128)
    assert (k.reward_window, k.min_rewards) == (16, 8)
    ids = torch.arange(3)
    # epoch 1: 4 rewards each (prompt 0: 1 1 0 0; prompt 1: 0 0 0 0; prompt 2: 1 0 0 0): totals 4 < 8, not valid
    k.update(group_result([2, 0, 1], [4, 4, 4]))
    valid, p = k.estimates(ids)
    assert valid.tolist() == [False, False, False] and p.tolist() == [0.0, 0.0, 0.0]
    assert k.plan(ids, 24).counts.tolist() == [8, 8, 8]  # all "unseen": n each
    # epoch 2: prompt 0 gets 4 more (1 1 1 1): total 8, valid, p = mean of its 8 rewards = 6/8 (the last group
    # alone would say 1.0); prompt 1 gets 16 (4 successes): a full window, p = 4/16 = 0.25; prompt 2 gets 2 (1 0):
    # total 6 < 8, still not valid
    k.update(group_result([4, 4, 1], [4, 16, 2]))
    valid, p = k.estimates(ids)
    assert valid.tolist() == [True, True, False]
    assert p.tolist() == [0.75, 0.25, 0.0]
    # epoch 3: prompt 0 gets 10 (0 x 10: successes-first helper with 0 successes): the last 16 rewards are these 10
    # and the newest 6 of the 8 before (1 1 1 1, then 0 0 of "1 1 0 0" read newest first): 4/16 = 0.25.
    # Prompt 1 gets 4 (all successes): the 4 plus the newest 12 of the 16 before. The 16 were "1 1 1 1 0 x 12"
    # in observation order, so the newest 12 are all 0: 4/16 = 0.25.
    k.update(group_result([0, 4, 0], [10, 4, 0]))
    valid, p = k.estimates(ids)
    assert valid.tolist() == [True, True, False]
    assert p.tolist() == [0.25, 0.25, 0.0]
    # the counts of a plan now differ from the last-group rule: prompt 0 is effective at p = 0.25 (its last group
    # alone was all 0: "unsolved"), prompt 1 at p = 0.25 (last group all 1: "solved")
    plan = k.plan(ids, 24)
    old = Knapsack(n=8, n_min=2, n_max=128, reward_window=1, min_rewards=1)
    old.update(group_result([2, 0, 1], [4, 4, 4]))
    old.update(group_result([4, 4, 1], [4, 16, 2]))
    old.update(group_result([0, 4, 0], [10, 4, 0]))
    assert old.estimates(ids)[1].tolist() == [0.0, 1.0, 0.5]  # the last group's rate, valid from the first group
    # p = (0.25, 0.25, invalid): base 2 + 2 + 8 = 12, leftover 12; need 2 * int(ln 0.1 / ln 0.75) = 2 * 8 = 16 >= 12,
    # no surplus: the DP gives the 12 extra units to the two equal effective items, 6 each
    assert plan.counts.tolist() == [8, 8, 8]
    # the reasons: effective, effective, unseen
    names = Knapsack.reason_names
    assert [names[int(r)] for r in plan._reasons] == ["effective", "effective", "unseen"]


def test_knapsack_reward_store_round_trip_and_bad_state() -> None:
    a = Knapsack(n=4, n_min=2, n_max=12)
    for step in range(3):
        a.update(group_result([step, 3, min(1, step)], [6, 6, 4 * step]))
    state = a.state_dict()
    b = Knapsack(n=4, n_min=2, n_max=12)
    b.load_state_dict(state)
    ids = torch.arange(3)
    assert [t.tolist() for t in a.estimates(ids)] == [t.tolist() for t in b.estimates(ids)]
    a.update(group_result([5, 0, 2], [5, 2, 7]))
    b.update(group_result([5, 0, 2], [5, 2, 7]))
    assert torch.equal(a.table.prompt_ids, b.table.prompt_ids)
    for key in ("tail", "filled", "total", "rate"):
        assert torch.equal(a._cols[key], b._cols[key])
    rows = state["table"]["rows"]
    cases = [
        ({"knapsack/tail": torch.zeros(3, 4, dtype=torch.bool)}, "knapsack/tail"),
        ({"knapsack/rate": [0.0, 0.0, 0.0]}, "knapsack/rate"),
        ({"knapsack/filled": torch.tensor([0, 17, 0])}, "knapsack/filled"),
    ]
    for change, field in cases:
        broken = dict(state, table={**state["table"], "rows": {**rows, "columns": {**rows["columns"], **change}}})
        with pytest.raises(InputError, match=field):
            Knapsack(n=4, n_min=2, n_max=12).load_state_dict(broken)
    unsorted = dict(state, table={**state["table"], "rows": {**rows, "prompt_ids": torch.tensor([1, 0, 2])}})
    with pytest.raises(InputError, match="prompt_ids"):
        Knapsack(n=4, n_min=2, n_max=12).load_state_dict(unsorted)
    with pytest.raises(InputError, match="rows"):
        Knapsack(n=4, n_min=2, n_max=12).load_state_dict(dict(state, table={"owner": "knapsack", "rows": {"tail": 1}}))
    with pytest.raises(InputError, match="reward_window"):
        Knapsack(reward_window=0)
    with pytest.raises(InputError, match="min_rewards"):
        Knapsack(min_rewards=-1)


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["knapsack"]),
    st.lists(st.integers(0, 10**12), min_size=1, max_size=15, unique=True),
    st.integers(0, 150),
    st.integers(0, 2**31),
    st.data(),
)
def test_budget_caps_determinism_permutation(
    kind: str, ids: list[int], budget: int, seed: int, data: st.DataObject
) -> None:
    check_budget_caps_determinism_permutation(kind, ids, budget, seed, data)


@pytest.mark.parametrize("kind", ["knapsack"])
def test_state_round_trip_mid_run(kind: str) -> None:
    check_state_round_trip_mid_run(kind)


def test_knapsack_load_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """NaN in a finite field, negative counters, more filled than the window or the total, repeated ids: an
    ``InputError`` naming the field (nested path); nothing changes."""
    _, good = _saved("knapsack")
    ids = good["table"]["rows"]["prompt_ids"]
    m = ids.numel()
    at = ("table", "rows", "columns")
    name = "state['table']['rows']['columns']"
    total = good["table"]["rows"]["columns"]["knapsack/total"]
    cases = [
        ((*at, "knapsack/rate"), torch.full((m,), math.nan, dtype=F64), f"{name}['knapsack/rate']"),
        ((*at, "knapsack/rate"), torch.full((m,), 1.5, dtype=F64), f"{name}['knapsack/rate']"),
        ((*at, "knapsack/total"), torch.full((m,), -1), f"{name}['knapsack/total']"),
        ((*at, "knapsack/filled"), torch.full((m,), -1), f"{name}['knapsack/filled']"),
        ((*at, "knapsack/filled"), total + 1, f"{name}['knapsack/filled']"),  # more filled than seen
        (("step",), -2, "state['step']"),
        (("table", "rows", "prompt_ids"), torch.cat([ids[:-1], ids[:1]]), "state['table']['rows']['prompt_ids']"),
    ]
    for path, value, argument in cases:
        _refused("knapsack", _with(good, path, value), argument)


@pytest.mark.parametrize("kind", ["knapsack"])
def test_empty_pool_and_zero_budget(kind: str) -> None:
    check_empty_pool_and_zero_budget(kind)


# -- bad input --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["knapsack"])
def test_bad_input(kind: str) -> None:
    check_bad_input(kind)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 80), st.integers(1, 4), st.integers(0, 2**31))
def test_lazy_columns_equal_the_full_table(rows: int, length: int, r: int, first: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, 4, (rows, length), generator=g).double().sort(dim=1, descending=True).values
    got = _top_units_lazy(lambda cols: full[:, :cols], length, r, first=first)
    assert got.tolist() == _top_units(full, r).tolist() == heap_greedy(full.tolist(), r)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["knapsack"]),
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=10),
    st.integers(0, 300),
)
def test_spends_everything_when_caps_do_not_bind(kind: str, groups: list[tuple[int, int]], budget: int) -> None:
    check_spends_everything_when_caps_do_not_bind(kind, groups, budget)


# -- the prompt table -------------------------------------------------------------------------------------------------
def test_knapsack_capacity_evicts_the_least_recently_updated() -> None:
    k = Knapsack(n=8, n_min=2, n_max=128, min_rewards=1, capacity=2)
    k.update(group_result([1, 0], [2, 2]))  # ids 0 (p = 1/2) and 1 (p = 0)
    k.update(group_result([2], [2], first=2))  # id 2 (p = 1): the tie of 0 and 1 evicts the smaller id, 0
    assert k.table.prompt_ids.tolist() == [1, 2]
    valid, p = k.estimates(torch.arange(3))
    assert valid.tolist() == [False, True, True] and p.tolist() == [0.0, 0.0, 1.0]
    fresh = Knapsack(n=8, n_min=2, n_max=128, min_rewards=1)
    fresh.update(group_result([2], [2], first=2))
    fresh.update(group_result([0], [2], first=1))
    assert k.plan(torch.arange(3), 40).counts.tolist() == fresh.plan(torch.arange(3), 40).counts.tolist()
