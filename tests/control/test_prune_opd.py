"""Prune-OPD (control/prune_opd.py): PruneOPD and PruneOPDWindow — oracles by hand, properties, state round trips,
bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    ESR,
    PruneOPD,
    PruneOPDWindow,
    StopState,
    replay,
)
from rolloutopt.errors import InputError

# ------------------------------------------------------------------------------------------------ helpers


def _teacher_for(student: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
    """Teacher ids [N, T, k] sharing exactly ``hits[n, t]`` ids with ``student`` [N, T, k] (ids < 1000)."""
    k = student.shape[-1]
    cols = torch.arange(k)
    return torch.where(cols < hits[..., None], student, 1000 + cols.expand_as(student))


def _run(rule: Any, inputs: dict[str, torch.Tensor], mask: torch.Tensor | None = None) -> StopState:
    n, t = next(iter(inputs.values())).shape[:2]
    state = rule.init(n)
    for j in range(t):
        state, _ = rule.step(
            state, active=None if mask is None else mask[:, j], **{k: v[:, j] for k, v in inputs.items()}
        )
    return state  # type: ignore[no-any-return]


def _prune(**kw: Any) -> PruneOPD:
    return PruneOPD(experimental=True, **kw)


def _overlaps(rule: PruneOPD, student: torch.Tensor, teacher: torch.Tensor) -> dict[str, torch.Tensor]:
    """PruneOPD's ``step`` input over a recorded generation: ``overlap`` [N, T] from top-k ids [N, T, K]."""
    t = student.shape[1]
    return {"overlap": torch.stack([rule.overlap(student[:, j], teacher[:, j]) for j in range(t)], 1)}


# ================================================================================================= PruneOPD


def test_prune_opd_hand_example() -> None:
    # k=2, W=2, tau_drift=0.5, m=2, rho=0.5, w_min=0.2, no hard drift.
    # o       = [1, .5, 0, 0, .5, 1, 1, 1]
    # smoothed= [1, .75, .25, 0, .25, .75, 1, 1]   (mean of the last <= 2 overlaps)
    # low run = [0, 0, 1, 2, 3, 0, 0, 0] -> drift event at t=3
    # w       = [1, 1, 1, .5, .25, .125]           -> .125 < .2: stop at t=5 (low_weight), keeps 6 tokens
    hits = torch.tensor([[2, 1, 0, 0, 1, 2, 2, 2]])
    student = torch.tensor([7, 9]).expand(1, 8, 2)
    rule = _prune(k=2, window=2, tau_drift=0.5, m=2, rho=0.5, w_min=0.2, tau_hard=0.0)
    inputs = _overlaps(rule, student, _teacher_for(student, hits))
    assert inputs["overlap"].tolist() == [[1.0, 0.5, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0]]
    state = _run(rule, inputs)
    res = rule.finalize(state)
    assert res.reasons() == ["low_weight"] and res.position.tolist() == [5] and res.length.tolist() == [6]
    assert state.extra["drift_at"].tolist() == [3]
    assert res.loss_weights(torch.ones(1, 8, dtype=torch.bool)).tolist() == [
        [1.0, 1.0, 1.0, 0.5, 0.25, 0.125, 0.0, 0.0]
    ]
    # the result's own token weights span the longest generated row (6 tokens); no reward, no row weight
    assert res.token_weight is not None and res.token_weight.tolist() == [[1.0, 1.0, 1.0, 0.5, 0.25, 0.125]]
    assert res.terminal_reward is None and res.row_weight is None
    assert res.rewards(torch.tensor([0.7])).tolist() == [pytest.approx(0.7)]
    # with a padding mask the weights are 0 there too
    pad = torch.tensor([[True, True, True, True, False, False, False, False]])
    assert res.loss_weights(pad).tolist() == [[1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]]
    # chunked decisions (C=4): the weight is below w_min from t=5, the decision falls at t=7
    chunked = _prune(k=2, window=2, tau_drift=0.5, m=2, rho=0.5, w_min=0.2, tau_hard=0.0, chunk=4)
    res = chunked.finalize(_run(chunked, inputs))
    assert res.position.tolist() == [7] and res.reasons() == ["low_weight"]
    # hard drift: o=0 < 0.5 at t=2; it wins over the weight rule; with C=4 it waits for t=3
    hard = _prune(k=2, window=2, tau_drift=0.5, m=2, rho=0.5, w_min=0.2, tau_hard=0.5)
    assert hard.finalize(_run(hard, inputs)).position.tolist() == [2]
    hard4 = _prune(k=2, window=2, tau_drift=0.5, m=2, rho=0.5, w_min=0.2, tau_hard=0.5, chunk=4)
    res = hard4.finalize(_run(hard4, inputs))
    assert res.position.tolist() == [3] and res.reasons() == ["hard_drift"]


