"""DOTS + Rollout Replay (arXiv 2506.05316): oracles, hand examples, properties, state round trips, bad input."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators._base import AllocationResult, Conversation, Request
from rolloutopt.allocators.dots import DOTS
from rolloutopt.errors import InputError

from .replay_helpers import F64, Rewards, const, keyed, run
from .table_helpers import check_shared_table


def bernoulli(rate: torch.Tensor, step: int) -> Rewards:
    def f(req: Request) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        p = rate[req.prompt_ids].repeat_interleave(req.counts)
        return (torch.rand(p.shape, generator=g, dtype=F64) < p).double()

    return f


def table(values: list[float]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: torch.tensor(values, dtype=F64)[ids]


# -- DOTS: oracles by hand following ASTRAL-Group/data-efficient-llm-rl -------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_dots_spec_oracle_tau_to_zero(seed: int) -> None:
    # predicted p = [0.1, 0.45, 0.5, 0.9], budget 2 (one rollout each): the sample is {0.5, 0.45}
    dots = DOTS(n=1, tau=1e-6, predictor=table([0.1, 0.45, 0.5, 0.9]), seed=seed)
    req = dots.plan(torch.arange(4), 2).next()
    assert req is not None
    assert sorted(req.prompt_ids.tolist()) == [1, 2]
    assert req.counts.tolist() == [1, 1]


def test_dots_spec_oracle_tau_1e3_weight_ratio() -> None:
    # 0.05 farther from 1/2 -> relative weight e^-50: with one slot the nearer prompt always wins
    dots = DOTS(n=1, predictor=table([0.55, 0.5]), seed=3)
    for _ in range(200):
        req = dots.plan(torch.arange(2), 1).next()
        assert req is not None and req.prompt_ids.tolist() == [1]


def test_dots_draws_follow_the_softmax() -> None:
    # tau = 0.05: weights e^0 and e^-1 (0.05 farther): P(first prompt) = 1 / (1 + e) = 0.2689 for one slot
    dots = DOTS(n=1, tau=0.05, predictor=table([0.55, 0.5]), seed=11)
    hits = 0
    trials = 3000
    for _ in range(trials):
        req = dots.plan(torch.arange(2), 1).next()
        assert req is not None
        hits += int(req.prompt_ids[0] == 0)
    sd = math.sqrt(0.2689 * 0.7311 / trials)
    assert abs(hits / trials - 1 / (1 + math.e)) < 4 * sd


# -- DOTS: replay by hand ---------------------------------------------------------------------------------------
def test_dots_replay_hand_example() -> None:
    # buffer_rule="paper": this test encodes the earlier default (a FIFO of the groups with unequal rewards,
    # replay from the second plan); the authors' code's rule, now the default, is tested below
    dots = DOTS(n=2, sigma=0.5, buffer_size=3, buffer_rule="paper", seed=0)
    world = {0: [1.0, 0.0], 1: [1.0, 1.0], 2: [0.0, 0.0], 3: [0.0, 1.0]}
    plan = dots.plan(torch.arange(4), 8)
    assert plan.replayed().num_groups == 0  # empty buffer: all fresh (the code's first round)
    res, reqs = run(plan, const(world))
    assert res.counts.tolist() == [2, 2, 2, 2]
    assert res.metrics["replayed_groups"].item() == 0
    dots.update(res)
    buf = dots.replay_buffer()
    # all-1 (prompt 1) and all-0 (prompt 2) groups are removed; the others enter in prompt-id order
    assert buf["prompt_ids"].tolist() == [0, 3]
    assert buf["keys"].tolist() == [0, 1]
    assert buf["steps"].tolist() == [0, 0]
    assert buf["rewards"].tolist() == [[1.0, 0.0], [0.0, 1.0]]
    # step 2: B = 4 groups, k = min(floor(0.5 * 4), 2) = 2 replayed, 2 fresh groups = 4 rollouts
    plan = dots.plan(torch.arange(4), 8)
    rep = plan.replayed()
    assert rep.prompt_ids.tolist() == [0, 3] and rep.keys.tolist() == [0, 1]
    assert rep.counts.tolist() == [2, 2]
    assert rep.group.tolist() == [0, 0, 1, 1] and rep.index.tolist() == [0, 1, 0, 1]
    assert rep.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    res, reqs = run(plan, const(world))
    assert len(reqs) == 1 and reqs[0].total == 4
    names = [res.reason_names[int(r)] for r in res.reasons]
    assert sorted(names) == ["displaced_by_replay", "displaced_by_replay", "selected", "selected"]
    assert res.metrics["replayed_groups"].item() == 2 and res.metrics["replayed_rollouts"].item() == 4


def test_dots_fifo_is_bounded_and_keeps_the_newest() -> None:
    # buffer_rule="paper" (the earlier default): a FIFO of at most buffer_size informative groups
    dots = DOTS(n=4, buffer_size=5, buffer_rule="paper", seed=1)
    rate = torch.full((40,), 0.5, dtype=F64)
    for step in range(6):
        res, _ = run(dots.plan(torch.arange(40), 64), bernoulli(rate, step))
        dots.update(res)
        buf = dots.replay_buffer()
        assert buf["keys"].numel() <= 5
        assert bool((buf["keys"][1:] > buf["keys"][:-1]).all())
        assert int(buf["keys"][-1]) == dots.state_dict()["next_key"] - 1
        assert int(buf["steps"][-1]) == step
        # every stored group has unequal rewards
        for row, c in zip(buf["rewards"], buf["counts"], strict=True):
            assert row[: int(c)].max() > row[: int(c)].min()


def test_dots_code_buffer_rule_by_hand() -> None:
    """The default buffer rule follows ASTRAL-Group/data-efficient-llm-rl@59df9187b7786c0058316f886b77c13c8608c533,
    ``rl_training/verl/verl/trainer/ppo/ray_trainer_teacher_replay.py``: ``select_buffer`` keeps the last group of
    each prompt (dedup), its all-0/all-1 filter is commented out, it draws ``int((1 - sigma) B)`` groups at random
    and then truncates to the newest ``buffer_size - int(sigma B)`` groups before the step's batch is appended;
    the first round (``epoch == 0``, ``mu = 2`` steps) never replays."""
    dots = DOTS(n=2, sigma=0.5, buffer_size=4, seed=0)
    assert dots.buffer_rule == "code" and dots.warmup_steps == 2
    world = {0: [1.0, 1.0], 1: [0.0, 0.0], 2: [1.0, 0.0], 3: [0.0, 1.0]}
    # step 0: B = 8 // 2 = 4 groups, no replay (first round). Truncate the empty buffer to 4 - 2 = 2, append all 4
    # groups (all-1 prompt 0 and all-0 prompt 1 included) in prompt-id order
    plan = dots.plan(torch.arange(4), 8)
    assert plan.replayed().num_groups == 0
    res, _ = run(plan, const(world))
    dots.update(res)
    buf = dots.replay_buffer()
    assert buf["prompt_ids"].tolist() == [0, 1, 2, 3] and buf["keys"].tolist() == [0, 1, 2, 3]
    assert buf["rewards"].tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    # step 1: still the first round (warmup_steps = 2), so 4 fresh groups and no replay although the buffer is full.
    # Truncate to the newest 2 groups (keys 2, 3: prompts 2, 3), append keys 4..7 (prompts 0..3), dedup: the newer
    # groups of prompts 2 and 3 replace keys 2 and 3
    plan = dots.plan(torch.arange(4), 8)
    assert plan.replayed().num_groups == 0
    res, reqs = run(plan, const(world))
    assert reqs[0].total == 8
    dots.update(res)
    buf = dots.replay_buffer()
    assert buf["keys"].tolist() == [4, 5, 6, 7] and buf["prompt_ids"].tolist() == [0, 1, 2, 3]
    assert buf["steps"].tolist() == [1, 1, 1, 1]
    # step 2: k = min(int(0.5 * 4), 4) = 2 groups drawn from keys 4..7, 2 fresh groups (4 rollouts). The labels
    # (p = 1, 0, 0.5, 0.5) with tau = 1e-3 pick prompts 2 and 3 for the fresh groups
    plan = dots.plan(torch.arange(4), 8)
    rep = plan.replayed()
    assert rep.num_groups == 2 and set(rep.keys.tolist()) <= {4, 5, 6, 7} and rep.steps.tolist() == [1, 1]
    res, reqs = run(plan, const(world))
    assert len(reqs) == 1 and reqs[0].total == 4 and sorted(reqs[0].prompt_ids.tolist()) == [2, 3]
    dots.update(res)
    # truncate keys 4..7 to the newest 2 (keys 6, 7: prompts 2, 3), append keys 8, 9 (prompts 2, 3), dedup
    buf = dots.replay_buffer()
    assert buf["keys"].tolist() == [8, 9] and buf["prompt_ids"].tolist() == [2, 3] and buf["steps"].tolist() == [2, 2]
    # the paper variant instead stores only prompts 2 and 3 at step 0 and replays them from the second plan
    paper = DOTS(n=2, sigma=0.5, buffer_size=4, buffer_rule="paper", seed=0)
    paper.update(run(paper.plan(torch.arange(4), 8), const(world))[0])
    assert paper.replay_buffer()["prompt_ids"].tolist() == [2, 3]
    assert paper.plan(torch.arange(4), 8).replayed().num_groups == 2
    # warmup_steps=0 with the code rule replays from the second plan too
    early = DOTS(n=2, sigma=0.5, buffer_size=4, warmup_steps=0, seed=0)
    early.update(run(early.plan(torch.arange(4), 8), const(world))[0])
    assert early.plan(torch.arange(4), 8).replayed().num_groups == 2


def test_dots_code_buffer_rule_state_round_trip() -> None:
    world = {i: [1.0, 0.0] for i in range(6)}
    a = DOTS(n=2, sigma=0.5, buffer_size=4, seed=3)
    for _ in range(2):
        a.update(run(a.plan(torch.arange(6), 12), const(world))[0])
    state = a.state_dict()
    assert state["planned_groups"] == 6
    b = DOTS(n=2, sigma=0.5, buffer_size=4, seed=9)
    b.load_state_dict(state)
    pa, pb = a.plan(torch.arange(6), 12), b.plan(torch.arange(6), 12)
    assert torch.equal(pa.replayed().keys, pb.replayed().keys) and pa.replayed().num_groups == 3
    ra, rb = run(pa, const(world))[0], run(pb, const(world))[0]
    a.update(ra)
    b.update(rb)
    for key, value in a.replay_buffer().items():
        assert torch.equal(value, b.replay_buffer()[key])
    for bad in (-1, 1.5, "6", True):
        broken = dict(state, planned_groups=bad)
        with pytest.raises(InputError, match="planned_groups"):
            DOTS(n=2).load_state_dict(broken)


def _rows(state: dict[str, Any], **changes: torch.Tensor) -> dict[str, Any]:
    """The ``"table"`` entry of a private-table DOTS ``state`` with ``prompt_ids`` or DOTS's columns replaced."""
    rows = dict(state["table"]["rows"])
    rows["columns"] = dict(rows["columns"])
    for key, value in changes.items():
        if key == "prompt_ids":
            rows["prompt_ids"] = value
        else:
            rows["columns"][f"dots/{key}"] = value
    return {**state["table"], "rows": rows}


