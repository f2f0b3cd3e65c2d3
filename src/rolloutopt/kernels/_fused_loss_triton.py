"""Triton kernels of :func:`rolloutopt.kernels.fused_policy_loss` (imported lazily, only for the triton backend).

One program per token row (grid ``(N,)``), looping over the vocabulary in ``BLOCK_V`` slices:

- ``_fused_fwd``: online log-sum-exp of ``u = (x - max x) / T`` with the entropy sum ``Σ e^u u`` carried
  alongside (both rescaled when the running maximum moves), then the sampled log-prob and the per-token
  objective in fp32 scalar math (the same formulas as ``fused_loss._torch_objective``).
- ``_fused_bwd``: ``dx = (g_l (1[v = y] - p) - g_H p (u - E_p u)) / T`` written to ``DX``, which is the logits'
  own storage when in place (each block is read before it is written by the same program).

Rules from ``specs/kernels.md`` §5.3: every load is cast to fp32 at once; no libdevice (``expm1`` is a
polynomial near 0); ``-inf`` is the max identity with the all-``-inf`` block guarded; row offsets are int64;
hyper-parameters are fp32 runtime scalars (no recompilation when a coefficient changes) and the structure
(trust region, KL estimator, corrections) is ``tl.constexpr``; a fixed config (no autotune); launches run
outside compiled graphs (``torch.compiler.disable``).
"""

# Triton kernels are untyped (the jit decorator and tl are Any): no annotations on the kernels themselves.
# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-untyped-call,no-any-return"

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from rolloutopt.kernels._backend import interpreting

# Bits of the flags output (same values as fused_loss.F_*).
F_CLIP, F_CLIP_LOW, F_CLIP_HIGH, F_DUAL, F_REMOVED = 1, 2, 4, 8, 16


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
def _expm1_k3(d):
    """``(expm1(d), expm1(d) - d)`` in fp32 without libdevice: a Taylor series for |d| < 0.5 (no cancellation)."""
    # d^2 (1/2 + d/6 + d^2/24 + ...) up to d^9/9!: relative error < 3e-10 for |d| < 0.5.
    q = 1.0 / 362880.0
    q = 1.0 / 40320.0 + d * q
    q = 1.0 / 5040.0 + d * q
    q = 1.0 / 720.0 + d * q
    q = 1.0 / 120.0 + d * q
    q = 1.0 / 24.0 + d * q
    q = 1.0 / 6.0 + d * q
    q = 0.5 + d * q
    k3_small = d * d * q
    small = tl.abs(d) < 0.5
    em1 = tl.where(small, k3_small + d, tl.exp(d) - 1.0)
    k3 = tl.where(small, k3_small, em1 - d)
    return em1, k3


