r"""Step-GRPO (arXiv 2604.16890): the dynamic truncated rollout and the step-aware relative reward.

- :class:`StepGRPOTruncation` (streaming :class:`~rolloutopt.control.StopRule`): at a step boundary after
  ``min_steps`` steps the engine probes an answer-forcing suffix and passes the probe's confidence; the row stops
  when it is at least ``threshold``.
- :func:`step_aware_reward` (post-hoc, ``rolloutopt.control.posthoc``): correct responses lose reward for
  redundant steps, relative to their group; :func:`count_steps` is the step count it needs.

Reconstructed from the abstract and public summaries: every class and function that rests on a reconstructed
detail requires ``experimental=True``. Provenance and worked examples: ``docs/methods/truncation_rules.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

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
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._base import StopState
from rolloutopt.control._markers import _DOCS, _check_flag, _markers, _ProbeGate
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, IntB, IntBT, NumB

__all__ = ["StepGRPOTruncation", "StepRewardOutput", "count_steps", "step_aware_reward"]

_SPANS = ("correct", "all")


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
