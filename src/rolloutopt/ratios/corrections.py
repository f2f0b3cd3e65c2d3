r"""Behaviour-policy corrections between the rollout engine and the trainer: TIS, MIS / IcePop, OPSM, rejection.

The rollout engine (vLLM, SGLang, an FP8 kernel) samples with log-probs :math:`\ell^{beh}` that differ from
the trainer's recompute :math:`\ell^{old}` of the same weights (precision, kernels, staleness). The mismatch
ratio :math:`\rho_{i,t} = \exp(\ell^{old}_{i,t} - \ell^{beh}_{i,t})` is corrected here, as the
``correction=`` stage of :func:`rolloutopt.losses.policy_loss` (``(ctx) -> CorrectionOutput``):

- :class:`TIS` — truncated importance sampling, token, sequence or geometric level (verl ``rollout_is``, TRL
  ``*_truncate``, ROLL's ``is_weight``, slime); ``source="current"`` is the bypass / REINFORCE variant against
  :math:`\ell^\theta`.
- :class:`MIS` — masked importance sampling / IcePop: out-of-band tokens or sequences leave the loss (verl
  IcePop ``"lower_upper"`` thresholds, TRL ``*_mask``), token, sequence or geometric level.
- :func:`fp8_token_tis`, :func:`fp8_token_mis` — the FP8-RL report's token-level variants (arXiv 2601.18150).
- :class:`OPSM` — DeepSeek-V3.2's off-policy sequence mask, as TRL's ``off_policy_mask_threshold``.
- :class:`RejectionFilter` — verl's ``rollout_rs`` chain of divergence filters (``token_k1`` …
  ``seq_max_k3``) and ROLL's catastrophic reject.

Every weight is detached; a mask is returned as ``keep`` (tokens with ``keep=False`` leave the loss
numerator; whether they stay in the denominator is ``policy_loss(removed_in_denominator=...)``, see
``docs/conventions.md``).
Log-ratios are clamped to ``±clamp`` (verl: 20) before ``exp``, so every finite input gives finite weights.
Weights are 0 outside ``mask`` (as verl's). The pure weight functions return a
:class:`~rolloutopt.ratios.CorrectionOutput` like the stages, the pure mask functions a
:class:`~rolloutopt.ratios.MaskOutput`. Each stage reports metrics with its own prefix (``tis_``,
``mis_``, ``opsm_``, ``rs_``); ``policy_loss`` adds ``is_weight_mean``/``is_weight_max``/``is_ess`` of the
combined weight. Nothing here synchronises with the host (batch normalisation included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    as_seq_or_token,
    choice,
    finite,
    positive,
    require_experimental,
)
from rolloutopt.errors import InputError
from rolloutopt.ratios.context import CorrectionOutput, MaskOutput, StageContext, as_weights
from rolloutopt.typing import BoolBT, FloatBT, FloatBTb, PerSeqOrToken, Scalar

__all__ = [
    "MIS",
    "OPSM",
    "RS_OPTIONS",
    "TIS",
    "RejectionFilter",
    "fp8_token_mis",
    "fp8_token_tis",
    "from_trl_vllm_is",
    "from_verl_rollout_is",
    "mis_weight",
    "offpolicy_metrics",
    "opsm_keep",
    "rejection_keep",
    "rs_statistic",
    "tis_weight",
]

TisLevel = Literal["token", "sequence", "geometric"]
MisLevel = Literal["token", "sequence", "geometric"]
Source = Literal["old", "current"]
SAFETY_BOUND = 20.0  # verl's SAFETY_BOUND: |log ratio| clamp before exp
_SUM_BOUND = 1e6  # token values are clamped to this before an unclamped row sum (verl's sequence IS, TRL's OPSM),
# so that +inf and -inf partial sums cannot meet (NaN); no real log-ratio comes near it

RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
    "catastrophic",
)
"""Rejection-filter options: verl 0.9.1's ``rollout_rs`` options plus ROLL's ``"catastrophic"`` reject."""


# ----------------------------------------------------------------------------------------------- helpers


def _zeros(x: Tensor) -> Tensor:
    return torch.zeros_like(x)


def _mean(x: Tensor, m: Tensor, dtype: torch.dtype) -> Tensor:
    """Mean of ``x`` over True positions of ``m`` (any shape) in ``dtype``, 0 when empty; bool ``x`` counts as 0/1."""
    xv = as_weights(x, dtype) if x.dtype == torch.bool else x.to(dtype)
    return (xv * as_weights(m, dtype)).sum() / m.sum().clamp(min=1).to(dtype)


def _max(x: Tensor, m: Tensor) -> Tensor:
    if x.numel() == 0:
        return x.sum()
    v = torch.where(m, x, torch.full_like(x, -math.inf)).amax()
    return torch.where(m.any(), v, _zeros(v))


def _min(x: Tensor, m: Tensor) -> Tensor:
    if x.numel() == 0:
        return x.sum()
    v = torch.where(m, x, torch.full_like(x, math.inf)).amin()
    return torch.where(m.any(), v, _zeros(v))


def _lengths(m: Tensor, dtype: torch.dtype) -> Tensor:
    return m.sum(-1).to(dtype)


def _masked_lr(lr: Tensor, m: Tensor) -> Tensor:
    return torch.where(m, lr, _zeros(lr))


def _mismatch_log_ratio(ctx: StageContext, source: Source, by: str) -> Tensor:
    """Detached :math:`\\ell^{ref} - \\ell^{beh}` with ref the proximal (``"old"``) or current policy, 0 outside mask."""
    behav: Tensor = ctx.need("behav_logp", by)
    ref = ctx.need("old_logp", by) if source == "old" else ctx.logp
    return _masked_lr((ref - behav).detach(), ctx.mask)


def _check_source(source: Any, owner: str) -> None:
    choice(source, f"{owner}.source", ("old", "current"))


def _validate_lr(log_ratio: Any, mask: Any) -> tuple[Tensor, Tensor]:
    dims = Dims()
    lr = as_float(log_ratio, "log_ratio", dims, "B T")
    m = as_mask(mask, "mask", dims, "B T", device=lr.device)
    finite(lr, "log_ratio", m)
    return _masked_lr(lr.detach(), m), m


def _batch_normalize(w: Tensor, m: Tensor, per_sequence: bool) -> tuple[Tensor, Tensor]:
    """verl's ``rollout_is_batch_normalize``: divide by the token mean (or the mean of per-sequence weights)."""
    mf = as_weights(m, w.dtype)
    if per_sequence:
        lengths = mf.sum(-1)
        valid = lengths > 0
        seq_w = (w * mf).sum(-1) / lengths.clamp(min=1)
        mean = (seq_w * as_weights(valid, w.dtype)).sum() / valid.sum().clamp(min=1).to(w.dtype)
    else:
        mean = (w * mf).sum() / mf.sum().clamp(min=1)
    ok = mean > 1e-8  # verl leaves the weights as they are when the mean is (near) 0
    return torch.where(ok, w / torch.where(ok, mean, torch.ones_like(mean)), w), torch.where(
        ok, mean, torch.ones_like(mean)
    )


