"""Reference advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline.

Oracles computed by hand following verl's estimators (``volcengine/verl@b178a3cd5``
``verl/trainer/ppo/core_algos.py``: ``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``,
``compute_reinforce_plus_plus_baseline_outcome_advantage``), singleton and zero-variance conventions, ``valid``
masks, hypothesis properties against a float64 per-group loop written independently of the library, gradchecks
and one test per class of bad input.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.advantages import dr_grpo, get, grpo, names, reinforce_pp_baseline, rloo, to_tokens
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses import policy_loss

from .helpers import SINGLETON_WARNING, D, close, ids, relabel_map, t

# ------------------------------------------------------------------------------------- independent oracle


def naive(
    method: str,
    rewards: list[float],
    group: list[int],
    *,
    valid: list[bool] | None = None,
    singleton: str = "zero",
    scale: str | None = "group",
    unbiased: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """Per-group Python loop in float64, straight from the estimators' formulas (see docs/api/advantages.md)."""
    b = len(rewards)
    ok = valid if valid is not None else [True] * b
    members: dict[int, list[int]] = {}
    for i in range(b):
        if ok[i]:
            members.setdefault(group[i], []).append(i)
    vals = [rewards[i] for i in range(b) if ok[i]]
    batch_mu = sum(vals) / max(len(vals), 1)
    batch_var = sum((x - batch_mu) ** 2 for x in vals) / max(len(vals) - (1 if unbiased else 0), 1)
    out = [0.0] * b
    for rows in members.values():
        xs = [rewards[i] for i in rows]
        n = len(xs)
        mu = sum(xs) / n
        for i in rows:
            r = rewards[i]
            if n == 1:
                if singleton == "zero":
                    out[i] = 0.0
                elif method == "rloo" or scale is None:
                    out[i] = r
                elif scale == "group":
                    out[i] = r / (1 + eps)
                else:
                    out[i] = r / (math.sqrt(batch_var) + eps)
                continue
            if method == "rloo":
                out[i] = r - (sum(xs) - r) / (n - 1)
            elif scale is None:
                out[i] = r - mu
            elif scale == "group":
                sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - (1 if unbiased else 0)))
                out[i] = (r - mu) / (sd + eps)
            else:
                out[i] = (r - mu) / (math.sqrt(batch_var) + eps)
    return out


# --------------------------------------------------------------------------------------- hand oracles

R4, G4 = t([1.0, 0.0, 0.0, 1.0]), ids([0, 0, 1, 1])


def test_two_groups_oracles() -> None:
    s = 0.5 / (math.sqrt(0.5) + 1e-6)  # unbiased std of [1, 0] is sqrt(1/2)
    close(grpo(R4, G4).advantages, [s, -s, -s, s])
    close(grpo(R4, G4).advantages, [0.70710, -0.70710, -0.70710, 0.70710], atol=1e-4)
    close(grpo(R4, G4, unbiased=False).advantages, [1.0, -1.0, -1.0, 1.0])  # population std 0.5
    close(dr_grpo(R4, G4).advantages, [0.5, -0.5, -0.5, 0.5])
    close(grpo(R4, G4, scale=None).advantages, [0.5, -0.5, -0.5, 0.5])
    close(rloo(R4, G4).advantages, [1.0, -1.0, -1.0, 1.0])


def test_one_group_spec_oracles() -> None:
    g = ids([7, 7, 7, 7])
    close(grpo(R4, g).advantages, [0.8660, -0.8660, -0.8660, 0.8660], atol=1e-4)  # unbiased std 0.5774
    close(dr_grpo(R4, g).advantages, [0.5, -0.5, -0.5, 0.5])
    close(rloo(R4, g).advantages, [2 / 3, -2 / 3, -2 / 3, 2 / 3])  # G/(G-1) times Dr.GRPO's


def test_reinforce_pp_baseline_spec_oracle() -> None:
    # measured on verl 0.9.1 (CPU): verl gives [0, 0, -1.354, 1.354] on [1, 1 | 0, 1]; with T = 3 full masks: centred
    # [0, 0, -.5, .5], 12 tokens, mean 0, var = 6 * .25 / 11.
    mask = torch.ones(4, 3, dtype=torch.bool)
    out = reinforce_pp_baseline(t([1.0, 1.0, 0.0, 1.0]), G4, mask, singleton="raw")
    a = 0.5 / math.sqrt(1.5 / 11 + 1e-8)
    assert out.advantages.shape == (4, 3)
    close(out.advantages, torch.tensor([[0.0] * 3, [0.0] * 3, [-a] * 3, [a] * 3]))
    close(out.advantages[2:, 0], [-1.354, 1.354], atol=1e-3)
    close(out.weight, [1.0, 1.0, 1.0, 1.0])


