"""D³S, Dynamic Dual-level Down-Sampling (arXiv 2509.22115): which rollouts and tokens of a group enter the loss.

:func:`d3s` keeps, per group, the rollouts whose advantages have the largest variance and, within them, the tokens
with the largest ``|A|·H``; :func:`d3s_schedule` is the linear curriculum that relaxes both budgets over training.
Every excluded rollout gets weight 0 and every excluded token is False in the returned token mask; the metrics
report the fractions, so nothing is dropped silently.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_index,
    as_mask,
    checks_enabled,
    choice,
    describe,
    finite,
)
from rolloutopt.advantages._base import SELECTORS, AdvantageOutput
from rolloutopt.advantages.reference import _emptied
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import (
    BoolB,
    BoolBT,
    FloatB,  # noqa: F401 - resolves the inherited fields of D3SOutput's generated __init__
    FloatBT,
    IntB,
    PerSeqOrToken,
)

__all__ = ["D3SOutput", "d3s", "d3s_schedule"]


def _fraction(value: Any, name: str, *, open_low: bool = True) -> float:
    """A number in (0, 1] (or [0, 1] with ``open_low=False``), else an InputError naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (0.0 < value <= 1.0) if open_low else (0.0 <= value <= 1.0)
    if not ok:
        interval = "(0, 1]" if open_low else "[0, 1]"
        raise InputError(name, f"a number in {interval}", describe(value), f"pass {name} as a fraction in {interval}")
    return float(value)


def _pair(value: Any, name: str) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InputError(name, "a pair (init, final) of fractions in (0, 1]", describe(value), f"pass {name}=(a, b)")
    return _fraction(value[0], f"{name}[0]"), _fraction(value[1], f"{name}[1]")


def _round_half_up(x: Tensor) -> Tensor:
    return torch.floor(x + 0.5).long()


@dataclass(frozen=True, kw_only=True)
class D3SOutput(AdvantageOutput):
    """What :func:`d3s` returns: an :class:`AdvantageOutput` plus the token mask of the token level.

    Attributes:
        advantages: the input advantages, unchanged (``[B]`` or ``[B, T]``): D³S normalises on the *full*
            group and does not re-normalise the selected subset.
        weight: ``[B]``, 1 for a rollout the sample level keeps, 0 for one it drops (and for invalid rows).
        token_mask: bool ``[B, T]``, True for the tokens the token level keeps (always inside ``mask`` and
            inside the kept rollouts). Pass it as the loss mask, with the full mask's token count as the
            denominator if the loss should keep its scale.
        metrics: ``sample_keep_frac``, ``excluded_frac`` (valid rollouts dropped), ``token_keep_frac`` (kept
            tokens over the masked-in tokens of valid rollouts), ``sample_frac`` and ``token_frac`` (the
            schedule's values at this progress) and ``selected_adv_var`` (mean over groups of the population
            variance of the kept advantages).
    """

    token_mask: Bool[Tensor, "B T"]


def d3s_schedule(
    progress: float, *, sample_frac: tuple[float, float] = (0.5, 1.0), token_frac: tuple[float, float] = (0.2, 1.0)
) -> tuple[float, float]:
    r"""The D³S curriculum: sample and token budgets at training progress ``p`` in [0, 1].

    .. math::  [N_s(p), K(p)] = (1-p)\,[N_\text{init}, K_\text{init}] + p\,[N_\text{final}, K_\text{final}]

    Reference: arXiv 2509.22115 (linear schedule, aggressive early, relaxed late). The budgets are fractions
    here (of each group's valid rollouts, and of the kept rollouts' tokens); the default values are ours (the
    paper's are not public): half the rollouts and 20% of their tokens at the start (the paper reports < 20%
    token usage early), everything at the end.

    Returns:
        ``(sample_frac, token_frac)`` at ``progress``.
    """
    p = _fraction(progress, "progress", open_low=False)
    s0, s1 = _pair(sample_frac, "sample_frac")
    k0, k1 = _pair(token_frac, "token_frac")
    return (1 - p) * s0 + p * s1, (1 - p) * k0 + p * k1


