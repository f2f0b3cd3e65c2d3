"""Advantage estimators: rewards (and group ids) → advantages.

Every estimator is a pure function ``f(rewards, group, ..., *, hyper-parameters)`` on ragged groups returning
an :class:`AdvantageOutput` (or a subclass with extra fields); reward shapers (``fapo_penalty``,
``truncation_penalty``, ``dare_rewards``) return shaped rewards to feed to an estimator. All are registered by
name: ``rolloutopt.advantages.get("grpo")`` returns the function and
``rolloutopt.advantages.names()`` lists the registered names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.confidence import ace, xrpo_sharpen
from rolloutopt.advantages.median import gapo, mc_grpo
from rolloutopt.advantages.multi_reward import gd2po, gdpo
from rolloutopt.advantages.prior import DAREOutput, V05Output, dare_rewards, v05
from rolloutopt.advantages.reference import dr_grpo, grpo, reinforce_pp_baseline, rloo, to_tokens
from rolloutopt.advantages.selection import D3SOutput, TokenSubsample, d3s, d3s_schedule, latent_mask, nat_weights
from rolloutopt.advantages.shaping import (
    ShapedRewards,
    dler_normalise,
    drpo,
    drpo_trust_penalty,
    fapo_penalty,
    truncation_penalty,
)

__all__ = [
    "REGISTRY",
    "AdvantageOutput",
    "D3SOutput",
    "DAREOutput",
    "ShapedRewards",
    "TokenSubsample",
    "V05Output",
    "ace",
    "d3s",
    "d3s_schedule",
    "dare_rewards",
    "dler_normalise",
    "dr_grpo",
    "drpo",
    "drpo_trust_penalty",
    "fapo_penalty",
    "gapo",
    "gd2po",
    "gdpo",
    "get",
    "grpo",
    "latent_mask",
    "mc_grpo",
    "names",
    "nat_weights",
    "register",
    "reinforce_pp_baseline",
    "rloo",
    "to_tokens",
    "truncation_penalty",
    "v05",
    "xrpo_sharpen",
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
