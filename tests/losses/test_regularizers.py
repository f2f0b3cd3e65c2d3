"""KL estimators (specs §7.1, verl ``kl_penalty``): oracles, aliases, straight-through "+", clamps, KL stage."""

from __future__ import annotations

import math

import pytest
import torch

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
    assert float(out) == 10.0
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