def _progress(progress: float | None, step: int | None, total_steps: int | None) -> float:
    if progress is not None:
        if step is not None or total_steps is not None:
            raise InputError("progress", "either progress or step/total_steps", "both", "pass only one of them")
        return _fraction(progress, "progress", open_low=False)
    if step is None and total_steps is None:
        return 0.0
    if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 1:
        raise InputError("total_steps", "a positive int", describe(total_steps), "pass the number of training steps")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InputError("step", "a non-negative int", describe(step), "pass the current training step (0-based)")
    return min(step / total_steps, 1.0)


def _split_budget(budget: Tensor, n_pos: Tensor, n_neg: Tensor, pos_frac: float) -> tuple[Tensor, Tensor]:
    """Positive and negative counts ``[G]``: the balanced split, topped up from the other side when one side
    has too few rows (zero-advantage rows are never taken)."""
    want_pos = _round_half_up(budget.to(torch.float64) * pos_frac)
    q = torch.minimum(budget - want_pos, n_neg)
    p = torch.minimum(n_pos, budget - q)  # leftover negative slots go to the positives ...
    q = torch.minimum(n_neg, budget - p)  # ... and leftover positive slots to the negatives
    return p, q


def _clean(x: Tensor, *, nonnegative: bool = False) -> bool:
    """Whether every value of ``x`` is finite (and >= 0 with ``nonnegative``): one min/max pass, one sync.

    Used as a fast pre-check with ``x`` zeroed where a mask is off (``x * mask``): a non-finite value there
    gives NaN and a false alarm, which the caller resolves with the exact masked checks.
    """
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    ok = (lo >= 0 if nonnegative else lo > float("-inf")) & (hi < float("inf"))  # False for NaN
    return bool(ok)


def _ordered_bits(x: Tensor) -> Tensor:
    """An integer tensor with the order of the floats ``x`` (same width; -0.0 and 0.0 both map to 0).

    Sign-magnitude to two's complement: ``sign(x) · |bits(x)|``. Exact for every non-NaN value, including
    infinities and subnormals, so comparisons and stable sorts of the result agree with those of ``x``.
    NaNs map beyond the infinities (by payload and sign).
    """
    bits = x.contiguous().view(torch.int32 if x.dtype == torch.float32 else torch.int64)
    width = bits.element_size() * 8
    sign = bits >> (width - 1)  # 0 or -1
    return ((bits & ((1 << (width - 1)) - 1)) ^ sign) - sign


def _select_balanced(a: Tensor, g: Groups, budget: Tensor, valid: Tensor | None, pos_frac: float) -> Tensor:
    """The ``p`` largest positives and ``q`` most negative advantages of each group, ties in row order.

    The ranks of ``Groups.rank`` from one stable sort instead of four: rows sorted by (group, side, -|A|),
    with side 0 for the positives, 1 for the negatives and 2 for the rest, list each group's positives by
    decreasing value, then its negatives by increasing value; a row's rank on its side is its position minus
    the start of its (group, side) run. The key is the floats' bits (``|A|`` of one sign is ordered as its
    bits), since integers sort several times faster than floats on the CPU.
    """
    pos, neg = a > 0, a < 0
    if valid is not None:
        pos, neg = valid & pos, valid & neg
    num_groups = g.num_groups
    side = 2 - (pos.view(torch.uint8) * 2 + neg.view(torch.uint8))  # 0, 1, 2 (arithmetic: no slow where)
    cell = g.inverse * 3 + side  # (group, side)
    counts = torch.bincount(cell, minlength=3 * num_groups)
    per_group = counts.view(num_groups, 3)
    p, q = _split_budget(budget, per_group[:, 0], per_group[:, 1], pos_frac)
    int_type = torch.int32 if a.dtype == torch.float32 else torch.int64
    # -|A| as a non-negative integer, increasing as |A| decreases (rows of side 2 get arbitrary values)
    value = torch.iinfo(int_type).max - a.abs().view(int_type).long()
    if int_type == torch.int32 and 3 * num_groups <= 2**31:
        sorted_key, perm = torch.sort((cell << 31) | value, stable=True)  # value < 2^31: one int64 key
        sorted_cell = sorted_key >> 31
    else:
        by_value = torch.sort(value, stable=True).indices
        sorted_cell, by_cell = torch.sort(cell.index_select(0, by_value), stable=True)
        perm = by_value.index_select(0, by_cell)
    # a run of (group, side) starts at its exclusive cumulative count; its first p (q, 0) rows are kept
    limit = torch.stack([p, q, torch.zeros_like(p)], 1).view(-1)
    end = counts.cumsum(0) - counts + limit
    kept_sorted = torch.arange(g.num_rows, device=a.device) < end.index_select(0, sorted_cell)
    return torch.empty_like(kept_sorted).scatter_(0, perm, kept_sorted)


