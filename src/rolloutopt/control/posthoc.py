"""Post-hoc truncation and length rules: decide after generation, return new masks, rewards and lengths.

Every rule here is a pure function over finished rollouts (rewards ``[B]``, lengths ``[B]``, a loss mask
``[B, T]``, group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`) that returns a
:class:`~rolloutopt.control.TruncationOutput`: the new loss mask, rewards and lengths, the rows it changed, and
metrics. Nothing is dropped silently: a row whose reward or mask changed has ``truncated`` True and is counted in
the metrics. Group decisions use :class:`~rolloutopt.groups.Groups` segment reductions (no Python loop over
groups or rows).

- :func:`dot` — DOT, dynamic outlier truncation of the extreme length tail inside fully-correct groups
  (arXiv 2601.03969; threshold rule reconstructed, ``experimental=True``).
- :func:`jet_truncation_points`, :func:`jet_group_layout`, :func:`jet_reward` — JET, Just-Enough Thinking
  (arXiv 2509.23392; from the authors' code, ``JinyiHan99/Just-Enough-Think``).
- :func:`dler_truncation_penalty`, :func:`dler_difficulty_budget`, :func:`dler_difficulty_penalty` — DLER's
  truncation length penalty and its difficulty-aware variant (arXiv 2510.15110; abstract only, reconstructed).
- :func:`soft_compression_penalty` — sample-level soft RL compression (abstract only, reconstructed).
- :func:`siri_max_length` — SIRI's cosine max-length schedule (arXiv 2509.25176; reconstructed).
- :func:`egae` — T-PPO's extended GAE for incomplete responses (arXiv 2506.15050; reconstructed).

Provenance and worked examples: ``docs/methods/length_rules.md``.

``mask`` is optional in the rules: without it, the returned mask is the right-padded prefix mask of ``lengths``
(width ``max(lengths)``, one host synchronisation). Lengths count response positions (tokens), so a cut at
length ``c`` keeps the positions ``t < c`` of the mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    checks_enabled,
    choice,
    describe,
    finite,
    require_experimental,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.advantages.dler import truncation_penalty
from rolloutopt.control._base import TruncationOutput
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.registry import Entry, Registry
from rolloutopt.typing import BoolB, BoolBT, FloatB, FloatBT, IntB, NumB, PerSeqOrToken

__all__ = [
    "EGAEOutput",
    "JETLayout",
    "dler_difficulty_budget",
    "dler_difficulty_penalty",
    "dler_truncation_penalty",
    "dot",
    "egae",
    "jet_group_layout",
    "jet_reward",
    "jet_truncation_points",
    "siri_max_length",
    "soft_compression_penalty",
]

_DOCS = "docs/methods/length_rules.md"

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


# ---------------------------------------------------------------------------------------------------- DOT

_DOT_METRICS = (
    "truncated_frac",
    "eligible_group_frac",
    "eligible_row_frac",
    "tokens_removed",
    "tokens_removed_frac",
    "reward_changed_frac",
)


def dot(
    rewards: FloatB,
    lengths: NumB,
    group: Groups | IntB,
    *,
    mask: BoolBT | None = None,
    rule: Literal["iqr", "z"] = "iqr",
    k: float = 1.5,
    z: float = 2.0,
    unbiased: bool = False,
    correct: float = 1.0,
    min_group_size: int = 4,
    mode: Literal["rescore", "mask"] = "rescore",
    truncated_reward: float = 0.0,
    experimental: bool = False,
) -> TruncationOutput:
    r"""DOT: truncate the extreme length tail of fully-correct groups at a per-group upper fence.

    .. math::  f_g = Q_3(L_g) + k\,(Q_3(L_g) - Q_1(L_g)) \quad\text{or}\quad f_g = \mu(L_g) + z\,\sigma(L_g),
               \qquad \text{row } i \text{ truncated} \iff g(i) \text{ eligible} \wedge L_i > f_{g(i)}

    A group is eligible when every reward is ``>= correct`` and it has at least ``min_group_size`` rows. A
    truncated row keeps its first :math:`\lfloor f_g \rfloor` positions (new length
    :math:`\lfloor f_g\rfloor < L_i`) and, with ``mode="rescore"``, gets ``truncated_reward`` (its answer is cut
    off); with ``mode="mask"`` it keeps its reward and only loses the loss on the tokens past the fence.

    Reference: DOT, Dynamic Outlier Truncation, arXiv 2601.03969 (ACL 2026). From the paper's abstract and
    summaries: DOT intervenes only on the extreme length tail inside fully-correct groups. Reconstructed
    (every choice below is a keyword, and ``experimental=True`` is required):
    the fence rules (``rule="iqr"``, Tukey's fence with ``k=1.5`` on numpy-``linear`` quantiles, or
    ``rule="z"``, ``mean + z*std`` with ``z=2`` and the population std unless ``unbiased``), the group-size
    floor 4, the cut at :math:`\lfloor f\rfloor`, and both treatments of a truncated row (``mode``). DOT's KL
    regulariser and "predictive dynamic sampling" are not part of this function (see ``allocators`` GRESO/DPS).

    Args:
        rewards: rewards ``[B]``.
        lengths: response lengths ``[B]`` in tokens (int or float), e.g. ``mask.sum(-1)``.
        group: group ids ``[B]`` or :class:`~rolloutopt.groups.Groups`.
        mask: loss mask ``[B, T]`` (default: the prefix mask of ``lengths``).
        rule: ``"iqr"`` (default) or ``"z"``.
        k: IQR multiplier (1.5, Tukey).
        z: std multiplier of the z-rule (2).
        unbiased: Bessel-corrected std for the z-rule (default False: numpy's population std).
        correct: a reward counts as correct when ``>= correct`` (1: binary rewards).
        min_group_size: smaller groups are skipped (4).
        mode: ``"rescore"`` (default) sets the reward of truncated rows to ``truncated_reward``; ``"mask"`` keeps it.
        truncated_reward: the reward of a truncated row under ``mode="rescore"`` (0).
        experimental: must be True (the threshold rule is reconstructed).

    Returns:
        :class:`~rolloutopt.control.TruncationOutput`; metrics ``truncated_frac``, ``eligible_group_frac``,
        ``eligible_row_frac``, ``tokens_removed``, ``tokens_removed_frac`` and ``reward_changed_frac``.

    Edge cases: an empty batch returns empty tensors and zero metrics; singleton and small groups are skipped;
    a group with any incorrect response is untouched; an all-equal-length group has fence = its length and
    nothing to truncate; an all-inactive batch (every length 0) is a no-op. Rows are truncated only when
    strictly longer than the fence, and never more than the rows above :math:`Q_3` (IQR rule).
    """
    _experimental(experimental, "DOT's outlier threshold rule", _DOCS)
    choice(rule, "rule", ("iqr", "z"))
    choice(mode, "mode", ("rescore", "mask"))
    _real(k, "k", low=0.0)
    _real(z, "z", low=0.0)
    _real(correct, "correct")
    _real(truncated_reward, "truncated_reward")
    _int(min_group_size, "min_group_size", low=1)
    if not isinstance(unbiased, bool):
        raise InputError("unbiased", "a bool", describe(unbiased), "pass True or False")
    r, length, m, dims = _rows(rewards, lengths, mask)
    if r.numel() == 0:
        return _empty_output(r, length, m, _DOT_METRICS)
    g = as_groups(group, dims)
    ok = r >= correct
    eligible = (g.count(~ok) == 0) & (g.sizes >= min_group_size)
    if rule == "iqr":
        q1 = g.quantile(length, 0.25)
        q3 = g.quantile(length, 0.75)
        fence = q3 + k * (q3 - q1)
    else:
        fence = g.mean(length) + z * g.std(length, unbiased=unbiased)
    row_eligible = g.broadcast(eligible)
    row_fence = g.broadcast(fence)
    trunc = row_eligible & (length > row_fence)
    keep = row_fence.floor().clamp(min=0).long()
    new_len = torch.where(trunc, keep.to(length.dtype), length).floor().long()
    new_mask = _cut(m, keep, trunc)
    new_r = torch.where(trunc, torch.full_like(r, truncated_reward), r) if mode == "rescore" else r.clone()
    metrics = {
        "truncated_frac": _frac(trunc),
        "eligible_group_frac": _frac(eligible),
        "eligible_row_frac": _frac(row_eligible),
        **_token_metrics(m, new_mask),
        "reward_changed_frac": _frac(new_r != r),
    }
    return TruncationOutput(mask=new_mask, rewards=new_r, lengths=new_len, truncated=trunc, metrics=metrics)


# ---------------------------------------------------------------------------------------------------- JET

_JET_RATIOS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _ratios(ratios: Any) -> tuple[float, ...]:
    if not isinstance(ratios, (tuple, list)) or len(ratios) == 0:
        raise InputError("ratios", "a non-empty tuple of fractions in (0, 1)", describe(ratios), "e.g. (0.1, 0.5, 0.9)")
    for x in ratios:
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0.0 < x < 1.0:
            raise InputError("ratios", "fractions in (0, 1)", describe(ratios), "e.g. (0.1, 0.3, 0.5, 0.7, 0.9)")
    return tuple(float(x) for x in ratios)


def jet_truncation_points(lengths: NumB, ratios: tuple[float, ...] = _JET_RATIOS) -> Int[Tensor, "B R"]:
    r"""JET's prefix cut points: where each full response is cut before the answer-forcing suffix.

    .. math::  c_{i,j} = \min\big(L_i,\ \max(1, \lfloor L_i\, \rho_j \rfloor)\big)

    Reference: JET, Just-Enough Thinking, arXiv 2509.23392; code ``JinyiHan99/Just-Enough-Think``,
    ``EasyR1/verl/workers/rollout/vllm_rollout_spmd.py`` (``ans[:max(1, int(len(ans) * r))]``, in *characters*
    of the decoded text; pass token counts to cut token sequences instead). The engine then appends the
    answer-forcing suffix ("...I have enough information to get the final answer.</think> ... \boxed{") and
    decodes at most 50 more tokens; that step belongs to the generation loop.

    Args:
        lengths: int or float tensor ``[B]`` of full-response lengths (characters or tokens).
        ratios: the cut fractions :math:`\rho`, default ``(0.1, 0.3, 0.5, 0.7, 0.9)`` (the paper's five).

    Returns:
        int64 ``[B, R]``: the prefix length to keep for each ratio (``R = len(ratios)``).

    Edge cases: an empty response (length 0) gives 0 (slicing an empty string); a response of length 1 keeps 1.
    The product is taken in float64, as Python's ``int(len * r)`` does.
    """
    rho = _ratios(ratios)
    length = _lengths(lengths, Dims())
    rt = torch.tensor(rho, dtype=torch.float64, device=length.device)
    cut = (length[:, None] * rt[None, :]).floor().clamp(min=1.0)
    return torch.minimum(cut, length[:, None]).long()


@dataclass(frozen=True)
class JETLayout:
    """The rows of one JET group of ``n`` responses (``n_full`` full responses first, then their variants).

    Attributes:
        n_full: full responses per prompt, ``n // (R + 1)``.
        n_truncated: truncated variants per prompt, ``R * n_full``.
        source: int64 ``[n]``, the full response each row derives from (itself for full rows).
        ratio_index: int64 ``[n]``, index into ``ratios`` of a truncated row; -1 for a full row.
        is_truncated: bool ``[n]``.
    """

    n_full: int
    n_truncated: int
    source: Int[Tensor, " N"]
    ratio_index: Int[Tensor, " N"]
    is_truncated: Bool[Tensor, " N"]


def jet_group_layout(n: int, *, num_ratios: int = 5) -> JETLayout:
    r"""JET's group layout: ``n // (R+1)`` full responses, then ``R`` truncated variants of each, in that order.

    .. math::  n_{full} = n / (R + 1), \qquad \text{row } n_{full} + aR + j
               \text{ is full response } a \text{ cut at ratio } j

    Reference: JET, arXiv 2509.23392; code ``vllm_rollout_spmd.py`` (``n_first = n // 6`` full answers, then for
    each answer its five prefixes; ``assert len(combined_q) == n``). The config uses ``n = 12``: 2 full responses
    and 10 truncated variants.

    Args:
        n: responses per prompt; must be a positive multiple of ``num_ratios + 1`` (6 for the paper's five ratios).
        num_ratios: number of cut ratios ``R`` (5).

    Returns:
        :class:`JETLayout`.

    Raises:
        InputError: ``n`` is not a positive multiple of ``num_ratios + 1`` (the authors' code asserts it).
    """
    r = _int(num_ratios, "num_ratios", low=1)
    _int(n, "n", low=1)
    if n % (r + 1) != 0:
        raise InputError(
            "n",
            f"a multiple of num_ratios + 1 = {r + 1} (n // {r + 1} full responses plus {r} variants of each)",
            repr(n),
            f"use e.g. n = {2 * (r + 1)}",
        )
    n_full = n // (r + 1)
    k = torch.arange(n)
    offset = k - n_full
    truncated = k >= n_full
    source = torch.where(truncated, torch.div(offset, r, rounding_mode="floor"), k)
    ratio_index = torch.where(truncated, offset.remainder(r), torch.full_like(k, -1))
    return JETLayout(n_full, n - n_full, source, ratio_index, truncated)


_JET_METRICS = ("correct_frac", "bonus_mean", "reward_mean")


def jet_reward(
    accuracy: FloatB,
    has_format: BoolB,
    lengths: NumB,
    group: Groups | IntB | None,
    *,
    mask: BoolBT | None = None,
    alpha: float = 1.2,
    delta: float = 0.05,
    format_weight: float = 0.1,
    eps: float = 1e-8,
    baseline: Literal["group", "batch"] = "group",
) -> TruncationOutput:
    r"""JET reward: accuracy and format, plus a length bonus for correct responses, shortest correct largest.

    .. math::  R_i = (1-w)\,acc_i + w\,fmt_i + [acc_i = 1]\Big(\delta + (1-\delta)\,\alpha\,
               \frac{L_{max} - L_i}{L_{max} - L_{min} + \epsilon}\Big)

    :math:`L_{min}, L_{max}` are taken over the correct responses of the row's group (``baseline="group"``) or of
    the whole batch (``baseline="batch"``).

    Reference: JET, arXiv 2509.23392; code ``EasyR1/examples/reward_function/math.py`` (``compute_score``) and
    ``examples/config.yaml``: ``w = 0.1``, ``alpha = 1.2``, ``delta = 0.05``, ``epsilon = 1e-8``, a response is
    correct when its accuracy score is exactly 1, lengths are ``response_length`` (tokens). The code takes
    :math:`L_{min}, L_{max}` over the list passed to the batch reward function — the whole batch under EasyR1's
    batch reward manager — while the README describes a per-group baseline; the default here is per-group (the
    README's reading), and ``baseline="batch"`` reproduces the code.

    Args:
        accuracy: accuracy scores ``[B]`` (1 correct, 0 incorrect).
        has_format: bool or 0/1 ``[B]``: a ``\boxed{}`` answer is present.
        lengths: response lengths ``[B]`` in tokens.
        group: group ids ``[B]`` or :class:`~rolloutopt.groups.Groups` (may be None with ``baseline="batch"``).
        mask: loss mask ``[B, T]``, returned unchanged (default: the prefix mask of ``lengths``).
        alpha, delta, format_weight, eps: the code's constants (1.2, 0.05, 0.1, 1e-8).
        baseline: ``"group"`` (default) or ``"batch"``.

    Returns:
        :class:`~rolloutopt.control.TruncationOutput` with the new rewards; ``mask`` and ``lengths`` unchanged and
        ``truncated`` all False (JET's truncation happens in the engine: :func:`jet_group_layout` says which rows
        are truncated variants). Metrics ``correct_frac``, ``bonus_mean`` (over correct rows), ``reward_mean``.

    Edge cases: a group with one correct response (or all correct ones of equal length) gives each the bonus
    :math:`\delta` (the numerator is 0); a group with no correct response gets no bonus; an empty batch returns
    empty tensors. The bonus lies in :math:`[\delta, \delta + (1-\delta)\alpha]`.
    """
    _real(alpha, "alpha", low=0.0)
    _real(delta, "delta", low=0.0, high=1.0)
    _real(format_weight, "format_weight", low=0.0, high=1.0)
    _real(eps, "eps", low=0.0, open_low=True)
    choice(baseline, "baseline", ("group", "batch"))
    dims = Dims()
    acc = as_float(accuracy, "accuracy", dims, "B")
    finite(acc, "accuracy")
    fmt = as_mask(has_format, "has_format", dims, "B", device=acc.device)
    length = _lengths(lengths, dims, acc.device)
    m = _mask(mask, length, dims)
    base = (1.0 - format_weight) * acc.to(torch.float64) + format_weight * fmt.to(torch.float64)
    ok = acc == 1.0
    if acc.numel() == 0:
        return _empty_output(acc, length, m, _JET_METRICS)
    if baseline == "group":
        if group is None:
            raise InputError("group", "group ids [B] or a Groups", "None", "pass group, or use baseline='batch'")
        g = as_groups(group, dims)
        lmin = g.broadcast(g.min(length, ok))
        lmax = g.broadcast(g.max(length, ok))
    else:
        if group is not None:
            as_groups(group, dims)  # validated for consistency, not used
        big = torch.full_like(length, float("inf"))
        lmin = torch.where(ok, length, big).amin().expand_as(length)
        lmax = torch.where(ok, length, -big).amax().expand_as(length)
    frac = torch.where(ok, (lmax - length) / (lmax - lmin + eps), torch.zeros_like(length))
    bonus = torch.where(ok, delta + (1.0 - delta) * alpha * frac, torch.zeros_like(length))
    out = (base + bonus).to(acc.dtype)
    metrics = {
        "correct_frac": _frac(ok),
        "bonus_mean": (bonus.sum() / ok.sum().clamp(min=1)).float().detach(),
        "reward_mean": out.float().mean().detach(),
    }
    return TruncationOutput(
        mask=m.clone(),
        rewards=out,
        lengths=length.floor().long(),
        truncated=torch.zeros_like(ok),
        metrics=metrics,
    )


# --------------------------------------------------------------------------------------------------- DLER

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
        rewards, lengths, group, mask: as in :func:`dot`.
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


# ------------------------------------------------------------------------------------ soft compression

_SOFT_METRICS = ("penalised_frac", "mastered_group_frac", "penalty_mean", "reward_mean")


def soft_compression_penalty(
    rewards: FloatB,
    lengths: NumB,
    group: Groups | IntB,
    *,
    mask: BoolBT | None = None,
    correct: float = 1.0,
    mastery: float = 0.75,
    coef: float = 0.5,
    cap: float = 0.5,
    relative: bool = True,
    penalise: Literal["correct", "all"] = "correct",
    experimental: bool = False,
) -> TruncationOutput:
    r"""Sample-level soft compression: penalise long rollouts of mastered prompts that already have a shorter
    correct rollout, in proportion to the excess length over the shortest correct one, capped.

    .. math::  p_g = \tfrac{1}{n_g}\textstyle\sum_{i\in g}[r_i \ge c], \quad
               L^\star_g = \min_{i \in g,\ r_i \ge c} L_i, \quad
               \pi_i = [p_{g} \ge m]\,[L_i > L^\star_g]\,\min\Big(\kappa\,\frac{L_i - L^\star_g}{s_g},\ C\Big),
               \quad \tilde r_i = r_i - \pi_i

    with :math:`s_g = \max(L^\star_g, 1)` (``relative=True``) or 1 (excess in tokens).

    Reference: "sample-level, soft reinforcement learning compression" — known only from its abstract (the paper
    penalises "inefficiently long rollouts, but only on problems where the model has already mastered and
    already produced a more concise rollout"; 20-40% shorter responses). **Reconstructed** (``experimental=True``
    required; every choice below is a keyword): mastery is the group pass rate ``>= mastery`` (0.75, our choice);
    "a more concise rollout" is the shortest correct rollout of the group; the penalty is linear in the excess
    length relative to it (``coef`` 0.5, ``relative``) and capped at ``cap`` (0.5, so a penalised correct rollout
    with reward 1 still beats an incorrect one with 0 — the "soft" part); only correct rollouts are penalised
    unless ``penalise="all"``. The loss mask is unchanged (the compression is a reward signal, not a cut).

    Args:
        rewards: rewards ``[B]``; a row is correct when ``>= correct`` (1).
        lengths: response lengths ``[B]`` in tokens.
        group: group ids ``[B]`` or :class:`~rolloutopt.groups.Groups`.
        mask: loss mask ``[B, T]``, returned unchanged (default: the prefix mask of ``lengths``).
        correct: correctness threshold (1).
        mastery: pass rate in (0, 1] from which a prompt counts as mastered (0.75).
        coef: penalty per unit of (relative) excess length :math:`\kappa` (0.5).
        cap: largest penalty :math:`C` (0.5).
        relative: measure the excess relative to the shortest correct length (default) or in tokens.
        penalise: ``"correct"`` (default) penalises correct rollouts only; ``"all"`` also long incorrect ones.
        experimental: must be True.

    Returns:
        :class:`~rolloutopt.control.TruncationOutput` with ``truncated`` marking the penalised rows; metrics
        ``penalised_frac``, ``mastered_group_frac``, ``penalty_mean`` (over penalised rows), ``reward_mean``.

    Edge cases: the shortest correct rollout (and every correct rollout as short) is never penalised, so a
    singleton group is untouched; groups below the mastery threshold are untouched; an empty batch returns empty
    tensors; an all-inactive batch (lengths 0) is a no-op. Penalties lie in ``[0, cap]``.
    """
    _experimental(experimental, "the sample-level soft compression penalty", _DOCS)
    _real(correct, "correct")
    _real(mastery, "mastery", low=0.0, high=1.0, open_low=True)
    _real(coef, "coef", low=0.0)
    _real(cap, "cap", low=0.0)
    if not isinstance(relative, bool):
        raise InputError("relative", "a bool", describe(relative), "pass True or False")
    choice(penalise, "penalise", ("correct", "all"))
    r, length, m, dims = _rows(rewards, lengths, mask)
    if r.numel() == 0:
        return _empty_output(r, length, m, _SOFT_METRICS)
    g = as_groups(group, dims)
    ok = r >= correct
    mastered = (_pass_rate(ok, g) >= mastery) & (g.count(ok) > 0)
    shortest = g.broadcast(g.min(length, ok))
    target = ok if penalise == "correct" else torch.ones_like(ok)
    hit = g.broadcast(mastered) & target & (length > shortest)
    scale = shortest.clamp(min=1.0) if relative else torch.ones_like(shortest)
    pen = torch.where(hit, (coef * (length - shortest) / scale).clamp(max=cap), torch.zeros_like(length))
    out = r - pen.to(r.dtype)
    metrics = {
        "penalised_frac": _frac(hit),
        "mastered_group_frac": _frac(mastered),
        "penalty_mean": (pen.sum() / hit.sum().clamp(min=1)).float().detach(),
        "reward_mean": out.float().mean().detach(),
    }
    return TruncationOutput(mask=m.clone(), rewards=out, lengths=length.floor().long(), truncated=hit, metrics=metrics)


# --------------------------------------------------------------------------------------------------- SIRI


def siri_max_length(step: int, *, l_lo: int, l_hi: int, period: int, experimental: bool = False) -> int:
    r"""SIRI's maximum rollout length at training step ``step``: a cosine between ``l_lo`` and ``l_hi``.

    .. math::  L(t) = L_{lo} + (L_{hi} - L_{lo})\,\frac{1 - \cos(2\pi\,(t \bmod P) / P)}{2}

    rounded to the nearest int (halves up). It starts in compression (:math:`L(0) = L_{lo}`), reaches the
    expanded end :math:`L(P/2) = L_{hi}` after half a period and returns to :math:`L(P) = L_{lo}`; it rises
    monotonically on :math:`[0, P/2]` and falls on :math:`[P/2, P]`. SIRI-low / SIRI-high checkpoints are the
    ones taken at ``step % period == 0`` and ``period // 2``.

    Reference: SIRI, arXiv 2509.25176 (compression and expansion phases alternate under a *cosine* length
    scheduler). **Reconstructed** (``experimental=True`` required): the exact
    form above, starting in compression; the paper's :math:`L_{lo}`, :math:`L_{hi}` and :math:`P` are not known,
    so they have no defaults.

    Args:
        step: the training step, an int >= 0.
        l_lo: the compressed maximum length (an int >= 1).
        l_hi: the expanded maximum length (an int >= ``l_lo``).
        period: the period :math:`P` in steps (an int >= 1; even for an exact :math:`L(P/2) = L_{hi}`).
        experimental: must be True.

    Returns:
        The maximum response length for this step, an int in ``[l_lo, l_hi]``.
    """
    _experimental(experimental, "SIRI's cosine length schedule", _DOCS)
    t = _int(step, "step", low=0)
    lo = _int(l_lo, "l_lo", low=1)
    hi = _int(l_hi, "l_hi", low=1)
    p = _int(period, "period", low=1)
    if hi < lo:
        raise InputError("l_hi", f"an int >= l_lo = {lo}", repr(hi), "swap l_lo and l_hi")
    phase = (t % p) / p
    value = lo + (hi - lo) * (1.0 - math.cos(2.0 * math.pi * phase)) / 2.0
    return min(hi, max(lo, math.floor(value + 0.5)))


# --------------------------------------------------------------------------------------------------- EGAE

#: ``c ** chunk >= exp(-_LOG_RANGE)``: the scaled flip-cumsum of one chunk stays in float64's normal range.
_LOG_RANGE = 280.0 * math.log(10.0)


def _discounted_reverse_cumsum(x: Tensor, c: float) -> Tensor:
    """``y[..., t] = sum_{k >= t} c**(k - t) * x[..., k]`` along the last dimension.

    ``c == 1``: one flip-cumsum-flip (exact). ``c == 0``: ``x``. Otherwise, in float64, the scaled form
    ``y_t = c**-t * revcumsum(c**k x_k)_t`` over chunks short enough that ``c**chunk`` stays normal, with the
    carry ``c**(end - t) * y_end`` from the next chunk: a Python loop over ``ceil(T / chunk)`` chunks (one chunk
    for ``c >= 0.9`` and ``T <= 6000``), never over tokens.
    """
    t_len = x.shape[-1]
    if t_len == 0 or c == 0.0:
        return x.clone()
    if c == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    x64 = x.to(torch.float64)
    chunk = max(1, int(_LOG_RANGE / -math.log(c)))
    out = torch.empty_like(x64)
    carry = torch.zeros(x64.shape[:-1], dtype=torch.float64, device=x.device)
    end = t_len
    while end > 0:
        start = max(0, end - chunk)
        n = end - start
        j = torch.arange(n, dtype=torch.float64, device=x.device)
        p = torch.pow(torch.tensor(c, dtype=torch.float64, device=x.device), j)
        seg = (x64[..., start:end] * p).flip(-1).cumsum(-1).flip(-1) / p
        seg = seg + carry[..., None] * torch.pow(torch.tensor(c, dtype=torch.float64, device=x.device), n - j)
        out[..., start:end] = seg
        carry = seg[..., 0]
        end = start
    return out.to(x.dtype)


@dataclass(frozen=True)
class EGAEOutput:
    """What :func:`egae` returns.

    Attributes:
        advantages: ``[B, T]`` (0 outside the mask).
        returns: ``[B, T]`` value targets (0 outside the mask).
        value_mask: bool ``[B, T]``: the tokens the value model trains on (finished rows only).
        metrics: detached 0-d tensors ``finished_frac``, ``value_token_frac``, ``advantage_mean``,
            ``bootstrap_mean`` (mean :math:`V(s_l)` over unfinished rows).
    """

    advantages: FloatBT
    returns: FloatBT
    value_mask: BoolBT
    metrics: dict[str, Tensor] = field(default_factory=dict)


def egae(
    values: Float[Tensor, "B _"],
    rewards: PerSeqOrToken,
    mask: BoolBT,
    finished: BoolB,
    *,
    bootstrap: FloatB | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    returns: Literal["mc", "lambda"] = "mc",
    experimental: bool = False,
) -> EGAEOutput:
    r"""T-PPO's extended GAE: advantages for incomplete responses, bootstrapped by the critic at the cut.

    .. math::  \delta_t = r_t + \gamma\,\bar V_{t+1} - V(s_t), \qquad
               \bar V_{t+1} = \begin{cases} V(s_{t+1}) & t + 1 < l \\ V(s_l) & t + 1 = l,\ \text{unfinished}
               \\ 0 & t + 1 = l,\ \text{finished} \end{cases}, \qquad
               A_t = \sum_{k=t}^{l-1} (\gamma\lambda)^{k-t}\,\delta_k

    A response cut at length :math:`l` before it finished bootstraps with the critic's :math:`V(s_l)`; a finished
    response ends in its terminal reward with no bootstrap. With :math:`\gamma = \lambda = 1` and zero
    intermediate rewards, :math:`A_t = V(s_l) - V(s_t)` for an unfinished response and :math:`R - V(s_t)` for a
    finished one with outcome reward :math:`R`.

    Reference: T-PPO (Truncated PPO), ByteDance Seed, arXiv 2506.15050. From the abstract: generation is
    length-restricted per step, incomplete responses are trained on with Extended GAE, and policy and value are
    optimised independently. **Reconstructed** (``experimental=True``
    required): the bootstrap form above, outcome rewards only on finished responses, and the value model trained
    only on finished responses (``value_mask``) with Monte-Carlo returns (``returns="mc"``:
    :math:`G_t = \sum_{k \ge t} \gamma^{k-t} r_k`, plus :math:`\gamma^{l-t} V(s_l)` on unfinished rows, which the
    value mask excludes); ``returns="lambda"`` gives verl's :math:`A_t + V(s_t)` instead. Defaults
    :math:`\gamma = \lambda = 1` are verl's GAE defaults for LLM PPO.

    Computation: a discounted reverse cumulative sum, vectorised over rows and tokens — exactly a flip-cumsum
    when :math:`\gamma\lambda = 1`, otherwise a scaled flip-cumsum in float64 over token chunks short enough to
    stay in range (a loop over ``ceil(T / chunk)`` chunks, one chunk for :math:`\gamma\lambda \ge 0.9` and
    ``T <= 6000``; no loop over tokens).

    Args:
        values: critic values, either ``[B, T+1]`` with ``values[:, t]`` = :math:`V(s_t)` (the state before
            token ``t``) and :math:`V(s_l)` at column :math:`l`, or ``[B, T]`` together with ``bootstrap``.
        rewards: outcome rewards ``[B]`` (placed on the last token of finished rows; unfinished rows earned no
            outcome and their entry is ignored) or per-token rewards ``[B, T]`` (used as given inside the mask).
        mask: right-padded bool ``[B, T]``: row ``i``'s response is its first :math:`l_i` positions.
        finished: bool ``[B]``: the response ended (EOS) within the window; False where it was cut.
        bootstrap: :math:`V(s_l)` ``[B]``, required with ``[B, T]`` values (read for unfinished rows only).
        gamma: discount :math:`\gamma \in [0, 1]` (1).
        lam: GAE :math:`\lambda \in [0, 1]` (1).
        returns: ``"mc"`` (default, the reconstructed rule) or ``"lambda"``.
        experimental: must be True.

    Returns:
        :class:`EGAEOutput`.

    Edge cases: an empty row (:math:`l = 0`) has zero advantages and no value tokens; an all-unfinished batch has
    an all-False ``value_mask``; an empty batch returns empty tensors. The mask must be a prefix mask (checked
    while checks are on), because GAE runs along the response.
    """
    _experimental(experimental, "T-PPO's Extended GAE", _DOCS)
    g_ = _real(gamma, "gamma", low=0.0, high=1.0)
    l_ = _real(lam, "lam", low=0.0, high=1.0)
    choice(returns, "returns", ("mc", "lambda"))
    dims = Dims()
    m = as_mask(mask, "mask", dims, "B T")
    b, t_len = m.shape
    fin = as_mask(finished, "finished", dims, "B", device=m.device)
    length = m.sum(-1)
    pos = torch.arange(t_len, device=m.device)
    if checks_enabled() and bool((m != (pos[None, :] < length[:, None])).any()):
        raise InputError(
            "mask", "a right-padded prefix mask (True then False in every row)", describe(mask), "pad on the right"
        )
    v = as_float(values, "values", device=m.device)
    if checks_enabled() and (v.ndim != 2 or v.shape[0] != b or v.shape[1] not in (t_len, t_len + 1)):
        raise InputError(
            "values",
            f"a tensor [B, T+1] or [B, T] (B={b}, T={t_len} from mask)",
            describe(values),
            "pass V(s_t) for t = 0..T, or [B, T] values with bootstrap=",
        )
    unfinished = ~fin
    if v.shape[1] == t_len + 1:
        if bootstrap is not None:
            raise InputError(
                "bootstrap", "None with [B, T+1] values (V(s_l) is values[:, l])", describe(bootstrap), "drop it"
            )
        full = v
    else:
        if bootstrap is None:
            raise InputError(
                "bootstrap", "V(s_l) [B]: values are [B, T]", "None", "pass bootstrap= or values of shape [B, T+1]"
            )
        boot = as_float(bootstrap, "bootstrap", dims, "B", device=m.device)
        finite(boot, "bootstrap", unfinished)
        boot = torch.where(unfinished, boot, torch.zeros_like(boot)).to(v.dtype)
        full = torch.cat([v, torch.zeros_like(v[:, :1])], dim=1)
        full = full.scatter(1, length[:, None], boot[:, None])
    pos1 = torch.arange(t_len + 1, device=m.device)
    finite(full, "values", pos1[None, :] < (length + unfinished.long())[:, None])
    r = as_float(rewards, "rewards", device=m.device)
    if r.ndim == 1:
        dims.check(r, "rewards", "B")
        finite(r, "rewards", fin)
        last = (length - 1).clamp(min=0)
        outcome = torch.where(fin & (length > 0), r, torch.zeros_like(r)).to(full.dtype)
        rt = torch.zeros(b, t_len, dtype=full.dtype, device=m.device)
        if t_len > 0:
            rt = rt.scatter(1, last[:, None], outcome[:, None])
    else:
        dims.check(r, "rewards", "B T")
        finite(r, "rewards", m)
        rt = torch.where(m, r, torch.zeros_like(r)).to(full.dtype)
    at_end = pos[None, :] == (length - 1)[:, None]
    v_t = torch.where(m, full[:, :t_len], torch.zeros_like(full[:, :t_len]))
    v_next = full[:, 1:]
    v_next = torch.where(at_end & fin[:, None], torch.zeros_like(v_next), v_next)
    v_next = torch.where(m, v_next, torch.zeros_like(v_next))
    delta = torch.where(m, rt + g_ * v_next - v_t, torch.zeros_like(rt))
    adv = _discounted_reverse_cumsum(delta, g_ * l_)
    if returns == "lambda":
        ret = torch.where(m, adv + v_t, torch.zeros_like(adv))
    else:
        boot_row = full.gather(1, length[:, None]).squeeze(1)
        extra = torch.where(at_end & unfinished[:, None], g_ * boot_row[:, None], torch.zeros_like(rt))
        ret = torch.where(m, _discounted_reverse_cumsum(rt + extra, g_), torch.zeros_like(rt))
    value_mask = m & fin[:, None]
    has = unfinished & (length > 0)
    boot_vals = full.gather(1, length[:, None]).squeeze(1)
    metrics = {
        "finished_frac": _frac(fin),
        "value_token_frac": (value_mask.sum() / m.sum().clamp(min=1)).float().detach(),
        "advantage_mean": (adv.sum() / m.sum().clamp(min=1)).float().detach(),
        "bootstrap_mean": (torch.where(has, boot_vals, torch.zeros_like(boot_vals)).sum() / has.sum().clamp(min=1))
        .float()
        .detach(),
    }
    return EGAEOutput(advantages=adv, returns=ret, value_mask=value_mask, metrics=metrics)


# ------------------------------------------------------------------------------------------------- registry
REGISTRY: Registry[Callable[..., Any]] = Registry("post-hoc rule")
"""The post-hoc rule functions by name (``get("dot")(rewards=..., lengths=..., group=..., experimental=True)``);
filled by :mod:`rolloutopt.control`, which also registers Step-GRPO's :func:`~rolloutopt.control.step_aware_reward`.
Each entry's ``requires`` are the batch tensors the function cannot run without (passing None raises an
:class:`~rolloutopt.errors.InputError` naming it), ``accepts`` the optional ones (``mask``)."""


def get(name: str) -> Callable[..., Any]:
    """The post-hoc rule function registered as ``name`` (an :class:`~rolloutopt.errors.InputError` lists them)."""
    return REGISTRY.get(name)


def entry(name: str) -> Entry[Callable[..., Any]]:
    """The :class:`~rolloutopt.registry.Entry` of post-hoc rule ``name`` (function, ``requires``, ``accepts``,
    ``reference``, ``experimental``)."""
    return REGISTRY.entry(name)


def names() -> list[str]:
    """Names of every registered post-hoc rule, sorted."""
    return REGISTRY.names()


def register(
    name: str,
    fn: Callable[..., Any],
    *,
    requires: tuple[str, ...] = (),
    accepts: tuple[str, ...] = (),
    reference: str = "",
    experimental: str | None = None,
    overwrite: bool = False,
) -> Callable[..., Any]:
    """Register a post-hoc rule function with its declarations; a different function under a taken name raises
    unless ``overwrite``."""
    return REGISTRY.register(
        name,
        fn,
        requires=requires,
        accepts=accepts,
        reference=reference,
        experimental=experimental,
        overwrite=overwrite,
    )
