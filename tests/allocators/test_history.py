"""PromptHistory and stable_prompt_ids: hand examples, a naive reference model, eviction, checkpoints, bad input."""

from __future__ import annotations

import hashlib
import io
import math
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators import AllocationResult, Uniform
from rolloutopt.allocators.history import SUCCESS_PRESETS, PromptHistory, PromptStats, stable_prompt_ids
from rolloutopt.allocators.table import PromptTable
from rolloutopt.errors import InputError


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


# -- hand examples ---------------------------------------------------------------------------------------------


def test_hand_example_one_update() -> None:
    h = PromptHistory(window=3)
    # prompt 7: rewards 1, 0, 1 (2 successes of 3); prompt 2: 0, 0 (all wrong); prompt 9: 1 (all correct)
    h.update(ids(7, 2, 7, 9, 2, 7), t(1, 0, 0, 1, 0, 1), step=4)
    s = h.lookup(ids(9, 7, 2, 100))
    assert s.seen.tolist() == [True, True, True, False]
    assert s.rollouts.tolist() == [1, 3, 2, 0]
    assert s.successes.tolist() == [1, 2, 0, 0]
    assert s.groups.tolist() == [1, 1, 1, 0]
    torch.testing.assert_close(s.pass_rate, torch.tensor([1.0, 2 / 3, 0.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(s.reward_mean, torch.tensor([1.0, 2 / 3, 0.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(s.ema_pass_rate, torch.tensor([1.0, 2 / 3, 0.0, 0.5], dtype=torch.float64))
    assert s.last_step.tolist() == [4, 4, 4, -1]
    assert s.correct_run.tolist() == [1, 0, 0, 0]
    assert s.wrong_run.tolist() == [0, 0, 1, 0]
    assert s.flat_run.tolist() == [1, 0, 1, 0]
    assert s.window_count.tolist() == [1, 1, 1, 0]
    torch.testing.assert_close(s.window[:, 0], torch.tensor([1.0, 2 / 3, 0.0, 0.0], dtype=torch.float64))
    assert s.window[:, 1:].abs().sum() == 0
    assert s.window_rollouts[:, 0].tolist() == [1, 3, 2, 0] and s.window_successes[:, 0].tolist() == [1, 2, 0, 0]
    assert s.window_mask.tolist() == [[True, False, False]] * 3 + [[False] * 3]
    assert len(h) == 3 and h.prompt_ids.tolist() == [2, 7, 9]


def test_hand_example_three_steps_ema_runs_window() -> None:
    h = PromptHistory(window=2, ema_decay=0.5)
    h.update(ids(1, 1), t(1, 1), step=0)  # rate 1: ema 1, correct_run 1
    h.update(ids(1, 1, 1, 1), t(1, 1, 1, 1), step=3)  # rate 1: ema 1, correct_run 2
    h.update(ids(1, 1), t(0, 1), step=5)  # rate 1/2: ema 0.5*1 + 0.5*0.5 = 0.75, runs reset
    s = h.lookup(ids(1))
    assert s.rollouts.tolist() == [8] and s.successes.tolist() == [7] and s.groups.tolist() == [3]
    assert s.ema_pass_rate.tolist() == [0.75]
    assert s.correct_run.tolist() == [0] and s.wrong_run.tolist() == [0] and s.flat_run.tolist() == [0]
    assert s.last_step.tolist() == [5]
    assert s.window.tolist() == [[0.5, 1.0]]  # most recent first; the first group fell out of the window
    assert s.window_rollouts.tolist() == [[2, 4]] and s.window_successes.tolist() == [[1, 4]]
    assert s.window_count.tolist() == [2]
    assert s.window_pass_rate.tolist() == [5 / 6]  # (1 + 4) / (2 + 4), CoBA's sliding-window p
    assert s.pass_rate.tolist() == [7 / 8]
    h.update(ids(1), t(0), step=6)
    h.update(ids(1), t(0), step=7)
    s = h.lookup(ids(1))
    assert s.wrong_run.tolist() == [2] and s.flat_run.tolist() == [2] and s.correct_run.tolist() == [0]


def test_success_presets() -> None:
    rewards = t(0.99, 1.0, 1.0, 0.1, 0.1, 0.0)
    pid = ids(1, 1, 1, 2, 2, 2)
    exact = PromptHistory.from_preset("exact")
    dps = PromptHistory.from_preset("dps")
    greso = PromptHistory.from_preset("greso")
    for h in (exact, dps, greso):
        h.update(pid, rewards, step=0)
    # 0.99 is not exactly 1.0 and not >= 1: 2 of 3 successes; GRESO counts 0.99 >= 0.98
    assert exact.lookup(ids(1, 2)).successes.tolist() == [2, 0]
    assert dps.lookup(ids(1, 2)).successes.tolist() == [2, 0]
    assert greso.lookup(ids(1, 2)).successes.tolist() == [3, 0]
    # run lengths: exact/dps by rollout (prompt 1 not all-correct; prompt 2 all failures = not successes)
    assert exact.lookup(ids(1, 2)).correct_run.tolist() == [0, 0]
    assert exact.lookup(ids(1, 2)).wrong_run.tolist() == [0, 1]
    # GRESO by group mean: mean(0.99, 1, 1) = 0.9967 >= 0.98 all-correct; mean(0.1, 0.1, 0) = 0.0667 <= 0.11
    g = greso.lookup(ids(1, 2))
    assert g.correct_run.tolist() == [1, 0] and g.wrong_run.tolist() == [0, 1]
    assert SUCCESS_PRESETS["greso"]["failure_threshold"] == 0.11
    # == compares exactly; > excludes the threshold itself
    h = PromptHistory(success_threshold=0.5, success_compare=">")
    h.update(ids(3, 3), t(0.5, 0.6), step=0)
    assert h.lookup(ids(3)).successes.tolist() == [1]


def test_mean_basis_differs_from_rollout_basis() -> None:
    # group mean 0.1 with n = 10: one success of 10. By rollout it is neither all-correct nor all-wrong;
    # by GRESO's mean rule (<= 0.11) it is all-wrong.
    r = torch.zeros(10)
    r[0] = 1.0
    by_rollout = PromptHistory(success_threshold=0.98, failure_threshold=0.11)
    by_mean = PromptHistory(success_threshold=0.98, failure_threshold=0.11, run_basis="mean")
    for h in (by_rollout, by_mean):
        h.update(torch.full((10,), 5), r, step=0)
    assert by_rollout.lookup(ids(5)).wrong_run.tolist() == [0]
    assert by_mean.lookup(ids(5)).wrong_run.tolist() == [1]


def test_unseen_policies() -> None:
    prior = PromptHistory(prior_pass_rate=0.25)
    nan = PromptHistory(unseen="nan")
    strict = PromptHistory(unseen="raise")
    assert prior.lookup(ids(4)).pass_rate.tolist() == [0.25]  # an empty history
    for h in (prior, nan, strict):
        h.update(ids(1, 1), t(1, 0), step=0)
    s = prior.lookup(ids(1, 4))
    assert s.pass_rate.tolist() == [0.5, 0.25] and s.ema_pass_rate.tolist() == [0.5, 0.25]
    assert s.window_pass_rate.tolist() == [0.5, 0.25] and s.reward_mean.tolist() == [0.5, 0.25]
    s = nan.lookup(ids(1, 4))
    assert s.pass_rate[0] == 0.5 and math.isnan(float(s.pass_rate[1])) and math.isnan(float(s.ema_pass_rate[1]))
    assert s.rollouts.tolist() == [2, 0] and s.last_step.tolist() == [0, -1]
    assert strict.lookup(ids(1)).seen.tolist() == [True]
    with pytest.raises(InputError, match=r"prompt_ids.*unknown ids such as \[4\]"):
        strict.lookup(ids(1, 4))


def test_lookup_repeats_and_empty() -> None:
    h = PromptHistory()
    h.update(ids(3, 3, 8), t(1, 1, 0), step=2)
    s = h.lookup(ids(8, 3, 8))
    assert s.rollouts.tolist() == [1, 2, 1]
    e = h.lookup(torch.zeros(0, dtype=torch.long))
    assert isinstance(e, PromptStats) and e.rollouts.numel() == 0 and e.window.shape == (0, 8)
    h.update(torch.zeros(0, dtype=torch.long), torch.zeros(0), step=3)  # an empty batch changes nothing
    assert h.lookup(ids(3)).last_step.tolist() == [2]


# -- eviction --------------------------------------------------------------------------------------------------


def test_eviction_least_recent() -> None:
    h = PromptHistory(capacity=3)
    h.update(ids(10, 20), t(1, 0), step=0)
    h.update(ids(30), t(1), step=1)
    h.update(ids(10), t(1), step=2)  # 10 is now the most recent; 20 the least recent
    h.update(ids(40), t(0), step=3)  # full: evict 20
    assert h.prompt_ids.tolist() == [10, 30, 40]
    assert h.lookup(ids(20)).seen.tolist() == [False]
    h.update(ids(50, 60), t(0, 0), step=4)  # evict the two least recent: 30 (update 2), then 10 (update 3)
    assert h.prompt_ids.tolist() == [40, 50, 60]


def test_eviction_ties_and_batch_members_are_kept() -> None:
    h = PromptHistory(capacity=3)
    h.update(ids(5, 1, 9), t(1, 1, 1), step=0)  # all touched in one update: ties broken by smaller id
    h.update(ids(9, 7), t(0, 0), step=1)  # 9 is in the batch and must stay; evict 1 (smallest id of 1, 5)
    assert h.prompt_ids.tolist() == [5, 7, 9]
    assert h.lookup(ids(9)).rollouts.tolist() == [2]
    with pytest.raises(InputError, match=r"prompt_ids.*capacity=3"):
        h.update(ids(1, 2, 3, 4), t(0, 0, 0, 0), step=2)


def test_two_histories_share_one_table_and_eviction() -> None:
    """Two histories on one table: separate statistics, one id set; a row added by one is unseen by the other,
    and eviction (least recently added by either) removes the prompt for both."""
    table = PromptTable(capacity=3)
    a, b = PromptHistory(table=table), PromptHistory(table=table, window=2)
    assert table.owners == ("history", "history#2")
    a.update(ids(1, 1, 2), t(1, 0, 1), step=0)
    b.update(ids(2, 3), t(0, 0), step=0)
    assert table.prompt_ids.tolist() == [1, 2, 3]
    assert a.prompt_ids.tolist() == [1, 2] and b.prompt_ids.tolist() == [2, 3]
    assert a.lookup(ids(1, 2, 3)).rollouts.tolist() == [2, 1, 0] and a.lookup(ids(3)).seen.tolist() == [False]
    assert b.lookup(ids(1, 2)).seen.tolist() == [False, True] and b.lookup(ids(2)).pass_rate.tolist() == [0.0]
    a.update(ids(4), t(1), step=1)  # full: 1 is the least recently added (a's first update), evicted for both
    assert table.prompt_ids.tolist() == [2, 3, 4] and a.prompt_ids.tolist() == [2, 4]
    with pytest.raises(InputError, match="capacity"):
        PromptHistory(table=table, capacity=5)
    with pytest.raises(InputError, match="table"):
        PromptHistory(table="shared")  # type: ignore[arg-type]


# -- a naive reference model (Python loops, allowed in a test) ------------------------------------------------


class Naive:
    def __init__(self, capacity: int, window: int, beta: float) -> None:
        self.capacity, self.window, self.beta = capacity, window, beta
        self.d: dict[int, dict[str, Any]] = {}
        self.clock = 0

    def update(self, pid: list[int], rew: list[float], step: int) -> None:
        groups: dict[int, list[float]] = {}
        for p, r in zip(pid, rew, strict=True):
            groups.setdefault(p, []).append(r)
        if not groups:
            return
        new = [p for p in groups if p not in self.d]
        overflow = len(self.d) + len(new) - self.capacity
        if overflow > 0:
            cands = sorted((v["touch"], p) for p, v in self.d.items() if p not in groups)
            for _, p in cands[:overflow]:
                del self.d[p]
        self.clock += 1
        for p, rs in groups.items():
            e = self.d.setdefault(
                p, {"n": 0, "s": 0, "g": 0, "sum": 0.0, "ema": 0.0, "c": 0, "w": 0, "f": 0, "win": [], "touch": 0}
            )
            n, s = len(rs), sum(1 for r in rs if r >= 1.0)
            rate = s / n
            e["ema"] = rate if e["g"] == 0 else self.beta * e["ema"] + (1 - self.beta) * rate
            e["n"] += n
            e["s"] += s
            e["g"] += 1
            e["sum"] += sum(rs)
            e["c"] = e["c"] + 1 if s == n else 0
            e["w"] = e["w"] + 1 if s == 0 else 0
            e["f"] = e["f"] + 1 if max(rs) == min(rs) else 0
            e["win"] = ([(sum(rs) / n, n, s)] + e["win"])[: self.window]
            e["touch"] = self.clock
            e["step"] = step


def check_equal(h: PromptHistory, ref: Naive, probe: list[int]) -> None:
    assert sorted(ref.d) == h.prompt_ids.tolist()
    s = h.lookup(torch.tensor(probe, dtype=torch.long))
    for i, p in enumerate(probe):
        e = ref.d.get(p)
        assert bool(s.seen[i]) == (e is not None)
        if e is None:
            assert int(s.rollouts[i]) == 0 and float(s.pass_rate[i]) == 0.5
            continue
        assert (int(s.rollouts[i]), int(s.successes[i]), int(s.groups[i])) == (e["n"], e["s"], e["g"])
        assert (int(s.correct_run[i]), int(s.wrong_run[i]), int(s.flat_run[i])) == (e["c"], e["w"], e["f"])
        assert int(s.last_step[i]) == e["step"]
        assert math.isclose(float(s.ema_pass_rate[i]), e["ema"], rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(float(s.reward_mean[i]), e["sum"] / e["n"], rel_tol=1e-12, abs_tol=1e-12)
        k = len(e["win"])
        assert int(s.window_count[i]) == k
        for j, (m, n, sc) in enumerate(e["win"]):
            assert math.isclose(float(s.window[i, j]), m, rel_tol=1e-12, abs_tol=1e-12)
            assert (int(s.window_rollouts[i, j]), int(s.window_successes[i, j])) == (n, sc)


batches = st.lists(
    st.lists(st.tuples(st.integers(0, 7), st.sampled_from([0.0, 0.5, 1.0])), min_size=0, max_size=12),
    min_size=1,
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(batches=batches, capacity=st.integers(2, 9), window=st.integers(1, 3))
def test_matches_naive_model(batches: list[list[tuple[int, float]]], capacity: int, window: int) -> None:
    h = PromptHistory(capacity=capacity, window=window, ema_decay=0.7)
    ref = Naive(capacity, window, 0.7)
    for step, batch in enumerate(batches):
        if len({p for p, _ in batch}) > capacity:
            continue
        pid = [p for p, _ in batch]
        rew = [r for _, r in batch]
        h.update(torch.tensor(pid, dtype=torch.long), torch.tensor(rew, dtype=torch.float64), step=step)
        ref.update(pid, rew, step)
        check_equal(h, ref, list(range(8)))


@settings(max_examples=25, deadline=None)
@given(batch=st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.0, 1.0])), min_size=1, max_size=20))
def test_rollout_order_and_id_values_do_not_matter(batch: list[tuple[int, float]]) -> None:
    pid = torch.tensor([p for p, _ in batch], dtype=torch.long)
    r = torch.tensor([x for _, x in batch])
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(len(batch)))
    a, b, c = PromptHistory(), PromptHistory(), PromptHistory()
    a.update(pid, r, step=0)
    b.update(pid[perm], r[perm], step=0)
    c.update(pid * 1_000_003 + 2**40, r, step=0)  # relabelled ids (order preserved)
    sa, sb = a.lookup(torch.arange(6)), b.lookup(torch.arange(6))
    sc = c.lookup(torch.arange(6) * 1_000_003 + 2**40)
    for name in ("rollouts", "successes", "flat_run", "correct_run", "pass_rate", "window", "ema_pass_rate"):
        assert torch.equal(getattr(sa, name), getattr(sb, name))
        assert torch.equal(getattr(sa, name), getattr(sc, name))


def test_update_from_result_equals_update() -> None:
    plan = Uniform().plan(ids(30, 10, 20, 40), 10)
    g = torch.Generator().manual_seed(1)
    while (req := plan.next()) is not None:
        plan.observe(req, torch.bernoulli(torch.full((req.total,), 0.5), generator=g))
    res = plan.finish()
    a, b = PromptHistory(), PromptHistory()
    a.update_from_result(res, step=1)
    b.update(res.prompt_ids, res.rewards, step=1)
    sa, sb = a.lookup(ids(10, 20, 30, 40)), b.lookup(ids(10, 20, 30, 40))
    for f in PromptStats.__dataclass_fields__:
        assert torch.equal(getattr(sa, f), getattr(sb, f)), f
    # a prompt that got no rollouts is not recorded
    res0 = plan_result_with_zero_count()
    c = PromptHistory()
    c.update_from_result(res0, step=0)
    assert c.prompt_ids.tolist() == [1]


def plan_result_with_zero_count() -> AllocationResult:
    plan = Uniform(n=2).plan(ids(1, 2), 3)  # budget // P = 1 each ... then make one prompt empty by hand
    while (req := plan.next()) is not None:
        plan.observe(req, torch.ones(req.total))
    res = plan.finish()
    keep = res.prompt_ids == 1
    return AllocationResult(
        res.prompt_ids[keep], res.group[keep], res.rewards[keep], res.weight[keep], res.plan_prompt_ids,
        torch.tensor([1, 0]), res.reasons, res.reason_names,
    )  # fmt: skip


# -- checkpoints -----------------------------------------------------------------------------------------------


def _stream(seed: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        pid = torch.randint(0, 40, (20,), generator=g)
        out.append((pid, torch.bernoulli(torch.full((20,), 0.6), generator=g)))
    return out


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(state, dict):
        return {prefix: state}
    return {k: v for key, sub in state.items() for k, v in _flat(sub, f"{prefix}/{key}").items()}


def _with(state: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    if len(path) == 1:
        return {**state, path[0]: value}
    return {**state, path[0]: _with(state[path[0]], path[1:], value)}


def test_state_dict_round_trip_continues_identically() -> None:
    stream = _stream(0, 8)
    a = PromptHistory(capacity=25, window=3)
    for step, (pid, r) in enumerate(stream[:4]):
        a.update(pid, r, step=step)
    state = a.state_dict()
    b = PromptHistory(capacity=25, window=3)
    b.load_state_dict(state)
    state["table"]["rows"]["columns"]["history/rollouts"].add_(100)  # the loaded copy must not alias the saved dict
    for step, (pid, r) in enumerate(stream[4:], start=4):
        a.update(pid, r, step=step)
        b.update(pid, r, step=step)
    sa, sb = _flat(a.state_dict()), _flat(b.state_dict())
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        assert torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k], k
    with pytest.raises(InputError, match="state"):
        PromptHistory(capacity=25, window=4).load_state_dict(a.state_dict())
    with pytest.raises(InputError, match="state"):
        PromptHistory().load_state_dict({"version": 0})


def _saved_history() -> dict[str, Any]:
    a = PromptHistory(capacity=25, window=3)
    for step, (pid, r) in enumerate(_stream(1, 3)):
        a.update(pid, r, step=step)
    return a.state_dict()


def test_load_refuses_nan_negative_counters_and_another_config_naming_the_field() -> None:
    """A NaN in a finite field, a negative counter, a foreign configuration, more prompts than ``capacity``: an
    ``InputError`` naming the field, and the history is unchanged."""
    good = _saved_history()
    n = good["table"]["rows"]["prompt_ids"].numel()
    rows = ("table", "rows")
    cases = [
        ((*rows, "columns", "history/reward_sum"), torch.full((n,), math.nan, dtype=torch.float64)),
        ((*rows, "columns", "history/ema"), torch.full((n,), -0.5, dtype=torch.float64)),
        ((*rows, "columns", "history/rollouts"), torch.full((n,), -1)),
        ((*rows, "columns", "history/window_successes"), torch.full((n, 3), -2)),
        ((*rows, "clock"), -1),
        ((*rows, "touch"), torch.full((n,), 10**6)),
        (("config",), {**good["config"], "ema_decay": 0.5}),
        (("config",), "not a config"),
        (("table", "owner"), "coba"),
    ]
    for path, value in cases:
        h = PromptHistory(capacity=25, window=3)
        with pytest.raises(InputError) as err:
            h.load_state_dict(_with(good, path, value))
        assert err.value.argument == "state" + "".join(f"[{k!r}]" for k in path)
        assert len(h) == 0 and len(h.table) == 0
    with pytest.raises(InputError) as err:
        PromptHistory(capacity=n - 1, window=3).load_state_dict(good)
    assert err.value.argument == "state['table']['rows']['prompt_ids']"
    with pytest.raises(InputError) as err:
        PromptHistory(capacity=25, window=3).load_state_dict({**good, "format": 2})
    assert err.value.argument == "state['format']"
    shared = PromptHistory(table=PromptTable(), window=3)
    with pytest.raises(InputError) as err:
        shared.load_state_dict(good)  # a private table's rows into a history on a shared table
    assert err.value.argument == "state['table']['rows']"


def test_state_loads_with_weights_only() -> None:
    """The state (configuration strings and None included) survives ``torch.load(weights_only=True)``."""
    a = PromptHistory.from_preset("greso", capacity=25, window=3)
    for step, (pid, r) in enumerate(_stream(2, 3)):
        a.update(pid, r, step=step)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = PromptHistory.from_preset("greso", capacity=25, window=3)
    b.load_state_dict(torch.load(buf, weights_only=True))
    ids = torch.arange(40)
    assert torch.equal(a.lookup(ids).window, b.lookup(ids).window)
    assert torch.equal(a.lookup(ids).last_step, b.lookup(ids).last_step)


# -- stable ids ------------------------------------------------------------------------------------------------


def _independent(s: str) -> int:
    # read the 8-byte digest's hex string backwards byte by byte (little-endian), drop the top bit
    hexdigest = hashlib.blake2b(s.encode("utf-8"), digest_size=8).hexdigest()
    little_endian_hex = "".join(reversed([hexdigest[i : i + 2] for i in range(0, 16, 2)]))
    return int(little_endian_hex, 16) % (2**63)


def test_stable_prompt_ids_match_hashlib() -> None:
    strings = ["", "a", "math_0", "math_1", "gsm8k_17", "Ünïcødé ∑", "x" * 1000]
    got = stable_prompt_ids(strings)
    assert got.dtype == torch.long and got.shape == (7,)
    assert got.tolist() == [_independent(s) for s in strings]
    assert bool((got >= 0).all()) and len(set(got.tolist())) == 7
    assert stable_prompt_ids(()).shape == (0,)
    assert stable_prompt_ids(("a",)).tolist() == stable_prompt_ids(["a"]).tolist()


def test_stable_prompt_ids_identical_across_processes() -> None:
    code = "from rolloutopt.allocators.history import stable_prompt_ids as f; print(f(['math_0', 'b']).tolist())"
    # a second interpreter with a different string-hash salt than this one
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONHASHSEED": "12345"}, capture_output=True, text=True, check=True
    ).stdout
    assert out == str(stable_prompt_ids(["math_0", "b"]).tolist()) + "\n"


# -- bad input -------------------------------------------------------------------------------------------------


def test_bad_update_input() -> None:
    h = PromptHistory()
    with pytest.raises(InputError, match=r"rewards.*N=3"):
        h.update(ids(1, 2, 3), t(1, 0), step=0)
    with pytest.raises(InputError, match=r"rewards.*finite"):
        h.update(ids(1, 2), t(1, float("nan")), step=0)
    with pytest.raises(InputError, match=r"rewards.*float"):
        h.update(ids(1, 2), ids(1, 0), step=0)
    with pytest.raises(InputError, match="prompt_ids"):
        h.update(torch.tensor([1.0, 2.0]), t(1, 0), step=0)
    with pytest.raises(InputError, match=r"prompt_ids.*1-d"):
        h.update(ids(1, 2).view(1, 2), t(1, 0).view(1, 2), step=0)
    with pytest.raises(InputError, match="step"):
        h.update(ids(1), t(1), step=-1)
    with pytest.raises(InputError, match="step"):
        h.update(ids(1), t(1), step=1.5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="result"):
        h.update_from_result("nope", step=0)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="prompt_ids"):
        h.lookup([1, 2])  # type: ignore[arg-type]
    assert len(h) == 0  # nothing was half-applied


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"capacity": 0}, "capacity"),
        ({"window": 0}, "window"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"ema_decay": float("nan")}, "ema_decay"),
        ({"success_threshold": "1"}, "success_threshold"),
        ({"success_compare": "!="}, "success_compare"),
        ({"failure_compare": "=>"}, "failure_compare"),
        ({"failure_threshold": True}, "failure_threshold"),
        ({"run_basis": "group"}, "run_basis"),
        ({"unseen": "zero"}, "unseen"),
        ({"prior_pass_rate": 1.5}, "prior_pass_rate"),
    ],
)
def test_bad_config(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(InputError, match=name):
        PromptHistory(**kwargs)


def test_bad_preset_and_strings() -> None:
    with pytest.raises(InputError, match="preset"):
        PromptHistory.from_preset("coba")
    with pytest.raises(InputError, match="strings"):
        stable_prompt_ids("abc")
    with pytest.raises(InputError, match="strings"):
        stable_prompt_ids(["a", 3])  # type: ignore[list-item]
