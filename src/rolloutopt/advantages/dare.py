"""DARE: label-free rewards for test-time RL from the answer distribution of a group.

:func:`dare_rewards` turns the answer distribution of a group into rewards for test-time RL (TTRL), with
distribution pruning and an exploration bonus. The formula is **reconstructed** (see ``docs/methods/prior.md``):
neither the paper's code nor its full text was available, only the abstract and public summaries. Every
reconstructed detail is a keyword, and each call raises unless ``experimental=True`` acknowledges it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_index,
    as_mask,
    checks_enabled,
    finite,
    positive,
)
from rolloutopt.advantages._base import SHAPERS
from rolloutopt.advantages.v05 import _experimental, _frac
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolB, FloatB, IntB

__all__ = ["DAREOutput", "dare_rewards"]


def _number(value: Any, name: str, low: float, high: float, *, fix: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        raise InputError(name, f"a number in [{low}, {high}]", repr(value), fix)


@dataclass(frozen=True)
class DAREOutput:
    """What :func:`dare_rewards` returns: label-free rewards to feed an advantage estimator (e.g. ``grpo``).

    Attributes:
        rewards: the DARE reward per rollout ``[B]`` (0 for invalid rows and rows without an answer).
        weight: 1 for rows that count, 0 for invalid rows (as ``AdvantageOutput.weight``); pass it on as the
            ``valid`` mask of the advantage estimator.
        metrics: detached 0-d tensors (see :func:`dare_rewards`).
        answer_prob: :math:`\\hat p(a_i)`, the share of the group holding row ``i``'s answer ``[B]``.
        majority: bool ``[B]``, True where row ``i`` holds a most frequent answer of its group (ties: all).
        pruned: bool ``[B]``, True where the answer's share is below the pruning threshold.
        bonus: the exploration bonus added to each row ``[B]``.
    """

    rewards: FloatB
    weight: FloatB
    metrics: dict[str, Tensor]
    answer_prob: FloatB
    majority: Bool[Tensor, " B"]
    pruned: Bool[Tensor, " B"]
    bonus: FloatB


_DIRECT_CELLS = 4  # a direct (group, answer) table up to this many cells per row; a sort beyond it


_INT64_SAFE = 2**62


def _cells(g: Groups, a: Tensor) -> tuple[Tensor, int]:
    """A cell index ``[B]`` per distinct (group, answer) pair, and the number of cells (some may be empty).

    The key ``group * span + (answer - min)`` is unique per pair. When the table ``G * span`` is small it is
    the cell itself (no sort); otherwise one 1-d sort compacts it. Answers whose range would overflow int64
    are compacted first. The cells' numbering differs from a ``torch.unique`` over the stacked pairs, but
    each cell holds the same rows in the same order, so index_add gives the same sums.
    """
    lo_hi = torch.stack([a.min(), a.max()]).tolist()
    lo, span = int(lo_hi[0]), int(lo_hi[1]) - int(lo_hi[0]) + 1
    if g.num_groups * span >= _INT64_SAFE:
        a_dense = torch.unique(a, return_inverse=True)[1]
        lo, span = 0, int(a_dense.max()) + 1
        a = a_dense
    key = g.inverse * span + (a - lo if lo != 0 else a)
    cells = g.num_groups * span
    if cells <= _DIRECT_CELLS * g.num_rows:
        return key, cells
    uniq, cell = torch.unique(key, return_inverse=True)
    return cell, int(uniq.numel())


def dare_rewards(
    answers: IntB,
    group: Groups | IntB,
    *,
    confidence: FloatB | None = None,
    uncertainty: FloatB | None = None,
    prune: float = 0.1,
    renormalize: bool = False,
    bonus: float = 0.1,
    bonus_quantile: float = 0.5,
    bonus_pruned: bool = False,
    null_answer: int | None = None,
    experimental: bool = False,
    valid: BoolB | None = None,
) -> DAREOutput:
    r"""DARE reward for test-time RL: the share of the group that agrees with a rollout's answer.

    .. math::  \hat p(a) = \frac{\sum_{j\in g,\ a_j = a} c_j}{\sum_{j\in g} c_j}, \qquad
               r_i = \hat p(a_i)\,\mathbb 1[\hat p(a_i) \ge \rho]
                     + \beta\,\mathbb 1[a_i \ne a_{\mathrm{MV}}]\,\mathbb 1[u_i \le q_g]

    with confidences :math:`c_j` (1 by default, so :math:`\hat p` is the answer frequency), pruning threshold
    :math:`\rho` (``prune``), bonus :math:`\beta`, and :math:`q_g` the ``bonus_quantile`` of the uncertainties
    in the group. Instead of TTRL's majority-vote reward :math:`\mathbb 1[a_i = a_{\mathrm{MV}}]`, every answer
    earns its share of the distribution; pruning zeroes rare answers (denoising), and the bonus rewards
    confident minority answers (exploration). Reference: arXiv 2601.21804 (DARE), on TTRL (arXiv 2504.16084).

    **Reconstructed** (from the abstract only; ``docs/methods/prior.md``): the reward as the share, the
    pruning rule, the bonus form, the uncertainty measure (an input) and all defaults. ``prune=0.1``,
    ``bonus=0.1`` and ``bonus_quantile=0.5`` (below the group median) are the project's choices.

    Args:
        answers: int64 id of each rollout's final answer ``[B]`` (canonicalised answers hashed to ints by the
            caller; only equality within a group matters).
        group: group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`.
        confidence: optional non-negative weight per rollout ``[B]`` for confidence-weighted counts (e.g. the
            exponentiated mean token log-prob); a group whose confidences sum to 0 gets shares 0.
        uncertainty: optional uncertainty per rollout ``[B]`` (e.g. mean token entropy); lower is more
            certain. Without it no bonus is given.
        prune: :math:`\rho`; shares below it earn 0 (0 turns pruning off).
        renormalize: divide the kept shares by the kept mass of the group, so that they sum to 1 over kept
            answers (with a large ``prune`` this tends to a hard majority vote); default False.
        bonus: :math:`\beta`, added to rows whose answer is not a majority answer and whose uncertainty is at
            most the group's ``bonus_quantile`` (linear interpolation, over rows with an answer).
        bonus_pruned: whether a pruned answer can earn the bonus (default False: pruning wins).
        null_answer: id meaning "no answer extracted": such rows count in the denominator, earn 0, are never
            the majority and get no bonus. None: every id is an answer.
        experimental: must be True: it acknowledges the reconstructed formula (otherwise an ``InputError``).
        valid: optional mask ``[B]`` of rows that count at all; others get reward 0 and weight 0.

    Returns:
        :class:`DAREOutput`; metrics ``majority_frac``, ``pruned_frac`` (rows whose reward pruning zeroed),
        ``bonus_frac``, ``null_answer_frac``, ``excluded_frac``, ``consensus_mean`` (mean top share per group)
        and ``reward_mean``.

    Edge cases: a singleton group's answer has share 1 (it is its own majority). A group whose rows all agree
    gives every row 1 (so GRPO on top gives 0 advantage). The rewards are invariant to permutations, to
    relabelling groups and answers, and to scaling a group's confidences by a positive constant.
    """
    _experimental("dare_rewards", experimental)
    _number(prune, "prune", 0.0, 1.0, fix="pass the pruning threshold as a share, e.g. 0.1 (0 disables)")
    _number(bonus_quantile, "bonus_quantile", 0.0, 1.0, fix="pass a quantile in [0, 1], e.g. 0.5 (the median)")
    positive(bonus, "bonus", strict=False)
    for flag, fname in ((renormalize, "renormalize"), (bonus_pruned, "bonus_pruned")):
        if not isinstance(flag, bool):
            raise InputError(fname, "a bool", repr(flag), f"pass {fname}=True or False")
    if null_answer is not None and (not isinstance(null_answer, int) or isinstance(null_answer, bool)):
        raise InputError("null_answer", "an int answer id or None", repr(null_answer), "pass the id, e.g. -1")

    dims = Dims()
    a = as_index(answers, "answers", dims, "B")
    g = as_groups(group, dims)
    v = None if valid is None else as_mask(valid, "valid", dims, "B", device=a.device)
    dtype = torch.float32
    c: Tensor | None = None
    if confidence is not None:
        c = as_float(confidence, "confidence", dims, "B", device=a.device)
        finite(c, "confidence", v)
        if checks_enabled() and bool(((c < 0) if v is None else (c < 0) & v).any()):
            raise InputError(
                "confidence", "non-negative weights", "negative values", "pass exp(mean logp) or another weight >= 0"
            )
        dtype = c.dtype
    u: Tensor | None = None
    if uncertainty is not None:
        u = as_float(uncertainty, "uncertainty", dims, "B", device=a.device)
        finite(u, "uncertainty", v)
        dtype = torch.promote_types(dtype, u.dtype)
        u = u.to(dtype)
    if c is not None:
        c = c.to(dtype)
    if checks_enabled() and a.device != g.inverse.device:
        raise InputError("group", f"a tensor on {a.device}", str(g.inverse.device), "move group to the answers' device")

    one = torch.ones(a.shape, dtype=dtype, device=a.device)
    counted = one if v is None else v.to(dtype)
    mass = counted if c is None else torch.where(counted > 0, c, torch.zeros_like(c))
    has_answer = torch.ones_like(a, dtype=torch.bool) if null_answer is None else a != null_answer
    if v is not None:
        has_answer = has_answer & v
    # One (group, answer) cell per distinct pair, no loop over groups.
    cell, num_cells = _cells(g, a)
    cell_mass = torch.zeros(num_cells, dtype=dtype, device=a.device).index_add(0, cell, mass)
    total = g.broadcast(g.sum(mass))
    share = cell_mass.index_select(0, cell) / torch.where(total > 0, total, torch.ones_like(total))
    share = torch.where(has_answer & (total > 0), share, torch.zeros_like(share))
    # every row has an answer without null_answer and valid: the unmasked (dense when sizes agree) max
    top = g.max(share, None if null_answer is None and v is None else has_answer)
    majority = has_answer & (share == g.broadcast(top)) & (share > 0)
    pruned = has_answer & (share < prune)
    kept = torch.where(pruned, torch.zeros_like(share), share)
    if renormalize:
        kept_mass = g.broadcast(g.sum(torch.where(pruned | ~has_answer, torch.zeros_like(mass), mass)))
        kept = torch.where(
            kept_mass > 0, kept * total / torch.where(kept_mass > 0, kept_mass, total.clamp(min=1)), kept
        )
    extra = torch.zeros_like(share)
    if u is not None and bonus > 0:
        q = g.quantile(u, bonus_quantile, has_answer)
        eligible = has_answer & ~majority & (u <= g.broadcast(q))
        if not bonus_pruned:
            eligible = eligible & ~pruned
        extra = torch.where(eligible, torch.full_like(share, bonus), extra)
    rewards = kept + extra
    weight = counted
    w = weight.detach()
    groups_with_rows = (g.count(v) > 0).to(dtype)
    metrics = {
        "majority_frac": _frac(majority.to(dtype), w),
        "pruned_frac": _frac((pruned & (share > 0)).to(dtype), w),
        "bonus_frac": _frac((extra > 0).to(dtype), w),
        "null_answer_frac": _frac((~has_answer).to(dtype) * w, w),
        "excluded_frac": (1 - w).mean(),
        "consensus_mean": _frac(top.detach() * groups_with_rows, groups_with_rows),
        "reward_mean": _frac(rewards.detach() * w, w),
    }
    return DAREOutput(
        rewards=rewards,
        weight=weight,
        metrics=metrics,
        answer_prob=share,
        majority=majority,
        pruned=pruned,
        bonus=extra,
    )


SHAPERS.register(
    "dare_rewards",
    dare_rewards,
    requires=("answers", "group"),
    accepts=("confidence", "uncertainty", "valid"),
    reference="DARE arXiv 2601.21804, on TTRL arXiv 2504.16084 (no public code)",
    experimental="the share-of-the-group reward, the pruning rule, the bonus form and every default are "
    "reconstructed from the abstract (no public code)",
)
