"""Shared helpers of the partial-rollout tests (the event API, APRIL, CoPRIS)."""

from __future__ import annotations

import torch

from rolloutopt.control import (
    APRILBuffer,
    CoPRISScheduler,
    Requests,
)

Sched = APRILBuffer | CoPRISScheduler


def seg(n: int, start: int = 0, lp: float = -0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """n new tokens (ids start, start+1, ...) with log-prob lp each."""
    return torch.arange(start, start + n), torch.full((n,), lp)


def by_prompt(reqs: Requests) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for q, p in zip(reqs.request_ids.tolist(), reqs.prompt_ids.tolist(), strict=True):
        out.setdefault(p, []).append(q)
    return out


def ids(x: torch.Tensor) -> set[int]:
    return set(x.tolist())
