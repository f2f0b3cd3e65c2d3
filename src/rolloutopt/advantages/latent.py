"""Latent-GRPO's invalid-sample advantage masking (arXiv 2604.27998).

:func:`latent_mask` gives invalid rollouts (truncated, unparsable, tool errors) advantage 0 and weight 0 and leaves
them out of their group's statistics, so they do not shift their siblings' baseline.
"""

from __future__ import annotations

from typing import Literal

import torch

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    describe,
    finite,
    positive,
)
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.reference import grpo
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, IntB

__all__ = ["latent_mask"]


def latent_mask(
    rewards: FloatB,
    group: Groups | IntB,
    *,
    invalid: BoolB | None = None,
    mask: BoolBT | None = None,
    max_len: int | None = None,
    scale: Literal["group", "batch"] | None = "group",
    unbiased: bool = True,
    eps: float = 1e-6,
    singleton: Literal["zero", "raw"] | None = None,
) -> AdvantageOutput:
    r"""Invalid-sample advantage masking: invalid rollouts get advantage 0 and leave their group's statistics.

    With :math:`V_g` the valid rollouts of group :math:`g`,

    .. math::  A_i = \begin{cases} \dfrac{r_i - \mu_{V_g}}{\sigma_{V_g} + \varepsilon} & i \text{ valid} \\
               0 & i \text{ invalid} \end{cases}

    and invalid rollouts get weight 0, so they neither train nor shift the baseline of their siblings.

    Reference: Latent-GRPO, arXiv 2604.27998 ("invalid-sample advantage masking"). Its code
    (``compute_latent_grpo_outcome_advantage_firstmask_best_exclude_advantage``, a verl 0.4 fork) flags a
    rollout invalid when its response length equals the maximum response length, computes the group mean and
    std over the others, and gives invalid rollouts advantage 0; that is ``latent_mask(r, g, mask=m,
    max_len=T, singleton="raw")``. We generalise "invalid" to any flag (truncated, unparsable answer, tool
    error) through ``invalid``; the paper's other two components (one-sided noise sampling, correct-path
    first-token selection) are not part of this function.

    Args:
        rewards: reward per rollout ``[B]``; values of invalid rows are ignored (they may be NaN).
        group: group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`.
        invalid: optional bool ``[B]``, True for invalid rollouts.
        mask, max_len: optional response mask ``[B, T]`` and maximum response length; rollouts with
            ``mask.sum(-1) >= max_len`` are truncated and invalid (the paper's rule). At least one of
            ``invalid`` and ``max_len`` must be given; both are combined with "or".
        scale, unbiased, eps, singleton: as in :func:`~rolloutopt.advantages.grpo`. ``singleton="zero"`` (the
            library's convention) gives a group left with one valid rollout advantage 0; the default ``None``
            does the same and warns (only the implicit default warns); the paper's code follows verl (``"raw"``:
            mean 0, std 1).

    Returns:
        :class:`AdvantageOutput` with ``advantages [B]`` and ``weight [B]`` (0 for invalid rollouts); metrics
        of :func:`grpo` plus ``invalid_frac`` and ``truncated_frac``.

    Edge cases: a group whose rollouts are all invalid gets advantage 0 everywhere; all-equal valid rewards
    give exactly 0; a non-binary reward is normalised like GRPO over the valid rows only; a NaN reward of a
    rollout that is not invalid raises (flag it through ``invalid``). An empty batch (B = 0) gives empty
    outputs and metrics 0.
    """
    dims = Dims()
    r = as_float(rewards, "rewards", dims, "B")
    if mask is not None and max_len is None:
        raise InputError("max_len", "the maximum response length when mask is given", "None", "pass max_len=T")
    if invalid is None and max_len is None:
        raise InputError(
            "invalid",
            "invalid flags [B], or mask and max_len (truncation)",
            "neither",
            "pass invalid=flags and/or mask=response_mask, max_len=max_response_length",
        )
    bad = torch.zeros(r.shape, dtype=torch.bool, device=r.device)
    truncated = bad
    if max_len is not None:
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
            raise InputError("max_len", "a positive int", describe(max_len), "pass the maximum response length")
        if mask is None:
            raise InputError("mask", "the response mask [B, T] when max_len is given", "None", "pass mask=...")
        m = as_mask(mask, "mask", dims, "B T", device=r.device)
        truncated = m.sum(-1) >= max_len
        bad = bad | truncated
    if invalid is not None:
        bad = bad | as_mask(invalid, "invalid", dims, "B", device=r.device)
    positive(eps, "eps", strict=False)
    finite(r, "rewards", ~bad, exclude="invalid")  # this estimator's keyword for rows to leave out
    out = grpo(r, group, scale=scale, unbiased=unbiased, eps=eps, singleton=singleton, valid=~bad)
    metrics = dict(out.metrics)
    rows = max(r.shape[0], 1)  # fractions of an empty batch are 0, not NaN
    metrics["invalid_frac"] = (bad.to(out.weight.dtype).sum() / rows).detach()
    metrics["truncated_frac"] = (truncated.to(out.weight.dtype).sum() / rows).detach()
    return AdvantageOutput(advantages=out.advantages, weight=out.weight, metrics=metrics)


REGISTRY.register(
    "latent_mask",
    latent_mask,
    requires=("mask",),
    accepts=("invalid",),
    reference="Latent-GRPO arXiv 2604.27998; code compute_latent_grpo_outcome_advantage_firstmask_best_exclude_"
    "advantage (its verl 0.4 fork)",
)
