"""GRESO (arXiv 2506.02177): oracles computed by hand following ``Infini-AI-Lab/GRESO``
(``verl/trainer/ttis/presampling_selector.py``, ``verl/trainer/ppo/ray_trainer.py``), the adaptive batch size by
hand, properties, bad input."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators._base import AllocationResult, Conversation, Request
from rolloutopt.allocators.greso import GRESO, greso_skip_probability
from rolloutopt.allocators.table import PromptTable
from rolloutopt.errors import InputError

from .helpers import same_state

Rewards = Callable[[Request], torch.Tensor]


def run(plan: Conversation, rewards: Rewards) -> tuple[AllocationResult, list[Request]]:
    reqs = []
    while (req := plan.next()) is not None:
        reqs.append(req)
        plan.observe(req, rewards(req))
    return plan.finish(), reqs


def world(kind: Callable[[torch.Tensor], torch.Tensor]) -> Rewards:
    """Deterministic rewards: kind(prompt id) is 0 (all 0), 1 (all 1) or 2 (alternating 1, 0, ...)."""

    def f(req: Request) -> torch.Tensor:
        k = kind(req.prompt_ids).repeat_interleave(req.counts)
        j = torch.cat([torch.arange(int(c)) for c in req.counts])
        return torch.where(k == 2, ((j + 1) % 2).double(), (k == 1).double())

    return f


def const_mean(means: dict[int, float]) -> Rewards:
    """Every rollout of prompt p gets reward means[p] (so its group mean is exactly that)."""

    def f(req: Request) -> torch.Tensor:
        return torch.tensor([means[int(p)] for p in req.prompt_ids], dtype=torch.float64).repeat_interleave(req.counts)

    return f


def small(**kw: object) -> GRESO:
    args: dict[str, object] = {
        "n": 4,
        "train_batch_size": 100,
        "sampling_batch_size": 100,
        "min_sampling_batch_size": 1,
    }
    args.update(kw)
    return GRESO(**args)  # type: ignore[arg-type]


def step(g: GRESO, ids: list[int], budget: int, rewards: Rewards) -> AllocationResult:
    res, _ = run(g.plan(torch.tensor(ids), budget), rewards)
    g.update(res)
    return res


def with_rows(g: GRESO, ids: torch.Tensor, k_easy: torch.Tensor, k_hard: torch.Tensor) -> dict[str, Any]:
    """``g.state_dict()`` with its private table holding the sorted ``ids``, seen by GRESO, with these run
    lengths."""
    state = copy.deepcopy(g.state_dict())
    rows = state["table"]["rows"]
    m = ids.numel()
    rows.update(prompt_ids=ids, touch=torch.zeros(m, dtype=torch.long), clock=0)
    rows["columns"] = {"greso/seen": torch.ones(m, dtype=torch.bool), "greso/k_easy": k_easy, "greso/k_hard": k_hard}
    return state


# -- by hand following the GRESO code -----------------------------------------------------------------------------
def test_spec_oracle_skip_probabilities() -> None:
    g = small(filter_zero_variance=False, p_easy=1.0, p_hard=1.0)  # p = 1: no skips while the history is built
    g.set_epoch(0)  # the same prompts every step within epoch 0 on purpose (silences the untold-epoch warning)
    ids = [1, 2, 3]
    # prompt 1: 0.5, 1.0, 0.98 (two easy entries after a non-easy one); prompt 2: easy x 3; prompt 3: last 0.5
    for h in ({1: 0.5, 2: 1.0, 3: 1.0}, {1: 1.0, 2: 1.0, 3: 0.0}, {1: 0.98, 2: 1.0, 3: 0.5}):
        step(g, ids, 100, const_mean(h))
    k_e, k_h = g.run_lengths(torch.tensor(ids))
    assert k_e.tolist() == [2, 3, 0] and k_h.tolist() == [0, 0, 0]  # 0.98 counts as easy (>= 0.98)
    state = g.state_dict()
    state.update(p_easy=0.5, p_hard=0.5)
    g.load_state_dict(state)
    pe, ph = g.skip_probabilities(torch.tensor(ids))
    assert float(pe[0]) == 0.75  # 1 - 0.5^2, exactly
    assert float(pe[2]) == 0.0 and float(ph[2]) == 0.0  # last entry 0.5: never skipped
    state["table"]["rows"]["columns"]["greso/k_easy"] = torch.tensor([2, 7, 0])
    g.load_state_dict(state)
    pe, _ = g.skip_probabilities(torch.tensor(ids))
    assert float(pe[1]) == 1 - 0.01  # 0.5^7 < 0.01: the floor
    assert torch.equal(
        greso_skip_probability(torch.tensor([0, 1, 2, 7]), 0.5),
        torch.tensor([0.0, 0.5, 0.75, 0.99], dtype=torch.float64),
    )


def test_hard_run_length_thresholds() -> None:
    g = small(filter_zero_variance=False, p_hard=1.0)
    g.set_epoch(0)  # repeated prompts within epoch 0 on purpose (silences the untold-epoch warning)
    step(g, [1, 2, 3], 100, const_mean({1: 0.1, 2: 0.11, 3: 0.2}))
    step(g, [1, 2, 3], 100, const_mean({1: 0.0, 2: 0.12, 3: 0.0}))
    k_e, k_h = g.run_lengths(torch.tensor([1, 2, 3, 4]))
    assert k_h.tolist() == [2, 0, 1, 0] and k_e.tolist() == [0, 0, 0, 0]
    g.p_hard = 0.5
    _, ph = g.skip_probabilities(torch.tensor([1, 3]))
    assert ph.tolist() == [0.75, 0.5]


def _hard_ratio_step(g: GRESO) -> AllocationResult:
    """10 prompts rolled out: ids 0-2 all wrong, 3-9 mixed: hard_ratio 0.3, easy_ratio 0."""
    return step(g, list(range(10)), 40, world(lambda p: torch.where(p < 3, 0, 2)))


def test_spec_oracle_p_adaptation() -> None:
    g = small()
    _hard_ratio_step(g)  # epoch 0: no adaptation (the code's epoch > 0)
    assert (g.p_hard, g.p_easy) == (0.5, 0.5)
    g = small()
    g.set_epoch(1)
    _hard_ratio_step(g)
    assert g.p_hard == 0.49  # 0.3 >= 0.1667: skip hard ones more
    assert g.p_easy == 0.51  # 0 < 0.0833: skip easy ones less
    g = small(adapt_from_epoch=0)
    for s in range(60):  # fresh all-wrong prompts (never skipped): hard ratio 1, easy ratio 0
        step(g, list(range(10 * s, 10 * s + 10)), 40, world(lambda p: p * 0))
    assert g.p_hard == 0.05 and g.p_easy == 0.95  # clamped at min_p / max_p


def test_steps_per_epoch_advances_the_epoch() -> None:
    g = small(steps_per_epoch=2)
    _hard_ratio_step(g)  # step 1, epoch 0: no adaptation; the epoch becomes 1 // 2 = 0
    _hard_ratio_step(g)  # step 2, still epoch 0 during the update; then epoch 2 // 2 = 1
    assert (g.p_hard, g.epoch, g.steps) == (0.5, 1, 2)
    g2 = small(steps_per_epoch=2)
    g2.load_state_dict(g.state_dict())
    for x in (g, g2):
        step(x, list(range(100, 110)), 40, world(lambda p: torch.where(p < 103, 0, 2)))  # fresh: no skips
    assert g.p_hard == g2.p_hard == 0.49 and g.state_dict()["steps"] == 3


def test_adaptive_sampling_batch_size_by_hand() -> None:
    """T = 3 prompts wanted, n = 4, rounds of at most 4 prompts, floor 2.

    Round 1 rolls out ids 0-3; 0 and 2 are all-correct (zero variance), 1 and 3 mixed: 2 kept, z = 1/2.
    Missing R = (3 - 2) * 4 = 4 trajectories: int(1.25 * 4 / (0.5 * 4)) = int(2.5) = 2 <= 4, so a last round of
    max(min(2, 4), 2) = 2 prompts: ids 4 and 5, both mixed; 4 completes the batch and 5 is surplus.
    """
    g = GRESO(n=4, train_batch_size=3, sampling_batch_size=4, min_sampling_batch_size=2)
    kind = world(lambda p: torch.where((p % 2 == 1) | (p == 4), 2, 1))
    plan = g.plan(torch.arange(10), 1000)
    res, reqs = run(plan, kind)
    assert [q.prompt_ids.tolist() for q in reqs] == [[0, 1, 2, 3], [4, 5]]
    assert [res.reason_of(p) for p in range(7)] == [
        "zero_variance",
        "kept",
        "zero_variance",
        "kept",
        "kept",
        "surplus",
        "not_reached",
    ]
    assert res.weight.view(-1, 4)[:, 0].tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert float(res.metrics["rounds"]) == 2 and float(res.metrics["kept_prompts"]) == 3
    assert float(res.metrics["zero_variance_frac"]) == pytest.approx(2 / 6)


def test_adaptive_batch_not_last_and_floor() -> None:
    """T = 8: after round 1 (2 kept, z = 1/2) the estimate int(1.25 * 24 / 2) = 15 is capped at 4 and the round
    is not the last; with a floor of 3, an estimate of 2 becomes 3."""
    kind = world(lambda p: torch.where(p % 2 == 1, 2, 1))
    g = GRESO(n=4, train_batch_size=8, sampling_batch_size=4, min_sampling_batch_size=1)
    _, reqs = run(g.plan(torch.arange(40), 1000), kind)
    assert [q.prompt_ids.numel() for q in reqs] == [4, 4, 4, 4]  # 2 kept per round until 8
    g = GRESO(n=4, train_batch_size=3, sampling_batch_size=4, min_sampling_batch_size=3)
    _, reqs = run(g.plan(torch.arange(40), 1000), kind)
    assert [q.prompt_ids.numel() for q in reqs] == [4, 3]


def test_round_granularity_follows_the_code_with_loader_batch_size() -> None:
    """Rounds of whole loader batches (the code) versus exactly the adaptive size (ours, the default).

    ``Infini-AI-Lab/GRESO@b27784315479921ea1977178d7e6c4858b2ae5a1``, ``verl/trainer/ppo/ray_trainer.py``
    (``fit``): each dataloader batch (``data.train_batch_size`` prompts) is skip-filtered and appended to
    ``acc_batch``; generation runs only once ``len(acc_batch) >= adaptive_sampling_bs``, on all of ``acc_batch``.

    Loader batches of 4, ids 0-11, no history (no skips), n = 2, T = 5 prompts wanted, sampling_batch_size 6;
    even ids have variance. Code: blocks [0-3] (4 < 6), + [4-7] = 8 >= 6: round 1 is ids 0-7, 4 kept, z = 1/2;
    R = (5 - 4) * 2 = 2, int(1.25 * 2 / (0.5 * 2)) = 2 <= 6, so the next round is the last, size max(2, floor):
    block [8-11] (4 >= 2), all of it; kept 0, 2, 4, 6, 8 and 10 is surplus.
    Ours: round 1 is ids 0-5 (3 kept, z = 1/2), R = 4, int(1.25 * 4 / 1) = 5 <= 6: last round ids 6-10.
    """
    kind = world(lambda p: torch.where(p % 2 == 0, 2, 1))
    code = GRESO(n=2, train_batch_size=5, sampling_batch_size=6, min_sampling_batch_size=1, loader_batch_size=4)
    res, reqs = run(code.plan(torch.arange(12), 1000), kind)
    assert [q.prompt_ids.tolist() for q in reqs] == [list(range(8)), [8, 9, 10, 11]]
    assert [res.reason_of(p) for p in (8, 9, 10, 11)] == ["kept", "zero_variance", "surplus", "zero_variance"]
    ours = GRESO(n=2, train_batch_size=5, sampling_batch_size=6, min_sampling_batch_size=1)
    res, reqs = run(ours.plan(torch.arange(12), 1000), kind)
    assert [q.prompt_ids.tolist() for q in reqs] == [list(range(6)), [6, 7, 8, 9, 10]]
    assert res.reason_of(10) == "surplus" and res.reason_of(11) == "not_reached"
    # skipped candidates inside a block that was read count as reached (the code read the whole block)
    skip = GRESO(n=2, train_batch_size=1, sampling_batch_size=2, min_sampling_batch_size=1, loader_batch_size=4)
    skip.load_state_dict(
        {**with_rows(skip, torch.tensor([1]), torch.tensor([50]), torch.tensor([0])), "p_easy": 0.0}
    )  # id 1: skip probability 0.99
    plan = skip.plan(torch.arange(8), 1000)
    res, reqs = run(plan, world(lambda p: p * 0 + 2))
    assert res.reason_of(1) == "skip_easy"  # drawn with probability 0.99 (seed 0)
    assert [q.prompt_ids.tolist() for q in reqs] == [[0, 2, 3]]  # block [0-3] minus the skipped 1
    assert [res.reason_of(p) for p in range(5)] == ["kept", "skip_easy", "surplus", "surplus", "not_reached"]


def test_units_default_floor_and_error_names_them() -> None:
    """The code hard-codes a floor of 64 prompts; here it defaults to min(64, sampling_batch_size)."""
    g = GRESO(n=4, train_batch_size=8, sampling_batch_size=8)  # raised "expected <= 8, got 64" before
    assert g.min_sampling_batch_size == 8 and GRESO().min_sampling_batch_size == 64
    res, reqs = run(g.plan(torch.arange(20), 1000), world(lambda p: p * 0 + 2))
    assert [q.prompt_ids.numel() for q in reqs] == [8] and float(res.metrics["kept_prompts"]) == 8
    with pytest.raises(InputError, match=r"count prompts per round, not rollouts") as err:
        GRESO(n=4, train_batch_size=8, sampling_batch_size=8, min_sampling_batch_size=64)
    msg = str(err.value)
    assert "budget counts rollouts" in msg and "min_sampling_batch_size <= 8" in msg and "None" in msg


def test_warns_once_when_the_epoch_is_never_told() -> None:
    """Code: p adapts only when ``epoch > 0``. Without set_epoch or steps_per_epoch the epoch stays 0 forever:
    a prompt coming back (a new epoch in a dataloader) warns, once; set_epoch or steps_per_epoch silence it."""
    g = small()
    step(g, [1, 2, 3], 100, world(lambda p: p * 0 + 2))  # first time seen: no warning
    with pytest.warns(UserWarning, match="never adapt"):
        step(g, [1, 2, 3], 100, world(lambda p: p * 0 + 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(g, [1, 2, 3], 100, world(lambda p: p * 0 + 2))  # once only
        for quiet in (small(), small(steps_per_epoch=100), small(adapt_from_epoch=0)):
            if quiet.steps_per_epoch is None and quiet.adapt_from_epoch:
                quiet.set_epoch(0)
            for _ in range(2):
                step(quiet, [1, 2, 3], 100, world(lambda p: p * 0 + 2))


def test_all_zero_variance_round_samples_full_batch() -> None:
    g = GRESO(n=2, train_batch_size=2, sampling_batch_size=3, min_sampling_batch_size=1)
    _, reqs = run(g.plan(torch.arange(9), 1000), world(lambda p: torch.where(p < 3, 1, 2)))
    assert [q.prompt_ids.tolist() for q in reqs] == [[0, 1, 2], [3, 4, 5]]  # z = 1: guarded, a full round


def test_budget_edge_and_partial_group() -> None:
    g = small()
    res, reqs = run(g.plan(torch.arange(5), 10), world(lambda p: p * 0 + 2))
    assert res.counts.tolist() == [4, 4, 0, 0, 0] and len(reqs) == 1  # 2 left < n_min = 4: unspent
    g = small(n_min=2)
    res, _ = run(g.plan(torch.arange(5), 10), world(lambda p: p * 0 + 2))
    assert res.counts.tolist() == [4, 4, 2, 0, 0] and res.reason_of(2) == "kept"
    g = small(n_max=6, sampling_batch_size=2, train_batch_size=2)
    res, _ = run(g.plan(torch.arange(5), 11), world(lambda p: p * 0 + 2))
    assert res.counts.tolist() == [4, 4, 0, 0, 0]  # a round of 2 prompts has a round budget of 8: no spread


def test_deterministic_skips_and_reasons() -> None:
    """floor = 0 and p = 0: any run skips with probability 1 - max(0^k, 0) = 1."""
    g = small(filter_zero_variance=False, floor=0.0, p_easy=0.0, p_hard=0.0)
    step(g, [1, 2, 3], 100, const_mean({1: 1.0, 2: 0.0, 3: 0.5}))
    res, reqs = run(g.plan(torch.tensor([1, 2, 3, 4]), 100), const_mean({3: 0.5, 4: 0.5}))
    assert reqs[0].prompt_ids.tolist() == [3, 4]
    assert [res.reason_of(p) for p in (1, 2, 3, 4)] == ["skip_easy", "skip_hard", "kept", "kept"]
    assert float(res.metrics["skip_easy_frac"]) == 0.25 and float(res.metrics["skip_hard_frac"]) == 0.25


def test_skip_rates_match_probabilities() -> None:
    """20,000 prompts with k_e = 2 (p_easy = 0.5) skip at 0.75; with k_h = 1 at 0.5 (4-sigma binomial bounds)."""
    k = 20_000
    g = GRESO(n=1, train_batch_size=k, sampling_batch_size=k, filter_zero_variance=False, seed=3)
    ids = torch.arange(2 * k)
    state = with_rows(g, ids, torch.cat([torch.full((k,), 2), torch.zeros(k, dtype=torch.long)]), (ids >= k).long())
    g.load_state_dict(state)
    res, _ = run(g.plan(ids, 10**6), lambda r: torch.zeros(r.total, dtype=torch.float64))
    easy = (res.reasons[:k] == 3).double().mean()
    hard = (res.reasons[k:] == 4).double().mean()
    assert abs(float(easy) - 0.75) < 4 * (0.75 * 0.25 / k) ** 0.5
    assert abs(float(hard) - 0.5) < 4 * (0.25 / k) ** 0.5
    assert not bool((res.reasons[k:] == 3).any())


# -- properties ---------------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    p=st.integers(1, 40),
    budget=st.integers(0, 400),
    n=st.integers(1, 6),
    train=st.integers(1, 20),
    sampling=st.integers(1, 12),
    filt=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_properties(p: int, budget: int, n: int, train: int, sampling: int, filt: bool, seed: int) -> None:
    """Budget, caps, weights, reasons consistent, determinism for a seed, run lengths bounded by steps."""
    kind = world(lambda x: x % 3)
    ids = torch.randperm(10 * p, generator=torch.Generator().manual_seed(seed))[:p]

    def make() -> GRESO:
        return GRESO(
            n=n, train_batch_size=train, sampling_batch_size=sampling, min_sampling_batch_size=1,
            filter_zero_variance=filt, seed=seed,
        )  # fmt: skip

    a, b = make(), make()
    for s in range(3):
        a.set_epoch(s)
        b.set_epoch(s)
        ra, qa = run(a.plan(ids, budget), kind)
        rb, qb = run(b.plan(ids, budget), kind)
        assert [(q.prompt_ids.tolist(), q.counts.tolist()) for q in qa] == [
            (q.prompt_ids.tolist(), q.counts.tolist()) for q in qb
        ]
        c = ra.counts
        assert int(c.sum()) == ra.rewards.numel() <= budget
        assert bool(((c == 0) | (c == n)).all())
        assert bool(((ra.weight == 0) | (ra.weight == 1)).all())
        kept = ra.reasons == 0
        assert int(kept.sum()) <= (train if filt else p)
        assert bool((c[kept] > 0).all()) and bool((c[ra.reasons >= 3] == 0).all())
        assert torch.equal(ra.weight > 0, kept[ra.group])
        if filt:  # kept groups have variance, zero_variance ones none
            kinds = ra.plan_prompt_ids % 3
            varied = (kinds == 2) & (n >= 2)  # a group of one rollout has no variance
            assert bool(varied[kept].all()) and not bool(varied[ra.reasons == 1].any())
        else:
            assert len(qa) <= 1
        a.update(ra)
        b.update(rb)
        k_e, k_h = a.run_lengths(ids)
        assert int(k_e.max()) <= s + 1 and int(k_h.max()) <= s + 1 and not bool(((k_e > 0) & (k_h > 0)).any())
    assert a.p_easy == b.p_easy and 0.05 <= a.p_hard <= 0.95


@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 30), n=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_permutation_without_history(p: int, n: int, seed: int) -> None:
    """With no history nothing is skipped; when one round covers every prompt, a permutation permutes the plan."""
    ids = torch.randperm(5 * p, generator=torch.Generator().manual_seed(seed))[:p]
    perm = torch.randperm(p, generator=torch.Generator().manual_seed(seed + 1))
    kind = world(lambda x: x % 3)
    res, _ = run(
        GRESO(n=n, train_batch_size=p, sampling_batch_size=p, min_sampling_batch_size=1).plan(ids, p * n), kind
    )
    res_p, _ = run(
        GRESO(n=n, train_batch_size=p, sampling_batch_size=p, min_sampling_batch_size=1).plan(ids[perm], p * n), kind
    )
    assert torch.equal(res_p.counts, res.counts[perm]) and torch.equal(res_p.reasons, res.reasons[perm])


def test_state_dict_round_trip_mid_run() -> None:
    rate = torch.linspace(0, 1, 60, dtype=torch.float64).pow(2)

    def bern(s: int) -> Rewards:
        def f(req: Request) -> torch.Tensor:
            q = rate[req.prompt_ids].repeat_interleave(req.counts)
            return (torch.rand(q.shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64) < q).double()

        return f

    pools = [torch.randperm(60, generator=torch.Generator().manual_seed(s)) for s in range(8)]

    def go(g: GRESO, steps: range) -> list[tuple[list[Request], AllocationResult]]:
        out = []
        for s in steps:
            g.set_epoch(s // 2)
            res, reqs = run(g.plan(pools[s], 200), bern(s))
            g.update(res)
            out.append((reqs, res))
        return out

    def make() -> GRESO:
        return GRESO(n=4, train_batch_size=12, sampling_batch_size=16, min_sampling_batch_size=4, seed=11)

    a = make()
    go(a, range(4))
    saved = a.state_dict()
    tail_a = go(a, range(4, 8))
    b = make()
    b.load_state_dict(saved)
    tail_b = go(b, range(4, 8))
    for (ra, xa), (rb, xb) in zip(tail_a, tail_b, strict=True):
        assert [(q.prompt_ids.tolist(), q.counts.tolist()) for q in ra] == [
            (q.prompt_ids.tolist(), q.counts.tolist()) for q in rb
        ]
        assert torch.equal(xa.rewards, xb.rewards) and torch.equal(xa.reasons, xb.reasons)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert same_state(sa[key], sb[key]), key
    assert any(bool((x.reasons == 3).any() | (x.reasons == 4).any()) for _, x in tail_a)  # skips did happen


# -- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"n": 0}, "n"),
        ({"n": 8, "n_min": 9}, "n_min"),
        ({"n": 8, "n_max": 7}, "n_max"),
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"sampling_batch_size": 0}, "sampling_batch_size"),
        ({"min_sampling_batch_size": 500}, "min_sampling_batch_size"),
        ({"oversample": 0.0}, "oversample"),
        ({"p_easy": 1.5}, "p_easy"),
        ({"p_hard": float("nan")}, "p_hard"),
        ({"min_p": 0.5, "max_p": 0.4}, "max_p"),
        ({"target_zero_variance": -0.1}, "target_zero_variance"),
        ({"hard_threshold": 0.99}, "hard_threshold"),
        ({"floor": 2.0}, "floor"),
        ({"filter_zero_variance": "yes"}, "filter_zero_variance"),
        ({"adapt_from_epoch": -1}, "adapt_from_epoch"),
        ({"steps_per_epoch": 0}, "steps_per_epoch"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_constructor(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        GRESO(**kwargs)  # type: ignore[arg-type]


def test_bad_plan_observe_update_load() -> None:
    g = small()
    with pytest.raises(InputError, match="budget"):
        g.plan(torch.tensor([1, 2]), -3)
    with pytest.raises(InputError, match="prompt_ids"):
        g.plan(torch.tensor([[1, 2]]), 8)
    plan = g.plan(torch.tensor([1, 2]), 8)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="request"):  # unknown ids / not the pending request
        plan.observe(Request(torch.tensor([9]), torch.tensor([8])), torch.zeros(8))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(2, 4))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((8,), float("nan")))
    with pytest.raises(InputError, match="result"):
        g.update(None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="epoch"):
        g.set_epoch(-1)
    with pytest.raises(InputError, match="state"):
        g.load_state_dict({})
    bad = g.state_dict()
    bad["table"]["rows"]["columns"]["greso/k_easy"] = torch.zeros(3, dtype=torch.long)
    with pytest.raises(InputError, match="k_easy"):
        g.load_state_dict(bad)
    with pytest.raises(InputError, match="run_length"):
        greso_skip_probability(torch.tensor([0.5]), 0.5)
    with pytest.raises(InputError, match="run_length"):
        greso_skip_probability(torch.tensor([-1]), 0.5)
    with pytest.raises(InputError, match="p"):
        greso_skip_probability(torch.tensor([1]), 1.5)


def test_empty_pool_and_zero_budget() -> None:
    for ids, budget in ((torch.zeros(0, dtype=torch.long), 100), (torch.arange(3), 0)):
        g = small()
        res, reqs = run(g.plan(ids, budget), lambda r: torch.zeros(r.total, dtype=torch.float64))
        assert reqs == [] and int(res.counts.sum()) == 0 and bool((res.reasons == 5).all())
        g.update(res)
        assert (g.p_easy, g.p_hard) == (0.5, 0.5)


def test_run_lengths_match_the_code_trace_walk() -> None:
    """The two counters equal the code's backward walk over the full (epoch, mean) trace, on random histories."""
    g = small(filter_zero_variance=False, p_easy=1.0, p_hard=1.0, sampling_batch_size=20)
    g.set_epoch(0)  # repeated prompts within epoch 0 on purpose (silences the untold-epoch warning)
    trace: dict[int, list[float]] = {}
    levels = torch.tensor([0.0, 0.1, 0.11, 0.12, 0.5, 0.97, 0.98, 1.0], dtype=torch.float64)
    for s in range(12):
        gen = torch.Generator().manual_seed(s)
        pool = torch.randperm(15, generator=gen)[:10]
        means = {int(p): float(levels[torch.randint(0, 8, (1,), generator=gen)]) for p in pool}
        res = step(g, pool.tolist(), 1000, const_mean(means))
        for p in res.plan_prompt_ids[res.counts > 0].tolist():
            trace.setdefault(p, []).append(means[p])

    def walk(t: list[float], hit: Callable[[float], bool]) -> int:
        count = 0
        for r in reversed(t):
            if not hit(r):
                break
            count += 1
        return count

    ids = torch.tensor(sorted(trace))
    k_e, k_h = g.run_lengths(ids)
    assert k_e.tolist() == [walk(trace[int(i)], lambda r: r >= 0.98) for i in ids]
    assert k_h.tolist() == [walk(trace[int(i)], lambda r: r <= 0.11) for i in ids]