def _select_optimal(a: Tensor, g: Groups, budget: Tensor, valid: Tensor) -> Tensor:
    """The exact maximiser of the subset's population variance among the non-zero advantages.

    A maximum-variance k-subset of reals always consists of the j smallest and the k - j largest values for
    some j (moving an interior point outward never lowers the variance), so it suffices to scan j = 0..k with
    prefix sums of the sorted values: O(G · max group size), vectorised.
    """
    nz = valid & (a != 0)
    n = g.count(nz)
    k = torch.minimum(budget, n)
    rank = g.rank(a, nz)  # ascending position among the group's non-zero values, -1 elsewhere
    width = g.max_size
    x = a.detach().to(torch.float64)
    srt = torch.zeros(g.num_groups, width, dtype=torch.float64, device=a.device)
    # rows outside nz add an exact 0 at position 0 (no host sync from nonzero())
    srt.index_put_((g.inverse, rank.clamp(min=0)), torch.where(nz, x, torch.zeros_like(x)), accumulate=True)
    zero = torch.zeros(g.num_groups, 1, dtype=torch.float64, device=a.device)
    s1 = torch.cat([zero, srt.cumsum(1)], 1)  # [G, width + 1]
    s2 = torch.cat([zero, (srt * srt).cumsum(1)], 1)
    j = torch.arange(width + 1, device=a.device)[None, :]  # number taken from the bottom
    top_start = (n[:, None] - (k[:, None] - j)).clamp(0, width)
    jj = j.clamp(max=width).expand(g.num_groups, -1)
    total = s1.gather(1, jj) + s1.gather(1, n[:, None].expand_as(jj)) - s1.gather(1, top_start)
    sq = s2.gather(1, jj) + s2.gather(1, n[:, None].expand_as(jj)) - s2.gather(1, top_start)
    kf = k[:, None].clamp(min=1).to(torch.float64)
    var = sq / kf - (total / kf) ** 2
    var = torch.where(j <= k[:, None], var, torch.full_like(var, -1.0))
    best = var.argmax(1)  # first maximiser: fewest taken from the bottom
    jb, kb, nb = g.broadcast(best), g.broadcast(k), g.broadcast(n)
    return nz & ((rank < jb) | (rank >= nb - (kb - jb)))


def _flat_nonzero(mask: Tensor) -> Tensor:
    """``torch.nonzero(mask).squeeze(1)`` for a sparse 1-d bool mask, several times faster on the CPU: a
    first pass over the mask read as int64 words (8 flags each) finds the words with a True flag."""
    if mask.numel() % 8 or not mask.is_contiguous() or mask.storage_offset() % 8:
        return torch.nonzero(mask).squeeze(1)
    words = torch.nonzero(mask.view(torch.int64)).squeeze(1)
    candidates = (words[:, None] * 8 + torch.arange(8, device=mask.device)).view(-1)
    return candidates[mask.index_select(0, candidates)]


