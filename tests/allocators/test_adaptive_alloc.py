"""AR3PO, AERO and V05Budget: hand oracles of our reconstructions (see docs/methods/adaptive_alloc.md),
hypothesis properties (budget, caps, determinism, permutation), state round trips and bad input."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.advantages.v05 import v05
from rolloutopt.allocators import AllocationResult, Request
from rolloutopt.allocators.aero import AERO, _beyond_limit, _cut_beyond_limit, dead_zone_probability
from rolloutopt.allocators.ar3po import AR3PO, response_key
from rolloutopt.allocators.v05_budget import V05Budget
from rolloutopt.errors import InputError

from .helpers import hashed, run, table


def reasons(res: AllocationResult) -> dict[int, str]:
    return {int(i): res.reason_names[int(c)] for i, c in zip(res.plan_prompt_ids, res.reasons, strict=True)}


def per_prompt(res: AllocationResult, values: torch.Tensor) -> dict[int, float]:
    s = torch.zeros(res.plan_prompt_ids.numel(), dtype=torch.float64).index_add_(0, res.group, values.double())
    return {int(i): float(v) for i, v in zip(res.plan_prompt_ids, s, strict=True)}


def ar3po(**kw: Any) -> AR3PO:
    return AR3PO(experimental=True, **kw)


def aero(**kw: Any) -> AERO:
    return AERO(experimental=True, **kw)


def v05b(**kw: Any) -> V05Budget:
    return V05Budget(experimental=True, **kw)


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


# -- AERO oracles ----------------------------------------------------------------------------------------------------
def test_dead_zone_probability_oracle() -> None:
    n = torch.arange(1, 30)
    one = torch.ones(())
    assert torch.allclose(dead_zone_probability(one, one, n), 2 / (n.double() + 1), rtol=1e-12)
    # a = 9, b = 1, n = 8: B(17,1)/B(9,1) + B(9,9)/B(9,1) = 9/17 + 9 * 8! 8! / 17!
    want = 9 / 17 + 9 * math.factorial(8) ** 2 / math.factorial(17)
    got = float(dead_zone_probability(torch.tensor(9.0), torch.tensor(1.0), 8))
    assert got == pytest.approx(want, rel=1e-12) and got == pytest.approx(0.529, abs=1e-3)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.05, 50), st.floats(0.05, 50), st.integers(1, 64))
def test_dead_zone_probability_is_expectation(a: float, b: float, n: int) -> None:
    """E[p^n + (1-p)^n] by quadrature of the Beta density; P0 is finite, in (0, 1] and decreasing in n."""
    x = torch.linspace(1e-6, 1 - 1e-6, 200001, dtype=torch.float64)
    logpdf = (a - 1) * torch.log(x) + (b - 1) * torch.log1p(-x)
    w = torch.exp(logpdf - logpdf.max())
    f = x**n + (1 - x) ** n
    quad = float((w * f).sum() / w.sum())
    at, bt = torch.tensor(a), torch.tensor(b)
    p0 = float(dead_zone_probability(at, bt, n))
    if min(a, b) >= 1:
        assert p0 == pytest.approx(quad, abs=2e-3)
    assert 0 < p0 <= 1 + 1e-12
    assert float(dead_zone_probability(at, bt, n + 1)) <= p0 + 1e-12


def test_aero_sizes_skips_and_updates() -> None:
    e = aero()
    a, b = e.posterior(torch.tensor([7]))
    assert (float(a), float(b)) == (1.0, 1.0)
    res, _ = run(e.plan(torch.tensor([7, 8]), 100), table({7: [1], 8: [1, 0]}))
    assert res.counts.tolist() == [9, 9]  # smallest n with 2/(n+1) <= 0.2
    e.update(res)
    a, b = e.posterior(torch.tensor([7, 8]))
    assert a.tolist() == [10.0, 6.0] and b.tolist() == [1.0, 5.0]
    # prompt 7: a = 10, b = 1: P0(16) ~ 10/26 < 0.5, never <= 0.2 -> n_max; after another 16/16 (a = 26): skip
    res, _ = run(e.plan(torch.tensor([7]), 100), table({7: [1]}))
    assert res.counts.tolist() == [16] and reasons(res) == {7: "flat_dropped"} and res.weight.sum() == 0
    e.update(res)
    res, reqs = run(e.plan(torch.tensor([7]), 100), table({7: [1]}))
    assert reqs == [] and reasons(res) == {7: "skipped"}


def test_aero_forgetting() -> None:
    e = aero(forget=0.5)
    e.update(run(e.plan(torch.tensor([1]), 100), table({1: [1, 0, 0]}))[0])  # 9 rollouts: 3 successes
    a, b = e.posterior(torch.tensor([1]))
    assert (float(a), float(b)) == (0.5 + 3, 0.5 + 6)


def test_aero_selective_rejection_oracle() -> None:
    # 1 success, 8 failures in 9 rollouts; ratio 2: keep the success and 2 failures
    res, _ = run(aero(reject_ratio=2.0).plan(torch.tensor([4]), 9), table({4: [1, 0, 0, 0, 0, 0, 0, 0, 0]}))
    assert res.counts.tolist() == [9] and reasons(res) == {4: "rejected_surplus"}
    kept = res.weight > 0
    assert int(kept.sum()) == 3 and float(res.rewards[kept].sum()) == 1.0
    res, _ = run(aero(reject_ratio=None).plan(torch.tensor([4]), 9), table({4: [1, 0, 0, 0, 0, 0, 0, 0, 0]}))
    assert res.weight.sum() == 9 and reasons(res) == {4: "allocated"}
    # n_min raises the kept majority: n_min = 5, m = 1 -> keep max(2, 4) = 4 failures
    res, _ = run(aero(n_min=5).plan(torch.tensor([4]), 9), table({4: [1, 0, 0, 0, 0, 0, 0, 0, 0]}))
    assert int((res.weight > 0).sum()) == 5


def test_aero_budget_priority_and_partial() -> None:
    e = aero()
    e.update(run(e.plan(torch.tensor([1]), 100), table({1: [1, 0]}))[0])  # a = 6, b = 5: P0(n) small, n < 9
    a, b = e.posterior(torch.tensor([1]))
    ns = torch.arange(2, 17)
    n1 = int(ns[(dead_zone_probability(a, b, ns) <= 0.2).nonzero()[0, 0]])
    res, _ = run(e.plan(torch.tensor([0, 1, 2]), n1 + 9 + 3), table({0: [1, 0], 1: [1, 0], 2: [1, 0]}))
    assert n1 < 9 and res.counts.tolist() == [9, n1, 3]
    assert reasons(res)[2] == "partial"
    res, _ = run(e.plan(torch.tensor([0, 1, 2]), n1 + 1), table({0: [1, 0], 1: [1, 0], 2: [1, 0]}))
    assert res.counts.tolist() == [0, n1, 0]  # remainder 1 < n_min: nothing


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), segs=st.integers(1, 8), kind=st.integers(0, 2))
def test_aero_cut_beyond_limit_matches_exact_ranking(seed: int, segs: int, kind: int) -> None:
    """The truncated-key sort selects what the exact (key, index) ranking selects, also when truncations tie."""
    g = torch.Generator().manual_seed(seed)
    size = torch.randint(2, 12, (segs,), generator=g)
    limit = (torch.rand(segs, generator=g, dtype=torch.float64) * (size - 1).double()).long() + 1
    seg = torch.cat([torch.repeat_interleave(torch.arange(segs), size), torch.full((seed % 4,), segs)])
    seg = seg[torch.randperm(seg.numel(), generator=g)]
    if kind == 0:  # seeded uniforms
        key = torch.rand(seg.numel(), generator=g, dtype=torch.float64)
    elif kind == 1:  # equal in their top 40 bits, distinct: every boundary is a tie of truncations
        key = 0.5 + torch.randint(0, 4, (seg.numel(),), generator=g).double() * 2.0**-45
    else:  # exact ties: ranked by index
        key = torch.randint(0, 3, (seg.numel(),), generator=g).double() / 4
    want, _ = _beyond_limit(seg, key, torch.cat([limit, torch.tensor([1 << 40])]))
    got = _cut_beyond_limit(seg.int(), key, size, limit)
    assert sorted(got.tolist()) == sorted(want.tolist())


def test_aero_cut_beyond_limit_int64_path() -> None:
    """More than 2**19 segments: the composite key is int64 (fewer key bits left in int32)."""
    g = torch.Generator().manual_seed(0)
    s_n = (1 << 19) + 5
    size = torch.full((s_n,), 3)
    limit = torch.randint(1, 3, (s_n,), generator=g)
    seg = torch.repeat_interleave(torch.arange(s_n), size)
    key = torch.rand(seg.numel(), generator=g, dtype=torch.float64)
    want, _ = _beyond_limit(seg, key, limit)
    got = _cut_beyond_limit(seg.int(), key, size, limit)
    assert torch.equal(got.sort().values, want.sort().values)


@pytest.mark.parametrize(("drop_flat", "prior"), [(True, (1.0, 1.0)), (False, (0.5, 2.0))])
def test_aero_rejection_matches_reference_ranking(drop_flat: bool, prior: tuple[float, float]) -> None:
    """Selective rejection keeps, per prompt, the majority rollouts whose seeded keys (one per majority rollout, in
    observation order) rank below the limit: replayed here with a generator seeded alike and the exact ranking."""
    ids = torch.arange(400) * 3 + 1
    res, _ = run(aero(seed=3, drop_flat=drop_flat, n_min=3, prior=prior).plan(ids, 5000), hashed(1))
    pos, y = res.group, (res.rewards >= 1.0).long()
    n = res.counts
    c = torch.zeros(ids.numel(), dtype=torch.long).index_add_(0, pos, y)
    m = torch.minimum(c, n - c)
    flat = (n > 0) & (m == 0)
    code = torch.where((2 * c == n) | flat, 2, (2 * c > n).long())
    idx = (code[pos] == y).nonzero().squeeze(1)
    key = torch.rand(idx.numel(), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    limit = torch.maximum(torch.ceil(2.0 * m.double()).long(), 3 - m)
    cut, _ = _beyond_limit(pos[idx], key, limit)
    want = (~flat).double()[pos] if drop_flat else torch.ones(pos.numel(), dtype=torch.float64)
    want[idx[cut]] = 0.0
    assert cut.numel() > 0
    assert torch.equal(res.weight, want)
    rejected = torch.zeros(ids.numel(), dtype=torch.bool)
    rejected[pos[idx[cut]]] = True
    assert torch.equal(res.reasons == 1, rejected)


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


# -- properties -------------------------------------------------------------------------------------------------------
FACTORIES: dict[str, Callable[[int], Any]] = {
    "ar3po": lambda s: ar3po(k=3, stages=3, buffer="random", seed=s, n_max=8),
    "ar3po_latest": lambda s: ar3po(k=2, stages=4, seed=s),
    "aero": lambda s: aero(n_max=10, seed=s),
    "v05": lambda s: v05b(n_max=9, rounds=2),
}
CAPS = {"ar3po": (3, 8), "ar3po_latest": (2, 8), "aero": (2, 10), "v05": (4, 9)}


def _steps(alloc: Any, ids: torch.Tensor, budget: int, seed: int, steps: int) -> list[AllocationResult]:
    out = []
    for t in range(steps):
        res, _ = run(alloc.plan(ids, budget), hashed(seed + t))
        alloc.update(res)
        out.append(res)
    return out


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(sorted(FACTORIES)),
    st.lists(st.integers(0, 10**9), min_size=0, max_size=12, unique=True),
    st.integers(0, 120),
    st.integers(0, 50),
)
def test_budget_caps_and_determinism(name: str, ids: list[int], budget: int, seed: int) -> None:
    t = torch.tensor(ids, dtype=torch.long)
    lo, hi = CAPS[name]
    ra = _steps(FACTORIES[name](seed), t, budget, seed, 3)
    rb = _steps(FACTORIES[name](seed), t, budget, seed, 3)
    for a, b in zip(ra, rb, strict=True):
        gen = int(a.counts.sum())
        assert gen <= budget and float(a.metrics["rollouts"]) == gen
        assert a.rewards.numel() == gen + int(a.metrics.get("reused", torch.tensor(0.0)))
        assert bool(((a.counts == 0) | ((a.counts >= lo) & (a.counts <= hi))).all())
        assert bool(torch.isfinite(a.weight).all()) and bool(((a.weight >= 0) & (a.weight <= 1)).all())
        for f in ("prompt_ids", "group", "rewards", "weight", "counts", "reasons"):
            assert torch.equal(getattr(a, f), getattr(b, f))


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(sorted(FACTORIES)),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=10, unique=True),
    st.integers(0, 100),
    st.randoms(use_true_random=False),
)
def test_permutation_permutes_the_plan(name: str, ids: list[int], budget: int, rnd: Any) -> None:
    perm = list(ids)
    rnd.shuffle(perm)
    ra = _steps(FACTORIES[name](0), torch.tensor(ids), budget, 1, 2)
    rb = _steps(FACTORIES[name](0), torch.tensor(perm), budget, 1, 2)
    for a, b in zip(ra, rb, strict=True):
        ca = dict(zip(a.plan_prompt_ids.tolist(), a.counts.tolist(), strict=True))
        cb = dict(zip(b.plan_prompt_ids.tolist(), b.counts.tolist(), strict=True))
        assert ca == cb and reasons(a) == reasons(b)
        assert per_prompt(a, a.rewards) == per_prompt(b, b.rewards)
        assert per_prompt(a, a.weight) == per_prompt(b, b.weight)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_dict_round_trip_mid_run(name: str) -> None:
    ids = torch.arange(30) * 7 + 1
    a = FACTORIES[name](5)
    _steps(a, ids, 150, 0, 3)
    state = a.state_dict()
    b = FACTORIES[name](99)
    b.load_state_dict(state)
    if name == "v05":
        a.set_prior(ids[:5], torch.full((5,), 0.2))
        b.set_prior(ids[:5], torch.full((5,), 0.2))
    ra = _steps(a, ids, 150, 3, 3)
    rb = _steps(b, ids, 150, 3, 3)
    for x, y in zip(ra, rb, strict=True):
        for f in ("prompt_ids", "group", "rewards", "weight", "counts", "reasons"):
            assert torch.equal(getattr(x, f), getattr(y, f))
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]) or (torch.isnan(sa[k]).equal(torch.isnan(sb[k])))
        else:
            assert sa[k] == sb[k]


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [AR3PO, AERO, V05Budget])
def test_experimental_flag_required(cls: Any) -> None:
    with pytest.raises(InputError, match="experimental"):
        cls()


@pytest.mark.parametrize(
    ("factory", "kw", "arg"),
    [
        (ar3po, {"k": 0}, "k"),
        (ar3po, {"n_min": 5}, "n_min"),
        (ar3po, {"n_max": 3}, "n_max"),
        (ar3po, {"buffer": "oldest"}, "buffer"),
        (ar3po, {"reuse": 1}, "reuse"),
        (ar3po, {"success": math.nan}, "success"),
        (aero, {"eps": 1.5}, "eps"),
        (aero, {"n_max": 1}, "n_max"),
        (aero, {"prior": (0.0, 1.0)}, "prior"),
        (aero, {"forget": 0.0}, "forget"),
        (aero, {"reject_ratio": -1.0}, "reject_ratio"),
        (v05b, {"n_max": 2}, "n_max"),
        (v05b, {"unseen_prior": 2.0}, "unseen_prior"),
        (v05b, {"v05_kwargs": {"experimental": False}}, "v05_kwargs"),
    ],
)
def test_bad_hyperparameters(factory: Callable[..., Any], kw: dict[str, Any], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        factory(**kw)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_bad_protocol_input(name: str) -> None:
    alloc = FACTORIES[name](0)
    with pytest.raises(InputError, match="budget"):
        alloc.plan(torch.tensor([1, 2]), -1)
    with pytest.raises(InputError, match="prompt_ids"):
        alloc.plan(torch.tensor([1.0, 2.0]), 10)
    plan = alloc.plan(torch.tensor([1, 2]), 40)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(req.total + 1))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((req.total,), math.nan))
    with pytest.raises(InputError, match="request"):
        plan.observe(Request(torch.tensor([77]), torch.tensor([req.total])), torch.zeros(req.total))
    plan2 = alloc.plan(torch.tensor([1, 2]), 40)
    req2 = plan2.next()
    assert req2 is not None
    plan2._pending = Request(torch.tensor([77]), req2.counts[:1])  # a request naming an id outside the plan
    with pytest.raises(InputError, match="prompt_ids"):
        plan2.observe(plan2._pending, torch.zeros(int(req2.counts[0])))
    with pytest.raises(InputError, match="result"):
        alloc.update("not a result")
    other = run(FACTORIES["aero" if name != "aero" else "v05"](0).plan(torch.tensor([1]), 10), hashed(0))[0]
    with pytest.raises(InputError, match="result"):
        alloc.update(other)
    with pytest.raises(InputError, match="state"):
        alloc.load_state_dict({"nope": 1})


def test_v05budget_bad_prior_and_output() -> None:
    vb = v05b()
    with pytest.raises(InputError, match="prior"):
        vb.set_prior(torch.tensor([1, 2]), torch.tensor([0.5]))
    with pytest.raises(InputError, match="prior"):
        vb.set_prior(torch.tensor([1]), torch.tensor([math.nan]))
    with pytest.raises(InputError, match="output"):
        vb.plan(torch.tensor([1]), 4).consume(torch.zeros(1))


def test_ar3po_reused_before_finish() -> None:
    with pytest.raises(InputError, match=r"plan\.reused"):
        ar3po().plan(torch.tensor([1]), 4).reused()


def test_aero_plan_sizes_equal_the_lgamma_rule() -> None:
    """The plan's cumulative-product P0 picks the same n as dead_zone_probability (lgamma) on random posteriors."""
    e = aero(n_min=3, n_max=12, eps=0.15, tau_skip=0.7)
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(200)
    a = torch.rand(200, generator=g, dtype=torch.float64) * 30 + 0.1
    b = torch.rand(200, generator=g, dtype=torch.float64) * 30 + 0.1
    e.load_state_dict({"ids": ids, "a": a, "b": b, "generator": torch.Generator().get_state()})
    res, _ = run(e.plan(ids, 10**6), hashed(0))
    ns = torch.arange(3, 13)
    p0 = dead_zone_probability(a[:, None], b[:, None], ns[None, :])
    below = p0 <= 0.15
    want = torch.where(below.any(1), ns[below.to(torch.int8).argmax(1)], 12)
    want = torch.where(p0[:, -1] > 0.7, 0, want)
    assert torch.equal(res.counts, want) and bool((want == 0).any()) and bool((want > 3).any())


