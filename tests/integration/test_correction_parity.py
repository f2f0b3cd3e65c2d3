"""Parity of the behaviour-policy corrections with verl 0.9.1's rollout correction and TRL 1.16's vLLM IS and OPSM.

verl (``verl/trainer/ppo/rollout_corr_helper.py``): ``compute_rollout_correction_weights`` (TIS and IcePop, token
and sequence level, batch normalisation) and ``compute_rollout_rejection_mask`` (every ``rollout_rs`` option and
chains of them) are called on identical float64 inputs and compared with :class:`TIS` / :class:`MIS` /
:class:`RejectionFilter` called on a :class:`StageContext`; then ``policy_loss(..., correction=...)`` is compared
with verl's ``vanilla`` loss fed verl's ``rollout_is_weights`` (and, for RS, verl's modified ``response_mask``),
in value and gradient.

TRL (``GRPOTrainer``): the vLLM IS ratio is computed inline in ``_generate_and_score_completions``; as in
``test_trl_advantages.py``, TRL's own lines are cut out with ``inspect`` (with a check that they still hold the
expressions relied on) and executed on a minimal ``self``. OPSM is TRL's static ``get_off_policy_mask``, called
directly, and the whole ``_compute_loss`` is run on a fake trainer (as ``test_trl_losses.py`` does) with
``off_policy_mask_threshold`` and ``importance_sampling_ratio`` set.

==================================================  ====================================================
verl / TRL                                          rolloutopt
==================================================  ====================================================
``rollout_is="token"``, threshold ``C``             ``TIS(cap=C)`` (= ``from_verl_rollout_is("token", C)``)
``rollout_is="sequence"``, threshold ``C``          ``TIS(cap=C, level="sequence")``
threshold ``"lo_hi"`` (IcePop)                      ``MIS(low=lo, high=hi, level=...)``
``rollout_is_batch_normalize=True``                 ``batch_normalize=True``
``rollout_rs="a,b"``, ``rollout_rs_threshold``      ``RejectionFilter.from_verl("a,b", ...)`` and
                                                    ``policy_loss(removed_in_denominator=False)``
TRL ``*_truncate`` (clip_min, clip_max)             ``TIS(cap=clip_max, lower=clip_min)``
TRL ``*_mask``                                      ``MIS(low=clip_min, high=clip_max, in_band="ratio")``
TRL ``off_policy_mask_threshold=δ``                 ``OPSM(delta=δ)`` (source "auto")
==================================================  ====================================================

Differences, pinned below: TRL exponentiates without the ±20 clamp (``clamp=`` keyword); verl's masked means
divide by ``n + 1e-8`` (ours by ``max(n, 1)``), a relative 1e-8 at most; verl's ``rollout_rs_seq_masked_fraction``
counts every row, ours non-empty rows. Both libraries build the sequence ratio as a product (sum of logs);
verl clamps the sum to ±20, TRL does not.
"""

from __future__ import annotations

import inspect
import math
import textwrap
import types
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from rolloutopt.losses import policy_loss
from rolloutopt.ratios import (
    MIS,
    OPSM,
    REINFORCE,
    TIS,
    PPOClip,
    RejectionFilter,
    StageContext,
    from_trl_vllm_is,
    from_verl_rollout_is,
    offpolicy_metrics,
    opsm_keep,
)

B, T = 24, 10
F64 = torch.float64


def verl_helper() -> Any:
    return pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")


def trl_grpo() -> Any:
    return pytest.importorskip("trl.trainer.grpo_trainer")


@dataclass(frozen=True)
class Batch:
    logp: torch.Tensor
    old: torch.Tensor
    behav: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor

    def ctx(self, **kw: Any) -> StageContext:
        lp = torch.where(self.mask, self.logp, torch.zeros_like(self.logp))
        return StageContext(logp=lp, old_logp=self.old, mask=self.mask, advantages=self.adv[:, None], **kw)


