"""HIVE (arXiv 2603.25184) and DEPO (arXiv 2509.01321): oracles, hand examples, properties, bad input.

DEPO's score oracle is computed by hand following ``txy77/DEPO``
``verl/trainer/rollout_purning/rollout_purning.py`` (``Rollout_Purning.purning_by_entropy``); HIVE's oracles test
the invariants of our reconstruction (see docs/methods/filters.md)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators._base import AllocationResult, Conversation, Request
from rolloutopt.allocators.depo import DEPO, depo_group_scores
from rolloutopt.allocators.hive import HIVE
from rolloutopt.errors import InputError

Rewards = Callable[[Request], torch.Tensor]
PerRow = Callable[[Request], torch.Tensor] | Mapping[int, float]
DEPO_REASONS = ("selected", "unseen", "epoch_zero", "padded", "filtered", "over_budget")


def per_rollout(values: Rewards | Mapping[int, float]) -> Rewards:
    """A rollout signal ``[n]`` for a request: a callable as is, or {prompt: value} repeated over its rollouts."""
    if callable(values):
        return values
    return lambda req: torch.tensor(
        [values[p] for p in req.prompt_ids.tolist()], dtype=torch.float64
    ).repeat_interleave(req.counts)


def per_row(values: PerRow) -> Rewards:
    """A prompt or probe signal ``[R]`` for a request: a callable as is, or {prompt: value} per request row."""
    if callable(values):
        return values
    return lambda req: torch.tensor([values[p] for p in req.prompt_ids.tolist()], dtype=torch.float64)


def run(
    plan: Conversation,
    rewards: Rewards,
    *,
    entropy: Rewards | Mapping[int, float] | None = None,
    prompt_entropy: PerRow | None = None,
) -> tuple[AllocationResult, list[Request]]:
    """Drive a plan: a probe is answered with ``prompt_entropy`` of its rows (or with nothing, skipping stage 2),
    a generating request with its rewards and, when given, its rollouts' ``entropy``."""
    reqs = []
    while (req := plan.next()) is not None:
        reqs.append(req)
        if req.is_probe:
            assert req.signals == ("prompt_entropy",) and req.total == 0
            signals = {} if prompt_entropy is None else {"prompt_entropy": per_row(prompt_entropy)(req)}
            plan.observe(req, None, **signals)
        else:
            signals = {} if entropy is None else {"entropy": per_rollout(entropy)(req)}
            plan.observe(req, rewards(req), **signals)
    return plan.finish(), reqs


def zero(req: Request) -> torch.Tensor:
    return torch.zeros(req.total, dtype=torch.float64)


def table(groups: dict[int, list[float]]) -> Rewards:
    """Prompt p's rollouts get the rewards groups[p] (its request count must match)."""

    def f(req: Request) -> torch.Tensor:
        return torch.tensor([x for p in req.prompt_ids.tolist() for x in groups[p]], dtype=torch.float64)

    return f


def bern(seed: int, n_ids: int = 64) -> Rewards:
    rate = torch.rand(n_ids, generator=torch.Generator().manual_seed(1000 + seed), dtype=torch.float64)

    def f(req: Request) -> torch.Tensor:
        q = rate[req.prompt_ids % n_ids].repeat_interleave(req.counts)
        return (torch.rand(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) < q).double()

    return f