def test_reinforce_pp_baseline_masked_tokens_and_lengths() -> None:
    # Long responses weigh more in the whitening: lengths 1, 3 | 2, 2.
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    r = t([1.0, 0.0, 3.0, 1.0])
    centred = [0.5, -0.5, 1.0, -1.0]
    toks = [c for c, k in zip(centred, mask.sum(1).tolist(), strict=True) for _ in range(k)]
    mu = sum(toks) / len(toks)
    var = sum((x - mu) ** 2 for x in toks) / (len(toks) - 1)
    expected = torch.tensor([[(c - mu) / math.sqrt(var + 1e-8)] * 3 for c in centred]) * mask
    close(reinforce_pp_baseline(r, G4, mask).advantages, expected)


def test_scale_batch_oracle() -> None:
    # group means [.5, 0]; batch std (unbiased) of [1, 0, 0, 0] is 0.5.
    out = grpo(t([1.0, 0.0, 0.0, 0.0]), G4, scale="batch")
    close(out.advantages, [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.0, 0.0])
    pop = grpo(t([1.0, 0.0, 0.0, 0.0]), G4, scale="batch", unbiased=False).advantages
    sd = math.sqrt(0.75 / 4)
    close(pop, [0.5 / (sd + 1e-6), -0.5 / (sd + 1e-6), 0.0, 0.0])


def test_eps_is_added_to_the_std() -> None:
    sd = math.sqrt(0.5)
    close(grpo(R4, G4, eps=0.5).advantages[0], 0.5 / (sd + 0.5))
    close(grpo(R4, G4, eps=0.0).advantages[0], 0.5 / sd)
    mask = torch.ones(4, 1, dtype=torch.bool)
    whitened = reinforce_pp_baseline(R4, G4, mask, eps=1.0).advantages[0, 0]
    close(whitened, 0.5 / math.sqrt(1 / 3 + 1.0))


# ------------------------------------------------------------------------- singletons and zero variance


def _record(fn: Callable[[], Any]) -> tuple[Any, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if "size 1" in str(w.message)]


R3, G3 = t([1.0, 0.0, 2.5]), ids([0, 0, 5])


@pytest.mark.parametrize("fn", [grpo, dr_grpo, rloo])
def test_singleton_zero_warns_and_gives_zero(fn: Callable[..., Any]) -> None:
    out, caught = _record(lambda: fn(R3, G3))
    assert len(caught) == 1
    assert caught[0].category is UserWarning
    assert out.advantages[2].item() == 0.0
    assert out.weight[2].item() == 1.0
    close(out.metrics["singleton_group_frac"], 0.5)


def test_singleton_raw_is_verls_convention() -> None:
    out, caught = _record(lambda: grpo(R3, G3, singleton="raw"))
    assert caught == []
    close(out.advantages[2], 2.5 / (1 + 1e-6))
    close(dr_grpo(R3, G3, singleton="raw").advantages[2], 2.5)
    close(rloo(R3, G3, singleton="raw").advantages[2], 2.5)  # verl rloo: no baseline
    close(grpo(R3, G3, singleton="raw", scale="batch").advantages[2], 2.5 / (grpo_batch_std(R3) + 1e-6))
    # the singleton does not change its siblings
    close(grpo(R3, G3, singleton="raw").advantages[:2], grpo(R3[:2], G3[:2]).advantages)


def grpo_batch_std(r: torch.Tensor) -> float:
    return float(r.double().std())


def test_reinforce_pp_baseline_singletons() -> None:
    mask = torch.ones(3, 2, dtype=torch.bool)
    zero, caught = _record(lambda: reinforce_pp_baseline(R3, G3, mask))
    assert len(caught) == 1
    assert torch.equal(zero.advantages[2], torch.zeros(2))
    # the singleton is left out of the whitening: the siblings are whitened among themselves
    close(zero.advantages[:2], reinforce_pp_baseline(R3[:2], G3[:2], mask[:2]).advantages)
    raw, caught = _record(lambda: reinforce_pp_baseline(R3, G3, mask, singleton="raw"))
    assert caught == []
    toks = [0.5, 0.5, -0.5, -0.5, 2.5, 2.5]
    mu = sum(toks) / 6
    sd = math.sqrt(sum((x - mu) ** 2 for x in toks) / 5 + 1e-8)
    close(raw.advantages[:, 0], [(x - mu) / sd for x in toks[::2]])


