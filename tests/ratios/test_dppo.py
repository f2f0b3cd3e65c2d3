"""DPPO divergence masks, the Predictive Divergence Mask and ECHO's clip: hand oracles, properties.

DPPO's oracles are computed by hand following ``sail-sg/Stable-RL@c6af1d11``
``verl/trainer/ppo/core_algos.py`` (``_compute_token_mask_for_policy_loss``); the Predictive Divergence Mask's
oracle is our reconstruction (see docs/methods/dppo.md).

verl parity (``dppo_tv``/``dppo_kl``) is in ``tests/integration/test_dppo_parity.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from rolloutopt import checks, losses
from rolloutopt.errors import InputError
from rolloutopt.losses import Denominators, policy_loss
from rolloutopt.ratios import (
    DPPO,
    DPPO_DEFAULT_DELTA,
    ECHOClip,
    MaskOutput,
    PPOClip,
    TrustOutput,
    binary_kl,
    binary_tv,
    dppo_loss,
    dppo_mask,
    echo_clip_epsilon,
    echo_clip_loss,
    ppo_clip_loss,
    predicted_kl_change,
    tail_confidence,
    topk_divergence,
)
from rolloutopt.ratios.context import StageContext

D = torch.float64
FAST = settings(max_examples=25, deadline=None)


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def lg(x: object) -> torch.Tensor:
    return t(x).log()


def kl(mu: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    return (mu * (mu.log() - pi.log())).sum(-1)


# ----------------------------------------------------------------------------------------------- oracles


def test_binary_tv_oracle() -> None:
    """By hand (Stable-RL's Binary-TV mask), δ = 0.15: p_θ = 0.6, p_old = 0.4, A > 0 → masked; p_θ = 0.3 → kept."""
    m = dppo_mask(lg([[0.6, 0.3]]), lg([[0.4, 0.4]]), t([1.0]), low=0.15, high=0.15)
    assert isinstance(m, MaskOutput)
    assert m.keep.tolist() == [[False, True]]
    assert m.metrics["dppo_masked_high_frac"].item() == 0.5 and m.metrics["dppo_masked_low_frac"].item() == 0
    assert m.metrics["dppo_masked_frac"].item() == 0.5
    assert m.metrics["dppo_divergence_mean"].item() == pytest.approx(0.15)
    assert_close(binary_tv(lg([[0.6, 0.3]]), lg([[0.4, 0.4]])), t([[0.2, 0.1]]))
    # mirrored for A < 0: moving down past δ_low is masked, moving up is the safe side
    m = dppo_mask(lg([[0.2, 0.6]]), lg([[0.4, 0.4]]), t([-1.0]), low=0.15, high=0.15)
    assert m.keep.tolist() == [[False, True]] and m.metrics["dppo_masked_low_frac"].item() == 0.5
    # asymmetric thresholds: only high gates A > 0, only low gates A <= 0
    m = dppo_mask(lg([[0.6], [0.2]]), lg([[0.4], [0.4]]), t([1.0, -1.0]), low=0.25, high=0.1)
    assert m.keep.tolist() == [[False], [True]]


def test_binary_kl_oracle() -> None:
    # KL(Bern(0.4) || Bern(0.6)) = 0.4 ln(0.4/0.6) + 0.6 ln(0.6/0.4) = 0.2 ln 1.5
    d = binary_kl(lg([[0.6]]), lg([[0.4]]))
    assert d.item() == pytest.approx(0.2 * math.log(1.5), abs=1e-7)
    assert binary_tv(lg([[0.6]]), lg([[0.4]])).item() == pytest.approx(0.2)
    # δ = 0.05 < 0.0811: A > 0 pushes p up (away) → masked; A < 0 pushes p down (back toward 0.4) → kept
    m = dppo_mask(lg([[0.6]]), lg([[0.4]]), t([1.0]), divergence="kl")
    assert m.keep.item() is False and m.metrics["dppo_masked_high_frac"].item() == 1.0
    assert dppo_mask(lg([[0.6]]), lg([[0.4]]), t([-1.0]), divergence="kl").keep.item() is True
    # p = 1 and p_old = 1: the 1e-8 guards keep it finite
    assert torch.isfinite(binary_kl(t([[0.0, 0.0]]), t([[0.0, -30.0]]))).all()


def test_topk_divergence_oracle() -> None:
    # mu's top-2 = [0.5, 0.3] (rest 0.2); pi at those ids = [0.4, 0.4] (rest 0.2)
    mu, pi = lg([[[0.5, 0.3]]]), lg([[[0.4, 0.4]]])
    expected_kl = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)  # rest term: 0.2 ln 1 = 0
    assert topk_divergence(pi, mu, kind="kl").item() == pytest.approx(expected_kl, abs=1e-12)
    assert topk_divergence(pi, mu, kind="tv").item() == pytest.approx(0.1, abs=1e-12)


def test_topk_divergence_full_distribution_is_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    mu = torch.softmax(torch.randn(3, 4, 7, generator=gen, dtype=D), -1)
    pi = torch.softmax(torch.randn(3, 4, 7, generator=gen, dtype=D), -1)
    assert_close(topk_divergence(pi.log(), mu.log(), kind="kl"), kl(mu, pi), atol=1e-10, rtol=1e-10)
    assert_close(topk_divergence(pi.log(), mu.log(), kind="tv"), (mu - pi).abs().sum(-1) / 2, atol=1e-10, rtol=0)


