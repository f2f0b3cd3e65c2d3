"""DAPODynamicSampling: a hand oracle, a replay of verl's filter_groups loop, budget, determinism, bad input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators import AllocationResult, Conversation
from rolloutopt.allocators.dynamic import DAPODynamicSampling
from rolloutopt.errors import InputError

Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def table_scorer(table: dict[int, list[float]]) -> Scorer:
    """Rewards from a fixed table: prompt p's k-th rollout gets table[p][k]."""

    def score(pid: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [torch.tensor(table[int(p)][: int(c)], dtype=torch.float64) for p, c in zip(pid, counts, strict=True)]
        )

    return score


def drive(plan: Conversation, score: Scorer) -> tuple[AllocationResult, list[list[int]]]:
    rounds = []
    while (req := plan.next()) is not None:
        rounds.append(req.prompt_ids.tolist())
        plan.observe(req, score(req.prompt_ids, req.counts))
    return plan.finish(), rounds


def reasons(res: AllocationResult) -> list[str]:
    return [res.reason_names[int(r)] for r in res.reasons]


# -- by hand following verl's recipe/dapo/dapo_ray_trainer.py ----------------------------------------------------


def test_oracle_keeps_only_the_varied_group() -> None:
    score = table_scorer({0: [1, 1, 1, 1], 1: [0, 0, 0, 0], 2: [1, 0, 0, 0]})
    alloc = DAPODynamicSampling(batch_size=1, n=4, gen_batch_size=3, shuffle=False)
    res, rounds = drive(alloc.plan(torch.tensor([0, 1, 2]), 100), score)
    assert rounds == [[0, 1, 2]]
    assert reasons(res) == ["zero_variance", "zero_variance", "kept"]
    assert res.weight.tolist() == [0.0] * 8 + [1.0] * 4
    assert res.counts.tolist() == [4, 4, 4]
    assert float(res.metrics["zero_variance_frac"]) == 8 / 12
    assert float(res.metrics["kept_groups"]) == 1 and float(res.metrics["target_reached"]) == 1


def test_oracle_two_rounds_when_half_survive() -> None:
    # 2 of every 4 prompts have variance, B = 4: round 1 keeps 2, round 2 keeps 2 more
    varied, flat = [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]
    table = {p: (varied if p % 2 == 0 else flat) for p in range(12)}
    alloc = DAPODynamicSampling(batch_size=4, n=4, gen_batch_size=4, shuffle=False)
    res, rounds = drive(alloc.plan(torch.arange(12), 1000), table_scorer(table))
    assert rounds == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert float(res.metrics["rounds"]) == 2 and res.rewards.numel() == 32
    assert reasons(res) == ["kept", "zero_variance"] * 4 + ["not_needed"] * 4
    assert float(res.weight.sum()) == 16


def test_truncation_marks_surplus_in_sampling_order() -> None:
    table = {p: [0.0, 1.0] for p in (50, 40, 30, 20, 10, 0)}  # every group varied
    alloc = DAPODynamicSampling(batch_size=2, n=2, gen_batch_size=3, shuffle=False)
    res, rounds = drive(alloc.plan(torch.tensor([50, 40, 30, 20, 10, 0]), 100), table_scorer(table))
    assert rounds == [[50, 40, 30]]
    assert reasons(res) == ["kept", "kept", "surplus", "not_needed", "not_needed", "not_needed"]
    assert res.weight.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_non_binary_rewards_and_singletons() -> None:
    table = {0: [0.3, 0.3, 0.3], 1: [0.1 + 0.2, 0.3, 0.3], 2: [0.3, 0.3, 0.30000000000000004]}
    res, _ = drive(DAPODynamicSampling(batch_size=3, n=3, shuffle=False).plan(torch.arange(3), 9), table_scorer(table))
    # 0.1 + 0.2 != 0.3 in binary floating point: groups 1 and 2 are (barely) varied, group 0 is not
    assert reasons(res) == ["zero_variance", "kept", "kept"]
    one = DAPODynamicSampling(batch_size=2, n=1, gen_batch_size=2, shuffle=False)
    res, _ = drive(one.plan(torch.arange(4), 10), table_scorer({p: [1.0] for p in range(4)}))
    assert reasons(res) == ["kept", "kept", "not_needed", "not_needed"]  # n = 1 keeps every group (verl)