def test_dots_load_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """NaN in a finite field, negative counters, a buffer key not below ``next_key``, a count above ``n_max``: an
    ``InputError`` naming the field (nested path for the buffer), and the allocator goes on unchanged."""
    rate = torch.rand(20, generator=torch.Generator().manual_seed(1), dtype=F64)
    a = DOTS(n=2, buffer_size=8, seed=2)
    for s in range(3):
        a.update(run(a.plan(torch.arange(20), 16), bernoulli(rate, s))[0])
    good = a.state_dict()
    rows = good["table"]["rows"]
    nl, g = rows["prompt_ids"].numel(), good["buffer"]["keys"].numel()
    assert nl >= 2 and g >= 2
    buf = good["buffer"]
    at = "state['table']['rows']"
    cases: list[tuple[str, Any, str]] = [
        ("table", _rows(good, label=torch.full((nl,), math.nan, dtype=F64)), f"{at}['columns']['dots/label']"),
        ("ref_labels", torch.full_like(good["ref_labels"], math.nan), "state['ref_labels']"),
        ("step", -1, "state['step']"),
        ("next_key", -1, "state['next_key']"),
        ("buffer", {**buf, "rewards": torch.full_like(buf["rewards"], math.nan)}, "state['buffer']['rewards']"),
        ("buffer", {**buf, "steps": torch.full((g,), -1)}, "state['buffer']['steps']"),
        ("buffer", {**buf, "counts": torch.full((g,), -1)}, "state['buffer']['counts']"),
        ("buffer", {**buf, "counts": torch.full((g,), a.n_max + 1)}, "state['buffer']['counts']"),
        ("buffer", {**buf, "keys": buf["keys"] + good["next_key"]}, "state['buffer']['keys']"),
        ("table", _rows(good, prompt_ids=rows["prompt_ids"].flip(0)), f"{at}['prompt_ids']"),
        ("table", {**good["table"], "owner": "dots#2"}, "state['table']['owner']"),
    ]
    label = rows["columns"]["dots/label"]
    for key, value, argument in cases:
        with pytest.raises(InputError) as err:
            a.load_state_dict({**good, key: value})
        assert err.value.argument == argument
        after = a.state_dict()
        assert after["step"] == good["step"] and torch.equal(after["table"]["rows"]["columns"]["dots/label"], label)
        assert torch.equal(a.table.prompt_ids, rows["prompt_ids"])
        assert torch.equal(after["buffer"]["keys"], buf["keys"]) and torch.equal(after["generator"], good["generator"])


