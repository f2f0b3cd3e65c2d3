"""Prefix ratios: the exact cumulative (prefix) importance ratio and PNPO's prefix-normalised ratio.

Both weight token ``t`` by the log-ratios of its causal prefix :math:`\\lambda_{i,k} = \\ell^\\theta_{i,k} -
\\ell^{old}_{i,k}`, :math:`k \\le t`, counted over valid (masked-in) positions only:

- cumulative: :math:`\\log w_{i,t} = \\sum_{k \\le t} m_{i,k}\\lambda_{i,k}` — the exact correction of the prefix
  state distribution, whose dynamic range grows like :math:`\\sqrt t` under per-token noise;
- PNPO: :math:`\\log w_{i,t} = \\frac{1}{n_{i,t}} \\sum_{k \\le t} m_{i,k}\\lambda_{i,k}` with :math:`n_{i,t}` the
  number of valid tokens up to ``t`` — a geometric mean along the prefix, whose range shrinks like
  :math:`1/\\sqrt t`; at the last valid token it equals GSPO's sequence ratio.

Each is a pure function plus a ratio stage (``log_ratio(logp, old_logp, mask)``) for
:func:`rolloutopt.losses.policy_loss`. One cumulative sum over ``[B, T]``: O(B·T) time and memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, choice, finite, positive, require_experimental
from rolloutopt.typing import BoolBT, FloatBT

__all__ = ["CumulativeRatio", "PNPORatio", "cumulative_log_ratio", "pnpo_log_ratio"]

PNPOGrad = Literal["prefix", "token"]
_GRADS = ("prefix", "token")


def _inputs(logp: Any, old_logp: Any, mask: Any, clamp: float) -> tuple[Tensor, Tensor, Tensor]:
    positive(clamp, "clamp")
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    old = as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    m = as_mask(mask, "mask", dims, "B T", device=lp.device)
    finite(lp, "logp", m)
    finite(old, "old_logp", m)
    return lp, old, m


def _token_log_ratios(lp: Tensor, old: Tensor, m: Tensor, clamp: float) -> Tensor:
    # Each token's log-ratio is clamped at ±clamp first (as TokenRatio does), so the prefix sums are finite for
    # every finite input (|sum| <= clamp·T) and a garbage value in the padding cannot enter a later prefix.
    lam = (lp - old).clamp(-clamp, clamp)
    return torch.where(m, lam, torch.zeros_like(lam))


def _cumulative(lp: Tensor, old: Tensor, m: Tensor, clamp: float) -> Tensor:
    s = _token_log_ratios(lp, old, m, clamp).cumsum(-1).clamp(-clamp, clamp)
    return torch.where(m, s, torch.zeros_like(s))


def _pnpo(lp: Tensor, old: Tensor, m: Tensor, clamp: float, grad: str) -> Tensor:
    lam = _token_log_ratios(lp, old, m, clamp)
    n = m.to(torch.int32).cumsum(-1).clamp(min=1).to(lam.dtype)
    mean = lam.cumsum(-1) / n  # |mean| <= clamp: no further clamp needed for the "prefix" value
    if grad == "token":
        # GSPO-token routing: the value is the prefix mean, the gradient flows through the token's own logp.
        mean = (mean.detach() + (lp - lp.detach())).clamp(-clamp, clamp)
    return torch.where(m, mean, torch.zeros_like(mean))


def cumulative_log_ratio(logp: FloatBT, old_logp: FloatBT, mask: BoolBT, *, clamp: float = 20.0) -> FloatBT:
    r"""Exact cumulative (prefix) log importance ratio: the log-ratio of the whole prefix up to each token.

    .. math::  \log w_{i,t} = \operatorname{clip}\Big(\sum_{k \le t} m_{i,k}\,
               \operatorname{clip}(\ell^\theta_{i,k} - \ell^{old}_{i,k}, -c, c),\ -c,\ c\Big)

    The weight :math:`w_{i,t} = \pi_\theta(y_{\le t})/\pi_{old}(y_{\le t})` corrects the distribution of the
    prefix state exactly, but its log has variance growing linearly in ``t`` (σ²t for i.i.d. per-token noise
    of variance σ²): the "length trap" of sequence-level importance sampling. Reference: PNPO, arXiv 2608.01418
    (the cumulative ratio it compares against); CTPO, arXiv 2605.07331, uses it with position-adaptive bounds.

    Args:
        logp: current log-probs ``[B, T]`` (carry the gradient).
        old_logp: proximal log-probs ``[B, T]``.
        mask: loss mask ``[B, T]``; only masked-in positions enter the sums (gaps inside a row are skipped).
        clamp: log-space clamp ``c`` applied to each token's log-ratio and to the sum (verl's 20), so every
            finite input gives a finite ``exp``. Where the sum is clamped, its gradient is 0.

    Returns:
        ``[B, T]`` log-weights, 0 outside ``mask`` (an all-masked row is all 0).

    Gradient: exact autograd, :math:`\partial \log w_{i,t} / \partial \ell^\theta_{i,k} = m_{i,k}` for every
    ``k ≤ t``; with a per-sequence advantage the surrogate :math:`\sum_t A\,w_t` sends each token the sum over
    its suffix (:math:`A\,(L - k + 1)` on-policy), a return-to-go form whose scale grows with length.
    """
    lp, old, m = _inputs(logp, old_logp, mask, clamp)
    return _cumulative(lp, old, m, clamp)


def pnpo_log_ratio(
    logp: FloatBT, old_logp: FloatBT, mask: BoolBT, *, grad: PNPOGrad = "prefix", clamp: float = 20.0
) -> FloatBT:
    r"""PNPO's prefix-normalised log-ratio: the mean token log-ratio over the causal prefix.

    .. math::  \log w_{i,t} = \frac{1}{n_{i,t}} \sum_{k \le t} m_{i,k}\,
               \operatorname{clip}(\ell^\theta_{i,k} - \ell^{old}_{i,k}, -c, c),
               \qquad n_{i,t} = \sum_{k \le t} m_{i,k}

    A geometric mean of the token ratios along the prefix: the prefix dependence of the cumulative ratio is
    kept, its log scale compressed (σ/√t for i.i.d. per-token noise of s.d. σ). At the first valid token it is
    the token ratio; at the last valid token it equals GSPO's sequence ratio
    (:func:`~rolloutopt.ratios.sequence_log_ratio`). Reference: PNPO, arXiv 2608.01418 (the weight as a digest
    of the paper quotes it; no code is public).

    Args:
        logp: current log-probs ``[B, T]`` (carry the gradient).
        old_logp: proximal log-probs ``[B, T]``.
        mask: loss mask ``[B, T]``; ``t`` counts masked-in positions only.
        grad: how the gradient is routed — a **[reconstructed]** detail (the sources do not say how the weight
            enters the loss):

            - ``"prefix"`` (default): exact autograd of the prefix mean; token ``k`` receives
              :math:`m_{i,k}/n_{i,t}` from every position ``t ≥ k``, so with a per-sequence advantage the
              on-policy surrogate sends it :math:`A \sum_{t \ge k} 1/n_{i,t} \approx A\log(L/k)`.
            - ``"token"``: GSPO-token routing (arXiv 2507.18071 §4.3), value :math:`w_{i,t}`, gradient through
              :math:`\ell^\theta_{i,t}` only: :math:`\log w_{i,t} = \operatorname{sg}(\cdot) + \ell^\theta_{i,t} -
              \operatorname{sg}(\ell^\theta_{i,t})`, so on-policy it is exactly the token-level PPO gradient.
        clamp: log-space clamp ``c`` of each token's log-ratio (verl's 20); the mean then lies in ``[-c, c]``.
            In ``"token"`` mode the routed value is clamped again at ``±c`` (gradient 0 where it binds).

    Returns:
        ``[B, T]`` log-weights, 0 outside ``mask`` (an all-masked row is all 0). O(B·T): one cumulative sum.
    """
    choice(grad, "grad", _GRADS)
    lp, old, m = _inputs(logp, old_logp, mask, clamp)
    return _pnpo(lp, old, m, clamp, grad)


@dataclass(frozen=True)
class CumulativeRatio:
    """Ratio stage: the exact cumulative prefix ratio (:func:`cumulative_log_ratio`), log clamped at ``±clamp``.

    Default ``clamp=20.0`` (verl's log-ratio clamp). Use with a trust region whose bounds suit a weight
    whose log spread grows like √t (see ``docs/methods/offpolicy.md``): GSPO's 3e-4/4e-4 would clip nearly
    every late token. Reference: arXiv 2608.01418 (as PNPO's comparison), CTPO arXiv 2605.07331.
    """

    clamp: float = 20.0

    def __post_init__(self) -> None:
        positive(self.clamp, "CumulativeRatio.clamp")

    def log_ratio(self, logp: FloatBT, old_logp: FloatBT, mask: Bool[Tensor, "B T"]) -> FloatBT:
        """Cumulative log-ratio ``[B, T]`` (inputs already validated by ``policy_loss``)."""
        return _cumulative(logp, old_logp, mask, self.clamp)


@dataclass(frozen=True)
class PNPORatio:
    """Ratio stage: PNPO's prefix-normalised ratio (:func:`pnpo_log_ratio`) in place of the token ratio.

    The loss wiring (a PPO/GSPO-style clipped surrogate with :math:`w_t` replacing the ratio, and how the
    gradient is routed, ``grad``) is **[reconstructed]** (no code, abstract and a digest only), so
    ``experimental=True`` is required. Defaults: ``clamp=20.0`` (verl), ``grad="prefix"`` (exact autograd of
    the prefix mean). Reference: PNPO, arXiv 2608.01418.
    """

    clamp: float = 20.0
    grad: PNPOGrad = "prefix"
    experimental: bool = False

    def __post_init__(self) -> None:
        require_experimental(
            self.experimental,
            "PNPO's loss wiring (the prefix-normalised weight in a clipped surrogate, and the gradient routing "
            "'prefix' vs 'token', from the abstract and a digest of arXiv 2608.01418)",
            "docs/methods/offpolicy.md",
        )
        positive(self.clamp, "PNPORatio.clamp")
        choice(self.grad, "PNPORatio.grad", _GRADS)

    def log_ratio(self, logp: FloatBT, old_logp: FloatBT, mask: Bool[Tensor, "B T"]) -> FloatBT:
        """PNPO log-ratio ``[B, T]`` (inputs already validated by ``policy_loss``)."""
        return _pnpo(logp, old_logp, mask, self.clamp, self.grad)
