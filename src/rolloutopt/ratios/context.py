"""The inputs every stage of :func:`rolloutopt.losses.policy_loss` may read, validated once.

Stages (ratio constructions, proximal-policy approximations, trust regions, off-policy corrections) that need
more than the ratio and the advantages read them from a :class:`StageContext`. Inputs beyond the common ones
(per-token policy versions, top-K log-probs, per-sequence confidence) are optional in ``policy_loss``; a stage
that needs one calls :meth:`StageContext.need`, which raises an :class:`~rolloutopt.errors.InputError` naming
the missing argument and the stage that needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatBT, FloatBTb, FloatBTK, IntBT, Scalar

__all__ = [
    "CorrectionOutput",
    "MaskOutput",
    "StageContext",
    "as_weights",
    "masked_max",
    "masked_mean",
    "masked_quantiles",
]

_OPTIONAL = {
    "behav_logp": "the rollout engine's log-probs of the sampled tokens [B, T]",
    "versions": "the policy version that generated each token, int64 [B, T]",
    "policy_version": "the version of the policy being trained (an int)",
    "topk_logp": "the current policy's log-probs at the reference top-K token ids [B, T, K]",
    "topk_behav_logp": "the rollout engine's top-K log-probs [B, T, K]",
    "confidence": "a per-sequence confidence in [0, 1], float [B]",
    "old_logp": "the proximal policy's log-probs [B, T]",
}


@dataclass(frozen=True)
class StageContext:
    """Validated inputs of one :func:`~rolloutopt.losses.policy_loss` call (fp32, or fp64 when given fp64).

    Attributes:
        logp: current log-probs ``[B, T]``, 0 outside ``mask``, carrying the gradient.
        old_logp: proximal log-probs ``[B, T]`` (after the ``proximal`` stage, when one is set).
        mask: bool loss mask ``[B, T]``.
        advantages: ``[B, 1]`` (per sequence) or ``[B, T]``.
        behav_logp: rollout-engine log-probs ``[B, T]`` or None.
        versions: policy version that generated each token, int64 ``[B, T]``, or None.
        policy_version: version of the policy being trained, or None.
        topk_logp: current log-probs at the rollout engine's top-K ids ``[B, T, K]`` or None.
        topk_behav_logp: the rollout engine's top-K log-probs ``[B, T, K]`` or None.
        confidence: per-sequence confidence ``[B]`` or None.
        extra: anything else a custom stage wants passed through (``policy_loss(..., stage_inputs=...)``).
    """

    logp: FloatBT
    old_logp: FloatBT | None
    mask: Bool[Tensor, "B T"]
    advantages: FloatBTb
    behav_logp: FloatBT | None = None
    versions: IntBT | None = None
    policy_version: int | None = None
    topk_logp: FloatBTK | None = None
    topk_behav_logp: FloatBTK | None = None
    confidence: FloatB | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def need(self, name: str, by: str) -> Any:
        """The input ``name``; an :class:`InputError` naming it and the stage ``by`` that needs it when missing."""
        value = getattr(self, name, None) if name in _OPTIONAL else self.extra.get(name)
        if value is None:
            what = _OPTIONAL.get(name, f"the stage input {name!r}")
            fix = (
                f"pass {name}=... to policy_loss (or the preset)"
                if name in _OPTIONAL
                else f"pass stage_inputs={{{name!r}: ...}} to policy_loss"
            )
            raise InputError(name, f"{what}, required by {by}", "None", fix)
        return value

    @property
    def count(self) -> Scalar:
        """Number of loss tokens, at least 1, in the logp dtype (a 0-d tensor, no host sync)."""
        return self.mask.sum().clamp(min=1).to(self.logp.dtype)


@dataclass(frozen=True)
class CorrectionOutput:
    """Per-token off-policy correction: a detached weight ``[B, T]`` (or ``[B, 1]``), an optional keep mask
    ``[B, T]`` and metrics (detached 0-d tensors)."""

    weight: FloatBTb
    keep: Bool[Tensor, "B T"] | None = None
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class MaskOutput:
    """What every mask function returns (M2PO's, DPPO's, OPSM's, the rejection filters'): a bool ``keep``
    (``[B, T]`` per token or ``[B]`` per sequence; True where a token or sequence stays in the loss) and
    detached 0-d metrics (masked fractions, the statistic before and after masking)."""

    keep: Bool[Tensor, " B *T"]
    metrics: dict[str, Tensor] = field(default_factory=dict)


def as_weights(mask: Shaped[Tensor, "*N"], dtype: torch.dtype) -> Shaped[Tensor, "*N"]:
    """A bool mask as 0/1 floats of ``dtype``, through a uint8 view (``bool.to(float)`` is ~8x slower on CPU)."""
    return (mask.view(torch.uint8) if mask.dtype == torch.bool else mask).to(dtype)


def masked_mean(x: Shaped[Tensor, "*N"], mask: Shaped[Tensor, "*N"], count: Scalar | None = None) -> Scalar:
    """Detached mean of ``x`` over the True positions of ``mask``; bool ``x`` counts as 0/1; 0 for an empty mask.

    A metric helper: non-finite values (e.g. garbage in padding) count as 0, so a metric is never NaN. It
    multiplies by a float mask rather than calling ``torch.where`` (an order of magnitude slower on CPU).
    """
    dtype = count.dtype if count is not None else (x.dtype if x.is_floating_point() else torch.float32)
    xv = as_weights(x, dtype) if x.dtype == torch.bool else x.detach().to(dtype).nan_to_num(0.0, 0.0, 0.0)
    n = mask.sum().clamp(min=1).to(dtype) if count is None else count
    return (xv * as_weights(mask, dtype)).sum() / n


def masked_max(x: Float[Tensor, "*N"], mask: Shaped[Tensor, "*N"]) -> Scalar:
    """Detached max of a non-negative ``x`` over ``mask`` (0 when empty; non-finite values count as 0)."""
    xv = x.detach().nan_to_num(0.0, 0.0, 0.0)
    return (xv * as_weights(mask, xv.dtype)).amax() if xv.numel() else xv.sum()


def masked_quantiles(
    x: Float[Tensor, "*N"], mask: Bool[Tensor, "*N"], qs: tuple[float, ...], *, max_samples: int | None = 16_384
) -> list[Scalar]:
    """Detached quantiles of ``x`` over ``mask`` (lower order statistic, like ``torch.quantile(interpolation="lower")``).

    One sort of the flattened tensor, masked-out values sent to +inf; indices are tensors, so there is no host
    synchronisation and no size limit (``torch.quantile`` refuses more than 2^24 elements). 0 for an empty mask.
    A metric should not cost more than the loss: with more than ``max_samples`` positions, the quantiles are
    those of an evenly strided sample of at most ``max_samples`` positions (a fixed stride chosen from the shape
    alone, so still no host sync); ``max_samples=None`` uses every position. When every requested quantile is
    at least 0.5, a top-k of static size replaces the sort (SAT's 95% tail threshold over a whole batch).
    """
    flat_x, flat_m = x.detach().flatten(), mask.flatten()
    if max_samples is not None and flat_x.numel() > max_samples:
        stride = -(-flat_x.numel() // max_samples)
        flat_x, flat_m = flat_x[::stride], flat_m[::stride]
    if flat_x.numel() == 0:
        return [flat_x.sum() for _ in qs]
    n = flat_m.sum()
    ranks = [(q * (n - 1).clamp(min=0).to(torch.float64)).floor().long().clamp(min=0) for q in qs]
    if qs and min(qs) >= 0.5:
        # Upper quantiles (e.g. a 95% tail threshold): only the top ceil((1 - q)(N - 1)) + 1 values can hold the
        # order statistic, whatever the mask, so a top-k of that static size replaces the full sort.
        k = min(flat_x.numel(), math.ceil((1 - min(qs)) * (flat_x.numel() - 1)) + 1)
        top = torch.where(flat_m, flat_x, torch.full_like(flat_x, -torch.inf)).topk(k).values  # descending
        picks = [top.gather(0, ((n - 1) - r).clamp(0, k - 1).reshape(1)).reshape(()) for r in ranks]
    else:
        ordered = torch.where(flat_m, flat_x, torch.full_like(flat_x, torch.inf)).sort().values
        picks = [ordered.gather(0, r.reshape(1)).reshape(()) for r in ranks]
    return [torch.where(n > 0, v, torch.zeros_like(v)) for v in picks]
