"""Triton kernels of :func:`rolloutopt.kernels.logits_logprobs` (imported lazily, only for the triton backend).

One program per token row (grid ``(N,)``), looping over the vocabulary in ``BLOCK_V`` slices:

- ``_stats_fwd``: online log-sum-exp of ``u = (x - max x) / T`` with the entropy sum ``Σ e^u u`` carried
  alongside (both rescaled when the running maximum moves); stores the sampled log-prob, the entropy, the row
  maximum and ``log Σ e^u`` (the two statistics the backward reads).
- ``_grad_bwd``: ``dx = (g_l (1[v = y] - p) - g_H p (u - E_p u)) / T`` written to ``DX``, which is the logits'
  own storage when in place (each block is read before it is written by the same program).

Rules that keep the kernels runnable under Triton's CPU interpreter (``docs/methods/kernels.md``): every load
is cast to fp32 at once; no libdevice; ``-inf`` is the max identity with the all-``-inf`` block guarded; row
offsets are int64; a fixed config (no autotune); launches run outside compiled graphs
(``torch.compiler.disable``).
"""

# Triton kernels are untyped (the jit decorator and tl are Any): no annotations on the kernels themselves.
# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call,no-any-return"

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rolloutopt.kernels._backend import interpreting


def block_v(v: int, gpu_block: int) -> int:
    """Vocabulary block: ``gpu_block`` on GPU; under the interpreter as large as the row (up to 32,768), since its
    cost scales with loop iterations, not elements."""
    if interpreting():
        return min(triton.next_power_of_2(v), 32768)
    return min(triton.next_power_of_2(v), gpu_block)


# GPU launch configuration, not tuned on hardware yet (no GPU run so far); close to Liger's grpo_loss, which
# measured ~75% of H200 bandwidth with 2,048-wide forward blocks and 4,096-wide backward blocks (PR #672).
FWD_BLOCK, FWD_WARPS = 2048, 4
BWD_BLOCK, BWD_WARPS = 4096, 8


@triton.jit
def row_offset(row, T_len, stride_b, stride_t):
    """Element offset of token row ``row`` of a ``[B, T, V]`` view, in int64 (``N·V`` may exceed 2^31)."""
    r = row.to(tl.int64)
    b = r // T_len
    t = r - b * T_len
    return b * stride_b + t * stride_t


@triton.jit
def row_offset_probe(OUT, first_row, T_len, stride_b, stride_t):
    """Test helper: ``OUT[i] = row_offset(first_row + i, ...)`` (checks the int64 arithmetic without 2^31 elements)."""
    i = tl.program_id(0)
    tl.store(OUT + i, row_offset(first_row + i, T_len, stride_b, stride_t))


@triton.jit
def _stats_fwd(
    X, stride_b, stride_t, T_len, V,
    TGT, MASK, LOGP, ENT, MX, LOGL,
    inv_t,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    live = tl.load(MASK + row)
    if live == 0:  # a masked-out row is never read
        tl.store(LOGP + row, 0.0)
        tl.store(ENT + row, 0.0)
        tl.store(MX + row, 0.0)
        tl.store(LOGL + row, 0.0)
        return
    base = X + row_offset(row, T_len, stride_b, stride_t)
    # online log-sum-exp and entropy sum, relative to the running maximum of the raw logits
    mx = float("-inf")
    l_sum = 0.0
    s_sum = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(mx, tl.max(x, 0))
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)  # a block of -inf only: keep the arithmetic finite
        shift = tl.where(l_sum > 0.0, (mx - safe_m) * inv_t, 0.0)  # nothing accumulated yet: no rescaling
        alpha = tl.exp(shift)
        valid = x > float("-inf")  # -inf logits and the masked tail have e = 0: no 0 * -inf
        u = tl.where(valid, (x - safe_m) * inv_t, 0.0)
        e = tl.where(valid, tl.exp(u), 0.0)
        s_sum = tl.where(l_sum > 0.0, alpha * (s_sum + l_sum * shift), 0.0) + tl.sum(e * u, 0)
        l_sum = l_sum * alpha + tl.sum(e, 0)
        mx = new_m
    logl = tl.log(l_sum)
    tgt = tl.load(TGT + row).to(tl.int64)
    x_t = tl.load(base + tgt).to(tl.float32)
    tl.store(LOGP + row, (x_t - mx) * inv_t - logl)
    tl.store(ENT + row, logl - s_sum / l_sum)
    tl.store(MX + row, tl.where(mx == float("-inf"), 0.0, mx))
    tl.store(LOGL + row, logl)


