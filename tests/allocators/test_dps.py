"""DPS (Dynamics-Predictive Sampling, arXiv 2603.10887): oracles computed by hand following ``maoyixiu/DPS``
``recipe/dps/task_sampler.py`` (``BayesianHMMSampler``), hand examples, properties, bad input."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators._base import AllocationResult, Conversation, Request, _fill
from rolloutopt.allocators.depo import DEPO
from rolloutopt.allocators.dps import DPS
from rolloutopt.allocators.table import PromptTable
from rolloutopt.errors import InputError

from .helpers import same_state
from .table_helpers import check_shared_table, in_turn

Rewards = Callable[[Request], torch.Tensor]


def run(plan: Conversation, rewards: Rewards) -> tuple[AllocationResult, list[Request]]:
    reqs = []
    while (req := plan.next()) is not None:
        reqs.append(req)
        plan.observe(req, rewards(req))
    return plan.finish(), reqs


def const(values: dict[int, list[float]]) -> Rewards:
    """Each prompt's rewards, cycled to the requested count."""

    def f(req: Request) -> torch.Tensor:
        out = [
            values[p][i % len(values[p])]
            for p, c in zip(req.prompt_ids.tolist(), req.counts.tolist(), strict=True)
            for i in range(c)
        ]
        return torch.tensor(out, dtype=torch.float64)

    return f


def bernoulli(rate: torch.Tensor, step: int) -> Rewards:
    """Rewards Bernoulli(rate[prompt id]) from a generator seeded by the step (the synthetic world)."""

    def f(req: Request) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + step)
        p = rate[req.prompt_ids].repeat_interleave(req.counts)
        return (torch.rand(p.shape, generator=g, dtype=torch.float64) < p).double()

    return f


MIXED = [1.0, 0.0]  # success rate 1/2: state S2


def by_id(req: Request) -> torch.Tensor:
    """A deterministic world: prompt p always fails (p % 3 == 0), always succeeds (1) or alternates (2)."""
    kind = (req.prompt_ids % 3).repeat_interleave(req.counts)
    j = torch.cat([torch.arange(int(c)) for c in req.counts]) if req.counts.numel() else kind
    return torch.where(kind == 2, (j % 2).double(), (kind == 1).double())


def step(d: DPS, ids: list[int], budget: int, rewards: Rewards) -> AllocationResult:
    res, _ = run(d.plan(torch.tensor(ids), budget), rewards)
    d.update(res)
    return res


COLUMNS = "state['table']['rows']['columns']"  # where a private table's columns are in a DPS state


def state_with(ids: torch.Tensor, **columns: torch.Tensor) -> dict[str, Any]:
    """A DPS state (private table) holding the sorted ``ids``, registered by DPS, with these columns (``alpha``,
    ``pi``, ``pi_before``, ``sampled_times``) and a generator seeded 0."""
    m = ids.numel()
    cols = {"dps/seen": torch.ones(m, dtype=torch.bool), **{f"dps/{k}": v for k, v in columns.items()}}
    rows = {"prompt_ids": ids, "touch": torch.zeros(m, dtype=torch.long), "clock": 0, "columns": cols}
    return {"table": {"owner": "dps", "rows": rows}, "generator": torch.Generator().manual_seed(0).get_state()}


def with_column(state: dict[str, Any], name: str, value: torch.Tensor) -> dict[str, Any]:
    """A copy of a DPS state (private table) with column ``name`` replaced."""
    out = copy.deepcopy(state)
    out["table"]["rows"]["columns"][f"dps/{name}"] = value
    return out


