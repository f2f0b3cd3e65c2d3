"""The allocator registry: every registered allocator, constructed by name, runs one step and declares its signals.

For each name: ``get(name)(...)`` with the default arguments (``experimental=True`` where the entry says the
allocator is reconstructed) runs one step through :func:`rolloutopt.allocators.run_step`; every request names
the signals to collect, ``observe`` refuses to go on without each signal the entry ``requires`` and refuses a
signal the request did not ask for, naming it; the signals it ``accepts`` reach ``result.signals`` when given.
Every ``update`` refuses an inconsistent result and keeps its state. The names are the snake_case of the class
names.
"""

from __future__ import annotations

import copy
import io
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import rolloutopt.allocators as allocators
from rolloutopt.allocators import SIGNALS, AllocationResult, Request, run_step
from rolloutopt.errors import InputError

from .helpers import same_state

NAMES = allocators.names()
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


def signal(name: str, req: Request) -> torch.Tensor:
    """A valid value of signal ``name`` for ``req``: per rollout ``[n]`` or per request row ``[R]``."""
    if name == "entropy":
        return torch.linspace(0.1, 2.0, req.total)
    if name == "tokens":
        return torch.arange(req.total) % 7 + 3.0
    if name in ("hardness", "prompt_entropy"):
        return torch.linspace(0.2, 0.8, req.prompt_ids.numel())
    raise AssertionError(f"no test value for signal {name!r}: add one")


def budget(name: str, prompts: torch.Tensor) -> int:
    return PER_PROMPT.get(name, 8) * prompts.numel()


def answer(give: set[str]) -> Callable[[Request], Any]:
    """A ``generate`` for :func:`run_step`: fp32 0/1 rewards that vary within every group, and the signals of
    ``give`` that each request asks for (a probe gets its signals only)."""
    seen: dict[int, int] = {}

    def generate(req: Request) -> dict[str, torch.Tensor | None]:
        out: dict[str, torch.Tensor | None] = {s: signal(s, req) for s in req.signals if s in give}
        if req.is_probe:
            return out
        values = []
        for pid, c in zip(req.prompt_ids.tolist(), req.counts.tolist(), strict=True):
            for _ in range(c):
                k = seen.get(pid, 0)
                seen[pid] = k + 1
                values.append(float((pid + k) % 2))
        out["rewards"] = torch.tensor(values)
        return out

    return generate


def step(alloc: Any, prompts: torch.Tensor, name: str, give: set[str] | None = None) -> AllocationResult:
    """One conversation (plan ... finish, no update) answering the signals of ``give`` (default: required)."""
    give = set(allocators.entry(name).requires) if give is None else give
    return run_step(alloc, prompts, budget(name, prompts), answer(give), update=False)


def test_names_are_the_snake_case_of_the_class_names() -> None:
    assert sorted(NAMES) == NAMES and len(NAMES) == 19
    for name in NAMES:
        assert name == snake(allocators.get(name).__name__)
    assert snake("DAPODynamicSampling") == "dapo_dynamic_sampling" and snake("PilotCommit") == "pilot_commit"
    assert snake("V05Budget") == "v05_budget" and snake("E3Budget") == "e3_budget"


