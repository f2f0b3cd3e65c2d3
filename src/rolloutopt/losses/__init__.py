"""The policy objective: :func:`policy_loss`, aggregation, regularisers, and named presets.

``rolloutopt.losses.get("dapo")`` returns a :class:`Preset`, a callable with :func:`policy_loss`'s signature
and the preset's configuration bound (keywords still override); ``rolloutopt.losses.entry("dapo")`` its
:class:`~rolloutopt.registry.Entry` (``requires``, ``accepts``, ``reference``, ``experimental``, derived from the
stages); ``rolloutopt.losses.names()`` lists them.
"""

from __future__ import annotations

from rolloutopt.losses.aggregation import AGG_MODES, AggMode, Denominators, aggregate
from rolloutopt.losses.fused import FusedLossOutput, fused_policy_loss
from rolloutopt.losses.policy import (
    ALWAYS_ACCEPTED,
    OPTIONAL_INPUTS,
    Correction,
    CorrectionOutput,
    LossOutput,
    declared_inputs,
    policy_loss,
)
from rolloutopt.losses.presets import PRESETS, Preset
from rolloutopt.losses.regularizers import KL, kl_penalty
from rolloutopt.registry import Entry

__all__ = [
    "AGG_MODES",
    "ALWAYS_ACCEPTED",
    "KL",
    "OPTIONAL_INPUTS",
    "PRESETS",
    "AggMode",
    "Correction",
    "CorrectionOutput",
    "Denominators",
    "FusedLossOutput",
    "LossOutput",
    "Preset",
    "aggregate",
    "declared_inputs",
    "entry",
    "fused_policy_loss",
    "get",
    "kl_penalty",
    "names",
    "policy_loss",
    "register",
]


def get(name: str) -> Preset:
    """The loss preset registered as ``name`` (an :class:`~rolloutopt.errors.InputError` lists the names)."""
    return PRESETS.get(name)


def entry(name: str) -> Entry[Preset]:
    """The registry entry of the preset ``name``: the preset and its derived ``requires`` and ``accepts``."""
    return PRESETS.entry(name)


def names() -> list[str]:
    """Names of every registered loss preset."""
    return PRESETS.names()


def register(name: str, preset: Preset, *, overwrite: bool = False) -> Preset:
    """Register a preset under ``name``; a different preset under a taken name raises unless ``overwrite``."""
    return PRESETS.register(name, preset, overwrite=overwrite)