def _rho_log(lr: Tensor, m: Tensor, level: str, clamp: float) -> Tensor:
    """The clamped log of the mismatch ratio at ``level``, ``[B, T]`` (token) or ``[B, 1]`` (sequence levels)."""
    if level == "token":
        return lr.clamp(-clamp, clamp)
    if level == "sequence":  # verl / TRL: the product of token ratios (sum of logs), clamped after the sum
        return lr.clamp(-_SUM_BOUND, _SUM_BOUND).sum(-1, keepdim=True).clamp(-clamp, clamp)
    # geometric: mean of the clamped token log-ratios (verl's seq_mean_k1 statistic), length invariant
    lengths = _lengths(m, lr.dtype).clamp(min=1)
    return (lr.clamp(-clamp, clamp).sum(-1) / lengths)[:, None]


# ----------------------------------------------------------------------------------------------- TIS


def _check_tis(cap: Any, lower: Any, level: Any, batch_normalize: Any, clamp: Any, owner: str) -> None:
    if cap is None and lower is None:
        raise InputError(
            f"{owner}cap", "an upper bound (or cap=None with a lower bound)", "cap=None and lower=None", "set cap=2.0"
        )
    if cap is not None:
        positive(cap, f"{owner}cap")
    if lower is not None:
        positive(lower, f"{owner}lower", strict=False)
        if cap is not None and lower > cap:
            raise InputError(f"{owner}lower", f"a lower bound <= cap={cap}", repr(lower), "lower the lower bound")
    choice(level, f"{owner}level", ("token", "sequence", "geometric"))
    if not isinstance(batch_normalize, bool):
        raise InputError(f"{owner}batch_normalize", "a bool", repr(batch_normalize), "pass True or False")
    positive(clamp, f"{owner}clamp")


def _tis(
    lr: Tensor, m: Tensor, cap: float | None, lower: float | None, level: str, batch_normalize: bool, clamp: float
) -> CorrectionOutput:
    """TIS on a validated, masked log-ratio: the weight ``[B, T]`` and the ``tis_*`` metrics."""
    log_rho = _rho_log(lr, m, level, clamp)
    raw = torch.exp(log_rho)
    w = raw.clamp(min=lower, max=cap).expand_as(lr) * as_weights(m, lr.dtype)
    factor = None
    if batch_normalize:
        w, factor = _batch_normalize(w, m, per_sequence=level != "token")
    at = m if level == "token" else m.any(-1, keepdim=True)
    dt = lr.dtype
    high = raw > cap if cap is not None else torch.zeros_like(at)
    low = raw < lower if lower is not None else torch.zeros_like(at)
    metrics = {
        "tis_high_frac": _mean(high, at, dt),
        "tis_low_frac": _mean(low, at, dt),
        "tis_raw_mean": _mean(raw, at, dt),
        "tis_raw_max": _max(raw, at),
        "tis_raw_min": _min(raw, at),
        "tis_log_ratio_mean": _mean(log_rho, at, dt),
    }
    if factor is not None:
        metrics["tis_batch_norm_factor"] = factor
    return CorrectionOutput(w, None, metrics)


def tis_weight(
    log_ratio: FloatBT,
    mask: BoolBT,
    *,
    cap: float | None = 2.0,
    lower: float | None = None,
    level: TisLevel = "token",
    batch_normalize: bool = False,
    clamp: float = SAFETY_BOUND,
) -> CorrectionOutput:
    r"""Truncated importance-sampling weight of the rollout/trainer mismatch, token, sequence or geometric level.

    With :math:`\delta_{i,t} = \ell^{old}_{i,t} - \ell^{beh}_{i,t}` (``log_ratio``), :math:`C` = ``cap``,
    :math:`C_{low}` = ``lower`` and :math:`L_i = \sum_t m_{i,t}`:

    .. math::
        w^{tok}_{i,t} = \min\big(\max(e^{\operatorname{clip}(\delta_{i,t}, \pm c)}, C_{low}), C\big), \qquad
        w^{seq}_{i} = \min\big(\max(e^{\operatorname{clip}(\sum_t m_{i,t}\delta_{i,t}, \pm c)}, C_{low}), C\big),

    .. math::
        w^{geo}_{i} = \min\Big(\max\big(e^{\frac{1}{\max(L_i, 1)}\sum_t m_{i,t}\operatorname{clip}(\delta_{i,t},
        \pm c)}, C_{low}\big), C\Big)

    The sequence weight is the *product* of the token ratios (the sum of logs, clamped after the sum), as in
    verl ``rollout_is="sequence"`` and TRL ``sequence_truncate`` (token values are bounded at ±1e6 before the
    sum so that no finite input gives NaN; real log-ratios never get there). The geometric weight is their
    geometric mean, length invariant: ROLL's ``train_infer_correction.is_weight.weight_type="geometric"``
    (``alibaba/ROLL@8eb27cc`` ``roll/utils/train_infer_corrections.py``: ``exp(masked_mean(old - infer))``
    clamped to ``[0, upper_bound]``; ROLL divides by :math:`L_i + 10^{-8}` and does not clamp the token
    log-ratios, so the weights agree to a relative :math:`10^{-8}/L_i` while every :math:`|\delta| \le c`).
    With ``batch_normalize`` (verl ``rollout_is_batch_normalize``) the truncated weights are divided by their
    mean: over loss tokens at token level, over non-empty sequences at the sequence levels; a mean ≤ 1e-8
    leaves them unchanged. The mean is over the local batch (verl uses a distributed mean when
    torch.distributed is initialised). No paper: the "Your efficient RL framework secretly brings you
    off-policy RL training" blog (Yao et al., 2025); verl ``compute_rollout_correction_weights``; used by the
    FP8-RL report, arXiv 2601.18150.

    Args:
        log_ratio: :math:`\ell^{old} - \ell^{beh}` (or :math:`\ell^\theta - \ell^{beh}` in bypass mode) ``[B, T]``;
            unclamped (the clamp applies to the token value or the sequence sum).
        mask: loss mask ``[B, T]``.
        cap: upper truncation :math:`C` (default 2.0: verl ``rollout_is_threshold``, ROLL
            ``infer_is_threshold_max``, slime ``--tis-clip``; ROLL's ``is_weight.upper_bound`` defaults to 1.2);
            None for none (TRL truncate with only a lower bound).
        lower: optional lower clamp :math:`C_{low}` (ROLL ``infer_is_threshold_min``, TRL
            ``vllm_importance_sampling_clip_min``); None (verl; ROLL's ``is_weight`` clamps at 0) for none.
        level: ``"token"``, ``"sequence"`` or ``"geometric"`` (the two sequence levels broadcast over the row).
        batch_normalize: verl's batch normalisation to mean 1.
        clamp: bound on the log before ``exp`` (verl 20; TRL has none, so use a larger one for TRL parity).

    Returns:
        A :class:`~rolloutopt.ratios.CorrectionOutput`: the detached ``weight`` ``[B, T]`` (0 outside ``mask``),
        ``keep=None``, and the ``tis_*`` metrics of :class:`TIS`.

    Edge cases: an empty row has sequence and geometric weight 1 before masking; ``B = 0``, ``T = 0`` and an
    all-masked batch give zero weights and zero metrics. Oracle (by hand): :math:`\delta = [\log 3, 0,
    \log 0.5]` gives token weights ``[2, 1, 0.5]``, sequence weight ``min(1.5, 2) = 1.5`` and geometric weight
    :math:`1.5^{1/3} = 1.1447`.
    """
    _check_tis(cap, lower, level, batch_normalize, clamp, "")
    lr, m = _validate_lr(log_ratio, mask)
    return _tis(lr, m, cap, lower, level, batch_normalize, clamp)


