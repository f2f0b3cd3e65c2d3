"""ARRoL (arXiv 2603.24840): hand oracles of our reconstruction (see docs/methods/early_stop.md), bad input; and the
properties shared with Abstention (arXiv 2604.18419), checked on both rules."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import Abstention, ARRoL, StopState, replay
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

from .checkpoint_rule_helpers import EXP, NAN, _abst, _data, _qhp, _replay


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
    # the pruned rows leave the loss (row weight 0); the survivors keep their whole mask; no terminal reward
    assert res.row_weight is not None
    assert res.row_weight.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    w = res.loss_weights(torch.ones(8, 5, dtype=torch.bool))
    assert w.sum(1).tolist() == [0.0, 0.0, 5.0, 5.0, 5.0, 0.0, 0.0, 5.0]
    assert res.terminal_reward is None and res.token_weight is None
    assert torch.equal(res.rewards(_oracle_scores()), _oracle_scores())
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