def _top_by_rank(
    digit: Tensor, budget: Tensor, tie_values: Callable[[Tensor], Tensor], scratch: Tensor | None = None
) -> Tensor:
    """Bool mask of the ``budget`` largest entries of a 1-d tensor of values, ties in index order.

    Exactly ``rank < budget`` for the ranks of a stable descending argsort of the values, without sorting
    them: ``digit`` (ints in ``[0, 2^16)``) must be non-decreasing in the values (e.g. their top 16 bits). A
    histogram of the digits finds the bucket that holds the ``budget``-th largest value; every entry of a
    higher bucket is kept, and only the entries of that bucket are sorted by ``tie_values(indices)`` (one
    host synchronisation, to gather them). ``scratch``: a uint8 buffer like ``digit`` that may be overwritten.
    """
    radix = 1 << 16
    hist = torch.bincount(digit, minlength=radix)
    prefix = hist.cumsum(0)  # [b]: entries whose digit is <= b; the tail from b holds total - prefix[b - 1]
    total = prefix[-1]
    # the highest bucket b whose tail holds budget entries: the number of b' < radix - 1 with
    # prefix[b'] <= total - budget
    b = torch.searchsorted(prefix[:-1], (total - budget).reshape(1), right=True).reshape(())
    rem = budget - (total - prefix[b])  # entries still to take from bucket b (0 when budget is 0)
    # comparisons into uint8 buffers (viewed as bool) run several times faster than into bool ones; one
    # buffer serves both (the tied entries first, then the output)
    buffer = scratch if scratch is not None else torch.empty(digit.shape, dtype=torch.uint8, device=digit.device)
    tied = _flat_nonzero(torch.eq(digit, b, out=buffer).view(torch.bool))
    out = torch.gt(digit, b, out=buffer).view(torch.bool)
    order = torch.sort(tie_values(tied), descending=True, stable=True).indices  # tied is in index order
    take = torch.empty(tied.numel(), dtype=torch.bool, device=digit.device)
    take.scatter_(0, order, torch.arange(tied.numel(), device=digit.device) < rem)
    return out.index_put_((tied,), take)


def _batch_budget(count: Tensor, frac: float) -> Tensor:
    return torch.where(count > 0, _round_half_up(count.to(torch.float64) * frac).clamp(min=1), count)


