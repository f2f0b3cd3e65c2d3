r"""Fused token-level policy loss on logits: log-softmax, sampled log-prob, entropy and the objective in one pass.

:func:`fused_policy_loss` takes the logits ``[B, T, V]`` (or ``[B·T, V]``) and returns what
:func:`rolloutopt.losses.policy_loss` returns for ``logp = log_softmax(logits / temperature).gather(targets)``
with the same configuration, plus the log-probs and entropies it computed on the way. One pass per row reads the
logits once in the forward (online log-sum-exp over vocabulary blocks) and once more in the backward, which
writes the gradient of the logits — by default into the logits' own storage.

Two backends with the same numbers: a chunked torch path (runs everywhere, the CPU default) and a Triton kernel
(CUDA; on CPU only under ``TRITON_INTERPRET=1``), imported lazily from ``_fused_loss_triton``.
Only token-level objectives are fused (:data:`FUSED_PRESETS`); sequence-level ratios go through
:func:`rolloutopt.kernels.token_logprobs` (or ``log_softmax`` + ``gather``) and ``policy_loss``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, checks_enabled, choice, describe, finite
from rolloutopt.errors import InputError
from rolloutopt.kernels._backend import resolve_backend
from rolloutopt.losses.aggregation import AGG_MODES, AggMode, Denominators, aggregate
from rolloutopt.losses.policy import RATIO_QUANTILES, LossOutput, aggregate_terms, weight_metrics
from rolloutopt.losses.presets import PRESETS, Preset
from rolloutopt.losses.regularizers import KL
from rolloutopt.ratios.context import StageContext, as_weights, masked_max, masked_mean, masked_quantiles
from rolloutopt.ratios.corrections import MIS, TIS
from rolloutopt.ratios.reference import CISPO, SAPO, PPOClip, TokenRatio

__all__ = ["FUSED_PRESETS", "FusedLossOutput", "fused_policy_loss"]

# Elements of one fp32 chunk of the torch backend (rows x V); its temporaries hold about four such chunks.
_TORCH_CHUNK_ELEMS = 1 << 22

# Trust-region kinds and KL kinds, shared with the Triton kernel (constexpr ints there).
TRUST_NONE, TRUST_PPO, TRUST_CISPO, TRUST_SAPO = 0, 1, 2, 3
KL_NONE, KL_K1, KL_ABS, KL_K2, KL_K3 = 0, 1, 2, 3, 4
_KL_KIND = {"k1": KL_K1, "kl": KL_K1, "abs": KL_ABS, "k2": KL_K2, "mse": KL_K2, "k3": KL_K3, "low_var_kl": KL_K3}
# Bits of the per-token flags: the trust region's indicators and the removal by a masking correction.
F_CLIP, F_CLIP_LOW, F_CLIP_HIGH, F_DUAL, F_REMOVED = 1, 2, 4, 8, 16

_FIX = (
    "compute the log-probs with rolloutopt.kernels.token_logprobs (from hidden states) or log_softmax + gather, "
    "then call rolloutopt.losses.policy_loss (or rolloutopt.losses.get(name))"
)


class _Preset:
    """Default of the stage keywords of :func:`fused_policy_loss`: the preset's value (or ``policy_loss``'s)."""

    def __repr__(self) -> str:
        return "<from preset>"


_FROM_PRESET: Any = _Preset()

_DEFAULTS: dict[str, Any] = {
    "ratio": TokenRatio(),
    "trust": PPOClip(),
    "correction": None,
    "proximal": None,
    "kl": None,
    "entropy_coef": 0.0,
    "agg": "token-mean",
    "removed_in_denominator": True,
}


@dataclass(frozen=True)
class _Plan:
    """The token-level objective, lowered to the numbers and switches both backends read."""

    ratio_clamp: float
    trust: int
    lo: float = 0.0
    hi: float = 0.0
    dual: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.0
    tis: TIS | None = None
    mis: MIS | None = None
    corrections: tuple[TIS | MIS, ...] = ()
    kl: KL | None = None
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    removed_in_denominator: bool = True

    @property
    def kl_kind(self) -> int:
        return KL_NONE if self.kl is None else _KL_KIND[self.kl.estimator.rstrip("+")]

    @property
    def kl_straight_through(self) -> bool:
        return self.kl is not None and self.kl.estimator.endswith("+")


@dataclass(frozen=True, kw_only=True)
class FusedLossOutput(LossOutput):
    """:class:`~rolloutopt.losses.LossOutput` plus the per-token quantities the fused pass computed.

    Attributes:
        logp: log-probs of the targets at ``temperature``, fp32, shaped like ``targets``; 0 at masked-out tokens
            (those rows are not read). Differentiable: a gradient on it reaches the logits.
        entropy: entropy of the tempered distribution per token, fp32, shaped like ``targets``; 0 at masked-out
            tokens. Differentiable (the exact entropy gradient).
        backend: ``"torch"`` or ``"triton"``, the backend that ran.
    """

    logp: Tensor
    entropy: Tensor
    backend: str = "torch"


def _unsupported(cfg: dict[str, Any]) -> tuple[str, str] | None:
    """``(stage, reason)`` when the configuration is not token-level in the fused kernel's sense, else None."""
    ratio = cfg["ratio"]
    if type(ratio) is not TokenRatio:
        return "ratio", f"the ratio {type(ratio).__name__} is sequence-level (a token's ratio needs its whole row)"
    trust = cfg["trust"]
    if trust is not None and type(trust) not in (PPOClip, CISPO, SAPO):
        return "trust", (
            f"the trust region {type(trust).__name__} needs batch, sequence or extra inputs; the kernel implements "
            "PPOClip (dual clip included), CISPO, SAPO and None"
        )
    if cfg["proximal"] is not None:
        return "proximal", "a proximal stage builds old_logp from other inputs; pass old_logp computed beforehand"
    corr = cfg["correction"]
    parts = () if corr is None else (tuple(corr) if isinstance(corr, Sequence) else (corr,))
    kinds: list[type] = []
    for c in parts:
        if type(c) not in (TIS, MIS):
            return "correction", f"the correction {type(c).__name__} is not token-level (the kernel has TIS and MIS)"
        if c.level != "token" or c.batch_normalize:
            return "correction", f"{type(c).__name__}(level={c.level!r}, batch_normalize={c.batch_normalize}) needs "
            "sequence or batch statistics; the kernel has token level without batch normalisation"
        if type(c) in kinds:
            return "correction", f"two {type(c).__name__} stages; the kernel takes at most one TIS and one MIS"
        kinds.append(type(c))
    if cfg["kl"] is not None and type(cfg["kl"]) is not KL:
        return "kl", f"the regulariser {type(cfg['kl']).__name__} is not rolloutopt.losses.KL"
    return None


