"""The scenario engine (stale, partial and mismatched rollouts and the inputs a preset reads from them), FP8
weights of a rollout engine, and the inputs each preset consumes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.testbed.engine import ScenarioEngine
from rolloutopt.testbed.policy import TinyPolicy
from rolloutopt.testbed.task import ReverseTask
from rolloutopt.testbed.train import Scenario, preset_inputs

TASK = ReverseTask(3, 50)


def _policy() -> TinyPolicy:
    return TinyPolicy(8, arch="transformer", generator=torch.Generator().manual_seed(0))


def test_quantized_rounds_matrices_per_tensor_and_keeps_biases() -> None:
    policy = _policy()
    with torch.no_grad():
        policy.head.weight.copy_(torch.linspace(-1.0, 0.5, policy.head.weight.numel()).view_as(policy.head.weight))
    q = policy.quantized()
    w = policy.head.weight.detach()
    scale = 1.0 / 448.0  # max |w| = 1 over float8_e4m3fn's largest finite 448
    expected = (w / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(q.head.weight, expected)
    assert torch.equal(q.head.bias, policy.head.bias)  # 1-D parameters stay float32
    assert not torch.equal(q.embed.weight, policy.embed.weight)
    assert not any(p.requires_grad for p in q.parameters()) and policy.head.weight.requires_grad
    # by hand: max |w| = 1, so 0.4221 scales to 189.1; float8_e4m3fn's neighbours in [128, 256) are 16 apart
    # (3 mantissa bits), 189.1 rounds to 192, and 192 / 448 = 0.428571
    with torch.no_grad():
        policy.head.weight.zero_()
        policy.head.weight[0, 0] = 1.0
        policy.head.weight[0, 1] = 0.4221
    assert float(policy.quantized().head.weight[0, 1]) == pytest.approx(192 / 448, rel=1e-6)
    assert torch.equal(policy.quantized(torch.bfloat16).head.weight[0, 1], torch.tensor(0.4221).bfloat16().float())


def test_quantized_refuses_a_non_float_dtype() -> None:
    with pytest.raises(InputError) as err:
        _policy().quantized(torch.int8)
    assert err.value.argument == "dtype"


def test_preset_inputs() -> None:
    assert preset_inputs("grpo") == ()
    assert preset_inputs("tis") == ("behav_logp",)
    assert preset_inputs("copris") == ("behav_logp", "policy_version", "versions")
    assert preset_inputs("grpo", entropy_coef=0.01) == ("entropy",)
    with pytest.raises(InputError) as err:
        preset_inputs("nope")
    assert err.value.argument == "loss"


def _engine(staleness: int, partial: bool, inputs: tuple[str, ...], perturb: bool = False) -> ScenarioEngine:
    scen = Scenario(0.0, staleness, partial, inputs)
    return ScenarioEngine(scen, generator=torch.Generator().manual_seed(1),
                          perturb=(lambda p, g: p.quantized()) if perturb else None)  # fmt: skip


def test_a_stale_engine_holds_the_policy_of_k_steps_ago() -> None:
    policy = _policy()
    engine = _engine(2, False, ("versions",))
    prompts = TASK.prompts(TASK.split()[0][:4])
    first = {}
    for step in range(4):
        engine.advance(policy, step)
        first[step] = engine.engines[0]
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.1)  # a training step
        _, versions = engine.sample(prompts, TASK.max_response_len, torch.Generator().manual_seed(0))
        assert engine.oldest_version == max(0, step - 2)
        assert bool((versions == max(0, step - 2)).all())
    # at step 3 the engine is the snapshot of step 1, one training step newer than step 2's (step 0's)
    assert first[3] is not policy and torch.allclose(first[3].head.bias, first[2].head.bias + 0.1)


@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, 4), steps=st.integers(1, 6))
def test_partial_rollouts_switch_versions_forward_inside_a_response(k: int, steps: int) -> None:
    policy = _policy()
    engine = _engine(k, True, ("versions",))
    prompts = TASK.prompts(TASK.split()[0][:6])
    for step in range(steps):
        engine.advance(policy, step)
    _, versions = engine.sample(prompts, TASK.max_response_len, torch.Generator().manual_seed(0))
    assert bool((versions >= max(0, steps - 1 - k)).all()) and bool((versions <= steps - 1).all())
    assert bool((versions[:, 1:] >= versions[:, :-1]).all())  # a response only moves to newer snapshots


def test_decoupled_inputs_recompute_old_logp_and_coupled_ones_keep_the_engine() -> None:
    policy = _policy()
    prompts = TASK.prompts(TASK.split()[0][:4])
    group = torch.tensor([0, 0, 1, 1])
    for inputs, decoupled in ((("behav_logp",), True), ((), False)):
        engine = _engine(0, False, inputs, perturb=True)
        engine.advance(policy, 0)
        roll, versions = engine.sample(prompts, TASK.max_response_len, torch.Generator().manual_seed(0))
        old, kw = engine.loss_inputs(policy, prompts, roll, versions, group=group, max_len=TASK.max_response_len)
        recompute, _ = policy.log_probs(prompts, roll.tokens)
        recompute = torch.where(roll.mask, recompute, torch.zeros_like(recompute))
        if decoupled:
            assert torch.allclose(old, recompute.detach()) and torch.equal(kw["behav_logp"], roll.logp)
            assert not torch.allclose(kw["behav_logp"], old)  # the FP8 engine disagrees with the trainer
        else:
            assert torch.equal(old, roll.logp) and kw == {}


def test_sample_before_advance_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        _engine(0, False, ()).sample(TASK.prompts(TASK.split()[0][:2]), 3, torch.Generator())
