"""Multi-Adversary GDRO (arXiv 2601.19280, reconstructed): oracles, controller convergence, properties.

Hand-derived oracles (three of our reconstruction, see docs/methods/gdro.md, and our own for the classifier's
hysteresis, the bin sampler's distribution and the budget cut), the shadow-price controller converging to the
square-root closed form on
stationary problems, hypothesis properties (budget, caps, determinism, permutation), save/load mid-run and one
test per class of bad input. No public code exists and neither verl 0.9.1 nor TRL 1.16 ships GDRO, so there is no
parity test.
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators import AllocationResult, Conversation, Uniform
from rolloutopt.allocators.gdro import PromptGDRO, RolloutGDRO
from rolloutopt.allocators.gdro_bins import (
    DifficultyClassifier,
    pass_at_k,
    shadow_price_arms,
    shadow_price_update,
    sqrt_allocation,
)
from rolloutopt.allocators.table import PromptTable
from rolloutopt.errors import InputError

from .table_helpers import check_shared_table, in_turn

F64 = torch.float64


def L(*xs: int) -> torch.Tensor:  # noqa: N802
    return torch.tensor(xs, dtype=torch.long)


def D(*xs: float) -> torch.Tensor:  # noqa: N802
    return torch.tensor(xs, dtype=F64)


def run(plan: Conversation, reward_fn: Any, hardness: Any = None) -> AllocationResult:
    """Drive a plan; ``reward_fn(prompt_ids [R], counts [R]) -> rewards [counts.sum()]``. ``hardness``: the
    optional per-prompt signal, ``{prompt: value}`` or ``fn(prompt_ids [R]) -> [R]``, observed per request row."""
    while (req := plan.next()) is not None:
        signals = {}
        if hardness is not None:
            assert "hardness" in req.signals
            h = hardness if callable(hardness) else lambda ids: torch.tensor([hardness[int(i)] for i in ids], dtype=F64)
            signals["hardness"] = h(req.prompt_ids)
        plan.observe(req, reward_fn(req.prompt_ids, req.counts), **signals)
    return plan.finish()


def bernoulli(p_of: dict[int, float], seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)

    def fn(ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        p = torch.tensor([p_of[int(i)] for i in ids], dtype=F64).repeat_interleave(counts)
        return (torch.rand(p.numel(), generator=g, dtype=F64) < p).to(F64)

    return fn


def exact_rate(p_of: dict[int, float]) -> Any:
    """Deterministic rewards: round(p * n) successes out of n (a stationary synthetic problem)."""

    def fn(ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = []
        for i, n in zip(ids.tolist(), counts.tolist(), strict=True):
            c = round(p_of[i] * n)
            out += [1.0] * c + [0.0] * (n - c)
        return torch.tensor(out, dtype=F64)

    return fn


def listed(rewards: dict[int, list[float]]) -> Any:
    def fn(ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out: list[float] = []
        for i, n in zip(ids.tolist(), counts.tolist(), strict=True):
            assert len(rewards[i]) == n
            out += rewards[i]
        return torch.tensor(out, dtype=F64)

    return fn


def binary_classifier(**kw: Any) -> DifficultyClassifier:
    """pass@1 = c/n, one edge at 0.5, no smoothing: bins 0 (hard), 1 (easy), 2 (unseen)."""
    base: dict[str, Any] = {"k": 1, "edges": (0.5,), "smoothing": 0.0, "experimental": True}
    return DifficultyClassifier(**{**base, **kw})


# ------------------------------------------------------------------------------------------ hand oracles


def test_pass_at_k_spec_oracle_and_hand_values() -> None:
    # unbiased pass@k (arXiv 2107.03374): n = 8, c = 2, k = 4: 1 - C(6,4)/C(8,4) = 1 - 15/70.
    out = pass_at_k(L(8, 8, 8, 3, 3, 5), L(2, 0, 5, 1, 0, 1), 4)
    # c = 0 -> 0; n - c = 3 < k -> 1; n = 3 < k: plug-in 1 - (2/3)^4 and 0; n=5,c=1: 1 - C(4,4)/C(5,4) = 4/5.
    assert out.dtype == F64
    torch.testing.assert_close(out, D(1 - 15 / 70, 0.0, 1.0, 1 - (2 / 3) ** 4, 0.0, 0.8))
    clip = pass_at_k(L(3, 3, 2), L(1, 0, 2), 4, small_group="clip")
    torch.testing.assert_close(clip, D(1.0, 0.0, 1.0))
    assert pass_at_k(L(), L(), 4).numel() == 0


@given(n=st.integers(1, 40), data=st.data(), k=st.integers(1, 12))
@settings(max_examples=40, deadline=None)
def test_pass_at_k_matches_the_product_formula(n: int, data: st.DataObject, k: int) -> None:
    c = data.draw(st.integers(0, n))
    got = float(pass_at_k(L(n), L(c), k)[0])
    want = 1 - math.comb(n - c, k) / math.comb(n, k) if n >= k else 1 - (1 - c / n) ** k
    assert got == pytest.approx(want, abs=1e-12)
    assert 0.0 <= got <= 1.0


def test_sqrt_allocation_spec_oracles() -> None:
    # equal mass, w.v = [1, 4], n_bar = 12 -> sqrt = [1, 2], mean sqrt 1.5 -> n = 12 * [1, 2] / 1.5 = [8, 16].
    torch.testing.assert_close(sqrt_allocation(D(1.0, 4.0), D(0.5, 0.5), 12), D(8.0, 16.0))
    # equal w.v -> n_bar everywhere; masses need not be normalised.
    torch.testing.assert_close(sqrt_allocation(D(0.3, 0.3, 0.3), D(2.0, 1.0, 1.0), 6), D(6.0, 6.0, 6.0))
    # a zero bin gets 0; masses 1/4, 3/4 with a = [0, 9]: 5 / (0.75 * 3) * 3 = 6.6667.
    torch.testing.assert_close(sqrt_allocation(D(0.0, 9.0), D(1.0, 3.0), 5), D(0.0, 5 / 0.75))
    # no signal at all: every bin gets n_bar.
    torch.testing.assert_close(sqrt_allocation(D(0.0, 0.0), D(1.0, 1.0), 5), D(5.0, 5.0))


def test_shadow_price_arms_hand_values() -> None:
    # a = [1, 4], mu = 1/64, n_min = 1: arms are the largest n with a / (n (n-1)) > mu: n(n-1) < 64 -> 8, < 256 -> 16.
    assert shadow_price_arms(D(1.0, 4.0), 1 / 64, n_min=1, n_max=32).tolist() == [8, 16]
    # a = 1, mu = 0.02, n_min = 2: gains 1/6, 1/12, 1/20, 1/30, 1/42 > 0.02, 1/56 < 0.02 -> 7.
    assert shadow_price_arms(D(1.0), 0.02, n_min=2, n_max=10).tolist() == [7]
    # mu = 0 -> n_max where a > 0; a = 0 -> n_min; the cap binds.
    assert shadow_price_arms(D(0.5, 0.0), 0.0, n_min=2, n_max=9).tolist() == [9, 2]
    assert shadow_price_arms(D(100.0), 1e-6, n_min=2, n_max=9).tolist() == [9]


@given(
    a=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=6),
    mu=st.floats(0.0, 1.0),
    n_min=st.integers(1, 5),
    width=st.integers(0, 12),
)
@settings(max_examples=60, deadline=None)
def test_shadow_price_arms_is_the_argmax_of_the_objective(a: list[float], mu: float, n_min: int, width: int) -> None:
    n_max = n_min + width
    arms = shadow_price_arms(torch.tensor(a, dtype=F64), mu, n_min=n_min, n_max=n_max)
    for ab, arm in zip(a, arms.tolist(), strict=True):
        values = [ab * (1 / n_min - 1 / n) - mu * n for n in range(n_min, n_max + 1)]
        assert values[arm - n_min] >= max(values) - 1e-12
        assert n_min <= arm <= n_max


def test_shadow_price_update_by_hand() -> None:
    assert shadow_price_update(0.01, 10.0, 8.0, eta_mu=0.001) == pytest.approx(0.012)
    assert shadow_price_update(0.001, 2.0, 8.0, eta_mu=0.001) == 0.0  # projected onto mu >= 0
    assert shadow_price_update(0.5, 8.0, 8.0, eta_mu=1.0) == 0.5
    assert shadow_price_update(0.01, 10.0, 8.0, eta_mu=0.5, scale=0.004) == pytest.approx(0.014)


# ----------------------------------------------------------------- the controller converges to the closed form


def control(
    a: torch.Tensor,
    pi: torch.Tensor,
    n_bar: float,
    eta_mu: float,
    steps: int,
    n_min: int,
    n_max: int,
    scale: float = 1.0,
) -> Any:
    mu, history = 0.0, []
    for _ in range(steps):
        arms = shadow_price_arms(a, mu, n_min=n_min, n_max=n_max)
        history.append(arms.to(F64))
        mu = shadow_price_update(mu, float((pi * arms).sum()), n_bar, eta_mu=eta_mu, scale=scale)
    return torch.stack(history), mu


def test_controller_reaches_the_spec_oracle_exactly() -> None:
    # a = [1, 4], equal mass, n_bar = 12: arm 8 needs 1/72 <= mu < 1/56 and arm 16 needs 4/272 <= mu < 4/240, so
    # every mu in [1/68, 1/60) gives arms [8, 16], whose mean is n_bar: the price stops there.
    arms, mu = control(D(1.0, 4.0), D(0.5, 0.5), 12.0, 2e-4, 400, 1, 32)
    assert arms[-50:].tolist() == [[8.0, 16.0]] * 50
    assert 1 / 68 <= mu < 1 / 60


@given(
    a=st.lists(st.floats(0.02, 0.25), min_size=2, max_size=5),
    mass=st.lists(st.floats(0.1, 1.0), min_size=5, max_size=5),
    n_bar=st.floats(5.0, 10.0),
)
@settings(max_examples=15, deadline=None)
def test_controller_converges_to_the_sqrt_allocation(a: list[float], mass: list[float], n_bar: float) -> None:
    aa = torch.tensor(a, dtype=F64)
    pi = torch.tensor(mass[: len(a)], dtype=F64)
    pi = pi / pi.sum()
    closed = sqrt_allocation(aa, pi, n_bar)
    if not bool(((closed > 3) & (closed < 29)).all()):  # the closed form must lie inside the arms
        return
    # RolloutGDRO's default "relative" step: eta_mu = 0.2 in units of the closed-form price over n_bar.
    price = float((pi * aa.sqrt()).sum() / n_bar) ** 2
    arms, _ = control(aa, pi, n_bar, 0.2, 1500, 2, 32, scale=price / n_bar)
    avg = arms[500:].mean(0)
    assert float((pi * avg).sum()) == pytest.approx(n_bar, abs=0.05)  # the mean budget holds on average
    # each bin within one rollout of the square-root rule, scaled by mass: the arms are integers, so the price
    # holds the mean budget by moving the lighter bins' arms, and a bin of mass pi_b absorbs the heaviest bin's
    # rounding times max(pi) / pi_b (a = [0.02, 0.1875], masses 0.9 / 0.1, n_bar = 5: the light bin is 1.2 off)
    assert ((avg - closed).abs() * pi).max() <= pi.max()


def test_rollout_gdro_converges_on_a_stationary_population() -> None:
    # 3 difficulty levels x 10 prompts, deterministic rewards (round(p n) of n correct): the allocator's time-average
    # arms approach the square-root rule computed from its own variance estimates, at mean n_bar = 8.
    p_of = {i: (0.1, 0.5, 0.9)[i % 3] for i in range(30)}
    clf = DifficultyClassifier(k=1, edges=(0.3, 0.7), experimental=True)
    al = RolloutGDRO(weights="uniform", n_bar=8.0, classifier=clf, experimental=True)
    ids = torch.arange(30)
    proposed = []
    for _ in range(300):
        res = run(al.plan(ids, 30 * 16), exact_rate(p_of))
        a, pi, arms = al.bin_values(ids)
        proposed.append(arms.to(F64))
        al.update(res)
    a, pi, _ = al.bin_values(ids)
    assert pi[:3].tolist() == pytest.approx([1 / 3] * 3)
    avg = torch.stack(proposed[100:]).mean(0)
    closed = sqrt_allocation(a[:3], pi[:3], 8.0)
    assert float((pi * avg).sum()) == pytest.approx(8.0, abs=0.1)
    assert (avg[:3] - closed).abs().max() <= 1.0
    assert float(avg[1]) > float(avg[0]) + 2  # the p = 0.5 bin (largest variance) gets clearly more


# ------------------------------------------------------------------------------------------------ classifier


def test_classifier_hysteresis_by_hand() -> None:
    clf = binary_classifier(margin=0.1, patience=2)
    assert clf.num_bins == 3 and clf.unseen_bin == 2
    one = L(7)

    def visit(c: int, n: int = 20) -> int:
        clf.update(one, L(n), L(c))
        return int(clf.bins(one)[0])

    assert int(clf.bins(one)[0]) == 2  # unseen
    assert visit(9) == 0  # 0.45: first visit takes its bin directly
    assert visit(11) == 0  # 0.55 crosses 0.5 but not by the margin: streak 1
    assert visit(11) == 1  # second consecutive visit across: moves
    assert visit(9) == 1  # 0.45 is inside the margin below 0.5: streak 1
    assert visit(11) == 1  # back inside bin 1: the streak resets
    assert visit(9) == 1  # streak 1 again
    assert visit(6) == 0  # 0.30 < 0.5 - 0.1: moves at once
    torch.testing.assert_close(clf.ema(L(7, 8)), D(0.3, math.nan), equal_nan=True)


def test_classifier_ema_and_unseen_policies() -> None:
    clf = DifficultyClassifier(k=1, edges=(0.25, 0.5, 0.75), smoothing=0.5, unseen="middle", experimental=True)
    assert clf.num_bins == 4 and clf.unseen_bin == 2
    clf.update(L(3), L(4), L(4))  # 1.0
    clf.update(L(3), L(25), L(11))  # 0.5 * 1 + 0.5 * 0.44 = 0.72: below 0.75, within the margin
    torch.testing.assert_close(clf.ema(L(3)), D(0.72))
    assert clf.bins(L(3, 99)).tolist() == [3, 2]  # hysteresis keeps 3 for one visit; 99 is unseen -> middle
    clf.update(L(3), L(4), L(0))  # 0.36: more than the margin below bin 3 -> bin 1 at once
    assert clf.bins(L(3)).tolist() == [1]


def test_classifier_capacity_forgets_the_least_recently_seen() -> None:
    clf = binary_classifier(capacity=2)
    clf.update(L(1, 2), L(2, 2), L(0, 2))
    clf.update(L(3), L(2), L(2))
    # 1 and 2 were last seen together; the table evicts the tie's smaller id, 1 (unseen again), 2 stays.
    assert len(clf) == 2 and clf.bins(L(1, 2, 3)).tolist() == [2, 1, 1]
    assert clf.table.prompt_ids.tolist() == [2, 3]


# ------------------------------------------------------------------------------------------------ Prompt-GDRO


def test_prompt_gdro_bin_probabilities_by_hand() -> None:
    al = PromptGDRO(n=2, classifier=binary_classifier(), experimental=True)
    first = {10: [0.0, 0.0], 11: [0.0, 0.0], 12: [1.0, 1.0], 13: [1.0, 0.0]}
    res = run(al.plan(L(10, 11, 12, 13), 8), listed(first))
    assert res.counts.tolist() == [2, 2, 2, 2] and res.reason_of(13) == "selected"
    al.update(res)
    # All four were unseen (bin 2) when planned: fail rates 1, 1, 0, 0.5 -> mean 0.625; s = 0.1 * 0.625, t = 1.
    # Classifier: pass@1 = 0, 0, 1, 0.5 -> bins 0, 0, 1, 1.
    assert al.classifier.bins(L(10, 11, 12, 13)).tolist() == [0, 0, 1, 1]
    second = {10: [0.0, 0.0], 11: [0.0, 0.0], 12: [1.0, 1.0], 13: [1.0, 1.0], 14: [0.0, 1.0], 15: [0.0, 1.0]}
    res = run(al.plan(L(10, 11, 12, 13, 14, 15), 12), listed(second))
    al.update(res)
    # bin 0: s = 0.1 * 1, t = 1 -> 1; bin 1: 0; bin 2: s = 0.9 * 0.0625 + 0.1 * 0.5 = 0.10625, t = 2 -> /0.19.
    s_hat = torch.tensor([1.0, 0.0, 0.10625 / 0.19], dtype=F64)
    q = torch.softmax(s_hat, 0) * 0.95 + 0.05 / 3
    torch.testing.assert_close(al.bin_probs(), q)
    # Only bins 0 and 1 among {10, 12}: renormalised over the present bins.
    q2 = torch.softmax(s_hat[:2], 0) * 0.95 + 0.05 / 2
    torch.testing.assert_close(al.bin_probs(L(10, 12)), torch.cat([q2, D(0.0)]))
    # loss_weights = q_b / pi_b: bins of (10, 11, 12) are (0, 0, 1), shares 2/3 and 1/3.
    torch.testing.assert_close(al.loss_weights(L(10, 11, 12)), torch.stack([q2[0] * 1.5, q2[0] * 1.5, q2[1] * 3]))


def test_prompt_gdro_unscored_bin_is_explored_at_the_best_score() -> None:
    al = PromptGDRO(n=2, classifier=binary_classifier(), experimental=True)
    res = run(al.plan(L(1, 2), 4), listed({1: [0.0, 0.0], 2: [0.0, 0.0]}))
    al.update(res)  # bin 2 scored 1.0 (both failed); bins 0, 1 have no updates
    # bins 0 and 1 score like the best scored present bin (bin 2: 1.0), so q is uniform.
    torch.testing.assert_close(al.bin_probs(), torch.full((3,), 1 / 3, dtype=F64))


def test_prompt_gdro_samples_bins_by_q() -> None:
    # 3 bins x 600 prompts; draw 30 at a time: each bin's share of the draws is q_b (to sampling error).
    al = PromptGDRO(n=1, eta=2.0, classifier=binary_classifier(), seed=3, experimental=True)
    hard, easy = torch.arange(600), torch.arange(600, 1200)
    al.classifier.update(
        torch.cat([hard, easy]), torch.ones(1200, dtype=torch.long), (torch.arange(1200) >= 600).long()
    )
    sd = al.state_dict()
    sd["scores"] = {"s": D(0.1, 0.02, 0.05), "t": L(1, 1, 1)}  # debiased: [1.0, 0.2, 0.5]
    al.load_state_dict(sd)
    pool = torch.arange(1800)
    q = al.bin_probs(pool)
    bins = al.classifier.bins(pool)
    counts = torch.zeros(3, dtype=F64)
    for _ in range(200):
        plan = al.plan(pool, 30)
        chosen = (plan._counts > 0).nonzero()[:, 0]  # the plan's request, read before any rollout
        counts += torch.bincount(bins[chosen], minlength=3).to(F64)
    share = counts / counts.sum()
    assert (share - q).abs().max() < 0.02, (share, q)  # 6000 draws: sd <= 0.0065


def test_prompt_gdro_budget_rules() -> None:
    ids = L(4, 5, 6)
    al = PromptGDRO(n=4, n_min=2, n_max=6, experimental=True)
    ones = lambda i, c: torch.ones(int(c.sum()), dtype=F64)  # noqa: E731
    assert run(al.plan(ids, 9), ones).counts.tolist().count(4) == 2  # 2 groups of 4, 1 rollout unspent
    assert run(al.plan(ids, 20), ones).counts.tolist() == [6, 6, 6]  # small pool: grows to min(n_max, 20 // 3)
    res = run(al.plan(ids, 3), ones)  # below n, at least n_min: one prompt gets the budget
    assert sorted(res.counts.tolist()) == [0, 0, 3]
    res = run(al.plan(ids, 1), ones)
    assert res.counts.tolist() == [0, 0, 0] and res.reason_of(5) == "no_budget"
    res = run(PromptGDRO(n=4, experimental=True).plan(ids, 20), ones)  # n_max = n by default
    assert res.counts.tolist() == [4, 4, 4]
    assert run(al.plan(L(), 8), ones).counts.numel() == 0


# ----------------------------------------------------------------------------------------------- Rollout-GDRO


def rollout_fixture(**kw: Any) -> RolloutGDRO:
    """Prompt 100 in bin 0 with v = 0.1 * 0.9 = 0.09, prompt 200 in bin 1 with v = 0.25 (uniform weights)."""
    al = RolloutGDRO(n_min=2, n_max=4, weights="uniform", beta=0.0, classifier=binary_classifier(), **kw)
    al.classifier.update(L(100, 200), L(10, 2), L(1, 1))
    sd = al.state_dict()
    sd["rate"] = {"s": D(0.1, 0.5, 0.0), "t": L(1, 1, 0)}
    al.load_state_dict(sd)
    return al


def test_rollout_gdro_budget_cut_by_hand() -> None:
    al = rollout_fixture(experimental=True)
    a, _, arms = al.bin_values(L(100, 200))
    torch.testing.assert_close(a, D(0.09, 0.25, 0.0))
    assert arms.tolist()[:2] == [4, 4]  # mu = 0
    # Units above n_min = 2, worth a / (k (k-1)): bin 1: k=3 0.0417, k=4 0.0208; bin 0: k=3 0.015, k=4 0.0075.
    zeros = lambda i, c: torch.zeros(int(c.sum()), dtype=F64)  # noqa: E731
    want = {8: [4, 4], 7: [3, 4], 6: [2, 4], 5: [2, 3], 4: [2, 2], 3: [0, 3], 2: [0, 2], 1: [0, 0]}
    for budget, counts in want.items():
        res = run(al.plan(L(100, 200), budget), zeros)
        assert res.counts.tolist() == counts, budget
    res = run(al.plan(L(100, 200), 3), zeros)
    assert (res.reason_of(100), res.reason_of(200)) == ("no_budget", "trimmed_to_budget")
    res = run(al.plan(L(100, 200), 8), zeros)
    assert {res.reason_of(100), res.reason_of(200)} == {"allocated"}
    assert float(res.metrics["proposed_mean_n"]) == 4.0 and float(res.metrics["n_bar"]) == 4.0


def test_rollout_gdro_empty_pool_and_zero_budget() -> None:
    al = RolloutGDRO(experimental=True)
    zeros = lambda i, c: torch.zeros(int(c.sum()), dtype=F64)  # noqa: E731
    res = run(al.plan(L(), 10), zeros)
    assert res.counts.numel() == 0 and res.rewards.numel() == 0
    al.update(res)
    assert al.mu == 0.0  # no prompts: no dual step
    res = run(al.plan(L(5, 6), 0), zeros)
    assert res.counts.tolist() == [0, 0] and {res.reason_of(5), res.reason_of(6)} == {"no_budget"}
    # the step's n_bar is clipped to n_min = 2: proposals (16) exceed it, the price rises (c = (0.5 / 2)^2 / 2)
    al.update(res)
    assert al.mu == pytest.approx(0.2 * 0.25**2 / 2 * (16 - 2))


def test_rollout_gdro_partial_level_is_split_within_a_bin() -> None:
    # four prompts of one bin, arms 4, budget 10: 2 each, then 2 of the 4 k=3 units.
    al = RolloutGDRO(n_min=2, n_max=4, classifier=binary_classifier(), experimental=True)
    res = run(al.plan(L(1, 2, 3, 4), 10), lambda i, c: torch.zeros(int(c.sum()), dtype=F64))
    assert sorted(res.counts.tolist()) == [2, 2, 3, 3]


def test_rollout_gdro_dual_step_on_update() -> None:
    zeros = lambda i, c: torch.zeros(int(c.sum()), dtype=F64)  # noqa: E731
    al = rollout_fixture(step="additive", eta_mu=0.01, experimental=True)
    al.update(run(al.plan(L(100, 200), 6), zeros))
    # proposed mean 4 (both arms n_max at mu = 0), n_bar = 6 / 2 = 3 -> mu = 0.01 * (4 - 3).
    assert al.mu == pytest.approx(0.01)
    al = rollout_fixture(experimental=True)  # relative: c = mu* / n_bar, mu* = ((0.3 + 0.5) / 2 / 3)^2
    res = run(al.plan(L(100, 200), 6), zeros)
    assert float(res.metrics["price_scale"]) == pytest.approx((0.4 / 3) ** 2 / 3)
    al.update(res)
    assert al.mu == pytest.approx(0.2 * (0.4 / 3) ** 2 / 3 * (4 - 3))


# ------------------------------------------------------------------------------------------------ properties

SETTINGS = settings(max_examples=20, deadline=None)


def make(kind: str, seed: int) -> Any:
    if kind == "prompt":
        return PromptGDRO(n=3, n_min=2, n_max=5, seed=seed, experimental=True)
    return RolloutGDRO(n_min=2, n_max=6, seed=seed, eta_mu=0.01, experimental=True)


def drive(al: Any, pool: torch.Tensor, budgets: list[int], p_of: dict[int, float], seed: int) -> list[AllocationResult]:
    out = []
    fn = bernoulli(p_of, seed)
    for b in budgets:
        res = run(al.plan(pool, b), fn)
        al.update(res)
        out.append(res)
    return out


pools = st.lists(st.integers(0, 10**12), min_size=1, max_size=25, unique=True)


@given(
    kind=st.sampled_from(["prompt", "rollout"]),
    ids=pools,
    budgets=st.lists(st.integers(0, 120), min_size=1, max_size=4),
    seed=st.integers(0, 99),
)
@SETTINGS
def test_budget_and_caps_hold(kind: str, ids: list[int], budgets: list[int], seed: int) -> None:
    pool = torch.tensor(ids)
    p_of = {i: (i % 7) / 6 for i in ids}
    al = make(kind, seed)
    for b, res in zip(budgets, drive(al, pool, budgets, p_of, seed), strict=True):
        c = res.counts
        assert int(c.sum()) <= b and res.rewards.numel() == int(c.sum())
        got = c[c > 0]
        assert bool((got >= 2).all()) and bool((got <= (5 if kind == "prompt" else 6)).all())
        assert bool((res.weight == 1).all())
        if kind == "prompt":
            assert got.unique().numel() <= 1  # one group size per step
            if len(ids) * 3 > b >= 3:
                assert int(c.sum()) == 3 * (b // 3)
        elif b >= 2 * len(ids):
            assert bool((c >= 2).all())  # everybody affordable gets at least n_min


@given(ids=pools, budget=st.integers(0, 200))
@SETTINGS
def test_rollout_gdro_spends_the_budget_at_zero_price(ids: list[int], budget: int) -> None:
    al = RolloutGDRO(n_min=2, n_max=6, experimental=True)  # fresh: mu = 0, every bin proposes n_max
    res = run(al.plan(torch.tensor(ids), budget), lambda i, c: torch.zeros(int(c.sum()), dtype=F64))
    assert int(res.counts.sum()) == (min(budget, 6 * len(ids)) if budget >= 2 else 0)


@given(kind=st.sampled_from(["prompt", "rollout"]), ids=pools, seed=st.integers(0, 99), data=st.data())
@SETTINGS
def test_determinism_and_permutation(kind: str, ids: list[int], seed: int, data: st.DataObject) -> None:
    pool = torch.tensor(ids)
    p_of = {i: (i % 5) / 4 for i in ids}
    perm = torch.tensor(data.draw(st.permutations(range(len(ids)))), dtype=torch.long)
    a, b, c = make(kind, seed), make(kind, seed), make(kind, seed)
    budgets = [len(ids) * 3, len(ids) * 2 + 1, len(ids) * 4]
    ra = drive(a, pool, budgets, p_of, seed)
    rb = drive(b, pool, budgets, p_of, seed)
    for x, y in zip(ra, rb, strict=True):
        assert torch.equal(x.counts, y.counts) and torch.equal(x.rewards, y.rewards)
    # the same history on a permuted pool: the plan is permuted and nothing else
    for b_, x in zip(budgets, ra, strict=True):
        plan = c.plan(pool[perm], b_)
        req = plan.next()
        counts = torch.zeros(len(ids), dtype=torch.long)
        if req is not None:
            counts[plan.positions(req.prompt_ids)] = req.counts
        assert torch.equal(counts, x.counts[perm])
        # feed c the same observations as a got, in c's request order, so the histories stay equal
        if req is not None:
            pos_a = {int(p): x.rewards[x.prompt_ids == p] for p in req.prompt_ids}
            plan.observe(req, torch.cat([pos_a[int(p)] for p in req.prompt_ids]))
            assert plan.next() is None
        res = plan.finish()
        assert torch.equal(res.reasons, x.reasons[perm])
        c.update(res)


@pytest.mark.parametrize("kind", ["prompt", "rollout"])
def test_state_dict_round_trip_mid_run(kind: str) -> None:
    ids = torch.arange(40) * 7 + 3
    p_of = {int(i): float(int(i) % 11) / 10 for i in ids}
    a = make(kind, 5)
    drive(a, ids, [90, 100, 80], p_of, 1)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = make(kind, 123)  # another seed: everything must come from the state
    b.load_state_dict(torch.load(buf, weights_only=True))
    ra = drive(a, ids, [90, 110, 70, 100], p_of, 2)
    rb = drive(b, ids, [90, 110, 70, 100], p_of, 2)
    for x, y in zip(ra, rb, strict=True):
        assert torch.equal(x.counts, y.counts) and torch.equal(x.reasons, y.reasons)
        assert torch.equal(x.rewards, y.rewards)
    sa, sb = a.state_dict(), b.state_dict()
    assert _same_state(sa, sb)
    assert torch.equal(a.table.prompt_ids, b.table.prompt_ids) and torch.equal(a._cols["ema"], b._cols["ema"])


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("cls", [PromptGDRO, RolloutGDRO, DifficultyClassifier])
def test_experimental_flag_is_required(cls: Any) -> None:
    with pytest.raises(InputError, match="experimental"):
        cls()


@pytest.mark.parametrize(
    ("cls", "kw", "arg"),
    [
        (PromptGDRO, {"n": 0}, "n"),
        (PromptGDRO, {"n": 4, "n_min": 5}, "n_min"),
        (PromptGDRO, {"n": 4, "n_max": 3}, "n_max"),
        (PromptGDRO, {"beta": 1.0}, "beta"),
        (PromptGDRO, {"gamma": 1.5}, "gamma"),
        (PromptGDRO, {"eta": -1.0}, "eta"),
        (PromptGDRO, {"hardness": "loss"}, "hardness"),
        (PromptGDRO, {"seed": -1}, "seed"),
        (PromptGDRO, {"classifier": "bins"}, "classifier"),
        (RolloutGDRO, {"n_min": 5, "n_max": 4}, "n_max"),
        (RolloutGDRO, {"n_min": 0}, "n_min"),
        (RolloutGDRO, {"n_bar": 40.0}, "n_bar"),
        (RolloutGDRO, {"eta_mu": -1e-3}, "eta_mu"),
        (RolloutGDRO, {"step": "newton"}, "step"),
        (RolloutGDRO, {"mu_init": -1.0}, "mu_init"),
        (RolloutGDRO, {"weights": "robust"}, "weights"),
        (RolloutGDRO, {"variance": "std"}, "variance"),
        (RolloutGDRO, {"unseen_variance": 2.0}, "unseen_variance"),
        (DifficultyClassifier, {"edges": (0.6, 0.3)}, "edges"),
        (DifficultyClassifier, {"edges": (0.0, 0.5)}, "edges"),
        (DifficultyClassifier, {"k": 0}, "k"),
        (DifficultyClassifier, {"smoothing": 1.0}, "smoothing"),
        (DifficultyClassifier, {"margin": -0.1}, "margin"),
        (DifficultyClassifier, {"patience": 0}, "patience"),
        (DifficultyClassifier, {"unseen": "first"}, "unseen"),
        (DifficultyClassifier, {"success_threshold": math.nan}, "success_threshold"),
        (DifficultyClassifier, {"capacity": 0}, "capacity"),
    ],
)
def test_bad_hyper_parameters(cls: Any, kw: dict[str, Any], arg: str) -> None:
    with pytest.raises(InputError, match=rf"^{arg}:"):
        cls(**kw, experimental=True)


@pytest.mark.parametrize("kind", ["prompt", "rollout"])
def test_bad_protocol_input(kind: str) -> None:
    al = make(kind, 0)
    with pytest.raises(InputError, match=r"^budget:"):
        al.plan(L(1, 2), -1)
    with pytest.raises(InputError, match=r"^prompt_ids:"):
        al.plan(torch.tensor([1.0, 2.0]), 8)
    with pytest.raises(InputError, match=r"^prompt_ids:"):
        al.plan(L(1, 1), 8)
    plan = al.plan(L(1, 2, 3), 12)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match=r"^rewards:"):
        plan.observe(req, torch.zeros(req.total + 1))
    with pytest.raises(InputError, match=r"^rewards:"):
        plan.observe(req, torch.full((req.total,), math.nan))
    with pytest.raises(InputError, match=r"^rewards:"):
        plan.observe(req, torch.zeros(req.total, dtype=torch.long))
    assert req.signals == ("hardness",)  # optional: observed per request row when the trainer measures it
    with pytest.raises(InputError, match=r"^hardness:"):
        plan.observe(req, torch.zeros(req.total), hardness=torch.zeros(req.total + 5))
    with pytest.raises(InputError, match=r"^entropy:"):  # a signal the request did not ask for
        plan.observe(req, torch.zeros(req.total), entropy=torch.zeros(req.total))
    with pytest.raises(InputError, match=r"^prompt_ids:"):
        plan.positions(L(99))  # an id outside the plan
    with pytest.raises(InputError, match=r"^result:"):
        al.update("not a result")
    with pytest.raises(InputError, match=r"^state:"):
        al.load_state_dict({"mu": 0.0})


def test_bad_update_inputs() -> None:
    al = RolloutGDRO(experimental=True)
    foreign = run(Uniform().plan(L(1, 2), 4), lambda i, c: torch.zeros(int(c.sum())))
    with pytest.raises(InputError, match=r"^result:"):
        al.update(foreign)  # a result without the controller's metrics
    pg = PromptGDRO(n=2, experimental=True)
    plan = pg.plan(L(1, 2), 4)
    req = plan.next()
    assert req is not None and req.prompt_ids.tolist() == [1, 2] and req.signals == ("hardness",)
    with pytest.raises(InputError, match=r"^hardness:"):
        plan.observe(req, torch.zeros(4), hardness=torch.zeros(3))  # one per request row
    with pytest.raises(InputError, match=r"^hardness:"):
        plan.observe(req, torch.zeros(4), hardness=torch.tensor([0.0, math.nan]))
    plan.observe(req, torch.zeros(4), hardness=torch.tensor([0.2, 0.4]))  # the right shape works
    res = plan.finish()
    torch.testing.assert_close(res.signals["hardness"], torch.tensor([0.2, 0.4]))
    pg.update(res)  # one step of 0.3 (the mean hardness, replacing the fail rate 1.0) for the bin
    assert pg._scores.s[-1].item() == pytest.approx(0.1 * 0.3)


@pytest.mark.parametrize("cls", [PromptGDRO, RolloutGDRO])
def test_hardness_signal_with_unrequested_prompts(cls: Any) -> None:
    # 3 candidates, budget 4 at 2 rollouts each: one prompt gets nothing, its hardness is NaN in the result
    al = cls(n=2, experimental=True) if cls is PromptGDRO else cls(n_min=2, n_max=2, experimental=True)
    of = {5: 0.2, 6: 0.4, 7: 0.6}
    res = run(al.plan(L(5, 6, 7), 4), lambda i, c: torch.zeros(int(c.sum()), dtype=F64), hardness=of)
    h, asked = res.signals["hardness"], res.counts > 0
    assert int(asked.sum()) == 2 and bool(torch.isnan(h[~asked]).all())
    assert h[asked].tolist() == pytest.approx([of[int(i)] for i in res.plan_prompt_ids[asked]])
    al.update(res)  # learns from the requested prompts' hardness only


def test_bad_function_inputs() -> None:
    with pytest.raises(InputError, match=r"^c:"):
        pass_at_k(L(4), L(5), 2)
    with pytest.raises(InputError, match=r"^n:"):
        pass_at_k(L(0), L(0), 2)
    with pytest.raises(InputError, match=r"^n:"):
        pass_at_k(D(4.0), L(1), 2)
    with pytest.raises(InputError, match=r"^k:"):
        pass_at_k(L(4), L(1), 0)
    with pytest.raises(InputError, match=r"^small_group:"):
        pass_at_k(L(4), L(1), 2, small_group="exact")  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^a:"):
        sqrt_allocation(D(-1.0, 1.0), D(0.5, 0.5), 8)
    with pytest.raises(InputError, match=r"^pi:"):
        sqrt_allocation(D(1.0, 1.0), D(0.0, 0.0), 8)
    with pytest.raises(InputError, match=r"^n_bar:"):
        sqrt_allocation(D(1.0, 1.0), D(0.5, 0.5), 0)
    with pytest.raises(InputError, match=r"^a:"):
        shadow_price_arms(D(math.inf), 0.1, n_min=1, n_max=4)
    with pytest.raises(InputError, match=r"^mu:"):
        shadow_price_arms(D(1.0), -0.1, n_min=1, n_max=4)
    with pytest.raises(InputError, match=r"^eta_mu:"):
        shadow_price_update(0.1, 4.0, 4.0, eta_mu=-1.0)
    with pytest.raises(InputError, match=r"^scale:"):
        shadow_price_update(0.1, 4.0, 4.0, eta_mu=1.0, scale=-1.0)
    clf = binary_classifier()
    with pytest.raises(InputError, match=r"^n:"):
        clf.update(L(1, 2), L(4), L(1, 1))
    with pytest.raises(InputError, match=r"^state\['table'\]\['rows'\]\['columns'\]\['difficulty/bin'\]:"):
        clf.update(L(1), L(2), L(1))
        sd = clf.state_dict()
        sd["table"]["rows"]["columns"]["difficulty/bin"] = L(7)
        clf.load_state_dict(sd)


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else bool(a == b)


def _replaced(state: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of ``state`` with ``value`` at ``path`` (the dicts along the path copied, ``state`` unchanged)."""
    if len(path) == 1:
        return {**state, path[0]: value}
    return {**state, path[0]: _replaced(state[path[0]], path[1:], value)}


