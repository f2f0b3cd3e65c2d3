r"""Log-prob and entropy of the sampled tokens from hidden states, without the ``[N, V]`` logits.

The LM head, the temperature, the log-softmax, the gather of the sampled token and the entropy form one
differentiable operation. It is chunked over tokens and over the vocabulary with an online log-sum-exp, so the
peak extra memory is a few ``[chunk_tokens, chunk_vocab]`` fp32 tiles, whatever N is. Two backends give the same
numbers: a chunked torch path (runs everywhere, the CPU default) and Triton kernels (CUDA; on CPU under
``TRITON_INTERPRET=1``). Design notes, anchors (verl, Liger) and limits: ``docs/methods/kernels.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rolloutopt._validation import checks_enabled, describe
from rolloutopt.errors import InputError
from rolloutopt.kernels._backend import resolve_backend

__all__ = ["token_logprobs"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def token_logprobs(
    hidden: Float[Tensor, "N d"],
    weight: Float[Tensor, "V d"],
    targets: Int[Tensor, " N"],
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    ignore_index: int | None = None,
    backend: str = "auto",
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> tuple[Float[Tensor, " N"], Float[Tensor, " N"] | None]:
    r"""Log-prob of each target token, and the entropy, from hidden states and the LM-head weight.

    .. math::
        z_{n} = \frac{W h_n}{\tau}, \qquad
        \log p_n = z_{n, y_n} - \operatorname{LSE}(z_n), \qquad
        H_n = \operatorname{LSE}(z_n) - \sum_v p_{n,v} z_{n,v}

    with :math:`p_n = \operatorname{softmax}(z_n)`. The logits are never materialised: a forward pass keeps, per
    token, the running maximum :math:`m`, :math:`s = \sum_v e^{z_v - m}` and :math:`a = \sum_v e^{z_v - m}
    (z_v - m)` over vocabulary chunks (online log-sum-exp, rescaled when :math:`m` grows), so
    :math:`\operatorname{LSE} = m + \log s` and :math:`H = \log s - a / s`. Both are formed relative to
    :math:`m`, so logits of magnitude 1e4 and more lose nothing to cancellation. Backward, with
    :math:`\log p_{n,v} = z_{n,v} - \operatorname{LSE}_n`:

    .. math::
        \frac{\partial \log p_n}{\partial z_{n,v}} = \mathbb 1[v = y_n] - p_{n,v}, \qquad
        \frac{\partial H_n}{\partial z_{n,v}} = -p_{n,v}\,\big(z_{n,v} - \mathbb E_{p_n} z_n\big)
                                             = -p_{n,v}\,\big(\log p_{n,v} + H_n\big),

    the raw logits get :math:`1/\tau` of that, and :math:`\partial h = G W`, :math:`\partial W = G^\top h`
    for the tile :math:`G` of logit gradients. The entropy gradient is exact (not detached, unlike prime-rl's).

    **Backward strategy: recompute.** Forward saves only ``hidden``, ``weight``, ``targets`` and two fp32
    numbers per token (LSE and H). Backward recomputes each ``[chunk_tokens, chunk_vocab]`` logits tile, turns
    it into :math:`G` in place and accumulates :math:`\partial h` and :math:`\partial W` in fp32: the
    4-matmul schedule. Keeping logits (3 matmuls) would need either memory proportional to N or the
    loss gradient during forward; under autograd the gradient of ``logp`` arrives only in backward (and may be
    a sequence-level function of all of ``logp``, e.g. GSPO), so recomputing is what keeps the extra memory
    independent of N. The extra memory is a few tiles plus the fp32 gradient accumulators (the gradients
    themselves for fp32 inputs).

    References: verl ``linear_cross_entropy`` (logp + entropy from hidden states, PR #462/#1878); Liger
    ``_ChunkedSelectiveLogProbFunction`` (PR #1160, online LSE over 2-D chunks); Apple Cut Cross-Entropy,
    arXiv 2411.09009 (recompute in backward); ``docs/methods/kernels.md``.

    Args:
        hidden: ``[N, d]`` hidden states before the LM head (fp32, bf16, fp16; fp64 on the torch backend).
            Flatten ``[B, T, d]`` with ``hidden.reshape(-1, d)`` and reshape the results to ``[B, T]``.
        weight: ``[V, d]`` LM-head weight, same dtype and device as ``hidden``. Any strides.
        targets: ``[N]`` integer token ids in ``[0, V)`` (the sampled tokens, already shifted).
        temperature: :math:`\tau > 0`; the logits are divided by it (sampling temperature of the rollout).
        with_entropy: whether to compute the entropy (skipping it saves one multiply-add per logit).
        ignore_index: a target value that marks a position without a token (e.g. -100, the Hugging Face
            label convention). Such positions get ``logp = 0`` and no gradient through ``logp``; their entropy
            is still computed (from their hidden state), so mask it in the loss. ``None`` (the default): every
            target must be a valid id, and padding is handled by the loss mask — pad with any valid id.
        backend: ``"auto"`` (Triton for CUDA tensors when importable, else torch; torch for float64), ``"torch"``
            or ``"triton"`` (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; fp32/bf16/fp16 only;
            raises and says why otherwise).
        chunk_tokens: tokens per tile (default 1024 on CPU, 4096 on CUDA).
        chunk_vocab: vocabulary entries per tile (default 8192 on CPU, 16384 on CUDA); on the Triton backend
            also the vocabulary split of one forward program (rounded up to its block size).

    Returns:
        ``(logp, entropy)``: fp32 ``[N]`` each (fp64 for fp64 inputs); ``entropy`` is None when
        ``with_entropy=False``. Gradients flow to ``hidden`` and ``weight`` from both outputs.

    Numerics: products in fp32 (half inputs are upcast per tile on the torch backend; ``tl.dot`` accumulates in
    fp32 on Triton, with IEEE fp32 products for fp32 inputs — no TF32), sums and gradient accumulators in fp32,
    the gradients cast to the input dtypes at the end. The two backends agree to fp32 rounding (summation
    order). Edge cases: ``N = 0`` gives empty outputs; ``V = 1`` gives ``logp = 0`` and ``H = 0``; any V and N
    (tails are masked); logits of any finite magnitude (``|z| > 1e4`` included) give finite results; row
    offsets in the Triton kernels are int64, so ``N * V > 2**31`` is safe.

    Raises:
        InputError: shapes, dtypes or devices that do not match; targets outside ``[0, V)`` (checked with one
            host synchronisation while ``rolloutopt.checks`` is on); a non-positive temperature or chunk size; a
            backend that cannot run here (with the reason).
    """
    if checks_enabled():
        _validate(hidden, weight, targets, temperature, ignore_index, chunk_tokens, chunk_vocab)
    chosen = resolve_backend(backend, hidden.device)
    if chosen == "triton" and hidden.dtype == torch.float64 and backend == "auto":
        chosen = "torch"  # the kernels accumulate in fp32; float64 (gradcheck) stays exact on the torch path
    if chosen == "triton" and hidden.dtype == torch.float64:
        raise InputError(
            "hidden", "fp32, bf16 or fp16 for backend='triton'", describe(hidden), "pass backend='torch' for float64"
        )
    cuda = hidden.device.type == "cuda"
    cn = chunk_tokens if chunk_tokens is not None else (4096 if cuda else 1024)
    cv = chunk_vocab if chunk_vocab is not None else (16384 if cuda else 8192)
    ignored: Tensor | None = None
    if ignore_index is not None:
        ignored = targets == ignore_index
        targets = targets.masked_fill(ignored, 0)
    logp, entropy = _TokenLogprobs.apply(  # type: ignore[no-untyped-call]
        hidden, weight, targets.long(), 1.0 / float(temperature), bool(with_entropy), chosen, int(cn), int(cv)
    )
    if ignored is not None:
        logp = logp.masked_fill(ignored, 0.0)
    return logp, (entropy if with_entropy else None)


def _validate(
    hidden: Any,
    weight: Any,
    targets: Any,
    temperature: Any,
    ignore_index: Any,
    chunk_tokens: Any,
    chunk_vocab: Any,
) -> None:
    for name, x in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(x, Tensor):
            raise InputError(name, "a torch.Tensor", describe(x), f"pass {name} as a tensor")
    if hidden.ndim != 2 or hidden.dtype not in _FLOATS:
        raise InputError(
            "hidden", "a floating tensor [N, d] (fp32, bf16, fp16, fp64)", describe(hidden), "reshape to [N, d]"
        )
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[1]:
        raise InputError(
            "weight", f"a tensor [V, d] with d={hidden.shape[1]} (from hidden)", describe(weight), "pass the LM head"
        )
    if weight.shape[0] == 0:
        raise InputError("weight", "a vocabulary of at least one entry", describe(weight), "pass the LM head")
    if weight.dtype != hidden.dtype:
        raise InputError("weight", f"the dtype of hidden ({hidden.dtype})", describe(weight), "cast both to one dtype")
    if weight.device != hidden.device or targets.device != hidden.device:
        bad = "weight" if weight.device != hidden.device else "targets"
        raise InputError(bad, f"a tensor on {hidden.device} (from hidden)", describe(locals()[bad]), "move it")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise InputError("targets", "an integer tensor of token ids", describe(targets), "cast with .long()")
    if targets.shape != (hidden.shape[0],):
        raise InputError(
            "targets", f"shape [N] with N={hidden.shape[0]} (from hidden)", describe(targets), "one id per token"
        )
    t_ok = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if not (t_ok and math.isfinite(temperature) and temperature > 0):
        raise InputError("temperature", "a finite number > 0", describe(temperature), "pass e.g. 1.0")
    if ignore_index is not None and (not isinstance(ignore_index, int) or isinstance(ignore_index, bool)):
        raise InputError("ignore_index", "an int or None", describe(ignore_index), "pass e.g. -100")
    for name, c in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise InputError(name, "a positive int or None", describe(c), f"pass e.g. {name}=1024")
    if targets.numel():
        valid = targets if ignore_index is None else targets[targets != ignore_index]
        if valid.numel():
            lo, hi = int(valid.min()), int(valid.max())
            vocab = weight.shape[0]
            if lo < 0 or hi >= vocab:
                raise InputError(
                    "targets",
                    f"token ids in [0, V) with V={vocab} (from weight)"
                    + ("" if ignore_index is None else f", or ignore_index={ignore_index}"),
                    f"ids in [{lo}, {hi}]",
                    "fix the ids, or pass ignore_index= for padding labels such as -100",
                )


class _TokenLogprobs(torch.autograd.Function):
    """``(hidden, weight, targets) -> (logp, entropy)`` with a recomputing, chunked backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        inv_t: float,
        with_entropy: bool,
        backend: str,
        cn: int,
        cv: int,
    ) -> tuple[Tensor, Tensor]:
        if backend == "triton":
            from rolloutopt.kernels import _token_logprobs_triton as tk

            lse, logp, entropy = tk.forward(hidden, weight, targets, inv_t, with_entropy, cv)
        else:
            lse, logp, entropy = _forward_torch(hidden, weight, targets, inv_t, with_entropy, cn, cv)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.config = (inv_t, with_entropy, backend, cn, cv)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        inv_t, with_entropy, backend, cn, cv = ctx.config
        if not with_entropy:
            g_ent = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logp is None and g_ent is None) or not (need_h or need_w):
            return (None,) * 8
        tile: Any = _grad_tile_torch
        if backend == "triton":
            from rolloutopt.kernels import _token_logprobs_triton as tk

            tile = tk.grad_tile
        acc = lse.dtype
        dh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        n, vocab = hidden.shape[0], weight.shape[0]
        bufs = _Buffers(min(cn, n) * min(cv, vocab), acc, hidden.device)
        for v0 in range(0, vocab, cv):
            v1 = min(v0 + cv, vocab)
            wv = weight[v0:v1].to(acc)
            for c0 in range(0, n, cn):
                c1 = min(c0 + cn, n)
                hc = hidden[c0:c1].to(acc)
                g, scale = tile(
                    hidden[c0:c1],
                    weight[v0:v1],
                    hc,
                    wv,
                    targets[c0:c1],
                    v0,
                    lse[c0:c1],
                    entropy[c0:c1],
                    None if g_logp is None else g_logp[c0:c1].to(acc),
                    None if g_ent is None else g_ent[c0:c1].to(acc),
                    inv_t,
                    bufs,
                )
                if dh is not None:  # the tile's scale rides on the GEMM (no extra pass over the tile)
                    dh[c0:c1].addmm_(g, wv, alpha=scale)
                if dw is not None:
                    dw[v0:v1].addmm_(g.t(), hc, alpha=scale)
        grad_h = None if dh is None else dh.to(hidden.dtype)
        grad_w = None if dw is None else dw.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Buffers:
    """Two reusable ``[chunk_tokens × chunk_vocab]`` workspaces: no fresh (page-faulting) tile per iteration."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.a = torch.empty(numel, dtype=dtype, device=device)
        self.b = torch.empty(numel, dtype=dtype, device=device)

    def views(self, rows: int, cols: int) -> tuple[Tensor, Tensor]:
        return self.a[: rows * cols].view(rows, cols), self.b[: rows * cols].view(rows, cols)


def _forward_torch(
    hidden: Tensor, weight: Tensor, targets: Tensor, inv_t: float, with_entropy: bool, cn: int, cv: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Online LSE (and entropy sums) over vocabulary chunks (outer) and token chunks (inner); returns lse, logp, H."""
    acc = _acc_dtype(hidden)
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    m = torch.empty(n, dtype=acc, device=dev)
    s = torch.empty(n, dtype=acc, device=dev)
    a = torch.zeros(n, dtype=acc, device=dev)
    zy = torch.zeros(n, dtype=acc, device=dev)
    bufs = _Buffers(min(cn, n) * min(cv, vocab), acc, dev)
    for v0 in range(0, vocab, cv):
        v1 = min(v0 + cv, vocab)
        wv = weight[v0:v1].to(acc)
        for c0 in range(0, n, cn):
            c1 = min(c0 + cn, n)
            z, e = bufs.views(c1 - c0, v1 - v0)
            z.addmm_(hidden[c0:c1].to(acc), wv.t(), beta=0, alpha=inv_t)  # logits tile / T (beta=0: no read)
            idx = targets[c0:c1] - v0
            inside = (idx >= 0) & (idx < v1 - v0)
            picked = z.gather(1, idx.clamp(0, v1 - v0 - 1)[:, None]).squeeze(1)
            zy[c0:c1] += torch.where(inside, picked, 0.0)
            tile_max = z.amax(1)
            if v0 == 0:
                m_new = tile_max
            else:
                m_old = m[c0:c1]
                m_new = torch.maximum(m_old, tile_max)
                alpha = torch.exp(m_old - m_new)
                if with_entropy:  # a = Σ e^{z-m}(z-m): re-centre on the new max before rescaling
                    a[c0:c1] = alpha * (a[c0:c1] + (m_old - m_new) * s[c0:c1])
                s[c0:c1] *= alpha
            z.sub_(m_new[:, None])
            torch.exp(z, out=e)
            if v0 == 0:
                s[c0:c1] = e.sum(1)
            else:
                s[c0:c1] += e.sum(1)
            if with_entropy:  # in place; a BLAS dot (einsum) would lose ~1e-4 relative over 150k terms
                a[c0:c1] += z.mul_(e).sum(1)
            m[c0:c1] = m_new
    return _finish(m, s, a, zy, with_entropy)


def _finish(m: Tensor, s: Tensor, a: Tensor, zy: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``lse = m + log s``, ``logp = z_y - lse``, ``H = log s - a / s`` from the running statistics."""
    log_s = torch.log(s)
    lse = m + log_s
    entropy = (log_s - a / s) if with_entropy else m.new_empty(0)
    return lse, zy - lse, entropy


def _grad_tile_torch(
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
    bufs: Any,
) -> tuple[Tensor, float]:
    """``(M, -1/T)`` with ``G = -M/T`` the tile's logit gradient, recomputing its logits:
    ``M = p (g_H (log p + H) + g_logp) - g_logp onehot``; three passes over the tile after the GEMM."""
    lp, p = bufs.views(hc.shape[0], wv.shape[0])
    torch.addmm(-lse_c[:, None], hc, wv.t(), alpha=inv_t, out=lp)  # log p = z/T - lse, one GEMM
    torch.exp(lp, out=p)
    if gh is not None:
        shift = gh * ent_c if gl is None else torch.addcmul(gl, gh, ent_c)  # g_H H + g_logp, per row
        torch.addcmul(shift[:, None], lp, gh[:, None], out=lp)  # g_H log p + g_H H + g_logp
        m = lp.mul_(p)
    else:
        assert gl is not None
        m = p.mul_(gl[:, None])
    if gl is not None:
        idx = targets_c - v0
        rows = torch.nonzero((idx >= 0) & (idx < m.shape[1])).squeeze(1)
        m.index_put_((rows, idx[rows]), -gl[rows], accumulate=True)
    return m, -inv_t