# -- the code's HMM by hand (uniform prior, all-ones alpha, lambda = 1) -------------------------------------------
def test_spec_oracle() -> None:
    d = DPS(n=4)
    step(d, [7], 4, const({7: MIXED}))
    alpha = d.transition_counts(torch.tensor([7]))[0]
    # C = outer(e_S2, uniform) * P(ones) normalised: 1/3 in each entry of the middle row.
    assert torch.allclose(alpha[1], torch.full((3,), 4 / 3, dtype=torch.float64))
    assert torch.equal(alpha[[0, 2]], torch.ones(2, 3, dtype=torch.float64))
    # P's middle column is (1, 4/3, 1) / (10/3) = (0.3, 0.4, 0.3); pi = P e_S2.
    assert torch.allclose(d.predictive(torch.tensor([7]))[0], torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64))
    step(d, [7], 4, const({7: MIXED}))
    alpha = d.transition_counts(torch.tensor([7]))[0]
    # pi_before = e_S2 now, so C = e_S2 e_S2^T: one count on [1, 1].
    assert torch.allclose(alpha[1], torch.tensor([4 / 3, 7 / 3, 4 / 3], dtype=torch.float64))
    pi = d.predictive(torch.tensor([7, 99]))
    assert torch.allclose(pi[0], torch.tensor([3 / 13, 7 / 13, 3 / 13], dtype=torch.float64))  # (1, 7/3, 1)/(13/3)
    assert torch.allclose(pi[1], torch.full((3,), 1 / 3, dtype=torch.float64))  # unseen: the prior
    assert int(d.sampled_times(torch.tensor([7]))[0]) == 2
    # top-k prefers the learned prompt (pi[S2] = 7/13) over an unseen one (1/3), whatever the order.
    for ids in ([99, 7], [7, 99]):
        req = d.plan(torch.tensor(ids), 4).next()
        assert req is not None and req.prompt_ids.tolist() == [7]


def test_observed_states_and_binarisation() -> None:
    """acc >= 1 binarises; rate 0 -> S1, rate 1 -> S3; success_threshold=None reads the raw mean (metric=score)."""
    d = DPS(n=2)
    step(d, [1, 2, 3], 6, const({1: [0.0, 0.0], 2: [1.0, 1.0], 3: [0.99, 0.99]}))
    pi = d.predictive(torch.tensor([1, 2, 3]))
    # From a one-hot state with the uniform P(ones) row update: alpha column s gets 1/3 on row s ... see oracle;
    # the observed state s gets 0.4 and the others 0.3.
    expect = torch.tensor([[0.4, 0.3, 0.3], [0.3, 0.3, 0.4], [0.4, 0.3, 0.3]], dtype=torch.float64)
    assert torch.allclose(pi, expect)  # 0.99 < 1 is a failure, so prompt 3 is S1
    d = DPS(n=2, success_threshold=None)
    step(d, [3], 2, const({3: [0.99, 0.99]}))
    assert torch.allclose(d.predictive(torch.tensor([3]))[0], torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64))


def test_planned_prompts_become_known_and_diffuse() -> None:
    """The code's quirk: every candidate is registered and then diffuses through P every step ('progress')."""
    d = DPS(n=4, prior_alpha="progress")
    res = step(d, [1, 2], 4, const({1: MIXED, 2: MIXED}))
    assert res.counts.tolist() == [4, 0] and res.reason_of(2) == "not_selected"
    # progress prior: columns (1,1,1)/3, (.5,1,1)/2.5, (.5,.5,1)/2; P @ uniform.
    expect = torch.tensor([0.78333333333 / 3, 0.98333333333 / 3, 1.23333333333 / 3], dtype=torch.float64)
    assert torch.allclose(d.predictive(torch.tensor([2]))[0], expect)
    assert torch.allclose(d.predictive(torch.tensor([5]))[0], torch.full((3,), 1 / 3, dtype=torch.float64))
    assert d.num_known == 2


def test_decay_of_unobserved_prompt() -> None:
    """lambda = 0.5: an observed S2 prompt, then a step without it: alpha decays half-way to the prior."""
    d = DPS(n=4, decay=0.5)
    step(d, [7], 4, const({7: MIXED}))
    # first step: 0.5 * 1 + 0.5 * 1 + 1/3 = 4/3 on the middle row, as with lambda = 1
    assert torch.allclose(d.transition_counts(torch.tensor([7]))[0, 1], torch.full((3,), 4 / 3, dtype=torch.float64))
    step(d, [8], 4, const({8: MIXED}))  # 7 is known, not rolled out: decays
    alpha = d.transition_counts(torch.tensor([7]))[0]
    assert torch.allclose(alpha[1], torch.full((3,), 7 / 6, dtype=torch.float64))  # 0.5 * 4/3 + 0.5
    assert torch.equal(alpha[[0, 2]], torch.ones(2, 3, dtype=torch.float64))
    # every column is (1, 7/6, 1) / (19/6): the prediction becomes (6, 7, 6) / 19
    pi = d.predictive(torch.tensor([7]))[0]
    assert torch.allclose(pi, torch.tensor([6 / 19, 7 / 19, 6 / 19], dtype=torch.float64))
    assert int(d.sampled_times(torch.tensor([7]))[0]) == 1


