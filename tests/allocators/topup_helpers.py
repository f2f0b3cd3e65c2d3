"""Shared drivers of the VIGOR and PilotCommit tests: result views and the bodies of the tests run for both families."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from rolloutopt.allocators import AllocationResult
from rolloutopt.allocators.pilot_commit import PilotCommit
from rolloutopt.allocators.vigor import VIGOR
from rolloutopt.errors import InputError


def reasons(res: AllocationResult) -> list[str]:
    return [res.reason_names[int(i)] for i in res.reasons]


def vigor(**kw: object) -> VIGOR:
    return VIGOR(experimental=True, **kw)  # type: ignore[arg-type]


def check_bad_protocol_input(make: Callable[[], VIGOR | PilotCommit]) -> None:
    alloc = make()
    with pytest.raises(InputError, match=r"^budget"):
        alloc.plan(torch.tensor([1, 2]), -1)
    with pytest.raises(InputError, match=r"^prompt_ids"):
        alloc.plan(torch.tensor([1.0, 2.0]), 4)
    plan = alloc.plan(torch.tensor([1, 2]), 8)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match=r"^rewards"):
        plan.observe(req, torch.zeros(req.total + 1))
    with pytest.raises(InputError, match=r"^rewards"):
        plan.observe(req, torch.full((req.total,), math.nan))
    bad = type(req)(torch.full_like(req.prompt_ids, 77), req.counts)
    with pytest.raises(InputError, match=r"^request"):
        plan.observe(bad, torch.zeros(req.total))
