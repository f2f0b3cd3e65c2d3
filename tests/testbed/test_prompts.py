"""The synthetic prompt population and run(): sampling, the learning rule by hand, determinism, bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators import AllocationResult, Uniform
from rolloutopt.allocators.dynamic import DAPODynamicSampling
from rolloutopt.errors import InputError
from rolloutopt.testbed import PromptPopulation, run


def result(pid: list[int], rewards: list[float], weight: list[float] | None = None) -> AllocationResult:
    """A hand-made AllocationResult (plan positions = sorted distinct ids)."""
    plan_ids = torch.tensor(sorted(set(pid)), dtype=torch.long)
    p = torch.tensor(pid, dtype=torch.long)
    group = torch.searchsorted(plan_ids, p)
    w = torch.ones(len(pid), dtype=torch.float64) if weight is None else torch.tensor(weight, dtype=torch.float64)
    return AllocationResult(
        prompt_ids=p,
        group=group,
        rewards=torch.tensor(rewards, dtype=torch.float64),
        weight=w,
        plan_prompt_ids=plan_ids,
        counts=torch.bincount(group, minlength=plan_ids.numel()),
        reasons=torch.zeros(plan_ids.numel(), dtype=torch.long),
        reason_names=("allocated",),
    )


def test_population_is_seeded_and_documented() -> None:
    a, b, c = PromptPopulation(seed=1), PromptPopulation(seed=1), PromptPopulation(seed=2)
    assert torch.equal(a.pass_rates, b.pass_rates) and not torch.equal(a.pass_rates, c.pass_rates)
    torch.testing.assert_close(a.pass_rates, torch.sigmoid(-a.difficulty))
    assert a.num_prompts == 1000 and a.prompt_ids.tolist() == list(range(1000))
    # difficulty ~ N(1, 2^2): sample mean and std near the parameters (1000 draws: se of the mean 0.063)
    assert abs(float(a.difficulty.mean()) - 1.0) < 0.25 and abs(float(a.difficulty.std()) - 2.0) < 0.25
    fixed = PromptPopulation(pass_rates=torch.tensor([0.0, 0.25, 1.0]))
    assert fixed.pass_rates.tolist() == [0.0, 0.25, 1.0] and fixed.num_prompts == 3


def test_sample_order_frequencies_and_reproducibility() -> None:
    pop = PromptPopulation(pass_rates=torch.tensor([0.0, 1.0, 0.3]))
    r = pop.sample(torch.tensor([1, 0, 1]), torch.tensor([2, 3, 1]), torch.Generator().manual_seed(0))
    assert r.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0] and r.dtype == torch.float32
    g = torch.Generator().manual_seed(5)
    big = pop.sample(torch.tensor([2]), torch.tensor([20000]), g)
    # Bernoulli(0.3): sd of the mean sqrt(0.21 / 20000) = 0.0032; allow 5 sd
    assert abs(float(big.mean()) - 0.3) < 0.017
    again = pop.sample(torch.tensor([2]), torch.tensor([20000]), torch.Generator().manual_seed(5))
    assert torch.equal(big, again)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    pop.sample(torch.tensor([2]), torch.tensor([10]), torch.Generator().manual_seed(1))
    assert torch.equal(torch.rand(1), before)  # the global RNG is untouched
    assert pop.sample(torch.tensor([0]), torch.tensor([0]), g).numel() == 0


def test_learn_rule_by_hand() -> None:
    pop = PromptPopulation(pass_rates=torch.tensor([0.5, 0.5, 0.2, 0.5]), learning_rate=0.1)
    res = result(
        [0, 0, 1, 1, 2, 2, 3, 3, 3],
        [1, 0, 1, 1, 0, 1, 0, 1, 1],
        [1, 1, 1, 1, 1, 0, 0.5, 0.5, 0.0],
    )
    k = pop.learn(res)
    # prompt 0: varied, 2 weighted rollouts -> k = 2; prompt 1: all equal -> 0;
    # prompt 2: one weighted rollout (reward 0) -> no variance among weighted rollouts -> 0;
    # prompt 3: weighted rollouts have rewards 0 and 1 (weights 0.5, 0.5) -> k = 1
    assert k.tolist() == [2.0, 0.0, 0.0, 1.0]
    expected = torch.sigmoid(torch.tensor([0.0 + 0.1 * 2, 0.0, math.log(0.2 / 0.8), 0.1 * 1], dtype=torch.float64))
    torch.testing.assert_close(pop.pass_rates, expected)


def test_learn_is_first_order_k_p_one_minus_p() -> None:
    p0 = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    pop = PromptPopulation(pass_rates=p0, learning_rate=1e-5)
    res = result([0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 0, 1, 1, 1, 0, 1])  # k = 3, 2, 4
    pop.learn(res)
    dp = pop.pass_rates - p0
    torch.testing.assert_close(
        dp, 1e-5 * torch.tensor([3.0, 2.0, 4.0], dtype=torch.float64) * p0 * (1 - p0), rtol=1e-4, atol=0
    )


def test_transfer_spreads_the_total_signal() -> None:
    pop = PromptPopulation(pass_rates=torch.tensor([0.5, 0.5, 0.5, 0.5]), learning_rate=0.1, transfer=2.0)
    pop.learn(result([0, 0], [0, 1]))  # k = [2, 0, 0, 0]; shared step 2 * 0.1 * 2 / 4 = 0.1
    torch.testing.assert_close(pop.pass_rates, torch.sigmoid(torch.tensor([0.3, 0.1, 0.1, 0.1], dtype=torch.float64)))


@settings(max_examples=30, deadline=None)
@given(
    p=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
    rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=20),
    lr=st.floats(0.0, 50.0),
)
def test_learning_never_lowers_a_pass_rate_and_stays_in_unit_interval(
    p: list[float], rewards: list[float], lr: float
) -> None:
    pop = PromptPopulation(pass_rates=torch.tensor(p, dtype=torch.float64), learning_rate=lr, transfer=0.5)
    before = pop.pass_rates
    pid = [i % len(p) for i in range(len(rewards))]
    pop.learn(result(pid, rewards))
    after = pop.pass_rates
    assert bool((after >= before).all()) and bool(((after >= 0) & (after <= 1)).all())
    assert bool(torch.isfinite(after).all())


def test_run_reports_rollouts_to_target_and_zero_variance() -> None:
    pop = PromptPopulation(num_prompts=50, learning_rate=0.05, seed=3)
    out = run(Uniform(n=4), pop, budget_per_step=200, steps=500, target=0.5)
    assert out["reached"] and out["rollouts_to_target"] == 200 * out["steps_to_target"]
    assert out["pass_rate"][-1] >= 0.5 > out["pass_rate"][-2]
    assert out["rollouts"] == [200 * (i + 1) for i in range(out["steps"])]
    assert all(b >= a for a, b in zip(out["pass_rate"], out["pass_rate"][1:], strict=False))
    assert 0 < out["zero_variance_frac"] < 1 and out["kept_frac"] == 1.0
    # deterministic: a fresh population and allocator with the same seeds reproduce the run
    again = run(Uniform(n=4), PromptPopulation(num_prompts=50, learning_rate=0.05, seed=3), 200, 500, 0.5)
    assert again == out


def test_run_on_a_population_that_cannot_learn() -> None:
    pop = PromptPopulation(pass_rates=torch.tensor([0.0, 1.0, 0.0, 1.0]))
    out = run(Uniform(n=2), pop, budget_per_step=8, steps=5, target=0.9)
    # every group is all-0 or all-1: all rollouts are in zero-variance groups, nothing is learnt
    assert not out["reached"] and out["rollouts_to_target"] is None and out["steps_to_target"] is None
    assert out["zero_variance_frac"] == 1.0 and out["total_rollouts"] == 40 and out["final_pass_rate"] == 0.5


def test_run_with_dapo_drops_zero_variance_groups() -> None:
    pop = PromptPopulation(num_prompts=200, seed=0)
    dapo = DAPODynamicSampling(batch_size=8, n=4, gen_batch_size=16, on_shortfall="keep")
    out = run(dapo, pop, budget_per_step=16 * 4 * 3, steps=3, target=0.99, pool_size=100, seed=1)
    assert out["steps"] == 3 and out["kept_frac"] <= 8 * 4 * 3 / out["total_rollouts"] + 1e-12
    assert 0 < out["kept_frac"] < 1


def test_population_state_dict_round_trip() -> None:
    a = PromptPopulation(num_prompts=5, pass_rates=None, seed=0)
    a.learn(result([0, 0, 1, 1], [0, 1, 1, 0]))
    b = PromptPopulation(num_prompts=5, seed=0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.pass_rates, b.pass_rates)
    with pytest.raises(InputError, match="state"):
        PromptPopulation(num_prompts=4).load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_prompts": 0}, "num_prompts"),
        ({"difficulty_std": -1.0}, "difficulty_std"),
        ({"difficulty_mean": float("inf")}, "difficulty_mean"),
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"transfer": -1.0}, "transfer"),
        ({"seed": -1}, "seed"),
        ({"pass_rates": torch.tensor([0.5, 1.5])}, "pass_rates"),
        ({"pass_rates": torch.tensor([1, 0])}, "pass_rates"),
    ],
)
def test_bad_population_config(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(InputError, match=name):
        PromptPopulation(**kwargs)


def test_bad_sample_learn_and_run_input() -> None:
    pop = PromptPopulation(num_prompts=3)
    g = torch.Generator()
    with pytest.raises(InputError, match="prompt_ids"):
        pop.sample(torch.tensor([5]), torch.tensor([1]), g)
    with pytest.raises(InputError, match="counts"):
        pop.sample(torch.tensor([0, 1]), torch.tensor([1]), g)
    with pytest.raises(InputError, match="counts"):
        pop.sample(torch.tensor([0]), torch.tensor([-1]), g)
    with pytest.raises(InputError, match="generator"):
        pop.sample(torch.tensor([0]), torch.tensor([1]), 0)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="result"):
        pop.learn("x")  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"result\.prompt_ids"):
        pop.learn(result([7], [1.0]))
    with pytest.raises(InputError, match="budget_per_step"):
        run(Uniform(), pop, -1, 1, 0.5)
    with pytest.raises(InputError, match="steps"):
        run(Uniform(), pop, 4, -1, 0.5)
    with pytest.raises(InputError, match="target"):
        run(Uniform(), pop, 4, 1, float("nan"))
    with pytest.raises(InputError, match="pool_size"):
        run(Uniform(), pop, 4, 1, 0.5, pool_size=4)
    with pytest.raises(InputError, match="population"):
        run(Uniform(), "pop", 4, 1, 0.5)  # type: ignore[arg-type]
