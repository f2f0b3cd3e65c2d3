"""Shared drivers of the HIVE and DEPO tests: signal tables, a plan runner that answers probes, allocator factories
and the bodies of the tests run for both families."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from rolloutopt.allocators._base import AllocationResult, Conversation, Request
from rolloutopt.allocators.depo import DEPO, depo_group_scores
from rolloutopt.allocators.hive import HIVE
from rolloutopt.errors import InputError

Rewards = Callable[[Request], torch.Tensor]

PerRow = Callable[[Request], torch.Tensor] | Mapping[int, float]


def per_rollout(values: Rewards | Mapping[int, float]) -> Rewards:
    """A rollout signal ``[n]`` for a request: a callable as is, or {prompt: value} repeated over its rollouts."""
    if callable(values):
        return values
    return lambda req: torch.tensor(
        [values[p] for p in req.prompt_ids.tolist()], dtype=torch.float64
    ).repeat_interleave(req.counts)


def per_row(values: PerRow) -> Rewards:
    """A prompt or probe signal ``[R]`` for a request: a callable as is, or {prompt: value} per request row."""
    if callable(values):
        return values
    return lambda req: torch.tensor([values[p] for p in req.prompt_ids.tolist()], dtype=torch.float64)


def run(
    plan: Conversation,
    rewards: Rewards,
    *,
    entropy: Rewards | Mapping[int, float] | None = None,
    prompt_entropy: PerRow | None = None,
) -> tuple[AllocationResult, list[Request]]:
    """Drive a plan: a probe is answered with ``prompt_entropy`` of its rows (or with nothing, skipping stage 2),
    a generating request with its rewards and, when given, its rollouts' ``entropy``."""
    reqs = []
    while (req := plan.next()) is not None:
        reqs.append(req)
        if req.is_probe:
            assert req.signals == ("prompt_entropy",) and req.total == 0
            signals = {} if prompt_entropy is None else {"prompt_entropy": per_row(prompt_entropy)(req)}
            plan.observe(req, None, **signals)
        else:
            signals = {} if entropy is None else {"entropy": per_rollout(entropy)(req)}
            plan.observe(req, rewards(req), **signals)
    return plan.finish(), reqs


def zero(req: Request) -> torch.Tensor:
    return torch.zeros(req.total, dtype=torch.float64)


def table(groups: dict[int, list[float]]) -> Rewards:
    """Prompt p's rollouts get the rewards groups[p] (its request count must match)."""

    def f(req: Request) -> torch.Tensor:
        return torch.tensor([x for p in req.prompt_ids.tolist() for x in groups[p]], dtype=torch.float64)

    return f


def bern(seed: int, n_ids: int = 64) -> Rewards:
    rate = torch.rand(n_ids, generator=torch.Generator().manual_seed(1000 + seed), dtype=torch.float64)

    def f(req: Request) -> torch.Tensor:
        q = rate[req.prompt_ids % n_ids].repeat_interleave(req.counts)
        return (torch.rand(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) < q).double()

    return f


