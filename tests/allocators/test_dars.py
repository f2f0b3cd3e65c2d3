"""DARS: hand oracles, properties, state round trips, bad input.

Oracles computed by hand following the authors' code (``yangzhch6/DARS``
``verl/verl/trainer/ppo/ray_dars_trainer.py``, ``schedule_ET``/``schedule_HW``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators.dars import DARS, dars_extra_rollouts
from rolloutopt.allocators.e3 import E3Budget
from rolloutopt.errors import InputError

from .difficulty_helpers import check_bad_arguments, check_bad_protocol_input, names
from .helpers import hashed, run, table


# -- DARS: the schedule oracle (by hand following yangzhch6/DARS, n = 8) --------------------------------------------
def test_dars_schedule_oracle() -> None:
    acc = torch.tensor([0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0])
    et = dars_extra_rollouts(acc, n=8, n_max=32, schedule="et")
    hw = dars_extra_rollouts(acc, n=8, n_max=64, schedule="hw")
    assert et.tolist() == [24, 11, 3, 1, 0, 0, 0]
    assert hw.tolist() == [56, 24, 8, 3, 0, 0, 0]
    assert et.dtype == torch.long


def test_dars_schedule_std_variant_by_hand() -> None:
    # S = 2 sqrt(a(1-a)), peak n: a = 0.25 -> S = sqrt(3)/2; ET: ceil(8 (1 - S) / S) = ceil(1.2376) = 2
    # HW: ceil((2 * 0.75 * 8 - 8 S) / S) = ceil(12/S - 8) = ceil(5.856) = 6
    a = torch.tensor([0.25])
    assert dars_extra_rollouts(a, n=8, n_max=64, use_std=True).tolist() == [2]
    assert dars_extra_rollouts(a, n=8, n_max=64, schedule="hw", use_std=True).tolist() == [6]


def test_dars_ceil_tolerance() -> None:
    # HW at a = 0.125 is exactly 24 in real arithmetic; a float error must not make it 25
    a = torch.tensor([0.125 + 1e-15])
    assert dars_extra_rollouts(a, n=8, n_max=64, schedule="hw").tolist() == [24]


def test_dars_plan_by_hand() -> None:
    # prompt 5: 1/8 correct (a = .125 -> 11 extras); 6: 4/8 (no extras); 7: 0/8 (24 extras, capped at 32 - 8)
    rew = table({5: [1.0] + [0.0] * 7 + [1.0] * 40, 6: [1.0, 0.0], 7: [0.0]})
    plan = DARS().plan(torch.tensor([7, 5, 6]), 200)
    res, reqs = run(plan, rew)
    assert reqs[0] == ([7, 5, 6], [8, 8, 8])
    assert reqs[1] == ([7, 5], [24, 11])
    assert res.counts.tolist() == [32, 19, 8]
    assert names(res) == ["dropped_all_wrong", "topped_up", "trained"]
    w = res.weight
    assert bool((w[res.prompt_ids == 7] == 0).all()) and bool((w[res.prompt_ids != 7] == 1).all())
    assert float(res.metrics["stage2_rollouts"]) == 35.0


def test_dars_drops_all_correct_pool() -> None:
    res, _ = run(DARS().plan(torch.tensor([1]), 8), table({1: [1.0]}))
    assert names(res) == ["dropped_all_correct"] and float(res.weight.sum()) == 0.0


def test_dars_budget_cut_by_hand() -> None:
    rew = table({5: [1.0] + [0.0] * 7, 6: [1.0, 0.0], 7: [0.0]})
    # stage 1 costs 24; 20 left for wants (5: 11, 7: 24): level L = 10 (10 + 10 = 20), nothing left over
    res, reqs = run(DARS().plan(torch.tensor([5, 6, 7]), 44), rew)
    assert reqs[1] == ([5, 7], [10, 10])
    assert names(res)[0] == "topped_up_budget_cut"
    # 21 left: L = 10 uses 20, the one left goes to the lowest accuracy (prompt 7, a = 0)
    res, reqs = run(DARS().plan(torch.tensor([5, 6, 7]), 45), rew)
    assert reqs[1] == ([5, 7], [10, 11])


def test_dars_short_budget_lowest_ids_first() -> None:
    res, reqs = run(DARS().plan(torch.tensor([30, 10, 20]), 17), table({10: [1.0], 20: [1.0], 30: [1.0]}))
    assert reqs == [([10, 20], [8, 8])]
    assert names(res)[0] == "no_budget" and res.counts.tolist() == [0, 8, 8]


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(0, 12),
    budget=st.integers(0, 400),
    seed=st.integers(0, 50),
    schedule=st.sampled_from(["et", "hw"]),
    n=st.integers(2, 8),
)
def test_dars_properties(p: int, budget: int, seed: int, schedule: str, n: int) -> None:
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(seed))[:p]
    alloc = DARS(n=n, schedule=schedule)
    res, _ = run(alloc.plan(ids, budget), hashed(seed))
    assert int(res.counts.sum()) <= budget
    played = res.counts > 0
    assert bool((res.counts[played] >= n).all()) and bool((res.counts <= alloc.n_max).all())
    # deterministic, and permuting the prompts permutes the plan and nothing else
    perm = torch.randperm(p, generator=torch.Generator().manual_seed(seed + 1))
    res2, _ = run(DARS(n=n, schedule=schedule).plan(ids[perm], budget), hashed(seed))
    assert res2.counts.tolist() == res.counts[perm].tolist()
    assert res2.reasons.tolist() == res.reasons[perm].tolist()
    # unlimited budget: stage 2 gets exactly the schedule's extras
    big, _ = run(DARS(n=n, schedule=schedule).plan(ids, 10_000), hashed(seed))
    if p:
        acc = torch.tensor([sum(hashed(seed)(int(i), k) for k in range(n)) / n for i in ids.tolist()])
        want = dars_extra_rollouts(acc, n=n, n_max=alloc.n_max, schedule=schedule)
        assert big.counts.tolist() == (want + n).tolist()


def test_dars_state_and_update() -> None:
    alloc = DARS(schedule="hw")
    assert alloc.n_max == 64 and alloc.state_dict() == {"format": 1}  # stateless: only the format version
    res, _ = run(alloc.plan(torch.tensor([1, 2]), 64), hashed(0))
    alloc.update(res)
    fresh = DARS(schedule="hw")
    fresh.load_state_dict(alloc.state_dict())
    a, _ = run(alloc.plan(torch.tensor([1, 2]), 64), hashed(0))
    b, _ = run(fresh.plan(torch.tensor([1, 2]), 64), hashed(0))
    assert a.counts.tolist() == b.counts.tolist()


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alloc", [DARS()], ids=["dars"])
def test_bad_protocol_input(alloc: DARS | E3Budget) -> None:
    check_bad_protocol_input(alloc)


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: DARS(n=0), "n"),
        (lambda: DARS(n=8, n_max=4), "n_max"),
        (lambda: DARS(n_min=9), "n_min"),
        (lambda: DARS(schedule="x"), "schedule"),
        (lambda: DARS(upper_threshold=0.0), "upper_threshold"),
        (lambda: DARS(success=float("nan")), "success"),
        (lambda: dars_extra_rollouts(torch.tensor([1.5])), "acc"),
        (lambda: dars_extra_rollouts(torch.tensor([1, 0])), "acc"),
    ],
)
def test_bad_arguments(make: Callable[[], object], arg: str) -> None:
    check_bad_arguments(make, arg)


def test_dars_state_is_only_a_format_version() -> None:
    """Stateless: any key, a non-dict or another format version is refused."""
    alloc = DARS()
    alloc.load_state_dict({})
    for bad, arg in (({"x": 1}, "state"), (None, "state"), ({"format": "1"}, "state['format']")):
        with pytest.raises(InputError) as err:
            alloc.load_state_dict(bad)  # type: ignore[arg-type]
        assert err.value.argument == arg