def test_constant_non_dyadic_group_is_dropped_unlike_verl_std() -> None:
    """Seven rewards of 0.1: verl keeps the group, we drop it (deliberate; the rule's intent).

    verl ``volcengine/verl@004c888001c88628b98fbc5fdee9c3e9b8898800``, ``recipe/dapo/dapo_ray_trainer.py``:
    ``prompt_uid2metric_std[uid] = np.std(metric_vals)``, kept iff ``std > 0 or len(metric_vals) == 1``.
    NumPy's float64 std of seven 0.1s is 1.3877787807814457e-17 (the mean 0.1 + rounding), so verl keeps a
    group whose advantages are all zero. Ours compares max and min: all equal, so ``"zero_variance"``.
    """
    np = pytest.importorskip("numpy")
    sevens = [0.1] * 7
    verl_std = float(np.std(sevens))  # computed the way verl computes it
    assert verl_std > 0 and verl_std < 1e-16  # verl would keep this group
    table = {0: sevens, 1: [0.1] * 6 + [0.2]}
    alloc = DAPODynamicSampling(batch_size=1, n=7, gen_batch_size=2, shuffle=False)
    res, rounds = drive(alloc.plan(torch.tensor([0, 1]), 14), table_scorer(table))
    assert rounds == [[0, 1]]
    assert reasons(res) == ["zero_variance", "kept"]  # verl: ["kept", "surplus"] (prompt 0 fills the batch)
    assert res.weight.tolist() == [0.0] * 7 + [1.0] * 7
    assert float(res.metrics["zero_variance_frac"]) == 7 / 14


# -- budget, pool and round limits ------------------------------------------------------------------------------


def test_budget_shrinks_the_last_round_and_is_never_exceeded() -> None:
    flat = {p: [1.0] * 4 for p in range(20)}
    alloc = DAPODynamicSampling(batch_size=5, n=4, gen_batch_size=3, shuffle=False, on_shortfall="keep")
    plan = alloc.plan(torch.arange(20), 30)  # 7 groups of 4 fit, with 2 rollouts left over
    res, rounds = drive(plan, table_scorer(flat))
    assert [len(r) for r in rounds] == [3, 3, 1]
    assert plan.spent == 28 and res.rewards.numel() == 28
    assert reasons(res) == ["zero_variance"] * 7 + ["no_budget"] * 13
    assert float(res.metrics["target_reached"]) == 0 and float(res.metrics["zero_variance_frac"]) == 1.0
    res, rounds = drive(alloc.plan(torch.arange(20), 3), table_scorer(flat))  # below n: nothing
    assert rounds == [] and res.rewards.numel() == 0 and set(reasons(res)) == {"no_budget"}
    res, rounds = drive(alloc.plan(torch.zeros(0, dtype=torch.long), 100), table_scorer(flat))
    assert rounds == [] and res.counts.numel() == 0


def test_round_limit_raises_like_verl_or_keeps() -> None:
    flat = {p: [0.0, 0.0] for p in range(100)}
    alloc = DAPODynamicSampling(batch_size=4, n=2, gen_batch_size=5, max_num_gen_batches=3, shuffle=False)
    plan = alloc.plan(torch.arange(100), 10_000)
    for _ in range(3):
        req = plan.next()
        assert req is not None
        plan.observe(req, torch.zeros(req.total))
    with pytest.raises(InputError, match="max_num_gen_batches"):
        plan.next()
    keep = DAPODynamicSampling(batch_size=4, n=2, gen_batch_size=5, max_num_gen_batches=3, on_shortfall="keep")
    res, rounds = drive(keep.plan(torch.arange(100), 10_000), table_scorer(flat))
    assert len(rounds) == 3 and float(res.weight.sum()) == 0
    unlimited = DAPODynamicSampling(batch_size=4, n=2, gen_batch_size=5, max_num_gen_batches=0)
    res, rounds = drive(unlimited.plan(torch.arange(100), 10_000), table_scorer(flat))
    assert len(rounds) == 20 and res.rewards.numel() == 200  # until the pool is exhausted, no error


# -- a replay of verl's recipe/dapo loop (Python, per uid), on random reward tables ---------------------------


