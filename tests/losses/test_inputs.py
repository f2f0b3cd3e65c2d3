"""Declared inputs of the policy objective: every input used or refused, derived ``requires``, GRPO defaults,
log-prob range, one compute dtype, and the errors a new user meets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rolloutopt as ro
from rolloutopt.errors import InputError
from rolloutopt.losses import OPTIONAL_INPUTS, declared_inputs, policy_loss
from rolloutopt.ratios import MIS, TIS, PPOClip

B, T, K = 6, 5, 4


def _base(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 2 - 0.05
    logp = (old + 0.1 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=-1e-3)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    return {
        "logp": logp.requires_grad_(),
        "old_logp": old,
        "advantages": torch.randn(B, generator=g, dtype=dtype),
        "mask": mask,
    }


def _input(name: str, dtype: torch.dtype = torch.float32) -> Any:
    """A valid value of the optional input ``name`` for a [B, T] batch."""
    g = torch.Generator().manual_seed(hash(name) % 1000)
    if name in ("behav_logp", "ref_logp"):
        return -torch.rand(B, T, generator=g, dtype=dtype) * 2 - 0.05
    if name == "entropy":
        return torch.rand(B, T, generator=g, dtype=dtype)
    if name == "versions":
        return torch.randint(3, 6, (B, T), generator=g)
    if name == "policy_version":
        return 6
    if name in ("topk_logp", "topk_behav_logp"):
        return torch.log_softmax(torch.randn(B, T, K, generator=g, dtype=dtype), -1)
    if name == "confidence":
        return torch.rand(B, generator=g, dtype=dtype)
    if name == "group":
        return torch.arange(B) // 2
    if name == "max_len":
        return T
    raise AssertionError(f"no builder for {name}")


def _call(name: str, inputs: dict[str, Any]) -> ro.losses.LossOutput:
    preset = ro.losses.get(name)
    extra = {"experimental": True} if preset.experimental else {}
    return preset(**_base(), **inputs, **extra)


PRESETS = ro.losses.names()


def test_every_input_name_is_in_the_glossary() -> None:
    for name in PRESETS:
        p = ro.losses.get(name)
        for n in (*p.requires, *p.accepts):
            assert n in OPTIONAL_INPUTS or n in ro.losses.ALWAYS_ACCEPTED or n == "sampled_in_topk", (name, n)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_runs_with_exactly_its_requires(name: str) -> None:
    p = ro.losses.get(name)
    out = _call(name, {n: _input(n) for n in p.requires})
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert ro.losses.entry(name).requires == p.requires
    assert ro.losses.entry(name).accepts == p.accepts


@pytest.mark.parametrize("name", PRESETS)
def test_preset_without_a_required_input_names_it(name: str) -> None:
    p = ro.losses.get(name)
    for missing in p.requires:
        inputs = {n: _input(n) for n in p.requires if n != missing}
        with pytest.raises(InputError) as err:
            _call(name, inputs)
        assert err.value.argument == missing


@pytest.mark.parametrize("name", PRESETS)
def test_preset_refuses_an_input_it_does_not_consume(name: str) -> None:
    p = ro.losses.get(name)
    unused = [n for n in OPTIONAL_INPUTS if n not in p.requires and n not in p.accepts]
    assert unused, name
    for extra in unused:
        inputs = {n: _input(n) for n in p.requires}
        inputs[extra] = _input(extra)
        with pytest.raises(InputError) as err:
            _call(name, inputs)
        assert err.value.argument == extra
        assert name in str(err.value)
        # allow_unused lets it pass, and the result is the result without it
        with_flag = _call(name, {**inputs, "allow_unused": True})
        without = _call(name, {n: _input(n) for n in p.requires})
        torch.testing.assert_close(with_flag.loss, without.loss)


def test_ignored_behaviour_logprobs_are_refused_not_silently_dropped() -> None:
    """The new user's case: grpo/dapo with behav_logp (and max_len to dapo) raise, naming the presets that use it."""
    b = _base()
    for name in ("grpo", "dapo"):
        with pytest.raises(InputError, match="tis") as err:
            ro.losses.get(name)(**b, behav_logp=b["old_logp"] - 5)
        assert err.value.argument == "behav_logp"
    with pytest.raises(InputError, match="dr_grpo") as err:
        ro.losses.get("dapo")(**b, max_len=T)
    assert err.value.argument == "max_len"