def test_load_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """A NaN probability or a negative run length, epoch or step count is an InputError naming the field, and
    the allocator keeps its own state."""
    g = GRESO(n=2)
    good = {
        **with_rows(g, torch.tensor([1, 4]), torch.tensor([2, 0]), torch.tensor([0, 3])),
        "p_easy": 0.4,
        "epoch": 1,
        "steps": 7,
    }
    g.load_state_dict(good)
    before = g.state_dict()
    bad = [
        ("p_easy", float("nan")),
        ("p_hard", 1.5),
        ("k_easy", torch.tensor([2, -1])),
        ("k_hard", torch.tensor([-3, 0])),
        ("epoch", -1),
        ("steps", -2),
    ]
    for key, value in bad:
        state = copy.deepcopy(good)
        if key.startswith("k_"):  # a table column
            state["table"]["rows"]["columns"][f"greso/{key}"] = value
            argument = f"state['table']['rows']['columns']['greso/{key}']"
        else:
            state[key] = value
            argument = f"state[{key!r}]"
        with pytest.raises(InputError) as err:
            g.load_state_dict(state)
        assert err.value.argument == argument
        assert same_state(g.state_dict(), before)


# -- the prompt table ---------------------------------------------------------------------------------------------
def test_capacity_evicts_the_least_recently_updated_prompt() -> None:
    """capacity=2: a third prompt evicts the least recently updated one, which then behaves as never rolled out
    (run lengths 0, never skipped)."""
    g = small(filter_zero_variance=False, floor=0.0, p_easy=0.0, p_hard=0.0, capacity=2)
    g.set_epoch(0)
    all_correct = const_mean({1: 1.0, 2: 1.0, 3: 0.0})
    step(g, [1], 100, all_correct)
    step(g, [2], 100, all_correct)
    assert g.run_lengths(torch.tensor([1, 2]))[0].tolist() == [1, 1]
    step(g, [3], 100, all_correct)  # 1 is the least recently updated: evicted
    assert g.table.prompt_ids.tolist() == [2, 3] and len(g.table) == 2
    k_e, k_h = g.run_lengths(torch.tensor([1, 2, 3]))
    assert k_e.tolist() == [0, 1, 0] and k_h.tolist() == [0, 0, 1]
    res, _ = run(g.plan(torch.tensor([2, 3, 1]), 100), all_correct)  # p = 0, floor 0: any run skips surely
    assert [res.reason_of(p) for p in (1, 2, 3)] == ["kept", "skip_easy", "skip_hard"]
    g.update(res)
    assert g.table.prompt_ids.tolist() == [1, 3]  # 1 came back (a fresh run of 1); 2 was updated least recently
    assert g.run_lengths(torch.tensor([1, 2]))[0].tolist() == [1, 0]
    with pytest.raises(InputError, match="capacity"):
        GRESO(capacity=0)
    with pytest.raises(InputError, match="capacity"):
        GRESO(capacity=5, table=PromptTable())
    with pytest.raises(InputError, match="table"):
        GRESO(table="shared")  # type: ignore[arg-type]
