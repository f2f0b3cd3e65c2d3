"""The composed policy objective: ratio → trust region → off-policy correction → regularisers → aggregation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, as_seq_or_token, choice, finite
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses.aggregation import AGG_MODES, AggMode, Denominators, aggregate
from rolloutopt.losses.regularizers import KL
from rolloutopt.ratios import PPOClip, TokenRatio, TrustOutput
from rolloutopt.typing import BoolBT, FloatB, FloatBT, IntB, PerSeqOrToken

__all__ = ["Correction", "CorrectionOutput", "LossOutput", "RatioStage", "TrustStage", "policy_loss"]


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
    """A trust region: ``(ratio, log_ratio, advantages, logp) -> TrustOutput`` (e.g. PPOClip, CISPO, SAPO)."""

    def __call__(self, ratio: Tensor, log_ratio: Tensor, advantages: Tensor, logp: Tensor) -> TrustOutput: ...


@dataclass(frozen=True)
class CorrectionOutput:
    """Per-token off-policy correction: a detached weight ``[B, T]``, an optional keep mask ``[B, T]`` and metrics."""

    weight: Tensor
    keep: Tensor | None = None
    metrics: dict[str, Tensor] = field(default_factory=dict)


@runtime_checkable
class Correction(Protocol):
    """The off-policy correction slot of :func:`policy_loss` (truncated/masked IS and friends).

    Called with the validated fp32 ``logp``, ``old_logp``, ``behav_logp`` (None when not given) and ``mask``;
    returns a :class:`CorrectionOutput`. Implementations live in :mod:`rolloutopt.ratios`.
    """

    def __call__(
        self, *, logp: Tensor, old_logp: Tensor, behav_logp: Tensor | None, mask: Tensor
    ) -> CorrectionOutput: ...


def _masked_mean(x: Tensor, m: Tensor, count: Tensor) -> Tensor:
    """Mean of ``x`` over the True positions of ``m`` (``count`` of them), detached; bool ``x`` counts as 0/1."""
    x = x.detach().to(count.dtype)
    return torch.where(m, x, torch.zeros_like(x)).sum() / count


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
    correction: Correction | None = None,
    is_weights: Tensor | None = None,
    kl: KL | None = None,
    entropy_coef: float = 0.0,
    agg: AggMode = "token-mean",
    denominators: Denominators | None = None,
    group: Groups | IntB | None = None,
    max_len: int | None = None,
    seq_weight: FloatB | None = None,
    removed_in_denominator: bool = True,
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
        correction: off-policy correction stage (:class:`Correction`), or None.
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
    # Padding may hold garbage (inf, NaN) in any input; this select makes the gradient at masked-out positions
    # exactly 0, so a non-finite local derivative there (0 * inf) cannot reach the caller's logp.
    lp = torch.where(m, lp, torch.zeros_like(lp))

    log_r = ratio.log_ratio(lp, old, m)
    r = torch.exp(log_r)
    out = TrustOutput(-adv * r, None, {}) if trust is None else trust(r, log_r, adv, lp)
    pg = out.loss
    keep = out.keep
    extra: dict[str, Tensor] = {}
    if correction is not None:
        c = correction(logp=lp, old_logp=old, behav_logp=behav, mask=m)
        pg = pg * c.weight
        keep = c.keep if keep is None else (keep if c.keep is None else keep & c.keep)
        extra.update(c.metrics)
    if is_weights is not None:
        w = as_seq_or_token(is_weights, "is_weights", dims, device=lp.device).detach()
        finite(w.expand_as(lp), "is_weights", m)
        pg = pg * w

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

    loss_mask = m if keep is None else m & keep
    denom_mask = m if removed_in_denominator else loss_mask
    kept = loss_mask  # before seq_weight: masked_frac reports trust-region and correction masks only
    if seq_weight is not None:
        sw = as_float(seq_weight, "seq_weight", dims, "B", device=lp.device)
        finite(sw, "seq_weight")
        total = total * sw[:, None]
        pg = pg * sw[:, None]
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

    count = m.sum().clamp(min=1).to(lp.dtype)
    rd = r.detach()
    metrics: dict[str, Tensor] = {
        "pg_loss": aggregate(pg.detach(), loss_mask, agg, **agg_kw).detach(),
        "ratio_mean": _masked_mean(rd, m, count),
        "ratio_max": torch.where(m, rd, torch.zeros_like(rd)).amax().detach() if rd.numel() else rd.sum().detach(),
        "approx_kl": _masked_mean(-log_r.detach(), m, count),
        "masked_frac": _masked_mean(~kept, m, count),
    }
    for name, ind in out.indicators.items():
        metrics[name] = _masked_mean(ind, m, count)
    metrics.update(extra)
    if ent is not None:
        metrics["entropy"] = _masked_mean(ent.detach(), m, count)
    if kl is not None:
        metrics["kl"] = _masked_mean(kl_tok.detach(), m, count)
    return LossOutput(loss=loss, per_token=per_token, metrics=metrics)
