"""Reference ratio constructions and trust regions: oracles from specs/ratios_and_losses.md §2 (B1–B3), SAPO."""

from __future__ import annotations

import math

import pytest
import torch

from rolloutopt.errors import InputError
from rolloutopt.ratios import (
    CISPO,
    SAPO,
    GSPORatio,
    PPOClip,
    TokenRatio,
    cispo_weight,
    gspo_token_log_ratio,
    log_ratio,
    ppo_clip_loss,
    sapo_gate,
    sequence_log_ratio,
)

D = torch.float64


def t(x: object, **kw: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D, **kw)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------- log_ratio


def test_log_ratio_value_and_clamp() -> None:
    logp = t([[0.0, -1.0, 30.0], [-50.0, 0.5, -2.0]])
    old = t([[-0.5, -1.0, 0.0], [0.0, 0.0, -2.5]])
    out = log_ratio(logp, old)
    assert torch.equal(out, t([[0.5, 0.0, 20.0], [-20.0, 0.5, 0.5]]))
    assert torch.equal(log_ratio(logp, old, clamp=5.0), t([[0.5, 0.0, 5.0], [-5.0, 0.5, 0.5]]))


def test_log_ratio_masked_positions_are_zero_and_garbage_does_not_propagate() -> None:
    mask = torch.tensor([[True, True, False], [True, False, False]])
    logp = t([[-1.0, -2.0, math.inf], [-0.5, math.nan, -math.inf]], requires_grad=True)
    old = t([[-1.5, -2.0, math.inf], [-0.25, 3.0, math.nan]])
    out = log_ratio(logp, old, mask)
    assert torch.equal(out, t([[0.5, 0.0, 0.0], [-0.25, 0.0, 0.0]]))
    out.exp().sum().backward()
    assert logp.grad is not None
    assert torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[~mask], torch.zeros(3, dtype=D))
    torch.testing.assert_close(logp.grad[mask], out.exp()[mask].detach())


def test_log_ratio_gradient_is_zero_where_clamped() -> None:
    logp = t([[25.0, 1.0, -25.0]], requires_grad=True)
    log_ratio(logp, torch.zeros_like(logp)).sum().backward()
    assert logp.grad is not None
    assert torch.equal(logp.grad, t([[0.0, 1.0, 0.0]]))


def test_log_ratio_non_finite_at_masked_in_position_raises() -> None:
    with pytest.raises(InputError, match="logp"):
        log_ratio(t([[math.nan, 0.0]]), t([[0.0, 0.0]]), torch.tensor([[True, False]]))
    with pytest.raises(InputError, match="old_logp"):
        log_ratio(t([[0.0, 0.0]]), t([[0.0, math.inf]]))


def test_log_ratio_bad_clamp_and_shape() -> None:
    with pytest.raises(InputError) as e:
        log_ratio(t([[0.0]]), t([[0.0]]), clamp=0.0)
    assert e.value.argument == "clamp"
    with pytest.raises(InputError) as e:
        log_ratio(t([[0.0, 1.0]]), t([[0.0]]))
    assert e.value.argument == "old_logp"
    with pytest.raises(InputError) as e:
        log_ratio(t([[0.0, 1.0]]), t([[0.0, 1.0]]), torch.ones(2, 2, dtype=torch.bool))
    assert e.value.argument == "mask"


# ------------------------------------------------------------------------------------------ sequence / GSPO


