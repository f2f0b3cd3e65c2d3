"""DEPO (arXiv 2509.01321): oracles, hand examples, properties, bad input.

DEPO's score oracle is computed by hand following ``txy77/DEPO``
``verl/trainer/rollout_purning/rollout_purning.py`` (``Rollout_Purning.purning_by_entropy``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators.depo import DEPO, depo_group_scores

from .filters_helpers import (
    _refused,
    check_bad_constructor,
    check_bad_plan_observe_update_load,
    check_budget_caps_determinism,
    check_empty_pool_and_zero_budget,
    check_permutation_permutes_the_plan,
    check_state_dict_round_trip_mid_run,
    column_name,
    run,
    table,
    with_rows,
    zero,
)

DEPO_REASONS = ("selected", "unseen", "epoch_zero", "padded", "filtered", "over_budget")


# -- DEPO: the score ----------------------------------------------------------------------------------------------
def test_depo_score_spec_oracle() -> None:
    # [1,1,0,0], correct entropies [1, 1], wrong [0.4, 3.0], rho 0.5: m = s = 0.5, A = +-1 (up to eps); the
    # 3.0 failure exceeds 0.5 * 1 and is dropped: 1 + 1 + 0.4 = 2.4. Second group all correct: A+ = 0, score 0.
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    correct = torch.tensor([True, True, False, False, True, True, True])
    h = torch.tensor([1.0, 1.0, 0.4, 3.0, 2.0, 5.0, 1.0], dtype=torch.float64)
    s = depo_group_scores(group, correct, h, num_groups=3, neg_pos_ratio=0.5)
    a = 0.5 / (0.5 + 1e-8)
    assert s.dtype == torch.float64
    assert torch.allclose(s, torch.tensor([2.4 * a, 0.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-12)
    # with rho = 3 the failure at 3.0 counts too: 1 + 1 + 0.4 + 3
    s3 = depo_group_scores(group, correct, h, num_groups=3, neg_pos_ratio=3.0)
    assert math.isclose(float(s3[0]), 5.4 * a, abs_tol=1e-12)
    # all wrong: A- = 0 / (0 + eps) = 0, and no correct mean (0 in the code): score 0
    s0 = depo_group_scores(
        torch.tensor([0, 0]), torch.tensor([False, False]), torch.ones(2, dtype=torch.float64), num_groups=1
    )
    assert float(s0[0]) == 0.0


def test_depo_score_matches_code_transcription() -> None:
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(1, 9, (40,), generator=gen)
    group = torch.arange(40).repeat_interleave(sizes)
    correct = torch.rand(group.numel(), generator=gen) < 0.5
    h = torch.rand(group.numel(), generator=gen, dtype=torch.float64) * 2
    got = depo_group_scores(group, correct, h, num_groups=40)
    for g in range(40):  # the code's per-epoch loop, transcribed
        pos = [float(x) for x, c in zip(h[group == g], correct[group == g], strict=True) if c]
        neg = [float(x) for x, c in zip(h[group == g], correct[group == g], strict=True) if not c]
        acc = [1] * len(pos) + [0] * len(neg)
        m = sum(acc) / len(acc)
        sd = math.sqrt(sum((a - m) ** 2 for a in acc) / len(acc))
        pa, na = (1 - m) / (sd + 1e-8), (0 - m) / (sd + 1e-8)
        avg = sum(pos) / len(pos) if pos else 0
        want = sum(abs(pa * x) for x in pos) + sum(abs(na * x) for x in neg if x <= 0.5 * avg)
        assert math.isclose(float(got[g]), want, rel_tol=1e-9, abs_tol=1e-12), g


# -- DEPO: selection by hand --------------------------------------------------------------------------------------
def depo_history() -> DEPO:
    """Prompts 0..3 after one epoch-0 step (3 once more): scores 0: 2.4, 1: s1, 2: 0, 3: s1; counts 1, 1, 1, 2."""
    d = DEPO(n=4, init_ratio=1.0, decay=0.5, pad_multiple=2, seed=5)
    groups = {0: [1.0, 1.0, 0.0, 0.0], 1: [1.0, 0.0, 0.0, 0.0], 2: [1.0, 1.0, 1.0, 1.0], 3: [1.0, 0.0, 0.0, 0.0]}
    h = {0: [1.0, 1.0, 0.4, 3.0], 1: [1.0] * 4, 2: [1.0] * 4, 3: [1.0] * 4}
    res, reqs = run(d.plan(torch.tensor([0, 1, 2, 3]), 16), table(groups), entropy=table(h))
    assert res.counts.tolist() == [4, 4, 4, 4] and all(DEPO_REASONS[r] == "epoch_zero" for r in res.reasons)
    assert [r.signals for r in reqs] == [("entropy",)]
    assert res.signals["entropy"].tolist() == [x for p in res.prompt_ids.tolist()[::4] for x in h[p]]
    d.update(res)
    res, _ = run(d.plan(torch.tensor([3]), 4), table(groups), entropy={3: 1.0})
    d.update(res)
    return d


def test_depo_selection_by_hand() -> None:
    d = depo_history()
    score, count = d.scores(torch.tensor([0, 1, 2, 3, 9]))
    s1 = 0.75 / (math.sqrt(0.1875) + 1e-8)  # [1,0,0,0], entropies 1: A+ * 1, the failures (1 > 0.5) dropped
    assert torch.allclose(score[:4], torch.tensor([2.4 * 0.5 / (0.5 + 1e-8), s1, 0.0, s1], dtype=torch.float64))
    assert math.isnan(float(score[4])) and count.tolist() == [1, 1, 1, 2, 0]
    d.set_epoch(1)  # thr = clamp(1.0 - 0.5 * 1, 0.4, 1) = 0.5
    assert d.keep_ratio == 0.5
    # K = 4 seen: top floor(4 * 0.5) = 2 by (score desc, count asc): 0 (2.4), then 1 (s1, count 1) before 3 (count
    # 2). Unseen 9 kept. 3 kept -> pad to a multiple of 2 with the least explored of {3 (count 2), 2 (count 1)}:
    # 2. Fill order 9, 0, 1, 2 with budget 14, n = 4: 4, 4, 4, then 2 < n_min = 4 -> 2 gets nothing.
    res, _ = run(d.plan(torch.tensor([3, 2, 9, 1, 0]), 14), zero, entropy=zero)
    assert res.counts.tolist() == [0, 0, 4, 4, 4]
    assert [res.reason_of(p) for p in (0, 1, 2, 3, 9)] == ["selected", "selected", "over_budget", "filtered", "unseen"]
    res, _ = run(d.plan(torch.tensor([3, 2, 9, 1, 0]), 100), zero, entropy=zero)
    assert res.counts.tolist() == [0, 4, 4, 4, 4] and res.reason_of(2) == "padded"
    d.set_epoch(100)  # thr floors at 0.4: floor(4 * 0.4) = 1 -> only 0; 9 + 0 = 2 kept, no padding needed
    res, _ = run(d.plan(torch.tensor([3, 2, 9, 1, 0]), 100), zero, entropy=zero)
    assert res.counts.tolist() == [0, 0, 4, 0, 4]


def test_depo_window_is_bounded_and_averages_last_k() -> None:
    d = DEPO(n=2, history_k=2)
    groups = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]  # scores h (A = +-1, the failure dropped), 0, 0
    for g in groups:
        res, _ = run(d.plan(torch.tensor([7]), 2), table({7: g}), entropy={7: 0.25})
        d.update(res)
    assert d._cols["scores"].shape == (1, 2) and d._cols["count"].tolist() == [3]
    score, _ = d.scores(torch.tensor([7]))
    assert float(score[0]) == 0.0  # window of 2 holds only the last two (zero) scores
    d2 = DEPO(n=2, history_k=3)
    for g in groups:
        res, _ = run(d2.plan(torch.tensor([7]), 2), table({7: g}), entropy={7: 0.25})
        d2.update(res)
    # first score: A+ = 0.5 / (0.5 + eps) times the correct entropy 0.25; the failure (0.25 > 0.5 * 0.25) drops
    want = 0.25 * 0.5 / (0.5 + 1e-8) / 3
    assert math.isclose(float(d2.scores(torch.tensor([7]))[0][0]), want, rel_tol=1e-12)


def test_depo_steps_per_epoch() -> None:
    d = DEPO(n=2, steps_per_epoch=2)
    sizes = []
    for _ in range(3):
        res, _ = run(d.plan(torch.tensor([1, 2]), 4), table({1: [1.0, 0.0], 2: [0.0, 0.0]}), entropy={1: 1.0, 2: 1.0})
        d.update(res)
        sizes.append(int(res.counts.sum()))
    # epochs 0, 0, 1: everything kept twice, then floor(2 * 0.99) = 1 of the two seen prompts
    assert d.epoch == 1 and sizes == [4, 4, 2]


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["depo"]), seed=st.integers(0, 1000), budget=st.integers(0, 150))
def test_budget_caps_determinism(kind: str, seed: int, budget: int) -> None:
    check_budget_caps_determinism(kind, seed, budget)


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["depo"]), seed=st.integers(0, 1000), budget=st.integers(0, 150))
def test_permutation_permutes_the_plan(kind: str, seed: int, budget: int) -> None:
    check_permutation_permutes_the_plan(kind, seed, budget)


@pytest.mark.parametrize("kind", ["depo"])
def test_state_dict_round_trip_mid_run(kind: str) -> None:
    check_state_dict_round_trip_mid_run(kind)


@pytest.mark.parametrize("kind", ["depo"])
def test_empty_pool_and_zero_budget(kind: str) -> None:
    check_empty_pool_and_zero_budget(kind)


@pytest.mark.parametrize(
    ("cls", "kwargs", "arg"),
    [
        (DEPO, {"n": 0}, "n"),
        (DEPO, {"history_k": 0}, "history_k"),
        (DEPO, {"init_ratio": -1.0}, "init_ratio"),
        (DEPO, {"decay": float("inf")}, "decay"),
        (DEPO, {"min_ratio": 1.5}, "min_ratio"),
        (DEPO, {"neg_pos_ratio": float("nan")}, "neg_pos_ratio"),
        (DEPO, {"eps": 0.0}, "eps"),
        (DEPO, {"pad_multiple": 0}, "pad_multiple"),
        (DEPO, {"steps_per_epoch": 0}, "steps_per_epoch"),
        (DEPO, {"seed": 1.5}, "seed"),
    ],
)
def test_bad_constructor(cls: type, kwargs: dict[str, object], arg: str) -> None:
    check_bad_constructor(cls, kwargs, arg)


@pytest.mark.parametrize("kind", ["depo"])
def test_bad_plan_observe_update_load(kind: str) -> None:
    check_bad_plan_observe_update_load(kind)


def col(key: str) -> str:
    return column_name("depo", key)


def test_depo_refuses_inf_scores_and_negative_counters_naming_the_field() -> None:
    d = DEPO(history_k=2)
    good = with_rows(
        {**d.state_dict(), "epoch": 2, "steps": 5},
        "depo",
        ids=torch.tensor([3, 7]),
        scores=torch.tensor([[math.nan, 0.5], [1.0, 0.0]], dtype=torch.float64),
        count=torch.tensor([1, 4]),
    )
    d.load_state_dict(good)
    assert d.epoch == 2 and d.steps == 5 and d.scores(torch.tensor([7]))[1].tolist() == [4]
    _refused(d, with_rows(good, "depo", scores=torch.tensor([[math.nan, math.inf], [1.0, 0.0]])), col("scores"))
    _refused(d, with_rows(good, "depo", count=torch.tensor([1, -1])), col("count"))
    _refused(d, {**good, "epoch": -1}, "state['epoch']")
    _refused(d, {**good, "steps": -3}, "state['steps']")
    _refused(d, {**good, "epoch": math.nan}, "state['epoch']")
    _refused(d, with_rows(good, "depo", scores=torch.zeros(2, 3)), col("scores"))  # history_k=3's windows
    _refused(d, with_rows(good, "depo", ids=torch.tensor([7, 3])), "state['table']['rows']['prompt_ids']")
    # a bad table is refused before the epoch is taken
    _refused(d, with_rows({**good, "epoch": 9}, "depo", count=torch.tensor([1, -1])), col("count"))


# -- the prompt table: capacity (sharing and checkpoints: test_shared_table.py) ----------------------------------------
def test_depo_capacity_evicts_the_least_recently_updated_prompt() -> None:
    d = DEPO(n=2, capacity=2)
    for p in (1, 2, 3):  # prompt 1, updated first, is evicted when 3 arrives
        res, _ = run(d.plan(torch.tensor([p]), 2), table({p: [1.0, 0.0]}), entropy={p: 1.0})
        d.update(res)
    assert d.table.prompt_ids.tolist() == [2, 3]
    score, count = d.scores(torch.tensor([1, 2, 3]))
    assert math.isnan(float(score[0])) and count.tolist() == [0, 1, 1]
    d.set_epoch(1)  # the evicted prompt is unseen again: kept as "unseen", as a prompt never rolled out
    res, _ = run(d.plan(torch.tensor([1, 2, 3, 4]), 100), zero, entropy=zero)
    assert res.reason_of(1) == "unseen" and res.reason_of(4) == "unseen"
