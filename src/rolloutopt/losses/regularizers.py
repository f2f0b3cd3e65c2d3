"""Regularisers of the policy objective: KL estimators against the reference policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, choice, finite, positive
from rolloutopt.typing import FloatBT

__all__ = ["KL", "KL_ESTIMATORS", "kl_penalty"]

_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
KL_ESTIMATORS: tuple[str, ...] = tuple(
    base + plus for base in ("k1", "abs", "k2", "k3", "kl", "mse", "low_var_kl") for plus in ("", "+")
)


def _base(logp: Tensor, ref: Tensor, name: str, clamp: bool) -> Tensor:
    if name == "k1":
        return logp - ref
    if name == "abs":
        return (logp - ref).abs()
    if name == "k2":
        return 0.5 * (logp - ref) ** 2
    d = ref - logp
    if clamp:
        d = d.clamp(-20.0, 20.0)
    k3 = torch.expm1(d) - d  # = e^d - d - 1 without the cancellation that rounds tiny values below 0
    return k3.clamp(-10.0, 10.0) if clamp else k3


def kl_penalty(logp: FloatBT, ref_logp: FloatBT, estimator: str = "k3", *, clamp: bool = True) -> FloatBT:
    r"""Per-token estimate of :math:`\mathrm{KL}(\pi_\theta \,\|\, \pi_{ref})` from the sampled tokens' log-probs.

    With :math:`\delta = \ell^{ref} - \ell^\theta`:

    - ``k1`` (``kl``): :math:`-\delta`; ``abs``: :math:`|\delta|`; ``k2`` (``mse``): :math:`\tfrac12 \delta^2`;
    - ``k3`` (``low_var_kl``): :math:`e^{\delta} - \delta - 1` (unbiased, non-negative, low variance).
      With ``clamp=True`` (verl) :math:`\delta` is clamped to ±20 and the result to [-10, 10]; TRL's
      ``beta`` term is the unclamped form (``clamp=False``).
    - a trailing ``+`` (``k3+``) keeps the value of the base estimator with the gradient of ``k2``
      (straight-through: :math:`k_2 - \operatorname{sg}(k_2) + \operatorname{sg}(k)`), as verl does.

    Reference: J. Schulman, "Approximating KL divergence" (2020); GRPO arXiv 2402.03300 uses k3.
    """
    choice(estimator, "estimator", KL_ESTIMATORS)
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    ref = as_float(ref_logp, "ref_logp", dims, "B T", device=lp.device)
    return _kl(lp, ref, estimator, clamp)


def _kl(lp: Tensor, ref: Tensor, estimator: str, clamp: bool) -> Tensor:
    straight_through = estimator.endswith("+")
    name = estimator.rstrip("+")
    name = _ALIASES.get(name, name)
    value = _base(lp, ref, name, clamp)
    if not straight_through:
        return value
    k2 = 0.5 * (lp - ref) ** 2
    return k2 - k2.detach() + value.detach()


@dataclass(frozen=True)
class KL:
    """Regulariser stage: ``coef · kl_penalty(logp, ref_logp, estimator)`` added to every loss token.

    Defaults are verl's actor KL loss (``kl_loss_type=low_var_kl``, ``kl_loss_coef=0.001``). The term shares
    the policy term's aggregation, which equals verl's separate ``agg_loss`` of the KL and TRL's per-token
    ``beta`` term. Requires ``ref_logp`` in :func:`rolloutopt.losses.policy_loss`.
    """

    estimator: str = "k3"
    coef: float = 0.001
    clamp: bool = True

    def __post_init__(self) -> None:
        choice(self.estimator, "KL.estimator", KL_ESTIMATORS)
        positive(self.coef, "KL.coef", strict=False)

    def per_token(self, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
        """The unscaled per-token KL estimate (inputs already validated)."""
        finite(ref_logp, "ref_logp", mask)
        return _kl(logp, ref_logp, self.estimator, self.clamp)
