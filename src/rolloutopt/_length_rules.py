"""The frame every post-hoc length rule shares: :class:`TruncationOutput` and the row helpers.

A post-hoc rule (:mod:`rolloutopt.control` — DOT, JET, soft compression; DLER in
:mod:`rolloutopt.advantages.dler`) is a pure function over finished rollouts (rewards ``[B]``, lengths ``[B]``, a
loss mask ``[B, T]``, group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`) that returns a
:class:`TruncationOutput`. The helpers here validate the lengths, build the right-padded prefix mask of
``lengths`` when no mask is given (width ``max(lengths)``, one host synchronisation), cut masks and report the
shared metrics. They sit below ``advantages`` and ``control`` so that both layers' length rules can use them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, checks_enabled, describe, finite, require_experimental
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, IntB

__all__ = ["TruncationOutput"]

_DOCS = "docs/methods/length_rules.md"


@dataclass(frozen=True)
class TruncationOutput:
    """What a post-hoc truncation or length rule produced.

    ``mask`` bool ``[B, T]`` (the new loss mask), ``rewards`` float ``[B]`` (the new rewards), ``lengths`` int64
    ``[B]`` (the new response lengths), ``truncated`` bool ``[B]`` (rows the rule changed), ``metrics``: detached
    0-d tensors. Nothing is dropped silently: a changed row has ``truncated`` True and shows in the metrics.
    """

    mask: BoolBT
    rewards: FloatB
    lengths: IntB
    truncated: BoolB
    metrics: dict[str, Tensor] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ helpers


def _experimental(flag: Any, what: str, where: str) -> None:
    require_experimental(flag, what, where)


def _lengths(lengths: Any, dims: Dims, device: torch.device | None = None) -> Tensor:
    """Validate response lengths ``[B]`` (int or float, finite, >= 0); return them as float64."""
    if checks_enabled():
        if not isinstance(lengths, Tensor) or lengths.dtype == torch.bool or lengths.is_complex():
            raise InputError(
                "lengths", "an int or float tensor [B] of response lengths", describe(lengths), "pass mask.sum(-1)"
            )
        dims.check(lengths, "lengths", "B")
        if device is not None and lengths.device != device:
            raise InputError("lengths", f"a tensor on {device}", describe(lengths), f"move it to {device}")
        bad = lengths < 0
        if lengths.is_floating_point():
            bad = bad | ~torch.isfinite(lengths)
        if bool(bad.any()):
            raise InputError("lengths", "finite, non-negative lengths", describe(lengths), "pass token counts")
    out: Tensor = lengths.to(torch.float64)
    return out


def _mask(mask: Any, lengths: Tensor, dims: Dims) -> Tensor:
    """The given mask (validated ``[B, T]``) or the right-padded prefix mask of ``lengths``."""
    if mask is not None:
        return as_mask(mask, "mask", dims, "B T", device=lengths.device)
    width = int(lengths.max().ceil()) if lengths.numel() else 0
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def _cut(mask: Tensor, keep: Tensor, rows: Tensor) -> Tensor:
    """``mask`` with the positions ``t >= keep[i]`` of the ``rows`` removed."""
    t = torch.arange(mask.shape[1], device=mask.device)
    limit = torch.where(rows, keep, torch.full_like(keep, mask.shape[1]))
    return mask & (t[None, :] < limit[:, None])


def _frac(x: Tensor, over: Tensor | None = None) -> Tensor:
    """Fraction of True in ``x`` (among ``over``) as a detached 0-d float tensor; 0 for an empty set."""
    xf = x.float() if over is None else (x & over).float()
    n = torch.tensor(float(x.numel()), device=x.device) if over is None else over.float().sum()
    return (xf.sum() / n.clamp(min=1)).detach()


def _token_metrics(old: Tensor, new: Tensor) -> dict[str, Tensor]:
    removed = (old.sum() - new.sum()).float()
    return {
        "tokens_removed": removed.detach(),
        "tokens_removed_frac": (removed / old.sum().float().clamp(min=1)).detach(),
    }


def _rows(rewards: Any, lengths: Any, mask: Any) -> tuple[Tensor, Tensor, Tensor, Dims]:
    dims = Dims()
    r = as_float(rewards, "rewards", dims, "B")
    finite(r, "rewards")
    length = _lengths(lengths, dims, r.device)
    m = _mask(mask, length, dims)
    return r, length, m, dims


def _empty_output(r: Tensor, length: Tensor, m: Tensor, names: tuple[str, ...]) -> TruncationOutput:
    zero = torch.zeros((), device=r.device)
    return TruncationOutput(
        mask=m.clone(),
        rewards=r.clone(),
        lengths=length.floor().long(),
        truncated=torch.zeros_like(r, dtype=torch.bool),
        metrics=dict.fromkeys(names, zero),
    )


def _pass_rate(correct: Tensor, g: Groups) -> Tensor:
    """Fraction of correct rows per group ``[G]``."""
    return g.mean(correct.to(torch.float64))