def test_sequence_log_ratio_spec_oracle() -> None:
    # specs B2: token log-ratios [0.2, -0.4, 0.5] -> log s = 0.1, s = 1.10517
    logp = t([[0.2, -0.4, 0.5, 7.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    out = sequence_log_ratio(logp, torch.zeros_like(logp), mask)
    torch.testing.assert_close(out, t([0.1, 1.0, 0.0]))
    assert math.isclose(float(out[0].exp()), 1.10517, rel_tol=1e-5)


def test_sequence_log_ratio_clamps_tokens_first() -> None:
    logp = t([[30.0, 0.0]])
    out = sequence_log_ratio(logp, torch.zeros_like(logp), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(out, t([10.0]))


def test_gspo_token_value_equals_sequence_value_at_every_token() -> None:
    # Large log-probs: the value must still be exactly the sequence log-ratio (no rounding from lp - sg(lp)).
    logp = t([[-30.2, -40.4, -50.5, 0.0], [-0.3, -0.1, 0.0, 0.0]]).float()
    old = t([[-30.4, -40.0, -51.0, 0.0], [-0.2, -0.3, 0.0, 0.0]]).float()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    out = gspo_token_log_ratio(logp, old, mask)
    seq = sequence_log_ratio(logp, old, mask)
    assert torch.equal(out[mask], seq[:, None].expand_as(out)[mask])
    assert torch.equal(out[~mask], torch.zeros(3))


def test_gspo_token_gradient_is_per_token() -> None:
    logp = t([[0.1, -0.2, 0.3]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    out = gspo_token_log_ratio(logp, torch.zeros_like(logp), mask)
    w = t([[2.0, 3.0, 5.0]])
    (out * w).sum().backward()
    assert logp.grad is not None
    # d log s_{i,t} / d logp_{i,t'} = [t == t'] on masked-in tokens: each token gets its own weight.
    assert torch.equal(logp.grad, t([[2.0, 3.0, 0.0]]))


def test_gspo_token_gradient_equals_sequence_gradient_with_sequence_advantages() -> None:
    torch.manual_seed(0)
    B, T = 3, 5
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    old = -torch.rand(B, T, dtype=D)
    base = old + 0.3 * torch.randn(B, T, dtype=D)
    adv = t([1.5, -0.7, 2.0])
    lengths = mask.sum(-1).to(D)

    lp_tok = base.clone().requires_grad_()
    tok = gspo_token_log_ratio(lp_tok, old, mask)
    # seq-mean-token-mean of -A * s_{i,t}
    ((-(adv[:, None] * tok.exp()) * mask).sum(-1) / lengths).mean().backward()

    lp_seq = base.clone().requires_grad_()
    s = sequence_log_ratio(lp_seq, old, mask).exp()
    (-(adv * s)).mean().backward()

    assert lp_tok.grad is not None and lp_seq.grad is not None
    torch.testing.assert_close(lp_tok.grad, lp_seq.grad)
    assert (lp_tok.grad[mask] != 0).all()


def test_gspo_token_clamp_max() -> None:
    logp = t([[12.0, 14.0], [3.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    out = gspo_token_log_ratio(logp, torch.zeros_like(logp), mask)
    assert torch.equal(out, t([[10.0, 10.0], [3.0, 0.0]]))
    out.sum().backward()
    assert logp.grad is not None
    assert torch.equal(logp.grad, t([[0.0, 0.0], [1.0, 0.0]]))
    # no lower clamp
    low = gspo_token_log_ratio(t([[-40.0]]), t([[0.0]]), torch.ones(1, 1, dtype=torch.bool))
    assert float(low) == -40.0
    assert float(gspo_token_log_ratio(logp.detach(), torch.zeros_like(logp), mask, clamp_max=2.0)[1, 0]) == 2.0
    with pytest.raises(InputError) as e:
        gspo_token_log_ratio(logp, logp, mask, clamp_max=-1.0)
    assert e.value.argument == "clamp_max"


def test_gspo_token_garbage_at_masked_positions() -> None:
    mask = torch.tensor([[True, False]])
    logp = t([[0.5, math.inf]], requires_grad=True)
    out = gspo_token_log_ratio(logp, t([[0.0, math.nan]]), mask)
    assert torch.equal(out, t([[0.5, 0.0]]))
    out.sum().backward()
    assert logp.grad is not None
    assert torch.equal(logp.grad, t([[1.0, 0.0]]))


def test_ratio_stages_match_functions() -> None:
    logp = t([[0.2, 25.0, -0.4], [1.0, -2.0, 3.0]])
    old = torch.zeros_like(logp)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert torch.equal(TokenRatio().log_ratio(logp, old, mask), log_ratio(logp, old, mask))
    assert torch.equal(TokenRatio(clamp=3.0).log_ratio(logp, old, mask), log_ratio(logp, old, mask, clamp=3.0))
    assert torch.equal(GSPORatio().log_ratio(logp, old, mask), gspo_token_log_ratio(logp, old, mask))
    assert torch.equal(
        GSPORatio(clamp_max=1.0).log_ratio(logp, old, mask), gspo_token_log_ratio(logp, old, mask, clamp_max=1.0)
    )


# ----------------------------------------------------------------------------------------------- PPO clip


def _ppo(r: float, a: float, **kw: object) -> tuple[float, float, dict[str, bool]]:
    ratio = t([[r]], requires_grad=True)
    loss, ind = ppo_clip_loss(ratio, t([[a]]), **kw)  # type: ignore[arg-type]
    loss.sum().backward()
    assert ratio.grad is not None
    return float(loss), float(ratio.grad), {k: bool(v) for k, v in ind.items()}


def test_ppo_clip_dual_clip_oracle() -> None:
    # A = -1, r = 5, eps 0.2, c = 3 -> L_clip = max(5, 1.2) = 5 -> dual clip loss 3, zero gradient
    loss, grad, ind = _ppo(5.0, -1.0, low=0.2, high=0.2, dual=3.0)
    assert loss == pytest.approx(3.0)
    assert grad == 0.0
    assert ind == {"clipfrac": False, "clip_low_frac": False, "clip_high_frac": False, "dual_clip_frac": True}
    # verl check: A = -1 with r = e^3 gives 3.0 and pg_clipfrac_lower 1
    loss, grad, ind = _ppo(math.exp(3), -1.0, low=0.2, high=0.2, dual=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0 and ind["dual_clip_frac"]
    # without dual clip the unclipped branch is active: loss = -A r, gradient -A
    loss, grad, ind = _ppo(5.0, -1.0, low=0.2, high=0.2, dual=None)
    assert loss == pytest.approx(5.0) and grad == pytest.approx(1.0) and not ind["dual_clip_frac"]


def test_ppo_clip_high_oracle() -> None:
    loss, grad, ind = _ppo(1.5, 1.0, low=0.2, high=0.2)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert ind == {"clipfrac": True, "clip_low_frac": False, "clip_high_frac": True, "dual_clip_frac": False}


def test_ppo_clip_unclipped_side_keeps_gradient() -> None:
    loss, grad, ind = _ppo(0.5, 1.0, low=0.2, high=0.2)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-1.0)
    assert not any(ind.values())


def test_ppo_clip_asymmetric_bounds() -> None:
    # high 0.28: r = 1.25 is inside for A > 0, r = 1.3 is clipped at 1.28
    loss, grad, _ = _ppo(1.25, 2.0, low=0.2, high=0.28)
    assert loss == pytest.approx(-2.5) and grad == pytest.approx(-2.0)
    loss, grad, ind = _ppo(1.3, 2.0, low=0.2, high=0.28)
    assert loss == pytest.approx(-2.56) and grad == 0.0 and ind["clip_high_frac"]
    # low 0.1: r = 0.85 is clipped at 0.9 for A < 0, r = 0.95 is not
    loss, grad, ind = _ppo(0.85, -1.0, low=0.1, high=0.28)
    assert loss == pytest.approx(0.9) and grad == 0.0 and ind["clip_low_frac"] and ind["clipfrac"]
    loss, grad, ind = _ppo(0.95, -1.0, low=0.1, high=0.28)
    assert loss == pytest.approx(0.95) and grad == pytest.approx(1.0) and not ind["clipfrac"]
    # the pessimistic side is never clipped: A < 0 with r above 1 + high keeps -A r (below the dual bound)
    loss, grad, ind = _ppo(1.5, -1.0, low=0.1, high=0.28)
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.0) and not any(ind.values())


def test_ppo_clip_indicators_vectorised() -> None:
    ratio = t([[0.5, 1.5, 0.7, 5.0, 1.0, 1.5]])
    adv = t([[1.0, 1.0, -1.0, -1.0, 0.0, -1.0]])
    loss, ind = ppo_clip_loss(ratio, adv, low=0.2, high=0.2, dual=3.0)
    torch.testing.assert_close(loss, t([[-0.5, -1.2, 0.8, 3.0, 0.0, 1.5]]))
    assert ind["clipfrac"].tolist() == [[False, True, True, False, False, False]]
    assert ind["clip_low_frac"].tolist() == [[False, False, True, False, False, False]]
    assert ind["clip_high_frac"].tolist() == [[False, True, False, False, False, False]]
    assert ind["dual_clip_frac"].tolist() == [[False, False, False, True, False, False]]
    assert all(v.dtype == torch.bool and v.shape == ratio.shape for v in ind.values())


def test_ppo_clip_zero_advantage_gives_zero_gradient() -> None:
    _, grad, _ = _ppo(1.1, 0.0)
    assert grad == 0.0


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"low": -0.1}, "PPOClip.low"),
        ({"high": -0.1}, "PPOClip.high"),
        ({"high": "0.2"}, "PPOClip.high"),
        ({"low": float("nan")}, "PPOClip.low"),
        ({"dual": 1.0}, "PPOClip.dual"),
        ({"dual": 0.5}, "PPOClip.dual"),
        ({"dual": True}, "PPOClip.dual"),
        ({"dual": "3"}, "PPOClip.dual"),
    ],
)
def test_ppo_clip_stage_validates(kw: dict[str, object], field: str) -> None:
    with pytest.raises(InputError) as e:
        PPOClip(**kw)  # type: ignore[arg-type]
    assert e.value.argument == field
    assert field in str(e.value)


def test_ppo_clip_function_validates() -> None:
    with pytest.raises(InputError) as e:
        ppo_clip_loss(t([[1.0]]), t([[1.0]]), dual=1.0)
    assert e.value.argument == "ppo_clip_loss.dual"


def test_ppo_clip_stage_matches_function() -> None:
    ratio = t([[0.5, 1.5, 0.7, 5.0]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    stage = PPOClip(low=0.1, high=0.3, dual=None)
    out = stage(ratio, ratio.log(), adv, ratio.log())
    loss, ind = ppo_clip_loss(ratio, adv, low=0.1, high=0.3, dual=None)
    assert out.keep is None
    assert torch.equal(out.loss, loss)
    assert out.indicators.keys() == ind.keys()
    assert not out.indicators["dual_clip_frac"].any()
    assert PPOClip() == PPOClip(low=0.2, high=0.28, dual=3.0)


# ------------------------------------------------------------------------------------------------- CISPO


def test_cispo_weight_oracle() -> None:
    ratio = t([[1.5, 0.01, 1.0]], requires_grad=True)
    w = cispo_weight(ratio, low=None, high=0.2)
    torch.testing.assert_close(w, t([[1.2, 0.01, 1.0]]))
    assert not w.requires_grad
    # r = 0.01 with low = 10 -> no lower clip
    torch.testing.assert_close(cispo_weight(ratio, low=10.0, high=0.2), t([[1.2, 0.01, 1.0]]))
    torch.testing.assert_close(cispo_weight(ratio, low=0.2, high=0.2), t([[1.2, 0.8, 1.0]]))


def test_cispo_loss_gradient_is_minus_weight_times_advantage() -> None:
    logp = t([[math.log(1.5), math.log(0.5), 0.0]], requires_grad=True)
    old = torch.zeros_like(logp)
    adv = t([[1.0, -2.0, 3.0]])
    r = torch.exp(logp - old)
    out = CISPO(high=0.2)(r, logp - old, adv, logp)
    out.loss.sum().backward()
    assert logp.grad is not None
    # d/dlogp (-sg(w) A logp) = -w A ; w = 1.2 (clipped, still a gradient), 0.5, 1.0
    torch.testing.assert_close(logp.grad, t([[-1.2, 1.0, -3.0]]))
    torch.testing.assert_close(out.loss.detach(), t([[-1.2 * math.log(1.5), 2 * 0.5 * math.log(0.5), 0.0]]))
    assert out.indicators["clipfrac"].tolist() == [[True, False, False]]
    assert out.keep is None


def test_cispo_absolute_cap_convention() -> None:
    ratio = t([[6.0, 1.5, 0.01]])
    torch.testing.assert_close(cispo_weight(ratio, high=None, cap=5.0), t([[5.0, 1.5, 0.01]]))
    # relative: 1 + 5.0 = 6.0 is the bound, not 5.0
    torch.testing.assert_close(cispo_weight(ratio, high=5.0), t([[6.0, 1.5, 0.01]]))
    out = CISPO(high=None, cap=5.0)(ratio, ratio.log(), t([[1.0, 1.0, 1.0]]), ratio.log())
    assert out.indicators["clipfrac"].tolist() == [[True, False, False]]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"cap": 5.0}, "high"),  # cap with the default high
        ({"high": None}, "high"),  # neither bound
        ({"high": None, "cap": 0.0}, "cap"),
        ({"high": None, "cap": -1.0}, "cap"),
        ({"high": -0.2}, "high"),
        ({"low": -0.2}, "low"),
        ({"low": 0.2, "high": None, "cap": 5.0}, "low"),  # relative low with absolute cap is ambiguous
    ],
)
def test_cispo_invalid_combinations(kw: dict[str, object], field: str) -> None:
    with pytest.raises(InputError) as e:
        cispo_weight(t([[1.0]]), **kw)  # type: ignore[arg-type]
    assert e.value.argument.endswith(field)
    with pytest.raises(InputError) as e:
        CISPO(**kw)  # type: ignore[arg-type]
    assert e.value.argument == f"CISPO.{field}"


# -------------------------------------------------------------------------------------------------- SAPO


@pytest.mark.parametrize("a", [1.0, -1.0, 2.5, -0.5])
def test_sapo_gate_at_ratio_one(a: float) -> None:
    # f(r) = 4/tau * sigmoid(tau (r - 1)): f(1) = 2/tau and f'(1) = 1, so the gradient matches -A r on-policy.
    tau = 1.0 if a > 0 else 1.05
    ratio = t([[1.0]], requires_grad=True)
    loss = sapo_gate(ratio, t([[a]]))
    loss.sum().backward()
    assert float(loss) == pytest.approx(-2 * a / tau)
    assert ratio.grad is not None
    assert float(ratio.grad) == pytest.approx(-a)


def test_sapo_gate_value_and_temperature_by_sign() -> None:
    ratio = t([[1.5, 1.5, 0.5, 1.5]], requires_grad=True)
    adv = t([[1.0, -1.0, -2.0, 0.0]])
    loss = sapo_gate(ratio, adv, tau_pos=2.0, tau_neg=3.0)

    def f(r: float, tau: float) -> float:
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))

    # A = 0 takes tau_neg (verl: tau_pos only where A > 0), and contributes 0
    expected = [-1.0 * f(1.5, 2.0), 1.0 * f(1.5, 3.0), 2.0 * f(0.5, 3.0), 0.0]
    torch.testing.assert_close(loss, t([expected]))
    loss.sum().backward()

    def df(r: float, tau: float) -> float:
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        return 4 * s * (1 - s)

    assert ratio.grad is not None
    torch.testing.assert_close(ratio.grad, t([[-df(1.5, 2.0), df(1.5, 3.0), 2 * df(0.5, 3.0), 0.0]]))


