"""Robust-baseline advantage estimators: MC-GRPO (median baseline, pivot excluded) and GAPO (densest interval).

Both replace GRPO's group mean by a robust location, so that one outlying reward (a heavy-tailed partial-credit
or format term, a mis-scored rollout) cannot flip the sign of its siblings' advantages:

- :func:`mc_grpo` (arXiv 2601.22582) samples G + 1 rollouts per prompt, centres on the group median and scales
  by the median absolute deviation (by default the group std where the MAD is 0, as for binary rewards); the
  rollout at the median (the *pivot*) gets weight 0, so G rollouts per prompt carry gradient.
- :func:`gapo` (arXiv 2510.21830) centres each group on the median of its shortest interval covering a fraction
  ``tau`` of the rewards (the highest-density interval), and scales by the root-mean-square deviation around it.

Both run on ragged groups with no Python loop over groups or rows: stable segment sorts (the order of
:meth:`rolloutopt.groups.Groups.sort`, computed as one integer sort, see :func:`_segment_sort`; MC-GRPO sorts
twice, by reward and by absolute deviation, GAPO once) and scatter reductions. On 65,536 rollouts (one CPU
thread) each takes 2-3x the time of :func:`~rolloutopt.advantages.grpo`; the sort is about half of it.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor

from rolloutopt._validation import check_bool, checks_enabled, choice, positive
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.reference import (
    _emptied,
    _empty_batch,
    _prepare,
    _singleton,
    _warn_singletons,
    _weight,
)
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import BoolB, FloatB, IntB

__all__ = ["gapo", "mc_grpo"]

MCScale = Literal["mad", "std", "mad_or_std"]


def _frac(num: Tensor, den: Tensor) -> Tensor:
    return (num.sum() / den.sum().clamp(min=1)).detach()


def _safe_sqrt(x: Tensor) -> Tensor:
    """``sqrt(x)`` with a zero (not NaN/inf) gradient where ``x`` is 0."""
    pos = x > 0
    return torch.where(pos, x, torch.ones_like(x)).sqrt() * pos


def _ordered_bits(key: Tensor, *, nonneg: bool = False) -> Tensor:
    """Signed integers in the order of the float values ``key`` (float32 -> int32, float64 -> int64).

    Equal floats give equal integers: ``-0.0`` is folded into ``+0.0`` first and, while checks are off (the only
    way a NaN gets here: with checks on the rewards were checked finite), every NaN into one NaN above ``+inf``,
    which is where :func:`torch.sort` puts NaNs. Flipping the 31 (63) low bits of the negative floats turns their
    sign-magnitude bits into two's-complement order. ``nonneg``: ``key`` holds no negative float and no ``-0.0``
    (an ``abs``), whose bits are already in order.
    """
    if not nonneg:
        key = key + 0.0  # -0.0 + 0.0 = +0.0
    if not checks_enabled():
        key = torch.where(key.isnan(), torch.full_like(key, float("nan")), key)
    if key.dtype == torch.float32:
        bits = key.view(torch.int32)
        return bits if nonneg else bits ^ ((bits >> 31) & 0x7FFFFFFF)
    bits = key.view(torch.int64)
    return bits if nonneg else bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)


def _segment_sort(g: Groups, x: Tensor, valid: Tensor | None, *, nonneg: bool = False) -> tuple[Tensor, Tensor]:
    """The permutation of :meth:`Groups.sort` (group by group, valid values ascending, ties in row order) and
    the sort key (``x`` detached, ``+inf`` at invalid rows, as :meth:`Groups.sort` keys them).

    Equal-sized groups without a mask take one ``[G, n]`` row-wise sort. Otherwise the values are mapped to
    integers of the same order and sorted as integers (a radix sort on the CPU, several times faster than a
    float sort): a float32 value and its group index fit one int64 key, ``group · 2^32 + bits``, so one stable
    integer sort gives the permutation; float64 values take two (by value, then stably by group), as
    :meth:`Groups.sort` does with float keys.
    """
    key = x.detach()
    if valid is None and g.dense_size is not None:
        m = g.dense_size
        rows = g.order.view(g.num_groups, m)  # each group's rows in increasing row order
        by_group = key.index_select(0, g.order).view_as(rows)
        if key.dtype == torch.float32:
            # distinct int64 keys (value bits, then column) give the stable order from a faster unstable sort
            cols = torch.arange(m, device=key.device)
            within = _ordered_bits(by_group, nonneg=nonneg).long().mul_(m).add_(cols).sort(dim=1).indices
        else:
            within = by_group.argsort(dim=1, stable=True)
        return rows.gather(1, within).reshape(-1), key
    if valid is not None:
        key = torch.where(valid, key, torch.full_like(key, float("inf")))
    bits = _ordered_bits(key, nonneg=nonneg)
    if bits.dtype == torch.int32:
        # bits lie in [-2^31, 2^31): group g's keys fill [g·2^32 - 2^31, g·2^32 + 2^31), below group g + 1's
        return torch.sort(bits.long().add_(g.inverse, alpha=1 << 32), stable=True).indices, key
    by_value = torch.sort(bits, stable=True).indices
    by_group = torch.sort(g.inverse.index_select(0, by_value), stable=True).indices
    return by_value.index_select(0, by_group), key


def mc_grpo(
    rewards: FloatB,
    group: Groups | IntB,
    *,
    scale: MCScale | None = "mad_or_std",
    eps: float = 1e-3,
    unbiased: bool = True,
    pivot: Literal["rank", "first"] = "rank",
    rescale_nonzero: bool = False,
    singleton: Literal["raise", "pivot"] = "raise",
    valid: BoolB | None = None,
) -> AdvantageOutput:
    r"""MC-GRPO advantage: median-centred, MAD-scaled, with the median rollout (the pivot) excluded.

    .. math::  A_i = \frac{r_i - \dot m_g}{s_g + \varepsilon}, \qquad
               \dot m_g = \operatorname{median}^{\downarrow}_{j\in g} r_j, \quad
               \operatorname{MAD}_g = \operatorname{median}^{\downarrow}_{j\in g} |r_j - \dot m_g|, \quad
               s_g = \begin{cases} \operatorname{MAD}_g & \operatorname{MAD}_g > 0 \\
                     \sigma_g & \operatorname{MAD}_g = 0 \end{cases}

    where :math:`\operatorname{median}^{\downarrow}` is the lower median (``torch.median``'s convention: rank
    :math:`\lfloor (n-1)/2 \rfloor` of :math:`n` sorted values) and :math:`\sigma_g` the group std. Sample
    G + 1 rollouts per prompt; the pivot (the rollout at the median, :math:`A = 0` by construction) gets
    ``weight`` 0, so ``policy_loss(seq_weight=out.weight)`` trains on G rollouts per prompt, as the reference
    code does by deleting the pivot's rows. The GRPO std division is skipped (the reference's training mode).

    Reference: MC-GRPO, arXiv 2601.22582; code ``lotusroot-kim/MC-GRPO@da07745``
    (``src/open_r1/grpo_trainer_math.py`` and ``grpo_trainer_gsm.py``, ``_generate_and_score_completions``).
    The code scales by :math:`\operatorname{MAD}_g + 10^{-3}` in every group: ``scale="mad"`` reproduces it
    exactly (with the default ``pivot="rank"``; add ``rescale_nonzero=True`` for the GSM8K trainer). The
    default ``scale="mad_or_std"`` differs from the code only where the MAD is 0, which is every group of
    binary (two-valued) rewards: there the code gives advantages :math:`\pm 1/\varepsilon = \pm 1000` (a
    loss of order 100 and gradient norms in the hundreds at the first step), and the default divides by the
    std instead, which bounds :math:`|A_i|` by :math:`\sqrt{2(n-1)}` in such a group.

    Args:
        rewards: scalar reward per rollout ``[B]``, G + 1 rollouts per prompt.
        group: group ids ``[B]`` (any int64 values, any order) or a prebuilt :class:`~rolloutopt.groups.Groups`.
            Groups may be ragged.
        scale: ``"mad_or_std"`` (default): the MAD, or the group std (over all G + 1 rollouts) where the MAD is
            0, plus ``eps``; bounded on tied rewards. ``"mad"`` (the paper's code): MAD + ``eps``, which is
            :math:`\pm|r_i - \dot m|/\varepsilon` where the MAD is 0. ``"std"``: the group std (pivot
            included) + ``eps``. ``None``: no scaling, :math:`A_i = r_i - \dot m_g`.
        eps: added to the scale. Default 1e-3 is the paper code's MAD epsilon (additive, not a floor); it must
            be positive with ``scale="mad"`` (a MAD of 0 beside a non-zero deviation), may be 0 otherwise.
        unbiased: Bessel-corrected std (n - 1) for ``scale="std"``/``"mad_or_std"``, as ``torch.std``.
        pivot: which row is the pivot when several rows tie with the median (advantages do not depend on it,
            every tied row has :math:`A = 0`; it decides which tied row leaves the loss, and so the loss's
            token and sequence denominators). ``"rank"`` (default, the authors' code): the row at position
            :math:`\lfloor (n-1)/2 \rfloor` of the group's valid rows stably sorted by reward (ties in row
            order), which is the index ``torch.median(dim=1)`` returns on the CPU (it orders by value, then
            index); on CUDA torch leaves the index among tied medians unspecified. ``"first"``: the tied row
            with the lowest row index.
        rescale_nonzero: multiply each group's non-zero advantages (:math:`|A_i| > 10^{-6}`, the code's
            ``isclose(A, 0, atol=1e-6)``) by :math:`n_g / \#\{i : |A_i| > 10^{-6}\}`, with :math:`n_g` the
            group's valid rollouts, pivot included (``grpo_trainer_gsm.py``: it compensates for the rollouts that
            carry no signal). Default False (``grpo_trainer_math.py`` does not rescale).
        singleton: a group with one valid rollout (G = 0) has no baseline. ``"raise"`` (default) raises
            :class:`~rolloutopt.errors.InputError` (the paper's method needs G ≥ 1; the check runs while
            :func:`rolloutopt.checks` is on); ``"pivot"`` makes the lone rollout its own pivot (advantage 0,
            weight 0), which is also what happens with checks off.
        valid: optional mask ``[B]`` of the rows that enter the group statistics; other rows get advantage 0
            and weight 0 and are never the pivot. This is the keyword that leaves out rows with NaN rewards.

    Returns:
        :class:`AdvantageOutput` with ``advantages [B]`` and ``weight [B]`` (0 for the pivot and invalid rows).
        Metrics: ``pivot_frac`` (pivots over valid rows: the fraction this estimator excludes),
        ``zero_mad_group_frac`` (groups of two or more whose MAD is 0: the groups where ``"mad_or_std"``
        falls back to the std, and where ``"mad"`` gives :math:`\pm|r_i - \dot m|/\varepsilon`),
        ``median_tie_group_frac`` (groups where more than one rollout equals the median),
        ``zero_variance_group_frac``, ``singleton_group_frac``, ``reward_mean``.

    Edge cases:
        - Binary rewards: the MAD of two-valued rewards is always 0 (the lower median of the deviations is a
          deviation of the median's majority), so the default uses the group std, e.g. [0, 1, 1] gives
          :math:`A = [-1/(0.5774 + 10^{-3}), 0, 0]`; ``scale="mad"`` gives [−1000, 0, 0] as the paper's code.
        - All-equal rewards: every advantage is exactly 0 and the pivot still gets weight 0.
        - Even group sizes (G odd, or ragged groups): the lower middle value is the median and the pivot, as
          in ``torch.median``; the MAD is also the lower median of the deviations. A group of two has MAD 0: it
          gives the larger reward :math:`(r_{max} - r_{min})/(\sigma + \varepsilon)` (``"mad"``:
          :math:`/\varepsilon`) and the smaller one is the pivot.
        - All-masked groups contribute nothing (advantage 0, weight 0) and are left out of the metrics.
        - An empty batch (B = 0) gives empty ``advantages``/``weight`` and metrics 0.
    """
    if scale is not None:
        choice(scale, "scale", ("mad", "std", "mad_or_std"))
    choice(pivot, "pivot", ("rank", "first"))
    check_bool(rescale_nonzero, "rescale_nonzero")
    choice(singleton, "singleton", ("raise", "pivot"))
    positive(eps, "eps", strict=scale == "mad")  # MAD = 0 with a non-zero deviation needs eps > 0
    kw: dict[str, Any] = {"scale": scale, "eps": eps, "unbiased": unbiased, "pivot": pivot}
    if (empty := _empty_batch(rewards, group, valid)) is not None:
        r0, g0, v0 = empty
        return _emptied(mc_grpo(r0, g0, **kw, rescale_nonzero=rescale_nonzero, singleton=singleton, valid=v0))
    r, g, v, _ = _prepare(rewards, group, valid)
    n = g.count(v)
    if singleton == "raise" and checks_enabled() and (g.min_size == 1 if v is None else bool((n == 1).any())):
        raise InputError(
            "group",
            "G + 1 >= 2 valid rollouts per prompt (MC-GRPO samples one extra rollout; G = 0 is meaningless)",
            "a group with a single valid rollout",
            "sample G + 1 rollouts per prompt with G >= 1, or pass singleton='pivot' to give lone rollouts "
            "advantage 0 and weight 0",
        )
    # lower medians: rank h = (n - 1) // 2 of the valid values (torch.median's convention), 0 for empty groups
    last = g.num_rows - 1
    start = g.offsets[:-1]
    at_h = (start + torch.div(n - 1, 2, rounding_mode="floor").clamp(min=0)).clamp(max=last)
    has_rows = n > 0
    by_reward, _ = _segment_sort(g, r, v)
    median_row = by_reward.index_select(0, at_h)  # the row at rank h of the stable sort: pivot="rank"
    med = r[median_row]
    med = torch.where(has_rows, med, torch.zeros_like(med))
    dev = r - g.broadcast(med)
    abs_dev = dev.abs()
    # sorted by |dev|, a group's rows at the median (|dev| = 0, the smallest key) come first, in row order: the
    # first is the lowest row index among them (pivot="first"), and the group has ties / zero variance when
    # the second / last valid key is 0 (invalid rows have key +inf and sort last)
    perm, key = _segment_sort(g, abs_dev, v, nonneg=True)
    mad = abs_dev[perm[at_h]]
    mad = torch.where(has_rows, mad, torch.zeros_like(mad))
    if pivot == "rank":
        pivot_row, has_pivot = median_row, has_rows
    else:
        pivot_row = perm.index_select(0, start)
        has_pivot = key.index_select(0, pivot_row) == 0  # no pivot in a group without a valid row
    big = n > 1
    ties = big & (key.index_select(0, perm.index_select(0, (start + 1).clamp(max=last))) == 0)
    flat = big & (key.index_select(0, perm.index_select(0, (start + n - 1).clamp(min=0))) == 0)

    std: Tensor | None = None
    if scale in ("std", "mad_or_std"):
        std = g.std(dev, v, unbiased=unbiased)
    if scale == "mad":
        s = mad + eps
    elif scale == "std":
        assert std is not None
        s = std + eps
    elif scale == "mad_or_std":
        assert std is not None
        s = torch.where(mad > 0, mad, std) + eps
    else:
        s = torch.ones_like(mad)
    # a zero scale (eps = 0 with std 0) means every deviation of the group is 0: divide by 1 instead of 0/0
    adv = dev / g.broadcast(torch.where(s > 0, s, torch.ones_like(s)))
    if v is not None:
        adv = torch.where(v, adv, torch.zeros_like(adv))
    if rescale_nonzero:
        nonzero = adv.detach().abs() > 1e-6  # the GSM8K trainer's ~isclose(A, 0, atol=1e-6); invalid rows are 0
        k = g.count(nonzero)
        factor = torch.where(k > 0, n.to(r.dtype) / k.clamp(min=1).to(r.dtype), torch.ones_like(mad))
        adv = torch.where(nonzero, adv * g.broadcast(factor), adv)

    valid_w = _weight(r, v)
    # one pivot row per group, in the group's own segment of the sorted order (distinct rows)
    not_pivot = torch.ones_like(r).index_copy_(0, pivot_row, (~has_pivot).to(r.dtype))
    weight = not_pivot if v is None else valid_w * not_pivot
    metrics = {
        "pivot_frac": _frac(has_pivot.to(r.dtype), valid_w),
        "zero_mad_group_frac": _frac(big & (mad.detach() == 0), has_rows),
        "median_tie_group_frac": _frac(ties, has_rows),
        "zero_variance_group_frac": _frac(flat, has_rows),
        "singleton_group_frac": _frac(n == 1, has_rows),
        "reward_mean": ((r * valid_w).sum() / valid_w.sum().clamp(min=1)).detach(),
    }
    return AdvantageOutput(advantages=adv, weight=weight, metrics=metrics)


def _covering_size(n: Tensor, tau: float) -> Tensor:
    """``k = ceil(n · tau)`` computed as the GAPO code does, ``ceil(n * (100 tau) / 100)`` in float64.

    The two differ where the rounding of ``100 tau`` pushes an integer product up: for n = 20, tau = 0.55,
    ``ceil(20 * 0.55) = 11`` but the code's ``20 * 55.00000000000001 / 100 = 11.000000000000002`` gives 12.
    """
    k = torch.ceil(n.to(torch.float64) * (tau * 100) / 100).to(torch.long)
    return torch.minimum(k.clamp(min=1), n.clamp(min=1))


def gapo(
    rewards: FloatB,
    group: Groups | IntB,
    *,
    tau: float = 0.5,
    center: Literal["median", "mean"] = "median",
    normalize: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
    singleton: Literal["zero", "raw"] | None = None,
    valid: BoolB | None = None,
) -> AdvantageOutput:
    r"""GAPO advantage: the median of the group's densest interval as the baseline, RMS deviation around it as scale.

    .. math::  A_i = \frac{r_i - Q_g}{d_g + \varepsilon}, \qquad
               d_g = \sqrt{\tfrac{1}{n_g - 1}\textstyle\sum_{j\in g}(r_j - Q_g)^2}

    :math:`Q_g` is the median of the shortest window of :math:`k = \lceil n_g \tau \rceil` consecutive sorted
    rewards :math:`s_{(j)}, \dots, s_{(j+k-1)}` (smallest range :math:`s_{(j+k-1)} - s_{(j)}`; ties keep the
    lowest window), the average of the two middle values when :math:`k` is even. :math:`d_g` is a
    root-mean-square deviation around :math:`Q_g`, not the std. Without ``normalize``, :math:`A_i = r_i - Q_g`.

    Reference: GAPO, arXiv 2510.21830 ("the interval with the highest SNR"; v1–v3: "highest-density interval");
    code ``TsingZ0/verl-GAPO@58f42b55`` (``core_algos.compute_grpo_outcome_advantage`` with
    ``find_method``, ``rollout_utils.find_shortest_covering_subarray``), whose behaviour this reproduces.

    Args:
        rewards: scalar reward per rollout ``[B]``.
        group: group ids ``[B]`` (any int64 values, any order) or a prebuilt :class:`~rolloutopt.groups.Groups`.
        tau: fraction of a group's rewards the interval must cover, in (0, 1] (``find_target_fraction``,
            default 0.5). ``k`` is computed as the code does (``ceil(n * (100 tau) / 100)`` in float64), which
            differs from ``ceil(n * tau)`` for e.g. n = 20, tau = 0.55 (12, not 11).
        center: ``"median"`` (default, the paper's method) or ``"mean"`` (``find_method=mean``: the window mean).
        normalize: divide by :math:`d_g + \varepsilon` (``norm_adv_by_std_in_grpo``, default True).
        unbiased: divide the squared deviations by n - 1 (the code) or, when False, by n.
        eps: added to :math:`d_g` (verl's 1e-6).
        singleton: a group with one valid rollout. ``"zero"`` (the library's convention) gives advantage 0;
            ``"raw"`` is the GAPO code's (verl's) convention, :math:`Q = 0, d = 1`, so
            :math:`A = r/(1 + \varepsilon)` (``A = r`` without ``normalize``). The default ``None`` acts as
            ``"zero"`` and warns when a group has one valid rollout (a prompt that trains on nothing usually
            means a sampling or grouping bug); only the implicit default warns, ``"zero"`` says it is intended.
        valid: optional mask ``[B]`` of rows that enter the statistics; other rows get advantage 0 and weight 0.
            This is the keyword that leaves out rows with NaN rewards.

    Returns:
        :class:`AdvantageOutput` with ``advantages [B]`` and ``weight [B]`` (1 for valid rows: GAPO excludes no
        rollout). Metrics: ``excluded_frac`` (0: nothing is excluded), ``interval_frac`` (fraction of valid
        rollouts inside the chosen interval), ``interval_width_mean`` (mean range of the chosen interval over
        groups of two or more), ``baseline_shift_mean`` (mean of :math:`Q_g - \mu_g` over those groups),
        ``zero_variance_group_frac``, ``singleton_group_frac``, ``reward_mean``.

    Edge cases: all-equal rewards give window range 0, :math:`Q = r`, :math:`d = 0` and advantages exactly 0.
    Advantages are not zero-mean: they can all be ≤ 0 when the dense cluster sits at the top. Windows are
    compared in float64 (as the code compares Python floats), so near-ties resolve as in the code. All-masked
    groups contribute nothing. Implementation: one segment sort; window ranges, the first minimal window,
    the window median (two gathers) and the window mean (a segment sum over the window's rows, shifted by its
    first value so that an all-equal window is exact) are vectorised over groups and windows, with no loop.
    An empty batch (B = 0) gives empty ``advantages``/``weight`` and metrics 0.
    """
    if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not 0.0 < tau <= 1.0:
        raise InputError("tau", "a fraction in (0, 1]", repr(tau), "pass the covered fraction, e.g. tau=0.5")
    choice(center, "center", ("median", "mean"))
    choice(normalize, "normalize", (True, False))
    singleton, warn = _singleton(singleton)
    positive(eps, "eps", strict=False)
    if (empty := _empty_batch(rewards, group, valid)) is not None:
        r0, g0, v0 = empty
        kw: dict[str, Any] = {"tau": tau, "center": center, "normalize": normalize, "unbiased": unbiased}
        return _emptied(gapo(r0, g0, **kw, eps=eps, singleton=singleton, valid=v0))
    r, g, v, _ = _prepare(rewards, group, valid)
    n = g.count(v)
    _warn_singletons(g, n, v, warn)
    num_rows = g.num_rows
    last = num_rows - 1

    perm, _ = _segment_sort(g, r, v)
    srt = r.index_select(0, perm)  # group by group, valid values ascending (carries the gradient)
    srt64 = srt.detach().to(torch.float64)
    start_of = g.offsets[:-1]
    k = _covering_size(n, tau)
    has_rows = n > 0
    dense = v is None and g.dense_size is not None
    if dense:
        # equal groups: the sorted values as [G, m]; the window widths of all groups in one subtraction, and the
        # first shortest window from min(dim=1), which returns the first index of the minimum
        assert g.dense_size is not None
        m = g.dense_size
        k_int = min(max(math.ceil(m * (tau * 100) / 100), 1), m)  # _covering_size in Python floats (float64)
        by_group = srt64.view(g.num_groups, m)
        best, win = (by_group[:, k_int - 1 :] - by_group[:, : m - k_int + 1]).min(dim=1)
        found = best == best  # False for a NaN width (non-finite rewards with checks off): no window
        origin = torch.where(found, start_of + win, torch.full_like(win, num_rows))
    else:
        grp = g.inverse.index_select(0, perm)
        pos = torch.arange(num_rows, device=r.device)  # sorted position
        k_row = k.index_select(0, grp)
        # a window of k values starts at sorted position p of group g when p - offsets[g] + k <= n[g]
        is_start = pos <= (start_of + n - k).index_select(0, grp)
        width = srt64.index_select(0, (pos + k_row).sub_(1).clamp_(max=last)) - srt64
        width = torch.where(is_start, width, torch.full_like(width, float("inf")))
        best = torch.full((g.num_groups,), float("inf"), dtype=torch.float64, device=r.device)
        best = best.scatter_reduce(0, grp, width, reduce="amin", include_self=True)
        # the first row of each group with the minimal width: a window start (other rows have width +inf, and
        # the group's first row is a start, so a minimum of +inf picks it, as the first start)
        first = torch.where(width == best.index_select(0, grp), pos, torch.full_like(pos, num_rows))
        origin = torch.full((g.num_groups,), num_rows, dtype=torch.long, device=r.device)
        origin = origin.scatter_reduce(0, grp, first, reduce="amin", include_self=True)
        found = has_rows & (origin < num_rows)  # no window without a valid row (or, checks off, for a NaN width)
        origin = torch.where(has_rows, origin, start_of)  # sorted position of each group's window start
    if center == "median":
        lo = srt[(origin + torch.div(k - 1, 2, rounding_mode="floor")).clamp(max=last)]
        hi = srt[(origin + torch.div(k, 2, rounding_mode="floor")).clamp(max=last)]
        q = (lo + hi) / 2
    else:
        if dense:
            grp = g.inverse.index_select(0, perm)
            pos = torch.arange(num_rows, device=r.device)
            k_row = k.index_select(0, grp)
        win_row = origin.index_select(0, grp)
        in_win = (pos >= win_row) & (pos < win_row + k_row)  # sorted rows inside the chosen window
        base = srt[origin.clamp(max=last)]
        shifted = torch.where(in_win, srt - base.index_select(0, grp), torch.zeros_like(srt))
        total = torch.zeros(g.num_groups, dtype=r.dtype, device=r.device).index_add(0, grp, shifted)
        q = base + total / k.to(r.dtype)
    single = n == 1
    keep_q = (n > 0) & ~single if singleton == "raw" else n > 0  # verl: a group of one has Q = 0
    q = torch.where(keep_q, q, torch.zeros_like(q))

    dev = r - g.broadcast(q)
    d: Tensor | None = None
    if normalize:
        denom = (n - (1 if unbiased else 0)).clamp(min=1).to(r.dtype)
        d = _safe_sqrt(g.sum(dev * dev, v) / denom)
        if singleton == "raw":
            d = torch.where(single, torch.ones_like(d), d)
        scale = d + eps  # 0 only when eps = 0 and every deviation is 0: divide by 1 instead of 0/0
        adv = dev / g.broadcast(torch.where(scale > 0, scale, torch.ones_like(scale)))
    else:
        adv = dev
    if singleton == "zero":
        adv = torch.where(g.broadcast(single), torch.zeros_like(adv), adv)
    if v is not None:
        adv = torch.where(v, adv, torch.zeros_like(adv))

    w = _weight(r, v)
    big = n > 1
    big_f = big.to(r.dtype)
    if v is None or checks_enabled():  # (v is None on the dense path)
        # The sorted positions offsets[g] .. offsets[g] + n[g] - 1 hold the group's valid values (with checks on
        # they are finite and sort before the invalid rows' +inf keys; without a mask every row is valid and a
        # NaN sorts last). A group's window holds k of them (none if no window was found): the count is exact,
        # as the sum of 0/1 row flags is. And as r - q is monotone in r, every |r - q| is 0 (zero variance)
        # exactly when it is 0 at the smallest and the largest valid value.
        in_interval = torch.where(found, k, torch.zeros_like(k)).to(r.dtype)
        q_d = q.detach()
        lowest = srt.detach().index_select(0, start_of)
        highest = srt.detach().index_select(0, (start_of + n - 1).clamp(min=0))
        no_spread = (lowest - q_d == 0) & (highest - q_d == 0)
    else:  # checks off: a valid NaN/inf reward may sort among the invalid rows
        start_row = origin.index_select(0, grp)
        in_win_sorted = (pos >= start_row) & (pos < start_row + k_row)
        in_interval = torch.where(in_win_sorted, w.index_select(0, perm), torch.zeros_like(w))
        no_spread = g.max(dev.detach().abs(), v) == 0
    mean = g.mean(r, v)
    interval_width = torch.where(big, best, torch.zeros_like(best)).to(r.dtype)
    metrics = {
        "excluded_frac": torch.zeros((), dtype=r.dtype, device=r.device),
        "interval_frac": _frac(in_interval, w),
        "interval_width_mean": _frac(interval_width, big_f),
        "baseline_shift_mean": _frac((q.detach() - mean.detach()) * big_f, big_f),
        "zero_variance_group_frac": _frac(big & no_spread, has_rows),
        "singleton_group_frac": _frac(single, has_rows),
        "reward_mean": ((r * w).sum() / w.sum().clamp(min=1)).detach(),
    }
    return AdvantageOutput(advantages=adv, weight=w, metrics=metrics)


REGISTRY.register(
    "mc_grpo",
    mc_grpo,
    accepts=("valid",),
    reference="MC-GRPO arXiv 2601.22582; code lotusroot-kim/MC-GRPO@da07745 "
    "(grpo_trainer_math.py::_generate_and_score_completions)",
)
REGISTRY.register(
    "gapo",
    gapo,
    accepts=("valid",),
    reference="GAPO arXiv 2510.21830; code TsingZ0/verl-GAPO@58f42b55 (core_algos.compute_grpo_outcome_advantage, "
    "rollout_utils.find_shortest_covering_subarray)",
)
