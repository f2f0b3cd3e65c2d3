"""Shared drivers of the DARS and E3 tests: result views and the bodies of the tests run for both families."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rolloutopt.allocators import AllocationResult
from rolloutopt.allocators.dars import DARS
from rolloutopt.allocators.e3 import E3Budget
from rolloutopt.errors import InputError


def names(res: AllocationResult) -> list[str]:
    return [res.reason_names[int(i)] for i in res.reasons]


# -- bad input -----------------------------------------------------------------------------------------------------
def check_bad_protocol_input(alloc: DARS | E3Budget) -> None:
    with pytest.raises(InputError, match="budget"):
        alloc.plan(torch.tensor([1, 2]), -1)
    with pytest.raises(InputError, match="prompt_ids"):
        alloc.plan(torch.tensor([1.0, 2.0]), 16)
    plan = alloc.plan(torch.tensor([1, 2]), 16)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(req.total + 1))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((req.total,), float("nan")))
    with pytest.raises(InputError, match="prompt_ids"):
        plan.positions(torch.tensor([99]))
    with pytest.raises(InputError, match="result"):
        alloc.update("not a result")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="state"):
        alloc.load_state_dict({"x": 1})


def check_bad_arguments(make: Callable[[], object], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        make()
