"""Regularisers of the policy objective: KL estimators against the reference policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, check_bool, choice, finite, positive
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolBT, FloatBT

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


def _check_clamp(estimator: str, clamp: Any, clamp_grad: Any, prefix: str = "") -> None:
    """Validate the two clamp flags; ``clamp_grad`` needs the clamp it refers to (k3 with ``clamp=True``)."""
    check_bool(clamp, f"{prefix}clamp")
    check_bool(clamp_grad, f"{prefix}clamp_grad")
    base = _ALIASES.get(estimator.rstrip("+"), estimator.rstrip("+"))
    if clamp_grad and (base != "k3" or not clamp):
        raise InputError(
            f"{prefix}clamp_grad",
            "clamp_grad=True only with a k3 estimator (k3, k3+, low_var_kl, low_var_kl+) and clamp=True: it zeroes "
            "the gradient where that clamp acts",
            f"estimator={estimator!r}, clamp={clamp!r}",
            "use estimator='k3+' with clamp=True (NeMo-RL's k3 term), or leave clamp_grad=False",
        )


def kl_penalty(
    logp: FloatBT, ref_logp: FloatBT, estimator: str = "k3", *, clamp: bool = True, clamp_grad: bool = False
) -> FloatBT:
    r"""Per-token estimate of :math:`\mathrm{KL}(\pi_\theta \,\|\, \pi_{ref})` from the sampled tokens' log-probs.

    With :math:`\delta = \ell^{ref} - \ell^\theta`:

    - ``k1`` (``kl``): :math:`-\delta`; ``abs``: :math:`|\delta|`; ``k2`` (``mse``): :math:`\tfrac12 \delta^2`;
    - ``k3`` (``low_var_kl``): :math:`e^{\delta} - \delta - 1` (unbiased, non-negative, low variance).
      With ``clamp=True`` (verl, NeMo-RL) :math:`\delta` is clamped to ±20 and the result to [-10, 10], so the
      gradient of ``k3`` is 0 where either clamp acts; TRL's ``beta`` term is the unclamped form
      (``clamp=False``).
    - a trailing ``+`` (``k3+``) keeps the value of the base estimator with the gradient of ``k2``
      (straight-through: :math:`k_2 - \operatorname{sg}(k_2) + \operatorname{sg}(k)`), as verl does: the
      gradient is :math:`\ell^\theta - \ell^{ref}` at every token, clamped or not.
    - ``clamp_grad=True`` (only with a k3 estimator and ``clamp=True``): the ``k3+`` gradient is 0 where the
      clamp acts, i.e. where :math:`|\delta| > 20` or :math:`k_3(\operatorname{clip}(\delta, \pm 20)) > 10`:

      .. math::  \nabla_\theta = \mathbb 1\big[|\delta| \le 20,\ k_3 \le 10\big]\,
                 (\ell^\theta - \ell^{ref})\, \nabla_\theta \ell^\theta

      This is NeMo-RL's on-policy k3 term (``NVIDIA-NeMo/RL@7ea279ab``, ``nemo_rl/algorithms/utils.py::
      calculate_kl`` with its default ``input_clamp_value=20``, ``output_clamp_value=10``, multiplied in
      ``nemo_rl/algorithms/loss/loss_functions.py::ClippedPGLossFn`` by the score-function weight
      :math:`e^{\ell^\theta - \operatorname{sg}(\ell^\theta)}`): its value is the clamped k3, its gradient
      :math:`k_3 \nabla\ell + \nabla k_3 = (\ell^\theta - \ell^{ref})\nabla\ell` (that of ``k2``) where no
      clamp acts, and 0 where one does (a clamped input detaches the weight; a clamped output has no gradient).
      NeMo-RL's ``use_on_policy_kl_approximation`` (a ratio to the generation policy) is not covered. With
      ``clamp_grad=False`` (default) ``k3+`` is verl's and equals NeMo-RL's except at the clamped tokens.

    Reference: J. Schulman, "Approximating KL divergence" (2020); GRPO arXiv 2402.03300 uses k3.
    """
    choice(estimator, "estimator", KL_ESTIMATORS)
    _check_clamp(estimator, clamp, clamp_grad)
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    ref = as_float(ref_logp, "ref_logp", dims, "B T", device=lp.device)
    return _kl(lp, ref, estimator, clamp, clamp_grad)


def _kl(lp: Tensor, ref: Tensor, estimator: str, clamp: bool, clamp_grad: bool = False) -> Tensor:
    straight_through = estimator.endswith("+")
    name = estimator.rstrip("+")
    name = _ALIASES.get(name, name)
    value = _base(lp, ref, name, clamp)
    if not straight_through:
        return value  # (a clamped k3 already has gradient 0 where its clamps act)
    k2 = 0.5 * (lp - ref) ** 2
    grad = k2 - k2.detach()  # value 0, gradient of k2
    if clamp_grad:
        d = (ref - lp).detach()
        dc = d.clamp(-20.0, 20.0)
        k3 = torch.expm1(dc) - dc
        unclamped = (d.abs() <= 20.0) & (k3 >= -10.0) & (k3 <= 10.0)  # False for NaN: no gradient there either
        grad = torch.where(unclamped, grad, torch.zeros_like(grad))
    return grad + value.detach()


@dataclass(frozen=True)
class KL:
    """Regulariser stage: ``coef · kl_penalty(logp, ref_logp, estimator)`` added to every loss token.

    Defaults are verl's actor KL loss (``kl_loss_type=low_var_kl``, ``kl_loss_coef=0.001``). The term shares
    the policy term's aggregation, which equals verl's separate ``agg_loss`` of the KL and TRL's per-token
    ``beta`` term. Requires ``ref_logp`` in :func:`rolloutopt.losses.policy_loss`. ``clamp`` and
    ``clamp_grad`` as in :func:`kl_penalty`: ``KL("k3+", coef=beta, clamp_grad=True)`` is NeMo-RL's
    ``reference_policy_kl_penalty=beta`` term (without ``use_on_policy_kl_approximation``).
    """

    estimator: str = "k3"
    coef: float = 0.001
    clamp: bool = True
    clamp_grad: bool = False
    requires: ClassVar[tuple[str, ...]] = ("ref_logp",)

    def __post_init__(self) -> None:
        choice(self.estimator, "KL.estimator", KL_ESTIMATORS)
        positive(self.coef, "KL.coef", strict=False)
        _check_clamp(self.estimator, self.clamp, self.clamp_grad, prefix="KL.")

    def per_token(self, logp: FloatBT, ref_logp: FloatBT, mask: BoolBT) -> FloatBT:
        """The unscaled per-token KL estimate (inputs already validated)."""
        finite(ref_logp, "ref_logp", mask)
        return _kl(logp, ref_logp, self.estimator, self.clamp, self.clamp_grad)
