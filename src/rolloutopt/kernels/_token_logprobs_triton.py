"""Triton kernels of :func:`rolloutopt.kernels.token_logprobs` (imported only when the Triton backend runs).

Two kernels, both computing logits tiles with ``tl.dot`` over ``d`` and never storing the ``[N, V]`` logits:

- ``_fwd_kernel``: grid ``(row blocks, vocabulary splits)``. Each program runs the online log-sum-exp over its
  split (running max ``m``, ``s = Σ e^{z-m}``, ``a = Σ e^{z-m}(z-m)``, and the target logit when it lies in the
  split) and writes fp32 partials ``[splits, N]``; :func:`forward` merges the splits in torch.
- ``_grad_tile_kernel``: one ``[chunk_tokens, chunk_vocab]`` tile of logit gradients
  ``G = [g_logp (onehot - p) - g_H p (log p + H)] / T``, recomputing the logits; the caller's chunk loop does
  ``dh += G W`` and ``dW += Gᵀ h`` (the 4-matmul schedule, ``docs/methods/kernels.md``).

Interpreter rules (``docs/methods/kernels.md``): every load is cast to fp32 before elementwise math; under
``TRITON_INTERPRET=1`` the ``tl.dot`` operands are upcast to fp32 (the interpreter multiplies raw bf16 bits); no
libdevice; no autotune (one fixed config per mode); launches are wrapped in ``torch.compiler.disable``. Row and column offsets are
int64 (every ``x * stride`` multiplies an int64 ``x64``; a test checks the source), so ``N * V`` and ``V * d``
beyond 2**31 index correctly. ``-inf`` is the max identity, and the first block and masked tail columns are
guarded so no ``0 * inf`` NaN appears. The kernels call no device functions of their own (and ``tl.full``
rather than the jitted ``tl.zeros``): under the interpreter each such call re-patches ``triton.language``
(milliseconds), once per tile.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from rolloutopt.kernels._backend import interpreting

__all__ = ["forward", "grad_tile"]


@triton.jit  # type: ignore[untyped-decorator]
def _offsets_probe(out_ptr: Any, start: Any, stride: Any, BLOCK: tl.constexpr) -> None:
    """Test helper: the kernels' offset pattern ``idx.to(tl.int64) * stride`` on ``start + arange(BLOCK)``."""
    idx = start + tl.arange(0, BLOCK)
    idx64 = idx.to(tl.int64)
    tl.store(out_ptr + tl.arange(0, BLOCK), idx64 * stride)


