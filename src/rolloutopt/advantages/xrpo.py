"""XRPO's novelty-aware advantage sharpening (arXiv 2510.06672): unlikely successes are rewarded more.

:func:`xrpo_sharpen` takes a base advantage (GRPO by default, or precomputed advantages) and makes *unlikely
successes* more positive, using the policy's length-normalised log-likelihood relative to the other rollouts of
the same prompt. The likelihood statistic is computed at advantage time and treated as a constant (detached).
Sequence log-probabilities may be passed per token ``[B, T]`` with a ``mask`` or per sequence ``[B]``.
"""

from __future__ import annotations

from typing import Literal

import torch

from rolloutopt._validation import (
    Dims,
    as_mask,
    choice,
    positive,
)
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.likelihood import Reduce, _base_advantages, _frac, _sequence_logp
from rolloutopt.groups import Groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, FloatBT, IntB

__all__ = ["xrpo_sharpen"]


_MAX_LOG_NOVELTY = 60.0  # exp(60) ~ 1e26: finite in fp32, and far past the point where the bonus is 0


def xrpo_sharpen(
    rewards: FloatB | None,
    group: Groups | IntB,
    logp: FloatB | FloatBT,
    *,
    mask: BoolBT | None = None,
    advantages: FloatB | None = None,
    lambda_novelty: float = 2.5,
    kappa_clip: float = 0.5,
    score: Reduce = "mean",
    baseline: Literal["group", "correct"] = "group",
    correct: BoolB | None = None,
    scale: Literal["group", "batch"] | None = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
    singleton: Literal["zero", "raw"] | None = None,
    valid: BoolB | None = None,
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
    "xrpo_sharpen",
    xrpo_sharpen,
    requires=("logp",),
    accepts=("mask", "advantages", "correct", "valid"),
    reference="XRPO arXiv 2510.06672, Eq. (6), the exploitation component (code UIUC-MLSys/XRPO, not checked)",
)
