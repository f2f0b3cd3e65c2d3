"""Reference ratio constructions and trust regions: token ratio, GSPO, PPO clip with dual clip, CISPO, SAPO.

Ratios are built in log space and clamped before ``exp`` so that no finite input gives inf or NaN. Each
construction and each trust region is a pure function plus a small frozen config object that
:func:`rolloutopt.losses.policy_loss` composes; the config's defaults are the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, finite, positive
from rolloutopt.errors import InputError
from rolloutopt.ratios.context import StageContext
from rolloutopt.typing import BoolBT, FloatB, FloatBT, FloatBTb, Scalar

__all__ = [
    "CISPO",
    "REINFORCE",
    "SAPO",
    "GSPORatio",
    "PPOClip",
    "TokenRatio",
    "TrustOutput",
    "bounded_clip_loss",
    "cispo_weight",
    "gspo_token_log_ratio",
    "log_ratio",
    "ppo_clip_loss",
    "sapo_gate",
    "sequence_log_ratio",
]


def _pair(logp: Any, old_logp: Any, mask: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    old = as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    m = None if mask is None else as_mask(mask, "mask", dims, "B T", device=lp.device)
    finite(lp, "logp", m)
    finite(old, "old_logp", m)
    return lp, old, m


def _clamped_log_ratio(lp: Tensor, old: Tensor, m: Tensor | None, clamp: float) -> Tensor:
    lr = (lp - old).clamp(-clamp, clamp)
    return lr if m is None else torch.where(m, lr, torch.zeros_like(lr))


def log_ratio(logp: FloatBT, old_logp: FloatBT, mask: BoolBT | None = None, *, clamp: float = 20.0) -> FloatBT:
    r"""Per-token log importance ratio, clamped: :math:`\operatorname{clip}(\ell^\theta - \ell^{old}, -c, c)`.

    The clamp (verl: 20) keeps ``exp`` finite for every finite input. Positions outside ``mask`` are set to
    0 (ratio 1), so padding holding garbage log-probs cannot produce inf. Reference: PPO, arXiv 1707.06347.
    """
    positive(clamp, "clamp")
    lp, old, m = _pair(logp, old_logp, mask)
    return _clamped_log_ratio(lp, old, m, clamp)


def sequence_log_ratio(logp: FloatBT, old_logp: FloatBT, mask: BoolBT, *, clamp: float = 20.0) -> FloatB:
    r"""GSPO's length-normalised sequence log-ratio :math:`\log s_i = \frac{1}{L_i}\sum_t m_{i,t}(\ell^\theta_{i,t} - \ell^{old}_{i,t})`.

    ``L_i`` is clamped to at least 1 (an empty row gives 0). Token log-ratios are clamped to ``±clamp`` first.
    Reference: GSPO, arXiv 2507.18071.
    """
    positive(clamp, "clamp")
    lp, old, m = _pair(logp, old_logp, mask)
    assert m is not None
    lr = _clamped_log_ratio(lp, old, m, clamp)
    return lr.sum(-1) / m.sum(-1).clamp(min=1).to(lr.dtype)


def gspo_token_log_ratio(logp: FloatBT, old_logp: FloatBT, mask: BoolBT, *, clamp_max: float = 10.0) -> FloatBT:
    r"""GSPO-token log-ratio: the sequence value with each token's own gradient.

    .. math::  \log s_{i,t} = \min\big(\operatorname{sg}(\log s_i) + \ell^\theta_{i,t} - \operatorname{sg}(\ell^\theta_{i,t}),\ c\big)

    Its value is the sequence log-ratio :math:`\log s_i` at every token, the mean of the *unclamped* token
    differences as in verl (so it equals :func:`sequence_log_ratio`, which clamps each token at ±20 first, only
    while every token difference is within ±20); its gradient flows through each
    token's log-prob, so per-token advantages are possible, and with per-sequence advantages the gradient
    equals GSPO's. ``clamp_max`` is verl's upper clamp (10, no lower clamp). Masked-out positions are 0.
    Reference: GSPO, arXiv 2507.18071 (GSPO-token, §4.3); verl ``compute_policy_loss_gspo``.
    """
    positive(clamp_max, "clamp_max")
    lp, old, m = _pair(logp, old_logp, mask)
    assert m is not None
    return _gspo_token(lp, old, m, clamp_max)


def _gspo_token(lp: Tensor, old: Tensor, m: Tensor, clamp_max: float) -> Tensor:
    diff = torch.where(m, lp - old, torch.zeros_like(lp))
    seq = diff.sum(-1) / m.sum(-1).clamp(min=1).to(lp.dtype)
    # (lp - sg(lp)) is exactly 0: the value is exactly log s_i, with no rounding at the scale of lp (verl's order).
    tok = (seq.detach()[:, None] + (lp - lp.detach())).clamp(max=clamp_max)
    return torch.where(m, tok, torch.zeros_like(tok))


@dataclass(frozen=True)
class TokenRatio:
    """Ratio stage: the per-token PPO ratio :math:`r_{i,t} = \\exp(\\ell^\\theta - \\ell^{old})`, log clamped at ``±clamp``."""

    clamp: float = 20.0

    def __post_init__(self) -> None:
        positive(self.clamp, "TokenRatio.clamp")

    def log_ratio(self, logp: FloatBT, old_logp: FloatBT, mask: Bool[Tensor, "B T"]) -> FloatBT:
        """Per-token log-ratio ``[B, T]`` (inputs already validated)."""
        return _clamped_log_ratio(logp, old_logp, mask, self.clamp)


@dataclass(frozen=True)
class GSPORatio:
    """Ratio stage: GSPO's sequence geometric-mean ratio in its GSPO-token form (:func:`gspo_token_log_ratio`)."""

    clamp_max: float = 10.0

    def __post_init__(self) -> None:
        positive(self.clamp_max, "GSPORatio.clamp_max")

    def log_ratio(self, logp: FloatBT, old_logp: FloatBT, mask: Bool[Tensor, "B T"]) -> FloatBT:
        """GSPO-token log-ratio ``[B, T]`` (inputs already validated)."""
        return _gspo_token(logp, old_logp, mask, self.clamp_max)


