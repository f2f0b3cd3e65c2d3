"""Conversation's fast paths (rows known from ``request``, equal-count broadcast, lazy sums, finite-sum check)
give what the general paths give."""

from __future__ import annotations

import pytest
import torch

from rolloutopt.allocators import AllocationResult, Conversation, Request
from rolloutopt.errors import InputError


class Scripted(Conversation):
    """Requests a fixed script of (rows, counts); ``known`` picks ``self.request`` (rows remembered) or a plain
    ``Request`` (ids looked up in ``observe``)."""

    def __init__(self, ids: torch.Tensor, budget: int, script: list[tuple[list[int], list[int]]], known: bool):
        super().__init__(ids, budget)
        self.script = list(script)
        self.known = known
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def decide(self) -> Request | None:
        if not self.script:
            return None
        rows, counts = self.script.pop(0)
        r, c = torch.tensor(rows, dtype=torch.long), torch.tensor(counts, dtype=torch.long)
        return self.request(r, c) if self.known else Request(self.prompt_ids[r], c)

    def on_observe(self, pos: torch.Tensor, rewards: torch.Tensor) -> None:
        self.seen.append((pos.clone(), rewards.clone()))


def drive(plan: Scripted, seed: int) -> tuple[AllocationResult, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    while (req := plan.next()) is not None:
        plan.observe(req, torch.rand(req.total, generator=gen, dtype=torch.float64) * 3 - 1)
    res = plan.finish()
    return res, plan.totals()


SCRIPTS = [
    [([2, 0, 3], [4, 4, 4]), ([1, 2], [1, 3]), ([3, 3], [2, 2])],  # equal, unequal, a repeated row
    [([0, 1, 2, 3], [1, 1, 1, 1])],
    [([3], [5]), ([0, 1], [2, 7])],
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_known_rows_match_looked_up_ids(script: list[tuple[list[int], list[int]]]) -> None:
    ids = torch.tensor([40, 10, 30, 20])
    a, ta = drive(Scripted(ids, 100, script, known=True), 0)
    b, tb = drive(Scripted(ids, 100, script, known=False), 0)
    for x, y in zip(ta, tb, strict=True):
        assert torch.equal(x, y)
    for field in ("prompt_ids", "group", "rewards", "weight", "counts", "reasons"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:
        assert torch.equal(a.metrics[k], b.metrics[k])
    rows = torch.cat([torch.tensor(r).repeat_interleave(torch.tensor(c)) for r, c in script])
    assert torch.equal(a.group, rows) and torch.equal(a.prompt_ids, ids[rows])


def test_lazy_sums_equal_eager_fold() -> None:
    ids = torch.tensor([7, 3, 5, 1])
    plan = Scripted(ids, 100, SCRIPTS[0], known=True)
    gen = torch.Generator().manual_seed(1)
    s = torch.zeros(4, dtype=torch.float64)
    ss = torch.zeros(4, dtype=torch.float64)
    while (req := plan.next()) is not None:
        r = torch.rand(req.total, generator=gen, dtype=torch.float64) / 3
        plan.observe(req, r)
        pos = plan.seen[-1][0]
        s.index_add_(0, pos, r)
        ss.index_add_(0, pos, r * r)
        if req.total % 2:  # ask for the totals in the middle sometimes
            plan.totals()
    _, got_s, got_ss = plan.totals()
    assert torch.equal(got_s, s) and torch.equal(got_ss, ss)


def test_finite_rewards_whose_sum_overflows_are_accepted() -> None:
    plan = Scripted(torch.tensor([1, 2]), 10, [([0, 1], [2, 2])], known=True)
    req = plan.next()
    assert req is not None
    plan.observe(req, torch.tensor([1e308, 1e308, 1e308, -1.0], dtype=torch.float64))
    assert plan.next() is None
    assert plan.finish().rewards.tolist() == [1e308, 1e308, 1e308, -1.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_rewards_raise_on_both_paths(bad: float) -> None:
    for known in (True, False):
        plan = Scripted(torch.tensor([1, 2]), 10, [([0, 1], [1, 2])], known=known)
        req = plan.next()
        assert req is not None
        with pytest.raises(InputError, match="rewards"):
            plan.observe(req, torch.tensor([0.0, bad, 1.0]))
        with pytest.raises(InputError, match="rewards"):
            plan.observe(req, torch.tensor([1e308, 1e308, bad], dtype=torch.float64))


def test_a_swapped_pending_request_is_looked_up() -> None:
    plan = Scripted(torch.tensor([1, 2]), 10, [([0, 1], [1, 1])], known=True)
    req = plan.next()
    assert req is not None
    plan._pending = Request(torch.tensor([9]), torch.tensor([2]))  # not the issued request: ids are checked
    with pytest.raises(InputError, match="prompt_ids"):
        plan.observe(plan._pending, torch.zeros(2))
