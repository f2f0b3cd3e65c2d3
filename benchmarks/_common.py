"""Shared pieces of the benchmark scripts: the timer and the two group layouts every table uses."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

B, T = 65_536, 8


def timeit(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in milliseconds over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def case_ids(case: str, gen: torch.Generator) -> torch.Tensor:
    """Group ids ``[B]``: ``"equal"`` groups of 8 in consecutive order, or ``"ragged"`` sizes 1–32, shuffled."""
    if case == "equal":
        return torch.arange(B // 8).repeat_interleave(8)
    sizes = torch.randint(1, 33, (B // 8,), generator=gen)
    sizes = sizes[torch.cumsum(sizes, 0) <= B]
    last = B - int(sizes.sum())
    sizes = torch.cat([sizes, torch.ones(last, dtype=torch.long)]) if last else sizes
    ids = torch.repeat_interleave(torch.randperm(len(sizes), generator=gen) * 7919 + 13, sizes)
    return ids[torch.randperm(B, generator=gen)]
