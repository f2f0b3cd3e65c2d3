"""The composed policy objective: ratio → trust region → off-policy correction → regularisers → aggregation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_index,
    as_mask,
    as_seq_or_token,
    check_log_probs,
    checks_enabled,
    choice,
    describe,
    finite,
)
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.losses._metrics import staleness_metrics, weight_metrics
from rolloutopt.losses.aggregation import AGG_MODES, AggMode, Denominators, aggregate_checked, check_max_len
from rolloutopt.losses.regularizers import KL
from rolloutopt.ratios import PPOClip, TokenRatio, TrustOutput
from rolloutopt.ratios.context import (
    CorrectionOutput,
    StageContext,
    as_weights,
    masked_max,
    masked_mean,
    masked_quantiles,
)
from rolloutopt.registry import Registry, check_inputs
from rolloutopt.typing import BoolBT, FloatB, FloatBT, FloatBTb, FloatBTK, IntB, IntBT, PerSeqOrToken, Scalar

__all__ = [
    "ALWAYS_ACCEPTED",
    "OPTIONAL_INPUTS",
    "PRESETS",
    "Correction",
    "CorrectionOutput",
    "LossOutput",
    "ProximalStage",
    "RatioStage",
    "StageContext",
    "TrustStage",
    "declared_inputs",
    "policy_loss",
]

RATIO_QUANTILES = (0.1, 0.5, 0.9)


@dataclass(frozen=True)
class LossOutput:
    """What a policy loss returns.

    Attributes:
        loss: the aggregated scalar to minimise (carries the gradient).
        per_token: the per-token loss ``[B, T]`` before aggregation (0 where a token does not count).
        metrics: detached 0-d tensors (no host synchronisation): ``pg_loss``, ``ratio_mean``, ``ratio_max``,
            ``approx_kl`` (mean of ℓ^old − ℓ^θ, verl's ``ppo_kl``), the trust region's clip fractions,
            ``masked_frac`` (fraction of loss tokens removed by a trust-region or correction mask),
            ``entropy`` and ``kl`` when given.
    """

    loss: Float[Tensor, ""]  # spelled out (not Scalar): FusedLossOutput resolves it in its own module
    per_token: FloatBT
    metrics: dict[str, Tensor] = field(default_factory=dict)


OPTIONAL_INPUTS: tuple[str, ...] = (
    "behav_logp",
    "ref_logp",
    "entropy",
    "versions",
    "policy_version",
    "topk_logp",
    "topk_behav_logp",
    "confidence",
    "group",
    "max_len",
)
"""The optional inputs of :func:`policy_loss` that some stage consumes (besides ``stage_inputs`` keys): each is
accepted only when a configured stage (or the aggregation) declares it."""

ALWAYS_ACCEPTED: tuple[str, ...] = ("seq_weight", "is_weights", "denominators", "entropy")
"""Inputs every configuration consumes: per-sequence weights, precomputed IS weights, global denominators, and
per-token entropies (reported as the ``entropy`` metric; the bonus also needs ``entropy_coef != 0``)."""


@runtime_checkable
class RatioStage(Protocol):
    """A ratio construction: ``log_ratio(logp, old_logp, mask) -> [B, T]`` (e.g. TokenRatio, GSPORatio).

    Every stage kind may declare ``requires`` and ``accepts``: tuples of the :func:`policy_loss` inputs
    (:data:`OPTIONAL_INPUTS`, or ``stage_inputs`` keys) that it cannot run without, or consumes when given. A
    stage that declares nothing consumes nothing beyond ``logp``, ``old_logp``, ``advantages`` and ``mask``.
    """

    def log_ratio(self, logp: FloatBT, old_logp: FloatBT, mask: Bool[Tensor, "B T"]) -> FloatBT: ...


@runtime_checkable
class TrustStage(Protocol):
    """A trust region: ``(ratio, log_ratio, advantages, logp, *, ctx) -> TrustOutput`` (e.g. PPOClip, CISPO).

    ``ctx`` (a :class:`StageContext`) carries the mask, the other log-probs and the optional inputs, for trust
    regions that need batch statistics (M2PO, SAT) or other policies (DPPO, TBPO).
    """

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput: ...


@runtime_checkable
class ProximalStage(Protocol):
    """Builds the proximal log-probs ``[B, T]`` (detached) from the context, when the trainer has none to give.

    Examples: A-3PO's version interpolation, CoPRIS's cross-stage concatenation (:mod:`rolloutopt.ratios`).
    """

    def __call__(self, ctx: StageContext) -> FloatBT: ...


@runtime_checkable
class Correction(Protocol):
    """The off-policy correction slot of :func:`policy_loss` (truncated/masked IS and friends).

    Called with the :class:`StageContext` (validated ``logp``, ``old_logp``, ``behav_logp``, ``mask``,
    advantages and optional inputs); returns a :class:`CorrectionOutput`. Implementations live in
    :mod:`rolloutopt.ratios`. Several corrections compose: their weights multiply and their keep masks AND.
    """

    def __call__(self, ctx: StageContext) -> CorrectionOutput: ...


def _corrections(correction: Correction | Sequence[Correction] | None) -> tuple[Correction, ...]:
    if correction is None:
        return ()
    if isinstance(correction, Sequence):
        parts = tuple(correction)
        for i, c in enumerate(parts):
            if not callable(c):
                raise InputError(
                    f"correction[{i}]", "a Correction (callable on a StageContext)", repr(c), "pass correction stages"
                )
        return parts
    if not callable(correction):
        raise InputError("correction", "a Correction or a sequence of them", repr(correction), "pass e.g. TIS()")
    return (correction,)


def _declared(stage: Any, attr: str) -> tuple[str, ...]:
    value = getattr(stage, attr, ())
    return tuple(value) if isinstance(value, (tuple, list)) else ()


def declared_inputs(
    *,
    ratio: Any = None,
    trust: Any = None,
    correction: Any = None,
    proximal: Any = None,
    kl: Any = None,
    entropy_coef: float = 0.0,
    agg: str = "seq-mean-token-mean",
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The inputs a configuration of :func:`policy_loss` consumes: ``(requires, accepts)``.

    ``requires``: what it cannot run without — each stage's own ``requires``, ``ref_logp`` for a KL stage,
    ``entropy`` when ``entropy_coef != 0``, ``max_len`` for ``agg="seq-mean-token-sum-norm"`` and ``group`` for
    ``agg="prompt-mean"``. ``accepts``: what its stages consume when given (their ``accepts``), plus
    :data:`ALWAYS_ACCEPTED`. Presets derive their ``requires`` and ``accepts`` from this; ``policy_loss``
    refuses an input outside both.
    """
    stages = [ratio, trust, proximal, kl, *_corrections(correction)]
    requires: list[str] = []
    accepts: list[str] = list(ALWAYS_ACCEPTED)
    for stage in stages:
        if stage is None:
            continue
        requires += _declared(stage, "requires")
        accepts += _declared(stage, "accepts")
    if entropy_coef != 0.0:
        requires.append("entropy")
    if agg == "seq-mean-token-sum-norm":
        requires.append("max_len")
    if agg == "prompt-mean":
        requires.append("group")
    req = tuple(dict.fromkeys(requires))
    return req, tuple(n for n in dict.fromkeys(accepts) if n not in req)


def _fix_missing(name: str) -> str:
    if name in OPTIONAL_INPUTS:
        return f"pass {name}=..."
    return f"pass stage_inputs={{{name!r}: ...}} (a custom stage's input)"


PRESETS: Registry[Any] = Registry("loss preset")
"""The loss presets by name (filled by :mod:`rolloutopt.losses.presets`): kept here so that an input refused by
:func:`policy_loss` names the presets that would use it."""


def _users(name: str) -> list[str]:
    return PRESETS.users(name)


def policy_loss(
    logp: FloatBT,
    old_logp: FloatBT | None,
    advantages: PerSeqOrToken,
    mask: BoolBT,
    *,
    behav_logp: FloatBT | None = None,
    ref_logp: FloatBT | None = None,
    entropy: FloatBT | None = None,
    ratio: RatioStage = TokenRatio(),
    trust: TrustStage | None = PPOClip(),
    correction: Correction | Sequence[Correction] | None = None,
    proximal: ProximalStage | None = None,
    is_weights: FloatB | FloatBT | None = None,
    kl: KL | None = None,
    entropy_coef: float = 0.0,
    agg: AggMode = "seq-mean-token-mean",
    denominators: Denominators | None = None,
    group: Groups | IntB | None = None,
    max_len: int | None = None,
    seq_weight: FloatB | None = None,
    removed_in_denominator: bool = True,
    versions: IntBT | None = None,
    policy_version: int | None = None,
    topk_logp: FloatBTK | None = None,
    topk_behav_logp: FloatBTK | None = None,
    confidence: FloatB | None = None,
    stage_inputs: dict[str, Any] | None = None,
    allow_unused: bool = False,
) -> LossOutput:
    r"""Policy-gradient loss composed from stages: ratio, trust region, off-policy correction, KL, entropy.

    .. math::
        \ell_{i,t} = w_{i,t}\, L^{trust}\big(r_{i,t}, A_{i,t}\big) + \beta\, \widehat{KL}_{i,t}
                     - c_H\, H_{i,t}, \qquad \mathcal L = \operatorname{agg}(\ell, m)

    with :math:`r = \exp(\text{ratio.log\_ratio}(\ell^\theta, \ell^{old}))`, :math:`L^{trust}` the trust
    region's per-token term (PPO clip by default; ``trust=None`` gives the plain surrogate :math:`-A r`),
    :math:`w` the product of the correction weight and ``is_weights``, and ``agg`` one of the modes of
    :func:`rolloutopt.losses.aggregate`. References: PPO arXiv 1707.06347, GRPO arXiv 2402.03300, DAPO
    arXiv 2503.14476; the presets in :func:`rolloutopt.losses.get` cite their own.

    The defaults are GRPO's (the ``grpo`` preset): the token ratio, PPO's symmetric clip 0.2 without dual clip,
    and the per-sequence token mean (``seq-mean-token-mean``).

    Inputs are declared, not guessed: each stage declares the optional inputs it consumes
    (:func:`declared_inputs`). A required one that is missing raises an :class:`InputError` naming it; one that
    no configured stage consumes raises too, naming it and the presets that would use it, so that e.g.
    ``behav_logp`` passed to a loss without an off-policy correction is never silently ignored. Trainer
    adapters that always pass everything set ``allow_unused=True`` (unused inputs are then not read).

    Args:
        logp: current policy log-probs of the sampled tokens ``[B, T]`` (carry the gradient).
        old_logp: proximal policy log-probs ``[B, T]``; ``None`` means on-policy (``logp.detach()``, so r ≡ 1
            and only the gradient of the surrogate remains, as in TRL with one iteration).
        advantages: ``[B]`` (broadcast over tokens) or ``[B, T]``.
        mask: loss mask ``[B, T]`` (bool, or 0/1).
        behav_logp: rollout-engine log-probs ``[B, T]``, read by the corrections and the stages that need the
            behaviour policy.
        ref_logp: reference log-probs ``[B, T]``, required by ``kl``.
        entropy: per-token entropy ``[B, T]``, required when ``entropy_coef != 0`` (and reported in metrics).
        ratio: ratio stage (:class:`~rolloutopt.ratios.TokenRatio`, :class:`~rolloutopt.ratios.GSPORatio`).
        trust: trust-region stage (:class:`~rolloutopt.ratios.PPOClip`, :class:`~rolloutopt.ratios.CISPO`,
            :class:`~rolloutopt.ratios.SAPO`) or None.
        correction: off-policy correction stage (:class:`Correction`), a sequence of them (weights multiply,
            keep masks AND; e.g. a rejection filter then truncated IS), or None.
        proximal: a stage that builds the proximal log-probs from the other inputs (A-3PO's interpolation,
            CoPRIS's cross-stage concatenation); then ``old_logp`` is what the stage reads as the trainer's
            recompute (CoPRIS) or may be None (A-3PO).
        is_weights: precomputed, detached importance weights ``[B, T]`` or ``[B]`` multiplied into the policy
            term (verl's ``rollout_is_weights``, TRL's ``importance_sampling_ratio``).
        kl: KL regulariser against ``ref_logp``, or None.
        entropy_coef: entropy bonus coefficient :math:`c_H` (subtracted, so positive values favour entropy).
        agg: aggregation mode; ``denominators``, ``group`` and ``max_len`` as in :func:`aggregate`
            (``group`` is consumed by ``prompt-mean`` only, ``max_len`` by ``seq-mean-token-sum-norm`` only).
        seq_weight: per-sequence weight ``[B]`` (``AdvantageOutput.weight``); a rollout with weight 0 leaves
            the loss and its denominators.
        removed_in_denominator: whether tokens removed by a trust-region or correction mask stay in the
            denominator (True, TRL: a mask does not inflate the other tokens' gradients) or leave it
            (False, verl's folding of rejection masks into the response mask).
        versions: policy version that generated each token, int ``[B, T]`` (CoPRIS, A-3PO; staleness metrics).
        policy_version: version of the policy being trained (A-3PO; staleness is measured against it, or
            against the newest version in ``versions`` when None).
        topk_logp, topk_behav_logp: ``[B, T, K]`` current and rollout-engine log-probs at the rollout
            engine's top-K token ids (DPPO's top-K divergences and the predictive mask).
        confidence: per-sequence confidence ``[B]`` in [0, 1] (ECHO's confidence-adaptive clip).
        stage_inputs: further named inputs for custom stages (``StageContext.extra``); each key must be
            declared by a stage's ``requires`` or ``accepts``.
        allow_unused: let inputs that no configured stage consumes pass without being read (for trainer
            adapters that always pass everything); missing required inputs still raise.

    Metrics (besides the trust region's and corrections' own): ``pg_loss``, ``ratio_mean``, ``ratio_max``,
    ``ratio_q10/q50/q90`` (lower order statistics over loss tokens; over an even stride of at most 16,384
    positions in larger batches), ``log_ratio_max`` (max |log r|),
    ``approx_kl``, ``masked_frac``; ``is_weight_mean``, ``is_weight_max`` and ``is_ess`` (effective sample
    size fraction :math:`(\sum w)^2 / (N \sum w^2)`, verl's ``1/mean((w/mean w)^2)``) when a correction or
    ``is_weights`` applies; ``staleness_mean``/``staleness_max`` (versions behind) when ``versions`` is read.

    Dtypes: inputs may be bf16, fp16, fp32 or fp64; the arithmetic and the results are fp32, or fp64 when
    every floating input is fp64 (for gradcheck).

    Edge cases: all-masked rows contribute nothing and leave sequence denominators; an empty batch gives
    loss 0; log-ratios are clamped so every finite input gives a finite loss. With checks on (the default),
    non-finite values at masked-in positions raise, and so do log-probs (``logp``, ``old_logp``,
    ``behav_logp``, ``ref_logp``) above 0.01 at masked-in positions (probabilities passed for log-probs; the
    margin absorbs the rounding of a low-precision log-softmax). Validation reads tensor values, so under
    ``torch.compile`` wrap the call in ``rolloutopt.checks(False)`` (an :class:`InputError` says so).
    """
    if not isinstance(entropy_coef, (int, float)) or isinstance(entropy_coef, bool) or not math.isfinite(entropy_coef):
        raise InputError(
            "entropy_coef", "a finite number", repr(entropy_coef), "pass a float (0.0 turns the bonus off)"
        )
    choice(agg, "agg", AGG_MODES)
    if not isinstance(allow_unused, bool):
        raise InputError("allow_unused", "a bool", repr(allow_unused), "pass allow_unused=True or False")
    if stage_inputs is not None and not isinstance(stage_inputs, dict):
        raise InputError("stage_inputs", "a dict of named inputs", repr(stage_inputs), "pass stage_inputs={...}")
    corrections = _corrections(correction)
    requires, accepts = declared_inputs(
        ratio=ratio, trust=trust, correction=corrections, proximal=proximal, kl=kl, entropy_coef=entropy_coef, agg=agg
    )
    given = {
        "behav_logp": behav_logp,
        "ref_logp": ref_logp,
        "entropy": entropy,
        "versions": versions,
        "policy_version": policy_version,
        "topk_logp": topk_logp,
        "topk_behav_logp": topk_behav_logp,
        "confidence": confidence,
        "group": group,
        "max_len": max_len,
        **(stage_inputs or {}),
    }
    check_inputs(given, requires=requires, accepts=accepts, by=_describe_config(trust, corrections), users=_users,
                 kind="preset", fix_missing=_fix_missing, allow_unused=allow_unused)  # fmt: skip
    used = set(requires) | set(accepts)

    def read(name: str, value: Any) -> Any:
        return value if name in used else None

    behav_logp, ref_logp, entropy = read("behav_logp", behav_logp), read("ref_logp", ref_logp), read("entropy", entropy)
    versions, policy_version = read("versions", versions), read("policy_version", policy_version)
    topk_logp, topk_behav_logp = read("topk_logp", topk_logp), read("topk_behav_logp", topk_behav_logp)
    confidence, group, max_len = read("confidence", confidence), read("group", group), read("max_len", max_len)
    extra = {k: v for k, v in (stage_inputs or {}).items() if k in used}

    dims = Dims()
    _order_hint(advantages, mask)
    lp = as_float(logp, "logp", dims, "B T")
    old = None if old_logp is None else as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    adv = as_seq_or_token(advantages, "advantages", dims, device=lp.device)
    m = as_mask(mask, "mask", dims, "B T", device=lp.device)
    behav = None if behav_logp is None else as_float(behav_logp, "behav_logp", dims, "B T", device=lp.device)
    ref = None if ref_logp is None else as_float(ref_logp, "ref_logp", dims, "B T", device=lp.device)
    ent = None if entropy is None else as_float(entropy, "entropy", dims, "B T", device=lp.device)
    tk = _topk(topk_logp, "topk_logp", dims, lp.device)
    tkb = _topk(topk_behav_logp, "topk_behav_logp", dims, lp.device)
    conf = None if confidence is None else _confidence(confidence, dims, lp.device)
    ver = None if versions is None else as_index(versions, "versions", dims, "B T", device=lp.device)
    sw = None if seq_weight is None else as_float(seq_weight, "seq_weight", dims, "B", device=lp.device)
    isw = None if is_weights is None else as_seq_or_token(is_weights, "is_weights", dims, device=lp.device)
    groups = None if group is None else as_groups(group, dims)
    if max_len is not None:
        check_max_len(max_len)
    if checks_enabled():
        for x, name in ((lp, "logp"), (old, "old_logp"), (behav, "behav_logp"), (ref, "ref_logp")):
            if x is not None:
                check_log_probs(x, name, m)
        seq_m = m.any(-1)
        for x, raw, name in (
            (adv, advantages, "advantages"),
            (isw, is_weights, "is_weights"),
            (ent, entropy, "entropy"),
        ):
            if x is not None:  # a per-sequence [B] input is checked (and reported) in its own shape
                finite(x[:, 0], name, seq_m) if getattr(raw, "ndim", 2) == 1 else finite(x, name, m)
        for x, name in ((tk, "topk_logp"), (tkb, "topk_behav_logp")):
            if x is not None:
                finite(x, name, m[..., None].expand_as(x))
        if sw is not None:
            finite(sw, "seq_weight")

    # One compute dtype: fp64 only when every floating input is fp64 (gradcheck), fp32 otherwise.
    floats = [t for t in (lp, old, adv, behav, ref, ent, tk, tkb, conf, sw, isw) if t is not None]
    dtype = torch.float64 if all(t.dtype == torch.float64 for t in floats) else torch.float32
    lp, adv = lp.to(dtype), adv.to(dtype)
    old, behav, ref, ent, tk, tkb, conf, sw, isw = (
        None if t is None else t.to(dtype) for t in (old, behav, ref, ent, tk, tkb, conf, sw, isw)
    )
    # Padding may hold garbage (inf, NaN) in any input; this select makes the gradient at masked-out positions
    # exactly 0, so a non-finite local derivative there (0 * inf) cannot reach the caller's logp.
    lp = torch.where(m, lp, torch.zeros_like(lp))
    old_t = lp.detach() if old is None else old
    ctx = StageContext(
        logp=lp,
        old_logp=None if (old is None and proximal is not None) else old_t,
        mask=m,
        advantages=adv,
        behav_logp=behav,
        versions=ver,
        policy_version=_version(policy_version),
        topk_logp=tk,
        topk_behav_logp=tkb,
        confidence=conf,
        extra=extra,
    )
    if proximal is not None:
        old_t = proximal(ctx).detach()
        ctx = replace(ctx, old_logp=old_t)

    log_r = ratio.log_ratio(lp, old_t, m)
    r = torch.exp(log_r)
    out = TrustOutput(-adv * r, None, {}) if trust is None else trust(r, log_r, adv, lp, ctx=ctx)
    if not isinstance(out, TrustOutput):
        raise InputError("trust", "a trust stage returning a TrustOutput", type(out).__name__, "return TrustOutput")
    pg = out.loss
    keep = out.keep
    corr_metrics: dict[str, Tensor] = {}
    weight: Tensor | None = None
    for corr in corrections:
        c = corr(ctx)
        weight = c.weight if weight is None else weight * c.weight
        keep = c.keep if keep is None else (keep if c.keep is None else keep & c.keep)
        corr_metrics.update(c.metrics)
    if isw is not None:
        weight = isw if weight is None else weight * isw
    if weight is not None:
        weight = weight.detach()
        pg = pg * weight

    total = pg
    if kl is not None:
        assert ref is not None  # required by the KL stage's declaration
        kl_tok = kl.per_token(lp, ref, m)
        total = total + kl.coef * kl_tok
    if entropy_coef != 0.0:
        assert ent is not None  # required when entropy_coef != 0
        total = total - entropy_coef * ent

    regularised = total is not pg
    a = aggregate_terms(
        total, pg, m, keep, agg=agg, seq_weight=sw, removed_in_denominator=removed_in_denominator,
        denominators=denominators, groups=groups, max_len=max_len,
    )  # fmt: skip
    loss, per_token, pg, loss_mask, kept = a.loss, a.per_token, a.pg, a.loss_mask, a.kept

    # Metrics: one float mask for every masked mean (a bool mask is converted once, not per metric), and the
    # policy-term loss is the loss itself when no regulariser was added.
    n_tok = m.sum()
    count = n_tok.clamp(min=1).to(dtype)
    mf = as_weights(m, dtype)
    rd = r.detach()
    lrd = log_r.detach()
    pg_metric = (
        aggregate_checked(torch.where(loss_mask, pg.detach(), torch.zeros_like(pg)), a.denominator_mask, agg,
                          denominators, groups, max_len)
        if regularised
        else loss.detach()
    )  # fmt: skip
    metrics: dict[str, Tensor] = {
        "pg_loss": pg_metric.detach(),
        "ratio_mean": masked_mean(rd, mf, count),
        "ratio_max": masked_max(rd, mf),
        "log_ratio_max": masked_max(lrd.abs(), mf),
        "approx_kl": -masked_mean(lrd, mf, count),
        "masked_frac": (n_tok - kept.sum()).to(dtype) / count if keep is not None else torch.zeros_like(count),
    }
    for q, v in zip(RATIO_QUANTILES, masked_quantiles(rd, m, RATIO_QUANTILES), strict=True):
        metrics[f"ratio_q{round(q * 100)}"] = v
    for name, ind in out.indicators.items():
        metrics[name] = masked_mean(ind, mf, count)
    metrics.update({k: v.detach() for k, v in out.metrics.items()})
    if weight is not None:
        metrics.update(weight_metrics(weight.expand_as(lp), mf))
    if ctx.versions is not None:
        metrics.update(staleness_metrics(ctx.versions, m, ctx.policy_version))
    metrics.update(corr_metrics)
    if ent is not None:
        metrics["entropy"] = masked_mean(ent.detach(), mf, count)
    if kl is not None:
        metrics["kl"] = masked_mean(kl_tok.detach(), mf, count)
    return LossOutput(loss=loss, per_token=per_token, metrics=metrics)


def _describe_config(trust: Any, corrections: tuple[Any, ...]) -> str:
    parts = [type(trust).__name__ if trust is not None else "the plain surrogate"]
    parts += [type(c).__name__ for c in corrections]
    return f"policy_loss with {' + '.join(parts)}"


def _order_hint(advantages: Any, mask: Any) -> None:
    """Name the argument order when ``advantages`` and ``mask`` look swapped (a bool where a float belongs)."""
    if not checks_enabled() or not isinstance(advantages, Tensor) or not isinstance(mask, Tensor):
        return
    if advantages.dtype == torch.bool or (mask.is_floating_point() and advantages.ndim == 2 and mask.ndim == 1):
        raise InputError(
            "advantages",
            "float advantages [B] or [B, T] as the third argument and the bool mask as the fourth",
            f"advantages {describe(advantages)} and mask {describe(mask)}",
            "call policy_loss(logp, old_logp, advantages, mask, ...): the arguments look swapped",
        )


@dataclass(frozen=True)
class AggregatedTerms:
    """What :func:`aggregate_terms` returns: the loss, the per-token loss, the weighted policy term, the loss mask
    (after sequence weights), the kept mask (before them) and the denominator mask."""

    loss: Scalar
    per_token: FloatBT
    pg: FloatBT
    loss_mask: Bool[Tensor, "B T"]
    kept: Bool[Tensor, "B T"]
    denominator_mask: Bool[Tensor, "B T"]


def aggregate_terms(
    total: FloatBT,
    pg: FloatBT,
    mask: Bool[Tensor, "B T"],
    keep: Bool[Tensor, "B T"] | None,
    *,
    agg: str,
    seq_weight: FloatB | None,
    removed_in_denominator: bool,
    denominators: Denominators | None,
    groups: Groups | None,
    max_len: int | None,
) -> AggregatedTerms:
    """The last stage of a policy loss on validated inputs, shared by :func:`policy_loss` and the fused loss:
    the loss mask (``mask`` and the stages' ``keep``; removed tokens stay in the denominator with
    ``removed_in_denominator``), the per-sequence weights ``seq_weight [B]`` (a weight-0 sequence leaves the
    numerator and every denominator), and the aggregation with explicit denominators. No validation."""
    loss_mask = mask if keep is None else mask & keep
    denom_mask = mask if removed_in_denominator else loss_mask
    kept = loss_mask  # before seq_weight: masked_frac reports trust-region and correction masks only
    if seq_weight is not None:
        total = total * seq_weight[:, None].to(total.dtype)
        pg = pg * seq_weight[:, None].to(pg.dtype)
        carries = (seq_weight != 0)[:, None]
        loss_mask = loss_mask & carries
        denom_mask = denom_mask & carries
    per_token = torch.where(loss_mask, total, torch.zeros_like(total))
    loss = aggregate_checked(per_token, denom_mask, agg, denominators, groups, max_len)
    return AggregatedTerms(loss, per_token, pg, loss_mask, kept, denom_mask)


def _version(v: Any) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise InputError("policy_version", "an int (the trained policy's version)", repr(v), "pass e.g. step")
    return v


def _topk(x: Any, name: str, dims: Dims, device: torch.device) -> Tensor | None:
    return None if x is None else as_float(x, name, dims, "B T K", device=device)


def _confidence(x: Any, dims: Dims, device: torch.device) -> Tensor:
    c = as_float(x, "confidence", dims, "B", device=device)
    finite(c, "confidence")
    if checks_enabled() and bool(((c < 0) | (c > 1)).any()):
        raise InputError("confidence", "values in [0, 1]", f"min {float(c.min())}, max {float(c.max())}", "rescale it")
    return c