@dataclass(frozen=True)
class TIS:
    r"""Correction: truncated importance sampling of the behaviour mismatch (:func:`tis_weight`).

    ``source="old"`` (decoupled, verl's default mode): :math:`\rho = \exp(\ell^{old} - \ell^{beh})`;
    ``source="current"`` (bypass / REINFORCE variant): :math:`\rho = \operatorname{sg}(\exp(\ell^\theta -
    \ell^{beh}))`. Needs ``behav_logp``. Defaults: ``cap=2.0`` (verl ``rollout_is_threshold``; FP8-RL's
    token TIS C=2), token level, no lower clamp, no batch normalisation. ``level="geometric"`` is ROLL's
    ``is_weight.weight_type="geometric"`` (pass ROLL's ``upper_bound``, default 1.2, as ``cap``).

    Reference: the TIS blog (Yao et al., 2025; no arXiv paper), verl ``rollout_is``, FP8-RL arXiv 2601.18150,
    ROLL ``compute_train_infer_correction``. Edge cases: an empty row has sequence and geometric weight 1 before
    masking; weights are 0 outside ``mask``; ``B = 0``, ``T = 0`` and an all-masked batch give zero weights and
    zero metrics.

    Metrics (raw = before truncation, over loss tokens at token level and non-empty rows at the sequence
    levels): ``tis_high_frac`` / ``tis_low_frac`` (fraction truncated from above / below), ``tis_raw_mean``,
    ``tis_raw_max``, ``tis_raw_min``, ``tis_log_ratio_mean`` (mean of :math:`\log\rho` at the level, i.e.
    minus the k1 estimate of KL(π_beh‖π_old) per token, per sequence or per token of a sequence), and
    ``tis_batch_norm_factor`` with ``batch_normalize``.
    """

    cap: float | None = 2.0
    level: TisLevel = "token"
    lower: float | None = None
    batch_normalize: bool = False
    source: Source = "old"
    clamp: float = SAFETY_BOUND
    requires: ClassVar[tuple[str, ...]] = ("behav_logp",)
    accepts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check_tis(self.cap, self.lower, self.level, self.batch_normalize, self.clamp, "TIS.")
        _check_source(self.source, "TIS")

    def __call__(self, ctx: StageContext) -> CorrectionOutput:
        lr = _mismatch_log_ratio(ctx, self.source, "TIS")
        return _tis(lr, ctx.mask, self.cap, self.lower, self.level, self.batch_normalize, self.clamp)


# ----------------------------------------------------------------------------------------------- MIS


def _check_mis(low: Any, high: Any, level: Any, in_band: Any, batch_normalize: Any, clamp: Any, owner: str) -> None:
    if low is None and high is None:
        raise InputError(f"{owner}high", "at least one bound", "low=None and high=None", "set e.g. high=5.0")
    if low is not None:
        positive(low, f"{owner}low")
    if high is not None:
        positive(high, f"{owner}high")
    if low is not None and high is not None and low > high:
        raise InputError(f"{owner}low", f"a lower bound <= high={high}", repr(low), "swap or fix the bounds")
    choice(level, f"{owner}level", ("token", "sequence", "geometric"))
    choice(in_band, f"{owner}in_band", ("ratio", "one"))
    if not isinstance(batch_normalize, bool):
        raise InputError(f"{owner}batch_normalize", "a bool", repr(batch_normalize), "pass True or False")
    positive(clamp, f"{owner}clamp")


def _mis(
    lr: Tensor,
    m: Tensor,
    low: float | None,
    high: float | None,
    level: str,
    in_band: str,
    batch_normalize: bool,
    clamp: float,
) -> CorrectionOutput:
    """MIS on a validated, masked log-ratio: weight ``[B, T]``, keep ``[B, T]`` (within ``m``), ``mis_*`` metrics."""
    rho = torch.exp(_rho_log(lr, m, level, clamp))
    # Compare ratios, not logs, as verl's IcePop and TRL's *_mask modes do (identical at the bounds).
    too_high = rho > high if high is not None else torch.zeros_like(rho, dtype=torch.bool)
    too_low = rho < low if low is not None else torch.zeros_like(rho, dtype=torch.bool)
    keep = (~(too_high | too_low)).expand_as(lr) & m
    value = rho.expand_as(lr) if in_band == "ratio" else torch.ones_like(lr)
    w = torch.where(keep, value, _zeros(lr))
    factor = None
    if batch_normalize:
        w, factor = _batch_normalize(w, m, per_sequence=level != "token")
    hi_t, lo_t = too_high.expand_as(m), too_low.expand_as(m)
    dt = lr.dtype
    metrics = {
        "mis_high_frac": _mean(hi_t, m, dt),
        "mis_low_frac": _mean(lo_t, m, dt),
        "mis_oob_frac": _mean(hi_t | lo_t, m, dt),
    }
    if level != "token":
        metrics["mis_seq_oob_frac"] = _mean(too_high | too_low, m.any(-1, keepdim=True), dt)
    if factor is not None:
        metrics["mis_batch_norm_factor"] = factor
    return CorrectionOutput(w, keep, metrics)


