"""The control registries: every rule class and every post-hoc rule, by name, runs and declares its inputs.

Rule classes (``rolloutopt.control.get``): constructed with their defaults (plus the documented required
arguments below, and ``experimental=True`` where the entry says the rule is reconstructed), a streaming rule
runs ``init`` → one ``step`` → ``finalize`` and a length/horizon controller one ``observe``, given only the
inputs the entry ``requires``; without each of them the call raises an ``InputError`` naming it; with the
``accepts`` inputs too it still runs. Post-hoc rules (``rolloutopt.control.posthoc.get``): the same, for one
call on a finished batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import rolloutopt.control as control
from rolloutopt.control import StopResult, StopRule
from rolloutopt.control._base import STANDARD_INPUTS
from rolloutopt.errors import InputError

N, K, J, D, T = 4, 3, 2, 3, 8
#: the constructor arguments without a default (documented as required in each class)
REQUIRED_ARGS: dict[str, dict[str, Any]] = {
    "abstention": {"r_abs": 0.0},
    "arrol": {"dim": D},
    "deer": {"markers": (1,)},
    "duet_abort": {"markers": (1,)},
    "step_grpo_truncation": {"markers": (1,)},
    "prune_opd_window": {"l0": 4, "l_max": 16},
}
#: the hyper-parameters a post-hoc rule needs beyond its inputs
POSTHOC_ARGS: dict[str, dict[str, Any]] = {
    "dler_truncation_penalty": {"max_len": 6},
    "dler_difficulty_penalty": {"max_len": 6},
}
#: the inputs of the per-training-step controllers' ``observe``
OBSERVE_INPUTS: dict[str, Any] = {
    "lengths": torch.tensor([3, 5, 8, 8]),
    "truncated": torch.tensor([False, False, True, True]),
    "tokens": torch.arange(N * T).reshape(N, T) % 5,
    "mask": torch.ones(N, T, dtype=torch.bool),
    "alignment": 0.7,
    "version": 3,
    "current_version": 4,
}
#: the batch inputs of the post-hoc rules (two groups of two, the second all correct)
POSTHOC_INPUTS: dict[str, Any] = {
    "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
    "accuracy": torch.tensor([1.0, 0.0, 1.0, 1.0]),
    "has_format": torch.tensor([True, True, False, True]),
    "lengths": torch.tensor([4, 8, 3, 6]),
    "steps": torch.tensor([2, 3, 1, 4]),
    "group": torch.tensor([0, 0, 1, 1]),
    "mask": torch.ones(N, T, dtype=torch.bool),
}

RULES = control.names()
STOP_RULES = [name for name in RULES if issubclass(control.get(name), StopRule)]  # not the per-step controllers
POSTHOC = control.posthoc.names()


def make(name: str) -> Any:
    entry = control.entry(name)
    kwargs = dict(REQUIRED_ARGS.get(name, {}))
    if entry.experimental is not None:
        kwargs["experimental"] = True
    return control.get(name)(**kwargs)


def tensor_input(rule: StopRule, name: str) -> torch.Tensor:
    """A valid value of a stop rule's input ``name`` (standard, rule-specific step input, or init input)."""
    g = torch.Generator().manual_seed(0)
    if name in ("group", "row_id"):
        return torch.tensor([0, 0, 1, 1]) if name == "group" else torch.arange(N)
    spec, kind = (
        (STANDARD_INPUTS[name], "float")
        if name in STANDARD_INPUTS
        else {
            **rule.extra_inputs,
            **rule.init_inputs,
        }[name]
    )
    if name == "tokens":
        kind = "int"
    shape = tuple({"N": N, "K": K, "J": J, "D": D}[d] for d in spec.split())
    if kind == "int":
        return torch.randint(0, 5, shape, generator=g)
    if kind == "bool":
        return torch.rand(shape, generator=g) < 0.5
    value = torch.rand(shape, generator=g)
    return -value if name in ("logp", "topk_logp") else value  # log-probs <= 0; the others lie in [0, 1)


def run_stream(rule: StopRule, names: set[str]) -> StopResult:
    init = {k: tensor_input(rule, k) for k in names if k in rule.init_inputs}
    step = {k: tensor_input(rule, k) for k in names if k not in rule.init_inputs}
    state = rule.init(N, **init)
    state, stop = rule.step(state, **step)
    assert stop.dtype == torch.bool and stop.shape == (N,)
    return rule.finalize(state)


def test_rule_names_are_the_snake_case_of_the_class_names() -> None:
    expected = {
        "ESPO": "espo",
        "ESPOCriticFree": "espo_critic_free",
        "Abstention": "abstention",
        "ARRoL": "arrol",
        "StepGRPOTruncation": "step_grpo_truncation",
        "DEER": "deer",
        "DUETAbort": "duet_abort",
        "ECHOPruning": "echo_pruning",
        "PruneOPD": "prune_opd",
        "ESR": "esr",
        "PruneOPDWindow": "prune_opd_window",
        "StableOPD": "stable_opd",
        "ADWINHorizon": "adwin_horizon",
    }
    assert {control.get(n).__name__: n for n in RULES} == expected
    rewrites = ("dot", "jet_reward", "dler_truncation_penalty", "dler_difficulty_penalty", "soft_compression_penalty")
    assert sorted([*rewrites, "step_aware_reward"]) == POSTHOC
    for name in POSTHOC:
        assert control.posthoc.get(name).__name__ == name


