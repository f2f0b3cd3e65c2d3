"""AERO: hand oracles of our reconstruction (see docs/methods/adaptive_alloc.md), hypothesis properties
(budget, caps, determinism, permutation), state round trips and bad input."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators.aero import AERO, _beyond_limit, _cut_beyond_limit, dead_zone_probability
from rolloutopt.allocators.table import PromptTable
from rolloutopt.errors import InputError

from .adaptive_helpers import (
    aero,
    ar3po,
    check_bad_hyperparameters,
    check_bad_protocol_input,
    check_budget_caps_and_determinism,
    check_experimental_flag_required,
    check_permutation_permutes_the_plan,
    check_shared_table_equals_private,
    check_state_dict_round_trip_mid_run,
    reasons,
)
from .helpers import hashed, run, table


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


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(["aero"]),
    st.lists(st.integers(0, 10**9), min_size=0, max_size=12, unique=True),
    st.integers(0, 120),
    st.integers(0, 50),
)
def test_budget_caps_and_determinism(name: str, ids: list[int], budget: int, seed: int) -> None:
    check_budget_caps_and_determinism(name, ids, budget, seed)


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(["aero"]),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=10, unique=True),
    st.integers(0, 100),
    st.randoms(use_true_random=False),
)
def test_permutation_permutes_the_plan(name: str, ids: list[int], budget: int, rnd: Any) -> None:
    check_permutation_permutes_the_plan(name, ids, budget, rnd)


@pytest.mark.parametrize("name", ["aero"])
def test_state_dict_round_trip_mid_run(name: str) -> None:
    check_state_dict_round_trip_mid_run(name)


# -- bad input -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [AERO])
def test_experimental_flag_required(cls: Any) -> None:
    check_experimental_flag_required(cls)


@pytest.mark.parametrize(
    ("factory", "kw", "arg"),
    [
        (aero, {"eps": 1.5}, "eps"),
        (aero, {"n_max": 1}, "n_max"),
        (aero, {"prior": (0.0, 1.0)}, "prior"),
        (aero, {"forget": 0.0}, "forget"),
        (aero, {"reject_ratio": -1.0}, "reject_ratio"),
    ],
)
def test_bad_hyperparameters(factory: Callable[..., Any], kw: dict[str, Any], arg: str) -> None:
    check_bad_hyperparameters(factory, kw, arg)


@pytest.mark.parametrize("name", ["aero"])
def test_bad_protocol_input(name: str) -> None:
    check_bad_protocol_input(name)


def test_aero_plan_sizes_equal_the_lgamma_rule() -> None:
    """The plan's cumulative-product P0 picks the same n as dead_zone_probability (lgamma) on random posteriors."""
    e = aero(n_min=3, n_max=12, eps=0.15, tau_skip=0.7)
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(200)
    a = torch.rand(200, generator=g, dtype=torch.float64) * 30 + 0.1
    b = torch.rand(200, generator=g, dtype=torch.float64) * 30 + 0.1
    pos, order = e._cols.add(ids)  # write the posteriors into AERO's table columns
    e._cols["a"].index_copy_(0, pos, a[order])
    e._cols["b"].index_copy_(0, pos, b[order])
    res, _ = run(e.plan(ids, 10**6), hashed(0))
    ns = torch.arange(3, 13)
    p0 = dead_zone_probability(a[:, None], b[:, None], ns[None, :])
    below = p0 <= 0.15
    want = torch.where(below.any(1), ns[below.to(torch.int8).argmax(1)], 12)
    want = torch.where(p0[:, -1] > 0.7, 0, want)
    assert torch.equal(res.counts, want) and bool((want == 0).any()) and bool((want > 3).any())


# -- the prompt table ------------------------------------------------------------------------------------------------
def test_aero_capacity_evicts_the_least_recently_updated() -> None:
    e = aero(capacity=2)
    e.update(run(e.plan(torch.tensor([7, 8]), 100), table({7: [1], 8: [1, 0]}))[0])
    e.update(run(e.plan(torch.tensor([9]), 100), table({9: [0]}))[0])
    # 7 and 8 were updated together: the tie evicts the smaller id, 7, which is back to the prior
    assert e.table.prompt_ids.tolist() == [8, 9]
    a, b = e.posterior(torch.tensor([7, 8, 9]))
    assert a.tolist() == [1.0, 6.0, 1.0] and b.tolist() == [1.0, 5.0, 10.0]
    res, _ = run(e.plan(torch.tensor([7]), 100), table({7: [1]}))
    assert res.counts.tolist() == [9]  # a never-seen prompt's group


def test_aero_shared_table_equals_private_tables() -> None:
    """Two AEROs ("aero", "aero#2") and an AR3PO on one table; the pools overlap, so each sees rows the others
    added (unseen for it: the prior)."""
    check_shared_table_equals_private(
        [
            lambda t: aero(n_max=10, seed=1, table=t),
            lambda t: ar3po(k=2, stages=3, table=t),
            lambda t: aero(n_min=3, prior=(0.5, 2.0), forget=0.8, seed=2, table=t),
        ],
        [torch.arange(30) * 7 + 1, torch.arange(25) * 5, torch.arange(20) * 3],
    )


def test_aero_refuses_a_shared_table_of_another_prior() -> None:
    """Rows another owner added hold the saving AERO's prior: an AERO with another prior refuses that table."""
    t = PromptTable()
    e, other = aero(table=t), ar3po(k=1, stages=1, table=t)
    e.update(run(e.plan(torch.tensor([1]), 100), table({1: [1, 0]}))[0])
    other.update(run(other.plan(torch.tensor([2]), 10), table({2: [1]}))[0])  # row 2: unseen by AERO
    ckpt = {"table": t.state_dict(), "aero": e.state_dict(), "ar3po": other.state_dict()}
    fresh = PromptTable()
    e2, other2 = aero(prior=(2.0, 1.0), table=fresh), ar3po(k=1, stages=1, table=fresh)
    fresh.load_state_dict(ckpt["table"])
    with pytest.raises(InputError, match=r"aero/a"):
        e2.load_state_dict(ckpt["aero"])
    other2.load_state_dict(ckpt["ar3po"])