def make_batch(seed: int, b: int = B, t: int = T, spread: float = 0.3) -> Batch:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=F64)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[:3] = torch.tensor([0, 1, t])  # an empty row, a one-token row, a full row
    lengths = lengths[torch.randperm(b, generator=gen)]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -3.0 * rand(b, t) - 4.01  # below -4: behav = old - d and logp = old + noise stay log-probs
    d = spread * randn(b, t)
    big = rand(b, t) < 0.15  # rho in e^{±[0.8, 2.3]}: token caps and IcePop bands fire
    d = torch.where(big, torch.sign(randn(b, t)) * (0.8 + 1.5 * rand(b, t)), d)
    behav = old - d  # old - behav = d
    logp = old + 0.4 * randn(b, t)
    pad = ~mask  # padding holds unrelated finite values
    old = torch.where(pad, -15.0 * rand(b, t), old)
    behav = torch.where(pad, -15.0 * rand(b, t), behav)
    logp = torch.where(pad, -15.0 * rand(b, t), logp)
    adv = randn(b)
    adv[0] = 0.0
    return Batch(logp, old, behav, adv, mask)


def on_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x.expand_as(mask)[mask]


# ------------------------------------------------------------------------------------------ verl IS weights

IS_CASES = [("token", 2.0), ("sequence", 2.0), ("token", "0.5_5.0"), ("sequence", "0.5_2.0"), ("token", "1.5")]


@pytest.mark.verl
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("batch_normalize", [False, True])
@pytest.mark.parametrize(("level", "threshold"), IS_CASES)
def test_is_weights_match_verl(level: str, threshold: Any, batch_normalize: bool, seed: int) -> None:
    helper = verl_helper()
    batch = make_batch(seed)
    lr = batch.old - batch.behav
    w_verl, m_verl = helper.compute_rollout_correction_weights(
        log_ratio=lr,
        response_mask=batch.mask,
        rollout_is=level,
        rollout_is_threshold=threshold,
        rollout_is_batch_normalize=batch_normalize,
    )
    corr = from_verl_rollout_is(level, threshold, batch_normalize=batch_normalize)  # type: ignore[arg-type]
    out = corr(batch.ctx(behav_logp=batch.behav))
    assert_close(out.weight, w_verl, rtol=1e-7, atol=1e-12)  # verl's weights are 0 outside the mask, as ours
    icepop = isinstance(threshold, str) and "_" in threshold
    assert isinstance(corr, MIS if icepop else TIS)
    cap = float(threshold.split("_")[-1]) if isinstance(threshold, str) else threshold
    # the cap or the band binds on these inputs, and not everywhere
    raw = torch.exp(lr.clamp(-20, 20)) if level == "token" else torch.exp((lr * batch.mask).sum(-1, keepdim=True))
    hit = on_mask(raw > cap, batch.mask)
    assert 0 < hit.double().mean() < 1
    if icepop:
        assert out.keep is not None
        assert_close(out.metrics["mis_oob_frac"].item(), m_verl["rollout_is_oob_ratio"], rtol=1e-7, atol=0)
        assert torch.equal(on_mask(out.keep, batch.mask), on_mask(w_verl != 0, batch.mask))
    elif level == "token":
        assert_close(out.metrics["tis_high_frac"].item(), m_verl["rollout_is_ratio_fraction_high"], rtol=1e-7, atol=0)
    if batch_normalize:
        key = "mis_batch_norm_factor" if icepop else "tis_batch_norm_factor"
        assert_close(out.metrics[key].item(), m_verl["rollout_is_batch_norm_factor"], rtol=1e-7, atol=0)


