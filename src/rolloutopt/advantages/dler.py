"""DLER (arXiv 2510.15110): batch-wise reward normalisation and the truncation length penalty.

:func:`truncation_penalty` is a reward shaper (a response over the length budget earns 0); :func:`dler_normalise`
is the estimator that normalises the group-relative rewards over the whole batch.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, checks_enabled, choice, describe, finite, positive
from rolloutopt.advantages._base import REGISTRY, SHAPERS, AdvantageOutput, ShapedRewards
from rolloutopt.advantages.fapo import _frac
from rolloutopt.advantages.reference import _emptied, _empty_batch, _prepare, _shifted
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import BoolB, FloatB, IntB, NumB

__all__ = ["dler_normalise", "truncation_penalty"]


def dler_normalise(
    rewards: FloatB,
    group: Groups | IntB,
    *,
    std_of: Literal["advantages", "rewards"] = "advantages",
    batch: Literal["all", "informative"] = "all",
    unbiased: bool = True,
    eps: float = 1e-6,
    valid: BoolB | None = None,
) -> AdvantageOutput:
    r"""DLER batch-wise reward normalisation: centre on the group mean, then whiten over the whole batch.

    .. math::  \tilde A_i = r_i - \mu_{g(i)}, \qquad
               A_i = \frac{\tilde A_i - \operatorname{mean}_{batch}(\tilde A)}{\operatorname{std}_{batch}(\tilde A)
               + \varepsilon}

    Reference: DLER, "Doing Length pEnalty Right", arXiv 2510.15110 (NVIDIA, 2025). From the paper (abstract
    and project page): DLER swaps GRPO's group-wise std normalisation for a *batch-wise* one, because a strict
    truncation penalty makes many rewards 0 and the per-group std of small groups then gives a biased, high-
    variance advantage. Reconstructed (we could not read the paper's equation or code here; kept configurable):
    the exact form above — group-mean centring followed by batch mean/std of the centred advantages, the
    REINFORCE++-baseline / Lite PPO scheme the paper builds on — with ``std_of="rewards"`` for the Lite PPO
    (arXiv 2508.08221) / TRL ``scale_rewards="batch"`` variant that divides by the batch std of the raw
    rewards; Bessel's correction and ``eps`` added to the std (verl GRPO's 1e-6) are our choices.

    Args:
        rewards: rewards ``[B]`` (DLER: correctness after :func:`truncation_penalty`).
        group: group ids ``[B]`` or :class:`~rolloutopt.groups.Groups`.
        std_of: ``"advantages"`` (default) standardises the group-centred advantages over the batch;
            ``"rewards"`` divides the centred advantages by the batch std of the raw rewards, without the batch
            mean shift (Lite PPO, TRL ``scale_rewards="batch"``).
        batch: which rows enter the batch statistics: ``"all"`` valid rows (default), or ``"informative"``,
            only rows of groups with at least two distinct rewards — what DLER's dynamic sampling (DAPO-style
            filtering of all-correct/all-wrong groups) leaves in the batch, without dropping the other rows.
        unbiased: Bessel-corrected batch std (n−1, torch's default); False for the population std.
        eps: added to the batch std.
        valid: optional mask ``[B]`` of rows that enter the statistics; other rows get advantage and weight 0.

    Returns:
        :class:`AdvantageOutput` with ``advantages [B]``; metrics ``batch_std``, ``zero_variance_group_frac``,
        ``singleton_group_frac``, ``excluded_frac`` (rows with weight 0) and ``reward_mean``.

    Edge cases: a singleton group and an all-equal group have :math:`\tilde A = 0` exactly (centring on a
    member), so with ``std_of="advantages"`` their advantage is :math:`-\operatorname{mean}_{batch}(\tilde A)
    /(\sigma + \varepsilon)`, 0 when every row is valid (the batch mean of group-centred values is 0) — no
    singleton warning is needed. A batch whose centred advantages are all 0 gives 0 everywhere. Advantages are
    invariant to a per-group shift of the rewards and (up to ``eps``) to a positive scale of all rewards. An
    empty batch (B = 0) gives empty outputs and metrics 0.
    """
    choice(std_of, "std_of", ("advantages", "rewards"))
    choice(batch, "batch", ("all", "informative"))
    positive(eps, "eps", strict=False)
    if (empty := _empty_batch(rewards, group, valid)) is not None:
        r0, g0, v0 = empty
        return _emptied(dler_normalise(r0, g0, std_of=std_of, batch=batch, unbiased=unbiased, eps=eps, valid=v0))
    r, g, v, _ = _prepare(rewards, group, valid)
    n = g.count(v)
    rs = _shifted(r, g, v)  # centred on a member: all-equal groups are exactly 0
    centred = rs - g.broadcast(g.mean(rs, v))
    spread = g.max(rs.detach(), v) - g.min(rs.detach(), v)
    informative = (spread > 0) & (n > 1)
    stat = torch.ones_like(r, dtype=torch.bool) if v is None else v
    if batch == "informative":
        stat = stat & g.broadcast(informative)
    sw = stat.to(r.dtype)
    count = sw.sum()
    x = centred if std_of == "advantages" else r
    mu = (x * sw).sum() / count.clamp(min=1)
    var = ((x - mu) ** 2 * sw).sum() / (count - (1 if unbiased else 0)).clamp(min=1)
    std = torch.where(var > 0, var, torch.ones_like(var)).sqrt() * (var > 0)
    shift = mu if std_of == "advantages" else torch.zeros_like(mu)
    adv = (centred - shift) / (std + eps)
    w = torch.ones_like(r) if v is None else v.to(r.dtype)
    if v is not None:
        adv = torch.where(v, adv, torch.zeros_like(adv))
    groups_with_rows = (n > 0).sum().clamp(min=1)
    metrics = {
        "batch_std": std.detach(),
        "zero_variance_group_frac": (((n > 1) & ~informative).sum() / groups_with_rows).detach(),
        "singleton_group_frac": ((n == 1).sum() / groups_with_rows).detach(),
        "excluded_frac": (1.0 - w.mean()).detach(),
        "reward_mean": ((r * w).sum() / w.sum().clamp(min=1)).detach(),
    }
    return AdvantageOutput(advantages=adv, weight=w, metrics=metrics)


def truncation_penalty(
    rewards: FloatB,
    lengths: NumB,
    *,
    budget: int | NumB,
    truncated_reward: float = 0.0,
) -> ShapedRewards:
    r"""DLER truncation length penalty: a response longer than the length budget gets reward 0.

    .. math::  \tilde r_i = \begin{cases} r_i & L_i \le B_{len} \\ r_{trunc} = 0 & L_i > B_{len} \end{cases}

    Reference: DLER, arXiv 2510.15110 (from the paper: the "simplest length penalty — truncation": a response
    that exceeds the target length is cut and earns zero reward, whatever its answer; DLER's recipe makes this
    penalty work through batch-wise normalisation, :func:`dler_normalise`). Reconstructed details: a response of
    exactly ``budget`` tokens fits (``<=``); the zero is a keyword, ``truncated_reward``; a per-rollout budget
    ``[B]`` serves Difficulty-Aware DLER, which tightens the budget on easier prompts.

    Args:
        rewards: rewards ``[B]`` (DLER: 1 correct, 0 incorrect).
        lengths: response lengths ``[B]`` in tokens (int or float), e.g. ``mask.sum(-1)``.
        budget: the truncation length, an int >= 1 or a tensor ``[B]`` of per-rollout budgets.
        truncated_reward: the reward of a truncated response (paper: 0).

    Returns:
        :class:`ShapedRewards`; metrics ``truncated_frac`` (rollouts whose reward was replaced; nothing is
        dropped downstream), ``truncated_correct_frac`` (among rollouts with a positive reward) and
        ``reward_mean`` (0 for an empty batch, B = 0, whose shaped rewards are empty).
    """
    dims = Dims()
    r = as_float(rewards, "rewards", dims, "B")
    finite(r, "rewards", exclude=None)  # no row mask here: every reward must be finite
    if (
        not isinstance(truncated_reward, (int, float))
        or isinstance(truncated_reward, bool)
        or not math.isfinite(truncated_reward)
    ):
        raise InputError("truncated_reward", "a finite number", describe(truncated_reward), "pass e.g. 0.0")
    if checks_enabled():
        if not isinstance(lengths, Tensor) or lengths.dtype == torch.bool or lengths.is_complex():
            raise InputError(
                "lengths", "an int or float tensor [B] of response lengths", describe(lengths), "pass mask.sum(-1)"
            )
        dims.check(lengths, "lengths", "B")
        if lengths.device != r.device:
            raise InputError("lengths", f"a tensor on {r.device}", describe(lengths), f"move it to {r.device}")
        if bool((~torch.isfinite(lengths) | (lengths < 0)).any()):
            raise InputError("lengths", "finite, non-negative lengths", describe(lengths), "pass token counts")
    if isinstance(budget, Tensor):
        if checks_enabled():
            if budget.dtype == torch.bool or budget.is_complex():
                raise InputError("budget", "an int >= 1 or a numeric tensor [B]", describe(budget), "pass lengths")
            dims.check(budget, "budget", "B")
            if bool((~torch.isfinite(budget) | (budget < 1)).any()):
                raise InputError("budget", "per-rollout budgets >= 1", describe(budget), "pass positive lengths")
        cap = budget.to(device=r.device)
    elif isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1:
        cap = torch.tensor(budget, device=r.device)
    else:
        raise InputError("budget", "an int >= 1 or a tensor [B]", describe(budget), "pass the truncation length")
    over = lengths.to(r.device) > cap
    out = torch.where(over, torch.full_like(r, float(truncated_reward)), r)
    metrics = {
        "truncated_frac": _frac(over),
        "truncated_correct_frac": _frac(over, r > 0),
        "reward_mean": (out.sum() / max(out.numel(), 1)).detach(),  # 0, not NaN, for B = 0
    }
    return ShapedRewards(rewards=out, metrics=metrics)


REGISTRY.register(
    "dler_normalise",
    dler_normalise,
    accepts=("valid",),
    reference="DLER arXiv 2510.15110 (batch-wise normalisation); Lite PPO arXiv 2508.08221; TRL "
    "scale_rewards='batch' (std_of='rewards')",
)


SHAPERS.register(
    "truncation_penalty",
    truncation_penalty,
    requires=("rewards", "lengths"),
    reference="DLER arXiv 2510.15110 (truncation length penalty)",
)
