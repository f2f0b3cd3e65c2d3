"""fused_policy_loss = logits_logprobs + policy_loss, against ``policy_loss`` on ``log_softmax`` + ``gather``.

Every registered preset is compared in float64 (value, per-token loss, every metric, log-probs, entropies and
d/dlogits, to 1e-9), as it is and with a KL term and an entropy bonus added; a subset in fp32 on both kernel
backends (Triton under ``TRITON_INTERPRET=1``, set by the root ``tests/conftest.py``) against the float64 reference;
then layouts, the entropy hand-off, the in-place contract and bad input.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from rolloutopt.errors import InputError
from rolloutopt.losses import KL, FusedLossOutput, fused_policy_loss, policy_loss
from rolloutopt.losses.presets import PRESETS

HAVE_TRITON = __import__("importlib.util").util.find_spec("triton") is not None
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed"))]
TEMP = 0.7
EPS32 = 2.0**-23


def batch(
    b: int = 4, t: int = 5, v: int = 97, *, dtype: torch.dtype = torch.float64, seed: int = 0, k: int = 4
) -> dict[str, Any]:
    """Logits, targets, mask (one empty sequence, ``-100`` targets there) and every optional input a preset may
    read, near on-policy; per-token inputs in ``dtype`` (float64 or float32)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g, dtype=torch.float64) * 3).to(dtype)
    tgt = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[0, 0] = True
    mask[1] = False
    with torch.no_grad():
        lsm = torch.log_softmax(logits.double() / TEMP, -1)
        lp = lsm.gather(-1, tgt[..., None])[..., 0]
        ids = (logits.double() + torch.randn(b, t, v, generator=g, dtype=torch.float64)).topk(k, -1).indices
        lsm_b = torch.log_softmax((logits.double() + 0.5 * torch.randn(b, t, v, generator=g, dtype=torch.float64))
                                  / TEMP, -1)  # fmt: skip

    def near(x: torch.Tensor, s: float) -> torch.Tensor:
        return (x + s * torch.randn(x.shape, generator=g, dtype=torch.float64)).clamp(max=0.0).to(dtype)

    old = near(lp, 0.3)
    tgt[~mask] = -100  # padding ids at masked-out positions are allowed
    return {
        "logits": logits,
        "targets": tgt,
        "mask": mask,
        "old_logp": old,
        "advantages": torch.randn(b, generator=g, dtype=torch.float64).to(dtype),
        "inputs": {
            "behav_logp": near(old.double(), 0.3),
            "ref_logp": near(lp, 0.2),
            "versions": torch.randint(0, 3, (b, t), generator=g),
            "policy_version": 3,
            "topk_logp": lsm.gather(-1, ids).to(dtype),
            "topk_behav_logp": lsm_b.gather(-1, ids).to(dtype),
            "confidence": torch.rand(b, generator=g, dtype=torch.float64).to(dtype),
            "group": torch.arange(b) // 2,
            "max_len": t,
        },
    }


def reference(d: dict[str, Any], preset: str | None, kw: dict[str, Any]) -> tuple[Any, torch.Tensor, Any, Any]:
    """float64 ``policy_loss`` (or the preset) on full logits: (LossOutput, d loss / d logits, logp, entropy)."""
    x = d["logits"].detach().double().requires_grad_()
    xs = torch.where(d["mask"][..., None], x, torch.zeros_like(x))
    lsm = torch.log_softmax(xs / TEMP, -1)
    lp = lsm.gather(-1, d["targets"].clamp(min=0)[..., None])[..., 0]
    p = lsm.exp()
    ent = -(p * torch.where(p > 0, lsm, torch.zeros_like(lsm))).sum(-1)
    lp.retain_grad()
    ent.retain_grad()
    extra = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    coef = extra.get("entropy_coef", PRESETS.get(preset).config.get("entropy_coef", 0.0) if preset else 0.0)
    if coef != 0:
        extra["entropy"] = ent
    fn: Any = policy_loss
    if preset is not None:
        fn = PRESETS.get(preset)
        if fn.experimental is not None:
            extra["experimental"] = True
    old = None if d["old_logp"] is None else d["old_logp"].double()
    out = fn(lp, old, d["advantages"].double(), d["mask"], **extra)
    out.loss.backward()
    assert x.grad is not None
    g_tok = (lp.grad.abs().max() if lp.grad is not None else 0.0) + (
        ent.grad.abs().max() if ent.grad is not None else 0.0
    )
    x.grad.rounding_scale = float(g_tok) / TEMP  # type: ignore[attr-defined]
    return out, x.grad, lp.detach(), ent.detach()