# two steps on one pool repeat prompts within epoch 0: GRESO warns that its epoch was never set (as it should)
@pytest.mark.filterwarnings("ignore:GRESO.*epoch:UserWarning")
@pytest.mark.parametrize("name", NAMES)
def test_every_allocator_runs_one_step_by_name_and_declares_its_signals(name: str) -> None:
    entry = allocators.entry(name)
    assert entry.name == name and entry.obj is allocators.get(name)
    assert entry.reference, "every allocator names its source"
    assert not set(entry.requires) & set(entry.accepts)
    assert set(entry.requires) | set(entry.accepts) <= set(SIGNALS)
    prompts = torch.arange(10, 18)
    required, accepted = set(entry.requires), set(entry.accepts)

    # with only the required signals: one full step through the driver, which also updates
    alloc = make(name)
    result = run_step(alloc, prompts, budget(name, prompts), answer(required))
    assert result.rewards.dtype == torch.float32 and result.weight.dtype == torch.float32
    assert 0 < int(result.counts.sum()) <= budget(name, prompts)
    assert set(result.signals) == required

    # every request names what to collect: the declared rollout/prompt signals (probes: their own)
    plan = make(name).plan(prompts, budget(name, prompts))
    req = plan.next()
    assert req is not None
    collect = {s for s in required | accepted if SIGNALS[s] != "probe"}
    assert set(req.signals) == ({s for s in required | accepted if SIGNALS[s] == "probe"} if req.is_probe else collect)

    # without each required signal: observe refuses, naming it
    for missing in required:
        plan = make(name).plan(prompts, budget(name, prompts))
        give = answer(required - {missing})
        with pytest.raises(InputError) as err:
            while (req := plan.next()) is not None:
                out = dict(give(req))
                plan.observe(req, out.pop("rewards", None), **out)
        assert err.value.argument == missing

    # a signal the request did not ask for is refused, naming it
    plan = make(name).plan(prompts, budget(name, prompts))
    req = plan.next()
    assert req is not None
    undeclared = next(s for s in SIGNALS if s not in req.signals and SIGNALS[s] != "probe")
    out = dict(answer(required)(req))
    with pytest.raises(InputError) as err:
        plan.observe(req, out.pop("rewards", None), **out, **{undeclared: signal(undeclared, req)})
    assert err.value.argument == undeclared

    # with every accepted signal too: the result carries them and the allocator reads them (a second step)
    result = step(alloc, prompts, name, required | accepted)
    assert set(result.signals) == required | accepted
    alloc.update(result)
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
    prompts = torch.arange(10, 18)
    alloc = make(name)
    result = step(alloc, prompts, name)
    before = alloc.state_dict()
    for how, field_name in CORRUPTIONS.items():
        bad = _corrupt(result, how)
        with pytest.raises(InputError) as err:
            alloc.update(bad)
        assert err.value.argument == field_name, (how, err.value)
        assert "plan" in err.value.fix
    assert same_state(before, alloc.state_dict())
    alloc.update(result)  # the intact result still works


