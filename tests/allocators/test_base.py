"""The allocation protocol (Conversation) and the Uniform baseline: hand examples, properties, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators import AllocationResult, Conversation, Request, Uniform
from rolloutopt.errors import InputError


def run(plan: Conversation, reward: float = 1.0) -> AllocationResult:
    while (req := plan.next()) is not None:
        plan.observe(req, torch.full((req.total,), reward))
    return plan.finish()


def test_uniform_hand_example() -> None:
    res = run(Uniform().plan(torch.tensor([5, 3, 9]), 8))
    assert res.prompt_ids.tolist() == [5, 5, 5, 3, 3, 3, 9, 9]
    assert res.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert res.counts.tolist() == [3, 3, 2]
    assert [res.reason_of(p) for p in (5, 3, 9)] == ["remainder", "remainder", "uniform"]
    assert res.weight.tolist() == [1.0] * 8 and res.rewards.dtype == torch.float32  # fp32 rewards observed
    assert float(res.metrics["budget_used_frac"]) == 1.0


@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [
        ((torch.float32,), torch.float32),
        ((torch.bfloat16,), torch.float32),
        ((torch.float16,), torch.float32),
        ((torch.float64,), torch.float64),
        ((torch.float64, torch.float32), torch.float32),
        ((torch.float64, torch.float64), torch.float64),
        ((), torch.float32),  # nothing observed
    ],
)
def test_result_dtype_is_fp32_unless_every_observe_was_float64(
    dtypes: tuple[torch.dtype, ...], expected: torch.dtype
) -> None:
    """Rewards and weights come back fp32 (float64 only when every observed reward tensor was float64), so the
    advantages computed from them and the loss stay fp32 with fp32 log-probs; the values are the observed ones."""
    from rolloutopt.advantages import grpo

    plan = Conversation(torch.tensor([4, 7]), 8)
    values = [torch.tensor([0.5, 1.0, 0.0, 0.25]), torch.tensor([1.0, 0.0, 0.75, 0.5])]
    pending = list(dtypes)

    def decide() -> Request | None:
        if not pending:
            return None
        pending.pop(0)
        return Request(torch.tensor([4, 7]), torch.tensor([2, 2]))

    plan.decide = decide  # type: ignore[method-assign]
    for dtype, value in zip(dtypes, values, strict=False):
        req = plan.next()
        assert req is not None
        plan.observe(req, value.to(dtype))
    assert plan.next() is None
    res = plan.finish()
    assert res.rewards.dtype == expected and res.weight.dtype == expected
    assert res.rewards.tolist() == [0.5, 1.0, 0.0, 0.25, 1.0, 0.0, 0.75, 0.5][: 4 * len(dtypes)]
    if dtypes:
        assert grpo(res.rewards, res.group).advantages.dtype == expected


def test_uniform_fixed_n_and_small_budget() -> None:
    res = run(Uniform(n=4).plan(torch.tensor([1, 2, 3]), 20))
    assert res.counts.tolist() == [4, 4, 4] and float(res.metrics["rollouts"]) == 12
    res = run(Uniform(n=4).plan(torch.tensor([1, 2, 3]), 2))  # budget // P = 0: nobody gets anything
    assert res.counts.tolist() == [0, 0, 0] and res.reason_of(2) == "no_budget" and res.rewards.numel() == 0


class TwoRounds(Conversation):
    """A tiny allocator: one rollout each, then two more for the prompt with the highest mean so far."""

    reason_names = ("allocated", "topped_up")

    def __init__(self, ids: torch.Tensor, budget: int) -> None:
        super().__init__(ids, budget)
        self.round = 0

    def decide(self) -> Request | None:
        self.round += 1
        if self.round == 1:
            return Request(self.prompt_ids, torch.ones_like(self.prompt_ids))
        if self.round == 2:
            n, s, _ = self.totals()
            best = int((s / n.clamp(min=1)).argmax())
            return Request(self.prompt_ids[best : best + 1], torch.tensor([2]))
        return None

    def select(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, _, _ = self.totals()
        return torch.ones(self.spent_observed), (n > 1).long()


def test_conversation_accumulates_across_requests() -> None:
    plan = TwoRounds(torch.tensor([10, 20, 30]), 5)
    req = plan.next()
    assert req is not None
    plan.observe(req, torch.tensor([0.0, 1.0, 0.5]))
    req = plan.next()
    assert req is not None and req.prompt_ids.tolist() == [20]
    plan.observe(req, torch.tensor([1.0, 0.0]))
    assert plan.next() is None
    res = plan.finish()
    assert res.prompt_ids.tolist() == [10, 20, 30, 20, 20]
    assert res.group.tolist() == [0, 1, 2, 1, 1]
    assert res.counts.tolist() == [1, 3, 1]
    _, s, sq = plan.totals()
    assert s.tolist() == [0.0, 2.0, 0.5] and sq.tolist() == [0.0, 2.0, 0.25]
    assert res.reason_of(20) == "topped_up" and res.reason_of(10) == "allocated"


def test_budget_overrun_is_an_allocator_bug() -> None:
    plan = TwoRounds(torch.tensor([10, 20, 30]), 3)  # round 1 spends 3, round 2 asks 2 more
    req = plan.next()
    assert req is not None
    plan.observe(req, torch.zeros(3))
    with pytest.raises(AssertionError, match="budget"):
        plan.next()


@pytest.mark.parametrize(
    ("rewards", "match"),
    [
        (torch.zeros(7), "rewards"),
        (torch.zeros(2, 4), "rewards"),
        (torch.tensor([0.0, float("nan"), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]), "rewards"),
        (torch.zeros(8, dtype=torch.long), "rewards"),
        ([0.0] * 8, "rewards"),
    ],
)
def test_bad_rewards(rewards: object, match: str) -> None:
    plan = Uniform().plan(torch.tensor([1, 2]), 8)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match=match):
        plan.observe(req, rewards)


def test_protocol_misuse() -> None:
    plan = Uniform().plan(torch.tensor([1, 2]), 4)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match=r"plan\.next"):
        plan.next()  # pending request
    with pytest.raises(InputError, match="request"):
        plan.observe(Request(req.prompt_ids, req.counts), torch.zeros(4))  # not the issued request
    with pytest.raises(InputError, match="finish"):
        plan.finish()
    plan.observe(req, torch.zeros(4))
    with pytest.raises(InputError, match="request"):
        plan.observe(req, torch.zeros(4))  # observed twice
    assert plan.next() is None
    plan.finish()
    with pytest.raises(InputError):
        plan.finish()


@pytest.mark.parametrize(
    ("ids", "budget", "arg"),
    [
        (torch.tensor([1, 1, 2]), 4, "prompt_ids"),
        (torch.tensor([1.0, 2.0]), 4, "prompt_ids"),
        (torch.tensor([[1, 2]]), 4, "prompt_ids"),
        ([1, 2], 4, "prompt_ids"),
        (torch.tensor([1, 2]), -1, "budget"),
        (torch.tensor([1, 2]), 2.5, "budget"),
        (torch.tensor([1, 2]), True, "budget"),
    ],
)
def test_bad_plan_input(ids: object, budget: object, arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        Uniform().plan(ids, budget)  # type: ignore[arg-type]


def test_bad_uniform_n() -> None:
    for n in (0, -1, 2.0, True):
        with pytest.raises(InputError, match="n"):
            Uniform(n=n)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=30, unique=True),
    budget=st.integers(0, 200),
    n=st.one_of(st.none(), st.integers(1, 10)),
    seed=st.integers(0, 2**16),
)
def test_uniform_properties(ids: list[int], budget: int, n: int | None, seed: int) -> None:
    """Budget conservation and caps; a permutation of the prompts permutes the per-prompt plan (remainder aside)."""
    t = torch.tensor(ids)
    res = run(Uniform(n=n).plan(t, budget))
    assert int(res.counts.sum()) == res.rewards.numel() <= budget
    if n is None:
        assert int(res.counts.sum()) == budget
        assert int(res.counts.max() - res.counts.min()) <= 1
    else:
        assert int(res.counts.max()) <= n
    assert torch.equal(res.prompt_ids, t[res.group])
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    res_p = run(Uniform(n=n).plan(t[perm], budget))
    assert sorted(res_p.counts.tolist()) == sorted(res.counts.tolist())
    if n is not None or budget % len(ids) == 0:
        assert torch.equal(res_p.counts, res.counts[perm])


def test_uniform_state_dict_round_trip() -> None:
    a = Uniform(n=3)
    b = Uniform(n=3)
    b.load_state_dict(a.state_dict())
    ra, rb = run(a.plan(torch.tensor([4, 5]), 10)), run(b.plan(torch.tensor([4, 5]), 10))
    assert torch.equal(ra.counts, rb.counts)


def test_uniform_state_is_only_a_format_version() -> None:
    """Stateless: the state is the format version; any key, a non-dict or another version is refused."""
    alloc = Uniform(n=3)
    assert alloc.state_dict() == {"format": 1}
    alloc.load_state_dict({})  # saved before format versions were written: version 1
    for bad, arg in (({"x": torch.zeros(1)}, "state"), ("state", "state"), ({"format": 2}, "state['format']")):
        with pytest.raises(InputError) as err:
            alloc.load_state_dict(bad)  # type: ignore[arg-type]
        assert err.value.argument == arg
    res = run(alloc.plan(torch.tensor([4, 5]), 10))
    assert res.counts.tolist() == [3, 3]