def _supported(preset: Preset) -> bool:
    return preset.experimental is None and _unsupported({**_DEFAULTS, **preset.config}) is None


FUSED_PRESETS: tuple[str, ...] = tuple(n for n in PRESETS.names() if _supported(PRESETS.get(n)))
"""Names of the registered presets whose loss is token-level and fused (computed at import time)."""


def _resolve(preset: str | Preset | None, overrides: dict[str, Any], given: dict[str, Any]) -> _Plan:
    cfg = dict(_DEFAULTS)
    p: Preset | None
    if preset is None:
        p = None
    elif isinstance(preset, Preset):
        p = preset
    elif isinstance(preset, str) and preset in PRESETS:
        p = PRESETS.get(preset)
    else:
        raise InputError(
            "preset",
            f"None, a Preset or a registered preset name (fused: {', '.join(FUSED_PRESETS)})",
            describe(preset),
            "pass e.g. preset='dapo', or configure the stages with the trust=/correction=/kl= keywords",
        )
    unknown = [] if p is None else sorted(set(p.config) - set(_DEFAULTS))
    if p is not None and unknown:
        raise InputError(
            "preset",
            "a preset configuring only ratio, trust, correction, kl, entropy_coef, agg, removed_in_denominator",
            f"{p.name!r} also binds {', '.join(unknown)}",
            _FIX,
        )
    if p is not None:
        cfg.update(p.config)
    cfg.update({k: v for k, v in overrides.items() if v is not _FROM_PRESET})
    bad = _unsupported(cfg)
    if bad is not None:
        stage, reason = bad
        passed = overrides.get(stage, _FROM_PRESET) is not _FROM_PRESET
        arg = "preset" if p is not None and not passed else stage
        got = f"{p.name!r}: {reason}" if p is not None and not passed else reason
        raise InputError(arg, f"a token-level objective (fused presets: {', '.join(FUSED_PRESETS)})", got, _FIX)
    if p is not None and p.experimental is not None:
        raise InputError("preset", "a preset that is not experimental", f"{p.name!r}: {p.experimental}", _FIX)
    if p is not None:
        missing = [n for n in p.requires if given.get(n) is None]
        if missing:
            raise InputError(
                missing[0],
                f"the inputs {', '.join(p.requires)} for the {p.name!r} preset",
                "None",
                f"pass {missing[0]}=...",
            )
    choice(cfg["agg"], "agg", AGG_MODES)
    ec = cfg["entropy_coef"]
    if not isinstance(ec, (int, float)) or isinstance(ec, bool) or not math.isfinite(ec):
        raise InputError("entropy_coef", "a finite number", repr(ec), "pass a float (0.0 turns the bonus off)")
    if not isinstance(cfg["removed_in_denominator"], bool):
        raise InputError("removed_in_denominator", "a bool", repr(cfg["removed_in_denominator"]), "pass True or False")
    corr = cfg["correction"]
    parts: tuple[TIS | MIS, ...] = () if corr is None else (tuple(corr) if isinstance(corr, Sequence) else (corr,))
    trust = cfg["trust"]
    kw: dict[str, Any] = {}
    if isinstance(trust, PPOClip):
        kw = {"trust": TRUST_PPO, "lo": 1 - trust.low, "hi": 1 + trust.high, "dual": trust.dual}
    elif isinstance(trust, CISPO):
        if trust.cap is not None:
            kw = {"trust": TRUST_CISPO, "lo": -math.inf, "hi": trust.cap}
        else:
            assert trust.high is not None
            kw = {"trust": TRUST_CISPO, "lo": -math.inf if trust.low is None else 1 - trust.low, "hi": 1 + trust.high}
    elif isinstance(trust, SAPO):
        kw = {"trust": TRUST_SAPO, "tau_pos": trust.tau_pos, "tau_neg": trust.tau_neg}
    else:
        kw = {"trust": TRUST_NONE}
    return _Plan(
        ratio_clamp=cfg["ratio"].clamp,
        tis=next((c for c in parts if isinstance(c, TIS)), None),
        mis=next((c for c in parts if isinstance(c, MIS)), None),
        corrections=parts,
        kl=cfg["kl"],
        entropy_coef=float(ec),
        agg=cfg["agg"],
        removed_in_denominator=cfg["removed_in_denominator"],
        **kw,
    )


