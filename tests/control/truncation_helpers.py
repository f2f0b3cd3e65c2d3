"""Shared helpers of the marker- and probe-gated stop-rule tests (Step-GRPO, DEER, DUET, ECHO): random inputs,
one factory per rule, and the stop-rule contract and state round trip each rule's test file runs on its rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rolloutopt.control import (
    DEER,
    DUETAbort,
    ECHOPruning,
    StepGRPOTruncation,
    StopRule,
    StopState,
    replay,
)

MARK = 1  # the marker token id of the random tests (vocabulary 0..4)


def random_inputs(n: int, t: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_token = {
        "tokens": torch.randint(0, 5, (n, t), generator=g),
        "confidence": torch.rand(n, t, generator=g),
        "logp": torch.log(torch.rand(n, t, generator=g).clamp(min=1e-3)),
    }
    active = torch.rand(n, t, generator=g) < 0.85
    group = torch.randint(0, 3, (n,), generator=g)
    return per_token, active, group


RULES: dict[str, tuple[Callable[[], StopRule], tuple[str, ...], bool]] = {
    # name: (factory, per-token inputs it reads, whether init takes group/row_id)
    "step_grpo": (
        lambda: StepGRPOTruncation(markers=[MARK], threshold=0.6, min_steps=2, experimental=True),
        ("tokens", "confidence"),
        False,
    ),
    "deer": (
        lambda: DEER(markers=[MARK, 3], threshold=0.7, min_tokens=2, experimental=True),
        ("tokens", "confidence"),
        False,
    ),
    "duet": (
        lambda: DUETAbort(markers=[MARK], horizon=3, keep_prob=0.4, answer_tail=1, seed=7, experimental=True),
        ("tokens",),
        True,
    ),
    "echo": (
        lambda: ECHOPruning(threshold=0.4, window=3, min_tokens=2, min_branches=1, experimental=True),
        ("logp",),
        True,
    ),
}


def init_kw(name: str, group: torch.Tensor, row_id: torch.Tensor) -> dict[str, Any]:
    if name == "echo":
        return {"group": group, "row_id": row_id}
    if name == "duet":
        return {"row_id": row_id}
    return {}


def check_stop_rule_contract(name: str, n: int, t: int, seed: int) -> None:
    """Never un-stops, inactive rows frozen, deterministic, row-permutation equivariant, all-inactive no-op."""
    factory, reads, _ = RULES[name]
    per_token, active, group = random_inputs(n, t, seed)
    x = {k: per_token[k] for k in reads}
    row_id = torch.arange(n) * 3 + 11
    init = init_kw(name, group, row_id)
    # never un-stops; inactive rows' state is frozen
    rule = factory()
    state = rule.init(n, **init)
    prev = state.stopped
    for k in range(t):
        before = state
        state, stop = rule.step(state, active=active[:, k], **{key: v[:, k] for key, v in x.items()})
        assert not bool((prev & ~stop).any())
        frozen = ~active[:, k] | before.stopped
        for key, v in state.extra.items():
            if key not in ("tree", "tie_order", "u"):
                assert torch.equal(v[frozen], before.extra[key][frozen]), key
        prev = stop
    res = rule.finalize(state)
    # determinism: a fresh rule with the same arguments (and seed) decides the same
    again = replay(factory(), mask=active, init=init, **x)
    assert torch.equal(again.position, res.position) and torch.equal(again.reason, res.reason)
    # permutation of rows (with group ids and row ids permuted alike) permutes the decisions
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    init_p = init_kw(name, group[perm] * 5 - 2, row_id[perm])
    res_p = replay(factory(), mask=active[perm], init=init_p, **{k: v[perm] for k, v in x.items()})
    assert torch.equal(res_p.position, res.position[perm]) and torch.equal(res_p.reason, res.reason[perm])
    # an all-inactive batch is a no-op
    none = replay(factory(), mask=torch.zeros(n, t, dtype=torch.bool), init=init, **x)
    assert not bool(none.stopped.any()) and bool((none.length == 0).all())


def check_state_round_trip(name: str, n: int, t: int, seed: int) -> None:
    """Saving the rule and the state mid-generation and resuming decides the same (and draws the same next)."""
    factory, reads, _ = RULES[name]
    per_token, active, group = random_inputs(n, t, seed)
    x = {k: per_token[k] for k in reads}
    init = init_kw(name, group, torch.arange(n))
    cut = t // 2
    rule = factory()
    rule.init(n, **init)  # a previous generation: the DUET draws depend on how many came before
    state = rule.init(n, **init)
    for k in range(t):
        if k == cut:
            saved_rule, saved_state = rule.state_dict(), state.state_dict()
        state, _ = rule.step(state, active=active[:, k], **{key: v[:, k] for key, v in x.items()})
    full = rule.finalize(state)
    fresh = factory()
    fresh.load_state_dict(saved_rule)
    resumed = StopState.from_state_dict(saved_state)
    for k in range(cut, t):
        resumed, _ = fresh.step(resumed, active=active[:, k], **{key: v[:, k] for key, v in x.items()})
    res = fresh.finalize(resumed)
    assert torch.equal(res.position, full.position) and torch.equal(res.reason, full.reason)
    for key in state.extra:
        assert torch.equal(resumed.extra[key], state.extra[key])
    # the next generation draws the same as well
    nxt_a, nxt_b = rule.init(n, **init), fresh.init(n, **init)
    for key in nxt_a.extra:
        assert torch.equal(nxt_a.extra[key], nxt_b.extra[key])


def check_empty_batch(name: str) -> None:
    """N = 0 works."""
    factory, reads, _ = RULES[name]
    init = init_kw(name, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    x = {
        "tokens": torch.zeros(0, 3, dtype=torch.long),
        "confidence": torch.zeros(0, 3),
        "logp": torch.zeros(0, 3),
    }
    res = replay(factory(), init=init, **{k: x[k] for k in reads})
    assert res.stopped.shape == (0,), name