@dataclass(frozen=True)
class TrustOutput:
    """Per-token result of a trust region: the policy loss term, which tokens it keeps, 0/1 indicators
    (e.g. which tokens were clipped) whose masked means become metrics, and batch-level metrics (detached
    0-d tensors, e.g. M2PO's second moment or an adaptive clip bound) reported as they are."""

    loss: FloatBT
    keep: Bool[Tensor, "B T"] | None
    indicators: dict[str, BoolBT]
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _check_clip(low: float, high: float, dual: float | None, owner: str) -> None:
    positive(low, f"{owner}.low", strict=False)
    positive(high, f"{owner}.high", strict=False)
    if dual is not None and not (isinstance(dual, (int, float)) and dual > 1):
        raise InputError(
            f"{owner}.dual", "a number > 1, or None to disable dual clip", repr(dual), "use e.g. dual=3.0 (verl)"
        )


def ppo_clip_loss(
    ratio: FloatBT, advantages: FloatBTb, *, low: float = 0.2, high: float = 0.2, dual: float | None = None
) -> tuple[FloatBT, dict[str, Bool[Tensor, "B T"]]]:
    r"""PPO clipped surrogate with asymmetric clip ("clip-higher") and dual clip, per token (to minimise).

    .. math::  L^{clip} = \max\big(-A r,\ -A\,\operatorname{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high})\big),
               \qquad L = \begin{cases}\min(L^{clip},\ c\,|A|) & A < 0\\ L^{clip} & A \ge 0\end{cases}

    Defaults are PPO's (arXiv 1707.06347): the symmetric ε = 0.2 and no dual clip. Dual clip: arXiv
    1912.09729 (``dual=3.0`` is verl's ``clip_ratio_c``); clip-higher: DAPO arXiv 2503.14476 (``low=0.2,
    high=0.28``). TRL has no dual clip. ROLL's dual constant is 1+2ε instead; pass it explicitly for parity.

    Returns the per-token loss and 0/1 indicators: ``clipfrac`` (the clipped branch is active, verl's
    ``pg_clipfrac``), ``clip_low_frac`` (r < 1-ε_low and A < 0), ``clip_high_frac`` (r > 1+ε_high and A > 0),
    ``dual_clip_frac`` (the dual bound is active, verl's ``pg_clipfrac_lower``). Clipped and dual-clipped
    tokens have zero gradient.
    """
    _check_clip(low, high, dual, "ppo_clip_loss")
    return bounded_clip_loss(ratio, advantages, ratio.new_tensor(1 - low), ratio.new_tensor(1 + high), dual)


