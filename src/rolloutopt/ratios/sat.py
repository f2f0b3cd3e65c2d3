"""SAT, the staleness-adaptive trust region (arXiv 2607.18722), for stale or mismatched rollouts.

:class:`SATClip` is the PPO clip with the one endpoint that points away from the behaviour policy contracted for the
batch's most stale tokens (or sequences). The method is known only from its abstract and public summaries: the
formula is **reconstructed** (see ``docs/methods/trust_regions.md``), every open detail is a keyword, and the stage
refuses to run unless constructed with ``experimental=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    choice,
    finite,
    positive,
    require_experimental,
)
from rolloutopt.errors import InputError
from rolloutopt.ratios.context import StageContext, masked_quantiles
from rolloutopt.ratios.m2po import _need_ctx
from rolloutopt.ratios.reference import TrustOutput, _check_clip, bounded_clip_loss
from rolloutopt.typing import BoolBT, FloatBT, FloatBTb, Scalar

__all__ = ["SATBounds", "SATClip", "sat_bounds"]

_KAPPAS = ("ratio", "sqrt", "exp")
_LEVELS = ("token", "sequence")


def _experimental(flag: object, owner: str, what: str) -> None:
    require_experimental(
        flag, f"{what} (from public summaries)", "docs/methods/trust_regions.md", argument=f"{owner}experimental"
    )


# ------------------------------------------------------------------------------------------------------ SAT


@dataclass(frozen=True)
class SATBounds:
    """Per-token clip bounds of SAT (:func:`sat_bounds`), detached.

    Attributes:
        low: :math:`\\epsilon'_{low}` ``[B, T]`` (the ratio's lower bound is ``1 - low``).
        high: :math:`\\epsilon'_{high}` ``[B, T]``.
        tail: bool ``[B, T]``, the tokens in the high-staleness tail (:math:`|d| > q`).
        d: the staleness proxy ``[B, T]`` (per token, or the sequence mean broadcast).
        quantile: the batch quantile :math:`q` (0-d).
    """

    low: FloatBT
    high: FloatBT
    tail: Bool[Tensor, "B T"]
    d: FloatBT
    quantile: Scalar


def _check_sat(low: float, high: float, tail: float, kappa: str, level: str, owner: str) -> None:
    positive(low, f"{owner}low", strict=False)
    positive(high, f"{owner}high", strict=False)
    if low > 1:
        raise InputError(f"{owner}low", "epsilon_low in [0, 1]", repr(low), "use e.g. low=0.2")
    if not (isinstance(tail, (int, float)) and not isinstance(tail, bool) and 0 < tail < 1):
        raise InputError(f"{owner}tail", "a fraction in (0, 1)", repr(tail), "use e.g. tail=0.05")
    choice(kappa, f"{owner}kappa", _KAPPAS)
    choice(level, f"{owner}level", _LEVELS)


def _sat_bounds(
    old: Tensor, behav: Tensor, m: Tensor, low: float, high: float, tail: float, kappa: str, level: str
) -> SATBounds:
    d = torch.where(m, (old - behav).detach().clamp(-20.0, 20.0), torch.zeros_like(old))
    if level == "sequence":
        n = m.sum(-1)
        seq = d.sum(-1) / n.clamp(min=1).to(d.dtype)
        q = masked_quantiles(seq.abs(), n > 0, (1 - tail,), max_samples=None)[0]
        d = torch.where(m, seq[:, None].expand_as(d), torch.zeros_like(d))
    else:
        q = masked_quantiles(d.abs(), m, (1 - tail,), max_samples=None)[0]
    a = d.abs()
    in_tail = m & (a > q)
    frac = q / a.clamp(min=torch.finfo(a.dtype).tiny)
    if kappa == "ratio":
        k = frac
    elif kappa == "sqrt":
        k = frac.sqrt()
    else:
        k = torch.exp(q - a)
    k = torch.where(in_tail, k.clamp(0.0, 1.0), torch.ones_like(k))
    one = torch.ones_like(d)
    eps_high = torch.where(d > 0, k, one) * high
    eps_low = torch.where(d < 0, k, one) * low
    return SATBounds(eps_low, eps_high, in_tail, d, q)


def sat_bounds(
    old_logp: FloatBT,
    behav_logp: FloatBT,
    mask: BoolBT,
    *,
    low: float = 0.2,
    high: float = 0.28,
    tail: float = 0.05,
    kappa: Literal["ratio", "sqrt", "exp"] = "ratio",
    level: Literal["token", "sequence"] = "token",
    experimental: bool = False,
) -> SATBounds:
    r"""SAT's staleness-adaptive clip bounds [reconstructed]: contract one PPO endpoint for the stale tail.

    .. math::
        d = \operatorname{sg}(\ell^{old} - \ell^{beh}) \ \text{(per token, or its mean over the sequence)},
        \qquad q = \operatorname{quantile}_{1-p}\big(|d|\big), \\
        \epsilon'_{high} = \epsilon_{high}\,\kappa \text{ if } d > q, \qquad
        \epsilon'_{low} = \epsilon_{low}\,\kappa \text{ if } d < -q, \qquad \text{otherwise unchanged},
        \qquad \kappa = q/|d| \in (0, 1]

    A token whose proximal policy already moved up from the behaviour policy (:math:`d > 0`, ratio too large)
    gets a smaller upper bound; one that moved down, a smaller lower bound; the other endpoint and every token
    below the quantile keep the PPO interval, so :math:`[1-\epsilon'_{low}, 1+\epsilon'_{high}] \subseteq
    [1-\epsilon_{low}, 1+\epsilon_{high}]` always. Reference: "Stale but Stable", arXiv 2607.18722 (Tencent
    Hy LLM Frontier); **reconstructed** from two public summaries (no code, no formula published): the form
    of :math:`\kappa`, the tail fraction :math:`p` and the quantile rule are our choices, hence
    ``experimental=True`` is required.

    Args:
        old_logp: proximal log-probs ``[B, T]``.
        behav_logp: the rollout engine's log-probs ``[B, T]``.
        mask: bool loss mask ``[B, T]``.
        low, high: the PPO bounds being adapted; defaults 0.2 / 0.28 (DAPO clip-higher, :class:`PPOClip`'s).
            For SAT-GSPO pass GSPO's 3e-4 / 4e-4 with ``level="sequence"``.
        tail: :math:`p`, the fraction of the batch treated as the stale tail [reconstructed; default 0.05].
        kappa: the contraction [reconstructed]: ``"ratio"`` :math:`q/|d|` (default), ``"sqrt"``
            :math:`\sqrt{q/|d|}`, ``"exp"`` :math:`e^{q-|d|}`; each is 1 at :math:`|d| = q` and decreasing.
        level: ``"token"`` (the quantile over the batch's valid tokens) or ``"sequence"`` (:math:`d` is each
            row's mean and the quantile runs over the non-empty rows: the summaries' "SAT-GSPO").
        experimental: must be True (see above).

    Returns:
        :class:`SATBounds`. The quantile is the lower order statistic (no interpolation), computed with one
        sort and tensor indices (no host sync); :math:`d` is clamped to ±20.

    Edge cases: :math:`d \equiv 0` (on-policy rollouts) → :math:`q = 0`, no tail, the PPO interval everywhere;
    if more than a fraction :math:`1-p` of the tokens have :math:`d = 0`, :math:`q = 0` and the tail
    endpoints collapse to 1 (:math:`\kappa = 0`); an empty mask gives no tail.
    """
    _experimental(experimental, "", "SAT's staleness-adaptive interval")
    _check_sat(low, high, tail, kappa, level, "")
    dims = Dims()
    old = as_float(old_logp, "old_logp", dims, "B T")
    behav = as_float(behav_logp, "behav_logp", dims, "B T", device=old.device)
    m = as_mask(mask, "mask", dims, "B T", device=old.device)
    finite(old, "old_logp", m)
    finite(behav, "behav_logp", m)
    return _sat_bounds(old, behav, m, low, high, tail, kappa, level)


@dataclass(frozen=True)
class SATClip:
    r"""Trust region: PPO clip with SAT's staleness-adaptive per-token bounds (:func:`sat_bounds`) [reconstructed].

    .. math::  L = \max\big(-A r,\ -A\,\operatorname{clip}(r, 1-\epsilon'_{low}, 1+\epsilon'_{high})\big)
               \quad (\text{and } \min(L, c|A|) \text{ for } A < 0 \text{ with } \texttt{dual}=c)

    Reads ``ctx.old_logp`` and ``ctx.behav_logp`` (required) for the staleness proxy; ``r`` is whatever the
    ratio stage built (:class:`~rolloutopt.ratios.TokenRatio` for SAT-PPO/GRPO/DAPO, or
    :class:`~rolloutopt.ratios.GSPORatio` with ``level="sequence"`` and GSPO's bounds for SAT-GSPO).
    With :math:`d \equiv 0` it equals ``PPOClip(low, high, dual)`` exactly. Defaults: ``low=0.2, high=0.28``
    (DAPO), ``dual=None`` (the ``dapo`` preset's), ``tail=0.05``, ``kappa="ratio"``, ``level="token"``
    ([reconstructed], see :func:`sat_bounds`); ``experimental=True`` is required.
    Reference: arXiv 2607.18722.

    Indicators: ``sat_tail_frac`` (tokens in the stale tail), ``sat_shrunk_high_frac`` / ``sat_shrunk_low_frac``
    (tail tokens whose upper / lower endpoint was contracted), ``clipfrac``, ``clip_low_frac``,
    ``clip_high_frac`` (and ``dual_clip_frac`` with ``dual``). Metrics: ``sat_quantile`` (:math:`q`).
    """

    low: float = 0.2
    high: float = 0.28
    tail: float = 0.05
    kappa: Literal["ratio", "sqrt", "exp"] = "ratio"
    level: Literal["token", "sequence"] = "token"
    dual: float | None = None
    experimental: bool = False
    requires: ClassVar[tuple[str, ...]] = ("behav_logp",)

    def __post_init__(self) -> None:
        _experimental(self.experimental, "SATClip.", "SAT's staleness-adaptive interval")
        _check_sat(self.low, self.high, self.tail, self.kappa, self.level, "SATClip.")
        _check_clip(self.low, self.high, self.dual, "SATClip")

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        c = _need_ctx(ctx, "SATClip")
        old = c.need("old_logp", "SATClip")
        behav = c.need("behav_logp", "SATClip")
        b = _sat_bounds(old, behav, c.mask, self.low, self.high, self.tail, self.kappa, self.level)
        loss, ind = bounded_clip_loss(ratio, advantages, 1 - b.low, 1 + b.high, self.dual)
        ind["sat_tail_frac"] = b.tail
        ind["sat_shrunk_high_frac"] = b.tail & (b.d > 0)
        ind["sat_shrunk_low_frac"] = b.tail & (b.d < 0)
        return TrustOutput(loss, None, ind, {"sat_quantile": b.quantile})
