"""KL estimators (verl ``kl_penalty_forward``): oracles, aliases, straight-through "+", clamps, KL stage."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.losses import KL, kl_penalty
from rolloutopt.losses.regularizers import KL_ESTIMATORS

D = torch.float64
LOGP = torch.tensor([[-1.0, -0.5, -2.0]], dtype=D)
REF = torch.tensor([[-1.5, -0.5, -1.0]], dtype=D)
DELTA = REF - LOGP  # [-0.5, 0, 1]


def k3(d: float) -> float:
    return math.exp(d) - d - 1


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [0.5, 0.0, -1.0]),
        ("abs", [0.5, 0.0, 1.0]),
        ("k2", [0.125, 0.0, 0.5]),
        ("k3", [k3(-0.5), 0.0, k3(1.0)]),
        ("kl", [0.5, 0.0, -1.0]),
        ("mse", [0.125, 0.0, 0.5]),
        ("low_var_kl", [k3(-0.5), 0.0, k3(1.0)]),
    ],
)
def test_estimator_oracles(estimator: str, expected: list[float]) -> None:
    out = kl_penalty(LOGP, REF, estimator)
    torch.testing.assert_close(out, torch.tensor([expected], dtype=D))


@pytest.mark.parametrize(("alias", "base"), [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_aliases_have_the_same_gradient(alias: str, base: str) -> None:
    grads = []
    for name in (alias, base):
        lp = LOGP.clone().requires_grad_()
        kl_penalty(lp, REF, name).sum().backward()
        grads.append(lp.grad)
    assert grads[0] is not None and grads[1] is not None
    assert torch.equal(grads[0], grads[1])


def test_k3_gradient() -> None:
    lp = LOGP.clone().requires_grad_()
    kl_penalty(lp, REF, "k3").sum().backward()
    # d/dlogp (e^d - d - 1) with d = ref - logp is 1 - e^d
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, 1 - DELTA.exp())


def test_default_estimator_is_k3() -> None:
    assert torch.equal(kl_penalty(LOGP, REF), kl_penalty(LOGP, REF, "k3"))


@pytest.mark.parametrize("base", ["k1", "abs", "k3", "kl", "low_var_kl", "k2"])
def test_straight_through_value_of_base_gradient_of_k2(base: str) -> None:
    lp = LOGP.clone().requires_grad_()
    out = kl_penalty(lp, REF, base + "+")
    torch.testing.assert_close(out.detach(), kl_penalty(LOGP, REF, base))
    out.sum().backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, LOGP - REF)  # d/dlogp 0.5 (logp - ref)^2


def test_k3_plus_differs_from_k3_in_gradient() -> None:
    grads = []
    for name in ("k3", "k3+"):
        lp = LOGP.clone().requires_grad_()
        kl_penalty(lp, REF, name).sum().backward()
        grads.append(lp.grad)
    assert grads[0] is not None and grads[1] is not None
    assert not torch.allclose(grads[0], grads[1])


def test_k3_clamp() -> None:
    lp = torch.tensor([[0.0, 0.0, 0.0, -30.0]], dtype=D, requires_grad=True)
    ref = torch.tensor([[-20.0, 3.0, -100.0, 0.0]], dtype=D)
    # d = [-20, 3, -100, 30]; k3 = e^d - d - 1 = [19 + e^-20, e^3 - 4, 99 (d clamped to -20: 19), huge]
    out = kl_penalty(lp, ref, "k3", clamp=True)
    expected = [min(k3(-20.0), 10.0), min(k3(3.0), 10.0), min(k3(-20.0), 10.0), 10.0]
    torch.testing.assert_close(out.detach(), torch.tensor([expected], dtype=D))
    assert float(out.detach().max()) <= 10.0
    out.sum().backward()
    assert lp.grad is not None
    # every entry is at the upper clamp except e^3 - 4 = 16.09 (also clamped): all gradients 0
    assert torch.equal(lp.grad, torch.zeros_like(lp))

    lp2 = torch.tensor([[0.0, 0.0]], dtype=D, requires_grad=True)
    unclamped = kl_penalty(lp2, torch.tensor([[-20.0, 3.0]], dtype=D), "k3", clamp=False)
    torch.testing.assert_close(unclamped.detach(), torch.tensor([[k3(-20.0), k3(3.0)]], dtype=D))
    unclamped.sum().backward()
    assert lp2.grad is not None
    torch.testing.assert_close(lp2.grad, torch.tensor([[1 - math.exp(-20.0), 1 - math.exp(3.0)]], dtype=D))


def test_k3_clamp_keeps_large_inputs_finite() -> None:
    lp = torch.tensor([[-200.0]], requires_grad=True)
    out = kl_penalty(lp, torch.tensor([[0.0]]), "k3")
    assert float(out.detach()) == 10.0
    out.sum().backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    assert torch.isinf(kl_penalty(lp.detach(), torch.tensor([[0.0]]), "k3", clamp=False)).all()


def test_clamp_does_not_touch_other_estimators() -> None:
    lp = torch.tensor([[0.0]], dtype=D)
    ref = torch.tensor([[-40.0]], dtype=D)
    for name, value in (("k1", 40.0), ("abs", 40.0), ("k2", 800.0)):
        assert float(kl_penalty(lp, ref, name, clamp=True)) == value


def test_half_precision_upcast() -> None:
    out = kl_penalty(LOGP.bfloat16(), REF.bfloat16(), "k2")
    assert out.dtype == torch.float32


def test_kl_stage() -> None:
    stage = KL()
    assert (stage.estimator, stage.coef, stage.clamp) == ("k3", 0.001, True)
    mask = torch.ones_like(LOGP, dtype=torch.bool)
    for est in ("k1", "k2+", "low_var_kl"):
        torch.testing.assert_close(KL(estimator=est).per_token(LOGP, REF, mask), kl_penalty(LOGP, REF, est))
    lp = torch.tensor([[0.0]], dtype=D)
    ref = torch.tensor([[-40.0]], dtype=D)
    m1 = torch.ones(1, 1, dtype=torch.bool)
    assert float(KL(clamp=False).per_token(lp, ref, m1)) > 10.0
    assert float(KL(clamp=True).per_token(lp, ref, m1)) == 10.0


def test_kl_stage_checks_ref_finite_at_masked_in_positions() -> None:
    ref = REF.clone()
    ref[0, 2] = math.nan
    with pytest.raises(InputError) as e:
        KL().per_token(LOGP, ref, torch.ones_like(LOGP, dtype=torch.bool))
    assert e.value.argument == "ref_logp"
    mask = torch.tensor([[True, True, False]])
    assert torch.isfinite(KL().per_token(LOGP, ref, mask)[mask]).all()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"estimator": "full"}, "KL.estimator"),
        ({"estimator": "k4"}, "KL.estimator"),
        ({"estimator": "k3++"}, "KL.estimator"),
        ({"coef": -0.1}, "KL.coef"),
        ({"coef": "0.1"}, "KL.coef"),
        ({"coef": math.nan}, "KL.coef"),
    ],
)
def test_kl_stage_validates(kw: dict[str, object], field: str) -> None:
    with pytest.raises(InputError) as e:
        KL(**kw)  # type: ignore[arg-type]
    assert e.value.argument == field


def test_kl_penalty_bad_inputs() -> None:
    with pytest.raises(InputError) as e:
        kl_penalty(LOGP, REF, "full")
    assert e.value.argument == "estimator"
    with pytest.raises(InputError) as e:
        kl_penalty(LOGP, REF[:, :2])
    assert e.value.argument == "ref_logp"
    with pytest.raises(InputError) as e:
        kl_penalty(LOGP.long(), REF)
    assert e.value.argument == "logp"


def test_estimator_list() -> None:
    assert {"k1", "k2", "k3", "abs", "k3+", "low_var_kl+", "kl", "mse"} <= set(KL_ESTIMATORS)
    assert "full" not in KL_ESTIMATORS


# ------------------------------------------------------------------------------------ hypothesis properties

NON_NEGATIVE = [e for e in KL_ESTIMATORS if e.rstrip("+") in ("abs", "k2", "k3", "mse", "low_var_kl")]
BASE = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def _fl(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)


@st.composite
def kl_pairs(draw: st.DrawFn, lo: float = -1e4, hi: float = 0.0, dtype: torch.dtype = D) -> tuple[torch.Tensor, ...]:
    """(logp, ref) [B, T] with values in [lo, hi]; some positions equal, some differences tiny."""
    b, n = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    vals = st.one_of(_fl(lo, hi), st.sampled_from([v for v in (0.0, -1.0, -20.0) if lo <= v <= hi]))
    lp = draw(st.lists(vals, min_size=b * n, max_size=b * n))
    kinds = st.one_of(vals, st.just("same"), _fl(-1e-6, 1e-6).map(lambda e: ("near", e)))
    ref = []
    for v, k in zip(lp, draw(st.lists(kinds, min_size=b * n, max_size=b * n)), strict=True):
        ref.append(v if k == "same" else v + k[1] if isinstance(k, tuple) else k)
    return torch.tensor(lp, dtype=dtype).view(b, n), torch.tensor(ref, dtype=dtype).view(b, n)


def _grad(logp: torch.Tensor, ref: torch.Tensor, estimator: str, **kw: bool) -> tuple[torch.Tensor, ...]:
    lp, rf = logp.clone().requires_grad_(True), ref.clone().requires_grad_(True)
    out = kl_penalty(lp, rf, estimator, **kw)
    out.sum().backward()
    assert lp.grad is not None and rf.grad is not None
    return out.detach(), lp.grad, rf.grad


@given(kl_pairs(), st.sampled_from([D, torch.float32]))
def test_prop_finite_value_and_gradient_with_clamp(pair: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
    logp, ref = (p.to(dtype) for p in pair)
    for estimator in KL_ESTIMATORS:
        out, g_lp, g_ref = _grad(logp, ref, estimator)
        assert torch.isfinite(out).all(), estimator
        assert torch.isfinite(g_lp).all() and torch.isfinite(g_ref).all(), estimator


@given(kl_pairs(lo=-30.0))
def test_prop_finite_without_clamp_on_log_prob_range(pair: tuple[torch.Tensor, ...]) -> None:
    # unclamped k3 is exp(d): finite in fp32 for |d| <= 60 (log-probs in [-30, 0])
    logp, ref = (p.float() for p in pair)
    for estimator in KL_ESTIMATORS:
        out, g_lp, g_ref = _grad(logp, ref, estimator, clamp=False)
        assert torch.isfinite(out).all() and torch.isfinite(g_lp).all() and torch.isfinite(g_ref).all(), estimator


@given(kl_pairs(), st.sampled_from([D, torch.float32]), st.booleans())
def test_prop_non_negative_estimators(pair: tuple[torch.Tensor, ...], dtype: torch.dtype, clamp: bool) -> None:
    logp, ref = (p.to(dtype) for p in pair)
    if not clamp:  # keep exp finite
        logp, ref = logp.clamp(min=-40.0), ref.clamp(min=-40.0)
    for estimator in NON_NEGATIVE:
        out = kl_penalty(logp, ref, estimator, clamp=clamp)
        assert bool((out >= 0).all()), estimator


@pytest.mark.parametrize(("dtype", "d"), [(torch.float32, 6.3562e-07), (D, 1e-08)])
def test_k3_non_negative_for_tiny_differences(dtype: torch.dtype, d: float) -> None:
    # computed as exp(d) - d - 1, k3 rounded to -5.96e-08 (fp32) here; expm1(d) - d is >= 0 and accurate
    out = kl_penalty(torch.zeros(1, 1, dtype=dtype), torch.full((1, 1), d, dtype=dtype), "k3")
    assert float(out) >= 0.0


@given(kl_pairs(), st.booleans())
def test_prop_zero_where_logp_equals_ref(pair: tuple[torch.Tensor, ...], clamp: bool) -> None:
    logp, _ = pair
    for estimator in KL_ESTIMATORS:
        out, g_lp, g_ref = _grad(logp, logp.clone(), estimator, clamp=clamp)
        assert torch.equal(out, torch.zeros_like(out)), estimator
        if estimator.endswith("+") or estimator.rstrip("+") in ("k2", "k3", "mse", "low_var_kl"):
            # k2's and k3's gradient vanishes at the minimum (and so does the straight-through gradient)
            assert torch.equal(g_lp, torch.zeros_like(g_lp)), estimator
            assert torch.equal(g_ref, torch.zeros_like(g_ref)), estimator


@given(kl_pairs())
def test_prop_k1_antisymmetric_k2_abs_symmetric(pair: tuple[torch.Tensor, ...]) -> None:
    logp, ref = pair
    for est in ("k1", "kl", "k1+"):
        assert torch.equal(kl_penalty(ref, logp, est), -kl_penalty(logp, ref, est)), est
    for est in ("k2", "mse", "abs", "k2+", "abs+"):
        assert torch.equal(kl_penalty(ref, logp, est), kl_penalty(logp, ref, est)), est
    assert torch.equal(kl_penalty(logp, ref, "abs"), kl_penalty(logp, ref, "k1").abs())


@given(kl_pairs(lo=-50.0), st.booleans())
def test_prop_straight_through_value_of_base_gradient_of_k2(pair: tuple[torch.Tensor, ...], clamp: bool) -> None:
    logp, ref = pair
    for estimator in (e for e in KL_ESTIMATORS if e.endswith("+")):
        base = estimator[:-1]
        value, g_lp, g_ref = _grad(logp, ref, estimator, clamp=clamp)
        assert torch.equal(value, kl_penalty(logp, ref, base, clamp=clamp)), estimator
        torch.testing.assert_close(g_lp, logp - ref, rtol=1e-12, atol=1e-12)  # d/dlogp 0.5 (logp - ref)^2
        torch.testing.assert_close(g_ref, ref - logp, rtol=1e-12, atol=1e-12)
        _, k2_lp, k2_ref = _grad(logp, ref, "k2")
        assert torch.equal(g_lp, k2_lp) and torch.equal(g_ref, k2_ref), estimator


@given(kl_pairs(lo=-15.0))
def test_prop_unclamped_k3_formula(pair: tuple[torch.Tensor, ...]) -> None:
    logp, ref = pair
    expected = [
        [math.expm1(r - p) - (r - p) for p, r in zip(pr, rr, strict=True)]
        for pr, rr in zip(logp.tolist(), ref.tolist(), strict=True)
    ]
    for est in ("k3", "low_var_kl"):
        out, g_lp, _ = _grad(logp, ref, est, clamp=False)
        torch.testing.assert_close(out, torch.tensor(expected, dtype=D), rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(g_lp, 1 - (ref - logp).exp(), rtol=1e-10, atol=1e-13)  # d/dlogp (e^d - d - 1)


@given(kl_pairs(lo=-1e4))
def test_prop_clamped_k3_bounded_and_equal_to_unclamped_where_small(pair: tuple[torch.Tensor, ...]) -> None:
    logp, ref = pair
    clamped = kl_penalty(logp, ref, "k3")
    assert bool((clamped <= 10).all()) and bool((clamped >= 0).all())
    d = ref - logp
    small = (d > -9.0) & (d < 2.0)  # where e^d - d - 1 < 10 and |d| < 20: the clamps do not act
    unclamped = kl_penalty(logp, ref, "k3", clamp=False)  # inf where d is large: only `small` is read
    assert torch.equal(clamped[small], unclamped[small])
    # where e^d - d - 1 > 10 (d > 3 or d < -12, either before or after the ±20 clamp of d) the value is exactly 10
    big = (d > 3.0) | (d < -12.0)
    assert torch.equal(clamped[big], torch.full_like(clamped[big], 10.0))


@settings(max_examples=30)
@given(kl_pairs(lo=-5.0), st.data())
def test_prop_gradcheck_k1_k2_k3(pair: tuple[torch.Tensor, ...], data: st.DataObject) -> None:
    logp, ref = pair
    d = ref - logp
    # the clamped form too, away from the kink where e^d - d - 1 reaches the clamp 10
    clamp = data.draw(st.booleans()) and bool(((d.exp() - d - 1 - 10).abs() > 1e-2).all())
    lp, rf = logp.clone().requires_grad_(True), ref.clone().requires_grad_(True)
    for est in ("k1", "k2", "k3", "abs"):
        if est == "abs" and bool((d.abs() < 1e-3).any()):
            continue  # |.| has a kink at 0
        assert torch.autograd.gradcheck(lambda a, b, est=est: kl_penalty(a, b, est, clamp=clamp), (lp, rf)), est


@given(kl_pairs(lo=-50.0), st.sampled_from(KL_ESTIMATORS), st.booleans(), st.data())
def test_prop_kl_stage_matches_function(
    pair: tuple[torch.Tensor, ...], estimator: str, clamp: bool, data: st.DataObject
) -> None:
    logp, ref = pair
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=logp.numel(), max_size=logp.numel()))).view_as(logp)
    stage = KL(estimator=estimator, coef=0.5, clamp=clamp)
    assert torch.equal(stage.per_token(logp, ref, mask), kl_penalty(logp, ref, estimator, clamp=clamp))


# ------------------------------------------------------------------------------ NeMo-RL's clamped k3 term


def nemo_k3_term(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's per-token KL term as ``NVIDIA-NeMo/RL@7ea279ab`` computes it, written out for the test:
    ``nemo_rl/algorithms/utils.py::calculate_kl(kl_type="k3", input_clamp_value=20, output_clamp_value=10,
    importance_sampling_weights=w)`` with ``ClippedPGLossFn``'s on-policy weight ``w = exp(logp - sg(logp))``
    (``nemo_rl/algorithms/loss/loss_functions.py``, ``use_on_policy_kl_approximation=False``): the log-ratio
    ``ref - logp`` is clamped to ±20 (where it is clamped, ``w`` is detached), ``w · (e^x - 1 - x)`` is formed
    and clamped to ±10."""
    w = torch.exp(logp - logp.detach())
    x = ref - logp
    xc = x.clamp(-20.0, 20.0)
    w = torch.where(x == xc, w, w.detach())
    return (w * (torch.exp(xc) - 1 - xc)).clamp(-10.0, 10.0)


