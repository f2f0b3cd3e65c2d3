"""Every registered estimator, reward shaper and selector against its declarations.

Each entry is called with exactly the inputs it ``requires`` (tiny valid tensors built per input name): it runs,
returns its declared type and equals the plain function on the same arguments. Without any one required input,
or with it set to None, the call raises an ``InputError`` naming it; with any one input the entry does not
consume, it raises naming that input (and the methods that would use it); an unknown keyword is an
``InputError``, never a ``TypeError``.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest
import torch

import rolloutopt.advantages as adv
from rolloutopt.advantages import REGISTRY, SELECTORS, SHAPERS, AdvantageOutput, Estimator
from rolloutopt.errors import InputError
from rolloutopt.registry import STANDARD_INPUTS, Entry, Method, MethodRegistry

B, T, K = 6, 4, 2
FAMILIES: dict[str, MethodRegistry[Any]] = {"estimator": REGISTRY, "shaper": SHAPERS, "selector": SELECTORS}
ENTRIES = [(family, e) for family, reg in FAMILIES.items() for e in reg.entries()]
IDS = [f"{family}-{e.name}" for family, e in ENTRIES]

# hyper-parameters some entries cannot run without (no default, or required together with an input)
HYPER: dict[str, dict[str, Any]] = {
    "drpo": {"max_len": T},
    "latent_mask": {"max_len": T},  # with the mask: the paper's truncation rule
    "truncation_penalty": {"budget": 3},
}

LENGTHS = torch.tensor([4, 3, 2, 4, 1, 3])
GROUP = torch.tensor([7, 7, 7, 2, 2, 2])


def value(name: str, present: set[str], reward_dims: str = "B") -> Any:
    """A small valid value for the input ``name`` (per-token log-probs when a mask is passed too)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    mask = torch.arange(T)[None, :] < LENGTHS[:, None]
    per_token = "mask" in present
    if name == "rewards":
        if reward_dims == "B K":
            return (torch.rand(B, K, generator=gen) > 0.5).float()
        return torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    if name == "group":
        return GROUP
    if name == "mask":
        return mask
    if name in ("logp", "ref_logp", "old_logp", "behav_logp"):
        return -torch.rand(B, T, generator=gen) if per_token else -torch.rand(B, generator=gen) * 5
    if name in ("topk_logp", "topk_behav_logp"):
        return -torch.rand(B, T, 3, generator=gen)
    if name == "entropy":
        return torch.rand(B, T, generator=gen)
    if name == "advantages":
        return adv.grpo(value("rewards", present), GROUP).advantages
    if name == "prior":
        return torch.tensor([0.4, 0.4, 0.4, 0.9, 0.9, 0.9])
    if name in ("valid", "correct"):
        return torch.tensor([True, True, False, True, True, True])
    if name in ("invalid", "is_flawed"):
        return torch.tensor([False, True, False, False, True, False])
    if name == "lengths":
        return LENGTHS
    if name in ("answers", "prompt_ids"):
        return torch.tensor([3, 3, 5, 1, 1, 1])
    if name in ("confidence", "uncertainty"):
        return torch.rand(B, generator=gen)
    raise AssertionError(f"no test value for the input {name!r}: add one")


def call_parts(family: str, e: Entry[Any], names: tuple[str, ...]) -> tuple[list[Any], dict[str, Any]]:
    """Positional arguments (the family's common inputs) and keywords for a call with the inputs ``names``."""
    m = e.obj
    present = set(names) | set(m.common)
    dims = m.reward_dims if isinstance(m, Estimator) else "B"
    args = [value(c, present, dims) for c in m.common]
    kw = {n: value(n, present, dims) for n in names}
    kw.update(HYPER.get(e.name, {}))
    if "generator" in m.hyper_required:
        kw["generator"] = torch.Generator().manual_seed(0)
    if m.experimental is not None:
        kw["experimental"] = True
    return args, kw


def all_inputs() -> set[str]:
    names = set(STANDARD_INPUTS)
    for reg in FAMILIES.values():
        for e in reg.entries():
            names |= set(e.requires) | set(e.accepts)
    return names


def test_every_name_is_in_exactly_one_family() -> None:
    est, sh, sel = set(REGISTRY.names()), set(SHAPERS.names()), set(SELECTORS.names())
    assert not (est & sh or est & sel or sh & sel)
    assert est == set(adv.names())
    assert sh == {"fapo_penalty", "truncation_penalty", "dare_rewards"}
    assert sel == {"d3s", "nat_weights"}
    assert len(est | sh | sel) == 19
    assert {"ace", "xrpo_sharpen", "drpo", "dler_normalise", "latent_mask", "v05"} <= est


