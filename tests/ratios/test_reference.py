"""Reference ratio constructions and trust regions (PPO dual clip, GSPO, CISPO, SAPO).

Oracles computed by hand following verl's losses (``volcengine/verl@b178a3cd5``
``verl/trainer/ppo/core_algos.py``: ``compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``,
``compute_policy_loss_cispo``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

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
    # GSPO: token log-ratios [0.2, -0.4, 0.5] -> log s = 0.1, s = 1.10517
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
    assert PPOClip() == PPOClip(low=0.2, high=0.2, dual=None)  # PPO's defaults


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


# ------------------------------------------------------------------------------------ hypothesis properties

GARBAGE = [math.inf, -math.inf, math.nan, 1e300, -1e300]


def _fl(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@st.composite
def _masks(draw: st.DrawFn, b: int, n: int) -> torch.Tensor:
    """A [b, n] mask whose rows are all-masked, all-kept or random (so all-masked rows are common)."""
    rows = []
    for _ in range(b):
        kind = draw(st.sampled_from(["none", "all", "random", "random"]))
        if kind == "none":
            rows.append([False] * n)
        elif kind == "all":
            rows.append([True] * n)
        else:
            rows.append(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    return torch.tensor(rows, dtype=torch.bool)


@st.composite
def pairs(draw: st.DrawFn, diff: float = 100.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, old_logp, mask) [B, T] fp64: old in [-50, 0], logp - old in [-diff, diff]."""
    b, n = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    old = torch.tensor(draw(st.lists(_fl(-50.0, 0.0), min_size=b * n, max_size=b * n)), dtype=D).view(b, n)
    d = torch.tensor(draw(st.lists(_fl(-diff, diff), min_size=b * n, max_size=b * n)), dtype=D).view(b, n)
    return old + d, old, draw(_masks(b, n))


def _like(draw: st.DrawFn, x: torch.Tensor, elements: st.SearchStrategy[float]) -> torch.Tensor:
    return torch.tensor(draw(st.lists(elements, min_size=x.numel(), max_size=x.numel())), dtype=x.dtype).view_as(x)