@pytest.mark.verl
def test_sequence_weight_is_product_clamped_after_the_sum() -> None:
    """verl sums unclamped token log-ratios and clamps the sum; a token beyond ±20 counts fully."""
    helper = verl_helper()
    batch = make_batch(3)
    row = int(torch.nonzero(batch.mask.sum(-1) >= 3)[0])
    old = batch.old.clone()
    old[row, 0] = batch.behav[row, 0] + 25.0
    old[row, 1] = batch.behav[row, 1] - 24.0  # sum over the two: +1, each token beyond ±20
    old[row, 2] = batch.behav[row, 2]
    b2 = Batch(batch.logp, old, batch.behav, batch.adv, batch.mask)
    w_verl, _ = helper.compute_rollout_correction_weights(old - batch.behav, batch.mask, "sequence", 1e6)
    out = TIS(cap=1e6, level="sequence")(b2.ctx(behav_logp=batch.behav))
    assert_close(out.weight, w_verl, rtol=1e-7, atol=1e-12)


# ------------------------------------------------------------------------------------------ verl RS masks

RS_CASES = [
    ("token_k1", "1.5"),
    ("token_k1", "0.7_2.0"),
    ("token_k2", 0.1),
    ("token_k3", 0.1),
    ("seq_sum_k1", "0.5_2.0"),
    ("seq_sum_k2", 0.5),
    ("seq_sum_k3", 0.5),
    ("seq_mean_k1", "0.9_1.1"),
    ("seq_mean_k2", 0.05),
    ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.3),
    ("seq_max_k3", 0.3),
    ("token_k1,seq_mean_k3", "1.5,0.05"),
    ("seq_sum_k1,seq_max_k2,token_k3", "0.4_3.0,0.5,0.2"),
    ("seq_mean_k2,seq_max_k3", 0.2),  # one threshold broadcast to both options
]


@pytest.mark.verl
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("options", "threshold"), RS_CASES)
def test_rejection_mask_matches_verl(options: str, threshold: Any, seed: int) -> None:
    helper = verl_helper()
    batch = make_batch(seed)
    lr = batch.old - batch.behav
    m_verl, metrics = helper.compute_rollout_rejection_mask(
        log_ratio=lr, response_mask=batch.mask, rollout_rs=options, rollout_rs_threshold=threshold
    )
    filt = RejectionFilter.from_verl(options, threshold)
    out = filt(batch.ctx(behav_logp=batch.behav))
    assert out.keep is not None
    ours = out.keep & batch.mask
    assert torch.equal(ours, m_verl.bool())
    frac = on_mask(~out.keep, batch.mask).double().mean()
    assert 0 < frac < 1  # the filter binds on these inputs, and not everywhere
    assert torch.equal(out.weight, torch.ones_like(out.weight))
    for opt in filt.options:
        assert_close(
            out.metrics[f"rs_{opt}_masked_frac"].item(),
            metrics[f"rollout_rs_{opt}_masked_fraction"],
            rtol=1e-7,
            atol=0,
        )
        assert_close(out.metrics[f"rs_{opt}_mean"].item(), metrics[f"rollout_rs_{opt}_mean"], rtol=1e-6, atol=1e-12)
    assert_close(out.metrics["rs_masked_frac"].item(), metrics["rollout_rs_masked_fraction"], rtol=1e-7, atol=0)
    # verl's sequence fraction divides by every row (the empty one included), ours by the non-empty rows
    rows = int(batch.mask.any(-1).sum())
    assert_close(out.metrics["rs_seq_masked_frac"].item() * rows / B, metrics["rollout_rs_seq_masked_fraction"])


# ------------------------------------------------------------------------------------------ verl loss


def verl_vanilla(batch: Batch, mask: torch.Tensor, weights: torch.Tensor | None, agg: str) -> tuple[Any, Any]:
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    verl_config = pytest.importorskip("verl.workers.config")
    cfg = verl_config.ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    lp = batch.logp.clone().requires_grad_(True)
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=batch.old,
        log_prob=lp,
        advantages=batch.adv[:, None].expand_as(lp).contiguous(),
        response_mask=mask,
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=weights,
    )
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