def bounded_clip_loss(
    ratio: FloatBT, advantages: FloatBTb, lo: Scalar | FloatBTb, hi: Scalar | FloatBTb, dual: float | None = None
) -> tuple[FloatBT, dict[str, Bool[Tensor, "B T"]]]:
    """PPO clip and dual clip with the ratio interval ``[lo, hi]`` given directly as tensors that broadcast
    against ``ratio`` (0-d batch bounds, ``[B, 1]`` per rollout, ``[B, T]`` per token; detached).

    The shared core of :func:`ppo_clip_loss` and the adaptive trust regions (M2PO's batch bounds, SAT's
    per-token bounds, ECHO's per-rollout radius); indicators as :func:`ppo_clip_loss`. No validation (hot path).
    """
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, lo, hi)
    lc = torch.maximum(l1, l2)
    neg = (advantages < 0).expand_as(ratio)
    ind = {
        "clipfrac": (l2 > l1),
        "clip_low_frac": (ratio < lo) & neg,
        "clip_high_frac": (ratio > hi) & (advantages > 0),
    }
    if dual is None:
        ind["dual_clip_frac"] = torch.zeros_like(neg)
        return lc, ind
    l3 = -advantages * dual
    ind["dual_clip_frac"] = (lc > l3) & neg
    return torch.where(neg, torch.minimum(lc, l3), lc), ind


@dataclass(frozen=True)
class PPOClip:
    """Trust region: PPO clip with asymmetric bounds and dual clip (:func:`ppo_clip_loss`).

    Defaults are PPO's (arXiv 1707.06347): ``low=high=0.2``, no dual clip. DAPO's clip-higher is
    ``PPOClip(0.2, 0.28)``; verl's default loss adds ``dual=3.0``.
    """

    low: float = 0.2
    high: float = 0.2
    dual: float | None = None

    def __post_init__(self) -> None:
        _check_clip(self.low, self.high, self.dual, "PPOClip")

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        loss, ind = ppo_clip_loss(ratio, advantages, low=self.low, high=self.high, dual=self.dual)
        return TrustOutput(loss, None, ind)


def cispo_weight(
    ratio: FloatBT, *, low: float | None = None, high: float | None = 0.2, cap: float | None = None
) -> FloatBT:
    r"""CISPO's clipped, stop-gradient importance weight :math:`\hat r = \operatorname{sg}(\operatorname{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high}))`.

    Two parameterisations, named apart because the trainers disagree: relative bounds ``low``/``high``
    (verl and the paper: bounds ``1-low`` and ``1+high``; ``low=None`` means no lower bound, MiniMax-M1's
    choice) or an absolute upper ``cap`` (TRL's ``epsilon_high`` for ``loss_type="cispo"``; ScaleRL uses 5.0).
    Passing ``cap`` requires ``high=None`` and ``low=None``. Reference: MiniMax-M1, arXiv 2506.13585.
    """
    _check_cispo(low, high, cap, "")
    if cap is not None:
        return ratio.clamp(max=cap).detach()
    assert high is not None
    return ratio.clamp(min=None if low is None else 1 - low, max=1 + high).detach()


