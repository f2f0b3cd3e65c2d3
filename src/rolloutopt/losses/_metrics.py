"""The per-token weight and staleness metrics :func:`~rolloutopt.losses.policy.policy_loss` reports (detached)."""

from __future__ import annotations

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt.ratios.context import as_weights, masked_max, masked_mean
from rolloutopt.typing import BoolBT, FloatBT, IntBT, Scalar

__all__ = ["staleness_metrics", "weight_metrics"]


def weight_metrics(weight: FloatBT, mask: BoolBT) -> dict[str, Scalar]:
    r"""Mean, max and effective-sample-size fraction of per-token weights over ``mask`` (detached).

    ``is_ess`` = :math:`(\sum_t w)^2 / (N \sum_t w^2)` over the N loss tokens: 1 for equal weights, 1/N when
    one token carries all the weight (verl's ``rollout_is_eff_sample_size`` = ``1/mean((w/mean w)^2)``).
    """
    w = weight.detach().nan_to_num(0.0, 0.0, 0.0) * as_weights(mask, weight.dtype)
    n = mask.sum().clamp(min=1).to(w.dtype)
    s1, s2 = w.sum(), (w * w).sum()
    return {
        "is_weight_mean": s1 / n,
        "is_weight_max": w.amax() if w.numel() else w.sum(),
        "is_ess": torch.where(s2 > 0, s1 * s1 / (n * s2), torch.ones_like(s2)),
    }


def staleness_metrics(versions: IntBT, mask: Bool[Tensor, "B T"], policy_version: int | None) -> dict[str, Scalar]:
    """How many versions behind the trained policy each loss token was generated: mean, max, fraction stale."""
    v = versions.to(torch.float64)
    if policy_version is not None:
        newest: Tensor | int = policy_version
    elif v.numel() == 0:
        newest = 0  # an empty batch: nothing is stale
    else:
        newest = torch.where(mask, v, torch.full_like(v, -torch.inf)).amax()
    lag = torch.where(mask, newest - v, torch.zeros_like(v)).to(torch.float32)
    return {
        "staleness_mean": masked_mean(lag, mask),
        "staleness_max": masked_max(lag, mask),
        "stale_frac": masked_mean(lag > 0, mask),
    }
