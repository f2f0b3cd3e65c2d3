"""Likelihood-aware advantage modulation: ACE (confidence-aware error penalty) and XRPO novelty sharpening.

Both methods take a base advantage (GRPO by default, or precomputed advantages from any estimator) and reshape
it with a per-rollout sequence log-likelihood statistic. ACE makes *confident errors* more negative, using the
policy's log-likelihood shift from the reference model; XRPO makes *unlikely successes* more positive, using the
policy's length-normalised log-likelihood relative to the other rollouts of the same prompt. The likelihood
statistics are computed at advantage time (from ``old_logp`` or ``behav_logp``) and treated as constants
(detached): gradients flow only through the base advantages (or the rewards that produced them).

Sequence log-probabilities may be passed per token ``[B, T]`` with a ``mask`` (the reduction over masked-in
tokens is a keyword, ``"sum"`` or ``"mean"``) or per sequence ``[B]``, already reduced by the caller and used as
is (the reduction keyword then does not apply).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    checks_enabled,
    choice,
    describe,
    finite,
    positive,
    require_experimental,
)
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.reference import grpo
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import FloatB, IntB

__all__ = ["ace", "xrpo_sharpen"]

Reduce = Literal["sum", "mean"]
Penalty = Literal["softplus", "softplus_shifted", "relu"]

_LN2 = math.log(2.0)
_MAX_LOG_NOVELTY = 60.0  # exp(60) ~ 1e26: finite in fp32, and far past the point where the bonus is 0


def _base_advantages(
    rewards: Any,
    group: Groups | IntB,
    advantages: Any,
    valid: Any,
    dims: Dims,
    grpo_kwargs: dict[str, Any],
) -> tuple[Tensor, Groups, Tensor | None, Tensor, dict[str, Tensor]]:
    """The advantages to reshape: GRPO on ``rewards``, or the caller's precomputed ``advantages`` (not both)."""
    if (rewards is None) == (advantages is None):
        raise InputError(
            "rewards",
            "exactly one of rewards (GRPO is applied as the base estimator) or advantages= (precomputed)",
            "both" if rewards is not None else "neither",
            "pass rewards [B] to use GRPO as the base, or rewards=None and advantages=<[B] tensor from any estimator>",
        )
    if advantages is None:
        as_float(rewards, "rewards", dims, "B")  # binds B for the log-prob arguments
        g = as_groups(group, dims)
        v = None if valid is None else as_mask(valid, "valid", dims, "B", device=rewards.device)
        out = grpo(rewards, g, valid=v, **grpo_kwargs)
        return out.advantages, g, v, out.weight, dict(out.metrics)
    a = as_float(advantages, "advantages", dims, "B")
    g = as_groups(group, dims)
    v = None if valid is None else as_mask(valid, "valid", dims, "B", device=a.device)
    finite(a, "advantages", v)
    if v is not None:
        a = torch.where(v, a, torch.zeros_like(a))
    w = torch.ones_like(a) if v is None else v.to(a.dtype)
    return a, g, v, w, {}


