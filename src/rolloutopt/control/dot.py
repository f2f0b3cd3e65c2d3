"""DOT — dynamic outlier truncation of the extreme length tail inside fully-correct groups (arXiv 2601.03969).

:func:`dot` is a post-hoc length rule (returns a :class:`~rolloutopt.control.TruncationOutput`; the threshold
rule is reconstructed, ``experimental=True``). Provenance and worked examples: ``docs/methods/length_rules.md``.
"""

from __future__ import annotations

from typing import Literal

import torch

from rolloutopt._length_rules import (
    _DOCS,
    TruncationOutput,
    _cut,
    _empty_output,
    _experimental,
    _frac,
    _rows,
    _token_metrics,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt._validation import choice, describe
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolBT, FloatB, IntB, NumB

__all__ = ["dot"]

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
