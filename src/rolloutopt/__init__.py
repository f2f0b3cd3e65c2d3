"""rolloutopt: policy-optimisation methods for reinforcement learning of language models.

Pure torch functions on one tensor convention (``[B, T]`` per-token tensors, ``[B]`` per-sequence tensors,
int64 group ids), composed into policy losses; see the documentation site (``docs/design.md``).

The objective side (``advantages``, ``groups``, ``losses``, ``ratios``) is imported eagerly; ``allocators``,
``control``, ``distributed``, ``kernels``, ``testbed``, ``arena`` and ``integrations`` are imported on first attribute
access (``rolloutopt.allocators``), so that ``import rolloutopt`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from rolloutopt import advantages, groups, losses, ratios
from rolloutopt._validation import checks, checks_enabled
from rolloutopt.errors import InputError, RolloutOptError
from rolloutopt.groups import Groups

__all__ = [
    "Groups",
    "InputError",
    "RolloutOptError",
    "advantages",
    "checks",
    "checks_enabled",
    "groups",
    "losses",
    "ratios",
]

_LAZY = ("allocators", "arena", "control", "distributed", "integrations", "kernels", "testbed")

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"rolloutopt.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'rolloutopt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
