"""V_{0.5} (arXiv 2603.10848) and DARE (arXiv 2601.21804); both reconstructed, no public reference implementation.

Hand-computed oracles (our reconstruction, see docs/methods/prior.md), an independent float64 per-group loop for
each estimator, hypothesis properties (permutation, relabelling, ragged = dense, invariances, finiteness),
gradchecks and one test per class of bad input.
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
from rolloutopt.advantages import get
from rolloutopt.advantages.dare import DAREOutput, dare_rewards
from rolloutopt.advantages.v05 import V05Output, v05
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

from .helpers import D, group_ids, ids, relabel_map, t


def close(a: torch.Tensor, b: object, atol: float = 1e-6) -> None:
    b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)
    torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=1e-6)


def V(*args: Any, **kw: Any) -> V05Output:  # noqa: N802
    return v05(*args, experimental=True, **kw)


def R(*args: Any, **kw: Any) -> DAREOutput:  # noqa: N802
    return dare_rewards(*args, experimental=True, **kw)


# --------------------------------------------------------------------------------------- independent oracles


def naive_v05(
    rewards: list[float],
    group: list[int],
    prior: dict[int, float],
    *,
    valid: list[bool] | None = None,
    variance: str = "bernoulli",
    fallback: str = "prior",
    var_floor: float = 0.0,
    threshold: float = 1.0,
    cost: float = 1e-3,
    max_extra: int = 4,
) -> tuple[list[float], dict[int, tuple[float, float, bool, int]]]:
    """Per-group float64 loop of our V_{0.5} reconstruction (docs/methods/prior.md); returns advantages and
    (b, w, accepted, k)."""
    ok = valid if valid is not None else [True] * len(rewards)
    per: dict[int, tuple[float, float, bool, int]] = {}
    for lab in sorted(set(group)):
        b0 = min(max(prior[lab], 0.0), 1.0)
        xs = [rewards[i] for i in range(len(rewards)) if group[i] == lab and ok[i]]
        n = len(xs)
        if n == 0:
            per[lab] = (b0, 0.0, True, max_extra)
            continue
        mu = xs[0] if len(set(xs)) == 1 else sum(xs) / n
        if variance == "bernoulli":
            var = max(mu * (1 - mu), 0.0)
        else:
            corr = 1 if variance == "sample" else 0
            var = sum((x - mu) ** 2 for x in xs) / (n - corr) if n > corr and len(set(xs)) > 1 else 0.0
        if var <= 0 and fallback == "prior":
            var = b0 * (1 - b0)
        var = max(var, var_floor)
        delta2 = max(0.0, (mu - b0) ** 2 - threshold * var / n)
        den = delta2 + var / n
        w = delta2 / den if den > 0 else 0.0

        def mse(m: float, d2: float = delta2, v: float = var) -> float:
            return d2 * v / (m * d2 + v) if m * d2 + v > 0 else 0.0

        k = next((k for k in range(max_extra + 1) if mse(n + k) - mse(n + k + 1) < cost), max_extra)
        per[lab] = (w * mu + (1 - w) * b0, w, delta2 == 0, k)
    adv = [rewards[i] - per[group[i]][0] if ok[i] else 0.0 for i in range(len(rewards))]
    return adv, per


def naive_dare(
    answers: list[int],
    group: list[int],
    *,
    confidence: list[float] | None = None,
    uncertainty: list[float] | None = None,
    prune: float = 0.1,
    bonus: float = 0.1,
    bonus_quantile: float = 0.5,
    valid: list[bool] | None = None,
) -> list[float]:
    """Per-group float64 loop of our DARE reconstruction (docs/methods/prior.md; no null answer, no
    renormalisation)."""
    b = len(answers)
    ok = valid if valid is not None else [True] * b
    c = confidence if confidence is not None else [1.0] * b
    out = [0.0] * b
    for lab in set(group):
        rows = [i for i in range(b) if group[i] == lab and ok[i]]
        total = sum(c[i] for i in rows)
        share = {i: (sum(c[j] for j in rows if answers[j] == answers[i]) / total if total > 0 else 0.0) for i in rows}
        top = max(share.values(), default=0.0)
        q = None
        if uncertainty is not None and rows:
            us = sorted(uncertainty[i] for i in rows)
            pos = bonus_quantile * (len(us) - 1)
            lo = math.floor(pos)
            hi = min(lo + 1, len(us) - 1)
            q = us[lo] + (us[hi] - us[lo]) * (pos - lo)
        for i in rows:
            pruned = share[i] < prune
            r = 0.0 if pruned else share[i]
            major = share[i] == top and share[i] > 0
            if q is not None and bonus > 0 and not major and not pruned and uncertainty is not None:
                r += bonus if uncertainty[i] <= q else 0.0
            out[i] = r
    return out


# -------------------------------------------------------------------------------------------- V05 oracles

R8, G8 = t([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]), ids([0, 0, 0, 0, 3, 3, 3, 3])
P8 = t([0.5] * 4 + [0.6] * 4)


def test_v05_hand_oracle() -> None:
    # group 0: mean .75, v = .1875, v/n = .046875, gap^2 = .0625, delta^2 = .015625, w = .25, b = .5625
    # group 3: mean .5, v = .25, v/n = .0625, gap^2 = .01 < .0625: prior accepted, b = .6
    out = V(R8, G8, P8)
    close(out.baseline, [0.5625, 0.6])
    close(out.fusion_weight, [0.25, 0.0])
    assert out.accepted.tolist() == [False, True]
    close(out.statistic, [0.0625 / 0.046875, 0.01 / 0.0625])
    close(out.advantages, [0.4375, 0.4375, -0.5625, 0.4375, 0.4, -0.6, -0.6, 0.4])
    # MSE(m) = d2 v / (m d2 + v): MSE(4) - MSE(5) = 6.9e-4 < cost 1e-3; an accepted prior asks for 0
    assert out.extra_rollouts.tolist() == [0, 0]
    assert out.extra_rollouts.dtype == torch.long
    assert out.group_ids.tolist() == [0, 3]
    close(out.weight, torch.ones(8))
    close(out.metrics["prior_accepted_frac"], 0.5)
    close(out.metrics["fusion_weight_mean"], 0.125)
    close(out.metrics["baseline_mean"], (0.5625 + 0.6) / 2)
    assert all(m.ndim == 0 and not m.requires_grad for m in out.metrics.values())
    # delta^2 = 1/64, v = 12/64: MSE(m) = (3/16) / (m + 12); Delta(4) = (3/16)/272 = 6.89e-4,
    # Delta(5) = (3/16)/306 = 6.13e-4: a cost of 6.5e-4 asks for one more rollout
    d1, d2 = 3 / 16 / 272, 3 / 16 / 306
    assert d2 < 6.5e-4 < d1
    assert V(R8, G8, P8, cost=6.5e-4).extra_rollouts.tolist() == [1, 0]
    assert V(R8, G8, P8, cost=1e-9, max_extra=3).extra_rollouts.tolist() == [3, 0]


def test_v05_all_correct_group_uses_the_prior_variance() -> None:
    # mean 1, Bernoulli v = 0 -> prior variance .25; v/n = .0625, gap^2 = .25, delta^2 = .1875, w = .75
    out = V(t([1.0] * 4), ids([5] * 4), t([0.5] * 4))
    close(out.fusion_weight, [0.75])
    close(out.baseline, [0.875])
    close(out.advantages, [0.125] * 4)
    # Delta MSE(m) = d^4 v / ((m d2 + v)((m+1) d2 + v)) stays above 1e-3 up to m = 8: capped at max_extra
    assert out.extra_rollouts.tolist() == [4]
    none = V(t([1.0] * 4), ids([5] * 4), t([0.5] * 4), fallback="none")
    close(none.fusion_weight, [1.0])
    close(none.advantages, [0.0] * 4)
    floor = V(t([1.0] * 4), ids([5] * 4), t([0.5] * 4), fallback="none", var_floor=0.25)
    close(floor.fusion_weight, [0.75])


def test_v05_spec_oracles() -> None:
    # mean == prior -> b = prior exactly (the test accepts)
    out = V(t([1.0, 0.0, 1.0, 0.0, 1.0]), ids([2] * 5), t([0.6] * 5))
    assert out.baseline.item() == t(0.6).item()
    assert out.accepted.all()
    # as n grows with a fixed conflict, w -> 1 and b -> mean
    ws = []
    for n in (4, 40, 400, 4000):
        r = t([1.0, 0.0, 0.0, 0.0] * (n // 4))
        o = V(r, ids([0] * n), t([0.75] * n))
        ws.append(o.fusion_weight.item())
        assert 0.0 <= ws[-1] <= 1.0
    assert ws == sorted(ws)
    assert ws[-1] > 0.99
    close(V(t([1.0, 0.0, 0.0, 0.0] * 1000), ids([0] * 4000), t([0.75] * 4000)).baseline, [0.25], atol=5e-3)


def test_v05_threshold_and_scale() -> None:
    # group 0 of the hand oracle: z^2 = 4/3; threshold 1.5 accepts the prior
    out = V(R8, G8, P8, threshold=1.5)
    assert out.accepted.tolist() == [True, True]
    close(out.baseline, [0.5, 0.6])
    strict = V(R8, G8, P8, threshold=0.0)  # w = gap^2 / (gap^2 + v/n)
    close(strict.fusion_weight, [0.0625 / (0.0625 + 0.046875), 0.01 / (0.01 + 0.0625)])
    sd = V(R8, G8, P8, scale="std", eps=0.0)
    close(sd.advantages[:4], t([0.4375, 0.4375, -0.5625, 0.4375]) / math.sqrt(0.1875))
    close(sd.advantages[4:], t([0.4, -0.6, -0.6, 0.4]) / 0.5)


def test_v05_sample_variance_and_non_binary_rewards() -> None:
    r, g = t([0.2, 3.0, 1.0]), ids([1, 1, 1])
    out = V(r, g, t([0.0] * 3), variance="sample", prior_range=None)
    mu = 4.2 / 3
    var = sum((x - mu) ** 2 for x in (0.2, 3.0, 1.0)) / 2
    d2 = max(0.0, mu**2 - var / 3)
    w = d2 / (d2 + var / 3)
    close(out.fusion_weight, [w])
    close(out.advantages, t([0.2, 3.0, 1.0]) - w * mu)
    pop = V(r, g, t([0.0] * 3), variance="population", prior_range=None)
    var_p = var * 2 / 3
    d2p = max(0.0, mu**2 - var_p / 3)
    close(pop.fusion_weight, [d2p / (d2p + var_p / 3)])


def test_v05_prior_clipping_and_singletons() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no singleton warning: the prior is a baseline
        out = v05(t([1.0, 0.0, 1.0]), ids([0, 1, 1]), t([1.4, -0.2, -0.2]), experimental=True)
    close(out.prior, [1.0, 0.0])
    close(out.metrics["prior_clipped_frac"], 1.0)
    # singleton: mean 1 = clipped prior 1 -> accepted, A = 0
    assert out.accepted[0].item()
    assert out.advantages[0].item() == 0.0
    # group 1: mean .5, v = .25, v/n = .125, gap^2 = .25, delta^2 = .125, w = .5, b = .25
    close(out.baseline[1], 0.25)
    unclipped = V(t([1.0]), ids([0]), t([1.4]), prior_range=None)
    close(unclipped.prior, [1.4])


def test_v05_valid_rows() -> None:
    r = t([1.0, math.nan, 0.0, 1.0, 1.0, 0.0])
    g = ids([0, 0, 0, 1, 1, 1])
    p = t([0.3, 0.3, 0.3, 0.9, 0.9, 0.9])
    valid = torch.tensor([True, False, True, False, False, False])
    out = V(r, g, p, valid=valid)
    ref = V(t([1.0, 0.0]), ids([0, 0]), t([0.3, 0.3]))
    close(out.baseline[0], ref.baseline[0])
    close(out.advantages[[0, 2]], ref.advantages)
    assert torch.equal(out.advantages[[1, 3, 4, 5]], torch.zeros(4))
    assert torch.equal(out.weight, valid.float())
    # group 1 has no valid row: the prior stands and the allocator is asked for max_extra rollouts
    close(out.baseline[1], 0.9)
    assert out.accepted[1].item()
    assert out.extra_rollouts[1].item() == 4
    close(out.metrics["excluded_frac"], 4 / 6)
    close(out.metrics["prior_accepted_frac"], float(ref.accepted[0]))
    assert all(torch.isfinite(m) for m in out.metrics.values())


def test_experimental_flag_is_required() -> None:
    for call in (lambda: v05(R8, G8, P8), lambda: dare_rewards(ids([1, 1]), ids([0, 0]))):
        with pytest.raises(InputError) as err:
            call()
        assert err.value.argument == "experimental"
        assert "reconstructed" in str(err.value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v05(R8, G8, P8, experimental=True)
        dare_rewards(ids([1, 1]), ids([0, 0]), experimental=True)


def test_v05_groups_object_and_dtypes() -> None:
    gen = torch.Generator().manual_seed(0)
    r = (torch.rand(30, generator=gen) > 0.5).float()
    g = torch.randint(-4, 5, (30,), generator=gen)
    p = Groups(g).broadcast(torch.rand(Groups(g).num_groups, generator=gen))
    a = V(r, Groups(g), p)
    b = V(r, g, p)
    assert torch.equal(a.advantages, b.advantages)
    assert torch.equal(a.extra_rollouts, b.extra_rollouts)
    assert V(r.bfloat16(), g, p).advantages.dtype == torch.float32
    assert V(r.double(), g, p).advantages.dtype == D
    with rolloutopt.checks(False):
        close(V(r, g, p).advantages, b.advantages)


# ------------------------------------------------------------------------------------------- DARE oracles


def test_dare_spec_oracle() -> None:
    a, g = ids([11, 11, 11, 42]), ids([0, 0, 0, 0])
    out = R(a, g, prune=0.0)
    close(out.rewards, [0.75, 0.75, 0.75, 0.25])
    close(out.answer_prob, [0.75, 0.75, 0.75, 0.25])
    assert out.majority.tolist() == [True, True, True, False]
    pruned = R(a, g, prune=0.3)
    close(pruned.rewards, [0.75, 0.75, 0.75, 0.0])
    assert pruned.pruned.tolist() == [False, False, False, True]
    close(pruned.metrics["pruned_frac"], 0.25)
    close(R(a, g, prune=0.3, renormalize=True).rewards, [1.0, 1.0, 1.0, 0.0])  # hard majority vote
    close(R(a, g).rewards, [0.75, 0.75, 0.75, 0.25])  # default prune 0.1 keeps B


def test_dare_hand_oracle_with_bonus_confidence_and_null() -> None:
    # group 0: answers A A B C, uncertainty .1 .9 .2 .8 -> shares .5 .5 .25 .25; median uncertainty .5:
    # B (non-majority, u = .2) earns the bonus, C (u = .8) does not. group 1: X Y with confidences 3 and 1.
    a = ids([1, 1, 2, 3, 7, 8])
    g = ids([0, 0, 0, 0, 9, 9])
    u = t([0.1, 0.9, 0.2, 0.8, 0.5, 0.5])
    c = t([1.0, 1.0, 1.0, 1.0, 3.0, 1.0])
    out = R(a, g, uncertainty=u, confidence=c, bonus=0.2)
    close(out.answer_prob, [0.5, 0.5, 0.25, 0.25, 0.75, 0.25])
    close(out.bonus, [0.0, 0.0, 0.2, 0.0, 0.0, 0.2])
    close(out.rewards, [0.5, 0.5, 0.45, 0.25, 0.75, 0.45])
    close(out.metrics["bonus_frac"], 2 / 6)
    close(out.metrics["majority_frac"], 3 / 6)
    close(out.metrics["consensus_mean"], (0.5 + 0.75) / 2)
    # pruning at .3 zeroes B and C; a pruned answer gets no bonus unless bonus_pruned
    p = R(a, g, uncertainty=u, confidence=c, bonus=0.2, prune=0.3)
    close(p.rewards, [0.5, 0.5, 0.0, 0.0, 0.75, 0.0])
    bp = R(a, g, uncertainty=u, confidence=c, bonus=0.2, prune=0.3, bonus_pruned=True)
    close(bp.rewards, [0.5, 0.5, 0.2, 0.0, 0.75, 0.2])
    # a null answer counts in the denominator, earns 0 and is never the majority
    n = R(ids([-1, -1, -1, 5]), ids([0] * 4), null_answer=-1, prune=0.0)
    close(n.rewards, [0.0, 0.0, 0.0, 0.25])
    assert n.majority.tolist() == [False, False, False, True]
    close(n.metrics["null_answer_frac"], 0.75)


def test_dare_singletons_ties_valid_and_zero_confidence() -> None:
    out = R(ids([3, 4, 4, 5, 5]), ids([0, 1, 1, 1, 1]), uncertainty=t([0.0, 0.0, 0.0, 0.0, 1.0]), prune=0.0)
    close(out.rewards, [1.0, 0.5, 0.5, 0.5, 0.5])  # ties: both answers are majority, no bonus
    assert out.majority.all()
    valid = torch.tensor([True, True, False, True, False])
    v = R(ids([3, 4, 4, 5, 5]), ids([0, 1, 1, 1, 1]), valid=valid)
    close(v.rewards, [1.0, 0.5, 0.0, 0.5, 0.0])
    assert torch.equal(v.weight, valid.float())
    close(v.metrics["excluded_frac"], 0.4)
    z = R(ids([1, 2]), ids([0, 0]), confidence=t([0.0, 0.0]))
    assert torch.equal(z.rewards, torch.zeros(2))
    assert all(torch.isfinite(m) for m in z.metrics.values())
    allbad = R(ids([1, 2]), ids([0, 0]), valid=torch.zeros(2, dtype=torch.bool))
    assert torch.equal(allbad.rewards, torch.zeros(2))
    assert all(torch.isfinite(m) for m in allbad.metrics.values())


def test_dare_dtypes_groups_object_and_checks_off() -> None:
    a, g = ids([1, 1, 2, 2, 2, 9]), ids([4, 4, 4, 4, 4, -1])
    base = R(a, g, prune=0.0)
    assert base.rewards.dtype == torch.float32
    close(base.rewards, [0.4, 0.4, 0.6, 0.6, 0.6, 1.0])
    assert torch.equal(R(a, Groups(g), prune=0.0).rewards, base.rewards)
    assert R(a, g, confidence=torch.ones(6, dtype=D)).rewards.dtype == D
    assert R(a, g, uncertainty=torch.ones(6, dtype=torch.bfloat16)).rewards.dtype == torch.float32
    with rolloutopt.checks(False):
        assert torch.equal(R(a, g, prune=0.0).rewards, base.rewards)


def test_v05_statistic_without_variance() -> None:
    # all-correct singleton with fallback="none": v = 0, the mean differs from the prior -> z^2 = inf, w = 1
    out = V(t([1.0, 0.5]), ids([0, 1]), t([0.2, 0.5]), fallback="none")
    assert out.statistic[0].item() == math.inf
    assert out.statistic[1].item() == 0.0  # a singleton at 0.5 = prior: v = .25, gap 0
    close(out.fusion_weight, [1.0, 0.0])
    close(out.advantages, [0.0, 0.0])
    assert out.extra_rollouts.tolist() == [0, 0]  # predicted MSE is 0 in both


def test_registry() -> None:
    assert get("v05").fn is v05
    assert rolloutopt.advantages.SHAPERS.get("dare_rewards").fn is dare_rewards


# ---------------------------------------------------------------------------------------------- bad input


def _raises(argument: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(InputError) as err:
        fn()
    assert err.value.argument == argument, str(err.value)
    assert "Fix:" in str(err.value)


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("rewards", lambda: V(R8[:, None], G8, P8)),
        ("rewards", lambda: V(ids([1, 0, 0, 1, 1, 0, 0, 1]), G8, P8)),
        ("rewards", lambda: V(t([1.0, math.nan, 0, 1, 1, 0, 0, 1]), G8, P8)),
        ("rewards", lambda: V(t([2.0, 0, 0, 1, 1, 0, 0, 1]), G8, P8)),  # outside [0, 1] for bernoulli
        ("group", lambda: V(R8, ids([0, 0, 1]), P8)),
        ("group", lambda: V(R8, G8.float(), P8)),
        ("prior", lambda: V(R8, G8, P8[:3])),
        ("prior", lambda: V(R8, G8, t([0.5, 0.4, 0.5, 0.5, 0.6, 0.6, 0.6, 0.6]))),  # differs inside a group
        ("prior", lambda: V(R8, G8, t([math.inf] * 8))),
        ("variance", lambda: V(R8, G8, P8, variance="std")),
        ("fallback", lambda: V(R8, G8, P8, fallback="floor")),
        ("scale", lambda: V(R8, G8, P8, scale="group")),
        ("threshold", lambda: V(R8, G8, P8, threshold=-1.0)),
        ("var_floor", lambda: V(R8, G8, P8, var_floor=math.nan)),
        ("cost", lambda: V(R8, G8, P8, cost=-1e-3)),
        ("eps", lambda: V(R8, G8, P8, eps=-1.0)),
        ("max_extra", lambda: V(R8, G8, P8, max_extra=2.5)),
        ("max_extra", lambda: V(R8, G8, P8, max_extra=-1)),
        ("prior_range", lambda: V(R8, G8, P8, prior_range=(1.0, 0.0))),
        ("valid", lambda: V(R8, G8, P8, valid=torch.ones(3, dtype=torch.bool))),
        ("experimental", lambda: v05(R8, G8, P8, experimental="yes")),
        ("experimental", lambda: dare_rewards(ids([1, 2]), ids([0, 0]), experimental=1)),
        ("answers", lambda: R(t([1.0, 2.0]), ids([0, 0]))),
        ("answers", lambda: R(ids([[1, 2]]), ids([0, 0]))),
        ("group", lambda: R(ids([1, 2]), ids([0, 0, 0]))),
        ("confidence", lambda: R(ids([1, 2]), ids([0, 0]), confidence=t([1.0, -1.0]))),
        ("confidence", lambda: R(ids([1, 2]), ids([0, 0]), confidence=t([1.0, math.nan]))),
        ("confidence", lambda: R(ids([1, 2]), ids([0, 0]), confidence=t([1.0]))),
        ("uncertainty", lambda: R(ids([1, 2]), ids([0, 0]), uncertainty=t([1.0, math.inf]))),
        ("prune", lambda: R(ids([1, 2]), ids([0, 0]), prune=1.5)),
        ("bonus", lambda: R(ids([1, 2]), ids([0, 0]), bonus=-0.1)),
        ("bonus_quantile", lambda: R(ids([1, 2]), ids([0, 0]), bonus_quantile=2)),
        ("renormalize", lambda: R(ids([1, 2]), ids([0, 0]), renormalize=1)),
        ("null_answer", lambda: R(ids([1, 2]), ids([0, 0]), null_answer=1.0)),
        ("valid", lambda: R(ids([1, 2]), ids([0, 0]), valid=torch.tensor([0, 2]))),
    ],
)
def test_bad_input_names_the_argument(argument: str, call: Callable[[], Any]) -> None:
    _raises(argument, call)


# ------------------------------------------------------------------------------------------------ properties


@st.composite
def batches(draw: st.DrawFn, *, equal: bool = False) -> dict[str, Any]:
    group = draw(group_ids(equal=equal, max_size=6, min_equal=1))
    b = len(group)
    binary = draw(st.booleans())
    values = st.sampled_from([0.0, 1.0]) if binary else st.floats(0, 1, width=32)
    rewards = draw(st.lists(values, min_size=b, max_size=b))
    prior = {lab: draw(st.floats(-0.5, 1.5, width=32)) for lab in dict.fromkeys(group)}
    answers = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
    unc = draw(st.lists(st.floats(0, 5, width=32), min_size=b, max_size=b))
    conf = draw(st.one_of(st.none(), st.lists(st.floats(0, 4, width=32), min_size=b, max_size=b)))
    valid = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=b, max_size=b)))
    perm = draw(st.permutations(list(range(b))))
    pick = [group[i] for i in perm]
    return {
        "rewards": rewards,
        "group": pick,
        "prior": prior,
        "answers": answers,
        "unc": unc,
        "conf": conf,
        "valid": valid,
        "binary": binary,
    }


V05_KW: list[dict[str, Any]] = [
    {},
    {"fallback": "none"},
    {"variance": "sample", "threshold": 3.84, "var_floor": 0.01},
    {"variance": "population", "cost": 1e-5, "max_extra": 6},
]


def _v05(batch: dict[str, Any], dtype: torch.dtype = D, **kw: Any) -> V05Output:
    p = torch.tensor([batch["prior"][lab] for lab in batch["group"]], dtype=dtype)
    v = None if batch["valid"] is None else torch.tensor(batch["valid"])
    return V(torch.tensor(batch["rewards"], dtype=dtype), torch.tensor(batch["group"]), p, valid=v, **kw)


def _dare(batch: dict[str, Any], dtype: torch.dtype = D, **kw: Any) -> DAREOutput:
    c = None if batch["conf"] is None else torch.tensor(batch["conf"], dtype=dtype)
    v = None if batch["valid"] is None else torch.tensor(batch["valid"])
    u = torch.tensor(batch["unc"], dtype=dtype)
    return R(torch.tensor(batch["answers"]), torch.tensor(batch["group"]), confidence=c, uncertainty=u, valid=v, **kw)


DARE_KW: list[dict[str, Any]] = [{}, {"prune": 0.0, "bonus": 0.3, "bonus_quantile": 0.25}, {"prune": 0.4}]


@given(batch=batches())
def test_matches_naive_loops(batch: dict[str, Any]) -> None:
    for kw in V05_KW:
        adv, per = naive_v05(batch["rewards"], batch["group"], batch["prior"], valid=batch["valid"], **kw)
        out = _v05(batch, **kw)
        labels = sorted(per)
        torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=D), atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(out.baseline, torch.tensor([per[lab][0] for lab in labels], dtype=D))
        torch.testing.assert_close(out.fusion_weight, torch.tensor([per[lab][1] for lab in labels], dtype=D))
        assert out.accepted.tolist() == [per[lab][2] for lab in labels]
        assert out.extra_rollouts.tolist() == [per[lab][3] for lab in labels], kw
        assert ((out.fusion_weight >= 0) & (out.fusion_weight <= 1)).all()
        if batch["binary"]:  # continuous near-zero variances round to 0 in fp32 and switch on the fallback
            out32 = _v05(batch, torch.float32, **kw)
            torch.testing.assert_close(out32.advantages, torch.tensor(adv, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    for kw in DARE_KW:
        expected = naive_dare(
            batch["answers"], batch["group"], confidence=batch["conf"], uncertainty=batch["unc"],
            valid=batch["valid"], **kw,
        )  # fmt: skip
        torch.testing.assert_close(_dare(batch, **kw).rewards, torch.tensor(expected, dtype=D), atol=1e-9, rtol=1e-9)


@given(batch=batches(), data=st.data())
def test_permutation_and_relabelling(batch: dict[str, Any], data: st.DataObject) -> None:
    b = len(batch["rewards"])
    perm = data.draw(st.permutations(list(range(b))))
    labels = sorted(set(batch["group"]))
    relabel = relabel_map(data, labels)
    answer_map = data.draw(st.lists(st.integers(-(2**62), 2**62), min_size=4, max_size=4, unique=True))

    def p(xs: list[Any] | None) -> list[Any] | None:
        return None if xs is None else [xs[i] for i in perm]

    moved = {
        "rewards": p(batch["rewards"]),
        "group": [relabel[batch["group"][i]] for i in perm],
        "prior": {relabel[k]: x for k, x in batch["prior"].items()},
        "answers": [answer_map[batch["answers"][i]] for i in perm],
        "unc": p(batch["unc"]),
        "conf": p(batch["conf"]),
        "valid": p(batch["valid"]),
        "binary": batch["binary"],
    }
    idx = torch.tensor(perm)
    # per-group outputs follow the sorted new labels
    gorder = torch.tensor([labels.index(lab) for lab in sorted(labels, key=lambda x: relabel[x])])
    for kw in V05_KW[::2]:
        base, other = _v05(batch, **kw), _v05(moved, **kw)
        torch.testing.assert_close(other.advantages, base.advantages[idx], atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(other.baseline, base.baseline[gorder], atol=1e-9, rtol=1e-9)
        assert torch.equal(other.extra_rollouts, base.extra_rollouts[gorder])
    for kw in DARE_KW[:2]:
        torch.testing.assert_close(_dare(moved, **kw).rewards, _dare(batch, **kw).rewards[idx], atol=1e-9, rtol=1e-9)


@given(batch=batches(equal=True))
def test_dense_fast_path_equals_ragged_path(batch: dict[str, Any]) -> None:
    batch = {**batch, "valid": None}
    everything = {**batch, "valid": [True] * len(batch["rewards"])}  # a valid mask forces the ragged path
    assert Groups(torch.tensor(batch["group"])).dense_size is not None
    for kw in V05_KW[::2]:
        a, b = _v05(batch, **kw), _v05(everything, **kw)
        torch.testing.assert_close(a.advantages, b.advantages, atol=1e-9, rtol=1e-9)
        assert torch.equal(a.extra_rollouts, b.extra_rollouts)
    for kw in DARE_KW[:2]:
        torch.testing.assert_close(_dare(batch, **kw).rewards, _dare(everything, **kw).rewards, atol=1e-9, rtol=1e-9)


@given(batch=batches(), scale=st.floats(0.1, 10), shift=st.floats(-3, 3))
def test_invariances(batch: dict[str, Any], scale: float, shift: float) -> None:
    # V05 with a sample variance is shift- and scale-equivariant: A(a r + c, a b0 + c) = a A(r, b0)
    kw: dict[str, Any] = {"variance": "sample", "prior_range": None, "fallback": "none"}
    base = _v05(batch, **kw)
    moved = {
        **batch,
        "rewards": [scale * x + shift for x in batch["rewards"]],
        "prior": {k: scale * x + shift for k, x in batch["prior"].items()},
    }
    out = _v05(moved, **kw)
    torch.testing.assert_close(out.advantages, scale * base.advantages, atol=1e-7, rtol=1e-6)
    # DARE: scaling all confidences and the uncertainties by a power of two (exact) leaves the rewards unchanged
    k = 2.0 ** round(math.log2(scale))
    conf = batch["conf"] or [1.0] * len(batch["answers"])
    moved_d = {**batch, "conf": [k * x for x in conf], "unc": [k * x for x in batch["unc"]]}
    for kw_d in DARE_KW:
        torch.testing.assert_close(_dare(moved_d, **kw_d).rewards, _dare({**batch, "conf": conf}, **kw_d).rewards)


@given(
    rewards=st.lists(st.floats(-(2.0**60), 2.0**60, width=32), min_size=1, max_size=16),
    bern=st.lists(st.sampled_from([0.0, 1.0]), min_size=16, max_size=16),
    group=st.lists(st.integers(0, 3), min_size=16, max_size=16),
    prior=st.lists(st.floats(-(2.0**60), 2.0**60, width=32), min_size=4, max_size=4),
    conf=st.lists(st.floats(0, 2.0**60, width=32), min_size=16, max_size=16),
    valid=st.lists(st.booleans(), min_size=16, max_size=16),
)
def test_finite_for_every_finite_input(
    rewards: list[float], bern: list[float], group: list[int], prior: list[float], conf: list[float], valid: list[bool]
) -> None:
    b = len(rewards)
    g = torch.tensor(group[:b])
    p = torch.tensor(prior)[g]
    v = torch.tensor(valid[:b])
    outs = []
    for vv in (None, v):
        outs.append(V(torch.tensor(rewards), g, p, variance="sample", prior_range=None, scale="std", valid=vv))
        outs.append(V(torch.tensor(bern[:b]), g, p, scale="std", valid=vv))
    for out in outs:
        assert torch.isfinite(out.advantages).all()
        assert torch.isfinite(out.baseline).all()
        assert all(torch.isfinite(m) for m in out.metrics.values())
    d = R(
        torch.tensor(group[::-1][:b]), g, confidence=torch.tensor(conf[:b]), uncertainty=torch.tensor(rewards), valid=v
    )
    assert torch.isfinite(d.rewards).all()
    assert all(torch.isfinite(m) for m in d.metrics.values())


@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    g = ids([0, 0, 0, 4, 4, 9, 2, 2, 2, 2])
    valid = torch.tensor([True, True, True, True, True, True, True, False, True, True])
    r = torch.rand(10, dtype=D, generator=gen).requires_grad_(True)
    prior = torch.tensor([0.9, 0.1, 0.2, 0.5], dtype=D)  # per group in id order 0, 2, 4, 9

    def fn(rr: torch.Tensor, pg: torch.Tensor, **kw: Any) -> torch.Tensor:
        return V(rr, g, Groups(g).broadcast(pg), **kw).advantages

    pg = prior.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda rr, pp: fn(rr, pp, valid=valid), (r, pg))
    for kw in ({"variance": "sample"}, {"scale": "std"}, {"threshold": 0.0}):
        assert torch.autograd.gradcheck(lambda rr, pp, kw=kw: fn(rr, pp, **kw), (r, pg))
    conf = (torch.rand(10, dtype=D, generator=gen) + 0.1).requires_grad_(True)
    answers = ids([1, 1, 2, 3, 3, 1, 5, 5, 6, 5])
    assert torch.autograd.gradcheck(lambda c: R(answers, g, confidence=c, prune=0.0).rewards, (conf,))


def test_dare_cells_for_any_answer_range() -> None:
    # small ranges use a direct (group, answer) table, wide ones a sort, int64-overflowing ones a compaction
    g = torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.long)
    base = torch.tensor([5, 5, 7, 5, 9, 5], dtype=torch.long)
    expected = dare_rewards(base, g, experimental=True, prune=0.0).rewards
    for answers in (base * 10**6, base * 2**59 - 2**62, torch.where(base == 5, -(2**63), 2**63 - 1)):
        torch.testing.assert_close(dare_rewards(answers, g, experimental=True, prune=0.0).rewards, expected)
