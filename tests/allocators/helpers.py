"""Shared test drivers for the allocators: deterministic reward tables and a plan runner."""

from __future__ import annotations

from collections.abc import Callable

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