@triton.jit
def _fused_fwd(
    X, stride_b, stride_t, T_len, V,
    TGT, MASK, OLD, ADV, BEHAV, REF, ISW,
    TOTAL, LOGP, ENT, COEF, PG, KLV, WGT, FLAGS, MX, LOGL,
    inv_t, ratio_clamp, lo, hi, dual, tau_pos, tau_neg,
    tis_cap, tis_lower, tis_clamp, mis_low, mis_high, mis_clamp, kl_coef, ent_coef,
    TRUST: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_OLD: tl.constexpr,
    HAS_TIS: tl.constexpr, TIS_CURRENT: tl.constexpr,
    HAS_MIS: tl.constexpr, MIS_CURRENT: tl.constexpr, MIS_ONE: tl.constexpr,
    HAS_ISW: tl.constexpr, KL_KIND: tl.constexpr, KL_ST: tl.constexpr, KL_CLAMP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    live = tl.load(MASK + row)
    if live == 0:
        tl.store(TOTAL + row, 0.0)
        tl.store(LOGP + row, 0.0)
        tl.store(ENT + row, 0.0)
        tl.store(COEF + row, 0.0)
        tl.store(PG + row, 0.0)
        tl.store(KLV + row, 0.0)
        tl.store(WGT + row, 0.0)
        tl.store(FLAGS + row, 0)
        tl.store(MX + row, 0.0)
        tl.store(LOGL + row, 0.0)
        return
    base = X + row_offset(row, T_len, stride_b, stride_t)

    # ---- online log-sum-exp and entropy sum, relative to the running maximum of the raw logits
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
    ent = logl - s_sum / l_sum
    tgt = tl.load(TGT + row).to(tl.int64)
    x_t = tl.load(base + tgt).to(tl.float32)
    logp = (x_t - mx) * inv_t - logl

    # ---- token-level objective (fused_loss._torch_objective, scalar form)
    if HAS_OLD:  # noqa: SIM108 (a constexpr branch)
        old = tl.load(OLD + row)
    else:
        old = logp
    adv = tl.load(ADV + row)
    dlr = logp - old
    lr = tl.minimum(tl.maximum(dlr, -ratio_clamp), ratio_clamp)
    r = tl.exp(lr)
    dr = tl.where((dlr >= -ratio_clamp) & (dlr <= ratio_clamp), r, 0.0)
    if TRUST == 1:  # PPO clip (+ dual clip); torch's max/min split the gradient evenly on ties
        l1 = -adv * r
        l2 = -adv * tl.minimum(tl.maximum(r, lo), hi)
        lc = tl.maximum(l1, l2)
        inb = ((r >= lo) & (r <= hi)).to(tl.float32)
        g = tl.where(l1 > l2, 1.0, tl.where(l1 == l2, 0.5 * (1.0 + inb), 0.0))
        neg = adv < 0.0
        flags = (
            (l2 > l1).to(tl.int32) * 1 + ((r < lo) & neg).to(tl.int32) * 2 + ((r > hi) & (adv > 0.0)).to(tl.int32) * 4
        )
        pg = lc
        if HAS_DUAL:
            l3 = -adv * dual
            flags += ((lc > l3) & neg).to(tl.int32) * 8
            g = tl.where(neg, g * tl.where(lc < l3, 1.0, tl.where(lc == l3, 0.5, 0.0)), g)
            pg = tl.where(neg, tl.minimum(lc, l3), lc)
        coef = -adv * g * dr
    elif TRUST == 2:  # CISPO: stop-gradient clipped weight times logp
        w_c = tl.minimum(tl.maximum(r, lo), hi)
        flags = (w_c != r).to(tl.int32)
        pg = -w_c * adv * logp
        coef = -w_c * adv
    elif TRUST == 3:  # SAPO soft gate
        tau = tl.where(adv > 0.0, tau_pos, tau_neg)
        sg = tl.sigmoid(tau * (r - 1.0))
        pg = -sg * 4.0 / tau * adv
        coef = -4.0 * adv * sg * (1.0 - sg) * dr
        flags = (r < 0.0).to(tl.int32)  # 0 (a tensor, for the store)
    else:  # plain surrogate
        pg = -adv * r
        coef = -adv * dr
        flags = (r < 0.0).to(tl.int32)
    weight = r * 0.0 + 1.0
    if HAS_TIS:
        behav_t = tl.load(BEHAV + row)
        if TIS_CURRENT:  # noqa: SIM108
            src_t = logp
        else:
            src_t = old
        rho_t = tl.exp(tl.minimum(tl.maximum(src_t - behav_t, -tis_clamp), tis_clamp))
        weight = weight * tl.minimum(tl.maximum(rho_t, tis_lower), tis_cap)
    if HAS_MIS:
        behav_m = tl.load(BEHAV + row)
        if MIS_CURRENT:  # noqa: SIM108
            src_m = logp
        else:
            src_m = old
        rho_m = tl.exp(tl.minimum(tl.maximum(src_m - behav_m, -mis_clamp), mis_clamp))
        out = (rho_m > mis_high) | (rho_m < mis_low)
        flags += out.to(tl.int32) * 16
        if MIS_ONE:  # noqa: SIM108
            w_m = tl.where(out, 0.0, 1.0)
        else:
            w_m = tl.where(out, 0.0, rho_m)
        weight = weight * w_m
    if HAS_ISW:
        weight = weight * tl.load(ISW + row)
    pg = pg * weight
    coef = coef * weight
    total = pg
    klv = r * 0.0
    if KL_KIND != 0:
        ref = tl.load(REF + row)
        dk = logp - ref
        if KL_KIND == 1:
            klv = dk
            kg = dk * 0.0 + 1.0
        elif KL_KIND == 2:
            klv = tl.abs(dk)
            kg = tl.where(dk > 0.0, 1.0, tl.where(dk < 0.0, -1.0, 0.0))
        elif KL_KIND == 3:
            klv = 0.5 * dk * dk
            kg = dk
        else:
            d3 = ref - logp
            ok = d3 == d3
            if KL_CLAMP:
                ok = (d3 >= -20.0) & (d3 <= 20.0)
                d3 = tl.minimum(tl.maximum(d3, -20.0), 20.0)
            em1, k3 = _expm1_k3(d3)
            klv = k3
            kg = -em1
            if KL_CLAMP:
                ok = ok & (k3 >= -10.0) & (k3 <= 10.0)
                klv = tl.minimum(tl.maximum(k3, -10.0), 10.0)
            kg = tl.where(ok, kg, 0.0)
        if KL_ST:
            kg = dk
        total = total + kl_coef * klv
        coef = coef + kl_coef * kg
    total = total - ent_coef * ent

    tl.store(TOTAL + row, total)
    tl.store(LOGP + row, logp)
    tl.store(ENT + row, ent)
    tl.store(COEF + row, coef)
    tl.store(PG + row, pg)
    tl.store(KLV + row, klv)
    tl.store(WGT + row, weight)
    tl.store(FLAGS + row, flags)
    tl.store(MX + row, tl.where(mx == float("-inf"), 0.0, mx))
    tl.store(LOGL + row, logl)


@triton.jit
def _fused_bwd(
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


def _f(value: float | None, default: float) -> float:
    return default if value is None else float(value)


@torch.compiler.disable
def forward(x: torch.Tensor, inp: Any, plan: Any, inv_t: float) -> tuple[torch.Tensor, ...]:
    """Launch ``_fused_fwd``; returns ``(total, logp, ent, coef, pg, kl, weight, flags, mx, logl)``, each ``[N]``."""
    b_, t_, v_ = x.shape
    n = b_ * t_
    dev = x.device
    outs = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(10)]
    outs[7] = torch.empty(n, dtype=torch.int32, device=dev)
    total, logp, ent, coef, pg, klv, wgt, flags, mx, logl = outs
    if n == 0:
        return tuple(outs)
    f32 = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731
    old, adv, behav, ref, isw = f32(inp.old), f32(inp.adv), f32(inp.behav), f32(inp.ref), f32(inp.isw)
    mask = inp.mask.to(torch.int8)
    dummy = adv
    tis, mis, kl = plan.tis, plan.mis, plan.kl
    _fused_fwd[(n,)](
        x, x.stride(0), x.stride(1), t_, v_,
        inp.tgt, mask, dummy if old is None else old, adv, dummy if behav is None else behav,
        dummy if ref is None else ref, dummy if isw is None else isw,
        total, logp, ent, coef, pg, klv, wgt, flags, mx, logl,
        inv_t, float(plan.ratio_clamp), float(plan.lo), float(plan.hi), _f(plan.dual, 1.0),
        float(plan.tau_pos), float(plan.tau_neg),
        _f(None if tis is None else tis.cap, math.inf), _f(None if tis is None else tis.lower, 0.0),
        _f(None if tis is None else tis.clamp, 20.0),
        _f(None if mis is None else mis.low, 0.0), _f(None if mis is None else mis.high, math.inf),
        _f(None if mis is None else mis.clamp, 20.0),
        0.0 if kl is None else float(kl.coef), float(plan.entropy_coef),
        TRUST=plan.trust, HAS_DUAL=plan.dual is not None, HAS_OLD=old is not None,
        HAS_TIS=tis is not None, TIS_CURRENT=tis is not None and tis.source == "current",
        HAS_MIS=mis is not None, MIS_CURRENT=mis is not None and mis.source == "current",
        MIS_ONE=mis is not None and mis.in_band == "one",
        HAS_ISW=isw is not None, KL_KIND=plan.kl_kind, KL_ST=plan.kl_straight_through,
        KL_CLAMP=kl is not None and kl.clamp,
        BLOCK_V=block_v(v_, FWD_BLOCK), num_warps=FWD_WARPS,
    )  # fmt: skip
    return total, logp, ent, coef, pg, klv, wgt, flags, mx, logl


@torch.compiler.disable
def backward(
    x: torch.Tensor,
    out: torch.Tensor,
    inp: Any,
    gl: torch.Tensor,
    gh: torch.Tensor,
    mx: torch.Tensor,
    logl: torch.Tensor,
    ent: torch.Tensor,
    inv_t: float,
) -> None:
    """Launch ``_fused_bwd``: ``dlogits`` into ``out`` (``x`` itself when in place)."""
    b_, t_, v_ = x.shape
    n = b_ * t_
    if n == 0:
        return
    _fused_bwd[(n,)](
        x, x.stride(0), x.stride(1), out, out.stride(0), out.stride(1), t_, v_,
        inp.tgt, inp.mask.to(torch.int8), gl.to(torch.float32).contiguous(), gh.to(torch.float32).contiguous(),
        mx, logl, ent, inv_t,
        BLOCK_V=block_v(v_, BWD_BLOCK), num_warps=BWD_WARPS,
    )  # fmt: skip
