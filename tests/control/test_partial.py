"""Partial-rollout scheduling (APRIL, CoPRIS): hand oracles, the no-rollout-lost property, the
state_dict round trip mid-run, the CoPRIS loss end to end, bad input.

Oracles and defaults follow the authors' code, traced by hand on a simulated engine: APRIL
(``RLsys-Foundation/APRIL``: ``slime/rollout/sglang_example.py``, ``slime/ray/buffer.py``,
``scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh``) and CoPRIS (``777pomingzi/CoPRIS@43ee8c7``:
``verl/experimental/agent_loop/agent_loop.py``, ``verl/trainer/ppo/ray_trainer.py``, ``CoPRIS_scripts/run_CoPRIS.sh``).
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    REMOVAL_REASONS,
    APRILBuffer,
    CoPRISScheduler,
    Requests,
    RoundResult,
)
from rolloutopt.errors import InputError
from rolloutopt.losses import policy_loss
from rolloutopt.ratios import CoPRISProximal, copris_old_logp

Sched = APRILBuffer | CoPRISScheduler


def seg(n: int, start: int = 0, lp: float = -0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """n new tokens (ids start, start+1, ...) with log-prob lp each."""
    return torch.arange(start, start + n), torch.full((n,), lp)


def by_prompt(reqs: Requests) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for q, p in zip(reqs.request_ids.tolist(), reqs.prompt_ids.tolist(), strict=True):
        out.setdefault(p, []).append(q)
    return out


def ids(x: torch.Tensor) -> set[int]:
    return set(x.tolist())


# ------------------------------------------------------------------------------------------------- APRIL


def test_april_spec_oracle() -> None:
    # APRIL by hand: target 2 groups, over-sampling 4, group finish times [1, 2, 5, 9]; n = 2 samples per group
    buf = APRILBuffer(rollout_batch_size=2, over_sampling_batch_size=4, n_samples_per_prompt=2, max_new_tokens=100)
    buf.begin_round(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), policy_version=0)
    reqs = buf.next_requests()
    assert reqs.prompt_ids.tolist() == [1, 1, 2, 2, 3, 3, 4, 4]  # 4 groups over-provisioned, fresh prompts in order
    assert reqs.max_new_tokens.tolist() == [100] * 8 and all(p.numel() == 0 for p in reqs.prefix)
    assert len(buf.next_requests()) == 0  # in flight (4) >= target (2): nothing more to submit
    q = by_prompt(reqs)
    finish_time = {1: 1, 2: 2, 3: 5, 4: 9}
    # each group generates 10 tokens per time unit; t = 1: group 1 finishes, t = 2: group 2 -> target reached
    for t in (1, 2):
        for p in [p for p, ft in finish_time.items() if ft == t]:
            for k, req in enumerate(q[p]):
                buf.finish(req, *seg(10 * t), reward=float(k))
    assert buf.done
    # abort at t = 2: groups 3 and 4 have 20 tokens each; group 4's tasks return first
    for p in (4, 3):
        for req in q[p]:
            buf.abort(req, *seg(20, start=100 * p))
    res = buf.end_round()
    assert res.batch.prompt_ids.tolist() == [1, 1, 2, 2]  # the batch is groups 1-2, sorted by prompt
    assert res.batch.lengths.tolist() == [10, 10, 20, 20]
    assert res.batch.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert res.unused_prompts.tolist() == [5, 6, 7, 8] and len(res.removed) == 0
    assert res.metrics["off_policy_tokens"].item() == 0.0 and res.metrics["held_groups"].item() == 2.0
    # groups 3-4 are buffered with their partial text
    assert len(buf.held_ids()) == 4
    buf.begin_round(torch.tensor([9, 10, 11]), policy_version=1)
    reqs = buf.next_requests()
    # the next round starts with groups 3 and 4 (as a set), ahead of any fresh prompt, with their partial text
    assert set(reqs.prompt_ids[:4].tolist()) == {3, 4} and reqs.prompt_ids[4:].tolist() == [9, 9, 10, 10]
    for p, pre, m in zip(reqs.prompt_ids[:4].tolist(), reqs.prefix[:4], reqs.max_new_tokens[:4].tolist(), strict=True):
        assert torch.equal(pre, torch.arange(100 * p, 100 * p + 20)) and m == 80
    q = by_prompt(reqs)
    for p in (3, 4):  # 30 more tokens each under version 1
        for req in q[p]:
            buf.finish(req, *seg(30), reward=1.0)
    res = buf.end_round()
    assert res.batch.prompt_ids.tolist() == [3, 3, 4, 4] and res.batch.lengths.tolist() == [50] * 4
    # 20 of each 50 tokens were generated under version 0 < 1: 80 off-policy tokens of 200
    assert res.metrics["off_policy_tokens"].item() == 80.0 and res.metrics[
        "off_policy_fraction"
    ].item() == pytest.approx(0.4)
    assert res.batch.versions[0].tolist() == [0] * 20 + [1] * 30
    assert res.metrics["resumed_rollouts"].item() == 4.0
    assert torch.equal(res.batch.tokens[0], torch.cat([torch.arange(300, 320), torch.arange(30)]))
    assert res.unused_prompts.tolist() == [11]  # groups 9 and 10 went back to the buffer, 11 never submitted


def test_april_without_partial_rollout_discards_and_reports() -> None:
    buf = APRILBuffer(
        rollout_batch_size=1,
        over_sampling_batch_size=3,
        n_samples_per_prompt=2,
        max_new_tokens=9,
        partial_rollout=False,
    )
    buf.begin_round(torch.tensor([7, 8, 9]), policy_version=0)
    q = by_prompt(buf.next_requests())
    for req in q[7]:
        buf.finish(req, *seg(3), reward=1.0)
    buf.abort(q[8][0], *seg(2))  # group 8: one partial, the other sample and group 9 never reported
    res = buf.end_round()
    assert res.batch.prompt_ids.tolist() == [7, 7]
    assert res.removed.prompt_ids.tolist() == [8, 8, 9, 9]
    assert set(res.removed.reason.tolist()) == {REMOVAL_REASONS.index("discarded")}
    assert res.metrics["removed_discarded"].item() == 4.0 and len(buf.held_ids()) == 0


def test_april_filter_drops_group_and_submits_another() -> None:
    buf = APRILBuffer(
        rollout_batch_size=2, over_sampling_batch_size=2, n_samples_per_prompt=2, max_new_tokens=9, filter_groups=True
    )
    buf.begin_round(torch.tensor([1, 2, 3, 4]), policy_version=0)
    q = by_prompt(buf.next_requests())
    assert sorted(q) == [1, 2]
    for req in q[1]:  # rewards [1, 1]: zero variance -> dropped; in flight 2 -> 1 < target, so 2 more groups
        buf.finish(req, *seg(2), reward=1.0)
    assert sorted(by_prompt(buf.next_requests())) == [3, 4]
    res = buf.end_round()
    assert res.removed.prompt_ids.tolist() == [1, 1]
    assert res.removed.reason.tolist() == [REMOVAL_REASONS.index("filtered")] * 2
    assert len(res.batch) == 0 and len(buf.held_ids()) == 6  # groups 2, 3, 4 buffered


def test_april_resume_with_no_room_is_truncated() -> None:
    buf = APRILBuffer(rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=1, max_new_tokens=5)
    buf.begin_round(torch.tensor([1, 2]), policy_version=0)
    q = by_prompt(buf.next_requests())
    buf.finish(q[1][0], *seg(3), reward=0.0)
    buf.abort(q[2][0], *seg(5))  # aborted exactly at the length cap
    assert buf.end_round().batch.truncated.tolist() == [False]
    buf.begin_round(torch.tensor([], dtype=torch.long), policy_version=1)
    reqs = buf.next_requests()
    assert reqs.prompt_ids.tolist() == [2] and reqs.max_new_tokens.tolist() == [0]  # 5 - 5 = 0: do not generate
    buf.finish(int(reqs.request_ids[0]), *seg(0), reward=0.5)
    res = buf.end_round()
    assert res.batch.truncated.tolist() == [True] and res.metrics["truncated_rollouts"].item() == 1.0


def test_april_extra_group_after_target_is_buffered_not_lost() -> None:
    buf = APRILBuffer(rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=1, max_new_tokens=5)
    buf.begin_round(torch.tensor([1, 2]), policy_version=0)
    q = by_prompt(buf.next_requests())
    buf.finish(q[1][0], *seg(1), reward=0.0)
    buf.finish(q[2][0], *seg(2), reward=1.0)  # finished after the stop event
    res = buf.end_round()
    assert res.batch.prompt_ids.tolist() == [1] and buf.buffered_groups().numel() == 1
    buf.begin_round(torch.tensor([3]), policy_version=1)
    assert len(buf.next_requests()) == 0 and buf.done  # the finished group is accepted on submission
    res = buf.end_round()
    # a submission takes over_sampling_batch_size groups at once (slime pops them together): prompt 3 was
    # submitted with the recycled group, never started, and is buffered, not unused
    assert res.batch.prompt_ids.tolist() == [2] and res.unused_prompts.tolist() == []
    assert buf.buffered_groups().numel() == 1 and len(buf.held_ids()) == 1


# ------------------------------------------------------------------------------------------------ CoPRIS


def test_copris_pool_and_queue_order() -> None:
    s = CoPRISScheduler(train_batch_size=1, gen_batch_size=3, n_samples_per_prompt=2, pool_size=3, max_new_tokens=50)
    s.begin_round(torch.tensor([10, 20, 30]), policy_version=0)
    reqs = s.next_requests()
    assert reqs.rollout_ids.tolist() == [0, 1, 2] and s.in_flight == 3  # pool_size in flight
    assert len(s.next_requests()) == 0
    s.finish(0, *seg(4), reward=1.0)
    more = s.next_requests()  # one finished -> one replacement, the queue's next
    assert more.rollout_ids.tolist() == [3] and s.in_flight == 3
    running = s.running_requests()
    assert running.request_ids.tolist() == [1, 2, 3] and running.rollout_ids.tolist() == [1, 2, 3]
    s.abort(3, *seg(2))
    s.abort(1, *seg(1))
    assert s.running_requests().request_ids.tolist() == [2]
    res = s.end_round()  # request 2 (rollout 2) still running: cancelled with no new tokens
    # cancelled partials first (report order, then the unreported running one), then the never-started
    assert s.queued_ids().tolist() == [3, 1, 2, 4, 5]
    assert len(res.batch) == 0 and res.metrics["aborted_requests"].item() == 3.0


def test_copris_spec_oracle_two_stages_and_uid_waits_for_all_samples() -> None:
    g = torch.Generator().manual_seed(0)
    rec_v1 = -torch.rand(2, 150, generator=g)
    rec_v2 = -torch.rand(1, 150, generator=g)
    s = CoPRISScheduler(train_batch_size=1, gen_batch_size=1, n_samples_per_prompt=2, pool_size=4, max_new_tokens=200)
    s.begin_round(torch.tensor([20]), policy_version=1)
    r = s.next_requests()
    s.finish(int(r.request_ids[0]), *seg(30, lp=-1.0), reward=1.0)  # sample 0 done; sample 1 still running
    s.abort(int(r.request_ids[1]), *seg(100, lp=-1.0))  # tokens 1-100 under v1
    res = s.end_round()
    assert len(res.batch) == 0  # the uid is not trained: one of its n samples is unfinished
    todo = s.needs_recompute()
    assert todo.lengths.tolist() == [30, 100] and todo.stored_len.tolist() == [0, 0]
    m = s.record_recompute(todo.rollout_ids, rec_v1[:, :100], policy_version=1)
    assert m["appended_tokens"].item() == 130.0 and m["version_mismatch_tokens"].item() == 0.0
    s.begin_round(torch.tensor([], dtype=torch.long), policy_version=2)
    r = s.next_requests()
    assert r.rollout_ids.tolist() == [1] and r.max_new_tokens.tolist() == [100]
    s.abort(int(r.request_ids[0]), *seg(50, start=100, lp=-2.0))  # tokens 101-150 under v2, aborted again
    s.end_round()
    todo = s.needs_recompute()
    assert todo.rollout_ids.tolist() == [1] and todo.stored_len.tolist() == [100]
    s.record_recompute(todo.rollout_ids, rec_v2, policy_version=2)  # v2 recomputes all 150; only 101-150 kept
    stored = s.needs_recompute()
    assert len(stored) == 0
    s.begin_round(torch.tensor([], dtype=torch.long), policy_version=3)
    r = s.next_requests()
    s.finish(int(r.request_ids[0]), *seg(0), reward=0.0)
    res = s.end_round()  # now all n samples are finished: the uid is trained
    b = res.batch
    assert b.rollout_ids.tolist() == [0, 1] and b.stored_len.tolist() == [30, 150]
    # stored behaviour log-probs: first 100 from v1's recompute, last 50 from v2's
    assert torch.equal(b.behav_logp[1, :100], rec_v1[1, :100]) and torch.equal(b.behav_logp[1, 100:], rec_v2[0, 100:])
    assert torch.equal(b.behav_logp[0, :30], rec_v1[0, :30]) and torch.equal(b.behav_logp[0, 30:], torch.zeros(120))
    assert b.versions[1].tolist() == [1] * 100 + [2] * 50 and b.versions[0, 30:].eq(-1).all()
    assert torch.equal(b.engine_logp[1], torch.cat([torch.full((100,), -1.0), torch.full((50,), -2.0)]))


def test_copris_batch_feeds_policy_loss_end_to_end() -> None:
    g = torch.Generator().manual_seed(1)
    s = CoPRISScheduler(train_batch_size=1, gen_batch_size=1, n_samples_per_prompt=2, pool_size=2, max_new_tokens=8)
    s.begin_round(torch.tensor([5]), policy_version=1)
    r = s.next_requests()
    s.finish(int(r.request_ids[0]), *seg(3), reward=1.0)
    s.abort(int(r.request_ids[1]), *seg(4))  # 4 tokens under v1
    s.end_round()
    todo = s.needs_recompute()
    rec_v1 = -torch.rand(2, 4, generator=g)
    s.record_recompute(todo.rollout_ids, rec_v1, policy_version=1)
    s.begin_round(torch.tensor([], dtype=torch.long), policy_version=2)
    r = s.next_requests()
    s.finish(int(r.request_ids[0]), *seg(2, start=4), reward=0.0)  # 2 more tokens under v2
    b = s.end_round().batch
    assert b.lengths.tolist() == [3, 6]
    recompute_v2 = -torch.rand(2, 6, generator=g)  # the trainer's recompute under v2 (old_logp)
    logp = (recompute_v2 + 0.1 * torch.randn(2, 6, generator=g)).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    out = policy_loss(
        logp,
        recompute_v2,
        adv,
        b.mask,
        behav_logp=b.behav_logp,
        versions=b.versions,
        policy_version=2,
        proximal=CoPRISProximal(),
    )
    # by hand: old = [rec_v1[0, :3] | pad], [rec_v1[1, :4], recompute_v2[1, 4:6]] (v1 tokens keep v1's recompute)
    old = torch.zeros(2, 6)
    old[0, :3] = rec_v1[0, :3]
    old[1, :4] = rec_v1[1, :4]
    old[1, 4:] = recompute_v2[1, 4:]
    assert torch.equal(copris_old_logp(b.stored_logp, b.stored_len, recompute_v2, mask=b.mask), old)
    ref = policy_loss(logp, old, adv, b.mask)
    torch.testing.assert_close(out.loss, ref.loss)
    (g1,) = torch.autograd.grad(out.loss, logp)
    (g2,) = torch.autograd.grad(ref.loss, logp)
    torch.testing.assert_close(g1, g2)


def test_copris_uids_kept_beyond_the_target_head_the_next_batch() -> None:
    s = CoPRISScheduler(train_batch_size=1, gen_batch_size=2, n_samples_per_prompt=1, pool_size=2, max_new_tokens=9)
    s.begin_round(torch.tensor([1, 2]), policy_version=0)
    q = by_prompt(s.next_requests())
    s.finish(q[2][0], *seg(2), reward=0.0)  # uid 2 kept first: the stop event fires
    s.finish(q[1][0], *seg(3), reward=1.0)  # uid 1 finished before the cancel reached it
    res = s.end_round()
    assert res.batch.prompt_ids.tolist() == [2] and len(s.held_ids()) == 1  # kept_prompt_uids[:1]
    s.begin_round(torch.tensor([3, 4]), policy_version=1)
    assert s.done and len(s.next_requests()) == 0  # the carried uid fills the batch at once
    res = s.end_round()
    assert res.batch.prompt_ids.tolist() == [1] and res.batch.versions[0].tolist() == [0, 0, 0]
    assert s.queued_ids().tolist() == [2, 3]  # the new gen batch waits in the queue


def test_copris_filter_clears_buffers() -> None:
    s = CoPRISScheduler(
        train_batch_size=1, gen_batch_size=2, n_samples_per_prompt=2, pool_size=4, max_new_tokens=9, filter_groups=True
    )
    s.begin_round(torch.tensor([1, 2]), policy_version=0)
    q = by_prompt(s.next_requests())
    for req in q[1]:
        s.finish(req, *seg(2), reward=0.0)  # all-equal rewards: dropped, not kept
    assert not s.done
    s.finish(q[2][0], *seg(2), reward=0.0)
    s.finish(q[2][1], *seg(3), reward=1.0)
    res = s.end_round()
    assert res.batch.prompt_ids.tolist() == [2, 2] and res.removed.prompt_ids.tolist() == [1, 1]
    assert res.metrics["removed_filtered"].item() == 2.0 and len(s.held_ids()) == 0


def test_eviction_by_capacity_and_staleness_is_reported() -> None:
    s = CoPRISScheduler(
        train_batch_size=1, gen_batch_size=3, n_samples_per_prompt=1, pool_size=2, max_new_tokens=9, max_buffered=1
    )
    s.begin_round(torch.tensor([1, 2, 3]), policy_version=0)
    q = by_prompt(s.next_requests())
    s.finish(q[1][0], *seg(1), reward=0.0)
    s.abort(q[2][0], *seg(1))
    res = s.end_round()  # held: prompt 2 (partial) and 3 (never started) -> 2 > 1: evict the oldest group (2)
    assert res.removed.prompt_ids.tolist() == [2]
    assert res.removed.reason.tolist() == [REMOVAL_REASONS.index("evicted_capacity")]
    assert s.queued_ids().tolist() == [2]  # rollout 2 is prompt 3's

    a = APRILBuffer(rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=1, max_staleness=1)
    a.begin_round(torch.tensor([1, 2]), policy_version=0)
    q = by_prompt(a.next_requests())
    a.finish(q[1][0], *seg(1), reward=0.0)
    a.abort(q[2][0], *seg(1))
    a.end_round()
    a.begin_round(torch.tensor([3]), policy_version=1)  # 1 version behind: kept
    assert len(a.held_ids()) == 1
    a.end_round()  # nothing requested: group 2 stays buffered, group 3 never submitted
    a.begin_round(torch.tensor([4]), policy_version=3)  # 3 behind > 1: evicted now, reported by end_round
    assert len(a.held_ids()) == 0
    res = a.end_round()
    assert res.removed.prompt_ids.tolist() == [2]
    assert res.removed.reason.tolist() == [REMOVAL_REASONS.index("evicted_stale")]


def test_defaults_are_the_reference_codes() -> None:
    a = APRILBuffer()
    assert (a.rollout_batch_size, a.over_sampling_batch_size, a.n_samples_per_prompt) == (32, 64, 8)
    assert a.max_new_tokens == 16384 and a.partial_rollout
    c = CoPRISScheduler()
    assert (c.pool_size, c.train_batch_size, c.gen_batch_size, c.n_samples_per_prompt) == (128, 64, 128, 8)
    assert c.max_new_tokens == 15360


def test_empty_round() -> None:
    for s in (APRILBuffer(), CoPRISScheduler()):
        s.begin_round(torch.tensor([], dtype=torch.long), policy_version=0)
        assert len(s.next_requests()) == 0
        res = s.end_round()
        assert len(res.batch) == 0 and res.batch.tokens.shape == (0, 0) and len(res.removed) == 0


# ------------------------------------------------------------------------------ random event sequences


def make(kind: str, data: st.DataObject) -> Sched:
    n = data.draw(st.integers(1, 3))
    common: dict[str, Any] = {
        "n_samples_per_prompt": n,
        "max_new_tokens": data.draw(st.integers(1, 6)),
        "filter_groups": data.draw(st.booleans()),
        "max_buffered": data.draw(st.sampled_from([None, None, 0, 2, 6, 20])),
        "max_staleness": data.draw(st.none() | st.integers(0, 2)),
        "eviction": data.draw(st.sampled_from(["oldest", "newest"])),
    }
    if kind == "april":
        return APRILBuffer(
            rollout_batch_size=data.draw(st.integers(1, 3)),
            over_sampling_batch_size=data.draw(st.integers(1, 4)),
            partial_rollout=data.draw(st.booleans()),
            **common,
        )
    return CoPRISScheduler(
        train_batch_size=data.draw(st.integers(1, 3)),
        gen_batch_size=data.draw(st.integers(1, 3)),
        pool_size=data.draw(st.integers(1, 5)),
        **common,
    )


def restore(s: Sched, kind: str) -> Sched:
    f = io.BytesIO()
    torch.save(s.state_dict(), f)
    f.seek(0)
    fresh: Sched = APRILBuffer(**_april_cfg(s)) if kind == "april" else CoPRISScheduler(**_copris_cfg(s))
    fresh.load_state_dict(torch.load(f, weights_only=True))  # plain containers and tensors only
    return fresh


def _april_cfg(s: Any) -> dict[str, Any]:
    keys = ("rollout_batch_size", "over_sampling_batch_size", "partial_rollout")
    return {**_common_cfg(s), **{k: getattr(s, k) for k in keys}}


def _copris_cfg(s: Any) -> dict[str, Any]:
    keys = ("train_batch_size", "gen_batch_size", "pool_size")
    return {**_common_cfg(s), **{k: getattr(s, k) for k in keys}}


def _common_cfg(s: Any) -> dict[str, Any]:
    keys = ("n_samples_per_prompt", "max_new_tokens", "filter_groups", "max_buffered", "max_staleness", "eviction")
    return {k: getattr(s, k) for k in keys}


def same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, (Requests, RoundResult)) or hasattr(a, "__dataclass_fields__"):
        for k in a.__dataclass_fields__:
            same(getattr(a, k), getattr(b, k))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert a == b


def drive(kind: str, data: st.DataObject, *, checkpoint: bool) -> None:
    s = make(kind, data)
    twin: Sched | None = None
    n_ops = data.draw(st.integers(0, 60))
    save_at = data.draw(st.integers(0, n_ops)) if checkpoint else -1
    running: dict[int, tuple[int, int]] = {}  # request id -> (rollout id, room)
    seen: set[int] = set()  # rollout ids ever requested
    returned: list[int] = []
    removed: list[int] = []
    version = 0
    size = s.gen_batch_size if isinstance(s, CoPRISScheduler) else data.draw(st.integers(1, 4))
    prompt = size
    s.begin_round(torch.arange(size), policy_version=0)

    def both(f: Any) -> Any:
        out = f(s)
        if twin is not None:
            same(out, f(twin))
        return out

    for i in range(n_ops):
        if i == save_at:
            twin = restore(s, kind)
        op = data.draw(st.sampled_from(["next", "next", "finish", "finish", "finish", "finish", "abort", "round"]))
        if op == "next":
            limit = data.draw(st.none() | st.integers(0, 4))
            reqs = both(lambda x, limit=limit: x.next_requests(limit))
            new = reqs.rollout_ids.tolist()
            assert len(set(new)) == len(new) and not set(new) & {r for r, _ in running.values()}
            seen |= set(new)
            for q, r, room in zip(reqs.request_ids.tolist(), new, reqs.max_new_tokens.tolist(), strict=True):
                running[q] = (r, room)
        elif op in ("finish", "abort") and running:
            req = data.draw(st.sampled_from(sorted(running)))
            toks = seg(data.draw(st.integers(0, running.pop(req)[1])))
            if op == "finish":
                reward = float(data.draw(st.integers(0, 1)))
                both(lambda x, req=req, toks=toks, reward=reward: x.finish(req, *toks, reward=reward))
            else:
                both(lambda x, req=req, toks=toks: x.abort(req, *toks))
        elif op == "round":
            for req in sorted(running):  # abort_all: most report their partial output, some never answer
                if data.draw(st.integers(0, 3)):
                    toks = seg(data.draw(st.integers(0, running[req][1])))
                    both(lambda x, req=req, toks=toks: x.abort(req, *toks))
            res = both(lambda x: x.end_round())
            running.clear()
            b = res.batch
            returned += b.rollout_ids.tolist()
            removed += res.removed.rollout_ids.tolist()
            # every returned group is complete: n finished samples, finite rewards
            counts = torch.bincount(b.group) if len(b) else torch.zeros(0, dtype=torch.long)
            assert counts[counts > 0].eq(s.n_samples_per_prompt).all() and torch.isfinite(b.rewards).all()
            assert torch.equal(b.mask.sum(1), b.lengths)
            target = s.rollout_batch_size if isinstance(s, APRILBuffer) else s.train_batch_size
            assert res.metrics["batch_groups"].item() <= target
            version += data.draw(st.sampled_from([1, 1, 0, 2]))
            size = s.gen_batch_size if isinstance(s, CoPRISScheduler) else data.draw(st.integers(0, 4))
            size = size if data.draw(st.integers(0, 3)) else 0
            prompts = torch.arange(prompt, prompt + size)
            prompt += size
            both(lambda x, prompts=prompts, version=version: x.begin_round(prompts, policy_version=version))
    res = both(lambda x: x.end_round())
    returned += res.batch.rollout_ids.tolist()
    removed += res.removed.rollout_ids.tolist()
    held = s.held_ids().tolist()
    assert held == sorted(set(range(max(returned + removed + held, default=-1) + 1)) - set(returned + removed))
    # nothing is stuck either: rounds without new prompts, every request finished, drain what is held
    for _ in range(len(held) + 1):
        if not held:
            break
        both(lambda x, version=version: x.begin_round(torch.arange(0), policy_version=version))
        while len(reqs := both(lambda x: x.next_requests())):
            for k, (q, room) in enumerate(zip(reqs.request_ids.tolist(), reqs.max_new_tokens.tolist(), strict=True)):
                toks = seg(min(room, 1))
                both(lambda x, q=q, toks=toks, k=k: x.finish(q, *toks, reward=float(k % 2)))
        res = both(lambda x: x.end_round())
        returned += res.batch.rollout_ids.tolist()
        removed += res.removed.rollout_ids.tolist()
        held = s.held_ids().tolist()
    assert not held
    # no rollout lost, none duplicated: returned, removed and held partition every rollout ever created
    assert len(set(returned)) == len(returned) and len(set(removed)) == len(removed)
    every = returned + removed + held
    assert sorted(every) == list(range(len(every)))
    assert seen <= set(every)
    if twin is not None:
        same(s.state_dict(), twin.state_dict())


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["april", "copris"]), data=st.data())
def test_no_rollout_lost_property(kind: str, data: st.DataObject) -> None:
    drive(kind, data, checkpoint=False)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["april", "copris"]), data=st.data())
def test_state_dict_round_trip_mid_run_continues_identically(kind: str, data: st.DataObject) -> None:
    drive(kind, data, checkpoint=True)


# --------------------------------------------------------------------------------------------- bad input


def started(kind: str = "copris") -> tuple[Sched, Requests]:
    s: Sched = (
        CoPRISScheduler(train_batch_size=2, gen_batch_size=1, n_samples_per_prompt=2, pool_size=2, max_new_tokens=4)
        if kind == "copris"
        else APRILBuffer(rollout_batch_size=1, over_sampling_batch_size=1, n_samples_per_prompt=2, max_new_tokens=4)
    )
    s.begin_round(torch.tensor([0]), policy_version=0)
    return s, s.next_requests()


@pytest.mark.parametrize("kind", ["april", "copris"])
def test_bad_request_ids(kind: str) -> None:
    s, r = started(kind)
    with pytest.raises(InputError, match="request_id"):
        s.finish(99, *seg(1), reward=0.0)  # unknown
    with pytest.raises(InputError, match="request_id"):
        s.finish(True, *seg(1), reward=0.0)
    s.finish(int(r.request_ids[0]), *seg(1), reward=0.0)
    with pytest.raises(InputError, match="request_id"):
        s.finish(int(r.request_ids[0]), *seg(1), reward=0.0)  # double finish
    s.abort(int(r.request_ids[1]), *seg(1))
    with pytest.raises(InputError, match="request_id"):
        s.abort(int(r.request_ids[1]), *seg(1))  # double abort
    with pytest.raises(InputError, match="request_id"):
        s.finish(int(r.request_ids[1]), *seg(1), reward=0.0)  # finish after abort


def test_bad_segments() -> None:
    s, r = started()
    q = int(r.request_ids[0])
    tok, lp = seg(2)
    with pytest.raises(InputError, match="tokens"):
        s.finish(q, tok[None], lp, reward=0.0)  # wrong shape
    with pytest.raises(InputError, match="tokens"):
        s.finish(q, tok.float(), lp, reward=0.0)
    with pytest.raises(InputError, match="tokens"):
        s.finish(q, *seg(5), reward=0.0)  # more than max_new_tokens = 4
    with pytest.raises(InputError, match="behav_logp"):
        s.finish(q, tok, lp[:1], reward=0.0)
    with pytest.raises(InputError, match="behav_logp"):
        s.finish(q, tok, torch.tensor([0.0, float("nan")]), reward=0.0)
    with pytest.raises(InputError, match="policy_version"):
        s.finish(q, tok, lp, reward=0.0, policy_version=torch.tensor([1]))
    with pytest.raises(InputError, match="reward"):
        s.finish(q, tok, lp, reward=float("inf"))
    with pytest.raises(InputError, match="reward"):
        s.finish(q, tok, lp, reward="1")  # type: ignore[arg-type]
    s.finish(q, tok, lp, reward=0.0)  # nothing above changed the state: the request is still running


def test_bad_round_protocol() -> None:
    s = CoPRISScheduler(gen_batch_size=2)
    with pytest.raises(InputError, match="next_requests"):
        s.next_requests()
    with pytest.raises(InputError, match="end_round"):
        s.end_round()
    with pytest.raises(InputError, match="prompt_ids"):
        s.begin_round(torch.tensor([1, 2, 3]), policy_version=0)  # not gen_batch_size
    with pytest.raises(InputError, match="prompt_ids"):
        s.begin_round(torch.tensor([1.0, 2.0]), policy_version=0)
    assert not s.round_open
    s.begin_round(torch.tensor([1, 2]), policy_version=3)
    with pytest.raises(InputError, match="begin_round"):
        s.begin_round(torch.tensor([1, 2]), policy_version=3)
    with pytest.raises(InputError, match="limit"):
        s.next_requests(-1)
    s.end_round()
    with pytest.raises(InputError, match="policy_version"):
        s.begin_round(torch.tensor([1, 2]), policy_version=2)  # versions never decrease


def test_bad_recompute() -> None:
    s, r = started()
    with pytest.raises(InputError, match="rollout_ids"):
        s.record_recompute(r.rollout_ids[:1], torch.zeros(1, 4), policy_version=0)  # running
    s.abort(int(r.request_ids[0]), *seg(3))
    s.abort(int(r.request_ids[1]), *seg(1))
    s.end_round()
    with pytest.raises(InputError, match="rollout_ids"):
        s.record_recompute(torch.tensor([77]), torch.zeros(1, 4), policy_version=0)
    with pytest.raises(InputError, match="rollout_ids"):
        s.record_recompute(torch.tensor([0, 0]), torch.zeros(2, 4), policy_version=0)
    with pytest.raises(InputError, match="logp"):
        s.record_recompute(torch.tensor([0]), torch.zeros(1, 2), policy_version=0)  # narrower than 3 tokens
    with pytest.raises(InputError, match="logp"):
        s.record_recompute(torch.tensor([0]), torch.zeros(2, 4), policy_version=0)


@pytest.mark.parametrize(
    ("cls", "kwargs", "name"),
    [
        (APRILBuffer, {"rollout_batch_size": 0}, "rollout_batch_size"),
        (APRILBuffer, {"over_sampling_batch_size": 1.5}, "over_sampling_batch_size"),
        (APRILBuffer, {"partial_rollout": 1}, "partial_rollout"),
        (APRILBuffer, {"n_samples_per_prompt": 0}, "n_samples_per_prompt"),
        (CoPRISScheduler, {"pool_size": 0}, "pool_size"),
        (CoPRISScheduler, {"train_batch_size": True}, "train_batch_size"),
        (CoPRISScheduler, {"max_new_tokens": 0}, "max_new_tokens"),
        (CoPRISScheduler, {"filter_groups": "yes"}, "filter_groups"),
        (CoPRISScheduler, {"max_buffered": -1}, "max_buffered"),
        (CoPRISScheduler, {"max_staleness": -1}, "max_staleness"),
        (CoPRISScheduler, {"eviction": "random"}, "eviction"),
    ],
)
def test_bad_hyper_parameters(cls: type, kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(InputError, match=name):
        cls(**kwargs)


def test_bad_state() -> None:
    s, _ = started()
    state = s.state_dict()
    with pytest.raises(InputError, match="state"):
        CoPRISScheduler(pool_size=3).load_state_dict(state)  # other config
    with pytest.raises(InputError, match="state"):
        APRILBuffer().load_state_dict(state)  # other class
    with pytest.raises(InputError, match="state"):
        s.load_state_dict({"kind": "CoPRISScheduler"})
