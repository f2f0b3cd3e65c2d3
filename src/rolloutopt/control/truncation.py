r"""Confidence- and marker-gated truncation: Step-GRPO, DUET's marker-gated abort, ECHO's branch pruning, DEER.

Four streaming stop rules (:class:`~rolloutopt.control.StopRule`) that decide at token ids the user names
(step or answer markers such as the ids of ``"\n\n"``, ``"Wait"``, ``"Alternatively"``, a closing ``\boxed{}``)
or from a windowed confidence signal, plus the Step-GRPO reward helpers:

- :class:`StepGRPOTruncation` — Step-GRPO's dynamic truncated rollout (arXiv 2604.16890): at a
  step boundary after ``min_steps`` steps the engine probes an answer-forcing suffix and passes the probe's
  confidence; the row stops when it is at least ``threshold``. :func:`step_aware_reward` is the step-aware
  relative reward, :func:`count_steps` the step count it needs.
- :class:`DEER` — DEER-style self-truncation (arXiv 2504.15895): the same probe at transition markers
  ("Wait"-style tokens), with a token warm-up instead of a step count.
- :class:`DUETAbort` — DUET's marker-gated abort with importance reweighting (arXiv 2605.08441).
- :class:`ECHOPruning` — ECHO's online pruning of persistently low-confidence tree branches
  (arXiv 2602.02150).

Provenance (``docs/methods/truncation_rules.md``). Step-GRPO is reconstructed from its abstract and public
summaries; the other three methods are reconstructed here from their abstracts (and, for DUET and ECHO, from
public summaries of the papers). Every one of them is therefore **reconstructed**: each open detail is a
keyword, and every class and :func:`step_aware_reward` refuse to run unless given ``experimental=True``.

The probe itself (appending an answer-forcing suffix and decoding a short answer) is the engine's job: these
rules never see a model. A rule tells the engine which rows to probe (``probe_rows``) and reads the probe's
confidence as the extra per-row input ``confidence``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_float,
    as_index,
    as_mask,
    checks_enabled,
    describe,
    finite,
    require_experimental,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._base import StepInputs, StopResult, StopRule, StopState
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, IntB, IntBT, NumB

__all__ = [
    "DEER",
    "DUETAbort",
    "ECHOPruning",
    "StepGRPOTruncation",
    "StepRewardOutput",
    "count_steps",
    "step_aware_reward",
]

_DOCS = "docs/methods/truncation_rules.md"
_SIGNALS = ("sampled_prob", "exp_neg_entropy", "topk_mean_prob")
_SPANS = ("correct", "all")
_MASK32 = 0xFFFFFFFF


# -- hyper-parameter checks -----------------------------------------------------------------------------------------
def _markers(markers: Any, name: str = "markers") -> tuple[int, ...]:
    if isinstance(markers, Tensor):
        if markers.is_floating_point() or markers.is_complex() or markers.dtype == torch.bool or markers.ndim != 1:
            raise InputError(name, "token ids: a 1-d int tensor or a sequence of ints", describe(markers), "fix it")
        markers = markers.tolist()
    if isinstance(markers, (str, bytes)) or not isinstance(markers, Sequence):
        raise InputError(
            name,
            "a non-empty sequence of token ids (ints)",
            describe(markers),
            f"tokenize the marker strings and pass their ids, e.g. {name}=(271, 14524)",
        )
    ids = tuple(markers)
    if not ids or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise InputError(
            name, "a non-empty sequence of non-negative int token ids", describe(markers), "pass the markers' token ids"
        )
    return tuple(sorted(set(ids)))


def _check_flag(flag: Any, owner: str, what: str, where: str) -> None:
    require_experimental(flag, what, where, argument=f"{owner}experimental" if owner else "experimental")


class _MarkerMixin:
    """Marker token ids as a tensor, cached per device (no host-to-device copy per step)."""

    markers: tuple[int, ...]
    _marker_cache: dict[torch.device, Tensor]

    def _at_marker(self, tokens: Tensor) -> Tensor:
        t = self._marker_cache.get(tokens.device)
        if t is None:
            t = torch.tensor(self.markers, dtype=torch.long, device=tokens.device)
            self._marker_cache[tokens.device] = t
        return torch.isin(tokens, t)


def _row_id(row_id: Any, n: int, device: torch.device) -> Tensor:
    if row_id is None:
        return torch.arange(n, dtype=torch.long, device=device)
    dims = Dims()
    dims.sizes["N"] = (n, "batch_size")
    return as_index(row_id, "row_id", dims, "N").to(device)


# -- a counter-based uniform: u(seed, epoch, row_id), so that decisions follow rows, not batch positions ------------
def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without int64 overflow (the constant split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: Tensor) -> Tensor:
    """The 'lowbias32' integer hash (C. Wellons) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _uniform(seed: int, epoch: int, row_id: Tensor) -> Tensor:
    """Per-row uniforms in [0, 1) that depend only on (seed, epoch, row id): float32 ``[N]``."""
    key = _hash32_int((seed & _MASK32) ^ _hash32_int((seed >> 32) ^ _hash32_int(epoch + 0x9E3779B9)))
    x = _hash32((row_id & _MASK32) ^ key)
    x = _hash32(x ^ ((row_id >> 32) & _MASK32))
    return ((x >> 8).to(torch.float32)) * (1.0 / (1 << 24))