def mis_weight(
    log_ratio: FloatBT,
    mask: BoolBT,
    *,
    low: float | None = 0.5,
    high: float | None = 5.0,
    level: MisLevel = "token",
    in_band: Literal["ratio", "one"] = "ratio",
    batch_normalize: bool = False,
    clamp: float = SAFETY_BOUND,
) -> CorrectionOutput:
    r"""Masked importance sampling (IcePop): keep a token or sequence only while its mismatch ratio is in a band.

    .. math::
        w_{i,t} = \begin{cases} \rho & C_{low} \le \rho \le C_{high} \\ 0 & \text{otherwise}\end{cases},
        \qquad \rho = \begin{cases} e^{\operatorname{clip}(\delta_{i,t}, \pm c)} & \text{token} \\
        e^{\operatorname{clip}(\sum_t m_{i,t}\delta_{i,t}, \pm c)} & \text{sequence} \\
        e^{\frac{1}{L_i}\sum_t m_{i,t}\operatorname{clip}(\delta_{i,t}, \pm c)} & \text{geometric}\end{cases}

    with :math:`\delta = \ell^{old} - \ell^{beh}`. ``in_band="one"`` gives the pure mask (weight 1 in band).
    Out-of-band tokens (or every token of an out-of-band sequence) get ``keep=False`` and weight 0. Token level
    with ``(0.5, 5.0)`` is verl's ``decoupled_token_icepop`` (``rollout_is_threshold="0.5_5.0"``; verl's
    in-band weight is the ratio); sequence level is TRL's ``sequence_mask`` (a product, like verl's
    sequence IS); the geometric level is the length-invariant Geo-RS band (and, with ``in_band="one"``,
    ROLL's ratio filter ``agg_type="geometric"``, ``ratio_low``/``ratio_high``). ``low=None`` is one-sided
    (TRL's default ``clip_min=None``). IcePop: Ant Ling/Ring team blog "Small leak can sink a great ship" and
    the Ring-1T report (arXiv id not confirmed); the values 0.5/5.0 and the in-band weight ρ follow verl, not
    the blog (both are keywords; ``docs/methods/corrections.md``).

    Args:
        log_ratio: :math:`\ell^{old} - \ell^{beh}` ``[B, T]`` (unclamped).
        mask: loss mask ``[B, T]``.
        low, high: the band (defaults 0.5 / 5.0, verl ``decoupled_token_icepop``); None drops that side.
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        in_band: ``"ratio"`` (IcePop, verl, TRL) or ``"one"`` (pure mask).
        batch_normalize: verl's normalisation of the weights to mean 1 (zeros of masked tokens included).
        clamp: bound on the log before ``exp`` (verl 20).

    Returns:
        A :class:`~rolloutopt.ratios.CorrectionOutput`: the detached ``weight`` ``[B, T]`` (0 outside ``mask``
        and outside the band), ``keep`` (bool ``[B, T]``, in the band and in ``mask``) and the ``mis_*``
        metrics of :class:`MIS`.

    Edge cases: an empty row has sequence and geometric ratio 1; ``B = 0``, ``T = 0`` and an all-masked batch
    give zero weights, an all-False ``keep`` and zero metrics. Oracle (by hand): :math:`\rho = [0.4, 1.2, 6.0]`
    with the band (0.5, 5) gives weights ``[0, 1.2, 0]``.
    """
    _check_mis(low, high, level, in_band, batch_normalize, clamp, "")
    lr, m = _validate_lr(log_ratio, mask)
    return _mis(lr, m, low, high, level, in_band, batch_normalize, clamp)


@dataclass(frozen=True)
class MIS:
    r"""Correction: masked importance sampling / IcePop (:func:`mis_weight`); out-of-band positions get ``keep=False``.

    Defaults ``low=0.5, high=5.0``, token level, in-band weight = ratio: verl's ``decoupled_token_icepop``
    (``docs/methods/corrections.md``). ``source`` as in :class:`TIS`. Needs ``behav_logp``. Masked tokens stay
    in the denominator with ``policy_loss``'s default ``removed_in_denominator=True`` — as verl's IcePop
    (weight 0, ``response_mask`` unchanged) and TRL's ``*_mask`` modes.

    References: IcePop (Ant Ling/Ring team blog; Ring-1T report, arXiv id not confirmed), verl
    ``compute_rollout_correction_weights``, TRL ``vllm_importance_sampling_mode="*_mask"``. Edge cases: an empty
    row has sequence ratio 1 (kept when 1 is in the band) and contributes nothing; weights are 0 outside
    ``mask``; ``B = 0``, ``T = 0`` and an all-masked batch give zero weights and zero metrics.

    Metrics: ``mis_high_frac`` / ``mis_low_frac`` (fraction of loss tokens whose ratio is above / below the
    band), ``mis_oob_frac`` (their sum; verl ``rollout_is_oob_ratio``), and at the sequence levels
    ``mis_seq_oob_frac`` (fraction of non-empty sequences dropped); ``mis_batch_norm_factor`` with
    ``batch_normalize``.
    """

    low: float | None = 0.5
    high: float | None = 5.0
    level: MisLevel = "token"
    in_band: Literal["ratio", "one"] = "ratio"
    batch_normalize: bool = False
    source: Source = "old"
    clamp: float = SAFETY_BOUND
    requires: ClassVar[tuple[str, ...]] = ("behav_logp",)
    accepts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check_mis(self.low, self.high, self.level, self.in_band, self.batch_normalize, self.clamp, "MIS.")
        _check_source(self.source, "MIS")

    def __call__(self, ctx: StageContext) -> CorrectionOutput:
        lr = _mismatch_log_ratio(ctx, self.source, "MIS")
        return _mis(lr, ctx.mask, self.low, self.high, self.level, self.in_band, self.batch_normalize, self.clamp)


# ----------------------------------------------------------------------------------------------- FP8-RL


def fp8_token_tis(cap: float = 2.0) -> TIS:
    r"""FP8-RL report's token-level TIS: :math:`w_{i,t} = \min(\rho_{i,t}, C)`, :math:`\rho = \pi^{BF16}_{old}/\pi^{FP8}_{rollout}`.

    ``TIS(cap=cap, level="token")``; C = 2 is verl's FP8 recipe (``docs/advance/fp8.md``: "Token-level TIS,
    C=2"). Reference: arXiv 2601.18150 (NVIDIA FP8-RL). With ρ ≡ 1 the loss is bit-identical to the
    uncorrected loss.
    """
    return TIS(cap=cap, level="token")


def fp8_token_mis(
    cap: float = 2.0,
    *,
    variant: Literal["upper", "band"] = "upper",
    low: float = 0.5,
    in_band: Literal["ratio", "one"] | None = None,
    experimental: bool = False,
) -> MIS:
    r"""FP8-RL report's token-level MIS, **[reconstructed]**: requires ``experimental=True``.

    .. math::
        \text{upper:}\ w_{i,t} = \rho_{i,t}\,\mathbb 1\{\rho_{i,t} \le C\}, \qquad
        \text{band:}\ w_{i,t} = \mathbb 1\{C_{low} \le \rho_{i,t} \le C\}

    The report (arXiv 2601.18150, abstract and introduction) names token-level MIS without its exact form;
    both readings are mapped onto :class:`MIS` (our reconstruction): ``variant="upper"`` is ``MIS(low=None,
    high=cap)`` with in-band weight ρ; ``variant="band"`` is ``MIS(low=low, high=cap)`` with in-band weight 1
    (``in_band`` overrides the in-band weight of either). ``cap=2.0`` follows the report's TIS C = 2,
    ``low=0.5`` follows IcePop; both unconfirmed. Out-of-band tokens get ``keep=False``.
    """
    require_experimental(
        experimental,
        "the FP8-RL report's MIS form (upper-only ratio mask or double-sided pure mask)",
        "docs/methods/corrections.md",
    )
    choice(variant, "variant", ("upper", "band"))
    positive(cap, "cap")
    if variant == "upper":
        return MIS(low=None, high=cap, level="token", in_band=in_band or "ratio")
    positive(low, "low")
    return MIS(low=low, high=cap, level="token", in_band=in_band or "one")


