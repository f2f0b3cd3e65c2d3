"""OPD horizon rules (control/opd.py): Prune-OPD, Stable-OPD, ADWIN, ESR, POPD/TOPD — oracles by hand, properties,
state round trips, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    ESR,
    ADWINHorizon,
    PruneOPD,
    PruneOPDWindow,
    StableOPD,
    StopState,
    esr_mask,
    gradient_cosine,
    kl_sign_alignment,
    popd_horizon,
    repeated_ngram_share,
    replay,
    topd_horizon,
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
    assert rule.token_weights(state, 8).tolist() == [[1.0, 1.0, 1.0, 0.5, 0.25, 0.125, 0.0, 0.0]]
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
    assert bool((rule.token_weights(state, t) == 1).all())


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
    w = rule.token_weights(state, t)
    assert bool((w[:, 1:] <= w[:, :-1]).all()) and bool(((w >= 0) & (w <= 1)).all())
    res = rule.finalize(state)
    assert torch.equal(w > 0, res.keep_mask(t) & (w > 0))
    # permutation of rows permutes decisions and weights
    perm = torch.randperm(n, generator=g)
    state_p = _run(rule, {k: v[perm] for k, v in inputs.items()}, active[perm])
    res_p = rule.finalize(state_p)
    assert torch.equal(res_p.position, res.position[perm]) and torch.equal(res_p.reason, res.reason[perm])
    assert torch.equal(rule.token_weights(state_p, t), w[perm])
    # determinism
    assert torch.equal(rule.finalize(_run(rule, inputs, active)).position, res.position)
    # all-inactive batch: a no-op
    none = _run(rule, inputs, torch.zeros(n, t, dtype=torch.bool))
    assert not none.stopped.any() and (none.steps == 0).all()
    assert bool((rule.token_weights(none, t) == 1).all())
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
        rule.token_weights(ESR().init(2), 3)
    with pytest.raises(InputError, match="length"):
        rule.token_weights(state, -1)
    ctl = PruneOPDWindow(l0=1, l_max=4, experimental=True)
    with pytest.raises(InputError, match="lengths"):
        ctl.observe(torch.tensor([-1]))
    with pytest.raises(InputError, match="lengths"):
        ctl.observe(torch.tensor([1.0]))
    with pytest.raises(InputError, match="state"):
        ctl.load_state_dict({"length": 2})


# =============================================================================================== StableOPD


def _stable(**kw: Any) -> StableOPD:
    return StableOPD(experimental=True, **kw)


def test_stable_opd_oracle() -> None:
    lengths = torch.full((10,), 50)
    three = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    two = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    d = _stable(tau_trunc=0.2).observe(lengths, three)
    assert d.tripped and d.reasons == ("truncation",) and d.truncated_frac == pytest.approx(0.3)
    assert d.kl_multiplier == 2.0 and d.mix_ratio == 0.25
    d = _stable(tau_trunc=0.2).observe(lengths, two)
    assert not d.tripped and d.reasons == () and d.kl_multiplier == 1.0 and d.mix_ratio == 0.0


def test_stable_opd_jump_kl_schedule_and_round_trip() -> None:
    mon = _stable(tau_trunc=0.5, delta=0.1, window=2, kl_up=2.0, kl_decay=0.5, kl_max=4.0)
    lengths = torch.full((20,), 8)

    def trunc(k: int) -> torch.Tensor:
        return torch.arange(20) < k

    assert not mon.observe(lengths, trunc(0)).tripped  # 0.0, no history
    d = mon.observe(lengths, trunc(3))  # 0.15 - min(0.0) > 0.1: jump
    assert d.reasons == ("jump",) and d.kl_multiplier == 2.0
    saved = mon.state_dict()
    d = mon.observe(lengths, trunc(11))  # 0.55: truncation and jump (0.55 - 0.0 > 0.1)
    assert d.reasons == ("truncation", "jump") and d.kl_multiplier == 4.0
    d = mon.observe(lengths, trunc(11))  # 0.55: truncation; history [0.15, 0.55] -> jump 0.4
    assert d.tripped and d.kl_multiplier == 4.0  # capped
    d = mon.observe(lengths, trunc(10))  # 0.5 not > 0.5; history [0.55, 0.55]: no jump -> decay
    assert not d.tripped and d.kl_multiplier == 2.0 and d.mix_ratio == 0.0
    assert mon.observe(lengths, trunc(10)).kl_multiplier == 1.0
    assert mon.observe(lengths, trunc(10)).kl_multiplier == 1.0  # never below 1
    fresh = _stable(tau_trunc=0.5, delta=0.1, window=2, kl_up=2.0, kl_decay=0.5, kl_max=4.0)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    replayed = [fresh.observe(lengths, trunc(k)) for k in (11, 11, 10)]
    assert [r.kl_multiplier for r in replayed] == [4.0, 4.0, 2.0] and fresh.trips == 3
    # an empty batch never trips on truncation
    assert not _stable().observe(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool)).tripped


def test_repeated_ngram_share_hand() -> None:
    tokens = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 8, [1] * 6 + [0, 0]], dtype=torch.bool)
    # row 0: 5 four-grams, 4 distinct -> 1/5; row 1: 5 distinct -> 0; row 2: 3 valid four-grams, 1 distinct -> 2/3
    assert repeated_ngram_share(tokens, mask).tolist() == pytest.approx([0.2, 0.0, 2 / 3])
    assert repeated_ngram_share(tokens[:, :3], mask[:, :3]).tolist() == [0.0, 0.0, 0.0]  # T < n
    assert repeated_ngram_share(tokens, mask, n=1).tolist() == pytest.approx([0.5, 0.0, 5 / 6])
    # a hole in the mask breaks the n-grams that span it: 2 + 4 valid bigrams, all (1, 1) -> 5/6
    holed = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert repeated_ngram_share(torch.ones(1, 9, dtype=torch.long), holed, n=2).tolist() == pytest.approx([5 / 6])
    # in the monitor: batch mean over rows with >= 4 tokens, default mask t < lengths
    mon = _stable(tau_rep=0.25)
    d = mon.observe(torch.tensor([8, 8, 6]), torch.zeros(3, dtype=torch.bool), tokens=tokens)
    assert d.repetition == pytest.approx((0.2 + 0.0 + 2 / 3) / 3) and d.reasons == ("repetition",)
    d = _stable().observe(torch.tensor([8, 3, 3]), torch.zeros(3, dtype=torch.bool), tokens=tokens)
    assert d.repetition == pytest.approx(0.2) and not d.tripped  # rows 1, 2 are too short; tau_rep None


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 4), st.integers(0, 12), st.integers(1, 4), st.integers(0, 10_000))
def test_prop_repeated_ngram_share_matches_reference(b: int, t: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 3, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    got = repeated_ngram_share(tokens, mask, n=n)
    want = []
    for i in range(b):
        grams = [tuple(tokens[i, j : j + n].tolist()) for j in range(t - n + 1) if bool(mask[i, j : j + n].all())]
        want.append((len(grams) - len(set(grams))) / len(grams) if grams else 0.0)
    assert got.tolist() == pytest.approx(want)
    if b:
        perm = torch.randperm(b, generator=g)
        assert torch.equal(repeated_ngram_share(tokens[perm], mask[perm], n=n), got[perm])


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(0, 10), st.integers(0, 10_000))
def test_prop_stable_opd_permutation_invariant(b: int, t: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    truncated = lengths == t
    tokens = torch.randint(0, 3, (b, t), generator=g)
    perm = torch.randperm(b, generator=g)
    a, c = _stable(tau_rep=0.5), _stable(tau_rep=0.5)
    for _ in range(2):
        d1 = a.observe(lengths, truncated, tokens=tokens)
        d2 = c.observe(lengths[perm], truncated[perm], tokens=tokens[perm])
        assert (d1.tripped, d1.reasons, d1.kl_multiplier, d1.mix_ratio) == (
            d2.tripped,
            d2.reasons,
            d2.kl_multiplier,
            d2.mix_ratio,
        )
        assert d1.truncated_frac == d2.truncated_frac and d1.repetition == pytest.approx(d2.repetition)
        assert d1.tripped == (d1.truncated_frac > 0.2 or d1.repetition > 0.5 or "jump" in d1.reasons)


def test_stable_opd_bad_input() -> None:
    with pytest.raises(InputError, match="experimental"):
        StableOPD()
    for kw, name in (
        ({"tau_trunc": 1.5}, "tau_trunc"),
        ({"delta": -0.1}, "delta"),
        ({"window": 0}, "window"),
        ({"kl_up": 0.5}, "kl_up"),
        ({"kl_decay": 0.0}, "kl_decay"),
        ({"kl_max": 0.5}, "kl_max"),
        ({"mix_ratio": 2.0}, "mix_ratio"),
        ({"tau_rep": 2.0}, "tau_rep"),
        ({"ngram": 0}, "ngram"),
    ):
        with pytest.raises(InputError, match=name):
            _stable(**kw)
    mon = _stable()
    ell, tr = torch.tensor([3, 4]), torch.tensor([True, False])
    with pytest.raises(InputError, match="truncated"):
        mon.observe(ell, tr[:1])
    with pytest.raises(InputError, match="truncated"):
        mon.observe(ell, torch.tensor([0.5, 1.0]))
    with pytest.raises(InputError, match="lengths"):
        mon.observe(torch.tensor([-1, 2]), tr)
    with pytest.raises(InputError, match="lengths"):
        mon.observe(ell.float(), tr)
    with pytest.raises(InputError, match="tokens"):
        mon.observe(ell, tr, tokens=torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(InputError, match="tokens"):
        mon.observe(ell, tr, tokens=torch.zeros(2, 4))
    with pytest.raises(InputError, match="mask"):
        mon.observe(ell, tr, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(InputError, match="mask"):
        mon.observe(ell, tr, tokens=torch.zeros(2, 4, dtype=torch.long), mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(InputError, match="state"):
        mon.load_state_dict({"history": [0.1]})
    assert mon.steps == 0  # nothing was recorded by the failed calls
    with pytest.raises(InputError, match="n"):
        repeated_ngram_share(torch.zeros(2, 4, dtype=torch.long), n=0)


# =================================================================================================== ADWIN


def _adwin(**kw: Any) -> ADWINHorizon:
    return ADWINHorizon(experimental=True, **kw)


def test_adwin_oracle() -> None:
    ctl = _adwin(h0=512, h_max=1500, tau_lo=0.5, tau_hi=0.9, beta_up=2.0, beta_down=0.5, staleness=2)
    assert ctl.observe(0.3, version=4, current_version=5) == 1024  # a < tau_lo: doubled
    assert ctl.observe(torch.tensor(0.3), version=5, current_version=5) == 1500  # 2048 capped at h_max
    assert ctl.observe(0.0, version=1, current_version=5) == 1500  # 4 > S=2 versions old: ignored
    assert ctl.observe(0.7, version=5, current_version=6) == 1500  # between thresholds: keep
    saved = ctl.state_dict()
    assert ctl.observe(0.95, version=6, current_version=6) == 750  # a >= tau_hi: shrink
    assert ctl.n_stale == 1 and ctl.n_probes == 5
    assert ctl.probes[2] == (1, 0.0, False, 1500) and ctl.probes[-1] == (6, 0.95, True, 750)
    fresh = _adwin(h0=512, h_max=1500, tau_lo=0.5, tau_hi=0.9, beta_up=2.0, beta_down=0.5, staleness=2)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert fresh.observe(0.95, version=6, current_version=6) == 750
    assert fresh.state_dict() == ctl.state_dict()
    # shrinking stops at h_min; the probe log is bounded
    small = _adwin(h0=100, h_min=64, history=2)
    for _ in range(3):
        small.observe(1.0, version=0, current_version=0)
    assert small.horizon == 64 and len(small.probes) == 2
    assert [_adwin(probe_every=10).probe_due(s) for s in (0, 5, 10, 20)] == [True, False, True, True]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-1, 1), st.integers(0, 4)), max_size=12))
def test_prop_adwin_bounds_and_staleness(probes: list[tuple[float, int]]) -> None:
    ctl = _adwin(h0=256, h_min=64, h_max=4096, staleness=1)
    for step, (a, age) in enumerate(probes):
        before = ctl.horizon
        after = ctl.observe(a, version=step, current_version=step + age)
        assert ctl.h_min <= after <= ctl.h_max
        if age > 1:
            assert after == before
        elif a < ctl.tau_lo:
            assert after >= before
        elif a >= ctl.tau_hi:
            assert after <= before
        else:
            assert after == before


def test_alignment_helpers_hand() -> None:
    p = torch.tensor([[1.0, -1.0, 2.0, 0.0]])
    f = torch.tensor([[2.0, 1.0, -1.0, 0.0]])
    m = torch.ones(1, 4, dtype=torch.bool)
    assert float(kl_sign_alignment(p, f, m, horizon=3)) == pytest.approx(1 / 3)  # agree at t=0 only
    assert float(kl_sign_alignment(p, f, m, horizon=4)) == pytest.approx(2 / 4)  # 0 and 0 agree
    assert float(kl_sign_alignment(p, f, torch.tensor([[1, 0, 0, 1]]), horizon=9)) == 1.0
    assert float(kl_sign_alignment(p, f, m, horizon=0)) == 1.0  # nothing compared
    assert float(kl_sign_alignment(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), horizon=2)) == 1.0
    nan_outside = torch.tensor([[1.0, -1.0, float("nan"), 0.0]])
    assert float(kl_sign_alignment(nan_outside, f, m, horizon=2)) == pytest.approx(0.5)  # NaN beyond H is fine
    assert float(gradient_cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))) == 0.0
    assert float(gradient_cosine(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0]))) == pytest.approx(1.0)
    assert float(gradient_cosine([torch.tensor([1.0]), torch.tensor([[1.0]])], [torch.tensor([-1.0, -1.0])])) == (
        pytest.approx(-1.0)
    )
    assert float(gradient_cosine(torch.zeros(3), torch.ones(3))) == 0.0
    assert float(gradient_cosine([], [])) == 0.0


def test_adwin_bad_input() -> None:
    with pytest.raises(InputError, match="experimental"):
        ADWINHorizon()
    for kw, name in (
        ({"h_min": 0}, "h_min"),
        ({"h_min": 64, "h_max": 32}, "h_max"),
        ({"h0": 10}, "h0"),
        ({"h0": 10_000}, "h0"),
        ({"tau_lo": -2.0}, "tau_lo"),
        ({"tau_hi": 0.4}, "tau_hi"),
        ({"beta_up": 0.5}, "beta_up"),
        ({"beta_down": 1.5}, "beta_down"),
        ({"staleness": -1}, "staleness"),
        ({"probe_every": 0}, "probe_every"),
        ({"history": -1}, "history"),
    ):
        with pytest.raises(InputError, match=name):
            _adwin(**kw)
    ctl = _adwin()
    with pytest.raises(InputError, match="alignment"):
        ctl.observe(1.5, version=0, current_version=0)
    with pytest.raises(InputError, match="alignment"):
        ctl.observe(float("nan"), version=0, current_version=0)
    with pytest.raises(InputError, match="alignment"):
        ctl.observe(torch.zeros(2), version=0, current_version=0)
    with pytest.raises(InputError, match="current_version"):
        ctl.observe(0.5, version=3, current_version=2)
    with pytest.raises(InputError, match="version"):
        ctl.observe(0.5, version=-1, current_version=2)
    with pytest.raises(InputError, match="step"):
        ctl.probe_due(-1)
    with pytest.raises(InputError, match="state"):
        ctl.load_state_dict({"horizon": 10, "probes": [], "n_probes": 0, "n_stale": 0})  # below h_min
    with pytest.raises(InputError, match="state"):
        ctl.load_state_dict({"horizon": 100})
    assert ctl.horizon == 512 and ctl.n_probes == 0
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(InputError, match="full_kl"):
        kl_sign_alignment(torch.zeros(1, 2), torch.zeros(1, 3), m, horizon=1)
    with pytest.raises(InputError, match="prefix_kl"):
        kl_sign_alignment(torch.tensor([[float("inf"), 0.0]]), torch.zeros(1, 2), m, horizon=1)
    with pytest.raises(InputError, match="horizon"):
        kl_sign_alignment(torch.zeros(1, 2), torch.zeros(1, 2), m, horizon=-1)
    with pytest.raises(InputError, match="g_full"):
        gradient_cosine(torch.zeros(2), torch.zeros(3))
    with pytest.raises(InputError, match="g_prefix"):
        gradient_cosine("grad", torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="g_full"):
        gradient_cosine(torch.ones(2), torch.tensor([1.0, float("nan")]))


# ===================================================================================================== ESR


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 6), st.integers(0, 12), st.integers(1, 8), st.integers(0, 10_000))
def test_prop_esr(b: int, t: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    live = torch.arange(t)[None, :] < lengths[:, None]  # EOS after `length` tokens
    rule = ESR(n=n)
    res = replay(rule, mask=live) if t else rule.finalize(rule.init(b))
    assert bool((res.length <= n).all())
    assert torch.equal(res.length, torch.clamp(lengths, max=n))
    assert torch.equal(res.stopped, lengths >= n)
    assert all(r == "prefix_limit" for r, s in zip(res.reasons(), res.stopped.tolist(), strict=True) if s)
    m = esr_mask(live, lengths, n=n)
    assert torch.equal(m.sum(-1), torch.clamp(lengths, max=n))
    assert torch.equal(esr_mask(live, n=n), m)
    # permutation and all-inactive no-op
    if b and t:
        perm = torch.randperm(b, generator=g)
        assert torch.equal(replay(rule, mask=live[perm]).position, res.position[perm])
        none = replay(rule, mask=torch.zeros(b, t, dtype=torch.bool))
        assert not none.stopped.any() and (none.length == 0).all()


def test_esr_hand_and_bad_input() -> None:
    res = replay(ESR(n=3), mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool))
    assert res.position.tolist() == [2, -1] and res.length.tolist() == [3, 2]
    assert res.reasons() == ["prefix_limit", "running"]
    assert ESR().n == 100
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert esr_mask(mask, torch.tensor([4, 1]), n=2).int().tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    with pytest.raises(InputError, match="n"):
        ESR(n=0)
    with pytest.raises(InputError, match="lengths"):
        esr_mask(mask, torch.tensor([1, 2, 3]))
    with pytest.raises(InputError, match="lengths"):
        esr_mask(mask, torch.tensor([1, -2]))
    with pytest.raises(InputError, match="mask"):
        esr_mask(torch.full((2, 5), 0.5))
    with pytest.raises(InputError, match="n"):
        esr_mask(mask, n=0)


# =============================================================================================== POPD/TOPD


def test_popd_topd_oracle() -> None:
    kw: dict[str, Any] = {"h0": 512, "l_max": 8192, "t_ramp": 100, "experimental": True}
    assert [popd_horizon(s, **kw) for s in (0, 50, 100, 150)] == [512, 4352, 8192, 8192]
    assert popd_horizon(1, h0=1, l_max=2, t_ramp=2, experimental=True) == 2  # 1.5 rounds half up
    assert popd_horizon(0, h0=8, l_max=64, t_ramp=0, experimental=True) == 64
    st_kw: dict[str, Any] = {"h0": 512, "l_max": 8192, "shape": "staircase", "k": 10, "experimental": True}
    assert [popd_horizon(s, **st_kw) for s in (0, 9, 10, 35, 40, 10**6)] == [512, 512, 1024, 4096, 8192, 8192]
    assert topd_horizon(8192) == 819 and topd_horizon(4096) == 410 and topd_horizon(5) == 1
    assert topd_horizon(100, frac=1.0) == 100


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 1000),
    st.integers(0, 5000),
    st.integers(0, 300),
    st.integers(1, 50),
    st.lists(st.integers(0, 1000), min_size=2, max_size=6),
)
def test_prop_popd_non_decreasing(h0: int, extra: int, t_ramp: int, k: int, steps: list[int]) -> None:
    l_max = h0 + extra
    for shape in ("linear", "staircase"):
        hs = [
            popd_horizon(s, h0=h0, l_max=l_max, t_ramp=t_ramp, shape=shape, k=k, experimental=True)  # type: ignore[arg-type]
            for s in sorted(steps)
        ]
        assert hs == sorted(hs) and all(h0 <= h <= l_max for h in hs)
        if shape == "staircase" or t_ramp > 0:
            assert popd_horizon(0, h0=h0, l_max=l_max, t_ramp=t_ramp, shape=shape, k=k, experimental=True) == h0  # type: ignore[arg-type]


def test_popd_topd_bad_input() -> None:
    kw: dict[str, Any] = {"h0": 512, "l_max": 8192, "t_ramp": 100}
    with pytest.raises(InputError, match="experimental"):
        popd_horizon(0, **kw)
    for bad, name in (
        ({"h0": 0}, "h0"),
        ({"l_max": 100}, "l_max"),
        ({"t_ramp": None}, "t_ramp"),
        ({"t_ramp": -1}, "t_ramp"),
        ({"shape": "cosine"}, "shape"),
        ({"shape": "staircase"}, "k"),
        ({"shape": "staircase", "k": 0}, "k"),
    ):
        with pytest.raises(InputError, match=name):
            popd_horizon(0, **{**kw, **bad, "experimental": True})
    with pytest.raises(InputError, match="step"):
        popd_horizon(-1, **kw, experimental=True)
    with pytest.raises(InputError, match="l_max"):
        topd_horizon(0)
    with pytest.raises(InputError, match="frac"):
        topd_horizon(100, frac=0.0)
    with pytest.raises(InputError, match="frac"):
        topd_horizon(100, frac=1.5)


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
