"""Parity with verl 0.9.1 for the decoupled PPO loss composed from rolloutopt's stages.

No installed trainer implements A-3PO, CoPRIS, PPO-EWMA, PNPO or the cumulative ratio (AReaL and the CoPRIS fork
of verl are not installable here). What verl 0.9.1 does have is the *decoupled* mode: its ``vanilla`` policy
loss against the recomputed proximal log-probs, multiplied by precomputed ``rollout_is_weights``. We compare

- rolloutopt: ``policy_loss(logp, prox, A, mask, behav_logp=behav, trust=PPOClip(0.2, 0.2, dual=None),
  correction=<behaviour weight w = exp(prox - behav), tokens with w > 5 masked>)``, with the proximal log-probs
  given directly, from :class:`~rolloutopt.ratios.A3POProximal`, or from :class:`~rolloutopt.ratios.CoPRISProximal`;
- verl: ``compute_policy_loss_vanilla(old_log_prob=prox, rollout_is_weights=where(w <= 5, w, 0),
  clip_ratio=0.2, clip_ratio_c=1e9)`` (dual clip off), ``token-mean``,

in value and in gradient, float64. Conventions: with the original response mask verl's denominator is the
original token count (``removed_in_denominator=True``; AReaL's ``ppo_actor_loss_fn`` takes this count
before its rejection sampling); verl's rollout rejection instead folds the
mask into ``response_mask`` (``removed_in_denominator=False``). Both are checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch.testing import assert_close

from rolloutopt.losses import CorrectionOutput, policy_loss
from rolloutopt.ratios import A3POProximal, CoPRISProximal, PPOClip, StageContext, a3po_proximal_logp

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")

pytestmark = pytest.mark.verl

D = torch.float64
CAP = 5.0


@dataclass(frozen=True)
class BehaviourWeight:
    """AReaL's behaviour weight with token rejection above ``cap`` (test-local stand-in for the MIS stage)."""

    cap: float = CAP
    requires: ClassVar[tuple[str, ...]] = ("behav_logp",)  # the declaration policy_loss checks inputs against

    def __call__(self, ctx: StageContext) -> CorrectionOutput:
        assert ctx.old_logp is not None and ctx.behav_logp is not None
        w = (ctx.old_logp - ctx.behav_logp).clamp(-20, 20).exp()
        keep = w <= self.cap
        return CorrectionOutput(torch.where(keep, w, torch.zeros_like(w)), keep, {})


def actor_config(**kwargs: Any) -> Any:
    return verl_config.ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **kwargs)


def batch(seed: int, b: int = 12, t: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    behav = -2 * torch.rand(b, t, generator=g, dtype=D) - 4.05  # prox and logp below stay log-probs
    prox = behav + 0.8 * torch.randn(b, t, generator=g, dtype=D)  # some e^{prox - behav} > 5
    logp = prox + 0.3 * torch.randn(b, t, generator=g, dtype=D)  # some clipped
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    mask[0] = True
    prox[0, 0] = behav[0, 0] + math.log(7.0)
    adv = torch.randn(b, generator=g, dtype=D)
    adv[1] = 0.0
    versions = torch.randint(0, 5, (b, t), generator=g)
    return {"behav": behav, "prox": prox, "logp": logp, "mask": mask, "adv": adv, "versions": versions}


def verl_decoupled(x: dict[str, torch.Tensor], prox: torch.Tensor, fold: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = (prox - x["behav"]).exp()
    keep = w <= CAP
    mask = x["mask"] & keep if fold else x["mask"]
    lp = x["logp"].clone().requires_grad_()
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=prox,
        log_prob=lp,
        advantages=x["adv"][:, None].expand_as(lp),
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=actor_config(clip_ratio=0.2, clip_ratio_c=1e9),
        rollout_is_weights=torch.where(keep, w, torch.zeros_like(w)),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def ours(x: dict[str, torch.Tensor], old: torch.Tensor | None, fold: bool, **kw: Any) -> tuple[torch.Tensor, ...]:
    lp = x["logp"].clone().requires_grad_()
    out = policy_loss(
        lp,
        old,
        x["adv"],
        x["mask"],
        behav_logp=x["behav"],
        trust=PPOClip(low=0.2, high=0.2, dual=None),
        correction=BehaviourWeight(),
        agg="token-mean",
        removed_in_denominator=not fold,
        **kw,
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fold", [False, True], ids=["areal-denominator", "verl-folded-mask"])
def test_decoupled_ppo_matches_verl_vanilla_with_weights(seed: int, fold: bool) -> None:
    x = batch(seed)
    ref = verl_decoupled(x, x["prox"], fold)
    got = ours(x, x["prox"], fold)
    assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_a3po_proximal_matches_verl_vanilla_on_interpolated_prox(seed: int) -> None:
    x = batch(seed)
    prox = a3po_proximal_logp(x["logp"], x["behav"], x["versions"], 5, mask=x["mask"])
    ref = verl_decoupled(x, prox, False)
    got = ours(x, None, False, versions=x["versions"], policy_version=5, proximal=A3POProximal())
    assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_copris_matches_verl_vanilla_on_concatenated_old_logp(seed: int) -> None:
    # CoPRIS's fork trains with verl's vanilla loss on the concatenated old log-probs and no behaviour weight;
    # its script sets clip 0.2 / 0.28 and clip_ratio_c = 10 (CoPRIS_scripts/run_CoPRIS.sh)
    x = batch(seed)
    versions = torch.where(torch.arange(x["logp"].shape[1])[None] < 4, 3, 4).expand_as(x["logp"])
    old = torch.where(versions < 4, x["behav"], x["prox"])
    lp = x["logp"].clone().requires_grad_()
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old,
        log_prob=lp,
        advantages=x["adv"][:, None].expand_as(lp),
        response_mask=x["mask"],
        loss_agg_mode="token-mean",
        config=actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0),
    )
    (grad,) = torch.autograd.grad(loss, lp)
    lp2 = x["logp"].clone().requires_grad_()
    out = policy_loss(
        lp2,
        x["prox"],
        x["adv"],
        x["mask"],
        behav_logp=x["behav"],
        versions=versions,
        proximal=CoPRISProximal(),
        trust=PPOClip(low=0.2, high=0.28, dual=10.0),
        agg="token-mean",
    )
    (grad2,) = torch.autograd.grad(out.loss, lp2)
    assert_close(out.loss.detach(), loss.detach(), rtol=1e-12, atol=1e-12)
    assert_close(grad2, grad, rtol=1e-12, atol=1e-12)
