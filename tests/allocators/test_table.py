"""PromptTable: hand examples, a naive reference model (dicts) under random adds, eviction, checkpoints, bad input."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators import PromptTable
from rolloutopt.allocators.table import Column, open_table
from rolloutopt.errors import InputError

F64 = torch.float64


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


def _table(capacity: int = 4) -> tuple[PromptTable, Any, Any]:
    t = PromptTable(capacity=capacity)
    a = t.register("a", {"x": Column("float", fill=math.nan, checks=("finite_or_nan",))})
    b = t.register("a", {"w": Column("int", (2,), fill=0, checks=("nonneg",))})
    return t, a, b


def test_hand_example_rows_fills_and_owners() -> None:
    t, a, b = _table()
    assert t.owners == ("a", "a#2") and len(t) == 0 and a.empty
    pos, order = a.add(ids(5, 3, 5))  # rows of ids[order] = [3, 5, 5], increasing
    assert order.tolist() == [1, 0, 2] and pos.tolist() == [0, 1, 1]
    assert t.prompt_ids.tolist() == [3, 5]
    a["x"].index_copy_(0, pos[:2], torch.tensor([1.5, 2.5], dtype=F64))
    assert torch.isnan(b["w"]).sum() == 0 and b["w"].tolist() == [[0, 0], [0, 0]]  # b's fills
    p, seen = a.find(ids(5, 9, 3))
    assert seen.tolist() == [True, False, True] and a["x"][p[seen]].tolist() == [2.5, 1.5]
    assert b.find(ids(3, 5))[1].tolist() == [False, False]  # rows exist, but b never added them
    b.add(ids(7))
    assert t.prompt_ids.tolist() == [3, 5, 7]
    assert torch.isnan(a["x"][2]) and a["seen"].tolist() == [True, True, False]  # a's fill on b's row


def test_eviction_least_recent_ties_toward_smaller_id_and_the_call_is_kept() -> None:
    t, a, b = _table(capacity=3)
    a.add(ids(4, 2))  # clock 1
    b.add(ids(9))  # clock 2
    a.add(ids(9, 1))  # clock 3: full (4 rows), evict the least recent: 2 and 4 tie at clock 1 -> 2 goes
    assert t.prompt_ids.tolist() == [1, 4, 9]
    a.add(ids(4, 6))  # clock 4: evict the least recent of the others: 9 and 1 (clock 3) -> 1 goes (smaller id)
    assert t.prompt_ids.tolist() == [4, 6, 9]
    assert a.find(ids(2))[1].tolist() == [False]
    with pytest.raises(InputError, match=r"prompt_ids.*capacity=3"):
        a.add(ids(4, 10, 11, 12))  # 4 distinct prompts in one call
    assert t.prompt_ids.tolist() == [4, 6, 9]  # refused before anything changed


def test_state_round_trip_with_weights_only() -> None:
    t, a, b = _table(capacity=4)
    a.add(ids(3, 5))
    a["x"][0] = 0.25
    b.add(ids(5, 8))
    b["w"][1:] = 3
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)
    buf.seek(0)
    t2, a2, _ = _table(capacity=3)  # a smaller capacity: the 3 rows fit
    t2.load_state_dict(torch.load(buf, weights_only=True))
    for key, col in t.state_dict()["columns"].items():
        assert torch.equal(col, t2.state_dict()["columns"][key]) or bool(torch.isnan(col).any()), key
    assert torch.equal(a2["x"].nan_to_num(-1), a["x"].nan_to_num(-1))
    a.add(ids(9, 10))
    a2.add(ids(9, 10))  # the same eviction continues on the loaded table
    assert torch.equal(t.prompt_ids, ids(5, 8, 9, 10)) and torch.equal(t2.prompt_ids, ids(8, 9, 10))


def _with(state: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if len(path) == 1:
        return {**state, path[0]: value}
    return {**state, path[0]: _with(state[path[0]], path[1:], value)}


def test_load_refuses_corrupted_or_foreign_states_naming_the_field() -> None:
    t, a, _ = _table()
    a.add(ids(1, 2, 3))
    good = t.state_dict()
    cols = dict(good["columns"])
    cases: list[tuple[tuple[str, ...], Any, str]] = [
        (("prompt_ids",), ids(3, 2, 1), "state['prompt_ids']"),
        (("touch",), ids(1, 1), "state['touch']"),
        (("touch",), ids(1, 1, 7), "state['touch']"),  # a row touched after the clock
        (("clock",), -1, "state['clock']"),
        (("columns", "a/x"), torch.full((3,), math.inf, dtype=F64), "state['columns']['a/x']"),
        (("columns", "a#2/w"), torch.zeros(3, 3, dtype=torch.long), "state['columns']['a#2/w']"),
        (("columns", "a#2/w"), torch.full((3, 2), -1), "state['columns']['a#2/w']"),
        (("columns",), {k: v for k, v in cols.items() if k != "a/x"}, "state['columns']"),
        (("columns",), {**cols, "b/y": torch.zeros(3)}, "state['columns']"),
    ]
    for path, value, argument in cases:
        t2, _, _ = _table()
        with pytest.raises(InputError) as err:
            t2.load_state_dict(_with(good, path, value))
        assert err.value.argument == argument, (path, err.value)
        assert len(t2) == 0
    with pytest.raises(InputError) as err:
        _table(capacity=2)[0].load_state_dict(good)
    assert err.value.argument == "state['prompt_ids']"


def test_owner_state_private_and_shared() -> None:
    cols = {"x": Column("float", fill=0.0)}
    private = open_table(None, 10, "o", cols)
    assert private.private and private.table.capacity == 10
    private.add(ids(1))
    saved = private.state()
    shared = open_table(PromptTable(), None, "o", cols)
    with pytest.raises(InputError) as err:
        shared.load(saved)
    assert err.value.argument == "state['table']['rows']"
    with pytest.raises(InputError) as err:
        open_table(None, None, "o", cols).load(shared.state())
    assert err.value.argument == "state['table']['rows']"
    with pytest.raises(InputError) as err:
        open_table(None, None, "p", cols).load(saved)
    assert err.value.argument == "state['table']['owner']"
    other = open_table(None, None, "o", cols)
    other.load(saved)
    assert other.table.prompt_ids.tolist() == [1]


def test_bad_input() -> None:
    with pytest.raises(InputError, match="capacity"):
        PromptTable(capacity=0)
    t = PromptTable()
    for owner in ("", "a/b", 3):
        with pytest.raises(InputError, match="owner"):
            t.register(owner, {})  # type: ignore[arg-type]
    for columns in ({"seen": Column("int")}, {"a/b": Column("int")}, {"x": "int"}, []):
        with pytest.raises(InputError, match="columns"):
            t.register("o", columns)  # type: ignore[arg-type]
    for kwargs, argument in (
        ({"kind": "complex"}, "kind"),
        ({"kind": "int", "shape": (0,)}, "shape"),
        ({"kind": "int", "fill": "0"}, "fill"),
        ({"kind": "int", "checks": ("ids",)}, "checks"),
    ):
        with pytest.raises(InputError) as err:
            Column(**kwargs)
        assert err.value.argument == argument
    with pytest.raises(InputError, match="table"):
        open_table({}, None, "o", {})
    with pytest.raises(InputError, match="capacity"):
        open_table(t, 5, "o", {})
    with pytest.raises(InputError, match="state"):
        t.load_state_dict([])  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 6),
    calls=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 9), min_size=1, max_size=4)), max_size=12),
)
def test_matches_a_naive_model(capacity: int, calls: list[tuple[bool, list[int]]]) -> None:
    """Random adds by two owners: the same rows, seen flags and values as a dict model with the documented
    eviction (least recently added by any owner, ties toward the smaller id, never a prompt of the call)."""
    t = PromptTable(capacity=capacity)
    views = [t.register(name, {"n": Column("int", fill=0)}) for name in ("a", "b")]
    model: dict[int, dict[str, Any]] = {}
    clock = 0
    for which, xs in calls:
        distinct = sorted(set(xs))
        if len(distinct) > capacity:
            with pytest.raises(InputError):
                views[which].add(torch.tensor(xs))
            continue
        clock += 1
        new = [x for x in distinct if x not in model]
        overflow = len(model) + len(new) - capacity
        if overflow > 0:
            for _, x in sorted((v["touch"], x) for x, v in model.items() if x not in distinct)[:overflow]:
                del model[x]
        for x in distinct:
            row = model.setdefault(x, {"touch": 0, "seen": [False, False], "n": [0, 0]})
            row["touch"], row["seen"][which] = clock, True
            row["n"][which] += 1
        pos, _ = views[which].add(torch.tensor(xs))
        first = torch.ones(len(xs), dtype=torch.bool)
        first[1:] = pos[1:] != pos[:-1]
        views[which]["n"].index_add_(0, pos[first], torch.ones(int(first.sum()), dtype=torch.long))
        assert t.prompt_ids.tolist() == sorted(model)
        for k, view in enumerate(views):
            assert view["seen"].tolist() == [model[x]["seen"][k] for x in sorted(model)]
            assert view["n"].tolist() == [model[x]["n"][k] for x in sorted(model)]
