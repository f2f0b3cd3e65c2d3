"""The composed policy objective: ratio → trust region → off-policy correction → regularisers → aggregation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_index, as_mask, as_seq_or_token, checks_enabled, choice, finite
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses.aggregation import AGG_MODES, AggMode, Denominators, aggregate
from rolloutopt.losses.regularizers import KL
from rolloutopt.ratios import PPOClip, TokenRatio, TrustOutput
from rolloutopt.ratios.context import (
    CorrectionOutput,
    StageContext,
    as_weights,
    masked_max,
    masked_mean,
    masked_quantiles,
)
from rolloutopt.typing import BoolBT, FloatB, FloatBT, IntB, PerSeqOrToken

__all__ = [
    "Correction",
    "CorrectionOutput",
    "LossOutput",
    "ProximalStage",
    "RatioStage",
    "StageContext",
    "TrustStage",
    "policy_loss",
]

RATIO_QUANTILES = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class LossOutput:
    """What a policy loss returns.

    Attributes:
        loss: the aggregated scalar to minimise (carries the gradient).
        per_token: the per-token loss ``[B, T]`` before aggregation (0 where a token does not count).
        metrics: detached 0-d tensors (no host synchronisation): ``pg_loss``, ``ratio_mean``, ``ratio_max``,
            ``approx_kl`` (mean of ℓ^old − ℓ^θ, verl's ``ppo_kl``), the trust region's clip fractions,
            ``masked_frac`` (fraction of loss tokens removed by a trust-region or correction mask),
            ``entropy`` and ``kl`` when given.
    """

    loss: Tensor
    per_token: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


class RatioStage(Protocol):
    """A ratio construction: ``log_ratio(logp, old_logp, mask) -> [B, T]`` (e.g. TokenRatio, GSPORatio)."""

    def log_ratio(self, logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor: ...


class TrustStage(Protocol):
    """A trust region: ``(ratio, log_ratio, advantages, logp, *, ctx) -> TrustOutput`` (e.g. PPOClip, CISPO).

    ``ctx`` (a :class:`StageContext`) carries the mask, the other log-probs and the optional inputs, for trust
    regions that need batch statistics (M2PO, SAT) or other policies (DPPO, TBPO).
    """

    def __call__(
        self, ratio: Tensor, log_ratio: Tensor, advantages: Tensor, logp: Tensor, *, ctx: StageContext | None = None
    ) -> TrustOutput: ...


class ProximalStage(Protocol):
    """Builds the proximal log-probs ``[B, T]`` (detached) from the context, when the trainer has none to give.

    Examples: A-3PO's version interpolation, CoPRIS's cross-stage concatenation (:mod:`rolloutopt.ratios`).
    """

    def __call__(self, ctx: StageContext) -> Tensor: ...


@runtime_checkable
class Correction(Protocol):
    """The off-policy correction slot of :func:`policy_loss` (truncated/masked IS and friends).

    Called with the :class:`StageContext` (validated ``logp``, ``old_logp``, ``behav_logp``, ``mask``,
    advantages and optional inputs); returns a :class:`CorrectionOutput`. Implementations live in
    :mod:`rolloutopt.ratios`. Several corrections compose: their weights multiply and their keep masks AND.
    """

    def __call__(self, ctx: StageContext) -> CorrectionOutput: ...


_masked_mean = masked_mean
_masked_max = masked_max


def _corrections(correction: Correction | Sequence[Correction] | None) -> tuple[Correction, ...]:
    if correction is None:
        return ()
    if isinstance(correction, Sequence):
        parts = tuple(correction)
        for i, c in enumerate(parts):
            if not callable(c):
                raise InputError(
                    f"correction[{i}]", "a Correction (callable on a StageContext)", repr(c), "pass correction stages"
                )
        return parts
    if not callable(correction):
        raise InputError("correction", "a Correction or a sequence of them", repr(correction), "pass e.g. TIS()")
    return (correction,)


@dataclass(frozen=True)
class AggregatedTerms:
    """What :func:`aggregate_terms` returns: the loss, the per-token loss, the weighted policy term, the loss mask
    (after sequence weights), the kept mask (before them) and the aggregation keywords used."""

    loss: Tensor
    per_token: Tensor
    pg: Tensor
    loss_mask: Tensor
    kept: Tensor
    agg_kw: dict[str, Any]


def aggregate_terms(
    total: Tensor,
    pg: Tensor,
    mask: Tensor,
    keep: Tensor | None,
    dims: Dims,
    *,
    agg: AggMode,
    seq_weight: Any,
    removed_in_denominator: bool,
    denominators: Denominators | None,
    group: Any,
    max_len: int | None,
) -> AggregatedTerms:
    """The last stage of a policy loss, shared by :func:`policy_loss` and the fused kernel: the loss mask (``mask``
    and the stages' ``keep``; removed tokens stay in the denominator with ``removed_in_denominator``), the
    per-sequence weights ``seq_weight [B]`` (a weight-0 sequence leaves the numerator and every denominator), and
    the aggregation with explicit denominators."""
    loss_mask = mask if keep is None else mask & keep
    denom_mask = mask if removed_in_denominator else loss_mask
    kept = loss_mask  # before seq_weight: masked_frac reports trust-region and correction masks only
    if seq_weight is not None:
        sw = as_float(seq_weight, "seq_weight", dims, "B", device=total.device)
        finite(sw, "seq_weight")
        total = total * sw[:, None].to(total.dtype)
        pg = pg * sw[:, None].to(pg.dtype)
        carries = (sw != 0)[:, None]
        loss_mask = loss_mask & carries
        denom_mask = denom_mask & carries
    per_token = torch.where(loss_mask, total, torch.zeros_like(total))
    agg_kw: dict[str, Any] = {
        "denominators": denominators,
        "group": group,
        "max_len": max_len,
        "denominator_mask": denom_mask,
    }
    loss = aggregate(per_token, loss_mask, agg, **agg_kw)
    return AggregatedTerms(loss, per_token, pg, loss_mask, kept, agg_kw)


def policy_loss(
    logp: FloatBT,
    old_logp: FloatBT | None,
    advantages: PerSeqOrToken,
    mask: BoolBT,
    *,
    behav_logp: FloatBT | None = None,
    ref_logp: FloatBT | None = None,
    entropy: FloatBT | None = None,
    ratio: RatioStage = TokenRatio(),
    trust: TrustStage | None = PPOClip(),
    correction: Correction | Sequence[Correction] | None = None,
    proximal: ProximalStage | None = None,
    is_weights: Tensor | None = None,
    kl: KL | None = None,
    entropy_coef: float = 0.0,
    agg: AggMode = "token-mean",
    denominators: Denominators | None = None,
    group: Groups | IntB | None = None,
    max_len: int | None = None,
    seq_weight: FloatB | None = None,
    removed_in_denominator: bool = True,
    versions: Tensor | None = None,
    policy_version: int | None = None,
    topk_logp: Tensor | None = None,
    topk_behav_logp: Tensor | None = None,
    confidence: FloatB | None = None,
    stage_inputs: dict[str, Any] | None = None,
) -> LossOutput:
    r"""Policy-gradient loss composed from stages: ratio, trust region, off-policy correction, KL, entropy.

    .. math::
        \ell_{i,t} = w_{i,t}\, L^{trust}\big(r_{i,t}, A_{i,t}\big) + \beta\, \widehat{KL}_{i,t}
                     - c_H\, H_{i,t}, \qquad \mathcal L = \operatorname{agg}(\ell, m)

    with :math:`r = \exp(\text{ratio.log\_ratio}(\ell^\theta, \ell^{old}))`, :math:`L^{trust}` the trust
    region's per-token term (PPO clip by default; ``trust=None`` gives the plain surrogate :math:`-A r`),
    :math:`w` the product of the correction weight and ``is_weights``, and ``agg`` one of the modes of
    :func:`rolloutopt.losses.aggregate`. References: PPO arXiv 1707.06347, GRPO arXiv 2402.03300, DAPO
    arXiv 2503.14476; the presets in :func:`rolloutopt.losses.get` cite their own.

    Args:
        logp: current policy log-probs of the sampled tokens ``[B, T]`` (carry the gradient).
        old_logp: proximal policy log-probs ``[B, T]``; ``None`` means on-policy (``logp.detach()``, so r ≡ 1
            and only the gradient of the surrogate remains, as in TRL with one iteration).
        advantages: ``[B]`` (broadcast over tokens) or ``[B, T]``.
        mask: loss mask ``[B, T]`` (bool, or 0/1).
        behav_logp: rollout-engine log-probs ``[B, T]``, passed to ``correction``.
        ref_logp: reference log-probs ``[B, T]``, required by ``kl``.
        entropy: per-token entropy ``[B, T]``, required when ``entropy_coef != 0`` and reported in metrics.
        ratio: ratio stage (:class:`~rolloutopt.ratios.TokenRatio`, :class:`~rolloutopt.ratios.GSPORatio`).
        trust: trust-region stage (:class:`~rolloutopt.ratios.PPOClip`, :class:`~rolloutopt.ratios.CISPO`,
            :class:`~rolloutopt.ratios.SAPO`) or None.
        correction: off-policy correction stage (:class:`Correction`), a sequence of them (weights multiply,
            keep masks AND; e.g. a rejection filter then truncated IS), or None.
        proximal: a stage that builds the proximal log-probs from the other inputs (A-3PO's interpolation,
            CoPRIS's cross-stage concatenation); then ``old_logp`` is what the stage reads as the trainer's
            recompute (CoPRIS) or may be None (A-3PO).
        is_weights: precomputed, detached importance weights ``[B, T]`` or ``[B]`` multiplied into the policy
            term (verl's ``rollout_is_weights``, TRL's ``importance_sampling_ratio``).
        kl: KL regulariser against ``ref_logp``, or None.
        entropy_coef: entropy bonus coefficient :math:`c_H` (subtracted, so positive values favour entropy).
        agg: aggregation mode; ``denominators``, ``group`` and ``max_len`` as in :func:`aggregate`.
        seq_weight: per-sequence weight ``[B]`` (``AdvantageOutput.weight``); a rollout with weight 0 leaves
            the loss and its denominators.
        removed_in_denominator: whether tokens removed by a trust-region or correction mask stay in the
            denominator (True, AReaL and TRL: a mask does not inflate the other tokens' gradients) or leave it
            (False, verl's folding of rejection masks into the response mask).
        versions: policy version that generated each token, int ``[B, T]`` (CoPRIS, A-3PO; staleness metrics).
        policy_version: version of the policy being trained (A-3PO; staleness is measured against it, or
            against the newest version in ``versions`` when None).
        topk_logp, topk_behav_logp: ``[B, T, K]`` current and rollout-engine log-probs at the rollout
            engine's top-K token ids (DPPO's top-K divergences and the predictive mask).
        confidence: per-sequence confidence ``[B]`` in [0, 1] (ECHO's confidence-adaptive clip).
        stage_inputs: further named inputs for custom stages (``StageContext.extra``).

    Metrics (besides the trust region's and corrections' own): ``pg_loss``, ``ratio_mean``, ``ratio_max``,
    ``ratio_q10/q50/q90`` (lower order statistics over loss tokens; over an even stride of at most 16,384
    positions in larger batches), ``log_ratio_max`` (max |log r|),
    ``approx_kl``, ``masked_frac``; ``is_weight_mean``, ``is_weight_max`` and ``is_ess`` (effective sample
    size fraction :math:`(\sum w)^2 / (N \sum w^2)`, verl's ``1/mean((w/mean w)^2)``) when a correction or
    ``is_weights`` applies; ``staleness_mean``/``staleness_max`` (versions behind) when ``versions`` is given.

    Edge cases: all-masked rows contribute nothing and leave sequence denominators; an empty batch gives
    loss 0; log-ratios are clamped so every finite input gives a finite loss; non-finite values at masked-in
    positions raise (unless checks are off).
    """
    if not isinstance(entropy_coef, (int, float)) or isinstance(entropy_coef, bool) or not math.isfinite(entropy_coef):
        raise InputError(
            "entropy_coef", "a finite number", repr(entropy_coef), "pass a float (0.0 turns the bonus off)"
        )
    choice(agg, "agg", AGG_MODES)
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    m = as_mask(mask, "mask", dims, "B T", device=lp.device)
    old = lp.detach() if old_logp is None else as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    adv = as_seq_or_token(advantages, "advantages", dims, device=lp.device)
    finite(lp, "logp", m)
    finite(old, "old_logp", m)
    finite(adv.expand_as(lp), "advantages", m)
    behav = None if behav_logp is None else as_float(behav_logp, "behav_logp", dims, "B T", device=lp.device)
    if behav is not None:
        finite(behav, "behav_logp", m)
    corrections = _corrections(correction)
    # Padding may hold garbage (inf, NaN) in any input; this select makes the gradient at masked-out positions
    # exactly 0, so a non-finite local derivative there (0 * inf) cannot reach the caller's logp.
    lp = torch.where(m, lp, torch.zeros_like(lp))
    ctx = StageContext(
        logp=lp,
        old_logp=None if (old_logp is None and proximal is not None) else old,
        mask=m,
        advantages=adv,
        behav_logp=behav,
        versions=None if versions is None else as_index(versions, "versions", dims, "B T"),
        policy_version=_version(policy_version),
        topk_logp=_topk(topk_logp, "topk_logp", dims, lp.device, m),
        topk_behav_logp=_topk(topk_behav_logp, "topk_behav_logp", dims, lp.device, m),
        confidence=None if confidence is None else _confidence(confidence, dims, lp.device),
        extra=dict(stage_inputs or {}),
    )
    if proximal is not None:
        old = proximal(ctx).detach()
        ctx = replace(ctx, old_logp=old)

    log_r = ratio.log_ratio(lp, old, m)
    r = torch.exp(log_r)
    out = TrustOutput(-adv * r, None, {}) if trust is None else trust(r, log_r, adv, lp, ctx=ctx)
    pg = out.loss
    keep = out.keep
    extra: dict[str, Tensor] = {}
    weight: Tensor | None = None
    for corr in corrections:
        c = corr(ctx)
        weight = c.weight if weight is None else weight * c.weight
        keep = c.keep if keep is None else (keep if c.keep is None else keep & c.keep)
        extra.update(c.metrics)
    if is_weights is not None:
        w = as_seq_or_token(is_weights, "is_weights", dims, device=lp.device).detach()
        finite(w.expand_as(lp), "is_weights", m)
        weight = w if weight is None else weight * w
    if weight is not None:
        weight = weight.detach()
        pg = pg * weight

    total = pg
    if kl is not None:
        if ref_logp is None:
            raise InputError(
                "ref_logp", "reference log-probs [B, T] when kl is set", "None", "pass ref_logp=... or kl=None"
            )
        ref = as_float(ref_logp, "ref_logp", dims, "B T", device=lp.device)
        kl_tok = kl.per_token(lp, ref, m)
        total = total + kl.coef * kl_tok
    ent = None
    if entropy is not None:
        ent = as_float(entropy, "entropy", dims, "B T", device=lp.device)
        finite(ent, "entropy", m)
    if entropy_coef != 0.0:
        if ent is None:
            raise InputError(
                "entropy",
                "per-token entropy [B, T] when entropy_coef != 0",
                "None",
                "pass entropy=... or entropy_coef=0",
            )
        total = total - entropy_coef * ent

    regularised = total is not pg
    a = aggregate_terms(
        total, pg, m, keep, dims, agg=agg, seq_weight=seq_weight, removed_in_denominator=removed_in_denominator,
        denominators=denominators, group=group, max_len=max_len,
    )  # fmt: skip
    loss, per_token, pg, loss_mask, kept, agg_kw = a.loss, a.per_token, a.pg, a.loss_mask, a.kept, a.agg_kw

    # Metrics: one float mask for every masked mean (a bool mask is converted once, not per metric), and the
    # policy-term loss is the loss itself when no regulariser was added.
    n_tok = m.sum()
    count = n_tok.clamp(min=1).to(lp.dtype)
    mf = as_weights(m, lp.dtype)
    rd = r.detach()
    lrd = log_r.detach()
    metrics: dict[str, Tensor] = {
        "pg_loss": aggregate(pg.detach(), loss_mask, agg, **agg_kw).detach() if regularised else loss.detach(),
        "ratio_mean": _masked_mean(rd, mf, count),
        "ratio_max": _masked_max(rd, mf),
        "log_ratio_max": _masked_max(lrd.abs(), mf),
        "approx_kl": -_masked_mean(lrd, mf, count),
        "masked_frac": (n_tok - kept.sum()).to(lp.dtype) / count if keep is not None else torch.zeros_like(count),
    }
    for q, v in zip(RATIO_QUANTILES, masked_quantiles(rd, m, RATIO_QUANTILES), strict=True):
        metrics[f"ratio_q{round(q * 100)}"] = v
    for name, ind in out.indicators.items():
        metrics[name] = _masked_mean(ind, mf, count)
    metrics.update({k: v.detach() for k, v in out.metrics.items()})
    if weight is not None:
        metrics.update(weight_metrics(weight.expand_as(lp), mf))
    if ctx.versions is not None:
        metrics.update(staleness_metrics(ctx.versions, m, ctx.policy_version))
    metrics.update(extra)
    if ent is not None:
        metrics["entropy"] = _masked_mean(ent.detach(), mf, count)
    if kl is not None:
        metrics["kl"] = _masked_mean(kl_tok.detach(), mf, count)
    return LossOutput(loss=loss, per_token=per_token, metrics=metrics)


def weight_metrics(weight: Tensor, mask: Tensor) -> dict[str, Tensor]:
    r"""Mean, max and effective-sample-size fraction of per-token weights over ``mask`` (detached).

    ``is_ess`` = :math:`(\sum_t w)^2 / (N \sum_t w^2)` over the N loss tokens: 1 for equal weights, 1/N when
    one token carries all the weight (verl's ``rollout_is_eff_sample_size`` = ``1/mean((w/mean w)^2)``).
    """
    w = weight.detach().nan_to_num(0.0, 0.0, 0.0) * as_weights(mask, weight.dtype)
    n = mask.sum().clamp(min=1).to(w.dtype)
    s1, s2 = w.sum(), (w * w).sum()
    return {
        "is_weight_mean": s1 / n,
        "is_weight_max": w.amax() if w.numel() else w.sum(),
        "is_ess": torch.where(s2 > 0, s1 * s1 / (n * s2), torch.ones_like(s2)),
    }


def staleness_metrics(versions: Tensor, mask: Tensor, policy_version: int | None) -> dict[str, Tensor]:
    """How many versions behind the trained policy each loss token was generated: mean, max, fraction stale."""
    v = versions.to(torch.float64)
    newest = torch.where(mask, v, torch.full_like(v, -torch.inf)).amax() if policy_version is None else policy_version
    lag = torch.where(mask, newest - v, torch.zeros_like(v)).to(torch.float32)
    return {
        "staleness_mean": _masked_mean(lag, mask),
        "staleness_max": _masked_max(lag, mask),
        "stale_frac": _masked_mean(lag > 0, mask),
    }


def _version(v: Any) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise InputError("policy_version", "an int (the trained policy's version)", repr(v), "pass e.g. step")
    return v


def _topk(x: Any, name: str, dims: Dims, device: torch.device, m: Tensor) -> Tensor | None:
    if x is None:
        return None
    t = as_float(x, name, dims, "B T K", device=device)
    finite(t, name, m[..., None].expand_as(t))
    return t


def _confidence(x: Any, dims: Dims, device: torch.device) -> Tensor:
    c = as_float(x, "confidence", dims, "B", device=device)
    finite(c, "confidence")
    if checks_enabled() and bool(((c < 0) | (c > 1)).any()):
        raise InputError("confidence", "values in [0, 1]", f"min {float(c.min())}, max {float(c.max())}", "rescale it")
    return c