def test_sigma_one_or_replay_off_never_replays() -> None:
    for kwargs in ({"sigma": 1.0}, {"replay": False}, {"buffer_size": 0}):
        dots = DOTS(n=2, seed=0, **kwargs)  # type: ignore[arg-type]
        world = {i: [1.0, 0.0] for i in range(6)}
        for _ in range(3):
            plan = dots.plan(torch.arange(6), 12)
            assert plan.replayed().num_groups == 0
            res, _ = run(plan, const(world))
            assert int(res.counts.sum()) == 12
            dots.update(res)


# -- DOTS: predictors ---------------------------------------------------------------------------------------------
def test_dots_label_predictor() -> None:
    dots = DOTS(n=4, replay=False, seed=0)
    assert dots.predict(torch.tensor([5])).tolist() == [0.5]  # no reference: the prior
    world = {0: [1.0, 0.0, 0.0, 0.0], 1: [1.0, 1.0, 1.0, 0.0]}
    res, _ = run(dots.plan(torch.arange(2), 8), const(world))
    dots.update(res)
    # seen prompts: their last success rate; unseen: the reference mean (0.25 + 0.75) / 2
    assert dots.predict(torch.tensor([0, 1, 7])).tolist() == [0.25, 0.75, 0.5]
    res, _ = run(dots.plan(torch.tensor([0]), 4), const({0: [1.0, 1.0, 0.0, 1.0]}))
    dots.update(res)
    assert dots.predict(torch.tensor([0, 7])).tolist() == [0.75, (0.25 + 0.75 + 0.75) / 3]


