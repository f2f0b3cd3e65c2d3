"""Divergence-based trust regions: DPPO's divergence masks and the Predictive Divergence Mask.

DPPO (arXiv 2602.04879) replaces PPO's ratio clip by a mask on an estimate of the policy divergence at each
token: a token is dropped when the update pushes the policy *away* from the reference (rollout) policy and the
divergence already exceeds a threshold. The kept tokens get the truncated-IS policy gradient
:math:`-A\\,\\operatorname{sg}(\\min(r, c))\\,\\ell^\\theta`. The Predictive Divergence Mask (arXiv 2607.10848)
keeps DPPO's proximity test and replaces its direction test by the sign of the predicted first-order change of
:math:`KL(\\mu\\|\\pi)` under one policy-gradient step (closed form **reconstructed**, so experimental).

Each method is a pure function plus a frozen config object (a trust stage of
:func:`rolloutopt.losses.policy_loss`); defaults are the papers' code defaults, with the source named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    checks_enabled,
    choice,
    finite,
    positive,
    require_experimental,
)
from rolloutopt.errors import InputError
from rolloutopt.ratios.context import MaskOutput, StageContext, masked_mean
from rolloutopt.ratios.reference import TrustOutput
from rolloutopt.typing import BoolBT, FloatBT, FloatBTb, FloatBTK, PerSeqOrToken

__all__ = [
    "DPPO",
    "DPPO_DEFAULT_DELTA",
    "binary_kl",
    "binary_tv",
    "dppo_loss",
    "dppo_mask",
    "predicted_kl_change",
    "topk_divergence",
]

Divergence = Literal["tv", "kl", "topk_kl", "topk_tv"]
Tail = Literal["aggregate", "uniform"]
Scope = Literal["token", "policy"]
WeightRef = Literal["old", "behav"]

_DIVERGENCES: tuple[str, ...] = ("tv", "kl", "topk_kl", "topk_tv")
_TAILS: tuple[str, ...] = ("aggregate", "uniform")
_SCOPES: tuple[str, ...] = ("token", "policy")
_WEIGHT_REFS: tuple[str, ...] = ("old", "behav")
_WEIGHT_LOG_MAX = 20.0  # Stable-RL compute_policy_loss_with_mask: torch.clamp(log_prob - rollout_log_prob, max=20.0)

# Default thresholds per divergence (low = high). tv / kl: the DPPO authors' verl example
# ``examples/dppo_trainer/run_qwen30b_dppo.sh`` (clip_ratio 0.15 for dppo_tv, 0.05 for dppo_kl);
# topk_tv follows the TV value; topk_kl: 0.15, the value a digest of the follow-up (arXiv 2607.10848) quotes
# for TopK-KL with K = 20 (a top-K partition is finer than the binary one, so its KL is larger).
DPPO_DEFAULT_DELTA: dict[str, float] = {"tv": 0.15, "kl": 0.05, "topk_tv": 0.15, "topk_kl": 0.15}

_MASS_FLOOR = 1e-12  # Stable-RL compute_topk_kl clamps the top-K and rest masses at 1e-12
_BINARY_EPS = 1e-8  # verl / Stable-RL guards in the binary KL: log((1 - p_old + 1e-8) / (1 - p + 1e-8))
_LOGP_FLOOR = -1e4  # exp(-1e4) == 0 in every float dtype; keeps top-K sums finite for any finite input


# ----------------------------------------------------------------------------------------------- divergences


def _probs(logp: Tensor) -> Tensor:
    """Probability of a log-prob, detached; log-probs above 0 (not valid) count as probability 1."""
    return torch.exp(logp.detach().clamp(max=0.0))


def _binary_kl(lp: Tensor, old: Tensor) -> Tensor:
    # verl 0.9.1 compute_policy_loss_dppo_kl, same operations in the same order (exact float64 parity)
    lp = lp.detach().clamp(max=0.0)
    old = old.detach().clamp(max=0.0)
    p, p_old = torch.exp(lp), torch.exp(old)
    return p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + _BINARY_EPS) / (1.0 - p + _BINARY_EPS))


_TopK = tuple[Tensor, Tensor, Tensor, Tensor]


def _topk_probs(topk_logp: Tensor, topk_behav_logp: Tensor) -> _TopK:
    """``(log pi, log mu, pi, mu)`` at the top-K ids, clamped and detached: computed once per call, since the
    ``[B, T, K]`` tensors dominate the cost of the top-K divergences and the predictive mask."""
    lq = topk_logp.detach().clamp(_LOGP_FLOOR, 0.0)  # pi, the trained policy, at the reference ids
    lp = topk_behav_logp.detach().clamp(_LOGP_FLOOR, 0.0)  # mu, the reference (rollout) policy's top-K
    return lq, lp, torch.exp(lq), torch.exp(lp)


def _topk(probs: _TopK, kind: str) -> Tensor:
    lq, lp, q, p = probs
    rest_q = (1.0 - q.sum(-1)).clamp(min=_MASS_FLOOR)
    rest_p = (1.0 - p.sum(-1)).clamp(min=_MASS_FLOOR)
    if kind == "kl":
        return (p * (lp - lq)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())
    return ((p - q).abs().sum(-1) + (rest_p - rest_q).abs()) / 2.0


def binary_tv(logp: FloatBT, old_logp: FloatBT) -> FloatBT:
    r"""Binary total variation between the sampled token's Bernoulli distributions: :math:`|p_\theta - p_{old}|`.

    .. math::  D^{TV}_t = \tfrac12\big(|p_\theta - p_{old}| + |(1-p_\theta) - (1-p_{old})|\big)
               = |p_\theta - p_{old}|, \qquad p = e^{\ell}

    The "Binary" approximation of DPPO (arXiv 2602.04879, §4): the vocabulary is split into the sampled token
    and everything else. Detached (a mask statistic). Log-probs above 0 count as probability 1.

    Args:
        logp: current log-probs of the sampled tokens ``[B, T]``.
        old_logp: the reference policy's log-probs ``[B, T]`` (rollout policy in the paper; see :class:`DPPO`).
    """
    lp, old = _two(logp, old_logp)
    return (_probs(lp) - _probs(old)).abs()


def binary_kl(logp: FloatBT, old_logp: FloatBT) -> FloatBT:
    r"""Binary KL :math:`KL(\mathrm{Bern}(p_{old})\,\|\,\mathrm{Bern}(p_\theta))` of the sampled token.

    .. math::  D^{KL}_t = p_{old}\,(\ell^{old} - \ell^\theta)
               + (1-p_{old})\log\frac{1 - p_{old} + 10^{-8}}{1 - p_\theta + 10^{-8}}

    The 1e-8 guards are verl 0.9.1's and the paper code's (``sail-sg/Stable-RL``), so the value is finite even
    at :math:`p = 1`. Detached; log-probs above 0 count as 0. Reference: DPPO, arXiv 2602.04879.

    Args:
        logp: current log-probs of the sampled tokens ``[B, T]``.
        old_logp: the reference policy's log-probs ``[B, T]``.
    """
    lp, old = _two(logp, old_logp)
    return _binary_kl(lp, old)


def topk_divergence(topk_logp: FloatBTK, topk_behav_logp: FloatBTK, *, kind: Literal["kl", "tv"] = "kl") -> FloatBT:
    r"""Top-K divergence between the reference policy :math:`\mu` and the trained policy :math:`\pi`, tail as one bucket.

    .. math::
        KL = \sum_{k \in \text{top-}K} \mu_k(\log\mu_k - \log\pi_k) + \mu_{rest}\log\frac{\mu_{rest}}{\pi_{rest}},
        \qquad TV = \tfrac12\Big(\sum_{k} |\mu_k - \pi_k| + |\mu_{rest} - \pi_{rest}|\Big)

    with :math:`\mu_{rest} = \max(1 - \sum_k \mu_k, 10^{-12})` (likewise :math:`\pi_{rest}`), exactly as
    ``sail-sg/Stable-RL`` ``verl/workers/actor/utils.py::compute_topk_kl``. Detached. Log-probs are clamped to
    ``[-1e4, 0]`` first (no change for valid log-probs below 0 that matter; keeps the sum finite). With K = V
    (full distributions) both are exact. Reference: DPPO, arXiv 2602.04879 (Top-K approximation).

    Args:
        topk_logp: :math:`\log\pi` at the reference policy's top-K token ids ``[B, T, K]``.
        topk_behav_logp: the reference (rollout) policy's top-K log-probs :math:`\log\mu` ``[B, T, K]``.
        kind: ``"kl"`` or ``"tv"``.
    """
    choice(kind, "kind", ("kl", "tv"))
    dims = Dims()
    q = as_float(topk_logp, "topk_logp", dims, "B T K")
    p = as_float(topk_behav_logp, "topk_behav_logp", dims, "B T K", device=q.device)
    finite(q, "topk_logp")
    finite(p, "topk_behav_logp")
    return _topk(_topk_probs(q, p), kind)


# ----------------------------------------------------------------------------------------------- predictive


def _in_topk(topk_logp: Tensor, logp: Tensor, tol: float) -> Tensor:
    return ((topk_logp.detach() - logp.detach()[..., None]).abs() <= tol).any(-1)


def _predicted_change(
    lp: Tensor,
    old: Tensor,
    probs: _TopK,
    in_topk: Tensor,
    tail: str,
    vocab_size: int | None,
) -> Tensor:
    _, _, q, p = probs  # pi_j and mu_j, j in top-K
    pi_k, mu_k = _probs(lp), _probs(old)  # the sampled token
    head = (q * (p - q)).sum(-1)
    rest_q = (1.0 - q.sum(-1)).clamp(min=0.0)
    rest_p = (1.0 - p.sum(-1)).clamp(min=0.0)
    out = ~in_topk  # the sampled token is in the tail: take it out of the tail and count it exactly
    tail_q = torch.where(out, (rest_q - pi_k).clamp(min=0.0), rest_q)
    tail_p = torch.where(out, (rest_p - mu_k).clamp(min=0.0), rest_p)
    own = torch.where(out, pi_k * (mu_k - pi_k), torch.zeros_like(pi_k))
    tail_sum = tail_q * (tail_p - tail_q)
    if tail == "uniform":
        assert vocab_size is not None
        k = q.shape[-1]
        n = (vocab_size - k) - out.to(lp.dtype)  # tail tokens, the sampled one excluded when it is there
        tail_sum = tail_sum / n.clamp(min=1.0)
    return (pi_k - mu_k) + head + own + tail_sum


def _check_vocab(vocab_size: int | None, tail: str, owner: str) -> None:
    choice(tail, f"{owner}tail", _TAILS)
    if vocab_size is not None and not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool)):
        raise InputError(f"{owner}vocab_size", "an int (the vocabulary size V) or None", repr(vocab_size), "pass V")
    if vocab_size is not None and vocab_size < 2:
        raise InputError(f"{owner}vocab_size", "an int >= 2", repr(vocab_size), "pass the vocabulary size V")
    if tail == "uniform" and vocab_size is None:
        raise InputError(
            f"{owner}vocab_size",
            "the vocabulary size V with tail='uniform' (the tail mass is spread over V - K tokens)",
            "None",
            "pass vocab_size=V, or use tail='aggregate'",
        )


def _check_k(vocab_size: int | None, k: int, name: str) -> None:
    if vocab_size is not None and k > vocab_size:
        raise InputError(
            name, f"at most vocab_size={vocab_size} top-K entries", f"K={k}", "pass vocab_size >= K (or fix K)"
        )


def _require_experimental(experimental: bool, what: str) -> None:
    require_experimental(
        experimental,
        f"{what}: the Predictive Divergence Mask's closed form A·[(π_k − μ_k) + Σ_j π_j(μ_j − π_j)] and its "
        "top-K tail estimators (from digests of arXiv 2607.10848)",
        "docs/methods/dppo.md",
    )


def predicted_kl_change(
    logp: FloatBT,
    old_logp: FloatBT,
    topk_logp: FloatBTK,
    topk_behav_logp: FloatBTK,
    *,
    tail: Tail = "aggregate",
    vocab_size: int | None = None,
    sampled_in_topk: BoolBT | None = None,
    match_tol: float = 1e-5,
    experimental: bool = False,
) -> FloatBT:
    r"""The Predictive Divergence Mask's bracket: first-order change of :math:`KL(\mu\|\pi)` per unit of :math:`A`.

    One policy-gradient step on the sampled token :math:`k` moves a softmax policy's logits by
    :math:`\Delta z_j = \eta A(\mathbb 1\{j = k\} - \pi_j)`; since :math:`\partial KL(\mu\|\pi)/\partial z_j =
    \pi_j - \mu_j`,

    .. math::  \Delta KL = \eta A\,\Big[\underbrace{(\pi_k - \mu_k)}_{\text{local}}
               + \underbrace{\textstyle\sum_j \pi_j(\mu_j - \pi_j)}_{\text{global}}\Big] + O(\eta^2)

    and this function returns the bracket ``[B, T]``. The local term is DPPO's direction test; the global,
    vocabulary-coupled term is the new part. **[reconstructed]** (our derivation from the mechanism three
    digests of arXiv 2607.10848 describe), so ``experimental=True`` is required.

    The sum over the vocabulary is exact when K = V (pass full distributions); with top-K only, the tail
    :math:`\sum_{j \notin \text{top-}K}` is estimated from the tail masses :math:`\pi_t, \mu_t`:
    ``tail="aggregate"`` treats the tail as one token (:math:`\pi_t(\mu_t - \pi_t)`), ``tail="uniform"`` spreads
    it evenly over the :math:`n` tail tokens (:math:`\pi_t(\mu_t - \pi_t)/n`, :math:`n = V - K`, needs
    ``vocab_size``).

    The sampled token's own probabilities are :math:`\pi_k = e^{\ell^\theta}` (``logp``) and
    :math:`\mu_k = e^{\ell^{old}}` (``old_logp``; pass the rollout log-probs for the paper's form). Whether the
    top-K arrays contain it is given by ``sampled_in_topk`` ``[B, T]`` or, when None, detected: some entry of
    ``topk_logp`` within ``match_tol`` of ``logp`` (both are the trained policy's log-probs from one forward
    pass). If it is absent it lies in the tail: its mass is taken out of the tail masses, its term
    :math:`\pi_k(\mu_k - \pi_k)` is added exactly, and the uniform tail counts :math:`V - K - 1` tokens.
    Tail masses are clamped at 0. Detached; finite for every finite input.

    Oracle (our reconstruction, ``docs/methods/dppo.md``): :math:`\pi = [0.1, 0.8, 0.1]`,
    :math:`\mu = [0.05, 0.5, 0.45]`, :math:`k = 0`: local
    +0.05, global −0.21, bracket −0.16, so with A > 0 the KL is predicted to *decrease*.

    Args:
        logp, old_logp: the sampled token's log-probs under :math:`\pi` and :math:`\mu` ``[B, T]``.
        topk_logp: :math:`\log\pi` at the reference top-K ids ``[B, T, K]``.
        topk_behav_logp: :math:`\log\mu` at the same ids ``[B, T, K]``.
        tail: ``"aggregate"`` (default) or ``"uniform"``.
        vocab_size: V, required by ``tail="uniform"``; must be >= K.
        sampled_in_topk: bool ``[B, T]``, whether the sampled token is among the K ids; None detects it.
        match_tol: absolute log-prob tolerance of the detection (default 1e-5).
        experimental: must be True (reconstructed closed form).
    """
    _require_experimental(experimental, "predicted_kl_change")
    _check_vocab(vocab_size, tail, "")
    positive(match_tol, "match_tol", strict=False)
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    old = as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    q = as_float(topk_logp, "topk_logp", dims, "B T K", device=lp.device)
    p = as_float(topk_behav_logp, "topk_behav_logp", dims, "B T K", device=lp.device)
    for x, name in ((lp, "logp"), (old, "old_logp"), (q, "topk_logp"), (p, "topk_behav_logp")):
        finite(x, name)
    _check_k(vocab_size, q.shape[-1], "topk_logp")
    inside = _in_topk(q, lp, match_tol) if sampled_in_topk is None else _sampled(sampled_in_topk, dims, lp.device)
    return _predicted_change(lp, old, _topk_probs(q, p), inside, tail, vocab_size)


def _sampled(x: Any, dims: Dims, device: torch.device) -> Tensor:
    return as_mask(x, "sampled_in_topk", dims, "B T", device=device)


# ----------------------------------------------------------------------------------------------- DPPO mask


@dataclass(frozen=True)
class _Parts:
    """Internal result of :meth:`DPPO._parts`: which tokens the divergence trust region keeps, and why.

    ``keep`` bool ``[B, T]`` (False where masked); ``high`` / ``low`` bool ``[B, T]``, masked on the
    positive- / non-positive-advantage side; ``divergence`` the estimate ``[B, T]``; ``flip`` (predictive only)
    where the predictive direction test disagrees with DPPO's local one on a token past its threshold.
    """

    keep: Tensor
    high: Tensor
    low: Tensor
    divergence: Tensor
    flip: Tensor | None = None


def _check_delta(value: float, name: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and not math.isnan(value)
    if not ok:
        raise InputError(name, "a non-negative threshold (a divergence level)", repr(value), f"set {name} >= 0")


@dataclass(frozen=True)
class DPPO:
    r"""Trust region: DPPO's divergence mask with truncated-IS policy gradient (and the Predictive Divergence Mask).

    .. math::
        L_t = -A_t\,\operatorname{sg}\big(\min(r_t, c)\big)\,M_t\,\ell^\theta_t, \qquad
        r_t = e^{\ell^\theta_t - \ell^{old}_t} \ \big(\text{or } e^{\ell^\theta_t - \ell^{beh}_t}
        \text{ with } \texttt{weight\_ref="behav"}\big),

    :math:`M_t = 0` (token masked) when the update moves *away* from the reference policy and the divergence
    :math:`D_t` already exceeds its threshold:

    .. math::
        M_t = 0 \iff \big(A_t > 0 \wedge D_t > \delta_{high} \wedge p_\theta > p_{old}\big) \vee
                      \big(A_t \le 0 \wedge D_t > \delta_{low} \wedge p_\theta < p_{old}\big)

    with :math:`p = e^\ell` of the sampled token and :math:`D` one of (``divergence``): ``"tv"``
    (:func:`binary_tv`; then the test reads :math:`p_\theta - p_{old} > \delta_{high}` or
    :math:`< -\delta_{low}`), ``"kl"`` (:func:`binary_kl`), ``"topk_kl"`` / ``"topk_tv"``
    (:func:`topk_divergence` from ``topk_logp``/``topk_behav_logp``). As in verl and the paper's code,
    :math:`A = 0` takes the second branch (its loss is 0 anyway; only the metrics see it).

    With ``predictive=True`` (top-K divergences only) the direction test becomes the Predictive Divergence
    Mask's (arXiv 2607.10848): masked when :math:`D_t > \delta` and :math:`A_t\,g_t > 0`, :math:`g` from
    :func:`predicted_kl_change` (``tail``, ``vocab_size``; the sampled token's membership in the top-K from
    ``stage_inputs={"sampled_in_topk": ...}`` or detected within ``match_tol``). **[reconstructed]**:
    ``experimental=True`` required. :math:`\delta = \delta_{high}` for A > 0, :math:`\delta_{low}` otherwise.

    Which policy is "old". The direction test and the binary divergences use the pipeline's ``old_logp``; the
    truncated IS weight uses the policy named by ``weight_ref``. The paper code (``sail-sg/Stable-RL@c6af1d1``
    ``verl/trainer/ppo/core_algos.py``, ``compute_policy_loss_with_mask``) always measures the weight against
    the **rollout** policy, ``min(exp(ℓ^θ − ℓ^{rollout}), c)``, and picks the mask's reference by mode:

    - ``dppo_binary_tv`` / ``dppo_binary_kl`` / ``dppo_topk_*`` (the paper's form): mask against the rollout
      policy too. Pass the rollout engine's log-probs as ``old_logp`` (verl ``bypass_mode``), ``weight_ref="old"``.
    - ``dppo_binary_tv_recompute`` / ``dppo_binary_kl_recompute``: mask against the trainer's recompute, weight
      still against the rollout policy. Pass the recompute as ``old_logp``, the rollout log-probs as
      ``behav_logp`` and ``weight_ref="behav"``.
    - verl 0.9.1's ``dppo_tv``/``dppo_kl`` outside bypass mode measure both against the recompute: pass it as
      ``old_logp`` with ``weight_ref="old"`` (the default).

    With ``weight_ref="behav"`` the log-ratio is clamped at 20 from above only, as Stable-RL does (``exp`` of a
    very negative finite value is 0, never inf), and the ratio passed in is not used. The top-K arrays are
    always the rollout engine's top-K (``topk_behav_logp``) and the trained policy at those ids
    (``topk_logp``).

    Aggregation. Stable-RL's ``seq-mean-token-sum-norm`` (``agg_loss``) divides the token sum by ``L_max``
    only (``loss_scale_factor``, the padded response length by default), not by the number of sequences as
    rolloutopt's (Dr.GRPO's) mode does: ``policy_loss(..., agg="seq-mean-token-sum-norm", max_len=L_max,
    denominators=Denominators(sequences=1))`` reproduces its number.

    Defaults and their sources:

    - ``low``/``high`` None → per divergence (:data:`DPPO_DEFAULT_DELTA`): 0.15 for ``"tv"``, 0.05 for ``"kl"``
      (the DPPO authors' verl example ``examples/dppo_trainer/run_qwen30b_dppo.sh``), 0.15 for ``"topk_tv"``
      (as TV) and ``"topk_kl"`` (a digest of arXiv 2607.10848: K = 20, δ = 0.15). verl reads them from
      ``clip_ratio_low``/``clip_ratio_high``, whose ``ActorConfig`` defaults are 0.2/0.2; prime-rl uses 0.2/0.2.
    - ``c=10.0``: the paper code's fallback (``Stable-RL`` ``compute_policy_loss_with_mask``,
      ``config.get("clip_ratio_c", 10.0)``; the paper, §5.4, recommends a large truncation). verl 0.9.1's
      ``dppo_tv``/``dppo_kl`` fall back to 20, but ``ActorConfig`` defines ``clip_ratio_c = 3.0``, so the
      effective value there is **3.0**: pass ``c=3.0`` for verl parity. The authors' verl example sets 10000
      (truncation off).
    - ``weight_ref="old"``: the weight uses the ratio the ratio stage built against ``old_logp`` (verl's
      ``dppo_tv``/``dppo_kl``, exact parity; the paper's form when ``old_logp`` is the rollout's);
      ``"behav"`` is Stable-RL's ``*_recompute`` (see above).
    - ``scope="token"``: a masked token leaves the loss numerator entirely (``keep=False``, counted in
      ``policy_loss``'s ``masked_frac``, and its KL/entropy terms go too). ``scope="policy"`` zeroes only the
      policy term, as verl does (``keep=None``; KL and entropy terms stay at masked tokens).

    Indicators (masked means over the loss mask): ``dppo_masked_frac`` (verl ``pg_clipfrac``),
    ``dppo_masked_high_frac``, ``dppo_masked_low_frac``, ``dppo_ratio_capped_frac`` (r > c among kept tokens,
    verl's ``pg_clipfrac_lower``), and with ``predictive`` ``dppo_direction_flip_frac``. Metric:
    ``dppo_divergence_mean``. Inputs beyond the common ones (:attr:`requires`, :attr:`accepts`): the two top-K
    tensors for the top-K divergences, ``behav_logp`` with ``weight_ref="behav"``, and
    ``stage_inputs={"sampled_in_topk": ...}`` (optional) with ``predictive=True``.

    Edge cases: ``B = 0``, ``T = 0``, all-masked rows and an empty mask give 0 loss and 0 metrics; A = 0 gives 0
    loss and gradient;
    every finite input gives finite outputs (log-probs above 0 count as probability 1). Reference: DPPO,
    arXiv 2602.04879; verl 0.9.1 ``compute_policy_loss_dppo_tv``/``_kl`` (exact float64 parity with ``c=3``).
    """

    divergence: Divergence = "tv"
    low: float | None = None
    high: float | None = None
    c: float = 10.0
    predictive: bool = False
    tail: Tail = "aggregate"
    vocab_size: int | None = None
    scope: Scope = "token"
    match_tol: float = 1e-5
    experimental: bool = False
    weight_ref: WeightRef = "old"

    @property
    def requires(self) -> tuple[str, ...]:
        """The :func:`~rolloutopt.losses.policy_loss` inputs this stage cannot run without: ``topk_logp`` and
        ``topk_behav_logp`` for the top-K divergences, ``behav_logp`` with ``weight_ref="behav"``."""
        topk = ("topk_logp", "topk_behav_logp") if self.divergence.startswith("topk_") else ()
        return topk + (("behav_logp",) if self.weight_ref == "behav" else ())

    @property
    def accepts(self) -> tuple[str, ...]:
        """Inputs consumed when given: ``stage_inputs={"sampled_in_topk": ...}`` with ``predictive=True``."""
        return ("sampled_in_topk",) if self.predictive else ()

    def __post_init__(self) -> None:
        choice(self.divergence, "DPPO.divergence", _DIVERGENCES)
        choice(self.weight_ref, "DPPO.weight_ref", _WEIGHT_REFS)
        default = DPPO_DEFAULT_DELTA[self.divergence]
        if self.low is None:
            object.__setattr__(self, "low", default)
        if self.high is None:
            object.__setattr__(self, "high", default)
        assert self.low is not None and self.high is not None
        _check_delta(self.low, "DPPO.low")
        _check_delta(self.high, "DPPO.high")
        positive(self.c, "DPPO.c")
        choice(self.scope, "DPPO.scope", _SCOPES)
        positive(self.match_tol, "DPPO.match_tol", strict=False)
        if not isinstance(self.predictive, bool):
            raise InputError("DPPO.predictive", "a bool", repr(self.predictive), "pass True or False")
        _check_vocab(self.vocab_size, self.tail, "DPPO.")
        if self.predictive:
            if not self.divergence.startswith("topk_"):
                raise InputError(
                    "DPPO.predictive",
                    "divergence='topk_kl' or 'topk_tv' with predictive=True (the predictive test needs the top-K "
                    "distributions)",
                    f"divergence={self.divergence!r}",
                    "use DPPO(divergence='topk_kl', predictive=True, experimental=True)",
                )
            _require_experimental(self.experimental, "DPPO(predictive=True)")
        elif self.tail != "aggregate" or self.vocab_size is not None:
            raise InputError(
                "DPPO.tail",
                "the defaults tail='aggregate', vocab_size=None unless predictive=True (they only shape the "
                "predictive tail estimate)",
                f"tail={self.tail!r}, vocab_size={self.vocab_size!r}, predictive=False",
                "set predictive=True, or drop tail/vocab_size",
            )

    def _parts(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        topk_logp: Tensor | None = None,
        topk_behav_logp: Tensor | None = None,
        sampled_in_topk: Tensor | None = None,
    ) -> _Parts:
        """The divergence mask for already validated tensors (see :func:`dppo_mask`)."""
        assert self.low is not None and self.high is not None
        lp, old = logp.detach(), old_logp.detach()
        p, p_old = _probs(lp), _probs(old)
        adv = advantages.detach().expand_as(lp)
        if self.divergence == "tv":
            d = (p - p_old).abs()
        elif self.divergence == "kl":
            d = _binary_kl(lp, old)
        else:
            if topk_logp is None or topk_behav_logp is None:
                raise InputError(
                    "topk_logp" if topk_logp is None else "topk_behav_logp",
                    f"top-K log-probs [B, T, K] for divergence={self.divergence!r}",
                    "None",
                    "pass topk_logp=... and topk_behav_logp=...",
                )
            probs = _topk_probs(topk_logp, topk_behav_logp)
            d = _topk(probs, "kl" if self.divergence == "topk_kl" else "tv")
        pos = adv > 0
        far_high = pos & (d > self.high)
        far_low = ~pos & (d > self.low)
        local_high, local_low = far_high & (p > p_old), far_low & (p < p_old)
        flip = None
        if self.predictive:
            assert topk_logp is not None and topk_behav_logp is not None
            inside = _in_topk(topk_logp, lp, self.match_tol) if sampled_in_topk is None else sampled_in_topk
            g = _predicted_change(lp, old, probs, inside, self.tail, self.vocab_size)
            away = adv * g > 0
            high, low = far_high & away, far_low & away
            flip = (high ^ local_high) | (low ^ local_low)
        else:
            high, low = local_high, local_low
        return _Parts(keep=~(high | low), high=high, low=low, divergence=d, flip=flip)

    def __call__(
        self,
        ratio: FloatBT,
        log_ratio: FloatBT,
        advantages: FloatBTb,
        logp: FloatBT,
        *,
        ctx: StageContext | None = None,
    ) -> TrustOutput:
        """The DPPO loss term ``[B, T]``, its keep mask and indicators (needs ``ctx``; see the class docstring)."""
        if ctx is None:
            raise InputError(
                "ctx",
                "a StageContext (DPPO reads old_logp and, for top-K divergences, topk_logp/topk_behav_logp)",
                "None",
                "call DPPO through rolloutopt.losses.policy_loss(..., trust=DPPO(...)), or pass ctx=StageContext(...)",
            )
        by = f"DPPO(divergence={self.divergence!r})"
        old = ctx.need("old_logp", by)
        if self.weight_ref == "behav":
            behav_logp: Tensor = ctx.need("behav_logp", "DPPO(weight_ref='behav')")
            lp = logp.detach()
            lr_w = torch.where(ctx.mask, lp - behav_logp.detach(), torch.zeros_like(lp))
            ratio = torch.exp(lr_w.clamp(max=_WEIGHT_LOG_MAX))
        topk = behav = sampled = None
        if self.divergence.startswith("topk_"):
            topk = ctx.need("topk_logp", by)
            behav = ctx.need("topk_behav_logp", by)
            _check_k(self.vocab_size, topk.shape[-1], "topk_logp")
            if self.predictive and ctx.extra.get("sampled_in_topk") is not None:
                sampled = as_mask(ctx.extra["sampled_in_topk"], "sampled_in_topk", device=logp.device)
                if checks_enabled() and sampled.shape != logp.shape:
                    raise InputError(
                        "sampled_in_topk",
                        f"a bool tensor of shape {tuple(logp.shape)} ([B, T])",
                        f"shape {tuple(sampled.shape)}",
                        "pass stage_inputs={'sampled_in_topk': mask [B, T]}",
                    )
        m = self._parts(logp, old, advantages, topk, behav, sampled)
        loss = dppo_loss(logp, ratio, advantages, m.keep, c=self.c)
        ind = {
            "dppo_masked_frac": ~m.keep,
            "dppo_masked_high_frac": m.high,
            "dppo_masked_low_frac": m.low,
            "dppo_ratio_capped_frac": (ratio.detach() > self.c) & m.keep,
        }
        if m.flip is not None:
            ind["dppo_direction_flip_frac"] = m.flip
        metrics = {"dppo_divergence_mean": masked_mean(m.divergence, ctx.mask)}
        return TrustOutput(loss, m.keep if self.scope == "token" else None, ind, metrics)


def dppo_mask(
    logp: FloatBT,
    old_logp: FloatBT,
    advantages: PerSeqOrToken,
    *,
    divergence: Divergence = "tv",
    low: float | None = None,
    high: float | None = None,
    topk_logp: FloatBTK | None = None,
    topk_behav_logp: FloatBTK | None = None,
    predictive: bool = False,
    tail: Tail = "aggregate",
    vocab_size: int | None = None,
    sampled_in_topk: BoolBT | None = None,
    match_tol: float = 1e-5,
    experimental: bool = False,
    mask: BoolBT | None = None,
) -> MaskOutput:
    r"""DPPO's divergence mask (and, with ``predictive=True``, the Predictive Divergence Mask) as a pure function.

    .. math::
        \text{masked}_t \iff \big(A_t > 0 \wedge D_t > \delta_{high} \wedge s_t\big) \vee
                              \big(A_t \le 0 \wedge D_t > \delta_{low} \wedge s_t\big)

    where the direction test :math:`s_t` is :math:`\operatorname{sgn}(A_t)(p_\theta - p_{old}) > 0` (DPPO,
    arXiv 2602.04879) or :math:`A_t\,g_t > 0` with :math:`g` from :func:`predicted_kl_change` (predictive,
    **[reconstructed]**, needs ``experimental=True``). Divergences, thresholds and defaults as in :class:`DPPO`
    (``low``/``high`` None take the per-divergence default).

    Args:
        logp, old_logp: sampled-token log-probs of the trained and the reference policy ``[B, T]``.
        advantages: ``[B]`` or ``[B, T]``.
        divergence: ``"tv"``, ``"kl"``, ``"topk_kl"`` or ``"topk_tv"``.
        topk_logp, topk_behav_logp: ``[B, T, K]``, required by the top-K divergences.
        predictive, tail, vocab_size, sampled_in_topk, match_tol, experimental: see :class:`DPPO` and
            :func:`predicted_kl_change`.
        mask: optional bool loss mask ``[B, T]``: ``keep`` is then a subset of it, the metrics are means over
            it and non-finite values outside it are allowed; None counts every position.

    Returns:
        A :class:`~rolloutopt.ratios.MaskOutput`: ``keep`` bool ``[B, T]`` (False where DPPO masks the token),
        and detached 0-d ``metrics`` (means over ``mask``; 0 when it is empty): ``dppo_masked_frac``,
        ``dppo_masked_high_frac`` (A > 0 side), ``dppo_masked_low_frac`` (A ≤ 0 side), ``dppo_divergence_mean``
        and, with ``predictive=True``, ``dppo_direction_flip_frac``. The divergence itself is
        :func:`binary_tv`, :func:`binary_kl` or :func:`topk_divergence`.

    Edge cases: ``B = 0``, ``T = 0`` and an all-False ``mask`` give an empty (or all-False) ``keep`` and zero
    metrics.
    Oracle (by hand, ``sail-sg/Stable-RL`` ``dppo_binary_tv``): δ = 0.15, A > 0, :math:`p_\theta = 0.6`,
    :math:`p_{old} = 0.4` → masked; :math:`p_\theta = 0.3` → kept.
    """
    cfg = DPPO(
        divergence=divergence,
        low=low,
        high=high,
        predictive=predictive,
        tail=tail,
        vocab_size=vocab_size,
        match_tol=match_tol,
        experimental=experimental,
    )
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    old = as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    adv = _advantages(advantages, dims, lp.device)
    m = None if mask is None else as_mask(mask, "mask", dims, "B T", device=lp.device)
    finite(lp, "logp", m)
    finite(old, "old_logp", m)
    finite(adv.expand_as(lp), "advantages", m)
    q = None if topk_logp is None else as_float(topk_logp, "topk_logp", dims, "B T K", device=lp.device)
    p = (
        None
        if topk_behav_logp is None
        else as_float(topk_behav_logp, "topk_behav_logp", dims, "B T K", device=lp.device)
    )
    for x, name in ((q, "topk_logp"), (p, "topk_behav_logp")):
        if x is not None:
            finite(x, name, None if m is None else m[..., None].expand_as(x))
    if q is not None:
        _check_k(vocab_size, q.shape[-1], "topk_logp")
    inside = None if sampled_in_topk is None else _sampled(sampled_in_topk, dims, lp.device)
    if m is not None:  # masked-out positions may hold garbage: neutral values there, so nothing is NaN
        z = torch.zeros_like(lp)
        lp, old, adv = torch.where(m, lp, z), torch.where(m, old, z), torch.where(m, adv.expand_as(lp), z)
        if q is not None and p is not None:
            m3 = m[..., None]
            q, p = torch.where(m3, q, torch.zeros_like(q)), torch.where(m3, p, torch.zeros_like(p))
    parts = cfg._parts(lp, old, adv, q, p, inside)
    at = torch.ones_like(lp, dtype=torch.bool) if m is None else m
    keep = parts.keep & at
    metrics = {
        "dppo_masked_frac": masked_mean(~parts.keep, at),
        "dppo_masked_high_frac": masked_mean(parts.high, at),
        "dppo_masked_low_frac": masked_mean(parts.low, at),
        "dppo_divergence_mean": masked_mean(parts.divergence, at),
    }
    if parts.flip is not None:
        metrics["dppo_direction_flip_frac"] = masked_mean(parts.flip, at)
    return MaskOutput(keep, metrics)


def _advantages(x: Any, dims: Dims, device: torch.device) -> Tensor:
    a = as_float(x, "advantages", device=device)
    if a.ndim == 1:
        dims.check(a, "advantages", "B")
        return a[:, None]
    dims.check(a, "advantages", "B T")
    return a


def dppo_loss(
    logp: FloatBT, ratio: FloatBT, advantages: FloatBTb, keep: BoolBT | None = None, *, c: float = 10.0
) -> FloatBT:
    r"""DPPO's per-token policy loss (to minimise): :math:`-A\,\operatorname{sg}(\min(r, c))\,M\,\ell^\theta`.

    The truncated importance weight :math:`\min(r, c)` is detached, so the gradient is the truncated-IS
    policy gradient :math:`-A \min(r, c) M \nabla\ell^\theta` (DPPO uses truncation instead of PPO's clip and
    dual clip). ``c`` defaults to the paper code's 10 (verl's effective value is 3.0, see :class:`DPPO`).
    ``keep`` (bool ``[B, T]``, the mask :math:`M`) None keeps every token. No validation (hot path): inputs as
    in :class:`DPPO`. Reference: arXiv 2602.04879.

    Args:
        logp: current log-probs ``[B, T]`` (carry the gradient).
        ratio: :math:`r` ``[B, T]`` (detached here).
        advantages: ``[B, 1]`` or ``[B, T]``.
        keep: the mask ``[B, T]`` or None.
        c: truncation level (> 0).
    """
    positive(c, "c")
    w = ratio.detach().clamp(max=c)
    loss = -advantages * w * logp
    if keep is None:
        return loss
    return loss * keep.to(loss.dtype)


def _two(logp: Any, old_logp: Any) -> tuple[Tensor, Tensor]:
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    old = as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    finite(lp, "logp")
    finite(old, "old_logp")
    return lp, old
