"""SAT (arXiv 2607.18722) and TBPO (arXiv 2604.07853): both reconstructed (docs/methods/trust_regions.md)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.losses import policy_loss
from rolloutopt.ratios import (
    TBPO,
    GSPORatio,
    PPOClip,
    SATClip,
    StageContext,
    TokenRatio,
    sat_bounds,
    tbpo_loss,
)

D = torch.float64
ONES = torch.ones


def t(x: object, **kw: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D, **kw)  # type: ignore[arg-type]


def sat(**kw: object) -> SATClip:
    return SATClip(experimental=True, **kw)  # type: ignore[arg-type]


def tbpo(**kw: object) -> TBPO:
    return TBPO(experimental=True, **kw)  # type: ignore[arg-type]


def batch(seed: int, B: int = 3, T: int = 6, stale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -0.1 - torch.rand(B, T, generator=g, dtype=D)
    return {
        "old": old,
        "logp": old + 0.1 * torch.randn(B, T, generator=g, dtype=D),
        "behav": old + stale * torch.randn(B, T, generator=g, dtype=D),
        "adv": torch.randn(B, generator=g, dtype=D),
        "mask": torch.rand(B, T, generator=g) < 0.8,
    }


# --------------------------------------------------------------------------------------------------- SAT


def test_sat_hand_oracle() -> None:
    # 20 tokens, |d| = 0.01 .. 0.20; tail = 0.1 -> q = lower order statistic at floor(0.9 * 19) = 17 -> 0.18.
    # Tail: |d| > 0.18, i.e. +0.20 (upper bound shrinks: 0.28 * 0.18 / 0.20 = 0.252) and -0.19 (lower bound
    # shrinks: 0.2 * 0.18 / 0.19).
    mags = [0.01 * (i + 1) for i in range(20)]
    d = t([[m if i != 18 else -m for i, m in enumerate(mags)]])
    behav = torch.zeros(1, 20, dtype=D)
    b = sat_bounds(d, behav, ONES(1, 20, dtype=torch.bool), tail=0.1, experimental=True)
    torch.testing.assert_close(b.quantile, t(0.18))
    assert b.tail.nonzero()[:, 1].tolist() == [18, 19]
    expected_high = torch.full((1, 20), 0.28, dtype=D)
    expected_high[0, 19] = 0.28 * 0.18 / 0.20
    expected_low = torch.full((1, 20), 0.2, dtype=D)
    expected_low[0, 18] = 0.2 * 0.18 / 0.19
    torch.testing.assert_close(b.high, expected_high)
    torch.testing.assert_close(b.low, expected_low)
    # the other contractions
    b = sat_bounds(d, behav, ONES(1, 20, dtype=torch.bool), tail=0.1, kappa="sqrt", experimental=True)
    assert float(b.high[0, 19]) == pytest.approx(0.28 * math.sqrt(0.9))
    b = sat_bounds(d, behav, ONES(1, 20, dtype=torch.bool), tail=0.1, kappa="exp", experimental=True)
    assert float(b.low[0, 18]) == pytest.approx(0.2 * math.exp(-0.01))


def test_sat_sequence_level_uses_row_means() -> None:
    old = t([[0.3, 0.1, 9.0], [-0.2, -0.2, 0.0], [0.01, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]]).bool()
    # row means of d = old - 0: 0.2, -0.4/3, 0.01 (the empty row is ignored); tail 0.5 -> q = sorted[1] = 0.1333
    b = sat_bounds(old, torch.zeros_like(old), mask, tail=0.5, level="sequence", experimental=True)
    torch.testing.assert_close(b.quantile, t(0.4 / 3))
    assert b.tail.tolist() == [[True, True, False], [False, False, False], [False] * 3, [False] * 3]
    torch.testing.assert_close(b.high[0, :2], torch.full((2,), 0.28 * (0.4 / 3) / 0.2, dtype=D))
    torch.testing.assert_close(b.low[0], torch.full((3,), 0.2, dtype=D))


finite = st.floats(-30.0, 30.0, allow_nan=False, width=64)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(finite, finite, st.booleans()), min_size=1, max_size=16),
    st.floats(0.01, 0.99),
    st.floats(0.01, 0.99),
    st.sampled_from(["ratio", "sqrt", "exp"]),
    st.sampled_from(["token", "sequence"]),
)
def test_sat_interval_inside_ppo_and_monotone_in_tail(
    cells: list[tuple[float, float, bool]], p1: float, p2: float, kappa: str, level: str
) -> None:
    old = t([[a for a, _, _ in cells]])
    behav = t([[b for _, b, _ in cells]])
    mask = torch.tensor([[k for _, _, k in cells]])
    kw = {"kappa": kappa, "level": level, "experimental": True}
    b = sat_bounds(old, behav, mask, tail=p1, **kw)  # type: ignore[arg-type]
    assert ((b.low >= 0) & (b.low <= 0.2)).all() and ((b.high >= 0) & (b.high <= 0.28)).all()
    assert (b.low[~b.tail] == 0.2).all() and (b.high[~b.tail] == 0.28).all()  # exactly PPO below the quantile
    assert ((b.low == 0.2) | (b.high == 0.28)).all()  # one endpoint at most
    lo_p, hi_p = sorted((p1, p2))
    small = sat_bounds(old, behav, mask, tail=lo_p, **kw)  # type: ignore[arg-type]
    large = sat_bounds(old, behav, mask, tail=hi_p, **kw)  # type: ignore[arg-type]
    assert (large.low <= small.low + 1e-15).all() and (large.high <= small.high + 1e-15).all()
    assert not (small.tail & ~large.tail).any()
    # every finite input gives a finite loss through policy_loss (shifted by -31 to be log-probabilities: the
    # staleness d = old - behav and the ratio are unchanged)
    logp = old + 0.5
    trust = sat(tail=p1, kappa=kappa, level=level)
    out = policy_loss(logp - 31, old - 31, t([1.0]), mask, behav_logp=behav - 31, trust=trust)
    assert torch.isfinite(out.loss) and all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("dual", [None, 3.0])
def test_sat_with_zero_staleness_equals_ppo_clip(dual: float | None) -> None:
    x = batch(0)
    for ratio in (TokenRatio(), GSPORatio()):
        lp_a = x["logp"].clone().requires_grad_()
        lp_b = x["logp"].clone().requires_grad_()
        a = policy_loss(lp_a, x["old"], x["adv"], x["mask"], behav_logp=x["old"], ratio=ratio, trust=sat(dual=dual))
        b = policy_loss(lp_b, x["old"], x["adv"], x["mask"], ratio=ratio, trust=PPOClip(0.2, 0.28, dual))
        assert torch.equal(a.loss, b.loss)
        a.loss.backward()
        b.loss.backward()
        assert lp_a.grad is not None and lp_b.grad is not None
        assert torch.equal(lp_a.grad, lp_b.grad)
        assert float(a.metrics["sat_tail_frac"]) == 0.0
        assert torch.equal(a.metrics["clipfrac"], b.metrics["clipfrac"])


def test_sat_contracts_the_clip_of_stale_tokens() -> None:
    # one token with d = +1 (proximal moved up from the behaviour policy), ratio 1.25 > 1.28 * kappa:
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    behav = old - t([[0.0, 0.0, 0.1, 1.0]])
    logp = (old + math.log(1.25)).requires_grad_()
    mask = ONES(1, 4, dtype=torch.bool)
    out = policy_loss(logp, old, t([1.0]), mask, behav_logp=behav, trust=sat(tail=0.3))
    # q = sorted |d| [0, 0, 0.1, 1] at floor(0.7 * 3) = 2 -> 0.1; tail: the d = 1 token, eps_high = 0.028
    out.loss.backward()
    assert logp.grad is not None
    assert float(logp.grad[0, 3]) == 0.0 and (logp.grad[0, :3] != 0).all()
    torch.testing.assert_close(out.per_token[0, 3], t(-1.028))
    assert float(out.metrics["sat_tail_frac"]) == 0.25 and float(out.metrics["sat_shrunk_high_frac"]) == 0.25
    assert float(out.metrics["sat_quantile"]) == pytest.approx(0.1)


def test_sat_gradcheck() -> None:
    x = batch(4)

    def f(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(lp, x["old"], x["adv"], x["mask"], behav_logp=x["behav"], trust=sat(tail=0.2)).loss

    assert torch.autograd.gradcheck(f, (x["logp"].clone().requires_grad_(),))


# -------------------------------------------------------------------------------------------------- TBPO


def test_tbpo_hand_oracle() -> None:
    # token log-ratios [0.2, -0.4, 0.5] -> r = e^0.1 = 1.10517 (GSPO's ratio); prox - behav mean log 1.5 -> w = 1.5
    old = t([[-1.0, -1.0, -1.0, 0.0]])
    logp = (old + t([[0.2, -0.4, 0.5, 0.0]])).requires_grad_()
    behav = old - math.log(1.5)
    mask = torch.tensor([[1, 1, 1, 0]]).bool()
    r = math.exp(0.1)
    out = tbpo_loss(logp, old, behav, t([-1.0]), mask, low=0.2, high=0.2, experimental=True)
    torch.testing.assert_close(out.loss[0, :3], torch.full((3,), 1.5 * r, dtype=D))  # inside: -r A w
    out.loss.sum().backward()
    assert logp.grad is not None and (logp.grad[0, :3] != 0).all()
    # eps_high = 0.05: both bounds bind for A < 0 -> loss (1 + 0.05) * |A| * w, zero gradient
    logp.grad = None
    out = tbpo_loss(logp, old, behav, t([-1.0]), mask, low=0.05, high=0.05, experimental=True)
    torch.testing.assert_close(out.loss[0, :3], torch.full((3,), 1.5 * 1.05, dtype=D))
    out.loss.sum().backward()
    assert logp.grad is not None and (logp.grad == 0).all()
    assert out.keep is not None and out.keep.tolist() == [[True, True, True, False]]
    # band C = 1.4 < w = 1.5: the sequence is dropped
    out = tbpo_loss(logp, old, behav, t([-1.0]), mask, band=1.4, experimental=True)
    assert out.keep is not None and not out.keep.any() and (out.loss == 0).all()


def test_tbpo_positive_advantages_equal_gspo_clip_times_weight() -> None:
    x = batch(5, stale=0.05)
    adv = x["adv"].abs()
    w = torch.exp(((x["old"] - x["behav"]) * x["mask"]).sum(-1) / x["mask"].sum(-1).clamp(min=1))
    a = policy_loss(
        x["logp"], x["old"], adv, x["mask"], behav_logp=x["behav"], ratio=GSPORatio(), trust=tbpo(band=10.0)
    )
    b = policy_loss(x["logp"], x["old"], adv, x["mask"], ratio=GSPORatio(), trust=PPOClip(3e-4, 4e-4, None))
    torch.testing.assert_close(a.per_token, b.per_token * w[:, None])
    # with no mismatch (w = 1) the loss is GSPO's
    c = policy_loss(x["logp"], x["old"], adv, x["mask"], behav_logp=x["old"], trust=tbpo(), agg="seq-mean-token-mean")
    d = policy_loss(
        x["logp"],
        x["old"],
        adv,
        x["mask"],
        ratio=GSPORatio(),
        trust=PPOClip(3e-4, 4e-4, None),
        agg="seq-mean-token-mean",
    )
    torch.testing.assert_close(c.loss, d.loss)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-15.0, 15.0, allow_nan=False, width=64), min_size=2, max_size=8),
    st.lists(st.floats(-3.0, 3.0, allow_nan=False, width=64), min_size=2, max_size=8),
    st.floats(-3.0, 3.0, allow_nan=False),
    st.floats(1.01, 5.0),
    st.floats(1.01, 5.0),
)
def test_tbpo_negative_advantage_bound_and_band_monotone(
    lr: list[float], mis: list[float], a: float, c1: float, c2: float
) -> None:
    n = min(len(lr), len(mis))
    old = torch.full((2, n), -1.0, dtype=D)
    logp = old + t([lr[:n], [x / 2 for x in lr[:n]]])
    behav = old - t([mis[:n], [x / 3 for x in mis[:n]]])
    mask = ONES(2, n, dtype=torch.bool)
    adv = t([-abs(a), -abs(a) / 2])
    out = tbpo_loss(logp, old, behav, adv, mask, low=0.2, high=0.28, band=c1, experimental=True)
    w = torch.exp(((old - behav) * mask).sum(-1) / n)
    assert torch.isfinite(out.loss).all()
    assert (out.loss.abs() <= 1.28 * adv.abs()[:, None] * w[:, None] + 1e-12).all()
    lo, hi = sorted((c1, c2))
    k_lo = tbpo_loss(logp, old, behav, adv, mask, band=lo, experimental=True).keep
    k_hi = tbpo_loss(logp, old, behav, adv, mask, band=hi, experimental=True).keep
    assert k_lo is not None and k_hi is not None and not (k_lo & ~k_hi).any()


def test_tbpo_out_of_band_sequences_contribute_exactly_zero() -> None:
    x = batch(6, B=4, T=5, stale=0.05)
    x = {k: v - 5.0 if k in ("logp", "old", "behav") else v for k, v in x.items()}  # log-probs stay <= 0 below
    behav = x["behav"].clone()
    behav[1] = x["old"][1] - 3.0  # w = e^3, outside [1/2, 2]
    behav[2] = x["old"][2] + 3.0  # w = e^-3
    lp = x["logp"].clone().requires_grad_()
    out = policy_loss(lp, x["old"], x["adv"], x["mask"], behav_logp=behav, ratio=GSPORatio(), trust=tbpo())
    out.loss.backward()
    assert lp.grad is not None
    assert (lp.grad[1:3] == 0).all() and (out.per_token[1:3] == 0).all()
    assert (lp.grad[0][x["mask"][0]] != 0).any()
    rows_in = x["mask"][[0, 3]].sum()
    assert float(out.metrics["tbpo_out_of_band_frac"]) == pytest.approx(1 - float(rows_in) / float(x["mask"].sum()))


def test_tbpo_ignores_the_ratio_passed_in() -> None:
    x = batch(7)
    ctx = StageContext(
        logp=x["logp"], old_logp=x["old"], mask=x["mask"], advantages=x["adv"][:, None], behav_logp=x["behav"]
    )
    junk = torch.full_like(x["logp"], 123.0)
    a = tbpo()(junk, junk, x["adv"][:, None], x["logp"], ctx=ctx)
    b = tbpo_loss(x["logp"], x["old"], x["behav"], x["adv"], x["mask"], experimental=True)
    assert torch.equal(a.loss, b.loss)


def test_tbpo_gradcheck() -> None:
    x = batch(8, stale=0.05)

    def f(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            lp,
            x["old"],
            x["adv"],
            x["mask"],
            behav_logp=x["behav"],
            ratio=GSPORatio(),
            trust=tbpo(low=0.2, high=0.2),
            agg="seq-mean-token-mean",
        ).loss

    assert torch.autograd.gradcheck(f, (x["logp"].clone().requires_grad_(),))


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: SATClip(), "SATClip.experimental"),
        (lambda: sat(tail=0.0), "SATClip.tail"),
        (lambda: sat(tail=1.0), "SATClip.tail"),
        (lambda: sat(kappa="linear"), "SATClip.kappa"),
        (lambda: sat(level="group"), "SATClip.level"),
        (lambda: sat(low=-0.1), "SATClip.low"),
        (lambda: sat(low=1.5), "SATClip.low"),
        (lambda: sat(dual=1.0), "SATClip.dual"),
        (lambda: TBPO(), "TBPO.experimental"),
        (lambda: tbpo(band=1.0), "TBPO.band"),
        (lambda: tbpo(high=-1.0), "TBPO.high"),
        (lambda: tbpo(low=2.0), "TBPO.low"),
        (lambda: tbpo(clamp_max=0.0), "TBPO.clamp_max"),
    ],
)
def test_bad_hyper_parameters(make: object, arg: str) -> None:
    with pytest.raises(InputError) as e:
        make()  # type: ignore[operator]
    assert e.value.argument == arg


def test_bad_inputs() -> None:
    x = t([[0.0, 0.0]])
    m = ONES(1, 2, dtype=torch.bool)
    with pytest.raises(InputError) as e:
        sat_bounds(x, x, m)
    assert e.value.argument == "experimental"
    with pytest.raises(InputError) as e:
        tbpo_loss(x, x, x, t([1.0]), m)
    assert e.value.argument == "experimental"
    for stage in (sat(), tbpo()):
        with pytest.raises(InputError, match="ctx"):
            stage(x.exp(), x, x, x)
        with pytest.raises(InputError, match="behav_logp"):
            policy_loss(x, x, t([1.0]), m, trust=stage)
    with pytest.raises(InputError) as e:
        sat_bounds(x, t([[0.0]]), m, experimental=True)
    assert e.value.argument == "behav_logp"
    with pytest.raises(InputError) as e:
        tbpo_loss(x, x, t([[math.nan, 0.0]]), t([1.0]), m, experimental=True)
    assert e.value.argument == "behav_logp"
    with pytest.raises(InputError) as e:
        tbpo_loss(x, x, x, t([1.0, 2.0]), m, experimental=True)
    assert e.value.argument == "advantages"
