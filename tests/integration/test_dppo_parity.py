"""Parity with verl 0.9.1's ``dppo_tv`` and ``dppo_kl`` policy losses (``verl.trainer.ppo.core_algos``).

verl's losses are called exactly as ``verl/workers/utils/losses.py::ppo_loss`` calls them (keyword-only, real
``verl.workers.config.ActorConfig``), and compared in value, in gradient with respect to ``logp`` and in
metrics with ``policy_loss(..., trust=DPPO(divergence, low, high, c=3.0))``. Inputs are float64 probabilities
(valid log-probs), ragged masks with all-masked rows, mixed-sign advantages (some exactly 0), tokens far past
the thresholds in both directions and ratios above the truncation, and unrelated finite values in the padding.

Conventions pinned here:

- verl reads the thresholds from ``clip_ratio_low``/``clip_ratio_high`` and the truncation from
  ``config.get("clip_ratio_c", 20.0)``; ``ActorConfig`` defines ``clip_ratio_c = 3.0``, so the effective
  truncation is 3.0 (``DPPO(c=3.0)``), not the fallback 20 and not the paper code's 10 (our default).
- verl's ``pg_clipfrac`` is our ``dppo_masked_frac``; ``pg_clipfrac_lower`` (r > c among valid tokens) is
  ``dppo_ratio_capped_frac``; ``ppo_kl`` is ``approx_kl``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.testing import assert_close

from rolloutopt.losses import policy_loss
from rolloutopt.ratios import DPPO

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")

pytestmark = pytest.mark.verl

B, T = 24, 12
F64 = torch.float64
METRICS = {
    "actor/pg_clipfrac": "dppo_masked_frac",
    "actor/pg_clipfrac_lower": "dppo_ratio_capped_frac",
    "actor/ppo_kl": "approx_kl",
}


def actor_config(**kwargs: Any) -> Any:
    """A real verl ActorConfig; ``strategy``, a micro-batch size and ``rollout_n`` are required, not read by losses."""
    return verl_config.ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **kwargs)


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=F64)

    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[:3] = torch.tensor([0, 0, T])  # two all-masked rows, one full row
    lengths = lengths[torch.randperm(B, generator=gen)]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    p_old = 0.01 + 0.98 * rand(B, T)
    near = (p_old + 0.1 * (rand(B, T) - 0.5)).clamp(1e-3, 0.999)  # inside every threshold
    far = rand(B, T)  # anywhere in (0, 1): TV up to ~1, binary KL up to ~4
    small = 0.02 * rand(B, T)  # p_old small, p large: r > 3 (the truncation) when paired with `far`
    p_old = torch.where(rand(B, T) < 0.2, small + 1e-3, p_old)
    p = torch.where(rand(B, T) < 0.5, far, near).clamp(1e-4, 0.9999)
    logp, old = p.log(), p_old.log()
    pad = ~mask  # padding holds unrelated finite values
    logp = torch.where(pad, -15.0 * rand(B, T), logp)
    old = torch.where(pad, -15.0 * rand(B, T), old)
    adv = torch.randn(B, generator=gen, dtype=F64)
    adv[:2] = torch.tensor([0.0, -0.7])
    adv_tok = torch.randn(B, T, generator=gen, dtype=F64)
    adv_tok = torch.where(rand(B, T) < 0.1, torch.zeros_like(adv_tok), adv_tok)
    return {"logp": logp, "old": old, "mask": mask, "adv": adv, "adv_tok": adv_tok, "w": 0.5 + rand(B, T)}


def run_verl(name: str, b: dict[str, torch.Tensor], cfg: Any, agg: str, adv: torch.Tensor, weights: bool) -> Any:
    lp = b["logp"].clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=b["old"],
        log_prob=lp,
        advantages=adv,
        response_mask=b["mask"],
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=b["w"] if weights else None,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def run_ours(b: dict[str, torch.Tensor], trust: DPPO, agg: str, adv: torch.Tensor, weights: bool) -> Any:
    lp = b["logp"].clone().requires_grad_(True)
    max_len = {"max_len": T} if agg == "seq-mean-token-sum-norm" else {}  # read by that mode only
    out = policy_loss(
        lp, b["old"], adv, b["mask"], trust=trust, agg=agg, is_weights=b["w"] if weights else None, **max_len
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad, out.metrics


CASES = [
    # (verl name, our divergence, low, high)
    ("dppo_tv", "tv", 0.2, 0.2),  # ActorConfig defaults
    ("dppo_tv", "tv", 0.15, 0.15),  # the DPPO authors' example (our default)
    ("dppo_tv", "tv", 0.1, 0.3),  # asymmetric: low gates A <= 0, high gates A > 0
    ("dppo_kl", "kl", 0.2, 0.2),
    ("dppo_kl", "kl", 0.05, 0.05),  # the DPPO authors' example (our default)
    ("dppo_kl", "kl", 0.3, 0.02),
]


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize("weights", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("name", "div", "low", "high"), CASES)
def test_dppo_matches_verl(
    name: str, div: str, low: float, high: float, seed: int, agg: str, weights: bool, per_token_adv: bool
) -> None:
    b = make_batch(seed)
    cfg = actor_config(clip_ratio_low=low, clip_ratio_high=high)
    assert cfg.clip_ratio_c == 3.0  # the effective truncation in verl 0.9.1
    v_adv = b["adv_tok"] if per_token_adv else b["adv"][:, None].expand(B, T).contiguous()
    o_adv = b["adv_tok"] if per_token_adv else b["adv"]
    v_loss, v_grad, v_metrics = run_verl(name, b, cfg, agg, v_adv, weights)
    o_loss, o_grad, o_metrics = run_ours(b, DPPO(div, low=low, high=high, c=3.0), agg, o_adv, weights)  # type: ignore[arg-type]
    assert_close(o_loss, v_loss, rtol=1e-12, atol=1e-13)
    assert_close(o_grad, v_grad, rtol=1e-12, atol=1e-13)
    assert (o_grad[~b["mask"]] == 0).all()
    for vk, ok in METRICS.items():
        # verl computes the fractions in float32 (``.float()``), hence the looser tolerance
        assert_close(o_metrics[ok].item(), v_metrics[vk], rtol=1e-6, atol=1e-9, msg=f"{vk} vs {ok}")
    # the inputs exercise the mask and the truncation: some tokens masked, some not; some ratios capped
    assert 0 < v_metrics["actor/pg_clipfrac"] < 1
    assert v_metrics["actor/pg_clipfrac_lower"] > 0
    assert o_metrics["dppo_masked_high_frac"] > 0 and o_metrics["dppo_masked_low_frac"] > 0


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_policy_scope_matches_verl(name: str) -> None:
    """``scope="policy"`` (keep=None, the policy term zeroed) gives the same policy loss as verl too."""
    b = make_batch(5)
    cfg = actor_config(clip_ratio_low=0.1, clip_ratio_high=0.1)
    v_loss, v_grad, _ = run_verl(name, b, cfg, "token-mean", b["adv"][:, None].expand(B, T).contiguous(), False)
    trust = DPPO("tv" if name == "dppo_tv" else "kl", low=0.1, high=0.1, c=3.0, scope="policy")
    o_loss, o_grad, o_metrics = run_ours(b, trust, "token-mean", b["adv"], False)
    assert_close(o_loss, v_loss, rtol=1e-12, atol=1e-13)
    assert_close(o_grad, v_grad, rtol=1e-12, atol=1e-13)
    assert o_metrics["masked_frac"] == 0 and o_metrics["dppo_masked_frac"] > 0


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_default_truncation_differs_from_verl(name: str) -> None:
    """Our default c = 10 (the paper's code) is not verl's effective 3.0: with ratios in (3, 10] they differ."""
    b = make_batch(6)
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.2)
    adv = b["adv"][:, None].expand(B, T).contiguous()
    v_loss, v_grad, v_metrics = run_verl(name, b, cfg, "token-mean", adv, False)
    assert v_metrics["actor/pg_clipfrac_lower"] > 0
    div = "tv" if name == "dppo_tv" else "kl"
    o_loss, o_grad, _ = run_ours(b, DPPO(div, low=0.2, high=0.2), "token-mean", b["adv"], False)  # type: ignore[arg-type]
    assert not torch.allclose(o_grad, v_grad) and not torch.allclose(o_loss, v_loss)
    o3_loss, o3_grad, _ = run_ours(b, DPPO(div, low=0.2, high=0.2, c=3.0), "token-mean", b["adv"], False)  # type: ignore[arg-type]
    assert_close(o3_grad, v_grad, rtol=1e-12, atol=1e-13)
    assert_close(o3_loss, v_loss, rtol=1e-12, atol=1e-13)


def test_binary_tv_oracle_through_verl() -> None:
    """By hand (Binary-TV), δ = 0.15: p_θ = 0.6, p_old = 0.4, A > 0 → masked; p_θ = 0.3, p_old = 0.4, A > 0 → kept."""
    logp = torch.tensor([[0.6, 0.3]], dtype=F64).log()
    old = torch.tensor([[0.4, 0.4]], dtype=F64).log()
    b = {"logp": logp, "old": old, "mask": torch.ones(1, 2, dtype=torch.bool), "w": torch.ones(1, 2, dtype=F64)}
    adv = torch.ones(1, 2, dtype=F64)
    cfg = actor_config(clip_ratio_low=0.15, clip_ratio_high=0.15)
    _, v_grad, v_metrics = run_verl("dppo_tv", b, cfg, "token-mean", adv, False)
    _, o_grad, o_metrics = run_ours(b, DPPO("tv", c=3.0), "token-mean", adv, False)
    assert v_metrics["actor/pg_clipfrac"] == 0.5 == o_metrics["dppo_masked_frac"].item()
    # masked token: no gradient; kept token: -A * min(r, c) / N with r = 0.3 / 0.4 (token-mean over 2 tokens)
    expected = torch.tensor([[0.0, -0.75 / 2]], dtype=F64)
    assert_close(v_grad, expected)
    assert_close(o_grad, expected)