def ours(batch: Batch, agg: str, **kw: Any) -> tuple[Any, Any]:
    lp = batch.logp.clone().requires_grad_(True)
    # verl's ActorConfig defaults: clip 0.2 / 0.2 and dual clip 3.0; behav_logp only where a correction reads it
    behav = {"behav_logp": batch.behav} if kw.get("correction") is not None else {}
    out = policy_loss(lp, batch.old, batch.adv, batch.mask, trust=PPOClip(0.2, 0.2, 3.0), agg=agg, **behav, **kw)
    (g,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), g


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@pytest.mark.verl
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    ("level", "threshold", "batch_normalize"),
    [("token", 2.0, False), ("sequence", 2.0, True), ("token", "0.5_5.0", False)],
)
def test_policy_loss_with_correction_matches_verl_vanilla(
    level: str, threshold: Any, batch_normalize: bool, agg: str
) -> None:
    """policy_loss(correction=...) = verl vanilla with verl's rollout_is_weights (value and gradient)."""
    helper = verl_helper()
    batch = make_batch(4)
    proto, _, _ = helper.compute_rollout_correction_and_rejection_mask(
        batch.old,
        batch.behav,
        batch.mask,
        rollout_is=level,
        rollout_is_threshold=threshold,
        rollout_is_batch_normalize=batch_normalize,
    )
    verl = verl_vanilla(batch, batch.mask, proto.batch["rollout_is_weights"], agg)
    mine = ours(batch, agg, correction=from_verl_rollout_is(level, threshold, batch_normalize=batch_normalize))  # type: ignore[arg-type]
    assert_close(mine[0], verl[0], rtol=1e-7, atol=1e-12)
    assert_close(mine[1], verl[1], rtol=1e-7, atol=1e-12)
    plain = ours(batch, agg)
    assert not torch.allclose(plain[0], verl[0])  # the correction matters on these inputs


@pytest.mark.verl
@pytest.mark.parametrize("agg", AGGS)
def test_decoupled_geo_rs_token_tis_matches_verl(agg: str) -> None:
    """RS folds into verl's response_mask (rejected tokens leave the denominators): removed_in_denominator=False."""
    helper = verl_helper()
    batch = make_batch(5)
    rs, rs_th = "seq_mean_k1,token_k2", "0.95_1.05,0.3"
    proto, new_mask, _ = helper.compute_rollout_correction_and_rejection_mask(
        batch.old,
        batch.behav,
        batch.mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs=rs,
        rollout_rs_threshold=rs_th,
    )
    verl = verl_vanilla(batch, new_mask.bool(), proto.batch["rollout_is_weights"], agg)
    chain = (RejectionFilter.from_verl(rs, rs_th), TIS(cap=2.0))
    mine = ours(batch, agg, correction=chain, removed_in_denominator=False)
    assert_close(mine[0], verl[0], rtol=1e-7, atol=1e-12)
    assert_close(mine[1], verl[1], rtol=1e-7, atol=1e-12)
    kept_in_denominator = ours(batch, agg, correction=chain)
    assert not torch.allclose(kept_in_denominator[0], verl[0])


# ------------------------------------------------------------------------------------------ TRL vLLM IS

IS_START = "if self.use_vllm and self.vllm_importance_sampling_correction:"
IS_END = "# Compute the per-token log probabilities for the reference model"
IS_EXPECTED = [
    "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
    "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
    "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
    'if self.vllm_importance_sampling_mode in ["sequence_truncate", "token_truncate"]:',
    'elif self.vllm_importance_sampling_mode in ["sequence_mask", "token_mask"]:',
    "invalid_mis_mask, value=0.0",
]


def trl_is_block() -> str:
    src = inspect.getsource(trl_grpo().GRPOTrainer._generate_and_score_completions)
    lines = src.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == IS_START)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == IS_END)
    return textwrap.dedent("\n".join(lines[start:end]))


@pytest.mark.trl
def test_trl_is_block_is_the_one_compared() -> None:
    block = trl_is_block()
    for expr in IS_EXPECTED:
        assert expr in block, f"TRL's vLLM IS block changed: {expr!r} is gone"


