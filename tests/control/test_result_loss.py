"""What a stop rule implies for the loss, carried by its StopResult: ``result.rewards`` and ``result.loss_weights``
by hand, properties over the stop rules that stop rows (the fields as each rule defines them, identity where a
rule implies nothing), ``replay`` returning the same fields as a streamed run, and bad input.

Each rule's own hand oracle of its fields is in its test file (test_abstention, test_espo, test_arrol, test_duet,
test_prune_opd); every registered rule is also checked by name in test_registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.control import (
    DEER,
    ESPO,
    ESR,
    Abstention,
    ARRoL,
    DUETAbort,
    ECHOPruning,
    ESPOCriticFree,
    PruneOPD,
    StepGRPOTruncation,
    StopResult,
    StopRule,
    replay,
    truncate_mask,
)
from rolloutopt.errors import InputError

EXP = {"experimental": True}


def _result(**fields: Any) -> StopResult:
    """Four rows: rows 0 and 2 stopped at positions 1 and 3, rows 1 and 3 ran on."""
    return StopResult(
        stopped=torch.tensor([True, False, True, False]),
        position=torch.tensor([1, -1, 3, -1]),
        length=torch.tensor([2, 3, 4, 3]),
        reason=torch.tensor([1, 0, 1, 0]),
        reason_names=("running", "cut"),
        **fields,
    )


_MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)


def test_loss_weights_and_rewards_by_hand() -> None:
    res = _result(
        terminal_reward=torch.tensor([-1.0, 99.0, 99.0, 99.0]),  # read on the terminal rows only
        terminal_rows=torch.tensor([True, False, False, False]),
        row_weight=torch.tensor([2.0, 1.0, 0.5, 0.0]),
        token_weight=torch.tensor([[1.0, 0.5, 0.25], [1.0, 1.0, 1.0], [0.9, 0.8, 0.7], [1.0, 1.0, 1.0]]),
    )
    # row 0: keeps 2 tokens, x2, token weights [1, .5]; row 1: its mask; row 2: keeps 4, x.5, [.9, .8, .7] then 1
    # (past the token weights' width only the keep mask counts); row 3: weight 0
    w = res.loss_weights(_MASK)
    assert w.dtype == torch.float32
    expected = [[2.0, 1.0, 0, 0, 0], [1.0, 1.0, 1.0, 0, 0], [0.45, 0.4, 0.35, 0.5, 0], [0, 0, 0, 0, 0]]
    assert torch.allclose(w, torch.tensor(expected))
    # a mask narrower than the token weights: they are cut to it
    assert torch.allclose(res.loss_weights(_MASK[:, :2]), torch.tensor([[2.0, 1.0], [1.0, 1.0], [0.45, 0.4], [0, 0]]))
    assert res.loss_weights(_MASK[:, :0]).shape == (4, 0)
    # 0/1 masks are accepted
    assert torch.equal(res.loss_weights(_MASK.int()), w)
    assert res.rewards(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-1.0, 2.0, 3.0, 4.0]
    r64 = res.rewards(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    assert r64.dtype == torch.float64 and r64.tolist() == [-1.0, 2.0, 3.0, 4.0]
    assert res.rewards(torch.ones(4, dtype=torch.bfloat16)).dtype == torch.float32


def test_a_result_without_loss_fields_changes_nothing() -> None:
    res = _result()
    assert torch.equal(res.loss_weights(_MASK), truncate_mask(_MASK, res).float())
    assert res.loss_weights(_MASK).tolist() == [
        [1.0, 1.0, 0, 0, 0],
        [1.0, 1.0, 1.0, 0, 0],
        [1.0, 1.0, 1.0, 1.0, 0],
        [0, 1.0, 1.0, 1.0, 1.0],
    ]
    r = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = res.rewards(r)
    assert torch.equal(out, r) and out.data_ptr() != r.data_ptr()  # a copy
    empty = StopResult(
        stopped=torch.zeros(0, dtype=torch.bool),
        position=torch.zeros(0, dtype=torch.long),
        length=torch.zeros(0, dtype=torch.long),
        reason=torch.zeros(0, dtype=torch.long),
        reason_names=("running",),
    )
    assert empty.rewards(torch.zeros(0)).shape == (0,) and empty.loss_weights(torch.ones(0, 3)).shape == (0, 3)


def test_rewards_and_loss_weights_bad_input() -> None:
    res = _result(row_weight=torch.ones(4))
    for bad in (torch.zeros(3), torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), [0.0] * 4):
        with pytest.raises(InputError, match="rewards") as err:
            res.rewards(bad)  # type: ignore[arg-type]
        assert err.value.argument == "rewards" and err.value.fix
    with pytest.raises(InputError, match="rewards") as err:
        res.rewards(torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    assert err.value.argument == "rewards"
    with pytest.raises(InputError, match="rewards") as err:
        res.rewards(torch.tensor([0.0, float("inf"), 0.0, 0.0]))
    for bad_mask in (torch.ones(3, 5, dtype=torch.bool), torch.ones(4, dtype=torch.bool), torch.full((4, 5), 0.5)):
        with pytest.raises(InputError, match="mask") as err:
            res.loss_weights(bad_mask)
        assert err.value.argument == "mask" and err.value.fix
    with pytest.raises(InputError, match="mask"):
        res.loss_weights([[True] * 5] * 4)  # type: ignore[arg-type]
    # with checks off the two methods still compute (validation only is skipped)
    with rolloutopt.checks(False):
        assert res.rewards(torch.ones(4)).tolist() == [1.0] * 4
        assert res.loss_weights(_MASK).shape == (4, 5)


def test_result_fields_are_checked() -> None:
    with pytest.raises(InputError, match="terminal_rows") as err:
        _result(terminal_reward=torch.zeros(4))
    assert err.value.argument == "terminal_rows"
    with pytest.raises(InputError, match="terminal_rows"):
        _result(terminal_rows=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(InputError, match="terminal_reward"):
        _result(terminal_reward=torch.zeros(3), terminal_rows=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(InputError, match="row_weight"):
        _result(row_weight=torch.ones(5))
    with pytest.raises(InputError, match="token_weight"):
        _result(token_weight=torch.ones(4))
    with pytest.raises(InputError, match="token_weight"):
        _result(token_weight=torch.ones(3, 2))


# -- properties over the stop rules --------------------------------------------------------------------------------
#: name -> (factory, per-token inputs it reads, whether init takes the group ids); parameters that stop rows
RULES: dict[str, tuple[Callable[[], StopRule], tuple[str, ...], bool]] = {
    "espo": (lambda: ESPO(beta_init=1.0, critic_warmup=False, r_fail=-0.5), ("logp", "topk_logp", "values"), False),
    "espo_critic_free": (
        lambda: ESPOCriticFree(rho_bar=0.05, s_rho=0.05, kappa=1.0, t_min=1, smoothing=0.0, **EXP),
        ("logp", "topk_logp"),
        False,
    ),
    "abstention": (lambda: Abstention(r_abs=0.4, every=2, **EXP), ("values",), False),
    "arrol": (lambda: ARRoL(dim=2, keep_frac=0.5, checkpoint=2, seed=1, **EXP), ("scores",), True),
    "duet": (
        lambda: DUETAbort(markers=[1], horizon=2, keep_prob=0.4, answer_tail=1, seed=3, **EXP),
        ("tokens",),
        False,
    ),
    "duet_self_normalized": (
        lambda: DUETAbort(markers=[1], horizon=2, keep_prob=0.4, answer_tail=1, self_normalize=True, **EXP),
        ("tokens",),
        True,
    ),
    "prune_opd": (lambda: PruneOPD(k=4, window=2, m=1, rho=0.5, w_min=0.3, tau_hard=0.0, **EXP), ("overlap",), False),
    "esr": (lambda: ESR(n=3), (), False),
    "echo": (lambda: ECHOPruning(threshold=0.5, window=2, min_tokens=1, **EXP), ("logp",), True),
    "deer": (lambda: DEER(markers=[1], threshold=0.5, **EXP), ("tokens", "confidence"), False),
    "step_grpo": (
        lambda: StepGRPOTruncation(markers=[1], threshold=0.5, min_steps=1, **EXP),
        ("tokens", "confidence"),
        False,
    ),
}


def _inputs(n: int, t: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    topk = -3 * torch.rand(n, t, 3, generator=g)
    return {
        "logp": topk.amax(-1) - 3 * torch.rand(n, t, generator=g),
        "topk_logp": topk,
        "values": torch.rand(n, t, generator=g),
        "scores": torch.rand(n, t, generator=g),
        "tokens": torch.randint(0, 4, (n, t), generator=g),
        "confidence": torch.rand(n, t, generator=g),
        "overlap": torch.randint(0, 5, (n, t), generator=g) / 4,
    }


def _run(name: str, n: int, t: int, seed: int) -> tuple[StopResult, StopResult, torch.Tensor]:
    """The rule's result streamed step by step and by ``replay``, and the ``active`` mask of the generation."""
    factory, reads, grouped = RULES[name]
    g = torch.Generator().manual_seed(seed)
    x = {k: v for k, v in _inputs(n, t, g).items() if k in reads}
    active = torch.rand(n, t, generator=g) < 0.9
    init = {"group": torch.randint(0, 3, (n,), generator=g)} if grouped else {}
    rule = factory()
    state = rule.init(n, **init)
    for j in range(t):
        state, _ = rule.step(state, active=active[:, j], **{k: v[:, j] for k, v in x.items()})
    streamed = rule.finalize(state)
    replayed = replay(factory(), mask=active, init=init, **x)
    return streamed, replayed, active


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(RULES)), st.integers(1, 7), st.integers(1, 8), st.integers(0, 4), st.integers(0, 9999))
def test_prop_loss_side_of_every_stop_rule(name: str, n: int, t: int, extra: int, seed: int) -> None:
    res, replayed, _ = _run(name, n, t, seed)
    # replay returns the same result, loss fields included
    for key in ("stopped", "position", "terminal_reward", "terminal_rows", "row_weight", "token_weight"):
        assert _same(getattr(res, key), getattr(replayed, key)), key
    g = torch.Generator().manual_seed(seed + 1)
    width = t + extra  # a loss mask may be wider than what the rule saw
    mask = torch.rand(n, width, generator=g) < 0.8
    w = res.loss_weights(mask)
    assert w.shape == (n, width) and w.dtype == torch.float32
    assert bool(torch.isfinite(w).all()) and bool((w >= 0).all())
    keep = res.keep_mask(width)
    assert bool((w[~mask] == 0).all()) and bool((w[~keep] == 0).all())  # 0 where masked out or after a stop
    truncated = truncate_mask(mask, res).float()
    if res.row_weight is None and res.token_weight is None:
        assert torch.equal(w, truncated)
    else:
        rw = torch.ones(n) if res.row_weight is None else res.row_weight
        cols = 0 if res.token_weight is None else res.token_weight.shape[1]
        assert cols <= t and torch.equal(w[:, cols:], truncated[:, cols:] * rw[:, None])
    if res.token_weight is not None:  # Prune-OPD: non-increasing weights within the generated tokens
        tw = res.token_weight
        assert bool((tw[:, 1:] <= tw[:, :-1]).all()) and bool(((tw >= 0) & (tw <= 1)).all())
    rewards = torch.randn(n, generator=g)
    out = res.rewards(rewards)
    if res.terminal_reward is None or res.terminal_rows is None:
        assert torch.equal(out, rewards)
    else:
        rows = res.terminal_rows
        assert not bool((rows & ~res.stopped).any())  # only a stopped row gets a terminal reward
        assert torch.equal(out[~rows], rewards[~rows]) and torch.equal(out[rows], res.terminal_reward[rows])


def test_the_rules_that_imply_something_do_stop_rows() -> None:
    # the property above sees every kind of field: terminal rewards, row and token weights on stopped rows
    seen: dict[str, set[str]] = {}
    for name in RULES:
        for seed in range(10):
            res, _, _ = _run(name, 6, 8, seed)
            if bool(res.stopped.any()):
                for key in ("terminal_reward", "row_weight", "token_weight"):
                    if getattr(res, key) is not None:
                        seen.setdefault(key, set()).add(name)
                break
    assert seen["terminal_reward"] == {"espo", "espo_critic_free", "abstention"}
    assert seen["row_weight"] == {"arrol", "duet", "duet_self_normalized"}
    assert seen["token_weight"] == {"prune_opd"}
