"""Shared drivers of the DOTS and XRPO tests: a plan runner and reward tables."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rolloutopt.allocators._base import AllocationResult, Conversation, Request

Rewards = Callable[[Request], torch.Tensor]

F64 = torch.float64


def run(plan: Conversation, rewards: Rewards) -> tuple[AllocationResult, list[Request]]:
    reqs = []
    while (req := plan.next()) is not None:
        reqs.append(req)
        plan.observe(req, rewards(req))
    return plan.finish(), reqs


def const(values: dict[int, list[float]]) -> Rewards:
    """Each prompt's rewards, cycled to the requested count (continuing across requests)."""
    seen: dict[int, int] = {}

    def f(req: Request) -> torch.Tensor:
        out = []
        for p, c in zip(req.prompt_ids.tolist(), req.counts.tolist(), strict=True):
            start = seen.get(p, 0)
            out += [values[p][(start + i) % len(values[p])] for i in range(c)]
            seen[p] = start + c
        return torch.tensor(out, dtype=F64)

    return f


def keyed(rate: torch.Tensor, step: int) -> Rewards:
    """Rewards that depend only on (prompt, rollout index within the request, step): order-free."""

    def f(req: Request) -> torch.Tensor:
        j = torch.cat([torch.arange(int(c)) for c in req.counts]) if req.counts.numel() else req.counts
        p = rate[req.prompt_ids].repeat_interleave(req.counts)
        return ((j * 0.37 + p * 7.1 + step * 0.13) % 1.0 < p).double()

    return f