def test_predictive_oracle() -> None:
    """Our reconstruction: π = [0.1, 0.8, 0.1], μ = [0.05, 0.5, 0.45], k = 0: local +0.05, global −0.21,
    bracket −0.16."""
    pi, mu = lg([[[0.1, 0.8, 0.1]]]), lg([[[0.05, 0.5, 0.45]]])
    g = predicted_kl_change(pi[..., 0], mu[..., 0], pi, mu, experimental=True)
    assert g.item() == pytest.approx(-0.16, abs=1e-12)
    kw = {"divergence": "topk_kl", "topk_logp": pi, "topk_behav_logp": mu, "low": 0.0, "high": 0.0}
    # A > 0, D = KL(μ||π) > δ = 0, r = 2: DPPO's local test says "away" (masked) ...
    plain = dppo_mask(pi[..., 0], mu[..., 0], t([1.0]), **kw)  # type: ignore[arg-type]
    assert plain.keep.item() is False
    # ... the predictive test says the KL decreases: kept, and the verdict flipped
    pred = dppo_mask(pi[..., 0], mu[..., 0], t([1.0]), predictive=True, experimental=True, **kw)  # type: ignore[arg-type]
    assert pred.keep.item() is True and pred.metrics["dppo_direction_flip_frac"].item() == 1.0
    assert "dppo_direction_flip_frac" not in plain.metrics
    # A < 0: A·g = +0.16 > 0 → predicted to move away → masked (locally p_θ > p_old was the safe side)
    pred = dppo_mask(pi[..., 0], mu[..., 0], t([-1.0]), predictive=True, experimental=True, **kw)  # type: ignore[arg-type]
    assert pred.keep.item() is False and pred.metrics["dppo_masked_low_frac"].item() == 1.0
    assert dppo_mask(pi[..., 0], mu[..., 0], t([-1.0]), **kw).keep.item() is True  # type: ignore[arg-type]


def _softmax_step_change(z: torch.Tensor, mu: torch.Tensor, k: int, a: float, eta: float) -> torch.Tensor:
    pi = torch.softmax(z, -1)
    step = eta * a * (torch.nn.functional.one_hot(torch.tensor(k), z.shape[-1]).to(D) - pi)
    return kl(mu, torch.softmax(z + step, -1)) - kl(mu, pi)


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(2, 9), st.sampled_from([1.0, -1.0, 0.5, -2.0]))
def test_predictive_closed_form_matches_finite_difference(seed: int, v: int, a: float) -> None:
    """One logit step along A(1{j=k} − π_j): ΔKL(μ||π)/η → A · bracket (the closed form, K = V)."""
    gen = torch.Generator().manual_seed(seed)
    z = 2.0 * torch.randn(v, generator=gen, dtype=D)
    mu = torch.softmax(2.0 * torch.randn(v, generator=gen, dtype=D), -1)
    k = int(torch.randint(v, (1,), generator=gen))
    pi = torch.softmax(z, -1)
    g = predicted_kl_change(
        pi.log()[k].reshape(1, 1), mu.log()[k].reshape(1, 1), pi.log().reshape(1, 1, v), mu.log().reshape(1, 1, v),
        experimental=True,
    ).item()  # fmt: skip
    eta = 1e-6
    fd = (_softmax_step_change(z, mu, k, a, eta) / eta).item()
    assert fd == pytest.approx(a * g, rel=1e-3, abs=1e-8)
    # and the sign decides: a finite step of the size the sign predicts changes the KL the same way
    if abs(a * g) > 1e-3:
        assert math.copysign(1.0, _softmax_step_change(z, mu, k, a, 1e-3).item()) == math.copysign(1.0, a * g)


def test_predictive_tail_estimators() -> None:
    """V = 4, π = [.4, .3, .2, .1], μ = [.3, .3, .3, .1], top-2 ids [0, 1], sampled k = 0 (in the top-K).

    local π_0 − μ_0 = 0.1; head Σ_{0,1} π(μ−π) = 0.4·(−0.1) + 0 = −0.04; tail masses π_t = 0.3, μ_t = 0.4.
    exact tail: 0.2·0.1 + 0.1·0 = 0.02 → 0.08; aggregate: 0.3·0.1 = 0.03 → 0.09; uniform: 0.03/2 → 0.075.
    """
    pi, mu = lg([[[0.4, 0.3]]]), lg([[[0.3, 0.3]]])
    lp, old = lg([[0.4]]), lg([[0.3]])
    agg = predicted_kl_change(lp, old, pi, mu, experimental=True)
    uni = predicted_kl_change(lp, old, pi, mu, tail="uniform", vocab_size=4, experimental=True)
    assert agg.item() == pytest.approx(0.09, abs=1e-12)
    assert uni.item() == pytest.approx(0.075, abs=1e-12)
    full = predicted_kl_change(lp, old, lg([[[0.4, 0.3, 0.2, 0.1]]]), lg([[[0.3, 0.3, 0.3, 0.1]]]), experimental=True)
    assert full.item() == pytest.approx(0.08, abs=1e-12)


def test_predictive_sampled_token_outside_topk() -> None:
    """Same V = 4 distributions, top-2 ids [1, 2], sampled k = 0 not among them.

    head: 0.3·0 + 0.2·0.1 = 0.02; tail masses π 0.5, μ 0.4, minus the sampled token's (0.4, 0.3): 0.1, 0.1;
    its own term 0.4·(0.3 − 0.4) = −0.04; tail term 0.1·0 = 0. Bracket 0.1 + 0.02 − 0.04 + 0 = 0.08 = exact.
    """
    pi, mu = lg([[[0.3, 0.2]]]), lg([[[0.3, 0.3]]])
    lp, old = lg([[0.4]]), lg([[0.3]])
    for kw in ({}, {"sampled_in_topk": torch.tensor([[False]])}, {"tail": "uniform", "vocab_size": 4}):
        g = predicted_kl_change(lp, old, pi, mu, experimental=True, **kw)  # type: ignore[arg-type]
        assert g.item() == pytest.approx(0.08, abs=1e-12)
    # treating it (wrongly) as inside the top-K leaves its mass in the aggregated tail: 0.1 + 0.02 + 0.5·(−0.1)
    g = predicted_kl_change(lp, old, pi, mu, sampled_in_topk=torch.tensor([[True]]), experimental=True)
    assert g.item() == pytest.approx(0.07, abs=1e-12)


