"""M2PO: second-moment trust regions for stale off-policy data (arXiv 2510.01161), in its two published forms.

M2PO bounds the batch second moment of the log importance ratio, :math:`\\hat M_2 = \\frac1N\\sum (\\log r)^2`,
instead of each token's ratio: a stale batch keeps almost all of its tokens, and only the few extreme
outliers that carry the variance are removed. Two implementations disagree on how:

- the paper and AReaL (``_apply_m2po_masking``, config ``m2_threshold``) **mask** the tokens with the largest
  squared log-ratio of the behaviour vs proximal policies until the mean of the rest is below τ
  (:func:`m2po_mask`, :class:`M2POMask`);
- the official code (``Infini-AI-Lab/M2PO@af54a3e``, ``compute_m2po_policy_loss``) turns the budget into one
  pair of batch-level PPO **clip bounds** computed from the "harmful" tokens (:func:`m2po_clip_bounds`,
  :class:`M2POClip`).

Both work on the whole batch of one call (one sort of the flattened tokens, tensor indices, no host sync).
Like both codebases, the statistic is that of the micro-batch the trainer passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, as_seq_or_token, choice, finite, positive
from rolloutopt.errors import InputError
from rolloutopt.ratios.context import MaskOutput, StageContext
from rolloutopt.ratios.reference import PPOClip, TrustOutput, bounded_clip_loss, ppo_clip_loss
from rolloutopt.typing import BoolBT, FloatBT, FloatBTb, PerSeqOrToken, Scalar

__all__ = ["M2POBounds", "M2POClip", "M2POMask", "m2po_clip_bounds", "m2po_mask"]

# The official code's tolerances (``_get_trust_region_tokens_delta_sq``, ``_solve_tau_from_sorted_delta2``).
_EPS = 1e-12
# The official "no clipping" bounds: ratio clamped to [0, 1e5].
_NO_CLIP_HIGH = 1e5


def _need_ctx(ctx: StageContext | None, owner: str) -> StageContext:
    if ctx is None:
        raise InputError(
            "ctx",
            f"a StageContext ({owner} reads the mask and other log-probs from it)",
            "None",
            f"call {owner} through rolloutopt.losses.policy_loss, or pass ctx=StageContext(...)",
        )
    return ctx


def _check_tau(tau: float, name: str) -> None:
    positive(tau, name)


# --------------------------------------------------------------------------------------------------- mask


def _m2po_mask(d: Tensor, m: Tensor, tau: float) -> tuple[Tensor, Tensor, Tensor]:
    """Vectorised AReaL rule on validated ``d [B, T]`` and bool ``m [B, T]``."""
    m2 = (d.detach() * d.detach()).flatten()
    flat_m = m.flatten()
    n_all = m2.numel()
    if n_all == 0:
        z = m2.sum()
        return m.clone(), z, z
    # Masked-out tokens sort last (m2 >= 0 > -1); stable, so ties keep their original order.
    keyed = torch.where(flat_m, m2, torch.full_like(m2, -1.0))
    ordered, order = torch.sort(keyed, descending=True, stable=True)
    vals = ordered.clamp(min=0)
    suffix = vals.flip(0).cumsum(0).flip(0)  # sum of sorted[k:], as AReaL (masked-out ones add 0)
    n = flat_m.sum()
    idx = torch.arange(n_all, device=m2.device)
    count = (n - idx).clamp(min=1).to(vals.dtype)
    mean_suffix = suffix / count
    below = (mean_suffix < tau) & (idx < n)
    first = torch.argmax(below.to(torch.uint8))  # first True (argmax returns the first maximum)
    # AReaL: mask the prefix before the first suffix whose mean is < tau; if none, keep only the smallest.
    k = torch.where(below.any(), first, (n - 1).clamp(min=0))
    keep_sorted = (idx >= k) & (idx < n)
    keep = torch.zeros_like(flat_m).scatter(0, order, keep_sorted).view_as(m)
    nf = n.clamp(min=1).to(vals.dtype)
    m2_before = suffix[0] / nf
    kept = (n - k).clamp(min=1).to(vals.dtype)
    m2_after = torch.where(n > 0, suffix.gather(0, k.reshape(1)).reshape(()) / kept, torch.zeros_like(m2_before))
    return keep, m2_before, m2_after


def m2po_mask(log_ratio: FloatBT, mask: BoolBT, *, tau: float = 0.04) -> MaskOutput:
    r"""M2PO's second-moment mask: drop the largest :math:`d^2` until the mean of the rest is below τ.

    .. math::  M_2(S) = \frac{1}{|S|}\sum_{(i,t)\in S} d_{i,t}^2, \qquad
               S^\star = \text{the largest suffix of the tokens sorted by } d^2 \text{ descending with }
               M_2(S^\star) < \tau

    i.e. the tokens with the largest :math:`d^2` are removed one by one, and the first remaining set whose mean
    is below τ is kept (AReaL ``_apply_m2po_masking``: the first suffix whose mean is < τ). If no suffix
    qualifies — even the smallest :math:`d^2` alone is ≥ τ — only the single smallest token is kept.
    ``d`` is the log importance ratio whose second moment is bounded: the paper and AReaL use
    :math:`d = \ell^{beh} - \ell^{prox}` (see :class:`M2POMask`). Reference: M2PO, arXiv 2510.01161;
    AReaL ``areal/trainer/ppo/actor.py`` and ``docs/algorithms/m2po.md``; τ = 0.04 is both codebases'
    default (``m2_threshold: 0.04``, ``M2_budget=0.04``).

    One stable sort and one cumulative sum of the flattened tokens, indices kept as tensors: no Python loop,
    no host synchronisation. Ties in :math:`d^2` are broken by position (AReaL's unstable sort leaves it open).

    Args:
        log_ratio: ``d`` ``[B, T]`` (detached inside).
        mask: bool loss mask ``[B, T]``; the statistic runs over all its True tokens of the batch.
        tau: the second-moment budget τ > 0.

    Returns:
        A :class:`~rolloutopt.ratios.MaskOutput`: ``keep``, the bool ``[B, T]`` kept tokens (a subset of
        ``mask``), and ``metrics`` (detached 0-d tensors, 0 for an empty mask): ``m2po_m2`` (the batch
        :math:`\hat M_2` before masking), ``m2po_m2_kept`` (the :math:`\hat M_2` of the kept tokens) and
        ``m2po_masked_frac`` (the fraction of ``mask`` tokens removed).

    Edge cases: an empty mask (``B = 0``, ``T = 0`` or all False) keeps nothing and gives 0 for every metric;
    all-masked rows are ignored; ``d ≡ 0`` keeps every token. Oracle (by hand, following AReaL's rule):
    ``d = [0.1, 0.1, 1.0]`` → :math:`d^2` = [0.01, 0.01, 1.0],
    mean 0.34 ≥ 0.04 → the 1.0 token is masked, 2 kept with mean 0.01.
    """
    _check_tau(tau, "tau")
    dims = Dims()
    d = as_float(log_ratio, "log_ratio", dims, "B T")
    m = as_mask(mask, "mask", dims, "B T", device=d.device)
    finite(d, "log_ratio", m)
    keep, m2, m2_kept = _m2po_mask(torch.where(m, d, torch.zeros_like(d)), m, tau)
    n = m.sum()
    removed = (n - keep.sum()).to(m2.dtype) / n.clamp(min=1).to(m2.dtype)
    return MaskOutput(keep, {"m2po_m2": m2, "m2po_m2_kept": m2_kept, "m2po_masked_frac": removed})


_PAIRS = ("behav_old", "old_current")


@dataclass(frozen=True)
class M2POMask:
    r"""Trust region: M2PO's mask (the paper, AReaL) then the plain surrogate, or a PPO clip, on the kept tokens.

    .. math::  L_{i,t} = -A_{i,t}\, r_{i,t} \quad \text{for the tokens kept by } \texttt{m2po\_mask}(d, \tau),
               \qquad d = \begin{cases} \ell^{beh} - \ell^{prox} & \texttt{pair="behav\_old"}\\
               \ell^{prox} - \operatorname{sg}(\ell^\theta) & \texttt{pair="old\_current"}\end{cases}

    Reference: M2PO, arXiv 2510.01161 (the paper writes the unclipped surrogate :math:`r A` — the default,
    ``clip=None``); AReaL keeps running its PPO loss on the masked tokens: pass ``clip=PPOClip(low=0.2,
    high=0.2, dual=None)`` (AReaL's default ``eps_clip=0.2``, no ``eps_clip_higher``, no ``c_clip``; its M2PO
    example ``examples/math/gsm8k_m2po.yaml`` sets ``eps_clip: 0.0``, i.e. ``PPOClip(0.0, 0.0)``). Defaults:
    τ = 0.04 (both codebases), ``pair="behav_old"`` (AReaL: ``old_logp`` is the rollout's behaviour log-probs
    and ``prox_logp`` the proximal policy's, ``delta = old_logp - prox_logp``). ``"old_current"`` is the
    alternative reading of the paper (the ratio being optimised, detached); it needs no ``behav_logp``. In
    bypass mode (no proximal recompute, ``old_logp`` is the behaviour policy's) ``"behav_old"`` gives
    :math:`d \equiv 0` and masks nothing: use ``"old_current"`` there.

    ``r`` is the ratio the ratio stage built (:class:`~rolloutopt.ratios.TokenRatio` against the proximal
    policy, as in AReaL). Masked tokens have ``keep=False``: no loss, no gradient.

    Denominator. The paper's objective (as AReaL's ``docs/algorithms/m2po.md`` writes it) divides by every
    response token, :math:`\frac{1}{\sum_i |o_i|}\sum M_{i,t} r_{i,t} A_{i,t}`: masked tokens stay in the
    denominator, ``policy_loss(..., removed_in_denominator=True)`` (the default and the ``m2po`` preset's; it is
    also the convention that stays exact with :func:`rolloutopt.distributed.global_denominators`). AReaL's code
    (``inclusionAI/AReaL@4aef98d`` ``areal/trainer/ppo/actor.py`` ``grpo_loss_fn``) differs: it replaces
    ``loss_mask`` by the M2PO mask before ``ppo_actor_loss_fn``, which divides by ``loss_mask.count_nonzero()``,
    the **M2PO-kept** count — ``removed_in_denominator=False`` for AReaL's number. With a masking correction on
    top (AReaL's M2PO example adds rejection sampling, ``MIS(low=None, high=5.0)``) AReaL still divides by the
    M2PO-kept count, so the rejected tokens stay in it; neither setting gives that, pass the count:
    ``denominators=Denominators(tokens=m2po_mask(behav_logp - old_logp, mask, tau=tau).keep.sum())``.

    The statistic needs ``ctx``: ``ctx.old_logp`` (proximal), ``ctx.mask``, and ``ctx.behav_logp`` for
    ``pair="behav_old"`` (:attr:`requires`); ``d`` is clamped to ``±clamp`` (20, like every log-ratio here) so
    that its square stays finite. Edge cases: ``B = 0``, ``T = 0`` and all-masked rows give zero loss and
    metrics.

    Indicators: ``m2po_masked_frac`` (plus the clip's own with ``clip``). Metrics: ``m2po_m2`` (batch
    :math:`\hat M_2` before masking), ``m2po_m2_kept`` (after).
    """

    tau: float = 0.04
    pair: Literal["behav_old", "old_current"] = "behav_old"
    clip: PPOClip | None = None
    clamp: float = 20.0
    accepts: ClassVar[tuple[str, ...]] = ()

    @property
    def requires(self) -> tuple[str, ...]:
        """The :func:`~rolloutopt.losses.policy_loss` inputs this stage cannot run without: ``("behav_logp",)``
        for ``pair="behav_old"``, none for ``"old_current"``."""
        return ("behav_logp",) if self.pair == "behav_old" else ()

    def __post_init__(self) -> None:
        _check_tau(self.tau, "M2POMask.tau")
        choice(self.pair, "M2POMask.pair", _PAIRS)
        positive(self.clamp, "M2POMask.clamp")
        if self.clip is not None and not isinstance(self.clip, PPOClip):
            raise InputError(
                "M2POMask.clip",
                "None (the paper's unclipped surrogate) or a PPOClip (AReaL)",
                repr(self.clip),
                "pass clip=PPOClip(low=0.2, high=0.2, dual=None) or clip=None",
            )

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        c = _need_ctx(ctx, "M2POMask")
        old = c.need("old_logp", "M2POMask")
        if self.pair == "behav_old":
            d = c.need("behav_logp", "M2POMask(pair='behav_old')") - old
        else:
            d = old - logp.detach()
        d = torch.where(c.mask, d.detach().clamp(-self.clamp, self.clamp), torch.zeros_like(d))
        keep, m2, m2_kept = _m2po_mask(d, c.mask, self.tau)
        ind: dict[str, Tensor] = {}
        if self.clip is None:
            loss = -advantages * ratio
        else:
            loss, ind = ppo_clip_loss(ratio, advantages, low=self.clip.low, high=self.clip.high, dual=self.clip.dual)
        ind = {**ind, "m2po_masked_frac": ~keep}
        return TrustOutput(loss, keep, ind, {"m2po_m2": m2, "m2po_m2_kept": m2_kept})


# ---------------------------------------------------------------------------------------- adaptive clip


@dataclass(frozen=True)
class M2POBounds:
    """Batch-level clip bounds of the official M2PO code (:func:`m2po_clip_bounds`); detached 0-d tensors.

    Attributes:
        low: :math:`\\epsilon_{low}` (the ratio's lower bound is ``1 - low``).
        high: :math:`\\epsilon_{high}` (the upper bound is ``1 + high``).
        clipping: True when the harmful tokens' :math:`\\hat M_2` exceeded τ (else the bounds are [0, 1e5]).
        tau_c: the cap :math:`\\tau_c` on :math:`|\\Delta|` (0 when not clipping).
        m2: :math:`\\hat M_2` of the harmful tokens before clipping.
        m2_after: :math:`\\frac1n\\sum\\min(\\Delta^2, \\tau_c^2)` over the harmful tokens (``m2`` when not
            clipping).
        harmful: bool ``[B, T]``, the harmful tokens.
    """

    low: Scalar
    high: Scalar
    clipping: Bool[Tensor, ""]
    tau_c: Scalar
    m2: Scalar
    m2_after: Scalar
    harmful: Bool[Tensor, "B T"]


def _m2po_bounds(
    log_ratio: Tensor,
    advantages: Tensor,
    m: Tensor,
    tau: float,
    miniclip_low: float | None,
    miniclip_high: float | None,
) -> M2POBounds:
    lr = log_ratio.detach()
    a = advantages.detach().expand_as(lr)
    r = torch.exp(lr)
    harmful = m & (((a > _EPS) & (r > 1 + _EPS)) | ((a < -_EPS) & (r < 1 - _EPS)))
    if lr.numel() == 0:  # B = 0 or T = 0 (a static shape, no host sync): no harmful token, no clipping
        zero = lr.sum()
        no = torch.zeros((), dtype=torch.bool, device=lr.device)
        low, high = 1 + zero, _NO_CLIP_HIGH - 1 + zero
        if miniclip_low is not None:
            low = low.clamp(min=miniclip_low)
        if miniclip_high is not None:
            high = high.clamp(min=miniclip_high)
        return M2POBounds(low, high, no, zero, zero, zero, harmful)
    v = (lr * lr).flatten()
    flat_h = harmful.flatten()
    keyed = torch.where(flat_h, v, torch.full_like(v, torch.inf))
    ordered = torch.sort(keyed).values  # ascending, harmful tokens first
    n = flat_h.sum()
    idx = torch.arange(v.numel(), device=v.device)
    valid = idx < n
    vals = torch.where(valid, ordered, torch.zeros_like(ordered))
    csum = vals.cumsum(0)
    total = vals.sum()
    nf = n.clamp(min=1).to(vals.dtype)
    m2 = total / nf
    clipping = (n > 0) & (m2 > tau + _EPS)
    # The official walk: the first k with (v_k - eps) * (n - k - 1) + csum_k >= tau * n - eps, i.e. capping at
    # v_k would meet the budget; tau_c^2 is the previous breakpoint v_{k-1} - eps, or 0 when k == 0.
    rest = (n - idx - 1).to(vals.dtype)
    cond = ((vals - _EPS) * rest + csum >= tau * n.to(vals.dtype) - _EPS) & valid
    k = torch.argmax(cond.to(torch.uint8))
    prev = (k - 1).clamp(min=0).reshape(1)
    v_prev = vals.gather(0, prev).reshape(())
    tau_c2 = torch.where(k > 0, v_prev - _EPS, torch.zeros_like(v_prev)).clamp(min=0)
    capped = torch.where(k > 0, (v_prev * (n - k).to(vals.dtype) + csum.gather(0, prev).reshape(())) / nf, 0 * m2)
    tau_c = torch.where(clipping, tau_c2.sqrt(), torch.zeros_like(tau_c2))
    zero = torch.zeros((), dtype=vals.dtype, device=vals.device)
    low = torch.where(clipping, -torch.expm1(-tau_c), 1 + zero)  # 1 - e^{-tau_c}; no clip: lower bound 0
    high = torch.where(clipping, torch.expm1(tau_c), _NO_CLIP_HIGH - 1 + zero)  # e^{tau_c} - 1; no clip: 1e5
    if miniclip_low is not None:
        low = low.clamp(min=miniclip_low)
    if miniclip_high is not None:
        high = high.clamp(min=miniclip_high)
    m2_after = torch.where(clipping, capped, m2)
    return M2POBounds(low, high, clipping, tau_c, m2, m2_after, harmful)


def m2po_clip_bounds(
    log_ratio: FloatBT,
    advantages: PerSeqOrToken,
    mask: BoolBT,
    *,
    tau: float = 0.04,
    miniclip_low: float | None = None,
    miniclip_high: float | None = None,
) -> M2POBounds:
    r"""Batch PPO clip bounds from an M2 budget over the "harmful" tokens (the official M2PO code).

    .. math::
        H = \{(A > 0 \wedge r > 1) \vee (A < 0 \wedge r < 1)\}, \quad \Delta = \ell^{old} - \ell^\theta, \quad
        n = |H|, \\
        \tfrac1n \textstyle\sum_H \Delta^2 \le \tau \Rightarrow \text{no clip (ratio bounds } [0, 10^5]),
        \quad\text{else}\quad \tau_c^2 = \Delta^2_{(k-1)},\ k = \min\{k : \textstyle\sum_{j\le k}\Delta^2_{(j)}
        + (n-k-1)\Delta^2_{(k)} \ge \tau n\}, \\
        \epsilon_{low} = \max(1 - e^{-\tau_c}, \text{miniclip}_{low}), \qquad
        \epsilon_{high} = \max(e^{\tau_c} - 1, \text{miniclip}_{high})

    with :math:`\Delta^2_{(j)}` sorted ascending. This reproduces ``Infini-AI-Lab/M2PO@af54a3e``
    ``verl/trainer/ppo/core_algos.py`` (``kpo_clip_harmful_tokens``, ``_solve_tau_from_sorted_delta2``,
    ``compute_m2po_policy_loss``), read and confirmed from the public code: the walk goes over the sorted
    :math:`\Delta^2` ascending and stops at the first breakpoint :math:`k` where capping at
    :math:`\Delta^2_{(k)}` would meet the budget :math:`\tau n`; it returns the previous breakpoint (the
    last one that stays under budget), a conservative choice rather than the exact water-filling solution
    of :math:`\sum\min(\Delta^2, \tau_c^2) = \tau n`; :math:`k = 0` gives :math:`\tau_c = 0`. The code's
    ``1e-12`` tolerances are kept (harmful: :math:`|A| > 10^{-12}`, :math:`|r - 1| > 10^{-12}`; the walk's
    comparison; :math:`\tau_c^2 = \Delta^2_{(k-1)} - 10^{-12}`, floored at 0 here where the code would take
    the square root of a negative number). Vectorised: one sort and one cumulative sum, the breakpoint found
    by ``argmax`` on a tensor (the code loops in Python with ``.item()``).

    Differences from the code, all at its edges: the code reads the advantage of each row's first token
    (``advantages[:, 0]``); here each token's own advantage is used (identical for per-sequence advantages).
    For :math:`k = 0` the code reports the pre-clip M2 as ``M2_after``; here ``m2_after`` is the capped
    moment (0). The code builds :math:`e^{\pm\tau_c}` through a float32 tensor; here it stays in the input
    dtype. Defaults: τ = 0.04 (``M2_budget=0.04`` in every released script); the floors ``miniclip_low/high``
    default to None: the function signature says 0.3 / 0.5, but ``dp_actor.py`` passes the config values,
    which the released scripts leave unset (None, no floor). Reference: arXiv 2510.01161.

    Args:
        log_ratio: :math:`\ell^\theta - \ell^{old}` ``[B, T]`` (detached inside; :math:`\Delta` is its negative).
        advantages: ``[B]`` or ``[B, T]``.
        mask: bool loss mask ``[B, T]``.
        tau: the M2 budget τ > 0.
        miniclip_low, miniclip_high: floors on :math:`\epsilon_{low}`, :math:`\epsilon_{high}`, or None.

    Returns:
        :class:`M2POBounds` (batch-level 0-d tensors; no host sync).

    Edge cases: no harmful token (on-policy data, A ≡ 0, empty mask, ``B = 0`` or ``T = 0``) → no clipping and
    ``m2 = 0``.
    Oracle (by hand, following the official ``compute_m2po_policy_loss``): harmful :math:`\Delta^2` =
    [0.01, 0.01, 1.0], τ = 0.04 → :math:`\tau_c` = 0.1 → :math:`\epsilon_{low}` = 0.0952,
    :math:`\epsilon_{high}` = 0.1052.
    """
    _check_bounds_args(tau, miniclip_low, miniclip_high, "")
    dims = Dims()
    lr = as_float(log_ratio, "log_ratio", dims, "B T")
    adv = as_seq_or_token(advantages, "advantages", dims, device=lr.device)
    m = as_mask(mask, "mask", dims, "B T", device=lr.device)
    finite(lr, "log_ratio", m)
    finite(adv.expand_as(lr), "advantages", m)
    return _m2po_bounds(torch.where(m, lr, torch.zeros_like(lr)), adv, m, tau, miniclip_low, miniclip_high)


def _check_bounds_args(tau: float, miniclip_low: float | None, miniclip_high: float | None, owner: str) -> None:
    _check_tau(tau, f"{owner}tau")
    if miniclip_low is not None:
        positive(miniclip_low, f"{owner}miniclip_low", strict=False)
        if miniclip_low > 1:
            raise InputError(
                f"{owner}miniclip_low", "a floor on epsilon_low in [0, 1], or None", repr(miniclip_low), "use <= 1"
            )
    if miniclip_high is not None:
        positive(miniclip_high, f"{owner}miniclip_high", strict=False)


@dataclass(frozen=True)
class M2POClip:
    r"""Trust region: PPO clip with the official M2PO code's batch-adaptive bounds (:func:`m2po_clip_bounds`).

    .. math::  L = \max\big(-A r,\ -A\,\operatorname{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high})\big)

    with :math:`\epsilon_{low}, \epsilon_{high}` computed from this batch's harmful tokens (detached; no dual
    clip, as in ``compute_m2po_policy_loss``). :math:`\Delta` is the negative of the ``log_ratio`` the ratio
    stage built (``old`` vs current, :class:`~rolloutopt.ratios.TokenRatio`); ``ctx`` supplies only the mask
    (called by hand without it, every position counts — padded positions with log-ratio 0 are never harmful).
    Defaults: τ = 0.04, no floors (the released scripts; see :func:`m2po_clip_bounds`).
    Reference: M2PO, arXiv 2510.01161; ``Infini-AI-Lab/M2PO@af54a3e``.

    Indicators: ``clipfrac``, ``clip_low_frac``, ``clip_high_frac``, ``m2po_harmful_frac``. Metrics (the
    code's ``m2po/*``): ``m2po_clip_low``, ``m2po_clip_high`` (the ε bounds), ``m2po_m2``, ``m2po_m2_after``,
    ``m2po_tau_c``, ``m2po_clipping`` (1 when the budget was exceeded). Edge cases: ``B = 0``, ``T = 0`` and
    all-masked rows give zero loss, no clipping and zero metrics. Inputs beyond the common ones: none.
    """

    tau: float = 0.04
    miniclip_low: float | None = None
    miniclip_high: float | None = None
    requires: ClassVar[tuple[str, ...]] = ()
    accepts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check_bounds_args(self.tau, self.miniclip_low, self.miniclip_high, "M2POClip.")

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        m = ctx.mask if ctx is not None else torch.ones_like(ratio, dtype=torch.bool)
        b = _m2po_bounds(log_ratio, advantages, m, self.tau, self.miniclip_low, self.miniclip_high)
        loss, ind = bounded_clip_loss(ratio, advantages, 1 - b.low, 1 + b.high)
        ind["m2po_harmful_frac"] = b.harmful
        metrics = {
            "m2po_clip_low": b.low,
            "m2po_clip_high": b.high,
            "m2po_m2": b.m2,
            "m2po_m2_after": b.m2_after,
            "m2po_tau_c": b.tau_c,
            "m2po_clipping": b.clipping.to(b.m2.dtype),
        }
        return TrustOutput(loss, None, ind, metrics)
