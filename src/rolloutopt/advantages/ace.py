"""ACE, the asymmetric confidence-aware error penalty (arXiv 2602.21420): confident errors are penalised more.

:func:`ace` takes a base advantage (GRPO by default, or precomputed advantages from any estimator) and makes
*confident errors* more negative, using the policy's log-likelihood shift from the reference model. The likelihood
statistic is computed at advantage time and treated as a constant (detached): gradients flow only through the
base advantages. Sequence log-probabilities may be passed per token ``[B, T]`` with a ``mask`` (the reduction is a
keyword, ``"sum"`` or ``"mean"``) or per sequence ``[B]``, already reduced and used as is. The form is partly
reconstructed, so ``experimental=True`` is required (see ``docs/methods/confidence.md``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from rolloutopt._validation import (
    Dims,
    choice,
    describe,
    positive,
    require_experimental,
)
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.likelihood import Reduce, _base_advantages, _frac, _sequence_logp
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, FloatBT, IntB

__all__ = ["ace"]


Penalty = Literal["softplus", "softplus_shifted", "relu"]


_LN2 = math.log(2.0)


def ace(
    rewards: FloatB | None,
    group: Groups | IntB,
    logp: FloatB | FloatBT,
    ref_logp: FloatB | FloatBT,
    *,
    mask: BoolBT | None = None,
    advantages: FloatB | None = None,
    alpha: float = 1.0,
    confidence: Reduce = "sum",
    penalty: Penalty = "softplus",
    tau: float = 1.0,
    max_scale: float | None = None,
    experimental: bool = False,
    scale: Literal["group", "batch"] | None = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
    singleton: Literal["zero", "raw"] | None = None,
    valid: BoolB | None = None,
) -> AdvantageOutput:
    r"""ACE: scale the negative advantages of overconfident errors by a softplus of the confidence shift.

    .. math::  c_i = \log\pi_\theta(y_i\mid x) - \log\pi_{\mathrm{ref}}(y_i\mid x)
               = \textstyle\sum_t m_{i,t}\,(\ell^\theta_{i,t} - \ell^{\mathrm{ref}}_{i,t}), \qquad
               \tilde A_i = \begin{cases} A_i\,\bigl(1 + \alpha\,\operatorname{softplus}(c_i/\tau)\bigr)
               & A_i < 0 \\ A_i & A_i \ge 0 \end{cases}

    with :math:`c_i` detached (a constant, computed from ``old_logp`` or ``behav_logp``), so the gradient flows
    through :math:`A_i` only. An error the policy has made *more* likely than the reference did (:math:`c_i > 0`)
    is pushed down harder; correct (non-negative-advantage) rollouts are untouched.

    Reference: ACE, arXiv 2602.21420 (``docs/methods/confidence.md``). Provenance: only the definition of
    :math:`c_i` is from the abstract; "a softplus of :math:`c_i` scales the negative advantage, softplus beats
    ReLU" is from public summaries; the multiplicative, detached form above, the :math:`\alpha` default and the
    reduction of :math:`c_i` are **reconstructed** (no public code). Hence ``experimental=True`` is required.

    Args:
        rewards: scalar rewards ``[B]``; GRPO (:func:`~rolloutopt.advantages.grpo`, with ``scale``, ``eps``,
            ``unbiased``, ``singleton``) gives the base advantages. Pass ``None`` together with ``advantages=``
            to compose ACE on top of any other estimator (DAPO, Dr.GRPO, RLOO...).
        group: group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`.
        logp: log-probs of the sampled tokens under the policy (``old_logp`` or ``behav_logp``), per token
            ``[B, T]`` (with ``mask``) or already summed per sequence ``[B]``.
        ref_logp: the same under the frozen reference model, ``[B, T]`` or ``[B]`` (each reduced on its own).
        mask: response mask ``[B, T]``; required with per-token log-probs.
        advantages: precomputed base advantages ``[B]`` (then ``rewards`` must be None).
        alpha: penalty strength :math:`\alpha \ge 0`; ``alpha=0`` reproduces the base advantages exactly. The
            paper's value is unknown; 1.0 (the value of our worked example) is our default.
        confidence: ``"sum"`` (default; the paper's definition, the log-ratio of whole sequences) or ``"mean"``
            (per-token mean shift), for per-token inputs; ``[B]`` inputs are used as given. Summed :math:`c_i` can reach O(100) nats on long chains of thought, where
            softplus is linear and the penalty large; ``"mean"``, a larger ``tau`` or ``max_scale`` tame it.
        penalty: ``"softplus"`` (default, per the summaries), ``"softplus_shifted"``
            (:math:`\operatorname{softplus}(c/\tau) - \ln 2`, so that :math:`c = 0` adds no penalty and
            under-confident errors are softened; needs :math:`\alpha \ln 2 \le 1` so signs never flip) or
            ``"relu"`` (:math:`\max(c/\tau, 0)`, the summaries' ablation).
        tau: temperature dividing :math:`c_i` inside the penalty (default 1, i.e. none).
        max_scale: optional cap on the multiplier :math:`1 + \alpha\,\operatorname{softplus}(c_i/\tau)`.
        experimental: must be True: the form is reconstructed (see above); passing it acknowledges that.
        scale, eps, unbiased, singleton: forwarded to :func:`~rolloutopt.advantages.grpo` (ignored with
            ``advantages=``).
        valid: optional mask ``[B]`` of rows that enter the statistics; other rows get advantage 0, weight 0,
            and their log-probs may be non-finite.

    Returns:
        :class:`AdvantageOutput` with ``advantages [B]`` and ``weight [B]``; metrics ``penalized_frac`` (rows
        whose advantage ACE enlarged), ``excluded_frac`` (weight 0), ``confidence_mean`` / ``confidence_max``
        (over valid rows), ``penalty_scale_mean`` (over penalized rows), ``capped_frac`` (with ``max_scale``),
        plus the base GRPO metrics.

    Edge cases: singleton and all-equal groups have base advantage 0 (GRPO), so ACE leaves them at 0. Rows of
    an all-masked response have :math:`c_i = 0` (the multiplier is :math:`1 + \alpha \ln 2` for an error).
    With non-binary rewards "error" means "negative advantage": below-baseline rollouts are penalised in
    proportion to their confidence shift.
    """
    require_experimental(
        experimental,
        "ACE's exact form (multiplicative softplus of the detached confidence shift, the alpha default, summed vs "
        "mean c_i, from the abstract and summaries of arXiv 2602.21420)",
        "docs/methods/confidence.md",
    )
    choice(confidence, "confidence", ("sum", "mean"))
    choice(penalty, "penalty", ("softplus", "softplus_shifted", "relu"))
    positive(alpha, "alpha", strict=False)
    positive(tau, "tau")
    if max_scale is not None:
        positive(max_scale, "max_scale")
        if max_scale < 1:
            raise InputError(
                "max_scale", "a cap >= 1 on the error multiplier, or None", describe(max_scale), "use >= 1"
            )
    if penalty == "softplus_shifted" and alpha * _LN2 > 1:
        raise InputError(
            "alpha",
            "alpha * ln 2 <= 1 with penalty='softplus_shifted' (otherwise an under-confident error's multiplier "
            "1 + alpha * (softplus(c) - ln 2) turns negative and flips its advantage)",
            describe(alpha),
            f"use alpha <= {1 / _LN2:.4f}, or penalty='softplus'",
        )
    dims = Dims()
    grpo_kwargs = {"scale": scale, "eps": eps, "unbiased": unbiased, "singleton": singleton}
    a, g, v, w, metrics = _base_advantages(rewards, group, advantages, valid, dims, grpo_kwargs)
    s, _ = _sequence_logp(logp, "logp", dims, mask, v, confidence)
    s_ref, _ = _sequence_logp(ref_logp, "ref_logp", dims, mask, v, confidence)
    c = (s - s_ref).to(a.dtype)
    z = c / tau
    if penalty == "relu":
        pen = z.clamp(min=0)
    else:
        pen = F.softplus(z)
        if penalty == "softplus_shifted":
            pen = pen - _LN2
    mult = 1 + alpha * pen
    capped = torch.zeros_like(mult, dtype=torch.bool)
    if max_scale is not None:
        capped = mult > max_scale
        mult = mult.clamp(max=max_scale)
    neg = a < 0
    adv = torch.where(neg, a * mult, a)

    n_rows = g.num_rows
    if v is None:  # every row valid: the masked reductions below reduce to plain ones (same values)
        n_valid = torch.tensor(n_rows, device=c.device)
        c_sum, c_max, excluded = c.sum(), c.max(), torch.zeros((), device=c.device)
    else:
        n_valid = v.sum()
        c_sum = (c * v).sum()
        c_max = torch.where(v, c, torch.full_like(c, -torch.inf)).max()
        excluded = _frac(~v, n_rows)
    metrics.update(
        penalized_frac=_frac(neg & (mult != 1), n_rows),
        excluded_frac=excluded,
        confidence_mean=(c_sum / n_valid.clamp(min=1)).detach(),
        confidence_max=c_max.nan_to_num(neginf=0.0).detach(),
        penalty_scale_mean=((mult * neg).sum() / neg.sum().clamp(min=1)).detach(),
    )
    if max_scale is not None:
        metrics["capped_frac"] = _frac(capped & neg, n_rows)
    return AdvantageOutput(advantages=adv, weight=w, metrics=metrics)


REGISTRY.register(
    "ace",
    ace,
    requires=("logp", "ref_logp"),
    accepts=("mask", "advantages", "valid"),
    reference="ACE arXiv 2602.21420 (no public code)",
    experimental="the multiplicative softplus of the detached confidence shift, the alpha default and the reduction "
    "of c_i are reconstructed from the abstract and public summaries (no public code)",
)