def test_explicit_singleton_zero_does_not_warn() -> None:
    # Only the implicit default warns (a singleton trains on nothing, usually a bug); "zero" says it is intended.
    mask = torch.ones(3, 2, dtype=torch.bool)
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (grpo, (R3, G3)),
        (dr_grpo, (R3, G3)),
        (rloo, (R3, G3)),
        (reinforce_pp_baseline, (R3, G3, mask)),
    ]
    for fn, args in calls:
        implicit, caught = _record(lambda fn=fn, args=args: fn(*args))
        assert len(caught) == 1, fn.__name__
        explicit, caught = _record(lambda fn=fn, args=args: fn(*args, singleton="zero"))
        assert caught == [], fn.__name__
        assert torch.equal(explicit.advantages, implicit.advantages)
    _, caught = _record(lambda: grpo(R4, G4, singleton="zero", valid=torch.tensor([True, False, True, True])))
    assert caught == []


def test_no_warning_without_singletons() -> None:
    _, caught = _record(lambda: (grpo(R4, G4), rloo(R4, G4), dr_grpo(R4, G4)))
    assert caught == []


def test_singleton_made_by_the_valid_mask_warns() -> None:
    valid = torch.tensor([True, False, True, True])
    out, caught = _record(lambda: grpo(R4, G4, valid=valid))
    assert len(caught) == 1
    assert out.advantages[0].item() == 0.0
    # a size-1 group whose only row is invalid is not a singleton that gets a (zero) advantage: no warning
    _, caught = _record(lambda: grpo(R3, G3, valid=torch.tensor([True, True, False])))
    assert caught == []


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1.0, -2.2, 1e6 + 0.1])
@pytest.mark.parametrize("n", [2, 3, 7, 16, 31])
def test_zero_variance_groups_are_exactly_zero(value: float, n: int) -> None:
    # float32 means of n copies of 0.1 are inexact; dividing the residue by std + eps must not leak out.
    r = torch.cat([torch.full((n,), value), t([0.0, 1.0])])
    g = torch.cat([torch.full((n,), 3, dtype=torch.long), ids([9, 9])])
    for valid in (None, torch.ones(n + 2, dtype=torch.bool)):
        for out in (grpo(r, g, valid=valid), dr_grpo(r, g, valid=valid), rloo(r, g, valid=valid)):
            assert torch.equal(out.advantages[:n], torch.zeros(n))
        assert torch.equal(grpo(r, g, valid=valid, scale="batch").advantages[:n], torch.zeros(n))
    out = grpo(r, g)
    close(out.metrics["zero_variance_group_frac"], 0.5)
    mask = torch.ones(n, 4, dtype=torch.bool)
    assert torch.equal(reinforce_pp_baseline(r[:n], g[:n], mask).advantages, torch.zeros(n, 4))


# -------------------------------------------------------------------------------------------- valid rows


@pytest.mark.parametrize("fill", [5.0, math.nan, math.inf])
def test_invalid_rows_get_zero_and_do_not_shift_siblings(fill: float) -> None:
    r = t([1.0, 0.0, fill, 0.0, 1.0, 2.0])
    g = ids([0, 0, 0, 1, 1, 1])
    valid = torch.tensor([True, True, False, True, True, True])
    keep = valid.nonzero().squeeze(1)
    for fn in (grpo, dr_grpo, rloo):
        out = fn(r, g, valid=valid)
        assert out.advantages[2].item() == 0.0
        assert torch.equal(out.weight, valid.float())
        close(out.advantages[keep], fn(r[keep], g[keep]).advantages)
        assert all(torch.isfinite(m) for m in out.metrics.values())
    mask = torch.ones(6, 3, dtype=torch.bool)
    out = reinforce_pp_baseline(r, g, mask, valid=valid)
    assert torch.equal(out.advantages[2], torch.zeros(3))
    close(out.advantages[keep], reinforce_pp_baseline(r[keep], g[keep], mask[keep]).advantages)
    batch = grpo(r, g, valid=valid, scale="batch")
    close(batch.advantages[keep], grpo(r[keep], g[keep], scale="batch").advantages)


