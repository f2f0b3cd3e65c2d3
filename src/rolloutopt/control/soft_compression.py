"""Sample-level soft RL compression: penalise long rollouts of mastered prompts (abstract only, reconstructed).

:func:`soft_compression_penalty` is a post-hoc length rule (returns a
:class:`~rolloutopt.control.TruncationOutput`). Provenance and worked examples: ``docs/methods/length_rules.md``.
"""

from __future__ import annotations

from typing import Literal

import torch

from rolloutopt._length_rules import _DOCS, TruncationOutput, _empty_output, _experimental, _frac, _pass_rate, _rows
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt._validation import choice, describe
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolBT, FloatB, IntB, NumB

__all__ = ["soft_compression_penalty"]

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
