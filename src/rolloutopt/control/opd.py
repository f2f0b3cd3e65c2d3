"""On-policy-distillation (OPD) horizon rules: Prune-OPD, Stable-OPD, ADWIN, ESR, POPD/TOPD
(``docs/methods/opd_horizon.md``).

In OPD the student samples a rollout and the teacher scores every token (a dense per-token reverse-KL reward), so
the question is not *whether* a rollout succeeded but *how much of it* still carries a useful teacher signal. The
rules here decide how long student rollouts run:

- :class:`PruneOPD` (streaming :class:`~rolloutopt.control.StopRule`): student/teacher top-k overlap, drift
  detection, monotone down-weighting of later teacher rewards (:meth:`PruneOPD.token_weights`) and truncation;
  :class:`PruneOPDWindow` grows the max length while compatibility stays high;
- :class:`StableOPD` (batch-level monitor): truncation-collapse and repetition monitor that raises the
  reference-KL coefficient and asks for a rollout mixture; :func:`repeated_ngram_share` is its repetition score;
- :class:`ADWINHorizon`: horizon controller audited by delayed full-rollout probes, with staleness control;
  :func:`kl_sign_alignment` and :func:`gradient_cosine` are its alignment measures (not the ADWIN concept-drift
  detector, which shares the name);
- :class:`ESR` (streaming): a fixed prefix of N = 100 tokens, and :func:`esr_mask` for the loss;
- :func:`popd_horizon` and :func:`topd_horizon`: short-to-long horizon schedules.

Most of Prune-OPD, Stable-OPD, ADWIN and the POPD schedule are known only from abstracts: every reconstructed
detail is a keyword, and the classes and functions that rest on them require ``experimental=True``. ESR
(N = 100) and TOPD (10% of the horizon) come from the abstracts and summaries and need no flag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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
from rolloutopt.typing import BoolB, BoolBT, FloatAny, FloatB, FloatBT, IntB, IntBT, Scalar

__all__ = [
    "ESR",
    "ADWINHorizon",
    "PruneOPD",
    "PruneOPDWindow",
    "StableOPD",
    "StableOPDDecision",
    "esr_mask",
    "gradient_cosine",
    "kl_sign_alignment",
    "popd_horizon",
    "repeated_ngram_share",
    "topd_horizon",
]

_DOCS = "docs/methods/opd_horizon.md"


# -- hyper-parameter checks ---------------------------------------------------------------------------------------
def _round(x: float) -> int:
    """Round half up (``floor(x + 0.5)``): the horizon schedules' rounding."""
    return math.floor(x + 0.5)


def _experimental(flag: Any, what: str) -> None:
    require_experimental(flag, what, _DOCS)


