"""Shared drivers of the prompt-table tests: the allocators that take ``table=``, a deterministic ``generate``
answering every signal, and the checks that a shared :class:`PromptTable` behaves as private ones.

:func:`check_shared_table` runs owners on private tables and on one shared table side by side, checkpoints the
shared ones through ``torch.save``/``torch.load(weights_only=True)`` into owners built afresh on a fresh table,
and checks that all three go on identically; it returns them for the checks of one allocator.
:func:`check_states_do_not_mix` checks that a private table's state and a shared table's do not load into each
other, nor one owner's state into another, and that ``capacity=`` with ``table=`` is refused.
"""

from __future__ import annotations

import inspect
import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import rolloutopt.allocators as allocators
from rolloutopt.allocators import AllocationResult, Request, run_step
from rolloutopt.allocators.depo import DEPO
from rolloutopt.allocators.table import PromptTable
from rolloutopt.errors import InputError

from .helpers import same_state

Make = Callable[[PromptTable | None], Any]
#: ``step(allocs, s)``: step ``s`` of each owner (plan, answer, update), its results in order
Step = Callable[[list[Any], int], list[Any]]


def takes_table(name: str) -> bool:
    """Whether the registered allocator ``name`` keeps its per-prompt state in a (shareable) prompt table."""
    return "table" in inspect.signature(allocators.get(name)).parameters


#: the registered allocators whose constructor accepts ``table=``
TABLE_NAMES = [name for name in allocators.names() if takes_table(name)]

#: keyword arguments beyond the defaults, so that what an allocator learns in the table changes its plans
#: within a few steps: a new epoch every step or two (DEPO, GRESO and E3 read their table only after one),
#: a decay of the DPS filter (applied to the allocator's own rows only)
EXERCISE: dict[str, dict[str, Any]] = {
    "depo": {"steps_per_epoch": 1},
    "dps": {"decay": 0.7, "prior_alpha": "progress"},
    "e3_budget": {"steps_per_epoch": 2},
    "greso": {
        "n": 4,
        "train_batch_size": 10,
        "sampling_batch_size": 8,
        "min_sampling_batch_size": 2,
        "steps_per_epoch": 1,
    },
}