def test_group_with_no_valid_row_and_metrics() -> None:
    r = t([1.0, 0.0, 0.5, 0.5, 2.0, 7.0])
    g = ids([0, 0, 1, 1, 2, 3])
    with pytest.warns(UserWarning, match="size 1"):
        out = grpo(r, g)
    close(out.metrics["singleton_group_frac"], 0.5)
    close(out.metrics["zero_variance_group_frac"], 0.25)
    close(out.metrics["reward_mean"], sum([1.0, 0.0, 0.5, 0.5, 2.0, 7.0]) / 6)
    valid = torch.tensor([True, True, True, True, False, False])  # groups 2 and 3 have no valid row
    out = grpo(r, g, valid=valid)
    assert torch.equal(out.advantages[4:], torch.zeros(2))
    close(out.metrics["singleton_group_frac"], 0.0)
    close(out.metrics["zero_variance_group_frac"], 0.5)
    close(out.metrics["reward_mean"], 0.5)
    assert all(m.ndim == 0 and not m.requires_grad for m in out.metrics.values())
    all_invalid = grpo(r, g, valid=torch.zeros(6, dtype=torch.bool))
    assert torch.equal(all_invalid.advantages, torch.zeros(6))
    assert all(torch.isfinite(m) for m in all_invalid.metrics.values())


