"""Shape aliases of the tensor convention (see ``docs/guide.md``, "Tensor convention").

Dimensions: ``B`` rollouts (sequences), ``T`` the padded response length, ``K`` reward components, ``G`` groups
(prompts of one batch), ``P`` prompts handed to an allocator, ``topk`` the top-K log-probs kept per position,
``N`` flattened token rows, ``V`` the vocabulary and ``d`` the hidden size. A name is bound across the arguments
of one call: two ``FloatBT`` arguments of one function must have the same ``[B, T]``. ``#T`` means ``T`` or 1
(broadcast), ``*T`` zero or more trailing dimensions.

The aliases are jaxtyping annotations. They document shapes and dtype kinds in every public signature; the
test suite runs the package under jaxtyping's runtime checker so that a signature cannot lie, but the library
does not depend on a runtime checker: its own validation at the public boundary is the error users see.
``Float`` is any floating dtype (bf16, fp16, fp32, fp64), ``Shaped`` any dtype (a mask may be bool or 0/1
numbers, a reward bool, int or float: the function converts it), ``Integer`` any integer dtype, signed or
unsigned (ids are converted to int64).
"""

from __future__ import annotations

from typing import TypeAlias

from jaxtyping import Float, Integer, Shaped
from torch import Tensor

__all__ = [
    "BoolB",
    "BoolBT",
    "FloatAny",
    "FloatB",
    "FloatBK",
    "FloatBT",
    "FloatBTK",
    "FloatBTb",
    "FloatG",
    "FloatP",
    "IntB",
    "IntBT",
    "IntP",
    "NumB",
    "PerSeqOrToken",
    "Scalar",
]

FloatBT: TypeAlias = Float[Tensor, "B T"]
"""Per-token floating tensor ``[B, T]`` (log-probs, per-token losses, per-token advantages)."""
FloatBTb: TypeAlias = Float[Tensor, "B #T"]
"""Per-token floating tensor ``[B, T]`` or its per-sequence column ``[B, 1]`` (advantages inside a stage)."""
BoolBT: TypeAlias = Shaped[Tensor, "B T"]
"""Per-token mask ``[B, T]``: bool, or 0/1 floats/ints that are converted to bool."""
IntBT: TypeAlias = Integer[Tensor, "B T"]
"""Per-token integer tensor ``[B, T]`` (token ids)."""
FloatBTK: TypeAlias = Float[Tensor, "B T topk"]
"""Top-K log-probs per position ``[B, T, topk]``."""
FloatB: TypeAlias = Float[Tensor, " B"]
"""Per-sequence floating tensor ``[B]`` (sequence advantages, weights, log-likelihoods)."""
NumB: TypeAlias = Shaped[Tensor, " B"]
"""Per-sequence numbers ``[B]`` of any dtype (rewards, lengths, counts: bool, int or float, converted)."""
BoolB: TypeAlias = Shaped[Tensor, " B"]
"""Per-sequence flags ``[B]``: bool, or 0/1 numbers that are converted to bool."""
FloatBK: TypeAlias = Float[Tensor, "B K"]
"""Multi-component rewards ``[B, K]``."""
FloatG: TypeAlias = Float[Tensor, " G"]
"""Per-group statistic ``[G]``, ordered as :attr:`rolloutopt.groups.Groups.unique_ids`."""
IntB: TypeAlias = Integer[Tensor, " B"]
"""Group ids ``[B]`` (int64, any values, any order)."""
IntP: TypeAlias = Integer[Tensor, " P"]
"""Prompt ids or per-prompt counts ``[P]`` (allocators)."""
FloatP: TypeAlias = Float[Tensor, " P"]
"""Per-prompt floating statistic ``[P]`` (allocators)."""
PerSeqOrToken: TypeAlias = Float[Tensor, "B *T"]
"""Advantages either per sequence ``[B]`` or per token ``[B, T]``."""
FloatAny: TypeAlias = Float[Tensor, "..."]
"""A floating tensor of any shape (element-wise functions)."""
Scalar: TypeAlias = Float[Tensor, ""]
"""A 0-d tensor."""
