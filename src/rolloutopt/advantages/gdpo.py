"""The GDPO family of multi-reward advantage estimators: GDPO and its conflict-aware extension GD²PO.

References: arXiv 2601.05242, 2606.16771 (``docs/methods/multi_reward.md``).

Both take K reward components per rollout (``rewards [B, K]``) and normalise each component inside its group
before combining them, so that one dominant reward cannot drown the others and distinct reward combinations do
not collapse onto one advantage (GRPO on the summed reward gives ``[1, 0] + [0, 1]`` and ``[0, 1] + [1, 0]`` the
same advantage). GD²PO adds conflict-aware masking of rollouts whose components pull in opposite directions and
a per-query weight by reward consensus.

Every statistic is a vectorised segment reduction over the components laid out as ``[K, B]`` (``index_add`` on
the dense group index of a :class:`~rolloutopt.groups.Groups`); nothing loops over groups, rows or components.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, checks_enabled, choice, describe, finite, positive
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.reference import _outside_package, _singleton
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolB, BoolBT, FloatBK, IntB

__all__ = ["gd2po", "gdpo"]

Final = Literal["sequence", "token"]
Singleton = Literal["zero", "raw"]


# ------------------------------------------------------------------------------------------------ helpers
#
# Layout: the K reward components are handled as a [K, B] tensor (one contiguous row per component), so that
# every per-row op is a contiguous pass, group sums are one ``index_add`` along dim 1, group statistics
# broadcast back with one ``index_select``, and sums over components are reductions over the outer dimension
# (on the CPU, a reduction or broadcast along a short inner dimension of size K costs several times a contiguous
# pass). Without a ``valid`` mask (the common case) every mask and ``torch.where`` that would be all-true is
# skipped, and the one host sync of the input checks is a single finiteness test of the sum.


class _Prepared(NamedTuple):
    r: Tensor  # rewards [K, B] (invalid entries zeroed)
    g: Groups
    w: Tensor  # weights [K]
    v: Tensor | None  # entry validity [K, B]; None: every entry valid
    m: Tensor | None  # response mask [B, T] as 0/1 floats (final="token")
    rows: Tensor | None  # rows with a valid entry [B]; None: every row
    length: Tensor | None  # masked-in tokens per row [B] (final="token"); None: 1 per row


def _prepare(rewards: Any, group: Groups | IntB, weights: Any, mask: Any, valid: Any, final: str) -> _Prepared:
    choice(final, "final", ("sequence", "token"))
    dims = Dims()
    r = as_float(rewards, "rewards", dims, "B K")
    if checks_enabled() and r.shape[1] == 0:
        raise InputError("rewards", "at least one reward component (K >= 1)", describe(r), "pass rewards [B, K]")
    g = as_groups(group, dims)
    v: Tensor | None = None
    rows: Tensor | None = None
    if valid is not None:
        v = as_mask(valid, "valid", device=r.device)
        if checks_enabled() and v.shape not in ((r.shape[0],), tuple(r.shape)):
            raise InputError(
                "valid",
                f"a mask of shape [B] or [B, K] with B={r.shape[0]}, K={r.shape[1]} (from rewards)",
                describe(valid),
                "pass one flag per rollout, or one per rollout and reward component",
            )
        if v.ndim == 1:
            rows, v = v, v[None, :].expand(r.shape[1], r.shape[0])
        else:
            rows, v = v.any(-1), torch.stack(v.unbind(1))
    # A finite sum proves every entry finite (one cheap host sync); otherwise run the full, masked check.
    if checks_enabled() and not bool(torch.isfinite(r.detach().sum())):
        finite(r, "rewards", None if v is None else v.t())
    rt = torch.stack(r.unbind(1))  # [K, B]
    if v is not None:
        rt = torch.where(v, rt, torch.zeros_like(rt))  # invalid entries may hold NaN (TRL: a reward function's None)
    k = r.shape[1]
    if weights is None:
        w = torch.ones(k, dtype=r.dtype, device=r.device)
    else:
        if not isinstance(weights, Tensor):
            try:
                weights = torch.tensor(weights, dtype=r.dtype, device=r.device)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise InputError(
                    "weights", "K numbers", describe(weights), "pass a list or tensor of K floats"
                ) from exc
        w = as_float(weights, "weights", dims, "K", device=r.device).to(r.dtype)
        finite(w, "weights")
    m: Tensor | None = None
    length: Tensor | None = None
    if final == "token":
        if mask is None:
            raise InputError(
                "mask", "a response mask [B, T] for final='token'", "None", "pass mask, or use final='sequence'"
            )
        # The mask as 0/1 floats: through a free uint8 view, several times faster on the CPU than a bool cast
        # (or than the implicit one of ``x * bool_mask``). Token counts are a matrix-vector product (exact).
        mb = as_mask(mask, "mask", dims, "B T", device=r.device)
        m = mb.view(torch.uint8).to(r.dtype)
        length = torch.mv(m, torch.ones(m.shape[1], dtype=r.dtype, device=r.device))
    elif mask is not None:
        raise InputError(
            "mask",
            "no mask with final='sequence' (the final normalisation runs over sequences)",
            describe(mask),
            "drop mask, or pass final='token' for the token-weighted whitening",
        )
    return _Prepared(rt, g, w, v, m, rows, length)


def _seg_sum(g: Groups, x: Tensor) -> Tensor:
    """Per-group sums of ``x [K, B]``: ``[K, G]``."""
    return torch.zeros((x.shape[0], g.num_groups), dtype=x.dtype, device=x.device).index_add(1, g.inverse, x)


def _bcast(g: Groups, stat: Tensor) -> Tensor:
    """A per-group statistic ``[K, G]`` (or ``[G]``) broadcast to its rows: ``[K, B]`` (or ``[B]``)."""
    return stat.index_select(stat.ndim - 1, g.inverse)


def _component_advantages(
    r: Tensor, g: Groups, v: Tensor | None, *, eps: float, unbiased: bool, singleton: str
) -> tuple[Tensor, Tensor, Tensor]:
    """GRPO advantage of every component inside its group: ``(A [K, B], count [K, G], std [K, G])``.

    Statistics are computed on rewards centred at a valid member of the (group, component), so that an
    all-equal component is exactly 0 (see ``reference._shifted``): the group's first row without a ``valid``
    mask, its largest valid value with one.
    """
    k = r.shape[0]
    corr = 1 if unbiased else 0
    if v is None:
        n = g.sizes[None, :].expand(k, g.num_groups)
        nf = g.sizes.to(r.dtype)
        first = g.broadcast(g.first_rows)  # [B]: its group's first row
        rs = r - r.detach().index_select(1, first)
        mean = _seg_sum(g, rs) / nf
        dev = rs - _bcast(g, mean)
        ss = _seg_sum(g, dev * dev)
        var = (
            ss / (nf - corr).clamp(min=1)
            if g.min_size > corr
            else torch.where(n > corr, ss / (nf - corr).clamp(min=1), torch.zeros_like(ss))
        )
    else:
        vf = v.to(r.dtype)
        n = _seg_sum(g, v.to(torch.long))
        fill = torch.full_like(r, float("-inf"))
        ref = torch.zeros((k, g.num_groups), dtype=r.dtype, device=r.device).scatter_reduce(
            1, g.inverse[None, :].expand_as(r), torch.where(v, r.detach(), fill), reduce="amax", include_self=False
        )
        ref = torch.where(n > 0, ref, torch.zeros_like(ref))
        rs = r - _bcast(g, ref)
        mean = _seg_sum(g, rs * vf) / n.clamp(min=1).to(r.dtype)
        dev = (rs - _bcast(g, mean)) * vf
        ss = _seg_sum(g, dev * dev)
        var = torch.where(n > corr, ss / (n - corr).clamp(min=1).to(r.dtype), torch.zeros_like(ss))
    pos = var > 0
    std = torch.where(pos, var, torch.ones_like(var)).sqrt() * pos  # zero (not NaN) gradient at var = 0
    den = std + eps
    adv = dev / _bcast(g, torch.where(den > 0, den, torch.ones_like(den)))  # eps=0: 0/0 -> 0
    # A (group, component) with one valid entry has dev = 0, hence adv = 0 already ("zero"), and an invalid entry
    # has dev = 0 and (zeroed) r = 0, hence adv = 0 under both conventions: only "raw" singletons need a where.
    if singleton == "raw" and (v is not None or g.min_size == 1):
        single = _bcast(g, n == 1)
        adv = torch.where(single, r / (1 + eps), adv)  # verl: mean 0, std 1 for a group of one
    return adv, n, std


def _final_normalise(
    s: Tensor, weight: Tensor | None, final: str, final_eps: float, unbiased: bool
) -> tuple[Tensor, Tensor]:
    """Normalise ``s [B]`` over the batch: z-score over sequences, or whiten over their tokens.

    ``weight [B]`` is each row's multiplicity in the statistics (its number of masked-in tokens for
    ``final="token"``, 0 or 1 for ``"sequence"``; None: 1 for every row), so that the token statistics cost
    ``[B]`` work, not ``[B, T]``. Returns ``(z [B], std)``; the caller zeroes rows of weight 0 and, for
    ``"token"``, broadcasts ``z`` over the mask.
    """
    # centre on one counted entry (detached) so that an all-equal batch is exactly 0
    if weight is None:
        count = torch.full((), float(s.shape[0]), dtype=s.dtype, device=s.device)  # a fill: no host-to-device copy
        ref = s.detach().amax()
        xs = s - ref
        mu = xs.sum() / count.clamp(min=1)
        mu = mu + (xs - mu).sum() / count.clamp(min=1)  # one refinement step: the float32 mean is inexact
        var = ((xs - mu) ** 2).sum()
    else:
        count = weight.sum()
        ref = torch.where(weight > 0, s.detach(), torch.full_like(s, float("-inf"))).amax()
        ref = torch.where(count > 0, ref, torch.zeros_like(ref))
        xs = s - ref
        mu = (xs * weight).sum() / count.clamp(min=1)
        mu = mu + ((xs - mu) * weight).sum() / count.clamp(min=1)
        var = ((xs - mu) ** 2 * weight).sum()
    corr = 1 if unbiased else 0
    var = var / (count - corr).clamp(min=1)
    var = torch.where(count > corr, var, torch.zeros_like(var))  # verl raises for a single token; we give 0
    if final == "token":
        den = var + final_eps
        return (xs - mu) * torch.rsqrt(torch.where(den > 0, den, torch.ones_like(den))), var.sqrt()
    pos = var > 0
    std = torch.where(pos, var, torch.ones_like(var)).sqrt() * pos
    den = std + final_eps
    return (xs - mu) / torch.where(den > 0, den, torch.ones_like(den)), std


def _finish(z: Tensor, keep: Tensor | None, g: Groups, n_rows: Tensor, singleton: str, m: Tensor | None) -> Tensor:
    """Zero the rows outside the statistics (``keep`` False) and, with ``"zero"``, rows alone in their group;
    broadcast over the mask for ``final="token"``: ``[B]`` or ``[B, T]``."""
    out = keep if keep is not None else None
    if singleton == "zero" and (keep is not None or g.min_size == 1):
        alone = _bcast(g, n_rows == 1)
        out = ~alone if out is None else out & ~alone
    if out is not None:
        z = z * out.to(z.dtype)
    if m is None:
        return z
    # m is this call's private float copy of the mask: without autograd, write the [B, T] output into it (one
    # [B, T] buffer less to allocate, and to page-fault in: a fresh 2 MB buffer costs more than the product)
    return z[:, None] * m if z.requires_grad else m.mul_(z[:, None])


def _warn_singletons(g: Groups, rows: Tensor | None, warn: bool) -> Tensor:
    """Per-group row counts; warns (``warn``: ``singleton`` left at its default) when a group has one valid row."""
    n_rows = g.sizes if rows is None else g.count(rows)
    if warn and (g.min_size == 1 if rows is None else bool((n_rows == 1).any())):
        warnings.warn(
            "rolloutopt: a group of size 1 gets advantage 0 (no baseline can be formed); pass singleton='zero' "
            "to confirm (and silence this warning) or singleton='raw' for verl's convention (advantage = raw "
            "reward)",
            stacklevel=_outside_package(),
        )
    return n_rows


def _defaults(final: str, final_eps: float | None) -> float:
    fe = (1e-8 if final == "token" else 1e-4) if final_eps is None else final_eps
    positive(fe, "final_eps", strict=False)
    return fe


def _base_metrics(
    r: Tensor, w: Tensor, rows: Tensor | None, n: Tensor, std: Tensor, n_rows: Tensor, s_std: Tensor
) -> dict[str, Tensor]:
    groups_with_rows = (n_rows > 0).sum().clamp(min=1)
    pairs = (n > 1).sum().clamp(min=1)
    weighted = w @ r  # [B]; invalid entries of r are 0
    b = r.shape[1]
    if rows is None:
        reward_mean = weighted.sum() / max(b, 1)
        invalid = torch.zeros((), dtype=torch.long, device=r.device)
    else:
        reward_mean = (weighted * rows).sum() / rows.sum().clamp(min=1)
        invalid = (~rows).sum()
    return {
        "singleton_group_frac": ((n_rows == 1).sum() / groups_with_rows).detach(),
        "zero_variance_group_frac": ((((std == 0) | (n < 2)).all(0) & (n_rows > 1)).sum() / groups_with_rows).detach(),
        "component_zero_variance_frac": (((std == 0) & (n > 1)).sum() / pairs).detach(),
        "reward_mean": reward_mean.detach(),
        "combined_std": s_std.detach(),
        "invalid_frac": (invalid / max(b, 1)).detach(),
    }


# ---------------------------------------------------------------------------------------------------- GDPO


def gdpo(
    rewards: FloatBK,
    group: Groups | IntB,
    *,
    weights: Float[Tensor, " K"] | Sequence[float] | None = None,
    final: Final = "sequence",
    mask: BoolBT | None = None,
    eps: float | None = None,
    final_eps: float | None = None,
    unbiased: bool = True,
    singleton: Singleton | None = None,
    valid: BoolB | Shaped[Tensor, "B K"] | None = None,
) -> AdvantageOutput:
    r"""GDPO advantage: normalise each reward component inside its group, sum with weights, normalise the batch.

    .. math::  \hat A_i^{(k)} = \frac{r_i^{(k)} - \mu_g^{(k)}}{\sigma_g^{(k)} + \varepsilon}, \qquad
               S_i = \textstyle\sum_k w_k \hat A_i^{(k)}, \qquad
               A_i = \frac{S_i - \bar S}{\operatorname{std}(S) + \varepsilon_f}

    with unbiased (n-1) stds. ``final="sequence"`` (NVlabs GDPO, TRL ``normalize_then_sum``) takes
    :math:`\bar S` and :math:`\operatorname{std}(S)` over the valid sequences of the batch.
    ``final="token"`` (verl ``gdpo``, the GD²PO verl port) whitens over every masked-in token instead (verl
    ``masked_whiten``): :math:`A_{i,t} = m_{i,t}(S_i - \bar S_{tok})/\sqrt{\operatorname{Var}_{tok}(S) +
    \varepsilon_f}`, so long responses weigh more in the statistics.

    Reference: GDPO, arXiv 2601.05242 (code ``NVlabs/GDPO@41f74c53``); verl 0.9.1
    ``compute_gdpo_outcome_advantage``; TRL 1.16 ``multi_objective_aggregation="normalize_then_sum"``.

    Args:
        rewards: reward components ``[B, K]``.
        group: group ids ``[B]`` (any int64 values, any order) or a :class:`~rolloutopt.groups.Groups`.
        weights: per-component weights ``[K]`` (tensor or sequence of floats); default all 1 (NVlabs, verl
            ``gdpo_reward_weights``, TRL ``reward_weights``). Applied after the per-component normalisation.
        final: ``"sequence"`` (default, NVlabs/TRL) returns ``[B]``; ``"token"`` (verl) needs ``mask`` and
            returns per-token advantages ``[B, T]``.
        mask: response mask ``[B, T]``; required for ``final="token"``, rejected for ``"sequence"``.
        eps: added to each component's group std. None picks the reference's value for the mode: 1e-4 for
            ``"sequence"`` (NVlabs, TRL), 1e-6 for ``"token"`` (verl GRPO).
        final_eps: None picks 1e-4 added to the batch std (``"sequence"``, NVlabs/TRL) or 1e-8 inside
            ``rsqrt(var + eps)`` (``"token"``, verl ``masked_whiten``).
        unbiased: Bessel-corrected stds (torch, verl, TRL and NVlabs all use ``torch.std``); False for population.
        singleton: a (group, component) with one valid entry has no baseline: ``"zero"`` (default, TRL/NVlabs,
            whose ``nanstd`` of one value is NaN and ``nansum`` drops it) gives the component 0; ``"raw"`` is
            verl's GRPO convention (``r / (1 + eps)``). The default None acts as ``"zero"`` and warns when a
            rollout is alone in its group (final advantage 0); an explicit ``"zero"`` confirms it silently.
        valid: optional mask ``[B]`` (rows) or ``[B, K]`` (entries) of what enters the statistics. An invalid
            entry (TRL: a reward function returned None, NaN) is left out of its component's group statistics
            and contributes 0 to :math:`S_i`; a row with no valid entry is left out of the final normalisation
            and gets advantage 0 and weight 0.

    Returns:
        :class:`AdvantageOutput` with ``advantages`` ``[B]`` (``"sequence"``) or ``[B, T]`` (``"token"``),
        ``weight`` 1 for rows with a valid entry, else 0; metrics ``singleton_group_frac``,
        ``zero_variance_group_frac`` (groups in which every component is constant), ``component_zero_variance_frac``
        (fraction of (group, component) pairs of two or more entries that are constant), ``reward_mean``
        (weighted sum of the raw components), ``combined_std`` (std of :math:`S` before the final step) and
        ``invalid_frac`` (rows excluded).

    Edge cases: a component constant within a group contributes exactly 0 there; a batch in which every
    :math:`S_i` is equal (e.g. every group zero-variance) gives 0 everywhere; all-masked rows give 0 (in
    ``"token"`` mode they have no tokens, so they do not enter the statistics). Non-binary rewards need nothing
    special: every stage is a z-score. Shift-invariant per component and group, scale-invariant per component
    (up to eps), and invariant to a positive scale of all weights (up to eps).

    Choices: K = 1 is not special-cased (NVlabs falls back to plain GRPO, i.e. skips the batch step; call
    :func:`~rolloutopt.advantages.reference.grpo` for that); rows alone in their group enter the final
    statistics with :math:`S = 0`, as in TRL and verl. An empty response (all-masked row) still counts in its
    group's component statistics (as in verl) but has no token in ``"token"`` mode.

    Trainer parity: TRL 1.16 ``normalize_then_sum`` equals ``gdpo(per_func, ids, weights=reward_weights,
    valid=~per_func.isnan())`` on consecutive groups of ``num_generations``. verl 0.9.1 ``gdpo`` equals
    ``gdpo(r, ids, weights=gdpo_reward_weights, final="token", mask=response_mask, singleton="raw")``.
    Differences from verl: it raises on a batch with a single masked-in token (we return 0); all-equal groups
    whose float32 mean is inexact (e.g. sixteen 0.1s) leave residues in its per-component GRPO (up to about
    ±0.2) where ours are exactly 0; it has no ``valid`` mask; its ``norm_adv_by_std_in_grpo=False`` (components
    centred but not scaled) is not offered here. From TRL: none on its inputs (fixed-size
    groups); TRL lets a rollout alone among scorable siblings keep :math:`(0 - \bar S)/\operatorname{std}`,
    which is 0 up to rounding and exactly 0 here (``singleton="zero"``).
    """
    singleton, warn = _singleton(singleton)
    p = _prepare(rewards, group, weights, mask, valid, final)
    r, g, w, rows = p.r, p.g, p.w, p.rows
    e = (1e-6 if final == "token" else 1e-4) if eps is None else eps
    positive(e, "eps", strict=False)
    fe = _defaults(final, final_eps)
    n_rows = _warn_singletons(g, rows, warn)
    comp, n, std = _component_advantages(r, g, p.v, eps=e, unbiased=unbiased, singleton=singleton)
    s = w @ comp  # sum_k w_k A^(k): one matrix-vector product over [K, B], no [K, B] temporary
    if p.length is None:
        weight = None if rows is None else rows.to(r.dtype)
    else:
        weight = p.length if rows is None else p.length * rows
    z, s_std = _final_normalise(s, weight, final, fe, unbiased)
    adv = _finish(z, rows, g, n_rows, singleton, p.m)
    metrics = _base_metrics(r, w, rows, n, std, n_rows, s_std)
    out_weight = torch.ones(r.shape[1], dtype=r.dtype, device=r.device) if rows is None else rows.to(r.dtype)
    return AdvantageOutput(advantages=adv, weight=out_weight, metrics=metrics)


# --------------------------------------------------------------------------------------------------- GD²PO


def gd2po(
    rewards: FloatBK,
    group: Groups | IntB,
    mask: BoolBT | None = None,
    *,
    weights: Float[Tensor, " K"] | Sequence[float] | None = None,
    filter: Literal["snr", "hard"] = "snr",
    threshold: float = 0.8,
    final: Final = "token",
    eps: float = 1e-6,
    final_eps: float | None = None,
    ratio_eps: float = 1e-8,
    sign_eps: float = 1e-8,
    unbiased: bool = True,
    singleton: Singleton | None = None,
    valid: BoolB | Shaped[Tensor, "B K"] | None = None,
) -> AdvantageOutput:
    r"""GD²PO advantage: GDPO with conflicting rollouts masked out and each query weighted by reward consensus.

    With the per-component group advantages :math:`\hat A_i^{(k)}` of :func:`gdpo` and response lengths
    :math:`L_i`, let :math:`a_i^{(k)} = \hat A_i^{(k)} L_i`. Rollout i is *conflicted* when some
    :math:`a_i^{(k)} > \delta` and some :math:`a_i^{(k)} < -\delta` (:math:`\delta` = ``sign_eps``).

    .. math::  s_i = \frac{\sum_k a_i^{(k)}}{\sum_k |a_i^{(k)}| + \varepsilon_r}, \qquad
               \text{keep}_i = \neg\big(\text{conflict}_i \wedge |s_i| < \tau\big), \qquad
               \kappa_g = \frac{\#\{i \in g: \text{keep}_i\}}{n_g}

    .. math::  \tilde A_i = \kappa_g\,\text{keep}_i \textstyle\sum_k w_k \hat A_i^{(k)}, \qquad
               A = \operatorname{whiten}(\tilde A) \text{ over the kept rollouts' tokens}

    (``filter="hard"``: :math:`\text{keep}_i = \neg\text{conflict}_i`). :math:`\kappa_g` multiplies before the
    whitening so that the whitening does not erase it. Masked rollouts get advantage 0 and weight 0.

    Reference: GD²PO, arXiv 2606.16771; code ``Qwen-Applications/GD2PO@f1ad765`` (``ray_trainer.py``:
    ``_get_mixed_sign_conflict_mask``, ``_compute_gdpo_ratio_conflict_advantages``,
    ``_compute_gdpo_group_keep_ratio``).

    Args:
        rewards, group, weights, unbiased, singleton, valid: as in :func:`gdpo` (``weights`` default 1, as the
            code's plain sum over components). The conflict test uses the unweighted :math:`a_i^{(k)}`.
        mask: response mask ``[B, T]``; required for ``final="token"`` (default), rejected for ``"sequence"``.
        filter: ``"snr"`` (default; ``gdpo_filter_ratio_conflict_group_ratio``, the variant the released scripts
            run with a threshold) or ``"hard"`` (``gdpo_filter_group_ratio``: every mixed-sign rollout is
            masked; ``threshold`` is ignored).
        threshold: :math:`\tau` (``gdpo_filter_ratio_conflict_threshold``). Default 0.8: every released training
            script sets 0.8, so the paper's results use it; the code's own default is 0.2 (pass it for that).
        final: ``"token"`` (default; ``use_masked_whiten_in_gdpo=True``, verl ``masked_whiten`` over kept
            tokens, ``[B, T]`` output) or ``"sequence"`` (z-score over kept sequences, ``[B]`` output).
        eps: added to each component's group std; 1e-6 (the code runs on verl's GRPO).
        final_eps: None picks 1e-8 inside ``rsqrt`` (``"token"``) or 1e-4 added to the std (``"sequence"``).
        ratio_eps: :math:`\varepsilon_r` of the consensus ratio; 1e-8 (tool-calling code; safe-alignment uses 1e-6).
        sign_eps: :math:`\delta`, 1e-8 (code).

    Returns:
        :class:`AdvantageOutput`; ``weight`` is 0 for masked (conflicted) and invalid rollouts. Metrics: those of
        :func:`gdpo` plus ``masked_frac`` (fraction of valid rollouts masked by the filter), ``excluded_frac``
        (fraction of all rollouts with weight 0: masked or invalid), ``downweighted_frac`` (fraction of valid
        rollouts kept with :math:`\kappa_g < 1`), ``mixed_sign_frac``
        (fraction with mixed signs, before the threshold), ``query_weight_mean`` (mean :math:`\kappa_g` over
        groups with a valid rollout) and ``zero_weight_group_frac`` (groups with every rollout masked).

    Edge cases: a component with advantage exactly 0 (constant within the group, a singleton under
    ``"zero"``, or an empty response, :math:`L_i = 0`) has no sign and never creates a conflict. A group whose
    rollouts are all conflicted gets :math:`\kappa = 0`. If nothing is kept, every advantage is 0. One kept
    token gives 0 (verl's ``masked_var`` raises). With K = 1 nothing can conflict and GD²PO is GDPO (token
    mode) with :math:`\kappa = 1`.

    Choices: :math:`n_g` counts the group's valid rollouts (the code divides by the group size G; they agree
    without a ``valid`` mask); in ``"sequence"`` mode :math:`L_i = 1`.
    """
    singleton, warn = _singleton(singleton)
    choice(filter, "filter", ("snr", "hard"))
    for value, name in ((eps, "eps"), (ratio_eps, "ratio_eps"), (sign_eps, "sign_eps"), (threshold, "threshold")):
        positive(value, name, strict=False)
    p = _prepare(rewards, group, weights, mask, valid, final)
    r, g, w, rows, length = p.r, p.g, p.w, p.rows, p.length
    fe = _defaults(final, final_eps)
    n_rows = _warn_singletons(g, rows, warn)
    comp, n, std = _component_advantages(r, g, p.v, eps=eps, unbiased=unbiased, singleton=singleton)
    a = comp.detach() if length is None else comp.detach() * length
    # "some a > delta and some a < -delta", as extrema over the components (one pass each, no [K, B] bools)
    mixed = (a.amax(0) > sign_eps) & (a.amin(0) < -sign_eps)
    if rows is not None:
        mixed = mixed & rows
    if filter == "snr":
        ratio = a.sum(0) / (a.abs().sum(0) + ratio_eps)
        conflict = mixed & (ratio.abs() < threshold)
    else:
        conflict = mixed
    keep = ~conflict if rows is None else rows & ~conflict
    keep_f = keep.to(r.dtype)
    kappa = g.count(keep).to(r.dtype) / n_rows.clamp(min=1).to(r.dtype)
    kappa_b = _bcast(g, kappa)
    s = kappa_b * keep_f * (w @ comp)
    z, s_std = _final_normalise(s, keep_f if length is None else keep_f * length, final, fe, unbiased)
    adv = _finish(z, keep, g, n_rows, singleton, p.m)
    metrics = _base_metrics(r, w, rows, n, std, n_rows, s_std)
    n_valid = (rows.sum() if rows is not None else torch.full((), r.shape[1], device=r.device)).clamp(min=1)
    has_rows = n_rows > 0
    groups_with_rows = has_rows.sum().clamp(min=1)
    metrics.update(
        masked_frac=(conflict.sum() / n_valid).detach(),
        excluded_frac=((~keep).sum() / max(keep.numel(), 1)).detach(),
        downweighted_frac=((keep & (kappa_b < 1)).sum() / n_valid).detach(),
        mixed_sign_frac=(mixed.sum() / n_valid).detach(),
        query_weight_mean=((kappa * has_rows).sum() / groups_with_rows).detach(),
        zero_weight_group_frac=(((kappa == 0) & has_rows).sum() / groups_with_rows).detach(),
    )
    return AdvantageOutput(advantages=adv, weight=keep_f, metrics=metrics)


REGISTRY.register(
    "gdpo",
    gdpo,
    accepts=("mask", "valid"),
    reward_dims="B K",
    reference="GDPO arXiv 2601.05242; code NVlabs/GDPO@41f74c53; verl 0.9.1 compute_gdpo_outcome_advantage "
    "(adv_estimator=gdpo); TRL multi_objective_aggregation='normalize_then_sum'",
)
REGISTRY.register(
    "gd2po",
    gd2po,
    requires=("mask",),
    accepts=("valid",),
    reward_dims="B K",
    reference="GD2PO arXiv 2606.16771; code Qwen-Applications/GD2PO@f1ad765 (ray_trainer.py: "
    "_compute_gdpo_ratio_conflict_advantages, _compute_gdpo_group_keep_ratio)",
)