def trl_is_ratio(batch: Batch, mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    module = trl_grpo()
    self = types.SimpleNamespace(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    scope = dict(vars(module))
    scope.update(
        self=self,
        completion_mask=batch.mask.long(),
        tool_mask=None,
        old_per_token_logps=batch.old,
        sampling_per_token_logps=batch.behav,
    )
    exec(trl_is_block(), scope)
    ratio: torch.Tensor = scope["vllm_importance_sampling_ratio"]
    return ratio


TRL_CASES = [
    (mode, lo, hi)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    for lo, hi in ((None, 3.0), (0.5, 2.0), (0.5, None))
]


@pytest.mark.trl
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("mode", "clip_min", "clip_max"), TRL_CASES)
def test_vllm_is_modes_match_trl(mode: str, clip_min: float | None, clip_max: float | None, seed: int) -> None:
    batch = make_batch(seed)
    trl = trl_is_ratio(batch, mode, clip_min, clip_max)
    assert trl.shape == ((B, 1) if mode.startswith("sequence") else (B, T))
    corr = from_trl_vllm_is(mode, clip_min, clip_max)  # type: ignore[arg-type]
    out = corr(batch.ctx(behav_logp=batch.behav))
    assert_close(on_mask(out.weight, batch.mask), on_mask(trl, batch.mask), rtol=1e-12, atol=0)
    bound = on_mask((trl != torch.exp(on_trl_log(batch, mode))), batch.mask)
    assert bound.any()  # a bound binds on these inputs
    if mode.endswith("mask"):
        assert out.keep is not None
        assert torch.equal(on_mask(out.keep, batch.mask), on_mask(trl != 0, batch.mask))


def on_trl_log(batch: Batch, mode: str) -> torch.Tensor:
    d = (batch.old - batch.behav) * batch.mask
    return d.sum(-1, keepdim=True) if mode.startswith("sequence") else d


@pytest.mark.trl
def test_trl_has_no_clamp() -> None:
    """TRL exponentiates the raw token log-ratio; ours clamps at ±20 unless clamp= is raised."""
    batch = make_batch(6)
    row = int(torch.nonzero(batch.mask.sum(-1) > 0)[0])
    batch.old[row, 0] = batch.behav[row, 0] - 25.0  # rho = e^-25: TRL keeps it, ours gives e^-20
    trl = trl_is_ratio(batch, "token_truncate", None, 3.0)
    out = from_trl_vllm_is("token_truncate", None, 3.0)(batch.ctx(behav_logp=batch.behav))
    assert not torch.allclose(on_mask(out.weight, batch.mask), on_mask(trl, batch.mask), rtol=1e-12, atol=0)
    wide = from_trl_vllm_is("token_truncate", None, 3.0, clamp=50.0)(batch.ctx(behav_logp=batch.behav))
    assert_close(on_mask(wide.weight, batch.mask), on_mask(trl, batch.mask), rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------ TRL OPSM


@pytest.mark.trl
@pytest.mark.parametrize("delta", [1e-4, 0.02, 0.5])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_opsm_matches_trl_get_off_policy_mask(delta: float, per_token_adv: bool) -> None:
    trainer = trl_grpo().GRPOTrainer
    batch = make_batch(7)
    adv = batch.adv[:, None]
    if per_token_adv:
        adv = adv + 0.5 * torch.randn(B, T, generator=torch.Generator().manual_seed(0), dtype=F64)
    lp = batch.logp.clone().requires_grad_(True)
    trl = trainer.get_off_policy_mask(
        advantages=adv,
        per_token_logps=lp,
        sampling_per_token_logps=batch.behav,
        mask=batch.mask.long(),
        off_policy_threshold=delta,
    )
    ours_keep = opsm_keep(lp, batch.behav, adv if per_token_adv else batch.adv, batch.mask, delta=delta).keep
    assert torch.equal(on_mask(ours_keep, batch.mask), on_mask(trl.bool(), batch.mask))
    if delta < 0.5:
        assert 0 < on_mask(~ours_keep, batch.mask).double().mean() < 1


class FakeAccelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_for_metrics(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def run_trl_loss(
    batch: Batch, *, threshold: float | None, is_ratio: torch.Tensor | None, sampling: bool
) -> tuple[Any, Any]:
    """TRL 1.16 ``_compute_loss`` (loss_type "dapo", ε 0.2 / 0.28) on a fake trainer, as test_trl_losses does."""
    lp = batch.logp.clone().requires_grad_(True)
    args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
        args=args,
        aux_loss_enabled=False,
        router_aux_loss_coef=0.0,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=threshold,
        importance_sampling_level="token",
        beta=0.0,
        loss_type="dapo",
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=True,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        accelerator=FakeAccelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _entropy_bonus_enabled=False,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        get_off_policy_mask=trl_grpo().GRPOTrainer.get_off_policy_mask,  # TRL's own static method
    )
    mask = batch.mask.long()
    inputs: dict[str, Any] = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones_like(mask),
        "completion_mask": mask,
        "advantages": batch.adv,
        "old_per_token_logps": batch.old,
        "num_items_in_batch": torch.tensor(float(mask.sum())),
    }
    if sampling:
        inputs["sampling_per_token_logps"] = batch.behav
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = trl_grpo().GRPOTrainer._compute_loss(trainer, None, inputs)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


def ours_dapo(batch: Batch, **kw: Any) -> tuple[Any, Any]:
    lp = batch.logp.clone().requires_grad_(True)
    out = policy_loss(lp, batch.old, batch.adv, batch.mask, trust=PPOClip(0.2, 0.28, dual=None), agg="token-mean", **kw)
    (g,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), g


@pytest.mark.trl
@pytest.mark.parametrize("sampling", [True, False])
def test_opsm_in_trl_loss(sampling: bool) -> None:
    """dapo + off_policy_mask_threshold: masked tokens stay in TRL's denominator (our default)."""
    batch = make_batch(8)
    trl = run_trl_loss(batch, threshold=0.02, is_ratio=None, sampling=sampling)
    kw: dict[str, Any] = {"behav_logp": batch.behav} if sampling else {}
    mine = ours_dapo(batch, correction=OPSM(delta=0.02), **kw)
    assert_close(mine[0], trl[0], rtol=1e-7, atol=1e-12)
    assert_close(mine[1], trl[1], rtol=1e-7, atol=1e-12)
    assert not torch.allclose(ours_dapo(batch)[0], trl[0])


@pytest.mark.trl
@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max"),
    [
        ("token_truncate", None, 2.0),
        ("token_mask", 0.5, 2.0),
        ("sequence_mask", None, 3.0),
        ("sequence_truncate", 0.5, 3.0),
    ],
)
def test_vllm_is_and_opsm_in_trl_loss(mode: str, clip_min: float | None, clip_max: float | None) -> None:
    batch = make_batch(9)
    ratio = trl_is_ratio(batch, mode, clip_min, clip_max)
    trl = run_trl_loss(batch, threshold=0.02, is_ratio=ratio, sampling=True)
    corr = (from_trl_vllm_is(mode, clip_min, clip_max), OPSM(delta=0.02))  # type: ignore[arg-type]
    mine = ours_dapo(batch, behav_logp=batch.behav, correction=corr)
    assert_close(mine[0], trl[0], rtol=1e-7, atol=1e-12)
    assert_close(mine[1], trl[1], rtol=1e-7, atol=1e-12)