def test_dots_reference_set_is_bounded() -> None:
    dots = DOTS(n=1, replay=False, ref_size=2, seed=0)
    res, _ = run(dots.plan(torch.arange(3), 3), const({0: [0.0], 1: [1.0], 2: [1.0]}))
    dots.update(res)
    state = dots.state_dict()
    assert state["ref_ids"].tolist() == [1, 2] and state["ref_labels"].tolist() == [1.0, 1.0]
    assert dots.predict(torch.tensor([9])).tolist() == [1.0]


def test_dots_embedding_predictor_by_hand() -> None:
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [1.0, 1.0]])
    with pytest.raises(InputError, match="experimental"):
        DOTS(embeddings=emb, embedding_ids=torch.arange(4))
    dots = DOTS(
        n=1, replay=False, embeddings=emb, embedding_ids=torch.arange(4), experimental=True, similarity_temperature=1e-3
    )
    assert dots.predict(torch.arange(4)).tolist() == [0.5] * 4  # no reference yet
    res, _ = run(dots.plan(torch.arange(2), 2), const({0: [0.0], 1: [1.0]}))
    dots.update(res)
    p = dots.predict(torch.arange(4))
    # prompt 2 points like prompt 0 (label 0); prompt 3 sits halfway (cosine equal to both): the mean 0.5.
    # Calibration on the references: raw predictions (0, 1) vs labels (0, 1): slope 1, intercept 0.
    torch.testing.assert_close(p, torch.tensor([0.0, 1.0, 0.0, 0.5], dtype=F64), atol=1e-9, rtol=0)
    with pytest.raises(InputError, match="prompt_ids"):
        dots.predict(torch.tensor([9]))


