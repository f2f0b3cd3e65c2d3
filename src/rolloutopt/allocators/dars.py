"""DARS: multi-stage top-up for hard prompts (:class:`DARS`, :func:`dars_extra_rollouts`).

Speaks the protocol of :mod:`rolloutopt.allocators._base` and decides within the step: a first stage on every
prompt, then extra rollouts for the prompts whose first-stage accuracy is below 1/2 (two requests,
arXiv 2508.13755). No Python loop over prompts or rollouts. See ``docs/methods/difficulty.md``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_bool as _bool
from rolloutopt._validation import describe
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    _choice,
    _int,
    _real,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatP, IntB, IntP

__all__ = ["DARS", "dars_extra_rollouts"]

_EPS = 1e-9  # ceil/floor tolerance: 24.000000001 must ceil to 24 (a DARS edge case)


# -- DARS ---------------------------------------------------------------------------------------------------------
def dars_extra_rollouts(
    acc: FloatP, *, n: int = 8, n_max: int = 32, schedule: str = "et", use_std: bool = False
) -> IntP:
    r"""DARS's extra rollouts per prompt from its first-stage accuracy (arXiv 2508.13755, ``schedule_ET/HW``).

    With :math:`a = 0` replaced by :math:`0.5/n` and :math:`S(a) = 2a(1-a)` (``use_std``: :math:`2\sqrt{a(1-a)}`,
    peak :math:`n` instead of :math:`0.5n`):

    .. math::

        \text{ET: } \Delta n = \Big\lceil \frac{0.5n - nS}{S} \Big\rceil
            = \Big\lceil \frac{n(1-2a)^2}{4a(1-a)} \Big\rceil, \qquad
        \text{HW: } \Delta n = \Big\lceil \frac{2(1-a)\,0.5n - nS}{S} \Big\rceil
            = \Big\lceil \frac{n(1-2a)}{2a} \Big\rceil,

    then :math:`\Delta n \leftarrow \min(\Delta n, n_{max} - n)`, and :math:`\Delta n = 0` for :math:`a \ge 0.5`.
    The ceiling tolerates float error (``ceil(x - 1e-9)``, so 24.000000001 gives 24).

    Args:
        acc: first-stage accuracy per prompt, float ``[P]`` in [0, 1] (empty allowed).
        n, n_max: first-stage group size and the cap on a prompt's total rollouts (``n_max >= n``).
        schedule: ``"et"`` (Equal Treatment, ``resampling_func=1``) or ``"hw"`` (Hardness Weighted, ``=2``).
        use_std: the ``grpo_use_std=True`` variant (the scripts use False).

    Returns:
        int64 ``[P]`` in ``[0, n_max - n]``.
    """
    _int(n, "n", 1)
    _int(n_max, "n_max", n)
    _choice(schedule, "schedule", ("et", "hw"))
    _bool(use_std, "use_std")
    if not isinstance(acc, Tensor) or not acc.is_floating_point() or acc.ndim != 1:
        raise InputError("acc", "a 1-d float tensor of accuracies [P]", describe(acc), "pass group means")
    a64 = acc.detach().double()
    if not bool(((a64 >= 0) & (a64 <= 1)).all()):
        raise InputError("acc", "accuracies in [0, 1]", describe(acc), "pass group success rates")
    a = torch.where(a64 == 0, 0.5 / n, a64)
    s = 2 * torch.sqrt(a * (1 - a)) if use_std else 2 * a * (1 - a)
    peak = float(n) if use_std else 0.5 * n
    target = peak if schedule == "et" else 2 * (1 - a) * peak
    s = s.clamp(min=1e-12)  # a in (0, 1) here except a = 1, which has a >= 0.5 and is zeroed below
    extra = torch.ceil((target - n * s) / s - _EPS).clamp(min=0, max=n_max - n)
    return torch.where(a >= 0.5, 0.0, extra).long()


_DARS_NAMES = ("trained", "topped_up", "topped_up_budget_cut", "dropped_all_wrong", "dropped_all_correct", "no_budget")


class _DARSPlan(Conversation):
    reason_names = _DARS_NAMES

    def __init__(self, prompt_ids: Tensor, budget: int, owner: DARS) -> None:
        super().__init__(prompt_ids, budget)
        self.o = owner
        p = prompt_ids.numel()
        k = min(p, budget // owner.n)
        self._first = torch.zeros(p, dtype=torch.long)
        self._first[self._order[:k]] = owner.n  # a short budget runs stage 1 on the lowest prompt ids
        self._succ = torch.zeros(p, dtype=torch.float64)
        self._want = torch.zeros(p, dtype=torch.long)
        self._extra = torch.zeros(p, dtype=torch.long)
        self.stage = 0

    def on_observe(self, pos: IntB, rewards: FloatB) -> None:
        self._succ.index_add_(0, pos, (rewards >= self.o.success).double())

    def decide(self) -> Request | None:
        self.stage += 1
        if self.stage == 1:
            keep = self._first > 0
            return self.request(keep, self._first[keep]) if bool(keep.any()) else None
        if self.stage > 2:
            return None
        o = self.o
        played = self._n > 0
        acc = self._succ / self._n.double().clamp(min=1)
        want = torch.where(
            played, dars_extra_rollouts(acc, n=o.n, n_max=o.n_max, schedule=o.schedule, use_std=o.use_std), 0
        )
        self._want = want
        remaining = self.budget - self.spent
        total = int(want.sum())
        if total <= remaining:
            extra = want
        else:  # the project's budget rule: level the extras to min(want, L), then one more to the largest wants
            lo, hi = 0, int(want.max())  # sum(min(want, lo)) <= remaining < sum(min(want, hi))
            while hi - lo > 1:  # O(log n_max) vectorised passes
                mid = (lo + hi) // 2
                if int(want.clamp(max=mid).sum()) <= remaining:
                    lo = mid
                else:
                    hi = mid
            extra = want.clamp(max=lo)
            left = remaining - int(extra.sum())
            # one more each to the prompts with want > lo: lowest accuracy first, then the lower prompt id
            cand = self._order[want[self._order] > lo]
            cand = cand[torch.sort(acc[cand], stable=True).indices]
            extra[cand[:left]] += 1
        self._extra = extra
        give = extra > 0
        return self.request(give, extra[give]) if bool(give.any()) else None

    def select(self) -> tuple[FloatB, IntP]:
        pos, _ = self.rollouts()
        n = self._n
        acc = self._succ / n.double().clamp(min=1)
        wrong = (n > 0) & (acc == 0)
        right = (n > 0) & (acc >= self.o.upper_threshold)
        drop = wrong | right
        topped = self._extra > 0
        cut = self._extra < self._want
        reasons = torch.where(
            n == 0,
            5,
            torch.where(wrong, 3, torch.where(right, 4, torch.where(cut, 2, torch.where(topped, 1, 0)))),
        )
        return (~drop).double().index_select(0, pos), reasons

    def finish(self) -> AllocationResult:
        res = super().finish()
        extra = self._extra.sum().double()
        return replace(res, metrics={**res.metrics, "stage2_rollouts": extra})


class DARS:
    r"""DARS: roll every prompt out ``n`` times, then top up the hard ones in one second batch.

    arXiv 2508.13755 (Difficulty-Adaptive Rollout Sampling; code ``yangzhch6/DARS``,
    ``verl/verl/trainer/ppo/ray_dars_trainer.py``; ``docs/methods/difficulty.md``). A plan makes two requests:

    1. **Stage 1**: ``n`` rollouts per prompt; accuracy :math:`a` = fraction of rewards ``>= success``.
    2. **Stage 2**: :math:`\Delta n(a)` more per prompt from the schedule (:func:`dars_extra_rollouts`; zero for
       :math:`a \ge 0.5`, capped so a prompt gets at most ``n_max`` in all), all in one request.
    3. **Pool and filter**: the pooled accuracy decides: prompts with pooled :math:`a = 0` or
       :math:`a \ge` ``upper_threshold`` get weight 0 on all their rollouts; the rest train on every rollout.

    **Stage-2 sampling (a code quirk).** The code passes ``do_sample=False`` to the stage-2 call, but its
    vLLM wrapper then resets the temperature to the rollout temperature, so stage 2 *samples* one response per
    replicated prompt row (top-p 1). This library only requests counts; the engine must *sample* the stage-2
    rollouts at the rollout temperature, exactly as stage 1 — an engine where ``do_sample=False`` means greedy
    would produce identical responses and silently change the method. ``plan.stage`` (1 or 2) tells an adapter
    which request it is serving.

    Budget (rollouts; the project's adaptation, the code has none): stage 1 takes ``n`` per prompt (a budget
    below ``P * n`` runs stage 1 on the ``budget // n`` lowest prompt ids; the others are ``"no_budget"``);
    stage 2 takes what it wants if that fits, otherwise every prompt's extras are levelled to
    :math:`\min(\Delta n_i, L)` with the largest :math:`L` that fits and the remaining units go one each to the
    prompts still short (lowest accuracy first, then the lower id): reason ``"topped_up_budget_cut"``. The budget
    is spent only as far as the schedule asks: ``P * n + sum(Delta n)`` at most.

    Defaults (the code and its ``experiments/*.sh`` scripts): ``n=8``; ``n_max=None`` means the scripts' 32 for
    ET and 64 for HW; ``upper_threshold=1.0`` (all-correct groups dropped); ``use_std=False`` (the scripts). The
    sources give no default schedule; ``"et"`` is ``resampling_func=1``. ``success=1.0``: a rollout counts as
    correct when its
    reward is at least 1. Nothing is kept across steps: ``update`` does nothing and the state dict is empty;
    the plan is deterministic (no seed is needed; ``seed`` is accepted for the protocol and unused).

    Args:
        n: stage-1 rollouts per prompt.
        schedule: ``"et"`` or ``"hw"``.
        use_std: ``grpo_use_std`` variant of the schedule.
        n_min: smallest group a trained prompt may have (``<= n``).
        n_max: most rollouts per prompt (``>= n``), or None for the schedule's default.
        upper_threshold: pooled accuracy at or above which a prompt is dropped.
        success: reward threshold of a correct rollout.
        seed: unused (deterministic), kept for a uniform constructor.

    Reasons: ``"trained"`` (no extras), ``"topped_up"``, ``"topped_up_budget_cut"``, ``"dropped_all_wrong"``,
    ``"dropped_all_correct"`` (weight 0), ``"no_budget"``. Metric ``stage2_rollouts``.
    """

    reference: ClassVar[str] = "arXiv 2508.13755 (DARS, Difficulty-Adaptive Rollout Sampling); code yangzhch6/DARS"
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        n: int = 8,
        schedule: str = "et",
        use_std: bool = False,
        n_min: int = 1,
        n_max: int | None = None,
        upper_threshold: float = 1.0,
        success: float = 1.0,
        seed: int = 0,
    ) -> None:
        _int(n, "n", 1)
        _choice(schedule, "schedule", ("et", "hw"))
        _bool(use_std, "use_std")
        _int(n_min, "n_min", 1)
        if n_min > n:
            raise InputError("n_min", f"n_min <= n = {n}", repr(n_min), "lower n_min or raise n")
        _int(n_max, "n_max", 1, none=True)
        if n_max is None:
            n_max = max(n, 32 if schedule == "et" else 64)
        if n_max < n:
            raise InputError("n_max", f"n_max >= n = {n}", repr(n_max), "raise n_max or lower n")
        _real(upper_threshold, "upper_threshold", 0.0, 1.0, open_low=True)
        if not isinstance(success, (int, float)) or isinstance(success, bool) or not math.isfinite(success):
            raise InputError("success", "a finite number (reward threshold)", describe(success), "pass success=1.0")
        _int(seed, "seed", 0)
        self.n, self.schedule, self.use_std, self.n_min, self.n_max = n, schedule, use_std, n_min, n_max
        self.upper_threshold, self.success, self.seed = float(upper_threshold), float(success), seed

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Stage 1 on every prompt, then the schedule's top-up (see the class docstring)."""
        return _DARSPlan(as_prompt_ids(prompt_ids), check_budget(budget), self)

    def update(self, result: AllocationResult) -> None:
        """Nothing to learn: DARS keeps nothing across steps."""
        _check_result(result)

    STATE: ClassVar[dict[str, Field]] = {}
    """The declared fields of :meth:`state_dict`: none (stateless; only the format version is saved)."""

    def state_dict(self) -> dict[str, Any]:
        """No state: only the format version."""
        return dump_state({})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state; a state with any key (or another format version) is an ``InputError``."""
        load_state(state, self.STATE, "DARS")
