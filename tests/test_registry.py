"""``rolloutopt.registry.Registry`` and the built-in registries of advantage estimators and loss presets."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import rolloutopt
from rolloutopt.errors import InputError
from rolloutopt.registry import Registry


def one() -> int:
    return 1


def two() -> int:
    return 2


def test_register_get_names() -> None:
    reg: Registry[Callable[[], int]] = Registry("estimator")
    assert reg.kind == "estimator"
    assert reg.names() == []
    assert reg.register("b", two) is two
    reg.register("a", one)
    assert reg.get("a") is one
    assert reg.get("b") is two
    assert reg.names() == ["a", "b"]  # sorted, not insertion order
    assert "a" in reg
    assert "c" not in reg
    assert 3 not in reg
    assert ["a"] not in reg  # unhashable: not an error


def test_same_object_twice_is_a_no_op() -> None:
    reg: Registry[Callable[[], int]] = Registry("estimator")
    reg.register("a", one)
    reg.register("a", one)
    assert reg.names() == ["a"]
    assert reg.get("a") is one


def test_duplicate_raises_and_keeps_the_first() -> None:
    reg: Registry[Callable[[], int]] = Registry("estimator")
    reg.register("a", one)
    with pytest.raises(InputError, match=r"^name: expected a estimator name that is not registered yet, got 'a'.*"):
        reg.register("a", two)
    assert reg.get("a") is one
    with pytest.raises(InputError, match=r"overwrite=True"):
        reg.register("a", two)


def test_overwrite() -> None:
    reg: Registry[Callable[[], int]] = Registry("estimator")
    reg.register("a", one)
    assert reg.register("a", two, overwrite=True) is two
    assert reg.get("a") is two
    assert reg.names() == ["a"]


def test_decorator() -> None:
    reg: Registry[Callable[[], int]] = Registry("preset")

    @reg.decorator("three")
    def three() -> int:
        return 3

    assert three() == 3  # the decorated function itself is returned
    assert reg.get("three") is three
    with pytest.raises(InputError, match=r"^name: "):

        @reg.decorator("three")
        def other() -> int:
            return 4


def test_unknown_name_lists_the_known_names() -> None:
    reg: Registry[Callable[[], int]] = Registry("estimator")
    reg.register("grpo", one)
    reg.register("rloo", two)
    with pytest.raises(InputError, match=r"^name: expected a registered estimator: grpo, rloo, got 'gpro'") as info:
        reg.get("gpro")
    assert info.value.argument == "name"
    with pytest.raises(InputError, match=r"grpo, rloo"):
        reg.get("GRPO")  # case-sensitive
    with pytest.raises(InputError, match=r"grpo, rloo"):
        reg.get(["grpo"])  # type: ignore[arg-type]  # unhashable


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_name(bad: object) -> None:
    reg: Registry[Callable[[], int]] = Registry("estimator")
    with pytest.raises(InputError, match=r"^name: expected a non-empty string"):
        reg.register(bad, one)  # type: ignore[arg-type]
    assert reg.names() == []


def test_builtin_advantage_names() -> None:
    names = rolloutopt.advantages.names()
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"} <= set(names)
    assert names == sorted(names)
    assert rolloutopt.advantages.get("grpo") is rolloutopt.advantages.grpo
    assert rolloutopt.advantages.get("rloo") is rolloutopt.advantages.rloo
    with pytest.raises(InputError, match=r"dr_grpo.*grpo"):
        rolloutopt.advantages.get("nope")


def test_builtin_loss_names() -> None:
    names = rolloutopt.losses.names()
    assert {"grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo"} <= set(names)
    assert names == sorted(names)
    assert isinstance(rolloutopt.losses.get("dapo"), rolloutopt.losses.Preset)
    assert rolloutopt.losses.get("dapo") is not rolloutopt.losses.get("grpo")
    with pytest.raises(InputError, match=r"cispo.*dapo"):
        rolloutopt.losses.get("nope")


def test_builtin_allocator_names() -> None:
    import inspect

    import torch

    import rolloutopt.allocators as alloc

    names = alloc.names()
    assert names == sorted(names) and len(names) == 19
    assert alloc.get("dps") is alloc.DPS and alloc.get("uniform") is alloc.Uniform
    for name in names:  # every registered class constructs from keywords alone (experimental ones acknowledged)
        cls = alloc.get(name)
        kw = {"experimental": True} if "experimental" in inspect.signature(cls).parameters else {}
        obj = cls(**kw)
        assert callable(obj.plan) and isinstance(obj.state_dict(), dict)
    res = alloc.get("uniform")().plan(torch.tensor([1, 2]), 4).next()
    assert res is not None and res.counts.tolist() == [2, 2]
    with pytest.raises(InputError, match=r"dps.*greso"):
        alloc.get("nope")
    with pytest.raises(InputError, match="name"):
        alloc.register("dps", alloc.Uniform)