def _garble(draw: st.DrawFn, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with every masked-out value replaced by a drawn non-finite or huge value."""
    junk = _like(draw, x, st.sampled_from(GARBAGE))
    return torch.where(mask, x, junk)


CLAMPS = st.sampled_from([20.0, 5.0, 0.5])


@given(pairs(), st.data())
def test_prop_ratio_outputs_and_gradients_finite(batch: tuple[torch.Tensor, ...], data: st.DataObject) -> None:
    logp, old, mask = batch
    adv = _like(data.draw, old, _fl(-1e3, 1e3))
    for dtype in (D, torch.float32):
        lp = logp.to(dtype).requires_grad_(True) if dtype != D else logp.clone().requires_grad_(True)
        o = old.to(dtype)
        a = adv.to(dtype)
        lr = log_ratio(lp, o, mask)
        seq = sequence_log_ratio(lp, o, mask)
        tok = gspo_token_log_ratio(lp, o, mask)
        r = lr.exp()
        terms = [
            lr,
            seq[:, None],
            tok,
            tok.exp(),
            ppo_clip_loss(r, a)[0],
            ppo_clip_loss(tok.exp(), a, dual=None)[0],
            sapo_gate(r, a),
            CISPO()(r, lr, a, lp).loss,
        ]
        for x in terms:
            assert torch.isfinite(x).all()
        total = sum(x.sum() for x in terms)
        total.backward()  # type: ignore[union-attr]
        assert lp.grad is not None
        assert torch.isfinite(lp.grad).all()


@given(pairs(), CLAMPS, st.data())
def test_prop_masked_positions_are_neutral_and_garbage_does_not_leak(
    batch: tuple[torch.Tensor, ...], clamp: float, data: st.DataObject
) -> None:
    logp, old, mask = batch
    bad_lp, bad_old = _garble(data.draw, logp, mask), _garble(data.draw, old, mask)
    w = _like(data.draw, old, _fl(-3.0, 3.0))
    for fn, kw in (
        (log_ratio, {"clamp": clamp}),
        (sequence_log_ratio, {"clamp": clamp}),
        (gspo_token_log_ratio, {"clamp_max": clamp}),
    ):
        outs, grads = [], []
        for lp0, o in ((logp, old), (bad_lp, bad_old)):
            lp = lp0.clone().requires_grad_(True)
            out = fn(lp, o, mask, **kw)  # type: ignore[operator]
            (out.exp() * (w if out.ndim == 2 else w[:, 0])).sum().backward()
            assert lp.grad is not None
            outs.append(out.detach())
            grads.append(lp.grad)
        assert torch.equal(outs[0], outs[1]), fn.__name__
        assert torch.equal(grads[0], grads[1]), fn.__name__
        assert torch.equal(grads[1][~mask], torch.zeros_like(grads[1][~mask])), fn.__name__
        if outs[1].ndim == 2:  # masked-out positions: log-ratio 0, ratio 1
            assert torch.equal(outs[1][~mask], torch.zeros_like(outs[1][~mask])), fn.__name__
            assert torch.equal(outs[1].exp()[~mask], torch.ones_like(outs[1][~mask])), fn.__name__
        else:  # an all-masked row has sequence log-ratio 0
            empty = ~mask.any(-1)
            assert torch.equal(outs[1][empty], torch.zeros_like(outs[1][empty]))


@given(pairs(), st.data())
def test_prop_row_permutation_equivariance(batch: tuple[torch.Tensor, ...], data: st.DataObject) -> None:
    logp, old, mask = batch
    perm = torch.tensor(data.draw(st.permutations(list(range(logp.shape[0])))))
    adv = _like(data.draw, old, _fl(-10.0, 10.0))
    # to rounding: the CPU kernels' vectorised body and scalar tail may round one element differently
    close = {"rtol": 1e-13, "atol": 0.0}
    for fn in (log_ratio, sequence_log_ratio, gspo_token_log_ratio):
        torch.testing.assert_close(fn(logp[perm], old[perm], mask[perm]), fn(logp, old, mask)[perm], **close)
    r = log_ratio(logp, old, mask).exp()
    for loss in (
        lambda r, a: ppo_clip_loss(r, a)[0],
        lambda r, a: sapo_gate(r, a),
        lambda r, a: cispo_weight(r) * a,
    ):
        torch.testing.assert_close(loss(r[perm], adv[perm]), loss(r, adv)[perm], **close)


@given(pairs(), CLAMPS)
def test_prop_log_ratio_antisymmetric_and_clamped(batch: tuple[torch.Tensor, ...], clamp: float) -> None:
    logp, old, mask = batch
    for m in (mask, None):
        fwd = log_ratio(logp, old, m, clamp=clamp)
        assert torch.equal(log_ratio(old, logp, m, clamp=clamp), -fwd)
        assert bool((fwd.abs() <= clamp).all())
        # within the clamp the log-ratio is the plain difference; beyond it, exactly +-clamp
        diff = logp - old if m is None else torch.where(m, logp - old, torch.zeros_like(logp))
        inside = diff.abs() <= clamp
        assert torch.equal(fwd[inside], diff[inside])
        assert torch.equal(fwd[~inside], clamp * diff[~inside].sign())


@given(pairs(), CLAMPS)
def test_prop_sequence_log_ratio_is_masked_mean_of_log_ratio(batch: tuple[torch.Tensor, ...], clamp: float) -> None:
    logp, old, mask = batch
    lr = log_ratio(logp, old, mask, clamp=clamp)
    expected = []
    for i in range(logp.shape[0]):
        vals = [float(lr[i, j]) for j in range(logp.shape[1]) if mask[i, j]]
        expected.append(math.fsum(vals) / len(vals) if vals else 0.0)
    got = sequence_log_ratio(logp, old, mask, clamp=clamp)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=D), rtol=1e-12, atol=1e-12)


@given(pairs(), st.sampled_from([10.0, 1.0, 0.1]))
def test_prop_gspo_token_value_is_clamped_sequence_log_ratio(batch: tuple[torch.Tensor, ...], cmax: float) -> None:
    # The value uses the *unclamped* token differences (verl): compare with sequence_log_ratio without its
    # per-token clamp (a clamp no difference reaches), then apply GSPO's upper clamp.
    logp, old, mask = batch
    seq = sequence_log_ratio(logp, old, mask, clamp=1e6).clamp(max=cmax)
    out = gspo_token_log_ratio(logp, old, mask, clamp_max=cmax)
    expected = torch.where(mask, seq[:, None].expand_as(out), torch.zeros_like(out))
    assert torch.equal(out, expected)
    assert bool((out <= cmax).all())


@given(pairs(diff=20.0))
def test_prop_gspo_token_value_equals_sequence_log_ratio_within_token_clamp(batch: tuple[torch.Tensor, ...]) -> None:
    # token differences within sequence_log_ratio's default clamp (20): both constructions agree exactly
    logp, old, mask = batch
    out = gspo_token_log_ratio(logp, old, mask, clamp_max=1e6)
    seq = sequence_log_ratio(logp, old, mask)
    torch.testing.assert_close(out[mask], seq[:, None].expand_as(out)[mask], rtol=1e-14, atol=1e-14)


@given(pairs(diff=15.0), st.sampled_from([10.0, 1.0, 0.2]), st.data())
def test_prop_gspo_token_gradient_equals_gspo_with_sequence_advantages(
    batch: tuple[torch.Tensor, ...], cmax: float, data: st.DataObject
) -> None:
    # With a per-sequence advantage A_i, the GSPO-token surrogate sum_i A_i/L_i sum_t m_it exp(log s_it) has the
    # gradient of GSPO's sequence surrogate sum_i A_i exp(min(log s_i, c)) (L_i = max(|mask_i|, 1)).
    logp, old, mask = batch
    adv = torch.tensor(data.draw(st.lists(_fl(-5.0, 5.0), min_size=logp.shape[0], max_size=logp.shape[0])), dtype=D)
    seq_value = sequence_log_ratio(logp, old, mask, clamp=1e6)
    assume(bool(((seq_value - cmax).abs() > 1e-9).all()))  # the clamp's kink
    lengths = mask.sum(-1).clamp(min=1).to(D)
    lp_tok = logp.clone().requires_grad_(True)
    tok = gspo_token_log_ratio(lp_tok, old, mask, clamp_max=cmax)
    (adv[:, None] * tok.exp() * mask / lengths[:, None]).sum().backward()
    lp_seq = logp.clone().requires_grad_(True)
    seq = sequence_log_ratio(lp_seq, old, mask, clamp=1e6)
    (adv * seq.clamp(max=cmax).exp() * mask.any(-1)).sum().backward()
    assert lp_tok.grad is not None and lp_seq.grad is not None
    torch.testing.assert_close(lp_tok.grad, lp_seq.grad, rtol=1e-10, atol=1e-12)


@st.composite
def clip_inputs(draw: st.DrawFn) -> dict[str, object]:
    b, n = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    near = st.sampled_from([0.8, 1.0, 1.28, 3.0, 0.0, 1.2])
    ratio = draw(st.lists(st.one_of(_fl(0.0, 6.0), near, _fl(0.0, 1e4)), min_size=b * n, max_size=b * n))
    adv = draw(st.lists(st.one_of(_fl(-100.0, 100.0), st.just(0.0)), min_size=b * n, max_size=b * n))
    low = draw(st.one_of(st.just(0.0), st.just(0.2), _fl(0.0, 0.99)))
    high = draw(st.one_of(st.just(0.0), st.just(0.28), _fl(0.0, 3.0)))
    dual = draw(st.one_of(st.none(), st.just(3.0), _fl(1.01, 10.0)))
    return {
        "ratio": torch.tensor(ratio, dtype=D).view(b, n),
        "adv": torch.tensor(adv, dtype=D).view(b, n),
        "low": low,
        "high": high,
        "dual": dual,
    }


@given(clip_inputs())
def test_prop_ppo_clip_case_formulas(x: dict[str, object]) -> None:
    r, a = x["ratio"], x["adv"]
    low, high, dual = x["low"], x["high"], x["dual"]
    assert isinstance(r, torch.Tensor) and isinstance(a, torch.Tensor)
    assert isinstance(low, float) and isinstance(high, float)
    assert dual is None or isinstance(dual, float)
    loss_nd, ind_nd = ppo_clip_loss(r, a, low=low, high=high, dual=None)
    loss, ind = ppo_clip_loss(r, a, low=low, high=high, dual=dual)
    # pessimistic bound: never below the unclipped surrogate
    assert bool((loss_nd >= -a * r).all())
    # case formulas: A > 0 caps the ratio above, A < 0 floors it below, inside the bounds the surrogate is -A r
    pos, neg = a > 0, a < 0
    torch.testing.assert_close(loss_nd[pos], (-a * r.clamp(max=1 + high))[pos], rtol=1e-15, atol=0)
    torch.testing.assert_close(loss_nd[neg], (a.abs() * r.clamp(min=1 - low))[neg], rtol=1e-15, atol=0)
    inside = (r >= 1 - low) & (r <= 1 + high)
    assert torch.equal(loss_nd[inside], (-a * r)[inside])
    assert torch.equal(loss_nd[a == 0], torch.zeros_like(loss_nd[a == 0]))
    # indicators: clipped exactly where low or high clip acts; they are 0/1 bools
    assert torch.equal(ind_nd["clipfrac"], ind_nd["clip_low_frac"] | ind_nd["clip_high_frac"])
    assert torch.equal(ind_nd["clip_high_frac"], pos & (r > 1 + high))
    assert torch.equal(ind_nd["clip_low_frac"], neg & (r < 1 - low))
    assert not bool(ind_nd["dual_clip_frac"].any())
    if dual is None:
        assert torch.equal(loss, loss_nd)
        return
    # dual clip: A < 0 losses are capped at c|A|, everything else unchanged
    assert bool((loss[neg] <= dual * a[neg].abs() * (1 + 1e-15)).all())
    assert torch.equal(loss[~neg], loss_nd[~neg])
    torch.testing.assert_close(loss[neg], torch.minimum(loss_nd, dual * a.abs())[neg], rtol=1e-15, atol=0)
    assert torch.equal(ind["dual_clip_frac"], neg & (loss_nd > -a * dual))
    assert bool((loss <= loss_nd).all())
    assert PPOClip(low, high, dual)(r, r.log(), a, r.log()).loss.equal(loss)


def _off_kinks(r: torch.Tensor, low: float, high: float, dual: float | None, eps: float = 1e-3) -> bool:
    kinks = [1 - low, 1 + high] + ([] if dual is None else [dual])
    return all(bool(((r - k).abs() > eps).all()) for k in kinks)


@given(clip_inputs())
def test_prop_ppo_clip_gradient_is_zero_exactly_where_clipped(x: dict[str, object]) -> None:
    r, a = x["ratio"], x["adv"]
    low, high, dual = x["low"], x["high"], x["dual"]
    assert isinstance(r, torch.Tensor) and isinstance(a, torch.Tensor)
    assert isinstance(low, float) and isinstance(high, float)
    assert dual is None or isinstance(dual, float)
    assume(_off_kinks(r, low, high, dual))
    rg = r.clone().requires_grad_(True)
    loss, ind = ppo_clip_loss(rg, a, low=low, high=high, dual=dual)
    loss.sum().backward()
    assert rg.grad is not None
    clipped = ind["clipfrac"] | ind["dual_clip_frac"]
    assert torch.equal(rg.grad[clipped], torch.zeros_like(rg.grad[clipped]))
    assert torch.equal(rg.grad[~clipped], -a[~clipped])
    # on-policy (r = 1) no token is clipped and the gradient is the policy-gradient -A
    one = torch.ones_like(r, requires_grad=True)
    loss1, ind1 = ppo_clip_loss(one, a, low=low, high=high, dual=dual)
    loss1.sum().backward()
    assert one.grad is not None
    assert torch.equal(one.grad, -a) and torch.equal(loss1, -a)
    assert not any(bool(v.any()) for v in ind1.values())


@settings(max_examples=30)
@given(
    st.lists(st.tuples(_fl(0.0, 6.0), _fl(1e-3, 100.0), st.booleans()), min_size=1, max_size=12),
    st.one_of(st.just(0.0), _fl(0.0, 0.99)),
    st.one_of(st.just(0.0), _fl(0.0, 3.0)),
    st.one_of(st.none(), _fl(1.01, 10.0)),
)
def test_prop_ppo_clip_gradcheck_off_kinks(
    values: list[tuple[float, float, bool]], low: float, high: float, dual: float | None
) -> None:
    r = torch.tensor([v[0] for v in values], dtype=D).view(1, -1)
    a = torch.tensor([v[1] if v[2] else -v[1] for v in values], dtype=D).view(1, -1)
    assume(_off_kinks(r, low, high, dual))
    rg, ag = r.clone().requires_grad_(True), a.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r_, a_: ppo_clip_loss(r_, a_, low=low, high=high, dual=dual)[0], (rg, ag))


@given(
    st.lists(st.one_of(_fl(0.0, 1e6), _fl(0.0, 3.0), st.sampled_from([0.0, 0.8, 1.0, 1.2])), min_size=1, max_size=48),
    st.one_of(st.none(), _fl(0.0, 1.0)),
    st.one_of(st.just(0.2), _fl(0.0, 5.0)),
    st.one_of(st.none(), _fl(0.01, 10.0)),
)
def test_prop_cispo_weight_bounds_and_detached(
    values: list[float], low: float | None, high: float, cap: float | None
) -> None:
    r = torch.tensor(values, dtype=D).view(1, -1).requires_grad_(True)
    if cap is None:
        w = cispo_weight(r, low=low, high=high)
        lo = 0.0 if low is None else 1 - low
        assert bool((w <= 1 + high).all()) and bool((w >= lo).all())
        inside = (r >= lo) & (r <= 1 + high)
        assert torch.equal(w[inside], r.detach()[inside])  # unclipped tokens keep their ratio exactly
        assert torch.equal(w[r > 1 + high], torch.full_like(w[r > 1 + high], 1 + high))
        stage = CISPO(low=low, high=high)
    else:
        w = cispo_weight(r, low=None, high=None, cap=cap)
        assert torch.equal(w, r.detach().clamp(max=cap))
        stage = CISPO(low=None, high=None, cap=cap)
    assert not w.requires_grad
    # CISPO's loss -sg(w) A logp: gradient -w A to logp, none to the ratio, clipfrac where w != r
    logp = torch.full_like(r, -1.5, requires_grad=True)
    a = torch.linspace(-2.0, 2.0, r.shape[1], dtype=D).view_as(r)
    out = stage(r, r.log(), a, logp)
    out.loss.sum().backward()
    assert logp.grad is not None and r.grad is None
    assert torch.equal(logp.grad, -w * a)
    assert torch.equal(out.indicators["clipfrac"], w != r.detach())


TAUS = st.one_of(st.just(1.0), st.just(1.05), _fl(0.05, 20.0))


@given(
    st.lists(_fl(0.0, 20.0), min_size=1, max_size=16),
    st.lists(st.one_of(_fl(-100.0, 100.0), st.just(0.0)), min_size=1, max_size=6),
    TAUS,
    TAUS,
)
def test_prop_sapo_gate_monotone_and_bounded(ratios: list[float], advs: list[float], tp: float, tn: float) -> None:
    # loss = -(4/tau) sigma(tau (r - 1)) A: decreasing in r for A > 0, increasing for A < 0, between 0 and -4A/tau
    r = torch.tensor(sorted(ratios), dtype=D).expand(len(advs), -1)
    a = torch.tensor(advs, dtype=D)[:, None].expand_as(r)
    loss = sapo_gate(r, a, tau_pos=tp, tau_neg=tn)
    assert torch.isfinite(loss).all()
    step = loss[:, 1:] - loss[:, :-1]
    pos, neg = a[:, 0] > 0, a[:, 0] < 0
    assert bool((step[pos] <= 0).all())
    assert bool((step[neg] >= 0).all())
    assert torch.equal(loss[a == 0], torch.zeros_like(loss[a == 0]))
    tau = torch.where(a > 0, torch.tensor(tp, dtype=D), torch.tensor(tn, dtype=D))
    bound = -4 * a / tau
    assert bool((loss.abs() <= bound.abs() * (1 + 1e-12)).all())
    assert bool((loss * a <= 0).all())  # sign opposite to A
    assert torch.equal(SAPO(tp, tn)(r, r.log(), a, r).loss, loss)


@given(st.lists(st.one_of(_fl(-100.0, 100.0), st.just(0.0)), min_size=1, max_size=24), TAUS, TAUS)
def test_prop_sapo_gate_on_policy_value_and_slope(advs: list[float], tp: float, tn: float) -> None:
    a = torch.tensor(advs, dtype=D).view(1, -1)
    r = torch.ones_like(a, requires_grad=True)
    loss = sapo_gate(r, a, tau_pos=tp, tau_neg=tn)
    tau = torch.where(a > 0, torch.tensor(tp, dtype=D), torch.tensor(tn, dtype=D))
    torch.testing.assert_close(loss, -2 * a / tau, rtol=1e-14, atol=0)
    loss.sum().backward()
    assert r.grad is not None
    torch.testing.assert_close(r.grad, -a, rtol=1e-14, atol=1e-300)  # slope -A: the unclipped surrogate's


@settings(max_examples=30)
@given(
    st.lists(st.tuples(_fl(0.0, 5.0), _fl(1e-3, 10.0), st.booleans()), min_size=1, max_size=12),
    TAUS,
    TAUS,
)
def test_prop_sapo_gate_gradcheck(pairs_: list[tuple[float, float, bool]], tp: float, tn: float) -> None:
    # |A| >= 1e-3: tau switches with the sign of A, so A stays away from 0 (drawn as a magnitude and a sign)
    r = torch.tensor([p[0] for p in pairs_], dtype=D).view(1, -1).requires_grad_(True)
    a = torch.tensor([p[1] if p[2] else -p[1] for p in pairs_], dtype=D).view(1, -1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r_, a_: sapo_gate(r_, a_, tau_pos=tp, tau_neg=tn), (r, a))


@settings(max_examples=30)
@given(pairs(diff=3.0), st.data())
def test_prop_ratio_constructions_gradcheck(batch: tuple[torch.Tensor, ...], data: st.DataObject) -> None:
    logp, old, mask = batch
    clamp = data.draw(st.sampled_from([20.0, 1.0]))
    assume(bool((((logp - old).abs() - clamp).abs() > 1e-3).all()))
    seq = sequence_log_ratio(logp, old, mask, clamp=1e6)
    assume(bool(((seq - clamp).abs() > 1e-3).all()))
    lp = logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: log_ratio(x, old, mask, clamp=clamp), (lp,))
    assert torch.autograd.gradcheck(lambda x: sequence_log_ratio(x, old, mask, clamp=clamp), (lp,))
    # GSPO-token's value is not its own antiderivative (stop-gradients); the per-sequence surrogate is
    lengths = mask.sum(-1).clamp(min=1).to(D)

    def gspo_surrogate(x: torch.Tensor) -> torch.Tensor:
        return (gspo_token_log_ratio(x, old, mask, clamp_max=clamp).exp() * mask).sum(-1) / lengths

    assert torch.autograd.gradcheck(gspo_surrogate, (lp,))
    stage_tok, stage_gspo = TokenRatio(clamp), GSPORatio(clamp)
    assert torch.equal(stage_tok.log_ratio(logp, old, mask), log_ratio(logp, old, mask, clamp=clamp))
    assert torch.equal(stage_gspo.log_ratio(logp, old, mask), gspo_token_log_ratio(logp, old, mask, clamp_max=clamp))
