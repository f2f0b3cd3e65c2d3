"""Signals and the driver: what an allocator learns from beyond rewards travels through the conversation.

Hand examples on a two-round plan that accepts every rollout and prompt signal (a test subclass of
``Conversation``), the probe request, ``run_step`` with each form of ``generate``, and bad input.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from rolloutopt.allocators import SIGNALS, AllocationResult, Conversation, Request, Uniform, run_step
from rolloutopt.errors import InputError


class TwoRounds(Conversation):
    """Round 1: prompts 0 and 1 get 2 rollouts each; round 2: prompt 0 gets 1 more. A probe first if asked."""

    def __init__(self, ids: torch.Tensor, budget: int, *, probe: bool = False, **kw: Any) -> None:
        super().__init__(ids, budget, **kw)
        self._round = -1 if probe else 0

    def decide(self) -> Request | None:
        self._round += 1
        if self._round == 0:
            return self.probe(torch.tensor([0, 2]), ("prompt_entropy",))
        if self._round == 1:
            return self.request(torch.tensor([0, 1]), torch.tensor([2, 2]))
        if self._round == 2:
            return self.request(torch.tensor([0]), torch.tensor([1]))
        return None


IDS = torch.tensor([10, 11, 12])


def test_signals_glossary() -> None:
    assert SIGNALS == {"entropy": "rollout", "tokens": "rollout", "hardness": "prompt", "prompt_entropy": "probe"}


def test_rollout_and_prompt_signals_reach_the_result_by_hand() -> None:
    plan = TwoRounds(IDS, 8, accepts=("entropy", "tokens", "hardness"))
    r1 = plan.next()
    assert r1 is not None and r1.signals == ("entropy", "tokens", "hardness") and not r1.is_probe
    plan.observe(
        r1,
        torch.tensor([1.0, 0.0, 1.0, 1.0]),
        entropy=torch.tensor([0.5, 1.5, 2.0, 2.5]),
        tokens=torch.tensor([3, 4, 5, 6]),
        hardness=torch.tensor([0.25, 0.75]),
    )
    r2 = plan.next()
    assert r2 is not None
    plan.observe(r2, torch.tensor([0.0]), entropy=torch.tensor([9.0]), tokens=torch.tensor([7]))
    assert plan.next() is None
    res = plan.finish()
    assert res.signals["entropy"].tolist() == [0.5, 1.5, 2.0, 2.5, 9.0]  # per rollout, observation order
    assert res.signals["tokens"].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0] and res.signals["tokens"].dtype == torch.float32
    h = res.signals["hardness"]  # per planned prompt [P], NaN for prompt 12 (never requested)
    assert h[:2].tolist() == [0.25, 0.75] and math.isnan(float(h[2]))
    assert res.group.tolist() == [0, 0, 1, 1, 0]


def test_probe_request_by_hand() -> None:
    plan = TwoRounds(IDS, 8, probe=True, accepts=("prompt_entropy",))
    probe = plan.next()
    assert probe is not None and probe.is_probe and probe.total == 0
    assert probe.prompt_ids.tolist() == [10, 12] and probe.signals == ("prompt_entropy",)
    with pytest.raises(InputError) as err:
        plan.observe(probe, torch.ones(2), prompt_entropy=torch.tensor([1.0, 2.0]))
    assert err.value.argument == "rewards"
    plan.observe(probe, None, prompt_entropy=torch.tensor([1.0, 2.0]))
    pe = plan.signal("prompt_entropy")
    assert pe is not None and pe[0] == 1.0 and math.isnan(float(pe[1])) and pe[2] == 2.0
    r1 = plan.next()
    assert r1 is not None and r1.signals == ()  # a generating request collects no probe signal
    plan.observe(r1, torch.zeros(4))
    r2 = plan.next()
    assert r2 is not None
    plan.observe(r2, torch.zeros(1))
    assert plan.next() is None
    assert plan.finish().signals["prompt_entropy"][2] == 2.0


def test_observe_refuses_what_the_request_did_not_ask_for_and_missing_required() -> None:
    plan = TwoRounds(IDS, 8, requires=("entropy",))
    req = plan.next()
    assert req is not None and req.signals == ("entropy",)
    for kw, name in (
        ({}, "entropy"),  # required, missing
        ({"entropy": torch.ones(4), "tokens": torch.ones(4)}, "tokens"),  # not asked for
        ({"entropy": torch.ones(3)}, "entropy"),  # wrong length
        ({"entropy": torch.tensor([1.0, math.nan, 1.0, 1.0])}, "entropy"),  # NaN
        ({"entropy": torch.ones(4, dtype=torch.bool)}, "entropy"),  # bool
        ({"entropy": torch.ones(2, 2)}, "entropy"),  # not 1-d
    ):
        with pytest.raises(InputError) as err:
            plan.observe(req, torch.zeros(4), **kw)
        assert err.value.argument == name, kw
    plan.observe(req, torch.zeros(4), entropy=torch.ones(4))  # the request is still pending: nothing was stored


def test_an_optional_rollout_signal_comes_with_every_request_or_none() -> None:
    plan = TwoRounds(IDS, 8, accepts=("entropy",))
    r1 = plan.next()
    assert r1 is not None
    plan.observe(r1, torch.zeros(4), entropy=torch.ones(4))
    r2 = plan.next()
    assert r2 is not None
    with pytest.raises(InputError, match="every request") as err:
        plan.observe(r2, torch.zeros(1))
    assert err.value.argument == "entropy"
    plan = TwoRounds(IDS, 8, accepts=("entropy",))
    r1 = plan.next()
    assert r1 is not None
    plan.observe(r1, torch.zeros(4))
    r2 = plan.next()
    assert r2 is not None
    with pytest.raises(InputError, match="every request"):
        plan.observe(r2, torch.zeros(1), entropy=torch.ones(1))
    plan.observe(r2, torch.zeros(1))
    assert plan.next() is None and plan.finish().signals == {}


def test_run_step_answers_each_form_of_generate() -> None:
    calls: list[Request] = []

    def as_tensor(req: Request) -> torch.Tensor:
        calls.append(req)
        return torch.ones(req.total)

    alloc = Uniform(n=2)
    res = run_step(alloc, IDS, 6, as_tensor)
    assert isinstance(res, AllocationResult) and res.counts.tolist() == [2, 2, 2] and len(calls) == 1
    res = run_step(alloc, IDS, 6, lambda req: {"rewards": torch.ones(req.total)}, update=False)
    assert res.rewards.tolist() == [1.0] * 6
    with pytest.raises(InputError) as err:
        run_step(alloc, IDS, 6, lambda req: [1.0] * req.total)
    assert err.value.argument == "generate"
    with pytest.raises(InputError) as err:
        run_step(alloc, IDS, 6, lambda req: {"entropy": torch.ones(req.total)})
    assert err.value.argument == "rewards"
    with pytest.raises(InputError) as err:
        run_step(alloc, IDS, 6, "not callable")  # type: ignore[arg-type]
    assert err.value.argument == "generate"
    with pytest.raises(InputError) as err:  # Uniform asks for no signal
        run_step(alloc, IDS, 6, lambda req: {"rewards": torch.ones(req.total), "entropy": torch.ones(req.total)})
    assert err.value.argument == "entropy"


def test_run_step_updates_unless_told_not_to() -> None:
    from rolloutopt.allocators import DPS

    def gen(req: Request) -> torch.Tensor:
        return (torch.arange(req.total) % 2).float()

    a, b = DPS(n=2, seed=0), DPS(n=2, seed=0)
    run_step(a, IDS, 4, gen)
    res = run_step(b, IDS, 4, gen, update=False)
    assert not torch.equal(a.table.prompt_ids, b.table.prompt_ids)  # b has not learnt from the step
    b.update(res)
    assert torch.equal(a.table.prompt_ids, b.table.prompt_ids)
    ca, cb = a.table.state_dict()["columns"], b.table.state_dict()["columns"]
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca)
    assert torch.equal(a.state_dict()["generator"], b.state_dict()["generator"])


def test_run_step_hands_the_finished_plan_to_on_finish_before_the_update() -> None:
    """``on_finish(plan, result)`` is called once, with the finished plan (AR3PO's ``reused()`` is readable there)
    and the very result returned, before the allocator learns from it; a non-callable is refused."""
    from rolloutopt.allocators import AR3PO

    seen: list[tuple[object, AllocationResult, int]] = []
    alloc = AR3PO(k=2, seed=0, experimental=True)

    def hook(plan: object, result: AllocationResult) -> None:
        seen.append((plan, result, alloc._step))

    res = run_step(alloc, IDS, 6, lambda req: torch.zeros(req.total), on_finish=hook)
    assert len(seen) == 1 and seen[0][1] is res and seen[0][2] == 0  # before update() advanced the step
    assert alloc._step == 1 and seen[0][0].reused().rows.numel() == 0  # type: ignore[attr-defined]
    with pytest.raises(InputError) as err:
        run_step(alloc, IDS, 6, lambda req: torch.zeros(req.total), on_finish="log")  # type: ignore[arg-type]
    assert err.value.argument == "on_finish"
