"""Proximal policies: A-3PO, PPO-EWMA (reconstructed), CoPRIS, and the decoupled PPO loss.

Oracles computed by hand following AReaL (``inclusionAI/AReaL@4aef98d8d``
``areal/utils/functional/functional.py::ppo_actor_loss_fn``, ``areal/trainer/ppo/actor.py``) and CoPRIS
(``777pomingzi/CoPRIS@43ee8c7`` ``verl/trainer/ppo/ray_trainer.py``); PPO-EWMA's is our reconstruction (see
docs/methods/offpolicy.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt import losses
from rolloutopt.errors import InputError
from rolloutopt.losses import CorrectionOutput, policy_loss
from rolloutopt.ratios import (
    A3POProximal,
    CoPRISProximal,
    EWMAProximal,
    PPOClip,
    StageContext,
    a3po_alpha,
    a3po_proximal_logp,
    copris_old_logp,
    factorise_log_ratio,
)

D = torch.float64


def t(x: object, **kw: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D, **kw)  # type: ignore[arg-type]


def ones(b: int, n: int) -> torch.Tensor:
    return torch.ones(b, n, dtype=torch.bool)


# ------------------------------------------------------------------------------------------------- A-3PO


def test_a3po_alpha_spec_oracle() -> None:
    # v_theta = 10, v_prox = 9. v_beh = 9 -> 0; 7 -> (9-7)/(10-7) = 2/3; 8 -> 1/2; 10 (= v_theta) -> 0;
    # 12 (newer than v_theta) -> 0; -1 (prompt token) -> 0; 0 -> 9/10
    versions = torch.tensor([[9, 7, 8, 10, 12, -1, 0]])
    torch.testing.assert_close(a3po_alpha(versions, 10, dtype=D), t([[0.0, 2 / 3, 0.5, 0.0, 0.0, 0.0, 0.9]]))


def test_a3po_loglinear_and_linear_by_hand() -> None:
    behav = t([[-1.0, -2.0, -0.5]])
    logp = t([[-1.5, -1.0, -0.5]], requires_grad=True)
    versions = torch.tensor([[4, 2, 2]])  # v_theta = 5: alpha = [0, 2/3, 2/3]
    ll = a3po_proximal_logp(logp, behav, versions, 5)
    torch.testing.assert_close(ll, t([[-1.0, -2.0 + 2 / 3 * 1.0, -0.5]]))
    assert not ll.requires_grad  # the proximal policy carries no gradient
    lin = a3po_proximal_logp(logp, behav, versions, 5, method="linear")
    p = [math.exp(-1.0), (1 / 3) * math.exp(-2.0) + (2 / 3) * math.exp(-1.0), math.exp(-0.5)]
    torch.testing.assert_close(lin, t([[math.log(x) for x in p]]))
    # AReaL's formula (log of the probability mix + 1e-10) agrees to ~1e-10 / p
    areal = torch.log((1 - 2 / 3) * behav.exp() + 2 / 3 * logp.detach().exp() + 1e-10)
    torch.testing.assert_close(lin[:, 1], areal[:, 1], atol=1e-9, rtol=0)


def test_a3po_one_version_behind_is_behaviour_exactly_and_mask_zeroes() -> None:
    torch.manual_seed(0)
    behav, logp = -torch.rand(3, 4), -torch.rand(3, 4)
    v = torch.full((3, 4), 6)
    for method in ("loglinear", "linear"):
        assert torch.equal(a3po_proximal_logp(logp, behav, v, 7, method=method), behav)  # type: ignore[arg-type]
    m = torch.tensor([[1, 1, 0, 0]] * 3, dtype=torch.bool)
    behav[:, 2:] = math.nan  # garbage in the padding
    out = a3po_proximal_logp(logp, behav, v - 2, 7, mask=m)
    assert torch.equal(out[:, 2:], torch.zeros(3, 2)) and torch.isfinite(out).all()


def test_a3po_stage_in_policy_loss_equals_precomputed_proximal() -> None:
    g = torch.Generator().manual_seed(1)
    behav = -torch.rand(3, 5, generator=g, dtype=D) - 0.2
    base = behav + 0.1 * torch.randn(3, 5, generator=g, dtype=D)
    versions = torch.randint(3, 8, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = t([1.0, -1.0, 0.5])
    for method in ("loglinear", "linear"):
        lp1 = base.clone().requires_grad_()
        out1 = policy_loss(
            lp1,
            None,
            adv,
            mask,
            behav_logp=behav,
            versions=versions,
            policy_version=8,
            proximal=A3POProximal(method=method),  # type: ignore[arg-type]
        )
        out1.loss.backward()
        prox = a3po_proximal_logp(base, behav, versions, 8, method=method, mask=mask)  # type: ignore[arg-type]
        lp2 = base.clone().requires_grad_()
        out2 = policy_loss(lp2, prox, adv, mask)
        out2.loss.backward()
        torch.testing.assert_close(out1.loss, out2.loss)
        torch.testing.assert_close(lp1.grad, lp2.grad)
        assert float(out1.metrics["staleness_max"]) == 8 - int(versions[mask].min())


def test_a3po_stage_needs_its_inputs() -> None:
    lp, m, adv = torch.zeros(2, 3), ones(2, 3), torch.ones(2)
    v = torch.zeros(2, 3, dtype=torch.long)
    given = {"behav_logp": lp, "versions": v, "policy_version": 1}
    for name in A3POProximal.requires:
        kw = {k: x for k, x in given.items() if k != name}
        with pytest.raises(InputError) as e:
            policy_loss(lp, None, adv, m, proximal=A3POProximal(), **kw)  # type: ignore[arg-type]
        assert e.value.argument == name
        # the stage itself names the missing input and itself
        ctx = StageContext(logp=lp, old_logp=None, mask=m, advantages=adv[:, None], **kw)  # type: ignore[arg-type]
        with pytest.raises(InputError, match=rf"^{name}.*A3POProximal"):
            A3POProximal()(ctx)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 20), st.floats(1e-3, 50.0))
def test_a3po_between_behaviour_and_current_and_alpha_monotone(seed: int, vt: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    behav = -scale * torch.rand(4, 6, generator=g, dtype=D)
    logp = -scale * torch.rand(4, 6, generator=g, dtype=D)
    versions = torch.randint(-1, vt + 2, (4, 6), generator=g)
    lo, hi = torch.minimum(behav, logp), torch.maximum(behav, logp)
    for method in ("loglinear", "linear"):
        out = a3po_proximal_logp(logp, behav, versions, vt, method=method)  # type: ignore[arg-type]
        assert torch.isfinite(out).all()
        assert (out >= lo - 1e-9).all() and (out <= hi + 1e-9).all()
    # alpha in [0, 1] and non-decreasing in staleness v_theta - v_beh (generated tokens)
    lag = torch.arange(0, 30)
    a = a3po_alpha((vt + 30 - lag)[None, :], vt + 30, dtype=D)[0]
    assert (a >= 0).all() and (a <= 1).all() and (a.diff() >= 0).all()


def test_a3po_bad_inputs() -> None:
    lp = torch.zeros(2, 3)
    v = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(InputError, match=r"A3POProximal\.method"):
        A3POProximal(method="geometric")  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^method"):
        a3po_proximal_logp(lp, lp, v, 1, method="x")  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^versions"):
        a3po_proximal_logp(lp, lp, v.float(), 1)
    with pytest.raises(InputError, match=r"^versions"):
        a3po_proximal_logp(lp, lp, v[:, :2], 1)
    with pytest.raises(InputError, match=r"^policy_version"):
        a3po_proximal_logp(lp, lp, v, 1.0)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^behav_logp"):
        a3po_proximal_logp(lp, torch.zeros(2, 4), v, 1)
    with pytest.raises(InputError, match=r"^behav_logp"):
        a3po_proximal_logp(lp, torch.full((2, 3), math.inf), v, 1)


# ----------------------------------------------------------------------------- decoupled PPO, composed


@dataclass(frozen=True)
class _BehaviourWeight:
    """Test-local correction: AReaL's behaviour weight w = exp(prox - behav), tokens with w > cap masked."""

    cap: float = 5.0
    requires: ClassVar[tuple[str, ...]] = ("behav_logp",)

    def __call__(self, ctx: StageContext) -> CorrectionOutput:
        assert ctx.old_logp is not None and ctx.behav_logp is not None
        w = (ctx.old_logp - ctx.behav_logp).clamp(-20, 20).exp().detach()
        keep = w <= self.cap
        return CorrectionOutput(torch.where(keep, w, torch.zeros_like(w)), keep, {})