def test_groups_object_gives_identical_results() -> None:
    r = torch.randn(40, generator=torch.Generator().manual_seed(1))
    g = torch.randint(-5, 9, (40,), generator=torch.Generator().manual_seed(2))
    groups = Groups(g)
    mask = torch.rand(40, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    for kw in ({"singleton": "raw"}, {"singleton": "raw", "scale": "batch"}):
        assert torch.equal(grpo(r, groups, **kw).advantages, grpo(r, g, **kw).advantages)
    assert torch.equal(rloo(r, groups, singleton="raw").advantages, rloo(r, g, singleton="raw").advantages)
    assert torch.equal(dr_grpo(r, groups, singleton="raw").advantages, dr_grpo(r, g, singleton="raw").advantages)
    a = reinforce_pp_baseline(r, groups, mask, singleton="raw").advantages
    assert torch.equal(a, reinforce_pp_baseline(r, g, mask, singleton="raw").advantages)


def test_dtypes() -> None:
    assert grpo(R4.bfloat16(), G4).advantages.dtype == torch.float32
    assert rloo(R4.half(), G4).advantages.dtype == torch.float32
    assert grpo(R4.double(), G4).advantages.dtype == torch.float64
    assert G4.dtype == torch.long
    close(grpo(R4, G4.int()).advantages, grpo(R4, G4).advantages)


def test_to_tokens() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert torch.equal(to_tokens(t([2.0, -1.0]), mask), t([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    per_token = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert torch.equal(to_tokens(per_token, mask), t([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]]))
    assert to_tokens(t([1.0, 2.0]).bfloat16(), mask).dtype == torch.float32
    assert to_tokens(t([1.0, 2.0], D), mask).dtype == D
    assert to_tokens(t([]), torch.zeros(0, 3, dtype=torch.bool)).shape == (0, 3)


def test_to_tokens_non_finite_advantages() -> None:
    # NaN/inf outside the mask (a masked-out row, a masked-out token) come out exactly 0; inside it they raise.
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(to_tokens(t([2.0, math.nan]), mask), t([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    per_token = t([[1.0, -3.0, math.inf], [math.nan, -math.inf, 0.5]])
    assert torch.equal(to_tokens(per_token, mask), t([[1.0, -3.0, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(InputError) as err:
        to_tokens(t([math.nan, 1.0]), mask)
    assert err.value.argument == "advantages" and "mask" in err.value.fix
    # reported with the [B] shape passed: one bad row, at index (0,), not the broadcast [B, 1]
    assert "shape (2,)" in err.value.got and "1 non-finite" in err.value.got and "(0,)" in err.value.got
    with pytest.raises(InputError) as err:
        to_tokens(per_token, torch.ones(2, 3, dtype=torch.bool))
    assert "shape (2, 3)" in err.value.got and "3 non-finite" in err.value.got and "(0, 2)" in err.value.got
    with rolloutopt.checks(False):  # no check, but masked-out positions still 0
        assert torch.equal(to_tokens(t([2.0, math.nan]), mask), t([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))


def test_nan_reward_message_names_the_valid_keyword() -> None:
    mask = torch.ones(4, 2, dtype=torch.bool)
    for call in (
        lambda r: grpo(r, G4),
        lambda r: rloo(r, G4),
        lambda r: dr_grpo(r, G4),
        lambda r: reinforce_pp_baseline(r, G4, mask),
    ):
        r = t([1.0, math.nan, 0.0, 1.0])
        with pytest.raises(InputError) as err:
            call(r)
        assert err.value.argument == "rewards"
        assert "valid=" in err.value.fix and "mask those positions" not in err.value.fix, err.value.fix


# ------------------------------------------------------------------------------------------ empty batch


EMPTY_CALLS: list[Callable[..., Any]] = [
    lambda r, g, v: grpo(r, g, valid=v),
    lambda r, g, v: grpo(r, g, scale="batch", singleton="raw", valid=v),
    lambda r, g, v: grpo(r, g, scale=None, eps=0.0, valid=v),
    lambda r, g, v: dr_grpo(r, g, valid=v),
    lambda r, g, v: rloo(r, g, singleton="raw", valid=v),
    lambda r, g, v: reinforce_pp_baseline(r, g, torch.zeros(r.shape[0], 5, dtype=torch.bool), valid=v),
]


@pytest.mark.parametrize("call", EMPTY_CALLS)
@pytest.mark.parametrize("masked", [False, True])
def test_empty_batch_gives_empty_outputs_and_zero_metrics(call: Callable[..., Any], masked: bool) -> None:
    # B = 0: as the losses return 0 for it, the estimators return empty outputs and metrics 0 (the same keys).
    r = torch.zeros(0, requires_grad=True)
    v = torch.zeros(0, dtype=torch.bool) if masked else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no singleton warning either
        out = call(r, ids([]), v)
    assert out.advantages.shape[0] == 0 and out.weight.shape == (0,)
    assert out.advantages.dtype == torch.float32 and out.weight.dtype == torch.float32
    full = call(t([0.0, 1.0, 0.5, 1.0]), G4, None if v is None else torch.ones(4, dtype=torch.bool))
    assert out.advantages.shape[1:] == full.advantages.shape[1:]
    assert set(out.metrics) == set(full.metrics)
    assert all(m.ndim == 0 and float(m) == 0.0 and not m.requires_grad for m in out.metrics.values())
    out.advantages.sum().backward()  # part of the (empty) rewards' graph
    assert r.grad is not None and r.grad.shape == (0,)
    with rolloutopt.checks(False):
        assert call(r.detach(), ids([]), v).advantages.shape[0] == 0


def test_empty_batch_feeds_the_loss() -> None:
    out = grpo(t([]).bfloat16(), ids([]))
    assert out.advantages.dtype == torch.float32
    logp = torch.zeros(0, 4, requires_grad=True)
    mask = torch.zeros(0, 4, dtype=torch.bool)
    loss = policy_loss(logp, logp.detach(), to_tokens(out.advantages, mask), mask, seq_weight=out.weight).loss
    assert float(loss.detach()) == 0.0


def test_registry() -> None:
    r, g, m = t([0.0, 1.0, 0.5, 2.0]), ids([0, 0, 1, 1]), torch.ones(4, 3, dtype=torch.bool)
    for name, fn in (("grpo", grpo), ("dr_grpo", dr_grpo), ("rloo", rloo)):  # the registered method computes fn
        assert torch.equal(get(name)(r, g).advantages, fn(r, g).advantages)
    assert torch.equal(get("reinforce_pp_baseline")(r, g, m).advantages, reinforce_pp_baseline(r, g, m).advantages)
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"} <= set(names())
    with pytest.raises(InputError) as err:
        get("grpoo")
    assert err.value.argument == "name"
    assert "grpo" in str(err.value)


# ----------------------------------------------------------------------------------------- bad input


def _raises(argument: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(InputError) as err:
        fn()
    assert err.value.argument == argument, str(err.value)
    assert isinstance(err.value, ValueError)


MASK = torch.ones(4, 2, dtype=torch.bool)


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("rewards", lambda: grpo(R4[:, None], G4)),
        ("rewards", lambda: rloo(ids([1, 0, 0, 1]), G4)),
        ("rewards", lambda: grpo([1.0, 0.0, 0.0, 1.0], G4)),
        ("group", lambda: grpo(R4, ids([0, 0, 1]))),
        ("group", lambda: dr_grpo(R4, G4.float())),
        ("group", lambda: rloo(R4, Groups(ids([0, 1, 1])))),
        ("group", lambda: grpo(R4, ids([[0, 0], [1, 1]]))),
        ("rewards", lambda: grpo(t([1.0, math.nan, 0.0, 1.0]), G4)),
        ("rewards", lambda: rloo(t([1.0, 0.0, math.inf, 1.0]), G4, valid=torch.ones(4, dtype=torch.bool))),
        ("rewards", lambda: reinforce_pp_baseline(t([1.0, math.nan, 0.0, 1.0]), G4, MASK)),
        ("scale", lambda: grpo(R4, G4, scale="prompt")),
        ("singleton", lambda: grpo(R4, G4, singleton="mean")),
        ("singleton", lambda: rloo(R4, G4, singleton="verl")),
        ("singleton", lambda: reinforce_pp_baseline(R4, G4, MASK, singleton="pivot")),
        ("rewards", lambda: grpo(ids([]), ids([]))),  # an empty batch is still validated
        ("group", lambda: rloo(t([]), ids([]).float())),
        ("group", lambda: grpo(t([1.0]), ids([]))),
        ("valid", lambda: dr_grpo(t([]), ids([]), valid=torch.ones(1, dtype=torch.bool))),
        ("mask", lambda: reinforce_pp_baseline(t([]), ids([]), torch.ones(1, 2, dtype=torch.bool))),
        ("eps", lambda: grpo(t([]), ids([]), eps=-1.0)),
        ("advantages", lambda: to_tokens(t([1.0, math.nan]), torch.ones(2, 3, dtype=torch.bool))),
        ("advantages", lambda: to_tokens(t([[1.0, math.inf, 0.0]]), torch.ones(1, 3, dtype=torch.bool))),
        ("eps", lambda: grpo(R4, G4, eps=-1e-6)),
        ("eps", lambda: grpo(R4, G4, eps=math.nan)),
        ("eps", lambda: reinforce_pp_baseline(R4, G4, MASK, eps=-1.0)),
        ("valid", lambda: grpo(R4, G4, valid=torch.ones(3, dtype=torch.bool))),
        ("valid", lambda: rloo(R4, G4, valid=torch.tensor([0, 1, 2, 1]))),
        ("mask", lambda: reinforce_pp_baseline(R4, G4, torch.ones(3, 2, dtype=torch.bool))),
        ("mask", lambda: reinforce_pp_baseline(R4, G4, torch.ones(4, dtype=torch.bool))),
        ("advantages", lambda: to_tokens(t([1.0, 2.0, 3.0]), MASK)),
    ],
)
def test_bad_input_names_the_argument(argument: str, call: Callable[[], Any]) -> None:
    _raises(argument, call)


def test_checks_off_skips_validation_but_computes() -> None:
    with rolloutopt.checks(False):
        close(grpo(R4, G4).advantages, grpo(R4.double(), G4).advantages.float())


# ------------------------------------------------------------------------------------------- properties


@st.composite
def batches(draw: st.DrawFn, *, max_groups: int = 6, max_size: int = 6, equal: bool = False) -> dict[str, Any]:
    n_groups = draw(st.integers(1, max_groups))
    if equal:
        size = draw(st.integers(2, max_size))
        sizes = [size] * n_groups
    else:
        sizes = draw(st.lists(st.integers(1, max_size), min_size=n_groups, max_size=n_groups))
    labels = draw(st.lists(st.integers(-(2**40), 2**40), min_size=n_groups, max_size=n_groups, unique=True))
    group = [lab for lab, k in zip(labels, sizes, strict=True) for _ in range(k)]
    b = len(group)
    binary = draw(st.booleans())
    values = st.sampled_from([0.0, 1.0]) if binary else st.floats(-10, 10, width=32)
    rewards = draw(st.lists(values, min_size=b, max_size=b))
    perm = draw(st.permutations(list(range(b))))
    valid = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=b, max_size=b)))
    group = [group[i] for i in perm]
    return {"rewards": rewards, "group": group, "valid": valid, "binary": binary}


def _call(method: str, batch: dict[str, Any], dtype: torch.dtype = D, **kw: Any) -> torch.Tensor:
    r = torch.tensor(batch["rewards"], dtype=dtype)
    g = torch.tensor(batch["group"], dtype=torch.long)
    v = None if batch["valid"] is None else torch.tensor(batch["valid"])
    if method == "dr_grpo":
        return dr_grpo(r, g, valid=v, **kw).advantages
    fn = {"grpo": grpo, "rloo": rloo}[method]
    return fn(r, g, valid=v, **kw).advantages


METHOD_KWARGS = [
    ("grpo", {}),
    ("grpo", {"singleton": "raw"}),
    ("grpo", {"unbiased": False, "eps": 1e-3}),
    ("grpo", {"scale": "batch"}),
    ("grpo", {"scale": "batch", "singleton": "raw"}),
    ("dr_grpo", {}),
    ("dr_grpo", {"singleton": "raw"}),
    ("rloo", {}),
    ("rloo", {"singleton": "raw"}),
]


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches())
def test_matches_naive_loop(batch: dict[str, Any]) -> None:
    for method, kw in METHOD_KWARGS:
        naive_kw = {k: v for k, v in kw.items()}
        if method == "dr_grpo":
            naive_kw["scale"] = None
        expected = naive(
            "rloo" if method == "rloo" else "grpo", batch["rewards"], batch["group"], valid=batch["valid"], **naive_kw
        )
        got = _call(method, batch, **kw)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=D), atol=1e-9, rtol=1e-9, msg=f"{method} {kw}")
        if batch["binary"]:  # fp32 with near-equal continuous rewards amplifies rounding by 1/eps
            got32 = _call(method, batch, torch.float32, **kw)
            torch.testing.assert_close(got32, torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches(), data=st.data())
def test_permutation_and_relabelling(batch: dict[str, Any], data: st.DataObject) -> None:
    b = len(batch["rewards"])
    perm = data.draw(st.permutations(list(range(b))))
    labels = sorted(set(batch["group"]))
    relabel = relabel_map(data, labels)
    permuted = {
        "rewards": [batch["rewards"][i] for i in perm],
        "group": [relabel[batch["group"][i]] for i in perm],
        "valid": None if batch["valid"] is None else [batch["valid"][i] for i in perm],
        "binary": batch["binary"],
    }
    idx = torch.tensor(perm)
    for method, kw in METHOD_KWARGS:
        base = _call(method, batch, **kw)
        torch.testing.assert_close(_call(method, permuted, **kw), base[idx], atol=1e-8, rtol=1e-8)


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches(equal=True))
def test_dense_fast_path_equals_ragged_path(batch: dict[str, Any]) -> None:
    batch = {**batch, "valid": None}
    everything = {**batch, "valid": [True] * len(batch["rewards"])}  # a valid mask forces the ragged path
    assert Groups(torch.tensor(batch["group"])).dense_size is not None
    for method, kw in METHOD_KWARGS:
        dense = _call(method, batch, **kw)
        torch.testing.assert_close(dense, _call(method, everything, **kw), atol=1e-8, rtol=1e-8)
    r = torch.tensor(batch["rewards"], dtype=D)
    g = torch.tensor(batch["group"])
    mask = torch.ones(len(r), 3, dtype=torch.bool)
    dense = reinforce_pp_baseline(r, g, mask).advantages
    ragged = reinforce_pp_baseline(r, g, mask, valid=torch.ones(len(r), dtype=torch.bool)).advantages
    torch.testing.assert_close(dense, ragged, atol=1e-8, rtol=1e-8)


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches())
def test_group_sums_are_zero_and_rloo_identity(batch: dict[str, Any]) -> None:
    g = torch.tensor(batch["group"])
    valid = torch.ones(len(g), dtype=torch.bool) if batch["valid"] is None else torch.tensor(batch["valid"])
    groups = Groups(g)
    for method in ("grpo", "dr_grpo", "rloo"):
        a = _call(method, batch)
        assert torch.equal(a[~valid], torch.zeros_like(a[~valid]))
        torch.testing.assert_close(groups.sum(a), torch.zeros(groups.num_groups, dtype=D), atol=1e-9, rtol=0)
    n = groups.broadcast(groups.count(valid)).to(D)
    dr, rl = _call("dr_grpo", batch), _call("rloo", batch)
    big = n > 1
    torch.testing.assert_close(rl[big], (n / (n - 1))[big] * dr[big], atol=1e-9, rtol=1e-9)


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(
    rewards=st.lists(st.floats(-(2.0**60), 2.0**60, width=32), min_size=1, max_size=24),
    group=st.lists(st.integers(0, 3), min_size=24, max_size=24),
    valid=st.lists(st.booleans(), min_size=24, max_size=24),
)
def test_finite_for_every_finite_input(rewards: list[float], group: list[int], valid: list[bool]) -> None:
    b = len(rewards)
    r = torch.tensor(rewards)
    g = torch.tensor(group[:b])
    v = torch.tensor(valid[:b])
    mask = torch.ones(b, 2, dtype=torch.bool)
    outs = []
    for vv in (None, v):
        outs += [grpo(r, g, valid=vv), grpo(r, g, valid=vv, scale="batch", singleton="raw"), dr_grpo(r, g, valid=vv)]
        outs += [rloo(r, g, valid=vv), reinforce_pp_baseline(r, g, mask, valid=vv)]
    for out in outs:
        assert torch.isfinite(out.advantages).all()
        assert all(torch.isfinite(m) for m in out.metrics.values())


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    g = ids([0, 0, 0, 4, 4, 9, 2, 2, 2, 2])
    valid = torch.tensor([True, True, True, True, True, True, True, False, True, True])
    mask = torch.rand(10, 3, generator=gen) > 0.3
    mask[:, 0] = True
    r = torch.randn(10, dtype=D, generator=gen, requires_grad=True)
    fns: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda x: grpo(x, g).advantages,
        lambda x: grpo(x, g, valid=valid, singleton="raw").advantages,
        lambda x: grpo(x, g, scale="batch", unbiased=False).advantages,
        lambda x: dr_grpo(x, g, valid=valid).advantages,
        lambda x: rloo(x, g, singleton="raw").advantages,
        lambda x: rloo(x, g, valid=valid).advantages,
        lambda x: reinforce_pp_baseline(x, g, mask, singleton="raw").advantages,
        lambda x: reinforce_pp_baseline(x, g, mask, valid=valid).advantages,
    ]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (r,))


