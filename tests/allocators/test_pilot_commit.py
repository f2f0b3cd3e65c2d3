"""PilotCommit: hand oracles, properties, bad input.

Pilot-Commit's oracles are computed by hand following ``databricks/pilot-commit``
(``recipe/pc/pc_ray_trainer.py``, ``recipe/pc/utils.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators import AllocationResult, Uniform
from rolloutopt.allocators.pilot_commit import PilotCommit
from rolloutopt.allocators.vigor import VIGOR, vigor_speedup
from rolloutopt.errors import InputError

from .helpers import Rewards, hashed, run, table
from .topup_helpers import check_bad_protocol_input, reasons

# ---------------------------------------------------------------------------------------------- PilotCommit oracles
ORACLE = {10: 0, 11: 1, 12: 6, 13: 7, 14: 8}  # pilot successes out of 8


def pilot_table(succ: dict[int, int], commit: float = 1.0) -> Rewards:
    return lambda pid, k: (1.0 if k < succ[pid] else 0.0) if k < 8 else commit


def test_pilot_commit_oracle_classification() -> None:
    # Pilot-Commit, p_upper .25, p_lower .125, p_solve 1.0 (the defaults), n_pilot 8. Means {0, 1/8, 6/8, 7/8, 1}:
    # keep {1/8, 6/8}, too incorrect {0}, too correct {7/8, 1}, evicted {1}.
    pc = PilotCommit(n_pilot=8, n_commit=4)
    res, reqs = run(pc.plan(torch.tensor(list(ORACLE)), 1000), pilot_table(ORACLE))
    assert reqs == [([10, 11, 12, 13, 14], [8] * 5), ([12, 11], [4, 4])]  # commit order: std .433 before .331
    assert reasons(res) == ["too_incorrect", "committed", "committed", "too_correct", "too_correct"]
    assert res.counts.tolist() == [8, 12, 12, 8, 8]
    kept = res.weight.bool()
    assert torch.equal(res.group[kept].unique(), torch.tensor([1, 2])) and int(kept.sum()) == 24
    pc.update(res)
    assert pc.evicted_ids().tolist() == [14] and pc.buffered_ids().tolist() == []
    res2, reqs2 = run(pc.plan(torch.tensor([14, 10]), 1000), pilot_table({10: 4, 14: 8}))
    assert reqs2[0] == ([10], [8]) and reasons(res2) == ["evicted", "committed"] and res2.counts[0] == 0


@pytest.mark.parametrize(("succ", "ones"), [(6, 2), (1, 1), (7, 3), (4, 2)])
def test_pilot_commit_max_variance_downsample(succ: int, ones: int) -> None:
    # Pilot-Commit: [1,1,1,1,1,1,0,0] down to 4 keeps two 1s and two 0s; with a single 1 (or 0) it keeps it and
    # fills up.
    for seed in range(5):
        pc = PilotCommit(n_pilot=8, n_commit=3, n_pilot_eff=4, p_lower=0.1, p_upper=0.1, seed=seed)
        res, _ = run(pc.plan(torch.tensor([5]), 100), pilot_table({5: succ}, commit=0.5))
        w, r = res.weight, res.rewards
        pilot_kept = r[:8][w[:8].bool()]
        assert pilot_kept.numel() == 4 and int(pilot_kept.sum()) == ones
        assert w[8:].tolist() == [1.0] * 3


def test_pilot_commit_rounds_gen_batch_and_buffer_carry() -> None:
    # gen batch 2, B = 1: round 1 pilots 20, 21 (both kept: 4/8, 2/8); round 2 commits the higher-std one (20,
    # std .5 > .433) and pilots 22, 23 in the same request; B is full, so 21, 22 (kept) stay buffered, 23
    # (0/8) is too incorrect.
    succ = {20: 4, 21: 2, 22: 3, 23: 0, 24: 5}
    pc = PilotCommit(n_pilot=8, n_commit=4, batch_size=1, gen_batch_size=2)
    res, reqs = run(pc.plan(torch.tensor([20, 21, 22, 23, 24]), 1000), pilot_table(succ))
    assert reqs == [([20, 21], [8, 8]), ([22, 23, 20], [8, 8, 4])]
    assert reasons(res) == ["committed", "buffered", "buffered", "too_incorrect", "not_piloted"]
    assert res.weight[res.group == 1].sum() == 0 and res.weight[res.group == 0].sum() == 12
    pc.update(res)
    assert pc.buffered_ids().tolist() == [21, 22]
    # next step: 22 (std sqrt(15/64) = .484) is committed without a new pilot, before 21 (.433); 24 is piloted.
    res2, reqs2 = run(pc.plan(torch.tensor([24, 22, 21]), 1000), pilot_table(succ))
    assert reqs2 == [([24, 22], [8, 4])]
    assert reasons(res2)[1] == "committed_carried" and res2.counts[1] == 4 and res2.weight[res2.group == 1].sum() == 4
    pc.update(res2)
    assert 22 not in pc.buffered_ids().tolist() and 21 in pc.buffered_ids().tolist()


def test_pilot_commit_ties_follow_pilot_order_like_the_code() -> None:
    """Equal pilot std and step: the prompt piloted first is committed first (not the lower id).

    ``databricks/pilot-commit@6def20ea211fc936ed092a5a08624807c54df381``, ``recipe/pc/replay_buffer.py``:
    ``add`` inserts kept prompts into a dict in the order of the explore batch (the data loader's), and
    ``_sample_by_variance`` sorts ``(uid, std, step)`` with ``sort(key=(std, step), reverse=True)``; Python's
    sort is stable, so equal keys keep the dict's insertion order (pilot order), also across steps.
    """
    # step 0: 30, 10, 20 all 4/8 (std .5, step 0), B = 2: the code commits 30 and 10 (inserted first), keeps 20
    pc = PilotCommit(n_pilot=8, n_commit=4, batch_size=2)
    res, reqs = run(pc.plan(torch.tensor([30, 10, 20]), 1000), pilot_table({30: 4, 10: 4, 20: 4}))
    assert reqs == [([30, 10, 20], [8, 8, 8]), ([30, 10], [4, 4])]  # the lower id first would give [10, 20]
    assert reasons(res) == ["committed", "committed", "buffered"]
    # across steps: 7, 6, 5 piloted in that order at step 0 (B = 1 commits 7); at step 1 the carried 6 and 5
    # tie on (std, step), and the code takes 6 (inserted before 5), whatever order the trainer re-lists them in
    pc = PilotCommit(n_pilot=8, n_commit=4, batch_size=1)
    res, reqs = run(pc.plan(torch.tensor([7, 6, 5]), 1000), pilot_table({7: 4, 6: 4, 5: 4}))
    assert reqs[1] == ([7], [4]) and reasons(res) == ["committed", "buffered", "buffered"]
    pc.update(res)
    assert pc.buffered_ids().tolist() == [5, 6]
    res2, reqs2 = run(pc.plan(torch.tensor([5, 6]), 1000), pilot_table({5: 4, 6: 4}))
    assert reqs2 == [([6], [4])] and reasons(res2) == ["buffered", "committed_carried"]


def test_pilot_commit_flushes_stale_buffer() -> None:
    pc = PilotCommit(n_pilot=8, n_commit=4, batch_size=1, max_off_steps=2)
    res, _ = run(pc.plan(torch.tensor([1, 2]), 1000), pilot_table({1: 4, 2: 3}))
    pc.update(res)  # step 0: 2 buffered (added at step 0)
    for step in (1, 2, 3):
        assert 2 in pc.buffered_ids().tolist(), step  # 2 - 0 <= 2 at every flush so far
        pc.update(run(pc.plan(torch.tensor([100 + step]), 1000), pilot_table({100 + step: 8}))[0])
    assert pc.buffered_ids().tolist() == []  # at the end of step 3: 3 - 0 > 2


def test_pilot_commit_divisible_by_and_max_rounds() -> None:
    # round 2: pilot 2 x 8 = 16 plus commit 3 x 4 = 12 -> 28; divisible by 8 needs an even commit count -> 2.
    succ = {1: 4, 2: 4, 3: 4, 4: 4, 5: 4}
    pc = PilotCommit(n_pilot=8, n_commit=4, gen_batch_size=3, divisible_by=8)
    _, reqs = run(pc.plan(torch.tensor([1, 2, 3, 4, 5]), 1000), pilot_table(succ))
    assert reqs[1] == ([4, 5, 1, 2], [8, 8, 4, 4])
    # every prompt too hard: rounds stop at max_rounds, batch not full
    pc = PilotCommit(n_pilot=8, n_commit=4, batch_size=1, gen_batch_size=1, max_rounds=3)
    res, reqs = run(pc.plan(torch.arange(10), 1000), pilot_table(dict.fromkeys(range(10), 0)))
    assert len(reqs) == 3 and float(res.metrics["batch_full"]) == 0 and float(res.metrics["committed"]) == 0


def test_pilot_commit_budget_reserves_commit() -> None:
    # budget 40, 8 + 4 per prompt: round 1 pilots 3 (3 x 12 = 36 <= 40); all kept -> 3 commits (12); 40 - 36 = 4 left.
    pc = PilotCommit(n_pilot=8, n_commit=4)
    res, reqs = run(pc.plan(torch.arange(5), 40), pilot_table(dict.fromkeys(range(5), 4)))
    assert reqs == [([0, 1, 2], [8, 8, 8]), ([0, 1, 2], [4, 4, 4])]
    assert reasons(res)[3:] == ["not_piloted", "not_piloted"] and res.rewards.numel() == 36


# ------------------------------------------------------------------------------------------ PilotCommit properties
@settings(max_examples=30, deadline=None)
@given(
    p=st.integers(1, 12),
    budget=st.integers(0, 300),
    seed=st.integers(0, 40),
    eff=st.one_of(st.none(), st.integers(0, 4)),
    batch=st.one_of(st.none(), st.integers(1, 5)),
    gen=st.one_of(st.none(), st.integers(1, 5)),
)
def test_pilot_commit_budget_and_caps(
    p: int, budget: int, seed: int, eff: int | None, batch: int | None, gen: int | None
) -> None:
    ids = torch.randperm(500, generator=torch.Generator().manual_seed(seed))[:p]
    kw = {"n_pilot": 4, "n_commit": 6, "n_pilot_eff": eff, "batch_size": batch, "gen_batch_size": gen}
    pc = PilotCommit(**kw, n_max=10, p_lower=0.25, p_upper=0.25, seed=seed)  # type: ignore[arg-type]
    res, _ = run(pc.plan(ids, budget), hashed(seed))
    c = res.counts
    assert int(c.sum()) == res.rewards.numel() <= budget and int(c.max()) <= 10
    trained = torch.zeros(p).index_add_(0, res.group, res.weight.float())
    committed = (res.reasons == 0).float()
    assert torch.equal(trained, committed * ((4 if eff is None else eff) + 6))
    assert batch is None or int(committed.sum()) <= batch
    again, _ = run(PilotCommit(**kw, n_max=10, p_lower=0.25, p_upper=0.25, seed=seed).plan(ids, budget), hashed(seed))  # type: ignore[arg-type]
    assert torch.equal(again.weight, res.weight) and torch.equal(again.reasons, res.reasons)


@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 10), seed=st.integers(0, 40))
def test_pilot_commit_permutation(p: int, seed: int) -> None:
    ids = torch.randperm(500, generator=torch.Generator().manual_seed(seed))[:p]
    perm = torch.randperm(p, generator=torch.Generator().manual_seed(seed + 1))
    pc = PilotCommit(n_pilot=4, n_commit=6, batch_size=3, p_lower=0.25, p_upper=0.25)
    a, _ = run(pc.plan(ids, 10_000), hashed(seed))
    b, _ = run(pc.plan(ids[perm], 10_000), hashed(seed))
    # Buffer ties on (pilot std, step) now go to the prompt piloted first, as in the code (previously: the lower
    # id), so which of two tied prompts is committed follows the given order; what is committed, buffered or
    # dropped, and how many rollouts each class gets, does not.
    assert sorted(b.counts.tolist()) == sorted(a.counts.tolist())
    assert sorted(b.reasons.tolist()) == sorted(a.reasons.tolist())
    # the kept prompts (committed, committed_carried or buffered) are the same set
    assert set(a.plan_prompt_ids[a.reasons <= 2].tolist()) == set(b.plan_prompt_ids[b.reasons <= 2].tolist())


def test_pilot_commit_state_dict_round_trip() -> None:
    def steps(pc: PilotCommit, start: int, n: int) -> list[AllocationResult]:
        out = []
        for s in range(start, start + n):
            ids = torch.cat([torch.arange(8) + 8 * s, pc.buffered_ids()])
            res, _ = run(pc.plan(ids, 120), hashed(s))
            pc.update(res)
            out.append(res)
        return out

    kw = {"n_pilot": 4, "n_commit": 4, "n_pilot_eff": 2, "batch_size": 3, "buffer_sampling": "random"}
    ref = PilotCommit(**kw, p_lower=0.25, p_upper=0.25, p_solve=0.75, seed=7)  # type: ignore[arg-type]
    steps(ref, 0, 2)
    saved = ref.state_dict()
    tail = steps(ref, 2, 3)
    fresh = PilotCommit(**kw, p_lower=0.25, p_upper=0.25, p_solve=0.75, seed=99)  # type: ignore[arg-type]
    fresh.load_state_dict(saved)
    again = steps(fresh, 2, 3)
    for x, y in zip(tail, again, strict=True):
        assert torch.equal(x.prompt_ids, y.prompt_ids) and torch.equal(x.weight, y.weight)
        assert torch.equal(x.reasons, y.reasons) and torch.equal(x.rewards, y.rewards)
    assert ref.state_dict()["step"] == fresh.state_dict()["step"] == 5
    assert torch.equal(ref.buffered_ids(), fresh.buffered_ids()) and torch.equal(ref.evicted_ids(), fresh.evicted_ids())


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"n_pilot": 0}, "n_pilot"),
        ({"n_commit": 0}, "n_commit"),
        ({"n_pilot_eff": 40}, "n_pilot_eff"),
        ({"p_upper": 1.5}, "p_upper"),
        ({"p_lower": 0.9}, "p_lower"),
        ({"p_solve": 2.0}, "p_solve"),
        ({"batch_size": 0}, "batch_size"),
        ({"buffer_sampling": "best"}, "buffer_sampling"),
        ({"divisible_by": 0}, "divisible_by"),
        ({"success": float("nan")}, "success"),
        ({"n_max": 100}, "n_max"),
        ({"n_min": 200}, "n_min"),
        ({"seed": -1}, "seed"),
    ],
)
def test_pilot_commit_bad_hyper_parameters(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises(InputError, match=rf"^{arg}"):
        PilotCommit(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [lambda: PilotCommit(n_pilot=2, n_commit=2)])
def test_bad_protocol_input(make: Callable[[], VIGOR | PilotCommit]) -> None:
    check_bad_protocol_input(make)


def test_pilot_commit_bad_update_and_state() -> None:
    pc = PilotCommit()
    uni, _ = run(Uniform().plan(torch.tensor([1]), 2), table({1: [1.0]}))
    with pytest.raises(InputError, match=r"^result"):
        pc.update(uni)
    with pytest.raises(InputError, match=r"^state"):
        pc.load_state_dict({"step": 0})
    with pytest.raises(InputError, match=r"^alpha"):
        vigor_speedup(1.0)
    with pytest.raises(InputError, match=r"^alpha"):
        vigor_speedup(torch.tensor([0.5]))


def test_pilot_commit_refuses_nan_and_negative_counters_naming_the_field() -> None:
    """A NaN pilot std, a negative step counter or buffer step, a buffer step not before the step counter and a
    versioned state without ``buffer_order``: an ``InputError`` naming the field, the allocator unchanged. A state
    saved before format versions and ``buffer_order`` loads with zero pilot order (the documented fallback)."""
    pc = PilotCommit(n_pilot=4, n_commit=4, batch_size=1, p_lower=0.25, p_upper=0.25)
    for s in range(3):
        res, _ = run(pc.plan(torch.cat([torch.arange(8) + 8 * s, pc.buffered_ids()]), 120), hashed(s))
        pc.update(res)
    good = pc.state_dict()
    m = good["buffer_ids"].numel()
    assert m >= 1
    nan_std = good["buffer_std"].clone()
    nan_std[0] = math.nan
    cases = [
        ({**good, "buffer_std": nan_std}, "state['buffer_std']"),
        ({**good, "step": -1}, "state['step']"),
        ({**good, "buffer_step": torch.full((m,), -1)}, "state['buffer_step']"),
        ({**good, "buffer_step": torch.full((m,), good["step"])}, "state['buffer_step']"),
        ({k: v for k, v in good.items() if k != "buffer_order"}, "state['buffer_order']"),
    ]
    for bad, arg in cases:
        with pytest.raises(InputError) as err:
            pc.load_state_dict(bad)
        assert err.value.argument == arg
    assert torch.equal(pc.state_dict()["buffer_std"], good["buffer_std"]) and pc.state_dict()["step"] == 3
    legacy = {k: v for k, v in good.items() if k not in ("buffer_order", "format")}
    fresh = PilotCommit(n_pilot=4, n_commit=4, batch_size=1, p_lower=0.25, p_upper=0.25)
    fresh.load_state_dict(legacy)
    assert torch.equal(fresh.state_dict()["buffer_order"], torch.zeros(m, dtype=torch.long))
    assert torch.equal(fresh.buffered_ids(), pc.buffered_ids())