def verl_replay(order: list[int], table: dict[int, list[float]], b: int, n: int, gen: int) -> list[int]:
    """verl's ``filter_groups`` loop, transcribed: returns the prompts of the training batch, in order."""
    batch: list[int] = []
    num_prompt_in_batch = 0
    for start in range(0, len(order), gen):
        new = order[start : start + gen]
        # verl tests np.std(vals) > 0; on the 0/1 tables used here that is max != min (not on 0.1s: see
        # test_constant_non_dyadic_group_is_dropped_unlike_verl_std)
        kept = [p for p in new if max(table[p][:n]) != min(table[p][:n]) or n == 1]
        num_prompt_in_batch += len(kept)
        batch += kept
        if num_prompt_in_batch >= b:
            return batch[:b]  # batch[:traj_bsz]
    return batch


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    p=st.integers(1, 30),
    b=st.integers(1, 8),
    n=st.integers(1, 4),
    gen=st.integers(1, 10),
)
def test_matches_verl_replay(data: st.DataObject, p: int, b: int, n: int, gen: int) -> None:
    table = {i: data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n)) for i in range(p)}
    alloc = DAPODynamicSampling(batch_size=b, n=n, gen_batch_size=gen, max_num_gen_batches=0, seed=p)
    plan = alloc.plan(torch.arange(p), 10**6)
    res, rounds = drive(plan, table_scorer(table))
    order = [q for r in rounds for q in r]
    expected = verl_replay(order, table, b, n, gen)
    kept = res.plan_prompt_ids[res.reasons == 0]
    assert sorted(kept.tolist()) == sorted(expected)
    assert float(res.weight.sum()) == n * len(expected)
    assert sorted(order) == sorted(set(order))  # a prompt is sampled at most once per step


# -- properties ---------------------------------------------------------------------------------------------


def random_scorer(seed: int) -> Scorer:
    g = torch.Generator().manual_seed(seed)

    def score(pid: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        p = (pid.double() % 7 / 7).repeat_interleave(counts)
        return torch.bernoulli(p, generator=g)

    return score


@settings(max_examples=30, deadline=None)
@given(p=st.integers(0, 40), budget=st.integers(0, 400), b=st.integers(1, 10), n=st.integers(1, 6))
def test_budget_conservation_and_caps(p: int, budget: int, b: int, n: int) -> None:
    alloc = DAPODynamicSampling(batch_size=b, n=n, gen_batch_size=2 * b, on_shortfall="keep", seed=1)
    plan = alloc.plan(torch.arange(p) * 3, budget)
    res, _ = drive(plan, random_scorer(p))
    assert plan.spent == res.rewards.numel() <= budget
    assert set(res.counts.tolist()) <= {0, n}  # every sampled group is full
    assert float(res.weight.sum()) == n * int((res.reasons == 0).sum()) <= n * b
    assert bool(((res.weight == 0) | (res.weight == 1)).all())


def test_determinism_and_seed() -> None:
    pool = torch.arange(100, 160)

    def once(seed: int) -> AllocationResult:
        alloc = DAPODynamicSampling(batch_size=6, n=4, gen_batch_size=8, seed=seed)
        return drive(alloc.plan(pool, 1000), random_scorer(0))[0]

    a, b, c = once(3), once(3), once(4)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.weight, b.weight)
    assert not torch.equal(a.prompt_ids, c.prompt_ids)


def test_permutation_of_prompt_order_permutes_the_result() -> None:
    pool = torch.arange(40) * 5 + 1
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    a, ra = drive(DAPODynamicSampling(batch_size=5, n=3, gen_batch_size=7, seed=2).plan(pool, 500), random_scorer(1))
    b, rb = drive(
        DAPODynamicSampling(batch_size=5, n=3, gen_batch_size=7, seed=2).plan(pool[perm], 500), random_scorer(1)
    )
    assert ra == rb  # the same prompts, in the same sampling order
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.rewards, b.rewards)
    assert torch.equal(a.weight, b.weight)
    assert torch.equal(a.reasons[perm], b.reasons) and torch.equal(a.counts[perm], b.counts)


def test_shuffle_false_uses_the_given_order() -> None:
    table = {p: [0.0, 1.0] for p in range(10)}
    _, rounds = drive(
        DAPODynamicSampling(batch_size=3, n=2, gen_batch_size=3, shuffle=False).plan(torch.arange(9, -1, -1), 99),
        table_scorer(table),
    )
    assert rounds == [[9, 8, 7]]