# ======================================================================================================= Prune-OPD
class PruneOPD(StopRule):
    r"""Prune-OPD [reconstructed]: truncate a student rollout once its top-k overlap with the teacher drifts.

    .. math::
        o_t = \frac{|\mathrm{TopK}_s(t) \cap \mathrm{TopK}_t(t)|}{k}, \qquad
        \bar o_t = \frac{1}{\min(t+1, W)} \sum_{j=\max(0, t-W+1)}^{t} o_j, \\
        d = \min\{t : \bar o_{t-m+1}, \dots, \bar o_t < \tau_{drift}\}, \qquad
        w_t = \begin{cases} 1 & t < d \\ \rho^{\,t-d+1} & t \ge d \end{cases}, \\
        \text{stop at } t \text{ if } w_t < w_{min} \ \text{or}\ o_t < \tau_{hard}
        \quad(\text{decided at chunk boundaries } (t+1) \bmod C = 0)

    The overlap is smoothed by a moving average over the last ``window`` tokens (a ring buffer ``[N, W]`` in
    ``StopState.extra``; the first tokens average what is there). A *drift event* is ``m`` consecutive tokens with
    a smoothed overlap below ``tau_drift``; from the token that completes it on, every token's weight is the last
    one times ``rho``, so weights never rise again. A row stops when its weight falls below ``w_min`` (reason
    ``"low_weight"``) or at a *hard drift*, one token whose raw overlap is below ``tau_hard`` (reason
    ``"hard_drift"``, which wins when both hold). With ``chunk = C > 1`` the teacher scores C tokens at a time, so
    a decision falls only on a row's C-th, 2C-th, ... token; a hard drift inside a chunk stops the row at the end
    of that chunk. :meth:`token_weights` gives the per-token loss weights ``[N, T]`` of the teacher rewards.

    Reference: Prune-OPD, arXiv 2605.07804. The abstract gives the idea (top-k overlap, prefix-drift events,
    monotone down-weighting, truncation, window expansion, 37.6–68.0% less training time); the formulas above,
    the smoothing, and every default except ``k = 8`` (suggested by a summary) are **reconstructed**
    (``docs/methods/opd_horizon.md``), hence ``experimental=True`` is required. The authors' code
    (yangzhch6/Prune-OPD) has not been checked.

    Args:
        k: the overlap width; the first ``k`` columns of each top-k input are used (ids in rank order, distinct
            within a row). Default 8 (summary).
        window: W, the moving-average length [reconstructed; default 8].
        tau_drift: drift threshold on the smoothed overlap [reconstructed; default 0.5].
        m: consecutive low tokens that make a drift event [reconstructed; default 4].
        rho: per-token decay after the drift, in (0, 1) [reconstructed; default 0.9].
        w_min: stop once the weight is below this [reconstructed; default 0.1, i.e. 22 tokens after the drift at
            ``rho = 0.9``].
        tau_hard: hard-drift threshold on the raw overlap [reconstructed; default 0.1: with ``k = 8`` only an
            empty overlap]; 0 disables it.
        chunk: C, decisions every C tokens of a row (default 1: every token).
        experimental: must be True.

    ``step`` input (required): ``overlap``, float ``[N]`` in [0, 1], the overlap :math:`o_t` of this step —
    ``rule.overlap(student_topk, teacher_topk)`` from the two top-k id tensors ``[N, K]``, or the same
    comparison run where both top-k tensors live (e.g. on the engine's GPU). The standard inputs are ignored.

    Edge cases: an all-inactive step changes nothing; an empty batch (N = 0) works; a student identical to its
    teacher (:math:`o_t = 1`) is never stopped and keeps every weight at 1. Inactive rows neither count tokens nor
    change state, so ``t`` is the row's own token counter (``StopState.steps``).
    """

    reason_names = ("running", "low_weight", "hard_drift")
    requires: ClassVar[tuple[str, ...]] = ("overlap",)
    extra_inputs: ClassVar[dict[str, tuple[str, str]]] = {"overlap": ("N", "float")}
    reference: ClassVar[str] = "arXiv 2605.07804 (Prune-OPD)"
    experimental: ClassVar[str | None] = "the drift rule, the smoothing, the weights and the defaults are reconstructed"

    def __init__(
        self,
        *,
        k: int = 8,
        window: int = 8,
        tau_drift: float = 0.5,
        m: int = 4,
        rho: float = 0.9,
        w_min: float = 0.1,
        tau_hard: float = 0.1,
        chunk: int = 1,
        experimental: bool = False,
    ) -> None:
        _experimental(experimental, "PruneOPD (drift rule, smoothing, weights and defaults)")
        self.k = _int(k, "k", 1)
        self.window = _int(window, "window", 1)
        self.tau_drift = _real(tau_drift, "tau_drift", 0.0, 1.0)
        self.m = _int(m, "m", 1)
        self.rho = _real(rho, "rho", 0.0, 1.0, open_low=True, open_high=True)
        self.w_min = _real(w_min, "w_min", 0.0, 1.0)
        self.tau_hard = _real(tau_hard, "tau_hard", 0.0, 1.0)
        self.chunk = _int(chunk, "chunk", 1)

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        super()._init(n, device, **inputs)
        return {
            "overlaps": torch.zeros(n, self.window, device=device),
            "overlap": torch.ones(n, device=device),
            "smoothed": torch.ones(n, device=device),
            "run": torch.zeros(n, dtype=torch.long, device=device),
            "drift_at": torch.full((n,), -1, dtype=torch.long, device=device),
            "hard": torch.zeros(n, dtype=torch.bool, device=device),
            "weight": torch.ones(n, device=device),
        }

    def overlap(self, student_topk: Int[Tensor, "B topk"], teacher_topk: Int[Tensor, "B topk"]) -> FloatB:
        """The top-k overlap :math:`o = |S \\cap T| / k` per row, float32 ``[N]``: the ``overlap`` input of ``step``.

        ``student_topk`` and ``teacher_topk``: int ``[N, K]`` token ids in rank order, distinct within a row,
        ``K >= k``; only the first ``k`` columns are compared (an ``[N, k, k]`` comparison).
        """
        dims = Dims()
        s = as_index(student_topk, "student_topk", dims, "N K")
        t = as_index(teacher_topk, "teacher_topk", dims, "N K").to(s.device)
        if checks_enabled() and s.shape[1] < self.k:
            raise InputError(
                "student_topk", f"[N, K] ids with K >= k = {self.k}", describe(s), f"pass top-{self.k} ids or lower k"
            )
        s, t = s[:, : self.k], t[:, : self.k]
        hits = (s[:, :, None] == t[:, None, :]).flatten(1).sum(-1).clamp(max=self.k)
        return hits.float() / self.k

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        o = x.need("overlap", "PruneOPD").clamp(0.0, 1.0)
        ex, live, pos = state.extra, x.live, state.steps
        col = (pos % self.window)[:, None]
        value = torch.where(live[:, None], o[:, None], ex["overlaps"].gather(1, col))
        overlaps = ex["overlaps"].scatter(1, col, value)
        filled = torch.clamp(pos + 1, max=self.window).float()
        smoothed = overlaps.sum(-1) / filled
        run = torch.where(smoothed < self.tau_drift, ex["run"] + 1, torch.zeros_like(ex["run"]))
        run = torch.where(live, run, ex["run"])
        drift_at = torch.where(live & (ex["drift_at"] < 0) & (run >= self.m), pos, ex["drift_at"])
        decay = torch.full_like(o, self.rho).pow((pos - drift_at + 1).clamp(min=0).float())
        weight = torch.where(drift_at >= 0, decay, torch.ones_like(decay))
        hard = ex["hard"] | (live & (o < self.tau_hard))
        boundary = (pos + 1) % self.chunk == 0
        low = weight < self.w_min
        fire = boundary & (hard | low)
        extra = {
            "overlaps": overlaps,
            "overlap": torch.where(live, o, ex["overlap"]),
            "smoothed": torch.where(live, smoothed, ex["smoothed"]),
            "run": run,
            "drift_at": drift_at,
            "hard": hard,
            "weight": torch.where(live, weight, ex["weight"]),
        }
        return extra, fire, torch.where(hard, 2, 1)

    def token_weights(self, state: StopState, length: int) -> FloatBT:
        r"""Per-token loss weights ``[N, length]`` of the teacher rewards: :math:`w_t` for kept tokens, 0 after a
        row's stop.

        Non-increasing along every row (1 before the drift, :math:`\rho^{t-d+1}` after it, 0 for the tokens a
        stopped row does not keep). ``t`` indexes the row's generated tokens (``StopState.steps``), the padded
        layout of a right-padded batch; multiply by the loss mask for padding.
        """
        if not isinstance(state, StopState) or "drift_at" not in state.extra:
            raise InputError(
                "state", "a StopState of PruneOPD", describe(state), "pass the state PruneOPD.step returned"
            )
        _int(length, "length", 0)
        d = state.extra["drift_at"][:, None]
        t = torch.arange(length, device=d.device)[None, :]
        decay = torch.full((1, 1), self.rho, device=d.device).pow((t - d + 1).clamp(min=0).float())
        w = torch.where((d >= 0) & (t >= d), decay, torch.ones_like(decay))
        keep = StopResult(state.stopped, state.position, state.steps, state.reason, self.reason_names).keep_mask(length)
        return w * keep


