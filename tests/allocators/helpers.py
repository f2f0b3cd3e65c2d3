"""Shared test drivers for the allocators: deterministic reward tables, a plan runner and a state comparison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rolloutopt.allocators import AllocationResult, Conversation

Rewards = Callable[[int, int], float]


def table(t: dict[int, list[float]]) -> Rewards:
    """Reward of the k-th rollout of prompt ``pid`` (cycling through its list)."""
    return lambda pid, k: t[pid][k % len(t[pid])]


def hashed(seed: int) -> Rewards:
    """A deterministic pseudo-random 0/1 reward per (prompt, occurrence) with a per-prompt success rate."""

    def f(pid: int, k: int) -> float:
        q = ((pid * 2654435761 + seed) % 101) / 100
        u = ((pid * 7919 + k * 104729 + seed * 31) % 997) / 997
        return float(u < q)

    return f


def run(plan: Conversation, reward: Rewards) -> tuple[AllocationResult, list[tuple[list[int], list[int]]]]:
    """Drive a plan to the end; return the result and the requests (ids, counts) in order."""
    occ: dict[int, int] = {}
    reqs = []
    while (req := plan.next()) is not None:
        vals = []
        for pid, c in zip(req.prompt_ids.tolist(), req.counts.tolist(), strict=True):
            for _ in range(c):
                k = occ.get(pid, 0)
                occ[pid] = k + 1
                vals.append(reward(pid, k))
        reqs.append((req.prompt_ids.tolist(), req.counts.tolist()))
        plan.observe(req, torch.tensor(vals, dtype=torch.float64))
    return plan.finish(), reqs


def same_state(a: Any, b: Any) -> bool:
    """Equality of (nested) states holding tensors; NaN (an unmeasured value) equals NaN."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
