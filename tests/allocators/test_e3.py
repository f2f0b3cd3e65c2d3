"""E3Budget and the E3 temperature schedule: hand oracles, properties, state round trips, bad input.

Oracles computed by hand following the authors' code (``LiaoMengqi/E3-RL4LLMs``
``e3/trainer/ray_trainer.py`` ``get_rollout_n_per_prompt``, ``e3/worker/temperature_scheduler.py``)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators.dars import DARS
from rolloutopt.allocators.depo import DEPO
from rolloutopt.allocators.e3 import E3Budget, E3Temperature, e3_counts, e3_temperature_step
from rolloutopt.allocators.table import PromptTable
from rolloutopt.errors import InputError

from .difficulty_helpers import check_bad_arguments, check_bad_protocol_input, names
from .helpers import hashed, run, same_state, table
from .table_helpers import check_shared_table, in_turn

COLUMNS = "state['table']['rows']['columns']"  # where a private table's columns are in an E3Budget state


def with_rows(alloc: E3Budget, ids: torch.Tensor, **columns: torch.Tensor) -> dict[str, Any]:
    """``alloc.state_dict()`` with its private table holding the sorted ``ids``, known to E3Budget, with these
    columns (``sum``, ``count``, ``rank``)."""
    state = copy.deepcopy(alloc.state_dict())
    rows = state["table"]["rows"]
    m = ids.numel()
    rows.update(prompt_ids=ids, touch=torch.zeros(m, dtype=torch.long), clock=0)
    rows["columns"] = {"e3_budget/seen": torch.ones(m, dtype=torch.bool)}
    rows["columns"].update({f"e3_budget/{k}": v for k, v in columns.items()})
    return state


def column(state: dict[str, Any], name: str) -> torch.Tensor:
    """Column ``name`` of the private table in an E3Budget state."""
    out: torch.Tensor = state["table"]["rows"]["columns"][f"e3_budget/{name}"]
    return out


def with_column(state: dict[str, Any], name: str, value: torch.Tensor) -> dict[str, Any]:
    out = copy.deepcopy(state)
    out["table"]["rows"]["columns"][f"e3_budget/{name}"] = value
    return out


# -- E3: allocation oracles (by hand following E3's code, n_min = 4, n_max = 12, N_total = 32) --------------------
@pytest.mark.parametrize("cap_share", [True, False])
def test_e3_counts_oracle(cap_share: bool) -> None:
    kw = {"cap_share": cap_share}
    assert e3_counts(torch.tensor([0.0, 0.25, 0.5, 0.75]), 32, 4, 12, **kw).tolist() == [4, 6, 10, 12]
    assert e3_counts(torch.tensor([-100.0, -100.0, 0.5, 0.5]), 32, 4, 12, **kw).tolist() == [4, 4, 12, 12]
    assert e3_counts(torch.tensor([0.0, 1 / 3, 2 / 3]), 24, 4, 12, **kw).tolist() == [4, 8, 12]


def test_e3_share_cap_quirk_by_hand() -> None:
    rank = torch.tensor([0.0, 0.0, 0.0, 0.9])
    # the code: spare 24 all to the one ranked prompt: floor(24 * .9 / (.9 + 1e-8)) = 23 -> 27 > n_max; the one
    # unit left goes to the first prompt with headroom in descending rank (ties: earlier row) -> row 0
    assert e3_counts(rank, 40, 4, 12, cap_share=False).tolist() == [5, 4, 4, 27]
    # fixed: the share stops at n_max - n_min = 8; the 16 left fill rows 0, 1 (rank 0, earlier rows first)
    assert e3_counts(rank, 40, 4, 12).tolist() == [12, 12, 4, 12]


def test_e3_water_filling_by_hand() -> None:
    # weights [3, 1, 1], spare 12, head 5: proportional 7.2 > 5 -> cap row 0; 7 left over weight 2 -> 3.5 each
    # -> floors [5, 3, 3] = 11, the leftover unit to row 1 (equal rank, earlier row)
    assert e3_counts(torch.tensor([0.75, 0.25, 0.25]), 24, 4, 9).tolist() == [9, 8, 7]


def test_e3_budget_flow_by_hand() -> None:
    alloc = E3Budget(n=8, n_low=4, n_high=12, n_update=2)
    ids = torch.tensor([40, 10, 30, 20])
    res, reqs = run(
        alloc.plan(ids, 32), table({10: [1.0], 20: [1.0, 1.0, 1.0, 0.0], 30: [1.0, 0.0], 40: [0.0, 0.0, 0.0, 1.0]})
    )
    assert reqs == [([40, 10, 30, 20], [8, 8, 8, 8])]  # epoch 1: caps at n
    assert set(names(res)) == {"unseen"}
    alloc.update(res)
    alloc.end_epoch()
    # means 10: 1, 20: .75, 30: .5, 40: .25 -> ranks 0, .25, .5, .75; caps 6 / 10
    assert alloc.ranks(torch.tensor([10, 20, 30, 40, 99])).tolist() == [0.0, 0.25, 0.5, 0.75, -100.0]
    assert (alloc.n_min, alloc.n_max) == (6, 10)
    # spare 8 by weight (sum 1.5): 0, 1.33, 2.67, 4 -> floors 0, 1, 2, 4; leftover 1: 40 is at 10, so 30 gets it
    res, reqs = run(alloc.plan(ids, 32), hashed(0))
    assert reqs[0] == ([40, 10, 30, 20], [10, 6, 9, 7])
    assert names(res) == ["capped", "unseen", "ranked", "ranked"]
    alloc.update(res)
    alloc.end_epoch()
    assert (alloc.n_min, alloc.n_max) == (4, 12) and alloc.epoch == 2


def test_e3_unseen_prompts_ranked_like_the_code_with_dataset_ids() -> None:
    """Prompts not rolled out by the epoch end: the code ranks them as mean reward 0, over the data-set size.

    ``LiaoMengqi/E3-RL4LLMs@7e90b8e9a4901e5f99d4a11523c6123e41344816``, ``e3/data/rl_dataset.py``: ``prompt_stats``
    holds every data-set row (rank -100, sum 0, count 0); ``update_rank`` sorts all rows by ``total_reward /
    sample_count`` (0 when ``sample_count == 0``), ``reverse=True`` (stable: ties keep row order) and sets
    ``rank = index / len(sorted_prompts)``. ``e3/trainer/ray_trainer.py``, ``get_rollout_n_per_prompt``:
    ``floor((N - P n_min) * rank / (sum(rank) + 1e-8))`` then the leftover by descending rank up to ``n_max``.
    """
    data = table({0: [1.0], 1: [0.0], 2: [1.0, 0.0]})  # means 1, 0, .5; rows 3 and 4 never rolled out
    code = E3Budget(n=4, n_low=2, n_high=6, n_update=2, cap_share=False, dataset_ids=torch.arange(5))
    ours = E3Budget(n=4, n_low=2, n_high=6, n_update=2, cap_share=False)
    for alloc in (code, ours):
        res, _ = run(alloc.plan(torch.tensor([0, 1, 2]), 12), data)
        alloc.update(res)
        alloc.end_epoch()
    # code: keys [1, 0, .5, 0, 0] -> sorted rows [0, 2, 1, 3, 4] -> ranks 0/5, 2/5, 1/5, 3/5, 4/5
    assert code.ranks(torch.arange(5)).tolist() == [0.0, 0.4, 0.2, 0.6, 0.8]
    # known prompts only (the default): K = 3, rows 3 and 4 keep -100 until an epoch end that knows them
    assert ours.ranks(torch.arange(5)).tolist() == [0.0, 2 / 3, 1 / 3, -100.0, -100.0]
    # caps 2 / 6, N = 4 * 5 = 20: spare 10, shares 10 * [0, .4, .2, .6, .8] / (2 + 1e-8) floor to [0, 1, 0, 2, 3]
    # (the 1e-8 pushes exact quotients below), counts [2, 3, 2, 4, 5] = 16; leftover 4 by descending rank:
    # row 4 +1 (to 6), row 3 +2 (to 6), row 1 +1 -> [2, 4, 2, 6, 6]
    _, reqs = run(code.plan(torch.arange(5), 20), hashed(0))
    assert reqs == [([0, 1, 2, 3, 4], [2, 4, 2, 6, 6])]
    _, reqs = run(ours.plan(torch.arange(5), 20), hashed(0))
    # -100 weighs 0: shares 10 * [0, 2/3, 1/3] / (1 + 1e-8) floor to [0, 6, 3] -> [2, 8, 5, 2, 2] (row 1 above
    # n_max: the code's uncapped share, cap_share=False); the leftover 1 goes to row 2 (row 1 has no headroom)
    assert reqs == [([0, 1, 2, 3, 4], [2, 8, 6, 2, 2])]
    with pytest.raises(InputError, match="dataset_ids"):
        E3Budget(dataset_ids=torch.tensor([1, 1]))


def test_e3_short_budget_hardest_first() -> None:
    alloc = E3Budget(n=4, n_low=4, n_high=4, n_update=0)
    alloc.load_state_dict(
        {
            **with_rows(
                alloc,
                torch.tensor([1, 2, 3]),
                sum=torch.zeros(3, dtype=torch.float64),
                count=torch.ones(3, dtype=torch.long),
                rank=torch.tensor([0.0, 2 / 3, 1 / 3], dtype=torch.float64),
            ),
            "n_min": 4,
            "n_max": 4,
            "epoch": 1,
            "steps": 1,
        }
    )
    res, _ = run(alloc.plan(torch.tensor([1, 2, 3]), 9), hashed(0))
    assert res.counts.tolist() == [0, 4, 4] and names(res)[0] == "no_budget"


def test_e3_steps_per_epoch() -> None:
    alloc = E3Budget(steps_per_epoch=2)
    for k in range(2):
        assert alloc.epoch == 0
        res, _ = run(alloc.plan(torch.tensor([1, 2]), 16), hashed(k))
        alloc.update(res)
    assert alloc.epoch == 1 and (alloc.n_min, alloc.n_max) == (6, 10)


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(1, 12),
    extra=st.integers(0, 150),
    seed=st.integers(0, 50),
    cap_share=st.booleans(),
)
def test_e3_properties(p: int, extra: int, seed: int, cap_share: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    alloc = E3Budget(steps_per_epoch=1, cap_share=cap_share)
    ids = torch.randperm(500, generator=g)[:p]
    res, _ = run(alloc.plan(ids, 8 * p), hashed(seed))
    alloc.update(res)  # epoch 1 ends: caps 6 / 10, ranks for all
    budget = 6 * p + extra
    res, _ = run(alloc.plan(ids, budget), hashed(seed + 1))
    total = int(res.counts.sum())
    assert total <= budget
    if cap_share:
        assert total == min(budget, 10 * p)
        assert bool((res.counts >= 6).all()) and bool((res.counts <= 10).all())
    perm = torch.randperm(p, generator=g)
    twin = E3Budget(steps_per_epoch=1, cap_share=cap_share)
    run_first, _ = run(twin.plan(ids, 8 * p), hashed(seed))
    twin.update(run_first)
    res2, _ = run(twin.plan(ids[perm], budget), hashed(seed + 1))
    assert res2.counts.tolist() == res.counts[perm].tolist()
    assert res2.reasons.tolist() == res.reasons[perm].tolist()


def test_e3_state_round_trip_mid_run() -> None:
    ids = torch.arange(20) * 7
    a = E3Budget(steps_per_epoch=2)
    for k in range(3):
        a.update(run(a.plan(ids[k:], 8 * (20 - k)), hashed(k))[0])
    b = E3Budget(steps_per_epoch=2)
    b.load_state_dict(a.state_dict())
    for k in range(3, 7):
        ra, rqa = run(a.plan(ids, 9 * 20), hashed(k))
        rb, rqb = run(b.plan(ids, 9 * 20), hashed(k))
        assert rqa == rqb and ra.reasons.tolist() == rb.reasons.tolist()
        a.update(ra)
        b.update(rb)
    assert same_state(a.state_dict(), b.state_dict())


# -- E3 temperature ------------------------------------------------------------------------------------------------
def test_temperature_rule_by_hand() -> None:
    v = 100
    f = math.log(100) + math.log(math.log(100))
    assert e3_temperature_step(1.0, 2.0, 2.0, v) == 1.0  # on target: unchanged
    assert e3_temperature_step(0.5, 2.0, 1.0, v) == pytest.approx(0.5 * (1 + 0.5 * math.log(2) / f))
    sched = E3Temperature(vocab_size=v, t_min=None, t_max=None)
    assert sched.step(2.0) == 1.0 and sched.target_entropy is None  # step 1 only records
    t = sched.step(torch.tensor([1.0, 1.0]))  # H* = 2, H = 1 -> T = 1 + ln 2 / f
    assert sched.target_entropy == 2.0 and t == pytest.approx(1 + math.log(2) / f)


def test_temperature_clipping_and_annealing() -> None:
    sched = E3Temperature(vocab_size=100, target_entropy=1.0, init_steps=1, t_max=1.05)
    sched.step(1.0)
    assert sched.step(0.01) == 1.05  # far below target: the rule would jump to 1 + ln(100)/f > 1.05
    ann = E3Temperature(vocab_size=100, target_entropy=2.0, max_steps=10, t_min=None, t_max=None)
    targets = []
    for _ in range(10):
        ann.step(2.0)
        targets.append(ann.target_entropy)
    # annealing starts at step 10 - int(10 * 0.4) = 6; target after step s: 2 * (.9 + .1 * .5 (1 + cos(pi (s-6)/4)))
    assert targets[:5] == [2.0] * 5
    for s in range(6, 11):
        assert targets[s - 1] == pytest.approx(2 * (0.9 + 0.05 * (1 + math.cos(math.pi * (s - 6) / 4))))
    assert targets[-1] == pytest.approx(1.8)


def test_temperature_state_round_trip() -> None:
    a = E3Temperature(vocab_size=1000)
    for h in (1.0, 0.8, 0.9):
        a.step(h)
    b = E3Temperature(vocab_size=1000)
    b.load_state_dict(a.state_dict())
    for h in (0.7, 1.2, 1.1):
        assert a.step(h) == b.step(h)


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alloc", [E3Budget()], ids=["e3_budget"])
def test_bad_protocol_input(alloc: DARS | E3Budget) -> None:
    check_bad_protocol_input(alloc)


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: E3Budget(n=4, n_low=5), "n_min"),
        (lambda: E3Budget(n_high=6), "n_high"),
        (lambda: E3Budget(n_max=13), "n_max"),
        (lambda: E3Budget(cap_share=1), "cap_share"),
        (lambda: E3Budget(steps_per_epoch=0), "steps_per_epoch"),
        (lambda: E3Temperature(vocab_size=2), "vocab_size"),
        (lambda: E3Temperature(vocab_size=100, t_min=2.0, t_max=1.0), "t_max"),
        (lambda: E3Temperature(vocab_size=100, init_steps=0), "init_steps"),
        (lambda: E3Temperature(vocab_size=100).step(-1.0), "entropy"),
        (lambda: e3_counts(torch.tensor([0.5, 2.0]), 32, 4, 12), "rank"),
        (lambda: e3_counts(torch.tensor([0.5, 0.2]), 7, 4, 12), "budget"),
        (lambda: e3_temperature_step(1.0, 1.0, 0.0, 100), "entropy"),
    ],
)
def test_bad_arguments(make: Callable[[], object], arg: str) -> None:
    check_bad_arguments(make, arg)


def test_e3_budget_state_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """NaN in a reward sum or a rank, a negative count or epoch, a rank outside [0, 1) (other than -100) and caps
    outside ``[n_low, n_high]``: an ``InputError`` naming the field, and the allocator keeps its own state."""
    alloc = E3Budget(n=4, n_low=2, n_high=8, steps_per_epoch=2)
    for s in range(3):
        res, _ = run(alloc.plan(torch.arange(6) + 3 * s, 30), hashed(s))
        alloc.update(res)
    good = alloc.state_dict()
    rank = column(good, "rank")
    assert bool((rank == -100).any()) and bool((rank >= 0).any())
    nan = column(good, "sum").clone()
    nan[0] = math.nan
    cases = [
        (with_column(good, "sum", nan), f"{COLUMNS}['e3_budget/sum']"),
        (with_column(good, "rank", torch.full_like(rank, math.nan)), f"{COLUMNS}['e3_budget/rank']"),
        (with_column(good, "rank", rank + 1.0), f"{COLUMNS}['e3_budget/rank']"),
        (with_column(good, "count", -column(good, "count") - 1), f"{COLUMNS}['e3_budget/count']"),
        ({**good, "epoch": -1}, "state['epoch']"),
        ({**good, "steps": -3}, "state['steps']"),
        ({**good, "n_min": 1}, "state['n_min']"),
        ({**good, "n_max": 9}, "state['n_max']"),
        ({**good, "n_min": good["n_max"] + 1}, "state['n_max']"),
    ]
    for bad, arg in cases:
        with pytest.raises(InputError) as err:
            alloc.load_state_dict(bad)
        assert err.value.argument == arg
    assert same_state(alloc.state_dict(), good) and good["epoch"] == 1


def test_e3_temperature_state_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """A NaN temperature or target, a non-positive step counter, a bad recorded entropy: an ``InputError`` naming
    the field, the schedule unchanged; a state round-trips."""
    sched = E3Temperature(vocab_size=100, init_steps=2)
    for h in (1.0, 1.2, 0.9):
        sched.step(h)
    good = sched.state_dict()
    assert good["format"] == 1 and good["init_entropy"] == [1.0, 1.2]
    cases = [
        ({**good, "temperature": math.nan}, "state['temperature']"),
        ({**good, "target_entropy": math.nan}, "state['target_entropy']"),
        ({**good, "initial_target": -1.0}, "state['initial_target']"),
        ({**good, "steps": -1}, "state['steps']"),
        ({**good, "steps": 0}, "state['steps']"),
        ({**good, "init_entropy": [1.0, math.nan]}, "state['init_entropy']"),
        ({**good, "init_entropy": "1.0"}, "state['init_entropy']"),
        ({**good, "surprise": 1}, "state"),
    ]
    for bad, arg in cases:
        with pytest.raises(InputError) as err:
            sched.load_state_dict(bad)
        assert err.value.argument == arg
    assert sched.state_dict() == good
    fresh = E3Temperature(vocab_size=100, init_steps=2)
    fresh.load_state_dict(good)
    assert fresh.step(1.1) == sched.step(1.1)


# -- the prompt table ---------------------------------------------------------------------------------------------
def test_e3_capacity_evicts_the_least_recently_updated_prompt() -> None:
    """capacity=2: a third prompt evicts the least recently updated one, which is then unknown again (rank -100
    until an epoch end, reward sum and count from zero when it comes back); K counts the stored prompts."""
    alloc = E3Budget(n=4, n_low=4, n_high=4, n_update=0, capacity=2)
    rewards = table({1: [1.0], 2: [0.0], 3: [1.0, 0.0]})
    for p in (1, 2, 3):
        alloc.update(run(alloc.plan(torch.tensor([p]), 4), rewards)[0])
    assert alloc.table.prompt_ids.tolist() == [2, 3]  # 1 was updated least recently
    alloc.end_epoch()  # K = 2: 3 (mean .5) then 2 (mean 0)
    assert alloc.ranks(torch.tensor([1, 2, 3])).tolist() == [-100.0, 0.5, 0.0]
    alloc.update(run(alloc.plan(torch.tensor([1]), 4), rewards)[0])  # back: evicts 2
    assert alloc.table.prompt_ids.tolist() == [1, 3]
    assert alloc.ranks(torch.tensor([1, 2, 3])).tolist() == [-100.0, -100.0, 0.0]
    assert alloc._cols["count"].tolist() == [4, 4] and alloc._cols["sum"].tolist() == [4.0, 2.0]
    alloc.end_epoch()
    assert alloc.ranks(torch.tensor([1, 3])).tolist() == [0.0, 0.5]
    with pytest.raises(InputError, match="dataset_ids"):
        E3Budget(dataset_ids=torch.arange(5), capacity=4)
    with pytest.raises(InputError, match="capacity"):
        E3Budget(capacity=5, table=PromptTable())


def test_e3_ranks_on_a_shared_table_count_only_its_own_prompts() -> None:
    """E3Budget with ``dataset_ids`` (the ranks divide by E3's known prompts, never by the rows another owner
    added), a DEPO and a second E3Budget ("e3_budget#2") on one PromptTable, over overlapping pools: the ranks of
    private tables, before and after a checkpoint."""
    shared = check_shared_table(
        [
            lambda t: E3Budget(n=4, n_low=2, n_high=6, steps_per_epoch=2, dataset_ids=torch.arange(50), table=t),
            lambda t: DEPO(n=2, steps_per_epoch=1, table=t),
            lambda t: E3Budget(n=4, n_low=2, n_high=6, steps_per_epoch=3, table=t),
        ],
        in_turn(4),
        first=4,
    )
    assert shared.table.owners == ("e3_budget", "depo", "e3_budget#2")
    ids = torch.arange(80)
    private = shared.private[0]
    for e3 in (shared.shared[0], shared.resumed[0]):
        assert torch.equal(e3.ranks(ids), private.ranks(ids))
    assert torch.equal(shared.shared[2].ranks(ids), shared.private[2].ranks(ids))
    assert len(private.table) == 50 < len(shared.table)  # the data set; the shared table holds more
    assert sorted(set(private.ranks(ids)[:50].tolist())) == [k / 50 for k in range(50)]  # K = 50


def test_e3_a_rank_outside_the_unit_interval_in_a_shared_table_is_refused() -> None:
    shared = PromptTable()
    first = E3Budget(table=shared)
    first.update(run(first.plan(torch.tensor([1, 2]), 16), hashed(0))[0])
    saved = shared.state_dict()
    saved["columns"]["e3_budget/rank"][0] = 1.5
    shared.load_state_dict(saved)
    with pytest.raises(InputError) as err:
        first.load_state_dict(first.state_dict())
    assert err.value.argument == "table.state_dict()['columns']['e3_budget/rank']"
