"""The result type shared by every advantage estimator, and the estimator registry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from rolloutopt.registry import Registry

__all__ = ["REGISTRY", "AdvantageOutput"]


@dataclass(frozen=True)
class AdvantageOutput:
    """What an advantage estimator returns.

    Attributes:
        advantages: per-sequence advantages ``[B]`` (broadcast with :func:`rolloutopt.advantages.to_tokens`),
            or per-token advantages ``[B, T]`` for estimators that produce them; fp32 (fp64 for fp64 input).
        weight: per-sequence loss weight ``[B]``: 1 for a rollout that carries gradient, 0 for one the
            estimator excludes (an invalid row, a pivot). Pass it to ``policy_loss(..., seq_weight=...)``, or
            multiply it into the mask, so that nothing is silently dropped.
        metrics: detached 0-d tensors describing the batch (fractions of zero-variance and singleton groups,
            reward mean and std); no host synchronisation.
    """

    advantages: Tensor
    weight: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


REGISTRY: Registry[Callable[..., Any]] = Registry("advantage estimator")