# ----------------------------------------------------------------------------------------------- OPSM


def _opsm(logp: Tensor, behav: Tensor, adv: Tensor, m: Tensor, delta: float) -> MaskOutput:
    """OPSM on validated tensors: keep ``[B, T]`` (within ``m``) and the ``opsm_*`` metrics."""
    kl = torch.where(m, behav - logp.detach(), _zeros(logp)).clamp(-_SUM_BOUND, _SUM_BOUND)
    seq_kl = kl.sum(-1) / _lengths(m, kl.dtype).clamp(min=1)
    keep = ((adv >= 0) | (seq_kl <= delta)[:, None]).expand_as(logp) & m
    rows = m.any(-1)
    dropped = ~keep & m
    dt = logp.dtype
    metrics = {
        "opsm_masked_frac": _mean(dropped, m, dt),
        "opsm_seq_masked_frac": _mean(dropped.any(-1), rows, dt),
        "opsm_kl_mean": _mean(seq_kl, rows, dt),
    }
    return MaskOutput(keep, metrics)


def opsm_keep(
    logp: FloatBT,
    behav_logp: FloatBT,
    advantages: PerSeqOrToken,
    mask: BoolBT,
    *,
    delta: float = 1e-4,
) -> MaskOutput:
    r"""DeepSeek-V3.2's off-policy sequence mask: drop negative-advantage sequences that drifted too far.

    .. math::
        M_{i,t} = \mathbb 1\Big\{A_{i,t} \ge 0\ \lor\ \frac{1}{\max(L_i, 1)}\sum_t m_{i,t}
        \big(\ell^{beh}_{i,t} - \operatorname{sg}(\ell^\theta_{i,t})\big) \le \delta\Big\}

    Exactly TRL 1.16's ``GRPOTrainer.get_off_policy_mask`` (``off_policy_mask_threshold``), where
    :math:`\ell^{beh}` is vLLM's sampling log-probs when present, else the old log-probs (``OPSM.source``).
    The divergence is unclamped, as in TRL. Reference: DeepSeek-V3.2, arXiv 2512.02556 (Eq. 9).

    Args:
        logp: current log-probs ``[B, T]`` (only their value is used).
        behav_logp: the sampling (or old) log-probs ``[B, T]``.
        advantages: ``[B]`` or ``[B, T]`` (TRL compares each token's advantage).
        mask: loss mask ``[B, T]``.
        delta: the threshold δ. Default 1e-4: slime's ``--opsm-delta``; TRL has no default (None disables
            the mask; its docs suggest e.g. 0.5).

    Returns:
        A :class:`~rolloutopt.ratios.MaskOutput`: ``keep`` (bool ``[B, T]``, a subset of ``mask``) and the
        ``opsm_*`` metrics of :class:`OPSM`.

    Edge cases: an empty row has divergence 0; ``B = 0``, ``T = 0`` and an all-masked batch give zero metrics.
    Oracle (by hand): a row with A < 0 whose mean :math:`\ell^{beh} - \ell^\theta` is 0.3 > δ = 0.2 is
    dropped, the same row with A ≥ 0 is kept.
    """
    _check_delta(delta, "delta")
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    behav = as_float(behav_logp, "behav_logp", dims, "B T", device=lp.device)
    adv = as_seq_or_token(advantages, "advantages", dims, device=lp.device)
    m = as_mask(mask, "mask", dims, "B T", device=lp.device)
    finite(lp, "logp", m)
    finite(behav, "behav_logp", m)
    finite(adv.expand_as(lp), "advantages", m)
    return _opsm(lp, behav, adv, m, delta)


def _check_delta(delta: Any, name: str) -> None:
    if not isinstance(delta, (int, float)) or isinstance(delta, bool) or not math.isfinite(delta):
        raise InputError(name, "a finite number (the divergence threshold)", repr(delta), f"set e.g. {name}=1e-4")


@dataclass(frozen=True)
class OPSM:
    r"""Correction: off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556) as TRL 1.16 does it (:func:`opsm_keep`).

    ``source``: ``"auto"`` (TRL: ``behav_logp`` when given — vLLM's sampling log-probs — else ``old_logp``),
    ``"behav"`` (require ``behav_logp``) or ``"old"``. Weight 1; dropped sequences get ``keep=False`` and stay
    in the denominator with ``policy_loss``'s default ``removed_in_denominator=True`` (TRL multiplies the
    per-token loss by the mask and keeps the denominator). Default ``delta=1e-4`` (slime ``--opsm-delta``;
    TRL's ``off_policy_mask_threshold`` defaults to None = off).

    Edge cases: an empty row has divergence 0; a row with A ≥ 0 is always kept; ``B = 0``, ``T = 0`` and an
    all-masked batch give zero metrics. Inputs (:attr:`requires`, :attr:`accepts`): ``behav_logp`` is accepted
    with ``source="auto"`` and required with ``"behav"``.

    Metrics: ``opsm_masked_frac`` (fraction of loss tokens dropped), ``opsm_seq_masked_frac`` (fraction of
    non-empty sequences with a dropped token), ``opsm_kl_mean`` (mean over non-empty sequences of the
    per-sequence divergence).
    """

    delta: float = 1e-4
    source: Literal["auto", "behav", "old"] = "auto"

    @property
    def requires(self) -> tuple[str, ...]:
        """Inputs this stage cannot run without: ``("behav_logp",)`` with ``source="behav"``, else none."""
        return ("behav_logp",) if self.source == "behav" else ()

    @property
    def accepts(self) -> tuple[str, ...]:
        """Inputs consumed when given: ``behav_logp`` with ``source="auto"`` (TRL: used when present)."""
        return ("behav_logp",) if self.source == "auto" else ()

    def __post_init__(self) -> None:
        _check_delta(self.delta, "OPSM.delta")
        choice(self.source, "OPSM.source", ("auto", "behav", "old"))

    def __call__(self, ctx: StageContext) -> CorrectionOutput:
        if self.source == "behav" or (self.source == "auto" and ctx.behav_logp is not None):
            ref: Tensor = ctx.need("behav_logp", f"OPSM(source={self.source!r})")
        else:
            ref = ctx.need("old_logp", "OPSM")
        out = _opsm(ctx.logp, ref.detach(), ctx.advantages, ctx.mask, self.delta)
        return CorrectionOutput(torch.ones_like(ctx.logp), out.keep, out.metrics)


# ----------------------------------------------------------------------------------------------- rejection


Threshold = float | tuple[float, float]


