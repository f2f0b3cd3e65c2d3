"""CoPRIS's concurrency-controlled partial rollouts: hand oracles following the authors' code, traced by hand on a
simulated engine (``777pomingzi/CoPRIS@43ee8c7``: ``verl/experimental/agent_loop/agent_loop.py``,
``verl/trainer/ppo/ray_trainer.py``, ``CoPRIS_scripts/run_CoPRIS.sh``), and the CoPRIS loss end to end."""

from __future__ import annotations

import torch

from rolloutopt.control import (
    CoPRISScheduler,
)
from rolloutopt.losses import policy_loss
from rolloutopt.ratios import CoPRISProximal, copris_old_logp

from .partial_helpers import by_prompt, seg


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
