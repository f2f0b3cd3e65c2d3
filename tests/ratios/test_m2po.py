"""M2PO (arXiv 2510.01161): the paper/AReaL mask and the official code's adaptive clip bounds.

Oracles computed by hand following AReaL (``inclusionAI/AReaL@4aef98d8d818``: ``areal/trainer/ppo/actor.py``
``grpo_loss_fn`` / ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` and ``areal/utils/functional/functional.py``
``ppo_actor_loss_fn`` / ``apply_rejection_sampling``) and the official code (``Infini-AI-Lab/M2PO@af54a3e``
``verl/trainer/ppo/core_algos.py::compute_m2po_policy_loss``).
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rolloutopt import losses
from rolloutopt.errors import InputError
from rolloutopt.losses import Denominators, policy_loss
from rolloutopt.ratios import (
    MIS,
    M2POClip,
    M2POMask,
    MaskOutput,
    PPOClip,
    StageContext,
    TrustOutput,
    m2po_clip_bounds,
    m2po_mask,
)

D = torch.float64


def t(x: object, **kw: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ transcriptions of the two public codes
# Written from the public source (loops, Python floats) to cross-check the vectorised versions.


def areal_mask(d: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """AReaL ``_apply_m2po_masking`` (inclusionAI/AReaL@4aef98d8d), with a stable sort for ties."""
    m2 = (d * d).flatten()[mask.flatten()]
    if m2.numel() == 0:
        return mask.clone()
    sorted_m2, indices = torch.sort(m2, descending=True, stable=True)
    n = sorted_m2.numel()
    num_to_mask = n - 1
    for k in range(n):
        if float(sorted_m2[k:].sum()) / (n - k) < tau:
            num_to_mask = k
            break
    sorted_keep = torch.ones(n, dtype=torch.bool)
    sorted_keep[:num_to_mask] = False
    keep_sel = torch.empty(n, dtype=torch.bool)
    keep_sel[indices] = sorted_keep
    out = torch.zeros(mask.numel(), dtype=torch.bool)
    out[mask.flatten()] = keep_sel
    return out.view_as(mask)


def official_bounds(
    old: torch.Tensor, logp: torch.Tensor, adv_seq: torch.Tensor, mask: torch.Tensor, budget: float
) -> tuple[float, float, float, float]:
    """Infini-AI-Lab/M2PO@af54a3e ``kpo_clip_harmful_tokens`` + ``_solve_tau_from_sorted_delta2`` + floors off.

    Returns (eps_low, eps_high, M2_now, M2_after), M2_after as the code reports it.
    """
    delta = old - logp
    ratio = torch.exp(-delta)
    harm = []
    for i in range(old.shape[0]):
        for j in range(old.shape[1]):
            if not mask[i, j]:
                continue
            a, r = float(adv_seq[i]), float(ratio[i, j])
            if (a > 1e-12 and r > 1 + 1e-12) or (a < -1e-12 and r < 1 - 1e-12):
                harm.append(float(delta[i, j]) ** 2)
    n = len(harm)
    if n == 0:
        return 1.0, 1e5 - 1, 0.0, 0.0
    m2_now = sum(harm) / n
    if m2_now <= budget + 1e-12:
        return 1.0, 1e5 - 1, m2_now, m2_now
    v = sorted(harm)
    target = budget * n
    csum = list(torch.cumsum(torch.tensor(v, dtype=D), 0).tolist())
    for k in range(n):
        rest = n - k - 1
        if (v[k] - 1e-12) * rest + csum[k] >= target - 1e-12:
            if k == 0:
                tau_c, after = 0.0, csum[-1] / n
            else:
                tau_c = max(v[k - 1] - 1e-12, 0.0) ** 0.5  # the code would take sqrt(<0) here; ours clamps at 0
                after = (v[k - 1] * (rest + 1) + csum[k - 1]) / n
            break
    return 1 - math.exp(-tau_c), math.exp(tau_c) - 1, m2_now, after


# --------------------------------------------------------------------------------------------- the mask


def m2(x: MaskOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.keep, x.metrics["m2po_m2"], x.metrics["m2po_m2_kept"]


def test_mask_spec_oracle() -> None:
    # AReaL's rule: log-ratios [0.1, 0.1, 1.0] -> m2 = [0.01, 0.01, 1.0], mean 0.34 > 0.04 -> mask the 1.0 token.
    out = m2po_mask(t([[0.1, 1.0, 0.1, 7.0]]), torch.tensor([[1, 1, 1, 0]]).bool())
    assert isinstance(out, MaskOutput)
    keep, before, after = m2(out)
    assert keep.tolist() == [[True, False, True, False]]
    torch.testing.assert_close(before, t(0.34))
    torch.testing.assert_close(after, t(0.01))
    torch.testing.assert_close(out.metrics["m2po_masked_frac"], t(1 / 3))
    assert all(v.ndim == 0 and not v.requires_grad for v in out.metrics.values())


def test_mask_keeps_everything_below_budget_and_the_single_smallest_when_impossible() -> None:
    keep, before, after = m2(m2po_mask(t([[0.1, -0.15, 0.05]]), torch.ones(1, 3, dtype=torch.bool)))
    assert keep.all()
    torch.testing.assert_close(before, after)
    # every d^2 >= tau: no suffix qualifies, AReaL keeps only the smallest token (num_to_mask = n - 1)
    keep, before, after = m2(m2po_mask(t([[1.0, -3.0], [0.5, 2.0]]), torch.ones(2, 2, dtype=torch.bool), tau=0.04))
    assert keep.tolist() == [[False, False], [True, False]]
    torch.testing.assert_close(before, t((1 + 9 + 0.25 + 4) / 4))
    torch.testing.assert_close(after, t(0.25))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (0, 0)])
def test_mask_empty_batches(shape: tuple[int, int]) -> None:
    out = m2po_mask(torch.zeros(shape, dtype=D), torch.zeros(shape, dtype=torch.bool))
    assert out.keep.shape == shape
    assert all(float(v) == 0 for v in out.metrics.values())


def test_mask_empty_and_all_masked_rows() -> None:
    out = m2po_mask(t([[5.0, 5.0]]), torch.zeros(1, 2, dtype=torch.bool))
    assert not out.keep.any() and all(float(v) == 0 for v in out.metrics.values())
    keep, _, _ = m2(m2po_mask(t([[0.1, 3.0], [9.0, 9.0]]), torch.tensor([[1, 1], [0, 0]]).bool()))
    assert keep.tolist() == [[True, False], [False, False]]


finite_d = st.floats(-3.0, 3.0, allow_nan=False, width=64)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(finite_d, st.booleans()), min_size=1, max_size=24),
    st.floats(0.005, 2.0),
    st.floats(0.005, 2.0),
)
def test_mask_properties_and_areal_transcription(cells: list[tuple[float, bool]], tau1: float, tau2: float) -> None:
    d = t([[v for v, _ in cells]])
    mask = torch.tensor([[k for _, k in cells]])
    keep, before, after = m2(m2po_mask(d, mask, tau=tau1))
    assert torch.equal(keep, areal_mask(d, mask, tau1))
    assert not (keep & ~mask).any()
    n, kept = int(mask.sum()), int(keep.sum())
    if n:
        torch.testing.assert_close(before, (d[mask] ** 2).mean())
        torch.testing.assert_close(after, (d[keep] ** 2).mean())
        assert kept >= 1
        if float(after) >= tau1:  # only the fallback: the single smallest token, itself over budget
            assert kept == 1 and float(after) == float((d[mask] ** 2).min())
        # minimal: putting back the smallest masked token breaks the budget
        masked = mask & ~keep
        if masked.any():
            back = torch.cat([d[keep] ** 2, (d[masked] ** 2).min().reshape(1)])
            assert float(back.mean()) >= tau1 - 1e-12
    # monotone in tau: a larger budget keeps a superset
    lo, hi = sorted((tau1, tau2))
    k_lo = m2po_mask(d, mask, tau=lo).keep
    k_hi = m2po_mask(d, mask, tau=hi).keep
    assert not (k_lo & ~k_hi).any()


def test_mask_stage_removes_tokens_from_numerator_but_not_denominator() -> None:
    # on-policy ratio (r = 1), A = 1: per-token loss -1; the 1.0-token is masked.
    old = t([[-1.0, -2.0, -0.5]])
    behav = old + t([[0.1, 1.0, 0.1]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = policy_loss(old.clone(), old, t([1.0]), mask, behav_logp=behav, trust=M2POMask(), agg="token-mean")
    torch.testing.assert_close(out.loss, t(-2.0 / 3.0))  # the paper's 1 / sum |o_i|: original denominator
    assert math.isclose(float(out.metrics["m2po_masked_frac"]), 1 / 3)
    assert math.isclose(float(out.metrics["m2po_m2"]), 0.34)
    assert math.isclose(float(out.metrics["m2po_m2_kept"]), 0.01)
    assert out.per_token[0, 1] == 0
    out = policy_loss(
        old.clone(),
        old,
        t([1.0]),
        mask,
        behav_logp=behav,
        trust=M2POMask(),
        agg="token-mean",
        removed_in_denominator=False,
    )
    torch.testing.assert_close(out.loss, t(-1.0))  # AReaL's code: the M2PO-kept count


# Two hand-computed AReaL batches. prox = our old_logp (AReaL's prox_logp), behav = AReaL's old_logp,
# d = behav - prox (AReaL's delta = old_logp - prox_logp), x = logp - prox (AReaL's log-ratio).
AREAL_PROX = -1.5
AREAL_D = t([[0.1, -0.1, 1.0], [0.05, 0.0, 0.0]])
AREAL_X = t([[0.1, 0.3, -0.2], [-0.3, 0.05, 0.0]])
AREAL_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
AREAL_ADV = t([1.0, -0.5])


def test_m2po_preset_denominators_against_areal_m2po_only() -> None:
    """AReaL ``grpo_loss_fn`` with ``m2_threshold=0.04``, ``eps_clip=0.2``, no rejection sampling.

    Following ``inclusionAI/AReaL@4aef98d8d818`` ``areal/trainer/ppo/actor.py`` (``grpo_loss_fn``:
    ``loss_mask = _apply_m2po_masking(old_logp, prox_logp, loss_mask, m2_threshold)``) and
    ``areal/utils/functional/functional.py`` (``ppo_actor_loss_fn``: ``loss_mask_count =
    loss_mask.count_nonzero()`` taken on the M2PO-masked mask, ``pg_loss = where(loss_mask, max(-A r, -A clip(r,
    0.8, 1.2)), 0).sum() / loss_mask_count``). By hand: d^2 = [0.01, 0.01, 1.0, 0.0025, 0] over the 5 loss
    tokens, mean 0.2045 >= 0.04; without the 1.0 token 0.0225 / 4 = 0.005625 < 0.04, so AReaL masks one token and
    divides by 4. Kept: row 0 (A = 1) r = e^0.1 = 1.105171 (unclipped, -1.105171) and r = e^0.3 = 1.349859
    (clipped at 1.2, -1.2); row 1 (A = -0.5) r = e^-0.3 = 0.740818 (clipped at 0.8, +0.4) and r = e^0.05 =
    1.051271 (+0.525636). Sum -1.3795354, AReaL's loss -1.3795354 / 4 = -0.3448838; the gradient is -A r / 4 on
    the two unclipped tokens (-0.2762927 and +0.1314089) and 0 elsewhere.
    """
    prox = torch.full((2, 3), AREAL_PROX, dtype=D)
    behav = prox + AREAL_D
    logp = (prox + AREAL_X).requires_grad_()
    trust = M2POMask(tau=0.04, clip=PPOClip(0.2, 0.2, dual=None))  # AReaL keeps its PPO clip
    preset = losses.get("m2po")
    assert preset.config["removed_in_denominator"] is True  # the paper's convention, documented
    areal = preset(logp, prox, AREAL_ADV, AREAL_MASK, behav_logp=behav, trust=trust, removed_in_denominator=False)
    torch.testing.assert_close(areal.loss, t(-0.3448838424719090), rtol=0, atol=1e-12)
    areal.loss.backward()
    assert logp.grad is not None
    want = t([[-0.27629272951891193, 0.0, 0.0], [0.0, 0.13140888704700301, 0.0]])
    torch.testing.assert_close(logp.grad, want, rtol=0, atol=1e-12)
    # the preset's default divides by all five loss tokens (the paper's 1 / sum |o_i|)
    paper = preset(logp.detach(), prox, AREAL_ADV, AREAL_MASK, behav_logp=behav, trust=trust)
    torch.testing.assert_close(paper.loss, t(-1.3795353698876358 / 5), rtol=0, atol=1e-12)


def test_m2po_with_rejection_sampling_against_areal_example_config() -> None:
    """AReaL's M2PO example (``examples/math/gsm8k_m2po.yaml``: ``m2_threshold: 0.04``, ``eps_clip: 0.0``,
    ``use_decoupled_loss: true``, ``rejection_sampling: {metric: ratio, upper: 5.0}``), by hand.

    Following ``inclusionAI/AReaL@4aef98d8d818``: ``areal/trainer/ppo/actor.py::grpo_loss_fn`` applies the M2PO
    mask to ``loss_mask``; ``areal/utils/functional/functional.py::ppo_actor_loss_fn`` then takes
    ``loss_mask_count`` (the M2PO-kept count) *before* ``apply_rejection_sampling`` (token level, mask action:
    tokens with ``exp(prox - behav) > 5`` leave ``loss_mask``, the others get the weight ``exp(prox - behav)``),
    and divides the sum by that count. Batch: row 0 (A = +1) has 51 tokens, one with d = behav - prox = 2.0, one
    with d = -1.7 and 49 with d = 0, all with logp - prox = -0.1; row 1 (A = -1) has 50 tokens with d = 0.01 and
    logp - prox = +0.1, and one pad. M2: (4 + 2.89 + 50e-4) / 101 = 0.06827 >= 0.04; without the d = 2 token
    2.895 / 100 = 0.02895 < 0.04, so M2PO masks one token and keeps 100. Rejection: e^1.7 = 5.474 > 5 drops the
    d = -1.7 token. With eps_clip = 0 the clipped ratio is 1: row 0 loss max(-e^-0.1, -1) = -0.904837, weight 1,
    49 tokens; row 1 max(e^0.1, 1) = 1.105171, weight e^-0.01 = 0.990050, 50 tokens. Sum 10.3716807;
    AReaL's loss 10.3716807 / 100 = 0.1037168. ``removed_in_denominator=False`` divides by 99 (1.0% off) and
    ``True`` by 101: only ``Denominators(tokens=<M2PO-kept count>)`` gives AReaL's number.
    """
    T = 51
    prox = torch.full((2, T), -2.5, dtype=D)
    d = torch.zeros(2, T, dtype=D)
    d[0, 0], d[0, 1], d[1, :50] = 2.0, -1.7, 0.01
    x = torch.full((2, T), -0.1, dtype=D)
    x[1] = 0.1
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, 50] = False
    adv = t([1.0, -1.0])
    behav, logp = prox + d, (prox + x).requires_grad_()
    kw = {
        "behav_logp": behav,
        "trust": M2POMask(tau=0.04, clip=PPOClip(0.0, 0.0, dual=None)),
        "correction": MIS(low=None, high=5.0, level="token"),  # AReaL's rejection sampling, ratio metric
        "agg": "token-mean",
    }
    kept = m2po_mask(behav - prox, mask, tau=0.04).keep.sum()
    assert int(kept) == 100
    out = policy_loss(logp, prox, adv, mask, denominators=Denominators(tokens=kept), **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(out.loss, t(0.10371680701498512), rtol=0, atol=1e-12)
    out.loss.backward()
    assert logp.grad is not None
    # unclipped tokens only (eps_clip = 0 clips the others): -A r w / 100
    torch.testing.assert_close(logp.grad[0, 2], t(-0.009048374180359595), rtol=0, atol=1e-12)
    torch.testing.assert_close(logp.grad[1, 0], t(0.010941742837052104), rtol=0, atol=1e-12)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == 0  # M2PO-masked, rejected
    leave = policy_loss(logp.detach(), prox, adv, mask, removed_in_denominator=False, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(leave.loss, t(10.371680701498512 / 99), rtol=0, atol=1e-12)
    stay = policy_loss(logp.detach(), prox, adv, mask, **kw)  # type: ignore[arg-type]
    torch.testing.assert_close(stay.loss, t(10.371680701498512 / 101), rtol=0, atol=1e-12)


def test_mask_stage_is_unclipped_by_default_and_areal_clip_on_request() -> None:
    old = t([[-1.0, -1.0, -1.0]])
    logp = t([[-0.5, -1.0, -1.2]], requires_grad=True)  # r = e^0.5 (beyond 1.2), 1, e^-0.2
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = policy_loss(logp, old, t([1.0]), mask, behav_logp=old, trust=M2POMask(), agg="token-mean")
    r = torch.exp(logp.detach() - old)
    torch.testing.assert_close(out.loss, -r.mean())
    clipped = policy_loss(
        logp, old, t([1.0]), mask, behav_logp=old, trust=M2POMask(clip=PPOClip(0.2, 0.2, None)), agg="token-mean"
    )
    torch.testing.assert_close(clipped.loss, -(torch.minimum(r, torch.full_like(r, 1.2))).mean())
    assert float(clipped.metrics["clipfrac"]) == pytest.approx(1 / 3)


def test_mask_stage_on_policy_reduces_to_plain_surrogate() -> None:
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 5, generator=g, dtype=D)
    old = logp + 0.1 * torch.randn(3, 5, generator=g, dtype=D)
    mask = torch.rand(3, 5, generator=g) < 0.8
    adv = torch.randn(3, generator=g, dtype=D)
    a = policy_loss(logp, old, adv, mask, behav_logp=old, trust=M2POMask())
    b = policy_loss(logp, old, adv, mask, trust=None)
    torch.testing.assert_close(a.loss, b.loss)
    # on-policy: r = 1, the loss is -mean(A)
    c = policy_loss(logp, None, adv, mask, trust=M2POMask(pair="old_current"), agg="token-mean")
    torch.testing.assert_close(c.loss, -(adv[:, None].expand_as(logp)[mask]).sum() / mask.sum())


def test_mask_stage_old_current_pair_uses_proximal_vs_current() -> None:
    old = t([[-1.0, -1.0, -1.0]])
    logp = old + t([[0.1, 1.0, -0.1]])
    stage = M2POMask(pair="old_current")
    ctx = StageContext(logp=logp, old_logp=old, mask=torch.ones(1, 3, dtype=torch.bool), advantages=t([[1.0]]))
    out = stage(torch.exp(logp - old), logp - old, t([[1.0]]), logp, ctx=ctx)
    assert out.keep is not None and out.keep.tolist() == [[True, False, True]]


def test_mask_stage_gradcheck() -> None:
    g = torch.Generator().manual_seed(2)
    old = -1.2 - torch.rand(2, 4, generator=g, dtype=D)  # behav = old + d stays a log-prob (< 0)
    behav = old + t([[0.05, 1.0, -0.02, 0.1], [0.0, -0.1, 0.9, 0.03]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
    adv = t([0.7, -1.3])
    lp0 = old + 0.05 * torch.randn(2, 4, generator=g, dtype=D)
    for stage in (M2POMask(), M2POMask(clip=PPOClip(0.2, 0.2, None))):

        def f(lp: torch.Tensor, stage: M2POMask = stage) -> torch.Tensor:
            return policy_loss(lp, old, adv, mask, behav_logp=behav, trust=stage).loss

        assert torch.autograd.gradcheck(f, (lp0.clone().requires_grad_(),))


def test_mask_stage_needs_context_and_behaviour() -> None:
    x = t([[0.0, 0.0]])
    with pytest.raises(InputError, match="ctx"):
        M2POMask()(x.exp(), x, x, x)
    with pytest.raises(InputError, match="behav_logp"):
        policy_loss(x, x, t([1.0]), torch.ones(1, 2, dtype=torch.bool), trust=M2POMask())


# ------------------------------------------------------------------------------------- the adaptive clip


def test_clip_bounds_spec_oracle() -> None:
    # the official code: harmful Delta^2 = [0.01, 0.01, 1.0], tau = 0.04 -> tau_c = 0.1 -> eps 0.0952 / 0.1052.
    # log r = -Delta; harmful: (A > 0, r > 1) or (A < 0, r < 1). The fourth token (A < 0, r > 1) is not.
    lr = t([[0.1, -0.1, 1.0, 3.0]])
    adv = t([[1.0, -1.0, 1.0, -1.0]])
    b = m2po_clip_bounds(lr, adv, torch.ones(1, 4, dtype=torch.bool))
    assert b.harmful.tolist() == [[True, True, True, False]]
    assert bool(b.clipping)
    torch.testing.assert_close(b.tau_c, t(0.1))
    assert float(b.low) == pytest.approx(1 - math.exp(-0.1)) == pytest.approx(0.0952, abs=5e-5)
    assert float(b.high) == pytest.approx(math.exp(0.1) - 1) == pytest.approx(0.1052, abs=5e-5)
    torch.testing.assert_close(b.m2, t(0.34))
    torch.testing.assert_close(b.m2_after, t(0.01))  # sum min(v, 0.01) / 3


def test_clip_bounds_no_clip_zero_cap_and_floors() -> None:
    mask = torch.ones(1, 3, dtype=torch.bool)
    b = m2po_clip_bounds(t([[0.1, 0.1, -0.1]]), t([[1.0, 1.0, 1.0]]), mask)
    assert not bool(b.clipping) and float(b.low) == 1.0 and float(b.high) == 1e5 - 1
    torch.testing.assert_close(b.m2, t(0.01))  # two harmful tokens (A > 0, r > 1), 0.01 each
    # no harmful token at all (A = 0)
    b = m2po_clip_bounds(t([[2.0, -2.0]]), t([0.0]), torch.ones(1, 2, dtype=torch.bool))
    assert not bool(b.clipping) and float(b.m2) == 0.0
    # the smallest harmful Delta^2 already >= tau: k = 0, tau_c = 0, both bounds collapse to 1
    b = m2po_clip_bounds(t([[0.5, 1.0]]), t([1.0]), torch.ones(1, 2, dtype=torch.bool))
    assert bool(b.clipping) and float(b.tau_c) == 0 and float(b.low) == 0 and float(b.high) == 0
    assert float(b.m2_after) == 0  # the capped moment (the code reports the pre-clip M2 here)
    b = m2po_clip_bounds(t([[0.5, 1.0]]), t([1.0]), torch.ones(1, 2, dtype=torch.bool), miniclip_low=0.3)
    assert float(b.low) == pytest.approx(0.3) and float(b.high) == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(finite_d, st.booleans()), min_size=2, max_size=20),
    st.lists(st.sampled_from([-1.5, -0.5, 0.0, 0.5, 2.0]), min_size=2, max_size=2),
    st.floats(0.01, 1.0),
    st.floats(0.01, 1.0),
)
def test_clip_bounds_match_official_transcription(
    cells: list[tuple[float, bool]], advs: list[float], tau: float, tau2: float
) -> None:
    T = len(cells) // 2
    assume(T >= 1)
    lr = t([[v for v, _ in cells[:T]], [v for v, _ in cells[T : 2 * T]]])
    mask = torch.tensor([[k for _, k in cells[:T]], [k for _, k in cells[T : 2 * T]]])
    adv = t(advs)
    old = -4.0 * torch.ones_like(lr)  # logp = old + lr stays a log-prob (|lr| <= 3)
    logp = old + lr
    lr = logp - old  # the log-ratio both sides see (old + lr - old rounds: a 1e-6 entry is not exactly 1e-6)
    b = m2po_clip_bounds(lr, adv, mask, tau=tau)
    low, high, m2_now, after = official_bounds(old, logp, adv, mask, tau)
    assert float(b.low) == pytest.approx(low, abs=1e-12)
    assert float(b.high) == pytest.approx(high, abs=1e-9)
    assert float(b.m2) == pytest.approx(m2_now, abs=1e-12)
    if float(b.tau_c) > 0 or not bool(b.clipping):
        assert float(b.m2_after) == pytest.approx(after, abs=1e-12)
        assert float(b.m2_after) <= tau + 1e-9  # the conservative rule stays under budget
    # loss parity: token-mean of the PPO clip with the code's bounds
    out = policy_loss(logp, old, adv, mask, trust=M2POClip(tau=tau), agg="token-mean")
    r = torch.exp(lr)
    a = adv[:, None]
    ref = torch.maximum(-a * r, -a * r.clamp(1 - low, 1 + high))
    torch.testing.assert_close(out.loss, (ref * mask).sum() / mask.sum().clamp(min=1), atol=1e-10, rtol=0)
    # monotone in tau: a larger budget never tightens the bounds
    lo_tau, hi_tau = sorted((tau, tau2))
    b_lo = m2po_clip_bounds(lr, adv, mask, tau=lo_tau)
    b_hi = m2po_clip_bounds(lr, adv, mask, tau=hi_tau)
    assert float(b_hi.low) >= float(b_lo.low) - 1e-12 and float(b_hi.high) >= float(b_lo.high) - 1e-12
    assert 0 <= float(b.low) <= 1 and math.isfinite(float(b.high))


def test_clip_stage_gradient_zero_on_clipped_tokens() -> None:
    lr = t([[0.1, -0.1, 1.0, 0.05]])
    old = -torch.ones(1, 4, dtype=D)
    logp = (old + lr).requires_grad_()
    adv = t([[1.0, -1.0, 1.0, 1.0]])
    out = policy_loss(logp, old, adv, torch.ones(1, 4, dtype=torch.bool), trust=M2POClip(), agg="token-mean")
    out.loss.backward()
    assert logp.grad is not None
    # tau_c^2 = 0.01 - 1e-12 (the code's tolerance), so the bounds are just inside [e^-0.1, e^0.1]: tokens 0
    # and 1 (|log r| = 0.1, the breakpoint) and token 2 are clipped (zero gradient); token 3 is inside
    r = torch.exp(lr)
    expected = t([[0.0, 0.0, 0.0, -float(r[0, 3]) / 4]])
    torch.testing.assert_close(logp.grad, expected)
    assert float(out.metrics["clip_high_frac"]) == pytest.approx(0.5)
    assert float(out.metrics["clip_low_frac"]) == pytest.approx(0.25)
    assert float(out.metrics["m2po_clip_high"]) == pytest.approx(math.exp(0.1) - 1)


def test_clip_stage_gradcheck_and_on_policy() -> None:
    g = torch.Generator().manual_seed(3)
    old = -0.5 - torch.rand(2, 5, generator=g, dtype=D)
    lp0 = old + 0.05 * torch.randn(2, 5, generator=g, dtype=D)  # M2 ~ 0.0025 < 0.04: bounds constant
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).bool()
    adv = t([1.0, -0.5])
    assert torch.autograd.gradcheck(
        lambda lp: policy_loss(lp, old, adv, mask, trust=M2POClip()).loss, (lp0.clone().requires_grad_(),)
    )
    a = policy_loss(lp0, None, adv, mask, trust=M2POClip())
    b = policy_loss(lp0, None, adv, mask, trust=None)
    torch.testing.assert_close(a.loss, b.loss)


# --------------------------------------------------------------------------- evidence: a heavy-tailed batch


def test_m2po_masks_far_fewer_tokens_than_ppo_clips_on_a_stale_heavy_tailed_batch() -> None:
    """The paper's claim (arXiv 2510.01161, staleness 256): M2PO removes only the extreme outliers.

    32,768 tokens whose behaviour-vs-proximal log-ratio d is Student-t with 2 degrees of freedom scaled by
    0.1 (T = Z / sqrt(-log U) for df = 2: most |d| are small, the tail is heavy), advantages ±1 per row.
    PPO with clip 0.2 on the stale ratio r = exp(-d) clips 9.00% of the tokens (clipfrac; 21.0% lie outside
    [0.8, 1.2]); M2PO's mask (tau 0.04) removes 0.50%, and the kept tokens' second moment is 0.03999 < 0.04
    (0.124 before, d clamped at ±20). Measured with torch.Generator().manual_seed(0), float64.
    """
    g = torch.Generator().manual_seed(0)
    B, T = 64, 512
    z = torch.randn(B, T, generator=g, dtype=D)
    u = torch.rand(B, T, generator=g, dtype=D).clamp(min=1e-300)
    d = 0.1 * z / torch.sqrt(-torch.log(u))
    old = -40.1 - 2 * torch.rand(B, T, generator=g, dtype=D)  # max d is 38.8: behav = old + d stays < 0
    behav = old + d
    adv = torch.where(torch.rand(B, generator=g) < 0.5, 1.0, -1.0).to(D)
    mask = torch.ones(B, T, dtype=torch.bool)
    ppo = policy_loss(old, behav, adv, mask, trust=PPOClip(0.2, 0.2, dual=None))
    m2 = policy_loss(old.clone(), old, adv, mask, behav_logp=behav, trust=M2POMask(tau=0.04))
    clipped = float(ppo.metrics["clipfrac"])
    masked = float(m2.metrics["m2po_masked_frac"])
    print(f"PPO clipfrac {clipped:.4f}, M2PO masked {masked:.4f}, M2 {float(m2.metrics['m2po_m2']):.4f}")
    assert 0.0 < masked < clipped / 5
    assert float(m2.metrics["m2po_m2_kept"]) < 0.04 < float(m2.metrics["m2po_m2"])


# ----------------------------------------------------------------------- empty batches and declared inputs

EMPTY_SHAPES = [(0, 4), (3, 0), (0, 0), (2, 3)]  # B = 0, T = 0, both, all-masked rows


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("stage", [M2POMask(), M2POMask(pair="old_current"), M2POClip(), M2POClip(0.04, 0.3, 0.5)])
def test_stages_on_empty_batches_give_zero_loss(shape: tuple[int, int], stage: object) -> None:
    lp = torch.full(shape, -1.0, dtype=D, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)
    adv = torch.ones(shape[0], dtype=D)
    behav = {"behav_logp": lp.detach() - 0.5} if isinstance(stage, M2POMask) and stage.pair == "behav_old" else {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        out = policy_loss(lp, lp.detach() + 0.1, adv, mask, trust=stage, agg=agg, **behav)  # type: ignore[arg-type]
        assert float(out.loss.detach()) == 0.0
        assert all(bool(torch.isfinite(v)) for v in out.metrics.values())
        out.loss.backward()
        assert lp.grad is not None and not lp.grad.any()


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_clip_bounds_on_empty_batches(shape: tuple[int, int]) -> None:
    b = m2po_clip_bounds(torch.zeros(shape, dtype=D), torch.ones(shape[0], dtype=D), torch.zeros(shape).bool())
    assert not bool(b.clipping) and float(b.m2) == 0 and float(b.low) == 1.0 and float(b.high) == 1e5 - 1
    b = m2po_clip_bounds(
        torch.zeros(shape, dtype=D), torch.ones(shape[0], dtype=D), torch.zeros(shape).bool(), miniclip_high=2e5
    )
    assert float(b.high) == 2e5


def ctx_of(stage_inputs: dict[str, torch.Tensor]) -> StageContext:
    lp = t([[-1.0, -2.0, -0.5]])
    return StageContext(
        logp=lp, old_logp=lp - 0.1, mask=torch.ones(1, 3, dtype=torch.bool), advantages=t([[1.0]]), **stage_inputs
    )


@pytest.mark.parametrize(
    ("stage", "requires", "accepts"),
    [
        (M2POMask(), ("behav_logp",), ()),
        (M2POMask(pair="old_current"), (), ()),
        (M2POClip(), (), ()),
    ],
)
def test_declared_inputs_match_what_the_stage_reads(
    stage: Any, requires: tuple[str, ...], accepts: tuple[str, ...]
) -> None:
    assert stage.requires == requires and stage.accepts == accepts
    lp = t([[-1.0, -2.0, -0.5]])
    args = (torch.ones(1, 3, dtype=D), torch.zeros(1, 3, dtype=D), t([[1.0]]), lp)
    full = ctx_of({"behav_logp": lp + 0.2})
    assert isinstance(stage(*args, ctx=full), TrustOutput)
    for name in requires:  # a context lacking a required input raises, naming it
        with pytest.raises(InputError) as e:
            stage(*args, ctx=replace(full, **{name: None}))
        assert e.value.argument == name
    if not requires:  # nothing beyond the common inputs: runs on a bare context
        assert isinstance(stage(*args, ctx=ctx_of({})), TrustOutput)
    # policy_loss accepts exactly the declared inputs
    mask = torch.ones(1, 3, dtype=torch.bool)
    if requires:
        policy_loss(lp, lp - 0.1, t([1.0]), mask, trust=stage, behav_logp=lp + 0.2)  # type: ignore[arg-type]
    else:
        with pytest.raises(InputError, match="behav_logp"):
            policy_loss(lp, lp - 0.1, t([1.0]), mask, trust=stage, behav_logp=lp + 0.2)  # type: ignore[arg-type]


def test_declarations_are_read_only() -> None:
    stage = M2POMask()
    with pytest.raises(AttributeError):
        stage.requires = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        M2POClip().accepts = ("x",)  # type: ignore[misc]
    assert "requires" not in {f.name for f in fields(M2POMask)}


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: M2POMask(tau=0.0), "M2POMask.tau"),
        (lambda: M2POMask(pair="behaviour"), "M2POMask.pair"),  # type: ignore[arg-type]
        (lambda: M2POMask(clip=0.2), "M2POMask.clip"),  # type: ignore[arg-type]
        (lambda: M2POMask(clamp=-1.0), "M2POMask.clamp"),
        (lambda: M2POClip(tau=-0.04), "M2POClip.tau"),
        (lambda: M2POClip(miniclip_low=-0.1), "M2POClip.miniclip_low"),
        (lambda: M2POClip(miniclip_low=1.5), "M2POClip.miniclip_low"),
        (lambda: M2POClip(miniclip_high=-1.0), "M2POClip.miniclip_high"),
    ],
)
def test_bad_hyper_parameters(make: object, arg: str) -> None:
    with pytest.raises(InputError) as e:
        make()
    assert e.value.argument == arg


def test_bad_tensors() -> None:
    with pytest.raises(InputError, match=r"^mask"):
        m2po_mask(t([[0.1, 0.2]]), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(InputError, match=r"^log_ratio"):
        m2po_mask(t([[math.nan, 0.2]]), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(InputError, match=r"^tau"):
        m2po_mask(t([[0.1]]), torch.ones(1, 1, dtype=torch.bool), tau=0)
    with pytest.raises(InputError, match=r"^advantages"):
        m2po_clip_bounds(t([[0.1, 0.2]]), t([1.0, 2.0, 3.0]), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(InputError, match=r"^advantages"):
        m2po_clip_bounds(t([[0.1, 0.2]]), t([math.inf]), torch.ones(1, 2, dtype=torch.bool))