def test_state_dict_mid_run_continues_identically() -> None:
    pool = torch.arange(50)

    def steps(alloc: DAPODynamicSampling, k: int, seed: int) -> list[torch.Tensor]:
        out = []
        for i in range(k):
            res, _ = drive(alloc.plan(pool, 400), random_scorer(seed + i))
            alloc.update(res)
            out.append(torch.cat([res.prompt_ids.double(), res.weight]))
        return out

    a = DAPODynamicSampling(batch_size=4, n=4, gen_batch_size=6, seed=9)
    steps(a, 2, 0)
    state = a.state_dict()
    b = DAPODynamicSampling(batch_size=4, n=4, gen_batch_size=6, seed=123)
    b.load_state_dict(state)
    for x, y in zip(steps(a, 3, 10), steps(b, 3, 10), strict=True):
        assert torch.equal(x, y)


def test_defaults_are_the_dapo_script() -> None:
    alloc = DAPODynamicSampling()
    assert (alloc.batch_size, alloc.n, alloc.gen_batch_size, alloc.max_num_gen_batches) == (512, 16, 1536, 10)
    assert alloc.on_shortfall == "raise" and alloc.shuffle
    plan = alloc.plan(torch.arange(2000), 1536 * 16 * 10)
    req = plan.next()
    assert req is not None and req.prompt_ids.numel() == 1536 and set(req.counts.tolist()) == {16}


# -- bad input ------------------------------------------------------------------------------------------------


def test_bad_plan_and_observe_input() -> None:
    alloc = DAPODynamicSampling(batch_size=2, n=2, gen_batch_size=2)
    with pytest.raises(InputError, match="budget"):
        alloc.plan(torch.arange(4), -1)
    with pytest.raises(InputError, match="prompt_ids"):
        alloc.plan(torch.tensor([1.0, 2.0]), 8)
    with pytest.raises(InputError, match="prompt_ids"):
        alloc.plan(torch.tensor([1, 1]), 8)
    plan = alloc.plan(torch.arange(4), 8)
    req = plan.next()
    assert req is not None
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(3))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.tensor([0.0, 1.0, float("nan"), 0.0]))
    with pytest.raises(InputError, match="rewards"):
        plan.observe(req, torch.zeros(4, dtype=torch.long))
    with pytest.raises(InputError, match="request"):  # a request this plan did not issue (unknown ids)
        plan.observe(type(req)(torch.tensor([99, 98]), req.counts), torch.zeros(4))
    plan.observe(req, torch.tensor([0.0, 1.0, 0.0, 1.0]))
    with pytest.raises(InputError, match="state"):
        alloc.load_state_dict({"generator": 3})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"n": 0}, "n"),
        ({"n": 2.0}, "n"),
        ({"gen_batch_size": 0}, "gen_batch_size"),
        ({"max_num_gen_batches": -1}, "max_num_gen_batches"),
        ({"on_shortfall": "warn"}, "on_shortfall"),
        ({"shuffle": 1}, "shuffle"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_config(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(InputError, match=name):
        DAPODynamicSampling(**kwargs)


def test_state_refuses_a_bad_generator_naming_it_and_keeps_its_own() -> None:
    """The only field is the generator: a string, a float tensor or an invalid generator state is an
    ``InputError`` naming ``state['generator']``, and the allocator draws as if nothing had been tried."""
    a = DAPODynamicSampling(batch_size=2, n=2, gen_batch_size=3, seed=4)
    twin = DAPODynamicSampling(batch_size=2, n=2, gen_batch_size=3, seed=4)
    good = a.state_dict()
    assert good["format"] == 1
    bad_gens = ("not a tensor", torch.zeros(5, dtype=torch.float64), torch.zeros(3, dtype=torch.uint8))
    for gen in bad_gens:
        with pytest.raises(InputError) as err:
            a.load_state_dict({**good, "generator": gen})
        assert err.value.argument == "state['generator']"
    with pytest.raises(InputError) as err:
        a.load_state_dict({**good, "format": 0})
    assert err.value.argument == "state['format']"
    pa, pb = a.plan(torch.arange(10), 40).next(), twin.plan(torch.arange(10), 40).next()
    assert pa is not None and pb is not None and torch.equal(pa.prompt_ids, pb.prompt_ids)
