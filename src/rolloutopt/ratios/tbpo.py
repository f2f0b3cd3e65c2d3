"""TBPO, trust-band policy optimisation (QaRL, arXiv 2604.07853), for quantised or mismatched rollouts.

:class:`TBPO` is a GSPO-style sequence objective, weighted by the sequence's behaviour-mismatch weight, with
two-sided clipping for negative advantages and the sequences outside a trust band dropped. The method is known only
from its abstract and public summaries: the formula is **reconstructed** (see ``docs/methods/trust_regions.md``),
every open detail is a keyword, and the stage refuses to run unless constructed with ``experimental=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    as_seq_or_token,
    finite,
    positive,
)
from rolloutopt.errors import InputError
from rolloutopt.ratios.context import StageContext
from rolloutopt.ratios.m2po import _need_ctx
from rolloutopt.ratios.reference import TrustOutput, _gspo_token
from rolloutopt.ratios.sat import _experimental
from rolloutopt.typing import BoolBT, FloatBT, FloatBTb, PerSeqOrToken

__all__ = ["TBPO", "tbpo_loss"]


# ----------------------------------------------------------------------------------------------------- TBPO


def _check_tbpo(low: float, high: float, band: float, owner: str) -> None:
    positive(low, f"{owner}low", strict=False)
    positive(high, f"{owner}high", strict=False)
    if low > 1:
        raise InputError(f"{owner}low", "epsilon_low in [0, 1]", repr(low), "use e.g. low=3e-4")
    ok = isinstance(band, (int, float)) and not isinstance(band, bool) and band > 1
    if not ok:
        raise InputError(
            f"{owner}band", "a number C > 1 (the band is [1/C, C])", repr(band), "use e.g. band=2.0 (reconstructed)"
        )


def _tbpo(
    logp: Tensor,
    old: Tensor,
    behav: Tensor,
    adv: Tensor,
    m: Tensor,
    low: float,
    high: float,
    band: float,
    clamp_max: float,
) -> TrustOutput:
    n = m.sum(-1)
    nf = n.clamp(min=1).to(logp.dtype)
    log_r = _gspo_token(logp, old, m, clamp_max)
    r = torch.exp(log_r)
    log_w = (torch.where(m, old - behav, torch.zeros_like(old)).sum(-1) / nf).detach().clamp(-20.0, 20.0)
    w = torch.exp(log_w)[:, None]
    lo, hi = 1 - low, 1 + high
    l1 = -adv * r
    clipped = r.clamp(lo, hi)
    l2 = -adv * clipped
    neg = adv < 0
    loss = torch.where(neg, l2, torch.maximum(l1, l2)) * w
    in_band = (log_w >= -math.log(band)) & (log_w <= math.log(band))
    keep = m & in_band[:, None]
    loss = torch.where(keep, loss, torch.zeros_like(loss))
    ind = {
        "clipfrac": torch.where(neg, (r < lo) | (r > hi), l2 > l1),
        "clip_low_frac": (r < lo) & neg,
        "clip_high_frac": (r > hi) & (adv > 0),
        "dual_clip_frac": (r > hi) & neg,
        "tbpo_out_of_band_frac": ~in_band[:, None].expand_as(m),
    }
    rows = n > 0
    wf = w[:, 0]
    metrics = {
        "tbpo_w_seq_mean": (wf * rows).sum() / rows.sum().clamp(min=1).to(wf.dtype),
        "tbpo_w_seq_max": torch.where(rows, wf, torch.zeros_like(wf)).amax() if wf.numel() else wf.sum(),
    }
    return TrustOutput(loss, keep, ind, metrics)


def tbpo_loss(
    logp: FloatBT,
    old_logp: FloatBT,
    behav_logp: FloatBT,
    advantages: PerSeqOrToken,
    mask: BoolBT,
    *,
    low: float = 3e-4,
    high: float = 4e-4,
    band: float = 2.0,
    clamp_max: float = 10.0,
    experimental: bool = False,
) -> TrustOutput:
    r"""TBPO's per-token loss, keep mask, indicators and metrics [reconstructed]; the formula is :class:`TBPO`'s.

    Args:
        logp: current log-probs ``[B, T]`` (carry the gradient).
        old_logp: proximal log-probs ``[B, T]``.
        behav_logp: the rollout engine's (e.g. quantised) log-probs ``[B, T]``.
        advantages: ``[B]`` or ``[B, T]``.
        mask: bool loss mask ``[B, T]``.
        low, high, band, clamp_max: as in :class:`TBPO` (defaults reconstructed).
        experimental: must be True.

    Returns:
        :class:`~rolloutopt.ratios.TrustOutput`; ``loss`` is 0 wherever ``keep`` is False (out-of-band
        sequences and masked-out positions). Reference: QaRL, arXiv 2604.07853. Edge cases: an empty row has
        ratio and weight 1 and keeps nothing.
    """
    _experimental(experimental, "", "TBPO's trust band and dual clip")
    _check_tbpo(low, high, band, "")
    positive(clamp_max, "clamp_max")
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    old = as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    behav = as_float(behav_logp, "behav_logp", dims, "B T", device=lp.device)
    adv = as_seq_or_token(advantages, "advantages", dims, device=lp.device)
    m = as_mask(mask, "mask", dims, "B T", device=lp.device)
    for x, name in ((lp, "logp"), (old, "old_logp"), (behav, "behav_logp"), (adv.expand_as(lp), "advantages")):
        finite(x, name, m)
    lp = torch.where(m, lp, torch.zeros_like(lp))
    return _tbpo(lp, old, behav, adv, m, low, high, band, clamp_max)


@dataclass(frozen=True)
class TBPO:
    r"""Trust region: TBPO (QaRL) — sequence ratio, dual clip for negative advantages, trust band [reconstructed].

    .. math::
        r_i = \exp\Big(\tfrac{1}{L_i}\textstyle\sum_t (\ell^\theta_{i,t} - \ell^{prox}_{i,t})\Big)
        \text{ (GSPO-token form)}, \qquad
        w_i = \operatorname{sg}\exp\Big(\tfrac{1}{L_i}\textstyle\sum_t (\ell^{prox}_{i,t} - \ell^{beh}_{i,t})\Big), \\
        L_{i,t} = w_i \cdot \begin{cases} -\min\big(r_i A,\ \operatorname{clip}(r_i, 1-\epsilon_l, 1+\epsilon_h) A\big)
        & A \ge 0 \\ -\operatorname{clip}(r_i, 1-\epsilon_l, 1+\epsilon_h)\, A & A < 0 \end{cases},
        \qquad L_{i,\cdot} := 0 \text{ if } w_i \notin [1/C, C]

    For positive advantages this is GSPO's clip (weighted by :math:`w_i`); for negative ones both bounds
    bind, so a quantisation "error token" with a tiny behaviour probability cannot give the loss a magnitude
    above :math:`(1+\epsilon_h)|A|\,w_i`. Sequences outside the band get ``keep=False``: exactly zero loss
    and gradient. Reference: QaRL, arXiv 2604.07853; **reconstructed** from the abstract and public
    summaries (``docs/methods/trust_regions.md``): the band's form and C, and the ε values, are our choices, hence
    ``experimental=True`` is required.

    TBPO builds its own sequence ratio from ``ctx`` (``logp``, ``ctx.old_logp``, ``ctx.mask``) with
    :func:`~rolloutopt.ratios.gspo_token_log_ratio`'s routing (value :math:`r_i` at every token, gradient
    through each token, upper log clamp ``clamp_max``) and **ignores the ratio passed in**; use
    ``ratio=GSPORatio()`` in :func:`~rolloutopt.losses.policy_loss` so that the ratio metrics describe the
    same quantity. Requires ``behav_logp``.

    Defaults [reconstructed]: ``low=3e-4, high=4e-4`` (GSPO's, the sequence objective TBPO is compared with),
    ``band=2.0`` (the band :math:`[1/2, 2]` on the geometric-mean mismatch weight, IcePop's token band
    applied per sequence; verl's geometric rejection uses the much tighter 0.999–1.001 for BF16 mismatch,
    quantised rollouts mismatch more).

    Indicators: ``clipfrac``, ``clip_low_frac``, ``clip_high_frac`` (A > 0, as GSPO), ``dual_clip_frac``
    (A < 0 and :math:`r > 1+\epsilon_h`: where TBPO differs from GSPO), ``tbpo_out_of_band_frac``. Metrics:
    ``tbpo_w_seq_mean``, ``tbpo_w_seq_max`` over non-empty sequences. Edge cases: an empty row has
    :math:`r = w = 1` and no tokens.
    """

    low: float = 3e-4
    high: float = 4e-4
    band: float = 2.0
    clamp_max: float = 10.0
    experimental: bool = False
    requires: ClassVar[tuple[str, ...]] = ("behav_logp",)

    def __post_init__(self) -> None:
        _experimental(self.experimental, "TBPO.", "TBPO's trust band and dual clip")
        _check_tbpo(self.low, self.high, self.band, "TBPO.")
        positive(self.clamp_max, "TBPO.clamp_max")

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        c = _need_ctx(ctx, "TBPO")
        old = c.need("old_logp", "TBPO")
        behav = c.need("behav_logp", "TBPO")
        return _tbpo(logp, old, behav, advantages, c.mask, self.low, self.high, self.band, self.clamp_max)
