"""``rolloutopt.integrations.verl`` against real verl 0.9.1: registration, the loss and estimator adapters, config.

What is checked, and how deep into verl it goes (all on the CPU):

- registration: after ``import verl``, every ``rolloutopt_<preset>`` / ``rolloutopt_<estimator>`` resolves through
  ``get_policy_loss_fn`` / ``get_adv_estimator_fn``; in fresh interpreters, the ``verl.plugins`` entry point
  alone, ``VERL_USE_EXTERNAL_MODULES`` alone, and the post-import hook (module imported before verl) each
  register the names, and nothing does when all three are off (the control); idempotency and module reload;
  failures are logged at ERROR on the ``"rolloutopt"`` logger.
- losses, called exactly as ``verl/workers/utils/losses.py::ppo_loss`` calls them (keyword-only, real
  ``ActorConfig``), with and without ``global_batch_info`` and ``rollout_is_weights``: value and gradient equal
  rolloutopt's preset with the verl-configured stages built by hand here; for grpo/dapo (``vanilla``), gspo,
  cispo, sapo, dppo_tv and dppo_kl they equal verl's built-in loss configured the same, metrics included.
- one level deeper: ``verl.workers.utils.losses.ppo_loss`` itself (unpadding of the model output, global batch
  info from the TensorDict, entropy and KL terms added by verl) with ``loss_mode=rolloutopt_*`` equals the same
  call with verl's built-in loss. verl's actor engines (FSDP/Megatron workers) need a process group and a
  model and are not run; ``ray_trainer.compute_advantage`` cannot be imported here (it needs ``torchdata``
  and ``peft``), so its ``else`` branch (the ``adv_kwargs`` it builds from a ``DataProto``) is reproduced.
- advantages: the adapters equal rolloutopt's estimators, and for grpo/rloo/reinforce_pp_baseline/dr_grpo
  verl's own estimators on identical inputs (uid strings as ``index``).
- ``RolloutOptPolicyLossConfig``: through ``ActorConfig(policy_loss=...)``, through hydra's ``instantiate``
  (verl's ``omega_conf_to_dataclass``) from the generated trainer yaml with the documented overrides, and
  through pickle (Ray ships configs to the workers).
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import rolloutopt.advantages as advantages
import rolloutopt.losses as losses
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses import Denominators
from rolloutopt.ratios import CISPO, DPPO, OPSM, SAPO, M2POClip, M2POMask, PPOClip

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")
omegaconf = pytest.importorskip("omegaconf")
verl_plugin = importlib.import_module("rolloutopt.integrations.verl")

pytestmark = [pytest.mark.verl, pytest.mark.filterwarnings("ignore:rolloutopt. a group of size 1")]

B, T = 12, 8
F64 = torch.float64
NO_DUAL = 1e9  # verl asserts clip_ratio_c > 1; with |log r| <= 20 a ratio never reaches 1e9
RUNNABLE = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "opsm", "cumulative", "pnpo", "m2po", "m2po_clip",
            "dppo_tv", "dppo_kl")  # fmt: skip
# preset -> the input verl cannot pass that it needs (checked in test_unavailable_inputs_raise)
UNAVAILABLE = {
    "tis": "behav_logp",
    "icepop": "behav_logp",
    "decoupled_ppo": "behav_logp",
    "copris": "behav_logp",
    "sat": "behav_logp",
    "tbpo": "behav_logp",
    "dppo_predictive": "topk_logp",
    "echo_clip": "confidence",
}


def config_class() -> Any:
    return verl_plugin.RolloutOptPolicyLossConfig


def actor_config(policy_loss: Any = None, **kwargs: Any) -> Any:
    """A real verl ActorConfig (``strategy``, a micro-batch size and ``rollout_n`` are required, not read by losses)."""
    if policy_loss is not None:
        kwargs["policy_loss"] = policy_loss
    return verl_config.ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **kwargs)


# ----------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Batch:
    logp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor  # [B, T], as verl passes them
    mask: torch.Tensor
    weights: torch.Tensor

    def rows(self, sl: slice) -> Batch:
        return Batch(*(getattr(self, f)[sl] for f in self.__dataclass_fields__))


def make_batch(seed: int) -> Batch:
    """Valid log-probs (DPPO's binary divergences need p <= 1) whose ratios reach every clip and the dual clip."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=F64)

    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[:3] = torch.tensor([0, 0, T])  # two all-masked rows, one full row
    lengths = lengths[torch.randperm(B, generator=gen)]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    p_old = 0.01 + 0.98 * rand(B, T)
    p_old = torch.where(rand(B, T) < 0.2, 0.002 + 0.02 * rand(B, T), p_old)  # small p_old: ratios > 3 possible
    lr = 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    big = rand(B, T) < 0.3
    lr = torch.where(big, torch.sign(rand(B, T) - 0.5) * (1.2 + rand(B, T)), lr)
    p = (p_old * lr.exp()).clamp(1e-4, 0.999)
    logp, old = p.log(), p_old.log()
    pad = ~mask  # unrelated finite values in the padding
    logp = torch.where(pad, -15.0 * rand(B, T), logp)
    old = torch.where(pad, -15.0 * rand(B, T), old)
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.where(rand(B, T) < 0.1, torch.zeros_like(adv), adv)
    return Batch(logp, old, adv, mask, 0.5 + rand(B, T))


def call(
    fn: Any, batch: Batch, config: Any, agg: str, weights: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Call a verl policy loss as ``ppo_loss`` does: keyword-only, gradient with respect to ``log_prob``."""
    lp = batch.logp.clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=batch.old,
        log_prob=lp,
        advantages=batch.adv,
        response_mask=batch.mask,
        loss_agg_mode=agg,
        config=config,
        rollout_is_weights=batch.weights if weights else None,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def ours(preset: str, batch: Batch, weights: bool, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
    lp = batch.logp.clone().requires_grad_(True)
    if weights:
        kwargs["is_weights"] = batch.weights
    p = losses.get(preset)
    kw = {**p.config, **kwargs}
    if kw.get("agg") != "seq-mean-token-sum-norm":
        kw.pop("max_len", None)  # L_max is read by seq-mean-token-sum-norm only (other modes refuse it)
    out = losses.policy_loss(lp, batch.old, batch.adv, batch.mask, **kw)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad, out.metrics


# verl settings unlike every preset default, so that reading them (rather than the preset's) is visible
LOW, HIGH, C, TAU_POS, TAU_NEG = 0.15, 0.25, 2.5, 1.3, 0.8
M2PO_TAU, OPSM_DELTA = 0.01, 1e-3


def expected_stages(preset: str, *, dual: bool = True) -> dict[str, Any]:
    """The stages rolloutopt_<preset> must use under the test ActorConfig, written out by hand (docs table)."""
    clip = PPOClip(LOW, HIGH, dual=C if dual else None)
    return {
        "grpo": {"trust": clip},
        "dapo": {"trust": clip},
        "dr_grpo": {"trust": clip},
        "cumulative": {"trust": clip},
        "pnpo": {"trust": clip},
        "gspo": {"trust": PPOClip(LOW, HIGH, dual=None)},  # verl's gspo: no dual clip
        "cispo": {"trust": CISPO(low=LOW, high=HIGH)},
        "sapo": {"trust": SAPO(tau_pos=TAU_POS, tau_neg=TAU_NEG)},
        "opsm": {"trust": clip, "correction": OPSM(delta=OPSM_DELTA)},
        "m2po": {"trust": M2POMask(tau=M2PO_TAU, pair="old_current")},
        "m2po_clip": {"trust": M2POClip(tau=M2PO_TAU)},
        "dppo_tv": {"trust": DPPO("tv", low=LOW, high=HIGH, c=C)},
        "dppo_kl": {"trust": DPPO("kl", low=LOW, high=HIGH, c=C)},
    }[preset]


def test_config(**extra: Any) -> Any:
    pl = config_class()(m2po_tau=M2PO_TAU, opsm_delta=OPSM_DELTA, experimental=True, **extra)
    return actor_config(pl, clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C, tau_pos=TAU_POS, tau_neg=TAU_NEG)


test_config.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


# ----------------------------------------------------------------------------------------------- registration


def test_every_name_resolves_after_import_verl() -> None:
    for name in losses.names():
        fn = core_algos.get_policy_loss_fn(f"rolloutopt_{name}")
        assert fn is verl_plugin.make_policy_loss_fn(name)
        assert fn.__name__ == f"rolloutopt_{name}"
    for name in advantages.names():
        assert core_algos.get_adv_estimator_fn(f"rolloutopt_{name}") is verl_plugin.make_advantage_fn(name)
    assert core_algos.get_policy_loss_fn("vanilla") is core_algos.compute_policy_loss_vanilla  # built-ins untouched


def test_register_is_idempotent() -> None:
    before_loss = dict(core_algos.POLICY_LOSS_REGISTRY)
    before_adv = dict(core_algos.ADV_ESTIMATOR_REGISTRY)
    first = verl_plugin.register()
    second = verl_plugin.register()
    assert first == second
    assert len(first) == len(losses.names()) + len(advantages.names())
    assert before_loss == core_algos.POLICY_LOSS_REGISTRY
    assert before_adv == core_algos.ADV_ESTIMATOR_REGISTRY


def test_registration_failures_are_logged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """verl hides plug-in errors at DEBUG; ours are logged at ERROR, with the exception, and the rest still register."""

    def broken(name: str) -> Any:
        raise RuntimeError(f"boom {name}")

    foreign = core_algos.ADV_ESTIMATOR_REGISTRY["grpo"]  # someone else's function under one of our names
    monkeypatch.setattr(core_algos, "register_policy_loss", broken)
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "rolloutopt_rloo", foreign)
    with caplog.at_level(logging.ERROR, logger="rolloutopt"):
        done = verl_plugin.register()
    errors = [r for r in caplog.records if r.name == "rolloutopt" and r.levelno == logging.ERROR]
    assert len(errors) == len(losses.names()) + 1
    assert any("rolloutopt_grpo" in r.getMessage() and "boom" in str(r.exc_info[1]) for r in errors if r.exc_info)
    assert any("rolloutopt_rloo" in r.getMessage() for r in errors)
    assert core_algos.ADV_ESTIMATOR_REGISTRY["rolloutopt_rloo"] is foreign  # left alone
    assert "rolloutopt_grpo" in done and "rolloutopt_rloo" not in done


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180, env=environ
    )


PROBE = """
    import verl.trainer.ppo.core_algos as c
    print(sorted(k for k in c.POLICY_LOSS_REGISTRY if k.startswith("rolloutopt_")) == {losses},
          sorted(k for k in c.ADV_ESTIMATOR_REGISTRY if k.startswith("rolloutopt_")) == {advs})
"""


def probe() -> str:
    return PROBE.format(
        losses=sorted(f"rolloutopt_{n}" for n in losses.names()),
        advs=sorted(f"rolloutopt_{n}" for n in advantages.names()),
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "True True"),  # the verl.plugins entry point alone (VERL_USE_EXTERNAL_PLUGINS=auto, verl's default)
        (
            {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "rolloutopt.integrations.verl"},
            "True True",
        ),
        # control: no mechanism, no names; then importing the module after verl registers at once
        ({"VERL_USE_EXTERNAL_PLUGINS": "none"}, "False False\nTrue True"),
    ],
    ids=["entry-point", "external-modules", "control-then-import"],
)
def test_registration_in_a_fresh_process(env: dict[str, str], expected: str) -> None:
    from importlib.metadata import entry_points

    assert [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "rolloutopt"] == [
        "rolloutopt.integrations.verl"
    ]
    code = probe()
    if "\n" in expected:
        code += "    import rolloutopt.integrations.verl\n" + probe()
    proc = run_python(code, **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-len(expected.splitlines()) :] == expected.splitlines()


def test_post_import_hook_and_reload_in_a_fresh_process() -> None:
    """Imported before verl (no entry point, no env var), the names appear when core_algos is imported; a reload
    of the module and a second register() re-bind our names without verl's duplicate-estimator error."""
    code = """
        import sys, importlib
        import rolloutopt.integrations.verl as plugin
        assert "verl" not in sys.modules
        import verl.trainer.ppo.core_algos as c
        assert c.get_policy_loss_fn("rolloutopt_grpo") is plugin.make_policy_loss_fn("grpo")
        assert c.get_adv_estimator_fn("rolloutopt_mc_grpo") is plugin.make_advantage_fn("mc_grpo")
        first = plugin.register()
        plugin = importlib.reload(plugin)
        assert plugin.register() == first
        assert c.get_adv_estimator_fn("rolloutopt_mc_grpo") is plugin.make_advantage_fn("mc_grpo")
        print("ok")
    """
    proc = run_python(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ok"


# ----------------------------------------------------------------------------------------------- loss adapters


@pytest.mark.parametrize("weights", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("global_info", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("preset", RUNNABLE)
def test_loss_equals_preset_with_verl_hyperparameters(preset: str, global_info: bool, weights: bool) -> None:
    batch = make_batch(0)
    cfg = test_config()
    agg = "seq-mean-token-sum-norm" if preset in ("dppo_tv", "dr_grpo") else "token-mean"
    den = Denominators()
    if global_info:
        cfg.global_batch_info.update(dp_size=2, batch_num_tokens=97, global_batch_size=29, loss_scale_factor=24)
        den = Denominators(tokens=97, sequences=29, world_size=2)
    fn = core_algos.get_policy_loss_fn(f"rolloutopt_{preset}")
    v_loss, v_grad, v_metrics = call(fn, batch, cfg, agg, weights)
    stages = expected_stages(preset)
    o_loss, o_grad, o_metrics = ours(
        preset, batch, weights, agg=agg, denominators=den, max_len=24 if global_info else T, **stages
    )
    assert_close(v_loss, o_loss, rtol=1e-12, atol=1e-14)
    assert_close(v_grad, o_grad, rtol=1e-12, atol=1e-14)
    assert o_grad.abs().sum() > 0 and (o_grad[~batch.mask] == 0).all()
    # metrics: floats under actor/<name>, verl's keys where they coincide, pg_loss left to verl
    assert all(isinstance(v, float) and k.startswith("actor/") for k, v in v_metrics.items())
    assert "actor/pg_loss" not in v_metrics
    assert v_metrics["actor/ppo_kl"] == pytest.approx(o_metrics["approx_kl"].item(), rel=1e-12)
    if "clipfrac" in o_metrics:
        assert v_metrics["actor/pg_clipfrac"] == pytest.approx(o_metrics["clipfrac"].item(), rel=1e-12)
    # the verl settings were read: the preset with its own defaults (M2PO: on the pair verl can feed) differs
    own = {"trust": M2POMask(pair="old_current")} if preset == "m2po" else {}
    p_loss, _, _ = ours(preset, batch, weights, agg=agg, denominators=den, max_len=24 if global_info else T, **own)
    assert not torch.allclose(p_loss, v_loss)


@pytest.mark.parametrize("preset", ["grpo", "dapo", "dr_grpo"])
def test_dual_clip_off_gives_the_published_preset(preset: str) -> None:
    """policy_loss.dual_clip=False and verl's clip set to the preset's: exactly rolloutopt's preset, unchanged."""
    trust = losses.get(preset).config["trust"]
    cfg = actor_config(config_class()(dual_clip=False), clip_ratio_low=trust.low, clip_ratio_high=trust.high)
    agg = losses.get(preset).config["agg"]
    batch = make_batch(1)
    v_loss, v_grad, _ = call(core_algos.get_policy_loss_fn(f"rolloutopt_{preset}"), batch, cfg, agg, False)
    lp = batch.logp.clone().requires_grad_(True)
    p = losses.get(preset)
    out = p(lp, batch.old, batch.adv, batch.mask, **({"max_len": T} if "max_len" in p.requires else {}))
    (o_grad,) = torch.autograd.grad(out.loss, lp)
    assert_close(v_loss, out.loss.detach(), rtol=1e-12, atol=1e-14)
    assert_close(v_grad, o_grad, rtol=1e-12, atol=1e-14)


def test_config_none_keeps_the_preset_stages() -> None:
    batch = make_batch(2)
    fn = core_algos.get_policy_loss_fn("rolloutopt_dapo")
    v_loss, v_grad, _ = call(fn, batch, None, "seq-mean-token-mean", False)
    o_loss, o_grad, _ = ours("dapo", batch, False, agg="seq-mean-token-mean")
    assert_close(v_loss, o_loss, rtol=1e-12, atol=1e-14)
    assert_close(v_grad, o_grad, rtol=1e-12, atol=1e-14)


# rolloutopt preset -> (verl built-in, verl metrics shared with ours)
BUILTIN = {
    "grpo": ("vanilla", ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")),
    "dapo": ("vanilla", ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")),
    "gspo": ("gspo", ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")),
    "cispo": ("cispo", ("actor/pg_clipfrac", "actor/ppo_kl")),
    "sapo": ("sapo", ("actor/ppo_kl",)),
    "dppo_tv": ("dppo_tv", ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")),
    "dppo_kl": ("dppo_kl", ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")),
}


@pytest.mark.parametrize("weights", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("global_info", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("preset", list(BUILTIN))
def test_loss_equals_verl_builtin(preset: str, global_info: bool, weights: bool) -> None:
    """Same ActorConfig, same call: the rolloutopt loss equals verl's own (value, gradient, shared metrics)."""
    builtin, shared = BUILTIN[preset]
    batch = make_batch(3)
    low, high = (3e-4, 4e-4) if preset == "gspo" else (0.2, 0.28) if preset == "dapo" else (LOW, HIGH)
    if preset == "gspo" and global_info:
        low, high = 0.2, 0.28  # a token-sized clip: both the clipped and the unclipped sequence branches
    cfg = actor_config(clip_ratio_low=low, clip_ratio_high=high, tau_pos=TAU_POS, tau_neg=TAU_NEG)
    agg = "seq-mean-token-mean" if preset in ("sapo", "gspo", "grpo") else "token-mean"  # verl's sapo forces it
    if global_info:
        cfg.global_batch_info.update(dp_size=2, batch_num_tokens=97, global_batch_size=29, loss_scale_factor=None)
    v_loss, v_grad, v_metrics = call(core_algos.get_policy_loss_fn(builtin), batch, cfg, agg, weights)
    o_loss, o_grad, o_metrics = call(core_algos.get_policy_loss_fn(f"rolloutopt_{preset}"), batch, cfg, agg, weights)
    assert_close(o_loss, v_loss, rtol=1e-9, atol=1e-12)
    assert_close(o_grad, v_grad, rtol=1e-9, atol=1e-12)
    for key in shared:
        # verl computes some fractions in float32 (dppo), hence the tolerance
        assert o_metrics[key] == pytest.approx(v_metrics[key], rel=1e-6, abs=1e-9), key
    if builtin in ("vanilla", "cispo", "dppo_tv", "dppo_kl"):  # the inputs exercise the clip / mask
        assert 0 < v_metrics["actor/pg_clipfrac"] < 1
    if builtin == "vanilla":
        assert v_metrics["actor/pg_clipfrac_lower"] > 0  # verl's dual clip (clip_ratio_c = 3) fires, ours too


def test_vanilla_without_dual_clip_equals_dual_clip_false() -> None:
    batch = make_batch(4)
    cfg = actor_config(config_class()(dual_clip=False), clip_ratio_c=NO_DUAL)
    v = call(core_algos.get_policy_loss_fn("vanilla"), batch, cfg, "token-mean", True)
    o = call(core_algos.get_policy_loss_fn("rolloutopt_grpo"), batch, cfg, "token-mean", True)
    assert_close(o[0], v[0], rtol=1e-9, atol=1e-12)
    assert_close(o[1], v[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("preset", list(UNAVAILABLE))
def test_unavailable_inputs_raise(preset: str) -> None:
    """Registered all the same; on call a clear InputError names the missing input and what to use instead."""
    batch = make_batch(5)
    fn = core_algos.get_policy_loss_fn(f"rolloutopt_{preset}")
    with pytest.raises(InputError, match=UNAVAILABLE[preset]) as info:
        call(fn, batch, test_config(), "token-mean", False)
    assert "verl" in str(info.value)


def test_m2po_paper_pair_needs_rollout_logprobs() -> None:
    cfg = actor_config(config_class()(m2po_pair="behav_old"))
    with pytest.raises(InputError, match="behav_logp"):
        call(core_algos.get_policy_loss_fn("rolloutopt_m2po"), make_batch(5), cfg, "token-mean", False)


@pytest.mark.parametrize("preset", ["pnpo", "sat", "tbpo", "dppo_predictive"])
def test_experimental_presets_need_the_flag(preset: str) -> None:
    with pytest.raises(InputError, match="experimental"):
        call(core_algos.get_policy_loss_fn(f"rolloutopt_{preset}"), make_batch(5), actor_config(), "token-mean", False)


def test_bad_aggregation_and_missing_global_counts() -> None:
    batch = make_batch(6)
    fn = core_algos.get_policy_loss_fn("rolloutopt_grpo")
    with pytest.raises(InputError, match="loss_agg_mode"):
        call(fn, batch, actor_config(), "prompt-mean", False)
    cfg = actor_config()
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=None, global_batch_size=None)
    with pytest.raises(InputError, match="batch_num_tokens"):
        call(fn, batch, cfg, "token-mean", False)
    with pytest.raises(InputError, match="global_batch_size"):
        call(fn, batch, cfg, "seq-mean-token-mean", False)
    with pytest.raises(ValueError, match="batch_num_tokens"):  # verl's own loss refuses the same config
        call(core_algos.get_policy_loss_fn("vanilla"), batch, cfg, "token-mean", False)


@pytest.mark.parametrize("preset", ["grpo", "m2po"])
def test_data_parallel_shards_sum_to_the_batch(preset: str) -> None:
    """Two DP shards with global_batch_info: DDP's average of the shard losses is the one-process loss."""
    batch = make_batch(7)
    n_tok = int(batch.mask.sum())
    fn = core_algos.get_policy_loss_fn(f"rolloutopt_{preset}")
    shard_losses, shard_grads = [], []
    for sl in (slice(0, B // 2), slice(B // 2, B)):
        cfg = test_config()
        cfg.global_batch_info.update(dp_size=2, batch_num_tokens=n_tok, global_batch_size=B)
        loss, grad, _ = call(fn, batch.rows(sl), cfg, "token-mean", True)
        shard_losses.append(loss)
        shard_grads.append(grad)
    cfg = test_config()
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=n_tok, global_batch_size=B)
    full_loss, full_grad, _ = call(fn, batch, cfg, "token-mean", True)
    if preset == "grpo":  # token-local: the shards add up exactly
        assert_close(sum(shard_losses) / 2, full_loss, rtol=1e-12, atol=1e-14)
        assert_close(torch.cat(shard_grads) / 2, full_grad, rtol=1e-12, atol=1e-14)
    else:  # M2PO's mask is a batch statistic: each rank masks by its own shard's second moment
        assert torch.isfinite(torch.stack(shard_losses)).all()


# ----------------------------------------------------------------------------------------------- ppo_loss


def ppo_loss_inputs(batch: Batch, seed: int) -> tuple[Any, torch.Tensor]:
    """verl's actor-side TensorDict (padded prompts/responses + attention mask) and the unpadded log-prob stream."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    P = 3
    prompt_len = torch.randint(1, P + 1, (B,), generator=gen)
    resp_len = batch.mask.sum(-1)
    attn = torch.zeros(B, P + T, dtype=torch.long)
    attn[:, :P] = (torch.arange(P)[None, :] >= (P - prompt_len)[:, None]).long()  # left-padded prompts
    attn[:, P:] = batch.mask.long()
    flat = []  # the model's log-prob stream: position prompt_len - 1 + t holds response token t
    for i in range(B):
        row = torch.zeros(int(prompt_len[i] + resp_len[i]), dtype=F64)
        row[int(prompt_len[i]) - 1 : int(prompt_len[i] + resp_len[i]) - 1] = batch.logp[i, : int(resp_len[i])]
        flat.append(row)
    td = TensorDict(
        {
            "prompts": torch.ones(B, P, dtype=torch.long),
            "responses": torch.ones(B, T, dtype=torch.long),
            "attention_mask": attn,
            "response_mask": batch.mask.long(),
            "old_log_probs": batch.old,
            "advantages": batch.adv * batch.mask,
            "rollout_is_weights": batch.weights,
            "ref_log_prob": batch.old - 0.1,
        },
        batch_size=[B],
    )
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(batch.mask.sum()), global_batch_size=B)
    return td, torch.cat(flat)


@pytest.mark.parametrize(("preset", "builtin"), [("grpo", "vanilla"), ("cispo", "cispo"), ("dppo_kl", "dppo_kl")])
def test_through_verl_ppo_loss(preset: str, builtin: str) -> None:
    """verl's actor loss (``verl/workers/utils/losses.py::ppo_loss``): unpadding, global batch info from the batch,
    entropy and KL terms — with loss_mode=rolloutopt_<preset> it equals loss_mode=<builtin>."""
    from verl.workers.utils.losses import ppo_loss

    batch = make_batch(8)
    results = []
    for mode in (builtin, f"rolloutopt_{preset}"):
        td, stream = ppo_loss_inputs(batch, 8)
        stream.requires_grad_(True)
        entropy = (0.5 + stream.detach().abs()).requires_grad_(True)
        pl = config_class()(loss_mode=mode)
        cfg = actor_config(
            pl, clip_ratio_low=LOW, clip_ratio_high=HIGH, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05
        )
        loss, metrics = ppo_loss(cfg, {"log_probs": stream, "entropy": entropy}, td)
        grads = torch.autograd.grad(loss, (stream, entropy))
        results.append(
            (loss.detach(), grads, {k: m.aggregate() for k, m in metrics.items() if hasattr(m, "aggregate")})
        )
    (v_loss, v_grads, v_m), (o_loss, o_grads, o_m) = results
    assert_close(o_loss, v_loss, rtol=1e-9, atol=1e-12)
    for g_o, g_v in zip(o_grads, v_grads, strict=True):
        assert_close(g_o, g_v, rtol=1e-9, atol=1e-12)
    assert v_grads[0].abs().sum() > 0
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "kl_loss", "actor/entropy_loss"):
        assert o_m[key] == pytest.approx(v_m[key], rel=1e-6, abs=1e-9), key


# ----------------------------------------------------------------------------------------------- advantages


def adv_batch(seed: int, singletons: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 7, (8,), generator=gen)
    if singletons:
        sizes[:2] = 1
    gid = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    gid = gid[torch.randperm(len(gid), generator=gen)]
    b = len(gid)
    scores = torch.randn(b, generator=gen) * 2 + 0.5
    lengths = torch.randint(0, T + 1, (b,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    tlr = torch.zeros(b, T)
    tlr[torch.arange(b), (lengths - 1).clamp(min=0)] = scores  # the score at the last token; verl sums over T
    index = np.array([f"uid-{int(g) * 7919 % 1000:04d}-{int(g)}" for g in gid], dtype=object)
    return {"tlr": tlr, "mask": mask, "index": index, "scores": scores}


def weighted(out: Any, mask: torch.Tensor) -> torch.Tensor:
    """What the adapter must return: A_i w_i m_it (per-token advantages [B, T] times w_i likewise)."""
    w = out.weight if out.advantages.dim() == 1 else out.weight[:, None]
    return advantages.to_tokens(out.advantages * w, mask)


def algo(**rolloutopt: dict[str, Any]) -> Any:
    """verl's ``algorithm`` config as the trainer passes it: a DictConfig, extra keys under ``rolloutopt``."""
    return omegaconf.OmegaConf.create({"adv_estimator": "x", "norm_adv_by_std_in_grpo": True, "rolloutopt": rolloutopt})


def compute_advantage(name: str, b: dict[str, Any], config: Any, **extra: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``ray_trainer.compute_advantage``'s ``else`` branch: adv_kwargs from a DataProto, then the estimator."""
    from verl import DataProto

    data = DataProto.from_dict(
        tensors={"token_level_rewards": b["tlr"], "response_mask": b["mask"].long(), **extra},
        non_tensors={"uid": b["index"]},
    )
    kwargs: dict[str, Any] = {
        "token_level_rewards": data.batch["token_level_rewards"],
        "response_mask": data.batch["response_mask"],
        "config": config,
    }
    if "uid" in data.non_tensor_batch:
        kwargs["index"] = data.non_tensor_batch["uid"]
    if "reward_baselines" in data.batch:
        kwargs["reward_baselines"] = data.batch["reward_baselines"]
    return core_algos.get_adv_estimator_fn(name)(**kwargs)  # type: ignore[no-any-return]


# rolloutopt estimator -> (verl function, its kwargs, our hyper-parameters that reproduce it)
VERL_ADV = {
    "grpo": ("compute_grpo_outcome_advantage", {}, {"singleton": "raw"}),
    "dr_grpo": ("compute_grpo_outcome_advantage", {"norm_adv_by_std_in_grpo": False}, {"singleton": "raw"}),
    "rloo": ("compute_rloo_outcome_advantage", {}, {"singleton": "raw"}),
    "reinforce_pp_baseline": ("compute_reinforce_plus_plus_baseline_outcome_advantage", {}, {"singleton": "raw"}),
}


@pytest.mark.parametrize("singletons", [False, True], ids=["groups", "with-singletons"])
@pytest.mark.parametrize("name", list(VERL_ADV))
def test_advantage_equals_verl_builtin(name: str, singletons: bool) -> None:
    fn_name, verl_kw, hyper = VERL_ADV[name]
    b = adv_batch(10, singletons)
    v_adv, _ = getattr(core_algos, fn_name)(
        token_level_rewards=b["tlr"].clone(), response_mask=b["mask"].float(), index=b["index"], **verl_kw
    )
    o_adv, o_ret = compute_advantage(f"rolloutopt_{name}", b, algo(**{name: hyper}))
    assert o_adv.shape == (len(b["scores"]), T) and o_adv.dtype == torch.float32
    assert torch.equal(o_adv, o_ret)
    assert_close(o_adv, v_adv.float(), rtol=1e-5, atol=1e-5)
    if singletons:  # our default convention (0 at singletons) differs from verl's there
        d_adv, _ = compute_advantage(f"rolloutopt_{name}", b, algo())
        assert not torch.allclose(d_adv, v_adv.float(), atol=1e-5)


def test_grpo_reads_norm_adv_by_std() -> None:
    b = adv_batch(11, False)
    cfg = omegaconf.OmegaConf.create({"norm_adv_by_std_in_grpo": False})
    o, _ = compute_advantage("rolloutopt_grpo", b, cfg)
    v, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=b["tlr"], response_mask=b["mask"].float(), index=b["index"], norm_adv_by_std_in_grpo=False
    )
    assert_close(o, v, rtol=1e-5, atol=1e-5)


# estimator -> (hyper-parameters under algorithm.rolloutopt.<name>, a baseline config they visibly change)
OWN: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "grpo": ({"eps": 1e-3, "unbiased": False}, {}),
    "dr_grpo": ({}, None),
    "rloo": ({}, None),
    "reinforce_pp_baseline": ({"eps": 10.0}, {}),
    "mc_grpo": ({"eps": 1e-2, "singleton": "pivot"}, {"singleton": "pivot"}),
    "gapo": ({"tau": 0.3}, {}),
    "dler_normalise": ({"std_of": "rewards"}, {}),
    "latent_mask": ({"scale": "batch"}, {}),  # max_len: the response width (the paper's truncation rule)
}


@pytest.mark.parametrize("name", list(OWN))
def test_advantage_equals_rolloutopt_estimator(name: str) -> None:
    b = adv_batch(12, name == "mc_grpo")
    hyper, baseline = OWN[name]
    o_adv, o_ret = compute_advantage(f"rolloutopt_{name}", b, algo(**{name: hyper}))
    groups = Groups.from_labels(b["index"])
    rewards = b["tlr"].sum(-1)
    est = advantages.get(name)
    if name == "reinforce_pp_baseline":
        out = est(rewards, groups, b["mask"], **hyper)
    elif name == "latent_mask":
        out = est(rewards, groups, mask=b["mask"], max_len=T, **hyper)
        assert (out.weight == 0).any()  # some rollouts fill the width: truncated, excluded
    else:
        out = est(rewards, groups, **hyper)
    expected = weighted(out, b["mask"])
    assert_close(o_adv, expected, rtol=0, atol=0)
    assert torch.equal(o_adv, o_ret)
    if baseline is not None:  # the hyper-parameters reached the estimator
        default, _ = compute_advantage(f"rolloutopt_{name}", b, algo(**{name: baseline}))
        assert not torch.allclose(default, o_adv)


def test_required_keyword_comes_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """An estimator keyword without a default must be set under algorithm.rolloutopt.<name>."""

    def needs_k(rewards: torch.Tensor, group: Any, *, k: float) -> advantages.AdvantageOutput:
        return advantages.AdvantageOutput(rewards * k, torch.ones_like(rewards))

    advantages.register("tmp_needs_k", needs_k, reference="a test estimator")
    try:
        fn = verl_plugin.make_advantage_fn("tmp_needs_k")
    finally:
        del advantages.REGISTRY._items["tmp_needs_k"]
    monkeypatch.delitem(verl_plugin._ADV_FNS, "tmp_needs_k")
    b = adv_batch(16, False)
    kw = {"token_level_rewards": b["tlr"], "response_mask": b["mask"], "index": b["index"]}
    with pytest.raises(InputError, match=r"algorithm\.rolloutopt\.tmp_needs_k\.k"):
        fn(**kw, config=algo())
    adv, _ = fn(**kw, config=algo(tmp_needs_k={"k": 2.0}))
    assert_close(adv, advantages.to_tokens(2.0 * b["tlr"].sum(-1), b["mask"]))


def test_advantage_runs_without_grad_and_takes_logp_from_kwargs() -> None:
    """xrpo_sharpen needs log-probs: verl's OTB path passes old_log_probs, which the adapter uses as logp."""
    b = adv_batch(13, False)
    gen = torch.Generator().manual_seed(13)
    logp = -torch.rand(len(b["scores"]), T, generator=gen)
    with torch.enable_grad():
        tlr = b["tlr"].clone().requires_grad_(True)
        fn = core_algos.get_adv_estimator_fn("rolloutopt_xrpo_sharpen")
        adv, _ = fn(
            token_level_rewards=tlr, response_mask=b["mask"], index=b["index"], config=algo(), old_log_probs=logp
        )
    assert not adv.requires_grad
    out = advantages.xrpo_sharpen(b["tlr"].sum(-1), Groups.from_labels(b["index"]), logp, mask=b["mask"])
    assert_close(adv, weighted(out, b["mask"]), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("ace", "logp"),
        ("drpo", "logp"),
        ("v05", "prior"),
        ("gdpo", "per-component"),
        ("gd2po", "per-component"),
    ],
)
def test_estimators_verl_cannot_feed_raise(name: str, match: str) -> None:
    with pytest.raises(InputError, match=match):
        compute_advantage(f"rolloutopt_{name}", adv_batch(14, False), algo())


def test_advantage_config_errors() -> None:
    b = adv_batch(15, False)
    with pytest.raises(InputError, match=r"algorithm\.rolloutopt\.grpo\.epsilon"):
        compute_advantage("rolloutopt_grpo", b, algo(grpo={"epsilon": 1e-6}))
    with pytest.raises(InputError, match=r"algorithm\.rolloutopt\.grpo\.mask"):
        compute_advantage("rolloutopt_grpo", b, algo(grpo={"mask": 1}))
    with pytest.raises(InputError, match="index"):
        core_algos.get_adv_estimator_fn("rolloutopt_grpo")(
            token_level_rewards=b["tlr"], response_mask=b["mask"], config=algo()
        )
    # drpo: logp from verl's old_log_probs (the OTB path), max_len the response width unless configured
    logp = -torch.rand(len(b["scores"]), T)
    for hyper, max_len in (({"threshold": 0.5}, T), ({"threshold": 0.5, "max_len": 2 * T}, 2 * T)):
        adv, _ = core_algos.get_adv_estimator_fn("rolloutopt_drpo")(
            token_level_rewards=b["tlr"], response_mask=b["mask"], index=b["index"], config=algo(drpo=hyper),
            old_log_probs=logp,
        )  # fmt: skip
        groups = Groups.from_labels(b["index"])
        out = advantages.drpo(b["tlr"].sum(-1), groups, logp, b["mask"], max_len=max_len, threshold=0.5)
        assert_close(adv, weighted(out, b["mask"]), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- config class


def test_config_subclass_in_actor_config() -> None:
    cls = config_class()
    assert issubclass(cls, verl_config.PolicyLossConfig)
    pl = cls(loss_mode="rolloutopt_m2po", m2po_tau=0.02)
    cfg = actor_config(pl)
    assert cfg.policy_loss.m2po_tau == 0.02 and cfg.policy_loss.loss_mode == "rolloutopt_m2po"
    defaults = cls()
    assert (defaults.m2po_tau, defaults.opsm_delta, defaults.dual_clip, defaults.m2po_pair) == (
        losses.get("m2po").config["trust"].tau,
        losses.get("opsm").config["correction"].delta,
        True,
        "old_current",
    )
    restored = pickle.loads(pickle.dumps(cfg))  # Ray ships the config to the workers
    assert type(restored.policy_loss) is cls and restored.policy_loss.m2po_tau == 0.02
    for field, value in [("m2po_tau", 0.0), ("m2po_pair", "current"), ("opsm_delta", -1.0), ("dual_clip", "yes")]:
        with pytest.raises(InputError, match=field):
            cls(**{field: value})


def generated_trainer_config() -> Any:
    import verl

    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    return omegaconf.OmegaConf.load(path)


def test_hydra_instantiate_from_the_trainer_yaml() -> None:
    """The documented overrides on verl's generated trainer yaml, then verl's omega_conf_to_dataclass (hydra)."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = generated_trainer_config()
    overrides = {
        "actor_rollout_ref.actor.policy_loss._target_": "rolloutopt.integrations.verl.RolloutOptPolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode": "rolloutopt_m2po",
        "actor_rollout_ref.actor.policy_loss.m2po_tau": 0.02,  # the "+" override of the command line
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.rollout.n": 4,
    }
    for key, value in overrides.items():
        omegaconf.OmegaConf.update(cfg, key, value, force_add=True)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, verl_config.ActorConfig)
    assert type(actor.policy_loss) is config_class()
    assert actor.policy_loss.m2po_tau == 0.02
    kw = verl_plugin.policy_loss_kwargs("m2po", actor, actor.loss_agg_mode, torch.ones(2, 3, dtype=torch.bool))
    assert kw["trust"] == M2POMask(tau=0.02, pair="old_current")


def test_plain_policy_loss_config_rejects_the_extra_key() -> None:
    """Why the subclass exists (docs/integrations/verl.md): verl's own PolicyLossConfig refuses m2po_tau."""
    from hydra.errors import InstantiationException
    from verl.utils.config import omega_conf_to_dataclass

    cfg = generated_trainer_config()
    omegaconf.OmegaConf.update(cfg, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1)
    omegaconf.OmegaConf.update(cfg, "actor_rollout_ref.actor.policy_loss.m2po_tau", 0.02, force_add=True)
    with pytest.raises(InstantiationException):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


# ----------------------------------------------------------------------------------------------- properties


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    preset=st.sampled_from(RUNNABLE),
    agg=st.sampled_from(
        ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
    ),
    weights=st.booleans(),
)
def test_adapter_is_the_preset_for_any_batch(seed: int, preset: str, agg: str, weights: bool) -> None:
    """For any batch and verl aggregation mode: finite, and equal to the preset with the hand-built stages."""
    batch = make_batch(seed)
    fn = core_algos.get_policy_loss_fn(f"rolloutopt_{preset}")
    v_loss, v_grad, v_metrics = call(fn, batch, test_config(), agg, weights)
    o_loss, o_grad, _ = ours(preset, batch, weights, agg=agg, max_len=T, **expected_stages(preset))
    assert torch.isfinite(v_loss) and torch.isfinite(v_grad).all()
    assert all(np.isfinite(v) for v in v_metrics.values())
    assert_close(v_loss, o_loss, rtol=1e-12, atol=1e-14)
    assert_close(v_grad, o_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("preset", ["dapo", "grpo", "sapo", "cumulative"])
def test_gradcheck_through_the_adapter(preset: str) -> None:
    """float64 gradcheck of the registered loss with respect to log_prob, with IS weights and global counts.

    Only presets whose gradient is the derivative of their value: GSPO-token, CISPO and DPPO route the
    gradient through stop-gradients on purpose (their gradients are compared with verl's above)."""
    batch = make_batch(20).rows(slice(0, 5))
    cfg = test_config()
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=40, global_batch_size=10)
    fn = core_algos.get_policy_loss_fn(f"rolloutopt_{preset}")
    # move the log-ratios off the clip boundaries' kinks: finite differences need a smooth neighbourhood
    logp = batch.old + 0.05 * torch.randn(batch.old.shape, generator=torch.Generator().manual_seed(20), dtype=F64)

    def loss_of(lp: torch.Tensor) -> torch.Tensor:
        loss, _ = fn(
            old_log_prob=batch.old, log_prob=lp, advantages=batch.adv, response_mask=batch.mask,
            loss_agg_mode="seq-mean-token-mean", config=cfg, rollout_is_weights=batch.weights,
        )  # fmt: skip
        return loss  # type: ignore[no-any-return]

    assert torch.autograd.gradcheck(loss_of, (logp.clone().requires_grad_(True),), eps=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# verl's fused-kernel path (use_fused_kernels=True, impl_backend=torch) through rolloutopt.kernels.token_logprobs


def test_use_token_logprobs_routes_verls_fused_path() -> None:
    """verl's patched LlamaForCausalLM forward (``patch_forward_with_backends``, the function verl's FSDP engine
    applies for ``use_fused_kernels``) builds ``FusedLinearForPPO`` per call: after :func:`use_token_logprobs`
    that is rolloutopt's kernel, with the same log-probs, entropies and gradients as verl's own; undone by
    ``use_token_logprobs(False)``."""
    transformers = pytest.importorskip("transformers")
    tf = pytest.importorskip("verl.utils.experimental.torch_functional")
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    ids = torch.randint(0, 64, (3, 7))

    def run() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), temperature=0.7, return_dict=True)
        loss = (out.log_probs * torch.linspace(-1, 1, 7)).sum() + 0.3 * out.entropy.sum()
        grads = torch.autograd.grad(loss, [p for p in model.parameters()])
        return out.log_probs.detach(), out.entropy.detach(), list(grads)

    original = tf.FusedLinearForPPO
    want = run()
    try:
        verl_plugin.use_token_logprobs()
        assert tf.FusedLinearForPPO is not original and issubclass(tf.FusedLinearForPPO, original)
        got = run()
    finally:
        verl_plugin.use_token_logprobs(False)
    assert tf.FusedLinearForPPO is original
    assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[2], want[2], strict=True):
        assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_fused_env_applies_the_route_in_a_fresh_process() -> None:
    code = textwrap.dedent(
        """
        import verl  # the verl.plugins entry point registers rolloutopt, reading ROLLOUTOPT_VERL_FUSED
        from verl.utils.experimental import torch_functional as tf
        print("ROUTED", tf.FusedLinearForPPO.__name__)
        """
    )
    env = {**os.environ, "ROLLOUTOPT_VERL_FUSED": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ROUTED RolloutOptFusedLinearForPPO" in proc.stdout