@pytest.mark.parametrize(("family", "e"), ENTRIES, ids=IDS)
def test_declarations(family: str, e: Entry[Any]) -> None:
    m = e.obj
    assert isinstance(m, Estimator if family == "estimator" else Method)
    assert (m.name, m.requires, m.accepts, m.reference, m.experimental) == (
        e.name,
        e.requires,
        e.accepts,
        e.reference,
        e.experimental,
    )
    assert "arXiv" in e.reference
    assert e.experimental is None or (isinstance(e.experimental, str) and len(e.experimental) > 20)
    assert m.returns is not None
    if family == "estimator":
        assert issubclass(m.returns, AdvantageOutput)
        assert m.common == ("rewards", "group")
    else:
        assert not issubclass(m.returns, AdvantageOutput) or family == "selector"  # D3SOutput carries weights
        assert m.common == ()
    assert set(m.hyper_required) <= set(HYPER.get(e.name, {})) | {"generator"}
    assert m.__doc__ == m.fn.__doc__ and m.__doc__
    assert inspect.signature(m) == inspect.signature(m.fn)
    # declared inputs are parameters; the rest of the parameters are hyper-parameters
    params = set(inspect.signature(m.fn).parameters)
    assert set(m.requires) | set(m.accepts) | set(m.common) | set(m.hyper) | {"experimental"} >= params
    assert not set(m.hyper) & STANDARD_INPUTS


@pytest.mark.parametrize(("family", "e"), ENTRIES, ids=IDS)
def test_runs_with_exactly_its_requires(family: str, e: Entry[Any]) -> None:
    m = e.obj
    args, kw = call_parts(family, e, e.requires)
    out = m(*args, **kw)
    assert m.returns is not None and isinstance(out, m.returns)
    if family == "estimator":
        assert isinstance(out, AdvantageOutput) and out.weight.shape == (B,)
    elif family == "shaper":
        assert out.rewards.shape == (B,)
    # the wrapper adds nothing: the plain function on the same arguments gives the same result
    if "generator" in kw:
        kw["generator"] = torch.Generator().manual_seed(0)
    plain = m.fn(*args, **kw)
    for field in ("advantages", "rewards", "weight", "mask", "token_mask"):
        if hasattr(out, field):
            assert torch.equal(getattr(out, field), getattr(plain, field)), field


@pytest.mark.parametrize(("family", "e"), ENTRIES, ids=IDS)
def test_each_missing_required_input_is_named(family: str, e: Entry[Any]) -> None:
    for name in e.requires:
        rest = tuple(n for n in e.requires if n != name)
        args, kw = call_parts(family, e, rest)
        with pytest.raises(InputError, match=f"required by the '{e.name}'") as info:
            e.obj(*args, **kw)
        assert info.value.argument == name
        with pytest.raises(InputError) as info:
            e.obj(*args, **kw, **{name: None})  # None counts as not passed
        assert info.value.argument == name


@pytest.mark.parametrize(("family", "e"), ENTRIES, ids=IDS)
def test_each_unused_input_is_named(family: str, e: Entry[Any]) -> None:
    consumed = set(e.requires) | set(e.accepts) | set(e.obj.common) | set(e.obj.hyper)
    unused = sorted(all_inputs() - consumed)
    assert unused
    for name in unused:
        args, kw = call_parts(family, e, e.requires)
        present = set(e.requires) | {name}
        with pytest.raises(InputError, match=f"only inputs that the '{e.name}'") as info:
            e.obj(*args, **kw, **{name: value(name, present)})
        assert info.value.argument == name
        kind, users = FAMILIES[family].would_use(name)
        if users:
            assert f"(the {kind}{'s' if len(users) > 1 else ''} {', '.join(users)} would)" in str(info.value)
        out = e.obj(*args, **kw, **{name: None})  # None: not passed, so not refused
        assert out is not None


@pytest.mark.parametrize(("family", "e"), ENTRIES, ids=IDS)
def test_unknown_keyword_and_experimental(family: str, e: Entry[Any]) -> None:
    args, kw = call_parts(family, e, e.requires)
    with pytest.raises(InputError, match="fix its spelling") as info:
        e.obj(*args, **kw, not_a_keyword=1)
    assert info.value.argument == "not_a_keyword"
    if e.experimental is not None:
        kw.pop("experimental")
        with pytest.raises(InputError, match="experimental=True") as info:
            e.obj(*args, **kw)
        assert info.value.argument == "experimental"
        assert e.experimental in str(info.value)
    with pytest.raises(InputError, match="at most") as info:
        e.obj(*args, *[None] * 20, **kw)
    assert info.value.argument == "args"