def _areal_decoupled(
    logp: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """AReaL ``ppo_actor_loss_fn`` written out: eps 0.2, no eps_high, no c_clip, behav_imp_weight_cap 5."""
    u = torch.exp(logp - prox)
    a = adv[:, None]
    pg = torch.maximum(-a * u, -a * u.clamp(0.8, 1.2))
    w = torch.exp(prox - behav)
    behav_mask = (w <= 5.0) & mask
    pg = pg * torch.where(behav_mask, w, torch.zeros_like(w))
    return torch.where(mask, pg, torch.zeros_like(pg)).sum() / mask.sum()  # original token count


def _decoupled_batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(4, 6, generator=g, dtype=D) - 4.1  # prox = behav + noise and logp stay log-probs
    prox = behav + 0.8 * torch.randn(4, 6, generator=g, dtype=D)  # some w = e^{prox-behav} > 5
    prox[0, 0] = behav[0, 0] + math.log(6.0)  # at least one rejected token
    logp = prox + 0.3 * torch.randn(4, 6, generator=g, dtype=D)  # some clipped
    mask = torch.rand(4, 6, generator=g) > 0.2
    mask[0, 0] = True
    adv = torch.randn(4, generator=g, dtype=D)
    return logp, prox, behav, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_loss_composed_equals_areal_formula(seed: int) -> None:
    logp, prox, behav, adv, mask = _decoupled_batch(seed)
    lp1 = logp.clone().requires_grad_()
    out = policy_loss(
        lp1,
        prox,
        adv,
        mask,
        behav_logp=behav,
        trust=PPOClip(low=0.2, high=0.2, dual=None),
        correction=_BehaviourWeight(5.0),
        agg="token-mean",
        removed_in_denominator=True,
    )
    out.loss.backward()
    lp2 = logp.clone().requires_grad_()
    ref = _areal_decoupled(lp2, prox, behav, adv, mask)
    ref.backward()
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(lp1.grad, lp2.grad)
    rejected = ((prox - behav).exp() > 5.0) & mask
    assert bool(rejected.any())
    torch.testing.assert_close(out.metrics["masked_frac"], rejected.sum().to(D) / mask.sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_preset_with_library_mis_equals_areal_formula(seed: int) -> None:
    # the decoupled_ppo composition with the library's correction: MIS(low=None, high=5.0, level="token")
    from rolloutopt.ratios import MIS

    logp, prox, behav, adv, mask = _decoupled_batch(seed)
    lp1 = logp.clone().requires_grad_()
    out = policy_loss(
        lp1,
        prox,
        adv,
        mask,
        behav_logp=behav,
        trust=PPOClip(low=0.2, high=0.2, dual=None),
        correction=MIS(low=None, high=5.0, level="token"),
        agg="token-mean",
    )
    out.loss.backward()
    lp2 = logp.clone().requires_grad_()
    ref = _areal_decoupled(lp2, prox, behav, adv, mask)
    ref.backward()
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(lp1.grad, lp2.grad)


def test_decoupled_loss_with_a3po_proximal_equals_areal_formula() -> None:
    logp, _, behav, adv, mask = _decoupled_batch(3)
    g = torch.Generator().manual_seed(3)
    versions = torch.randint(0, 6, (4, 6), generator=g)
    prox = a3po_proximal_logp(logp, behav, versions, 6, mask=mask)
    lp1 = logp.clone().requires_grad_()
    out = policy_loss(
        lp1,
        None,
        adv,
        mask,
        behav_logp=behav,
        versions=versions,
        policy_version=6,
        proximal=A3POProximal(),
        trust=PPOClip(low=0.2, high=0.2, dual=None),
        correction=_BehaviourWeight(5.0),
        agg="token-mean",
    )
    out.loss.backward()
    lp2 = logp.clone().requires_grad_()
    _areal_decoupled(lp2, prox, behav, adv, mask).backward()
    torch.testing.assert_close(out.loss, _areal_decoupled(logp, prox, behav, adv, mask))
    torch.testing.assert_close(lp1.grad, lp2.grad)


def test_decoupled_spec_oracle_prox_equals_behaviour_is_plain_ppo() -> None:
    # decoupled PPO: l_prox = l_beh => w = 1 and the loss equals plain PPO against l_beh
    logp, _, behav, adv, mask = _decoupled_batch(4)
    trust = PPOClip(low=0.2, high=0.2, dual=None)
    a = policy_loss(logp, behav, adv, mask, behav_logp=behav, trust=trust, correction=_BehaviourWeight())
    b = policy_loss(logp, behav, adv, mask, trust=trust)
    assert torch.equal(a.loss, b.loss)
    torch.testing.assert_close(a.metrics["is_weight_mean"], t(1.0))


def test_decoupled_gradcheck_through_policy_loss() -> None:
    logp, prox, behav, adv, mask = _decoupled_batch(5)
    logp = prox + 0.01 * (logp - prox)  # stay away from the clip kinks

    def f(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            lp,
            prox,
            adv,
            mask,
            behav_logp=behav,
            trust=PPOClip(low=0.2, high=0.2, dual=None),
            correction=_BehaviourWeight(),
        ).loss

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(),))