# ========================================================================= probe-gated rules (Step-GRPO, DEER)
class _ProbeGate(_MarkerMixin, StopRule):
    """Shared machinery of the probe-gated rules: count markers, say where to probe, read ``confidence``."""

    requires: ClassVar[tuple[str, ...]] = ("tokens",)
    #: needed at the probe points only (``probe_rows``); ignored elsewhere
    accepts: ClassVar[tuple[str, ...]] = ("confidence",)
    extra_inputs: ClassVar[dict[str, tuple[str, str]]] = {"confidence": ("N", "float")}
    threshold: float

    def _eligible(self, state: StopState, count: Tensor) -> Tensor:
        raise NotImplementedError

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        super()._init(n, device, **inputs)
        z = torch.zeros(n, dtype=torch.long, device=device)
        return {"markers": z, "probes": z.clone()}

    def _probe(self, state: StopState, x: StepInputs) -> tuple[Tensor, Tensor]:
        tokens = x.need("tokens", type(self).__name__)
        at = x.live & self._at_marker(tokens)
        count = state.extra["markers"] + at.long()
        return at & self._eligible(state, count), count

    def probe_rows(self, state: StopState, *, tokens: IntB, active: BoolB | None = None) -> BoolB:
        """Bool ``[N]``: the rows the engine must probe at this step (live, at a marker, past the warm-up).

        Call it with the token ids just sampled, run the answer-forcing probe for those rows, then call
        :meth:`~rolloutopt.control.StopRule.step` with the same ``tokens`` and ``confidence=``. Rows not flagged need no probe (any finite
        ``confidence`` value is ignored for them).
        """
        if not isinstance(state, StopState):
            raise InputError("state", "a StopState from rule.init()", describe(state), "call rule.init(batch_size)")
        x = self._inputs(state, None, None, None, tokens, active, {})
        return self._probe(state, x)[0]

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        probe, count = self._probe(state, x)
        conf = x.extra.get("confidence")
        if conf is None:
            if checks_enabled() and bool(probe.any()):
                raise InputError(
                    "confidence",
                    f"a float tensor [N]: {int(probe.sum())} row(s) are at a probe point this step",
                    "None",
                    "probe the rows rule.probe_rows(...) returns and pass confidence= to step()",
                )
            fire = torch.zeros_like(probe)
        else:
            if checks_enabled():
                bad = probe & ((conf < 0) | (conf > 1))
                if bool(bad.any()):
                    raise InputError(
                        "confidence",
                        "probabilities in [0, 1] at the probed rows (the mean token probability of the probe answer)",
                        f"{describe(conf)} with {int(bad.sum())} value(s) outside [0, 1]",
                        "pass exp(mean log-prob) or the mean of the answer tokens' probabilities",
                    )
            fire = probe & (conf >= self.threshold)
        extra = {"markers": count, "probes": state.extra["probes"] + probe.long()}
        return extra, fire, 1

    def finalize(self, state: StopState) -> StopResult:
        """:meth:`StopRule.finalize` plus ``markers_mean`` and ``probes_mean`` (per row) in the metrics."""
        res = super().finalize(state)
        n = max(state.batch_size, 1)
        metrics = dict(res.metrics)
        metrics["markers_mean"] = (state.extra["markers"].float().sum() / n).detach()
        metrics["probes_mean"] = (state.extra["probes"].float().sum() / n).detach()
        return replace(res, metrics=metrics)