def ents(seed: int) -> Rewards:
    """Response entropies of a step's (single) generating request: uniform on [0, 3), seeded."""
    return lambda req: torch.rand(req.total, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


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
    st_ = d.state_dict()
    assert st_["scores"].shape == (1, 2) and st_["count"].tolist() == [3]
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


# -- both: budget, caps, determinism, permutation, state round trip -----------------------------------------------
def make(kind: str, seed: int, **kw: object) -> HIVE | DEPO:
    if kind == "hive":
        return HIVE(n=4, n_min=2, n_max=6, window=3, experimental=True, seed=seed, **kw)  # type: ignore[arg-type]
    return DEPO(n=4, n_min=2, n_max=6, decay=0.2, pad_multiple=3, seed=seed, **kw)  # type: ignore[arg-type]


def drive(a: HIVE | DEPO, steps: range, budget: int, pools: list[torch.Tensor]) -> list[AllocationResult]:
    out = []
    for s in steps:
        if isinstance(a, DEPO):
            a.set_epoch(s // 2)
        pool = pools[s]
        pe = dict(zip(pool.tolist(), (pool.double() * 0.37 + s).sin().abs().tolist(), strict=True))
        res, _ = run(a.plan(pool, budget), bern(s), entropy=ents(s), prompt_entropy=pe if isinstance(a, HIVE) else None)
        a.update(res)
        out.append(res)
    return out


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["hive", "depo"]), seed=st.integers(0, 1000), budget=st.integers(0, 150))
def test_budget_caps_determinism(kind: str, seed: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pools = [torch.randperm(64, generator=gen)[:24] for _ in range(5)]
    a, b = make(kind, seed), make(kind, seed)
    ra, rb = drive(a, range(5), budget, pools), drive(b, range(5), budget, pools)
    for x, y in zip(ra, rb, strict=True):
        assert torch.equal(x.counts, y.counts) and torch.equal(x.reasons, y.reasons)
        assert int(x.counts.sum()) <= budget and x.rewards.numel() == int(x.counts.sum())
        nz = x.counts[x.counts > 0]
        assert bool(((nz >= 2) & (nz <= 6)).all())
        assert bool((x.weight == 1).all())


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["hive", "depo"]), seed=st.integers(0, 1000), budget=st.integers(0, 150))
def test_permutation_permutes_the_plan(kind: str, seed: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pools = [torch.randperm(64, generator=gen)[:24] for _ in range(3)]
    a, b = make(kind, 7), make(kind, 7)
    drive(a, range(3), 60, pools)
    drive(b, range(3), 60, pools)
    if isinstance(a, DEPO) and isinstance(b, DEPO):
        a.set_epoch(2)
        b.set_epoch(2)
    ids = torch.randperm(64, generator=gen)[:30]
    perm = torch.randperm(30, generator=gen)
    pe = dict(zip(ids.tolist(), torch.rand(30, generator=gen, dtype=torch.float64).tolist(), strict=True))
    probe = pe if isinstance(a, HIVE) else None  # each prompt keeps its prompt entropy under the permutation
    x, _ = run(a.plan(ids, budget), zero, entropy=zero, prompt_entropy=probe)
    y, _ = run(b.plan(ids[perm], budget), zero, entropy=zero, prompt_entropy=probe)
    assert torch.equal(y.counts, x.counts[perm]) and torch.equal(y.reasons, x.reasons[perm])


@pytest.mark.parametrize("kind", ["hive", "depo"])
def test_state_dict_round_trip_mid_run(kind: str) -> None:
    gen = torch.Generator().manual_seed(4)
    pools = [torch.randperm(64, generator=gen)[:24] for _ in range(8)]
    a = make(kind, 11)
    drive(a, range(4), 50, pools)
    saved = a.state_dict()
    tail_a = drive(a, range(4, 8), 50, pools)
    b = make(kind, 11)
    b.load_state_dict(saved)
    tail_b = drive(b, range(4, 8), 50, pools)
    for x, y in zip(tail_a, tail_b, strict=True):
        assert torch.equal(x.counts, y.counts) and torch.equal(x.reasons, y.reasons)
        assert torch.equal(x.rewards, y.rewards) and torch.equal(x.prompt_ids, y.prompt_ids)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(torch.as_tensor(sa[key]), torch.as_tensor(sb[key]), rtol=0, atol=0, equal_nan=True)
    # something was filtered along the way (the run is not trivially "keep all")
    assert any(bool((x.reasons != 0).any()) for x in tail_a)


@pytest.mark.parametrize("kind", ["hive", "depo"])
def test_empty_pool_and_zero_budget(kind: str) -> None:
    for ids, budget in ((torch.zeros(0, dtype=torch.long), 100), (torch.arange(3), 0)):
        a = make(kind, 0)
        res, reqs = run(a.plan(ids, budget), zero, entropy=zero, prompt_entropy=dict.fromkeys(range(3), 1.0))
        # nothing generated; HIVE still probes its (unseen, so surviving) candidates when there are some
        assert [r for r in reqs if not r.is_probe] == [] and int(res.counts.sum()) == 0
        assert len(reqs) == (1 if kind == "hive" and ids.numel() else 0)
        a.update(res)
        assert a.state_dict()["ids"].numel() == 0


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
    if cls is HIVE:
        kwargs = {**kwargs, "experimental": True}
    with pytest.raises(InputError, match=arg):
        cls(**kwargs)


@pytest.mark.parametrize("kind", ["hive", "depo"])
def test_bad_plan_observe_update_load(kind: str) -> None:
    a = make(kind, 0)
    with pytest.raises(InputError, match="budget"):
        a.plan(torch.tensor([1, 2]), -3)
    with pytest.raises(InputError, match="prompt_ids"):
        a.plan(torch.tensor([[1, 2]]), 8)
    with pytest.raises(InputError, match="prompt_ids"):
        a.plan(torch.tensor([1, 1]), 8)
    plan = a.plan(torch.tensor([1, 2]), 8)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="request"):  # unknown ids / not the pending request
        plan.observe(Request(torch.tensor([9]), torch.tensor([8])), torch.zeros(8))
    if isinstance(a, HIVE):  # the probe first: bad prompt entropies, then a good answer
        assert req.is_probe and req.prompt_ids.tolist() == [1, 2]
        with pytest.raises(InputError, match="prompt_entropy"):
            plan.observe(req, None, prompt_entropy=torch.zeros(3))  # one per probed row
        with pytest.raises(InputError, match="prompt_entropy"):
            plan.observe(req, None, prompt_entropy=torch.tensor([0.5, float("nan")]))
        with pytest.raises(InputError, match=r"^entropy"):  # not asked for by a probe
            plan.observe(req, None, prompt_entropy=torch.zeros(2), entropy=torch.zeros(2))
        with pytest.raises(InputError, match="rewards"):  # a probe generates nothing
            plan.observe(req, torch.zeros(2), prompt_entropy=torch.zeros(2))
        plan.observe(req, None, prompt_entropy=torch.ones(2))
        req = plan.next()
        assert req is not None
    assert not req.is_probe and req.signals == ("entropy",) and req.total == 8
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(2, 4), entropy=torch.zeros(8))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((8,), float("nan")), entropy=torch.zeros(8))
    with pytest.raises(InputError, match=r"^entropy"):
        plan.observe(req, torch.zeros(8), entropy=torch.zeros(7))
    with pytest.raises(InputError, match=r"^entropy"):
        plan.observe(req, torch.zeros(8), entropy=torch.full((8,), float("nan")))
    with pytest.raises(InputError, match=r"^prompt_entropy"):  # a probe signal with rollouts: not asked for
        plan.observe(req, torch.zeros(8), entropy=torch.zeros(8), prompt_entropy=torch.zeros(2))
    with pytest.raises(InputError, match=r"^hardness"):
        plan.observe(req, torch.zeros(8), entropy=torch.zeros(8), hardness=torch.zeros(2))
    if isinstance(a, DEPO):
        with pytest.raises(InputError, match=r"^entropy"):  # DEPO requires it
            plan.observe(req, torch.zeros(8))
    plan.observe(req, torch.zeros(8), entropy=torch.zeros(8))
    res = plan.finish()
    with pytest.raises(InputError, match="result"):
        a.update(None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="entropy"):  # a result whose entropy signal does not fit its rollouts
        a.update(dataclasses.replace(res, signals={**res.signals, "entropy": torch.zeros(7, dtype=torch.float64)}))
    if isinstance(a, DEPO):
        with pytest.raises(InputError, match=r"^entropy"):  # a result without the required signal
            a.update(dataclasses.replace(res, signals={}))
    with pytest.raises(InputError, match="state"):
        a.load_state_dict({})
    a.update(res)
    bad = a.state_dict()
    bad["ids"] = torch.tensor([2, 1])
    with pytest.raises(InputError, match="ids"):
        a.load_state_dict(bad)
    if isinstance(a, HIVE):
        top = HIVE(stage2="top", experimental=True).plan(torch.tensor([1]), 8)
        probe = top.next()
        assert probe is not None and probe.is_probe
        top.observe(probe, None)
        with pytest.raises(InputError, match="prompt_entropy"):
            top.next()
    else:
        with pytest.raises(InputError, match="epoch"):
            a.set_epoch(-1)
        with pytest.raises(InputError, match="correct"):
            depo_group_scores(torch.tensor([0]), torch.tensor([1.0]), torch.ones(1), num_groups=1)
        with pytest.raises(InputError, match="group"):
            depo_group_scores(torch.tensor([3]), torch.tensor([True]), torch.ones(1), num_groups=1)
        with pytest.raises(InputError, match="entropy"):
            depo_group_scores(torch.tensor([0]), torch.tensor([True]), torch.ones(2), num_groups=1)