# ------------------------------------------------------------------------------------------------- CoPRIS


def test_copris_old_logp_spec_oracle() -> None:
    a, b, a2, b2, c, d = -0.1, -0.2, -0.15, -0.25, -0.3, -0.4
    buffered = t([[a, b, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [a, b, c, d]])
    recomputed = t([[a2, b2, c, d], [a2, b2, c, d], [a2, b2, 9.0, 9.0]])
    lengths = torch.tensor([2, 0, 4])
    out = copris_old_logp(buffered, lengths, recomputed)
    # stage-k buffer [a, b] + stage-k+1 recompute [a', b', c, d] -> [a, b, c, d]; a response finished in one
    # stage (nothing buffered) is the plain recompute; a fully buffered one keeps the buffer
    torch.testing.assert_close(out, t([[a, b, c, d], [a2, b2, c, d], [a, b, c, d]]))
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(copris_old_logp(buffered, lengths, recomputed, mask=m)[0], t([a, b, c, 0.0]))


def test_copris_two_stages_100_plus_50_tokens() -> None:
    # CoPRIS: tokens 1-100 generated under v1, 101-150 under v2
    g = torch.Generator().manual_seed(0)
    rec_v1 = -torch.rand(1, 150, generator=g, dtype=D)  # v1's recompute after stage 1 (first 100 valid)
    rec_v2 = -torch.rand(1, 150, generator=g, dtype=D)  # v2's recompute of all 150 after stage 2
    mask1 = torch.zeros(1, 150, dtype=torch.bool)
    mask1[:, :100] = True
    stage1 = copris_old_logp(torch.zeros(1, 150, dtype=D), torch.tensor([0]), rec_v1, mask=mask1)
    stage2 = copris_old_logp(stage1, torch.tensor([100]), rec_v2)
    assert torch.equal(stage2[:, :100], rec_v1[:, :100]) and torch.equal(stage2[:, 100:], rec_v2[:, 100:])

    versions = torch.tensor([[1] * 100 + [2] * 50])
    ctx = StageContext(
        logp=rec_v2, old_logp=rec_v2, mask=ones(1, 150), advantages=t([[1.0]]), behav_logp=stage1, versions=versions
    )
    assert torch.equal(CoPRISProximal()(ctx), stage2)  # policy_version None -> newest = 2
    assert torch.equal(CoPRISProximal()(replace(ctx, policy_version=2)), stage2)
    one_stage = replace(ctx, versions=torch.full((1, 150), 2))
    assert torch.equal(CoPRISProximal()(one_stage), rec_v2)  # one-stage response: plain recompute


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_copris_stage_equals_buffer_concatenation(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n_b, n_t = 5, 8
    buffered = -torch.rand(n_b, n_t, generator=g, dtype=D)
    recomputed = -torch.rand(n_b, n_t, generator=g, dtype=D) - 0.3  # logp = recomputed + noise stays < 0
    lengths = torch.randint(0, n_t + 1, (n_b,), generator=g)
    pos = torch.arange(n_t)
    versions = torch.where(pos[None] < lengths[:, None], torch.randint(0, 3, (n_b, 1), generator=g), 3)
    m = pos[None] < torch.randint(1, n_t + 1, (n_b, 1), generator=g)
    logp = recomputed + 0.05 * torch.randn(n_b, n_t, generator=g, dtype=D)
    adv = torch.randn(n_b, generator=g, dtype=D)
    expected = copris_old_logp(buffered, lengths, recomputed, mask=m)
    a = policy_loss(
        logp, recomputed, adv, m, behav_logp=buffered, versions=versions, policy_version=3, proximal=CoPRISProximal()
    )
    b = policy_loss(logp, expected, adv, m)
    torch.testing.assert_close(a.loss, b.loss)
    assert "staleness_mean" in a.metrics


def test_copris_gradcheck_through_policy_loss() -> None:
    g = torch.Generator().manual_seed(0)
    buffered, recomputed = -torch.rand(3, 5, generator=g, dtype=D), -torch.rand(3, 5, generator=g, dtype=D) - 0.1
    versions = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    logp = recomputed + 0.01 * torch.randn(3, 5, generator=g, dtype=D)
    adv, m = t([1.0, -2.0, 0.5]), ones(3, 5)

    def f(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            lp, recomputed, adv, m, behav_logp=buffered, versions=versions, proximal=CoPRISProximal()
        ).loss

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(),))