class StepGRPOTruncation(_ProbeGate):
    r"""Step-GRPO's dynamic truncated rollout: stop at a step boundary once a probed answer is confident.

    Reasoning is split into *semantic steps* at marker tokens (reconstructed: ``"\n\n"`` or a marker list such as
    "Wait", "Alternatively", "Let me check"). A row's step count :math:`s` is the number of marker tokens it
    has generated. At a boundary with :math:`s \ge s_{min}` the engine appends an answer-forcing suffix, decodes
    a short answer greedily and passes its confidence

    .. math::
        c = \frac{1}{|a|} \sum_{j=1}^{|a|} p(a_j \mid \text{prefix}, \text{suffix}, a_{<j}),
        \qquad \text{stop (reason "confident") if } c \ge \tau_{conf}.

    ``confidence`` is read only at the probe points — live rows whose token this step is a marker and whose step
    count (this marker included) is at least ``min_steps`` (``probe_rows``); elsewhere it is ignored and
    may be omitted (``None``) on steps with no probe point. The stopped row's kept prefix ends with the marker
    token; the engine then emits the forced answer and EOS (the *truncated variant*). To keep the full rollout
    too (the variant joins the group; the full rollout may also be kept), fork the row before stopping
    it: this rule only decides where the variant is cut.

    Reference: Step-GRPO, arXiv 2604.16890 (ACL 2026). **Reconstructed** (the probe, the confidence and the
    threshold rule are not from the paper text), hence ``experimental=True`` is required.

    Args:
        markers: step-boundary token ids (non-empty; e.g. the ids of ``"\n\n"``, ``"Wait"``, ``"Alternatively"``).
        threshold: :math:`\tau_{conf}` in (0, 1]. Default 0.95 — ours (the paper's value is not known to us).
        min_steps: :math:`s_{min}`, the first step count at which a boundary is probed (>= 1). Default 2 — ours.
        experimental: must be True (see above).

    Inputs of :meth:`~rolloutopt.control.StopRule.step`: ``tokens`` int ``[N]`` (required), ``active`` bool ``[N]``, ``confidence`` float
    ``[N]`` in [0, 1] at the probed rows. Per-row state: ``markers`` (steps so far) and ``probes`` (probes run).
    Methods besides the protocol: ``probe_rows(state, *, tokens, active=None)`` returns the bool ``[N]`` rows to
    probe at this step; ``finalize`` adds ``markers_mean`` and ``probes_mean`` to the metrics.

    Edge cases: an all-inactive batch changes nothing; an empty batch (N = 0) works; a row with no marker
    never stops; rows probed with ``confidence`` below the threshold continue.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "confident")
    reference: ClassVar[str] = "arXiv 2604.16890 (Step-GRPO's dynamic truncated rollout)"
    experimental: ClassVar[str | None] = "the probe, the confidence and the threshold rule are reconstructed"

    def __init__(
        self,
        *,
        markers: Sequence[int] | Int[Tensor, " _"],
        threshold: float = 0.95,
        min_steps: int = 2,
        experimental: bool = False,
    ) -> None:
        _check_flag(experimental, "", "Step-GRPO's dynamic truncated rollout (probe, confidence, threshold)", _DOCS)
        self.markers = _markers(markers)
        _real(threshold, "threshold", 0.0, 1.0, open_low=True)
        _int(min_steps, "min_steps", 1)
        self.threshold = float(threshold)
        self.min_steps = min_steps
        self._marker_cache = {}

    def _eligible(self, state: StopState, count: Tensor) -> Tensor:
        return count >= self.min_steps


class DEER(_ProbeGate):
    r"""Self-truncation by early exit at reasoning-transition markers (DEER-style): exit when a trial answer is confident.

    At a transition marker ("Wait"-style tokens, ids given by the user) of a live row that has generated at least
    ``min_tokens`` tokens, the engine induces a trial answer (e.g. by an answer-forcing suffix) and passes its
    confidence :math:`c` (the mean token probability of the trial answer) as ``confidence``:

    .. math::
        \text{exit (reason "early_exit") if } c \ge \lambda .

    The kept prefix ends with the marker token (``length = position + 1``). Engines that *replace* the marker by
    the answer inducer, as DEER does with "Wait", drop that last token (``length - 1``).

    Reference: "Dynamic Early Exit in Reasoning Models" (DEER), arXiv 2504.15895.
    **Reconstructed** from the abstract ("monitors model behavior at potential reasoning transition points
    (e.g. "Wait" tokens) and dynamically terminates ... when the model exhibits high confidence in a trial
    answer"), hence ``experimental=True`` is required. The confidence definition, the threshold and the warm-up
    are our choices.

    Args:
        markers: transition-marker token ids (non-empty).
        threshold: :math:`\lambda` in (0, 1]. Default 0.95 — ours.
        min_tokens: no probe before the row has generated this many tokens (the marker included). Default 0 — ours.
        experimental: must be True.

    Inputs of :meth:`~rolloutopt.control.StopRule.step`: ``tokens`` int ``[N]`` (required), ``active`` bool ``[N]``, ``confidence`` float
    ``[N]`` in [0, 1] at the probed rows. ``probe_rows(state, *, tokens, active=None)`` returns the bool ``[N]``
    rows to probe at this step; ``finalize`` adds ``markers_mean`` and ``probes_mean`` to the metrics.

    Edge cases: an all-inactive batch changes nothing; N = 0 works; a row without markers never exits.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "early_exit")
    reference: ClassVar[str] = "arXiv 2504.15895 (DEER: Dynamic Early Exit in Reasoning Models)"
    experimental: ClassVar[str | None] = "the early exit is reconstructed from DEER's abstract"

    def __init__(
        self,
        *,
        markers: Sequence[int] | Int[Tensor, " _"],
        threshold: float = 0.95,
        min_tokens: int = 0,
        experimental: bool = False,
    ) -> None:
        _check_flag(
            experimental,
            "",
            "the self-truncation early exit (DEER, from its abstract)",
            "docs/methods/truncation_rules.md",
        )
        self.markers = _markers(markers)
        _real(threshold, "threshold", 0.0, 1.0, open_low=True)
        _int(min_tokens, "min_tokens", 0)
        self.threshold = float(threshold)
        self.min_tokens = min_tokens
        self._marker_cache = {}

    def _eligible(self, state: StopState, count: Tensor) -> Tensor:
        return state.steps + 1 >= self.min_tokens