def _rs_bounds(options: Any, thresholds: Any, owner: str) -> tuple[tuple[float | None, float], ...]:
    """Normalise (options, thresholds) to per-option (lower, upper) bounds; raise on bad input."""
    if isinstance(options, str) or not isinstance(options, Sequence) or len(options) == 0:
        raise InputError(
            f"{owner}options", f"a non-empty tuple of {', '.join(RS_OPTIONS)}", repr(options), 'e.g. ("seq_mean_k1",)'
        )
    for opt in options:
        choice(opt, f"{owner}options", RS_OPTIONS)
    if len(set(options)) != len(options):
        raise InputError(f"{owner}options", "distinct options", repr(options), "list each option once")
    n = len(options)
    if isinstance(thresholds, (int, float)):
        thresholds = (thresholds,) * n  # one number shared by every option, as verl broadcasts
    elif (
        n == 1
        and isinstance(thresholds, Sequence)
        and len(thresholds) == 2
        and all(isinstance(x, (int, float)) for x in thresholds)
    ):
        thresholds = (tuple(thresholds),)  # a bare (lower, upper) pair for a single option
    elif isinstance(thresholds, Sequence) and len(thresholds) == 1:
        thresholds = tuple(thresholds) * n
    if not isinstance(thresholds, Sequence) or len(thresholds) != n:
        raise InputError(
            f"{owner}thresholds",
            f"one threshold per option ({n}) or one shared threshold",
            repr(thresholds),
            "pass e.g. thresholds=((0.999, 1.001),) for seq_mean_k1 or (0.01,) for seq_mean_k3",
        )
    out: list[tuple[float | None, float]] = []
    for opt, th in zip(options, thresholds, strict=True):
        name = f"{owner}thresholds[{opt}]"
        if opt.endswith("k1"):
            if isinstance(th, (tuple, list)):
                if len(th) != 2:
                    raise InputError(name, "(lower, upper) ratio bounds", repr(th), "pass two numbers")
                lo, hi = th
                positive(lo, name)
                positive(hi, name)
            else:
                positive(th, name)
                lo, hi = 1.0 / th, th  # verl: a single u means [1/u, u]
            if lo > hi:
                raise InputError(name, "lower <= upper (a single u needs u >= 1)", repr(th), "fix the bounds")
            out.append((float(lo), float(hi)))
        else:
            if isinstance(th, (tuple, list)):
                raise InputError(
                    name, "one positive upper bound (k2, k3 and catastrophic take no pair)", repr(th), "pass a number"
                )
            positive(th, name)
            out.append((None, float(th)))
    return tuple(out)


def _token_stat(lr: Tensor, k: str) -> Tensor:
    if k == "k1":
        return -lr
    if k == "k2":
        return 0.5 * lr * lr
    return torch.expm1(lr) - lr  # k3 = e^lr - 1 - lr, via expm1 (never negative for tiny lr)


def _rs_stat(lr: Tensor, m: Tensor, option: str) -> Tensor:
    """verl's statistic of ``option`` on the clamped, masked log-ratio: ``[B, T]`` (token) or ``[B, 1]``."""
    if option == "catastrophic":  # min token log-ratio of the row, capped at 0 (an empty row gives 0)
        low = torch.where(m, lr, _zeros(lr))
        return low.amin(-1, keepdim=True).clamp(max=0.0) if lr.shape[-1] else low.sum(-1, keepdim=True)
    agg, k = option.rsplit("_", 1)
    stat = torch.where(m, _token_stat(lr, k), _zeros(lr))
    if agg == "token":
        return stat
    if agg == "seq_sum":
        return stat.sum(-1, keepdim=True)
    if agg == "seq_mean":
        return stat.sum(-1, keepdim=True) / _lengths(m, lr.dtype).clamp(min=1)[:, None]
    # seq_max of a non-negative statistic (k2, k3): masked positions are 0, an empty row gives 0
    return stat.clamp(min=0.0).amax(-1, keepdim=True) if lr.shape[-1] else stat.sum(-1, keepdim=True)


def _rs_keep(stat: Tensor, option: str, lo: float | None, hi: float) -> Tensor:
    if option == "catastrophic":  # drop the row if any token ratio < hi (ROLL: 1e-4)
        return stat >= math.log(hi)
    if option.endswith("k1"):  # verl: k1 = -log ratio, bounds on exp(k1) = π_beh / π_old
        assert lo is not None
        return (stat >= math.log(lo)) & (stat <= math.log(hi))
    return stat <= hi


def rs_statistic(log_ratio: FloatBT, mask: BoolBT, option: str, *, clamp: float = SAFETY_BOUND) -> FloatBTb:
    r"""The divergence statistic of one rejection option (verl ``compute_rollout_rejection_mask``).

    With :math:`\delta = \operatorname{clip}(\ell^{old} - \ell^{beh}, \pm 20)`: :math:`k_1 = -\delta`,
    :math:`k_2 = \tfrac12\delta^2`, :math:`k_3 = e^{\delta} - 1 - \delta`; ``token_k*`` is per token
    ``[B, T]``, ``seq_sum_k*`` / ``seq_mean_k*`` / ``seq_max_k*`` the masked sum / mean / max over the row
    ``[B, 1]`` (an empty row gives 0); ``catastrophic`` is the row's minimum :math:`\delta` capped at 0
    (ROLL). Reference: verl 0.9.1 ``rollout_corr_helper``; "When Speed Kills Stability" (Yao et al., 2025,
    no arXiv id).
    """
    choice(option, "option", RS_OPTIONS)
    positive(clamp, "clamp")
    lr, m = _validate_lr(log_ratio, mask)
    return _rs_stat(lr.clamp(-clamp, clamp), m, option)