def build(name: str, table: PromptTable | None = None, **kwargs: Any) -> Any:
    """``allocators.get(name)(table=table, ...)`` with ``experimental=True`` where the entry says the allocator
    is reconstructed, the :data:`EXERCISE` arguments and ``kwargs``."""
    entry = allocators.entry(name)
    args = {"experimental": True} if entry.experimental is not None else {}
    args.update(EXERCISE.get(name, {}), **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a reconstructed allocator's defaults
        return entry.obj(table=table, **args)


def partner(table: PromptTable | None) -> DEPO:
    """The DEPO that shares a table with the allocator under test (it adds rows of its own every step)."""
    return DEPO(n=2, history_k=2, decay=0.3, steps_per_epoch=1, seed=1, table=table)


# -- a deterministic world ------------------------------------------------------------------------------------------
def signal(name: str, req: Request, rollout: torch.Tensor, s: int) -> torch.Tensor:
    """Signal ``name`` for ``req`` at step ``s``, deterministic per prompt (and per rollout: ``rollout`` is each
    rollout's index within its prompt's rollouts of the step): per rollout ``[n]`` or per request row ``[R]``."""
    pid = req.prompt_ids.repeat_interleave(req.counts)
    if name == "entropy":
        return ((pid * 7 + rollout) % 5).double() / 5 + 0.1
    if name == "tokens":
        return ((pid + rollout) % 7 + 3).double()
    if name in ("hardness", "prompt_entropy"):
        return (req.prompt_ids * 0.31 + s).sin().abs().double()
    raise AssertionError(f"no test value for signal {name!r}: add one")


def answer(s: int) -> Callable[[Request], dict[str, torch.Tensor]]:
    """A ``generate`` for :func:`run_step` at step ``s``: every signal a request asks for and, unless it is a
    probe, rewards deterministic per prompt, rollout index and step: prompt ``p`` fails every rollout, succeeds
    every rollout or alternates (success first) as ``(p + s // 3) % 3`` is 0, 1 or 2, so that some groups vary
    and some do not, and a prompt changes kind every three steps."""
    drawn: dict[int, int] = {}  # rollouts of each prompt so far in the step (a multi-round plan asks again)

    def generate(req: Request) -> dict[str, torch.Tensor]:
        index = []
        for pid, c in zip(req.prompt_ids.tolist(), req.counts.tolist(), strict=True):
            index.extend(range(drawn.get(pid, 0), drawn.get(pid, 0) + c))
            drawn[pid] = drawn.get(pid, 0) + c
        rollout = torch.tensor(index, dtype=torch.long)
        out = {name: signal(name, req, rollout, s) for name in req.signals}
        if not req.is_probe:
            kind = (req.prompt_ids.repeat_interleave(req.counts) + s // 3) % 3
            out["rewards"] = torch.where(kind == 2, ((rollout + 1) % 2).double(), (kind == 1).double())
        return out

    return generate


def pools(s: int, owners: int = 3) -> list[torch.Tensor]:
    """Overlapping, different candidate pools of ``owners`` allocators at step ``s`` (owner ``i``: 24 of the ids
    ``15 i .. 15 i + 39``, in a random order)."""
    gen = torch.Generator().manual_seed(s)
    return [15 * i + torch.randperm(40, generator=gen)[:24] for i in range(owners)]


def in_turn(
    per_prompt: int = 6,
    *,
    drive: Callable[[Any, torch.Tensor, int], Any] | None = None,
    at: Callable[[int, int], list[torch.Tensor]] | Sequence[torch.Tensor] = pools,
) -> Step:
    """A step of every owner in turn, each on its pool: ``at(s, owners)`` at step ``s`` (default :func:`pools`),
    or the same pools ``at`` every step. ``drive(alloc, pool, s)`` runs it (plans, answers, updates) and returns
    the result (or a tuple of it and what else to compare); default: :func:`run_step` with ``per_prompt``
    rollouts a prompt (six: some allocators must choose), answered by :func:`answer`."""

    def default(alloc: Any, pool: torch.Tensor, s: int) -> AllocationResult:
        return run_step(alloc, pool, per_prompt * pool.numel(), answer(s))

    def step(allocs: list[Any], s: int) -> list[Any]:
        now = at(s, len(allocs)) if callable(at) else at
        return [(drive or default)(a, pool, s) for a, pool in zip(allocs, now, strict=True)]

    return step


# -- comparisons ------------------------------------------------------------------------------------------------------
RESULT_FIELDS = ("prompt_ids", "group", "rewards", "weight", "plan_prompt_ids", "counts", "reasons")


def same_results(xs: Sequence[Any], ys: Sequence[Any]) -> None:
    """The results are identical: every per-rollout and per-prompt tensor, the reason names, the metrics and
    the signals (an entry may be a tuple of a result and what else a step returned, compared as states)."""
    for x, y in zip(xs, ys, strict=True):
        if not isinstance(x, AllocationResult):
            assert isinstance(x, tuple) and isinstance(y, tuple) and len(x) == len(y)
            same_results(x[:1], y[:1])
            assert same_state(x[1:], y[1:])
            continue
        for name in RESULT_FIELDS:
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert x.reason_names == y.reason_names
        assert same_state(x.metrics, y.metrics)
        assert same_state(x.signals, y.signals)  # NaN: a prompt the signal was not measured for


def table_paths(state: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Where an allocator's ``state_dict`` holds its place in a table (``{"owner": ..., "rows": ...}``)."""
    if not isinstance(state, dict):
        return []
    if set(state) == {"owner", "rows"}:
        return [path]
    return [p for k, v in state.items() for p in table_paths(v, (*path, k))]


def named(path: tuple[str, ...]) -> str:
    """``("table", "rows")`` -> ``"state['table']['rows']"``, as an ``InputError`` names a part of a state."""
    return "state" + "".join(f"[{k!r}]" for k in path)


def without_tables(state: Any) -> Any:
    """``state`` with its places in tables (owner name, private rows) left out: what does not depend on the
    table being private or shared."""
    if isinstance(state, dict):
        if set(state) == {"owner", "rows"}:
            return None
        return {k: without_tables(v) for k, v in state.items()}
    return state


def owned(table: PromptTable, owner: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The prompts ``owner`` has seen in ``table`` (sorted) and its columns on their rows, by short name."""
    state = table.state_dict()
    seen = state["columns"][f"{owner}/seen"]
    prefix = f"{owner}/"
    cols = {k[len(prefix) :]: v[seen] for k, v in state["columns"].items() if k.startswith(prefix)}
    return state["prompt_ids"][seen], cols


def expected_owners(makes: Sequence[Make]) -> list[tuple[str, ...]]:
    """The names each of ``makes`` registers on a shared table, in turn: an allocator's names on a table of its
    own, with ``"#2"``, ``"#3"``, ... for a name registered before."""
    taken: list[str] = []
    out = []
    for make in makes:
        alone = PromptTable()
        make(alone)
        mine = []
        for owner in alone.owners:
            name, k = owner, 1
            while name in taken:
                k += 1
                name = f"{owner}#{k}"
            taken.append(name)
            mine.append(name)
        out.append(tuple(mine))
    return out


@dataclass
class Shared:
    """What :func:`check_shared_table` ran: the owners on private tables, on ``table`` and, resumed from the
    checkpoint, on ``resumed_table``; ``owners[i]``: the names of ``shared[i]`` in ``table``; ``results[s]``:
    what step ``s`` returned (the same for all three)."""

    private: list[Any]
    shared: list[Any]
    resumed: list[Any]
    table: PromptTable
    resumed_table: PromptTable
    owners: list[tuple[str, ...]]
    results: list[list[Any]]


def check_like_private(
    private: list[Any], shared: list[Any], table: PromptTable, owners: list[tuple[str, ...]]
) -> None:
    """The owners on ``table`` learnt what the private ones did: the same state beyond the table, the same
    prompts seen and the same values in their columns on them; the table holds the union of the private rows."""
    union = torch.cat([p.table.prompt_ids for p in private]).unique()
    assert torch.equal(table.prompt_ids, union)
    for p, s, names in zip(private, shared, owners, strict=True):
        assert same_state(without_tables(p.state_dict()), without_tables(s.state_dict()))
        assert len(p.table.owners) == len(names)
        for mine, theirs in zip(p.table.owners, names, strict=True):
            ids, cols = owned(p.table, mine)
            shared_ids, shared_cols = owned(table, theirs)
            assert torch.equal(shared_ids, ids) and same_state(shared_cols, cols), theirs


def check_shared_table(makes: Sequence[Make], step: Step, *, first: int = 3, then: int = 3) -> Shared:
    """Owners ``makes[i](table)`` (``makes[i](None)``: on a private table) sharing one :class:`PromptTable` plan
    and learn exactly as on private tables over ``first`` steps (``step(allocs, s)`` runs step ``s`` of each);
    ``table.state_dict()`` and each owner's ``state_dict()``, through ``torch.save`` and
    ``torch.load(weights_only=True)``, restore owners built in the same order on a fresh table, which go on as
    the private and the shared ones for ``then`` more steps and end in the same state."""
    private = [make(None) for make in makes]
    table = PromptTable()
    shared = [make(table) for make in makes]
    owners = expected_owners(makes)
    assert table.owners == tuple(name for names in owners for name in names)
    assert all(a.table is table for a in shared) and all(p.table is not table for p in private)
    results = []
    for s in range(first):
        results.append(step(private, s))
        same_results(results[-1], step(shared, s))
    check_like_private(private, shared, table, owners)
    assert all(owned(table, name)[0].numel() for names in owners for name in names)  # every owner has rows

    buf = io.BytesIO()
    torch.save({"table": table.state_dict(), "owners": [a.state_dict() for a in shared]}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed_table = PromptTable()
    resumed = [make(resumed_table) for make in makes]
    resumed_table.load_state_dict(ckpt["table"])
    for a, state in zip(resumed, ckpt["owners"], strict=True):
        a.load_state_dict(state)
    for s in range(first, first + then):
        results.append(step(private, s))
        same_results(results[-1], step(shared, s))
        same_results(results[-1], step(resumed, s))
    check_like_private(private, shared, table, owners)
    assert same_state(resumed_table.state_dict(), table.state_dict())
    for a, b in zip(resumed, shared, strict=True):
        assert same_state(a.state_dict(), b.state_dict())
    return Shared(private, shared, resumed, table, resumed_table, owners, results)


def check_states_do_not_mix(make: Callable[..., Any], step: Step) -> None:
    """``make(table=..., **kwargs)``: a private table's state does not load into an owner of a shared table,
    nor the reverse, nor a second owner's state into the first (an ``InputError`` naming the part of the state,
    and the allocator keeps its own); ``capacity=`` with ``table=`` is refused, naming ``capacity``."""
    table = PromptTable()
    private, first, second = make(table=None), make(table=table), make(table=table)
    step([private, first, second], 0)
    (at,) = table_paths(private.state_dict())
    for into, state, part in (
        (first, private.state_dict(), "rows"),
        (private, first.state_dict(), "rows"),
        (first, second.state_dict(), "owner"),
    ):
        before = (into.state_dict(), into.table.state_dict())
        with pytest.raises(InputError) as err:
            into.load_state_dict(state)
        assert err.value.argument == named((*at, part))
        assert same_state((into.state_dict(), into.table.state_dict()), before)
    with pytest.raises(InputError) as err:
        make(table=PromptTable(), capacity=5)
    assert err.value.argument == "capacity"