def _refused(alloc: HIVE | DEPO, state: dict[str, object], argument: str) -> None:
    """Loading ``state`` is an InputError naming ``argument``, and ``alloc`` keeps its own state."""
    before = alloc.state_dict()
    with pytest.raises(InputError) as err:
        alloc.load_state_dict(state)
    assert err.value.argument == argument
    after = alloc.state_dict()
    for k, v in before.items():  # NaN marks a missing value: equal where both are NaN
        w = after[k]
        assert (
            v == w
            if not isinstance(v, torch.Tensor)
            else v.shape == w.shape and bool(((v == w) | (v != v) & (w != w)).all())
        )


def test_hive_refuses_inf_values_and_a_foreign_window_naming_the_field() -> None:
    """HIVE's windows and prompt entropies mark a missing value with NaN (it has no counter): an inf is refused,
    and so is a window of another width than the constructor's."""
    h = HIVE(window=2, experimental=True)
    good = {
        **h.state_dict(),
        "ids": torch.tensor([3, 7]),
        "reward": torch.tensor([[math.nan, 0.5], [1.0, 0.0]]),
        "entropy": torch.full((2, 2), math.nan),
        "prompt_entropy": torch.tensor([math.nan, 0.3]),
    }
    h.load_state_dict(good)  # NaN (missing) loads
    assert h.history(torch.tensor([3, 7]))[0].tolist() == [0.5, 0.5]
    for key in ("reward", "entropy"):
        t = torch.zeros(2, 2)
        t[1, 0] = math.inf
        _refused(h, {**good, key: t}, f"state[{key!r}]")
    _refused(h, {**good, "prompt_entropy": torch.tensor([0.1, -math.inf])}, "state['prompt_entropy']")
    _refused(h, {**good, "reward": torch.zeros(2, 3), "entropy": torch.zeros(2, 3)}, "state['reward']")
    _refused(h, {**good, "ids": torch.tensor([7, 3])}, "state['ids']")


def test_depo_refuses_inf_scores_and_negative_counters_naming_the_field() -> None:
    d = DEPO(history_k=2)
    good = {
        **d.state_dict(),
        "ids": torch.tensor([3, 7]),
        "scores": torch.tensor([[math.nan, 0.5], [1.0, 0.0]]),
        "count": torch.tensor([1, 4]),
        "epoch": 2,
        "steps": 5,
    }
    d.load_state_dict(good)
    assert d.epoch == 2 and d.steps == 5 and d.scores(torch.tensor([7]))[1].tolist() == [4]
    _refused(d, {**good, "scores": torch.tensor([[math.nan, math.inf], [1.0, 0.0]])}, "state['scores']")
    _refused(d, {**good, "count": torch.tensor([1, -1])}, "state['count']")
    _refused(d, {**good, "epoch": -1}, "state['epoch']")
    _refused(d, {**good, "steps": -3}, "state['steps']")
    _refused(d, {**good, "epoch": math.nan}, "state['epoch']")
    _refused(d, {**good, "scores": torch.zeros(2, 3)}, "state['scores']")  # history_k=3's windows