def _sequence_logp(
    x: Any, name: str, dims: Dims, mask: Any, valid: Tensor | None, reduce: Reduce, *, need_lengths: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Sequence log-likelihood ``[B]`` from ``[B]`` or masked ``[B, T]`` log-probs, detached, 0 at invalid rows.

    Also returns the response lengths (int32 ``[B]``) for per-token input when ``reduce="mean"`` or
    ``need_lengths``, else None.
    """
    t = as_float(x, name)
    lengths: Tensor | None = None
    if t.ndim == 1:
        dims.check(t, name, "B")
        finite(t, name, valid)
        s = t.detach()  # a per-sequence input is the caller's statistic, used as is
    elif t.ndim == 2:
        dims.check(t, name, "B T")
        if mask is None:
            raise InputError(
                "mask",
                f"a response mask [B, T] when {name} is per token",
                "None",
                "pass mask= (True where a token counts)",
            )
        m = as_mask(mask, "mask", dims, "B T", device=t.device)
        # One pass over [B, T]; invalid rows are zeroed below, on [B]. The row sums certify finiteness (a sum
        # with a non-finite term is non-finite), so the exact [B, T] check runs only when a sum is not finite.
        s = torch.where(m, t.detach(), 0.0).sum(-1)
        if checks_enabled():
            bad = ~torch.isfinite(s)
            if bool((bad if valid is None else bad & valid).any()):
                finite(t, name, m if valid is None else m & valid[:, None])
        if reduce == "mean" or need_lengths:
            lengths = m.sum(-1, dtype=torch.int32)
        if reduce == "mean":
            assert lengths is not None
            s = s / lengths.clamp(min=1).to(s.dtype)
    else:
        raise InputError(
            name,
            "per-sequence log-probs [B] or per-token log-probs [B, T]",
            describe(t),
            f"pass {name} as [B] (summed over the response) or [B, T] with mask=",
        )
    return (s if valid is None else torch.where(valid, s, 0.0)), lengths


def _frac(x: Tensor, n: int | Tensor) -> Tensor:
    return (x.sum() / n).detach() if isinstance(n, int) else (x.sum() / n.clamp(min=1)).detach()


def ace(
    rewards: FloatB | None,
    group: Groups | IntB,
    logp: Tensor,
    ref_logp: Tensor,
    *,
    mask: Any = None,
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
    valid: Any = None,
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


def xrpo_sharpen(
    rewards: FloatB | None,
    group: Groups | IntB,
    logp: Tensor,
    *,
    mask: Any = None,
    advantages: FloatB | None = None,
    lambda_novelty: float = 2.5,
    kappa_clip: float = 0.5,
    score: Reduce = "mean",
    baseline: Literal["group", "correct"] = "group",
    correct: Any = None,
    scale: Literal["group", "batch"] | None = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
    singleton: Literal["zero", "raw"] | None = None,
    valid: Any = None,
) -> AdvantageOutput:
    r"""XRPO novelty-aware advantage sharpening: amplify correct responses the policy found unlikely.

    .. math::  s_i = \frac{1}{|y_i|}\sum_t \log\pi_\theta(y_{i,t}\mid x, y_{i,<t}), \qquad
               \eta_i = e^{\,s_i - \bar s_g}, \qquad
               A^+_i = A_i + \min\bigl(\max(\lambda_{\mathrm{novelty}}(1 - \eta_i),\, 0),\;
               \kappa_{\mathrm{clip}}\, A_i\bigr) \quad (\text{correct } i,\ A_i > 0)

    where :math:`\bar s_g` is the mean score of the group. A correct response less likely than its siblings
    (:math:`\eta_i < 1`) gets a bonus of up to :math:`\lambda_{\mathrm{novelty}}`, capped at
    :math:`\kappa_{\mathrm{clip}} A_i` so the sharpened advantage never exceeds :math:`(1+\kappa)A_i`; typical
    (:math:`\eta_i \ge 1`) and incorrect responses keep :math:`A_i`. The scores are detached constants.

    Reference: XRPO, arXiv 2510.06672 (Bamba et al., 2025; ICML 2026), the exploitation component, Eq. (6).
    Provenance: the novelty :math:`\eta_i = e^{s(y_i) - \bar s}`, the application to responses judged correct,
    and the defaults :math:`\lambda_{\mathrm{novelty}} = 2.5`, :math:`\kappa_{\mathrm{clip}} = 0.5` (the paper's
    reproducibility statement) are as quoted from the paper by its public reviews; the form of :math:`A^+` and
    the length-normalised score :math:`s` are as a public re-implementation states the paper's equations. The
    paper's text and code (github.com/UIUC-MLSys/XRPO) could not be checked here. **Reconstructed** (our
    choices, keywords): which rows enter :math:`\bar s_g` (``baseline``), what "correct" means for non-binary
    rewards (``correct``), the detachment of :math:`s`, the ``[B]`` input convention.

    Args:
        rewards: scalar rewards ``[B]``; GRPO (with ``scale``, ``eps``, ``unbiased``, ``singleton``, as in
            :func:`~rolloutopt.advantages.grpo`) gives the base advantages, as in the paper. Pass ``None`` with
            ``advantages=`` to sharpen the output of another estimator (e.g. GSPO-style GRPO advantages).
        group: group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`.
        logp: log-probs of the sampled tokens under the policy that generated them (``old_logp``), per token
            ``[B, T]`` with ``mask``, or per sequence ``[B]``.
        mask: response mask ``[B, T]``; required with per-token ``logp``.
        advantages: precomputed base advantages ``[B]`` (then ``rewards`` must be None).
        lambda_novelty: bonus scale :math:`\lambda_{\mathrm{novelty}} \ge 0` (paper: 2.5). 0 returns the base.
        kappa_clip: cap :math:`\kappa_{\mathrm{clip}} \ge 0` relative to :math:`A_i` (paper: 0.5).
        score: ``"mean"`` (default, length-normalised log-likelihood) or ``"sum"`` (the raw sequence log-prob),
            for per-token ``logp``; a ``[B]`` ``logp`` is taken as the score :math:`s_i` as given.
        baseline: rows whose scores form :math:`\bar s_g`: ``"group"`` (default, every valid rollout of the
            prompt) or ``"correct"`` (only its correct rollouts, comparing successes with each other).
        correct: optional bool mask ``[B]`` of correct responses; default: rows with :math:`A_i > 0` (for
            binary rewards in a mixed group, exactly the correct ones). Rows are sharpened only when correct
            *and* :math:`A_i > 0`, so the cap :math:`\kappa A_i` is positive.
        valid: optional mask ``[B]``; invalid rows get advantage 0, weight 0, stay out of :math:`\bar s_g`, and
            their log-probs may be non-finite.

    Returns:
        :class:`AdvantageOutput` with ``advantages [B]``; metrics ``sharpened_frac`` (rows given a bonus),
        ``capped_frac`` (rows whose bonus hit :math:`\kappa A_i`), ``bonus_mean`` (over sharpened rows),
        ``novelty_mean`` (mean :math:`\eta` of valid rows), ``excluded_frac`` (weight 0), plus the base metrics.

    Edge cases: a singleton group has :math:`\eta = 1` (and base advantage 0): no bonus. All-equal rewards
    give :math:`A = 0`, hence no bonus. An all-masked response (per-token input) has no likelihood: it is left
    out of :math:`\bar s_g` and gets no bonus (its base advantage is kept). Sharpened advantages of a group no longer sum to 0. The score is
    group-relative: adding a constant to the scores of a whole group changes nothing.
    """
    positive(lambda_novelty, "lambda_novelty", strict=False)
    positive(kappa_clip, "kappa_clip", strict=False)
    choice(score, "score", ("sum", "mean"))
    choice(baseline, "baseline", ("group", "correct"))
    dims = Dims()
    grpo_kwargs = {"scale": scale, "eps": eps, "unbiased": unbiased, "singleton": singleton}
    a, g, v, w, metrics = _base_advantages(rewards, group, advantages, valid, dims, grpo_kwargs)
    s, lengths = _sequence_logp(logp, "logp", dims, mask, v, score, need_lengths=True)
    s = s.to(a.dtype)
    ok = torch.ones_like(a, dtype=torch.bool) if v is None else v
    is_correct = a.detach() > 0
    if correct is not None:
        is_correct = is_correct & as_mask(correct, "correct", dims, "B", device=a.device)
    if v is not None:
        is_correct = is_correct & v
    scored = ok
    if lengths is not None:  # an all-masked response has no likelihood: it stays out of s_bar and gets no bonus
        scored = lengths > 0 if v is None else v & (lengths > 0)
        is_correct = is_correct & scored
    members = scored if baseline == "group" else is_correct
    s_bar = g.broadcast(g.mean(s, members))
    eta = torch.exp((s - s_bar).clamp(max=_MAX_LOG_NOVELTY))
    raw = (lambda_novelty * (1 - eta)).clamp(min=0)
    cap = kappa_clip * a.detach()
    bonus = torch.where(is_correct, torch.minimum(raw, cap), torch.zeros_like(raw))
    # The bonus is a constant added to A: d A+/d A = 1 off the cap, 1 + kappa on it (the min picks kappa * A).
    on_cap = is_correct & (cap < raw)
    adv = a + torch.where(on_cap, kappa_clip * a, bonus)

    n_rows = g.num_rows
    sharpened = bonus > 0
    metrics.update(
        sharpened_frac=_frac(sharpened, n_rows),
        capped_frac=_frac(on_cap & sharpened, n_rows),
        bonus_mean=(bonus.sum() / sharpened.sum().clamp(min=1)).detach(),  # bonus >= 0: 0 unless sharpened
        novelty_mean=((eta * scored).sum() / scored.sum().clamp(min=1)).detach(),
        excluded_frac=_frac(~ok, n_rows),
    )
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
REGISTRY.register(
    "xrpo_sharpen",
    xrpo_sharpen,
    requires=("logp",),
    accepts=("mask", "advantages", "correct", "valid"),
    reference="XRPO arXiv 2510.06672, Eq. (6), the exploitation component (code UIUC-MLSys/XRPO, not checked)",
)