def test_zero_mass_soft_count_is_guarded() -> None:
    """'local' prior (no S1 -> S3 mass) with prior_pi '1': observing S3 has zero joint mass; the code writes NaN."""
    d = DPS(n=2, prior_alpha="local", prior_pi="1")
    step(d, [1], 2, const({1: [1.0, 1.0]}))
    alpha = d.transition_counts(torch.tensor([1]))[0]
    assert torch.equal(alpha, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], dtype=torch.float64))
    assert torch.allclose(d.predictive(torch.tensor([1]))[0], torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64))


def test_fixed_transitions_and_no_update() -> None:
    d = DPS(n=2, prior_alpha="progress", transitions="fixed")
    step(d, [1], 2, const({1: MIXED}))
    step(d, [1], 2, const({1: MIXED}))
    assert torch.equal(d.transition_counts(torch.tensor([1]))[0], DPS(prior_alpha="progress").prior_alpha)
    # P(progress) column S2 = (.5, 1, 1) / 2.5
    assert torch.allclose(d.predictive(torch.tensor([1]))[0], torch.tensor([0.2, 0.4, 0.4], dtype=torch.float64))
    d = DPS(n=2, no_update=True)
    step(d, [1], 2, const({1: MIXED}))
    assert d.num_known == 0 and torch.allclose(d.predictive(torch.tensor([1]))[0], d.prior_pi)


def test_topk_entropy() -> None:
    """pi = (.3, .4, .3) has H = 1.0889 < log 3: w = 1 keeps it first, w = 10 prefers the unseen prompt."""
    for w, first in ((1.0, 7), (10.0, 99)):
        d = DPS(n=4, strategy="topk+entropy", entropy_weight=w)
        step(d, [7], 4, const({7: MIXED}))
        req = d.plan(torch.tensor([99, 7]), 4).next()
        assert req is not None and req.prompt_ids.tolist() == [first]


def test_uniform_strategy_is_seeded() -> None:
    ids = torch.arange(50)
    picks = []
    for seed in (0, 0, 1):
        req = DPS(n=2, strategy="uniform", seed=seed).plan(ids, 20).next()
        assert req is not None and req.prompt_ids.numel() == 10
        picks.append(sorted(req.prompt_ids.tolist()))
    assert picks[0] == picks[1] and picks[0] != picks[2]


def test_fill_hand_examples() -> None:
    assert _fill(5, 19, 4, 4, 4).tolist() == [4, 4, 4, 4, 0]  # 3 left unspent
    assert _fill(5, 19, 4, 2, 4).tolist() == [4, 4, 4, 4, 3]  # partial group >= n_min
    assert _fill(5, 19, 4, 4, 6).tolist() == [5, 5, 5, 4, 0]  # spread up to n_max, best first
    assert _fill(3, 19, 4, 4, 6).tolist() == [6, 6, 6]  # capped at n_max: 1 unspent
    assert _fill(2, 3, 4, 4, 4).tolist() == [0, 0]
    assert _fill(0, 9, 4, 1, 9).tolist() == []


def test_budget_caps_and_reasons() -> None:
    d = DPS(n=4, n_min=2)
    res, reqs = run(d.plan(torch.tensor([10, 11, 12]), 11), const({10: MIXED, 11: MIXED, 12: MIXED}))
    assert len(reqs) == 1 and res.counts.tolist() == [4, 4, 3]
    assert [res.reason_of(p) for p in (10, 11, 12)] == ["selected", "selected", "partial_group"]
    assert res.weight.tolist() == [1.0] * 11
    res, reqs = run(d.plan(torch.tensor([10]), 1), const({10: MIXED}))  # budget < n_min: nothing
    assert reqs == [] and res.counts.tolist() == [0] and res.reason_of(10) == "not_selected"