def run(d: dict[str, Any], preset: str | None, kw: dict[str, Any], backend: str) -> tuple[FusedLossOutput, Any]:
    x = d["logits"].clone().requires_grad_()
    experimental = preset is not None and PRESETS.get(preset).experimental is not None
    out = fused_policy_loss(
        x, d["targets"], d["old_logp"], d["advantages"], d["mask"], preset=preset, temperature=TEMP,
        backend=backend, inplace=False, experimental=experimental, **kw,
    )  # fmt: skip
    out.loss.backward()
    return out, x.grad


def check(
    d: dict[str, Any], preset: str | None, kw: dict[str, Any], backend: str, *, tol: float, gtol: float
) -> FusedLossOutput:
    ref, gref, lpref, entref = reference(d, preset, kw)
    out, g = run(d, preset, kw, backend)
    assert out.backend == backend
    m = d["mask"]
    torch.testing.assert_close(out.loss.double(), ref.loss.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.per_token.double(), ref.per_token.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.logp.double()[m], lpref[m], rtol=tol, atol=tol * 10)
    torch.testing.assert_close(out.entropy.double()[m], entref[m], rtol=tol, atol=tol)
    assert (out.logp[~m] == 0).all() and (out.entropy[~m] == 0).all()
    assert set(out.metrics) == set(ref.metrics) | {"entropy"}
    for k, v in ref.metrics.items():
        torch.testing.assert_close(out.metrics[k].double(), v.double(), rtol=10 * tol, atol=tol, msg=k)
    mean_h = entref[m].mean()
    torch.testing.assert_close(out.metrics["entropy"].double(), mean_h, rtol=tol, atol=tol)
    scale = float(gref.abs().max())
    bound = gtol * scale + EPS32 * 8 * gref.rounding_scale * (gtol > 1e-8) + 1e-14  # type: ignore[attr-defined]
    err = float((g.double() - gref).abs().max())
    assert err <= bound, f"dlogits error {err:.3g} > {bound:.3g} (max |g| {scale:.3g})"
    assert (g[~m] == 0).all()
    return out


def everything(d: dict[str, Any]) -> dict[str, Any]:
    """Every optional input, with ``allow_unused=True`` (a configuration reads what it declares, on both sides)."""
    return {**d["inputs"], "allow_unused": True}


# ------------------------------------------------------------------------------------------------ every preset


@pytest.mark.parametrize("regularised", [False, True], ids=["as-is", "kl+entropy"])
@pytest.mark.parametrize("name", PRESETS.names())
def test_every_preset_equals_policy_loss_float64(name: str, regularised: bool) -> None:
    d = batch(seed=PRESETS.names().index(name))
    kw = everything(d)
    if regularised:
        kw.update(kl=KL("k3", 0.05), entropy_coef=0.01)
    check(d, name, kw, "torch", tol=1e-9, gtol=1e-9)


TOKEN_AND_SEQUENCE = ["grpo", "dapo", "cispo", "sapo", "tis", "icepop", "gspo", "cumulative"]