def test_prune_opd_overlap_uses_first_k_columns() -> None:
    rule = _prune(k=3)
    s = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    t = torch.tensor([[3, 9, 1, 2], [8, 7, 6, 5]])  # row 0: {1,2,3} vs {3,9,1} -> 2; row 1: {5,6,7} vs {8,7,6} -> 2
    assert rule.overlap(s, t).tolist() == pytest.approx([2 / 3, 2 / 3])


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 5), st.integers(1, 12), st.integers(0, 10_000))
def test_prop_prune_opd_identical_student_never_truncated(n: int, t: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(n, t, 50, generator=g).argsort(-1)[..., :8]  # distinct ids per row, any order
    shuffled = ids[..., torch.randperm(8, generator=g)]  # same set, other ranking
    rule = _prune(tau_hard=1.0, tau_drift=1.0)  # the strictest thresholds: o = 1 is still not below them
    state = _run(rule, _overlaps(rule, ids, shuffled))
    assert not state.stopped.any()
    res = rule.finalize(state)
    assert res.token_weight is not None and bool((res.token_weight == 1).all())
    assert bool((res.loss_weights(torch.ones(n, t, dtype=torch.bool)) == 1).all())


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 14), st.integers(1, 3), st.integers(0, 10_000))
def test_prop_prune_opd_properties(n: int, t: int, chunk: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    student = torch.rand(n, t, 20, generator=g).argsort(-1)[..., :4]
    hits = torch.randint(0, 5, (n, t), generator=g)
    active = torch.rand(n, t, generator=g) < 0.85
    rule = _prune(k=4, window=3, m=2, rho=0.7, w_min=0.3, tau_hard=0.2, chunk=chunk)
    inputs = _overlaps(rule, student, _teacher_for(student, hits))
    # never un-stops; a stopped row's weight state no longer changes
    state = rule.init(n)
    for j in range(t):
        prev = state
        state, stop = rule.step(state, active=active[:, j], **{k: v[:, j] for k, v in inputs.items()})
        assert not bool((prev.stopped & ~stop).any())
        frozen = prev.stopped | ~active[:, j]
        assert torch.equal(state.extra["weight"][frozen], prev.extra["weight"][frozen])
    # weights are non-increasing along every row, in [0, 1], and 0 exactly after the kept length
    # (the mask of each row's generated tokens, right-padded: t indexes StopState.steps)
    generated = torch.arange(t)[None, :] < state.steps[:, None]
    res = rule.finalize(state)
    w = res.loss_weights(generated)
    assert bool((w[:, 1:] <= w[:, :-1]).all()) and bool(((w >= 0) & (w <= 1)).all())
    assert torch.equal(w > 0, res.keep_mask(t) & (w > 0))
    # permutation of rows permutes decisions and weights
    perm = torch.randperm(n, generator=g)
    state_p = _run(rule, {k: v[perm] for k, v in inputs.items()}, active[perm])
    res_p = rule.finalize(state_p)
    assert torch.equal(res_p.position, res.position[perm]) and torch.equal(res_p.reason, res.reason[perm])
    assert torch.equal(res_p.loss_weights(generated[perm]), w[perm])
    # determinism
    assert torch.equal(rule.finalize(_run(rule, inputs, active)).position, res.position)
    # all-inactive batch: a no-op
    none = _run(rule, inputs, torch.zeros(n, t, dtype=torch.bool))
    assert not none.stopped.any() and (none.steps == 0).all()
    assert bool((rule.finalize(none).loss_weights(torch.ones(n, t, dtype=torch.bool)) == 1).all())
    # state round trip mid-run: save, rebuild, continue -> identical
    mid = t // 2
    first = _run(rule, {k: v[:, :mid] for k, v in inputs.items()}, active[:, :mid]) if mid else rule.init(n)
    again = StopState.from_state_dict(first.state_dict())
    for j in range(mid, t):
        step = {k: v[:, j] for k, v in inputs.items()}
        first, _ = rule.step(first, active=active[:, j], **step)
        again, _ = rule.step(again, active=active[:, j], **step)
    assert torch.equal(first.position, again.position) and torch.equal(first.position, state.position)
    assert all(torch.equal(first.extra[k], again.extra[k]) for k in first.extra)
    assert rule.state_dict() == {}


def test_prune_opd_window_controller() -> None:
    ctl = PruneOPDWindow(l0=100, l_max=300, growth=2.0, patience=2, experimental=True)
    assert ctl.observe(torch.tensor([100, 100])) == 100  # streak 1
    assert ctl.observe(torch.tensor([100, 100])) == 200  # streak 2 -> grow, streak restarts
    assert ctl.observe(torch.tensor([150, 250])) == 200  # mean 200 >= 200: streak 1
    saved = ctl.state_dict()
    assert ctl.observe(torch.tensor([199, 200])) == 200  # mean 199.5 < 200: streak reset
    assert ctl.observe(torch.tensor([200, 200])) == 200
    assert ctl.observe(torch.tensor([200, 200])) == 300  # 400 capped at l_max
    assert ctl.observe(torch.tensor([300, 300])) == 300 and ctl.observe(torch.tensor([300, 300])) == 300
    assert ctl.observe(torch.zeros(0, dtype=torch.long)) == 300  # empty batch: unchanged
    fresh = PruneOPDWindow(l0=100, l_max=300, growth=2.0, patience=2, experimental=True)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert fresh.observe(torch.tensor([200, 200])) == 300  # streak 1 -> 2: grow (differs from the reset path)
    # a StopResult is accepted
    rule = ESR(n=2)
    res = replay(rule, mask=torch.ones(3, 4, dtype=torch.bool))
    ctl2 = PruneOPDWindow(l0=2, l_max=8, patience=1, experimental=True)
    assert ctl2.observe(res) == 4


def test_prune_opd_bad_input() -> None:
    with pytest.raises(InputError, match="experimental"):
        PruneOPD()
    with pytest.raises(InputError, match="experimental"):
        PruneOPDWindow(l0=1, l_max=2)
    for kw, name in (
        ({"k": 0}, "k"),
        ({"window": 0}, "window"),
        ({"tau_drift": 1.5}, "tau_drift"),
        ({"m": 0}, "m"),
        ({"rho": 1.0}, "rho"),
        ({"rho": 0.0}, "rho"),
        ({"w_min": -0.1}, "w_min"),
        ({"tau_hard": float("nan")}, "tau_hard"),
        ({"chunk": 0}, "chunk"),
        ({"k": True}, "k"),
    ):
        with pytest.raises(InputError, match=name):
            _prune(**kw)
    for kw, name in (
        ({"l0": 0, "l_max": 4}, "l0"),
        ({"l0": 5, "l_max": 4}, "l_max"),
        ({"l0": 1, "l_max": 4, "growth": 1.0}, "growth"),
        ({"l0": 1, "l_max": 4, "patience": 0}, "patience"),
        ({"l0": 1, "l_max": 4, "ratio": 0.0}, "ratio"),
    ):
        with pytest.raises(InputError, match=name):
            PruneOPDWindow(experimental=True, **kw)
    rule = _prune(k=4)
    state = rule.init(2)
    ids = torch.arange(8).reshape(2, 4)
    with pytest.raises(InputError, match="overlap"):
        rule.step(state)  # the one required input
    with pytest.raises(InputError, match="overlap"):
        rule.step(state, overlap=torch.ones(3))
    with pytest.raises(InputError, match="overlap"):
        rule.step(state, overlap=torch.tensor([1.0, float("nan")]))
    with pytest.raises(InputError, match="student_topk"):
        rule.step(state, student_topk=ids, overlap=torch.ones(2))  # not a PruneOPD input
    with pytest.raises(InputError, match="student_topk"):
        rule.overlap(ids[:, :3], ids[:, :3])  # K < k
    with pytest.raises(InputError, match="teacher_topk"):
        rule.overlap(ids, ids[:, :3])
    with pytest.raises(InputError, match="student_topk"):
        rule.overlap(ids.float(), ids)
    with pytest.raises(InputError, match="teacher_topk"):
        rule.overlap(ids, ids[:1])
    with pytest.raises(InputError, match="state"):
        rule.finalize(ESR().init(2))
    with pytest.raises(InputError, match="mask"):
        rule.finalize(state).loss_weights(torch.ones(3, 4, dtype=torch.bool))
    ctl = PruneOPDWindow(l0=1, l_max=4, experimental=True)
    with pytest.raises(InputError, match="lengths"):
        ctl.observe(torch.tensor([-1]))
    with pytest.raises(InputError, match="lengths"):
        ctl.observe(torch.tensor([1.0]))
    with pytest.raises(InputError, match="state"):
        ctl.load_state_dict({"length": 2})


def test_prune_opd_overlap_of_ids_drives_the_rule() -> None:
    """``overlap=rule.overlap(student_topk, teacher_topk)`` per step: rows whose top-k agree never stop."""
    g = torch.Generator().manual_seed(3)
    n, t_len, k = 6, 24, 8
    student = torch.stack([torch.randperm(40, generator=g)[:k] for _ in range(n * t_len)]).view(n, t_len, k)
    teacher = torch.stack([torch.randperm(40, generator=g)[:k] for _ in range(n * t_len)]).view(n, t_len, k)
    teacher[:3] = student[:3]  # three rows agree fully
    rule = PruneOPD(experimental=True)
    o = _overlaps(rule, student, teacher)["overlap"]
    assert bool((o[:3] == 1).all())
    # by hand for row 3 at t = 0: the shared ids of two random top-8 sets out of 40
    assert float(o[3, 0]) == len(set(student[3, 0].tolist()) & set(teacher[3, 0].tolist())) / k
    res = replay(rule, overlap=o)
    assert res.stopped[3:].any() and not res.stopped[:3].any()
