"""HIVE (arXiv 2603.25184): oracles, hand examples, properties, bad input.

HIVE's oracles test the invariants of our reconstruction (see docs/methods/filters.md)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators._base import AllocationResult
from rolloutopt.allocators.depo import DEPO
from rolloutopt.allocators.hive import HIVE
from rolloutopt.errors import InputError

from .filters_helpers import (
    _refused,
    bern,
    check_bad_constructor,
    check_bad_plan_observe_update_load,
    check_budget_caps_determinism,
    check_empty_pool_and_zero_budget,
    check_permutation_permutes_the_plan,
    check_state_dict_round_trip_mid_run,
    column_name,
    ents,
    run,
    table,
    with_rows,
    zero,
)
from .table_helpers import check_shared_table


# -- HIVE --------------------------------------------------------------------------------------------------------
def hive(**kw: object) -> HIVE:
    args: dict[str, object] = {"n": 2, "window": 2, "experimental": True, "seed": 1}
    args.update(kw)
    return HIVE(**args)  # type: ignore[arg-type]


def hive_history(h: HIVE) -> None:
    """Prompts 0..4: mean rewards 0.5, 1.0, 0.0, 0.5, 0.5; response entropies 1, -, -, 3, 2; prompt entropies 2."""
    groups = {0: [1.0, 0.0], 1: [1.0, 1.0], 2: [0.0, 0.0], 3: [0.0, 1.0], 4: [1.0, 0.0]}
    ids = torch.tensor([0, 1, 2, 3, 4])
    e = {0: 1.0, 1: 9.0, 2: 9.0, 3: 3.0, 4: 2.0}
    res, reqs = run(h.plan(ids, 10), table(groups), entropy=e, prompt_entropy=dict.fromkeys(range(5), 2.0))
    assert [r.is_probe for r in reqs] == [True, False] and reqs[0].prompt_ids.tolist() == [0, 1, 2, 3, 4]
    h.update(res)


def test_hive_stages_by_hand() -> None:
    h = hive()
    hive_history(h)
    r, hh, h0 = h.history(torch.tensor([0, 1, 2, 3, 4, 8]))
    assert r[:5].tolist() == [0.5, 1.0, 0.0, 0.5, 0.5] and hh[:5].tolist() == [1.0, 9.0, 9.0, 3.0, 2.0]
    assert h0[:5].tolist() == [2.0] * 5 and math.isnan(float(r[5]))
    ids = torch.tensor([8, 4, 3, 2, 1, 0])
    # stage 1: 1 (mean 1.0) and 2 (mean 0.0) are out of the band [0.1, 0.9]; 8 unseen passes.
    # stage 2 (drop, delta 0.1): 3's prompt entropy fell 2.0 -> 1.7 (> 10 %): pruned; 4: 2.0 -> 1.9 stays.
    pe = {8: 5.0, 4: 1.9, 3: 1.7, 2: 2.0, 1: 2.0, 0: 2.0}
    res, reqs = run(h.plan(ids, 4), zero, prompt_entropy=pe)
    # the probe measures the stage-1 survivors only (in plan order), then one generating request
    probe, gen = reqs
    assert probe.is_probe and probe.signals == ("prompt_entropy",)
    assert probe.prompt_ids.tolist() == [8, 4, 3, 0] and probe.counts.tolist() == [0, 0, 0, 0]
    assert not gen.is_probe and gen.signals == ("entropy",) and gen.prompt_ids.tolist() == [8, 4]
    # the probed values, per planned prompt (NaN for the prompts stage 1 dropped)
    assert res.signals["prompt_entropy"].tolist()[:3] == [5.0, 1.9, 1.7] and res.signals["prompt_entropy"][5] == 2.0
    assert bool(res.signals["prompt_entropy"][3:5].isnan().all())
    # ranking: unseen 8 first, then by response entropy 4 (2.0) > 0 (1.0); budget 4 = two groups of 2
    assert res.counts.tolist() == [2, 2, 0, 0, 0, 0]
    assert [res.reason_of(p) for p in (8, 4, 3, 2, 1, 0)] == [
        "selected",
        "selected",
        "entropy_pruned",
        "out_of_band",
        "out_of_band",
        "over_budget",
    ]
    # the prompt entropy stored for the selected 4 is now 1.9; 3 keeps its 2.0
    assert h.history(torch.tensor([4, 3]))[2].tolist() == [1.9, 2.0]


def test_hive_without_prompt_entropy_skips_stage_two_and_top_mode() -> None:
    h = hive()
    hive_history(h)
    ids = torch.tensor([0, 3, 4])
    # answered, a prompt entropy fallen from 2.0 to 1.0 prunes 3; the probe answered with nothing skips stage 2
    res, _ = run(h.plan(ids, 100), zero, prompt_entropy={0: 2.0, 3: 1.0, 4: 2.0})
    assert res.counts.tolist() == [2, 0, 2] and res.reason_of(3) == "entropy_pruned"
    h = hive()
    hive_history(h)
    res, reqs = run(h.plan(ids, 100), zero)
    assert reqs[0].is_probe and reqs[0].prompt_ids.tolist() == [0, 3, 4]
    assert res.counts.tolist() == [2, 2, 2] and "prompt_entropy" not in res.signals
    assert h.history(ids)[2].tolist() == [2.0, 2.0, 2.0]  # nothing measured, nothing stored
    t = hive(stage2="top")
    hive_history(t)
    res, _ = run(t.plan(ids, 4), lambda q: torch.zeros(q.total), prompt_entropy={0: 3.0, 3: 0.1, 4: 1.0})
    assert res.counts.tolist() == [2, 0, 2] and res.reason_of(3) == "over_budget"  # top-2 by prompt entropy
    # stage2="top" ranks by the prompt entropy: a probe answered without it is refused, naming it
    plan = t.plan(ids, 4)
    probe = plan.next()
    assert probe is not None and probe.is_probe
    plan.observe(probe, None)
    with pytest.raises(InputError, match="prompt_entropy"):
        plan.next()


def test_hive_no_probe_when_stage_one_drops_everything() -> None:
    h = hive()
    hive_history(h)
    res, reqs = run(h.plan(torch.tensor([1, 2]), 100), zero)  # means 1.0 and 0.0: both out of band
    assert reqs == [] and res.counts.tolist() == [0, 0]
    assert {res.reason_of(1), res.reason_of(2)} == {"out_of_band"}


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    budget=st.integers(0, 120),
    p_lo=st.floats(0.0, 0.6),
    width=st.floats(0.0, 0.6),
    delta=st.floats(0.0, 0.5),
    stage2=st.sampled_from(["drop", "top"]),
)
def test_hive_structure(seed: int, budget: int, p_lo: float, width: float, delta: float, stage2: str) -> None:
    """Invariants: |stage 2| <= |stage 1| <= |pool|, unseen prompts always survive stage 1; budget and caps."""
    h = hive(n=3, n_min=2, n_max=5, p_lo=p_lo, p_hi=p_lo + width, delta=delta, stage2=stage2, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for s in range(3):
        ids = torch.randperm(40, generator=gen)[:20]
        pe = dict(zip(ids.tolist(), torch.rand(20, generator=gen, dtype=torch.float64).tolist(), strict=True))
        seen_before = ~torch.isnan(h.history(ids)[0])
        res, reqs = run(h.plan(ids, budget), bern(seed + s, 40), entropy=ents(s), prompt_entropy=pe)
        reasons = res.reasons
        stage1 = reasons != 1
        stage2_ = stage1 & (reasons != 2)
        assert int(stage2_.sum()) <= int(stage1.sum()) <= ids.numel()
        assert bool(stage1[~seen_before].all())
        assert int(res.counts.sum()) <= budget
        nz = res.counts[res.counts > 0]
        assert bool(((nz >= 2) & (nz <= 5)).all())
        assert bool((res.counts[reasons != 0] == 0).all())
        if bool(stage1.any()):  # the probe asked exactly the stage-1 survivors
            assert reqs[0].is_probe and reqs[0].prompt_ids.tolist() == ids[stage1].tolist()
        else:
            assert reqs == []
        h.update(res)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["hive"]), seed=st.integers(0, 1000), budget=st.integers(0, 150))
def test_budget_caps_determinism(kind: str, seed: int, budget: int) -> None:
    check_budget_caps_determinism(kind, seed, budget)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["hive"]), seed=st.integers(0, 1000), budget=st.integers(0, 150))
def test_permutation_permutes_the_plan(kind: str, seed: int, budget: int) -> None:
    check_permutation_permutes_the_plan(kind, seed, budget)


@pytest.mark.parametrize("kind", ["hive"])
def test_state_dict_round_trip_mid_run(kind: str) -> None:
    check_state_dict_round_trip_mid_run(kind)


@pytest.mark.parametrize("kind", ["hive"])
def test_empty_pool_and_zero_budget(kind: str) -> None:
    check_empty_pool_and_zero_budget(kind)


# -- bad input ----------------------------------------------------------------------------------------------------
def test_hive_requires_experimental() -> None:
    with pytest.raises(InputError, match="experimental"):
        HIVE()
    HIVE(experimental=True)
    DEPO()


@pytest.mark.parametrize(
    ("cls", "kwargs", "arg"),
    [
        (HIVE, {"n": 0}, "n"),
        (HIVE, {"n": 4, "n_min": 5}, "n_min"),
        (HIVE, {"n": 4, "n_max": 3}, "n_max"),
        (HIVE, {"p_lo": float("nan")}, "p_lo"),
        (HIVE, {"p_lo": 0.5, "p_hi": 0.4}, "p_hi"),
        (HIVE, {"window": 0}, "window"),
        (HIVE, {"delta": -0.1}, "delta"),
        (HIVE, {"stage2": "both"}, "stage2"),
        (HIVE, {"seed": -1}, "seed"),
    ],
)
def test_bad_constructor(cls: type, kwargs: dict[str, object], arg: str) -> None:
    check_bad_constructor(cls, kwargs, arg)


@pytest.mark.parametrize("kind", ["hive"])
def test_bad_plan_observe_update_load(kind: str) -> None:
    check_bad_plan_observe_update_load(kind)


def test_hive_refuses_inf_values_and_a_foreign_window_naming_the_field() -> None:
    """HIVE's windows and prompt entropies mark a missing value with NaN (it has no counter): an inf is refused,
    and so is a window of another width than the constructor's."""
    h = HIVE(window=2, experimental=True)
    good = with_rows(
        h.state_dict(),
        "hive",
        ids=torch.tensor([3, 7]),
        reward=torch.tensor([[math.nan, 0.5], [1.0, 0.0]], dtype=torch.float64),
        entropy=torch.full((2, 2), math.nan, dtype=torch.float64),
        prompt_entropy=torch.tensor([math.nan, 0.3], dtype=torch.float64),
    )
    h.load_state_dict(good)  # NaN (missing) loads
    assert h.history(torch.tensor([3, 7]))[0].tolist() == [0.5, 0.5]
    for key in ("reward", "entropy"):
        t = torch.zeros(2, 2)
        t[1, 0] = math.inf
        _refused(h, with_rows(good, "hive", **{key: t}), column_name("hive", key))
    bad_h = torch.tensor([0.1, -math.inf])
    _refused(h, with_rows(good, "hive", prompt_entropy=bad_h), column_name("hive", "prompt_entropy"))
    wide = with_rows(good, "hive", reward=torch.zeros(2, 3), entropy=torch.zeros(2, 3))
    _refused(h, wide, column_name("hive", "reward"))
    _refused(h, with_rows(good, "hive", ids=torch.tensor([7, 3])), "state['table']['rows']['prompt_ids']")