def _steps(alloc: Any, name: str, steps: range, give: set[str]) -> list[AllocationResult]:
    """Steps through the driver; rewards depend on the prompt, the rollout's index and the step."""
    prompts = torch.arange(10, 26)
    out = []
    for s in steps:

        def generate(req: Request, s: int = s) -> dict[str, torch.Tensor]:
            base = answer(give)(req)
            if "rewards" in base:
                base["rewards"] = (base["rewards"] + s + (req.prompt_ids.repeat_interleave(req.counts) // 3)) % 2
            return base

        out.append(run_step(alloc, prompts, budget(name, prompts), generate))
    return out


@pytest.mark.filterwarnings("ignore:GRESO.*epoch:UserWarning")
@pytest.mark.parametrize("name", NAMES)
def test_every_allocator_continues_identically_after_a_checkpoint(name: str) -> None:
    """Six steps in one go against three steps, ``torch.save``, ``torch.load(weights_only=True)`` into a fresh
    allocator and three more: the last three results and the final state are identical."""
    entry = allocators.entry(name)
    give = set(entry.requires) | set(entry.accepts)
    whole = make(name)
    want = _steps(whole, name, range(6), give)
    first = make(name)
    _steps(first, name, range(3), give)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make(name)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    got = _steps(resumed, name, range(3, 6), give)
    for a, b in zip(want[3:], got, strict=True):
        for field_name in ("prompt_ids", "group", "rewards", "weight", "plan_prompt_ids", "counts", "reasons"):
            assert torch.equal(getattr(a, field_name), getattr(b, field_name)), field_name
        assert a.signals.keys() == b.signals.keys()
    assert same_state(whole.state_dict(), resumed.state_dict())


@pytest.mark.filterwarnings("ignore:GRESO.*epoch:UserWarning")
@pytest.mark.parametrize("name", NAMES)
def test_every_allocator_copes_with_no_prompt_and_no_budget(name: str) -> None:
    entry = allocators.entry(name)
    give = set(entry.requires) | set(entry.accepts)
    for prompts, b in ((torch.zeros(0, dtype=torch.long), 64), (torch.arange(4), 0)):
        alloc = make(name)
        result = run_step(alloc, prompts, b, answer(give))
        assert int(result.counts.sum()) == 0 and result.rewards.numel() == 0
        assert result.plan_prompt_ids.tolist() == prompts.tolist()


def _tensor_keys(state: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths to the tensors of a (nested) state dict with at least two rows."""
    out = []
    for k, v in state.items():
        if isinstance(v, dict):
            out += _tensor_keys(v, (*prefix, k))
        elif isinstance(v, torch.Tensor) and v.ndim >= 1 and v.shape[0] >= 2 and v.dtype != torch.uint8:
            out.append((*prefix, k))
    return out


def _with(state: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(state)
    d = out
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return out


def _get(state: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        state = state[k]
    return state


@pytest.mark.filterwarnings("ignore:GRESO.*epoch:UserWarning")
@pytest.mark.parametrize("name", NAMES)
def test_every_allocator_refuses_a_corrupted_state_and_keeps_its_own(name: str) -> None:
    """Unknown or missing keys, a truncated tensor, a string for a tensor, another allocator's state: an
    ``InputError`` at load time, and the allocator goes on as if the load had not been tried."""
    entry = allocators.entry(name)
    give = set(entry.requires) | set(entry.accepts)
    alloc, twin = make(name), make(name)
    _steps(alloc, name, range(3), give)
    _steps(twin, name, range(3), give)
    good = alloc.state_dict()
    other = make("uniform" if name != "uniform" else "dps")
    _steps(other, "uniform" if name != "uniform" else "dps", range(1), set())
    bad: list[tuple[str, Any]] = [
        ("unknown key", {**good, "surprise": torch.zeros(1)}),
        ("foreign state", other.state_dict()),
        ("not a dict", "state"),
    ]
    for k in good:
        if k != "format":  # a state without its format version loads as version 1 (saved before versions)
            bad.append((f"missing {k}", {kk: v for kk, v in good.items() if kk != k}))
    if "format" in good:
        bad.append(("another format version", {**good, "format": 2}))
    for path in _tensor_keys(good):
        bad.append((f"truncated {'.'.join(path)}", _with(good, path, _get(good, path)[:-1])))
        bad.append((f"string for {'.'.join(path)}", _with(good, path, "not a tensor")))
    for what, state in bad:
        if what == "foreign state" and same_state(state, good):
            continue  # an allocator with no state (Uniform, DARS, VIGOR): every empty state is its own
        with pytest.raises(InputError):
            alloc.load_state_dict(state)
            pytest.fail(f"{name}: accepted a state with {what}")
    a, b = _steps(alloc, name, range(3, 5), give), _steps(twin, name, range(3, 5), give)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.counts, y.counts) and torch.equal(x.rewards, y.rewards)
    assert same_state(alloc.state_dict(), twin.state_dict())


@pytest.mark.parametrize("name", ["knapsack", "dots", "coba"])
def test_update_does_not_depend_on_how_the_groups_rows_interleave(name: str) -> None:
    """The rows of a result arrive grouped from a one-request plan (a fast path skips the sort) or interleaved
    from a trainer that merges results: with each group's own order kept, the learnt state is the same."""
    grouped_alloc, mixed_alloc = make(name), make(name)
    prompts = torch.arange(10, 26)
    for _ in range(4):
        plan_res = run_step(grouped_alloc, prompts, budget(name, prompts), answer(set()), update=False)
        twin = run_step(mixed_alloc, prompts, budget(name, prompts), answer(set()), update=False)
        assert torch.equal(plan_res.counts, twin.counts)
        # round-robin over the groups: row k of every group, then row k + 1, ...; each group's order kept
        within = torch.zeros_like(twin.group)
        for g in twin.group.unique():
            at = (twin.group == g).nonzero().squeeze(1)
            within[at] = torch.arange(at.numel())
        order = torch.argsort(within * (int(twin.group.max()) + 1) + twin.group, stable=True)
        assert not torch.equal(order, torch.arange(order.numel()))
        mixed = _replace(
            twin,
            prompt_ids=twin.prompt_ids[order],
            group=twin.group[order],
            rewards=twin.rewards[order],
            weight=twin.weight[order],
        )
        grouped_alloc.update(plan_res)
        mixed_alloc.update(mixed)
    assert same_state(grouped_alloc.state_dict(), mixed_alloc.state_dict())
