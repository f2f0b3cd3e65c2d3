"""logits_logprobs against the float64 reference ``log_softmax(logits.double() / T).gather(...)`` and entropy.

Both backends (torch; Triton under ``TRITON_INTERPRET=1``, which the root ``tests/conftest.py`` sets before
anything imports triton) are compared in value and in d/dlogits for random cotangents on both outputs: fp32,
fp16 and bf16 logits, all-masked rows and batches, |logits| > 1e4, -inf logits, temperatures != 1, odd N and V,
V = 151,936 and 256,000, every layout, the in-place contract, and the workspace bound of the torch backend. Shapes
stay small: the interpreter runs ~200x slower than torch.
"""

from __future__ import annotations

import ast
import importlib
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rolloutopt.errors import InputError
from rolloutopt.kernels import logits_logprobs, resolve_logits_backend, torch_chunk_rows

os.environ.setdefault("TRITON_INTERPRET", "1")  # the root conftest.py sets it first; kept for direct runs

# the module (``rolloutopt.kernels.logits_logprobs`` as an attribute is the function of the same name)
ll = importlib.import_module("rolloutopt.kernels.logits_logprobs")

HAVE_TRITON = __import__("importlib.util").util.find_spec("triton") is not None
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed"))]
ROOT = Path(__file__).resolve().parents[2]
EPS32 = 2.0**-23


def make(
    b: int = 3,
    t: int = 5,
    v: int = 997,
    *,
    dtype: torch.dtype = torch.float32,
    scale: float = 3.0,
    seed: int = 0,
    masked_row: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logits ``[B, T, V]``, targets (``-100`` at masked-out positions) and a mask with one empty row."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * scale).to(dtype)
    tgt = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[0, 0] = True
    if masked_row and b > 1:
        mask[1] = False
    tgt[~mask] = -100
    return logits, tgt, mask


def reference(
    logits: torch.Tensor, tgt: torch.Tensor, temperature: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(logp, entropy)`` of every row (0 where masked) and the leaf they were computed from."""
    x = logits.detach().double().requires_grad_()
    xs = torch.where(mask[..., None], x, torch.zeros_like(x))  # masked-out rows may hold anything (NaN)
    lsm = torch.log_softmax(xs / temperature, -1)
    lp = lsm.gather(-1, tgt.clamp(0, x.shape[-1] - 1)[..., None])[..., 0]
    p = lsm.exp()
    ent = -(p * torch.where(p > 0, lsm, torch.zeros_like(lsm))).sum(-1)
    zero = torch.zeros_like(lp)
    return torch.where(mask, lp, zero), torch.where(mask, ent, zero), x


def compare(
    logits: torch.Tensor,
    tgt: torch.Tensor,
    mask: torch.Tensor | None,
    backend: str,
    *,
    temperature: float = 0.7,
    gtol: float = 2e-5,
    vtol: float = 1e-5,
    inplace: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values and d/dlogits of ``logp·g_l + H·g_h`` against the float64 reference; returns (logp, H, dlogits)."""
    m = torch.ones(tgt.shape, dtype=torch.bool) if mask is None else mask
    g = torch.Generator().manual_seed(seed + 1)
    gl = torch.randn(tgt.shape, generator=g, dtype=torch.float64)
    gh = torch.randn(tgt.shape, generator=g, dtype=torch.float64)
    lp_ref, ent_ref, x64 = reference(logits, tgt, temperature, m)
    (lp_ref * gl + ent_ref * gh).sum().backward()
    assert x64.grad is not None
    x = logits.clone().requires_grad_()
    lp, ent = logits_logprobs(x, tgt, temperature=temperature, mask=mask, inplace=inplace, backend=backend)
    assert lp.shape == tgt.shape and ent.shape == tgt.shape
    assert lp.dtype == ent.dtype == (torch.float64 if logits.dtype == torch.float64 else torch.float32)
    (lp.double() * gl + ent.double() * gh).sum().backward()
    assert x.grad is not None
    scale_v = max(1.0, float(lp_ref.detach().abs().max()) if lp_ref.numel() else 1.0)
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=vtol, atol=vtol * scale_v)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), rtol=vtol, atol=vtol)
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all()
    gref = x64.grad
    # fp32 rounds 1 - p at ~1.2e-7 relative: an entry's error can reach eps32 * |cotangent| / T even where the
    # gradient itself is tiny (p -> 1).
    rounding = EPS32 * float((gl.abs() + gh.abs()).max()) / temperature if gl.numel() else 0.0
    bound = gtol * float(gref.abs().max() if gref.numel() else 0.0) + 8 * rounding + 1e-12
    err = float((x.grad.double() - gref).abs().max()) if gref.numel() else 0.0
    assert err <= bound, f"dlogits error {err:.3g} > {bound:.3g}"
    assert (x.grad[~m] == 0).all()
    return lp.detach(), ent.detach(), x.grad