@pytest.mark.parametrize("name", RULES)
def test_every_rule_runs_by_name_and_requires_exactly_what_it_declares(name: str) -> None:
    entry = control.entry(name)
    assert entry.obj is control.get(name) and entry.reference.startswith("arXiv ")
    req, acc = set(entry.requires), set(entry.accepts)
    assert not req & acc
    rule = make(name)
    if isinstance(rule, StopRule):
        known = set(STANDARD_INPUTS) | set(rule.extra_inputs) | set(rule.init_inputs)
        assert req | acc <= known, f"{name} declares inputs it has no shape for"
        res = run_stream(rule, req)  # only the required inputs: one step works
        assert res.stopped.shape == (N,)
        for missing in req:
            with pytest.raises(InputError) as err:
                run_stream(make(name), req - {missing})
            assert err.value.argument == missing
        run_stream(make(name), req | acc)  # the accepted inputs are read when given
    else:
        rule.observe(**{k: OBSERVE_INPUTS[k] for k in req})
        for missing in req:
            kw = {k: OBSERVE_INPUTS[k] for k in req - {missing}}
            with pytest.raises(InputError) as err:
                make(name).observe(**kw, **{missing: None})
            assert err.value.argument == missing
        make(name).observe(**{k: OBSERVE_INPUTS[k] for k in req | acc})


@pytest.mark.parametrize("name", STOP_RULES)
def test_every_stop_rules_result_gives_rewards_and_loss_weights(name: str) -> None:
    rule = make(name)
    entry = control.entry(name)
    res = run_stream(rule, set(entry.requires) | set(entry.accepts))
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0])
    out = res.rewards(rewards)
    assert out.shape == (N,) and out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    if res.terminal_reward is None:
        assert torch.equal(out, rewards)
    mask = torch.ones(N, T, dtype=torch.bool)
    mask[0, 5:] = False
    w = res.loss_weights(mask)
    assert w.shape == (N, T) and w.dtype == torch.float32 and bool(torch.isfinite(w).all())
    assert bool((w[~mask] == 0).all()) and bool((w >= 0).all())
    if res.row_weight is None and res.token_weight is None:
        assert torch.equal(w, control.truncate_mask(mask, res).float())
    # the same through replay, on one recorded step
    init = {k: tensor_input(rule, k) for k in set(entry.requires) | set(entry.accepts) if k in rule.init_inputs}
    step = {k: tensor_input(rule, k)[:, None] for k in set(entry.requires) if k not in rule.init_inputs}
    again = control.replay(make(name), mask=torch.ones(N, 1, dtype=torch.bool), init=init, **step)
    assert again.rewards(rewards).shape == (N,) and again.loss_weights(mask).shape == (N, T)


@pytest.mark.parametrize(("signal", "standard"), [("exp_neg_entropy", "entropy"), ("topk_mean_prob", "topk_logp")])
def test_echo_pruning_requires_the_input_its_signal_reads(signal: str, standard: str) -> None:
    rule = control.get("echo_pruning")(signal=signal, experimental=True)
    assert rule.requires == (standard, "group") and control.get("echo_pruning").requires == ("logp", "group")
    run_stream(rule, {standard, "group"})
    with pytest.raises(InputError) as err:
        run_stream(rule, {"group", "logp"})
    assert err.value.argument == standard


def test_abstention_accepts_a_custom_estimators_inputs() -> None:
    rule = control.get("abstention")(
        r_abs=0.0,
        estimator=lambda x, due: x.need("hidden", "test").mean(-1),
        estimator_inputs={"hidden": ("N D", "float")},
        experimental=True,
    )
    assert rule.accepts == ("values", "hidden")
    assert control.get("abstention").accepts == ("values", "continuation_rewards")


@pytest.mark.parametrize("name", POSTHOC)
def test_every_posthoc_rule_runs_by_name_and_requires_exactly_what_it_declares(name: str) -> None:
    entry = control.posthoc.entry(name)
    fn = control.posthoc.get(name)
    assert entry.obj is fn and entry.reference
    kwargs = dict(POSTHOC_ARGS.get(name, {}))
    if entry.experimental is not None:
        kwargs["experimental"] = True
    req, acc = set(entry.requires), set(entry.accepts)
    out = fn(**{k: POSTHOC_INPUTS[k] for k in req}, **kwargs)
    assert out.rewards.shape == (N,) and out.rewards.dtype == torch.float32
    for missing in req:
        with pytest.raises(InputError) as err:
            fn(**{k: POSTHOC_INPUTS[k] for k in req - {missing}}, **{missing: None}, **kwargs)
        assert err.value.argument == missing
    fn(**{k: POSTHOC_INPUTS[k] for k in req | acc}, **kwargs)


def test_unknown_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(InputError, match="espo") as err:
        control.get("StopRule")
    assert err.value.argument == "name"
    with pytest.raises(InputError, match="dot"):
        control.posthoc.get("siri_max_length")  # a schedule, not a registered post-hoc rule
    with pytest.raises(InputError, match="already bound"):
        control.register("espo", control.ESR)