# -- the prompt table: capacity, plans interleaved with another owner's ------------------------------------------------
def test_hive_capacity_evicts_the_least_recently_updated_prompt() -> None:
    h = hive(capacity=2, p_lo=0.4, p_hi=0.6)
    for p in (1, 2, 3):  # all-correct groups: out of the band once seen; 1, the oldest, is evicted by 3
        res, _ = run(h.plan(torch.tensor([p]), 2), table({p: [1.0, 1.0]}), prompt_entropy={p: 1.0})
        h.update(res)
    assert h.table.prompt_ids.tolist() == [2, 3]
    r, _, h0 = h.history(torch.tensor([1, 2, 3]))
    assert math.isnan(float(r[0])) and math.isnan(float(h0[0])) and r[1:].tolist() == [1.0, 1.0]
    res, _ = run(h.plan(torch.tensor([1, 2, 3]), 100), zero, prompt_entropy=dict.fromkeys((1, 2, 3), 1.0))
    # the evicted prompt passes stage 1 again, as a prompt never rolled out
    assert [res.reason_of(p) for p in (1, 2, 3)] == ["selected", "out_of_band", "out_of_band"]


def _interleaved(allocs: list[HIVE | DEPO], s: int) -> list[AllocationResult]:
    """Step ``s``: every owner plans, then the plans run in reverse order: DEPO inserts rows into the shared table
    between HIVE's plan and its probe's answer (HIVE's positions from the plan are stale then, and must be looked
    up again)."""
    pool = torch.randperm(12, generator=torch.Generator().manual_seed(s))[:8]
    plans = []
    for i, a in enumerate(allocs):
        if isinstance(a, DEPO):
            a.set_epoch(s // 2)
        plans.append((a, a.plan(pool[i : i + 6], 9)))
    out = []
    for a, plan in plans[::-1]:
        pe = dict(zip(plan.prompt_ids.tolist(), (plan.prompt_ids * 0.31 + s).sin().abs().tolist(), strict=True))
        res, _ = run(plan, bern(s, 12), entropy=ents(s), prompt_entropy=pe)
        a.update(res)
        out.append(res)
    return out


def test_hive_shared_table_matches_private_tables_and_reloads() -> None:
    """HIVE and a DEPO on one table, their plans interleaved (:func:`_interleaved`): the results of private
    tables, and after a checkpoint."""
    shared = check_shared_table(
        [
            lambda t: HIVE(n=3, window=2, p_lo=0.2, p_hi=0.8, experimental=True, seed=3, table=t),
            lambda t: DEPO(n=2, decay=0.3, seed=1, table=t),
        ],
        _interleaved,
        first=4,
    )
    assert shared.table.owners == ("hive", "depo")
    assert any(bool(res.reasons.any()) for step in shared.results[:4] for res in step)  # something filtered or pruned
