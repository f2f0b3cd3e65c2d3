"""JET — Just-Enough Thinking (arXiv 2509.23392; from the authors' code, ``JinyiHan99/Just-Enough-Think``).

- :func:`jet_truncation_points` — where each full response is cut before the answer-forcing suffix;
- :func:`jet_group_layout` — which rows of a group are full responses and which their truncated variants;
- :func:`jet_reward` — the length-bonus reward (a post-hoc rule: returns a
  :class:`~rolloutopt.control.TruncationOutput`).

Provenance and worked examples: ``docs/methods/length_rules.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from rolloutopt._length_rules import TruncationOutput, _empty_output, _frac, _lengths, _mask
from rolloutopt._validation import Dims, as_float, as_mask, choice, describe, finite
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, IntB, NumB

__all__ = ["JETLayout", "jet_group_layout", "jet_reward", "jet_truncation_points"]

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
