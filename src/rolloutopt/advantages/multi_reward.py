"""Multi-reward advantage estimators: GDPO and GD²PO (specs/advantages.md A7, A8).

Both take K reward components per rollout (``rewards [B, K]``) and normalise each component inside its group
before combining them, so that one dominant reward cannot drown the others and distinct reward combinations do
not collapse onto one advantage (GRPO on the summed reward gives ``[1, 0] + [0, 1]`` and ``[0, 1] + [1, 0]`` the
same advantage). GD²PO adds conflict-aware masking of rollouts whose components pull in opposite directions and
a per-query weight by reward consensus.

Every statistic is a vectorised segment reduction over ``[B, K]`` (``index_add`` on the dense group index of a
:class:`~rolloutopt.groups.Groups`); nothing loops over groups, rows or components.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, checks_enabled, choice, describe, finite, positive
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.reference import _outside_package
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolBT, FloatBK, IntB

__all__ = ["gd2po", "gdpo"]

Final = Literal["sequence", "token"]
Singleton = Literal["zero", "raw"]


# ------------------------------------------------------------------------------------------------ helpers


def _prepare(
    rewards: Any, group: Groups | IntB, weights: Any, mask: Any, valid: Any, final: str
) -> tuple[Tensor, Groups, Tensor, Tensor, Tensor | None, Tensor, Tensor]:
    """Validated ``(r [B, K], groups, w [K], entry_valid [B, K], mask [B, T] | None, row_valid [B], length [B])``."""
    choice(final, "final", ("sequence", "token"))
    dims = Dims()
    r = as_float(rewards, "rewards", dims, "B K")
    if checks_enabled() and r.shape[1] == 0:
        raise InputError("rewards", "at least one reward component (K >= 1)", describe(r), "pass rewards [B, K]")
    g = as_groups(group, dims)
    if valid is None:
        v = torch.ones(r.shape, dtype=torch.bool, device=r.device)
    else:
        v = as_mask(valid, "valid", device=r.device)
        if checks_enabled() and v.shape not in ((r.shape[0],), tuple(r.shape)):
            raise InputError(
                "valid",
                f"a mask of shape [B] or [B, K] with B={r.shape[0]}, K={r.shape[1]} (from rewards)",
                describe(valid),
                "pass one flag per rollout, or one per rollout and reward component",
            )
        v = v[:, None].expand(r.shape) if v.ndim == 1 else v
    finite(r, "rewards", v)
    r = torch.where(v, r, torch.zeros_like(r))  # invalid entries may hold NaN (TRL: a reward function's None)
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
    if final == "token":
        if mask is None:
            raise InputError(
                "mask", "a response mask [B, T] for final='token'", "None", "pass mask, or use final='sequence'"
            )
        m = as_mask(mask, "mask", dims, "B T", device=r.device)
        length = m.sum(-1).to(r.dtype)
    else:
        if mask is not None:
            raise InputError(
                "mask",
                "no mask with final='sequence' (the final normalisation runs over sequences)",
                describe(mask),
                "drop mask, or pass final='token' for the token-weighted whitening",
            )
        length = torch.ones(r.shape[0], dtype=r.dtype, device=r.device)
    return r, g, w, v, m, v.any(-1), length


def _seg_sum(g: Groups, x: Tensor) -> Tensor:
    """Per-group sums of ``x [B, K]``: ``[G, K]``."""
    return torch.zeros((g.num_groups, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add(0, g.inverse, x)


def _component_advantages(
    r: Tensor, g: Groups, v: Tensor, *, eps: float, unbiased: bool, singleton: str
) -> tuple[Tensor, Tensor, Tensor]:
    """GRPO advantage of every component inside its group: ``(A [B, K], count [G, K], std [G, K])``.

    Statistics are computed on rewards centred at a valid member of the (group, component), so that an
    all-equal component is exactly 0 (see ``reference._shifted``).
    """
    vf = v.to(r.dtype)
    n = _seg_sum(g, v.long())
    fill = torch.full_like(r, float("-inf"))
    ref = torch.zeros((g.num_groups, r.shape[1]), dtype=r.dtype, device=r.device)
    ref = ref.scatter_reduce(
        0, g.inverse[:, None].expand_as(r), torch.where(v, r.detach(), fill), reduce="amax", include_self=False
    )
    ref = torch.where(n > 0, ref, torch.zeros_like(ref))
    rs = r - ref.index_select(0, g.inverse)
    mean = _seg_sum(g, rs * vf) / n.clamp(min=1).to(r.dtype)
    dev = (rs - mean.index_select(0, g.inverse)) * vf
    corr = 1 if unbiased else 0
    ss = _seg_sum(g, dev * dev)
    var = torch.where(n > corr, ss / (n - corr).clamp(min=1).to(r.dtype), torch.zeros_like(ss))
    pos = var > 0
    std = torch.where(pos, var, torch.ones_like(var)).sqrt() * pos  # zero (not NaN) gradient at var = 0
    den = std + eps
    adv = dev / torch.where(den > 0, den, torch.ones_like(den)).index_select(0, g.inverse)  # eps=0: 0/0 -> 0
    single = (n == 1).index_select(0, g.inverse)
    if singleton == "raw":  # verl: mean 0, std 1 for a group of one
        adv = torch.where(single, r / (1 + eps), adv)
    else:
        adv = torch.where(single, torch.zeros_like(adv), adv)
    adv = torch.where(v, adv, torch.zeros_like(adv))
    return adv, n, std


def _final_normalise(
    s: Tensor, rows: Tensor, m: Tensor | None, final: str, final_eps: float, unbiased: bool
) -> tuple[Tensor, Tensor]:
    """Normalise ``s [B]`` over the batch rows ``rows``: z-score over sequences, or whiten over their tokens.

    Returns ``(advantages, std)``: ``[B]`` for ``final="sequence"``, ``[B, T]`` (0 off the mask) for ``"token"``.
    """
    x = s if m is None else s[:, None].expand(m.shape)
    w = (rows if m is None else m & rows[:, None]).to(s.dtype)
    count = w.sum()
    # centre on one counted entry (detached) so that an all-equal batch is exactly 0
    ref = (torch.where(w > 0, x.detach(), torch.full_like(x, float("-inf")))).amax() if x.numel() else x.sum()
    ref = torch.where(count > 0, ref, torch.zeros_like(ref))
    xs = x - ref
    mu = (xs * w).sum() / count.clamp(min=1)
    mu = mu + ((xs - mu) * w).sum() / count.clamp(min=1)  # one refinement step: the float32 mean is inexact
    corr = 1 if unbiased else 0
    var = ((xs - mu) ** 2 * w).sum() / (count - corr).clamp(min=1)
    var = torch.where(count > corr, var, torch.zeros_like(var))  # verl raises for a single token; we give 0
    if final == "token":
        den = var + final_eps
        return (xs - mu) * torch.rsqrt(torch.where(den > 0, den, torch.ones_like(den))) * w, var.sqrt()
    pos = var > 0
    std = torch.where(pos, var, torch.ones_like(var)).sqrt() * pos
    den = std + final_eps
    return (xs - mu) / torch.where(den > 0, den, torch.ones_like(den)) * w, std


def _warn_singletons(g: Groups, rows: Tensor, singleton: str) -> Tensor:
    n_rows = g.count(rows)
    if singleton == "zero" and bool((n_rows == 1).any()):
        warnings.warn(
            "rolloutopt: a group of size 1 gets advantage 0 (no baseline can be formed); pass singleton='raw' "
            "for verl's convention (advantage = raw reward)",
            stacklevel=_outside_package(),
        )
    return n_rows


def _defaults(final: str, final_eps: float | None) -> float:
    fe = (1e-8 if final == "token" else 1e-4) if final_eps is None else final_eps
    positive(fe, "final_eps", strict=False)
    return fe


def _base_metrics(
    r: Tensor, w: Tensor, v: Tensor, rows: Tensor, n: Tensor, std: Tensor, n_rows: Tensor, s_std: Tensor
) -> dict[str, Tensor]:
    groups_with_rows = (n_rows > 0).sum().clamp(min=1)
    vf = v.to(r.dtype)
    pairs = (n > 1).sum().clamp(min=1)
    weighted = (r * vf * w).sum(-1)
    return {
        "singleton_group_frac": ((n_rows == 1).sum() / groups_with_rows).detach(),
        "zero_variance_group_frac": ((((std == 0) | (n < 2)).all(-1) & (n_rows > 1)).sum() / groups_with_rows).detach(),
        "component_zero_variance_frac": (((std == 0) & (n > 1)).sum() / pairs).detach(),
        "reward_mean": ((weighted * rows).sum() / rows.sum().clamp(min=1)).detach(),
        "combined_std": s_std.detach(),
        "invalid_frac": ((~rows).sum() / max(rows.numel(), 1)).detach(),
    }


# ---------------------------------------------------------------------------------------------------- GDPO


def gdpo(
    rewards: FloatBK,
    group: Groups | IntB,
    *,
    weights: Any = None,
    final: Final = "sequence",
    mask: BoolBT | None = None,
    eps: float | None = None,
    final_eps: float | None = None,
    unbiased: bool = True,
    singleton: Singleton = "zero",
    valid: Any = None,
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
            verl's GRPO convention (``r / (1 + eps)``). With ``"zero"``, a rollout alone in its group gets final
            advantage 0 and a warning.
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
    choice(singleton, "singleton", ("zero", "raw"))
    r, g, w, v, m, rows, _ = _prepare(rewards, group, weights, mask, valid, final)
    e = (1e-6 if final == "token" else 1e-4) if eps is None else eps
    positive(e, "eps", strict=False)
    fe = _defaults(final, final_eps)
    n_rows = _warn_singletons(g, rows, singleton)
    comp, n, std = _component_advantages(r, g, v, eps=e, unbiased=unbiased, singleton=singleton)
    s = (comp * w).sum(-1)
    adv, s_std = _final_normalise(s, rows, m, final, fe, unbiased)
    if singleton == "zero":
        alone = (n_rows == 1).index_select(0, g.inverse)
        adv = torch.where(alone if adv.ndim == 1 else alone[:, None], torch.zeros_like(adv), adv)
    metrics = _base_metrics(r, w, v, rows, n, std, n_rows, s_std)
    return AdvantageOutput(advantages=adv, weight=rows.to(r.dtype), metrics=metrics)


# --------------------------------------------------------------------------------------------------- GD²PO


def gd2po(
    rewards: FloatBK,
    group: Groups | IntB,
    mask: BoolBT | None = None,
    *,
    weights: Any = None,
    filter: Literal["snr", "hard"] = "snr",
    threshold: float = 0.8,
    final: Final = "token",
    eps: float = 1e-6,
    final_eps: float | None = None,
    ratio_eps: float = 1e-8,
    sign_eps: float = 1e-8,
    unbiased: bool = True,
    singleton: Singleton = "zero",
    valid: Any = None,
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
    choice(singleton, "singleton", ("zero", "raw"))
    choice(filter, "filter", ("snr", "hard"))
    for value, name in ((eps, "eps"), (ratio_eps, "ratio_eps"), (sign_eps, "sign_eps"), (threshold, "threshold")):
        positive(value, name, strict=False)
    r, g, w, v, m, rows, length = _prepare(rewards, group, weights, mask, valid, final)
    fe = _defaults(final, final_eps)
    n_rows = _warn_singletons(g, rows, singleton)
    comp, n, std = _component_advantages(r, g, v, eps=eps, unbiased=unbiased, singleton=singleton)
    a = comp.detach() * length[:, None]
    mixed = (a > sign_eps).any(-1) & (a < -sign_eps).any(-1) & rows
    if filter == "snr":
        ratio = a.sum(-1) / (a.abs().sum(-1) + ratio_eps)
        conflict = mixed & (ratio.abs() < threshold)
    else:
        conflict = mixed
    keep = rows & ~conflict
    kappa = g.count(keep).to(r.dtype) / n_rows.clamp(min=1).to(r.dtype)
    s = g.broadcast(kappa) * keep.to(r.dtype) * (comp * w).sum(-1)
    adv, s_std = _final_normalise(s, keep, m, final, fe, unbiased)
    if singleton == "zero":
        alone = (n_rows == 1).index_select(0, g.inverse)
        adv = torch.where(alone if adv.ndim == 1 else alone[:, None], torch.zeros_like(adv), adv)
    metrics = _base_metrics(r, w, v, rows, n, std, n_rows, s_std)
    n_valid = rows.sum().clamp(min=1)
    has_rows = n_rows > 0
    groups_with_rows = has_rows.sum().clamp(min=1)
    metrics.update(
        masked_frac=(conflict.sum() / n_valid).detach(),
        excluded_frac=((~keep).sum() / max(keep.numel(), 1)).detach(),
        downweighted_frac=((keep & (g.broadcast(kappa) < 1)).sum() / n_valid).detach(),
        mixed_sign_frac=(mixed.sum() / n_valid).detach(),
        query_weight_mean=((kappa * has_rows).sum() / groups_with_rows).detach(),
        zero_weight_group_frac=(((kappa == 0) & has_rows).sum() / groups_with_rows).detach(),
    )
    return AdvantageOutput(advantages=adv, weight=keep.to(r.dtype), metrics=metrics)


REGISTRY.register("gdpo", gdpo)
REGISTRY.register("gd2po", gd2po)
