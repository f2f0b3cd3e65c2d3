r"""Log-prob and entropy of the sampled tokens from logits, one pass per row, ``dlogits`` written in place.

:func:`logits_logprobs` is the logits-level primitive of the hot path: ``log_softmax(logits / T)`` gathered at
the sampled tokens, and the entropy of each row, without the ``[N, V]`` log-softmax that autograd would keep for
the backward. The forward reads each row once (online log-sum-exp over vocabulary blocks) and keeps four numbers
per row; the backward reads the row once more and writes ``d/dlogits`` — by default into the logits' own
storage. Any objective on the ``[B, T]`` log-probs (:func:`rolloutopt.losses.fused_policy_loss` composes it with
``policy_loss``) then runs in plain torch autograd.

Two backends with the same numbers: a chunked torch path (runs everywhere, the CPU default) and Triton kernels
(CUDA; on CPU only under ``TRITON_INTERPRET=1``), imported lazily from ``_logits_logprobs_triton``. This module
imports only the core (``_validation``, ``errors``) and ``rolloutopt.kernels._backend``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from rolloutopt._validation import Dims, as_mask, checks_enabled, describe
from rolloutopt.errors import InputError
from rolloutopt.kernels._backend import resolve_backend

__all__ = ["logits_logprobs", "resolve_logits_backend", "torch_chunk_rows"]

# Elements of one chunk of rows of the torch backend (rows x V, at most 16 MiB in fp32); its temporaries hold
# about five such chunks, whatever N is.
_TORCH_CHUNK_ELEMS = 1 << 22

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def torch_chunk_rows(vocab: int) -> int:
    """Rows per chunk of the torch backend at vocabulary size ``vocab``: ``max(1, 2**22 // vocab)``.

    Every temporary of the torch backend (forward and backward) is one chunk ``[rows, V]`` or a per-row vector,
    so its workspace is a few chunks — bounded by ``max(2**22, V)`` elements each, independent of N.
    """
    return max(1, _TORCH_CHUNK_ELEMS // max(int(vocab), 1))


def resolve_logits_backend(backend: str, logits: Shaped[Tensor, " ..."]) -> str:
    """The backend :func:`logits_logprobs` runs for ``logits``: ``"torch"`` or ``"triton"``.

    ``"auto"`` picks Triton for CUDA tensors when it is importable and torch otherwise (and for float64, which
    the Triton kernels would compute in fp32); a forced ``"triton"`` that cannot run raises and says why.
    """
    chosen = resolve_backend(backend, logits.device)
    if chosen == "triton" and logits.dtype == torch.float64:
        if backend == "auto":
            return "torch"
        raise InputError(
            "logits", "fp32, bf16 or fp16 for backend='triton'", describe(logits), "pass backend='torch' for float64"
        )
    return chosen


def logits_logprobs(
    logits: Float[Tensor, "... V"],
    targets: Int[Tensor, "*N"],
    *,
    temperature: float = 1.0,
    mask: Shaped[Tensor, "*N"] | None = None,
    inplace: bool = True,
    backend: str = "auto",
) -> tuple[Float[Tensor, "*N"], Float[Tensor, "*N"]]:
    r"""Log-prob of each sampled token and the entropy of its row, from the logits, in one pass per row.

    .. math::
        z = x / \tau, \qquad \log p_y = z_y - \log\textstyle\sum_v e^{z_v}, \qquad
        H = \log\textstyle\sum_v e^{z_v} - \sum_v p_v z_v, \qquad p = \operatorname{softmax}(z)

    (``log_softmax(logits / T).gather(targets)`` and ``-Σ p log p``; verl's ``logprobs_from_logits`` and
    ``entropy_from_logits`` in ``verl/utils/torch_functional.py``). **Forward:** an online log-sum-exp over
    vocabulary blocks (Milakov & Gimelshein, arXiv 1805.02867) kept relative to the running maximum :math:`m`
    of the *raw* logits: with :math:`u_v = (x_v - m)/\tau`, the sums :math:`s = \sum_v e^{u_v}` and
    :math:`a = \sum_v e^{u_v} u_v` are rescaled when :math:`m` grows (:math:`s \leftarrow \alpha s`,
    :math:`a \leftarrow \alpha(a + s\delta)`, :math:`\delta = (m - m')/\tau`, :math:`\alpha = e^\delta`); then
    :math:`\log p_y = u_y - \log s` and :math:`H = \log s - a/s`. Subtracting the maximum before dividing by
    :math:`\tau` keeps :math:`|x| > 10^4` exact. The forward keeps four numbers per row (:math:`H`, :math:`m`,
    :math:`\log s`; the targets and mask), never ``[N, V]``.

    **Backward:** autograd hands the cotangents :math:`g_\ell = \partial\mathcal L/\partial \log p` and
    :math:`g_H = \partial\mathcal L/\partial H` (``[N]`` each; either may be absent); one more read of the row
    gives the exact gradient, entropy term included:

    .. math::
        \frac{\partial \mathcal L}{\partial x_v} = \frac1\tau\Big(g_\ell\big(\mathbb 1[v = y] - p_v\big)
        - g_H\,p_v\,(u_v - \mathbb E_p u)\Big).

    That is the floor for a logits-level op: one read forward, one read and one write backward. Rows with
    :math:`g_\ell = g_H = 0` (masked, clipped or removed tokens) are written as zeros; on the Triton backend they
    are not even read. References: Liger-Kernel's Triton ``grpo_loss`` (``linkedin/Liger-Kernel``,
    ``src/liger_kernel/ops/grpo_loss.py``, in-place ``dlogits``), flash-attn's Triton cross-entropy
    (``inplace_backward``); ``docs/methods/kernels.md``.

    **In place (default).** With ``inplace=True`` the backward writes ``dlogits`` into the storage of ``logits``
    and hands that tensor to autograd as the gradient, so no second ``[N, V]`` buffer is allocated. After
    ``backward()`` the logits hold their gradient: do not use them again. The version counter is bumped, so a
    second backward through them, or another autograd term that saved them, raises "modified by an inplace
    operation" instead of reading the gradient. A logits leaf then has ``logits.grad`` aliasing its own storage.
    ``inplace=False`` allocates the gradient. Logits with a non-unit stride along V are copied first (the write
    lands in that copy).

    Args:
        logits: ``[B, T, V]`` or ``[N, V]`` (bf16, fp16, fp32; fp64 on the torch backend), any strides with unit
            stride along V (e.g. ``x[:, :-1]``), or ``[B, T + 1, V]`` with ``[B, T]`` targets — the model's
            output with the position after the last response token still attached: that position is skipped
            (no copy) and gets a zero gradient.
        targets: sampled token ids, integer: ``[B, T]`` for ``[B, T(+1), V]`` logits; ``[N]`` or ``[B, T]``
            (``B·T = N``) for ``[N, V]`` logits. In ``[0, V)`` where ``mask`` is True; anything (e.g. -100)
            where it is False.
        temperature: sampling temperature :math:`\tau > 0` dividing the logits.
        mask: bool (or 0/1) tensor shaped like ``targets``, or None (every row counts). Masked-out rows get
            ``logp = entropy = 0`` and a zero gradient; the Triton backend never reads them.
        inplace: write the gradient into the logits' storage (see above).
        backend: ``"auto"`` (Triton for CUDA tensors when importable, else torch; torch for float64),
            ``"torch"`` or ``"triton"`` (raises, saying why, where it cannot run).

    Returns:
        ``(logp, entropy)``, each shaped like ``targets``, fp32 (fp64 for fp64 logits), 0 at masked-out rows,
        both differentiable with respect to ``logits``.

    Numerics: fp32 arithmetic (fp64 for fp64 logits on the torch backend, for ``gradcheck``); the gradient is
    cast to the logits' dtype. Both backends agree to fp32 rounding. Edge cases: ``N = 0`` gives empty outputs;
    ``V = 1`` gives ``logp = H = 0``; ``-inf`` logits (vocabulary masking) have probability 0; an all-masked
    batch gives zeros. Memory: the Triton backend keeps only per-row vectors; the torch backend works on chunks
    of :func:`torch_chunk_rows` rows (a few ``[rows, V]`` temporaries of at most 2^22 elements), independent of
    N. Row offsets in the Triton kernels are int64 (``N·V > 2^31`` is safe).

    Raises:
        InputError: logits that are not a floating ``[B, T, V]`` / ``[N, V]`` tensor, targets of the wrong
            type, shape or device, targets outside ``[0, V)`` at masked-in rows (one host synchronisation while
            ``rolloutopt.checks`` is on), a bad mask, a non-positive temperature, a non-bool ``inplace``, a
            backend that cannot run here; and, after the forward while checks are on, a masked-in row whose
            logits are all ``-inf`` or hold NaN or ``+inf`` (``logits``).
    """
    _check_logits(logits)
    chosen = resolve_logits_backend(backend, logits)
    t_ok = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not (t_ok and math.isfinite(temperature) and temperature > 0):
        raise InputError("temperature", "a finite number > 0", describe(temperature), "pass e.g. temperature=1.0")
    if not isinstance(inplace, bool):
        raise InputError("inplace", "a bool", describe(inplace), "pass inplace=True or False")
    x, tgt, t_len, out_shape = _layout(logits, targets)
    dims = Dims()
    spec = "N" if targets.ndim == 1 else "B T"
    dims.check(targets, "targets", spec)
    if mask is None:
        m = torch.ones(tgt.shape, dtype=torch.bool, device=x.device)
    else:
        m = as_mask(mask, "mask", dims, spec, device=x.device).reshape(tgt.shape)
    vocab = x.shape[2]
    if checks_enabled() and tgt.numel():
        bad = m & ((tgt < 0) | (tgt >= vocab))
        if bool(bad.any()):
            where = tuple(torch.nonzero(bad.view(out_shape))[0].tolist())
            raise InputError(
                "targets",
                f"token ids in [0, {vocab}) (from logits) at masked-in positions",
                f"{describe(targets)} with id {int(targets[where])} at {where}",
                "fix the ids, or mask those positions out (mask=...)",
            )
    m_flat = m.reshape(-1).contiguous()
    tgt_flat = torch.where(m, tgt, torch.zeros_like(tgt)).reshape(-1).contiguous()
    logp, ent = _LogitsLogprobs.apply(  # type: ignore[no-untyped-call]
        x, t_len, tgt_flat, m_flat, 1.0 / float(temperature), chosen, inplace
    )
    if checks_enabled():
        bad = m_flat & ~(torch.isfinite(logp.detach()) & torch.isfinite(ent.detach()))
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0])
            where = tuple(torch.nonzero(bad.view(out_shape))[0].tolist())
            raise InputError(
                "logits",
                "at least one finite logit, and no NaN or +inf, in every masked-in row",
                f"{describe(logits)} whose row at {where} gives log-prob {float(logp[row])}, entropy {float(ent[row])}",
                "fix the logits, or mask that position out",
            )
    return logp.view(out_shape), ent.view(out_shape)


def _check_logits(logits: Any) -> None:
    if not isinstance(logits, Tensor) or logits.dtype not in _FLOATS or logits.ndim not in (2, 3):
        raise InputError(
            "logits",
            "a floating tensor [B, T, V] or [N, V] (fp32, bf16, fp16 or fp64)",
            describe(logits),
            "pass the model's output logits of the response tokens",
        )
    if logits.shape[-1] < 1:
        raise InputError("logits", "a vocabulary dimension V >= 1", describe(logits), "pass non-empty logits")


def _layout(logits: Tensor, targets: Any) -> tuple[Tensor, Tensor, int, tuple[int, ...]]:
    """``(logits [B, T(+1), V] with unit stride along V, targets [B, T] int64, T, output shape)``."""
    if (
        not isinstance(targets, Tensor)
        or targets.is_floating_point()
        or targets.is_complex()
        or targets.dtype == torch.bool
    ):
        raise InputError("targets", "an integer tensor of token ids", describe(targets), "cast with targets.long()")
    if targets.device != logits.device:
        raise InputError("targets", f"a tensor on {logits.device}", describe(targets), "move it to the logits' device")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()  # the kernels need unit stride along V
    v = x.shape[-1]
    if x.ndim == 3:
        b_, tx = x.shape[:2]
        if targets.ndim != 2 or targets.shape[0] != b_ or targets.shape[1] not in (tx, tx - 1):
            raise InputError(
                "targets",
                f"shape [B, T] = {[b_, tx]} (from logits [B, T, V]) or [B, T - 1] (logits with one extra position)",
                describe(targets),
                "fix the shapes",
            )
        return x, targets.long(), int(targets.shape[1]), tuple(targets.shape)
    n = x.shape[0]
    if targets.ndim == 1 and targets.shape[0] == n:
        return x.view(1, n, v), targets.long().view(1, n), n, (n,)
    if targets.ndim == 2 and targets.shape[0] * targets.shape[1] == n:
        b_, t_ = int(targets.shape[0]), int(targets.shape[1])
        return x.view(b_, t_, v), targets.long(), t_, (b_, t_)
    raise InputError(
        "targets", f"shape [N] or [B, T] with B·T = N = {n} (from logits [N, V])", describe(targets), "fix the shapes"
    )


# ------------------------------------------------------------------------------------------------ torch backend


def _row_chunks(x: Tensor, *others: Tensor) -> Iterator[tuple[int, int, tuple[Tensor, ...]]]:
    """``(start, stop, (rows of x, rows of each other))`` over the token rows of ``x [B, T, V]``, at most
    :func:`torch_chunk_rows` rows at a time; ``others`` have x's shape (any layout) and are cut at the same rows."""
    b_, t_, v_ = x.shape
    step = torch_chunk_rows(v_)
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