def test_ar3po_state_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """A NaN buffered reward, a negative step counter, buffer steps not before it and keys of another step: an
    ``InputError`` naming the field, and the allocator keeps its own state."""
    a = FACTORIES["ar3po_latest"](0)
    _steps(a, torch.arange(30) * 7 + 1, 150, 0, 3)
    good = a.state_dict()
    m = good["buffer_ids"].numel()
    assert m >= 1
    nan_r = good["buffer_rewards"].clone()
    nan_r[-1] = math.nan
    cases = [
        ({**good, "buffer_rewards": nan_r}, "state['buffer_rewards']"),
        ({**good, "step": -1}, "state['step']"),
        ({**good, "buffer_steps": good["buffer_steps"] - 10}, "state['buffer_steps']"),
        ({**good, "buffer_steps": torch.full((m,), good["step"])}, "state['buffer_steps']"),
        ({**good, "buffer_keys": good["buffer_keys"] + (1 << 32)}, "state['buffer_keys']"),
    ]
    for bad, arg in cases:
        with pytest.raises(InputError) as err:
            a.load_state_dict(bad)
        assert err.value.argument == arg
    after = a.state_dict()
    assert after["step"] == good["step"] and torch.equal(after["buffer_rewards"], good["buffer_rewards"])


def test_v05budget_state_refuses_nan_and_negative_counts_naming_the_field() -> None:
    """A NaN reward sum, a negative count, a prior outside [0, 1]: an ``InputError`` naming the field; a NaN prior
    (none) is valid."""
    vb = FACTORIES["v05"](0)
    ids = torch.arange(30) * 7 + 1
    _steps(vb, ids, 150, 0, 2)
    vb.set_prior(ids[:5], torch.full((5,), 0.2))
    good = vb.state_dict()
    assert bool(torch.isnan(good["value"]).any())  # prompts without a value-model prior
    nan_sum = good["sum"].clone()
    nan_sum[0] = math.nan
    cases = [
        ({**good, "sum": nan_sum}, "state['sum']"),
        ({**good, "count": good["count"] - 1e6}, "state['count']"),
        ({**good, "value": torch.where(torch.isnan(good["value"]), 1.5, good["value"])}, "state['value']"),
        ({**good, "value": torch.full_like(good["value"], math.inf)}, "state['value']"),
    ]
    for bad, arg in cases:
        with pytest.raises(InputError) as err:
            vb.load_state_dict(bad)
        assert err.value.argument == arg
    assert torch.equal(vb.state_dict()["sum"], good["sum"])
    fresh = FACTORIES["v05"](0)
    fresh.load_state_dict(good)
    assert torch.equal(fresh.prior(ids), vb.prior(ids))
