"""The XRPO allocator (arXiv 2510.06672): oracles, hand examples, properties, state round trips, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators.xrpo import XRPO, t_quantile
from rolloutopt.errors import InputError

from .replay_helpers import F64, const, keyed, run


# -- XRPO -----------------------------------------------------------------------------------------------------------
def test_t_quantile_against_tables() -> None:
    # two-sided 95% critical values of Student's t (standard tables)
    df = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 30.0])
    want = torch.tensor([12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.2281, 2.0423], dtype=F64)
    got = t_quantile(0.975, df)
    assert bool(((got - want).abs() / want < 3e-3).all())
    torch.testing.assert_close(got[:2], want[:2], atol=1e-4, rtol=0)
    assert bool(torch.isnan(t_quantile(0.975, torch.tensor([0.0]))).all())


def test_xrpo_requires_experimental() -> None:
    with pytest.raises(InputError, match="experimental"):
        XRPO()


def test_xrpo_priority_by_hand() -> None:
    # lam = 0: priority = t_{.975,3} s / 2 - t_{.975,4} s / sqrt(5), s = sample sd of [1, 0, 1, 0] = sqrt(1/3)
    xr = XRPO(n_base=4, lam=0.0, round_size=1, experimental=True)
    plan = xr.plan(torch.tensor([10, 20]), 9)
    world = const({10: [1.0, 0.0], 20: [1.0]})
    req = plan.next()
    assert req is not None and req.counts.tolist() == [4, 4]
    plan.observe(req, world(req))
    s = math.sqrt(1 / 3)
    want = 3.1824 * s / 2 - 2.7764 * s / math.sqrt(5)
    pri = plan.priority()  # type: ignore[attr-defined]
    assert abs(float(pri[0]) - want) < 2e-3 and float(pri[1]) == 0.0
    req = plan.next()
    assert req is not None and req.prompt_ids.tolist() == [10] and req.counts.tolist() == [1]
    plan.observe(req, world(req))
    assert plan.next() is None
    res = plan.finish()
    assert res.counts.tolist() == [5, 4]
    assert [res.reason_of(10), res.reason_of(20)] == ["extra", "base"]


def test_xrpo_bonus_alone_is_round_robin() -> None:
    # all-equal groups: Delta h = 0, the bonus lam sqrt(log(1+T)/n) favours the fewest rollouts, ties to lower ids
    xr = XRPO(n_base=2, lam=1.0, round_size=1, experimental=True)
    res, reqs = run(xr.plan(torch.tensor([3, 1, 2]), 6 + 3), const({1: [1.0], 2: [0.0], 3: [1.0]}))
    assert [r.prompt_ids.tolist() for r in reqs[1:]] == [[1], [2], [3]]
    assert res.counts.tolist() == [3, 3, 3]


def test_xrpo_targets_uncertain_prompts_caps_and_short_budget() -> None:
    xr = XRPO(n_base=4, n_max=12, lam=0.0, experimental=True)
    world = const({0: [1.0, 0.0], 1: [1.0], 2: [0.0], 3: [0.0, 1.0]})
    res, _ = run(xr.plan(torch.arange(4), 32), world)
    assert int(res.counts.sum()) == 32
    assert res.counts.tolist() == [12, 4, 4, 12]  # the mixed prompts take all 16 extras, up to n_max
    assert [res.reason_of(i) for i in range(4)] == ["capped", "base", "base", "capped"]
    res, _ = run(xr.plan(torch.arange(4), 1000), world)  # everything capped: spends 4 * 12
    assert res.counts.tolist() == [12] * 4
    res, _ = run(xr.plan(torch.tensor([7, 5, 6]), 9), world_all := const({5: [1.0], 6: [1.0], 7: [1.0]}))
    assert res.counts.tolist() == [0, 5, 4] and res.reason_of(7) == "no_budget"  # lowest ids get base groups
    del world_all


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(0, 10),
    budget=st.integers(0, 120),
    n_base=st.integers(1, 5),
    extra=st.integers(0, 6),
    lam=st.sampled_from([0.0, 0.05, 1.0]),
    seed=st.integers(0, 50),
)
def test_xrpo_properties(k: int, budget: int, n_base: int, extra: int, lam: float, seed: int) -> None:
    n_max = n_base + extra
    rate = torch.linspace(0.0, 1.0, 20, dtype=F64)
    ids = torch.randperm(20, generator=torch.Generator().manual_seed(seed))[:k]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed + 1))
    xr = XRPO(n_base=n_base, n_max=n_max, lam=lam, experimental=True)

    world = keyed(rate, 0)
    ra, _ = run(xr.plan(ids, budget), world)
    rb, _ = run(xr.plan(ids[perm], budget), world)
    spent = int(ra.counts.sum())
    assert spent <= budget
    got = ra.counts[ra.counts > 0]
    assert bool(((got >= n_base) & (got <= n_max)).all())
    if k and budget >= k * n_base:
        assert spent == min(budget, k * n_max)  # spends everything unless every prompt is capped
    assert torch.equal(rb.counts, ra.counts[perm]) and torch.equal(rb.reasons, ra.reasons[perm])
    xr.update(ra)
    rc, _ = run(xr.plan(ids, budget), world)
    assert torch.equal(rc.counts, ra.counts)  # deterministic


def test_xrpo_state_and_bad_input() -> None:
    xr = XRPO(experimental=True)
    other = XRPO(experimental=True, seed=5)
    other.load_state_dict(xr.state_dict())
    assert torch.equal(other.state_dict()["generator"], xr.state_dict()["generator"])
    for kwargs, arg in (
        ({"n_base": 0}, "n_base"),
        ({"n_max": 4}, "n_max"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": 0.0}, "alpha"),
        ({"lam": -1.0}, "lam"),
        ({"round_size": 0}, "round_size"),
        ({"s_floor": -0.1}, "s_floor"),
        ({"n_min": 0}, "n_min"),
    ):
        with pytest.raises(InputError, match=arg):
            XRPO(experimental=True, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="budget"):
        xr.plan(torch.arange(2), -3)
    plan = xr.plan(torch.arange(2), 16)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(3))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((req.total,), float("nan")))
    with pytest.raises(InputError, match="prompt_ids"):
        plan.positions(torch.tensor([42]))
    with pytest.raises(InputError, match="result"):
        xr.update(None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="state"):
        xr.load_state_dict({})


def test_xrpo_load_refuses_a_bad_generator_or_version_naming_the_field() -> None:
    """XRPO's only state is its generator: a non-generator tensor, a NaN float tensor in its place or another format
    version is an ``InputError`` naming the field, and the generator is unchanged."""
    xr = XRPO(experimental=True)
    good = xr.state_dict()
    for value in (torch.full((4,), math.nan), torch.full((3,), -1), "state"):
        with pytest.raises(InputError) as err:
            xr.load_state_dict({**good, "generator": value})
        assert err.value.argument == "state['generator']"
    with pytest.raises(InputError) as err:
        xr.load_state_dict({**good, "format": 2})
    assert err.value.argument == "state['format']"
    assert torch.equal(xr.state_dict()["generator"], good["generator"])