def test_requires_are_derived_from_the_stages() -> None:
    assert ro.losses.get("dr_grpo").requires == ("max_len",)
    assert ro.losses.get("dppo_tv").requires == ("max_len",)
    assert ro.losses.get("dppo_kl").requires == ("max_len",)
    assert ro.losses.get("grpo").requires == ()
    assert ro.losses.get("tis").requires == ("behav_logp",)
    assert declared_inputs(kl=ro.losses.KL())[0] == ("ref_logp",)
    assert declared_inputs(entropy_coef=0.01)[0] == ("entropy",)
    assert declared_inputs(agg="prompt-mean")[0] == ("group",)
    req, acc = declared_inputs(correction=(TIS(), MIS()))
    assert req == ("behav_logp",)
    assert "behav_logp" not in acc
    # an override at call time changes what the call consumes
    b = _base()
    out = ro.losses.get("grpo")(**b, correction=TIS(), behav_logp=_input("behav_logp"))
    assert "is_weight_mean" in out.metrics


def test_stage_inputs_must_be_declared_by_a_stage() -> None:
    with pytest.raises(InputError) as err:
        policy_loss(**_base(), stage_inputs={"foo": torch.zeros(B)})
    assert err.value.argument == "foo"


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(PRESETS), st.sets(st.sampled_from(OPTIONAL_INPUTS)))
def test_a_call_succeeds_iff_its_inputs_are_between_requires_and_accepts(name: str, passed: set[str]) -> None:
    p = ro.losses.get(name)
    ok = set(p.requires) <= passed <= set(p.requires) | set(p.accepts)
    inputs = {n: _input(n) for n in passed}
    if ok:
        assert torch.isfinite(_call(name, inputs).loss)
    else:
        with pytest.raises(InputError) as err:
            _call(name, inputs)
        bad = (set(p.requires) - passed) | (passed - set(p.requires) - set(p.accepts))
        assert err.value.argument in bad


def test_bare_policy_loss_is_grpo() -> None:
    b = _base()
    bare = policy_loss(**b)
    grpo = ro.losses.get("grpo")(**b)
    torch.testing.assert_close(bare.loss, grpo.loss, rtol=0, atol=0)
    assert PPOClip() == PPOClip(low=0.2, high=0.2, dual=None)


def test_ppo_clip_defaults_are_ppos() -> None:
    """PPO, arXiv 1707.06347: symmetric eps = 0.2, no dual clip. Hand-computed: A = -1, r = 5 gives the clipped
    branch max(-A r, -A clip(r)) = max(5, 1.2) = 5 (a dual clip of 3 would cap it at 3)."""
    r = torch.tensor([[5.0, 0.5]])
    a = torch.tensor([[-1.0, 1.0]])
    loss, ind = ro.ratios.ppo_clip_loss(r, a)
    torch.testing.assert_close(loss, torch.tensor([[5.0, -0.5]]))
    assert not bool(ind["dual_clip_frac"].any())
    capped, _ = ro.ratios.ppo_clip_loss(r, a, dual=3.0)
    torch.testing.assert_close(capped, torch.tensor([[3.0, -0.5]]))