class _Workspace:
    """Two reusable chunk buffers ``[rows, V]`` in the compute dtype: every elementwise pass writes into them (``out=``
    or in place), so a call allocates no fresh chunk-sized tensor per chunk (on a CPU each fresh one page-faults)."""

    def __init__(self, x: Tensor) -> None:
        rows = min(torch_chunk_rows(x.shape[2]), x.shape[0] * x.shape[1])
        numel = rows * x.shape[2]
        dt = _acc_dtype(x)
        self.a = torch.empty(numel, dtype=dt, device=x.device)
        self.b = torch.empty(numel, dtype=dt, device=x.device)

    def views(self, rows: int, cols: int) -> tuple[Tensor, Tensor]:
        return self.a[: rows * cols].view(rows, cols), self.b[: rows * cols].view(rows, cols)


def _torch_stats(x: Tensor, tgt: Tensor, m: Tensor, inv_t: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row: ``(logp, entropy, max of the raw logits, log Σ exp((x - max)/T))``, 0 at masked rows."""
    n = tgt.numel()
    dt = _acc_dtype(x)
    logp, ent, mx, logl = (torch.zeros(n, dtype=dt, device=x.device) for _ in range(4))
    if n == 0:
        return logp, ent, mx, logl
    ws = _Workspace(x)
    for s, e, (rows,) in _row_chunks(x):
        u, p = ws.views(e - s, rows.shape[1])
        rmx = rows.amax(-1, keepdim=True).to(dt)  # the max of half logits is exact; upcast after
        safe = torch.where(torch.isfinite(rmx), rmx, torch.zeros_like(rmx))
        torch.sub(rows, safe, out=u)  # half logits are upcast exactly by type promotion
        u.mul_(inv_t)
        torch.exp(u, out=p)
        lsum = p.sum(-1)
        ut = u.gather(-1, tgt[s:e, None]).squeeze(-1)
        # Σ e^u u: at -inf logits e^u = 0 and u = -inf, whose product (NaN) is 0; nothing else can be NaN here
        # (a NaN logit has already made lsum NaN)
        su = p.mul_(u).nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf).sum(-1)
        ll = torch.log(lsum)
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
    """Write ``d loss / d logits`` into ``out`` (``x`` itself when in place), chunk by chunk:
    ``dz = (g_l (1[v = y] - p) - g_H p (u - E_p u)) / T`` with ``p = e^{u - log s}``, 0 at masked rows."""
    if tgt.numel() == 0:
        return
    eu_all = logl - ent  # E_p[u] per row, u = (x - max) / T
    ws = _Workspace(x)
    for s, e, (rows, orows) in _row_chunks(x, out):
        dz, p = ws.views(e - s, rows.shape[1])
        off = ~m[s:e, None]
        torch.sub(rows, mx[s:e, None], out=dz)  # reads the row before the (possibly same) storage is written
        dz.mul_(inv_t)  # u
        torch.sub(dz, logl[s:e, None], out=p).exp_()  # p
        g = gl[s:e, None]
        # (g_l + g_H (u - E u)) p: at -inf logits p = 0 and u = -inf, whose product (NaN) is 0
        dz.sub_(eu_all[s:e, None]).mul_(gh[s:e, None]).add_(g).mul_(p).neg_()
        dz.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
        dz.scatter_add_(-1, tgt[s:e, None], g)
        dz.mul_(inv_t).masked_fill_(off, 0.0)  # masked rows (which may hold anything) get exactly 0
        orows.copy_(dz)


# ------------------------------------------------------------------------------------------------ autograd


class _LogitsLogprobs(torch.autograd.Function):
    """Differentiable ``(logp, entropy)`` per token row from the logits; the backward writes ``dlogits``."""

    @staticmethod
    def forward(
        ctx: Any, full: Tensor, t_len: int, tgt: Tensor, m: Tensor, inv_t: float, backend: str, inplace: bool
    ) -> tuple[Tensor, Tensor]:
        # full: [B, T, V], or [B, T + 1, V] whose last position is not a token (no copy, zero gradient there)
        x = full[:, :t_len]
        if backend == "triton":
            from rolloutopt.kernels import _logits_logprobs_triton as tk

            logp, ent, mx, logl = tk.forward(x, tgt, m, inv_t)
        else:
            logp, ent, mx, logl = _torch_stats(x, tgt, m, inv_t)
        ctx.save_for_backward(full, tgt, m, ent, mx, logl)
        ctx.t_len, ctx.inv_t, ctx.backend, ctx.inplace = t_len, inv_t, backend, inplace
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        if g_logp is None and g_ent is None:
            return (None,) * 7
        full, tgt, m, ent, mx, logl = ctx.saved_tensors
        gl = torch.zeros_like(ent) if g_logp is None else g_logp.to(ent.dtype).contiguous()
        gh = torch.zeros_like(ent) if g_ent is None else g_ent.to(ent.dtype).contiguous()
        full = full.detach()  # shares storage and version counter with the logits
        out_full = full if ctx.inplace else torch.empty_like(full)
        if ctx.inplace:
            # The storage now holds dlogits: any other autograd node that saved these logits must fail loudly.
            torch.autograd.graph.increment_version(full)
        x, out = full[:, : ctx.t_len], out_full[:, : ctx.t_len]
        if full.shape[1] > ctx.t_len:
            out_full[:, ctx.t_len :].zero_()
        if ctx.backend == "triton":
            from rolloutopt.kernels import _logits_logprobs_triton as tk

            tk.backward(x, out, tgt, m, gl, gh, mx, logl, ent, ctx.inv_t)
        else:
            with torch.no_grad():
                _torch_backward(x, out, tgt, m, gl, gh, mx, logl, ent, ctx.inv_t)
        return out_full, None, None, None, None, None, None