@pytest.mark.parametrize("name", TOKEN_AND_SEQUENCE)
def test_fp32_logits_torch_backend(name: str) -> None:
    d = batch(dtype=torch.float32, v=301, seed=TOKEN_AND_SEQUENCE.index(name))
    check(d, name, {**everything(d), "kl": KL("k3", 0.05), "entropy_coef": 0.01}, "torch", tol=1e-5, gtol=2e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
@pytest.mark.parametrize("name", ["dapo", "gspo", "icepop"])
def test_fp32_logits_triton_backend(name: str) -> None:
    d = batch(b=3, t=4, dtype=torch.float32, v=301, seed=7)
    check(d, name, {**everything(d), "kl": KL("k3", 0.05), "entropy_coef": 0.01}, "triton", tol=1e-5, gtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype: torch.dtype, backend: str) -> None:
    # The reference reads the same half-precision values (upcast exactly); dlogits are rounded to the dtype.
    d = batch(b=3, t=4, v=257, seed=3)
    d["logits"] = d["logits"].to(dtype)
    d["old_logp"], d["advantages"] = d["old_logp"].float(), d["advantages"].float()
    kw = {"behav_logp": d["inputs"]["behav_logp"].float()}
    check(d, "tis", kw, backend, tol=1e-5, gtol=1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_stage_keywords_without_a_preset() -> None:
    from rolloutopt.ratios import MIS, SAPO, TIS, GSPORatio, PPOClip

    d = batch(seed=11)
    behav = d["inputs"]["behav_logp"]
    cases: list[dict[str, Any]] = [
        {"trust": None, "kl": KL("k1", 0.1), "ref_logp": d["inputs"]["ref_logp"]},
        {"trust": PPOClip(0.1, 0.3, dual=2.0), "agg": "token-sum", "seq_weight": torch.tensor([1.0, 0.0, 2.0, 0.5],
                                                                                           dtype=torch.float64)},
        {"trust": SAPO(0.9, 1.2), "correction": (MIS(0.8, 1.3, in_band="one"), TIS(cap=1.2)), "behav_logp": behav,
         "removed_in_denominator": False},
        {"ratio": GSPORatio(), "agg": "prompt-mean", "group": d["inputs"]["group"]},
        {"is_weights": torch.rand(4, 5, dtype=torch.float64) + 0.5, "entropy_coef": 0.1},
    ]  # fmt: skip
    for kw in cases:
        check(d, None, kw, "torch", tol=1e-9, gtol=1e-9)
    d["old_logp"] = None  # on-policy
    check(d, None, {"entropy_coef": 0.05}, "torch", tol=1e-9, gtol=1e-9)


def test_gradcheck_float64() -> None:
    d = batch(b=2, t=3, v=7, seed=9)
    kw = {"preset": "tis", "behav_logp": d["inputs"]["behav_logp"], "ref_logp": d["inputs"]["ref_logp"],
          "kl": KL("k3", 0.5), "entropy_coef": 0.2, "temperature": 1.3, "backend": "torch", "inplace": False}  # fmt: skip

    def f(x: torch.Tensor) -> torch.Tensor:
        return fused_policy_loss(x, d["targets"], d["old_logp"], d["advantages"], d["mask"], **kw).loss

    assert torch.autograd.gradcheck(f, (d["logits"].clone().requires_grad_(),), eps=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------ hand computed


def test_hand_computed_one_token() -> None:
    """One token, V = 2, logits ``[0, log 3]`` at temperature 1: p = (1/4, 3/4), target 1, so logp = log(3/4)
    and H = -(1/4 log 1/4 + 3/4 log 3/4). On-policy GRPO (ratio 1, unclipped): loss = -A - c H; with
    ``d(-A r)/d logp = -A`` and the softmax Jacobian, ``dL/dx = -A (1[v = y] - p) + c p (log p + H)``."""
    a, c = 0.8, 0.3
    p = [0.25, 0.75]
    h = -(p[0] * math.log(p[0]) + p[1] * math.log(p[1]))
    expect = [-a * ((v == 1) - p[v]) + c * p[v] * (math.log(p[v]) + h) for v in range(2)]
    x = torch.tensor([[[0.0, math.log(3.0)]]], dtype=torch.float64, requires_grad=True)
    out = fused_policy_loss(x, torch.tensor([[1]]), None, torch.tensor([a], dtype=torch.float64),
                            torch.tensor([[True]]), preset="grpo", entropy_coef=c)  # fmt: skip
    assert out.logp.item() == pytest.approx(math.log(0.75), abs=1e-12)
    assert out.entropy.item() == pytest.approx(h, abs=1e-12)
    assert out.loss.item() == pytest.approx(-a - c * h, abs=1e-12)
    assert out.metrics["entropy"].item() == pytest.approx(h, abs=1e-12)
    out.loss.backward()
    assert x.grad is not None
    assert x.grad[0, 0].tolist() == pytest.approx(expect, abs=1e-12)


def test_entropy_reaches_policy_loss_only_when_consumed() -> None:
    """``dapo`` has no entropy bonus: the entropy is not passed (``policy_loss`` would refuse it) but reported;
    with ``entropy_coef=c`` and token-mean aggregation the loss moves by exactly ``-c · mean(H)``."""
    d = batch(seed=4)
    base, _ = run(d, "dapo", {}, "torch")
    bonus, _ = run(d, "dapo", {"entropy_coef": 0.25}, "torch")
    m = d["mask"]
    mean_h = base.entropy[m].mean()
    torch.testing.assert_close(base.metrics["entropy"], mean_h)
    torch.testing.assert_close(bonus.loss, base.loss - 0.25 * mean_h)
    torch.testing.assert_close(bonus.metrics["pg_loss"], base.loss)


# ------------------------------------------------------------------------------------------------ layouts


@pytest.mark.parametrize("backend", BACKENDS)
def test_flat_layout_is_one_sequence(backend: str) -> None:
    """``[N, V]`` logits with ``[N]`` targets and ``[N]`` per-token inputs: one sequence of N tokens."""
    d = batch(b=3, t=4, v=50, dtype=torch.float32, seed=2)
    n = 12
    behav = d["inputs"]["behav_logp"]
    adv_tok = d["advantages"][:, None].expand(3, 4)
    kw = {"preset": "tis", "temperature": TEMP, "backend": backend}
    one = fused_policy_loss(d["logits"].reshape(1, n, 50), d["targets"].reshape(1, n), d["old_logp"].reshape(1, n),
                            adv_tok.reshape(1, n), d["mask"].reshape(1, n), behav_logp=behav.reshape(1, n), **kw)  # fmt: skip
    flat = fused_policy_loss(d["logits"].reshape(n, 50), d["targets"].reshape(n), d["old_logp"].reshape(n),
                             adv_tok.reshape(n), d["mask"].reshape(n), behav_logp=behav.reshape(n), **kw)  # fmt: skip
    torch.testing.assert_close(flat.loss, one.loss)
    assert flat.per_token.shape == flat.logp.shape == flat.entropy.shape == (n,)
    torch.testing.assert_close(flat.per_token, one.per_token.view(n))
    for k, v in one.metrics.items():
        torch.testing.assert_close(flat.metrics[k], v, msg=k)
    # [B·T, V] logits with [B, T] tensors: the same as [B, T, V]
    bt = fused_policy_loss(d["logits"].reshape(n, 50), d["targets"], d["old_logp"], d["advantages"], d["mask"],
                           behav_logp=behav, **kw)  # fmt: skip
    b3 = fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"], behav_logp=behav, **kw)
    torch.testing.assert_close(bt.loss, b3.loss)
    assert bt.logp.shape == (3, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_default_and_extra_position(backend: str) -> None:
    d = batch(b=3, t=4, v=64, dtype=torch.float32, seed=6)
    args = (d["targets"], d["old_logp"], d["advantages"], d["mask"])
    _, g = run(d, "gspo", {}, backend)
    full = torch.cat([d["logits"], torch.randn(3, 1, 64)], 1).requires_grad_()  # [B, T + 1, V]
    out = fused_policy_loss(full, *args, preset="gspo", temperature=TEMP, backend=backend)
    out.loss.backward(retain_graph=True)
    assert full.grad is not None and full.grad.data_ptr() == full.data_ptr()
    torch.testing.assert_close(full.grad[:, :4], g)
    assert (full.grad[:, 4] == 0).all()
    with pytest.raises(RuntimeError, match="inplace"):
        out.loss.backward()  # the logits now hold their gradient


def test_all_masked_batch() -> None:
    d = batch(b=2, t=3, v=20, dtype=torch.float32)
    d["mask"][:] = False
    d["logits"][0] = torch.nan  # masked rows never reach the loss or the gradient
    out, g = run(d, "dapo", {}, "torch")
    assert out.loss.item() == 0.0
    assert (g == 0).all()
    assert all(bool(torch.isfinite(v)) for v in out.metrics.values())


def test_preset_object_equals_name() -> None:
    d = batch(b=2, t=3, v=20, dtype=torch.float32)
    args = (d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"])
    by_name = fused_policy_loss(*args, preset="dapo")
    by_object = fused_policy_loss(*args, preset=PRESETS.get("dapo"))
    torch.testing.assert_close(by_object.loss, by_name.loss, rtol=0, atol=0)
    assert by_name.backend == "torch"  # auto on CPU


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kw", "arg"),
    [
        ({"preset": "nope"}, "preset"),
        ({"preset": 3}, "preset"),
        ({"trsut": None}, "trsut"),
        ({"entropy": torch.zeros(2, 2)}, "entropy"),
        ({"experimental": "yes"}, "experimental"),
        ({"experimental": True}, "experimental"),
        ({"preset": "pnpo"}, "experimental"),
        ({"preset": "tis"}, "behav_logp"),
        ({"preset": "dapo", "behav_logp": torch.zeros(2, 2)}, "behav_logp"),
        ({"kl": KL()}, "ref_logp"),
        ({"preset": "dr_grpo"}, "max_len"),
        ({"backend": "cuda"}, "backend"),
        ({"temperature": 0.0}, "temperature"),
        ({"inplace": "yes"}, "inplace"),
        ({"agg": "mean"}, "agg"),
        ({"entropy_coef": float("inf")}, "entropy_coef"),
    ],
)
def test_bad_configuration(kw: dict[str, Any], arg: str) -> None:
    d = batch(b=2, t=2, v=10, dtype=torch.float32)
    with pytest.raises(InputError) as e:
        fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"], **kw)
    assert e.value.argument == arg


@pytest.mark.parametrize(
    ("change", "arg"),
    [
        (lambda d: d.update(logits=d["logits"].long()), "logits"),
        (lambda d: d.update(targets=d["targets"].float()), "targets"),
        (lambda d: d.update(targets=d["targets"][:1]), "targets"),
        (lambda d: d["targets"].__setitem__((0, 0), 10), "targets"),
        (lambda d: d.update(old_logp=d["old_logp"][:, :1]), "old_logp"),
        (lambda d: d.update(mask=d["mask"].float() * 2), "mask"),
        (lambda d: d.update(advantages=torch.ones(3)), "advantages"),
        (lambda d: d["old_logp"].__setitem__((0, 0), float("nan")), "old_logp"),
        (lambda d: d["logits"].__setitem__((0, 0, 3), float("nan")), "logits"),
    ],
)
def test_bad_inputs(change: Any, arg: str) -> None:
    d = batch(b=2, t=2, v=10, dtype=torch.float32)
    d["mask"][0, 0] = True
    d["targets"][0, 0] = 3
    change(d)
    with pytest.raises(InputError) as e:
        fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"])
    assert e.value.argument == arg
