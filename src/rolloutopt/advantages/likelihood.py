"""Sequence log-likelihood statistics shared by the likelihood-aware estimators (ACE, XRPO).

The base advantages (GRPO by default, or precomputed ones) and the per-rollout sequence log-probability, reduced over
masked-in tokens (``"sum"`` or ``"mean"``) or given per sequence ``[B]`` and used as is; both are computed at
advantage time and detached.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    checks_enabled,
    describe,
    finite,
)
from rolloutopt.advantages.reference import grpo
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import IntB

__all__: list[str] = []

Reduce = Literal["sum", "mean"]


def _base_advantages(
    rewards: Any,
    group: Groups | IntB,
    advantages: Any,
    valid: Any,
    dims: Dims,
    grpo_kwargs: dict[str, Any],
) -> tuple[Tensor, Groups, Tensor | None, Tensor, dict[str, Tensor]]:
    """The advantages to reshape: GRPO on ``rewards``, or the caller's precomputed ``advantages`` (not both)."""
    if (rewards is None) == (advantages is None):
        raise InputError(
            "rewards",
            "exactly one of rewards (GRPO is applied as the base estimator) or advantages= (precomputed)",
            "both" if rewards is not None else "neither",
            "pass rewards [B] to use GRPO as the base, or rewards=None and advantages=<[B] tensor from any estimator>",
        )
    if advantages is None:
        as_float(rewards, "rewards", dims, "B")  # binds B for the log-prob arguments
        g = as_groups(group, dims)
        v = None if valid is None else as_mask(valid, "valid", dims, "B", device=rewards.device)
        out = grpo(rewards, g, valid=v, **grpo_kwargs)
        return out.advantages, g, v, out.weight, dict(out.metrics)
    a = as_float(advantages, "advantages", dims, "B")
    g = as_groups(group, dims)
    v = None if valid is None else as_mask(valid, "valid", dims, "B", device=a.device)
    finite(a, "advantages", v)
    if v is not None:
        a = torch.where(v, a, torch.zeros_like(a))
    w = torch.ones_like(a) if v is None else v.to(a.dtype)
    return a, g, v, w, {}


def _sequence_logp(
    x: Any, name: str, dims: Dims, mask: Any, valid: Tensor | None, reduce: Reduce, *, need_lengths: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Sequence log-likelihood ``[B]`` from ``[B]`` or masked ``[B, T]`` log-probs, detached, 0 at invalid rows.

    Also returns the response lengths (int32 ``[B]``) for per-token input when ``reduce="mean"`` or
    ``need_lengths``, else None.
    """
    t = as_float(x, name)
    lengths: Tensor | None = None
    if t.ndim == 1:
        dims.check(t, name, "B")
        finite(t, name, valid)
        s = t.detach()  # a per-sequence input is the caller's statistic, used as is
    elif t.ndim == 2:
        dims.check(t, name, "B T")
        if mask is None:
            raise InputError(
                "mask",
                f"a response mask [B, T] when {name} is per token",
                "None",
                "pass mask= (True where a token counts)",
            )
        m = as_mask(mask, "mask", dims, "B T", device=t.device)
        # One pass over [B, T]; invalid rows are zeroed below, on [B]. The row sums certify finiteness (a sum
        # with a non-finite term is non-finite), so the exact [B, T] check runs only when a sum is not finite.
        s = torch.where(m, t.detach(), 0.0).sum(-1)
        if checks_enabled():
            bad = ~torch.isfinite(s)
            if bool((bad if valid is None else bad & valid).any()):
                finite(t, name, m if valid is None else m & valid[:, None])
        if reduce == "mean" or need_lengths:
            lengths = m.sum(-1, dtype=torch.int32)
        if reduce == "mean":
            assert lengths is not None
            s = s / lengths.clamp(min=1).to(s.dtype)
    else:
        raise InputError(
            name,
            "per-sequence log-probs [B] or per-token log-probs [B, T]",
            describe(t),
            f"pass {name} as [B] (summed over the response) or [B, T] with mask=",
        )
    return (s if valid is None else torch.where(valid, s, 0.0)), lengths


def _frac(x: Tensor, n: int | Tensor) -> Tensor:
    return (x.sum() / n).detach() if isinstance(n, int) else (x.sum() / n.clamp(min=1)).detach()