# d = ref - logp (logp = 0): inside the clamps, k3 just above 10 (d = 2.7 and -12), |d| > 20 on either side
NEMO_D = [-0.5, 0.0, 1.0, 2.6, 2.7, -10.5, -12.0, 25.0, -25.0]


def test_k3_plus_clamp_grad_is_nemo_rl_on_hand_values() -> None:
    # values: k3 = e^d - d - 1, clamped to 10: [0.10653, 0, 0.71828, 9.86374, 10, 9.50003, 10, 10, 10]
    # gradient wrt logp: logp - ref = -d inside both clamps (k3 <= 10 and |d| <= 20), 0 outside:
    #   [0.5, 0, -1, -2.6, 0, 10.5, 0, 0, 0]; verl's k3+ (clamp_grad=False) has -d everywhere.
    ref = torch.tensor([NEMO_D], dtype=D)
    values = [k3(-0.5), 0.0, k3(1.0), k3(2.6), 10.0, k3(-10.5), 10.0, 10.0, 10.0]
    torch.testing.assert_close(
        torch.tensor(values[:6]), torch.tensor([0.10653, 0, 0.71828, 9.86374, 10, 9.50003]), atol=1e-5, rtol=0
    )
    grads = {}
    for clamp_grad in (True, False):
        lp = torch.zeros(1, len(NEMO_D), dtype=D, requires_grad=True)
        out = kl_penalty(lp, ref, "k3+", clamp_grad=clamp_grad)
        torch.testing.assert_close(out.detach(), torch.tensor([values], dtype=D))
        out.sum().backward()
        assert lp.grad is not None
        grads[clamp_grad] = lp.grad[0].tolist()
    assert grads[True] == pytest.approx([0.5, 0.0, -1.0, -2.6, 0.0, 10.5, 0.0, 0.0, 0.0], abs=1e-12)
    assert grads[False] == pytest.approx([-d for d in NEMO_D], abs=1e-12)
    # NeMo-RL's term, by autograd on its own formula, gives the same value and gradient
    lp = torch.zeros(1, len(NEMO_D), dtype=D, requires_grad=True)
    theirs = nemo_k3_term(lp, ref)
    theirs.sum().backward()
    assert lp.grad is not None
    torch.testing.assert_close(theirs.detach(), torch.tensor([values], dtype=D))
    assert lp.grad[0].tolist() == pytest.approx(grads[True], abs=1e-12)
    # the KL stage, with a coefficient
    stage = KL("k3+", coef=0.04, clamp_grad=True)
    lp = torch.zeros(1, len(NEMO_D), dtype=D, requires_grad=True)
    (stage.coef * stage.per_token(lp, ref, torch.ones(1, len(NEMO_D), dtype=torch.bool))).sum().backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.04 * x for x in grads[True]], abs=1e-12)