def rejection_keep(
    log_ratio: FloatBT,
    mask: BoolBT,
    *,
    options: Sequence[str] = ("seq_mean_k1",),
    thresholds: Threshold | Sequence[Threshold] = ((0.999, 1.001),),
    clamp: float = SAFETY_BOUND,
) -> MaskOutput:
    r"""verl's rollout rejection sampling: keep a token only if every option's statistic is within its bound.

    .. math::
        M_{i,t} = \prod_{o} \mathbb 1\{s^{o}_{i(,t)} \in B_o\}, \qquad
        B_o = [\log C_{low}, \log C_{high}]\ (k_1\ \text{options}),\quad [0, C]\ (k_2, k_3)

    with :math:`s^o` from :func:`rs_statistic`. Because :math:`k_1 = -\delta`, the k1 bounds apply to the
    ratio :math:`\pi^{beh}/\pi^{old}` (verl's convention; it matters only for asymmetric bounds); a single
    number ``u`` means ``[1/u, u]``. ``catastrophic`` (ROLL) drops a sequence when any token has
    :math:`\rho < C` (default in ROLL: 1e-4). Sequence options drop the whole row.

    Args:
        log_ratio: :math:`\ell^{old} - \ell^{beh}` ``[B, T]``.
        mask: loss mask ``[B, T]``.
        options: a chain of :data:`RS_OPTIONS` (AND). Default ``("seq_mean_k1",)`` with bounds
            ``(0.999, 1.001)``: verl's ``decoupled_geo_rs`` preset (Geo-RS).
        thresholds: one per option, or one shared (verl broadcasts a single value): ``(lower, upper)`` or
            ``u`` for k1 options, one positive upper bound for k2 / k3 / catastrophic.
        clamp: bound on the token log-ratio (verl 20).

    Returns:
        A :class:`~rolloutopt.ratios.MaskOutput`: ``keep`` (bool ``[B, T]``, a subset of ``mask``) and the
        ``rs_*`` metrics of :class:`RejectionFilter`.

    Edge cases: empty rows have statistic 0; ``B = 0``, ``T = 0`` and an all-masked batch give zero metrics.
    Oracle (by hand): ``seq_mean_k1`` with bounds (0.999, 1.001) keeps a row whose mean log-ratio is
    ``5e-4`` (:math:`e^{-5\cdot 10^{-4}} \ge 0.999`) and drops one at ``2e-3``.
    """
    bounds = _rs_bounds(options, thresholds, "")
    positive(clamp, "clamp")
    lr, m = _validate_lr(log_ratio, mask)
    return _rejection(lr.clamp(-clamp, clamp), m, tuple(options), bounds)


def _rejection(
    lr: Tensor, m: Tensor, options: tuple[str, ...], bounds: tuple[tuple[float | None, float], ...]
) -> MaskOutput:
    keep = m.clone()
    metrics: dict[str, Tensor] = {}
    dt = lr.dtype
    for opt, (lo, hi) in zip(options, bounds, strict=True):  # a loop over the (few) options, not over data
        stat = _rs_stat(lr, m, opt)
        k = _rs_keep(stat, opt, lo, hi).expand_as(m)
        keep = keep & k
        metrics[f"rs_{opt}_masked_frac"] = _mean(~k, m, dt)
        metrics[f"rs_{opt}_mean"] = _mean(stat.expand_as(lr), m, dt)
    rows = m.any(-1)
    metrics["rs_masked_frac"] = _mean(~keep, m, dt)
    metrics["rs_seq_masked_frac"] = _mean((~keep & m).any(-1), rows, dt)
    return MaskOutput(keep, metrics)