@triton.jit
def _grad_bwd(
    X, stride_b, stride_t, DX, dstride_b, dstride_t, T_len, V,
    TGT, MASK, GL, GH, MX, LOGL, ENT, inv_t,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    dbase = DX + row_offset(row, T_len, dstride_b, dstride_t)
    live = tl.load(MASK + row)
    gl = tl.load(GL + row)
    gh = tl.load(GH + row)
    if (live == 0) | ((gl == 0.0) & (gh == 0.0)):  # masked, clipped or removed token: zeros, no read
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(dbase + cols, tl.zeros([BLOCK_V], tl.float32).to(DX.dtype.element_ty), mask=cols < V)
        return
    base = X + row_offset(row, T_len, stride_b, stride_t)
    mx = tl.load(MX + row)
    logl = tl.load(LOGL + row)
    eu = logl - tl.load(ENT + row)  # E_p[u]
    tgt = tl.load(TGT + row).to(tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        u = (x - mx) * inv_t
        p = tl.exp(u - logl)
        u = tl.where(p > 0.0, u, eu)  # -inf logits and the masked tail: p = 0, and no 0 * -inf
        dz = -p * (gl + gh * (u - eu))
        dz = dz + tl.where(cols == tgt, gl, 0.0)
        tl.store(dbase + cols, (dz * inv_t).to(DX.dtype.element_ty), mask=cols < V)


@torch.compiler.disable
def forward(
    x: torch.Tensor, tgt: torch.Tensor, mask: torch.Tensor, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch ``_stats_fwd`` on ``x [B, T, V]``; returns ``(logp, entropy, row max, log Σ e^u)``, fp32 ``[N]``."""
    b_, t_, v_ = x.shape
    n = b_ * t_
    logp, ent, mx, logl = (torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(4))
    if n == 0:
        return logp, ent, mx, logl
    _stats_fwd[(n,)](
        x, x.stride(0), x.stride(1), t_, v_,
        tgt, mask.to(torch.int8), logp, ent, mx, logl,
        inv_t,
        BLOCK_V=block_v(v_, FWD_BLOCK), num_warps=FWD_WARPS,
    )  # fmt: skip
    return logp, ent, mx, logl


@torch.compiler.disable
def backward(
    x: torch.Tensor,
    out: torch.Tensor,
    tgt: torch.Tensor,
    mask: torch.Tensor,
    gl: torch.Tensor,
    gh: torch.Tensor,
    mx: torch.Tensor,
    logl: torch.Tensor,
    ent: torch.Tensor,
    inv_t: float,
) -> None:
    """Launch ``_grad_bwd``: ``dlogits`` into ``out`` (``x`` itself when in place)."""
    b_, t_, v_ = x.shape
    n = b_ * t_
    if n == 0:
        return
    _grad_bwd[(n,)](
        x, x.stride(0), x.stride(1), out, out.stride(0), out.stride(1), t_, v_,
        tgt, mask.to(torch.int8), gl.to(torch.float32).contiguous(), gh.to(torch.float32).contiguous(),
        mx, logl, ent, inv_t,
        BLOCK_V=block_v(v_, BWD_BLOCK), num_warps=BWD_WARPS,
    )  # fmt: skip