def test_copris_bad_inputs() -> None:
    buf = torch.zeros(2, 3)
    with pytest.raises(InputError, match=r"^buffered_len"):
        copris_old_logp(buf, torch.tensor([1, 4]), buf)
    with pytest.raises(InputError, match=r"^buffered_len"):
        copris_old_logp(buf, torch.tensor([1, -1]), buf)
    with pytest.raises(InputError, match=r"^buffered_len"):
        copris_old_logp(buf, torch.tensor([1.0, 2.0]), buf)
    with pytest.raises(InputError, match=r"^buffered_len"):
        copris_old_logp(buf, torch.tensor([1, 2, 3]), buf)
    with pytest.raises(InputError, match=r"^recomputed"):
        copris_old_logp(buf, torch.tensor([1, 2]), torch.zeros(2, 4))
    with pytest.raises(InputError, match=r"^recomputed"):
        copris_old_logp(buf, torch.tensor([1, 2]), torch.full((2, 3), math.nan))
    copris_old_logp(buf, torch.tensor([3, 3]), torch.full((2, 3), math.nan))  # recompute unused: fine
    with pytest.raises(InputError, match=r"^buffered"):
        copris_old_logp(torch.full((2, 3), math.inf), torch.tensor([1, 0]), buf)
    lp, adv, m = torch.zeros(2, 3), torch.ones(2), ones(2, 3)
    with pytest.raises(InputError) as e:
        policy_loss(lp, lp, adv, m, behav_logp=lp, proximal=CoPRISProximal())
    assert e.value.argument == "versions"
    ctx = StageContext(logp=lp, old_logp=lp, mask=m, advantages=adv[:, None], behav_logp=lp)
    with pytest.raises(InputError, match=r"^versions.*CoPRISProximal"):
        CoPRISProximal()(ctx)
    with pytest.raises(InputError, match=r"old_logp.*CoPRISProximal"):
        policy_loss(
            lp, None, adv, m, behav_logp=lp, versions=torch.zeros(2, 3, dtype=torch.long), proximal=CoPRISProximal()
        )