@pytest.mark.parametrize(("family", "e"), ENTRIES, ids=IDS)
def test_allow_unused_drops_what_the_method_does_not_consume(family: str, e: Entry[Any]) -> None:
    args, kw = call_parts(family, e, e.requires)
    extra = sorted(all_inputs() - set(e.requires) - set(e.accepts) - set(e.obj.common) - set(e.obj.hyper))
    present = set(e.requires) | set(extra)
    everything = {**kw, **{n: value(n, present) for n in extra}}
    out = e.obj(*args, **everything, allow_unused=True)
    if "generator" in kw:
        kw["generator"] = torch.Generator().manual_seed(0)
    ref = e.obj(*args, **kw)
    for field in ("advantages", "rewards", "weight", "mask"):
        if hasattr(out, field):
            assert torch.equal(getattr(out, field), getattr(ref, field))
    for key in set(e.requires):  # allow_unused never excuses a missing required input
        args2, kw2 = call_parts(family, e, tuple(n for n in e.requires if n != key))
        with pytest.raises(InputError) as info:
            e.obj(*args2, **kw2, allow_unused=True)
        assert info.value.argument == key


def test_hyper_parameters_pass_through_and_positional_inputs_bind() -> None:
    r, g = value("rewards", set()), GROUP
    mask = value("mask", set())
    assert torch.equal(adv.get("grpo")(r, g, eps=0.5).advantages, adv.grpo(r, g, eps=0.5).advantages)
    assert not torch.equal(adv.get("grpo")(r, g, eps=0.5).advantages, adv.grpo(r, g).advantages)
    pos = adv.get("reinforce_pp_baseline")(r, g, mask).advantages  # the plain function's positional order
    assert torch.equal(pos, adv.reinforce_pp_baseline(r, g, mask).advantages)
    with pytest.raises(InputError, match="a positional and a keyword value") as info:
        adv.get("reinforce_pp_baseline")(r, g, mask, mask=mask)
    assert info.value.argument == "mask"
    with pytest.raises(InputError, match="every advantage estimator is called as") as info:
        adv.get("grpo")(rewards=r)
    assert info.value.argument == "group"
    with pytest.raises(InputError, match="max_len=") as info:
        adv.get("drpo")(r, g, logp=-torch.rand(B, T), mask=mask)
    assert info.value.argument == "max_len"
    with pytest.raises(InputError) as info:
        adv.get("grpo")(r, g, experimental="yes")
    assert info.value.argument == "experimental"


def test_ace_on_precomputed_advantages_through_the_registry() -> None:
    """``rewards=None`` with ``advantages=``: ACE on another estimator's output, the same call shape."""
    r = value("rewards", set())
    base = adv.rloo(r, GROUP).advantages
    logp, ref = -torch.rand(B) * 4, -torch.rand(B) * 4
    out = adv.get("ace")(None, GROUP, logp=logp, ref_logp=ref, advantages=base, experimental=True)
    plain = adv.ace(None, GROUP, logp, ref, advantages=base, experimental=True)
    assert torch.equal(out.advantages, plain.advantages)


def test_a_shaper_then_an_estimator_then_a_selector() -> None:
    """The three families chained by name, as a trainer config would."""
    r = value("rewards", set())
    mask = value("mask", set())
    shaped = SHAPERS.get("truncation_penalty")(rewards=r, lengths=LENGTHS, budget=3)
    assert shaped.rewards.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0, 1.0]  # lengths 4 > 3 are cut to 0
    out = adv.get("dr_grpo")(shaped.rewards, GROUP)
    assert torch.allclose(out.advantages, torch.tensor([-1 / 3, -1 / 3, 2 / 3, -2 / 3, 1 / 3, 1 / 3]))
    sel = SELECTORS.get("d3s")(
        advantages=out.advantages, group=GROUP, entropy=torch.ones(B, T), mask=mask, sample_frac=(1.0, 1.0)
    )
    assert torch.equal(sel.weight, torch.ones(B))  # every rollout has a non-zero advantage


def test_methods_pickle_and_compare() -> None:
    m = adv.get("gapo")
    back = pickle.loads(pickle.dumps(m))
    assert back == m and back.fn is m.fn and back.registry is None
    r = value("rewards", set())
    assert torch.equal(back(r, GROUP).advantages, m(r, GROUP).advantages)
    with pytest.raises(InputError, match="mask") as info:  # without its registry: no list of users, same check
        back(r, GROUP, mask=value("mask", set()))
    assert info.value.argument == "mask"
