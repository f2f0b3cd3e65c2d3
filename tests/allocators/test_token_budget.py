"""Budgets in tokens: every allocator by name through the driver with a TokenBudget (six steps, a checkpoint round
trip mid-run that continues identically), the conversion and re-pricing by hand, ResponseLengths by hand, and
bad input."""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rolloutopt
import rolloutopt.allocators as allocators
from rolloutopt.allocators import (
    AllocationResult,
    DAPODynamicSampling,
    PromptTable,
    Request,
    ResponseLengths,
    TokenBudget,
    Uniform,
    run_step,
)
from rolloutopt.errors import InputError

from .helpers import same_state
from .test_registry import PER_PROMPT, answer, make

NAMES = allocators.names()
PROMPTS = torch.arange(10, 26)


def length_of(req: Request) -> torch.Tensor:
    """Response lengths that depend on the prompt (prompt id 10 -> 20 tokens, ..., 25 -> 95) and the rollout."""
    pid = req.prompt_ids.repeat_interleave(req.counts)
    return ((pid - 10) * 5 + 20 + torch.arange(req.total) % 3).double()


def _generate(give: set[str], s: int) -> Any:
    def generate(req: Request) -> dict[str, torch.Tensor | None]:
        base = answer(give)(req)
        if "rewards" in base:
            base["rewards"] = (base["rewards"] + s + (req.prompt_ids.repeat_interleave(req.counts) // 3)) % 2
        if "tokens" in req.signals:
            base["tokens"] = length_of(req)
        return base

    return generate


def _token_steps(alloc: Any, lengths: ResponseLengths, name: str, steps: range, give: set[str]) -> list[Any]:
    out = []
    tokens = PER_PROMPT.get(name, 8) * PROMPTS.numel() * 50  # about the rollout budget at 50 tokens a response
    for s in steps:
        res = run_step(alloc, PROMPTS, lengths.budget(tokens, PROMPTS), _generate(give, s))
        lengths.update(res)
        out.append(res)
    return out


@pytest.mark.filterwarnings("ignore:GRESO.*epoch:UserWarning")
@pytest.mark.parametrize("name", NAMES)
def test_every_allocator_spends_a_token_budget_and_continues_identically_after_a_checkpoint(name: str) -> None:
    """Six steps with a TokenBudget (allocator and lengths on one shared table) in one go, against three steps, a
    ``torch.save``/``torch.load(weights_only=True)`` of the table, the allocator and the lengths, and three more:
    identical results and state. Every step asks for ``tokens`` and reports them with the budget."""
    entry = allocators.entry(name)
    give = set(entry.requires) | set(entry.accepts) | {"tokens"}

    def build() -> tuple[PromptTable, Any, ResponseLengths]:
        table = PromptTable()
        kwargs: dict[str, Any] = {"experimental": True} if entry.experimental is not None else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            cls = allocators.get(name)
            alloc = cls(**kwargs, table=table) if "table" in cls.__init__.__code__.co_varnames else make(name)
        return table, alloc, ResponseLengths(prior=40.0, table=table)

    t_whole, whole, l_whole = build()
    want = _token_steps(whole, l_whole, name, range(6), give)
    for res in want:
        m = res.metrics
        assert "tokens" in res.signals and float(m["tokens"]) == float(torch.nansum(res.signals["tokens"].double()))
        assert float(m["token_budget"]) == PER_PROMPT.get(name, 8) * PROMPTS.numel() * 50
        assert math.isclose(float(m["budget_used_frac"]), float(m["tokens"]) / float(m["token_budget"]))
    t_first, first, l_first = build()
    _token_steps(first, l_first, name, range(3), give)
    buf = io.BytesIO()
    torch.save({"table": t_first.state_dict(), "alloc": first.state_dict(), "lengths": l_first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    t_res, resumed, l_res = build()
    t_res.load_state_dict(saved["table"])
    resumed.load_state_dict(saved["alloc"])
    l_res.load_state_dict(saved["lengths"])
    got = _token_steps(resumed, l_res, name, range(3, 6), give)
    for a, b in zip(want[3:], got, strict=True):
        for field_name in ("prompt_ids", "group", "rewards", "weight", "counts", "reasons"):
            assert torch.equal(getattr(a, field_name), getattr(b, field_name)), field_name
    assert same_state(whole.state_dict(), resumed.state_dict()) and same_state(t_whole.state_dict(), t_res.state_dict())


def test_one_shot_conversion_by_hand() -> None:
    """Uniform(n=4) over 3 prompts of expected lengths 100, 200, 300 and 1,000 tokens: floor(1000 / 200) = 5
    rollouts, the first prompts by Uniform's own rule; the result reports tokens and the fraction of the budget."""
    plan = Uniform(n=4).plan(torch.tensor([1, 2, 3]), TokenBudget(1000, torch.tensor([100.0, 200.0, 300.0])))
    req = plan.next()
    assert req is not None and req.total <= 5 and "tokens" in req.signals
    plan.observe(req, torch.zeros(req.total), tokens=torch.full((req.total,), 150.0))
    assert plan.next() is None
    res = plan.finish()
    assert float(res.metrics["tokens"]) == 150.0 * req.total and float(res.metrics["token_budget"]) == 1000.0
    assert float(res.metrics["budget_used_frac"]) == 150.0 * req.total / 1000.0


def test_multi_round_reprices_with_the_tokens_spent() -> None:
    """DAPO dynamic sampling (groups of 2, one prompt per round): a budget of 1,000 tokens at an expected 100
    opens with 10 rollouts; the first group (flat rewards, dropped) costs 2 x 300 tokens, so the rest is
    floor(400 / 300) = 1 rollout: less than a group, and the step ends after 2 rollouts."""
    alloc = DAPODynamicSampling(batch_size=3, n=2, gen_batch_size=1, max_num_gen_batches=0)
    plan = alloc.plan(torch.tensor([7, 8, 9]), TokenBudget(1000, torch.full((3,), 100.0)))
    assert plan.budget == 10
    req = plan.next()
    assert req is not None and req.total == 2
    plan.observe(req, torch.ones(2), tokens=torch.tensor([300.0, 300.0]))
    assert plan.budget == 2 + 1
    assert plan.next() is None
    res = plan.finish()
    assert float(res.metrics["tokens"]) == 600.0 and float(res.metrics["budget_used_frac"]) == 0.6


def test_a_token_plan_requires_the_tokens_signal() -> None:
    plan = Uniform(n=2).plan(torch.tensor([1]), TokenBudget(100, torch.tensor([10.0])))
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError) as err:
        plan.observe(req, torch.zeros(req.total))
    assert err.value.argument == "tokens"


def test_response_lengths_by_hand() -> None:
    """decay 0.5: prompt 1 sees lengths (10, 30) then (40): 20, then 0.5 * 20 + 0.5 * 40 = 30; an unmeasured
    candidate gets the mean over the measured candidates, else over the table, else the prior."""
    lengths = ResponseLengths(prior=64.0)
    assert lengths.expected(torch.tensor([1, 2])).tolist() == [64.0, 64.0]

    def result(ids: list[int], group: list[int], tokens: list[float]) -> AllocationResult:
        g = torch.tensor(group)
        return AllocationResult(
            prompt_ids=torch.tensor(ids)[g],
            group=g,
            rewards=torch.zeros(len(group)),
            weight=torch.ones(len(group)),
            plan_prompt_ids=torch.tensor(ids),
            counts=torch.bincount(g, minlength=len(ids)),
            reasons=torch.zeros(len(ids), dtype=torch.long),
            reason_names=("allocated",),
            signals={"tokens": torch.tensor(tokens)},
        )

    lengths.update(result([1, 2], [0, 0, 1], [10.0, 30.0, 100.0]))
    assert lengths.expected(torch.tensor([1, 2, 3])).tolist() == [20.0, 100.0, 60.0]
    lengths.update(result([1], [0], [40.0]))
    assert lengths.expected(torch.tensor([1, 3])).tolist() == [30.0, 30.0]  # 3: the candidates' mean
    assert lengths.expected(torch.tensor([5])).tolist() == [65.0]  # no measured candidate: the table's mean
    budget = lengths.budget(600, torch.tensor([1, 2]))
    assert budget.tokens == 600 and budget.expected.tolist() == [30.0, 100.0] and budget.rollouts == 9
    lengths.update(result([4], [0, 0], [math.nan, 8.0]))  # a reused response without a length is skipped
    assert lengths.expected(torch.tensor([4])).tolist() == [8.0]


def test_response_lengths_refuse_bad_input_and_corrupted_state() -> None:
    with pytest.raises(InputError, match="prior"):
        ResponseLengths(prior=0.0)
    with pytest.raises(InputError, match="decay"):
        ResponseLengths(prior=1.0, decay=1.0)
    lengths = ResponseLengths(prior=10.0)
    res = run_step(Uniform(n=2), torch.tensor([1, 2]), 4, lambda r: torch.zeros(r.total))
    with pytest.raises(InputError) as err:
        lengths.update(res)
    assert err.value.argument == "result.signals['tokens']"
    with pytest.raises(InputError, match="tokens"):
        lengths.budget(-1, torch.tensor([1]))
    good = ResponseLengths(prior=10.0)
    nine = {"rewards": torch.zeros(4), "tokens": torch.full((4,), 9.0)}
    good.update(
        run_step(Uniform(n=2), torch.tensor([1, 2]), TokenBudget(40, torch.tensor([10.0, 10.0])), lambda r: nine)
    )
    with pytest.raises(InputError, match="response lengths >= 0"):
        run_step(
            Uniform(n=2), torch.tensor([1]), TokenBudget(40, torch.tensor([10.0])),
            lambda r: {"rewards": torch.zeros(r.total), "tokens": torch.full((r.total,), -1.0)},
        )  # fmt: skip
    with rolloutopt.checks(False):  # unchecked, a negative length reaches the result: update refuses it
        negative = run_step(
            Uniform(n=2), torch.tensor([1]), TokenBudget(40, torch.tensor([10.0])),
            lambda r: {"rewards": torch.zeros(r.total), "tokens": torch.full((r.total,), -1.0)},
        )  # fmt: skip
    with pytest.raises(InputError, match="non-negative") as err:
        good.update(negative)
    assert err.value.argument == "result.signals['tokens']"
    state = good.state_dict()
    state["table"]["rows"]["columns"]["lengths/mean"][0] = -1.0
    with pytest.raises(InputError) as err:
        ResponseLengths(prior=10.0).load_state_dict(state)
    assert err.value.argument == "state['table']['rows']['columns']['lengths/mean']"


@pytest.mark.parametrize(
    ("tokens", "expected", "argument"),
    [
        (-1, torch.tensor([1.0]), "tokens"),
        (1.5, torch.tensor([1.0]), "tokens"),
        (10, torch.tensor([0.0]), "expected"),
        (10, torch.tensor([math.nan]), "expected"),
        (10, torch.tensor([1]), "expected"),
        (10, [1.0], "expected"),
    ],
)
def test_token_budget_bad_input(tokens: Any, expected: Any, argument: str) -> None:
    with pytest.raises(InputError) as err:
        TokenBudget(tokens, expected)
    assert err.value.argument == argument


def test_a_token_budget_for_other_prompts_is_refused() -> None:
    with pytest.raises(InputError) as err:
        Uniform().plan(torch.tensor([1, 2, 3]), TokenBudget(100, torch.tensor([10.0, 10.0])))
    assert err.value.argument == "budget"


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 5000),
    lengths=st.lists(st.floats(1.0, 500.0, allow_nan=False), min_size=1, max_size=8),
    n=st.integers(1, 8),
)
def test_one_shot_plans_never_request_more_than_the_converted_budget(tokens: int, lengths: list[float], n: int) -> None:
    """For any budget and lengths, a one-round plan requests at most floor(T / mean L) rollouts."""
    expected = torch.tensor(lengths, dtype=torch.float64)
    budget = TokenBudget(tokens, expected)
    plan = Uniform(n=n).plan(torch.arange(len(lengths)), budget)
    req = plan.next()
    total = 0 if req is None else req.total
    assert total <= math.floor(tokens / float(expected.mean())) == budget.rollouts