@pytest.mark.trl
@pytest.mark.verl
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    ("trl_mode", "verl_threshold", "clip_min", "clip_max"),
    [
        ("sequence_truncate", 2.0, None, 2.0),
        ("token_mask", "0.5_5.0", 0.5, 5.0),
        ("sequence_mask", "0.5_2.0", 0.5, 2.0),
    ],
)
def test_trl_and_verl_agree_within_the_clamp(
    trl_mode: str, verl_threshold: Any, clip_min: float | None, clip_max: float, seed: int
) -> None:
    """Both build the sequence ratio as a product; they agree wherever the log sum is within ±20."""
    helper = verl_helper()
    batch = make_batch(seed)
    level = "token" if trl_mode.startswith("token") else "sequence"
    w_verl, _ = helper.compute_rollout_correction_weights(batch.old - batch.behav, batch.mask, level, verl_threshold)
    trl = trl_is_ratio(batch, trl_mode, clip_min, clip_max)
    assert_close(on_mask(trl, batch.mask), on_mask(w_verl, batch.mask), rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------ verl diagnostics


@pytest.mark.verl
@pytest.mark.parametrize("seed", [0, 1])
def test_offpolicy_metrics_match_verl(seed: int) -> None:
    helper = verl_helper()
    batch = make_batch(seed)
    verl = helper.compute_offpolicy_metrics(batch.old, batch.behav, batch.mask)
    ours_all = offpolicy_metrics(batch.old, batch.behav, batch.mask, count_empty_rows=True)
    assert set(ours_all) == set(verl)
    for key, value in verl.items():
        assert_close(ours_all[key].item(), value, rtol=1e-7, atol=1e-12, msg=key)
    # default: sequence metrics over non-empty rows only (the batch has one empty row)
    ours = offpolicy_metrics(batch.old, batch.behav, batch.mask)
    assert not math.isclose(ours["training_ppl"].item(), verl["training_ppl"], rel_tol=1e-9)
    rows = batch.mask.any(-1)
    sub = helper.compute_offpolicy_metrics(batch.old[rows], batch.behav[rows], batch.mask[rows])
    for key, value in sub.items():
        assert_close(ours[key].item(), value, rtol=1e-7, atol=1e-12, msg=key)


# ------------------------------------------------------------------------------------------ verl bypass mode


@pytest.mark.verl
@pytest.mark.parametrize(
    ("preset", "rollout_is", "threshold", "agg"),
    [
        ("bypass_pg_is", "sequence", 2.0, "seq-mean-token-sum"),  # verl's REINFORCE default aggregation
        ("bypass_pg_is", "sequence", 2.0, "token-mean"),
        ("bypass_pg_token_icepop", "token", "0.5_5.0", "token-mean"),
    ],
)
def test_bypass_reinforce_matches_verl(preset: str, rollout_is: str, threshold: Any, agg: str) -> None:
    """verl's bypass_mode ``reinforce`` loss (IS recomputed from the current policy against the rollout) equals
    ``trust=REINFORCE()`` with the correction's ``source="current"``, old_logp = the rollout log-probs."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    verl_config = pytest.importorskip("verl.workers.config")
    algorithm = pytest.importorskip("verl.trainer.config.algorithm")
    rc = getattr(algorithm.RolloutCorrectionConfig, preset)()
    assert rc.rollout_is == rollout_is and rc.loss_type == "reinforce"
    cfg = verl_config.ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        policy_loss=verl_config.PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc),
    )
    batch = make_batch(7)
    lp = batch.logp.clone().requires_grad_(True)
    loss, _ = core_algos.get_policy_loss_fn("bypass_mode")(
        old_log_prob=batch.behav,
        log_prob=lp,
        advantages=batch.adv[:, None].expand_as(lp).contiguous(),
        response_mask=batch.mask,
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=None,
    )
    (g_verl,) = torch.autograd.grad(loss, lp)
    correction = from_verl_rollout_is(rollout_is, rc.rollout_is_threshold, source="current")
    mine = policy_loss(
        lp, batch.behav, batch.adv, batch.mask, behav_logp=batch.behav, trust=REINFORCE(), correction=correction,
        agg=agg,  # type: ignore[arg-type]
    )  # fmt: skip
    (g,) = torch.autograd.grad(mine.loss, lp)
    assert_close(mine.loss.detach(), loss.detach(), rtol=1e-7, atol=1e-12)
    assert_close(g, g_verl, rtol=1e-7, atol=1e-12)
    assert float(g.abs().sum()) > 0
