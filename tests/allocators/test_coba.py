"""CoBA-RL (arXiv 2602.03048): oracles, transcriptions, properties, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators._base import Request
from rolloutopt.allocators.coba import CoBA, coba_beta_params
from rolloutopt.allocators.knapsack import Knapsack
from rolloutopt.errors import InputError

from .budget_helpers import (
    F64,
    Rewards,
    _refused,
    _saved,
    _with,
    check_bad_input,
    check_budget_caps_determinism_permutation,
    check_caps,
    check_empty_pool_and_zero_budget,
    check_spends_everything_when_caps_do_not_bind,
    check_state_round_trip_mid_run,
    heap_greedy,
    run,
    seed_history,
)


def fractions(rates: dict[int, tuple[int, int]]) -> Rewards:
    """Prompt i gets successes-then-failures in the proportion s/t of rates[i] (cycled)."""

    def f(req: Request) -> torch.Tensor:
        out = []
        for pid, c in zip(req.prompt_ids.tolist(), req.counts.tolist(), strict=True):
            s, t = rates[pid]
            out += [1.0 if (j % t) < s else 0.0 for j in range(c)]
        return torch.tensor(out, dtype=F64)

    return f


# -- oracles --------------------------------------------------------------------------------------------------------
def test_coba_beta_oracle() -> None:
    a, b = coba_beta_params(0.8, 7)
    assert (a, b) == (5.0, 2.0)
    assert (a - 1) / (a + b - 2) == pytest.approx(0.8)  # Beta mode
    a, b = coba_beta_params(0.3, 7)
    f = 1 / (1 + math.exp(2.0))  # sigmoid(10 (0.3 - 0.5)) ~ 0.119
    assert f == pytest.approx(0.119, abs=1e-3)
    assert a == pytest.approx(1 + 5 * f) and b == pytest.approx(7 - a)
    assert a == pytest.approx(1.596, abs=1e-3) and b == pytest.approx(5.404, abs=1e-3)
    assert (a - 1) / (a + b - 2) == pytest.approx(0.119, abs=1e-3)
    assert coba_beta_params(1.0, 7) == (6.0, 1.0)  # clipped at S - 1
    with pytest.raises(InputError, match="failure_rate"):
        coba_beta_params(1.5)


def test_coba_gain_closed_form_matches_value_difference() -> None:
    a = CoBA()
    p = torch.tensor([0.05, 0.3, 0.5, 0.77, 0.99], dtype=F64)
    tau = a._tau(p)
    n = torch.arange(a.n_min, a.n_max, dtype=F64)
    diff = a.value(n[None, :] + 1, p[:, None], tau) - a.value(n[None, :], p[:, None], tau)
    pc = p
    c = pc * (1 - pc) / tau
    closed = torch.exp(a._log_pdf(pc)[:, None] - n[None, :] * c[:, None]) * (-torch.expm1(-c))[:, None]
    assert torch.allclose(diff, closed, rtol=1e-9, atol=1e-15)


# -- CoBA: a transcription of BetaAllocator.allocate (with this library's deliberate fixes) ---------------------------
def coba_reference(a: CoBA, p_opt: list[float | None], budget: int) -> list[int]:
    m = len(p_opt)
    if all(x is None for x in p_opt) or budget < m * a.n_min:
        return _ref_uniform(budget, m, a.n_min, a.n_max)
    p = [0.5 if x is None else x for x in p_opt]
    n = [a.n_min] * m
    rem = budget - m * a.n_min
    if rem == 0:
        return n
    hard = [i for i in range(m) if p[i] < 0.05]
    easy = [i for i in range(m) if p[i] > 0.99]
    expl = [i for i in range(m) if 0.05 <= p[i] <= 0.99]
    rho = a.exploration_budget_ratio
    ratio = (rho if len(expl) > m / 2 else 0.6 + (rho - 0.6) * (len(expl) / m * 2)) if expl else 0.6
    units = int(rem * ratio)
    if expl and units > 0:
        pe = torch.tensor([p[i] for i in expl], dtype=F64)
        tau = a._tau(pe)
        s = a.smoothing
        alpha, beta = a.alpha, a.beta
        log_b = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
        gains = []
        for x in pe.tolist():
            xc = min(max(x, s), 1 - s)
            c = xc * (1 - xc) / tau
            lp = (alpha - 1) * math.log(xc) + (beta - 1) * math.log1p(-xc) - log_b
            gains.append([math.exp(lp - k * c) * -math.expm1(-c) for k in range(a.n_min, a.n_max)])
        take = heap_greedy(gains, units)
        for i, t in zip(expl, take, strict=True):
            n[i] += t
        rem -= sum(take)
    for tier in (hard, expl, easy):
        if rem <= 0:
            break
        avail = [i for i in tier if n[i] < a.n_max]
        if not avail:
            continue
        w = {i: (1 - min(max(p[i], 1e-6), 1 - 1e-6)) ** a.weight_alpha for i in avail}
        total = sum(w.values())
        start = rem
        if total > 0:
            for i in avail:  # the fix: shares of the tier's starting leftover
                give = min(int(start * w[i] / total), a.n_max - n[i])
                n[i] += give
                rem -= give
        avail = [i for i in avail if n[i] < a.n_max]
        if avail and rem > 0:
            per, extra = divmod(rem, len(avail))
            for j, i in enumerate(avail):
                give = min(per + (1 if j < extra else 0), a.n_max - n[i])
                n[i] += give
                rem -= give
    return n


def _ref_uniform(budget: int, m: int, n_min: int, n_max: int) -> list[int]:
    if m == 0:
        return []
    if budget >= m * n_min:
        per, extra = divmod(budget, m)
        return [min(per + (1 if i < extra else 0), n_max) for i in range(m)]
    k = min(m, budget // n_min)
    out = [n_min] * k + [0] * (m - k)
    r = budget - k * n_min
    if k:
        per, extra = divmod(r, k)
        for i in range(k):
            out[i] += min(per + (1 if i < extra else 0), n_max - n_min)
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), min_size=1, max_size=12),
    st.integers(0, 200),
    st.sampled_from([(2, 32), (2, 8), (3, 5), (1, 1)]),
    st.floats(0.0, 1.0),
)
def test_coba_equals_transcription(
    groups: list[tuple[int, int]], budget: int, caps: tuple[int, int], failure: float
) -> None:
    a = CoBA(n_min=caps[0], n_max=caps[1])
    a.alpha, a.beta = coba_beta_params(failure)
    tot = [t for _, t in groups]
    succ = [min(s, t) for s, t in groups]
    ids = seed_history(a, succ, tot)
    p_opt: list[float | None] = [None if t == 0 else s / t for s, t in zip(succ, tot, strict=True)]
    counts = a.plan(ids, budget).counts
    assert counts.tolist() == coba_reference(a, p_opt, budget)
    check_caps(counts, budget, *caps)


def test_coba_identical_p_within_one_rollout() -> None:
    a = CoBA()
    ids = seed_history(a, [3] * 5 + [1, 7], [8] * 7)
    counts = a.plan(ids, 100).counts
    same = counts[:5]
    assert int(same.max() - same.min()) <= 1
    check_caps(counts, 100, 2, 32)


def test_coba_unseen_uniform_and_short_budget() -> None:
    a = CoBA()
    plan = a.plan(torch.tensor([5, 3, 9]), 10)  # nothing seen: 10 // 3 = 3, the smallest id gets one more
    assert plan.counts.tolist() == [3, 4, 3]
    res = run(plan, lambda r: torch.ones(r.total, dtype=F64))
    assert res.reason_of(3) == "uniform"
    plan = a.plan(torch.tensor([5, 3, 9]), 5)  # below 3 * n_min: two prompts get 2, the smallest id one more
    assert plan.counts.tolist() == [2, 3, 0]
    res = run(plan, lambda r: torch.ones(r.total, dtype=F64))
    assert res.reason_of(9) == "no_budget" and res.reason_of(3) == "short_budget"
    assert a.plan(torch.tensor([5, 3, 9]), 1000).counts.tolist() == [32, 32, 32]  # capped at n_max


def test_coba_beta_update_by_hand() -> None:
    a = CoBA(window=2)
    assert (a.alpha, a.beta) == (5.0, 2.0)
    # step 1: prompt 0 all correct, prompt 1 half correct: average success 0.75, failure 0.25
    res = run(a.plan(torch.tensor([0, 1]), 8), fractions({0: (1, 1), 1: (1, 2)}))
    a.update(res)
    f = 1 / (1 + math.exp(-10 * (0.25 - 0.5)))
    assert a.alpha == pytest.approx(1 + 5 * f) and a.beta == pytest.approx(7 - a.alpha)
    # step 2: all wrong: window average success (0.75 + 0) / 2, failure 0.625 (no sharpening)
    res = run(a.plan(torch.tensor([0, 1]), 8), lambda r: torch.zeros(r.total, dtype=F64))
    a.update(res)
    assert a.alpha == pytest.approx(1 + 5 * 0.625)
    # step 3: the window drops step 1: failure (1 + 1) / 2 = 1 -> alpha clipped to 6
    res = run(a.plan(torch.tensor([0, 1]), 8), lambda r: torch.zeros(r.total, dtype=F64))
    a.update(res)
    assert a.alpha == 6.0
    # the per-prompt window: prompt 0 saw 1.0 then 0.0 then 0.0; W = 2 keeps the last two
    assert float(a.history.lookup(torch.tensor([0])).window_pass_rate) == 0.0


def test_coba_reward_must_be_exactly_one() -> None:
    a = CoBA()
    res = run(a.plan(torch.tensor([0]), 4), lambda r: torch.full((r.total,), 0.999, dtype=F64))
    a.update(res)
    assert a.alpha == 6.0  # failure 1: no success counted
    assert float(a.history.lookup(torch.tensor([0])).window_pass_rate) == 0.0


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["coba"]),
    st.lists(st.integers(0, 10**12), min_size=1, max_size=15, unique=True),
    st.integers(0, 150),
    st.integers(0, 2**31),
    st.data(),
)
def test_budget_caps_determinism_permutation(
    kind: str, ids: list[int], budget: int, seed: int, data: st.DataObject
) -> None:
    check_budget_caps_determinism_permutation(kind, ids, budget, seed, data)


@pytest.mark.parametrize("kind", ["coba"])
def test_state_round_trip_mid_run(kind: str) -> None:
    check_state_round_trip_mid_run(kind)


def test_coba_load_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """NaN in a finite field, a negative counter (the allocator's and its history's), a truncated or foreign rate
    window, a Beta shape that does not match the rates: an ``InputError`` naming the field; nothing changes."""
    _, good = _saved("coba")
    m, r = good["history"]["table"]["rows"]["prompt_ids"].numel(), good["rates"].numel()
    rows, at = ("history", "table", "rows"), "state['history']['table']['rows']"
    cases = [
        (
            (*rows, "columns", "coba/reward_sum"),
            torch.full((m,), math.nan, dtype=F64),
            f"{at}['columns']['coba/reward_sum']",
        ),
        ((*rows, "columns", "coba/rollouts"), torch.full((m,), -1), f"{at}['columns']['coba/rollouts']"),
        ((*rows, "clock"), -1, f"{at}['clock']"),
        ((*rows, "prompt_ids"), good["history"]["table"]["rows"]["prompt_ids"][:-1], f"{at}['touch']"),
        (("rates",), torch.full((r,), math.nan, dtype=F64), "state['rates']"),
        (("rates",), torch.cat([good["rates"], good["rates"]]), "state['rates']"),
        (("rates",), good["rates"][:-1], "state['rates']"),
        (("rated",), good["step"] + 1, "state['rated']"),
        (("step",), -1, "state['step']"),
        (("alpha",), good["alpha"] + 0.25, "state['alpha']"),
        (("beta",), good["beta"] - 0.25, "state['beta']"),
        (("history", "config"), {**good["history"]["config"], "window": 5}, "state['history']['config']"),
        (("history", "table", "owner"), "knapsack", "state['history']['table']['owner']"),
    ]
    for path, value, argument in cases:
        _refused("coba", _with(good, path, value), argument)


@pytest.mark.parametrize("kind", ["coba"])
def test_empty_pool_and_zero_budget(kind: str) -> None:
    check_empty_pool_and_zero_budget(kind)


# -- bad input --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["coba"])
def test_bad_input(kind: str) -> None:
    check_bad_input(kind)


def test_unknown_ids_in_a_request() -> None:
    plan = CoBA().plan(torch.tensor([1, 2]), 8)
    with pytest.raises(InputError, match="prompt_ids"):
        plan.positions(torch.tensor([99]))


def test_bad_hyper_parameters() -> None:
    with pytest.raises(InputError, match="n_max"):
        CoBA(n_min=4, n_max=3)
    with pytest.raises(InputError, match="tau_max"):
        CoBA(tau_min=5.0, tau_max=4.0)
    with pytest.raises(InputError, match="smoothing"):
        CoBA(smoothing=0.5)
    with pytest.raises(InputError, match="exploration_budget_ratio"):
        CoBA(exploration_budget_ratio=1.5)
    with pytest.raises(InputError, match="beta_params_sum"):
        CoBA(beta_params_sum=2)
    with pytest.raises(InputError, match="no_extra"):
        Knapsack(no_extra="one")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="cost"):
        Knapsack(cost="mean")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="alpha"):
        Knapsack(alpha=1.0)
    with pytest.raises(InputError, match="n"):
        Knapsack(n=200)
    with pytest.raises(InputError, match="negative_n"):
        Knapsack(negative_n=1000)
    with pytest.raises(InputError, match="n_max"):
        Knapsack(n_min=4, n_max=3)


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["coba"]),
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=10),
    st.integers(0, 300),
)
def test_spends_everything_when_caps_do_not_bind(kind: str, groups: list[tuple[int, int]], budget: int) -> None:
    check_spends_everything_when_caps_do_not_bind(kind, groups, budget)
