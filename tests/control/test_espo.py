"""ESPO (digest rule and critic-free variant) and absorbing_failure: hand oracles, properties, bad input.

The digest rule's oracle is computed by hand from the rule as public summaries of arXiv 2605.29860 describe it;
the critic-free variant's is our reconstruction (see docs/methods/early_stop.md).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import ESPO, ESPOCriticFree, StopRule, StopState, absorbing_failure, replay, surrogate_regret
from rolloutopt.errors import InputError

CF = {"experimental": True}


def test_surrogate_regret_by_hand() -> None:
    lp = torch.tensor([-2.3, -0.1, -0.05])
    topk = torch.tensor([[-0.1, -2.3], [-2.0, -0.1], [-0.1, -4.0]])  # any order; row 2 above the top-k (numerics)
    assert surrogate_regret(lp, topk).tolist() == pytest.approx([2.2, 0.0, 0.0])
    assert surrogate_regret(torch.zeros(0), torch.zeros(0, 3)).shape == (0,)


def _digest_oracle_rule(**kw: Any) -> ESPO:
    return ESPO(beta_init=1.0, delta=0.0, clip=5.0, alpha_s=0.9, eps_v=0.2, critic_warmup=False, **kw)


def test_espo_oracle() -> None:
    # digest rule: g = -0.1 - (-2.3) = 2.2; (2.2 - 0) / sqrt(1 + 0) = 2.2; z_1 = 0.1 * 2.2 = 0.22 > 1 * max(0.1, 0.2)
    rule = _digest_oracle_rule()
    state = rule.init(2)
    state, stop = rule.step(
        state,
        logp=torch.tensor([-2.3, -2.3]),
        topk_logp=torch.tensor([[-0.1, -2.3], [-0.1, -2.3]]),
        values=torch.tensor([0.1, 0.3]),  # row 1: threshold 0.3 > 0.22, keeps running
    )
    assert state.extra["z"].tolist() == pytest.approx([0.22, 0.22])
    assert stop.tolist() == [True, False]
    for _ in range(2):  # row 1 runs on with zero regret
        state, stop = rule.step(
            state,
            logp=torch.tensor([-9.0, -0.1]),
            topk_logp=torch.tensor([[-0.1], [-0.1]]),
            values=torch.tensor([0.1, 0.3]),
        )
    res = rule.finalize(state)
    assert res.reasons() == ["regret", "running"] and res.position.tolist() == [0, -1]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    out = absorbing_failure(torch.tensor([1.0, 0.5]), mask, res, r_fail=rule.r_fail)
    # stopped row: zeros with r_fail at T_stop, done there; the normal row keeps its reward, no r_fail added
    assert out.token_rewards.tolist() == [[-1.0, 0, 0, 0], [0, 0, 0.5, 0]]
    assert out.done.tolist() == [[True, False, False, False], [False, False, True, False]]
    assert out.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 1, 0]]
    assert out.rewards.tolist() == [-1.0, 0.5] and out.stopped.tolist() == [True, False]
    assert float(out.metrics["tokens_removed"]) == 2.0 and float(out.metrics["stop_frac"]) == 0.5
    # the result carries the terminal reward: absorbing_failure reads it by default, result.rewards applies it
    assert res.terminal_rows is not None and res.terminal_reward is not None
    assert res.terminal_rows.tolist() == [True, False] and float(res.terminal_reward[0]) == -1.0
    assert res.row_weight is None and res.token_weight is None
    assert res.rewards(torch.tensor([1.0, 0.5])).tolist() == [-1.0, 0.5]
    assert torch.equal(absorbing_failure(torch.tensor([1.0, 0.5]), mask, res).token_rewards, out.token_rewards)
    assert res.loss_weights(mask).tolist() == [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    other = ESPO(r_fail=-2.5, beta_init=1.0, delta=0.0, critic_warmup=False).finalize(state)
    assert other.rewards(torch.tensor([1.0, 0.5])).tolist() == [-2.5, 0.5]
    assert absorbing_failure(torch.tensor([1.0, 0.5]), mask, other).token_rewards[0].tolist() == [-2.5, 0, 0, 0]
    # an explicit r_fail still wins
    assert absorbing_failure(torch.tensor([1.0, 0.5]), mask, other, r_fail=-1.0).rewards.tolist() == [-1.0, 0.5]


def test_espo_normalisation_by_hand() -> None:
    rule = ESPO(mu_init=1.0, var_init=4.0, delta=0.0, critic_warmup=False)
    state, _ = rule.step(
        rule.init(1), logp=torch.tensor([-2.3]), topk_logp=torch.tensor([[-0.1]]), values=torch.tensor([1.0])
    )
    assert float(state.extra["z"][0]) == pytest.approx(0.1 * (2.2 - 1.0) / 2.0)
    rule = ESPO(clip=0.5, delta=0.0, critic_warmup=False)  # normalised 2.2 clipped to 0.5
    state, _ = rule.step(
        rule.init(1), logp=torch.tensor([-2.3]), topk_logp=torch.tensor([[-0.1]]), values=torch.tensor([1.0])
    )
    assert float(state.extra["z"][0]) == pytest.approx(0.05)


def _two_row_batch(rule: ESPO) -> StopState:
    # row 0: regret 3 -> z = 0.3 > 1 * 0.2: stops; row 1: regret 1 -> z = 0.1: runs (beta = 1, mu 0, var 1)
    state = rule.init(3)  # row 2 never generates: not counted in the stop rate
    state, _ = rule.step(
        state,
        logp=torch.tensor([-3.0, -1.0, 0.0]),
        topk_logp=torch.tensor([[0.0], [0.0], [0.0]]),
        values=torch.tensor([0.0, 0.0, 0.0]),
        active=torch.tensor([True, True, False]),
    )
    return state


def test_espo_update_by_hand() -> None:
    rule = _digest_oracle_rule(alpha_ema=0.5, seed_from_first_batch=False)
    state = _two_row_batch(rule)
    assert state.stopped.tolist() == [True, False, False]
    m = rule.update(state)
    # batch regret mean 2, var ((3-2)^2 + (1-2)^2)/2 = 1; EMA 0.5: mu = 1, var = 1; stop rate 1/2 (row 2 idle)
    assert (rule.mu, rule.var) == pytest.approx((1.0, 1.0))
    assert float(m["stop_rate"]) == 0.5 and rule.beta == pytest.approx(1.0 + 0.1 * (0.5 - 0.25))
    seeded = _digest_oracle_rule()
    seeded.update(_two_row_batch(seeded))
    assert (seeded.mu, seeded.var) == pytest.approx((2.0, 1.0))  # first batch replaces the initial values
    capped = _digest_oracle_rule(beta_max=1.0)
    capped.update(_two_row_batch(capped))
    assert capped.beta == 1.0
    low = _digest_oracle_rule(target_stop_rate=1.0)  # rate 0.5 < 1: beta would drop to 0.95, clipped at beta_min 1
    low.update(_two_row_batch(low))
    assert low.beta == 1.0
    empty = _digest_oracle_rule()
    empty.update(empty.init(2))  # no tokens: nothing changes
    assert (empty.mu, empty.var, empty.beta, empty.batches) == (0.0, 1.0, 1.0, 0)
    # a batch generated while disabled: statistics learnt, beta untouched, nothing stopped
    warm = ESPO(beta_init=1.0, delta=0.0)
    state = _two_row_batch(warm)
    assert not state.stopped.any()
    warm.update(state)
    assert warm.beta == 1.0 and warm.mu == pytest.approx(2.0)
    # the sums are what ranks all-reduce
    st_ = rule.batch_stats(_two_row_batch(rule))
    assert (float(st_.tokens), float(st_.regret_sum), float(st_.rows)) == (2.0, 4.0, 2.0)


def test_espo_warmup_gate() -> None:
    rule = ESPO()
    assert not rule.enabled
    assert [rule.observe_critic_loss(x) for x in (0.9, 0.4, 0.45, 0.3)] == [False, False, False, True]
    rule = ESPO()
    # no previous loss for the first; then changes 0.05, 0.02, 0.01 < 0.1
    assert [rule.observe_critic_loss(torch.tensor(x)) for x in (2.0, 1.95, 1.93, 1.92)] == [False] * 3 + [True]
    rule = ESPO()
    for x in (0.4, 0.4, 3.0, 0.4, 0.4):  # 3.0: loss >= 0.5 and a jump of 2.6: the streak restarts
        assert not rule.observe_critic_loss(x)
    assert rule.observe_critic_loss(0.4)
    assert rule.observe_critic_loss(9.0)  # latched
    forced = ESPO()
    forced.training_progress = 0.05
    assert not forced.enabled
    # enabled state is fixed per rollout at init
    state = forced.init(1)
    forced.training_progress = 0.1
    assert forced.enabled
    kw = {"logp": torch.tensor([-30.0]), "topk_logp": torch.tensor([[0.0]]), "values": torch.tensor([0.0])}
    for _ in range(20):
        state, stop = forced.step(state, **kw)
    assert not stop.any()
    forced.beta = 1.0
    state, stop = forced.step(forced.init(1), **kw)  # z = 0.1 * 5 (clipped) = 0.5 > 1 * 0.2
    assert stop.tolist() == [True]


def test_critic_free_oracle() -> None:
    # our reconstruction: constant regret 0.5, rho_bar = s_rho = 0.1, kappa 3, t_min 10: 0.5 t > 0.1 t + 0.3 sqrt(t)
    # for every t >= 1, so the first t >= t_min, t = 10 (position 9).
    lp = torch.full((2, 30), -1.0)
    topk = torch.stack([torch.full((2, 30), -0.5), torch.full((2, 30), -3.0)], dim=-1)
    topk[1, :, 0] = -1.0  # row 1: the sampled token is always the argmax, regret 0: never stops
    rule = ESPOCriticFree(rho_bar=0.1, s_rho=0.1, kappa=3.0, t_min=10, smoothing=0.0, **CF)
    res = replay(rule, logp=lp, topk_logp=topk)
    assert res.position.tolist() == [9, -1] and res.length.tolist() == [10, 30]
    # the stopped row is an absorbing failure with r_fail = -1 (the default); no weights
    assert res.rewards(torch.tensor([1.0, 1.0])).tolist() == [-1.0, 1.0]
    assert res.terminal_rows is not None and res.terminal_rows.tolist() == [True, False]
    assert res.row_weight is None and res.token_weight is None
    res = replay(ESPOCriticFree(rho_bar=0.1, s_rho=0.1, smoothing=0.0, r_fail=0.0, **CF), logp=lp, topk_logp=topk)
    assert res.rewards(torch.tensor([1.0, 1.0])).tolist() == [0.0, 1.0]
    # with the default smoothing a = 0.9: S_10 = 0.05 * sum_k k 0.9^(10-k) = 0.05 * 41.35 = 2.067 > 1 + 0.3 sqrt(10)
    smooth = sum(0.05 * k * 0.9 ** (10 - k) for k in range(1, 11))
    assert smooth > 1.0 + 0.3 * math.sqrt(10)
    res = replay(ESPOCriticFree(rho_bar=0.1, s_rho=0.1, **CF), logp=lp, topk_logp=topk)
    assert res.position.tolist() == [9, -1]
    # without a reference the rule never fires
    res = replay(ESPOCriticFree(**CF), logp=lp, topk_logp=topk)
    assert not res.stopped.any()


def test_critic_free_update_by_hand() -> None:
    rule = ESPOCriticFree(ref_alpha=0.5, **CF)
    lp = torch.tensor([[-0.2, -0.4], [-1.0, -1.0], [-5.0, -5.0]])
    topk = torch.zeros(3, 2, 1)
    state = rule.init(3)
    for t in range(2):
        state, _ = rule.step(state, logp=lp[:, t], topk_logp=topk[:, t])
    # only row 0 is successful: regrets 0.2, 0.4 -> mean 0.3, std 0.1
    rule.update(state, torch.tensor([True, False, False]))
    assert (rule.rho_bar, rule.s_rho) == pytest.approx((0.3, 0.1))
    # next batch: rows 0 and 2 successful, regrets {0.2, 0.4, 5, 5}: mean 2.65, std sqrt(50.2/4 - 2.65^2)
    rule.update(state, torch.tensor([1, 0, 1]))
    std = math.sqrt((0.04 + 0.16 + 50.0) / 4 - 2.65**2)
    assert rule.rho_bar == pytest.approx(0.5 * 0.3 + 0.5 * 2.65) and rule.s_rho == pytest.approx(0.05 + 0.5 * std)
    before = rule.state_dict()
    rule.update(state, torch.zeros(3, dtype=torch.bool))  # no successful row: no change
    assert rule.state_dict() == before


def test_absorbing_failure_token_rewards_and_edges() -> None:
    class At(StopRule):
        reason_names = ("running", "cut")

        def _step(self, state: StopState, x: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
            return {}, state.steps == torch.tensor([1, 9, 9]), 1

    res = replay(At(), mask=torch.ones(3, 4, dtype=torch.bool))
    tok = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    out = absorbing_failure(tok, mask, res, r_fail=-2.0)
    assert out.token_rewards.tolist() == [[0, -2.0, 0, 0], [0, 0, 0, 1.0], [0, 0, 0, 0]]
    assert out.rewards.tolist() == pytest.approx([-2.0, 1.0, 0.0])
    assert out.done.tolist() == [[False, True, False, False], [False, False, False, True], [False] * 4]
    # a rule without a terminal reward: absorbing_failure's default is -1.0 (the ESPO digests' value)
    assert absorbing_failure(tok, mask, res).token_rewards[0].tolist() == [0, -1.0, 0, 0]
    res0 = At().finalize(At().init(2))
    out0 = absorbing_failure(torch.tensor([1.0, 2.0]), torch.zeros(2, 0, dtype=torch.bool), res0)
    assert out0.token_rewards.shape == (2, 0) and out0.rewards.tolist() == [1.0, 2.0]


# -- properties ------------------------------------------------------------------------------------------------------
def _stream(n: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    topk = -3 * torch.rand(n, t, 4, generator=g)
    lp = topk.amax(-1) - 4 * torch.rand(n, t, generator=g) ** 2
    return {
        "logp": lp,
        "topk_logp": topk,
        "values": torch.rand(n, t, generator=g) * 0.5,
        "mask": torch.rand(n, t, generator=g) < 0.85,
    }


def _rules() -> list[StopRule]:
    return [
        ESPO(beta_init=1.0, critic_warmup=False, mu_init=1.0),
        ESPOCriticFree(rho_bar=0.5, s_rho=0.3, t_min=3, kappa=1.0, smoothing=0.5, **CF),
    ]


def _run(rule: StopRule, s: dict[str, torch.Tensor], state: StopState | None = None, start: int = 0) -> StopState:
    n, t = s["logp"].shape
    state = rule.init(n) if state is None else state
    for k in range(start, t):
        kw = {key: v[:, k] for key, v in s.items() if key != "mask"}
        if isinstance(rule, ESPOCriticFree):
            kw.pop("values")
        state, _ = rule.step(state, active=s["mask"][:, k], **kw)
    return state


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 10_000))
def test_prop_never_unstops_noop_permutation_determinism(n: int, t: int, seed: int) -> None:
    s = _stream(n, t, seed)
    for rule in _rules():
        extra = {k: v for k, v in s.items() if k != "mask" and not (k == "values" and isinstance(rule, ESPOCriticFree))}
        state = rule.init(n)
        prev = state.stopped
        for k in range(t):
            state, stop = rule.step(state, active=s["mask"][:, k], **{key: v[:, k] for key, v in extra.items()})
            assert not (prev & ~stop).any()
            prev = stop
        res = rule.finalize(state)
        again = rule.finalize(_run(rule, s))
        assert torch.equal(res.position, again.position) and torch.equal(res.reason, again.reason)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        res_p = replay(rule, mask=s["mask"][perm], **{k: v[perm] for k, v in extra.items()})
        assert torch.equal(res_p.position, res.position[perm]) and torch.equal(res_p.stopped, res.stopped[perm])
        # an all-inactive batch is a no-op
        idle = rule.init(n)
        after, stop = rule.step(idle, active=torch.zeros(n, dtype=torch.bool), **{k: v[:, 0] for k, v in extra.items()})
        assert not stop.any() and (after.steps == 0).all()
        for key, value in idle.extra.items():
            assert torch.equal(after.extra[key], value)


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(2, 10), st.integers(0, 10_000))
def test_prop_state_dict_round_trip(n: int, t: int, seed: int) -> None:
    s = _stream(n, t, seed)
    for make in (lambda: ESPO(beta_init=2.0), lambda: ESPOCriticFree(**CF)):
        rule = make()
        if isinstance(rule, ESPO):
            for loss in (0.1, 0.1, 0.1):
                rule.observe_critic_loss(loss)
            rule.update(_run(rule, s))
        else:
            rule.update(_run(rule, s), torch.ones(n, dtype=torch.bool))
        cut = t // 2
        mid = _run(rule, {k: v[:, :cut] for k, v in s.items()})
        saved_rule, saved_state = rule.state_dict(), mid.state_dict()
        end = rule.finalize(_run(rule, s, mid, cut))
        fresh = make()
        fresh.load_state_dict(saved_rule)
        assert fresh.state_dict() == saved_rule
        end2 = fresh.finalize(_run(fresh, s, StopState.from_state_dict(saved_state), cut))
        assert torch.equal(end.position, end2.position) and torch.equal(end.reason, end2.reason)


# -- bad input -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"alpha_s": 1.5}, "alpha_s"),
        ({"alpha_ema": -0.1}, "alpha_ema"),
        ({"beta_init": 30.0}, "beta_init"),
        ({"beta_max": 0.5}, "beta_max"),
        ({"eps_v": -1.0}, "eps_v"),
        ({"clip": 0.0}, "clip"),
        ({"var_init": 0.0, "delta": 0.0}, "var_init"),
        ({"warmup_patience": 0}, "warmup_patience"),
        ({"critic_warmup": 1}, "critic_warmup"),
        ({"target_stop_rate": float("nan")}, "target_stop_rate"),
        ({"r_fail": "x"}, "r_fail"),
    ],
)
def test_espo_bad_hyper_parameters(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(InputError, match=name):
        ESPO(**kwargs)


def test_critic_free_bad_hyper_parameters() -> None:
    with pytest.raises(InputError, match="experimental"):
        ESPOCriticFree()
    for kwargs, name in (
        ({"kappa": -1.0}, "kappa"),
        ({"t_min": 0}, "t_min"),
        ({"smoothing": 1.0}, "smoothing"),
        ({"rho_bar": 0.1}, "rho_bar"),
        ({"rho_bar": 0.1, "s_rho": -0.1}, "s_rho"),
        ({"ref_alpha": 2.0}, "ref_alpha"),
    ):
        with pytest.raises(InputError, match=name):
            ESPOCriticFree(**kwargs, **CF)  # type: ignore[arg-type]


def test_bad_step_inputs() -> None:
    rule = ESPO(critic_warmup=False)
    state = rule.init(2)
    ok = {"logp": torch.zeros(2), "topk_logp": torch.zeros(2, 3), "values": torch.zeros(2)}
    with pytest.raises(InputError, match="values"):
        rule.step(state, **{**ok, "values": None})
    with pytest.raises(InputError, match="values"):
        rule.step(state, **{**ok, "values": torch.zeros(3)})
    with pytest.raises(InputError, match="values"):
        rule.step(state, **{**ok, "values": torch.tensor([0.0, float("inf")])})
    with pytest.raises(InputError, match="topk_logp"):
        rule.step(state, **{**ok, "topk_logp": None})
    with pytest.raises(InputError, match="topk_logp"):
        rule.step(state, **{**ok, "topk_logp": torch.zeros(2, 0)})
    with pytest.raises(InputError, match="topk_logp"):
        rule.step(state, **{**ok, "topk_logp": torch.full((2, 3), float("nan"))})
    with pytest.raises(InputError, match="logp"):
        rule.step(state, **{**ok, "logp": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(InputError, match="group"):
        rule.init(2, group=torch.zeros(2))
    with pytest.raises(InputError, match="topk_logp"):
        surrogate_regret(torch.zeros(2), torch.zeros(3, 2))
    with pytest.raises(InputError, match="topk_logp"):
        surrogate_regret(torch.zeros(2), torch.zeros(2, 0))
    with pytest.raises(InputError, match="logp"):
        surrogate_regret(torch.tensor([float("nan"), 0.0]), torch.zeros(2, 2))
    cf = ESPOCriticFree(**CF)
    with pytest.raises(InputError, match="topk_logp"):
        cf.step(cf.init(2), logp=torch.zeros(2))


def test_bad_state_and_update_inputs() -> None:
    rule = ESPO()
    with pytest.raises(InputError, match="loss"):
        rule.observe_critic_loss(float("nan"))
    with pytest.raises(InputError, match="training_progress"):
        rule.training_progress = 1.5
    with pytest.raises(InputError, match="state"):
        rule.update(ESPOCriticFree(**CF).init(2))
    with pytest.raises(InputError, match="state"):
        rule.load_state_dict({"mu": 0.0})
    with pytest.raises(InputError, match="beta"):
        rule.load_state_dict({**rule.state_dict(), "beta": "x"})
    with pytest.raises(InputError, match="warm"):
        rule.load_state_dict({**rule.state_dict(), "warm": 1})
    cf = ESPOCriticFree(**CF)
    with pytest.raises(InputError, match="success"):
        cf.update(cf.init(2), torch.ones(3, dtype=torch.bool))
    with pytest.raises(InputError, match="state"):
        cf.update(rule.init(2), torch.ones(2, dtype=torch.bool))
    with pytest.raises(InputError, match="state"):
        cf.load_state_dict({"rho_bar": 0.1, "s_rho": None, "batches": 0})
    with pytest.raises(InputError, match="batches"):
        cf.load_state_dict({"rho_bar": None, "s_rho": None, "batches": -1})


def test_absorbing_failure_bad_input() -> None:
    rule = _digest_oracle_rule()
    state, _ = rule.step(
        rule.init(2),
        logp=torch.tensor([-2.3, 0.0]),
        topk_logp=torch.tensor([[-0.1], [0.0]]),
        values=torch.zeros(2),
    )
    res = rule.finalize(state)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(InputError, match="result"):
        absorbing_failure(torch.zeros(3), torch.ones(3, 3, dtype=torch.bool), res)
    with pytest.raises(InputError, match="result"):
        absorbing_failure(torch.zeros(2), mask, "nope")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="result"):  # the stop position is outside the mask
        absorbing_failure(torch.zeros(2), torch.tensor([[0, 1, 1], [1, 1, 1]]), res)
    with pytest.raises(InputError, match="rewards"):
        absorbing_failure(torch.zeros(2, 4), mask, res)
    with pytest.raises(InputError, match="rewards"):
        absorbing_failure(torch.tensor([float("nan"), 0.0]), mask, res)
    with pytest.raises(InputError, match="mask"):
        absorbing_failure(torch.zeros(2), torch.full((2, 3), 0.5), res)
    with pytest.raises(InputError, match="r_fail"):
        absorbing_failure(torch.zeros(2), mask, res, r_fail=float("inf"))
