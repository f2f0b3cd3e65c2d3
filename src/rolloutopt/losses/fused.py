r"""The policy loss straight from the logits: :func:`fused_policy_loss` = ``logits_logprobs`` + ``policy_loss``.

The ``[B, T, V]`` part — log-softmax, the sampled token's log-prob, the entropy and their gradient, written into
the logits' storage — is the kernel :func:`rolloutopt.kernels.logits_logprobs`; the ``[B, T]`` objective is
:func:`rolloutopt.losses.policy_loss` (or a preset) in torch autograd on those log-probs. Every stage's per-token
math therefore exists once, in the stage, and every preset works: token-level ones, sequence-level ratios
(GSPO, PNPO, cumulative), batch statistics (M2PO, SAT, OPSM), extra inputs (DPPO, ECHO, CoPRIS).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from rolloutopt._validation import describe
from rolloutopt.errors import InputError
from rolloutopt.losses.policy import LossOutput, policy_loss
from rolloutopt.losses.presets import PRESETS, Preset
from rolloutopt.ratios.context import as_weights, masked_mean
from rolloutopt.typing import PerSeqOrToken

__all__ = ["FusedLossOutput", "fused_policy_loss"]

_POLICY_PARAMS = inspect.signature(policy_loss).parameters
_POLICY_KEYWORDS = frozenset(_POLICY_PARAMS) - {"logp", "old_logp", "advantages", "mask"}
# Inputs of policy_loss that hold one value per token: with [N, V] logits and [N] targets (one sequence of N
# tokens) they are viewed as [1, N] (``topk_*`` as [1, N, K]).
_PER_TOKEN = ("behav_logp", "ref_logp", "is_weights", "versions", "topk_logp", "topk_behav_logp")


@dataclass(frozen=True, kw_only=True)
class FusedLossOutput(LossOutput):
    """:class:`~rolloutopt.losses.LossOutput` plus the per-token quantities the kernel computed.

    Attributes:
        logp: log-probs of the targets at ``temperature``, shaped like ``targets``, fp32 (fp64 for fp64 logits);
            0 at masked-out tokens. Differentiable: a gradient on it reaches the logits.
        entropy: entropy of the tempered distribution per token, shaped like ``targets``; 0 at masked-out
            tokens. Differentiable (the exact entropy gradient).
        backend: ``"torch"`` or ``"triton"``, the backend of the kernel that ran.
    """

    per_token: Float[Tensor, "*N"] = field(kw_only=False)
    logp: Float[Tensor, "*N"]
    entropy: Float[Tensor, "*N"]
    backend: str = "torch"


def _resolve_preset(preset: Any) -> Preset | None:
    if preset is None or isinstance(preset, Preset):
        return preset
    if isinstance(preset, str) and preset in PRESETS:
        return PRESETS.get(preset)
    raise InputError(
        "preset",
        f"None, a Preset or a registered preset name ({', '.join(PRESETS.names())})",
        describe(preset),
        "pass e.g. preset='dapo', or configure the stages with policy_loss's keywords (trust=, correction=, ...)",
    )


def fused_policy_loss(
    logits: Float[Tensor, "... V"],
    targets: Int[Tensor, "*N"],
    old_logp: Float[Tensor, "*N"] | None,
    advantages: PerSeqOrToken,
    mask: Shaped[Tensor, "*N"],
    *,
    preset: str | Preset | None = None,
    temperature: float = 1.0,
    backend: str = "auto",
    inplace: bool = True,
    experimental: bool = False,
    **kwargs: Any,
) -> FusedLossOutput:
    r"""Policy loss from the logits: log-softmax, log-prob and entropy fused, then :func:`policy_loss`.

    Equals ``policy_loss(logp, old_logp, advantages, mask, entropy=H, **kwargs)`` (or the preset's) with

    .. math::
        \ell^\theta_{i,t} = \log\operatorname{softmax}(x_{i,t} / \tau)_{y_{i,t}}, \qquad
        H_{i,t} = -\textstyle\sum_v p_v \log p_v, \quad p = \operatorname{softmax}(x_{i,t} / \tau),

    and :math:`\mathcal L = \operatorname{agg}\big(w\,L^{trust}(r, A) + \beta\,\widehat{KL} - c_H H\big)` as
    composed by :func:`~rolloutopt.losses.policy_loss` from the preset's or the given stages. The log-probs and
    entropies come from :func:`rolloutopt.kernels.logits_logprobs` (one read of the logits forward, one read and
    one write backward, ``dlogits`` in place by default; never an ``[N, V]`` log-softmax); the objective runs in
    torch autograd on ``[B, T]``, so **every registered preset works** (``rolloutopt.losses.names()``), sequence
    and batch-level ones included — there is no list of "fused" presets. References: PPO arXiv 1707.06347, GRPO
    arXiv 2402.03300, DAPO arXiv 2503.14476 (the presets cite their own); the logits-level kernel follows
    Liger-Kernel's Triton ``grpo_loss`` (``docs/methods/kernels.md``).

    The entropy is passed to ``policy_loss`` only when the configuration consumes it (``entropy_coef != 0``);
    the ``entropy`` metric is always reported (the masked mean of the kernel's entropy).

    **In place (default).** The backward writes the gradient into the logits' storage: after ``backward()`` do
    not use the logits again (see :func:`~rolloutopt.kernels.logits_logprobs`; ``inplace=False`` allocates).

    Args:
        logits: ``[B, T, V]``, ``[B, T + 1, V]`` (the extra last position is skipped, zero gradient) or ``[N, V]``
            (bf16, fp16, fp32; fp64 on the torch backend), unit stride along V.
        targets: sampled token ids ``[B, T]`` (or ``[N]`` with ``[N, V]`` logits: one sequence of N tokens), in
            ``[0, V)`` at masked-in positions; masked-out positions may hold anything (e.g. -100).
        old_logp: proximal log-probs ``[B, T]``, or None for on-policy.
        advantages: ``[B]`` or ``[B, T]`` (``[N]`` per token in the 1-D layout).
        mask: loss mask ``[B, T]`` (bool or 0/1); masked-out rows of the logits are not read by the Triton
            kernel and get a zero gradient.
        preset: a registered preset name (any of ``rolloutopt.losses.names()``), a
            :class:`~rolloutopt.losses.Preset`, or None (``policy_loss``'s defaults, GRPO's).
        temperature: sampling temperature :math:`\tau > 0` dividing the logits.
        backend: the kernel's backend, ``"auto"`` (Triton for CUDA tensors when importable, else torch),
            ``"torch"`` or ``"triton"``.
        inplace: write ``dlogits`` into the logits' storage.
        experimental: acknowledge an experimental preset (``Preset.experimental``); only with ``preset``.
        **kwargs: keywords of :func:`~rolloutopt.losses.policy_loss` (stages ``ratio``, ``trust``,
            ``correction``, ``proximal``, ``kl``, ``entropy_coef``, ``agg``, ...; inputs ``behav_logp``,
            ``ref_logp``, ``is_weights``, ``versions``, ``topk_logp``, ``confidence``, ``group``, ``max_len``,
            ``seq_weight``, ``denominators``, ``stage_inputs``, ``allow_unused``), overriding the preset's.
            In the ``[N]`` layout the per-token ones (``behav_logp``, ``ref_logp``, ``is_weights``, ``versions``,
            ``topk_logp``, ``topk_behav_logp``) are given as ``[N]`` (``[N, K]``) too. Everything except the
            logits is a constant: the gradient reaches only the logits.

    Returns:
        :class:`FusedLossOutput`: ``loss``, ``per_token`` and ``metrics`` exactly as ``policy_loss`` (plus the
        ``entropy`` metric), and the per-token ``logp`` and ``entropy`` (differentiable) shaped like ``targets``.

    Raises:
        InputError: everything :func:`~rolloutopt.kernels.logits_logprobs` and ``policy_loss`` raise (bad
            logits, targets outside ``[0, V)`` at masked-in positions, a masked-in row of NaN or all ``-inf``
            logits, missing or unused inputs, ...); an unknown preset or keyword; ``entropy=`` (the entropy is
            computed from the logits); ``experimental`` without a preset.

    Edge cases: all-masked rows give 0 (log-prob, entropy, loss, gradient); an all-masked batch gives loss 0;
    ``-inf`` logits (vocabulary masking) have probability 0.
    """
    p = _resolve_preset(preset)
    unknown = sorted(set(kwargs) - _POLICY_KEYWORDS)
    if unknown:
        raise InputError(
            unknown[0],
            "a keyword of rolloutopt.losses.policy_loss",
            f"{unknown[0]}=...",
            "check the spelling; fused_policy_loss takes policy_loss's keywords plus preset, temperature, backend, "
            "inplace and experimental",
        )
    if "entropy" in kwargs:
        raise InputError(
            "entropy", "no entropy= (fused_policy_loss computes it from the logits)", "entropy=...", "drop entropy="
        )
    if not isinstance(experimental, bool):
        raise InputError("experimental", "a bool", describe(experimental), "pass experimental=True or False")
    if experimental and p is None:
        raise InputError(
            "experimental", "experimental=True only together with an experimental preset", "preset=None",
            "drop experimental=True, or pass the preset",
        )  # fmt: skip
    # rolloutopt.kernels is imported on first use (``import rolloutopt`` leaves it out)
    from rolloutopt.kernels.logits_logprobs import logits_logprobs, resolve_logits_backend

    be = resolve_logits_backend(backend, logits) if isinstance(logits, Tensor) else backend
    logp, ent = logits_logprobs(logits, targets, temperature=temperature, mask=mask, inplace=inplace, backend=be)

    flat = logits.ndim == 2 and targets.ndim == 1
    n = int(targets.shape[0]) if flat else -1

    def tok(value: Any) -> Any:
        if flat and isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] == n:
            return value.unsqueeze(0)
        return value

    kw = {k: (tok(v) if k in _PER_TOKEN else v) for k, v in kwargs.items()}
    if "entropy_coef" in kw:
        coef = kw["entropy_coef"]
    else:
        coef = (p.config if p is not None else {}).get("entropy_coef", _POLICY_PARAMS["entropy_coef"].default)
    lp, h, m = tok(logp), tok(ent), tok(mask)
    if not (type(coef) in (int, float) and coef == 0):  # consumed; a bad coefficient raises in policy_loss
        kw["entropy"] = h
    if p is None:
        out = policy_loss(lp, tok(old_logp), tok(advantages), m, **kw)
    else:
        out = p(lp, tok(old_logp), tok(advantages), m, experimental=experimental, **kw)
    metrics = dict(out.metrics)
    if "entropy" not in metrics:
        dtype = out.loss.dtype
        mb = m if m.dtype == torch.bool else m != 0
        count = mb.sum().clamp(min=1).to(dtype)
        metrics["entropy"] = masked_mean(h.detach().to(dtype), as_weights(mb, dtype), count)
    per_token = out.per_token.view(-1) if flat else out.per_token
    return FusedLossOutput(loss=out.loss, per_token=per_token, metrics=metrics, logp=logp, entropy=ent, backend=be)