@dataclass(frozen=True)
class RejectionFilter:
    r"""Correction: verl's ``rollout_rs`` chain of divergence filters (:func:`rejection_keep`); weight 1.

    Defaults: ``options=("seq_mean_k1",)``, ``thresholds=((0.999, 1.001),)`` — verl's ``decoupled_geo_rs``.
    verl folds the mask into ``response_mask``, so its denominators drop rejected tokens: use
    ``policy_loss(..., removed_in_denominator=False)`` for verl's numbers. ``source`` as in :class:`TIS`
    (``"current"`` is verl's bypass mode, which recomputes RS from the current policy). Needs ``behav_logp``.
    :meth:`from_verl` parses verl's ``rollout_rs`` / ``rollout_rs_threshold`` strings.

    References: verl 0.9.1 ``compute_rollout_rejection_mask`` and "When Speed Kills Stability" (Yao et al.,
    2025; no arXiv id); ROLL ``InferCorrectionHandler`` for ``catastrophic``. Edge cases: an empty row has
    statistic 0; ``B = 0``, ``T = 0`` and an all-masked batch give zero metrics.

    Metrics: per option ``rs_<opt>_masked_frac`` (fraction of loss tokens the option rejects, verl's
    ``rollout_rs_<opt>_masked_fraction``) and ``rs_<opt>_mean`` (token-weighted mean of its statistic); overall
    ``rs_masked_frac`` and ``rs_seq_masked_frac`` (over non-empty sequences; verl divides by every row).
    """

    options: tuple[str, ...] = ("seq_mean_k1",)
    thresholds: Threshold | tuple[Threshold, ...] = ((0.999, 1.001),)
    source: Source = "old"
    clamp: float = SAFETY_BOUND
    requires: ClassVar[tuple[str, ...]] = ("behav_logp",)
    accepts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if isinstance(self.options, list):
            object.__setattr__(self, "options", tuple(self.options))
        _rs_bounds(self.options, self.thresholds, "RejectionFilter.")
        _check_source(self.source, "RejectionFilter")
        positive(self.clamp, "RejectionFilter.clamp")

    @classmethod
    def from_verl(
        cls, rollout_rs: str, rollout_rs_threshold: str | float, *, source: Source = "old"
    ) -> RejectionFilter:
        """The filter of verl's ``algorithm.rollout_correction.rollout_rs`` / ``rollout_rs_threshold``.

        ``rollout_rs`` is comma-separated (duplicates dropped, as verl does); each threshold is a number or a
        ``"lower_upper"`` string for k1 options; one threshold is shared by every option.
        """
        if not isinstance(rollout_rs, str) or not rollout_rs.strip():
            raise InputError("rollout_rs", "a comma-separated option string", repr(rollout_rs), 'e.g. "seq_mean_k1"')
        opts = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
        specs = (
            [str(rollout_rs_threshold)]
            if isinstance(rollout_rs_threshold, (int, float))
            else [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
        )
        parsed: list[Threshold] = []
        for spec in specs:
            try:
                if "_" in spec:
                    lo, hi = spec.split("_", 1)
                    parsed.append((float(lo), float(hi)))
                else:
                    parsed.append(float(spec))
            except ValueError as exc:
                raise InputError(
                    "rollout_rs_threshold", "numbers or 'lower_upper' strings", repr(rollout_rs_threshold), "fix it"
                ) from exc
        return cls(options=tuple(opts), thresholds=tuple(parsed), source=source)

    def __call__(self, ctx: StageContext) -> CorrectionOutput:
        lr = _mismatch_log_ratio(ctx, self.source, "RejectionFilter").clamp(-self.clamp, self.clamp)
        bounds = _rs_bounds(self.options, self.thresholds, "RejectionFilter.")
        out = _rejection(lr, ctx.mask, self.options, bounds)
        return CorrectionOutput(torch.ones_like(lr), out.keep, out.metrics)


# ----------------------------------------------------------------------------------------------- adapters


def from_verl_rollout_is(
    rollout_is: Literal["token", "sequence"],
    rollout_is_threshold: str | float = 2.0,
    *,
    batch_normalize: bool = False,
    source: Source = "old",
) -> TIS | MIS:
    """The correction of verl's ``rollout_is`` / ``rollout_is_threshold`` / ``rollout_is_batch_normalize``.

    A number (or a number string) is TIS with that cap; a ``"lower_upper"`` string is IcePop:
    ``MIS(low, high, level=rollout_is, in_band="ratio")`` (weight 0 outside the band; verl keeps those tokens
    in ``response_mask``, i.e. in the denominator, our default). ``source="current"`` is verl's bypass mode.
    """
    choice(rollout_is, "rollout_is", ("token", "sequence"))
    spec = rollout_is_threshold
    if isinstance(spec, str) and "_" in spec:
        try:
            lo, hi = (float(x) for x in spec.strip().split("_", 1))
        except ValueError as exc:
            raise InputError("rollout_is_threshold", "a number or 'lower_upper'", repr(spec), "e.g. '0.5_5.0'") from exc
        return MIS(low=lo, high=hi, level=rollout_is, batch_normalize=batch_normalize, source=source)
    try:
        cap = float(spec)
    except (TypeError, ValueError) as exc:
        raise InputError("rollout_is_threshold", "a number or 'lower_upper'", repr(spec), "e.g. 2.0") from exc
    return TIS(cap=cap, level=rollout_is, batch_normalize=batch_normalize, source=source)


def from_trl_vllm_is(
    mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
    *,
    clamp: float = SAFETY_BOUND,
) -> TIS | MIS:
    """The correction of TRL 1.16's ``vllm_importance_sampling_mode`` / ``_clip_min`` / ``_clip_max``.

    Defaults are TRL's (``"sequence_mask"``, ``clip_min=None``, ``clip_max=3.0``). ``*_truncate`` is
    ``TIS(cap=clip_max, lower=clip_min)``; ``*_mask`` is ``MIS(low=clip_min, high=clip_max, in_band="ratio")``;
    the sequence ratio is the product of token ratios in both libraries. TRL exponentiates without a clamp:
    the weights agree while every token (token modes) or sequence sum (sequence modes) of
    :math:`\\ell^{old} - \\ell^{beh}` is within ``±clamp``.
    """
    modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    choice(mode, "mode", modes)
    level: Literal["token", "sequence"] = "token" if mode.startswith("token") else "sequence"
    if mode.endswith("truncate"):
        return TIS(cap=clip_max, lower=clip_min, level=level, clamp=clamp)
    return MIS(low=clip_min, high=clip_max, level=level, in_band="ratio", clamp=clamp)


# ----------------------------------------------------------------------------------------------- diagnostics

_EXP_BOUND = 80.0  # keeps exp finite in fp32 (e^88 overflows); binds only for absurd perplexities


def offpolicy_metrics(
    old_logp: FloatBT, behav_logp: FloatBT, mask: BoolBT, *, count_empty_rows: bool = False
) -> dict[str, Scalar]:
    r"""verl's off-policy diagnostics of the rollout/trainer mismatch, as detached 0-d tensors (no host sync).

    With :math:`\delta = \ell^{old} - \ell^{beh}`, :math:`\bar\ell_i` the per-sequence mean log-prob and
    means over loss tokens (token metrics) or sequences (sequence metrics):

    .. math::
        \mathrm{kl} = \overline{-\delta}, \quad \mathrm{k3\_kl} = \overline{e^{\delta} - 1 - \delta}, \quad
        \mathrm{ppl} = \operatorname{mean}_i e^{-\bar\ell_i}, \quad
        \chi^2_{tok} = \overline{e^{2\operatorname{clip}(\delta, \pm 20)}} - 1, \quad
        \chi^2_{seq} = \operatorname{mean}_i e^{2\operatorname{clip}(\sum_t m\delta, \pm 20)} - 1

    Keys (verl ``compute_offpolicy_metrics``, without the ``rollout_corr/`` prefix): ``training_ppl``,
    ``training_log_ppl``, ``kl``, ``k3_kl``, ``rollout_ppl``, ``rollout_log_ppl``, ``log_ppl_diff``,
    ``log_ppl_abs_diff``, ``log_ppl_diff_max``, ``log_ppl_diff_min``, ``ppl_ratio``, ``chi2_token``,
    ``chi2_seq``. Reference: verl 0.9.1 ``rollout_corr_helper``; "When Speed Kills Stability" (Yao et al.,
    2025; no arXiv id).

    Differences from verl, for finiteness: the k3 log-ratio is clamped to ±20 (verl exponentiates it raw),
    and perplexity exponents are clamped to ±80. Sequence means are over non-empty sequences; verl averages
    over every row, an empty row counting as log-prob 0 (perplexity 1): ``count_empty_rows=True`` does that.

    Args:
        old_logp: trainer log-probs ``[B, T]``.
        behav_logp: rollout-engine log-probs ``[B, T]``.
        mask: loss mask ``[B, T]``.
        count_empty_rows: average sequence metrics over every row (verl) instead of non-empty ones.

    Edge cases: an empty mask gives 0 for every metric except the χ² terms (−1 … 0 by the formula, reported
    as 0 too).
    """
    if not isinstance(count_empty_rows, bool):
        raise InputError("count_empty_rows", "a bool", repr(count_empty_rows), "pass True (verl) or False")
    dims = Dims()
    old = as_float(old_logp, "old_logp", dims, "B T")
    behav = as_float(behav_logp, "behav_logp", dims, "B T", device=old.device)
    m = as_mask(mask, "mask", dims, "B T", device=old.device)
    finite(old, "old_logp", m)
    finite(behav, "behav_logp", m)
    dt = old.dtype
    old = _masked_lr(old.detach(), m).clamp(-_SUM_BOUND, _SUM_BOUND)
    behav = _masked_lr(behav.detach(), m).clamp(-_SUM_BOUND, _SUM_BOUND)
    lr = old - behav
    rows = m.any(-1) if not count_empty_rows else torch.ones_like(m[:, 0])
    lengths = _lengths(m, dt).clamp(min=1)
    mean_old, mean_beh = old.sum(-1) / lengths, behav.sum(-1) / lengths
    diff = mean_beh - mean_old
    lrc = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    has = m.any()

    def ppl(x: Tensor) -> Tensor:
        return _mean(torch.exp(x.clamp(-_EXP_BOUND, _EXP_BOUND)), rows, dt)

    chi2_tok = _mean(torch.exp(2 * lrc), m, dt) - 1
    chi2_seq = _mean(torch.exp(2 * lr.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)), rows, dt) - 1
    out = {
        "training_ppl": ppl(-mean_old),
        "training_log_ppl": _mean(-mean_old, rows, dt),
        "kl": _mean(-lr, m, dt),
        "k3_kl": _mean(torch.expm1(lrc) - lrc, m, dt),
        "rollout_ppl": ppl(-mean_beh),
        "rollout_log_ppl": _mean(-mean_beh, rows, dt),
        "log_ppl_diff": _mean(diff, rows, dt),
        "log_ppl_abs_diff": _mean(diff.abs(), rows, dt),
        "log_ppl_diff_max": _max(diff, rows),
        "log_ppl_diff_min": _min(diff, rows),
        "ppl_ratio": ppl(diff),
        "chi2_token": torch.where(has, chi2_tok, _zeros(chi2_tok)),
        "chi2_seq": torch.where(has, chi2_seq, _zeros(chi2_seq)),
    }
    return out