def ents(seed: int) -> Rewards:
    """Response entropies of a step's (single) generating request: uniform on [0, 3), seeded."""
    return lambda req: torch.rand(req.total, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


# -- both: budget, caps, determinism, permutation, state round trip -----------------------------------------------
def make(kind: str, seed: int, **kw: object) -> HIVE | DEPO:
    if kind == "hive":
        return HIVE(n=4, n_min=2, n_max=6, window=3, experimental=True, seed=seed, **kw)  # type: ignore[arg-type]
    return DEPO(n=4, n_min=2, n_max=6, decay=0.2, pad_multiple=3, seed=seed, **kw)  # type: ignore[arg-type]


def drive(a: HIVE | DEPO, steps: range, budget: int, pools: list[torch.Tensor]) -> list[AllocationResult]:
    out = []
    for s in steps:
        if isinstance(a, DEPO):
            a.set_epoch(s // 2)
        pool = pools[s]
        pe = dict(zip(pool.tolist(), (pool.double() * 0.37 + s).sin().abs().tolist(), strict=True))
        res, _ = run(a.plan(pool, budget), bern(s), entropy=ents(s), prompt_entropy=pe if isinstance(a, HIVE) else None)
        a.update(res)
        out.append(res)
    return out


def check_budget_caps_determinism(kind: str, seed: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pools = [torch.randperm(64, generator=gen)[:24] for _ in range(5)]
    a, b = make(kind, seed), make(kind, seed)
    ra, rb = drive(a, range(5), budget, pools), drive(b, range(5), budget, pools)
    for x, y in zip(ra, rb, strict=True):
        assert torch.equal(x.counts, y.counts) and torch.equal(x.reasons, y.reasons)
        assert int(x.counts.sum()) <= budget and x.rewards.numel() == int(x.counts.sum())
        nz = x.counts[x.counts > 0]
        assert bool(((nz >= 2) & (nz <= 6)).all())
        assert bool((x.weight == 1).all())


def check_permutation_permutes_the_plan(kind: str, seed: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pools = [torch.randperm(64, generator=gen)[:24] for _ in range(3)]
    a, b = make(kind, 7), make(kind, 7)
    drive(a, range(3), 60, pools)
    drive(b, range(3), 60, pools)
    if isinstance(a, DEPO) and isinstance(b, DEPO):
        a.set_epoch(2)
        b.set_epoch(2)
    ids = torch.randperm(64, generator=gen)[:30]
    perm = torch.randperm(30, generator=gen)
    pe = dict(zip(ids.tolist(), torch.rand(30, generator=gen, dtype=torch.float64).tolist(), strict=True))
    probe = pe if isinstance(a, HIVE) else None  # each prompt keeps its prompt entropy under the permutation
    x, _ = run(a.plan(ids, budget), zero, entropy=zero, prompt_entropy=probe)
    y, _ = run(b.plan(ids[perm], budget), zero, entropy=zero, prompt_entropy=probe)
    assert torch.equal(y.counts, x.counts[perm]) and torch.equal(y.reasons, x.reasons[perm])


def check_state_dict_round_trip_mid_run(kind: str) -> None:
    gen = torch.Generator().manual_seed(4)
    pools = [torch.randperm(64, generator=gen)[:24] for _ in range(8)]
    a = make(kind, 11)
    drive(a, range(4), 50, pools)
    saved = a.state_dict()
    tail_a = drive(a, range(4, 8), 50, pools)
    b = make(kind, 11)
    b.load_state_dict(saved)
    tail_b = drive(b, range(4, 8), 50, pools)
    for x, y in zip(tail_a, tail_b, strict=True):
        assert torch.equal(x.counts, y.counts) and torch.equal(x.reasons, y.reasons)
        assert torch.equal(x.rewards, y.rewards) and torch.equal(x.prompt_ids, y.prompt_ids)
    assert same_state(a.state_dict(), b.state_dict())
    # something was filtered along the way (the run is not trivially "keep all")
    assert any(bool((x.reasons != 0).any()) for x in tail_a)


def check_empty_pool_and_zero_budget(kind: str) -> None:
    for ids, budget in ((torch.zeros(0, dtype=torch.long), 100), (torch.arange(3), 0)):
        a = make(kind, 0)
        res, reqs = run(a.plan(ids, budget), zero, entropy=zero, prompt_entropy=dict.fromkeys(range(3), 1.0))
        # nothing generated; HIVE still probes its (unseen, so surviving) candidates when there are some
        assert [r for r in reqs if not r.is_probe] == [] and int(res.counts.sum()) == 0
        assert len(reqs) == (1 if kind == "hive" and ids.numel() else 0)
        a.update(res)
        assert len(a.table) == 0


def check_bad_constructor(cls: type, kwargs: dict[str, object], arg: str) -> None:
    if cls is HIVE:
        kwargs = {**kwargs, "experimental": True}
    with pytest.raises(InputError, match=arg):
        cls(**kwargs)


def check_bad_plan_observe_update_load(kind: str) -> None:
    a = make(kind, 0)
    with pytest.raises(InputError, match="budget"):
        a.plan(torch.tensor([1, 2]), -3)
    with pytest.raises(InputError, match="prompt_ids"):
        a.plan(torch.tensor([[1, 2]]), 8)
    with pytest.raises(InputError, match="prompt_ids"):
        a.plan(torch.tensor([1, 1]), 8)
    plan = a.plan(torch.tensor([1, 2]), 8)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="request"):  # unknown ids / not the pending request
        plan.observe(Request(torch.tensor([9]), torch.tensor([8])), torch.zeros(8))
    if isinstance(a, HIVE):  # the probe first: bad prompt entropies, then a good answer
        assert req.is_probe and req.prompt_ids.tolist() == [1, 2]
        with pytest.raises(InputError, match="prompt_entropy"):
            plan.observe(req, None, prompt_entropy=torch.zeros(3))  # one per probed row
        with pytest.raises(InputError, match="prompt_entropy"):
            plan.observe(req, None, prompt_entropy=torch.tensor([0.5, float("nan")]))
        with pytest.raises(InputError, match=r"^entropy"):  # not asked for by a probe
            plan.observe(req, None, prompt_entropy=torch.zeros(2), entropy=torch.zeros(2))
        with pytest.raises(InputError, match="rewards"):  # a probe generates nothing
            plan.observe(req, torch.zeros(2), prompt_entropy=torch.zeros(2))
        plan.observe(req, None, prompt_entropy=torch.ones(2))
        req = plan.next()
        assert req is not None
    assert not req.is_probe and req.signals == ("entropy",) and req.total == 8
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(2, 4), entropy=torch.zeros(8))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((8,), float("nan")), entropy=torch.zeros(8))
    with pytest.raises(InputError, match=r"^entropy"):
        plan.observe(req, torch.zeros(8), entropy=torch.zeros(7))
    with pytest.raises(InputError, match=r"^entropy"):
        plan.observe(req, torch.zeros(8), entropy=torch.full((8,), float("nan")))
    with pytest.raises(InputError, match=r"^prompt_entropy"):  # a probe signal with rollouts: not asked for
        plan.observe(req, torch.zeros(8), entropy=torch.zeros(8), prompt_entropy=torch.zeros(2))
    with pytest.raises(InputError, match=r"^hardness"):
        plan.observe(req, torch.zeros(8), entropy=torch.zeros(8), hardness=torch.zeros(2))
    if isinstance(a, DEPO):
        with pytest.raises(InputError, match=r"^entropy"):  # DEPO requires it
            plan.observe(req, torch.zeros(8))
    plan.observe(req, torch.zeros(8), entropy=torch.zeros(8))
    res = plan.finish()
    with pytest.raises(InputError, match="result"):
        a.update(None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="entropy"):  # a result whose entropy signal does not fit its rollouts
        a.update(dataclasses.replace(res, signals={**res.signals, "entropy": torch.zeros(7, dtype=torch.float64)}))
    if isinstance(a, DEPO):
        with pytest.raises(InputError, match=r"^entropy"):  # a result without the required signal
            a.update(dataclasses.replace(res, signals={}))
    with pytest.raises(InputError, match="state"):
        a.load_state_dict({})
    a.update(res)
    bad = a.state_dict()
    bad["table"]["rows"]["prompt_ids"] = torch.tensor([2, 1])
    with pytest.raises(InputError, match="prompt_ids"):
        a.load_state_dict(bad)
    if isinstance(a, HIVE):
        top = HIVE(stage2="top", experimental=True).plan(torch.tensor([1]), 8)
        probe = top.next()
        assert probe is not None and probe.is_probe
        top.observe(probe, None)
        with pytest.raises(InputError, match="prompt_entropy"):
            top.next()
    else:
        with pytest.raises(InputError, match="epoch"):
            a.set_epoch(-1)
        with pytest.raises(InputError, match="correct"):
            depo_group_scores(torch.tensor([0]), torch.tensor([1.0]), torch.ones(1), num_groups=1)
        with pytest.raises(InputError, match="group"):
            depo_group_scores(torch.tensor([3]), torch.tensor([True]), torch.ones(1), num_groups=1)
        with pytest.raises(InputError, match="entropy"):
            depo_group_scores(torch.tensor([0]), torch.tensor([True]), torch.ones(2), num_groups=1)


def same_state(v: object, w: object) -> bool:
    """Two states (nested dicts of tensors and scalars) are equal, NaN equal to NaN (a missing value)."""
    if isinstance(v, dict):
        return isinstance(w, dict) and v.keys() == w.keys() and all(same_state(v[k], w[k]) for k in v)
    if isinstance(v, torch.Tensor):
        return (
            isinstance(w, torch.Tensor)
            and v.shape == w.shape
            and v.dtype == w.dtype
            and bool(((v == w) | (v != v) & (w != w)).all())
        )
    return v == w


def _refused(alloc: HIVE | DEPO, state: dict[str, object], argument: str) -> None:
    """Loading ``state`` is an InputError naming ``argument``, and ``alloc`` keeps its own state."""
    before = alloc.state_dict()
    with pytest.raises(InputError) as err:
        alloc.load_state_dict(state)
    assert err.value.argument == argument
    assert same_state(before, alloc.state_dict())


def with_rows(state: dict[str, Any], owner: str, **columns: torch.Tensor) -> dict[str, Any]:
    """A copy of a private-table ``state`` of ``owner`` whose table rows are replaced: ``ids`` (the prompt ids,
    all seen by the owner) and the owner's columns by short name."""
    out = copy.deepcopy(state)
    rows = out["table"]["rows"]
    for key, value in columns.items():
        if key == "ids":
            rows["prompt_ids"], rows["touch"] = value, torch.zeros_like(value)
            rows["columns"][f"{owner}/seen"] = torch.ones(value.shape, dtype=torch.bool)
        else:
            rows["columns"][f"{owner}/{key}"] = value
    return out


def column_name(owner: str, key: str) -> str:
    """The argument an ``InputError`` names for a bad column ``key`` of ``owner`` in a private-table state."""
    return f"state['table']['rows']['columns']['{owner}/{key}']"