@settings(max_examples=60)
@given(kl_pairs(lo=-60.0), st.sampled_from(["k3+", "low_var_kl+"]))
def test_prop_clamp_grad_matches_nemo_rl(pair: tuple[torch.Tensor, ...], estimator: str) -> None:
    logp, ref = pair
    ours, g_ours, _ = _grad(logp, ref, estimator, clamp_grad=True)
    lp = logp.clone().requires_grad_(True)
    theirs = nemo_k3_term(lp, ref)
    theirs.sum().backward()
    assert lp.grad is not None
    torch.testing.assert_close(ours, theirs.detach(), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(g_ours, lp.grad, atol=1e-8, rtol=1e-8)
    # inside the clamps it is verl's k3+ gradient; the value never changes
    plain, g_plain, _ = _grad(logp, ref, estimator)
    assert torch.equal(plain, ours)
    d = ref - logp
    inside = (d.abs() <= 20) & (torch.expm1(d.clamp(-20, 20)) - d.clamp(-20, 20) <= 10)
    assert torch.equal(g_ours[inside], g_plain[inside]) and bool((g_ours[~inside] == 0).all())


def test_clamp_grad_bad_input() -> None:
    for kw, arg in (
        ({"estimator": "k2+", "clamp_grad": True}, "clamp_grad"),
        ({"estimator": "k1", "clamp_grad": True}, "clamp_grad"),
        ({"estimator": "k3+", "clamp": False, "clamp_grad": True}, "clamp_grad"),
        ({"estimator": "k3+", "clamp_grad": 1}, "clamp_grad"),
        ({"estimator": "k3", "clamp": "yes"}, "clamp"),
    ):
        with pytest.raises(InputError) as e:
            kl_penalty(LOGP, REF, **kw)  # type: ignore[arg-type]
        assert e.value.argument == arg, kw
        with pytest.raises(InputError) as e:
            KL(**kw)  # type: ignore[arg-type]
        assert e.value.argument == f"KL.{arg}", kw
    # plain k3 with its clamp already has NeMo-RL's zero gradient where clamped: clamp_grad is accepted, same output
    lp = torch.zeros(1, len(NEMO_D), dtype=D)
    ref = torch.tensor([NEMO_D], dtype=D)
    assert torch.equal(kl_penalty(lp, ref, "k3", clamp_grad=True), kl_penalty(lp, ref, "k3"))
    assert KL().clamp_grad is False
