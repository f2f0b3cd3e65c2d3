"""fused_policy_loss against the float64 reference ``policy_loss(log_softmax(logits.double() / T).gather(...))``.

Both backends (torch; Triton under ``TRITON_INTERPRET=1``, set by ``conftest.py``) are compared in value,
metrics and gradient with respect to the logits, for every fused preset, every stage option, fp32/fp16/bf16
logits and the kernel's edge cases (all-masked rows, |x| > 1e4, temperature != 1, odd V and N, V = 151,936 and
256,000, strided views, int64 row offsets). Shapes stay small: the interpreter runs ~200x slower than torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.kernels import fused_loss
from rolloutopt.kernels.fused_loss import FUSED_PRESETS, FusedLossOutput, fused_policy_loss
from rolloutopt.losses import KL
from rolloutopt.losses.policy import policy_loss
from rolloutopt.losses.presets import PRESETS
from rolloutopt.ratios import CISPO, MIS, SAPO, TIS, GSPORatio, PPOClip

os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest.py sets it too; needed before the kernel module import

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("triton") is None, reason="triton not installed"))]  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]


def batch(
    b: int = 3,
    t: int = 5,
    v: int = 997,
    *,
    dtype: torch.dtype = torch.float32,
    scale: float = 3.0,
    temperature: float = 0.7,
    seed: int = 0,
    masked_row: bool = True,
) -> dict[str, Any]:
    """Random logits and per-token inputs near on-policy (ratios spread across the clip bounds)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * scale).to(dtype)
    tgt = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[0, 0] = True
    if masked_row and b > 1:
        mask[1] = False
        tgt[1] = -100  # padding ids at masked-out positions are allowed
    with torch.no_grad():
        lp = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tgt.clamp(min=0)[..., None])[..., 0]
    old = (lp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).float()
    return {
        "logits": logits,
        "targets": tgt,
        "old_logp": old,
        "advantages": torch.randn(b, generator=g),
        "mask": mask,
        "behav_logp": old + 0.5 * torch.randn(b, t, generator=g),
        "ref_logp": (lp + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)).float(),
        "temperature": temperature,
    }


def reference(d: dict[str, Any], preset: str | None, kw: dict[str, Any]) -> tuple[Any, torch.Tensor, Any, Any]:
    """float64 ``policy_loss`` on full logits: (LossOutput, d loss / d logits, logp, entropy)."""
    x = d["logits"].detach().double().requires_grad_()
    lsm = torch.log_softmax(x / d["temperature"], -1)
    v = x.shape[-1]
    lp = lsm.gather(-1, d["targets"].clamp(0, v - 1)[..., None])[..., 0]
    p = lsm.exp()
    ent = -(p * torch.where(p > 0, lsm, torch.zeros_like(lsm))).sum(-1)
    lp.retain_grad()
    ent.retain_grad()
    fn: Any = policy_loss if preset is None else PRESETS.get(preset)
    extra = {k: v64 for k, v64 in kw.items() if k not in ("backend", "inplace")}
    for name in ("behav_logp", "ref_logp", "is_weights"):
        if isinstance(extra.get(name), torch.Tensor):
            extra[name] = extra[name].double()
    out = fn(lp, d["old_logp"].double(), d["advantages"].double(), d["mask"], entropy=ent, **extra)
    out.loss.backward()
    assert x.grad is not None
    # fp32 rounds 1 - p at ~1.2e-7 relative: an entry's error can reach eps32 * |dL/dlogp| / T even where the
    # gradient itself is tiny (p -> 1); record that scale for the tolerance.
    g_tok = (lp.grad.abs().max() if lp.grad is not None else 0.0) + (
        ent.grad.abs().max() if ent.grad is not None else 0.0
    )
    x.grad.rounding_scale = float(g_tok) / d["temperature"]  # type: ignore[attr-defined]
    return out, x.grad, lp.detach(), ent.detach()


