"""ECHO's confidence-adaptive clip (arXiv 2602.02150; authors' code user683/ECHO).

PPO's clip interval narrows per rollout as the rollout's tail confidence grows: :func:`echo_clip_epsilon` maps a
per-rollout confidence to a clip radius, :func:`tail_confidence` computes that confidence from per-token
confidences, :func:`echo_clip_loss` is the clipped surrogate, and :class:`ECHOClip` the trust stage of
:func:`rolloutopt.losses.policy_loss` (it requires ``confidence``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    finite,
    positive,
)
from rolloutopt.errors import InputError
from rolloutopt.ratios.context import StageContext, masked_mean
from rolloutopt.ratios.reference import TrustOutput, bounded_clip_loss
from rolloutopt.typing import BoolBT, FloatB, FloatBT, FloatBTb, PerSeqOrToken

__all__ = ["ECHOClip", "echo_clip_epsilon", "echo_clip_loss", "tail_confidence"]


# ----------------------------------------------------------------------------------------------- ECHO


def _check_echo(eps_min: float, eps_max: float, kappa: float, owner: str) -> None:
    positive(eps_min, f"{owner}eps_min", strict=False)
    positive(eps_max, f"{owner}eps_max", strict=False)
    if not math.isfinite(eps_max):
        raise InputError(f"{owner}eps_max", "a finite number", repr(eps_max), "use e.g. eps_max=0.2")
    if eps_min > eps_max:
        raise InputError(
            f"{owner}eps_min",
            f"eps_min <= eps_max (got eps_max={eps_max})",
            repr(eps_min),
            "swap them, or set eps_min = eps_max for a fixed clip",
        )
    positive(kappa, f"{owner}kappa", strict=False)
    if not math.isfinite(kappa):
        raise InputError(f"{owner}kappa", "a finite number", repr(kappa), "use e.g. kappa=4.0")


def _echo_eps(confidence: Tensor, eps_min: float, eps_max: float, kappa: float) -> Tensor:
    conf = confidence.detach().clamp(0.0, 1.0)
    return eps_min + (eps_max - eps_min) * torch.sigmoid(kappa * (1.0 - conf))


def echo_clip_epsilon(confidence: FloatB, *, eps_min: float = 0.05, eps_max: float = 0.2, kappa: float = 4.0) -> FloatB:
    r"""ECHO's per-rollout clip radius from its tail confidence: confident rollouts get a narrower trust region.

    .. math::  \epsilon_i = \epsilon_{min} + (\epsilon_{max} - \epsilon_{min})\,
               \sigma\big(\kappa\,(1 - C^{tail}_i)\big)

    Reference: ECHO, arXiv 2602.02150, §3.2 "Confidence-Adaptive Clipping" (section per a summary of the paper);
    the formula and the defaults ``eps_min=0.05``, ``eps_max=0.2``, ``kappa=4.0`` are the official code's
    (``user683/ECHO`` ``verl/verl/trainer/ppo/core_algos.py::apply_hybrid_advantage_shaping``). Since
    :math:`\sigma(\cdot) \in [1/2, \sigma(\kappa)]` for :math:`C \in [0, 1]`, the radius lies in
    :math:`[\epsilon_{min} + (\epsilon_{max}-\epsilon_{min})/2,\ \epsilon_{max})`: confidence 1 gives the
    midpoint (0.125 with the defaults), not :math:`\epsilon_{max}`, and the interval is always inside PPO's
    :math:`[1-\epsilon_{max}, 1+\epsilon_{max}]`. Confidence is clamped to [0, 1] (the code clamps it too).

    Args:
        confidence: per-rollout tail confidence ``[B]`` in [0, 1] (:func:`tail_confidence`).
        eps_min, eps_max: radius range (0 <= eps_min <= eps_max).
        kappa: slope of the logistic (>= 0; 0 gives the midpoint everywhere).
    """
    _check_echo(eps_min, eps_max, kappa, "")
    c = as_float(confidence, "confidence", Dims(), "B")
    finite(c, "confidence")
    return _echo_eps(c, eps_min, eps_max, kappa)


def tail_confidence(token_confidence: FloatBT, mask: BoolBT, *, window: int = 16) -> FloatB:
    r"""ECHO's trajectory tail confidence: the mean token confidence over the last ``window`` loss tokens.

    .. math::  C^{tail}_i = \frac{1}{|W_i|}\sum_{t \in W_i} C_{i,t}, \qquad
               W_i = \text{the last } \min(w, L_i) \text{ positions of } m_i

    clamped to [0, 1]; 0 for an all-masked row. ``window=16`` and the clamp are the official code's
    (``user683/ECHO`` ``_compute_tail_confidence``, ``tail_window`` default 16); ``window <= 0`` averages the
    whole response, as there. The code takes positions ``L_i - w .. L_i - 1`` (right-padded masks); here the
    window is the last ``w`` True positions of the mask, the same for right-padded masks and well defined for
    masks with holes. Token confidence :math:`C_{i,t}` is the caller's: the paper defines the mean probability
    of the top-k tokens (the code's ``_compute_topk_confidence``, k = 5); the released script path
    (``use_remove_padding=True``) falls back to the sampled token's probability :math:`e^{\ell}`.
    Reference: ECHO, arXiv 2602.02150.

    Args:
        token_confidence: ``[B, T]``.
        mask: bool ``[B, T]``.
        window: number of trailing tokens (int).
    """
    if not isinstance(window, int) or isinstance(window, bool):
        raise InputError("window", "an int (number of trailing tokens)", repr(window), "pass e.g. window=16")
    dims = Dims()
    conf = as_float(token_confidence, "token_confidence", dims, "B T")
    m = as_mask(mask, "mask", dims, "B T", device=conf.device)
    finite(conf, "token_confidence", m)
    w = conf.shape[-1] if window <= 0 else window
    from_end = m.flip(-1).to(torch.int64).cumsum(-1).flip(-1)  # loss tokens at or after t
    tail = m & (from_end <= w)
    tw = tail.to(conf.dtype)
    vals = torch.where(tail, conf, torch.zeros_like(conf))
    return ((vals * tw).sum(-1) / tw.sum(-1).clamp(min=1.0)).clamp(0.0, 1.0)


def echo_clip_loss(
    ratio: FloatBT,
    advantages: FloatBTb,
    epsilon: PerSeqOrToken,
    *,
    dual: float | None = 3.0,
) -> tuple[FloatBT, dict[str, Bool[Tensor, "B T"]]]:
    r"""PPO clipped surrogate with a per-rollout symmetric radius :math:`\epsilon_i` and dual clip (to minimise).

    .. math::  L^{clip} = \max\big(-A r,\ -A\,\operatorname{clip}(r, 1-\epsilon_i, 1+\epsilon_i)\big),\qquad
               L = \min(L^{clip}, c|A|) \text{ for } A < 0

    ECHO's ``compute_policy_loss`` (``user683/ECHO``, ``cliprange_tensor_low = cliprange_tensor_high =
    clip_epsilon``) with verl's dual clip ``clip_ratio_c = 3.0`` (``dual=None`` turns it off). Indicators as
    :func:`~rolloutopt.ratios.ppo_clip_loss`. No validation (hot path). Reference: arXiv 2602.02150.

    Args:
        ratio: ``[B, T]``.
        advantages: ``[B, 1]`` or ``[B, T]``.
        epsilon: radius ``[B]``, ``[B, 1]`` or ``[B, T]``.
        dual: dual-clip constant (> 1) or None.
    """
    eps = epsilon[:, None] if epsilon.ndim == 1 else epsilon
    eps = eps.detach().to(ratio.dtype)
    return bounded_clip_loss(ratio, advantages, 1 - eps, 1 + eps, dual)


@dataclass(frozen=True)
class ECHOClip:
    r"""Trust region: ECHO's confidence-adaptive PPO clip, radius :math:`\epsilon_i` per rollout from ``ctx.confidence``.

    .. math::  \epsilon_i = \epsilon_{min} + (\epsilon_{max} - \epsilon_{min})\,\sigma\big(\kappa(1 - C_i)\big),
               \qquad L = \text{PPO clip with } [1-\epsilon_i, 1+\epsilon_i] \text{ and dual clip } c

    (:func:`echo_clip_epsilon`, :func:`echo_clip_loss`). ``ctx.confidence`` ``[B]`` is the rollout's tail
    confidence :math:`C^{tail}_i` (:func:`tail_confidence`), passed as ``policy_loss(..., confidence=...)``.
    Defaults from the official code (``user683/ECHO``): ``eps_min=0.05``, ``eps_max=0.2``, ``kappa=4.0``;
    ``dual=3.0`` is verl's ``clip_ratio_c``, which ECHO's ``compute_policy_loss`` keeps. The interval is always
    inside PPO's :math:`[1-\epsilon_{max}, 1+\epsilon_{max}]` and narrows as confidence grows;
    ``eps_min == eps_max`` gives plain :class:`~rolloutopt.ratios.PPOClip` with that radius.

    Indicators: ``clipfrac``, ``clip_low_frac``, ``clip_high_frac``, ``dual_clip_frac``; metric
    ``echo_clip_eps_mean`` (token-weighted mean radius). Requires ``confidence``. Edge cases: ``B = 0``,
    ``T = 0``, all-masked rows and an empty mask are harmless (0 loss, 0 metrics). Reference: ECHO, arXiv 2602.02150, §3.2.
    """

    eps_min: float = 0.05
    eps_max: float = 0.2
    kappa: float = 4.0
    dual: float | None = 3.0
    requires: ClassVar[tuple[str, ...]] = ("confidence",)
    accepts: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check_echo(self.eps_min, self.eps_max, self.kappa, "ECHOClip.")
        if self.dual is not None and not (
            isinstance(self.dual, (int, float)) and not isinstance(self.dual, bool) and self.dual > 1
        ):
            raise InputError(
                "ECHOClip.dual", "a number > 1, or None to disable dual clip", repr(self.dual), "use dual=3.0 (verl)"
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
        """The ECHO clipped loss ``[B, T]`` and its indicators (needs ``ctx.confidence``)."""
        if ctx is None:
            raise InputError(
                "ctx",
                "a StageContext carrying confidence [B] (ECHOClip's per-rollout radius)",
                "None",
                "call through rolloutopt.losses.policy_loss(..., trust=ECHOClip(), confidence=...)",
            )
        conf = ctx.need("confidence", "ECHOClip")
        eps = _echo_eps(conf, self.eps_min, self.eps_max, self.kappa).to(ratio.dtype)[:, None]
        loss, ind = echo_clip_loss(ratio, advantages, eps, dual=self.dual)
        metrics = {"echo_clip_eps_mean": masked_mean(eps.expand_as(ratio), ctx.mask)}
        return TrustOutput(loss, None, ind, metrics)