def test_tail_confidence_oracle() -> None:
    conf = t([[0.1, 0.2, 0.3, 0.4, 0.9], [0.5, 0.6, 0.7, 0.8, 0.9], [0.2, 0.2, 0.2, 0.2, 0.2]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 1, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert_close(tail_confidence(conf, mask, window=2), t([0.35, 0.8, 0.0]))
    assert_close(tail_confidence(conf, mask, window=0), t([0.25, 0.7, 0.0]))  # whole response
    assert_close(tail_confidence(conf, mask), t([0.25, 0.7, 0.0]))  # window 16 > length
    assert tail_confidence(t([[3.0]]), torch.ones(1, 1, dtype=torch.bool)).item() == 1.0  # clamped


def test_echo_epsilon_oracle() -> None:
    # ε = 0.05 + 0.15 σ(4 (1 − C)): C = 1 → 0.125 (the midpoint), C = 0 → 0.05 + 0.15 σ(4)
    eps = echo_clip_epsilon(t([1.0, 0.0, 0.5]))
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert_close(eps, t([0.125, 0.05 + 0.15 * s(4.0), 0.05 + 0.15 * s(2.0)]))
    assert_close(echo_clip_epsilon(t([0.3]), kappa=0.0), t([0.125]))


# ----------------------------------------------------------------------------------------------- pipeline


def test_dppo_loss_and_gradient_by_hand() -> None:
    """Tokens: kept (r = 2), masked (TV 0.3 > 0.15, A > 0), kept and truncated (TV 0.11, r = 12 > c = 10), padding."""
    p = t([[0.2, 0.5, 0.12, 0.3]])
    p_old = t([[0.1, 0.2, 0.01, 0.9]])
    logp = p.log().requires_grad_(True)
    mask = torch.tensor([[True, True, True, False]])
    adv = t([1.5])
    out = policy_loss(logp, p_old.log(), adv, mask, trust=DPPO(), agg="token-mean")
    (g,) = torch.autograd.grad(out.loss, logp)
    # token-mean over the 3 loss tokens (the masked one stays in the denominator): -A min(r, c) ∇logp / 3
    assert_close(g, t([[-1.5 * 2 / 3, 0.0, -1.5 * 10 / 3, 0.0]]))
    expected = -1.5 * (2 * math.log(0.2) + 10 * math.log(0.12)) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.metrics["dppo_masked_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["dppo_masked_high_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["dppo_ratio_capped_frac"].item() == pytest.approx(1 / 3)
    assert out.metrics["masked_frac"].item() == pytest.approx(1 / 3)


# Stable-RL's five-token batch: (p_rollout, p_recompute, p_theta, A); row 1 has one pad.
SRL_P_ROLL = t([[0.5, 0.2, 0.05], [0.4, 0.3, 0.5]])
SRL_P_OLD = t([[0.5, 0.5, 0.55], [0.3, 0.35, 0.5]])
SRL_P = t([[0.7, 0.6, 0.6], [0.1, 0.25, 0.5]])
SRL_ADV = t([1.0, -1.0])
SRL_MASK = torch.tensor([[True, True, True], [True, True, False]])


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_recompute_modes_against_stable_rl(divergence: str) -> None:
    """``dppo_binary_tv_recompute`` / ``dppo_binary_kl_recompute``: mask against the recompute, IS weight against
    the rollout policy, by hand following ``sail-sg/Stable-RL@c6af1d11`` ``verl/trainer/ppo/core_algos.py``.

    ``_compute_token_mask_for_policy_loss`` (``old_prob`` = the recompute): TV masks p - p_old > 0.15 for A > 0
    and < -0.15 for A <= 0; KL (0.05) masks KL(Bern(p_old) || Bern(p)) > 0.05 with p > p_old (A > 0) or
    p < p_old (A <= 0). Both mask tokens (0, 0) (TV 0.2, KL 0.0872) and (1, 0) (TV -0.2, KL 0.1537), and keep
    (0, 1) (0.1 / 0.0204), (0, 2) (0.05 / 0.0051), (1, 1) (-0.1 / 0.0247). ``compute_policy_loss_with_mask``:
    ``ratio = exp(clamp(log_prob - rollout_log_prob, max=20)).clamp(max=clip_ratio_c=10)``, detached, so the
    weights of the kept tokens are 0.6 / 0.2 = 3, min(0.6 / 0.05, 10) = 10 and 0.25 / 0.3 = 5/6; ``pg_losses =
    -A ratio mask log_prob``, token-mean over the 5 response tokens: (-3 ln 0.6 - 10 ln 0.6 + (5/6) ln 0.25) / 5
    = 5.4854878 / 5 = 1.0970976; the gradient is -A w / 5 = -0.6, -2.0, +1/6 on the kept tokens.
    """
    logp = SRL_P.log().requires_grad_()
    trust = DPPO(divergence, c=10.0, weight_ref="behav")  # type: ignore[arg-type]
    kw = {"behav_logp": SRL_P_ROLL.log(), "trust": trust, "agg": "token-mean"}
    out = policy_loss(logp, SRL_P_OLD.log(), SRL_ADV, SRL_MASK, **kw)  # type: ignore[arg-type]
    assert_close(out.loss, t(1.0970975616049272), rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad(out.loss, logp)
    assert_close(g, t([[0.0, -0.6, -2.0], [0.0, 1 / 6, 0.0]]), rtol=0, atol=1e-12)
    assert out.metrics["dppo_masked_frac"].item() == pytest.approx(2 / 5)
    assert out.metrics["dppo_ratio_capped_frac"].item() == pytest.approx(1 / 5)  # the w = 12 -> 10 token
    # the default weight_ref="old" re-anchors the weight at the recompute (verl's dppo_tv / dppo_kl): not Stable-RL
    old = DPPO(divergence, c=10.0)  # type: ignore[arg-type]
    re = policy_loss(logp, SRL_P_OLD.log(), SRL_ADV, SRL_MASK, trust=old, agg="token-mean")
    assert_close(re.loss, t(0.180044807412036 / 5), rtol=0, atol=1e-12)


def test_dppo_tv_preset_with_stable_rl_aggregation() -> None:
    """``dppo_binary_tv`` (the paper's form: mask and weight against the rollout policy) with Stable-RL's
    ``loss_agg_mode="seq-mean-token-sum-norm"``: ``agg_loss`` returns ``sum(seq_losses) / loss_scale_factor``
    (``sail-sg/Stable-RL@c6af1d11`` ``verl/trainer/ppo/core_algos.py``; ``loss_scale_factor`` defaults to the
    padded length), not divided by the number of sequences.

    Rollout log-probs = the recompute column above: masked (0, 0) and (1, 0); kept weights 0.6 / 0.5 = 1.2,
    0.6 / 0.55 and 0.25 / 0.35; sum -1.2 ln 0.6 - (12/11) ln 0.6 + (5/7) ln 0.25 = 0.1800448; Stable-RL:
    0.1800448 / L_max(3) = 0.0600149. rolloutopt's mode (Dr.GRPO's) divides by N_seqs * L_max = 6;
    ``Denominators(sequences=1)`` gives Stable-RL's number.
    """
    preset = losses.get("dppo_tv")
    logp = SRL_P.log()
    ours = preset(logp, SRL_P_OLD.log(), SRL_ADV, SRL_MASK, max_len=3)
    assert_close(ours.loss, t(0.180044807412036 / 6), rtol=0, atol=1e-12)
    stable = preset(logp, SRL_P_OLD.log(), SRL_ADV, SRL_MASK, max_len=3, denominators=Denominators(sequences=1))
    assert_close(stable.loss, t(0.060014935804011994), rtol=0, atol=1e-12)
    kl = losses.get("dppo_kl")(
        logp, SRL_P_OLD.log(), SRL_ADV, SRL_MASK, max_len=3, denominators=Denominators(sequences=1)
    )
    assert_close(kl.loss, t(0.060014935804011994), rtol=0, atol=1e-12)  # the same two tokens masked


def test_dppo_mask_with_a_loss_mask() -> None:
    """``mask`` makes ``keep`` a subset of it, the metrics means over it, and garbage outside it harmless."""
    lp = lg([[0.6, 0.3, 0.5]])
    lp[0, 2] = math.nan  # padding garbage
    out = dppo_mask(lp, lg([[0.4, 0.4, 0.4]]), t([1.0]), mask=torch.tensor([[True, True, False]]))
    assert out.keep.tolist() == [[False, True, False]]
    assert out.metrics["dppo_masked_frac"].item() == 0.5
    assert all(torch.isfinite(v) for v in out.metrics.values())
    with pytest.raises(InputError) as e:
        dppo_mask(lp, lg([[0.4, 0.4, 0.4]]), t([1.0]))
    assert e.value.argument == "logp"


def test_dppo_scope_entropy_terms() -> None:
    """scope='token' drops a masked token's entropy term too; scope='policy' (verl) keeps it."""
    logp, old = lg([[0.6, 0.5]]), lg([[0.4, 0.5]])
    mask, ent = torch.ones(1, 2, dtype=torch.bool), t([[2.0, 3.0]])
    kw = {"entropy": ent, "entropy_coef": 0.1}
    tok = policy_loss(logp, old, t([1.0]), mask, trust=DPPO(), **kw)  # type: ignore[arg-type]
    pol = policy_loss(logp, old, t([1.0]), mask, trust=DPPO(scope="policy"), **kw)  # type: ignore[arg-type]
    # both: policy term only at token 1; entropy 0.1·3 at token 1 in both, 0.1·2 at token 0 only with "policy"
    pg = -math.log(0.5)
    assert tok.loss.item() == pytest.approx((pg - 0.3) / 2)
    assert pol.loss.item() == pytest.approx((pg - 0.3 - 0.2) / 2)


def test_dppo_topk_and_sampled_in_topk_through_policy_loss() -> None:
    pi, mu = lg([[[0.1, 0.8, 0.1]]]), lg([[[0.05, 0.5, 0.45]]])
    kw = {"topk_logp": pi, "topk_behav_logp": mu}
    trust = DPPO("topk_kl", low=0.0, high=0.0, predictive=True, experimental=True)
    out = policy_loss(pi[..., 0], mu[..., 0], t([1.0]), torch.ones(1, 1, dtype=torch.bool), trust=trust, **kw)  # type: ignore[arg-type]
    assert out.metrics["dppo_masked_frac"].item() == 0.0
    assert out.metrics["dppo_direction_flip_frac"].item() == 1.0
    assert out.metrics["dppo_divergence_mean"].item() == pytest.approx(kl(mu.exp(), pi.exp()).item())
    out = policy_loss(
        pi[..., 0], mu[..., 0], t([1.0]), torch.ones(1, 1, dtype=torch.bool), trust=trust,
        stage_inputs={"sampled_in_topk": torch.tensor([[False]])}, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    # wrongly 'outside': the sampled token is counted twice, 0.05 − 0.21 + 0.1·(0.05 − 0.1) = −0.165 < 0: still kept
    assert out.metrics["dppo_masked_frac"].item() == 0.0


def test_echo_matches_transcription_of_official_loss() -> None:
    """ECHOClip through policy_loss vs a transcription of ECHO's compute_policy_loss (user683/ECHO)."""
    gen = torch.Generator().manual_seed(3)
    b, n = 6, 7
    old = -3 * torch.rand(b, n, generator=gen, dtype=D)
    logp = (old + 0.6 * torch.randn(b, n, generator=gen, dtype=D)).clamp(max=0.0).requires_grad_(True)
    mask = torch.arange(n)[None] < torch.tensor([7, 3, 0, 5, 7, 1])[:, None]
    adv = torch.randn(b, generator=gen, dtype=D)
    conf = torch.rand(b, generator=gen, dtype=D)
    out = policy_loss(logp, old, adv, mask, trust=ECHOClip(), confidence=conf, agg="token-mean")
    (g,) = torch.autograd.grad(out.loss, logp)

    lp2 = logp.detach().clone().requires_grad_(True)
    clip_eps = 0.05 + (0.2 - 0.05) * torch.sigmoid(4.0 * (1.0 - conf.clamp(0, 1)))
    eps = clip_eps.unsqueeze(-1).expand_as(mask).to(D)
    ratio = torch.exp(torch.clamp(lp2 - old, -20.0, 20.0))
    a = adv[:, None].expand(b, n)
    l1, l2 = -a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps)
    c1 = torch.maximum(l1, l2)
    pg = torch.where(a < 0, torch.min(-a * 3.0, c1), c1)
    ref = (pg * mask).sum() / mask.sum()
    (rg,) = torch.autograd.grad(ref, lp2)
    assert_close(out.loss, ref.detach(), rtol=1e-12, atol=1e-14)
    assert_close(g, rg, rtol=1e-12, atol=1e-14)
    assert 0 < out.metrics["clipfrac"].item() < 1
    assert out.metrics["echo_clip_eps_mean"].item() == pytest.approx((clip_eps[:, None] * mask).sum() / mask.sum())


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.28])
def test_echo_fixed_radius_is_ppo_clip(eps: float) -> None:
    gen = torch.Generator().manual_seed(4)
    old = -2 * torch.rand(5, 6, generator=gen, dtype=D)
    logp = (old + 0.5 * torch.randn(5, 6, generator=gen, dtype=D)).clamp(max=0.0)
    mask, adv = torch.ones(5, 6, dtype=torch.bool), torch.randn(5, generator=gen, dtype=D)
    conf = torch.rand(5, generator=gen, dtype=D)
    a = policy_loss(logp, old, adv, mask, trust=ECHOClip(eps, eps), confidence=conf)
    b = policy_loss(logp, old, adv, mask, trust=PPOClip(eps, eps, dual=3.0))
    assert_close(a.loss, b.loss)
    for k in ("clipfrac", "clip_low_frac", "clip_high_frac", "dual_clip_frac"):
        assert_close(a.metrics[k], b.metrics[k])


# ----------------------------------------------------------------------------------------------- properties


def _fl(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)


N = 6  # tokens per draw, as [2, 3]


def _bt(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=D).reshape(2, 3)


ANY = st.lists(_fl(-1e30, 1e30), min_size=N, max_size=N)
LOGP = st.lists(st.one_of(_fl(-30.0, 0.0), st.just(0.0)), min_size=N, max_size=N)
ADV = st.lists(st.one_of(_fl(-1e3, 1e3), st.just(0.0)), min_size=N, max_size=N)
TOPK = st.lists(_fl(-1e30, 1e30), min_size=3 * N, max_size=3 * N)


@FAST
@given(ANY, ANY, ADV, TOPK, TOPK, st.sampled_from(["tv", "kl", "topk_kl", "topk_tv"]), st.booleans())
def test_prop_finite_for_any_finite_input(
    lp: list[float], old: list[float], adv: list[float], q: list[float], p: list[float], div: str, pred: bool
) -> None:
    topk = torch.tensor(q, dtype=D).reshape(2, 3, 3), torch.tensor(p, dtype=D).reshape(2, 3, 3)
    pred = pred and div.startswith("topk")
    logp = _bt(lp).requires_grad_(True)
    trust = DPPO(div, predictive=pred, experimental=pred)  # type: ignore[arg-type]
    tk = {"topk_logp": topk[0], "topk_behav_logp": topk[1]} if div.startswith("topk") else {}
    with checks(False):  # any finite value, log-probs above 0 included (validation would refuse those)
        out = policy_loss(
            logp, _bt(old), _bt(adv), torch.ones(2, 3, dtype=torch.bool), trust=trust, agg="token-mean", **tk
        )
    (g,) = torch.autograd.grad(out.loss, logp)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    # the truncated weight is bounded by c: |∂L/∂logp| <= |A| c / N
    assert (g.abs() <= _bt(adv).abs() * 10.0 / N * (1 + 1e-12)).all()
    if pred:
        g2 = predicted_kl_change(_bt(lp), _bt(old), *topk, experimental=True)
        assert torch.isfinite(g2).all()


@FAST
@given(LOGP, LOGP, ADV, st.sampled_from(["tv", "kl", "topk_kl", "topk_tv"]), _fl(0.0, 1.0), _fl(0.0, 1.0), st.data())
def test_prop_mask_monotone_in_thresholds(
    lp: list[float], old: list[float], adv: list[float], div: str, d1: float, d2: float, data: st.DataObject
) -> None:
    """A larger threshold never masks more tokens, on either side, for every divergence and the predictive test."""
    q = torch.tensor(data.draw(st.lists(_fl(-30.0, 0.0), min_size=3 * N, max_size=3 * N)), dtype=D).reshape(2, 3, 3)
    p = torch.tensor(data.draw(st.lists(_fl(-30.0, 0.0), min_size=3 * N, max_size=3 * N)), dtype=D).reshape(2, 3, 3)
    lo, hi = sorted((d1, d2))
    for pred in (False, True) if div.startswith("topk") else (False,):
        kw = {"divergence": div, "topk_logp": q, "topk_behav_logp": p, "predictive": pred, "experimental": pred}
        small = dppo_mask(_bt(lp), _bt(old), _bt(adv), low=lo, high=lo, **kw)  # type: ignore[arg-type]
        large = dppo_mask(_bt(lp), _bt(old), _bt(adv), low=hi, high=hi, **kw)  # type: ignore[arg-type]
        assert (large.keep | ~small.keep).all()
        only_high = dppo_mask(_bt(lp), _bt(old), _bt(adv), low=lo, high=hi, **kw)  # type: ignore[arg-type]
        low_side = _bt(adv) <= 0  # only high gates A > 0: the A <= 0 side is that of the small thresholds
        assert (only_high.keep == small.keep)[low_side].all() and (only_high.keep | ~small.keep).all()


@FAST
@given(LOGP, ADV, st.sampled_from(["tv", "kl", "topk_kl", "topk_tv"]))
def test_prop_on_policy_keeps_everything_and_is_the_plain_gradient(lp: list[float], adv: list[float], div: str) -> None:
    """old = logp (and μ = π): r = 1, D = 0, nothing masked; the gradient is the plain policy gradient −A ∇ℓ."""
    logp = _bt(lp).requires_grad_(True)
    mask, a = torch.ones(2, 3, dtype=torch.bool), _bt(adv)
    topk = torch.log_softmax(torch.arange(9, dtype=D).reshape(1, 1, 9).expand(2, 3, 9), -1)[..., :3]
    tk = {"topk_logp": topk, "topk_behav_logp": topk} if div.startswith("topk") else {}
    for pred in (False, True) if div.startswith("topk") else (False,):
        trust = DPPO(div, predictive=pred, experimental=pred, low=0.0, high=0.0)  # type: ignore[arg-type]
        out = policy_loss(logp, logp.detach(), a, mask, trust=trust, **tk)
        (g,) = torch.autograd.grad(out.loss, logp)
        plain = policy_loss(logp, logp.detach(), a, mask, trust=None)
        (gp,) = torch.autograd.grad(plain.loss, logp)
        assert out.metrics["dppo_masked_frac"] == 0
        assert_close(g, gp, rtol=1e-12, atol=0)


@FAST
@given(st.lists(_fl(0.0, 1.0), min_size=1, max_size=8), _fl(0.0, 0.5), _fl(0.0, 0.5), _fl(0.0, 20.0))
def test_prop_echo_radius_bounded_and_monotone(conf: list[float], e1: float, e2: float, kappa: float) -> None:
    lo, hi = sorted((e1, e2))
    c = torch.tensor(sorted(conf), dtype=D)
    eps = echo_clip_epsilon(c, eps_min=lo, eps_max=hi, kappa=kappa)
    assert ((eps >= lo - 1e-15) & (eps <= hi + 1e-15)).all()  # inside PPO's interval with ε_max
    assert (eps[1:] <= eps[:-1] + 1e-15).all()  # more confident → narrower


@FAST
@given(st.lists(st.tuples(_fl(-5.0, 5.0), _fl(-10.0, 10.0), _fl(0.0, 1.0)), min_size=1, max_size=6))
def test_prop_echo_rows_are_ppo_clip_with_their_radius(rows: list[tuple[float, float, float]]) -> None:
    lr, adv, conf = (torch.tensor(x, dtype=D) for x in zip(*rows, strict=True))
    eps = echo_clip_epsilon(conf)
    loss, ind = echo_clip_loss(lr.exp()[:, None], adv[:, None], eps)
    for i in range(len(rows)):
        ref, rind = ppo_clip_loss(
            lr[i].exp().reshape(1, 1), adv[i].reshape(1, 1), low=eps[i].item(), high=eps[i].item(), dual=3.0
        )
        assert_close(loss[i : i + 1], ref)
        for k, v in rind.items():
            assert bool(ind[k][i, 0]) == bool(v[0, 0])


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["tv", "kl", "topk_kl", "topk_kl_pred", "echo"]))
def test_prop_gradcheck_through_policy_loss(seed: int, which: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    b, n, k = 3, 4, 5
    old = torch.log(0.05 + 0.9 * torch.rand(b, n, generator=gen, dtype=D))
    logp = (old + 0.5 * torch.randn(b, n, generator=gen, dtype=D)).clamp(max=-1e-3).requires_grad_(True)
    mask = torch.arange(n)[None] < torch.tensor([4, 2, 0])[:, None]
    adv = torch.randn(b, generator=gen, dtype=D)
    q = torch.log_softmax(torch.randn(b, n, 8, generator=gen, dtype=D), -1)[..., :k]
    p = torch.log_softmax(torch.randn(b, n, 8, generator=gen, dtype=D), -1)[..., :k]
    if which == "echo":
        trust: object = ECHOClip()
    else:
        pred = which.endswith("pred")
        trust = DPPO(which.removesuffix("_pred"), predictive=pred, experimental=pred)  # type: ignore[arg-type]
    conf = torch.rand(b, generator=gen, dtype=D)
    lr0 = (logp - old).detach()

    def f(x: torch.Tensor) -> torch.Tensor:
        # DPPO's weight sg(min(r, c)) has no gradient, so its loss *value* is not the surrogate whose derivative
        # is the gradient; holding r fixed (old moves with x, detached) makes it one: d/dx = -A min(r, c) M / N.
        o = old if which == "echo" else x.detach() - lr0
        kw = {"confidence": conf} if which == "echo" else {}
        if which.startswith("topk"):
            kw = {"topk_logp": q, "topk_behav_logp": p}
        return policy_loss(x, o, adv, mask, trust=trust, **kw).loss  # type: ignore[arg-type]

    assert torch.autograd.gradcheck(f, (logp,))


# ----------------------------------------------------------------------- empty batches and declared inputs

EMPTY_SHAPES = [(0, 4), (3, 0), (0, 0), (2, 3)]  # B = 0, T = 0, both, all-masked rows
STAGES = [
    DPPO("tv"),
    DPPO("kl", scope="policy"),
    DPPO("tv", weight_ref="behav"),
    DPPO("topk_kl"),
    DPPO("topk_tv"),
    DPPO("topk_kl", predictive=True, experimental=True),
    DPPO("topk_tv", predictive=True, experimental=True, tail="uniform", vocab_size=9),
    ECHOClip(),
]


def _inputs(stage: object, b: int, n: int, k: int = 3) -> dict[str, object]:
    """Every input ``stage`` declares, shaped [b, n] (or [b, n, k], [b])."""
    values = {
        "behav_logp": torch.full((b, n), -1.2, dtype=D),
        "topk_logp": torch.full((b, n, k), -2.0, dtype=D),
        "topk_behav_logp": torch.full((b, n, k), -1.5, dtype=D),
        "confidence": torch.full((b,), 0.5, dtype=D),
    }
    out: dict[str, object] = {n_: values[n_] for n_ in stage.requires}  # type: ignore[attr-defined]
    if "sampled_in_topk" in stage.accepts:  # type: ignore[attr-defined]
        out["stage_inputs"] = {"sampled_in_topk": torch.zeros(b, n, dtype=torch.bool)}
    return out


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("stage", STAGES, ids=repr)
def test_stages_on_empty_batches_give_zero_loss(shape: tuple[int, int], stage: object) -> None:
    lp = torch.full(shape, -1.0, dtype=D, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)
    for agg in ("token-mean", "seq-mean-token-mean"):
        out = policy_loss(
            lp,
            lp.detach() - 0.3,
            torch.ones(shape[0], dtype=D),
            mask,
            trust=stage,
            agg=agg,
            **_inputs(stage, *shape),  # type: ignore[arg-type]
        )
        assert float(out.loss.detach()) == 0.0
        assert all(bool(torch.isfinite(v)) for v in out.metrics.values())
        (g,) = torch.autograd.grad(out.loss, lp)
        assert not g.any()


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_pure_functions_on_empty_batches(shape: tuple[int, int]) -> None:
    b, n = shape
    lp, m = torch.full(shape, -1.0, dtype=D), torch.zeros(shape, dtype=torch.bool)
    q, p = torch.full((b, n, 3), -2.0, dtype=D), torch.full((b, n, 3), -1.5, dtype=D)
    assert binary_tv(lp, lp).shape == shape and binary_kl(lp, lp).shape == shape
    assert topk_divergence(q, p).shape == shape
    assert predicted_kl_change(lp, lp, q, p, experimental=True).shape == shape
    for kw in ({}, {"divergence": "topk_kl", "topk_logp": q, "topk_behav_logp": p}):
        out = dppo_mask(lp, lp - 0.5, torch.ones(b, dtype=D), mask=m, **kw)  # type: ignore[arg-type]
        assert out.keep.shape == shape and not out.keep.any()
        assert all(float(v) == 0 for v in out.metrics.values())
    assert_close(tail_confidence(lp, m), torch.zeros(b, dtype=D))
    assert echo_clip_epsilon(torch.zeros(b, dtype=D)).shape == (b,)
    assert dppo_loss(lp, lp.exp(), torch.ones(b, 1, dtype=D), m).shape == shape


@pytest.mark.parametrize(
    ("stage", "requires", "accepts"),
    [
        (DPPO("tv"), (), ()),
        (DPPO("kl", weight_ref="behav"), ("behav_logp",), ()),
        (DPPO("topk_kl"), ("topk_logp", "topk_behav_logp"), ()),
        (DPPO("topk_tv", weight_ref="behav"), ("topk_logp", "topk_behav_logp", "behav_logp"), ()),
        (DPPO("topk_kl", predictive=True, experimental=True), ("topk_logp", "topk_behav_logp"), ("sampled_in_topk",)),
        (ECHOClip(), ("confidence",), ()),
    ],
    ids=repr,
)
def test_declared_inputs_match_what_the_stage_reads(
    stage: Any, requires: tuple[str, ...], accepts: tuple[str, ...]
) -> None:
    assert stage.requires == requires and stage.accepts == accepts
    lp = lg([[0.5, 0.4, 0.3]])
    m, a = torch.ones(1, 3, dtype=torch.bool), t([[1.0]])
    given = {k: v for k, v in _inputs(stage, 1, 3).items() if k != "stage_inputs"}
    ctx = StageContext(logp=lp, old_logp=lp - 0.2, mask=m, advantages=a, **given)  # type: ignore[arg-type]
    args = (torch.exp(lp - ctx.old_logp), lp - ctx.old_logp, a, lp)  # type: ignore[operator]
    assert isinstance(stage(*args, ctx=ctx), TrustOutput)
    for name in requires:  # a context lacking a required input raises, naming it
        with pytest.raises(InputError) as e:
            stage(*args, ctx=replace(ctx, **{name: None}))
        assert e.value.argument == name
    for name in accepts:  # an accepted input is read when given
        extra = {name: torch.ones(1, 3, dtype=torch.bool)}
        assert isinstance(stage(*args, ctx=replace(ctx, extra=extra)), TrustOutput)
        with pytest.raises(InputError) as e:
            stage(*args, ctx=replace(ctx, extra={name: torch.ones(1, 4, dtype=torch.bool)}))
        assert e.value.argument == name
    # policy_loss refuses an input the stage does not declare
    undeclared = "behav_logp" if "behav_logp" not in requires else "confidence"
    value = lp - 0.1 if undeclared == "behav_logp" else t([0.5])
    with pytest.raises(InputError) as e:
        policy_loss(lp, lp - 0.2, a[:, 0], m, trust=stage, **given, **{undeclared: value})  # type: ignore[arg-type]
    assert e.value.argument == undeclared


# ----------------------------------------------------------------------------------------------- defaults, bad input


def test_defaults() -> None:
    assert (DPPO().low, DPPO().high, DPPO().c) == (0.15, 0.15, 10.0)
    assert DPPO("kl").low == 0.05 == DPPO_DEFAULT_DELTA["kl"]
    assert DPPO("topk_kl").high == 0.15 and DPPO(low=0.1).high == 0.15
    assert ECHOClip() == ECHOClip(0.05, 0.2, 4.0, 3.0)


def _arg(exc: pytest.ExceptionInfo[InputError]) -> str:
    return exc.value.argument


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"divergence": "js"}, "DPPO.divergence"),
        ({"low": -0.1}, "DPPO.low"),
        ({"high": math.nan}, "DPPO.high"),
        ({"c": 0.0}, "DPPO.c"),
        ({"scope": "seq"}, "DPPO.scope"),
        ({"divergence": "topk_kl", "predictive": True}, "experimental"),
        ({"divergence": "tv", "predictive": True, "experimental": True}, "DPPO.predictive"),
        ({"divergence": "topk_kl", "predictive": True, "experimental": True, "tail": "uniform"}, "DPPO.vocab_size"),
        ({"divergence": "topk_kl", "predictive": True, "experimental": True, "tail": "x"}, "DPPO.tail"),
        ({"tail": "uniform", "vocab_size": 10}, "DPPO.tail"),
        ({"divergence": "topk_kl", "predictive": True, "experimental": True, "vocab_size": 1}, "DPPO.vocab_size"),
        ({"match_tol": -1.0}, "DPPO.match_tol"),
        ({"weight_ref": "rollout"}, "DPPO.weight_ref"),
    ],
)
def test_dppo_bad_config(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InputError) as e:
        DPPO(**kwargs)  # type: ignore[arg-type]
    assert _arg(e) == argument


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"eps_min": 0.3, "eps_max": 0.2}, "ECHOClip.eps_min"),
        ({"eps_max": -0.1}, "ECHOClip.eps_max"),
        ({"kappa": -1.0}, "ECHOClip.kappa"),
        ({"kappa": math.inf}, "ECHOClip.kappa"),
        ({"dual": 1.0}, "ECHOClip.dual"),
    ],
)
def test_echo_bad_config(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InputError) as e:
        ECHOClip(**kwargs)  # type: ignore[arg-type]
    assert _arg(e) == argument