OTHER_DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", OTHER_DEVICES)
def test_copris_preset_refuses_versions_on_another_device(device: str) -> None:
    """``versions`` on another device than the log-probs: an InputError naming ``versions`` and the fix, from the
    preset, from ``policy_loss`` and from the stage itself (never a raw device error from ``torch.where``)."""
    lp, adv, m = torch.full((2, 3), -1.0, dtype=D), torch.ones(2, dtype=D), ones(2, 3)
    versions = torch.zeros(2, 3, dtype=torch.long, device=device)
    with pytest.raises(InputError) as e:
        losses.get("copris")(lp, lp, adv, m, behav_logp=lp, versions=versions)
    assert e.value.argument == "versions" and "versions" in e.value.fix
    with pytest.raises(InputError) as e:
        policy_loss(lp, lp, adv, m, behav_logp=lp, versions=versions, proximal=CoPRISProximal())
    assert e.value.argument == "versions"
    ctx = StageContext(logp=lp, old_logp=lp, mask=m, advantages=adv[:, None], behav_logp=lp, versions=versions)
    with pytest.raises(InputError) as e:
        CoPRISProximal()(ctx)
    assert e.value.argument == "versions" and ".to(" in e.value.fix
    ctx = replace(ctx, policy_version=1)
    with pytest.raises(InputError) as e:
        A3POProximal()(ctx)
    assert e.value.argument == "versions"
    with pytest.raises(InputError) as e:
        a3po_proximal_logp(lp, lp, versions, 1)
    assert e.value.argument == "versions"