@pytest.mark.parametrize("kind", ["classifier", "prompt", "rollout"])
def test_load_refuses_nan_and_negative_counters_naming_the_field(kind: str) -> None:
    """A NaN bin score, a negative update count, a pass@k EMA outside [0, 1], a negative streak, a bin out of
    range, unsorted prompt ids, bin EMAs over another number of bins than the classifier's: an InputError naming
    the (nested) field; the object keeps its own state."""
    reward = lambda i, c: (torch.arange(int(c.sum())) % 2).double()  # noqa: E731
    if kind == "classifier":
        obj: Any = binary_classifier()
        obj.update(L(1, 2), L(2, 2), L(0, 2))
    elif kind == "prompt":
        obj = PromptGDRO(n=2, classifier=binary_classifier(), experimental=True)
        obj.update(run(obj.plan(L(1, 2), 4), reward))
    else:
        obj = RolloutGDRO(n_min=2, n_max=4, classifier=binary_classifier(), experimental=True)
        obj.update(run(obj.plan(L(1, 2), 8), reward))
    good = obj.state_dict()
    at: tuple[str, ...] = (() if kind == "classifier" else ("classifier",)) + ("table", "rows")
    bad: list[tuple[tuple[str, ...], Any]] = [
        ((*at, "columns", "difficulty/ema"), D(0.5, math.nan)),
        ((*at, "columns", "difficulty/ema"), D(0.5, 1.5)),
        ((*at, "columns", "difficulty/streak"), L(0, -1)),
        ((*at, "columns", "difficulty/bin"), L(0, 3)),  # 3 bins: 0, 1 and the unseen 2
        ((*at, "prompt_ids"), L(2, 1)),
    ]
    if kind != "classifier":
        bad += [(("scores", "s"), D(0.1, math.nan, 0.0)), (("scores", "t"), L(1, -1, 0))]
        bad += [(("scores",), {"s": D(0.1, 0.2), "t": L(1, 1)})]  # two bins, the classifier has three
    if kind == "rollout":
        bad += [(("rate", "s"), D(0.1, 1.5, 0.0)), (("rate", "t"), L(0, 0, -2)), (("mu",), -0.5), (("mu",), math.nan)]
    for path, value in bad:
        state = _replaced(good, path, value)
        if path == ("scores",) and "rate" in state:
            state["rate"] = dict(value)
        with pytest.raises(InputError) as err:
            obj.load_state_dict(state)
        named = (*path, "s") if path == ("scores",) else path
        assert err.value.argument == "state" + "".join(f"[{k!r}]" for k in named), (path, value)
        assert _same_state(obj.state_dict(), good)