def test_missing_inputs_and_context() -> None:
    lp, m, a = lg([[0.5, 0.4]]), torch.ones(1, 2, dtype=torch.bool), t([1.0])
    with pytest.raises(InputError) as e:
        policy_loss(lp, lp, a, m, trust=DPPO("topk_kl"))
    assert _arg(e) == "topk_logp"
    with pytest.raises(InputError) as e:
        policy_loss(lp, lp, a, m, trust=ECHOClip())
    assert _arg(e) == "confidence"
    for trust in (DPPO(), ECHOClip()):
        with pytest.raises(InputError) as e:
            trust(lp.exp(), lp, a[:, None], lp)
        assert _arg(e) == "ctx"
    ctx = StageContext(logp=lp, old_logp=lp, mask=m, advantages=a[:, None])
    assert DPPO()(torch.ones_like(lp), torch.zeros_like(lp), a[:, None], lp, ctx=ctx).keep is not None
    q = lg([[[0.3, 0.2, 0.1], [0.3, 0.2, 0.1]]])
    trust = DPPO("topk_kl", predictive=True, experimental=True, tail="uniform", vocab_size=2)
    with pytest.raises(InputError) as e:
        policy_loss(lp, lp, a, m, trust=trust, topk_logp=q, topk_behav_logp=q)
    assert _arg(e) == "topk_logp"
    trust = DPPO("topk_kl", predictive=True, experimental=True)
    with pytest.raises(InputError) as e:
        policy_loss(
            lp, lp, a, m, trust=trust, topk_logp=q, topk_behav_logp=q,
            stage_inputs={"sampled_in_topk": torch.ones(2, 2, dtype=torch.bool)},
        )  # fmt: skip
    assert _arg(e) == "sampled_in_topk"


