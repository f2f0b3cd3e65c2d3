"""Advantage estimators: rewards (and group ids) → advantages.

Every estimator is a pure function ``f(rewards, group, ..., *, hyper-parameters) -> AdvantageOutput`` on
ragged groups, registered by name: ``rolloutopt.advantages.get("grpo")`` returns the function and
``rolloutopt.advantages.names()`` lists the registered names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.reference import dr_grpo, grpo, reinforce_pp_baseline, rloo, to_tokens

__all__ = [
    "REGISTRY",
    "AdvantageOutput",
    "dr_grpo",
    "get",
    "grpo",
    "names",
    "register",
    "reinforce_pp_baseline",
    "rloo",
    "to_tokens",
]


def get(name: str) -> Callable[..., Any]:
    """The advantage estimator registered as ``name`` (an :class:`~rolloutopt.errors.InputError` lists the names)."""
    return REGISTRY.get(name)


def names() -> list[str]:
    """Names of every registered advantage estimator."""
    return REGISTRY.names()


def register(name: str, fn: Callable[..., Any], *, overwrite: bool = False) -> Callable[..., Any]:
    """Register an estimator under ``name``; a different function under a taken name raises unless ``overwrite``."""
    return REGISTRY.register(name, fn, overwrite=overwrite)
