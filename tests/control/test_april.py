"""APRIL's active partial rollouts: hand oracles following the authors' code, traced by hand on a simulated
engine (``RLsys-Foundation/APRIL``: ``slime/rollout/sglang_example.py``, ``slime/ray/buffer.py``,
``scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh``)."""

from __future__ import annotations

import pytest
import torch

from rolloutopt.control import (
    REMOVAL_REASONS,
    APRILBuffer,
)

from .partial_helpers import by_prompt, seg


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
