"""Abstention (arXiv 2604.18419) and ARRoL (arXiv 2603.24840): hand oracles of our reconstructions (see
docs/methods/early_stop.md), properties, bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import Abstention, ARRoL, SoftValue, StepInputs, StopState, replay, soft_value
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

EXP = {"experimental": True}
NAN = float("nan")


def test_soft_value_by_hand() -> None:
    r = torch.tensor([[0.0, 1.0], [0.3, 0.3], [2.0, 2.0]])
    assert soft_value(r).tolist() == pytest.approx([math.log((1 + math.e) / 2), 0.3, 2.0])
    # beta = 0.5: 0.5 * log((1 + e^2) / 2)
    assert float(soft_value(r[:1], beta=0.5)[0]) == pytest.approx(0.5 * math.log((1 + math.e**2) / 2))
    assert soft_value(torch.tensor([[0.7]])).tolist() == pytest.approx([0.7])  # J = 1: the reward itself
    assert soft_value(torch.zeros(0, 3)).shape == (0,)


def test_abstention_oracle_values() -> None:
    # our reconstruction: r_abs 0.3, V at the checkpoints [0.6, 0.5, 0.25, 0.7]: abstain at the third (t = 6 with K = 2,
    # position 5); the fourth is never read (NaN there and between checkpoints raises nothing)
    rule = Abstention(r_abs=0.3, every=2, **EXP)
    v = torch.tensor([[NAN, 0.6, NAN, 0.5, NAN, 0.25, NAN, NAN, NAN, NAN]])
    state = rule.init(1)
    for t in range(v.shape[1]):
        state, _ = rule.step(state, values=v[:, t])
    res = rule.finalize(state)
    assert res.reasons() == ["abstain"] and res.position.tolist() == [5]
    assert state.extra["checks"].tolist() == [3] and state.extra["value"].tolist() == [0.25]
    assert rule.terminal_rewards(torch.tensor([1.0]), res).tolist() == [pytest.approx(0.3)]
    assert rule.terminal_rewards(torch.tensor([1.0]), rule.finalize(rule.init(1))).tolist() == [1.0]


def test_abstention_oracle_estimator_not_called_after_stop() -> None:
    # the default estimator (soft value, J = 1: V = r) driven the way an engine would: continuation rewards are
    # computed only when rule.due() says a row needs them
    rule = Abstention(r_abs=0.3, every=2, **EXP)
    at_checkpoints = iter([0.6, 0.5, 0.25, 0.7])
    state, computed = rule.init(1), 0
    for _ in range(12):
        due = rule.due(state)
        cont = None
        if bool(due.any()):
            computed += 1
            cont = torch.tensor([[next(at_checkpoints)]])
        state, _ = rule.step(state, continuation_rewards=cont)
    assert computed == 3 and rule.finalize(state).position.tolist() == [5]

    # a custom estimator sees `due`; a stopped row is never due again
    seen: list[list[bool]] = []

    def estimator(x: StepInputs, due: torch.Tensor) -> torch.Tensor:
        seen.append(due.tolist())
        return x.need("v", "test")

    rule = Abstention(r_abs=0.3, every=2, estimator=estimator, estimator_inputs={"v": ("N", "float")}, **EXP)
    v = torch.tensor([[NAN, 0.6, NAN, 0.5, NAN, 0.25, NAN, 0.7], [NAN, 0.9, NAN, 0.9, NAN, 0.9, NAN, 0.9]])
    res = replay(rule, v=v)
    assert res.position.tolist() == [5, -1]
    assert [d[0] for d in seen] == [False, True, False, True, False, True, False, False]
    assert [d[1] for d in seen] == [False, True] * 4
    # V = r_abs does not abstain (strict inequality)
    assert not replay(Abstention(r_abs=0.3, every=1, **EXP), values=torch.full((1, 3), 0.3)).stopped.any()


def test_abstention_missing_value_at_checkpoint() -> None:
    rule = Abstention(r_abs=0.3, every=2, **EXP)
    state, _ = rule.step(rule.init(2))  # t = 1: no row due, nothing needed
    with pytest.raises(InputError, match="values"):
        rule.step(state)
    # an inactive row is not due: nothing needed
    state, stop = rule.step(state, active=torch.tensor([False, False]))
    assert not stop.any() and state.steps.tolist() == [1, 1]
    with pytest.raises(InputError, match="values"):  # NaN at a due row
        rule.step(state, values=torch.tensor([NAN, 0.5]))


def _oracle_scores() -> torch.Tensor:
    return torch.tensor([0.9, 0.8, 0.7, 0.6, 0.2, 0.1, 0.05, 0.4])


def test_quality_head_oracle() -> None:
    # our reconstruction: n' = 8, n = 4, rho 0.5: classes 4 positive / 4 negative; keep the two least confident of each
    rule = ARRoL(dim=2, keep_frac=0.5, checkpoint=3, **EXP)
    scores = _oracle_scores()[:, None].expand(8, 5).clone()
    scores[:, :2] = NAN  # not read before the checkpoint
    res = replay(rule, scores=scores, init={"group": torch.full((8,), 7)})
    kept = sorted(_oracle_scores()[~res.stopped].tolist())
    assert kept == pytest.approx([0.2, 0.4, 0.6, 0.7])
    assert res.reasons().count("pruned") == 4 and set(res.position[res.stopped].tolist()) == {2}  # L_c = 3 kept
    # the same with a Groups and the rows shuffled into two interleaved groups of 8
    both = torch.cat([_oracle_scores(), _oracle_scores()])
    ids = torch.tensor([5, 9] * 8)
    order = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    s = torch.empty(16).scatter_(0, order, both)
    res = replay(rule, scores=s[:, None].expand(16, 3).clone(), init={"group": Groups(ids)})
    for g in (5, 9):
        assert sorted(s[(ids == g) & ~res.stopped].tolist()) == pytest.approx([0.2, 0.4, 0.6, 0.7])


def test_quality_head_ragged_and_early_finishers() -> None:
    rule = ARRoL(dim=2, keep_frac=0.5, checkpoint=1, **EXP)
    # group 0 (size 2, keep 1): one positive .9, one negative .3; k = 1, k+ = floor(0.5 + 0.5) = 1: keep .9
    # group 1 (size 1): keep ceil(0.5) = 1; group 2 (size 3, keep 2): all positive, k+ clipped up to 2: keep
    # .7 and .8 (least confident), prune .9
    ids = torch.tensor([0, 0, 1, 2, 2, 2])
    s = torch.tensor([0.9, 0.3, 0.1, 0.9, 0.8, 0.7])
    res = replay(rule, scores=s[:, None], init={"group": ids})
    assert res.stopped.tolist() == [False, True, False, True, False, False]
    # a row that finished before L_c counts as a survivor: group of 4 (keep 2), row 3 inactive; candidates
    # .9, .2, .3: k = 2 - 1 = 1; k+ = floor(0.5 + 0.5) = 1: keep .9
    rule = ARRoL(dim=2, keep_frac=0.5, checkpoint=2, **EXP)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    s = torch.tensor([0.9, 0.2, 0.3, 0.5])[:, None].expand(4, 2).clone()
    res = replay(rule, scores=s, mask=mask, init={"group": torch.zeros(4, dtype=torch.long)})
    assert res.stopped.tolist() == [False, True, True, False]
    # keep_frac = 1 never prunes
    full = ARRoL(dim=2, keep_frac=1.0, checkpoint=1, **EXP)
    assert not replay(full, scores=torch.rand(5, 2), init={"group": torch.zeros(5, dtype=torch.long)}).stopped.any()


def test_quality_head_training_by_hand() -> None:
    rule = ARRoL(dim=2, lr=0.1, train_steps=1, train_batch=1, buffer_size=2, min_labels=1, **EXP)
    assert not rule.ready
    # one label, y = 1, w = b = 0: q = 0.5, err = -0.5: w = 0.1 * 0.5 * [1, 2], b = 0.1 * 0.5
    m = rule.train_head(torch.tensor([[1.0, 2.0]]), torch.tensor([True]))
    assert rule.weight.tolist() == pytest.approx([0.05, 0.1]) and float(rule.bias) == pytest.approx(0.05)
    assert float(m["loss"]) == pytest.approx(-math.log(torch.sigmoid(torch.tensor(0.05 + 0.05 + 0.2)).item()))
    assert rule.ready
    assert float(rule.predict(torch.tensor([[1.0, 2.0]]))[0]) == pytest.approx(1 / (1 + math.exp(-0.3)))
    # FIFO: two more labels into a buffer of 2 evict the first
    rule.train_head(torch.tensor([[3.0, 3.0], [4.0, 4.0]]), torch.tensor([0, 1]))
    sd = rule.state_dict()
    assert sd["count"] == 2 and sd["next"] == 1 and sd["buffer_x"].tolist() == [[4.0, 4.0], [3.0, 3.0]]
    # once ready, the head scores the features at L_c: w = [1, 0] favours row 0
    rule.weight = torch.tensor([1.0, 0.0])
    rule.bias = torch.tensor(0.0)
    pruner = ARRoL(dim=2, keep_frac=0.5, checkpoint=1, buffer_size=2, **EXP)
    pruner.load_state_dict(rule.state_dict())
    assert pruner.ready is False  # 2 labels < min_labels = 64
    pruner.min_labels = 2
    feats = torch.tensor([[[5.0, 0.0]], [[-5.0, 0.0]], [[0.1, 0.0]], [[-0.1, 0.0]]])
    res = replay(pruner, features=feats, init={"group": torch.zeros(4, dtype=torch.long)})
    # q = sigmoid(5), sigmoid(-5), sigmoid(.1), sigmoid(-.1): keep the least confident of each class
    assert res.stopped.tolist() == [True, True, False, False]


def test_quality_head_learns_separable_labels() -> None:
    g = torch.Generator().manual_seed(3)
    f = torch.randn(200, 4, generator=g)
    y = f[:, 0] > 0
    rule = ARRoL(dim=4, lr=0.5, train_steps=200, min_labels=100, **EXP)
    before = rule.train_head(f[:0], y[:0])["loss"]
    assert float(before) == 0.0
    loss = rule.train_head(f, y)["loss"]
    assert float(loss) < 0.3  # log 2 = 0.69 at w = 0
    acc = ((rule.predict(f) > 0.5) == y).float().mean()
    assert float(acc) > 0.9


# -- properties ------------------------------------------------------------------------------------------------------
def _data(n: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "values": torch.rand(n, t, generator=g),
        "scores": torch.rand(n, t, generator=g),
        "mask": torch.rand(n, t, generator=g) < 0.9,
        "group": torch.randint(0, 3, (n,), generator=g) * 10,
    }


def _abst() -> Abstention:
    return Abstention(r_abs=0.35, every=2, **EXP)


def _qhp() -> ARRoL:
    return ARRoL(dim=3, keep_frac=0.5, checkpoint=2, seed=5, **EXP)


def _replay(rule: Any, d: dict[str, torch.Tensor], use_scores: bool = True) -> Any:
    if isinstance(rule, Abstention):
        return replay(rule, values=d["values"], mask=d["mask"])
    if use_scores:
        return replay(rule, scores=d["scores"], mask=d["mask"], init={"group": d["group"]})
    feats = torch.zeros(*d["mask"].shape, 3)  # unused before the head is ready: the seeded draws decide
    return replay(rule, features=feats, mask=d["mask"], init={"group": d["group"]})


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 9), st.integers(1, 7), st.integers(0, 10_000))
def test_prop_never_unstops_noop_permutation(n: int, t: int, seed: int) -> None:
    d = _data(n, t, seed)
    for rule in (_abst(), _qhp()):
        init = {} if isinstance(rule, Abstention) else {"group": d["group"]}
        key = "values" if isinstance(rule, Abstention) else "scores"
        state = rule.init(n, **init)
        prev = state.stopped
        for k in range(t):
            state, stop = rule.step(state, active=d["mask"][:, k], **{key: d[key][:, k]})
            assert not (prev & ~stop).any()
            prev = stop
        res = rule.finalize(state)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        res_p = _replay(rule, {k: v[perm] for k, v in d.items()})
        assert torch.equal(res_p.position, res.position[perm]) and torch.equal(res_p.stopped, res.stopped[perm])
        idle = rule.init(n, **init)
        for _ in range(3):
            after, stop = rule.step(idle, active=torch.zeros(n, dtype=torch.bool), **{key: d[key][:, 0]})
            assert not stop.any() and (after.steps == 0).all()
            assert all(torch.equal(after.extra[k], v) for k, v in idle.extra.items())


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 8), st.integers(2, 6), st.integers(0, 10_000))
def test_prop_determinism_and_round_trip(n: int, t: int, seed: int) -> None:
    d = _data(n, t, seed)
    # determinism: two fresh pruners with one seed draw the same pre-training scores
    a, b = _replay(_qhp(), d, use_scores=False), _replay(_qhp(), d, use_scores=False)
    assert torch.equal(a.stopped, b.stopped) and torch.equal(a.position, b.position)
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, t, 3, generator=g)
    for make in (_abst, _qhp):
        rule = make()
        if isinstance(rule, ARRoL):
            rule.train_head(torch.randn(80, 3, generator=g), torch.rand(80, generator=g) < 0.5)
            assert rule.ready
        init = {} if isinstance(rule, Abstention) else {"group": d["group"]}
        step_in = {"values": d["values"]} if isinstance(rule, Abstention) else {"features": feats}
        cut = t // 2

        def run(r: Any, state: StopState, lo: int, hi: int, step_in: dict[str, torch.Tensor] = step_in) -> StopState:
            for k in range(lo, hi):
                state, _ = r.step(state, active=d["mask"][:, k], **{kk: v[:, k] for kk, v in step_in.items()})
            return state

        mid = run(rule, rule.init(n, **init), 0, cut)
        saved_rule, saved_state = rule.state_dict(), mid.state_dict()
        end = rule.finalize(run(rule, mid, cut, t))
        fresh = make()
        fresh.load_state_dict(saved_rule)
        end2 = fresh.finalize(run(fresh, StopState.from_state_dict(saved_state), cut, t))
        assert torch.equal(end.position, end2.position) and torch.equal(end.reason, end2.reason)
        if isinstance(rule, ARRoL):
            assert isinstance(fresh, ARRoL)
            assert torch.equal(rule.init(n, **init).extra["noise"], fresh.init(n, **init).extra["noise"])


# -- bad input -------------------------------------------------------------------------------------------------------
def test_abstention_bad_input() -> None:
    with pytest.raises(InputError, match="experimental"):
        Abstention(r_abs=0.3)
    for kwargs, name in (
        ({"r_abs": NAN}, "r_abs"),
        ({"r_abs": 0.3, "every": 0}, "every"),
        ({"r_abs": 0.3, "estimator": 3}, "estimator"),
        ({"r_abs": 0.3, "estimator_inputs": {"h": "N"}}, "estimator_inputs"),
        ({"r_abs": 0.3, "estimator_inputs": {"values": ("N", "float")}}, "estimator_inputs"),
        ({"r_abs": 0.3, "beta": 0.0}, "beta"),
    ):
        with pytest.raises(InputError, match=name):
            Abstention(**kwargs, **EXP)
    with pytest.raises(TypeError):
        Abstention(**EXP)  # type: ignore[call-arg]  # r_abs has no default
    rule = Abstention(r_abs=0.3, every=1, **EXP)
    state = rule.init(2)
    with pytest.raises(InputError, match="values"):
        rule.step(state, values=torch.zeros(3))
    with pytest.raises(InputError, match="continuation_rewards"):
        rule.step(state, continuation_rewards=torch.zeros(2, 0))
    with pytest.raises(InputError, match="typo"):
        rule.step(state, values=torch.zeros(2), typo=torch.zeros(2))
    with pytest.raises(InputError, match="group"):
        rule.init(2, group=torch.zeros(2, dtype=torch.long))
    with pytest.raises(InputError, match="state"):
        rule.due("nope")  # type: ignore[arg-type]
    bad = Abstention(r_abs=0.3, every=1, estimator=lambda x, due: torch.zeros(3), **EXP)
    with pytest.raises(InputError, match="estimator"):
        bad.step(bad.init(2))
    with pytest.raises(InputError, match="result"):
        rule.terminal_rewards(torch.zeros(3), rule.finalize(state))
    with pytest.raises(InputError, match="rewards"):
        soft_value(torch.zeros(2, 0))
    with pytest.raises(InputError, match="rewards"):
        soft_value(torch.tensor([[NAN]]))
    with pytest.raises(InputError, match="beta"):
        SoftValue(beta=-1.0)


def test_quality_head_bad_input() -> None:
    with pytest.raises(InputError, match="experimental"):
        ARRoL(dim=2)
    for kwargs, name in (
        ({"dim": 0}, "dim"),
        ({"dim": 2, "keep_frac": 0.0}, "keep_frac"),
        ({"dim": 2, "keep_frac": 1.5}, "keep_frac"),
        ({"dim": 2, "rho": 2.0}, "rho"),
        ({"dim": 2, "checkpoint": 0}, "checkpoint"),
        ({"dim": 2, "lr": 0.0}, "lr"),
        ({"dim": 2, "buffer_size": 0}, "buffer_size"),
        ({"dim": 2, "seed": -1}, "seed"),
    ):
        with pytest.raises(InputError, match=name):
            ARRoL(**kwargs, **EXP)
    rule = ARRoL(dim=2, checkpoint=1, min_labels=0, **EXP)
    with pytest.raises(InputError, match="features"):  # even before the head is ready: the checkpoint needs inputs
        rule.step(rule.init(2, group=torch.zeros(2, dtype=torch.long)))
    with pytest.raises(InputError, match="group"):
        rule.init(3)
    with pytest.raises(InputError, match="group"):
        rule.init(3, group=torch.zeros(2, dtype=torch.long))
    with pytest.raises(InputError, match="group"):
        rule.init(3, group=torch.zeros(3))
    with pytest.raises(InputError, match="group"):
        rule.init(3, group=Groups(torch.zeros(2, dtype=torch.long)))
    state = rule.init(2, group=torch.zeros(2, dtype=torch.long))
    with pytest.raises(InputError, match="scores"):
        rule.step(state, scores=torch.tensor([NAN, 0.5]))
    rule.train_head(torch.zeros(1, 2), torch.ones(1))
    with pytest.raises(InputError, match="features"):
        rule.step(state)
    with pytest.raises(InputError, match="features"):
        rule.step(state, features=torch.zeros(2, 3))
    with pytest.raises(InputError, match="labels"):
        rule.train_head(torch.zeros(2, 2), torch.tensor([0.5, 1.0]))
    with pytest.raises(InputError, match="features"):
        rule.train_head(torch.zeros(2, 3), torch.ones(2))
    with pytest.raises(InputError, match="features"):
        rule.predict(torch.zeros(2, 3))
    with pytest.raises(InputError, match="state"):
        rule.load_state_dict({"weight": torch.zeros(2)})
    with pytest.raises(InputError, match="weight"):
        rule.load_state_dict({**rule.state_dict(), "weight": torch.zeros(3)})
    with pytest.raises(InputError, match="count"):
        rule.load_state_dict({**rule.state_dict(), "count": 10**9})
    # NaN scores or features at rows that are not at the checkpoint are not read
    state, _ = rule.step(rule.init(2, group=torch.zeros(2, dtype=torch.long)), scores=torch.tensor([0.2, 0.9]))
    state, stop = rule.step(state, scores=torch.tensor([NAN, NAN]), features=torch.full((2, 2), NAN))
    assert stop.tolist() == [True, False]


def test_checks_off_missing_checkpoint_inputs_do_not_stop() -> None:
    import rolloutopt

    abst = Abstention(r_abs=0.3, every=1, **EXP)
    qhp = ARRoL(dim=2, checkpoint=1, **EXP)
    with rolloutopt.checks(False):
        state, stop = abst.step(abst.init(2))
        assert not stop.any() and state.extra["checks"].tolist() == [0, 0]
        state, stop = qhp.step(qhp.init(4, group=torch.zeros(4, dtype=torch.long)))
        assert not stop.any() and state.steps.tolist() == [1, 1, 1, 1]
