"""The result type shared by every advantage estimator, and the registries of estimators, shapers and selectors."""

from __future__ import annotations

from collections.abc import Callable  # noqa: F401 - resolves the annotations of Estimator's generated __init__
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from rolloutopt.errors import InputError
from rolloutopt.registry import Method, MethodRegistry
from rolloutopt.typing import FloatB, PerSeqOrToken

__all__ = ["REGISTRY", "SELECTORS", "SHAPERS", "AdvantageOutput", "Estimator", "ShapedRewards"]


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

    advantages: PerSeqOrToken
    weight: FloatB
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class ShapedRewards:
    """What a reward-shaping function returns.

    Attributes:
        rewards: the shaped per-sequence rewards ``[B]`` (fp32; fp64 for fp64 input), to be passed to an
            advantage estimator.
        metrics: detached 0-d tensors (fraction of rollouts the shaping changed, mean shaped reward).
    """

    rewards: FloatB
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimator(Method):
    """A registered advantage estimator: ``est(rewards, group, **inputs) -> AdvantageOutput``.

    What :func:`rolloutopt.advantages.get` returns: a :class:`~rolloutopt.registry.Method` (the inputs are
    checked against ``requires`` and ``accepts``, hyper-parameters pass through, ``experimental=True`` is
    required where ``experimental`` gives a reason) whose function maps rewards and groups to an
    :class:`AdvantageOutput`. ``est.fn`` is the plain function.

    Attributes:
        reward_dims: ``"B"`` for one reward per rollout ``[B]``, ``"B K"`` for estimators of ``K`` reward
            components per rollout ``[B, K]`` (``gdpo``, ``gd2po``).
    """

    reward_dims: Literal["B", "B K"] = "B"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reward_dims not in ("B", "B K"):
            raise InputError(
                "reward_dims",
                '"B" (one reward per rollout) or "B K" (K reward components)',
                repr(self.reward_dims),
                f'declare reward_dims="B" or "B K" for the estimator {self.name!r}',
            )

    def __call__(self, *args: Any, **kwargs: Any) -> AdvantageOutput:
        """Check the inputs against the declarations, then return ``fn(rewards, group, ...)``."""
        out = super().__call__(*args, **kwargs)
        if not isinstance(out, AdvantageOutput):
            raise InputError(
                "fn",
                f"an advantage estimator returning AdvantageOutput (the {self.name!r} estimator)",
                type(out).__name__,
                "register a function that returns an AdvantageOutput (reward shapers and selectors have their own "
                "registries: rolloutopt.advantages.SHAPERS, rolloutopt.advantages.SELECTORS)",
            )
        return out


REGISTRY: MethodRegistry[Estimator] = MethodRegistry(
    "advantage estimator", Estimator, common=("rewards", "group"), result=AdvantageOutput
)
"""Advantage estimators only: every entry is called as ``get(name)(rewards, group, **inputs)``."""

SHAPERS: MethodRegistry[Method] = MethodRegistry("reward shaper", Method)
"""Reward shapers: functions that return shaped rewards (``.rewards [B]``) to feed an estimator."""

SELECTORS: MethodRegistry[Method] = MethodRegistry("selector", Method)
"""Token and sample selectors: functions that return loss weights or masks."""

_FAMILIES: tuple[MethodRegistry[Any], ...] = (REGISTRY, SHAPERS, SELECTORS)
for _reg in _FAMILIES:
    _reg.related = [r for r in _FAMILIES if r is not _reg]
