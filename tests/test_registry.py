"""``rolloutopt.registry`` (``Registry``, ``Entry``, ``check_inputs``, ``Method``, ``MethodRegistry``) and the
built-in registries of advantage estimators, loss presets and allocators."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import rolloutopt
from rolloutopt.advantages import ShapedRewards
from rolloutopt.errors import InputError
from rolloutopt.registry import Entry, Method, MethodRegistry, Registry, check_inputs


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
    assert names == sorted(names) and len(names) == 14
    assert rolloutopt.advantages.get("grpo").fn is rolloutopt.advantages.grpo
    assert rolloutopt.advantages.get("rloo").fn is rolloutopt.advantages.rloo
    assert rolloutopt.advantages.entry("rloo").obj is rolloutopt.advantages.get("rloo")
    with pytest.raises(InputError, match=r"dr_grpo.*grpo"):
        rolloutopt.advantages.get("nope")
    with pytest.raises(InputError, match=r"registered advantage estimator"):
        rolloutopt.advantages.get("fapo_penalty")  # a reward shaper, in its own registry
    assert rolloutopt.advantages.SHAPERS.get("fapo_penalty").fn is rolloutopt.advantages.fapo_penalty


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


# ---------------------------------------------------------------------------------------------- Entry, users


class Declared:
    """An object that declares its inputs as attributes (as a loss Preset or an allocator class does)."""

    requires = ("mask",)
    accepts = ("valid", "logp")
    reference = "arXiv 0000.00000"
    experimental = "a reconstructed part"


def test_declarations_are_read_from_the_object() -> None:
    reg: Registry[Any] = Registry("thing")
    obj = Declared()
    reg.register("declared", obj)
    e = reg.entry("declared")
    assert e == Entry("declared", obj, ("mask",), ("valid", "logp"), "arXiv 0000.00000", "a reconstructed part")
    reg.register("plain", one)  # a function declares nothing
    assert reg.entry("plain") == Entry("plain", one)
    assert reg.entries() == [reg.entry("declared"), reg.entry("plain")]


def test_explicit_declarations_override_the_object() -> None:
    reg: Registry[Any] = Registry("thing")
    obj = Declared()
    reg.register("x", obj, requires=["logp"], accepts=(), reference="arXiv 1111.11111", experimental=None)
    e = reg.entry("x")
    assert (e.requires, e.accepts, e.reference) == (("logp",), (), "arXiv 1111.11111")
    assert e.experimental == "a reconstructed part"  # None means "not given": the object's reason stays
    with pytest.raises(InputError, match=r"^requires: expected a tuple of input names"):
        reg.register("y", one, requires="mask")  # a bare string is not a tuple of names
    with pytest.raises(InputError, match=r"^accepts: "):
        reg.register("y", one, accepts=("valid", ""))
    assert "y" not in reg


def test_users_lists_every_entry_that_requires_or_accepts_an_input() -> None:
    reg: Registry[Any] = Registry("thing")
    reg.register("b", one, requires=("mask",))
    reg.register("a", two, accepts=("mask", "valid"))
    reg.register("c", Declared())
    assert reg.users("mask") == ["a", "b", "c"]  # sorted by name
    assert reg.users("valid") == ["a", "c"]
    assert reg.users("entropy") == []


def test_check_inputs() -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    check_inputs({"mask": mask, "valid": None}, requires=("mask",), accepts=(), by="the 'x' method")
    with pytest.raises(InputError, match=r"^mask: expected mask=\.\.\., required by the 'x' method") as info:
        check_inputs({"mask": None}, requires=("mask",), accepts=(), by="the 'x' method")
    assert info.value.argument == "mask"
    with pytest.raises(InputError, match=r"entropy=.*\(the method 'd3s' would\)") as info:
        check_inputs({"entropy": mask}, requires=(), accepts=("valid",), by="the 'x' method", users=lambda n: ["'d3s'"])
    assert info.value.argument == "entropy"
    check_inputs({"entropy": mask}, requires=(), accepts=(), by="the 'x' method", allow_unused=True)
    with pytest.raises(InputError, match=r"^mask: "):  # allow_unused does not excuse a missing required input
        check_inputs({}, requires=("mask",), accepts=(), by="the 'x' method", allow_unused=True)


# ---------------------------------------------------------------------------------------------- Method


@dataclass(frozen=True)
class Result:
    value: torch.Tensor


def scaled(rewards: torch.Tensor, group: Any, mask: torch.Tensor, *, valid: Any = None, k: float = 2.0) -> Result:
    """k · rewards · (number of masked-in tokens per row), 0 where valid is False."""
    out = k * rewards * mask.sum(-1)
    return Result(out if valid is None else out * valid)


def needs_c(rewards: torch.Tensor, group: Any, *, c: float) -> Result:
    return Result(rewards + c)


def reconstructed(rewards: torch.Tensor, group: Any, *, experimental: bool = False) -> Result:
    assert experimental is True  # forwarded to functions that take it
    return Result(rewards)


def family() -> MethodRegistry[Method]:
    return MethodRegistry("toy estimator", Method, common=("rewards", "group"), result=Result)


def test_method_checks_then_calls_the_plain_function() -> None:
    reg = family()
    m = reg.register("scaled", scaled, requires=("mask",), accepts=("valid",), reference="arXiv 2222.22222")
    assert reg.get("scaled") is m and m.fn is scaled
    assert (m.hyper, m.hyper_required, m.returns) == (("k",), (), Result)
    r, g = torch.tensor([1.0, -1.0]), torch.tensor([0, 0])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # by hand: k · r · L = 2 · [1, -1] · [2, 1] = [4, -2]; with k = 0.5: [1, -0.5]; valid [T, F]: [4, 0]
    assert m(r, g, mask=mask).value.tolist() == [4.0, -2.0]
    assert m(r, g, mask, k=0.5).value.tolist() == [1.0, -0.5]
    assert m(r, g, mask=mask, valid=torch.tensor([1.0, 0.0])).value.tolist() == [4.0, 0.0]
    assert m(r, g, mask=mask, valid=None).value.tolist() == [4.0, -2.0]  # None: not passed
    with pytest.raises(InputError, match=r"required by the 'scaled' toy estimator") as info:
        m(r, g)
    assert info.value.argument == "mask"
    with pytest.raises(InputError, match=r"nothing configured reads") as info:
        m(r, g, mask=mask, logp=torch.zeros(2, 3))  # a standard input name that 'scaled' does not consume
    assert info.value.argument == "logp"
    with pytest.raises(InputError, match=r"inputs mask, valid; hyper-parameters k") as info:
        m(r, g, mask=mask, kk=1.0)  # a misspelt hyper-parameter: an InputError, not a TypeError
    assert info.value.argument == "kk"
    with pytest.raises(InputError, match="every toy estimator is called as f\\(rewards, group") as info:
        m(r, mask=mask)
    assert info.value.argument == "group"
    assert m(r, g, mask=mask, logp=torch.zeros(2, 3), allow_unused=True).value.tolist() == [4.0, -2.0]
    assert m.__doc__ == scaled.__doc__ and m.__name__ == "scaled"


def test_method_names_the_users_of_an_unconsumed_input() -> None:
    reg = family()
    m = reg.register("needs_c", needs_c)
    reg.register("scaled", scaled, requires=("mask",), accepts=("valid",))
    other: MethodRegistry[Method] = MethodRegistry("toy selector", Method)
    other.register("sel", lambda mask, extra: Result(mask), requires=("mask", "extra"))
    reg.related = [other]
    r, g = torch.tensor([1.0]), torch.tensor([0])
    with pytest.raises(InputError, match=r"\(the toy estimator scaled would\)"):
        m(r, g, c=1.0, mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(InputError, match=r"\(the toy selector sel would\)") as info:
        m(r, g, c=1.0, extra=torch.ones(1))  # no estimator uses it: the related family's method is named
    assert info.value.argument == "extra"
    with pytest.raises(InputError, match=r"^c: expected c=\.\.\., a hyper-parameter of the 'needs_c'"):
        m(r, g)
    assert m(r, g, c=1.5).value.tolist() == [2.5]


def test_experimental_method_needs_the_flag() -> None:
    reg = family()
    m = reg.register("rec", reconstructed, experimental="its form is a guess")
    r, g = torch.tensor([1.0]), torch.tensor([0])
    with pytest.raises(InputError, match=r"experimental=True for the 'rec' toy estimator: its form is a guess"):
        m(r, g)
    assert m(r, g, experimental=True).value.tolist() == [1.0]
    plain = reg.register("plain_needs_c", needs_c)
    assert plain(r, g, c=0.0, experimental=True).value.tolist() == [1.0]  # accepted, not forwarded


def test_method_registry_refuses_what_does_not_fit_the_family() -> None:
    reg = family()
    with pytest.raises(InputError, match=r"^fn: expected a toy estimator taking \(rewards, group, \.\.\.\) first"):
        reg.register("shaper", lambda rewards, is_flawed: Result(rewards))
    with pytest.raises(InputError, match=r"returning Result"):

        def wrong(rewards: torch.Tensor, group: Any) -> torch.Tensor:
            return rewards

        reg.register("wrong", wrong)
    with pytest.raises(InputError, match=r"^accepts: .*'mask' is a standard input name"):
        reg.register("undeclared", scaled, accepts=("valid",))  # mask left undeclared
    with pytest.raises(InputError, match=r"^requires: expected inputs that needs_c takes"):
        reg.register("phantom", needs_c, requires=("mask",))
    with pytest.raises(InputError, match=r"^mask: expected each input declared once"):
        reg.register("twice", scaled, requires=("mask",), accepts=("mask", "valid"))
    with pytest.raises(InputError, match=r"^extra: expected a declaration of a toy estimator"):
        reg.register("extra", needs_c, extra=1)
    assert reg.names() == []


def test_method_registry_duplicates_overwrite_and_decorator() -> None:
    reg = family()
    first = reg.register("m", scaled, requires=("mask",), accepts=("valid",))
    assert reg.register("m", scaled, requires=("mask",), accepts=("valid",)) is first  # same: a no-op
    assert reg.register("m", reg.get("m")) is first  # re-registering the Method itself: the same
    with pytest.raises(InputError, match=r"^name: expected a toy estimator name that is not registered yet"):
        reg.register("m", scaled, requires=("mask",), accepts=("valid",), reference="x")  # other declarations
    with pytest.raises(InputError, match="overwrite=True"):
        reg.register("m", needs_c)
    replaced = reg.register("m", needs_c, overwrite=True)
    assert reg.get("m") is replaced and replaced.fn is needs_c
    alias = reg.register("alias", first)  # a Method under another name keeps its declarations
    assert (alias.name, alias.fn, alias.requires, alias.accepts) == ("alias", scaled, ("mask",), ("valid",))

    @reg.decorator("decorated", requires=("mask",))
    def decorated(rewards: torch.Tensor, group: Any, mask: torch.Tensor) -> Result:
        return Result(rewards * mask.sum(-1))

    assert not isinstance(decorated, Method)  # the function stays plain
    assert reg.get("decorated").fn is decorated
    with pytest.raises(InputError, match=r"^name: expected a non-empty string"):
        reg.register("", needs_c)


def test_advantages_register() -> None:
    import rolloutopt.advantages as adv

    def doubled(rewards: torch.Tensor, group: Any, *, valid: Any = None) -> adv.AdvantageOutput:
        """2 · GRPO."""
        out = adv.grpo(rewards, group, valid=valid)
        return adv.AdvantageOutput(2 * out.advantages, out.weight)

    try:
        est = adv.register("tmp_doubled", doubled, accepts=("valid",), reference="arXiv 2402.03300 (x2)")
        assert adv.get("tmp_doubled") is est and est.reward_dims == "B" and "tmp_doubled" in adv.names()
        r, g = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
        # group 0: [1, 0] -> GRPO [0.7071, -0.7071] (std 0.7071), doubled; group 1: all equal -> 0
        assert torch.allclose(est(r, g).advantages, torch.tensor([2**0.5, -(2**0.5), 0.0, 0.0]), atol=1e-4)
        with pytest.raises(InputError, match=r"^reward_dims: "):
            adv.register("tmp_bad", doubled, accepts=("valid",), reward_dims="K")  # type: ignore[arg-type]
        with pytest.raises(InputError, match=r"^fn: expected an advantage estimator taking \(rewards, group"):
            adv.register("tmp_bad", adv.fapo_penalty, requires=("is_flawed",))

        with pytest.raises(InputError, match=r"returning AdvantageOutput, got 'tmp_bad', which returns ShapedRewards"):
            adv.register("tmp_bad", shaped)
        assert "tmp_bad" not in adv.names()
    finally:
        for name in ("tmp_doubled", "tmp_bad"):
            adv.REGISTRY._items.pop(name, None)


def shaped(rewards: torch.Tensor, group: Any) -> ShapedRewards:
    return ShapedRewards(rewards)