@triton.jit  # type: ignore[untyped-decorator]
def _fwd_kernel(
    h_ptr: Any,
    w_ptr: Any,
    t_ptr: Any,
    m_ptr: Any,
    s_ptr: Any,
    a_ptr: Any,
    zy_ptr: Any,
    N: Any,
    V: Any,
    D: Any,
    stride_hn: Any,
    stride_hd: Any,
    stride_wv: Any,
    stride_wd: Any,
    inv_t: tl.constexpr,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < N
    tgt = tl.load(t_ptr + rows, mask=row_ok, other=-1)
    rows64 = rows.to(tl.int64)
    h_off = rows64 * stride_hn
    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    s = tl.full((BM,), 0.0, dtype=tl.float32)
    a = tl.full((BM,), 0.0, dtype=tl.float32)
    zy = tl.full((BM,), 0.0, dtype=tl.float32)
    v_start = pid_s * SPLIT
    v_end = tl.minimum(v_start + SPLIT, V)
    for v0 in range(v_start, v_end, BN):
        cols = v0 + tl.arange(0, BN)
        col_ok = cols < v_end
        cols64 = cols.to(tl.int64)
        w_off = cols64 * stride_wv
        acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
        for k0 in range(0, D, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < D
            ks64 = ks.to(tl.int64)
            hb = tl.load(
                h_ptr + h_off[:, None] + ks64[None, :] * stride_hd, mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            wb = tl.load(
                w_ptr + w_off[None, :] + ks64[:, None] * stride_wd, mask=k_ok[:, None] & col_ok[None, :], other=0.0
            )
            if UPCAST:  # the interpreter multiplies bf16 dot operands as raw bits
                hb = hb.to(tl.float32)
                wb = wb.to(tl.float32)
            acc = tl.dot(hb, wb, acc, input_precision="ieee") if IEEE else tl.dot(hb, wb, acc)
        z = tl.where(col_ok[None, :], acc * inv_t, float("-inf"))
        zy += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)  # 0 on the first block (m = -inf, m_new finite)
        zc = z - m_new[:, None]
        e = tl.exp(zc)  # 0 on masked columns
        if WITH_ENTROPY:
            shift = tl.where(s > 0.0, m - m_new, 0.0) * s  # no -inf * 0 on the first block
            a = alpha * (a + shift) + tl.sum(e * tl.where(col_ok[None, :], zc, 0.0), axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
    split64 = pid_s.to(tl.int64)
    out = split64 * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(a_ptr + out, a, mask=row_ok)
    tl.store(zy_ptr + out, zy, mask=row_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _grad_tile_kernel(
    h_ptr: Any,
    w_ptr: Any,
    t_ptr: Any,
    lse_ptr: Any,
    ent_ptr: Any,
    gl_ptr: Any,
    gh_ptr: Any,
    g_ptr: Any,
    N: Any,
    V: Any,
    D: Any,
    v0: Any,
    stride_hn: Any,
    stride_hd: Any,
    stride_wv: Any,
    stride_wd: Any,
    stride_gn: Any,
    inv_t: tl.constexpr,
    HAS_GL: tl.constexpr,
    HAS_GH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
) -> None:
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < N
    col_ok = cols < V
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    h_off = rows64 * stride_hn
    w_off = cols64 * stride_wv
    acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
    for k0 in range(0, D, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < D
        ks64 = ks.to(tl.int64)
        hb = tl.load(
            h_ptr + h_off[:, None] + ks64[None, :] * stride_hd, mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        wb = tl.load(
            w_ptr + w_off[None, :] + ks64[:, None] * stride_wd, mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        if UPCAST:  # the interpreter multiplies bf16 dot operands as raw bits
            hb = hb.to(tl.float32)
            wb = wb.to(tl.float32)
        acc = tl.dot(hb, wb, acc, input_precision="ieee") if IEEE else tl.dot(hb, wb, acc)
    z = acc
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    logp = z * inv_t - lse[:, None]
    p = tl.exp(logp)
    g = tl.full((BM, BN), 0.0, dtype=tl.float32)
    if HAS_GH:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        gh = tl.load(gh_ptr + rows, mask=row_ok, other=0.0)
        g = -gh[:, None] * p * (logp + ent[:, None])
    if HAS_GL:
        gl = tl.load(gl_ptr + rows, mask=row_ok, other=0.0)
        tgt = tl.load(t_ptr + rows, mask=row_ok, other=-1) - v0
        onehot = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
        g += gl[:, None] * (onehot - p)
    g = g * inv_t
    out = (rows64 * stride_gn)[:, None] + cols64[None, :]
    tl.store(g_ptr + out, g, mask=row_ok[:, None] & col_ok[None, :])


def _config(dtype: torch.dtype, n: int, vocab: int) -> dict[str, Any]:
    """One fixed config per mode (no autotune: the interpreter cannot run multi-config autotune)."""
    if interpreting():  # the interpreter's cost is programs × loop iterations × elements: fit the blocks
        return {
            "BM": 16 if n <= 16 else 32,
            "BN": 256 if vocab <= 8192 else 16384,
            "BK": 64,
            "UPCAST": True,
            "IEEE": False,
        }
    half = dtype in (torch.float16, torch.bfloat16)
    return {"BM": 128, "BN": 128, "BK": 64 if half else 32, "UPCAST": False, "IEEE": not half, "num_warps": 8}


@torch.compiler.disable  # type: ignore[untyped-decorator]
def forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, inv_t: float, with_entropy: bool, cv: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(lse, logp, entropy)`` fp32 ``[N]``; ``entropy`` is empty when ``with_entropy`` is False."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    cfg = _config(hidden.dtype, n, vocab)
    targets = targets.contiguous()  # 1-D vectors are indexed as contiguous in the kernels
    split = triton.cdiv(min(cv, vocab), cfg["BN"]) * cfg["BN"]
    n_split = triton.cdiv(vocab, split)
    part = torch.empty((4, n_split, n), dtype=torch.float32, device=hidden.device)
    if n:
        grid = (triton.cdiv(n, cfg["BM"]), n_split)
        _fwd_kernel[grid](
            hidden, weight, targets, part[0], part[1], part[2], part[3], n, vocab, d,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            inv_t=float(inv_t), SPLIT=split, WITH_ENTROPY=bool(with_entropy), **cfg,
        )  # fmt: skip
    m_k, s_k, a_k, zy_k = part
    m = m_k.amax(0)
    scale = torch.exp(m_k - m)
    s = (scale * s_k).sum(0)
    a = (scale * (a_k + (m_k - m) * s_k)).sum(0)
    log_s = torch.log(s)
    lse = m + log_s
    entropy = (log_s - a / s) if with_entropy else m.new_empty(0)
    return lse, zy_k.sum(0) - lse, entropy


@torch.compiler.disable  # type: ignore[untyped-decorator]
def grad_tile(
    hidden_c: Tensor,
    weight_v: Tensor,
    hc: Tensor,
    wv: Tensor,
    targets_c: Tensor,
    v0: int,
    lse_c: Tensor,
    ent_c: Tensor,
    gl: Tensor | None,
    gh: Tensor | None,
    inv_t: float,
    bufs: Any = None,
) -> tuple[Tensor, float]:
    """``(G, 1.0)``: the fp32 ``[rows, cols]`` logit-gradient tile for ``hidden_c`` × ``weight_v`` (the fp32 copies
    and the torch path's workspaces are unused)."""
    n, d = hidden_c.shape
    vocab = weight_v.shape[0]
    cfg = _config(hidden_c.dtype, n, vocab)
    g = torch.empty((n, vocab), dtype=torch.float32, device=hidden_c.device)
    if n == 0:
        return g, 1.0
    # 1-D vectors are indexed as contiguous (an autograd cotangent may be an expanded, stride-0 tensor)
    targets_c, lse_c, ent_c = targets_c.contiguous(), lse_c.contiguous(), ent_c.contiguous()
    gl = None if gl is None else gl.contiguous()
    gh = None if gh is None else gh.contiguous()
    dummy = lse_c
    grid = (triton.cdiv(n, cfg["BM"]), triton.cdiv(vocab, cfg["BN"]))
    _grad_tile_kernel[grid](
        hidden_c, weight_v, targets_c, lse_c, ent_c if gh is not None else dummy,
        gl if gl is not None else dummy, gh if gh is not None else dummy, g, n, vocab, d, v0,
        hidden_c.stride(0), hidden_c.stride(1), weight_v.stride(0), weight_v.stride(1), g.stride(0),
        inv_t=float(inv_t), HAS_GL=gl is not None, HAS_GH=gh is not None, **cfg,
    )  # fmt: skip
    return g, 1.0
