"""rolloutopt: policy-optimisation methods for reinforcement learning of language models.

Pure torch functions on one tensor convention (``[B, T]`` per-token tensors, ``[B]`` per-sequence tensors,
int64 group ids), composed into policy losses; see ``DESIGN.md`` and the documentation site.
"""

from __future__ import annotations

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

__version__ = "0.1.0"