def test_pure_function_bad_input() -> None:
    lp = lg([[0.5, 0.4]])
    q = lg([[[0.3, 0.2], [0.3, 0.2]]])
    cases = [
        (lambda: binary_tv(lp, lg([[0.5]])), "old_logp"),
        (lambda: binary_kl(t([[math.nan, 0.0]]), lp), "logp"),
        (lambda: topk_divergence(q, q, kind="js"), "kind"),  # type: ignore[arg-type]
        (lambda: topk_divergence(q, q[..., :1]), "topk_behav_logp"),
        (lambda: predicted_kl_change(lp, lp, q, q), "experimental"),
        (lambda: predicted_kl_change(lp, lp, q, q, tail="uniform", experimental=True), "vocab_size"),
        (lambda: predicted_kl_change(lp, lp, q, q, vocab_size=1, experimental=True), "vocab_size"),
        (lambda: dppo_mask(lp, lp, t([1.0, 2.0])), "advantages"),
        (lambda: dppo_mask(lp, lp, t([1.0]), divergence="topk_tv"), "topk_logp"),
        (lambda: dppo_loss(lp, lp.exp(), t([[1.0]]), c=-1.0), "c"),
        (lambda: echo_clip_epsilon(t([[0.5]])), "confidence"),
        (lambda: echo_clip_epsilon(t([0.5]), eps_min=0.5), "eps_min"),
        (lambda: tail_confidence(lp, torch.ones(1, 2), window=1.5), "window"),  # type: ignore[arg-type]
        (lambda: tail_confidence(lp, torch.ones(1, 3)), "mask"),
    ]
    for fn, argument in cases:
        with pytest.raises(InputError) as e:
            fn()
        assert _arg(e) == argument, argument
