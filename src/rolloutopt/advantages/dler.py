"""DLER (arXiv 2510.15110, "Doing Length pEnalty Right"), all of it: the truncation length penalty, its
difficulty-aware variant and the batch-wise reward normalisation.

- :func:`truncation_penalty` is a reward shaper (a response over the length budget earns 0);
- :func:`dler_truncation_penalty` is the same penalty as a post-hoc length rule: it also cuts the loss mask and the
  lengths at the budget and returns a :class:`~rolloutopt.control.TruncationOutput` (its rewards are
  :func:`truncation_penalty`'s);
- :func:`dler_difficulty_budget` and :func:`dler_difficulty_penalty` are Difficulty-Aware DLER (a tighter budget on
  prompts the policy already solves);
- :func:`dler_normalise` is the estimator that normalises the group-relative rewards over the whole batch.

The two post-hoc rules are exported and registered by :mod:`rolloutopt.control` too
(``rolloutopt.control.dler_truncation_penalty``, ``rolloutopt.control.posthoc.get("dler_difficulty_penalty")``);
their provenance and worked examples are in ``docs/methods/length_rules.md``, the shaper's and the estimator's in
``docs/methods/shaping.md``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor

from rolloutopt._length_rules import (
    _DOCS,
    TruncationOutput,
    _cut,
    _empty_output,
    _experimental,
    _pass_rate,
    _rows,
    _token_metrics,
)
from rolloutopt._validation import Dims, as_float, checks_enabled, choice, describe, finite, positive
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.advantages._base import REGISTRY, SHAPERS, AdvantageOutput, ShapedRewards
from rolloutopt.advantages.fapo import _frac
from rolloutopt.advantages.reference import _emptied, _empty_batch, _prepare, _shifted
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, IntB, NumB

__all__ = [
    "dler_difficulty_budget",
    "dler_difficulty_penalty",
    "dler_normalise",
    "dler_truncation_penalty",
    "truncation_penalty",
]


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


# ------------------------------------------------------------------- the penalty as a post-hoc length rule

_DLER_WHAT = "DLER's truncation penalty (arXiv 2510.15110; only the abstract was available)"
_DLER_WHERE = _DOCS
_DLER_METRICS = ("truncated_frac", "truncated_correct_frac", "reward_mean", "tokens_removed", "tokens_removed_frac")


def _budget(max_len: Any, dims: Dims, device: torch.device) -> Tensor:
    if isinstance(max_len, Tensor):
        if checks_enabled():
            if max_len.dtype == torch.bool or max_len.is_complex():
                raise InputError("max_len", "an int >= 1 or a numeric tensor [B]", describe(max_len), "pass lengths")
            dims.check(max_len, "max_len", "B")
            bad = max_len < 1
            if max_len.is_floating_point():
                bad = bad | ~torch.isfinite(max_len)
            if bool(bad.any()):
                raise InputError("max_len", "per-rollout budgets >= 1", describe(max_len), "pass positive lengths")
        return max_len.to(device=device).floor().long() if max_len.is_floating_point() else max_len.to(device).long()
    return torch.tensor(_int(max_len, "max_len", low=1), device=device)


def _dler_apply(
    r: Tensor, length: Tensor, m: Tensor, cap: Tensor, truncated_reward: float, cut_mask: bool
) -> TruncationOutput:
    over = length > cap.to(length.dtype)
    shaped = truncation_penalty(r, length, budget=cap.expand_as(length), truncated_reward=truncated_reward)
    keep = cap.expand_as(length)
    new_mask = _cut(m, keep, over) if cut_mask else m.clone()
    new_len = torch.where(over, keep.to(length.dtype), length).floor().long()
    metrics = {**shaped.metrics, **_token_metrics(m, new_mask)}
    return TruncationOutput(mask=new_mask, rewards=shaped.rewards, lengths=new_len, truncated=over, metrics=metrics)


def dler_truncation_penalty(
    rewards: FloatB,
    lengths: NumB,
    *,
    max_len: int | NumB,
    mask: BoolBT | None = None,
    truncated_reward: float = 0.0,
    cut_mask: bool = True,
    experimental: bool = False,
) -> TruncationOutput:
    r"""DLER truncation length penalty: a response longer than ``max_len`` is cut there and earns reward 0.

    .. math::  \tilde r_i = \begin{cases} r_i & L_i \le L_{max} \\ r_{trunc} & L_i > L_{max}\end{cases},
               \qquad \tilde L_i = \min(L_i, L_{max})

    Precisely: a row with :math:`L_i > L_{max}` (strictly; a response of exactly ``max_len`` tokens fits) gets
    reward ``truncated_reward`` (0) whatever its answer, its loss mask keeps only the positions
    :math:`t < L_{max}` (``cut_mask=True``: the tokens an engine capped at ``max_len`` would have produced), and its
    new length is ``max_len``. Rows within the budget are returned unchanged.

    Reference: DLER, "Doing Length pEnalty Right", arXiv 2510.15110. Only the abstract was available: DLER
    revisits "the simplest length penalty — truncation" and makes it work with batch-wise reward normalisation,
    higher clipping and dynamic sampling. **Reconstructed** (``experimental=True`` required; every choice a
    keyword): the strict ``>``, the zero reward (``truncated_reward``), the mask cut (``cut_mask``). The reward
    part is :func:`rolloutopt.advantages.dler.truncation_penalty`. DLER's batch-wise reward normalisation is
    :func:`rolloutopt.advantages.dler.dler_normalise` (group-mean centring, batch whitening) or
    ``rolloutopt.advantages.grpo(..., scale="batch")`` (TRL ``scale_rewards="batch"``); apply it to
    ``out.rewards``. Higher clipping is ``PPOClip(high=0.28)``; dynamic sampling is the allocators' filter.

    Args:
        rewards: rewards ``[B]`` (DLER: 1 correct, 0 incorrect).
        lengths: response lengths ``[B]`` in tokens.
        max_len: the truncation length, an int >= 1, or an int tensor ``[B]`` of per-row budgets
            (:func:`dler_difficulty_budget`).
        mask: loss mask ``[B, T]`` (default: the prefix mask of ``lengths``).
        truncated_reward: the reward of an over-long response (0).
        cut_mask: drop the loss on positions ``t >= max_len`` of over-long rows (default True).
        experimental: must be True.

    Returns:
        :class:`~rolloutopt.control.TruncationOutput`; metrics ``truncated_frac``, ``truncated_correct_frac``
        (among rows with a positive reward), ``reward_mean``, ``tokens_removed``, ``tokens_removed_frac``.

    Edge cases: an empty batch returns empty tensors; an all-inactive batch (lengths 0) is a no-op.
    """
    _experimental(experimental, _DLER_WHAT, _DLER_WHERE)
    _real(truncated_reward, "truncated_reward")
    if not isinstance(cut_mask, bool):
        raise InputError("cut_mask", "a bool", describe(cut_mask), "pass True or False")
    r, length, m, dims = _rows(rewards, lengths, mask)
    cap = _budget(max_len, dims, r.device)
    if r.numel() == 0:
        return _empty_output(r, length, m, _DLER_METRICS)
    return _dler_apply(r, length, m, cap, truncated_reward, cut_mask)


def _difficulty_budget(
    r: Tensor, g: Groups, max_len: int, tighten: float, easy_from: float, correct: float
) -> tuple[Tensor, Tensor]:
    p = _pass_rate(r >= correct, g)
    # easy_from = 1: only fully-solved groups are tightened (the linear ramp would divide by 0)
    s = ((p - easy_from) / (1.0 - easy_from)).clamp(0.0, 1.0) if easy_from < 1.0 else (p >= 1.0).to(p.dtype)
    budget = (max_len * (1.0 - tighten * s)).floor().clamp(min=1.0).long()
    return g.broadcast(budget), p


def _difficulty_args(max_len: Any, tighten: Any, easy_from: Any, correct: Any) -> None:
    _int(max_len, "max_len", low=1)
    _real(tighten, "tighten", low=0.0, high=1.0)
    _real(easy_from, "easy_from", low=0.0, high=1.0)
    _real(correct, "correct")


def dler_difficulty_budget(
    rewards: FloatB,
    group: Groups | IntB,
    *,
    max_len: int,
    tighten: float = 0.5,
    easy_from: float = 0.5,
    correct: float = 1.0,
    experimental: bool = False,
) -> IntB:
    r"""Difficulty-Aware DLER's per-row truncation length: tighter on prompts the policy already solves.

    .. math::  p_g = \frac{1}{n_g}\sum_{i\in g} [r_i \ge c], \quad
               s_g = \operatorname{clip}\Big(\frac{p_g - p_0}{1 - p_0}, 0, 1\Big), \quad
               L_g = \max\big(1, \lfloor L_{max}\,(1 - \tau\, s_g)\rfloor\big)

    Reference: DLER, arXiv 2510.15110 ("Difficulty-Aware DLER adaptively tightens truncation on easier questions";
    only the abstract was available). **Reconstructed** (``experimental=True`` required; every choice a keyword):
    difficulty is the group pass rate :math:`p_g` of the rewards given (the rollouts judged in full), the budget
    falls linearly from ``max_len`` at pass rate ``easy_from`` (:math:`p_0`, 0.5) to
    ``(1 - tighten) * max_len`` (:math:`\tau` = 0.5) at pass rate 1; with ``easy_from=1`` only all-correct groups
    are tightened.

    Args:
        rewards: rewards ``[B]``; a row is correct when ``>= correct`` (1).
        group: group ids ``[B]`` or :class:`~rolloutopt.groups.Groups`.
        max_len: the budget of hard prompts (an int >= 1).
        tighten: fraction :math:`\tau \in [0, 1]` removed from the budget of a fully-solved prompt (0.5).
        easy_from: pass rate :math:`p_0 \in [0, 1]` above which tightening starts (0.5).
        correct: correctness threshold on the rewards (1).
        experimental: must be True.

    Returns:
        int64 ``[B]``: each row's truncation length (equal within a group), for
        :func:`dler_truncation_penalty`'s ``max_len``.

    Edge cases: an empty batch gives an empty tensor; a singleton group's pass rate is 0 or 1; budgets are at
    least 1 and at most ``max_len``, and never increase with the pass rate.
    """
    _experimental(experimental, "Difficulty-Aware DLER's budget rule", _DLER_WHERE)
    _difficulty_args(max_len, tighten, easy_from, correct)
    dims = Dims()
    r = as_float(rewards, "rewards", dims, "B")
    finite(r, "rewards")
    if r.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=r.device)
    g = as_groups(group, dims)
    return _difficulty_budget(r, g, max_len, tighten, easy_from, correct)[0]


def dler_difficulty_penalty(
    rewards: FloatB,
    lengths: NumB,
    group: Groups | IntB,
    *,
    max_len: int,
    mask: BoolBT | None = None,
    tighten: float = 0.5,
    easy_from: float = 0.5,
    correct: float = 1.0,
    truncated_reward: float = 0.0,
    cut_mask: bool = True,
    experimental: bool = False,
) -> TruncationOutput:
    r"""Difficulty-Aware DLER: :func:`dler_truncation_penalty` with the per-prompt budget of
    :func:`dler_difficulty_budget`.

    .. math::  \tilde r_i = \begin{cases} r_i & L_i \le L_{g(i)} \\ r_{trunc} & L_i > L_{g(i)}\end{cases}, \qquad
               L_g = \max\big(1, \lfloor L_{max}(1 - \tau\, s_g)\rfloor\big)

    Reference: DLER, arXiv 2510.15110 (abstract only). **Reconstructed** (``experimental=True`` required): see
    :func:`dler_difficulty_budget` for the budget rule and :func:`dler_truncation_penalty` for the cut. The pass
    rate is read from ``rewards`` before the penalty. Normalise the resulting rewards batch-wise
    (:func:`rolloutopt.advantages.dler.dler_normalise`).

    Args:
        rewards, lengths, group, mask: as in :func:`~rolloutopt.control.dot.dot`.
        max_len, tighten, easy_from, correct: as in :func:`dler_difficulty_budget`.
        truncated_reward, cut_mask: as in :func:`dler_truncation_penalty`.
        experimental: must be True.

    Returns:
        :class:`~rolloutopt.control.TruncationOutput`; metrics as :func:`dler_truncation_penalty` plus
        ``budget_mean`` (mean per-row budget) and ``tightened_group_frac``.

    Edge cases: an empty batch returns empty tensors; an all-inactive batch is a no-op; a group with pass rate
    ``<= easy_from`` keeps the full ``max_len``.
    """
    _experimental(experimental, "Difficulty-Aware DLER", _DLER_WHERE)
    _difficulty_args(max_len, tighten, easy_from, correct)
    _real(truncated_reward, "truncated_reward")
    if not isinstance(cut_mask, bool):
        raise InputError("cut_mask", "a bool", describe(cut_mask), "pass True or False")
    r, length, m, dims = _rows(rewards, lengths, mask)
    if r.numel() == 0:
        return _empty_output(r, length, m, (*_DLER_METRICS, "budget_mean", "tightened_group_frac"))
    g = as_groups(group, dims)
    cap, _ = _difficulty_budget(r, g, max_len, tighten, easy_from, correct)
    out = _dler_apply(r, length, m, cap, truncated_reward, cut_mask)
    tightened = g.max(cap.to(torch.float64)) < max_len
    out.metrics["budget_mean"] = cap.double().mean().float().detach()
    out.metrics["tightened_group_frac"] = _frac(tightened)
    return out


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
