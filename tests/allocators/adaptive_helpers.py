"""Shared drivers of the AR3PO, AERO and V05Budget tests: allocator factories, result views, a multi-step runner
and the bodies of the tests run for each of the three families."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rolloutopt.allocators import AllocationResult, Request
from rolloutopt.allocators.aero import AERO
from rolloutopt.allocators.ar3po import AR3PO
from rolloutopt.allocators.v05_budget import V05Budget
from rolloutopt.errors import InputError

from .helpers import hashed, run
from .table_helpers import Make, check_shared_table, in_turn


def reasons(res: AllocationResult) -> dict[int, str]:
    return {int(i): res.reason_names[int(c)] for i, c in zip(res.plan_prompt_ids, res.reasons, strict=True)}


def per_prompt(res: AllocationResult, values: torch.Tensor) -> dict[int, float]:
    s = torch.zeros(res.plan_prompt_ids.numel(), dtype=torch.float64).index_add_(0, res.group, values.double())
    return {int(i): float(v) for i, v in zip(res.plan_prompt_ids, s, strict=True)}


def ar3po(**kw: Any) -> AR3PO:
    return AR3PO(experimental=True, **kw)


def aero(**kw: Any) -> AERO:
    return AERO(experimental=True, **kw)


def v05b(**kw: Any) -> V05Budget:
    return V05Budget(experimental=True, **kw)


# -- properties -------------------------------------------------------------------------------------------------------
FACTORIES: dict[str, Callable[[int], Any]] = {
    "ar3po": lambda s: ar3po(k=3, stages=3, buffer="random", seed=s, n_max=8),
    "ar3po_latest": lambda s: ar3po(k=2, stages=4, seed=s),
    "aero": lambda s: aero(n_max=10, seed=s),
    "v05": lambda s: v05b(n_max=9, rounds=2),
}

CAPS = {"ar3po": (3, 8), "ar3po_latest": (2, 8), "aero": (2, 10), "v05": (4, 9)}


def _steps(alloc: Any, ids: torch.Tensor, budget: int, seed: int, steps: int) -> list[AllocationResult]:
    out = []
    for t in range(steps):
        res, _ = run(alloc.plan(ids, budget), hashed(seed + t))
        alloc.update(res)
        out.append(res)
    return out


def check_budget_caps_and_determinism(name: str, ids: list[int], budget: int, seed: int) -> None:
    t = torch.tensor(ids, dtype=torch.long)
    lo, hi = CAPS[name]
    ra = _steps(FACTORIES[name](seed), t, budget, seed, 3)
    rb = _steps(FACTORIES[name](seed), t, budget, seed, 3)
    for a, b in zip(ra, rb, strict=True):
        gen = int(a.counts.sum())
        assert gen <= budget and float(a.metrics["rollouts"]) == gen
        assert a.rewards.numel() == gen + int(a.metrics.get("reused", torch.tensor(0.0)))
        assert bool(((a.counts == 0) | ((a.counts >= lo) & (a.counts <= hi))).all())
        assert bool(torch.isfinite(a.weight).all()) and bool(((a.weight >= 0) & (a.weight <= 1)).all())
        for f in ("prompt_ids", "group", "rewards", "weight", "counts", "reasons"):
            assert torch.equal(getattr(a, f), getattr(b, f))


def check_permutation_permutes_the_plan(name: str, ids: list[int], budget: int, rnd: Any) -> None:
    perm = list(ids)
    rnd.shuffle(perm)
    ra = _steps(FACTORIES[name](0), torch.tensor(ids), budget, 1, 2)
    rb = _steps(FACTORIES[name](0), torch.tensor(perm), budget, 1, 2)
    for a, b in zip(ra, rb, strict=True):
        ca = dict(zip(a.plan_prompt_ids.tolist(), a.counts.tolist(), strict=True))
        cb = dict(zip(b.plan_prompt_ids.tolist(), b.counts.tolist(), strict=True))
        assert ca == cb and reasons(a) == reasons(b)
        assert per_prompt(a, a.rewards) == per_prompt(b, b.rewards)
        assert per_prompt(a, a.weight) == per_prompt(b, b.weight)


def check_state_dict_round_trip_mid_run(name: str) -> None:
    ids = torch.arange(30) * 7 + 1
    a = FACTORIES[name](5)
    _steps(a, ids, 150, 0, 3)
    state = a.state_dict()
    b = FACTORIES[name](99)
    b.load_state_dict(state)
    if name == "v05":
        a.set_prior(ids[:5], torch.full((5,), 0.2))
        b.set_prior(ids[:5], torch.full((5,), 0.2))
    ra = _steps(a, ids, 150, 3, 3)
    rb = _steps(b, ids, 150, 3, 3)
    for x, y in zip(ra, rb, strict=True):
        for f in ("prompt_ids", "group", "rewards", "weight", "counts", "reasons"):
            assert torch.equal(getattr(x, f), getattr(y, f))
    assert same_state(a.state_dict(), b.state_dict())


def same_state(a: Any, b: Any) -> bool:
    """Equal (nested) states: dicts key by key, tensors equal with NaN in the same places, other values ==."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return torch.isnan(a).equal(torch.isnan(b)) and a.nan_to_num(0.0).equal(b.nan_to_num(0.0))
        return a.equal(b)
    return bool(a == b)


def check_shared_table_equals_private(makes: list[Make], pools: list[torch.Tensor]) -> None:
    """Allocators sharing one ``PromptTable`` (``makes[i](table)``; ``makes[i](None)``: a private table),
    stepping in turn on their ``pools`` (150 rollouts, :func:`hashed` rewards): :func:`check_shared_table`."""
    check_shared_table(makes, in_turn(drive=lambda a, pool, s: _steps(a, pool, 150, s, 1)[0], at=pools))


# -- bad input -----------------------------------------------------------------------------------------------------
def check_experimental_flag_required(cls: Any) -> None:
    with pytest.raises(InputError, match="experimental"):
        cls()


def check_bad_hyperparameters(factory: Callable[..., Any], kw: dict[str, Any], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        factory(**kw)


def check_bad_protocol_input(name: str) -> None:
    alloc = FACTORIES[name](0)
    with pytest.raises(InputError, match="budget"):
        alloc.plan(torch.tensor([1, 2]), -1)
    with pytest.raises(InputError, match="prompt_ids"):
        alloc.plan(torch.tensor([1.0, 2.0]), 10)
    plan = alloc.plan(torch.tensor([1, 2]), 40)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(req.total + 1))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((req.total,), math.nan))
    with pytest.raises(InputError, match="request"):
        plan.observe(Request(torch.tensor([77]), torch.tensor([req.total])), torch.zeros(req.total))
    plan2 = alloc.plan(torch.tensor([1, 2]), 40)
    req2 = plan2.next()
    assert req2 is not None
    plan2._pending = Request(torch.tensor([77]), req2.counts[:1])  # a request naming an id outside the plan
    with pytest.raises(InputError, match="prompt_ids"):
        plan2.observe(plan2._pending, torch.zeros(int(req2.counts[0])))
    with pytest.raises(InputError, match="result"):
        alloc.update("not a result")
    other = run(FACTORIES["aero" if name != "aero" else "v05"](0).plan(torch.tensor([1]), 10), hashed(0))[0]
    with pytest.raises(InputError, match="result"):
        alloc.update(other)
    with pytest.raises(InputError, match="state"):
        alloc.load_state_dict({"nope": 1})