def run(d: dict[str, Any], preset: str | None, kw: dict[str, Any], backend: str) -> tuple[FusedLossOutput, Any]:
    x = d["logits"].clone().requires_grad_()
    out = fused_policy_loss(
        x, d["targets"], d["old_logp"], d["advantages"], d["mask"], preset=preset,
        temperature=d["temperature"], backend=backend, inplace=False, **kw,
    )  # fmt: skip
    out.loss.backward()
    return out, x.grad


def check(d: dict[str, Any], preset: str | None, kw: dict[str, Any], backend: str, gtol: float = 2e-5) -> None:
    ref, gref, lpref, entref = reference(d, preset, kw)
    out, g = run(d, preset, kw, backend)
    assert out.backend == backend
    m = d["mask"]
    torch.testing.assert_close(out.loss.double(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.per_token.double(), ref.per_token.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logp.double()[m], lpref[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy.double()[m], entref[m], rtol=1e-5, atol=1e-5)
    assert (out.logp[~m] == 0).all() and (out.entropy[~m] == 0).all()
    assert set(out.metrics) == set(ref.metrics) | {"entropy"}
    for k, v in ref.metrics.items():
        torch.testing.assert_close(out.metrics[k].double(), v.double(), rtol=1e-4, atol=1e-5, msg=k)
    scale = gref.abs().max().item()
    bound = gtol * scale + 1e-6 * gref.rounding_scale + 1e-12  # type: ignore[attr-defined]
    err = (g.double() - gref).abs().max().item()
    assert err <= bound, f"dlogits error {err:.3g} > {bound:.3g} (max |g| {scale:.3g})"
    assert (g[~m] == 0).all()


def preset_kw(name: str, d: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {"kl": KL("k3", 0.05), "ref_logp": d["ref_logp"], "entropy_coef": 0.01}
    if "behav_logp" in PRESETS.get(name).requires:
        kw["behav_logp"] = d["behav_logp"]
    if PRESETS.get(name).config["agg"] == "seq-mean-token-sum-norm":
        kw["max_len"] = 8
    return kw


# ------------------------------------------------------------------------------------------------ presets


def test_fused_presets_are_the_token_level_ones() -> None:
    assert set(FUSED_PRESETS) == {"grpo", "dapo", "dr_grpo", "cispo", "sapo", "tis", "icepop", "decoupled_ppo"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FUSED_PRESETS)
def test_every_preset_matches_reference(name: str, backend: str) -> None:
    d = batch(seed=FUSED_PRESETS.index(name))
    check(d, name, preset_kw(name, d), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype: torch.dtype, backend: str) -> None:
    # The reference reads the same half-precision values (upcast exactly); dlogits are rounded to the dtype.
    d = batch(dtype=dtype, seed=3)
    check(d, "icepop", preset_kw("icepop", d), backend, gtol=1e-2 if dtype == torch.bfloat16 else 2e-3)


STAGES: list[tuple[str, dict[str, Any]]] = [
    ("plain surrogate, k1", {"trust": None, "kl": KL("k1", 0.1)}),
    ("ppo dual, abs", {"trust": PPOClip(0.1, 0.3, dual=2.0), "kl": KL("abs", 0.1)}),
    ("cispo low/high, k2", {"trust": CISPO(low=0.1, high=0.1), "kl": KL("k2", 0.1)}),
    ("cispo cap, k3+", {"trust": CISPO(high=None, cap=1.1), "kl": KL("k3+", 0.1)}),
    ("sapo, k3 unclamped", {"trust": SAPO(0.9, 1.2), "kl": KL("k3", 0.1, clamp=False)}),
    ("tis current + lower", {"correction": TIS(cap=1.5, lower=0.8, source="current")}),
    (
        "mis one + tis, kept out",
        {"correction": (MIS(0.8, 1.3, in_band="one"), TIS(cap=1.2)), "removed_in_denominator": False},
    ),
    ("is_weights, seq_weight", {"is_weights": "tok", "seq_weight": "seq", "agg": "seq-mean-token-sum"}),
    ("on-policy, entropy", {"old_logp": None, "entropy_coef": 0.1, "agg": "token-sum"}),
    ("prompt-mean, global denominators", {"agg": "prompt-mean", "group": "grp", "world_size": 2}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", STAGES, ids=[s[0] for s in STAGES])
def test_every_stage_option_matches_reference(case: tuple[str, dict[str, Any]], backend: str) -> None:
    from rolloutopt.losses import Denominators

    d = batch(b=4, seed=11)
    kw = dict(case[1])
    if kw.get("is_weights") == "tok":
        kw["is_weights"] = torch.rand(4, 5) + 0.5
        kw["seq_weight"] = torch.tensor([1.0, 0.0, 2.0, 0.5])
    if "world_size" in kw:
        kw["denominators"] = Denominators(groups=5, world_size=kw.pop("world_size"))
        kw["group"] = torch.tensor([7, 7, 3, 3])
    if "old_logp" in kw:
        d["old_logp"] = kw.pop("old_logp")
    if "kl" in kw:
        kw["ref_logp"] = d["ref_logp"]
    if "correction" in kw:
        kw["behav_logp"] = d["behav_logp"]
    if d["old_logp"] is None:
        ref_old = None
        x = d["logits"].clone().requires_grad_()
        out = fused_policy_loss(x, d["targets"], None, d["advantages"], d["mask"], temperature=0.7, backend=backend,
                                inplace=False, **kw)  # fmt: skip
        out.loss.backward()
        xr = d["logits"].double().requires_grad_()
        lsm = torch.log_softmax(xr / 0.7, -1)
        lp = lsm.gather(-1, d["targets"].clamp(min=0)[..., None])[..., 0]
        ent = -(lsm.exp() * lsm).sum(-1)
        ref = policy_loss(lp, ref_old, d["advantages"].double(), d["mask"], entropy=ent, **kw)
        ref.loss.backward()
        torch.testing.assert_close(out.loss.double(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
        assert x.grad is not None and xr.grad is not None
        torch.testing.assert_close(x.grad.double(), xr.grad, rtol=0, atol=2e-5 * xr.grad.abs().max().item())
        return
    check(d, None, kw, backend)


# ------------------------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_huge_logits_and_temperature(temperature: float, backend: str) -> None:
    # Every logit near 2e4 (ulp 2e-3 in fp32, so x / T before subtracting the max would lose ~1e-3 in p), some at
    # -3e4 (probability 0); the sampled log-probs stay moderate, as they are in practice.
    d = batch(b=2, t=3, v=301, temperature=temperature, seed=5)
    d["logits"] = d["logits"] + 2e4
    d["logits"][:, :, 7::10] = -3e4
    d["targets"][d["targets"] % 10 == 7] += 1
    check(d, "tis", preset_kw("tis", d), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v", [151_936, 256_000])
def test_production_vocabularies(v: int, backend: str) -> None:
    d = batch(b=1, t=2, v=v, masked_row=False, seed=v % 97)
    check(d, "dapo", preset_kw("dapo", d), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits_vocab_masking(backend: str) -> None:
    d = batch(b=2, t=3, v=130, seed=8)
    d["logits"][..., 100:] = -torch.inf  # e.g. padded vocabulary entries
    check(d, "cispo", preset_kw("cispo", d), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_masked_batch(backend: str) -> None:
    d = batch(b=2, t=3, v=50)
    d["mask"][:] = False
    d["logits"][0] = torch.nan  # masked rows are never read
    x = d["logits"].clone().requires_grad_()
    out = fused_policy_loss(x, d["targets"], d["old_logp"], d["advantages"], d["mask"], preset="grpo",
                            backend=backend)  # fmt: skip
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert x.grad is not None and (x.grad == 0).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_vocabulary(backend: str) -> None:
    d = batch(b=2, t=3, v=1)
    check(d, "dapo", preset_kw("dapo", d), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts_strided_flat_and_3d_agree(backend: str) -> None:
    d = batch(b=3, t=4, v=257, seed=2)
    base = torch.randn(3, 5, 257)
    base[:, :4] = d["logits"]
    view = base[:, :4]  # a [B, T+1, V] buffer sliced: non-contiguous, no copy
    assert not view.is_contiguous()
    kw = {"preset": "dapo", "temperature": 0.7, "backend": backend}
    args = (d["old_logp"], d["advantages"], d["mask"])
    ref = fused_policy_loss(d["logits"], d["targets"], *args, inplace=False, **kw)
    strided = fused_policy_loss(view.requires_grad_(), d["targets"], *args, inplace=False, **kw)
    flat2d = fused_policy_loss(d["logits"].reshape(12, 257), d["targets"], *args, **kw)
    torch.testing.assert_close(strided.loss, ref.loss)
    torch.testing.assert_close(flat2d.loss, ref.loss)
    # [N, V] logits with [N] per-token inputs: one sequence of N tokens (same as a token-mean over [B, T]).
    flat1d = fused_policy_loss(
        d["logits"].reshape(12, 257), d["targets"].reshape(12), d["old_logp"].reshape(12),
        d["advantages"][:, None].expand(3, 4).reshape(12), d["mask"].reshape(12), **kw,
    )  # fmt: skip
    torch.testing.assert_close(flat1d.loss, ref.loss)
    assert flat1d.per_token.shape == (12,)
    x = d["logits"].clone().requires_grad_()
    fused_policy_loss(x, d["targets"], *args, inplace=False, **kw).loss.backward()
    assert x.grad is not None
    # A strided view, gradient allocated (its layout differs from the view's) and written in place.
    for inplace in (False, True):
        leaf = base.clone().requires_grad_()
        extra = leaf.detach()[:, 4].clone()
        fused_policy_loss(leaf[:, :4], d["targets"], *args, inplace=inplace, **kw).loss.backward()
        assert leaf.grad is not None
        torch.testing.assert_close(leaf.grad[:, :4], x.grad)
        assert (leaf.grad[:, 4] == 0).all()
        if not inplace:
            torch.testing.assert_close(leaf.detach()[:, 4], extra)
    # [B, T+1, V] with [B, T] targets: the last position is skipped, its gradient is 0, and in place the leaf's
    # gradient is the buffer itself (no full-size zero buffer from a slice backward).
    full = base.clone().requires_grad_()
    out = fused_policy_loss(full, d["targets"], *args, inplace=True, **kw)
    torch.testing.assert_close(out.loss, ref.loss)
    out.loss.backward()
    assert full.grad is not None and full.grad.data_ptr() == full.data_ptr()
    torch.testing.assert_close(full.grad[:, :4], x.grad)
    assert (full.grad[:, 4] == 0).all()


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("triton") is None, reason="triton not installed")
def test_row_offsets_are_int64() -> None:
    from rolloutopt.kernels._fused_loss_triton import row_offset_probe

    # Rows held in int32 (as tl.program_id gives them) and beyond 2^31, with the strides of a [B, T+1, V] view at
    # V = 151,936: every offset is past 2^31 and must not wrap.
    t_len, sb, st = 4096, 4097 * 151_936, 151_936
    for first in (40_000, 2**31 + 5):
        out = torch.zeros(6, dtype=torch.int64)
        row_offset_probe[(6,)](out, first, t_len, sb, st)
        expect = [((first + i) // t_len) * sb + ((first + i) % t_len) * st for i in range(6)]
        assert out.tolist() == expect
        assert min(expect) > 2**32


# ------------------------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("backend", BACKENDS)
def test_logp_and_entropy_outputs_carry_exact_gradients(backend: str) -> None:
    d = batch(b=2, t=3, v=77, seed=4)
    x = d["logits"].clone().requires_grad_()
    out = fused_policy_loss(x, d["targets"], d["old_logp"], d["advantages"], d["mask"], temperature=0.7,
                            backend=backend, inplace=False)  # fmt: skip
    (out.logp * 0.3 + out.entropy * 1.7).sum().backward()
    xr = d["logits"].double().requires_grad_()
    lsm = torch.log_softmax(xr / 0.7, -1)
    m = d["mask"]
    lpr = lsm.gather(-1, d["targets"].clamp(min=0)[..., None])[..., 0]
    entr = -(lsm.exp() * lsm).sum(-1)
    (torch.where(m, lpr * 0.3 + entr * 1.7, 0.0)).sum().backward()
    assert x.grad is not None and xr.grad is not None
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=0, atol=1e-5 * xr.grad.abs().max().item())


def test_gradcheck_float64_torch_backend() -> None:
    d = batch(b=2, t=3, v=7, seed=9, temperature=1.3)
    kw = {"preset": "tis", "behav_logp": d["behav_logp"].double(), "ref_logp": d["ref_logp"].double(),
          "kl": KL("k3", 0.5), "entropy_coef": 0.2, "temperature": 1.3, "backend": "torch", "inplace": False}  # fmt: skip

    def f(x: torch.Tensor) -> torch.Tensor:
        return fused_policy_loss(x, d["targets"], d["old_logp"].double(), d["advantages"].double(), d["mask"],
                                 **kw).loss  # fmt: skip

    assert torch.autograd.gradcheck(f, (d["logits"].double().requires_grad_(),), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_writes_dlogits_into_the_logits(backend: str) -> None:
    d = batch(b=2, t=3, v=64, seed=6)
    x = d["logits"].clone().requires_grad_()
    out = fused_policy_loss(x, d["targets"], d["old_logp"], d["advantages"], d["mask"], preset="dapo",
                            backend=backend)  # fmt: skip
    out.loss.backward(retain_graph=True)
    assert x.grad is not None
    assert x.grad.data_ptr() == x.data_ptr()  # the storage now holds the gradient
    _, g = run({**d, "temperature": 1.0}, "dapo", {}, backend)
    torch.testing.assert_close(x.grad, g)
    with pytest.raises(RuntimeError, match="inplace"):
        out.loss.backward()  # the logits are gone: a second backward must not run on the gradient
    # Another term that saved the logits fails loudly instead of reading dlogits.
    y = d["logits"].clone().requires_grad_()
    other = (y * y).sum()
    fused = fused_policy_loss(y, d["targets"], d["old_logp"], d["advantages"], d["mask"], backend=backend)
    with pytest.raises(RuntimeError, match="inplace"):
        (fused.loss + other).backward()


def test_torch_backend_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    d = batch(b=3, t=5, v=101, seed=12)
    kw = preset_kw("icepop", d)
    whole, g_whole = run(d, "icepop", kw, "torch")
    monkeypatch.setattr(fused_loss, "_TORCH_CHUNK_ELEMS", 250)  # two rows per chunk
    chunked, g_chunked = run(d, "icepop", kw, "torch")
    torch.testing.assert_close(chunked.loss, whole.loss, rtol=0, atol=0)
    torch.testing.assert_close(g_chunked, g_whole, rtol=0, atol=0)


def test_auto_backend_is_torch_on_cpu() -> None:
    d = batch(b=1, t=2, v=10)
    out = fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"])
    assert out.backend == "torch"
    by_object = fused_policy_loss(
        d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"], preset=PRESETS.get("dapo")
    )
    by_name = fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"], preset="dapo")
    torch.testing.assert_close(by_object.loss, by_name.loss, rtol=0, atol=0)


@given(
    b=st.integers(1, 3),
    t=st.integers(1, 4),
    v=st.integers(1, 40),
    name=st.sampled_from(FUSED_PRESETS),
    temperature=st.sampled_from([0.6, 1.0, 1.7]),
    seed=st.integers(0, 10_000),
)
def test_property_torch_backend_equals_reference(
    b: int, t: int, v: int, name: str, temperature: float, seed: int
) -> None:
    d = batch(b, t, v, temperature=temperature, seed=seed, masked_row=b > 1)
    check(d, name, preset_kw(name, d), "torch")


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "name", ["gspo", "pnpo", "cumulative", "tbpo", "m2po", "m2po_clip", "sat", "opsm", "copris", "dppo_tv", "echo_clip"]
)
def test_sequence_level_presets_point_to_token_logprobs(name: str) -> None:
    d = batch(b=1, t=2, v=10)
    with pytest.raises(InputError, match="token_logprobs") as e:
        fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"], preset=name)
    assert e.value.argument == "preset"


@pytest.mark.parametrize(
    ("kw", "arg"),
    [
        ({"ratio": GSPORatio()}, "ratio"),
        ({"correction": TIS(level="sequence")}, "correction"),
        ({"correction": MIS(batch_normalize=True)}, "correction"),
        ({"correction": (TIS(), TIS())}, "correction"),
        ({"preset": "nope"}, "preset"),
        ({"preset": "tis"}, "behav_logp"),
        ({"kl": KL()}, "ref_logp"),
        ({"correction": TIS()}, "behav_logp"),
        ({"preset": "dr_grpo"}, "max_len"),
        ({"backend": "cuda"}, "backend"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"inplace": "yes"}, "inplace"),
        ({"agg": "mean"}, "agg"),
        ({"entropy_coef": float("inf")}, "entropy_coef"),
    ],
)
def test_bad_configuration(kw: dict[str, Any], arg: str) -> None:
    d = batch(b=2, t=2, v=10)
    with pytest.raises(InputError) as e:
        fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"], **kw)
    assert e.value.argument == arg


@pytest.mark.parametrize(
    ("change", "arg"),
    [
        (lambda d: d.update(logits=d["logits"].long()), "logits"),
        (lambda d: d.update(logits=d["logits"][0, 0]), "logits"),
        (lambda d: d.update(targets=d["targets"].float()), "targets"),
        (lambda d: d.update(targets=d["targets"][:1]), "targets"),
        (lambda d: d.update(targets=d["targets"].reshape(4)), "targets"),
        (lambda d: d["targets"].__setitem__((0, 0), 10), "targets"),
        (lambda d: d["targets"].__setitem__((0, 0), -1), "targets"),
        (lambda d: d.update(old_logp=d["old_logp"][:, :1]), "old_logp"),
        (lambda d: d.update(mask=d["mask"].float() * 2), "mask"),
        (lambda d: d.update(advantages=torch.ones(3)), "advantages"),
        (lambda d: d["old_logp"].__setitem__((0, 0), float("nan")), "old_logp"),
        (lambda d: d["logits"].__setitem__((0, 0, 3), float("nan")), "logits"),
    ],
)
def test_bad_inputs(change: Any, arg: str) -> None:
    d = batch(b=2, t=2, v=10)
    change(d)
    with pytest.raises(InputError) as e:
        fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"])
    assert e.value.argument == arg


def test_masked_out_targets_may_be_padding_ids() -> None:
    d = batch(b=2, t=2, v=10)
    assert (d["targets"][1] == -100).all() and not d["mask"][1].any()
    fused_policy_loss(d["logits"], d["targets"], d["old_logp"], d["advantages"], d["mask"])


# ------------------------------------------------------------------------------------------------ benchmark script


def test_gpu_benchmark_dry_run(tmp_path: Path) -> None:
    """``benchmarks/kernels_gpu.py --dry-run`` runs every section at tiny shapes on CPU (torch backend)."""
    out = tmp_path / "kernels_gpu.md"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels_gpu.py"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "FAILED" not in res.stdout, res.stdout[-3000:]
    table = out.read_text()
    for section in ("correct/fused_policy_loss", "correct/token_logprobs", "bench/logits", "bench/fused_linear"):
        assert f"## {section}" in table
    assert "PASS" in table and "FAIL" not in table
