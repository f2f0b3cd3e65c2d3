"""Shared drivers of the CoBA and Knapsack tests: a plan runner, reward and history builders, checks, allocator
factories and the bodies of the tests run for both families."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

from rolloutopt.allocators._base import AllocationResult, Conversation, Request
from rolloutopt.allocators.coba import CoBA
from rolloutopt.allocators.knapsack import Knapsack
from rolloutopt.errors import InputError

Rewards = Callable[[Request], torch.Tensor]

F64 = torch.float64


def run(plan: Conversation, rewards: Rewards) -> AllocationResult:
    while (req := plan.next()) is not None:
        plan.observe(req, rewards(req))
    return plan.finish()


def bernoulli(rate: torch.Tensor, seed: int) -> Rewards:
    def f(req: Request) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        p = rate[req.prompt_ids].repeat_interleave(req.counts)
        return (torch.rand(p.shape, generator=g, dtype=F64) < p).double()

    return f


def group_result(succ: list[int], tot: list[int], first: int = 0) -> AllocationResult:
    """One group per prompt (ids first..first+P-1; tot 0 = not rolled out): successes first, then failures."""
    ids, group, rewards = [], [], []
    for i, (s, t) in enumerate(zip(succ, tot, strict=True)):
        ids += [first + i] * t
        group += [i] * t
        rewards += [1.0] * s + [0.0] * (t - s)
    p = len(succ)
    return AllocationResult(
        prompt_ids=torch.tensor(ids, dtype=torch.long),
        group=torch.tensor(group, dtype=torch.long),
        rewards=torch.tensor(rewards, dtype=F64),
        weight=torch.ones(len(rewards), dtype=F64),
        plan_prompt_ids=torch.arange(first, first + p),
        counts=torch.tensor(tot, dtype=torch.long),
        reasons=torch.zeros(p, dtype=torch.long),
        reason_names=Knapsack.reason_names,
    )


def seed_history(alloc: CoBA | Knapsack, succ: list[int], tot: list[int]) -> torch.Tensor:
    """Write one group per prompt (ids 0..P-1; tot 0 = unseen) into the allocator's history; return the ids.

    Knapsack has no history (its reward store is its own table columns), so it is seeded through ``update``."""
    if isinstance(alloc, Knapsack):
        alloc.update(group_result(succ, tot))
        return torch.arange(len(succ))
    ids, rewards = [], []
    for i, (s, t) in enumerate(zip(succ, tot, strict=True)):
        ids += [i] * t
        rewards += [1.0] * s + [0.0] * (t - s)
    alloc.history.update(torch.tensor(ids, dtype=torch.long), torch.tensor(rewards, dtype=F64), step=0)
    return torch.arange(len(succ))


def check_caps(counts: torch.Tensor, budget: int, n_min: int, n_max: int) -> None:
    assert int(counts.sum()) <= budget
    nz = counts[counts > 0]
    assert bool(((nz >= n_min) & (nz <= n_max)).all())


# -- the exact greedy -------------------------------------------------------------------------------------------------
def heap_greedy(gains: list[list[float]], r: int) -> list[int]:
    """The codes' heap: pop the largest gain (ties: smaller index), push that row's next gain."""
    taken = [0] * len(gains)
    heap = [(-row[0], i) for i, row in enumerate(gains) if row]
    heapq.heapify(heap)
    while r > 0 and heap:
        _, i = heapq.heappop(heap)
        taken[i] += 1
        r -= 1
        if taken[i] < len(gains[i]):
            heapq.heappush(heap, (-gains[i][taken[i]], i))
    return taken


# -- properties of both ------------------------------------------------------------------------------------------
def make(kind: str) -> CoBA | Knapsack:
    return CoBA(n_min=2, n_max=12) if kind == "coba" else Knapsack(n=4, n_min=2, n_max=12)


def check_budget_caps_determinism_permutation(
    kind: str, ids: list[int], budget: int, seed: int, data: st.DataObject
) -> None:
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(ids, dtype=torch.long)
    rate = dict(zip(ids, torch.rand(len(ids), generator=g, dtype=F64).tolist(), strict=True))

    def rewards(step: int) -> Rewards:
        def f(req: Request) -> torch.Tensor:
            gg = torch.Generator().manual_seed(seed + step)
            p = torch.tensor([rate[i] for i in req.prompt_ids.tolist()], dtype=F64).repeat_interleave(req.counts)
            return (torch.rand(p.shape, generator=gg, dtype=F64) < p).double()

        return f

    a, b = make(kind), make(kind)
    for s in range(3):
        pa, pb = a.plan(pool, budget), b.plan(pool, budget)
        assert torch.equal(pa.counts, pb.counts)  # deterministic
        check_caps(pa.counts, budget, 2, 12)
        ra, rb = run(pa, rewards(s)), run(pb, rewards(s))
        a.update(ra)
        b.update(rb)
    perm = torch.tensor(data.draw(st.permutations(range(len(ids)))), dtype=torch.long)
    base = a.plan(pool, budget)
    permuted = a.plan(pool[perm], budget)
    assert torch.equal(permuted.counts, base.counts[perm])
    assert torch.equal(permuted._reasons, base._reasons[perm])


def check_state_round_trip_mid_run(kind: str) -> None:
    rate = torch.rand(40, generator=torch.Generator().manual_seed(3), dtype=F64)
    pool = torch.arange(40)
    a = make(kind)
    for s in range(3):
        a.update(run(a.plan(pool[s : s + 30], 200), bernoulli(rate, s)))
    saved = a.state_dict()
    b = make(kind)
    b.load_state_dict(saved)
    for s in range(3, 6):
        pa, pb = a.plan(pool[s : s + 30], 200), b.plan(pool[s : s + 30], 200)
        assert torch.equal(pa.counts, pb.counts)
        ra, rb = run(pa, bernoulli(rate, s)), run(pb, bernoulli(rate, s))
        assert torch.equal(ra.rewards, rb.rewards) and torch.equal(ra.reasons, rb.reasons)
        a.update(ra)
        b.update(rb)
    assert torch.equal(a.table.prompt_ids, b.table.prompt_ids)
    for key, col in a.table.state_dict()["columns"].items():
        assert torch.equal(col, b.table.state_dict()["columns"][key]), key


def _with(state: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of ``state`` with ``value`` at ``path`` (nested keys)."""
    if len(path) == 1:
        return {**state, path[0]: value}
    return {**state, path[0]: _with(state[path[0]], path[1:], value)}