EMPTY_SHAPES = [(0, 4), (3, 0), (0, 0), (2, 3)]  # B = 0, T = 0, both, all-masked rows


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_proximal_stages_on_empty_batches_give_zero_loss(shape: tuple[int, int], method: str) -> None:
    lp = torch.full(shape, -1.0, dtype=D, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)
    adv = torch.ones(shape[0], dtype=D)
    versions = torch.zeros(shape, dtype=torch.long)
    behav = lp.detach() - 0.5
    for agg in ("token-mean", "seq-mean-token-mean"):
        outs = [
            policy_loss(
                lp, lp.detach(), adv, mask, behav_logp=behav, versions=versions, proximal=CoPRISProximal(), agg=agg
            ),
            policy_loss(
                lp, None, adv, mask, behav_logp=behav, versions=versions, policy_version=2,
                proximal=A3POProximal(method=method), agg=agg,  # type: ignore[arg-type]
            ),
            losses.get("copris")(lp, lp.detach(), adv, mask, behav_logp=behav, versions=versions),
        ]  # fmt: skip
        for out in outs:
            assert float(out.loss.detach()) == 0.0
            assert all(bool(torch.isfinite(v)) for v in out.metrics.values())
            (g,) = torch.autograd.grad(out.loss, lp)
            assert not g.any()
    assert a3po_proximal_logp(lp, behav, versions, 2, method=method, mask=mask).shape == shape  # type: ignore[arg-type]
    assert copris_old_logp(behav, torch.zeros(shape[0], dtype=torch.long), behav, mask=mask).shape == shape
    assert all(x.shape == shape for x in factorise_log_ratio(lp, behav, behav, mask))


@pytest.mark.parametrize(
    ("stage", "requires", "accepts"),
    [
        (A3POProximal(), ("behav_logp", "versions", "policy_version"), ()),
        (A3POProximal(method="linear"), ("behav_logp", "versions", "policy_version"), ()),
        (CoPRISProximal(), ("behav_logp", "versions"), ("policy_version",)),
    ],
    ids=repr,
)
def test_declared_inputs_match_what_the_stage_reads(
    stage: Any, requires: tuple[str, ...], accepts: tuple[str, ...]
) -> None:
    assert stage.requires == requires and stage.accepts == accepts
    lp, m, adv = t([[-1.0, -2.0, -0.5]]), ones(1, 3), t([[1.0]])
    given = {"behav_logp": lp - 0.3, "versions": torch.tensor([[0, 1, 2]]), "policy_version": 2}
    ctx = StageContext(logp=lp, old_logp=lp - 0.1, mask=m, advantages=adv, **given)  # type: ignore[arg-type]
    full = stage(ctx)
    for name in requires:  # a context lacking a required input raises, naming it
        with pytest.raises(InputError) as e:
            stage(replace(ctx, **{name: None}))
        assert e.value.argument == name
    for name in accepts:  # an accepted input is read when given: CoPRIS's V from policy_version, else the newest
        without = stage(replace(ctx, **{name: None}))
        assert not torch.equal(stage(replace(ctx, policy_version=1)), without)
        assert torch.equal(without, full)  # the newest version in ctx.versions is 2 = policy_version
    # policy_loss and the presets refuse an input the stage does not declare
    kw = {k: given[k] for k in requires + accepts}
    with pytest.raises(InputError) as e:
        policy_loss(lp, lp - 0.1, adv[:, 0], m, proximal=stage, confidence=t([0.5]), **kw)
    assert e.value.argument == "confidence"


