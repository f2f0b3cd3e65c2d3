"""ACE (arXiv 2602.21420, reconstructed form) and XRPO novelty-aware advantage sharpening (arXiv 2510.06672).

Hand-computed oracles (our reconstruction of ACE, see docs/methods/confidence.md, and our own examples for both
methods), the experimental gate, composition with GRPO and with precomputed advantages, ``valid`` masks,
hypothesis properties against a float64 Python loop
written from the formulas, invariances, gradchecks and one test per class of bad input. Neither method has a
public reference implementation installed (verl 0.9.1 and TRL 1.16 ship neither; ACE has no public code; XRPO's
code is not available offline), so parity is with the formulas as documented in the module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.advantages._base import REGISTRY
from rolloutopt.advantages.ace import ace
from rolloutopt.advantages.reference import grpo
from rolloutopt.advantages.xrpo import xrpo_sharpen
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

from .helpers import D, close, group_ids, ids, relabel_map, t

pytestmark = pytest.mark.filterwarnings("ignore:rolloutopt. a group of size 1")


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# ------------------------------------------------------------------------------------------------ oracles


def test_ace_spec_oracle() -> None:
    # our reconstruction (docs/methods/confidence.md): A = [+1, -1, -1], c = [5, 0, 3], alpha = 1.
    a = t([1.0, -1.0, -1.0])
    out = ace(None, ids([0, 0, 0]), t([5.0, 0.0, 3.0]), t([0.0, 0.0, 0.0]), advantages=a, experimental=True)
    close(out.advantages, [1.0, -(1 + math.log(2)), -(1 + softplus(3.0))])
    close(out.weight, [1.0, 1.0, 1.0])
    assert out.metrics["penalized_frac"].item() == pytest.approx(2 / 3)
    assert out.metrics["confidence_max"].item() == pytest.approx(5.0)
    assert out.metrics["excluded_frac"].item() == 0.0


def test_ace_hand_example_from_rewards_per_token() -> None:
    # GRPO on [1, 0, 0, 1]: +-sqrt(3)/2. Per-token log-probs with a ragged mask; c is the masked sum.
    r = t([1.0, 0.0, 0.0, 1.0])
    logp = t([[-0.1, -0.2, 9.0], [-0.5, -0.5, -0.5], [-1.0, 7.0, 7.0], [-3.0, -3.0, -3.0]])
    ref = t([[-0.4, -0.4, 0.0], [-1.0, -1.0, -1.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    # c = [0.5, 1.5, -0.5, -9]; errors are rows 1 and 2.
    h = math.sqrt(3) / 2
    out = ace(r, ids([7, 7, 7, 7]), logp, ref, mask=mask, alpha=0.5, experimental=True)
    close(out.advantages, [h, -h * (1 + 0.5 * softplus(1.5)), -h * (1 + 0.5 * softplus(-0.5)), h])
    assert out.metrics["confidence_mean"].item() == pytest.approx((0.5 + 1.5 - 0.5 - 9) / 4)
    # confidence="mean": c = [0.25, 0.5, -0.5, -3]
    out = ace(r, ids([7, 7, 7, 7]), logp, ref, mask=mask, confidence="mean", experimental=True)
    close(out.advantages, [h, -h * (1 + softplus(0.5)), -h * (1 + softplus(-0.5)), h])


def test_ace_penalty_variants_tau_and_cap() -> None:
    a = t([-1.0, -2.0, 1.0])
    c = t([0.0, 4.0, 10.0])
    z = torch.zeros(3)
    g = ids([0, 0, 1])
    shifted = ace(None, g, c, z, advantages=a, penalty="softplus_shifted", experimental=True).advantages
    close(shifted, [-1.0, -2.0 * (1 + softplus(4.0) - math.log(2)), 1.0])  # c = 0 adds nothing
    relu = ace(None, g, c, z, advantages=a, penalty="relu", alpha=2.0, experimental=True).advantages
    close(relu, [-1.0, -2.0 * 9.0, 1.0])
    tau = ace(None, g, c, z, advantages=a, tau=2.0, experimental=True).advantages
    close(tau, [-(1 + math.log(2)), -2.0 * (1 + softplus(2.0)), 1.0])
    out = ace(None, g, c, z, advantages=a, max_scale=3.0, experimental=True)
    close(out.advantages, [-(1 + math.log(2)), -6.0, 1.0])
    assert out.metrics["capped_frac"].item() == pytest.approx(1 / 3)
    # Shifted softplus, under-confident error: the multiplier drops below 1 but stays >= 1 - alpha ln 2 >= 0.
    soft = ace(None, g, t([-50.0, 0.0, 0.0]), z, advantages=a, penalty="softplus_shifted", experimental=True)
    close(soft.advantages, [-(1 - math.log(2)), -2.0, 1.0])


def test_ace_is_monotone_in_confidence_for_errors() -> None:
    c = torch.linspace(-20, 20, 41, dtype=D)
    a = -torch.ones(41, dtype=D)
    adv = ace(None, torch.zeros(41, dtype=torch.long), c, torch.zeros(41), advantages=a, experimental=True).advantages
    assert (adv[1:] < adv[:-1]).all()


def test_xrpo_hand_example_capped_and_uncapped() -> None:
    r = t([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    g = ids([0, 0, 0, 0, 5, 5])
    s = t([-0.5, -1.0, -2.0, -1.0, -0.3, -0.3])
    h = math.sqrt(3) / 2  # GRPO on [1, 0, 1, 0]
    s_bar = -4.5 / 4
    eta0, eta2 = math.exp(-0.5 - s_bar), math.exp(-2.0 - s_bar)
    assert eta0 > 1 > eta2  # row 0 is a typical success (no bonus), row 2 a novel one
    # defaults lambda = 2.5, kappa = 0.5: the bonus 2.5 (1 - eta2) = 1.458 is capped at 0.5 h
    out = xrpo_sharpen(r, g, s)
    close(out.advantages, [h, -h, 1.5 * h, -h, 0.0, 0.0])
    assert out.metrics["sharpened_frac"].item() == pytest.approx(1 / 6)
    assert out.metrics["capped_frac"].item() == pytest.approx(1 / 6)
    # lambda = 0.5: 0.5 (1 - eta2) = 0.2916 < 0.433, not capped
    out = xrpo_sharpen(r, g, s, lambda_novelty=0.5)
    close(out.advantages, [h, -h, h + 0.5 * (1 - eta2), -h, 0.0, 0.0])
    assert out.metrics["capped_frac"].item() == 0.0
    assert out.metrics["bonus_mean"].item() == pytest.approx(0.5 * (1 - eta2), rel=1e-5)
    # baseline="correct": s_bar over the successes only, (-0.5 - 2) / 2
    eta2c = math.exp(-2.0 + 1.25)
    out = xrpo_sharpen(r, g, s, lambda_novelty=0.5, baseline="correct")
    close(out.advantages, [h, -h, h + min(0.5 * (1 - eta2c), 0.5 * h), -h, 0.0, 0.0])


def test_xrpo_per_token_mean_score_and_correct_mask() -> None:
    # Two correct responses in a group of three: lengths 1 and 4, per-token mean scores -0.2 and -1.0.
    r = t([1.0, 1.0, 0.0])
    logp = t([[-0.2, 5.0, 5.0, 5.0], [-1.0, -1.0, -1.0, -1.0], [-0.6, -0.6, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    base = grpo(r, ids([0, 0, 0])).advantages
    s = [-0.2, -1.0, -0.6]
    eta1 = math.exp(s[1] - sum(s) / 3)
    out = xrpo_sharpen(r, ids([0, 0, 0]), logp, mask=mask, lambda_novelty=0.1)
    close(out.advantages, base + t([0.0, 0.1 * (1 - eta1), 0.0]))
    # score="sum": [-0.2, -4.0, -1.2]
    ssum = [-0.2, -4.0, -1.2]
    eta1 = math.exp(ssum[1] - sum(ssum) / 3)
    out = xrpo_sharpen(r, ids([0, 0, 0]), logp, mask=mask, score="sum", lambda_novelty=0.1)
    close(out.advantages, base + t([0.0, min(0.1 * (1 - eta1), 0.5 * base[1].item()), 0.0]))
    # A correct mask that excludes row 1 removes its bonus.
    out = xrpo_sharpen(r, ids([0, 0, 0]), logp, mask=mask, correct=torch.tensor([True, False, False]))
    close(out.advantages, base)


# --------------------------------------------------------------------------------------------- conventions


def test_ace_requires_experimental() -> None:
    with pytest.raises(InputError, match=r"experimental.*reconstructed"):
        ace(t([1.0, 0.0]), ids([0, 0]), t([0.0, 0.0]), t([0.0, 0.0]))


def test_alpha_and_lambda_zero_reproduce_the_base() -> None:
    r = t([1.0, 0.0, 0.0, 1.0, 0.3, 0.7, 0.5])
    g = ids([0, 0, 0, 0, 3, 3, 3])
    lp = torch.randn(7, generator=torch.Generator().manual_seed(0))
    base = grpo(r, g)
    assert torch.equal(ace(r, g, lp, lp * 2, alpha=0.0, experimental=True).advantages, base.advantages)
    assert torch.equal(xrpo_sharpen(r, g, lp, lambda_novelty=0.0).advantages, base.advantages)
    assert torch.equal(xrpo_sharpen(r, g, lp, kappa_clip=0.0).advantages, base.advantages)
    # GRPO keywords are forwarded
    kw: dict[str, Any] = {"scale": None, "eps": 1e-4, "singleton": "raw", "unbiased": False}
    assert torch.equal(ace(r, g, lp, lp, alpha=0.0, experimental=True, **kw).advantages, grpo(r, g, **kw).advantages)
    # composition: rewards -> GRPO inside equals GRPO advantages passed in
    for fn in (
        lambda **k: ace(ref_logp=lp.flip(0), alpha=0.7, experimental=True, **k),
        lambda **k: xrpo_sharpen(lambda_novelty=1.0, **k),
    ):
        got = fn(rewards=r, group=g, logp=lp).advantages
        pre = fn(rewards=None, group=g, logp=lp, advantages=base.advantages).advantages
        torch.testing.assert_close(got, pre)


def test_singletons_and_all_equal_groups_stay_zero() -> None:
    r = t([1.0, 0.4, 0.4, 0.4, 0.0, 0.0])
    g = ids([9, 1, 1, 1, 2, 2])
    lp = t([-5.0, -1.0, -9.0, -0.1, -3.0, -0.2])
    for out in (ace(r, g, lp, torch.zeros(6), experimental=True), xrpo_sharpen(r, g, lp)):
        assert torch.equal(out.advantages, torch.zeros(6))
    raw = xrpo_sharpen(r, g, lp, singleton="raw")  # verl's singleton convention: A = r, eta = 1, no bonus
    close(raw.advantages, grpo(r, g, singleton="raw").advantages)


def test_invalid_rows_get_zero_weight_and_may_be_nan() -> None:
    r = t([1.0, 0.0, 0.0, math.nan, 1.0])
    g = ids([0, 0, 0, 0, 0])
    valid = torch.tensor([True, True, True, False, True])
    logp = t([[-1.0, -1.0], [-0.1, -0.1], [-2.0, -2.0], [math.nan, math.inf], [-3.0, -3.0]])
    ref = t([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [math.nan, 0.0], [-1.0, -1.0]])
    mask = torch.ones(5, 2, dtype=torch.bool)
    for out in (
        ace(r, g, logp, ref, mask=mask, valid=valid, experimental=True),
        xrpo_sharpen(r, g, logp, mask=mask, valid=valid),
    ):
        assert out.advantages[3].item() == 0.0
        assert torch.equal(out.weight, valid.float())
        assert out.metrics["excluded_frac"].item() == pytest.approx(0.2)
        assert all(torch.isfinite(m) for m in out.metrics.values())
        assert all(m.ndim == 0 and not m.requires_grad for m in out.metrics.values())
    # the invalid row does not shift the group's mean score: same as dropping it
    keep = valid.nonzero().squeeze(1)
    dropped = xrpo_sharpen(r[keep], g[keep], logp[keep], mask=mask[keep]).advantages
    close(xrpo_sharpen(r, g, logp, mask=mask, valid=valid).advantages[keep], dropped)
    # masked-out tokens may hold anything
    logp2 = logp.clone()
    logp2[0, 1] = math.nan
    mask2 = mask.clone()
    mask2[0, 1] = False
    out = ace(r, g, logp2, ref, mask=mask2, valid=valid, experimental=True)
    assert torch.isfinite(out.advantages).all()


def test_registry_and_groups_object() -> None:
    assert REGISTRY.get("ace").fn is ace
    assert REGISTRY.get("xrpo_sharpen").fn is xrpo_sharpen
    r = t([1.0, 0.0, 1.0, 1.0, 0.0])
    g = ids([3, 1, 3, 1, 3])
    lp = t([-1.0, -2.0, -3.0, -0.5, -0.7])
    gg = Groups(g)
    assert torch.equal(xrpo_sharpen(r, gg, lp).advantages, xrpo_sharpen(r, g, lp).advantages)
    a1 = ace(r, gg, lp, lp * 0, experimental=True).advantages
    assert torch.equal(a1, ace(r, g, lp, lp * 0, experimental=True).advantages)


def test_dtypes() -> None:
    r = t([1.0, 0.0, 1.0, 0.0])
    g = ids([0, 0, 0, 0])
    lp = t([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0], [-0.2, -0.1]])
    m = torch.ones(4, 2, dtype=torch.bool)
    for dt in (torch.bfloat16, torch.float16):
        out = xrpo_sharpen(r.to(dt), g, lp.to(dt), mask=m)
        assert out.advantages.dtype == torch.float32
        out = ace(r.to(dt), g, lp.to(dt), lp.to(dt) * 0, mask=m, experimental=True)
        assert out.advantages.dtype == torch.float32
    assert xrpo_sharpen(r.double(), g, lp, mask=m).advantages.dtype == D


def _bad_calls() -> list[tuple[str, Callable[[], Any]]]:
    r, g, s = t([1.0, 0.0]), ids([0, 0]), t([-1.0, -2.0])
    tok, m = t([[-1.0], [-2.0]]), torch.ones(2, 1, dtype=torch.bool)

    def a(**kw: Any) -> Any:
        args: dict[str, Any] = {"rewards": r, "group": g, "logp": s, "ref_logp": s, "experimental": True}
        return ace(**{**args, **kw})

    def x(**kw: Any) -> Any:
        return xrpo_sharpen(**{"rewards": r, "group": g, "logp": s, **kw})

    return [
        ("rewards", lambda: a(advantages=r)),  # both rewards and advantages
        ("rewards", lambda: x(rewards=None)),  # neither
        ("rewards", lambda: a(rewards=r.long())),  # dtype
        ("advantages", lambda: x(rewards=None, advantages=torch.zeros(2, 1))),  # shape
        ("advantages", lambda: x(rewards=None, advantages=t([1.0, math.nan]))),  # non-finite
        ("group", lambda: x(group=ids([0, 0, 1]))),
        ("logp", lambda: x(logp=t([-1.0, -2.0, -3.0]))),  # B mismatch
        ("logp", lambda: x(logp=torch.zeros(2, 1, 1))),  # rank
        ("logp", lambda: x(logp=t([-1.0, math.inf]))),  # non-finite at a valid row
        ("ref_logp", lambda: a(ref_logp=t([[math.nan], [0.0]]), mask=m)),
        ("mask", lambda: x(logp=tok)),  # per-token without mask
        ("mask", lambda: x(logp=tok, mask=torch.ones(2, 2, dtype=torch.bool))),  # T mismatch
        ("mask", lambda: x(logp=tok, mask=t([[0.5], [1.0]]))),  # soft mask
        ("valid", lambda: a(valid=torch.tensor([True]))),
        ("correct", lambda: x(correct=torch.tensor([True, False, True]))),
        ("alpha", lambda: a(alpha=-1.0)),
        ("alpha", lambda: a(alpha=2.0, penalty="softplus_shifted")),
        ("tau", lambda: a(tau=0.0)),
        ("max_scale", lambda: a(max_scale=0.5)),
        ("confidence", lambda: a(confidence="max")),
        ("penalty", lambda: a(penalty="exp")),
        ("experimental", lambda: a(experimental=False)),
        ("lambda_novelty", lambda: x(lambda_novelty=-0.1)),
        ("kappa_clip", lambda: x(kappa_clip=-1)),
        ("score", lambda: x(score="max")),
        ("baseline", lambda: x(baseline="batch")),
        ("scale", lambda: x(scale="token")),
    ]


@pytest.mark.parametrize(("argument", "call"), _bad_calls())
def test_bad_input_names_the_argument(argument: str, call: Callable[[], Any]) -> None:
    with pytest.raises(InputError) as info:
        call()
    assert info.value.argument == argument


def test_checks_off_skips_validation_but_computes() -> None:
    r, g, s = t([1.0, 0.0]), ids([0, 0]), t([-1.0, math.inf])
    with rolloutopt.checks(False):
        out = xrpo_sharpen(r, g, s)
    assert out.advantages.shape == (2,)


# --------------------------------------------------------------------------------------------- properties


@st.composite
def batches(draw: st.DrawFn, *, equal: bool = False) -> dict[str, Any]:
    group = draw(group_ids(equal=equal))
    b = len(group)
    perm = draw(st.permutations(list(range(b))))
    group = [group[i] for i in perm]
    binary = draw(st.booleans())
    values = st.sampled_from([0.0, 1.0]) if binary else st.floats(-5, 5, width=32)
    lps = st.floats(-8, 0, width=32)
    return {
        "rewards": draw(st.lists(values, min_size=b, max_size=b)),
        "group": group,
        "logp": draw(st.lists(st.lists(lps, min_size=3, max_size=3), min_size=b, max_size=b)),
        "ref_logp": draw(st.lists(st.lists(lps, min_size=3, max_size=3), min_size=b, max_size=b)),
        "mask": draw(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=b, max_size=b)),
        "valid": draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=b, max_size=b))),
    }


def _tensors(batch: dict[str, Any]) -> dict[str, Any]:
    return {
        "rewards": torch.tensor(batch["rewards"], dtype=D),
        "group": torch.tensor(batch["group"], dtype=torch.long),
        "logp": torch.tensor(batch["logp"], dtype=D),
        "ref_logp": torch.tensor(batch["ref_logp"], dtype=D),
        "mask": torch.tensor(batch["mask"], dtype=torch.bool),
        "valid": None if batch["valid"] is None else torch.tensor(batch["valid"]),
    }


ACE_KW: list[dict[str, Any]] = [
    {},
    {"confidence": "mean", "alpha": 0.3},
    {"penalty": "softplus_shifted", "alpha": 1.2, "tau": 2.0},
    {"penalty": "relu", "max_scale": 2.5},
]
XRPO_KW: list[dict[str, Any]] = [{}, {"score": "sum", "lambda_novelty": 0.3}, {"baseline": "correct", "kappa_clip": 2}]


def _ace(x: dict[str, Any], **kw: Any) -> torch.Tensor:
    return ace(
        x["rewards"], x["group"], x["logp"], x["ref_logp"], mask=x["mask"], valid=x["valid"], experimental=True, **kw
    ).advantages


def _xrpo(x: dict[str, Any], **kw: Any) -> torch.Tensor:
    return xrpo_sharpen(x["rewards"], x["group"], x["logp"], mask=x["mask"], valid=x["valid"], **kw).advantages


def naive_ace(base: list[float], batch: dict[str, Any], **kw: Any) -> list[float]:
    """Row-by-row float64 loop from the documented formula."""
    alpha, tau, cap = kw.get("alpha", 1.0), kw.get("tau", 1.0), kw.get("max_scale")
    out = []
    for i, a in enumerate(base):
        toks = [
            (lp, rf) for lp, rf, m in zip(batch["logp"][i], batch["ref_logp"][i], batch["mask"][i], strict=True) if m
        ]
        c = sum(lp - rf for lp, rf in toks)
        if kw.get("confidence") == "mean":
            c /= max(len(toks), 1)
        pen = {"softplus": softplus(c / tau), "softplus_shifted": softplus(c / tau) - math.log(2)}.get(
            kw.get("penalty", "softplus"), max(c / tau, 0.0)
        )
        mult = 1 + alpha * pen
        mult = min(mult, cap) if cap is not None else mult
        out.append(a * mult if a < 0 else a)
    return out


def naive_xrpo(base: list[float], batch: dict[str, Any], **kw: Any) -> list[float]:
    """Per-group float64 loop from the documented formula."""
    lam, kappa = kw.get("lambda_novelty", 2.5), kw.get("kappa_clip", 0.5)
    b = len(base)
    ok = batch["valid"] or [True] * b
    score = []
    for i in range(b):
        toks = [lp for lp, m in zip(batch["logp"][i], batch["mask"][i], strict=True) if m]
        score.append(sum(toks) if kw.get("score") == "sum" else sum(toks) / max(len(toks), 1))
    out = list(base)
    for gid in set(batch["group"]):
        rows = [i for i in range(b) if batch["group"][i] == gid and ok[i] and any(batch["mask"][i])]
        pool = [i for i in rows if base[i] > 0] if kw.get("baseline") == "correct" else rows
        s_bar = sum(score[i] for i in pool) / len(pool) if pool else 0.0
        for i in rows:
            if base[i] > 0:
                eta = math.exp(min(score[i] - s_bar, 60.0))
                out[i] = base[i] + min(max(lam * (1 - eta), 0.0), kappa * base[i])
    return out


@given(batch=batches())
def test_matches_naive_loop(batch: dict[str, Any]) -> None:
    x = _tensors(batch)
    base = grpo(x["rewards"], x["group"], valid=x["valid"]).advantages.tolist()
    for kw in ACE_KW:
        torch.testing.assert_close(_ace(x, **kw), torch.tensor(naive_ace(base, batch, **kw), dtype=D), msg=str(kw))
    for kw in XRPO_KW:
        torch.testing.assert_close(_xrpo(x, **kw), torch.tensor(naive_xrpo(base, batch, **kw), dtype=D), msg=str(kw))


@given(batch=batches(), data=st.data())
def test_permutation_and_relabelling(batch: dict[str, Any], data: st.DataObject) -> None:
    b = len(batch["rewards"])
    perm = data.draw(st.permutations(list(range(b))))
    labels = sorted(set(batch["group"]))
    relabel = relabel_map(data, labels)
    moved = {k: None if v is None else [v[i] for i in perm] for k, v in batch.items()}
    moved["group"] = [relabel[gid] for gid in moved["group"]]
    x, y = _tensors(batch), _tensors(moved)
    idx = torch.tensor(perm)
    for kw in ACE_KW:
        torch.testing.assert_close(_ace(y, **kw), _ace(x, **kw)[idx], atol=1e-9, rtol=1e-9)
    for kw in XRPO_KW:
        torch.testing.assert_close(_xrpo(y, **kw), _xrpo(x, **kw)[idx], atol=1e-9, rtol=1e-9)


@given(batch=batches(equal=True))
def test_dense_fast_path_equals_ragged_path(batch: dict[str, Any]) -> None:
    x = _tensors({**batch, "valid": None})
    y = _tensors({**batch, "valid": [True] * len(batch["rewards"])})  # a valid mask forces the ragged path
    assert Groups(x["group"]).dense_size is not None
    for kw in ACE_KW:
        torch.testing.assert_close(_ace(x, **kw), _ace(y, **kw), atol=1e-9, rtol=1e-9)
    for kw in XRPO_KW:
        torch.testing.assert_close(_xrpo(x, **kw), _xrpo(y, **kw), atol=1e-9, rtol=1e-9)


@settings(max_examples=30)  # slow: four invariances, each over every keyword set
@given(batch=batches(), data=st.data())
def test_invariances(batch: dict[str, Any], data: st.DataObject) -> None:
    x = _tensors(batch)
    # rewards: positive affine maps leave GRPO (up to eps) and hence both methods unchanged. Rewards on a 1/4
    # grid keep every non-zero group std >= 0.1, so that eps moves advantages by < 1e-5 relative.
    x["rewards"] = torch.round(x["rewards"] * 4) / 4
    scale_, shift = data.draw(st.floats(0.5, 4.0)), data.draw(st.floats(-3.0, 3.0))
    y = {**x, "rewards": x["rewards"] * scale_ + shift}
    for kw in ACE_KW:
        torch.testing.assert_close(_ace(y, **kw), _ace(x, **kw), atol=1e-4, rtol=1e-4)
    for kw in XRPO_KW:
        torch.testing.assert_close(_xrpo(y, **kw), _xrpo(x, **kw), atol=1e-4, rtol=1e-4)
    # ACE: a per-token shift common to logp and ref_logp leaves c unchanged
    bump = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=3, max_size=3)), dtype=D)
    y = {**x, "logp": x["logp"] + bump, "ref_logp": x["ref_logp"] + bump}
    for kw in ACE_KW:
        torch.testing.assert_close(_ace(y, **kw), _ace(x, **kw), atol=1e-9, rtol=1e-9)
    # XRPO: the score is group-relative; a constant per-token shift of a whole group (score="mean") is a no-op
    gshift = {gid: data.draw(st.floats(-3, 3)) for gid in set(batch["group"])}
    y = {**x, "logp": x["logp"] + torch.tensor([gshift[gid] for gid in batch["group"]], dtype=D)[:, None]}
    torch.testing.assert_close(_xrpo(y), _xrpo(x), atol=1e-9, rtol=1e-9)
    # monotone: XRPO never lowers an advantage; ACE never raises one and never changes a non-negative one
    base = grpo(x["rewards"], x["group"], valid=x["valid"]).advantages
    for kw in XRPO_KW:
        up = _xrpo(x, **kw)
        assert (up >= base).all()
        assert (up[base <= 0] == base[base <= 0]).all()
    for kw in ACE_KW:
        down = _ace(x, **kw)
        if kw.get("penalty") != "softplus_shifted":  # the shifted penalty softens under-confident errors
            assert (down <= base).all()
        assert (down[base >= 0] == base[base >= 0]).all()


@given(
    rewards=st.lists(st.floats(-(2.0**60), 2.0**60, width=32), min_size=1, max_size=12),
    logp=st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=12, max_size=12),
    ref=st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=12, max_size=12),
    group=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    valid=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_finite_for_every_finite_input(
    rewards: list[float], logp: list[float], ref: list[float], group: list[int], valid: list[bool]
) -> None:
    b = len(rewards)
    r, lp, rf, g, v = t(rewards), t(logp[:b]), t(ref[:b]), ids(group[:b]), torch.tensor(valid[:b])
    outs = []
    for vv in (None, v):
        outs += [
            ace(r, g, lp, rf, valid=vv, experimental=True),
            ace(r, g, lp, rf, valid=vv, max_scale=10.0, experimental=True),
        ]
        outs += [xrpo_sharpen(r, g, lp, valid=vv), xrpo_sharpen(r, g, lp, valid=vv, baseline="correct")]
    for out in outs:
        assert torch.isfinite(out.advantages).all()
        assert all(torch.isfinite(m) for m in out.metrics.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    g = ids([0, 0, 0, 4, 4, 9, 2, 2, 2, 2])
    valid = torch.tensor([True, True, True, True, True, True, True, False, True, True])
    mask = torch.rand(10, 3, generator=gen) > 0.3
    lp = -torch.rand(10, 3, dtype=D, generator=gen) * 3
    ref = -torch.rand(10, 3, dtype=D, generator=gen) * 3
    r = torch.randn(10, dtype=D, generator=gen, requires_grad=True)
    fns: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda x: ace(x, g, lp, ref, mask=mask, experimental=True).advantages,
        lambda x: ace(x, g, lp, ref, mask=mask, valid=valid, max_scale=2.0, experimental=True).advantages,
        lambda x: ace(None, g, lp, ref, mask=mask, advantages=x, penalty="relu", experimental=True).advantages,
        lambda x: xrpo_sharpen(x, g, lp, mask=mask).advantages,
        lambda x: xrpo_sharpen(x, g, lp, mask=mask, valid=valid, lambda_novelty=0.2).advantages,
        lambda x: xrpo_sharpen(None, g, lp, mask=mask, advantages=x, kappa_clip=0.1).advantages,
    ]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (r,))
    # the likelihood statistics are constants: no gradient reaches the log-probs
    lpg = lp.clone().requires_grad_(True)
    (
        ace(r, g, lpg, ref, mask=mask, experimental=True).advantages.sum()
        + xrpo_sharpen(r, g, lpg, mask=mask).advantages.sum()
    ).backward()
    assert lpg.grad is None


def test_finiteness_certificate_on_per_token_input() -> None:
    # Row sums certify finiteness: NaN outside the mask and a finite row whose sum overflows must not raise; a
    # non-finite masked-in value still raises, naming the argument.
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    logp = torch.tensor([[-1.0, -2.0], [-1.5, math.nan], [-3e38, -3e38], [-0.5, -0.5]])
    ace(r, g, logp, logp * 0.5, mask=mask, experimental=True)
    xrpo_sharpen(r, g, logp, mask=mask)
    bad = logp.clone()
    bad[3, 1] = math.inf
    with pytest.raises(InputError, match="ref_logp"):
        ace(r, g, logp, bad, mask=mask, experimental=True)
    with pytest.raises(InputError, match="logp"):
        xrpo_sharpen(r, g, bad, mask=mask)