# -- properties ---------------------------------------------------------------------------------------------------
def _random_state(k: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(4 * k + 1, generator=g)[:k].sort().values
    pi = torch.rand(k, 3, generator=g, dtype=torch.float64) + 0.01
    pi = pi / pi.sum(-1, keepdim=True)
    return state_with(
        ids,
        alpha=torch.rand(k, 3, 3, generator=g, dtype=torch.float64) + 0.1,
        pi=pi,
        pi_before=pi.clone(),
        sampled_times=torch.randint(0, 5, (k,), generator=g),
    )


@settings(max_examples=30, deadline=None)
@given(
    k=st.integers(1, 40),
    budget=st.integers(0, 300),
    n=st.integers(1, 8),
    dn_min=st.integers(0, 7),
    dn_max=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_properties(k: int, budget: int, n: int, dn_min: int, dn_max: int, seed: int) -> None:
    """Budget, caps, spending, permutation equivariance (distinct scores), determinism, finiteness after update."""
    n_min, n_max = max(1, n - dn_min), n + dn_max
    state = _random_state(k, seed)
    ids = state["table"]["rows"]["prompt_ids"]
    d = DPS(n=n, n_min=n_min, n_max=n_max, decay=0.7)
    d.load_state_dict(state)
    res, _ = run(d.plan(ids, budget), by_id)
    c = res.counts
    assert int(c.sum()) == res.rewards.numel() <= budget
    assert bool(((c == 0) | ((c >= n_min) & (c <= n_max))).all())
    if n_min == 1:
        assert int(c.sum()) == min(budget, k * n_max)
    assert int((c > 0).sum()) == min(k, budget // n + (budget % n >= n_min and budget // n < k))
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed + 1))
    d2 = DPS(n=n, n_min=n_min, n_max=n_max, decay=0.7)
    d2.load_state_dict(state)
    res_p, _ = run(d2.plan(ids[perm], budget), by_id)
    assert torch.equal(res_p.counts, c[perm]) and torch.equal(res_p.reasons, res.reasons[perm])
    d.update(res)
    d2.update(res_p)
    assert same_state(d.state_dict(), d2.state_dict())
    pi = d.predictive(ids)
    assert bool(torch.isfinite(pi).all()) and torch.allclose(pi.sum(-1), torch.ones(k, dtype=torch.float64))
    assert bool(torch.isfinite(d.transition_counts(ids)).all())


@pytest.mark.parametrize("strategy", ["topk", "uniform"])
def test_state_dict_round_trip_mid_run(strategy: str) -> None:
    rate = torch.linspace(0, 1, 40, dtype=torch.float64)
    pools = [torch.randperm(40, generator=torch.Generator().manual_seed(s))[:24] for s in range(6)]

    def go(d: DPS, steps: range) -> list[tuple[list[Request], AllocationResult]]:
        out = []
        for s in steps:
            res, reqs = run(d.plan(pools[s], 30), bernoulli(rate, s))
            d.update(res)
            out.append((reqs, res))
        return out

    a = DPS(n=3, strategy=strategy, decay=0.7, seed=5)  # type: ignore[arg-type]
    go(a, range(3))
    saved = a.state_dict()
    tail_a = go(a, range(3, 6))
    b = DPS(n=3, strategy=strategy, decay=0.7, seed=5)  # type: ignore[arg-type]
    b.load_state_dict(saved)
    tail_b = go(b, range(3, 6))
    for (ra, xa), (rb, xb) in zip(tail_a, tail_b, strict=True):
        assert [(q.prompt_ids.tolist(), q.counts.tolist()) for q in ra] == [
            (q.prompt_ids.tolist(), q.counts.tolist()) for q in rb
        ]
        assert torch.equal(xa.rewards, xb.rewards) and torch.equal(xa.reasons, xb.reasons)
    for key, value in a.state_dict().items():  # the table, the generator and the format version (an int)
        assert same_state(value, b.state_dict()[key]), key


def test_dps_prefers_partially_solved_prompts() -> None:
    """In a static world (pass rates 0, 1/2, 1), after a warm-up DPS spends most rollouts on the 1/2 prompts."""
    rate = torch.tensor([0.0, 1.0, 0.5] * 20, dtype=torch.float64)  # id % 3 == 2 is the partially solved one
    ids = torch.arange(60)
    d = DPS(n=8)
    for s in range(3):  # warm-up visits every prompt once (budget covers all)
        step(d, ids.tolist(), 60 * 8, bernoulli(rate, s))
    res, _ = run(d.plan(ids, 20 * 8), bernoulli(rate, 9))
    picked = res.plan_prompt_ids[res.counts > 0]
    assert bool((picked % 3 == 2).all())


# -- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"n": 0}, "n"),
        ({"n": 4, "n_min": 5}, "n_min"),
        ({"n": 4, "n_max": 3}, "n_max"),
        ({"strategy": "top"}, "strategy"),
        ({"prior_alpha": "nope"}, "prior_alpha"),
        ({"prior_alpha": -1.0}, "prior_alpha"),
        ({"prior_alpha": torch.zeros(3, 3)}, "prior_alpha"),
        ({"prior_alpha": torch.ones(2, 3)}, "prior_alpha"),
        ({"prior_pi": "4"}, "prior_pi"),
        ({"prior_pi": torch.tensor([-1.0, 1.0, 1.0])}, "prior_pi"),
        ({"decay": 1.5}, "decay"),
        ({"decay": float("nan")}, "decay"),
        ({"transitions": "frozen"}, "transitions"),
        ({"no_update": 1}, "no_update"),
        ({"seed": -1}, "seed"),
        ({"entropy_weight": float("inf")}, "entropy_weight"),
    ],
)
def test_bad_constructor(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        DPS(**kwargs)  # type: ignore[arg-type]


def test_bad_plan_observe_update_load() -> None:
    d = DPS(n=2)
    with pytest.raises(InputError, match="budget"):
        d.plan(torch.tensor([1, 2]), -1)
    with pytest.raises(InputError, match="prompt_ids"):
        d.plan(torch.tensor([1, 1]), 4)
    plan = d.plan(torch.tensor([1, 2]), 4)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="request"):  # unknown request / ids
        plan.observe(Request(torch.tensor([3]), torch.tensor([4])), torch.zeros(4))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(3))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.tensor([0.0, float("nan"), 1.0, 1.0]))
    with pytest.raises(InputError, match="result"):
        d.update("not a result")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="state"):
        d.load_state_dict({"ids": torch.zeros(1)})
    bad = with_column(d.state_dict(), "pi", torch.zeros(5, 3))
    with pytest.raises(InputError, match="pi"):
        d.load_state_dict(bad)
    third = torch.ones(1, 3, dtype=torch.float64) / 3
    bad = state_with(
        torch.tensor([3]),
        alpha=torch.zeros(1, 3, 3, dtype=torch.float64),
        pi=third,
        pi_before=third,
        sampled_times=torch.zeros(1, dtype=torch.long),
    )
    with pytest.raises(InputError, match="alpha") as err:
        d.load_state_dict(bad)
    assert err.value.argument == f"{COLUMNS}['dps/alpha']"
    with pytest.raises(InputError, match="prompt_ids"):
        d.predictive(torch.tensor([0.5]))