def small_blocks(backend: str, monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """Force ``block``-wide vocabulary blocks in the Triton kernels (the interpreter otherwise reads a row of up to
    32,768 entries in one block), so that the online rescaling across blocks runs."""
    if backend == "triton":
        tk = importlib.import_module("rolloutopt.kernels._logits_logprobs_triton")
        monkeypatch.setattr(tk, "block_v", lambda v, gpu_block: block)


# ------------------------------------------------------------------------------------------------ hand computed


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_computed_online_log_sum_exp(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four logits in two vocabulary blocks of two, at temperature 2, computed as Liger's Triton
    ``_selective_log_softmax_kernel`` does (``linkedin/Liger-Kernel@08a676ef80099d8a2de2f85c1537e9289ca542cc``,
    ``src/liger_kernel/ops/grpo_loss.py``: running max ``m``, ``l = l·e^{m - m'} + Σ e^{z - m'}`` per block,
    ``lse = m + log l``, ``logp = z_y - lse``) and the entropy as verl's ``entropy_from_logits``
    (``volcengine/verl@33ddc71428da6e945cee80f6020dac4b59cb9c63``, ``verl/utils/torch_functional.py``:
    ``logsumexp(z) - Σ softmax(z) z``). Gradients by hand: ``d logp / dx_v = (1[v = y] - p_v) / T`` and
    ``dH / dx_v = -p_v (z_v - E_p z) / T``."""
    x = [1.0, 3.0, 2.0, 0.0]
    t_, y = 2.0, 2
    z = [v / t_ for v in x]  # 0.5, 1.5, 1.0, 0.0
    m1 = max(z[0], z[1])  # block 1: m = 1.5, l = e^{-1} + 1
    l1 = math.exp(z[0] - m1) + math.exp(z[1] - m1)
    m2 = max(m1, z[2], z[3])  # block 2: the max stays 1.5 (alpha = 1)
    l2 = l1 * math.exp(m1 - m2) + math.exp(z[2] - m2) + math.exp(z[3] - m2)
    lse = m2 + math.log(l2)
    logp = z[y] - lse
    p = [math.exp(v - lse) for v in z]
    ez = sum(pv * zv for pv, zv in zip(p, z, strict=True))
    entropy = lse - ez
    assert entropy == pytest.approx(-sum(pv * math.log(pv) for pv in p), rel=1e-12)
    d_logp = [((v == y) - p[v]) / t_ for v in range(4)]
    d_ent = [-p[v] * (z[v] - ez) / t_ for v in range(4)]

    small_blocks(backend, monkeypatch, 2)  # Triton: two vocabulary blocks of two (torch reads whole rows)
    for cotangent, expect in (((1.0, 0.0), d_logp), ((0.0, 1.0), d_ent)):
        logits = torch.tensor([x], requires_grad=True)
        lp, ent = logits_logprobs(logits, torch.tensor([y]), temperature=t_, backend=backend, inplace=False)
        assert lp.detach().tolist() == pytest.approx([logp], abs=1e-6)
        assert ent.detach().tolist() == pytest.approx([entropy], abs=1e-6)
        (cotangent[0] * lp.sum() + cotangent[1] * ent.sum()).backward()
        assert logits.grad is not None
        assert logits.grad[0].tolist() == pytest.approx(expect, abs=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_row_has_entropy_log_v(backend: str) -> None:
    """Equal logits: p = 1/V, so log p = -log V and H = log V at any temperature; the gradient of H is 0."""
    v = 37
    logits = torch.full((2, v), 4.5, requires_grad=True)
    lp, ent = logits_logprobs(logits, torch.tensor([0, 36]), temperature=1.7, backend=backend, inplace=False)
    torch.testing.assert_close(lp, torch.full((2,), -math.log(v)))
    torch.testing.assert_close(ent, torch.full((2,), math.log(v)))
    ent.sum().backward()
    assert logits.grad is not None and float(logits.grad.abs().max()) < 1e-7


# ------------------------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_matches_reference(backend: str) -> None:
    logits, tgt, mask = make()
    compare(logits, tgt, mask, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype: torch.dtype, backend: str) -> None:
    # The reference reads the same half-precision values (upcast exactly); dlogits are rounded to the dtype.
    logits, tgt, mask = make(dtype=dtype, seed=3)
    _, _, g = compare(logits, tgt, mask, backend, gtol=1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert g.dtype == dtype


def test_float64_torch_backend_is_exact_and_passes_gradcheck() -> None:
    logits, tgt, mask = make(b=2, t=3, v=7, dtype=torch.float64, seed=9)
    compare(logits, tgt, mask, "torch", temperature=1.3, vtol=1e-12, gtol=1e-11)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return logits_logprobs(x, tgt, temperature=1.3, mask=mask, inplace=False, backend="torch")

    assert torch.autograd.gradcheck(f, (logits.clone().requires_grad_(),), eps=1e-6, atol=1e-7)
    # and with the extra last position attached ([B, T + 1, V] logits, [B, T] targets)
    full = torch.cat([logits, torch.randn(2, 1, 7, dtype=torch.float64)], 1)
    assert torch.autograd.gradcheck(f, (full.requires_grad_(),), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_huge_logits_and_temperature(temperature: float, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every logit near 2e4 (ulp 2e-3 in fp32, so x / T before subtracting the max would lose ~1e-3 in p), some at
    # -3e4 (probability 0); the sampled log-probs stay moderate, as they are in practice.
    small_blocks(backend, monkeypatch, 64)
    logits, tgt, mask = make(b=2, t=3, v=301, seed=5)
    logits = logits + 2e4
    logits[:, :, 7::10] = -3e4
    tgt[mask & (tgt % 10 == 7)] += 1
    compare(logits, tgt, mask, backend, temperature=temperature)


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    small_blocks(backend, monkeypatch, 32)
    logits, tgt, mask = make(b=2, t=3, v=130, seed=8)
    logits[..., 100:] = -torch.inf  # e.g. padded vocabulary entries
    logits[0, 2, :64] = -torch.inf  # whole leading blocks of -inf: the max identity must not give NaN
    tgt[0, 2], mask[0, 2] = 70, True
    tgt[mask] = tgt[mask] % 100
    logits[0, 1, :] = -torch.inf  # one entry left: p = 1, so logp = 0 and H = 0
    logits[0, 1, 42] = 3.0
    tgt[0, 1], mask[0, 1] = 42, True
    lp, ent, g = compare(logits, tgt, mask, backend)
    assert float(lp[0, 1]) == 0.0 and float(ent[0, 1]) == 0.0
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_rows_are_zero_and_never_leak(backend: str) -> None:
    logits, tgt, mask = make(b=3, t=4, v=50, seed=1)
    logits[1] = torch.nan  # a masked-out row: its NaN must not reach the outputs or the gradient
    compare(logits, tgt, mask, backend)
    mask[:] = False
    x = logits.clone().requires_grad_()
    lp, ent = logits_logprobs(x, tgt, mask=mask, backend=backend)
    (lp.sum() + ent.sum()).backward()
    assert (lp == 0).all() and (ent == 0).all()
    assert x.grad is not None and (x.grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("n", "v"), [(1, 1), (7, 3), (13, 1023), (5, 1025), (3, 4097)])
def test_odd_n_and_v(n: int, v: int, backend: str) -> None:
    g = torch.Generator().manual_seed(n * v)
    logits = torch.randn(n, v, generator=g) * 2
    tgt = torch.randint(0, v, (n,), generator=g)
    lp, ent, _ = compare(logits, tgt, None, backend, temperature=1.3)
    if v == 1:
        assert (lp == 0).all() and (ent == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v", [151_936, 256_000])
def test_production_vocabularies(v: int, backend: str) -> None:
    logits, tgt, mask = make(b=1, t=2, v=v, masked_row=False, seed=v % 97)
    compare(logits, tgt, mask, backend)


def test_empty_batch() -> None:
    logits = torch.randn(0, 9, requires_grad=True)
    lp, ent = logits_logprobs(logits, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad is not None and logits.grad.shape == (0, 9)


@given(
    b=st.integers(1, 3),
    t=st.integers(1, 4),
    v=st.integers(1, 40),
    temperature=st.sampled_from([0.6, 1.0, 1.7]),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    seed=st.integers(0, 10_000),
)
def test_property_torch_backend_equals_reference(
    b: int, t: int, v: int, temperature: float, scale: float, seed: int
) -> None:
    logits, tgt, mask = make(b, t, v, scale=scale, seed=seed, masked_row=b > 1)
    compare(logits, tgt, mask, "torch", temperature=temperature, seed=seed)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_backends_agree_to_rounding() -> None:
    logits, tgt, mask = make(b=4, t=6, v=2053, seed=21)
    a = compare(logits, tgt, mask, "torch", seed=21)
    b = compare(logits, tgt, mask, "triton", seed=21)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_output_alone(backend: str) -> None:
    """Only logp, or only the entropy, in the loss: the other cotangent is absent (None) in the backward."""
    logits, tgt, mask = make(b=2, t=3, v=77, seed=4)
    for which in ("logp", "entropy"):
        x = logits.clone().requires_grad_()
        lp, ent = logits_logprobs(x, tgt, temperature=0.7, mask=mask, backend=backend, inplace=False)
        (lp if which == "logp" else ent).mul(torch.linspace(-1, 2, 6).view(2, 3)).sum().backward()
        lr, er, x64 = reference(logits, tgt, 0.7, mask)
        (lr if which == "logp" else er).mul(torch.linspace(-1, 2, 6, dtype=torch.float64).view(2, 3)).sum().backward()
        assert x.grad is not None and x64.grad is not None
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=2e-6 * float(x64.grad.abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_writes_dlogits_into_the_logits(backend: str) -> None:
    logits, tgt, mask = make(b=2, t=3, v=64, seed=6)
    _, _, g_alloc = compare(logits, tgt, mask, backend, inplace=False)
    x = logits.clone().requires_grad_()
    keep = logits.clone()
    lp, ent = logits_logprobs(x, tgt, temperature=0.7, mask=mask, backend=backend)
    gen = torch.Generator().manual_seed(1)
    gl = torch.randn(tgt.shape, generator=gen, dtype=torch.float64)
    gh = torch.randn(tgt.shape, generator=gen, dtype=torch.float64)
    loss = (lp.double() * gl + ent.double() * gh).sum()
    loss.backward(retain_graph=True)
    assert x.grad is not None
    assert x.grad.data_ptr() == x.data_ptr()  # the storage now holds the gradient
    torch.testing.assert_close(x.grad, g_alloc, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()  # the logits are gone: a second backward must not run on the gradient
    # inplace=False leaves the logits untouched
    y = logits.clone().requires_grad_()
    logits_logprobs(y, tgt, mask=mask, backend=backend, inplace=False)[0].sum().backward()
    torch.testing.assert_close(y.detach(), keep, rtol=0, atol=0)
    # Another term that saved the logits fails loudly instead of reading dlogits.
    z = logits.clone().requires_grad_()
    other = (z * z).sum()
    lp2, _ = logits_logprobs(z, tgt, mask=mask, backend=backend)
    with pytest.raises(RuntimeError, match="inplace"):
        (lp2.sum() + other).backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts_strided_flat_and_extra_position(backend: str) -> None:
    logits, tgt, mask = make(b=3, t=4, v=257, seed=2)
    ref_lp, ref_ent, ref_g = compare(logits, tgt, mask, backend)
    kw: dict[str, Any] = {"temperature": 0.7, "backend": backend}
    gen = torch.Generator().manual_seed(1)
    gl = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    gh = torch.randn(3, 4, generator=gen, dtype=torch.float64)

    def grad_of(x: torch.Tensor, t: torch.Tensor, m: torch.Tensor, **extra: Any) -> torch.Tensor:
        leaf = x.detach().clone().requires_grad_()
        lp, ent = logits_logprobs(leaf, t, mask=m, **kw, **extra)
        (lp.double().reshape(3, 4) * gl + ent.double().reshape(3, 4) * gh).sum().backward()
        assert leaf.grad is not None
        return leaf.grad

    # [B·T, V] logits with [B, T] targets, and [N, V] with [N]: the same numbers
    torch.testing.assert_close(grad_of(logits.reshape(12, 257), tgt, mask).view(3, 4, 257), ref_g)
    lp, ent = logits_logprobs(logits.reshape(12, 257), tgt.reshape(12), mask=mask.reshape(12), **kw)
    assert lp.shape == (12,)
    torch.testing.assert_close(lp.view(3, 4), ref_lp)
    torch.testing.assert_close(ent.view(3, 4), ref_ent)
    torch.testing.assert_close(grad_of(logits.reshape(12, 257), tgt.reshape(12), mask.reshape(12)).view(3, 4, 257),
                               ref_g)  # fmt: skip
    # a [B, T + 1, V] buffer sliced (non-contiguous, no copy) and the buffer itself with [B, T] targets
    base = torch.randn(3, 5, 257)
    base[:, :4] = logits
    for inplace in (False, True):
        leaf = base.clone().requires_grad_()
        lp, ent = logits_logprobs(leaf[:, :4], tgt, mask=mask, inplace=inplace, **kw)
        (lp.double() * gl + ent.double() * gh).sum().backward()
        assert leaf.grad is not None
        torch.testing.assert_close(leaf.grad[:, :4], ref_g)
        assert (leaf.grad[:, 4] == 0).all()
        full = base.clone().requires_grad_()
        lp, ent = logits_logprobs(full, tgt, mask=mask, inplace=inplace, **kw)
        torch.testing.assert_close(lp, ref_lp)
        (lp.double() * gl + ent.double() * gh).sum().backward()
        assert full.grad is not None
        torch.testing.assert_close(full.grad[:, :4], ref_g)
        assert (full.grad[:, 4] == 0).all()
        if inplace:  # the leaf's gradient is its own buffer: no full-size zero buffer from a slice backward
            assert full.grad.data_ptr() == full.data_ptr()
    # logits with a non-unit stride along V are copied first (same numbers)
    transposed = logits.transpose(1, 2).contiguous().transpose(1, 2)
    assert transposed.stride(-1) != 1
    torch.testing.assert_close(grad_of(transposed, tgt, mask), ref_g)
    # 0/1 float mask and mask=None
    torch.testing.assert_close(grad_of(logits, tgt, mask.float()), ref_g)
    lp_all, _ = logits_logprobs(logits, tgt.clamp(min=0), **kw)
    torch.testing.assert_close(lp_all[mask], ref_lp[mask])


# ------------------------------------------------------------------------------------------------ memory


class _Allocations(TorchDispatchMode):
    """Records the largest storage (in elements) that any op creates, ignoring the logits' own storage."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.skip = logits.untyped_storage().data_ptr()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.skip:
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


def test_chunk_rows() -> None:
    assert torch_chunk_rows(151_936) == (1 << 22) // 151_936 == 27
    assert torch_chunk_rows(1) == 1 << 22
    assert torch_chunk_rows(1 << 23) == 1  # a vocabulary larger than a chunk: one row at a time


@pytest.mark.parametrize("n", [64, 1024])
def test_torch_workspace_is_independent_of_n(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every temporary of the torch backend (forward and in-place backward) is one chunk of rows or a per-row
    vector: with 4,096-element chunks, no op allocates more than 4,096 elements, at N = 64 and N = 1,024
    (N·V = 32,768 and 524,288)."""
    monkeypatch.setattr(ll, "_TORCH_CHUNK_ELEMS", 4096)
    v = 512
    assert torch_chunk_rows(v) == 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, v, generator=g).requires_grad_()
    tgt = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.1
    rec = _Allocations(x)
    with rec:
        lp, ent = logits_logprobs(x, tgt, temperature=0.7, mask=mask, backend="torch")
        (lp.sum() + 0.5 * ent.sum()).backward()
    assert x.grad is not None and x.grad.data_ptr() == x.data_ptr()
    assert rec.largest <= 4096, f"an op allocated {rec.largest} elements (> one 4,096-element chunk)"


def test_torch_backend_chunking_is_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, tgt, mask = make(b=3, t=5, v=101, seed=12)
    whole = compare(logits, tgt, mask, "torch")
    monkeypatch.setattr(ll, "_TORCH_CHUNK_ELEMS", 250)  # two rows per chunk
    chunked = compare(logits, tgt, mask, "torch")
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_row_offsets_are_int64() -> None:
    from rolloutopt.kernels._logits_logprobs_triton import row_offset_probe

    # Rows held in int32 (as tl.program_id gives them) and beyond 2^31, with the strides of a [B, T+1, V] view at
    # V = 151,936: every offset is past 2^31 and must not wrap.
    t_len, sb, st_ = 4096, 4097 * 151_936, 151_936
    for first in (40_000, 2**31 + 5):
        out = torch.zeros(6, dtype=torch.int64)
        row_offset_probe[(6,)](out, first, t_len, sb, st_)
        expect = [((first + i) // t_len) * sb + ((first + i) % t_len) * st_ for i in range(6)]
        assert out.tolist() == expect
        assert min(expect) > 2**32


# ------------------------------------------------------------------------------------------------ layering


def test_kernels_import_only_the_core() -> None:
    """``rolloutopt.kernels`` sits directly above the core: no module of it imports losses, ratios or any layer
    above (checked on the source, so that no import order can hide it)."""
    allowed = ("rolloutopt._validation", "rolloutopt.errors", "rolloutopt.typing", "rolloutopt.groups",
               "rolloutopt.registry", "rolloutopt.kernels")  # fmt: skip
    for path in sorted((ROOT / "src" / "rolloutopt" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] if node.level == 0 else []
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == "rolloutopt" or name.startswith("rolloutopt."):
                    assert name.startswith(allowed), f"{path.name} imports {name}"


# ------------------------------------------------------------------------------------------------ bad input


def test_backend_choice() -> None:
    logits = torch.randn(2, 5)
    assert resolve_logits_backend("auto", logits) == "torch"  # CPU tensors: torch, also under the interpreter
    assert resolve_logits_backend("auto", logits.double()) == "torch"
    if HAVE_TRITON:
        assert resolve_logits_backend("triton", logits) == "triton"  # CPU tensors under TRITON_INTERPRET=1
        with pytest.raises(InputError) as e:
            logits_logprobs(logits.double(), torch.tensor([0, 1]), backend="triton")
        assert e.value.argument == "logits" and "backend='torch'" in str(e.value)


def _base() -> dict[str, Any]:
    logits, tgt, mask = make(b=2, t=2, v=10)
    return {"logits": logits, "targets": tgt, "mask": mask}


@pytest.mark.parametrize(
    ("change", "arg"),
    [
        (lambda d: d.update(logits=d["logits"].long()), "logits"),
        (lambda d: d.update(logits=[[0.0, 1.0]]), "logits"),
        (lambda d: d.update(logits=d["logits"][0, 0]), "logits"),
        (lambda d: d.update(logits=torch.zeros(2, 2, 0)), "logits"),
        (lambda d: d.update(targets=d["targets"].float()), "targets"),
        (lambda d: d.update(targets=d["targets"].bool()), "targets"),
        (lambda d: d.update(targets=d["targets"][:1]), "targets"),
        (lambda d: d.update(targets=d["targets"].reshape(4)), "targets"),
        (lambda d: d.update(targets=[[0, 1], [2, 3]]), "targets"),
        (lambda d: d["targets"].__setitem__((0, 0), 10), "targets"),
        (lambda d: d["targets"].__setitem__((0, 0), -1), "targets"),
        (lambda d: d.update(mask=d["mask"][:, :1]), "mask"),
        (lambda d: d.update(mask=d["mask"].float() * 2), "mask"),
        (lambda d: d.update(temperature=0.0), "temperature"),
        (lambda d: d.update(temperature=float("nan")), "temperature"),
        (lambda d: d.update(temperature=True), "temperature"),
        (lambda d: d.update(inplace="yes"), "inplace"),
        (lambda d: d.update(backend="cuda"), "backend"),
        (lambda d: d["logits"].__setitem__((0, 0, 3), float("nan")), "logits"),
        (lambda d: d["logits"].__setitem__((0, 0), -float("inf")), "logits"),
        (lambda d: d["logits"].__setitem__((0, 0, 1), float("inf")), "logits"),
    ],
)
def test_bad_inputs(change: Any, arg: str) -> None:
    d = _base()
    d["targets"][0, 0] = 3
    d["mask"][0, 0] = True
    change(d)
    with pytest.raises(InputError) as e:
        logits_logprobs(d.pop("logits"), d.pop("targets"), **d)
    assert e.value.argument == arg


def test_masked_out_targets_may_be_padding_ids() -> None:
    d = _base()
    assert (d["targets"][1] == -100).all() and not d["mask"][1].any()
    lp, _ = logits_logprobs(d["logits"], d["targets"], mask=d["mask"])
    assert (lp[1] == 0).all()
