"""The allocator registry: every registered allocator, constructed by name, runs one step and declares its signals.

For each name: ``get(name)(...)`` with the default arguments (``experimental=True`` where the entry says the
allocator is reconstructed) plans, observes, finishes and updates one step; ``update`` (or ``plan``) refuses to
run without each signal the entry ``requires``, naming it, and runs with only those; the signals it ``accepts``
are read when given. The names are the snake_case of the class names.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch

import rolloutopt.allocators as allocators
from rolloutopt.allocators import AllocationResult
from rolloutopt.errors import InputError

NAMES = allocators.names()
PLAN_SIGNALS = {"prompt_entropy"}  # signals that go to ``plan``; the others go to ``update``
#: class names whose acronym mixes cases, so the generic snake_case split does not apply
ACRONYMS = {"AR3PO": "ar3po", "ARRoL": "arrol", "CoBA": "coba"}
#: rollouts per candidate prompt in the step's budget: 8, or what the defaults need to request anything
#: (Pilot-Commit pilots a prompt only when the budget can also commit it: 32 + 96 rollouts)
PER_PROMPT = {"pilot_commit": 128}


def snake(name: str) -> str:
    """``DAPODynamicSampling`` -> ``dapo_dynamic_sampling``, ``V05Budget`` -> ``v05_budget``."""
    if name in ACRONYMS:
        return ACRONYMS[name]
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def make(name: str) -> Any:
    entry = allocators.entry(name)
    kwargs = {"experimental": True} if entry.experimental is not None else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # VIGOR() warns that its defaults are reconstructed
        return allocators.get(name)(**kwargs)


def signal(name: str, result: AllocationResult | None, p: int) -> torch.Tensor:
    """A valid value of signal ``name``: per rollout of ``result`` (``[N]``) or per planned prompt (``[P]``)."""
    if name == "entropy":
        assert result is not None
        return torch.linspace(0.1, 2.0, result.rewards.numel())
    if name in ("hardness", "prompt_entropy"):
        return torch.linspace(0.2, 0.8, p)
    raise AssertionError(f"no test value for signal {name!r}: add one")


def budget(name: str, prompts: torch.Tensor) -> int:
    return PER_PROMPT.get(name, 8) * prompts.numel()


def step(alloc: Any, prompts: torch.Tensor, plan_kw: dict[str, torch.Tensor], name: str) -> AllocationResult:
    """One conversation with fp32 0/1 rewards that vary within every group."""
    plan = alloc.plan(prompts, budget(name, prompts), **plan_kw)
    seen: dict[int, int] = {}
    while (req := plan.next()) is not None:
        values = []
        for pid, c in zip(req.prompt_ids.tolist(), req.counts.tolist(), strict=True):
            for _ in range(c):
                k = seen.get(pid, 0)
                seen[pid] = k + 1
                values.append(float((pid + k) % 2))
        plan.observe(req, torch.tensor(values))
    result: AllocationResult = plan.finish()
    return result


def split(names: tuple[str, ...]) -> tuple[set[str], set[str]]:
    return {n for n in names if n in PLAN_SIGNALS}, {n for n in names if n not in PLAN_SIGNALS}


def test_names_are_the_snake_case_of_the_class_names() -> None:
    assert sorted(NAMES) == NAMES and len(NAMES) == 19
    for name in NAMES:
        assert name == snake(allocators.get(name).__name__)
    assert snake("DAPODynamicSampling") == "dapo_dynamic_sampling" and snake("PilotCommit") == "pilot_commit"
    assert snake("V05Budget") == "v05_budget" and snake("E3Budget") == "e3_budget"


@pytest.mark.parametrize("name", NAMES)
def test_every_allocator_runs_one_step_by_name_and_declares_its_signals(name: str) -> None:
    entry = allocators.entry(name)
    assert entry.name == name and entry.obj is allocators.get(name)
    assert entry.reference, "every allocator names its source"
    assert not set(entry.requires) & set(entry.accepts)
    prompts = torch.arange(10, 18)
    p = prompts.numel()
    plan_req, update_req = split(entry.requires)
    plan_acc, update_acc = split(entry.accepts)

    # with only the required signals: one full step
    alloc = make(name)
    result = step(alloc, prompts, {k: signal(k, None, p) for k in plan_req}, name)
    assert result.rewards.dtype == torch.float32 and result.weight.dtype == torch.float32
    assert 0 < int(result.counts.sum()) <= budget(name, prompts)
    alloc.update(result, **{k: signal(k, result, p) for k in update_req})

    # without each required signal: refused, naming it
    for missing in plan_req:
        fresh = make(name)
        with pytest.raises(InputError) as err:
            fresh.plan(prompts, budget(name, prompts), **{k: signal(k, None, p) for k in plan_req - {missing}})
        assert err.value.argument == missing
    for missing in update_req:
        fresh = make(name)
        res = step(fresh, prompts, {k: signal(k, None, p) for k in plan_req}, name)
        kw: dict[str, Any] = {k: signal(k, res, p) for k in update_req - {missing}}
        with pytest.raises(InputError) as err:
            fresh.update(res, **kw)
        assert err.value.argument == missing
        with pytest.raises(InputError) as err:
            fresh.update(res, **kw, **{missing: None})
        assert err.value.argument == missing

    # with every accepted signal too: the allocator reads them (a second step, from the learnt state)
    result = step(alloc, prompts, {k: signal(k, None, p) for k in plan_req | plan_acc}, name)
    alloc.update(result, **{k: signal(k, result, p) for k in update_req | update_acc})
    alloc.load_state_dict(alloc.state_dict())


def test_unknown_names_and_duplicates_are_refused() -> None:
    with pytest.raises(InputError, match="dps") as err:
        allocators.get("e3")  # the registry name is e3_budget
    assert err.value.argument == "name"
    with pytest.raises(InputError, match="already bound"):
        allocators.register("dps", allocators.GRESO)
    assert allocators.register("dps", allocators.DPS) is allocators.DPS  # the same class again: a no-op


def _replace(result: AllocationResult, **fields: torch.Tensor) -> AllocationResult:
    """A copy of ``result`` with ``fields`` replaced, built without ``__init__``: the test suite's shape checker
    refuses an inconsistent result at construction, users (who run without it) can build one."""
    out = copy.copy(result)
    for name, value in fields.items():
        object.__setattr__(out, name, value)
    return out


def _corrupt(result: AllocationResult, how: str) -> AllocationResult:
    """``result`` with one part made inconsistent (each is a class of bad input that used to reach torch)."""
    p = result.plan_prompt_ids.numel()
    if how == "nan_reward":
        r = result.rewards.clone()
        r[0] = float("nan")
        return _replace(result, rewards=r)
    if how == "short_rewards":
        return _replace(result, rewards=result.rewards[:-1])
    if how == "group_past_plan":
        g = result.group.clone()
        g[0] = p
        return _replace(result, group=g)
    if how == "short_counts":
        return _replace(result, counts=result.counts[:-1])
    if how == "negative_weight":
        w = result.weight.clone()
        w[0] = -1.0
        return _replace(result, weight=w)
    if how == "ids_disagree":
        ids = result.prompt_ids.clone()
        ids[0] = int(result.plan_prompt_ids.max()) + 1
        return _replace(result, prompt_ids=ids)
    raise AssertionError(how)


def _same(a: Any, b: Any) -> bool:
    """Equality of (nested) state dicts holding tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


CORRUPTIONS = {
    "nan_reward": "result.rewards",
    "short_rewards": "result.rewards",
    "group_past_plan": "result.group",
    "short_counts": "result.counts",
    "negative_weight": "result.weight",
    "ids_disagree": "result.prompt_ids",
}


@pytest.mark.parametrize("name", NAMES)
def test_every_allocator_refuses_an_inconsistent_result_and_keeps_its_state(name: str) -> None:
    entry = allocators.entry(name)
    prompts = torch.arange(10, 18)
    p = prompts.numel()
    plan_req, update_req = split(entry.requires)
    alloc = make(name)
    result = step(alloc, prompts, {k: signal(k, None, p) for k in plan_req}, name)
    before = alloc.state_dict()
    for how, field_name in CORRUPTIONS.items():
        bad = _corrupt(result, how)
        with pytest.raises(InputError) as err:
            alloc.update(bad, **{k: signal(k, result, p) for k in update_req})
        assert err.value.argument == field_name, (how, err.value)
        assert "plan" in err.value.fix
    assert _same(before, alloc.state_dict())
    alloc.update(result, **{k: signal(k, result, p) for k in update_req})  # the intact result still works