def test_empty_pool_and_zero_budget() -> None:
    for ids, budget in ((torch.zeros(0, dtype=torch.long), 100), (torch.arange(3), 0)):
        d = DPS()
        res, reqs = run(d.plan(ids, budget), by_id)
        assert reqs == [] and int(res.counts.sum()) == 0 and bool((res.reasons == 2).all())
        d.update(res)  # registers the planned prompts, observes nothing
        assert d.num_known == ids.numel()
        assert torch.allclose(d.predictive(ids), d.prior_pi.expand(ids.numel(), 3))


class CodeReference:
    """A line-by-line transcription of the code's ``BayesianHMMSampler`` (dicts, one prompt at a time)."""

    def __init__(self, prior_alpha: torch.Tensor, prior_pi: torch.Tensor, decay: float) -> None:
        self.prior_alpha, self.prior_pi, self.decay = prior_alpha, prior_pi, decay
        self.alphas: dict[int, torch.Tensor] = {}
        self.pis: dict[int, torch.Tensor] = {}
        self.pis_before: dict[int, torch.Tensor] = {}

    def get(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.alphas.setdefault(idx, self.prior_alpha)
        self.pis.setdefault(idx, self.prior_pi)
        self.pis_before.setdefault(idx, self.prior_pi)
        return self.alphas[idx], self.pis[idx], self.pis_before[idx]

    def predict(self, alpha: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
        nxt = (alpha / alpha.sum(0, keepdim=True)) @ pi
        return nxt / nxt.sum()

    def transition(self, alpha: torch.Tensor, pi: torch.Tensor, pi_next: torch.Tensor, lr: float) -> torch.Tensor:
        num = torch.outer(pi_next, pi) * (alpha / alpha.sum(0, keepdim=True))
        return alpha * self.decay + self.prior_alpha * (1 - self.decay) + num / num.sum() * lr

    def sample_batch(self, candidates: list[int]) -> None:
        for idx in candidates:
            self.get(idx)

    def train(self, indices: list[int], y: list[float]) -> None:
        for idx, s in zip(indices, y, strict=True):
            alpha, _, pi_before = self.get(idx)
            pi_new = torch.zeros(3, dtype=torch.float64)
            pi_new[0 if s == 0.0 else 2 if s == 1.0 else 1] = 1.0
            alpha_new = self.transition(alpha, pi_before, pi_new, 1.0)
            self.alphas[idx], self.pis_before[idx] = alpha_new, pi_new
            self.pis[idx] = self.predict(alpha_new, pi_new)
        for idx in list(self.alphas):
            if idx not in indices:
                alpha, pi, pi_before = self.get(idx)
                alpha_new = self.transition(alpha, pi_before, pi, 0.0)
                self.alphas[idx], self.pis_before[idx] = alpha_new, pi
                self.pis[idx] = self.predict(alpha_new, pi)


@pytest.mark.parametrize(("prior", "decay"), [(1.0, 1.0), ("progress", 0.7), ("stability", 0.5)])
def test_vectorised_filter_matches_the_code_loop(prior: float | str, decay: float) -> None:
    """Eight steps over random pools: every known prompt's alpha, pi and pi_before equal the code's loop."""
    d = DPS(n=4, prior_alpha=prior, decay=decay)
    ref = CodeReference(d.prior_alpha, d.prior_pi, decay)
    rate = torch.rand(30, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for s in range(8):
        pool = torch.randperm(30, generator=torch.Generator().manual_seed(s))[:12]
        ref.sample_batch(pool.tolist())
        res, _ = run(d.plan(pool, 6 * 4), bernoulli(rate, s))
        d.update(res)
        rolled = res.counts > 0
        succ = torch.zeros(12, dtype=torch.float64).index_add_(0, res.group, (res.rewards >= 1).double())
        ref.train(res.plan_prompt_ids[rolled].tolist(), (succ / res.counts.clamp(min=1))[rolled].tolist())
    known = torch.tensor(sorted(ref.alphas))
    assert d.num_known == known.numel()
    assert torch.allclose(d.transition_counts(known), torch.stack([ref.alphas[int(i)] for i in known]), atol=1e-12)
    assert torch.allclose(d.predictive(known), torch.stack([ref.pis[int(i)] for i in known]), atol=1e-12)
    assert torch.equal(d.table.prompt_ids, known)
    assert torch.allclose(d._cols["pi_before"], torch.stack([ref.pis_before[int(i)] for i in known]))


def test_load_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """A NaN or negative pseudo-count, a probability outside [0, 1] or a negative sampling counter is an
    InputError naming the field, and the allocator keeps its own state."""
    d = DPS(n=2)
    good = _random_state(3, 0)
    d.load_state_dict(good)
    before = d.state_dict()

    def refused(key: str, value: torch.Tensor) -> None:
        with pytest.raises(InputError) as err:
            d.load_state_dict(with_column(good, key, value))
        assert err.value.argument == f"{COLUMNS}['dps/{key}']"
        assert same_state(d.state_dict(), before)

    alpha = good["table"]["rows"]["columns"]["dps/alpha"]
    nan_alpha, neg_alpha = alpha.clone(), alpha.clone()
    nan_alpha[1, 2, 0] = math.nan
    neg_alpha[0, 0, 1] = -0.5
    refused("alpha", nan_alpha)
    refused("alpha", neg_alpha)
    refused("pi", torch.tensor([[0.5, 0.5, 0.0], [math.nan, 0.5, 0.5], [0.2, 0.3, 0.5]], dtype=torch.float64))
    refused("pi_before", torch.tensor([[1.5, -0.5, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64))
    refused("sampled_times", torch.tensor([0, -1, 2]))


# -- the prompt table ---------------------------------------------------------------------------------------------
def test_capacity_evicts_the_least_recently_planned_prompt() -> None:
    """capacity=2: a third prompt evicts the least recently planned one, which is then unknown again (the prior
    pi and alpha, no visits) and starts over from the prior when planned again."""
    d = DPS(n=4, prior_alpha="progress", capacity=2)
    step(d, [7], 4, const({7: MIXED}))
    step(d, [8], 4, const({8: [1.0]}))
    step(d, [9], 4, const({9: [0.0]}))  # 7 is the least recently planned: evicted
    assert d.table.prompt_ids.tolist() == [8, 9] and d.num_known == 2
    assert torch.equal(d.predictive(torch.tensor([7]))[0], d.prior_pi)
    assert torch.equal(d.transition_counts(torch.tensor([7]))[0], d.prior_alpha)
    assert d.sampled_times(torch.tensor([7, 8, 9])).tolist() == [0, 1, 1]
    fresh = DPS(n=4, prior_alpha="progress")
    step(fresh, [7], 4, const({7: MIXED}))
    step(d, [7], 4, const({7: MIXED}))  # back, as a never-seen prompt: 8 is evicted now
    assert d.table.prompt_ids.tolist() == [7, 9]
    assert torch.equal(d.predictive(torch.tensor([7])), fresh.predictive(torch.tensor([7])))
    with pytest.raises(InputError, match="capacity"):
        DPS(capacity=5, table=PromptTable())


def test_a_shared_table_keeps_the_filter_to_the_rows_of_dps() -> None:
    """DPS (decaying its filter), a DEPO and a second DPS (uniform, "dps#2") on one PromptTable, over overlapping
    pools, with half the prompts in the budget: the same filter as with private tables, before and after a
    checkpoint (the rows the other owners added do not decay with DPS's and are not DPS's known prompts)."""
    shared = check_shared_table(
        [
            lambda t: DPS(n=2, prior_alpha="progress", decay=0.7, table=t),
            lambda t: DEPO(n=2, steps_per_epoch=1, table=t),
            lambda t: DPS(n=2, strategy="uniform", seed=4, table=t),
        ],
        in_turn(1),
        first=4,
    )
    assert shared.table.owners == ("dps", "depo", "dps#2")
    ids = torch.arange(80)
    (dps, _, dps2), (private, _, private2) = shared.shared, shared.private
    for d, ref in ((dps, private), (shared.resumed[0], private), (dps2, private2)):
        assert d.num_known == ref.num_known == len(ref.table) < len(shared.table)
        assert torch.equal(d.predictive(ids), ref.predictive(ids))
        assert torch.equal(d.transition_counts(ids), ref.transition_counts(ids))
        assert torch.equal(d.sampled_times(ids), ref.sampled_times(ids))


def test_a_shared_table_with_a_zero_alpha_is_refused() -> None:
    """A zero alpha column of a prompt DPS knows, in a shared table, is refused naming the table's column."""
    table = PromptTable()
    first = DPS(n=2, table=table)
    step(first, [1, 2], 4, const({1: MIXED, 2: [1.0]}))
    saved = table.state_dict()
    saved["columns"]["dps/alpha"][0, :, 1] = 0.0
    table.load_state_dict(saved)
    with pytest.raises(InputError) as err:
        first.load_state_dict(first.state_dict())
    assert err.value.argument == "table.state_dict()['columns']['dps/alpha']"