# ---------------------------------------------------------------------------------------------- PPO-EWMA


def test_ewma_beta_zero_is_current_logp_and_ratio_one() -> None:
    # PPO-EWMA: beta = 0 => the average is the current policy => u = 1
    ewma = EWMAProximal(beta=0.0, experimental=True)
    ids = torch.tensor([3, 1])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    for step in range(3):
        logp = -torch.rand(2, 3, dtype=D) - step
        old = ewma.update(ids, logp, m)
        assert torch.equal(old, torch.where(m, logp, torch.zeros_like(logp)))
        out = policy_loss(logp, old, t([1.0, -1.0]), m)
        torch.testing.assert_close(out.metrics["ratio_mean"], t(1.0))


def test_ewma_hand_example_new_positions_and_ids() -> None:
    ewma = EWMAProximal(beta=0.5, experimental=True)
    m2 = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    out = ewma.update(torch.tensor([7, 3]), t([[1.0, 2.0], [3.0, 99.0]]), m2)
    torch.testing.assert_close(out, t([[1.0, 2.0], [3.0, 0.0]]))  # new ids start at their logp
    # id 3 grew to 3 tokens (a partial rollout continued); id 9 is new
    out = ewma.update(torch.tensor([3, 9]), t([[5.0, 6.0, 1.0], [3.0, 4.0, 1.0]]), ones(2, 3))
    # id 3: 0.5*3 + 0.5*5 = 4; positions 1, 2 seen for the first time start at 6, 1
    torch.testing.assert_close(out, t([[4.0, 6.0, 1.0], [3.0, 4.0, 1.0]]))
    out = ewma.update(torch.tensor([7]), t([[3.0, 0.0, 8.0]]), ones(1, 3))
    torch.testing.assert_close(out, t([[2.0, 1.0, 8.0]]))
    assert len(ewma) == 3


def test_ewma_bounded_memory_evicts_least_recently_updated() -> None:
    ewma = EWMAProximal(beta=0.5, capacity=2, experimental=True)
    m = ones(1, 2)
    ewma.update(torch.tensor([1]), t([[1.0, 1.0]]), m)
    ewma.update(torch.tensor([2]), t([[2.0, 2.0]]), m)
    ewma.update(torch.tensor([1]), t([[3.0, 3.0]]), m)  # 1 is now the most recent
    ewma.update(torch.tensor([5]), t([[5.0, 5.0]]), m)  # evicts 2 (least recently updated)
    assert len(ewma) == 2
    assert ewma.state_dict()["ids"].tolist() == [1, 5]
    # 1 kept its average (0.5*1 + 0.5*3 = 2); 2 was evicted and starts afresh
    torch.testing.assert_close(ewma.update(torch.tensor([1]), t([[4.0, 4.0]]), m), t([[3.0, 3.0]]))
    torch.testing.assert_close(ewma.update(torch.tensor([2]), t([[0.0, 0.0]]), m), t([[0.0, 0.0]]))
    # a whole batch at capacity replaces everything older
    ewma.update(torch.tensor([8, 9]), t([[1.0, 1.0], [1.0, 1.0]]), ones(2, 2))
    assert ewma.state_dict()["ids"].tolist() == [8, 9]


def test_ewma_state_dict_round_trip_continues_identically() -> None:
    g = torch.Generator().manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.randperm(12, generator=g)[:5]
        width = int(torch.randint(3, 7, (1,), generator=g))
        return ids, -torch.rand(5, width, generator=g), torch.rand(5, width, generator=g) > 0.3

    a = EWMAProximal(beta=0.8, capacity=8, experimental=True)
    for _ in range(4):
        a.update(*batch())
    b = EWMAProximal(beta=0.8, capacity=8, experimental=True)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        ids, lp, m = batch()
        assert torch.equal(a.update(ids, lp, m), b.update(ids, lp, m))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 0.99))