# ------------------------------------------------------------------------------------------------ the prompt table


def test_gdro_capacity_forgets_the_least_recently_visited() -> None:
    al = PromptGDRO(n=2, capacity=2, experimental=True)
    ones = lambda i, c: torch.ones(int(c.sum()), dtype=F64)  # noqa: E731
    al.update(run(al.plan(L(1, 2), 4), ones))
    al.update(run(al.plan(L(3), 2), ones))
    # 1 and 2 were visited together: the tie evicts the smaller id, 1, which is back in the unseen bin
    assert al.table is al.classifier.table and al.table.prompt_ids.tolist() == [2, 3]
    assert al.classifier.bins(L(1, 2, 3)).tolist() == [al.classifier.unseen_bin, 4, 4]
    assert math.isnan(float(al.classifier.ema(L(1))[0])) and len(al.classifier) == 2


def test_gdro_shared_table_equals_private_tables() -> None:
    """Two Prompt-GDROs ("promptgdro", "promptgdro#2"), a Rollout-GDRO and the allocator of a classifier built on
    its own ("difficulty") on one table, on overlapping pools, plan and learn as with private tables, and after a
    checkpoint (table_helpers.check_shared_table)."""
    makes: list[Any] = [
        lambda t: PromptGDRO(n=3, n_min=2, n_max=5, seed=1, table=t, experimental=True),
        lambda t: RolloutGDRO(n_min=2, n_max=6, seed=2, eta_mu=0.01, table=t, experimental=True),
        lambda t: PromptGDRO(n=2, seed=3, table=t, experimental=True),
        lambda t: RolloutGDRO(classifier=binary_classifier(table=t), experimental=True),
    ]
    pools = [torch.arange(40) * 7 + 3, torch.arange(30) * 5, torch.arange(0, 90, 3), torch.arange(25) * 11]
    p_of = {i: (i % 11) / 10 for i in range(300)}
    shared = check_shared_table(
        makes, in_turn(drive=lambda al, pool, s: drive(al, pool, [int(pool.numel()) * 3], p_of, s)[0], at=pools)
    )
    assert shared.table.owners == ("promptgdro", "rolloutgdro", "promptgdro#2", "difficulty")


def test_gdro_table_of_a_given_classifier_is_refused() -> None:
    with pytest.raises(InputError, match=r"^table:"):
        PromptGDRO(classifier=binary_classifier(), table=PromptTable(), experimental=True)
    with pytest.raises(InputError, match=r"^capacity:"):
        RolloutGDRO(classifier=binary_classifier(), capacity=10, experimental=True)
    with pytest.raises(InputError, match=r"^capacity:"):
        binary_classifier(capacity=10, table=PromptTable())