def test_sapo_gate_decays_far_from_one() -> None:
    ratio = t([[1.0, 3.0, 10.0]], requires_grad=True)
    sapo_gate(ratio, t([[1.0, 1.0, 1.0]])).sum().backward()
    assert ratio.grad is not None
    g = ratio.grad.abs()[0]
    assert g[0] > g[1] > g[2] > 0


def test_sapo_stage_matches_function() -> None:
    ratio = t([[1.5, 0.5]])
    adv = t([[1.0, -1.0]])
    out = SAPO(tau_pos=0.5, tau_neg=2.0)(ratio, ratio.log(), adv, ratio.log())
    assert torch.equal(out.loss, sapo_gate(ratio, adv, tau_pos=0.5, tau_neg=2.0))
    assert out.keep is None and out.indicators == {}
    assert SAPO() == SAPO(tau_pos=1.0, tau_neg=1.05)


@pytest.mark.parametrize(("kw", "field"), [({"tau_pos": 0.0}, "tau_pos"), ({"tau_neg": -1.0}, "tau_neg")])
def test_sapo_validates(kw: dict[str, float], field: str) -> None:
    with pytest.raises(InputError) as e:
        SAPO(**kw)
    assert e.value.argument == f"SAPO.{field}"
    with pytest.raises(InputError) as e:
        sapo_gate(t([[1.0]]), t([[1.0]]), **kw)
    assert e.value.argument == field


# ------------------------------------------------------------------------------------------- ratio stages


@pytest.mark.parametrize(
    ("cls", "kw", "field"),
    [
        (TokenRatio, {"clamp": 0.0}, "TokenRatio.clamp"),
        (TokenRatio, {"clamp": -1.0}, "TokenRatio.clamp"),
        (TokenRatio, {"clamp": "20"}, "TokenRatio.clamp"),
        (GSPORatio, {"clamp_max": 0.0}, "GSPORatio.clamp_max"),
        (GSPORatio, {"clamp_max": None}, "GSPORatio.clamp_max"),
    ],
)
def test_ratio_stages_validate(cls: type, kw: dict[str, object], field: str) -> None:
    with pytest.raises(InputError) as e:
        cls(**kw)
    assert e.value.argument == field


def test_stages_are_frozen() -> None:
    for stage in (TokenRatio(), GSPORatio(), PPOClip(), CISPO(), SAPO()):
        with pytest.raises(AttributeError):
            stage.x = 1  # type: ignore[attr-defined]
        field = next(iter(stage.__dataclass_fields__))
        with pytest.raises(AttributeError):
            setattr(stage, field, 1.0)