def _saved(kind: str) -> tuple[CoBA | Knapsack, dict[str, Any]]:
    rate = torch.rand(40, generator=torch.Generator().manual_seed(4), dtype=F64)
    a = make(kind)
    for s in range(3):
        a.update(run(a.plan(torch.arange(s, s + 30), 200), bernoulli(rate, s)))
    return a, a.state_dict()


def _refused(kind: str, state: dict[str, Any], argument: str) -> None:
    a, before = _saved(kind)
    before_ids, before_cols = a.table.prompt_ids.clone(), a.table.state_dict()["columns"]
    with pytest.raises(InputError) as err:
        a.load_state_dict(state)
    assert err.value.argument == argument
    after = a.state_dict()
    assert torch.equal(a.table.prompt_ids, before_ids)
    for key, col in a.table.state_dict()["columns"].items():
        assert torch.equal(col, before_cols[key]), key
    assert after["step"] == before["step"]


def check_empty_pool_and_zero_budget(kind: str) -> None:
    a = make(kind)
    res = run(a.plan(torch.zeros(0, dtype=torch.long), 10), lambda r: torch.zeros(r.total, dtype=F64))
    assert res.rewards.numel() == 0
    a.update(res)
    res = run(a.plan(torch.tensor([1, 2]), 0), lambda r: torch.zeros(r.total, dtype=F64))
    assert res.counts.tolist() == [0, 0] and res.reason_of(1) == "no_budget"
    a.update(res)


# -- bad input --------------------------------------------------------------------------------------------------------
def check_bad_input(kind: str) -> None:
    a = make(kind)
    with pytest.raises(InputError, match="budget"):
        a.plan(torch.tensor([1, 2]), -1)
    with pytest.raises(InputError, match="prompt_ids"):
        a.plan(torch.tensor([1, 1]), 8)
    with pytest.raises(InputError, match="prompt_ids"):
        a.plan(torch.tensor([1.0, 2.0]), 8)
    plan = a.plan(torch.tensor([1, 2]), 8)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(req.total + 1))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.full((req.total,), float("nan")))
    with pytest.raises(InputError, match="request"):
        plan.observe(Request(torch.tensor([99]), torch.tensor([req.total])), torch.zeros(req.total))
    with pytest.raises(InputError, match="result"):
        a.update("not a result")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="state"):
        a.load_state_dict({"nope": 1})


def check_spends_everything_when_caps_do_not_bind(kind: str, groups: list[tuple[int, int]], budget: int) -> None:
    a: CoBA | Knapsack = CoBA(n_min=2, n_max=10**4) if kind == "coba" else Knapsack(n=4, n_min=2, n_max=10**4)
    ids = seed_history(a, [min(s, t) for s, t in groups], [t for _, t in groups])
    counts = a.plan(ids, budget).counts
    check_caps(counts, budget, 2, 10**4)
    if budget >= 4 * len(groups):  # at least every base allocation (n = 4 for never-seen Knapsack prompts)
        assert int(counts.sum()) == budget
