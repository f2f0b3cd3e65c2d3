"""The one check of an :class:`~rolloutopt.allocators.AllocationResult` before an allocator's ``update`` learns
from it."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rolloutopt._validation import checks_enabled, describe
from rolloutopt.allocators._base import SIGNALS, AllocationResult
from rolloutopt.errors import InputError

__all__: list[str] = []


def _check_result(
    result: Any, owner: str | None = None, reason_names: tuple[str, ...] | None = None
) -> AllocationResult:
    """The one check of what ``update`` learns from: an :class:`AllocationResult` whose parts agree.

    Always: the type, and ``reason_names`` when the allocator needs its own plan's result (``owner`` names it).
    While :func:`rolloutopt.checks` is on, also: 1-D per-rollout fields of one length N and per-prompt fields of
    one length P; ``group`` in ``0..P-1`` with ``prompt_ids[i] == plan_prompt_ids[group[i]]``; finite rewards;
    finite, non-negative weights; non-negative counts; reason codes inside ``reason_names``. An inconsistent
    result would otherwise fail deep inside torch or, worse, change the allocator's state silently.
    """
    plan = f"a {owner} plan" if owner else "plan"
    if not isinstance(result, AllocationResult) or (reason_names is not None and result.reason_names != reason_names):
        raise InputError("result", f"the AllocationResult of {plan}.finish()", describe(result), "pass plan.finish()")
    if not checks_enabled():
        return result

    def bad(field_: str, expected: str, got: str) -> InputError:
        return InputError(f"result.{field_}", expected, got, f"pass the AllocationResult of {plan}.finish() unchanged")

    per_rollout = ("prompt_ids", "group", "rewards", "weight")
    per_prompt = ("plan_prompt_ids", "counts", "reasons")
    for names in (per_rollout, per_prompt):
        first = getattr(result, names[0])
        for name in names:
            x = getattr(result, name)
            if not isinstance(x, Tensor) or x.ndim != 1 or x.shape != first.shape:
                raise bad(name, f"a 1-D tensor as long as result.{names[0]} ({first.numel()})", describe(x))
    p = result.plan_prompt_ids.numel()
    group = result.group
    # one reduction per check where it proves the property (a finite sum: every value finite; a non-negative
    # minimum with a finite sum: every weight finite and >= 0), the exact test only on an alarm
    if group.numel():
        span = f"integer positions into the plan's {p} prompts (0..{p - 1})"
        if group.is_floating_point() or group.dtype == torch.bool:
            raise bad("group", span, describe(group))
        lo, hi = torch.aminmax(group)
        if int(lo) < 0 or int(hi) >= p:
            raise bad("group", span, describe(group))
        if not torch.equal(result.plan_prompt_ids.index_select(0, group.long()), result.prompt_ids):
            raise bad("prompt_ids", "the planned prompt of each rollout's group", "ids that disagree with group")
    r, w = result.rewards, result.weight
    if r.numel() and not math.isfinite(float(r.sum())) and not bool(torch.isfinite(r).all()):
        raise bad("rewards", "finite rewards", f"{describe(r)} with non-finite values")
    if w.numel() and not (float(w.min()) >= 0 and math.isfinite(float(w.sum()))):
        raise bad("weight", "finite, non-negative weights", describe(w))
    if p and int(result.counts.min()) < 0:
        raise bad("counts", "non-negative rollout counts", describe(result.counts))
    if p and (int(result.reasons.min()) < 0 or int(result.reasons.max()) >= len(result.reason_names)):
        raise bad("reasons", f"codes into reason_names (0..{len(result.reason_names) - 1})", describe(result.reasons))
    if not isinstance(result.signals, dict):
        raise bad("signals", "a dict of signal name -> tensor", describe(result.signals))
    for name, value in result.signals.items():
        if name not in SIGNALS:
            raise bad("signals", f"signals among {sorted(SIGNALS)}", repr(name))
        n = group.numel() if SIGNALS[name] == "rollout" else p
        if not isinstance(value, Tensor) or value.shape != (n,) or not value.is_floating_point():
            raise bad(f"signals[{name!r}]", f"a float tensor [{n}]", describe(value))
    return result