# =========================================================================================== Step-aware reward
@dataclass(frozen=True)
class StepRewardOutput:
    """Result of :func:`step_aware_reward`.

    ``rewards`` float ``[B]`` (the new rewards), ``penalty`` float ``[B]`` (the subtracted length term
    :math:`\\lambda\\,\\ell_i`, 0 for incorrect rows), ``correct`` bool ``[B]``, ``metrics``: detached 0-d tensors
    (``correct_frac``, ``penalty_mean`` over correct rows, ``penalized_frac``).
    """

    rewards: FloatB
    penalty: FloatB
    correct: BoolB
    metrics: dict[str, Tensor] = field(default_factory=dict)


def step_aware_reward(
    rewards: FloatB,
    steps: NumB,
    group: Groups | IntB,
    *,
    lam: float = 0.5,
    correct_threshold: float = 0.5,
    span: Literal["correct", "all"] = "correct",
    eps: float = 1e-6,
    experimental: bool = False,
) -> StepRewardOutput:
    r"""Step-GRPO's step-aware relative reward: correct responses lose reward for redundant steps, relative to the group.

    .. math::
        r'_i = \begin{cases} r_i - \lambda\,
        \dfrac{s_i - \min_{j \in g,\ \text{correct}} s_j}{\max_{j \in g} s_j - \min_{j \in g,\ \text{correct}} s_j
        + \epsilon} & r_i \ge \rho \ (\text{correct}) \\ r_i & \text{otherwise (no length term)} \end{cases}

    With binary rewards (correct = 1) this is :math:`1 - \lambda(s_i - s^{c}_{min})/(s_{max} -
    s^{c}_{min} + \epsilon)`. A correct response with its group's minimum step count keeps its full reward, the
    maximum of its group; the longest correct one gets :math:`r_i - \lambda` up to
    :math:`\epsilon`.

    Reference: Step-GRPO, arXiv 2604.16890. **Reconstructed** from the abstract and summaries: the formula is
    our reconstruction; whether :math:`\max s` runs over the correct responses or all of them (``span``), the
    correctness threshold and the defaults are our choices, hence ``experimental=True`` is required.

    Args:
        rewards: float ``[B]``, finite.
        steps: ``[B]`` step counts (int or float, finite, >= 0), e.g. from :func:`count_steps`.
        group: int64 ``[B]`` group ids or a :class:`~rolloutopt.groups.Groups`.
        lam: :math:`\lambda >= 0`. Default 0.5 — ours (keeps the longest correct response above a 0-reward
            failure).
        correct_threshold: :math:`\rho`; a response is correct when ``rewards >= correct_threshold``. Default 0.5
            (binary 0/1 or ±1 rewards).
        span: ``"correct"`` (default; :math:`\max` over the group's correct responses, so the term lies in [0, 1))
            or ``"all"`` (over all its responses).
        eps: :math:`\epsilon > 0`. Default 1e-6.
        experimental: must be True.

    Returns:
        :class:`StepRewardOutput`.

    Edge cases: a group without a correct response is unchanged; a singleton group, or a group whose correct
    responses all have the same step count (``span="correct"``), gets no penalty; B = 0 is refused by
    :class:`~rolloutopt.groups.Groups` (no ids).
    """
    _check_flag(experimental, "", "Step-GRPO's step-aware relative reward", _DOCS)
    _real(lam, "lam", 0.0, math.inf)
    if not (isinstance(correct_threshold, (int, float)) and not isinstance(correct_threshold, bool)) or not (
        math.isfinite(float(correct_threshold))
    ):
        raise InputError("correct_threshold", "a finite number", describe(correct_threshold), "e.g. 0.5")
    if span not in _SPANS:
        raise InputError("span", f"one of {_SPANS}", describe(span), "pass span='correct'")
    _real(eps, "eps", 0.0, math.inf, open_low=True)
    dims = Dims()
    r = as_float(rewards, "rewards", dims, "B")
    if checks_enabled() and isinstance(steps, Tensor) and steps.dtype == torch.bool:
        raise InputError("steps", "step counts (int or float) [B]", describe(steps), "pass counts, e.g. count_steps()")
    s_in = steps.float() if isinstance(steps, Tensor) and not steps.is_floating_point() else steps
    s = as_float(s_in, "steps", dims, "B", device=r.device)
    finite(r, "rewards")
    finite(s, "steps")
    if checks_enabled() and bool((s < 0).any()):
        raise InputError("steps", "non-negative step counts", f"{describe(steps)} with negative values", "fix them")
    g = as_groups(group, dims)
    s = s.to(r.dtype)
    correct = r >= correct_threshold
    s_min = g.broadcast(g.min(s, correct))
    s_max = g.broadcast(g.max(s, correct if span == "correct" else None))
    term = (s - s_min) / (s_max - s_min + eps)
    penalty = torch.where(correct, lam * term, torch.zeros_like(term))
    out = r - penalty
    nc = correct.sum()
    metrics = {
        "correct_frac": correct.float().mean(),
        "penalty_mean": penalty.sum() / nc.clamp(min=1).to(penalty.dtype),
        "penalized_frac": (penalty > 0).float().mean(),
    }
    return StepRewardOutput(out, penalty, correct, {k: v.detach() for k, v in metrics.items()})