def _check_cispo(low: float | None, high: float | None, cap: float | None, owner: str) -> None:
    if cap is not None:
        positive(cap, f"{owner}cap")
        for name, value in (("high", high), ("low", low)):
            if value is not None:
                raise InputError(
                    f"{owner}{name}",
                    "None with cap (cap is an absolute upper bound, TRL's convention, and has no lower bound)",
                    f"cap={cap} with {name}={value}",
                    f"pass {name}=None with cap, or drop cap and use the relative bounds low/high",
                )
        return
    if low is not None:
        positive(low, f"{owner}low", strict=False)
    if high is None:
        raise InputError(
            f"{owner}high",
            "a relative upper bound (1+high) or cap=",
            "high=None and cap=None",
            "set high (e.g. 0.2) or cap (e.g. 5.0)",
        )
    positive(high, f"{owner}high", strict=False)


@dataclass(frozen=True)
class CISPO:
    r"""Trust region: CISPO, :math:`L = -\operatorname{sg}(\hat r)\, A\, \ell^\theta` with :math:`\hat r` from :func:`cispo_weight`.

    Every token keeps a gradient (unlike PPO, which zeroes clipped tokens). Defaults: no lower bound,
    ``high=0.2`` (verl's CISPO example); ``cap`` gives TRL's absolute-cap convention. Indicator ``clipfrac``
    marks tokens whose weight was clipped (verl ``pg_clipfrac``). Reference: arXiv 2506.13585.
    """

    low: float | None = None
    high: float | None = 0.2
    cap: float | None = None

    def __post_init__(self) -> None:
        _check_cispo(self.low, self.high, self.cap, "CISPO.")

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        w = cispo_weight(ratio, low=self.low, high=self.high, cap=self.cap)
        return TrustOutput(-w * advantages * logp, None, {"clipfrac": w != ratio.detach()})


def sapo_gate(ratio: FloatBT, advantages: FloatBTb, *, tau_pos: float = 1.0, tau_neg: float = 1.05) -> FloatBT:
    r"""SAPO's soft gate, the per-token loss :math:`L = -\frac{4}{\tau}\,\sigma(\tau(r-1))\,A`.

    :math:`\tau = \tau_{pos}` where A > 0, else :math:`\tau_{neg}`; at r = 1 the gate equals 2/τ with slope 1,
    so on-policy its gradient matches the unclipped surrogate's, and it decays smoothly instead of clipping. Defaults 1.0 /
    1.05 (verl ``tau_pos``/``tau_neg``, TRL ``sapo_temperature_*``). Reference: SAPO, arXiv 2511.20347.
    """
    positive(tau_pos, "tau_pos")
    positive(tau_neg, "tau_neg")
    # Build tau in the ratio's dtype: torch.where on Python scalars gives fp32 (1.05 -> 1.0499999523), which
    # would put a ~1e-6 relative error into fp64 losses (caught by the verl parity test).
    pos = torch.tensor(tau_pos, dtype=ratio.dtype, device=ratio.device)
    tau = torch.where(advantages > 0, pos, torch.tensor(tau_neg, dtype=ratio.dtype, device=ratio.device))
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages


@dataclass(frozen=True)
class SAPO:
    """Trust region: SAPO's soft gate (:func:`sapo_gate`); no token is clipped, so it has no clip indicators."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        positive(self.tau_pos, "SAPO.tau_pos")
        positive(self.tau_neg, "SAPO.tau_neg")

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        return TrustOutput(sapo_gate(ratio, advantages, tau_pos=self.tau_pos, tau_neg=self.tau_neg), None, {})


@dataclass(frozen=True)
class REINFORCE:
    r"""Trust region: none, the plain policy-gradient term :math:`L = -A\,\ell^\theta` (the ratio is ignored).

    With an off-policy correction (e.g. :class:`~rolloutopt.ratios.TIS` with ``source="current"``, weight
    :math:`\operatorname{sg}(\min(\pi_\theta/\pi_{beh}, C))`) this is verl's bypass-mode ``reinforce`` loss
    :math:`-\operatorname{sg}(w)\,A\,\ell^\theta` (``compute_policy_loss_reinforce``, default aggregation
    ``seq-mean-token-sum``). Its gradient equals the unclipped surrogate's on-policy. Reference: Williams 1992
    (REINFORCE); verl rollout correction docs.
    """

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        return TrustOutput(-advantages * logp, None, {})
