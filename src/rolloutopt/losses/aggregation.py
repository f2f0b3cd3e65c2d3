"""Loss aggregation: per-token losses ``[B, T]`` → a scalar, with explicit global denominators.

Modes (verl names; verl ``agg_loss``, ``docs/conventions.md``):

=========================  ==================================================================================
``token-mean``             Σ m ℓ / N_tokens                                             (verl default, DAPO)
``token-sum``              Σ m ℓ
``seq-mean-token-mean``    Σ_i (Σ_t m ℓ / L_i) / N_seqs                               (GRPO paper, GSPO, SAPO)
``seq-mean-token-sum``     Σ_i Σ_t m ℓ / N_seqs
``seq-mean-token-sum-norm`` Σ m ℓ / (N_seqs · L_max), L_max a constant                 (Dr.GRPO)
``prompt-mean``            Σ_g (Σ_{i∈g,t} m ℓ / Σ_{i∈g,t} m) / N_groups                  (SkyRL ``prompt_mean``)
=========================  ==================================================================================

``N_*`` default to the local counts: tokens in the mask, sequences with at least one token, groups with at
least one token (verl excludes empty rows from its sequence denominators). On a data-parallel rank, pass the
global counts in :class:`Denominators` (see :func:`rolloutopt.distributed.global_denominators`) so that the
per-rank losses sum to the loss of the whole batch; ``world_size`` then multiplies the result so that DDP's
gradient averaging gives that sum (verl's ``dp_size`` factor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from jaxtyping import Bool, Real
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, choice
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolBT, FloatBT, IntB, Scalar

__all__ = ["AGG_MODES", "AggMode", "Denominators", "aggregate", "aggregate_checked", "check_max_len"]

AggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "prompt-mean"
]
AGG_MODES: tuple[str, ...] = get_args(AggMode)


@dataclass(frozen=True)
class Denominators:
    """Global denominators of one optimizer step; ``None`` fields fall back to the local counts.

    Attributes:
        tokens: loss tokens in the global batch (``token-mean``).
        sequences: sequences with at least one loss token (``seq-mean-*``).
        groups: prompts with at least one loss token (``prompt-mean``).
        world_size: multiplies the result, so that averaging gradients over data-parallel ranks gives the
            gradient of the global loss (1 for a single process).
    """

    tokens: float | Real[Tensor, ""] | None = None
    sequences: float | Real[Tensor, ""] | None = None
    groups: float | Real[Tensor, ""] | None = None
    world_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise InputError(
                "Denominators.world_size", "an int >= 1", repr(self.world_size), "pass the data-parallel size"
            )


def _denom(given: float | Tensor | None, local: Tensor) -> Tensor:
    value = local if given is None else torch.as_tensor(given, dtype=local.dtype, device=local.device)
    return value.clamp(min=1)


def aggregate(
    per_token: FloatBT,
    mask: BoolBT,
    mode: AggMode = "token-mean",
    *,
    denominators: Denominators | None = None,
    group: Groups | IntB | None = None,
    max_len: int | None = None,
    denominator_mask: BoolBT | None = None,
) -> Scalar:
    """Aggregate per-token losses ``[B, T]`` over ``mask`` into a scalar (formulas in the module docstring).

    Args:
        per_token: per-token loss ``[B, T]``.
        mask: tokens that enter the numerator ``[B, T]``.
        mode: one of :data:`AGG_MODES`.
        denominators: global counts; ``None`` uses the local ones.
        group: group ids ``[B]`` or :class:`Groups`, required by ``prompt-mean``.
        max_len: Dr.GRPO's constant ``L_max`` (the configured maximum response length), required by
            ``seq-mean-token-sum-norm``; it must not be the padded width, which changes from batch to batch.
        denominator_mask: tokens that count in the local denominators (default ``mask``). A token removed
            by a trust-region mask can stay in the denominator (AReaL, TRL) by passing the original mask here.

    Edge cases: a batch with no token gives 0 (denominators are clamped to at least 1); a sequence with no
    token is left out of the sequence count; per-sequence token means divide by ``max(L_i, 1)``.
    """
    choice(mode, "mode", AGG_MODES)
    dims = Dims()
    x = as_float(per_token, "per_token", dims, "B T")
    m = as_mask(mask, "mask", dims, "B T", device=x.device)
    dm = m if denominator_mask is None else as_mask(denominator_mask, "denominator_mask", dims, "B T", device=x.device)
    g = None
    if mode == "prompt-mean":
        if group is None:
            raise InputError("group", "group ids for mode='prompt-mean'", "None", "pass group=... (one id per rollout)")
        g = as_groups(group, dims)
    if mode == "seq-mean-token-sum-norm":
        check_max_len(max_len)
    return aggregate_checked(torch.where(m, x, torch.zeros_like(x)), dm, mode, denominators, g, max_len)


def check_max_len(max_len: object) -> int:
    """Return Dr.GRPO's constant ``L_max`` if it is an int >= 1; an :class:`InputError` naming ``max_len`` otherwise."""
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise InputError(
            "max_len",
            "the configured maximum response length (an int >= 1) for agg='seq-mean-token-sum-norm'",
            repr(max_len),
            "pass max_len=<max new tokens of the rollout engine>; the padded width is not constant",
        )
    return max_len


def aggregate_checked(
    masked: FloatBT,
    denominator_mask: Bool[Tensor, "B T"],
    mode: str,
    denominators: Denominators | None,
    groups: Groups | None,
    max_len: int | None,
) -> Scalar:
    """:func:`aggregate` on inputs its caller already validated: ``masked`` is the per-token loss with 0 outside
    the numerator's mask, ``denominator_mask`` a bool ``[B, T]``, ``groups`` a :class:`Groups` for
    ``prompt-mean`` and ``max_len`` an int for ``seq-mean-token-sum-norm``. No checks, no host sync."""
    d = denominators or Denominators()
    dm = denominator_mask
    if mode == "token-mean":
        out = masked.sum() / _denom(d.tokens, dm.sum().to(masked.dtype))
    elif mode == "token-sum":
        out = masked.sum()
    elif mode == "prompt-mean":
        assert groups is not None
        tok = groups.sum(masked.sum(-1))
        cnt = groups.sum(dm.sum(-1).to(masked.dtype))
        per_group = tok / cnt.clamp(min=1)
        out = per_group.sum() / _denom(d.groups, (cnt > 0).sum().to(masked.dtype))
    else:
        lengths = dm.sum(-1).to(masked.dtype)
        seq_sum = masked.sum(-1)
        n_seq = _denom(d.sequences, (lengths > 0).sum().to(masked.dtype))
        if mode == "seq-mean-token-mean":
            out = (seq_sum / lengths.clamp(min=1)).sum() / n_seq
        elif mode == "seq-mean-token-sum":
            out = seq_sum.sum() / n_seq
        else:
            assert max_len is not None
            out = seq_sum.sum() / (n_seq * max_len)
    return out * d.world_size