def test_dots_calibration_rescales() -> None:
    # soft similarities (T = 1) shrink the raw predictions towards the mean; the linear fit on the references
    # maps the reference points back onto their labels exactly (two points), so prompt 0 predicts 0.
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    kw = {"n": 1, "replay": False, "embeddings": emb, "embedding_ids": torch.arange(2), "experimental": True}
    raw = DOTS(similarity_temperature=1.0, calibrate=False, **kw)  # type: ignore[arg-type]
    cal = DOTS(similarity_temperature=1.0, **kw)  # type: ignore[arg-type]
    for d in (raw, cal):
        res, _ = run(d.plan(torch.arange(2), 2), const({0: [0.0], 1: [1.0]}))
        d.update(res)
    w = 1 / (1 + math.e)  # softmax([cos 0, cos 1] / 1) weight of the orthogonal reference
    torch.testing.assert_close(raw.predict(torch.arange(2)), torch.tensor([w, 1 - w], dtype=F64))
    torch.testing.assert_close(cal.predict(torch.arange(2)), torch.tensor([0.0, 1.0], dtype=F64))


# -- DOTS: properties ---------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(0, 12),
    budget=st.integers(0, 80),
    n=st.integers(1, 4),
    dn_min=st.integers(0, 3),
    dn_max=st.integers(0, 3),
    seed=st.integers(0, 50),
)
def test_dots_properties(k: int, budget: int, n: int, dn_min: int, dn_max: int, seed: int) -> None:
    n_min = max(1, n - dn_min)
    n_max = n + dn_max
    rate = torch.linspace(0.0, 1.0, 30, dtype=F64)
    ids = torch.randperm(30, generator=torch.Generator().manual_seed(seed))[:k]
    a = DOTS(n=n, n_min=n_min, n_max=n_max, buffer_size=6, seed=seed)
    b = DOTS(n=n, n_min=n_min, n_max=n_max, buffer_size=6, seed=seed)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed + 1))
    for step in range(3):
        pa = a.plan(ids, budget)
        pb = b.plan(ids[perm], budget)
        ra, reqs = run(pa, keyed(rate, step))
        rb, _ = run(pb, keyed(rate, step))
        assert len(reqs) <= 1 and int(ra.counts.sum()) <= budget
        got = ra.counts[ra.counts > 0]
        assert bool(((got >= n_min) & (got <= n_max)).all())
        assert int(ra.counts.sum()) + n * pa.replayed().num_groups <= budget or pa.replayed().num_groups == 0
        # permutation of the pool permutes the plan (same draws, same replay) and nothing else
        assert torch.equal(rb.counts, ra.counts[perm]) and torch.equal(rb.reasons, ra.reasons[perm])
        assert torch.equal(pb.replayed().keys, pa.replayed().keys)
        assert bool(torch.isfinite(pa.predicted).all())
        a.update(ra)
        b.update(rb)


def test_dots_seeded_and_state_round_trip_mid_run() -> None:
    rate = torch.rand(50, generator=torch.Generator().manual_seed(0), dtype=F64)
    ids = torch.arange(50)

    def steps(d: DOTS, start: int, count: int) -> list[tuple[list[int], list[int]]]:
        out = []
        for s in range(start, start + count):
            plan = d.plan(ids, 96)
            res, _ = run(plan, bernoulli(rate, s))
            d.update(res)
            out.append((res.counts.tolist(), plan.replayed().keys.tolist()))
        return out

    a = DOTS(n=4, buffer_size=10, seed=7)
    first = steps(a, 0, 3)
    state = a.state_dict()
    rest_a = steps(a, 3, 4)
    b = DOTS(n=4, buffer_size=10, seed=123)
    b.load_state_dict(state)
    assert steps(b, 3, 4) == rest_a
    c = DOTS(n=4, buffer_size=10, seed=7)
    assert steps(c, 0, 3) == first  # same seed, same run
    assert any(keys for _, keys in rest_a)  # replay was exercised