class PruneOPDWindow:
    r"""Prune-OPD's window control [reconstructed]: grow the rollout max length while compatibility stays high.

    .. math::
        \bar\ell_s = \operatorname{mean}_i \ell_{i,s}, \qquad
        \text{if } \bar\ell_s \ge r\,L \text{ for } p \text{ consecutive steps: } L \leftarrow \min(L_{max},
        \lceil g L \rceil)

    :math:`\ell_{i,s}` is the kept length of row ``i`` at training step ``s`` (``StopResult.length``: the
    truncation position + 1 of a truncated row, the generated length otherwise). When the batch's mean kept length
    reaches the current max length ``L`` for ``patience`` steps in a row, almost no rollout was truncated by drift,
    so the window grows (and the streak restarts). Reference: Prune-OPD, arXiv 2605.07804 ("when compatibility
    stays high, the training window is expanded automatically"); the trigger, the growth rule and every default are
    **reconstructed** (``docs/methods/opd_horizon.md``), hence ``experimental=True``.

    Args:
        l0: the initial max length L (required).
        l_max: the cap (required).
        growth: g > 1, the multiplicative growth [reconstructed; default 2].
        patience: p, steps in a row before growing [reconstructed; default 3, "several steps"].
        ratio: r in (0, 1]: the mean kept length must reach ``ratio * L`` [reconstructed; default 1, i.e.
            ">= L"].
        experimental: must be True.

    Called once per training step, not per token: :meth:`observe` (``lengths`` required).

    Edge cases: an empty batch leaves the state unchanged; ``L`` never exceeds ``l_max`` and never shrinks.
    """

    requires: ClassVar[tuple[str, ...]] = ("lengths",)
    reference: ClassVar[str] = "arXiv 2605.07804 (Prune-OPD's window expansion)"
    experimental: ClassVar[str | None] = "the trigger and the growth rule of the window are reconstructed"

    def __init__(
        self,
        *,
        l0: int,
        l_max: int,
        growth: float = 2.0,
        patience: int = 3,
        ratio: float = 1.0,
        experimental: bool = False,
    ) -> None:
        _experimental(experimental, "PruneOPDWindow (trigger and growth rule)")
        self.l0 = _int(l0, "l0", 1)
        self.l_max = _int(l_max, "l_max", l0)
        self.growth = _real(growth, "growth", 1.0, math.inf, open_low=True, open_high=True)
        self.patience = _int(patience, "patience", 1)
        self.ratio = _real(ratio, "ratio", 0.0, 1.0, open_low=True)
        self.length = self.l0
        self.streak = 0
        self.steps = 0

    def observe(self, lengths: IntB | StopResult) -> int:
        """Record one training step's kept lengths (int ``[B]``, or a :class:`StopResult`); return the new L."""
        raw = lengths.length if isinstance(lengths, StopResult) else lengths
        ell = as_index(raw, "lengths", Dims(), "B")
        if checks_enabled() and bool((ell < 0).any()):
            raise InputError("lengths", "non-negative lengths", describe(raw), "pass kept lengths (>= 0)")
        if ell.numel() == 0:
            return self.length
        self.steps += 1
        if float(ell.double().mean()) >= self.ratio * self.length:
            self.streak += 1
            if self.streak >= self.patience:
                self.length = min(self.l_max, math.ceil(self.length * self.growth))
                self.streak = 0
        else:
            self.streak = 0
        return self.length

    def state_dict(self) -> dict[str, Any]:
        """``{"length", "streak", "steps"}`` (plain ints)."""
        return {"length": self.length, "streak": self.streak, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly."""
        try:
            length, streak, steps = int(state["length"]), int(state["streak"]), int(state["steps"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError("state", "a dict from PruneOPDWindow.state_dict()", describe(state), "pass it") from exc
        self.length, self.streak, self.steps = length, streak, steps


# ====================================================================================================== Stable-OPD
def repeated_ngram_share(tokens: IntBT, mask: BoolBT | None = None, *, n: int = 4) -> FloatB:
    r"""Share of repeated n-grams per rollout: the repetition score of Stable-OPD.

    .. math::
        \mathrm{rep}_i = \frac{G_i - |\{\text{distinct } n\text{-grams of row } i\}|}{G_i}

    :math:`G_i` counts the n-grams of row ``i`` whose ``n`` tokens are all masked in; a row without any has score
    0. Exact (``torch.unique`` over ``(row, n-gram)`` tuples, no hashing), vectorised over the batch. Reference:
    Stable-OPD, arXiv 2604.08527 ("repetition saturation"); the 4-gram share is our choice
    (``docs/methods/opd_horizon.md``).

    Args:
        tokens: int ``[B, T]`` token ids.
        mask: bool ``[B, T]`` (default all True).
        n: the n-gram length (default 4).

    Returns:
        float ``[B]`` in ``[0, 1)``. Edge cases: ``T < n``, an empty batch, or an all-masked row give 0.
    """
    _int(n, "n", 1)
    dims = Dims()
    tok = as_index(tokens, "tokens", dims, "B T")
    m = torch.ones_like(tok, dtype=torch.bool) if mask is None else as_mask(mask, "mask", dims, "B T").to(tok.device)
    b, t = tok.shape
    out = torch.zeros(b, device=tok.device)
    if t < n or b == 0:
        return out
    grams = tok.unfold(1, n, 1)  # [B, G, n]
    valid = m.unfold(1, n, 1).all(-1)  # [B, G]
    rows = torch.arange(b, device=tok.device)[:, None, None].expand(b, grams.shape[1], 1)
    keys = torch.cat([rows, grams], dim=-1)[valid]  # [M, n + 1]
    total = valid.sum(-1)
    if keys.shape[0] == 0:
        return out
    distinct = torch.bincount(torch.unique(keys, dim=0)[:, 0], minlength=b)
    return (total - distinct).float() / total.clamp(min=1).float()


@dataclass(frozen=True)
class StableOPDDecision:
    """What :meth:`StableOPD.observe` decided for the next training step.

    ``tripped`` (bool), ``reasons`` (which triggers fired: ``"truncation"``, ``"jump"``, ``"repetition"``),
    ``kl_multiplier`` (multiply the reference-KL coefficient by it), ``mix_ratio`` (fraction of the next batch to
    draw from the reference policy or the teacher; 0 when not tripped), ``truncated_frac`` and ``repetition`` (the
    batch statistics), ``metrics`` (detached 0-d tensors).
    """

    tripped: bool
    reasons: tuple[str, ...]
    kl_multiplier: float
    mix_ratio: float
    truncated_frac: float
    repetition: float
    metrics: dict[str, Tensor] = field(default_factory=dict)


class StableOPD:
    r"""Stable-OPD's length-inflation monitor [reconstructed]: detect truncation collapse, then stabilise.

    .. math::
        f_s = \frac{1}{B}\sum_i \mathbb 1[\text{row } i \text{ hit the max length}], \qquad
        \text{trip}_s = f_s > \tau_{trunc} \ \vee\ f_s - \min_{s-w \le j < s} f_j > \delta
        \ \vee\ \overline{\mathrm{rep}}_s > \tau_{rep}, \\
        \kappa_s = \begin{cases} \min(\kappa_{max}, \kappa_{s-1}\,u) & \text{trip} \\
        \max(1, \kappa_{s-1}\,d) & \text{otherwise} \end{cases}, \qquad
        \text{mix}_s = \text{mix\_ratio} \cdot \mathbb 1[\text{trip}_s]

    A batch-level monitor called once per training step (not a streaming rule). When truncated, max-length
    rollouts start to dominate the batch ("truncation collapse") — more than ``tau_trunc`` of them, or a jump of
    more than ``delta`` over the smallest fraction of the last ``window`` steps — it multiplies the reference-KL
    coefficient by ``kl_up`` (the returned ``kl_multiplier`` is cumulative, capped at ``kl_max``) and asks that a
    fraction ``mix_ratio`` of the next batch come from a reference policy or the teacher (rollout mixture
    distillation). The repetition score (:func:`repeated_ngram_share`, batch mean over rows with an n-gram) is
    reported always and trips the monitor only when ``tau_rep`` is set.

    Reference: Stable-OPD, "Demystifying OPD: Length Inflation and Stabilization", arXiv 2604.08527. The abstract
    names the failure mode and the two fixes (reference-based divergence constraint, rollout mixture); the
    triggers, the schedule and every default are **reconstructed** (the abstract does not give the exact
    schedule), hence ``experimental=True``.

    Args:
        tau_trunc: truncated-fraction threshold [reconstructed; default 0.2].
        delta: jump threshold within the window [reconstructed; default 0.1].
        window: steps of history for the jump [reconstructed; default 5].
        kl_up: KL multiplier growth on a trip, >= 1 [reconstructed; default 2].
        kl_decay: multiplier decay on a quiet step, in (0, 1] [reconstructed; default 1: the raised coefficient
            stays].
        kl_max: cap on the cumulative multiplier [reconstructed; default 16].
        mix_ratio: fraction of the batch mixed in on a trip, in [0, 1] (reconstructed; default 0.25).
        tau_rep: repetition threshold, or None (default) to only report the score.
        ngram: n of the repetition score [reconstructed; default 4].
        experimental: must be True.

    Called once per training step, not per token: :meth:`observe` (``lengths`` and ``truncated`` required,
    ``tokens`` and ``mask`` optional).

    Edge cases: an empty batch has ``truncated_frac = 0`` (it never trips on truncation); the first step has no
    history, so it cannot trip on a jump.
    """

    requires: ClassVar[tuple[str, ...]] = ("lengths", "truncated")
    accepts: ClassVar[tuple[str, ...]] = ("tokens", "mask")
    reference: ClassVar[str] = "arXiv 2604.08527 (Stable-OPD: Demystifying OPD, length inflation and stabilization)"
    experimental: ClassVar[str | None] = "the triggers, the KL schedule and the mixture ratio are reconstructed"

    def __init__(
        self,
        *,
        tau_trunc: float = 0.2,
        delta: float = 0.1,
        window: int = 5,
        kl_up: float = 2.0,
        kl_decay: float = 1.0,
        kl_max: float = 16.0,
        mix_ratio: float = 0.25,
        tau_rep: float | None = None,
        ngram: int = 4,
        experimental: bool = False,
    ) -> None:
        _experimental(experimental, "StableOPD (triggers, KL schedule, mixture ratio)")
        self.tau_trunc = _real(tau_trunc, "tau_trunc", 0.0, 1.0)
        self.delta = _real(delta, "delta", 0.0, 1.0)
        self.window = _int(window, "window", 1)
        self.kl_up = _real(kl_up, "kl_up", 1.0, math.inf, open_high=True)
        self.kl_decay = _real(kl_decay, "kl_decay", 0.0, 1.0, open_low=True)
        self.kl_max = _real(kl_max, "kl_max", 1.0, math.inf, open_high=True)
        self.mix_ratio = _real(mix_ratio, "mix_ratio", 0.0, 1.0)
        self.tau_rep = None if tau_rep is None else _real(tau_rep, "tau_rep", 0.0, 1.0)
        self.ngram = _int(ngram, "ngram", 1)
        self.history: list[float] = []
        self.kl_multiplier = 1.0
        self.steps = 0
        self.trips = 0

    def observe(
        self, lengths: IntB, truncated: BoolB, *, tokens: IntBT | None = None, mask: BoolBT | None = None
    ) -> StableOPDDecision:
        """Record one batch and decide the next step's KL multiplier and mixture ratio.

        Args:
            lengths: int ``[B]`` response lengths (>= 0).
            truncated: bool ``[B]``, True where the rollout hit the max length.
            tokens: int ``[B, T]`` response ids, for the repetition score (optional).
            mask: bool ``[B, T]`` (default ``t < lengths``).

        One host sync (the batch statistics become Python floats): a per-training-step monitor, not a hot path.
        """
        dims = Dims()
        ell = as_index(lengths, "lengths", dims, "B")
        trunc = as_mask(truncated, "truncated", dims, "B")
        if checks_enabled() and bool((ell < 0).any()):
            raise InputError("lengths", "non-negative lengths", describe(lengths), "pass response lengths")
        b = ell.numel()
        frac = float(trunc.sum()) / b if b else 0.0
        rep_t = torch.zeros((), dtype=torch.float32)
        if tokens is not None:
            tok = as_index(tokens, "tokens", dims, "B T")
            if mask is None:
                m = torch.arange(tok.shape[1], device=tok.device)[None, :] < ell.to(tok.device)[:, None]
            else:
                m = as_mask(mask, "mask", dims, "B T").to(tok.device)
            score = repeated_ngram_share(tok, m, n=self.ngram)
            has = m.long().sum(-1) >= self.ngram
            rep_t = (score * has).sum() / has.sum().clamp(min=1)
        elif mask is not None:
            raise InputError("mask", "None when tokens is None", describe(mask), "pass tokens= with mask=")
        rep = float(rep_t)
        reasons: list[str] = []
        if frac > self.tau_trunc:
            reasons.append("truncation")
        if self.history and frac - min(self.history) > self.delta:
            reasons.append("jump")
        if self.tau_rep is not None and rep > self.tau_rep:
            reasons.append("repetition")
        tripped = bool(reasons)
        if tripped:
            self.kl_multiplier = min(self.kl_max, self.kl_multiplier * self.kl_up)
            self.trips += 1
        else:
            self.kl_multiplier = max(1.0, self.kl_multiplier * self.kl_decay)
        self.history = [*self.history, frac][-self.window :]
        self.steps += 1
        mix = self.mix_ratio if tripped else 0.0
        metrics = {
            "stable_opd/truncated_frac": torch.tensor(frac),
            "stable_opd/repetition": rep_t.detach().float(),
            "stable_opd/length_mean": ell.double().mean().float() if b else torch.tensor(0.0),
            "stable_opd/tripped": torch.tensor(float(tripped)),
            "stable_opd/kl_multiplier": torch.tensor(self.kl_multiplier),
            "stable_opd/mix_ratio": torch.tensor(mix),
        }
        return StableOPDDecision(tripped, tuple(reasons), self.kl_multiplier, mix, frac, rep, metrics)

    def state_dict(self) -> dict[str, Any]:
        """``{"history", "kl_multiplier", "steps", "trips"}`` (plain Python values)."""
        return {
            "history": list(self.history),
            "kl_multiplier": self.kl_multiplier,
            "steps": self.steps,
            "trips": self.trips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly."""
        try:
            history = [float(v) for v in state["history"]][-self.window :]
            kl, steps, trips = float(state["kl_multiplier"]), int(state["steps"]), int(state["trips"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError("state", "a dict from StableOPD.state_dict()", describe(state), "pass it") from exc
        self.history, self.kl_multiplier, self.steps, self.trips = history, kl, steps, trips


# ========================================================================================================== ADWIN
def kl_sign_alignment(prefix_kl: FloatBT, full_kl: FloatBT, mask: BoolBT, *, horizon: int) -> Scalar:
    r"""ADWIN's cheap alignment proxy [reconstructed]: agreement of per-token reverse-KL signs on the first H
    positions.

    .. math::
        a = \frac{\sum_{i,\,t < H} m_{i,t}\,\mathbb 1[\operatorname{sign} p_{i,t} = \operatorname{sign} f_{i,t}]}
        {\sum_{i,\,t < H} m_{i,t}}

    ``prefix_kl`` is the per-token signal of the prefix update and ``full_kl`` that of the full-rollout probe at
    the same positions — e.g. per-token reverse KL :math:`\log\pi_s - \log\pi_t`, or its return-to-go summed up to
    ``H`` and up to the end of the rollout respectively. Reference: ADWIN, arXiv 2605.28396 (the proxy is our
    reconstruction, ``docs/methods/opd_horizon.md``). Zero counts as its own sign.

    Args:
        prefix_kl, full_kl: float ``[B, T]``.
        mask: bool ``[B, T]``.
        horizon: H >= 0, the prefix length compared.

    Returns:
        0-d fp32 tensor in [0, 1]; 1 when no position is compared (empty batch, H = 0, all masked): no
        disagreement was observed, so check the count at the call site if that matters.
    """
    _int(horizon, "horizon", 0)
    dims = Dims()
    p = as_float(prefix_kl, "prefix_kl", dims, "B T")
    f = as_float(full_kl, "full_kl", dims, "B T").to(p.device)
    m = as_mask(mask, "mask", dims, "B T").to(p.device)
    m = m & (torch.arange(p.shape[1], device=p.device)[None, :] < horizon)
    finite(p, "prefix_kl", m)
    finite(f, "full_kl", m)
    agree = (torch.sign(p) == torch.sign(f)) & m
    n = m.sum()
    return torch.where(n > 0, agree.sum().float() / n.clamp(min=1).float(), torch.ones((), device=p.device))


def gradient_cosine(g_prefix: FloatAny | Sequence[FloatAny], g_full: FloatAny | Sequence[FloatAny]) -> Scalar:
    r"""Cosine between the prefix and the full-rollout OPD gradients: ADWIN's alignment.

    .. math::
        a = \frac{\langle g_{prefix}, g_{full} \rangle}{\lVert g_{prefix}\rVert\,\lVert g_{full}\rVert}

    Each argument is a tensor or a sequence of tensors (per-parameter gradients, flattened and concatenated in
    order; the two must match in total size). Reference: ADWIN, arXiv 2605.28396 (``docs/methods/opd_horizon.md``).
    Returns a 0-d fp32 tensor in [-1, 1]; 0 when either gradient is zero or empty.
    """

    def flat(g: Tensor | Sequence[Tensor], name: str) -> Tensor:
        parts = [g] if isinstance(g, Tensor) else list(g) if isinstance(g, Sequence) else None
        if parts is None or not all(isinstance(x, Tensor) for x in parts):
            raise InputError(name, "a tensor or a sequence of tensors", describe(g), "pass the gradients")
        if not parts:
            return torch.zeros(0)
        out = torch.cat([as_float(x, name).reshape(-1).double() for x in parts])
        finite(out, name)
        return out

    a, b = flat(g_prefix, "g_prefix"), flat(g_full, "g_full")
    if a.numel() != b.numel():
        raise InputError("g_full", f"{a.numel()} elements in all (as g_prefix)", f"{b.numel()}", "pass matching grads")
    b = b.to(a.device)
    na, nb = a.norm(), b.norm()
    den = na * nb
    cos = torch.where(den > 0, (a @ b) / den.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(den))
    return cos.clamp(-1.0, 1.0).float()


class ADWINHorizon:
    r"""ADWIN horizon controller for OPD [reconstructed]: adapt the training prefix length H from delayed probes.

    .. math::
        H \leftarrow \begin{cases} \max(H_{min}, \operatorname{round}(H\,\beta_{down})) & a \ge \tau_{hi} \\
        \min(H_{max}, \operatorname{round}(H\,\beta_{up})) & a < \tau_{lo} \\ H & \text{otherwise} \end{cases}
        \qquad \text{for probes with } v_{now} - v_{probe} \le S

    Training uses short, teacher-anchored prefixes of H tokens. Every ``probe_every`` steps (:meth:`probe_due`) the
    trainer generates full rollouts for a small probe subset off the critical path and, when they are scored,
    reports the alignment ``a`` between the prefix and the full-rollout update (:func:`gradient_cosine`, or the
    cheaper :func:`kl_sign_alignment`) with the policy version that produced the probe
    (:meth:`observe`). A high alignment means the prefix suffices (shrink, or keep with ``beta_down = 1``); a
    low one means the prefix misleads (grow). Probes older than ``staleness`` versions are recorded and ignored.

    Not the ADWIN (adaptive windowing) concept-drift detector of Bifet & Gavaldà, which shares the name. Reference:
    "Adaptive Windows for horizon-aware OPD", arXiv 2605.28396 (abstract: online admissibility, delayed
    full-rollout probes, staleness control, up to 4.1x lower training cost); the update rule and every default
    are **reconstructed** (``docs/methods/opd_horizon.md``), hence ``experimental=True``.

    Args:
        h0: initial horizon [reconstructed; default 512].
        h_min, h_max: bounds [reconstructed; defaults 64, 8192].
        tau_hi: shrink/keep at or above it [reconstructed; default 0.9].
        tau_lo: grow below it [reconstructed; default 0.5].
        beta_up: growth factor >= 1 [reconstructed; default 2].
        beta_down: shrink factor in (0, 1] [reconstructed; default 0.5; 1 keeps H].
        staleness: S, the oldest usable probe in policy versions [reconstructed; default 2].
        probe_every: P, steps between probes [reconstructed; default 10].
        history: probe results kept in the log (a bounded queue; default 64).
        experimental: must be True.

    Alignments lie in [-1, 1] (a cosine; the sign agreement is in [0, 1]). Called once per probe result, not per
    token: :meth:`observe` (``alignment``, ``version`` and ``current_version`` required).
    """

    requires: ClassVar[tuple[str, ...]] = ("alignment", "version", "current_version")
    reference: ClassVar[str] = "arXiv 2605.28396 (ADWIN: adaptive windows for horizon-aware OPD)"
    experimental: ClassVar[str | None] = "the horizon update rule, its thresholds and the defaults are reconstructed"

    def __init__(
        self,
        *,
        h0: int = 512,
        h_min: int = 64,
        h_max: int = 8192,
        tau_hi: float = 0.9,
        tau_lo: float = 0.5,
        beta_up: float = 2.0,
        beta_down: float = 0.5,
        staleness: int = 2,
        probe_every: int = 10,
        history: int = 64,
        experimental: bool = False,
    ) -> None:
        _experimental(experimental, "ADWINHorizon (update rule, thresholds, defaults)")
        self.h_min = _int(h_min, "h_min", 1)
        self.h_max = _int(h_max, "h_max", self.h_min)
        self.h0 = _int(h0, "h0", self.h_min)
        if self.h0 > self.h_max:
            raise InputError("h0", f"an int in [h_min, h_max] = [{h_min}, {h_max}]", describe(h0), "fix h0")
        self.tau_lo = _real(tau_lo, "tau_lo", -1.0, 1.0)
        self.tau_hi = _real(tau_hi, "tau_hi", self.tau_lo, 1.0)
        self.beta_up = _real(beta_up, "beta_up", 1.0, math.inf, open_high=True)
        self.beta_down = _real(beta_down, "beta_down", 0.0, 1.0, open_low=True)
        self.staleness = _int(staleness, "staleness", 0)
        self.probe_every = _int(probe_every, "probe_every", 1)
        self.max_history = _int(history, "history", 0)
        self.horizon = self.h0
        self.probes: list[tuple[int, float, bool, int]] = []
        self.n_probes = 0
        self.n_stale = 0

    def probe_due(self, step: int) -> bool:
        """Whether training step ``step`` (>= 0) should launch a full-rollout probe (every ``probe_every``)."""
        return _int(step, "step", 0) % self.probe_every == 0

    def observe(self, alignment: float | FloatAny, *, version: int, current_version: int) -> int:
        """Apply one probe's alignment (float or 0-d tensor) produced at policy ``version``; return the new H.

        The probe is logged as ``(version, alignment, applied, horizon)`` in ``self.probes`` (bounded queue);
        a probe with ``current_version - version > staleness`` is logged with ``applied=False`` and leaves H.
        """
        if isinstance(alignment, Tensor):
            if alignment.numel() != 1:
                raise InputError("alignment", "a number or a 1-element tensor", describe(alignment), "pass a scalar")
            alignment = float(alignment)
        a = _real(alignment, "alignment", -1.0, 1.0)
        v = _int(version, "version", 0)
        now = _int(current_version, "current_version", v)
        self.n_probes += 1
        applied = now - v <= self.staleness
        if not applied:
            self.n_stale += 1
        elif a >= self.tau_hi:
            self.horizon = max(self.h_min, _round(self.horizon * self.beta_down))
        elif a < self.tau_lo:
            self.horizon = min(self.h_max, _round(self.horizon * self.beta_up))
        if self.max_history:
            self.probes = [*self.probes, (v, a, applied, self.horizon)][-self.max_history :]
        return self.horizon

    def state_dict(self) -> dict[str, Any]:
        """``{"horizon", "probes", "n_probes", "n_stale"}`` (plain Python values)."""
        return {
            "horizon": self.horizon,
            "probes": [list(p) for p in self.probes],
            "n_probes": self.n_probes,
            "n_stale": self.n_stale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly."""
        try:
            horizon = int(state["horizon"])
            probes = [(int(p[0]), float(p[1]), bool(p[2]), int(p[3])) for p in state["probes"]]
            n_probes, n_stale = int(state["n_probes"]), int(state["n_stale"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise InputError("state", "a dict from ADWINHorizon.state_dict()", describe(state), "pass it") from exc
        if not self.h_min <= horizon <= self.h_max:
            raise InputError("state", f"a horizon in [{self.h_min}, {self.h_max}]", repr(horizon), "match h_min/h_max")
        self.horizon, self.probes, self.n_probes, self.n_stale = horizon, probes, n_probes, n_stale


# ============================================================================================================ ESR
class ESR(StopRule):
    r"""Early Stopping Rollout for OPD: keep only the first N response tokens of every student rollout.

    .. math::
        \text{stop at } t = N - 1 \qquad(\text{every row keeps } \min(N, \ell_i) \text{ tokens})

    The rule is ``max_new_tokens = N`` as a stop rule (reason ``"prefix_limit"``), so one generation loop can run
    it beside the others; a row that emits EOS earlier (``active`` False) is used as is. The distillation loss
    (reverse KL against the teacher) runs on those tokens only — :func:`esr_mask` builds the mask — and no reward
    is needed, the OPD signal being per token. Reference: ESR, arXiv 2605.27028 ("off-policy teacher decay":
    a teacher continuing a long student prefix degrades); N = 100 is the default reported by one summary
    (``docs/methods/opd_horizon.md``).

    Args:
        n: N >= 1, the prefix length (default 100).

    Requires no input (it counts each row's tokens). Edge cases: an all-inactive step changes nothing; N = 1 stops
    after one token.
    """

    reason_names = ("running", "prefix_limit")
    reference: ClassVar[str] = "arXiv 2605.27028 (ESR: early stopping rollout for OPD)"

    def __init__(self, *, n: int = 100) -> None:
        self.n = _int(n, "n", 1)

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        return state.extra, state.steps + 1 >= self.n, 1


def esr_mask(mask: BoolBT, lengths: IntB | None = None, *, n: int = 100) -> BoolBT:
    r"""ESR's loss mask: the first ``min(N, length)`` response tokens of every row.

    .. math::
        m'_{i,t} = m_{i,t} \wedge t < \min(N, \ell_i)

    Args:
        mask: bool ``[B, T]`` the loss mask (right-padded responses).
        lengths: int ``[B]`` response lengths (optional; without it the mask alone bounds the row).
        n: N >= 1 (default 100, arXiv 2605.27028 per one summary).

    Returns:
        bool ``[B, T]``; with ``mask = t < lengths`` every row covers exactly ``min(N, length)`` tokens. An empty
        batch gives an empty mask.
    """
    _int(n, "n", 1)
    dims = Dims()
    m = as_mask(mask, "mask", dims, "B T")
    t = torch.arange(m.shape[1], device=m.device)[None, :]
    keep = m & (t < n)
    if lengths is not None:
        ell = as_index(lengths, "lengths", dims, "B").to(m.device)
        if checks_enabled() and bool((ell < 0).any()):
            raise InputError("lengths", "non-negative lengths", describe(lengths), "pass response lengths")
        keep = keep & (t < ell[:, None])
    return keep


# ====================================================================================================== POPD/TOPD
def popd_horizon(
    step: int,
    *,
    h0: int,
    l_max: int,
    t_ramp: int | None = None,
    shape: Literal["linear", "staircase"] = "linear",
    k: int | None = None,
    experimental: bool = False,
) -> int:
    r"""Progressive OPD (POPD) [reconstructed]: the rollout horizon at training step ``step``, short to long.

    .. math::
        H_{linear}(t) = \operatorname{round}\Big(H_0 + (L_{max} - H_0)\min\big(1, \tfrac{t}{T_{ramp}}\big)\Big),
        \qquad H_{staircase}(t) = \min\big(L_{max}, H_0\, 2^{\lfloor t / K \rfloor}\big)

    Non-decreasing in ``t``, ``H(0) = H_0``, and ``L_max`` from ``T_ramp`` on (linear). Rounding is half up.
    Reference: "Are Full Rollouts Necessary for OPD?", arXiv 2605.31490 (POPD widens the horizon gradually, up to
    3x better training efficiency); the paper's schedule shape is not known — both shapes are **reconstructed**
    (``docs/methods/opd_horizon.md``), hence ``experimental=True``. Run the horizon with ``ESR(n=H)`` or the
    engine's ``max_new_tokens``.

    Args:
        step: training step t >= 0.
        h0: H_0 >= 1, the initial horizon (required; our worked example uses 512).
        l_max: L_max >= h0, the full horizon (required; oracle 8192).
        t_ramp: T_ramp >= 0, steps of the linear ramp (required for ``"linear"``; 0 gives L_max at once).
        shape: ``"linear"`` (default) or ``"staircase"`` (doubling every K steps).
        k: K >= 1, steps per stair (required for ``"staircase"``).
        experimental: must be True.
    """
    _experimental(experimental, "the POPD schedule shape")
    t = _int(step, "step", 0)
    h = _int(h0, "h0", 1)
    top = _int(l_max, "l_max", h)
    if shape == "linear":
        if t_ramp is None:
            raise InputError("t_ramp", "an int >= 0 for shape='linear'", "None", "pass e.g. t_ramp=100")
        ramp = _int(t_ramp, "t_ramp", 0)
        frac = 1.0 if ramp == 0 else min(1.0, t / ramp)
        return min(top, _round(h + (top - h) * frac))
    if shape == "staircase":
        if k is None:
            raise InputError("k", "an int >= 1 for shape='staircase'", "None", "pass e.g. k=50")
        stairs = t // _int(k, "k", 1)
        return top if stairs >= top.bit_length() else min(top, h * 2**stairs)
    raise InputError("shape", "one of 'linear', 'staircase'", describe(shape), "pass shape='linear'")


def topd_horizon(l_max: int, *, frac: float = 0.1) -> int:
    r"""Truncated OPD (TOPD): a fixed rollout horizon, a fraction of the full one.

    .. math::
        H = \max\big(1, \operatorname{round}(\text{frac}\cdot L_{max})\big)

    Reference: "Are Full Rollouts Necessary for OPD?", arXiv 2605.31490 (TOPD matches OPD with only 10% of the
    rollout horizon); ``frac = 0.1`` is the abstract's figure (``docs/methods/opd_horizon.md``). Rounding is half
    up.

    Args:
        l_max: L_max >= 1, the full horizon.
        frac: in (0, 1] (default 0.1).
    """
    top = _int(l_max, "l_max", 1)
    f = _real(frac, "frac", 0.0, 1.0, open_low=True)
    return max(1, _round(f * top))
