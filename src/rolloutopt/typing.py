"""Shape aliases of the tensor convention (see ``docs/guide.md``, "Tensor convention").

``B`` is the number of rollouts (sequences), ``T`` the padded response length, ``K`` the number of reward
components and ``G`` the number of groups (prompts). The aliases are jaxtyping annotations; they document
shapes in every public signature and are checked by the library's own validation, not by a runtime
type-checker.
"""

from __future__ import annotations

from typing import TypeAlias

from jaxtyping import Float, Int, Shaped
from torch import Tensor

__all__ = [
    "BoolBT",
    "FloatB",
    "FloatBK",
    "FloatBT",
    "FloatG",
    "IntB",
    "PerSeqOrToken",
    "Scalar",
]

FloatBT: TypeAlias = Float[Tensor, "B T"]
"""Per-token floating tensor ``[B, T]`` (log-probs, per-token losses, per-token advantages)."""
BoolBT: TypeAlias = Shaped[Tensor, "B T"]
"""Per-token mask ``[B, T]``: bool, or 0/1 floats/ints that are converted to bool."""
FloatB: TypeAlias = Float[Tensor, " B"]
"""Per-sequence floating tensor ``[B]`` (rewards, sequence advantages, weights)."""
FloatBK: TypeAlias = Float[Tensor, "B K"]
"""Multi-component rewards ``[B, K]``."""
FloatG: TypeAlias = Float[Tensor, " G"]
"""Per-group statistic ``[G]``, ordered as :attr:`rolloutopt.groups.Groups.unique_ids`."""
IntB: TypeAlias = Int[Tensor, " B"]
"""Group ids ``[B]`` (int64, any values, any order)."""
PerSeqOrToken: TypeAlias = Float[Tensor, "B *T"]
"""Advantages either per sequence ``[B]`` or per token ``[B, T]``."""
Scalar: TypeAlias = Float[Tensor, ""]
"""A 0-d tensor."""