def count_steps(tokens: IntBT, mask: BoolBT, *, markers: Sequence[int] | Int[Tensor, " _"]) -> IntB:
    r"""Semantic step counts of responses: marker tokens + 1 for a non-empty response, 0 for an empty one.

    .. math::
        s_i = \sum_t m_{i,t}\,[\,y_{i,t} \in \mathcal M\,] + [\,\textstyle\sum_t m_{i,t} > 0\,]

    Step-GRPO (arXiv 2604.16890) measures reasoning in steps split at linguistic markers; counting "markers + 1"
    (a trailing marker also opens a step) is our convention, the same count :class:`StepGRPOTruncation`
    keeps in its ``markers`` state plus one.

    Args:
        tokens: int ``[B, T]`` token ids.
        mask: bool ``[B, T]``, True on response tokens.
        markers: step-marker token ids (non-empty).

    Returns:
        int64 ``[B]``. Edge cases: an all-masked row has 0 steps; B = 0 gives an empty tensor.
    """
    ids = _markers(markers)
    dims = Dims()
    tok = as_index(tokens, "tokens", dims, "B T")
    m = as_mask(mask, "mask", dims, "B T", device=tok.device)
    at = torch.isin(tok, torch.tensor(ids, dtype=torch.long, device=tok.device)) & m
    return at.sum(dim=1) + m.any(dim=1).long()