@pytest.mark.parametrize("name", ["logp", "old_logp", "behav_logp", "ref_logp"])
def test_positive_log_probs_raise(name: str) -> None:
    b = _base()
    extra: dict[str, Any] = {}
    if name == "behav_logp":
        extra = {"correction": TIS(), "behav_logp": _input("behav_logp")}
    if name == "ref_logp":
        extra = {"kl": ro.losses.KL(), "ref_logp": _input("ref_logp")}
    target = b if name in b else extra
    probs = target[name].detach().exp()  # probabilities passed by mistake
    target[name] = probs.requires_grad_() if name == "logp" else probs
    with pytest.raises(InputError, match="log-probabilities") as err:
        policy_loss(**b, **extra)
    assert err.value.argument == name
    # a positive value at a masked-out position is padding, not an error; rounding up to 0.01 is tolerated
    b2 = _base()
    lp = b2["logp"].detach().clone()
    lp[0, 4] = 3.0
    lp[1, 1] = 0.005
    b2["logp"] = lp.requires_grad_()
    assert torch.isfinite(policy_loss(**b2).loss)


def test_outputs_are_fp32_unless_every_float_input_is_fp64() -> None:
    b = _base()
    b["advantages"] = b["advantages"].double()
    out = policy_loss(**b)
    assert out.loss.dtype == torch.float32
    assert out.per_token.dtype == torch.float32
    assert all(v.dtype in (torch.float32, torch.bool, torch.int64) for v in out.metrics.values())
    b64 = _base(dtype=torch.float64)
    assert policy_loss(**b64).loss.dtype == torch.float64
    bh = _base()
    bh["logp"] = bh["logp"].detach().bfloat16().requires_grad_()
    assert policy_loss(**bh).loss.dtype == torch.float32


def test_nan_sequence_advantages_are_reported_with_their_own_shape() -> None:
    b = _base()
    b["advantages"][2] = float("nan")
    with pytest.raises(InputError, match=r"shape \(6,\)") as err:
        policy_loss(**b)
    assert err.value.argument == "advantages"
    # an all-masked row may hold anything
    b = _base()
    b["mask"][2] = False
    b["advantages"][2] = float("nan")
    assert torch.isfinite(policy_loss(**b).loss)


def test_swapped_advantages_and_mask_name_the_order() -> None:
    b = _base()
    with pytest.raises(InputError, match="swapped") as err:
        policy_loss(b["logp"], b["old_logp"], b["mask"], b["advantages"])
    assert err.value.argument == "advantages"


def test_prompt_mean_without_group_names_group() -> None:
    with pytest.raises(InputError) as err:
        policy_loss(**_base(), agg="prompt-mean")
    assert err.value.argument == "group"
    out = policy_loss(**_base(), agg="prompt-mean", group=_input("group"))
    assert torch.isfinite(out.loss)


def test_unknown_preset_keyword_is_an_input_error() -> None:
    with pytest.raises(InputError) as err:
        ro.losses.get("grpo")(**_base(), behaviour_logp=_input("behav_logp"))
    assert err.value.argument == "behaviour_logp"


@pytest.mark.parametrize("name", PRESETS)
def test_empty_batch_gives_zero(name: str) -> None:
    p = ro.losses.get(name)
    empty = {
        "logp": torch.zeros(0, T, requires_grad=True),
        "old_logp": torch.zeros(0, T),
        "advantages": torch.zeros(0),
        "mask": torch.zeros(0, T, dtype=torch.bool),
    }
    inputs: dict[str, Any] = {}
    for n in p.requires:
        v = _input(n)
        inputs[n] = v[:0] if isinstance(v, torch.Tensor) else v
    extra = {"experimental": True} if p.experimental else {}
    out = p(**empty, **inputs, **extra)
    assert float(out.loss.detach()) == 0.0
    assert all(bool(torch.isfinite(v).all()) for v in out.metrics.values())


def test_compile_with_checks_on_says_to_turn_them_off() -> None:
    b = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in _base().items()}

    def f(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return policy_loss(logp, old, adv, mask).loss

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"rolloutopt\.checks\(False\)"):
        torch.compile(f, fullgraph=True)(b["logp"], b["old_logp"], b["advantages"], b["mask"])
    torch._dynamo.reset()
    with ro.checks(False):
        compiled = torch.compile(f, fullgraph=True)(b["logp"], b["old_logp"], b["advantages"], b["mask"])
    torch.testing.assert_close(compiled, f(b["logp"], b["old_logp"], b["advantages"], b["mask"]))
