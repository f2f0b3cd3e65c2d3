"""The partial-rollout event API both schedulers share (``rolloutopt.control.partial``): eviction, the reference
codes' defaults, empty rounds, the no-rollout-lost property and the state_dict round trip mid-run over random
event sequences of APRIL and CoPRIS, and bad input. APRIL's and CoPRIS's own oracles are in test_april.py and
test_copris.py.
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

from .partial_helpers import Sched, by_prompt, seg


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