# ============================================================================================ DUET (2605.08441)
class DUETAbort(_MarkerMixin, StopRule):
    r"""DUET's marker-gated abort: stop after an answer marker; past a horizon without one, abort all but a sample.

    Per row, with answer-marker ids :math:`\mathcal M` (a closing ``\boxed{}``, a closing code fence, an answer
    span), horizon :math:`H`, keep probability :math:`p` and tail :math:`k`:

    - the row stops :math:`k` tokens after its first marker token (reason ``"answered"``; ``answer_tail=None``
      never stops it there);
    - a row that reaches :math:`H` tokens without a marker is gated once: with :math:`u_i \sim U[0, 1)`, it is
      aborted there (reason ``"aborted"``) if :math:`u_i \ge p`, and otherwise continues to EOS as a survivor;
    - the importance weights (:meth:`weights`) make the kept rollouts an unbiased sample of the full-length ones:

    .. math::
        w_i = \begin{cases} 1/p & \text{survived the gate} \\ w_{abort} & \text{aborted} \\ 1 & \text{otherwise}
        \end{cases}, \qquad \mathbb E[w_i f(y_i)] = \mathbb E[f(y_i)] \text{ for } w_{abort} = 0,

    optionally self-normalised per group, :math:`\tilde w_i = w_i\, n_g / \sum_{j \in g} w_j` (0 where
    :math:`\sum_{j \in g} w_j = 0`). Pass them as ``seq_weight`` to :func:`~rolloutopt.losses.policy_loss`.

    Randomness: :math:`u_i` is a counter-based hash of (``seed``, the rule's ``init`` count, the row's
    ``row_id``), drawn at :meth:`~rolloutopt.control.StopRule.init` and kept in the state: no global RNG, identical for a seed, and a row keeps
    its draw when rows are permuted together with their ``row_id`` (default: the row index).

    Reference: DUET, arXiv 2605.08441. **Reconstructed** from the abstract ("a
    marker-gated abort rule with importance reweighting to set when to stop them") and a public summary
    (abort of marker-less tails past a horizon, a kept sample continued to EOS with importance weighting, keep
    probability 0.05, stop shortly after a marker); the exact gate, the weights and the other defaults are ours,
    hence ``experimental=True`` is required.

    Args:
        markers: answer-marker token ids (non-empty).
        horizon: :math:`H >= 1`, tokens after which a marker-less row is gated (the summary's horizon plus grace
            window). Default 4096 — ours.
        keep_prob: :math:`p \in (0, 1]`. Default 0.05 (the public summary of DUET).
        answer_tail: :math:`k >= 0` tokens kept after the first marker before stopping, or None. Default 0 — ours
            (right for closing markers; raise it for opening ones).
        aborted_weight: :math:`w_{abort} \in [0, 1]`. Default 0.0 (aborted rollouts leave the loss; unbiased).
        self_normalize: self-normalise :meth:`weights` per group. Default False.
        seed: int seed of the gate draws. Default 0.
        experimental: must be True.

    Inputs of :meth:`~rolloutopt.control.StopRule.step`: ``tokens`` int ``[N]`` (required), ``active`` bool ``[N]``. :meth:`~rolloutopt.control.StopRule.init` takes an
    optional ``row_id`` int ``[N]`` (stable rollout ids). Cross-batch state (:meth:`state_dict`): the seed and
    the number of ``init`` calls.

    Edge cases: an all-inactive batch changes nothing; N = 0 works; ``keep_prob=1`` never aborts (all weights 1);
    a group whose rows were all aborted gets weights 0 under self-normalisation.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "answered", "aborted")
    requires: ClassVar[tuple[str, ...]] = ("tokens",)
    accepts: ClassVar[tuple[str, ...]] = ("row_id",)
    init_inputs: ClassVar[dict[str, tuple[str, str]]] = {"row_id": ("N", "int")}
    reference: ClassVar[str] = "arXiv 2605.08441 (DUET's marker-gated abort)"
    experimental: ClassVar[str | None] = "the gate, the weights and the defaults are reconstructed from the abstract"

    def __init__(
        self,
        *,
        markers: Sequence[int] | Int[Tensor, " _"],
        horizon: int = 4096,
        keep_prob: float = 0.05,
        answer_tail: int | None = 0,
        aborted_weight: float = 0.0,
        self_normalize: bool = False,
        seed: int = 0,
        experimental: bool = False,
    ) -> None:
        _check_flag(
            experimental,
            "",
            "DUET's marker-gated abort (from the abstract and a summary)",
            "docs/methods/truncation_rules.md",
        )
        self.markers = _markers(markers)
        _int(horizon, "horizon", 1)
        _real(keep_prob, "keep_prob", 0.0, 1.0, open_low=True)
        _int(answer_tail, "answer_tail", 0, none=True)
        _real(aborted_weight, "aborted_weight", 0.0, 1.0)
        if not isinstance(self_normalize, bool):
            raise InputError("self_normalize", "a bool", describe(self_normalize), "pass True or False")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InputError("seed", "an int", describe(seed), "pass e.g. seed=0")
        self.horizon = horizon
        self.keep_prob = float(keep_prob)
        self.answer_tail = answer_tail
        self.aborted_weight = float(aborted_weight)
        self.self_normalize = self_normalize
        self.seed = seed
        self.epoch = 0
        self._marker_cache = {}

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        row_id = _row_id(inputs.pop("row_id", None), n, device)
        super()._init(n, device, **inputs)
        u = _uniform(self.seed, self.epoch, row_id)
        self.epoch += 1
        return {
            "u": u,
            "first_marker": torch.full((n,), -1, dtype=torch.long, device=device),
            "survived": torch.zeros(n, dtype=torch.bool, device=device),
        }

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        tokens = x.need("tokens", "DUETAbort")
        t = state.steps  # index of this step's token
        first = state.extra["first_marker"]
        first = torch.where(x.live & (first < 0) & self._at_marker(tokens), t, first)
        has = first >= 0
        tail = self.answer_tail
        answered = torch.zeros_like(has) if tail is None else x.live & has & (t - first >= tail)
        gate = x.live & ~has & (t + 1 == self.horizon)
        keep = state.extra["u"] < self.keep_prob
        abort = gate & ~keep
        extra = {"u": state.extra["u"], "first_marker": first, "survived": state.extra["survived"] | (gate & keep)}
        return extra, answered | abort, torch.where(answered, 1, 2)

    def weights(self, state: StopState, *, group: Groups | IntB | None = None) -> FloatB:
        r"""Importance weights float32 ``[N]`` for the loss: :math:`1/p` for survivors of the gate,
        ``aborted_weight`` for aborted rows, 1 otherwise; self-normalised per ``group`` when the rule was built
        with ``self_normalize=True`` (then ``group`` int ``[N]`` or :class:`~rolloutopt.groups.Groups` is
        required)."""
        if not isinstance(state, StopState):
            raise InputError("state", "a StopState from rule.init()", describe(state), "pass the state step() returned")
        aborted = state.reason == 2
        one = torch.ones(state.batch_size, dtype=torch.float32, device=state.reason.device)
        w = torch.where(state.extra["survived"], one / self.keep_prob, one)
        w = torch.where(aborted, one * self.aborted_weight, w)
        if not self.self_normalize:
            if group is not None:
                raise InputError("group", "None: self_normalize=False", describe(group), "drop group= or normalise")
            return w
        if group is None:
            raise InputError("group", "group ids [N]: self_normalize=True", "None", "pass group= (one id per row)")
        dims = Dims()
        dims.sizes["B"] = (state.batch_size, "state")
        g = as_groups(group, dims)
        total = g.broadcast(g.sum(w))
        n_g = g.broadcast(g.sizes.to(w.dtype))
        return torch.where(total > 0, w * n_g / total.clamp(min=torch.finfo(w.dtype).tiny), torch.zeros_like(w))

    def finalize(self, state: StopState) -> StopResult:
        """:meth:`StopRule.finalize` plus ``survived_frac`` (rows past the gate) in the metrics."""
        res = super().finalize(state)
        metrics = dict(res.metrics)
        metrics["survived_frac"] = (state.extra["survived"].float().sum() / max(state.batch_size, 1)).detach()
        return replace(res, metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        """``{"seed", "epoch"}``: the seed and how many generations :meth:`~rolloutopt.control.StopRule.init` has started."""
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly."""
        super().load_state_dict(state)
        seed, epoch = state.get("seed"), state.get("epoch")
        if not isinstance(seed, int) or not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise InputError("state", "a dict from DUETAbort.state_dict()", describe(state), "pass that dict")
        self.seed, self.epoch = seed, epoch


