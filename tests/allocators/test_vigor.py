"""VIGOR and vigor_speedup: hand oracles, properties, bad input.

VIGOR's oracles are our reconstruction (see docs/methods/topup.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators.pilot_commit import PilotCommit
from rolloutopt.allocators.vigor import VIGOR, vigor_speedup
from rolloutopt.errors import InputError

from .helpers import hashed, run, table
from .topup_helpers import check_bad_protocol_input, reasons, vigor


# ---------------------------------------------------------------------------------------------------- VIGOR oracles
@pytest.mark.parametrize("rule", ["variance", "marginal"])
def test_vigor_oracle_flat_groups_get_nothing(rule: str) -> None:
    # VIGOR: budget 16, variances [0, 0, .25, .25] after a 2-each warm start: the 8 extra go to the last two.
    # variance rule: both .25 prompts tie at the cut, so each round's chunk (ceil(8/4) = 2) is shared 1 + 1.
    res, reqs = run(vigor(mode="static", rule=rule).plan(torch.tensor([0, 1, 2, 3]), 16),
                    table({0: [1, 1], 1: [0, 0], 2: [1, 0], 3: [0, 1]}))  # fmt: skip
    assert res.counts.tolist() == [2, 2, 6, 6]
    assert reqs[0] == ([0, 1, 2, 3], [2, 2, 2, 2])
    assert reasons(res) == ["zero_variance", "zero_variance", "top_up", "top_up"]
    assert res.weight.tolist() == [1.0] * 16


def test_vigor_oracle_marginal_spreads() -> None:
    # VIGOR: variances [.25, .0625] ([1,0] and [0,.5]), warm start 2 each, 4 extra units. Marginal gains
    # s^2/(n(n+1)): p0 .25/6, .25/12, .25/20 all beat p1's .0625/6 = .0104; then p1's .0104 beats p0's .25/30.
    # Greedy: p0, p0, p0, p1 -> [5, 3].
    res, _ = run(vigor(mode="static", rule="marginal").plan(torch.tensor([0, 1]), 8), table({0: [1, 0], 1: [0, 0.5]}))
    assert res.counts.tolist() == [5, 3]
    # The abstract's rule gives every unit to the highest-variance group (top half of 2 eligible = 1): [6, 2].
    res, _ = run(vigor(mode="static").plan(torch.tensor([0, 1]), 8), table({0: [1, 0], 1: [0, 0.5]}))
    assert res.counts.tolist() == [6, 2]


def test_vigor_online_reestimates() -> None:
    # Warm start [1,0] and [1,0] (both .25, tie). Round 1 (chunk 2): tie at the cut -> one each; p0 draws 1 ->
    # [1,0,1] var 2/9; p1 draws .5 -> [1,0,.5] var 1/6. Online round 2: p0 alone is the top half -> +2 -> [5, 3].
    # Static keeps the tie -> one each again -> [4, 4].
    t = table({0: [1, 0, 1, 1, 1, 1], 1: [1, 0, 0.5, 0.5, 0.5]})
    on, reqs = run(vigor(chunk=2).plan(torch.tensor([0, 1]), 8), t)
    assert on.counts.tolist() == [5, 3] and reqs[1:] == [([0, 1], [1, 1]), ([0], [2])]
    off, _ = run(vigor(chunk=2, mode="static").plan(torch.tensor([0, 1]), 8), t)
    assert off.counts.tolist() == [4, 4]


def test_vigor_reasons_and_caps() -> None:
    # vars after warm-up: 0, .25, .0625, 0; chunk 2 -> p1 (top half of {p1, p2}) gets 2 -> n = 4 = n_max.
    t = table({0: [1, 1], 1: [1, 0], 2: [0, 0.5], 3: [0, 0]})
    res, _ = run(vigor(chunk=2, n_max=4).plan(torch.tensor([0, 1, 2, 3]), 10), t)
    assert res.counts.tolist() == [2, 4, 2, 2]
    assert reasons(res) == ["zero_variance", "capped", "initial", "zero_variance"]
    # n_max caps every prompt; once all eligible prompts are capped the rest of the budget is left unspent.
    res, _ = run(vigor(chunk=2, n_max=4).plan(torch.tensor([0, 1, 2, 3]), 40), t)
    assert res.counts.tolist() == [2, 4, 4, 2] and res.rewards.numel() == 12


def test_vigor_short_budget_warms_lowest_ids() -> None:
    res, reqs = run(vigor().plan(torch.tensor([7, 3, 5]), 5), table({3: [1, 0], 5: [1, 1], 7: [0, 1]}))
    assert reqs[0] == ([3, 5], [2, 2]) and res.counts.tolist() == [0, 3, 2]  # the 1 left goes to p3 (var > 0)
    assert reasons(res) == ["no_budget", "top_up", "zero_variance"]
    res, reqs = run(vigor().plan(torch.tensor([7, 3]), 1), table({3: [1], 7: [1]}))
    assert reqs == [] and reasons(res) == ["no_budget", "no_budget"]


def test_vigor_unbiased_and_n_min() -> None:
    # n_min raises the warm start; unbiased variance only rescales, so the same prompt wins.
    res, reqs = run(vigor(n_min=3, variance="unbiased", chunk=1).plan(torch.tensor([0, 1]), 7),
                    table({0: [1, 0, 0], 1: [1, 1, 0]}))  # fmt: skip
    assert reqs[0] == ([0, 1], [3, 3]) and res.counts.sum() == 7 and res.counts.min() >= 3


def test_vigor_prior_reprobes_flat_groups() -> None:
    # With a Beta(1, 1) prior, [1,1] scores (2+1)(0+1)/16 = 3/16 > 0: a flat group can be re-probed.
    res, _ = run(vigor(prior=(1.0, 1.0), chunk=1).plan(torch.tensor([0]), 3), table({0: [1]}))
    assert res.counts.tolist() == [3]
    res, _ = run(vigor(chunk=1).plan(torch.tensor([0]), 3), table({0: [1]}))
    assert res.counts.tolist() == [2] and reasons(res) == ["zero_variance"]


def test_vigor_default_warns_and_experimental_silences() -> None:
    with pytest.warns(UserWarning, match="reconstructed"):
        VIGOR()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        VIGOR(experimental=True)
    a = VIGOR(experimental=True)
    a.update(run(a.plan(torch.tensor([1]), 2), table({1: [0, 1]}))[0])
    assert a.state_dict() == {"format": 1}  # stateless: only the format version


# -------------------------------------------------------------------------------------------------- speed-up formula
def test_vigor_speedup_oracle() -> None:
    # (alpha - 1/2)^2 / (alpha (alpha - 1)): 2.25/2, 1/0.75, 0.5625/0.3125
    assert vigor_speedup(2.0) == pytest.approx(1.125, abs=1e-15)
    assert vigor_speedup(1.5) == pytest.approx(4 / 3, abs=1e-15)
    assert vigor_speedup(1.25) == pytest.approx(1.8, abs=1e-15)
    t = vigor_speedup(torch.tensor([2.0, 1.5], dtype=torch.float64))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.tolist() == pytest.approx([1.125, 4 / 3])
    big = vigor_speedup(1e6)
    assert isinstance(big, float) and 1.0 < big < 1.0 + 1e-6


@pytest.mark.parametrize("alpha", [2.5, 3.0, 5.0])
def test_vigor_speedup_monte_carlo(alpha: float) -> None:
    # sigma^2 ~ Pareto(alpha, x_m = 1) by inverse CDF (seeded). Uniform allocation of N rollouts: total variance
    # M sum sigma^2 / N; square-root allocation n_i = N sigma_i / sum sigma: sum sigma_i^2 / n_i. Their ratio is
    # the speed-up. alpha > 2 keeps Var(sigma^2) finite; 4M prompts put the standard error below 0.3 % (checked
    # across seeds), so 1 % is a tolerance of > 3 standard errors.
    g = torch.Generator().manual_seed(1234)
    m, n_total = 4_000_000, 1.0e9
    sigma2 = torch.rand(m, generator=g, dtype=torch.float64).clamp(min=1e-300) ** (-1 / alpha)
    sigma = sigma2.sqrt()
    uniform = (sigma2 / (n_total / m)).sum()
    sqrt_rule = (sigma2 / (n_total * sigma / sigma.sum())).sum()
    assert float(uniform / sqrt_rule) == pytest.approx(vigor_speedup(alpha), rel=0.01)


# ------------------------------------------------------------------------------------------------ VIGOR properties
@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(1, 10),
    budget=st.integers(0, 90),
    seed=st.integers(0, 50),
    n_max=st.one_of(st.none(), st.integers(3, 9)),
    rule=st.sampled_from(["variance", "marginal"]),
    mode=st.sampled_from(["online", "static"]),
    chunk=st.one_of(st.none(), st.integers(1, 7)),
)
def test_vigor_budget_caps_determinism_permutation(
    p: int, budget: int, seed: int, n_max: int | None, rule: str, mode: str, chunk: int | None
) -> None:
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(seed))[:p]
    alloc = vigor(n_max=n_max, rule=rule, mode=mode, chunk=chunk)
    res, _ = run(alloc.plan(ids, budget), hashed(seed))
    c = res.counts
    assert int(c.sum()) == res.rewards.numel() <= budget
    assert bool(((c == 0) | (c >= 2)).all()) and (n_max is None or int(c.max()) <= n_max)
    # the budget is spent unless no warmed prompt can take more (flat or capped)
    if res.rewards.numel() < budget:
        grp = res.group
        hi = torch.zeros(p, dtype=res.rewards.dtype).scatter_reduce(0, grp, res.rewards, "amax", include_self=False)
        lo = torch.ones(p, dtype=res.rewards.dtype).scatter_reduce(0, grp, res.rewards, "amin", include_self=False)
        open_ = (c > 0) & (hi != lo) & (torch.ones_like(c, dtype=torch.bool) if n_max is None else c < n_max)
        assert not bool(open_.any())
    again, _ = run(alloc.plan(ids, budget), hashed(seed))
    assert torch.equal(again.counts, c) and torch.equal(again.rewards, res.rewards)
    perm = torch.randperm(p, generator=torch.Generator().manual_seed(seed + 1))
    moved, _ = run(alloc.plan(ids[perm], budget), hashed(seed))
    assert torch.equal(moved.counts, c[perm]) and torch.equal(moved.reasons, res.reasons[perm])


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.sampled_from([0.0, 0.0625, 0.1875, 0.25, 2 / 9]), st.integers(2, 6), st.integers(0, 8)),
        min_size=1,
        max_size=8,
    ),
    units=st.integers(1, 30),
)
def test_marginal_greedy_equals_heap_greedy(data: list[tuple[float, int, int]], units: int) -> None:
    # The vectorised bisection must give exactly what a heap greedy gives: one unit at a time to the largest
    # v/((n+j)(n+j+1)), ties to the lower index, at most cap per prompt, flat prompts (v = 0) never.
    import heapq

    from rolloutopt.allocators.vigor import _greedy_marginal

    v = torch.tensor([d[0] for d in data], dtype=torch.float64)
    n = torch.tensor([d[1] for d in data])
    cap = torch.tensor([d[2] for d in data])
    heap = [(-d[0] / (d[1] * (d[1] + 1)), i, 0) for i, d in enumerate(data) if d[0] > 0 and d[2] > 0]
    heapq.heapify(heap)
    want = [0] * len(data)
    for _ in range(units):
        if not heap:
            break
        _, i, j = heapq.heappop(heap)
        want[i] += 1
        vi, ni, ci = data[i]
        if j + 1 < ci:
            m = ni + j + 1
            heapq.heappush(heap, (-vi / (m * (m + 1)), i, j + 1))
    got = _greedy_marginal(v, n, cap, units, torch.arange(len(data)))
    assert got.tolist() == want


# ------------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"n_init": 1}, "n_init"),
        ({"rounds": 0}, "rounds"),
        ({"chunk": 0}, "chunk"),
        ({"top_frac": 0.0}, "top_frac"),
        ({"rule": "best"}, "rule"),
        ({"mode": "batch"}, "mode"),
        ({"variance": "sample"}, "variance"),
        ({"prior": (1.0,)}, "prior"),
        ({"prior": (1.0, -1.0)}, "prior"),
        ({"n_max": 1}, "n_max"),
        ({"n_min": 0}, "n_min"),
    ],
)
def test_vigor_bad_hyper_parameters(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises(InputError, match=rf"^{arg}"):
        VIGOR(experimental=True, **kwargs)  # type: ignore[arg-type]


def test_vigor_options_need_experimental() -> None:
    with pytest.raises(InputError, match=r"^experimental"):
        VIGOR(rule="marginal")
    with pytest.raises(InputError, match=r"^experimental"):
        VIGOR(prior=(1.0, 1.0))


@pytest.mark.parametrize("make", [lambda: vigor()])
def test_bad_protocol_input(make: Callable[[], VIGOR | PilotCommit]) -> None:
    check_bad_protocol_input(make)


def test_unknown_ids_in_a_request_raise() -> None:
    plan = vigor().plan(torch.tensor([1, 2]), 8)
    with pytest.raises(InputError, match=r"^prompt_ids"):
        plan.positions(torch.tensor([77]))


def test_vigor_state_is_only_a_format_version() -> None:
    """Stateless: any key, a non-dict or another format version is refused."""
    a = vigor()
    a.load_state_dict({})
    a.load_state_dict(a.state_dict())
    for bad, arg in (({"step": 0}, "state"), ([], "state"), ({"format": 2}, "state['format']")):
        with pytest.raises(InputError) as err:
            a.load_state_dict(bad)  # type: ignore[arg-type]
        assert err.value.argument == arg