def test_ewma_is_a_convex_combination_of_the_history(seed: int, beta: float) -> None:
    g = torch.Generator().manual_seed(seed)
    ewma = EWMAProximal(beta=beta, capacity=4, experimental=True)
    ids = torch.tensor([0, 1, 2])
    m = ones(3, 4)
    history = []
    for _ in range(5):
        lp = -10 * torch.rand(3, 4, generator=g, dtype=D)
        history.append(lp)
        out = ewma.update(ids, lp, m)
        h = torch.stack(history)
        assert torch.isfinite(out).all()
        assert (out >= h.amin(0) - 1e-9).all() and (out <= h.amax(0) + 1e-9).all()
    const = EWMAProximal(beta=beta, experimental=True)
    for _ in range(3):
        c = const.update(ids, torch.full((3, 4), -2.5, dtype=D), m)
    torch.testing.assert_close(c, torch.full((3, 4), -2.5, dtype=D))


def test_ewma_bad_inputs() -> None:
    with pytest.raises(InputError, match=r"^experimental"):
        EWMAProximal()
    with pytest.raises(InputError, match=r"^beta"):
        EWMAProximal(beta=1.0, experimental=True)
    with pytest.raises(InputError, match=r"^capacity"):
        EWMAProximal(capacity=0, experimental=True)
    e = EWMAProximal(capacity=2, experimental=True)
    with pytest.raises(InputError, match=r"^ids"):
        e.update(torch.tensor([1, 1]), torch.zeros(2, 3), ones(2, 3))
    with pytest.raises(InputError, match=r"^ids"):
        e.update(torch.tensor([1, 2, 3]), torch.zeros(3, 3), ones(3, 3))
    with pytest.raises(InputError, match=r"^ids"):
        e.update(torch.tensor([1.0, 2.0]), torch.zeros(2, 3), ones(2, 3))
    with pytest.raises(InputError, match=r"^logp"):
        e.update(torch.tensor([1, 2]), torch.full((2, 3), math.nan), ones(2, 3))
    with pytest.raises(InputError, match=r"^mask"):
        e.update(torch.tensor([1, 2]), torch.zeros(2, 3), ones(2, 4))
    with pytest.raises(InputError, match=r"^state\['beta'\]"):
        e.load_state_dict(EWMAProximal(beta=0.5, capacity=2, experimental=True).state_dict())
    with pytest.raises(InputError, match=r"^state"):
        e.load_state_dict({"beta": 0.9})


# ---------------------------------------------------------------------------------------- factorisation


def test_factorise_identity_exact_and_masked() -> None:
    # dyadic values: every difference is exact in binary floating point, so the identity holds bit for bit
    logp = t([[-0.5, -1.25, -3.0], [-0.125, -2.0, 7.0]], requires_grad=True)
    old = t([[-0.75, -1.0, -2.5], [-0.25, -2.5, 0.0]])
    behav = t([[-1.0, -1.5, -2.0], [-0.375, -1.75, 0.0]])
    disc, stale = factorise_log_ratio(logp, old, behav)
    assert torch.equal(disc + stale, logp - behav)
    assert torch.equal(disc, old - behav)
    stale.sum().backward()
    assert logp.grad is not None and torch.equal(logp.grad, torch.ones(2, 3, dtype=D))
    m = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    d2, s2 = factorise_log_ratio(logp.detach(), old, behav, m)
    assert d2[1, 2] == 0 and s2[1, 2] == 0


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-3, 100.0))
def test_factorise_identity_property(seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logp, old, behav = (-scale * torch.rand(4, 5, generator=g, dtype=D) for _ in range(3))
    disc, stale = factorise_log_ratio(logp, old, behav)
    torch.testing.assert_close(disc + stale, logp - behav, rtol=0, atol=4 * scale * 2.0**-52)
    torch.testing.assert_close((disc + stale).exp(), (logp - old).exp() * (old - behav).exp())


def test_factorise_bad_inputs() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(InputError, match=r"^behav_logp"):
        factorise_log_ratio(z, z, torch.zeros(3, 3))
    with pytest.raises(InputError, match=r"^old_logp"):
        factorise_log_ratio(z, torch.full((2, 3), math.nan), z)
