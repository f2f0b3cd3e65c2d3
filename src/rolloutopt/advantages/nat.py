"""NAT ("Not All Tokens Are Needed", arXiv 2603.06619): token subsampling with Horvitz–Thompson weights.

:func:`nat_weights` subsamples tokens at random and returns one over each token's inclusion probability, so the
subsampled loss is an unbiased estimate of the full-token loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_mask,
    checks_enabled,
    choice,
    describe,
)
from rolloutopt.advantages._base import SELECTORS
from rolloutopt.advantages.d3s import _fraction
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolBT, FloatBT

__all__ = ["TokenSubsample", "nat_weights"]


@dataclass(frozen=True)
class TokenSubsample:
    """What :func:`nat_weights` returns.

    Attributes:
        mask: bool ``[B, T]``, the subsampled tokens (a subset of the input mask).
        weight: ``[B, T]``, ``1/π`` on kept tokens and 0 elsewhere (Horvitz–Thompson weights): multiply the
            per-token loss by it, keep the *full* mask's denominator, and the loss is unbiased.
        inclusion: ``[B, T]``, the inclusion probability π of every masked-in token (0 outside the mask).
        metrics: ``token_keep_frac`` (kept over masked-in tokens), ``excluded_frac`` (its complement),
            ``expected_keep_frac`` (Σπ over the count
            of masked-in tokens), ``weight_max`` and ``weight_mean`` (over kept tokens).
    """

    mask: Bool[Tensor, "B T"]
    weight: FloatBT
    inclusion: FloatBT
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _nat_output(
    kept: Tensor, w: Tensor, pi: Tensor, m8: Tensor, kept8: Tensor, w_val: Tensor | None = None
) -> TokenSubsample:
    """The :class:`TokenSubsample` of :func:`nat_weights` with its metrics, from exact integer counts of the
    uint8 views ``m8`` and ``kept8`` (``count_nonzero`` needs no ``[B, T]`` temporary, unlike a sum with a
    wider dtype). ``w_val``: the one weight every kept token has (URS), which gives ``weight_max`` without a
    pass over ``w``."""
    n_tok = torch.count_nonzero(m8).to(torch.float32).clamp(min=1)
    n_kept = torch.count_nonzero(kept8)
    if w_val is not None:
        w_max = (n_kept > 0).to(torch.float32) * w_val
    else:
        w_max = w.amax() if w.numel() else torch.zeros((), device=w.device)
    metrics = {
        "token_keep_frac": n_kept / n_tok,
        "excluded_frac": 1 - n_kept / n_tok,
        "expected_keep_frac": pi.sum() / n_tok,
        "weight_max": w_max,
        "weight_mean": w.sum() / n_kept.clamp(min=1),  # summed like the reference: the same rounding
    }
    return TokenSubsample(mask=kept, weight=w, inclusion=pi, metrics=metrics)


def _nat_uniform(m: Tensor, generator: torch.Generator, p: float) -> TokenSubsample:
    """URS of :func:`nat_weights`: the same draws, mask, weights and inclusion as the plain expressions
    (``kept = m & (u < p)``, ``pi = m * p``, ``w = where(kept, 1 / pi, 0)``) with no ``[B, T]`` temporary
    beyond the outputs: every kept token has the same weight ``1 / p`` (as float32), so ``w`` is the kept mask
    times one scalar, written into the buffer of the uniform draws."""
    u = torch.rand(m.shape, generator=generator, device=m.device)
    # outputs laid out like the mask (as the elementwise reference's are), so the metrics' sums add in its order
    kept = torch.lt(u, p, out=torch.empty_like(m))
    m8 = m.view(torch.uint8)
    kept8 = kept.view(torch.uint8).bitwise_and_(m8)  # kept = m & (u < p), in place (uint8: no slow bool ops)
    pi = m8.to(torch.float32).mul_(p)
    # the weight of a kept token, exactly as the elementwise 1 / pi.clamp(min=1e-30) computes it in float32
    w_val = 1 / torch.tensor(p, dtype=torch.float32, device=m.device).clamp(min=1e-30)
    w = (u if m.is_contiguous() else torch.empty_like(pi)).copy_(kept8).mul_(w_val)
    return _nat_output(kept, w, pi, m8, kept8, w_val)


def nat_weights(
    mask: BoolBT,
    *,
    generator: torch.Generator,
    scheme: Literal["uniform", "prefix"] = "uniform",
    keep_prob: float = 0.5,
    min_frac: float = 0.0,
) -> TokenSubsample:
    r"""NAT token subsampling with Horvitz–Thompson weights: an unbiased partial-token policy gradient.

    Each masked-in token :math:`t` of rollout :math:`i` is kept with a known probability :math:`\pi_{i,t} > 0`
    and, when kept, weighted by :math:`1/\pi_{i,t}`:

    .. math::  \hat g = \sum_{i,t} \frac{\mathbb 1[t \in S_i]}{\pi_{i,t}}\, g_{i,t}, \qquad
               \mathbb E[\hat g] = \sum_{i,t} m_{i,t}\, g_{i,t}

    for any per-token terms :math:`g_{i,t}` (policy-gradient terms, clipped surrogates, KL terms), because
    :math:`\mathbb E[\mathbb 1[t \in S_i]] = \pi_{i,t}`.

    - ``scheme="uniform"`` (URS, uniform random sampling): every token independently with probability
      ``keep_prob``; :math:`\pi = p`.
    - ``scheme="prefix"`` (RPC, random prefix cutting): each rollout keeps its first :math:`\lceil u L_i\rceil`
      tokens, :math:`u \sim \mathcal U(a, 1]` with :math:`a` = ``min_frac``; the token at (0-based) position
      :math:`t` among the rollout's :math:`L_i` tokens is kept iff :math:`t < uL_i`, so
      :math:`\pi_{i,t} = \min\{1, (1 - t/L_i)/(1 - a)\}`. The expected kept fraction is about :math:`(1+a)/2`
      (one half at the default :math:`a=0`). The kept tokens are contiguous, which is what saves the
      forward/backward compute, at the price of weights up to :math:`(1-a)L_i` on the last tokens.

    Reference: "Not All Tokens Are Needed (NAT): token efficient reinforcement learning", arXiv 2603.06619
    (Horvitz–Thompson reweighting, URS and RPC, as few as 50% of tokens). Only its abstract was available to
    us; the exact sampling laws above (Bernoulli URS; uniform cut fraction for RPC, with ``min_frac``) are our
    reconstruction, and their weights are exact for the laws we sample, so unbiasedness holds by construction.

    Args:
        mask: response mask ``[B, T]``; positions count among a row's masked-in tokens, so holes are allowed.
        generator: an explicit :class:`torch.Generator` on the mask's device (the global RNG is never used).
        scheme: ``"uniform"`` (URS) or ``"prefix"`` (RPC).
        keep_prob: URS keep probability in (0, 1] (default 0.5, the paper's headline token budget).
        min_frac: RPC lower end of the cut fraction, in [0, 1] (default 0; 1 keeps everything). Both are
            validated whatever the scheme (a NaN or out-of-range value of the unused one raises too).

    Returns:
        :class:`TokenSubsample` with the subsampled ``mask``, the ``weight`` and the ``inclusion`` probabilities.

    Edge cases: all-masked rows keep nothing and get weight 0; ``keep_prob=1`` (URS) and ``min_frac=1``
    (RPC) return the input mask with weight 1. Aggregate with the full mask's token count: dividing by the
    subsampled count (a plain token-mean over the new mask) is a ratio estimator and is biased.
    """
    choice(scheme, "scheme", ("uniform", "prefix"))
    if not isinstance(generator, torch.Generator):
        raise InputError(
            "generator", "a torch.Generator", describe(generator), "pass generator=torch.Generator().manual_seed(s)"
        )
    m = as_mask(mask, "mask", Dims(), "B T")
    if checks_enabled() and generator.device.type != m.device.type:
        raise InputError(
            "generator", f"a generator on {m.device}", f"a generator on {generator.device}", "create it on that device"
        )
    p = _fraction(keep_prob, "keep_prob")  # both checked whatever the scheme: a NaN is never accepted silently
    a = _fraction(min_frac, "min_frac", open_low=False)
    if scheme == "uniform":
        return _nat_uniform(m, generator, p)
    m8 = m.view(torch.uint8)
    mf = m8.to(torch.float32)
    pos = mf.cumsum(1)  # the exact integer counts, so its last column is the row's length L
    length = pos[:, -1:].clone()
    pos.sub_(1)  # 0-based position among the row's masked-in tokens
    cut = a + (1 - a) * (1 - torch.rand((m.shape[0], 1), generator=generator, device=m.device))  # (a, 1]
    kept = torch.lt(pos, cut * length, out=torch.empty_like(m))  # laid out like the mask, as the reference's
    kept8 = kept.view(torch.uint8).bitwise_and_(m8)  # kept = m & (pos < cut L), in place
    frac_pos = pos.div_(length.clamp(min=1))
    # the weights' buffer (laid out like the mask, as the reference's) first holds the 0/1 flags of pi = 1
    w = torch.le(frac_pos, a, out=torch.empty_like(m, dtype=torch.float32))
    # pi = where(frac_pos <= a, 1, min(tail, 1)) * m as arithmetic, in the positions' buffer: min(tail, 1) is
    # in (0, 1], so its maximum with the flag is 1 where flagged and min(tail, 1) elsewhere
    tail = frac_pos.neg_().add_(1).div_(max(1 - a, 1e-12))  # (1 - frac_pos) / (1 - a)
    pi = torch.maximum(tail.clamp_(max=1), w, out=tail).mul_(mf)
    # w = where(kept, 1 / pi, 0): the reciprocal (what ``1 / x`` computes) is finite, so a 0/1 multiply is exact
    torch.clamp(pi, min=1e-30, out=w).reciprocal_().mul_(mf.copy_(kept8))
    return _nat_output(kept, w, pi, m8, kept8)


SELECTORS.register(
    "nat_weights",
    nat_weights,
    requires=("mask",),
    reference="NAT arXiv 2603.06619 (URS and RPC with Horvitz-Thompson weights; no public code)",
)