# -- DOTS: bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"n": 0}, "n"),
        ({"n_min": 9}, "n_min"),
        ({"n_max": 2}, "n_max"),
        ({"alpha": 1.5}, "alpha"),
        ({"tau": 0.0}, "tau"),
        ({"sigma": 0.0}, "sigma"),
        ({"buffer_size": -1}, "buffer_size"),
        ({"ref_size": 0}, "ref_size"),
        ({"replay": 1}, "replay"),
        ({"buffer_rule": "fifo"}, "buffer_rule"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"prior": float("nan")}, "prior"),
        ({"similarity_temperature": -1.0}, "similarity_temperature"),
        ({"predictor": 3}, "predictor"),
        ({"seed": -1}, "seed"),
        ({"embeddings": torch.zeros(3, 2), "embedding_ids": torch.arange(2), "experimental": True}, "embedding_ids"),
        ({"embeddings": torch.zeros(3), "embedding_ids": torch.arange(3), "experimental": True}, "embeddings"),
    ],
)
def test_dots_bad_constructor(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        DOTS(**kwargs)  # type: ignore[arg-type]


def test_dots_bad_plan_observe_update_load() -> None:
    dots = DOTS(n=2)
    with pytest.raises(InputError, match="budget"):
        dots.plan(torch.arange(3), -1)
    with pytest.raises(InputError, match="prompt_ids"):
        dots.plan(torch.tensor([0.5]), 2)
    plan = dots.plan(torch.arange(3), 6)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(req.total + 1))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((req.total,), float("nan")))
    with pytest.raises(InputError, match="request"):
        plan.observe(Request(torch.tensor([99]), torch.tensor([6])), torch.zeros(6))
    with pytest.raises(InputError, match="prompt_ids"):
        Conversation.positions(plan, torch.tensor([99]))  # unknown ids
    with pytest.raises(InputError, match="result"):
        dots.update("not a result")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="state"):
        dots.load_state_dict({"step": 0})
    bad = dots.state_dict()
    bad["table"]["rows"]["columns"]["dots/label"] = torch.zeros(3)  # no prompt stored yet
    with pytest.raises(InputError, match="state"):
        dots.load_state_dict(bad)
    wrong = DOTS(n=2, n_max=3).state_dict()
    with pytest.raises(InputError, match="state"):
        DOTS(n=2).load_state_dict(wrong)  # buffer width n_max differs
    with pytest.raises(InputError, match="predictor"):
        DOTS(predictor=lambda ids: torch.zeros(1)).plan(torch.arange(3), 16)
    with pytest.raises(InputError, match="predictor"):
        DOTS(predictor=lambda ids: torch.full(ids.shape, math.nan, dtype=F64)).plan(torch.arange(3), 16)


def test_dots_empty_pool_and_small_budget() -> None:
    dots = DOTS(n=4)
    for ids, budget in ((torch.zeros(0, dtype=torch.long), 16), (torch.arange(3), 3), (torch.arange(3), 0)):
        res, reqs = run(dots.plan(ids, budget), const({}))
        assert reqs == [] and res.rewards.numel() == 0
        dots.update(res)


# -- DOTS: the prompt table (capacity, replay on a shared table) -------------------------------------------------------
def test_dots_capacity_evicts_the_least_recently_updated_prompt() -> None:
    dots = DOTS(n=1, replay=False, capacity=2, seed=0)
    for p, r in ((1, 0.0), (2, 1.0), (3, 1.0)):  # prompt 1, labelled first, is evicted when 3 arrives
        dots.update(run(dots.plan(torch.tensor([p]), 1), const({p: [r]}))[0])
    assert dots.table.prompt_ids.tolist() == [2, 3]
    # the evicted prompt predicts as an unseen one: the reference mean (0 + 1 + 1) / 3, not its label 0
    assert dots.predict(torch.tensor([1, 2, 3, 9])).tolist() == [2 / 3, 1.0, 1.0, 2 / 3]


RATE = torch.rand(30, generator=torch.Generator().manual_seed(5), dtype=F64)


def _dots_step(allocs: list[DOTS], s: int) -> list[tuple[AllocationResult, torch.Tensor, torch.Tensor]]:
    """Step ``s`` of each DOTS on overlapping pools: the result, the replayed groups' keys, the predictions."""
    pool = torch.randperm(30, generator=torch.Generator().manual_seed(s))[:16]
    out = []
    for i, d in enumerate(allocs):
        plan = d.plan(pool[4 * i : 4 * i + 12], 12)
        res, _ = run(plan, bernoulli(RATE, s + 10 * i))
        d.update(res)
        out.append((res, plan.replayed().keys, plan.predicted))
    return out


def test_dots_shared_table_matches_private_tables_and_reloads() -> None:
    """Two DOTS ("dots", "dots#2": the paper's buffer rule) on one table: the same replayed groups and predictions
    as with private tables, and after a checkpoint."""
    shared = check_shared_table(
        [
            lambda t: DOTS(n=2, buffer_size=6, seed=1, table=t),
            lambda t: DOTS(n=3, sigma=0.4, buffer_size=5, buffer_rule="paper", tau=0.1, seed=2, table=t),
        ],
        _dots_step,
        first=4,
    )
    assert shared.table.owners == ("dots", "dots#2")
    assert any(keys.numel() for step in shared.results[:4] for _, keys, _ in step)  # replay was exercised