def test_gradient_is_finite_with_nan_at_invalid_rows() -> None:
    r = t([1.0, 0.0, math.nan, 2.0], D).requires_grad_(True)
    valid = torch.tensor([True, True, False, True])
    grpo(r, ids([0, 0, 0, 0]), valid=valid).advantages.pow(2).sum().backward()
    assert r.grad is not None
    assert torch.isfinite(r.grad).all()
    assert r.grad[2].item() == 0.0


@pytest.mark.parametrize("estimator", [dr_grpo, rloo, lambda r, g: grpo(r, g, scale="batch")])
def test_zero_variance_group_frac_without_group_std(estimator: Any) -> None:
    # Groups: {1, 1} (zero variance), {0, 1}, {0.3, 0.3, 0.3} (zero variance), {5} (singleton, not counted).
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.3, 0.3, 5.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = estimator(rewards, group)
    assert out.metrics["zero_variance_group_frac"].item() == pytest.approx(2 / 4)


@given(st.integers(1, 6), st.integers(1, 6), st.data())
def test_to_tokens_properties(b: int, t_: int, data: st.DataObject) -> None:
    adv = torch.tensor(data.draw(st.lists(st.floats(-1e6, 1e6), min_size=b, max_size=b)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=t_, max_size=t_), min_size=b, max_size=b)))
    out = to_tokens(adv, mask)
    assert out.shape == (b, t_)
    assert torch.equal(out[mask], adv[:, None].expand(b, t_)[mask])  # every masked-in token carries A_i
    assert (out[~mask] == 0).all()
    noisy = torch.where(mask, adv[:, None], math.nan)  # NaN at every masked-out position: never leaks
    assert torch.equal(to_tokens(noisy, mask), out)
    perm = torch.randperm(b)
    assert torch.equal(to_tokens(adv[perm], mask[perm]), out[perm])
    assert torch.equal(to_tokens(out, mask), out)  # per-token input is returned masked: idempotent


def test_grpo_eps_zero_gives_zero_not_nan_on_zero_variance_groups() -> None:
    out = grpo(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), eps=0.0)
    torch.testing.assert_close(out.advantages, torch.tensor([0.0, 0.0, -(0.5**0.5), 0.5**0.5]))