# ============================================================================================ ECHO (2602.02150)
class ECHOPruning(StopRule):
    r"""ECHO's online confidence-based pruning: terminate persistently low-confidence branches of a rollout tree.

    Rows are branches; ``group`` (given to :meth:`~rolloutopt.control.StopRule.init`) says which tree each belongs to. Per token a confidence
    :math:`c_t` (``signal``) enters a moving window of the last :math:`W` tokens,

    .. math::
        \bar c_{i,t} = \frac{1}{\min(n_i, W)} \sum_{s = t - \min(n_i, W) + 1}^{t} c_{i,s},
        \qquad c_t \in \{\, p(y_t),\ e^{-H_t},\ \tfrac1k\textstyle\sum_{v \in \mathrm{top}k} p_t(v) \,\},

    and a live branch becomes a candidate when :math:`\bar c < \tau` has held for ``patience`` consecutive tokens
    and it has generated at least ``min_tokens`` tokens. Candidates are terminated (reason ``"low_confidence"``)
    lowest :math:`\bar c` first (ties by ``row_id``) while their tree keeps at least ``min_branches`` branches
    not stopped by this rule (finished and not-yet-started rows count as kept).

    Reference: ECHO (Entropy-Confidence Hybrid GRPO), arXiv 2602.02150.
    **Reconstructed** from the abstract ("online confidence-based pruning to terminate persistently
    low-confidence branches") and a public summary (token confidence as the mean top-k probability, window
    smoothing); the window rule, the persistence test, the floor on branches and all defaults are ours, hence
    ``experimental=True`` is required.

    Args:
        threshold: :math:`\tau`. Default 0.5 — ours, for the default signal. ``"topk_mean_prob"`` is at most
            :math:`1/k`: scale :math:`\tau` with it.
        window: :math:`W >= 1` tokens. Default 32 — ours.
        patience: consecutive low tokens needed (>= 1). Default 1 — ours (the window already smooths).
        min_tokens: warm-up before a branch can be pruned; None means ``window``. Default None.
        min_branches: branches kept per tree (>= 0). Default 1.
        signal: ``"sampled_prob"`` (default; :math:`e^{\log p(y_t)}`, needs ``logp``), ``"exp_neg_entropy"``
            (needs ``entropy``) or ``"topk_mean_prob"`` (the summary's ECHO token confidence; needs
            ``topk_logp``).
        experimental: must be True.

    :meth:`~rolloutopt.control.StopRule.init` takes ``group`` int ``[N]`` (required: tree ids) and an optional ``row_id`` int ``[N]`` (unique
    tie-break keys, default the row index; permuting rows together with their ``group`` and ``row_id`` permutes
    the decisions). Per-row state: the window ``buf`` ``[N, W]``, the low streak ``low``.

    Edge cases: an all-inactive batch changes nothing; N = 0 works; a singleton tree with ``min_branches >= 1``
    is never pruned; ``min_branches=0`` prunes every candidate.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "low_confidence")
    #: for the default ``signal="sampled_prob"``; an instance requires the one standard input its signal reads
    requires: ClassVar[tuple[str, ...]] = ("logp", "group")
    accepts: ClassVar[tuple[str, ...]] = ("row_id",)
    init_inputs: ClassVar[dict[str, tuple[str, str]]] = {"group": ("N", "int"), "row_id": ("N", "int")}
    reference: ClassVar[str] = "arXiv 2602.02150 (ECHO's online confidence-based pruning)"
    experimental: ClassVar[str | None] = "the window rule, the persistence test and the branch floor are reconstructed"

    def __init__(
        self,
        *,
        threshold: float = 0.5,
        window: int = 32,
        patience: int = 1,
        min_tokens: int | None = None,
        min_branches: int = 1,
        signal: Literal["sampled_prob", "exp_neg_entropy", "topk_mean_prob"] = "sampled_prob",
        experimental: bool = False,
    ) -> None:
        _check_flag(
            experimental,
            "",
            "ECHO's confidence-based branch pruning (from the abstract)",
            "docs/methods/truncation_rules.md",
        )
        _real(threshold, "threshold", 0.0, 1.0)
        _int(window, "window", 1)
        _int(patience, "patience", 1)
        _int(min_tokens, "min_tokens", 0, none=True)
        _int(min_branches, "min_branches", 0)
        if signal not in _SIGNALS:
            raise InputError("signal", f"one of {_SIGNALS}", describe(signal), "pass signal='sampled_prob'")
        self.threshold = float(threshold)
        self.window = window
        self.patience = patience
        self.min_tokens = window if min_tokens is None else min_tokens
        self.min_branches = min_branches
        self.signal = signal
        # the one standard input this instance's signal reads, and the tree ids (StopRule checks self.requires)
        signal_input = {"sampled_prob": "logp", "exp_neg_entropy": "entropy", "topk_mean_prob": "topk_logp"}[signal]
        self.__dict__["requires"] = (signal_input, "group")

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        group = inputs.pop("group", None)
        row_id = _row_id(inputs.pop("row_id", None), n, device)
        super()._init(n, device, **inputs)
        if group is None:
            raise InputError("group", "tree ids [N] (int)", "None", "pass init(n, group=tree_id_of_each_row)")
        dims = Dims()
        dims.sizes["N"] = (n, "batch_size")
        gid = as_index(group, "group", dims, "N").to(device)
        tree = Groups(gid).inverse if n > 0 else gid
        order = torch.argsort(row_id, stable=True)
        return {
            "tree": tree,
            "tie_order": order,
            "buf": torch.zeros(n, self.window, dtype=torch.float32, device=device),
            "low": torch.zeros(n, dtype=torch.long, device=device),
            "confidence": torch.ones(n, dtype=torch.float32, device=device),
        }

    def _signal(self, x: StepInputs) -> Tensor:
        name = "ECHOPruning"
        if self.signal == "sampled_prob":
            c = x.need("logp", name).clamp(max=0.0).exp()
        elif self.signal == "exp_neg_entropy":
            c = (-x.need("entropy", name).clamp(min=0.0)).exp()
        else:
            c = x.need("topk_logp", name).clamp(max=0.0).exp().mean(dim=-1)
        return c.float()

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        e = state.extra
        live = x.live
        n = state.batch_size
        c = self._signal(x)
        slot = (state.steps % self.window)[:, None]
        old = e["buf"].gather(1, slot)
        buf = e["buf"].scatter(1, slot, torch.where(live[:, None], c[:, None], old))
        seen = (state.steps + live.long()).clamp(max=self.window)
        mean = torch.where(live, buf.sum(dim=1) / seen.clamp(min=1).to(buf.dtype), e["confidence"])
        low = torch.where(live, torch.where(mean < self.threshold, e["low"] + 1, 0), e["low"])
        cand = live & (low >= self.patience) & (state.steps + 1 >= self.min_tokens)
        # rank the candidates of each tree by (mean, row_id): two stable sorts on top of the row_id order
        tree = e["tree"]
        key = torch.where(cand, mean, torch.full_like(mean, math.inf))
        order = e["tie_order"]
        order = order.index_select(0, torch.argsort(key.index_select(0, order), stable=True))
        order = order.index_select(0, torch.argsort(tree.index_select(0, order), stable=True))
        size = torch.zeros(n, dtype=torch.long, device=tree.device).index_add_(0, tree, torch.ones_like(tree))
        start = torch.cumsum(size, 0) - size
        pos = torch.arange(n, device=tree.device) - start.index_select(0, tree.index_select(0, order))
        rank = torch.empty_like(pos).scatter_(0, order, pos)
        kept = torch.zeros(n, dtype=torch.long, device=tree.device).index_add_(0, tree, (~state.stopped).long())
        allowed = (kept - self.min_branches).clamp(min=0)
        fire = cand & (rank < allowed.index_select(0, tree))
        extra = {"tree": tree, "tie_order": e["tie_order"], "buf": buf, "low": low, "confidence": mean}
        return extra, fire, 1

    def confidence(self, state: StopState) -> FloatB:
        """The current windowed confidence :math:`\\bar c` float32 ``[N]`` (1 before a row's first token)."""
        if not isinstance(state, StopState):
            raise InputError("state", "a StopState from rule.init()", describe(state), "pass the state step() returned")
        return state.extra["confidence"].clone()
