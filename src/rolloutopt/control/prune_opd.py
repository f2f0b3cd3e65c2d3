r"""Prune-OPD (arXiv 2605.07804): truncate a student rollout once its top-k overlap with the teacher drifts.

:class:`PruneOPD` (streaming :class:`~rolloutopt.control.StopRule`): student/teacher top-k overlap, drift
detection, monotone down-weighting of later teacher rewards (``token_weight`` of the result of
:meth:`PruneOPD.finalize`) and truncation; :class:`PruneOPDWindow` grows the max length while compatibility
stays high. Both are reconstructed from the
abstract (``experimental=True``). Provenance and worked examples: ``docs/methods/opd_horizon.md``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import (
    Dims,
    as_index,
    checks_enabled,
    describe,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._base import StepInputs, StopResult, StopRule, StopState
from rolloutopt.control._opd import _experimental
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, IntB

__all__ = ["PruneOPD", "PruneOPDWindow"]


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
    of that chunk. :meth:`finalize` adds the per-token loss weights of the teacher rewards to the result
    (``token_weight``; ``result.loss_weights(mask)``).

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

    def finalize(self, state: StopState) -> StopResult:
        r""":meth:`~rolloutopt.control.StopRule.finalize` plus the per-token loss weights of the teacher rewards as
        ``token_weight`` ``[N, L]`` (``L`` the longest generated row): :math:`w_t` on kept tokens, 0 after a
        row's stop.

        .. math::
            w_{i,t} = \begin{cases} 1 & t < d_i \text{ or no drift} \\ \rho^{\,t-d_i+1} & t \ge d_i \end{cases}
            \quad (t < \ell^{keep}_i), \qquad w_{i,t} = 0 \quad (t \ge \ell^{keep}_i)

        Non-increasing along every row (Prune-OPD, arXiv 2605.07804: monotone down-weighting after a drift). ``t``
        indexes the row's generated tokens (``StopState.steps``), the padded layout of a right-padded batch;
        ``result.loss_weights(mask)`` multiplies them into the mask (1 past ``L``).
        """
        if not isinstance(state, StopState) or "drift_at" not in state.extra:
            raise InputError(
                "state", "a StopState of PruneOPD", describe(state), "pass the state PruneOPD.step returned"
            )
        res = super().finalize(state)
        d = state.extra["drift_at"][:, None]
        length = int(state.steps.max()) if state.batch_size else 0
        t = torch.arange(length, device=d.device)[None, :]
        decay = torch.full((1, 1), self.rho, device=d.device).pow((t - d + 1).clamp(min=0).float())
        w = torch.where((d >= 0) & (t >= d), decay, torch.ones_like(decay))
        return replace(res, token_weight=w * res.keep_mask(length))


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
        self.STATE: dict[str, Field] = {
            "length": Field("integer", low=self.l0, high=self.l_max),
            "streak": Field("integer", low=0, high=self.patience - 1),
            "steps": Field("integer", low=0),
        }
        """The declared fields of :meth:`state_dict` (the bounds of L and of the streak from the constructor)."""

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
        return dump_state({"length": self.length, "streak": self.streak, "steps": self.steps})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "PruneOPDWindow")
        self.length, self.streak, self.steps = s["length"], s["streak"], s["steps"]