# ------------------------------------------------------------------------------------------------ torch backend


def _row_chunks(x: Tensor, *others: Tensor) -> Iterator[tuple[int, int, tuple[Tensor, ...]]]:
    """``(start, stop, (rows of x, rows of each other))`` over the token rows of ``x [B, T, V]``, in chunks of
    bounded size; ``others`` have x's shape (any layout) and are cut at the same rows."""
    b_, t_, v_ = x.shape
    step = max(1, _TORCH_CHUNK_ELEMS // max(v_, 1))
    try:
        flat = [t.view(b_ * t_, v_) for t in (x, *others)]
    except RuntimeError:  # a strided view that cannot be flattened: chunk inside each sequence
        for b in range(b_):
            for s in range(0, t_, step):
                e = min(s + step, t_)
                yield b * t_ + s, b * t_ + e, tuple(t[b, s:e] for t in (x, *others))
        return
    for s in range(0, b_ * t_, step):
        e = min(s + step, b_ * t_)
        yield s, e, tuple(f[s:e] for f in flat)


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _torch_stats(x: Tensor, tgt: Tensor, m: Tensor, inv_t: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row: ``(logp, entropy, max of the raw logits, log Σ exp((x - max)/T))``, 0 at masked rows."""
    n = tgt.numel()
    dt = _acc_dtype(x)
    logp, ent, mx, logl = (torch.zeros(n, dtype=dt, device=x.device) for _ in range(4))
    for s, e, (rows,) in _row_chunks(x):
        xr = rows.to(dt)
        rmx = xr.amax(-1, keepdim=True)
        safe = torch.where(torch.isfinite(rmx), rmx, torch.zeros_like(rmx))
        u = (xr - safe) * inv_t
        p_un = torch.exp(u)
        lsum = p_un.sum(-1)
        su = torch.where(p_un > 0, p_un * u, torch.zeros_like(u)).sum(-1)
        ll = torch.log(lsum)
        ut = u.gather(-1, tgt[s:e, None]).squeeze(-1)
        mk = m[s:e]
        logp[s:e] = torch.where(mk, ut - ll, 0.0)
        ent[s:e] = torch.where(mk, ll - su / lsum, 0.0)
        mx[s:e] = torch.where(mk, safe.squeeze(-1), 0.0)
        logl[s:e] = torch.where(mk, ll, 0.0)
    return logp, ent, mx, logl


def _torch_backward(
    x: Tensor,
    out: Tensor,
    tgt: Tensor,
    m: Tensor,
    gl: Tensor,
    gh: Tensor,
    mx: Tensor,
    logl: Tensor,
    ent: Tensor,
    inv_t: float,
) -> None:
    """Write ``d loss / d logits`` into ``out`` (``x`` itself when in place), chunk by chunk."""
    dt = _acc_dtype(x)
    eu_all = logl - ent  # E_p[u] per row, u = (x - max) / T
    for s, e, (rows, orows) in _row_chunks(x, out):
        mk = m[s:e, None]
        u = (rows.to(dt) - mx[s:e, None]) * inv_t
        p = torch.exp(u - logl[s:e, None])
        g = gl[s:e, None]
        dz = torch.where(p > 0, -p * (g + gh[s:e, None] * (u - eu_all[s:e, None])), torch.zeros_like(p))
        dz.scatter_add_(-1, tgt[s:e, None], g)
        orows.copy_(torch.where(mk, dz * inv_t, torch.zeros_like(dz)))


def _expm1_minus(d: Tensor) -> Tensor:
    return torch.expm1(d) - d


def _torch_objective(
    plan: _Plan,
    logp: Tensor,
    ent: Tensor,
    old: Tensor | None,
    adv: Tensor,
    behav: Tensor | None,
    ref: Tensor | None,
    isw: Tensor | None,
    m: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per token ``(total, d total / d logp, policy term, kl, weight, flags)`` — the kernel's scalar math, vectorised."""
    lp = torch.where(m, logp, torch.zeros_like(logp))
    oldv = lp if old is None else old
    c = plan.ratio_clamp
    d = lp - oldv
    lr = torch.where(m, d.clamp(-c, c), torch.zeros_like(d))
    r = torch.exp(lr)
    dr = torch.where(m & (d >= -c) & (d <= c), r, torch.zeros_like(r))
    zero_i = torch.zeros_like(m, dtype=torch.int32)
    flags = zero_i
    if plan.trust == TRUST_PPO:
        lo, hi = r.new_tensor(plan.lo), r.new_tensor(plan.hi)
        l1 = -adv * r
        l2 = -adv * torch.clamp(r, lo, hi)
        lc = torch.maximum(l1, l2)
        inb = ((r >= lo) & (r <= hi)).to(r.dtype)
        g = torch.where(l1 > l2, 1.0, torch.where(l1 == l2, 0.5 * (1.0 + inb), 0.0))
        neg = adv < 0
        flags = (
            (l2 > l1).int() * F_CLIP + ((r < lo) & neg).int() * F_CLIP_LOW + ((r > hi) & (adv > 0)).int() * F_CLIP_HIGH
        )
        pg = lc
        if plan.dual is not None:
            l3 = -adv * plan.dual
            flags = flags + ((lc > l3) & neg).int() * F_DUAL
            g = torch.where(neg, g * torch.where(lc < l3, 1.0, torch.where(lc == l3, 0.5, 0.0)), g)
            pg = torch.where(neg, torch.minimum(lc, l3), lc)
        coef = -adv * g * dr
    elif plan.trust == TRUST_CISPO:
        w = r.clamp(min=plan.lo, max=plan.hi)
        flags = (w != r).int() * F_CLIP
        pg = -w * adv * lp
        coef = -w * adv
    elif plan.trust == TRUST_SAPO:
        tau = torch.where(adv > 0, r.new_tensor(plan.tau_pos), r.new_tensor(plan.tau_neg))
        sg = torch.sigmoid(tau * (r - 1))
        pg = -sg * 4 / tau * adv
        coef = -4 * adv * sg * (1 - sg) * dr
    else:
        pg = -adv * r
        coef = -adv * dr
    weight = torch.ones_like(lp)
    for corr in plan.corrections:
        src = lp.detach() if corr.source == "current" else oldv
        assert behav is not None
        lrc = torch.where(m, src - behav, torch.zeros_like(src)).clamp(-corr.clamp, corr.clamp)
        rho = torch.exp(lrc)
        if isinstance(corr, TIS):
            w_c = rho.clamp(min=corr.lower, max=corr.cap)
        else:
            out = torch.zeros_like(m)
            if corr.high is not None:
                out = out | (rho > corr.high)
            if corr.low is not None:
                out = out | (rho < corr.low)
            flags = flags + out.int() * F_REMOVED
            w_c = torch.where(out, 0.0, rho if corr.in_band == "ratio" else torch.ones_like(rho))
        weight = weight * w_c
    if isw is not None:
        weight = weight * isw
    pg = pg * weight
    coef = coef * weight
    total = pg
    klv = torch.zeros_like(lp)
    if plan.kl is not None:
        assert ref is not None
        kind = plan.kl_kind
        if kind == KL_K1:
            klv, kg = lp - ref, torch.ones_like(lp)
        elif kind == KL_ABS:
            klv, kg = (lp - ref).abs(), torch.sign(lp - ref)
        elif kind == KL_K2:
            klv, kg = 0.5 * (lp - ref) ** 2, lp - ref
        else:
            dd = ref - lp
            ok = torch.ones_like(m)
            if plan.kl.clamp:
                ok = (dd >= -20.0) & (dd <= 20.0)
                dd = dd.clamp(-20.0, 20.0)
            klv, kg = _expm1_minus(dd), -torch.expm1(dd)
            if plan.kl.clamp:
                ok = ok & (klv >= -10.0) & (klv <= 10.0)
                klv = klv.clamp(-10.0, 10.0)
            kg = torch.where(ok, kg, torch.zeros_like(kg))
        if plan.kl_straight_through:
            kg = lp - ref
        total = total + plan.kl.coef * klv
        coef = coef + plan.kl.coef * kg
    if plan.entropy_coef != 0.0:
        total = total - plan.entropy_coef * ent
    zero = torch.zeros_like(lp)
    return (
        torch.where(m, total, zero),
        torch.where(m, coef, zero),
        torch.where(m, pg, zero),
        torch.where(m, klv, zero),
        torch.where(m, weight, zero),
        torch.where(m, flags, zero_i),
    )


# ------------------------------------------------------------------------------------------------ autograd


@dataclass
class _Inputs:
    """The validated per-token inputs, flattened to ``[N]`` (fp32, or fp64 for fp64 logits)."""

    tgt: Tensor
    mask: Tensor
    old: Tensor | None
    adv: Tensor
    behav: Tensor | None
    ref: Tensor | None
    isw: Tensor | None


def _forward(
    x: Tensor, inp: _Inputs, plan: _Plan, inv_t: float, backend: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if backend == "triton":
        from rolloutopt.kernels import _fused_loss_triton

        return _fused_loss_triton.forward(x, inp, plan, inv_t)  # type: ignore[no-any-return]
    logp, ent, mx, logl = _torch_stats(x, inp.tgt, inp.mask, inv_t)
    total, coef, pg, klv, weight, flags = _torch_objective(
        plan, logp, ent, inp.old, inp.adv, inp.behav, inp.ref, inp.isw, inp.mask
    )
    return total, logp, ent, coef, pg, klv, weight, flags, mx, logl


class _FusedPolicyLoss(torch.autograd.Function):
    """Differentiable ``(total, logp, entropy)`` per token from the logits; the backward writes ``dlogits``."""

    @staticmethod
    def forward(
        ctx: Any, full: Tensor, t_len: int, inp: _Inputs, plan: _Plan, inv_t: float, backend: str, inplace: bool
    ) -> tuple[Tensor, ...]:
        # full: [B, T, V], or [B, T + 1, V] whose last position is not a token (no copy, zero gradient there)
        x = full[:, :t_len]
        total, logp, ent, coef, pg, klv, weight, flags, mx, logl = _forward(x, inp, plan, inv_t, backend)
        ctx.save_for_backward(full, coef, ent, mx, logl)
        ctx.t_len, ctx.inp, ctx.plan, ctx.inv_t, ctx.backend, ctx.inplace = t_len, inp, plan, inv_t, backend, inplace
        ctx.mark_non_differentiable(pg, klv, weight, flags)
        return total, logp, ent, pg, klv, weight, flags

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_total: Tensor, g_logp: Tensor, g_ent: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        x, coef, ent, mx, logl = ctx.saved_tensors
        inp: _Inputs = ctx.inp
        g_total = g_total.to(coef.dtype)
        gl = (g_total * coef + g_logp.to(coef.dtype)).contiguous()
        gh = (g_ent.to(coef.dtype) - ctx.plan.entropy_coef * g_total).contiguous()
        full = x.detach()  # shares storage and version counter with the logits
        out_full = full if ctx.inplace else torch.empty_like(full)
        if ctx.inplace:
            # The storage now holds dlogits: any other autograd node that saved these logits must fail loudly.
            torch.autograd.graph.increment_version(full)
        x, out = full[:, : ctx.t_len], out_full[:, : ctx.t_len]
        if full.shape[1] > ctx.t_len:
            out_full[:, ctx.t_len :].zero_()
        if ctx.backend == "triton":
            from rolloutopt.kernels import _fused_loss_triton

            _fused_loss_triton.backward(x, out, inp, gl, gh, mx, logl, ent, ctx.inv_t)
        else:
            with torch.no_grad():
                _torch_backward(x, out, inp.tgt, inp.mask, gl, gh, mx, logl, ent, ctx.inv_t)
        return out_full, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------------ public API


def _logits3(logits: Any, targets: Any) -> tuple[Tensor, Tensor, bool, int]:
    """``(logits [B, T(+1), V], targets [B, T] int64, flat, T)``; ``flat`` when the per-token inputs are ``[N]``."""
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.ndim not in (2, 3):
        raise InputError(
            "logits",
            "a floating tensor [B, T, V] or [N, V] (fp32, bf16, fp16 or fp64)",
            describe(logits),
            "pass the model's output logits of the response tokens",
        )
    if logits.shape[-1] < 1:
        raise InputError("logits", "a vocabulary dimension V >= 1", describe(logits), "pass non-empty logits")
    if (
        not isinstance(targets, Tensor)
        or targets.is_floating_point()
        or targets.is_complex()
        or targets.dtype == torch.bool
    ):
        raise InputError("targets", "an integer tensor of token ids", describe(targets), "cast with targets.long()")
    if targets.device != logits.device:
        raise InputError("targets", f"a tensor on {logits.device}", describe(targets), "move it to the logits' device")
    v = logits.shape[-1]
    x = logits
    if x.stride(-1) != 1:
        x = x.contiguous()  # the kernels need unit stride along V (then the backward writes into this copy)
    if x.ndim == 3:
        b_, tx = x.shape[:2]
        if targets.ndim != 2 or targets.shape[0] != b_ or targets.shape[1] not in (tx, tx - 1):
            raise InputError(
                "targets",
                f"shape [B, T] = {[b_, tx]} (from logits [B, T, V]) or [B, T - 1] (logits with one extra position)",
                describe(targets),
                "fix the shapes",
            )
        return x, targets.long(), False, int(targets.shape[1])
    n = x.shape[0]
    if targets.ndim == 1 and targets.shape[0] == n:
        return x.view(1, n, v), targets.long().view(1, n), True, n
    if targets.ndim == 2 and targets.shape[0] * targets.shape[1] == n:
        return x.view(targets.shape[0], targets.shape[1], v), targets.long(), False, int(targets.shape[1])
    raise InputError(
        "targets", f"shape [N] or [B, T] with B·T = N = {n} (from logits [N, V])", describe(targets), "fix the shapes"
    )


def fused_policy_loss(
    logits: Tensor,
    targets: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    preset: str | Preset | None = None,
    temperature: float = 1.0,
    ref_logp: Tensor | None = None,
    behav_logp: Tensor | None = None,
    is_weights: Tensor | None = None,
    ratio: TokenRatio = _FROM_PRESET,
    trust: PPOClip | CISPO | SAPO | None = _FROM_PRESET,
    correction: TIS | MIS | Sequence[TIS | MIS] | None = _FROM_PRESET,
    kl: KL | None = _FROM_PRESET,
    entropy_coef: float = _FROM_PRESET,
    agg: AggMode = _FROM_PRESET,
    removed_in_denominator: bool = _FROM_PRESET,
    denominators: Denominators | None = None,
    group: Any = None,
    max_len: int | None = None,
    seq_weight: Tensor | None = None,
    backend: str = "auto",
    inplace: bool = True,
) -> FusedLossOutput:
    r"""Token-level policy loss straight from the logits, fused: log-softmax, log-prob, entropy, objective.

    Equals ``policy_loss(logp, old_logp, advantages, mask, entropy=H, ...)`` (or the named preset) with

    .. math::
        z_{i,t} = x_{i,t} / \tau, \quad \ell^\theta_{i,t} = z_{i,t,y_{i,t}} - \log\textstyle\sum_v e^{z_{i,t,v}},
        \quad H_{i,t} = -\textstyle\sum_v p_v \log p_v, \quad p = \operatorname{softmax}(z_{i,t})

    and the per-token term :math:`\ell_{i,t} = w_{i,t} L^{trust}(r_{i,t}, A_{i,t}) + \beta\,\widehat{KL}_{i,t} -
    c_H H_{i,t}` of :func:`rolloutopt.losses.policy_loss` (PPO clip with dual clip, CISPO, SAPO or the plain
    surrogate; TIS / MIS (IcePop) weights from ``behav_logp``; ``is_weights``; a KL estimator against
    ``ref_logp``; the entropy bonus), aggregated by :func:`rolloutopt.losses.aggregate` with the same
    ``agg``, :class:`~rolloutopt.losses.Denominators`, ``group``, ``max_len`` and ``seq_weight``.

    One pass per row: an online log-sum-exp over vocabulary blocks, kept relative to the row maximum of the raw
    logits (so |x| > 1e4 and any temperature lose no precision), gives ``logp``, the entropy and the per-token
    objective and its derivative; the backward reads the row once more and writes
    :math:`\partial\mathcal L/\partial x_v = \tfrac1\tau\big(g_\ell(\mathbb 1[v = y] - p_v) - g_H\,p_v(z_v - \mathbb
    E_p z)\big)`. References: PPO arXiv 1707.06347, GRPO arXiv 2402.03300, DAPO arXiv 2503.14476, CISPO arXiv
    2506.13585, SAPO arXiv 2511.20347, TIS (Yao et al. 2025 blog), IcePop (Ring-1T); the kernel design follows
    Liger-Kernel's Triton ``grpo_loss`` (PR #672; ``specs/kernels.md`` §1b, §4 "logits-level path").

    **Backward strategy: keep the logits, recompute the softmax.** The forward saves four fp32 numbers per token
    (the derivative of the objective, the entropy, the row maximum and log-normaliser), never ``[N, V]``. The
    backward re-reads the logits (already in memory: the caller holds them) and recomputes each probability
    from the saved statistics. That is the floor for a logits-level loss: one read in the forward, one read and
    one write in the backward.

    **In place (default).** With ``inplace=True`` the backward writes ``dlogits`` into the storage of ``logits``
    and hands that tensor to autograd as the gradient, so no second ``[N, V]`` buffer is allocated. After
    ``backward()`` the logits hold their gradient, not the logits: do not use them again (no second backward
    through them, no other loss term that saved them — autograd raises "modified by an inplace operation" for
    such a term, because the version counter is bumped; a term that merely reads a copy is fine). A logits leaf
    then has ``logits.grad`` aliasing its own storage. Pass ``inplace=False`` to allocate the gradient instead.
    Logits with a non-unit stride along V are copied first, so the write lands in that copy.

    Args:
        logits: ``[B, T, V]`` or ``[B·T, V]`` (bf16, fp16, fp32, fp64; any strides with unit stride along V, e.g.
            ``x[:, :-1]``), or ``[B, T + 1, V]`` — the model's output with the position after the last response
            token still attached: that position is skipped (no copy) and gets a zero gradient, which also spares
            autograd the full-size zero buffer a ``[:, :-1]`` slice costs in the backward. Arithmetic is fp32
            (fp64 for fp64 logits on the torch backend).
        targets: sampled token ids ``[B, T]`` (or ``[N]`` with ``[N, V]`` logits: one sequence of N tokens), in
            ``[0, V)`` at masked-in positions; masked-out positions may hold anything (e.g. -100).
        old_logp: proximal log-probs ``[B, T]``, or None for on-policy (ratio 1).
        advantages: ``[B]`` or ``[B, T]`` (``[N]`` in the 1-D layout).
        mask: loss mask ``[B, T]`` (bool or 0/1). Masked-out rows are not read.
        preset: a name in :data:`FUSED_PRESETS` (grpo, dapo, dr_grpo, cispo, sapo, tis, icepop, decoupled_ppo),
            a :class:`~rolloutopt.losses.Preset`, or None (``policy_loss``'s defaults). Keywords below override it.
        temperature: sampling temperature :math:`\tau > 0` dividing the logits.
        ref_logp: reference log-probs ``[B, T]`` for ``kl``.
        behav_logp: rollout-engine log-probs ``[B, T]`` for TIS / MIS.
        is_weights: precomputed detached importance weights ``[B]`` or ``[B, T]``.
        ratio: :class:`~rolloutopt.ratios.TokenRatio` (the only fused ratio).
        trust: :class:`~rolloutopt.ratios.PPOClip`, :class:`~rolloutopt.ratios.CISPO`,
            :class:`~rolloutopt.ratios.SAPO` or None.
        correction: :class:`~rolloutopt.ratios.TIS` and/or :class:`~rolloutopt.ratios.MIS` at token level without
            batch normalisation (at most one of each), or None.
        kl: :class:`~rolloutopt.losses.KL` (every estimator, ``+`` variants included) or None.
        entropy_coef, agg, removed_in_denominator, denominators, group, max_len, seq_weight: as in
            :func:`~rolloutopt.losses.policy_loss`.
        backend: ``"auto"`` (Triton for CUDA tensors when importable, else torch), ``"torch"`` or ``"triton"``
            (raises, saying why, where it cannot run).
        inplace: write the gradient into the logits' storage (see above).

    Returns:
        :class:`FusedLossOutput`: ``loss``, ``per_token`` and ``metrics`` as :func:`~rolloutopt.losses.policy_loss`
        (``entropy`` always, ``kl`` with a KL term), plus ``logp`` and ``entropy`` per token.

    Raises:
        InputError: bad shapes, dtypes, devices, targets outside ``[0, V)`` at masked-in positions, a bad
            backend, or an objective that is not token-level (GSPO, PNPO, cumulative ratios, M2PO, SAT, OPSM,
            CoPRIS, DPPO, ECHO, sequence-level or batch-normalised IS): those need the whole sequence or batch,
            so compute the log-probs with :func:`rolloutopt.kernels.token_logprobs` and call ``policy_loss``.

    Edge cases: all-masked rows give 0 (log-prob, entropy, loss, gradient) and leave sequence denominators; an
    all-masked batch gives loss 0; rows with ``-inf`` logits (vocabulary masking) are handled (those entries
    have probability 0); a masked-in row whose logits are all ``-inf`` or hold NaN raises (``logits``) while
    checks are on. Only the logits receive a gradient (old/ref/behav log-probs and advantages are constants).
    """
    plan = _resolve(
        preset,
        {
            "ratio": ratio,
            "trust": trust,
            "correction": correction,
            "kl": kl,
            "entropy_coef": entropy_coef,
            "agg": agg,
            "removed_in_denominator": removed_in_denominator,
        },
        {"behav_logp": behav_logp, "ref_logp": ref_logp},
    )
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or not (math.isfinite(temperature) and temperature > 0)
    ):
        raise InputError("temperature", "a finite number > 0", describe(temperature), "pass e.g. temperature=1.0")
    if not isinstance(inplace, bool):
        raise InputError("inplace", "a bool", describe(inplace), "pass True or False")
    x, tgt, flat, t_ = _logits3(logits, targets)
    be = resolve_backend(backend, x.device)
    b_, v_ = x.shape[0], x.shape[2]

    def tok(value: Any, name: str) -> Any:
        if flat and isinstance(value, Tensor) and value.ndim == 1:
            return value.view(1, -1)
        return value

    dims = Dims()
    dims.check(tgt, "targets", "B T")
    m = as_mask(tok(mask, "mask"), "mask", dims, "B T", device=x.device)
    dt = _acc_dtype(x)
    old = None if old_logp is None else as_float(tok(old_logp, "old_logp"), "old_logp", dims, "B T", device=x.device)
    adv_t = as_float(tok(advantages, "advantages"), "advantages", device=x.device)
    if adv_t.ndim == 1:
        dims.check(adv_t, "advantages", "B")
        adv = adv_t[:, None].expand(b_, t_)
    else:
        dims.check(adv_t, "advantages", "B T")
        adv = adv_t
    if checks_enabled():
        bad = m & ((tgt < 0) | (tgt >= v_))
        if bool(bad.any()):
            where = tuple(torch.nonzero(bad)[0].tolist())
            raise InputError(
                "targets",
                f"token ids in [0, {v_}) at masked-in positions",
                f"{describe(targets)} with id {int(tgt[where])} at {where}",
                "fix the ids or mask those positions out",
            )
    finite(adv, "advantages", m)
    if old is not None:
        finite(old, "old_logp", m)

    def opt(value: Any, name: str, needed: bool, why: str) -> Tensor | None:
        if value is None:
            if needed:
                raise InputError(name, f"log-probs [B, T] {why}", "None", f"pass {name}=...")
            return None
        t = as_float(tok(value, name), name, dims, "B T", device=x.device)
        finite(t, name, m)
        return t.to(dt).reshape(-1).contiguous()

    behav = opt(behav_logp, "behav_logp", bool(plan.corrections), "for the TIS / MIS correction")
    ref = opt(ref_logp, "ref_logp", plan.kl is not None, "when kl is set")
    isw = None
    if is_weights is not None:
        w = as_float(tok(is_weights, "is_weights"), "is_weights", device=x.device)
        dims.check(w, "is_weights", "B" if w.ndim == 1 else "B T")
        w = (w[:, None] if w.ndim == 1 else w).expand(b_, t_).detach()
        finite(w, "is_weights", m)
        isw = w.to(dt).reshape(-1).contiguous()
    inp = _Inputs(
        tgt=torch.where(m, tgt, torch.zeros_like(tgt)).reshape(-1).contiguous(),
        mask=m.reshape(-1).contiguous(),
        old=None if old is None else old.detach().to(dt).reshape(-1).contiguous(),
        adv=adv.detach().to(dt).reshape(-1).contiguous(),
        behav=behav,
        ref=ref,
        isw=isw,
    )
    inv_t = 1.0 / float(temperature)
    total, logp, ent, pg, klv, weight, flags = _FusedPolicyLoss.apply(x, t_, inp, plan, inv_t, be, inplace)  # type: ignore[no-untyped-call]
    if checks_enabled():
        finite(logp.detach(), "logits", inp.mask)  # a masked-in row of NaN or all -inf logits
        finite(ent.detach(), "logits", inp.mask)

    shape = (b_, t_)
    total, logp2, ent2 = total.view(shape), logp.view(shape), ent.view(shape)
    pg, klv, weight, flags = pg.view(shape), klv.view(shape), weight.view(shape), flags.view(shape)
    removed = (flags & F_REMOVED) != 0
    keep = ~removed if plan.mis is not None else None
    a = aggregate_terms(
        total, pg, m, keep, dims, agg=plan.agg, seq_weight=seq_weight,  # type: ignore[arg-type]
        removed_in_denominator=plan.removed_in_denominator, denominators=denominators, group=group, max_len=max_len,
    )  # fmt: skip
    loss, per_token, pg, loss_mask, kept, agg_kw = a.loss, a.per_token, a.pg, a.loss_mask, a.kept, a.agg_kw
    metrics = _metrics(
        plan, loss, pg, logp2.detach(), ent2.detach(), klv, weight, flags, m, kept, keep, inp, dims, loss_mask, agg_kw
    )
    if flat:
        per_token, logp2, ent2 = per_token.view(-1), logp2.view(-1), ent2.view(-1)
    return FusedLossOutput(loss=loss, per_token=per_token, metrics=metrics, logp=logp2, entropy=ent2, backend=be)


def _metrics(
    plan: _Plan,
    loss: Tensor,
    pg: Tensor,
    lp: Tensor,
    ent: Tensor,
    klv: Tensor,
    weight: Tensor,
    flags: Tensor,
    m: Tensor,
    kept: Tensor,
    keep: Tensor | None,
    inp: _Inputs,
    dims: Dims,
    loss_mask: Tensor,
    agg_kw: dict[str, Any],
) -> dict[str, Tensor]:
    """``policy_loss``'s metrics from the fused outputs (detached, no host synchronisation)."""
    shape = m.shape
    old = lp if inp.old is None else inp.old.view(shape)
    c = plan.ratio_clamp
    lrd = torch.where(m, (lp - old).clamp(-c, c), torch.zeros_like(lp))
    rd = torch.exp(lrd)
    n_tok = m.sum()
    count = n_tok.clamp(min=1).to(lp.dtype)
    mf = as_weights(m, lp.dtype)
    regularised = plan.kl is not None or plan.entropy_coef != 0.0
    out: dict[str, Tensor] = {
        "pg_loss": aggregate(pg.detach(), loss_mask, plan.agg, **agg_kw).detach() if regularised else loss.detach(),  # type: ignore[arg-type]
        "ratio_mean": masked_mean(rd, mf, count),
        "ratio_max": masked_max(rd, mf),
        "log_ratio_max": masked_max(lrd.abs(), mf),
        "approx_kl": -masked_mean(lrd, mf, count),
        "masked_frac": (n_tok - kept.sum()).to(lp.dtype) / count if keep is not None else torch.zeros_like(count),
    }
    for q, v in zip(RATIO_QUANTILES, masked_quantiles(rd, m, RATIO_QUANTILES), strict=True):
        out[f"ratio_q{round(q * 100)}"] = v
    if plan.trust == TRUST_PPO:
        for name, bit in (
            ("clipfrac", F_CLIP),
            ("clip_low_frac", F_CLIP_LOW),
            ("clip_high_frac", F_CLIP_HIGH),
            ("dual_clip_frac", F_DUAL),
        ):
            out[name] = masked_mean((flags & bit) != 0, mf, count)
    elif plan.trust == TRUST_CISPO:
        out["clipfrac"] = masked_mean((flags & F_CLIP) != 0, mf, count)
    if plan.corrections or inp.isw is not None:
        out.update(weight_metrics(weight, mf))
    if plan.corrections:
        ctx = StageContext(
            logp=lp,
            old_logp=old,
            mask=m,
            advantages=inp.adv.view(shape),
            behav_logp=None if inp.behav is None else inp.behav.view(shape),
        )
        for corr in plan.corrections:
            out.update(corr(ctx).metrics)
    out["entropy"] = masked_mean(ent, mf, count)
    if plan.kl is not None:
        out["kl"] = masked_mean(klv, mf, count)
    return out