def _token_keep_nonnegative(scale: Tensor, h: Tensor, m: Tensor, keep: Tensor, frac: float) -> Tensor:
    """``_token_keep(scale * h, m & keep[:, None], frac, "batch")`` where every key ``scale * h`` on a token of
    ``m & keep`` is >= 0 (or -0.0) and not NaN (``scale`` is ``[B, 1]`` or ``[B, T]``).

    The bits of such keys are ordered, so their top 16 bits (less the sign bit, set only by -0.0) are the
    digits of :func:`_top_by_rank`, shifted up past 0; digit 0 marks the ineligible tokens, all
    tied below every eligible key (as the -inf of the masked sort), so none is kept. Rows outside ``keep``
    get a NaN scale: a NaN product (whatever ``h`` holds) is quiet, so its top bits are at least those of
    the quiet NaN (0x7FC0 in fp32, 0x7FF8 in fp64), which the clamp and shift map to 0. Every ``[B, T]`` buffer
    is reused in place,
    since on the CPU a fresh one costs more (page faults) than the arithmetic on it, and there is no
    ``where`` or ``masked_fill`` on ``[B, T]`` (several times slower than the arithmetic).
    """
    nan = torch.full((), float("nan"), dtype=scale.dtype, device=scale.device)
    scale_kept = torch.where(keep[:, None], scale, nan)
    key = scale_kept * h
    int_type = torch.int32 if key.dtype == torch.float32 else torch.int64
    digit = key.view(-1).view(int_type)
    digit.bitwise_right_shift_(torch.iinfo(int_type).bits - 16).bitwise_and_(0x7FFF)
    quiet_nan = 0x7FC0 if int_type == torch.int32 else 0x7FF8  # the top 16 bits of every quiet NaN are >= it
    digit.clamp_(max=quiet_nan).add_(0x8000 - quiet_nan).bitwise_and_(0x7FFF)  # NaN -> 0, others shifted up
    digit.mul_(m.reshape(-1).view(torch.uint8))
    budget = _batch_budget(torch.count_nonzero(digit), frac)
    h_flat, width = h.reshape(-1), h.shape[1]

    def tie_values(idx: Tensor) -> Tensor:  # the same products scale * h, at the tied (eligible) tokens only
        s = scale.reshape(-1).index_select(0, idx // width if scale.shape[1] == 1 else idx)
        return s * h_flat.index_select(0, idx)

    return _top_by_rank(digit, budget, tie_values).view(key.shape)


def _token_keep(key: Tensor, eligible: Tensor, frac: float, level: str) -> Tensor:
    """The top ``frac`` of the eligible tokens by ``key``: over the whole batch or within each row."""
    if level == "batch":
        budget = _batch_budget(torch.count_nonzero(eligible), frac)
        k_flat = torch.where(eligible.reshape(-1), key.reshape(-1), float("-inf"))
        o = _ordered_bits(k_flat)
        o = torch.where(torch.isnan(k_flat), torch.iinfo(o.dtype).max, o)  # NaNs first in torch's sort, alike
        digit = (o >> (o.element_size() * 8 - 16)) + (1 << 15)  # the signed top 16 bits, as [0, 2^16)
        mask = _top_by_rank(digit, budget, lambda idx: o.index_select(0, idx))
        return eligible & mask.reshape(key.shape)
    k_masked = torch.where(eligible, key, torch.full_like(key, float("-inf")))
    count = eligible.sum(1)
    budget = torch.where(count > 0, _round_half_up(count.to(torch.float64) * frac).clamp(min=1), count)
    order = torch.argsort(k_masked, dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(key.shape[1], device=key.device).expand_as(order))
    return eligible & (ranks < budget[:, None])


def d3s(
    advantages: PerSeqOrToken,
    group: Groups | IntB,
    entropy: FloatBT,
    mask: BoolBT,
    *,
    progress: float | None = None,
    step: int | None = None,
    total_steps: int | None = None,
    sample_frac: tuple[float, float] = (0.5, 1.0),
    token_frac: tuple[float, float] = (0.2, 1.0),
    sample_level: Literal["group", "batch"] = "group",
    split: Literal["balanced", "optimal"] = "balanced",
    pos_frac: float = 0.5,
    token_level: Literal["batch", "sequence"] = "batch",
    valid: BoolB | None = None,
) -> D3SOutput:
    r"""D³S: keep the rollouts that maximise advantage variance and, in them, the tokens with the largest |A|·H.

    Sample level: in each group choose a subset :math:`S` of :math:`N_s` rollouts maximising
    :math:`\operatorname{Var}(A_S)`, by taking the :math:`N_\text{pos}` largest positive and the
    :math:`N_\text{neg}` most negative advantages. Token level: within the kept rollouts keep the top
    :math:`K` fraction of tokens by

    .. math::  \kappa_{i,t} = |A_{i,t}|\cdot H_{i,t},

    and the budgets follow the linear curriculum of :func:`d3s_schedule`,
    :math:`[N_s, K](p) = (1-p)[N_\text{init}, K_\text{init}] + p[N_\text{final}, K_\text{final}]`.

    Reference: "Learning More with Less: A Dynamic Dual-Level Down-Sampling Framework for Efficient Policy
    Optimization", arXiv 2509.22115 (ICLR 2026). The rules above and the cross-group variant are the paper's;
    its code is not public, so the following are our choices, each a keyword: budgets as fractions (of the
    group's valid rollouts, of the kept tokens), their defaults, the balanced split with top-up, rounding
    half up with at least one rollout per non-empty group and one token per non-empty pool, tie-breaking by
    row (and position) order, and the batch-wide token pool.

    Args:
        advantages: advantages normalised on the *full* group, ``[B]`` or per-token ``[B, T]``, e.g.
            ``grpo(r, g).advantages``; they are not re-normalised after selection. For per-token advantages
            the sample level ranks rollouts by their masked mean advantage.
        group: group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`.
        entropy: full-vocabulary policy entropy per position ``[B, T]`` (non-negative; detached).
        mask: response mask ``[B, T]``.
        progress: training progress in [0, 1]; or give ``step`` and ``total_steps`` (``progress =
            step / total_steps``, capped at 1). Default 0 (the most aggressive budgets).
        sample_frac, token_frac: ``(init, final)`` budgets in (0, 1] for the schedule. Defaults ours: (0.5, 1)
            and (0.2, 1). The per-group sample budget is ``round(frac · n_valid)``, at least 1.
        sample_level: ``"group"`` (D³S-I, selection within each group) or ``"batch"`` (the cross-group
            variant: one selection over the whole batch with the same total budget; advantages stay
            normalised within groups, so zero-advantage groups drop out automatically).
        split: ``"balanced"`` (the summarised rule: ``round(pos_frac · N_s)`` largest positives and the rest most
            negative, topping up from the other side when one side runs out) or ``"optimal"`` (the exact
            maximiser of the subset's population variance, j smallest and k - j largest for the best j).
        pos_frac: share of the budget given to positive advantages under ``split="balanced"`` (default 0.5).
        token_level: ``"batch"`` (default: one top-K pool over all tokens of the kept rollouts, so with
            sequence-level advantages rollouts compete by |A| and tokens within one by entropy) or
            ``"sequence"`` (top-K fraction within each kept rollout).
        valid: optional mask ``[B]``; invalid rows are never kept and do not count in the budgets.

    Returns:
        :class:`D3SOutput` with ``weight [B]`` (kept rollouts) and ``token_mask [B, T]`` (kept tokens).

    Edge cases: zero-advantage rollouts (all-equal groups, singletons under ``singleton="zero"``) are never
    kept, so a group with fewer non-zero rollouts than its budget keeps all of them and an all-zero group
    none; all-masked rows keep no token; with ``(1, 1)`` budgets every non-zero-advantage rollout and all its
    tokens are kept. Scaling the advantages by a positive constant changes neither selection. An empty batch
    (B = 0) gives empty outputs (``token_mask [0, T]``) and metrics 0, except ``sample_frac`` and
    ``token_frac``, the schedule's values.
    """
    choice(sample_level, "sample_level", ("group", "batch"))
    choice(split, "split", ("balanced", "optimal"))
    choice(token_level, "token_level", ("batch", "sequence"))
    pf = _fraction(pos_frac, "pos_frac", open_low=False)
    p = _progress(progress, step, total_steps)
    s_frac, k_frac = d3s_schedule(p, sample_frac=sample_frac, token_frac=token_frac)

    dims = Dims()
    m = as_mask(mask, "mask", dims, "B T")
    h = as_float(entropy, "entropy", dims, "B T", device=m.device).detach()
    a_in = as_float(advantages, "advantages", device=m.device)
    if checks_enabled() and a_in.ndim not in (1, 2):
        raise InputError("advantages", "a tensor of shape [B] or [B, T]", describe(a_in), "pass one row per rollout")
    dims.check(a_in, "advantages", "B" if a_in.ndim == 1 else "B T")
    if isinstance(group, Tensor) and group.ndim == 1 and group.numel() == 0:
        # B = 0: Groups needs a row, so compute on one padded row that is not valid and cut the outputs back
        if checks_enabled():
            as_index(group, "group", dims)
        v0 = None if valid is None else as_mask(valid, "valid", dims, "B", device=m.device)
        pad: dict[str, Any] = {
            "advantages": torch.cat([a_in, a_in.new_zeros((1, *a_in.shape[1:]))]),
            "group": torch.zeros(1, dtype=torch.long, device=m.device),
            "entropy": torch.cat([h, h.new_zeros((1, h.shape[1]))]),
            "mask": torch.cat([m, m.new_zeros((1, m.shape[1]))]),
            "valid": torch.zeros(1, dtype=torch.bool, device=m.device)
            if v0 is None
            else torch.cat([v0, v0.new_zeros(1)]),
        }
        kw: dict[str, Any] = {"sample_level": sample_level, "split": split, "pos_frac": pf, "token_level": token_level}
        out = d3s(**pad, progress=p, sample_frac=sample_frac, token_frac=token_frac, **kw)
        return _emptied(out, keep=("sample_frac", "token_frac"))
    g = as_groups(group, dims)
    v_in = None if valid is None else as_mask(valid, "valid", dims, "B", device=m.device)
    v = torch.ones(g.num_rows, dtype=torch.bool, device=m.device) if v_in is None else v_in
    a = a_in.detach()
    if checks_enabled():
        # one min/max pass each, no [B, T] temporary; on an alarm (which may come from masked-out values)
        # the exact masked checks decide, and raise with their own messages
        if not _clean(h, nonnegative=True):
            finite(h, "entropy", m & v[:, None])
            if bool(((h < 0) & m).any()):
                raise InputError(
                    "entropy", "non-negative entropies", "negative values", "pass the policy entropy H >= 0"
                )
        if not _clean(a):
            if a.ndim == 1:
                finite(a, "advantages", v, exclude="valid")
            else:
                finite(a, "advantages", m & v[:, None])
    if a.ndim == 2:
        a = torch.where(m, a, torch.zeros_like(a))
        seq = a.sum(1) / m.sum(1).clamp(min=1).to(a.dtype)
        if v_in is not None:
            seq = torch.where(v, seq, torch.zeros_like(seq))
    else:
        seq = a if v_in is None else torch.where(v, a, torch.zeros_like(a))

    n_valid = g.count(v_in)
    budget = torch.where(n_valid > 0, _round_half_up(n_valid.to(torch.float64) * s_frac).clamp(min=1), n_valid)
    sel_groups = g
    if sample_level == "batch":
        sel_groups = Groups(torch.zeros(g.num_rows, dtype=torch.long, device=m.device))
        budget = budget.sum().reshape(1)
    if split == "balanced":
        keep = _select_balanced(seq, sel_groups, budget, v_in, pf)
    else:
        keep = _select_optimal(seq, sel_groups, budget, v)

    scale = a.abs() if a.ndim == 2 else a.abs()[:, None]
    if token_level == "batch" and checks_enabled():
        # validated inputs give finite |A| and finite H >= 0 on the eligible tokens: keys >= 0, never NaN
        token_mask = _token_keep_nonnegative(scale, h, m, keep, k_frac)
    else:
        token_mask = _token_keep(scale * h, m & keep[:, None], k_frac, token_level)

    w = keep.to(seq.dtype)
    valid_tokens = torch.count_nonzero(m if v_in is None else m & v[:, None])
    kept_adv = torch.where(keep, seq, torch.zeros_like(seq))
    n_kept = g.count(keep)
    mean_k = g.sum(kept_adv) / n_kept.clamp(min=1).to(seq.dtype)
    var_k = g.sum(torch.where(keep, (seq - g.broadcast(mean_k)) ** 2, torch.zeros_like(seq))) / n_kept.clamp(min=1).to(
        seq.dtype
    )
    groups_kept = (n_kept > 0).sum()
    sample_keep = keep.sum() / v.sum().clamp(min=1)
    metrics = {
        "sample_keep_frac": sample_keep.to(seq.dtype).detach(),
        "excluded_frac": (1 - sample_keep).to(seq.dtype).detach(),
        "token_keep_frac": (torch.count_nonzero(token_mask) / valid_tokens.clamp(min=1)).to(seq.dtype).detach(),
        "sample_frac": torch.tensor(s_frac, dtype=seq.dtype, device=m.device),
        "token_frac": torch.tensor(k_frac, dtype=seq.dtype, device=m.device),
        "selected_adv_var": (var_k.sum() / groups_kept.clamp(min=1)).to(seq.dtype).detach(),
    }
    return D3SOutput(advantages=a_in, weight=w, token_mask=token_mask, metrics=metrics)


SELECTORS.register(
    "d3s",
    d3s,
    requires=("advantages", "group", "entropy", "mask"),
    accepts=("valid",),
    reference="D3S arXiv 2509.22115 (ICLR 2026; code not public)",
)
