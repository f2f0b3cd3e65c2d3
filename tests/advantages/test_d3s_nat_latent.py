"""Selection estimators: D³S (arXiv 2509.22115), NAT token subsampling, Latent-GRPO invalid-sample masking.

Hand-computed oracles, a brute-force check of the max-variance subset, Monte Carlo unbiasedness of the NAT
Horvitz–Thompson weights with an explicit generator, parity of ``latent_mask`` with verl's GRPO on the valid rows
and with a transcription of the Latent-GRPO reference loop, hypothesis properties and bad-input tests.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.advantages._base import REGISTRY, SELECTORS, AdvantageOutput
from rolloutopt.advantages.d3s import D3SOutput, d3s, d3s_schedule
from rolloutopt.advantages.latent import latent_mask
from rolloutopt.advantages.nat import nat_weights
from rolloutopt.advantages.reference import grpo
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

from .helpers import SINGLETON_WARNING, D, close, ids, t


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pop_var(xs: list[float]) -> float:
    mu = sum(xs) / len(xs)
    return sum((x - mu) ** 2 for x in xs) / len(xs)


# ============================================================================================== D³S

A4 = t([1.5, 0.5, -0.5, -1.5])
G1 = ids([0, 0, 0, 0])
ONES = torch.ones(4, 3, dtype=torch.bool)
H4 = t([[0.1, 0.2, 0.3]] * 4)


@pytest.mark.parametrize("split", ["balanced", "optimal"])
@pytest.mark.parametrize("sample_level", ["group", "batch"])
def test_d3s_spec_oracle(split: str, sample_level: str) -> None:
    # D³S's selection rule (arXiv 2509.22115, as summarised) by hand: N_s = 2 of [1.5, .5, -.5, -1.5] -> {1.5, -1.5},
    # variance 2.25, the maximum over all pairs
    out = d3s(A4, G1, H4, ONES, sample_frac=(0.5, 0.5), split=split, sample_level=sample_level)  # type: ignore[arg-type]
    assert isinstance(out, D3SOutput) and isinstance(out, AdvantageOutput)
    assert torch.equal(out.weight, t([1.0, 0.0, 0.0, 1.0]))
    assert max(pop_var(list(p)) for p in itertools.combinations(A4.tolist(), 2)) == 2.25
    close(out.metrics["selected_adv_var"], 2.25)
    close(out.metrics["excluded_frac"], 0.5)
    assert torch.equal(out.advantages, A4)  # not re-normalised


def test_d3s_hand_example_ragged_tokens() -> None:
    # group 7: A = [1, -1, .5] (budget round(1.5) = 2: one positive, one negative -> rows 0 and 1)
    # group 3: A = [2, -2]     (budget 1: one positive -> row 3)
    a = t([1.0, -1.0, 0.5, 2.0, -2.0])
    g = ids([7, 7, 7, 3, 3])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    h = t([[0.5, 2.0, 1.0], [3.0, 0.1, 9.0], [5.0, 5.0, 5.0], [0.2, 7.0, 7.0], [1.0, 1.0, 1.0]])
    out = d3s(a, g, h, mask, sample_frac=(0.5, 1.0), token_frac=(0.5, 1.0), progress=0.0)
    assert torch.equal(out.weight, t([1.0, 1.0, 0.0, 1.0, 0.0]))
    # eligible tokens: row 0 keys [.5, 2, 1], row 1 keys [3, .1], row 3 keys [.4]; 6 tokens, keep 3: 3, 2, 1
    expected = torch.zeros(5, 3, dtype=torch.bool)
    expected[1, 0] = expected[0, 1] = expected[0, 2] = True
    assert torch.equal(out.token_mask, expected)
    close(out.metrics["sample_keep_frac"], 0.6)
    close(out.metrics["token_keep_frac"], 3 / 12)
    close(out.metrics["selected_adv_var"], (1.0 + 0.0) / 2)  # var{1, -1} = 1, var{2} = 0
    per_seq = d3s(a, g, h, mask, sample_frac=(0.5, 1.0), token_frac=(0.5, 1.0), token_level="sequence")
    expected = torch.zeros(5, 3, dtype=torch.bool)
    expected[0, 1] = expected[0, 2] = True  # round(1.5) = 2 of row 0
    expected[1, 0] = True  # 1 of row 1
    expected[3, 0] = True  # at least one token of a kept rollout
    assert torch.equal(per_seq.token_mask, expected)


def test_d3s_schedule_and_progress() -> None:
    assert d3s_schedule(0.0) == (0.5, 0.2)
    s, k = d3s_schedule(0.5, sample_frac=(0.25, 0.75), token_frac=(0.2, 1.0))
    assert math.isclose(s, 0.5) and math.isclose(k, 0.6)
    assert d3s_schedule(1.0) == (1.0, 1.0)
    r = torch.randn(16, generator=gen(0))
    a = grpo(r, torch.arange(16) // 8).advantages
    g = torch.arange(16) // 8
    h = torch.rand(16, 5, generator=gen(1))
    m = torch.ones(16, 5, dtype=torch.bool)
    by_step = d3s(a, g, h, m, step=30, total_steps=60)
    by_progress = d3s(a, g, h, m, progress=0.5)
    assert torch.equal(by_step.token_mask, by_progress.token_mask)
    close(by_progress.metrics["sample_frac"], 0.75)
    close(by_progress.metrics["token_frac"], 0.6)
    assert torch.equal(d3s(a, g, h, m, step=90, total_steps=60).weight, d3s(a, g, h, m, progress=1.0).weight)
    # relaxation is monotone: later progress keeps at least as many rollouts and tokens
    counts = [d3s(a, g, h, m, progress=p) for p in (0.0, 0.3, 0.7, 1.0)]
    assert [int(o.weight.sum()) for o in counts] == sorted(int(o.weight.sum()) for o in counts)
    assert [int(o.token_mask.sum()) for o in counts] == sorted(int(o.token_mask.sum()) for o in counts)


def test_d3s_edge_cases() -> None:
    a = t([0.0, 0.0, 0.0, 1.0, -1.0, 0.0])  # group 0 all-equal, group 1 has a zero row, group 2 singleton (0)
    g = ids([0, 0, 0, 1, 1, 2])
    m = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1], [0, 0], [1, 0]], dtype=torch.bool)  # row 4 all-masked
    h = torch.ones(6, 2)
    out = d3s(a, g, h, m, sample_frac=(1.0, 1.0), token_frac=(1.0, 1.0))
    assert torch.equal(out.weight, t([0.0, 0.0, 0.0, 1.0, 1.0, 0.0]))  # zero-advantage rows are never kept
    assert torch.equal(out.token_mask, m & out.weight.bool()[:, None])
    assert not out.token_mask[4].any()
    # with full budgets every non-zero rollout and all of its tokens are kept (plain GRPO)
    r = torch.randn(12, generator=gen(3))
    g2 = torch.arange(12) % 3
    adv = grpo(r, g2).advantages
    m2 = torch.rand(12, 4, generator=gen(4)) > 0.3
    full = d3s(adv, g2, torch.rand(12, 4, generator=gen(5)), m2, progress=1.0)
    assert torch.equal(full.weight, (adv != 0).float())
    assert torch.equal(full.token_mask, m2 & (adv != 0)[:, None])
    # all rows invalid: nothing kept, finite metrics
    none = d3s(adv, g2, torch.ones(12, 4), m2, valid=torch.zeros(12, dtype=torch.bool))
    assert not none.weight.any() and not none.token_mask.any()
    assert all(torch.isfinite(x) and x.ndim == 0 and not x.requires_grad for x in none.metrics.values())


def test_d3s_one_sided_group_tops_up_and_batch_level() -> None:
    # only one positive: the balanced split (2 + 2) tops up with negatives -> 1 positive + 3 negatives
    a = t([3.0, -1.0, -1.5, -0.5, -0.25, 0.0, 0.0, 0.0])
    g = ids([0, 0, 0, 0, 0, 1, 1, 1])
    h = torch.ones(8, 1)
    m = torch.ones(8, 1, dtype=torch.bool)
    out = d3s(a, g, h, m, sample_frac=(0.8, 0.8))  # budgets round(4) = 4 and round(2.4) = 2
    assert torch.equal(out.weight, t([1, 1, 1, 1, 0, 0, 0, 0]))
    # the cross-group variant spends the same total budget (6) over the batch; the zero group drops out
    batch = d3s(a, g, h, m, sample_frac=(0.8, 0.8), sample_level="batch")
    assert torch.equal(batch.weight, t([1, 1, 1, 1, 1, 0, 0, 0]))
    # advantages normalised within groups are not re-normalised across groups: a larger |A| wins
    a2 = t([2.0, -2.0, 0.1, -0.1])
    two = d3s(a2, ids([0, 0, 1, 1]), torch.ones(4, 1), torch.ones(4, 1, dtype=torch.bool), sample_level="batch")
    assert torch.equal(two.weight, t([1, 1, 0, 0]))


def test_d3s_per_token_advantages_and_scaling() -> None:
    a = torch.randn(6, 4, generator=gen(7))
    g = ids([0, 0, 0, 1, 1, 1])
    h = torch.rand(6, 4, generator=gen(8))
    m = torch.rand(6, 4, generator=gen(9)) > 0.2
    out = d3s(a, g, h, m)
    seq = (a * m).sum(1) / m.sum(1).clamp(min=1)
    ref = d3s(seq, g, h * 0 + 1, m)
    assert torch.equal(out.weight, ref.weight)  # rollouts ranked by their masked mean advantage
    for c in (0.01, 3.0, 1e4):
        scaled = d3s(a * c, g, h, m)
        assert torch.equal(scaled.weight, out.weight) and torch.equal(scaled.token_mask, out.token_mask)
    assert out.token_mask.dtype == torch.bool and not (out.token_mask & ~m).any()


def test_d3s_dtypes_groups_object_and_registry() -> None:
    a = grpo(t([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), ids([0, 0, 0, 1, 1, 1])).advantages
    g = ids([0, 0, 0, 1, 1, 1])
    h = torch.rand(6, 3, generator=gen(1))
    m = torch.ones(6, 3, dtype=torch.bool)
    base = d3s(a, g, h, m)
    assert torch.equal(d3s(a.bfloat16(), Groups(g), h.half(), m.int()).weight, base.weight)
    assert base.weight.dtype == torch.float32
    assert d3s(a.double(), g, h.double(), m).weight.dtype == torch.float64
    assert SELECTORS.get("d3s").fn is d3s
    assert SELECTORS.get("nat_weights").fn is nat_weights
    assert REGISTRY.get("latent_mask").fn is latent_mask
    with rolloutopt.checks(False):
        assert torch.equal(d3s(a, g, h, m).token_mask, base.token_mask)


# ---------------------------------------------------------------------------------------- D³S properties


@st.composite
def selection_batches(draw: st.DrawFn) -> dict[str, Any]:
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    labels = draw(st.lists(st.integers(-(2**40), 2**40), min_size=len(sizes), max_size=len(sizes), unique=True))
    group = [lab for lab, k in zip(labels, sizes, strict=True) for _ in range(k)]
    b = len(group)
    # distinct non-zero values (or exact zeros) so that the selection is unique up to ties of zero rows
    base = draw(st.lists(st.integers(-1000, 1000), min_size=b, max_size=b, unique=True))
    adv = [x / 100 for x in base]
    t_len = draw(st.integers(1, 5))
    mask = draw(st.lists(st.lists(st.booleans(), min_size=t_len, max_size=t_len), min_size=b, max_size=b))
    ent = draw(st.lists(st.integers(0, 10**6), min_size=b * t_len, max_size=b * t_len, unique=True))
    frac = draw(st.sampled_from([0.2, 0.5, 0.75, 1.0]))
    tok = draw(st.sampled_from([0.1, 0.5, 1.0]))
    return {"adv": adv, "group": group, "mask": mask, "ent": ent, "t": t_len, "frac": frac, "tok": tok}


def _d3s(batch: dict[str, Any], perm: list[int] | None = None, relabel: int = 0, **kw: Any) -> D3SOutput:
    b = len(batch["adv"])
    idx = perm if perm is not None else list(range(b))
    a = torch.tensor([batch["adv"][i] for i in idx], dtype=D)
    g = torch.tensor([batch["group"][i] * 3 + relabel for i in idx], dtype=torch.long)
    m = torch.tensor([batch["mask"][i] for i in idx], dtype=torch.bool)
    h = torch.tensor(batch["ent"], dtype=D).reshape(b, batch["t"])[idx] / 1e6
    return d3s(a, g, h, m, sample_frac=(batch["frac"], 1.0), token_frac=(batch["tok"], 1.0), **kw)


KWS = [
    {},
    {"split": "optimal"},
    {"sample_level": "batch"},
    {"token_level": "sequence"},
    {"sample_level": "batch", "split": "optimal"},
]


@given(selection_batches(), st.data())
def test_d3s_permutation_and_relabelling(batch: dict[str, Any], data: st.DataObject) -> None:
    b = len(batch["adv"])
    perm = data.draw(st.permutations(list(range(b))))
    relabel = data.draw(st.integers(-50, 50))
    for kw in KWS:
        base = _d3s(batch, **kw)
        moved = _d3s(batch, perm, relabel, **kw)
        assert torch.equal(moved.weight, base.weight[perm])
        assert torch.equal(moved.token_mask, base.token_mask[perm])
        for name, value in base.metrics.items():
            close(moved.metrics[name], value, atol=1e-9)


@given(selection_batches())
def test_d3s_optimal_is_the_max_variance_subset(batch: dict[str, Any]) -> None:
    out = _d3s(batch, split="optimal")
    bal = _d3s(batch)
    adv, group = batch["adv"], batch["group"]
    for lab in set(group):
        rows = [i for i, x in enumerate(group) if x == lab]
        nonzero = [adv[i] for i in rows if adv[i] != 0]
        budget = max(1, math.floor(batch["frac"] * len(rows) + 0.5))
        k = min(budget, len(nonzero))
        kept = [adv[i] for i in rows if out.weight[i] == 1]
        assert len(kept) == k == sum(int(bal.weight[i]) for i in rows)
        if k:
            best = max(pop_var(list(c)) for c in itertools.combinations(nonzero, k))
            assert math.isclose(pop_var(kept), best, rel_tol=1e-9, abs_tol=1e-12)
            assert pop_var([adv[i] for i in rows if bal.weight[i] == 1]) <= best + 1e-12


@given(selection_batches())
def test_d3s_ragged_equals_dense_and_is_finite(batch: dict[str, Any]) -> None:
    # the group-level selection of a group does not depend on the other groups: appending a ragged group (which
    # turns off the dense fast path) leaves the original rows' selection unchanged
    out = _d3s(batch, token_level="sequence")
    extra = dict(batch)
    b = len(batch["adv"])
    extra["adv"] = batch["adv"] + [50.0, -50.0, 25.0]
    extra["group"] = batch["group"] + [2**41] * 3
    extra["mask"] = batch["mask"] + [[True] * batch["t"]] * 3
    extra["ent"] = batch["ent"] + [2 * 10**6 + i for i in range(3 * batch["t"])]
    bigger = _d3s(extra, token_level="sequence")
    assert torch.equal(bigger.weight[:b], out.weight)
    assert torch.equal(bigger.token_mask[:b], out.token_mask)
    assert all(bool(torch.isfinite(v)) for v in out.metrics.values())
    assert not (out.token_mask & ~out.weight.bool()[:, None]).any()


# ============================================================================================== NAT


def _tiny_policy(b: int, t_len: int, seed: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """A linear softmax policy over 3 actions; returns the parameters and a per-token surrogate ℓ_{i,t}(θ)."""
    g = gen(seed)
    feats = torch.randn(b, t_len, 4, generator=g, dtype=D)
    actions = torch.randint(0, 3, (b, t_len), generator=g)
    adv = torch.randn(b, 1, generator=g, dtype=D).expand(b, t_len)
    theta = torch.randn(4, 3, generator=g, dtype=D)

    def per_token(th: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(feats @ th, -1).gather(-1, actions[..., None]).squeeze(-1)
        return adv * logp  # [B, T]

    return theta, per_token


MASK_NAT = torch.tensor(
    [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]],
    dtype=torch.bool,
)


@pytest.mark.parametrize(
    ("scheme", "kw"),
    [("uniform", {"keep_prob": 0.5}), ("uniform", {"keep_prob": 0.2}), ("prefix", {}), ("prefix", {"min_frac": 0.4})],
)
def test_nat_expected_gradient_equals_full_gradient(scheme: str, kw: dict[str, float]) -> None:
    """Monte Carlo over R independent draws (one explicit generator): the mean subsampled gradient matches the
    full-token gradient within 4 standard errors per coordinate (SE = sample std / sqrt(R)). For a correct
    estimator a 4-sigma miss has probability ~6e-5 per coordinate (12 coordinates); a biased one — e.g. dropping
    the 1/π weights, which shrinks the gradient by the keep fraction — misses by dozens of SEs (checked below)."""
    b, t_len = MASK_NAT.shape
    theta, per_token = _tiny_policy(b, t_len, seed=11)
    jac = torch.autograd.functional.jacobian(per_token, theta).reshape(b * t_len, -1)  # [B*T, P]
    full = (MASK_NAT.reshape(-1).to(D)[:, None] * jac).sum(0)
    reps = 4000
    draw = nat_weights(MASK_NAT.repeat(reps, 1), generator=gen(123), scheme=scheme, **kw)  # type: ignore[arg-type]
    w = draw.weight.to(D).reshape(reps, b * t_len)
    est = w @ jac  # [R, P]: each row the gradient of sum_t w_t ℓ_t
    se = est.std(0) / math.sqrt(reps)
    assert bool(((est.mean(0) - full).abs() <= 4 * se + 1e-12).all())
    unweighted = (w > 0).to(D) @ jac  # the mask without Horvitz–Thompson weights is biased
    assert bool(((unweighted.mean(0) - full).abs() > 4 * se).any())
    # the inclusion probabilities are right: empirical keep frequencies within 4 binomial SEs
    freq = (w > 0).to(D).mean(0)
    pi = draw.inclusion[:b].reshape(-1).to(D)
    assert bool(((freq - pi).abs() <= 4 * torch.sqrt(pi * (1 - pi) / reps) + 1e-12).all())
    # one draw through real autograd equals w @ J (the estimator is linear in the weights)
    th = theta.clone().requires_grad_(True)
    (per_token(th) * draw.weight[:b].to(D)).sum().backward()
    assert th.grad is not None
    close(th.grad.reshape(-1), est[0], atol=1e-10)


def test_nat_uniform_oracle_and_edges() -> None:
    out = nat_weights(MASK_NAT, generator=gen(0), keep_prob=0.25)
    assert not (out.mask & ~MASK_NAT).any()
    assert torch.equal(out.weight, out.mask.float() * 4.0)
    assert torch.equal(out.inclusion, MASK_NAT.float() * 0.25)
    assert not out.mask[3].any() and not out.weight[3].any()  # all-masked row
    same = nat_weights(MASK_NAT, generator=gen(0), keep_prob=0.25)
    assert torch.equal(same.mask, out.mask)  # reproducible with the same seed
    keep_all = nat_weights(MASK_NAT, generator=gen(1), keep_prob=1.0)
    assert torch.equal(keep_all.mask, MASK_NAT) and torch.equal(keep_all.weight, MASK_NAT.float())
    close(out.metrics["expected_keep_frac"], 0.25)
    assert all(v.ndim == 0 and not v.requires_grad and torch.isfinite(v) for v in out.metrics.values())


def test_nat_prefix_oracle() -> None:
    # a row of L = 4 tokens: pi_t = 1 - t/4 = [1, .75, .5, .25] for min_frac = 0, and with min_frac = .5:
    # t/L <= .5 -> 1, else (1 - t/L) / .5 = [1, 1, 1, .5]
    m = torch.ones(1, 4, dtype=torch.bool)
    close(nat_weights(m, generator=gen(0), scheme="prefix").inclusion, [[1.0, 0.75, 0.5, 0.25]])
    close(nat_weights(m, generator=gen(0), scheme="prefix", min_frac=0.5).inclusion, [[1.0, 1.0, 1.0, 0.5]])
    # positions count among masked-in tokens: a hole does not shift the probabilities
    holes = torch.tensor([[1, 0, 1, 1, 0, 1]], dtype=torch.bool)
    close(nat_weights(holes, generator=gen(0), scheme="prefix").inclusion, [[1.0, 0, 0.75, 0.5, 0, 0.25]])
    for seed in range(20):
        out = nat_weights(MASK_NAT, generator=gen(seed), scheme="prefix")
        pos = MASK_NAT.long().cumsum(1) - 1
        kept_len = out.mask.sum(1)
        # a contiguous prefix (in masked-in positions), at least one token of every non-empty row
        assert torch.equal(out.mask, MASK_NAT & (pos < kept_len[:, None]))
        assert bool((kept_len[MASK_NAT.any(1)] >= 1).all())
        assert torch.equal(out.weight, torch.where(out.mask, 1 / out.inclusion, torch.zeros(())))
    everything = nat_weights(MASK_NAT, generator=gen(0), scheme="prefix", min_frac=1.0)
    assert torch.equal(everything.mask, MASK_NAT) and torch.equal(everything.weight, MASK_NAT.float())


@given(
    st.integers(1, 5).flatmap(
        lambda t_len: st.lists(st.lists(st.booleans(), min_size=t_len, max_size=t_len), min_size=1, max_size=6)
    ),
    st.sampled_from([("uniform", 0.3, 0.0), ("uniform", 1.0, 0.0), ("prefix", 0.5, 0.0), ("prefix", 0.5, 0.7)]),
    st.integers(0, 2**31),
)
def test_nat_properties(rows: list[list[bool]], cfg: tuple[str, float, float], seed: int) -> None:
    scheme, keep_prob, min_frac = cfg
    m = torch.tensor(rows, dtype=torch.bool)
    out = nat_weights(m, generator=gen(seed), scheme=scheme, keep_prob=keep_prob, min_frac=min_frac)  # type: ignore[arg-type]
    assert not (out.mask & ~m).any()
    assert bool(torch.isfinite(out.weight).all()) and bool((out.weight[out.mask] >= 1).all())
    assert torch.equal(out.weight == 0, ~out.mask)
    pi = out.inclusion
    assert bool(((pi > 0) & (pi <= 1))[m].all()) and not pi[~m].any()
    close(out.weight[out.mask] * pi[out.mask], torch.ones(int(out.mask.sum())))
    assert all(bool(torch.isfinite(v)) for v in out.metrics.values())
    # a row's draw does not depend on the other rows' masks (URS) / lengths (RPC inclusion)
    if scheme == "prefix":
        solo = nat_weights(m[:1], generator=gen(seed), scheme="prefix", min_frac=min_frac)
        assert torch.equal(solo.inclusion, pi[:1])


def _nat_reference(m: torch.Tensor, g: torch.Generator, scheme: str, keep_prob: float, min_frac: float) -> Any:
    """The plain elementwise NAT expressions, the oracle for the in-place implementation."""
    mf = m.to(torch.float32)
    if scheme == "uniform":
        u = torch.rand(m.shape, generator=g)
        kept = m & (u < keep_prob)
        pi = mf * keep_prob
    else:
        length = mf.sum(1, keepdim=True)
        pos = mf.cumsum(1) - 1
        frac_pos = pos / length.clamp(min=1)
        cut = min_frac + (1 - min_frac) * (1 - torch.rand((m.shape[0], 1), generator=g))
        kept = m & (pos < cut * length)
        tail = (1 - frac_pos) / max(1 - min_frac, 1e-12)
        pi = torch.where(frac_pos <= min_frac, torch.ones_like(mf), tail.clamp(max=1)) * mf
    w = torch.where(kept, 1 / pi.clamp(min=1e-30), torch.zeros_like(pi))
    n_tok = mf.sum().clamp(min=1)
    metrics = {
        "token_keep_frac": kept.sum() / n_tok,
        "expected_keep_frac": pi.sum() / n_tok,
        "weight_max": w.amax() if w.numel() else torch.zeros(()),
        "weight_mean": w.sum() / kept.sum().clamp(min=1),
    }
    return kept, w, pi, metrics


@pytest.mark.parametrize(
    ("scheme", "keep_prob", "min_frac"),
    [
        ("uniform", 0.5, 0.0),
        ("uniform", 0.3, 0.0),
        ("uniform", 1.0, 0.0),
        ("prefix", 0.5, 0.0),
        ("prefix", 0.5, 0.4),
        ("prefix", 0.5, 0.7),
        ("prefix", 0.5, 1.0),
    ],
)
def test_nat_matches_elementwise_reference_bit_for_bit(scheme: str, keep_prob: float, min_frac: float) -> None:
    """Same generator state: the same mask, weights, inclusion, metrics and generator state afterwards as the
    plain expressions, for contiguous, transposed, float, empty and all-masked masks."""
    r = gen(3)
    masks = [
        MASK_NAT,
        torch.rand(300, 7, generator=r) > 0.3,
        (torch.rand(7, 300, generator=r) > 0.3).t(),
        (torch.rand(40, 9, generator=r) > 0.5).float(),
        torch.zeros(3, 0, dtype=torch.bool),
        torch.zeros(0, 4, dtype=torch.bool),
        torch.zeros(2, 3, dtype=torch.bool),
    ]
    for m in masks:
        g_new, g_ref = gen(9), gen(9)
        out = nat_weights(m, generator=g_new, scheme=scheme, keep_prob=keep_prob, min_frac=min_frac)  # type: ignore[arg-type]
        kept, w, pi, metrics = _nat_reference(m != 0, g_ref, scheme, keep_prob, min_frac)
        assert torch.equal(out.mask, kept) and torch.equal(out.weight, w) and torch.equal(out.inclusion, pi)
        assert torch.equal(g_new.get_state(), g_ref.get_state())
        for name, value in metrics.items():
            assert torch.equal(out.metrics[name], value), name


# ====================================================================================== Latent-GRPO


def latent_grpo_reference(
    scores: list[float], lengths: list[int], index: list[int], max_len: int, eps: float = 1e-6
) -> list[float]:
    """Transcription of the masking part of Latent-GRPO's
    ``compute_latent_grpo_outcome_advantage_firstmask_best_exclude_advantage`` (verl 0.4 fork): truncated rows
    (length == max_len) are left out of the group statistics and get 0; a group with one (or no) kept row has
    mean 0 and std 1 (verl's convention)."""
    kept: dict[int, list[float]] = {}
    for s, n, i in zip(scores, lengths, index, strict=True):
        kept.setdefault(i, [])
        if n != max_len:
            kept[i].append(s)
    stats = {}
    for i, xs in kept.items():
        if len(xs) <= 1:
            stats[i] = (0.0, 1.0)
        else:
            mu = sum(xs) / len(xs)
            stats[i] = (mu, math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)))
    return [
        0.0 if n == max_len else (s - stats[i][0]) / (stats[i][1] + eps)
        for s, n, i in zip(scores, lengths, index, strict=True)
    ]


def test_latent_mask_hand_oracle() -> None:
    # valid [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3)
    out = latent_mask(t([1.0, 0.0, math.nan, 0.0]), ids([5, 5, 5, 5]), invalid=torch.tensor([0, 0, 1, 0]))
    sd = math.sqrt(1 / 3)
    close(out.advantages, [(2 / 3) / (sd + 1e-6), -(1 / 3) / (sd + 1e-6), 0.0, -(1 / 3) / (sd + 1e-6)])
    close(out.advantages[:2], [1.1547, -0.5773], atol=1e-4)
    assert torch.equal(out.weight, t([1.0, 1.0, 0.0, 1.0]))
    close(out.metrics["invalid_frac"], 0.25)
    close(out.metrics["truncated_frac"], 0.0)
    assert all(v.ndim == 0 and not v.requires_grad and torch.isfinite(v) for v in out.metrics.values())


def test_latent_mask_truncation_rule_and_reference_parity() -> None:
    scores = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.25]
    lengths = [3, 4, 4, 2, 1, 4, 4, 4, 2]  # max_len 4: rows 1, 2, 5, 6, 7 truncated
    index = [0, 0, 0, 1, 1, 1, 2, 2, 3]  # group 2 all truncated, group 3 a singleton, group 1 left with two
    mask = torch.tensor([[j < n for j in range(4)] for n in lengths])
    ref = latent_grpo_reference(scores, lengths, index, 4)
    out = latent_mask(t(scores, D), ids(index), mask=mask, max_len=4, singleton="raw")
    close(out.advantages, ref, atol=1e-9)
    assert torch.equal(out.weight, t([n != 4 for n in lengths], D))
    close(out.metrics["truncated_frac"], 5 / 9)
    with pytest.warns(UserWarning, match="size 1"):
        zero = latent_mask(t(scores), ids(index), mask=mask, max_len=4)
    assert zero.advantages[0].item() == 0.0 and zero.advantages[8].item() == 0.0  # groups left with one row
    # invalid flags and truncation combine with "or"
    both = latent_mask(t(scores), ids(index), mask=mask, max_len=4, invalid=torch.arange(9) == 3, singleton="raw")
    assert both.weight[3].item() == 0.0 and both.weight[4].item() == 1.0


def test_latent_mask_matches_verl_grpo_on_the_valid_rows() -> None:
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    gen_ = gen(5)
    r = torch.randint(0, 2, (24,), generator=gen_).float()
    r[::5] += 0.5  # non-binary rewards too
    g = torch.arange(24) % 4
    invalid = torch.rand(24, generator=gen_) < 0.3
    out = latent_mask(r, g, invalid=invalid, singleton="raw")
    keep = (~invalid).nonzero().squeeze(1)
    t_len = 3
    token_rewards = torch.zeros(len(keep), t_len)
    token_rewards[:, -1] = r[keep]
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, torch.ones(len(keep), t_len), np.array([str(i) for i in g[keep].tolist()], dtype=object)
    )
    close(out.advantages[keep], verl_adv[:, 0], atol=1e-5)
    assert torch.equal(out.advantages[invalid], torch.zeros(int(invalid.sum())))


@settings(deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, 0.3, -2.0]), st.integers(1, 4)), min_size=1),
    st.data(),
)
def test_latent_mask_properties(rows: list[tuple[int, float, int]], data: st.DataObject) -> None:
    index = [x[0] for x in rows]
    scores = [x[1] for x in rows]
    lengths = [x[2] for x in rows]
    ref = latent_grpo_reference(scores, lengths, index, 4)
    mask = torch.tensor([[j < n for j in range(4)] for n in lengths])
    out = latent_mask(t(scores, D), ids(index), mask=mask, max_len=4, singleton="raw")
    close(out.advantages, ref, atol=1e-9)
    assert all(bool(torch.isfinite(v)) for v in out.metrics.values())
    perm = data.draw(st.permutations(list(range(len(rows)))))
    shift = data.draw(st.integers(-7, 7))
    moved = latent_mask(
        t([scores[i] for i in perm], D),
        ids([index[i] * 2 + shift for i in perm]),
        mask=mask[perm],
        max_len=4,
        singleton="raw",
    )
    close(moved.advantages, out.advantages[perm], atol=1e-12)
    # shift invariance of the valid rows' advantages (scale="group" also has scale invariance up to eps)
    shifted = latent_mask(t(scores, D) + 3.25, ids(index), mask=mask, max_len=4, singleton="raw")
    single = [
        sum(1 for j in range(len(rows)) if index[j] == index[i] and lengths[j] != 4) == 1 for i in range(len(rows))
    ]
    multi = torch.tensor([not s for s in single])
    close(shifted.advantages[multi], out.advantages[multi], atol=1e-9)


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@pytest.mark.parametrize("seed", [0, 1])
def test_latent_mask_gradcheck(seed: int) -> None:
    g_ = gen(seed)
    r = torch.randn(10, generator=g_, dtype=D, requires_grad=True)
    g = ids([0, 0, 0, 1, 1, 1, 1, 2, 2, 3])
    invalid = torch.tensor([0, 1, 0, 0, 0, 1, 0, 1, 0, 0], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda x: latent_mask(x, g, invalid=invalid).advantages, (r,))
    out = latent_mask(r, g, invalid=invalid)
    out.advantages.sum().backward()
    assert r.grad is not None and torch.equal(r.grad[invalid], torch.zeros(3, dtype=D))  # invalid rows get no gradient


def test_latent_mask_all_invalid_group() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = latent_mask(t([1.0, 0.0, 2.0, 3.0]), ids([0, 0, 1, 1]), invalid=torch.tensor([1, 1, 0, 0]))
    assert torch.equal(out.advantages[:2], torch.zeros(2)) and torch.equal(out.weight, t([0.0, 0.0, 1.0, 1.0]))
    close(out.advantages[2:], grpo(t([2.0, 3.0]), ids([1, 1])).advantages)


def test_latent_mask_singleton_warning_only_for_the_implicit_default() -> None:
    r, g, invalid = t([1.0, 0.0, 2.0, 3.0]), ids([0, 0, 1, 1]), torch.tensor([0, 0, 1, 0], dtype=torch.bool)
    with pytest.warns(UserWarning, match="size 1"):
        implicit = latent_mask(r, g, invalid=invalid)  # group 1 is left with one valid rollout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explicit = latent_mask(r, g, invalid=invalid, singleton="zero")
    assert torch.equal(explicit.advantages, implicit.advantages) and explicit.advantages[3].item() == 0.0


def test_latent_mask_nan_reward_message_names_the_invalid_keyword() -> None:
    with pytest.raises(InputError) as err:
        latent_mask(t([1.0, math.nan, 0.0, 1.0]), G4, invalid=torch.zeros(4, dtype=torch.bool))
    assert (
        err.value.argument == "rewards"
        and "invalid=" in err.value.fix
        and "valid=" not in err.value.fix.replace("invalid=", "")
    )
    invalid = torch.tensor([False, True, False, False])
    ok = latent_mask(t([1.0, math.nan, 0.0, 1.0]), G4, invalid=invalid, singleton="zero")
    assert torch.isfinite(ok.advantages).all() and ok.weight.tolist() == [1.0, 0.0, 1.0, 1.0]


def test_d3s_nan_advantage_message_names_the_valid_keyword() -> None:
    with pytest.raises(InputError) as err:
        d3s(t([1.0, math.nan, 0.0, 0.0]), G1, H4, ONES)
    assert err.value.argument == "advantages" and "valid=" in err.value.fix
    with pytest.raises(InputError) as err:  # per-token advantages: the mask leaves positions out
        d3s(t([[1.0, math.nan, 0.0]] * 4), G1, H4, ONES)
    assert err.value.argument == "advantages" and "mask" in err.value.fix
    out = d3s(t([1.0, math.nan, 0.0, -1.0]), G1, H4, ONES, valid=torch.tensor([True, False, True, True]))
    assert out.weight[1].item() == 0.0


def test_nat_weights_validates_both_fractions_whatever_the_scheme() -> None:
    for scheme in ("uniform", "prefix"):
        for kw, arg in (({"min_frac": math.nan}, "min_frac"), ({"keep_prob": math.nan}, "keep_prob")):
            with pytest.raises(InputError) as err:
                nat_weights(ONES, generator=gen(0), scheme=scheme, **kw)  # type: ignore[arg-type]
            assert err.value.argument == arg
    with pytest.raises(InputError) as err:
        nat_weights(ONES, generator=gen(0), min_frac=-0.5)  # uniform, unused but out of range
    assert err.value.argument == "min_frac"
    out = nat_weights(ONES, generator=gen(0), scheme="prefix", min_frac=1.0, keep_prob=1.0)
    assert torch.equal(out.mask, ONES) and torch.equal(out.weight, torch.ones(4, 3))


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_d3s_empty_batch(per_token: bool, masked: bool) -> None:
    a = torch.zeros(0, 3) if per_token else torch.zeros(0)
    v = torch.zeros(0, dtype=torch.bool) if masked else None
    out = d3s(a, ids([]), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), valid=v, progress=0.5)
    assert out.advantages.shape == a.shape and out.weight.shape == (0,) and out.token_mask.shape == (0, 3)
    assert out.token_mask.dtype == torch.bool
    # the schedule's values are kept; every data metric is 0
    close(out.metrics["sample_frac"], 0.75)
    close(out.metrics["token_frac"], 0.6)
    assert all(float(m) == 0.0 for k, m in out.metrics.items() if k not in ("sample_frac", "token_frac"))
    full = d3s(A4 if not per_token else A4[:, None].expand(4, 3), G1, H4, ONES, progress=0.5)
    assert set(out.metrics) == set(full.metrics)
    with pytest.raises(InputError) as err:
        d3s(a, ids([]), torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool))
    assert err.value.argument in ("entropy", "advantages")


def test_latent_mask_and_nat_empty_batch() -> None:
    empty_mask = torch.zeros(0, 4, dtype=torch.bool)
    for kw in ({"invalid": torch.zeros(0, dtype=torch.bool)}, {"mask": empty_mask, "max_len": 4}):
        out = latent_mask(t([]), ids([]), **kw)  # type: ignore[arg-type]
        assert out.advantages.shape == (0,) and out.weight.shape == (0,)
        assert all(m.ndim == 0 and float(m) == 0.0 for m in out.metrics.values())
        assert {"invalid_frac", "truncated_frac", "reward_mean"} <= set(out.metrics)
    for scheme in ("uniform", "prefix"):
        sub = nat_weights(empty_mask, generator=gen(0), scheme=scheme)  # type: ignore[arg-type]
        assert sub.mask.shape == (0, 4) and all(torch.isfinite(m) for m in sub.metrics.values())


# ======================================================================================== bad input


def _raises(argument: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(InputError) as err:
        fn()
    assert err.value.argument == argument, str(err.value)


M2 = torch.ones(4, 3, dtype=torch.bool)
R4 = t([1.0, 0.0, 0.0, 1.0])
G4 = ids([0, 0, 1, 1])


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("entropy", lambda: d3s(A4, G1, torch.ones(4, 2), M2)),
        ("entropy", lambda: d3s(A4, G1, -torch.ones(4, 3), M2)),
        ("entropy", lambda: d3s(A4, G1, torch.full((4, 3), math.nan), M2)),
        ("entropy", lambda: d3s(A4, G1, torch.ones(4, 3, dtype=torch.long), M2)),
        ("advantages", lambda: d3s(A4[:3], G1, H4, M2)),
        ("advantages", lambda: d3s(A4[:, None, None], G1, H4, M2)),
        ("advantages", lambda: d3s(t([1.0, math.inf, 0.0, 0.0]), G1, H4, M2)),
        ("mask", lambda: d3s(A4, G1, H4, torch.full((4, 3), 2))),
        ("group", lambda: d3s(A4, ids([0, 0, 1]), H4, M2)),
        ("valid", lambda: d3s(A4, G1, H4, M2, valid=torch.ones(3, dtype=torch.bool))),
        ("progress", lambda: d3s(A4, G1, H4, M2, progress=1.5)),
        ("progress", lambda: d3s(A4, G1, H4, M2, progress=0.5, step=1, total_steps=2)),
        ("total_steps", lambda: d3s(A4, G1, H4, M2, step=3)),
        ("step", lambda: d3s(A4, G1, H4, M2, step=-1, total_steps=10)),
        ("sample_frac[0]", lambda: d3s(A4, G1, H4, M2, sample_frac=(0.0, 1.0))),
        ("token_frac", lambda: d3s(A4, G1, H4, M2, token_frac=0.5)),  # type: ignore[arg-type]
        ("split", lambda: d3s(A4, G1, H4, M2, split="greedy")),  # type: ignore[arg-type]
        ("sample_level", lambda: d3s(A4, G1, H4, M2, sample_level="prompt")),  # type: ignore[arg-type]
        ("token_level", lambda: d3s(A4, G1, H4, M2, token_level="row")),  # type: ignore[arg-type]
        ("pos_frac", lambda: d3s(A4, G1, H4, M2, pos_frac=1.2)),
        ("progress", lambda: d3s_schedule(-0.1)),
        ("generator", lambda: nat_weights(M2, generator=None)),  # type: ignore[arg-type]
        ("generator", lambda: nat_weights(M2, generator=7)),  # type: ignore[arg-type]
        ("scheme", lambda: nat_weights(M2, generator=gen(0), scheme="topk")),  # type: ignore[arg-type]
        ("keep_prob", lambda: nat_weights(M2, generator=gen(0), keep_prob=0.0)),
        ("min_frac", lambda: nat_weights(M2, generator=gen(0), scheme="prefix", min_frac=1.5)),
        ("min_frac", lambda: nat_weights(M2, generator=gen(0), min_frac=math.nan)),
        ("keep_prob", lambda: nat_weights(M2, generator=gen(0), scheme="prefix", keep_prob=math.inf)),
        ("group", lambda: d3s(t([]), ids([]).float(), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool))),
        ("valid", lambda: d3s(t([]), ids([]), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), valid=R4 > 0)),
        ("sample_frac[0]", lambda: d3s(t([]), ids([]), torch.zeros(0, 3), M2[:0], sample_frac=(0.0, 1.0))),
        ("mask", lambda: nat_weights(torch.ones(4), generator=gen(0))),
        ("mask", lambda: nat_weights(torch.full((2, 2), 0.5), generator=gen(0))),
        ("invalid", lambda: latent_mask(R4, G4)),
        ("invalid", lambda: latent_mask(R4, G4, invalid=torch.ones(3, dtype=torch.bool))),
        ("invalid", lambda: latent_mask(R4, G4, invalid=torch.tensor([0, 2, 0, 1]))),
        ("mask", lambda: latent_mask(R4, G4, max_len=3)),
        ("max_len", lambda: latent_mask(R4, G4, mask=M2)),
        ("max_len", lambda: latent_mask(R4, G4, mask=M2, max_len=0)),
        ("mask", lambda: latent_mask(R4, G4, mask=torch.ones(3, 3, dtype=torch.bool), max_len=3)),
        ("rewards", lambda: latent_mask(t([1.0, math.nan, 0.0, 1.0]), G4, invalid=torch.zeros(4, dtype=torch.bool))),
        ("eps", lambda: latent_mask(R4, G4, invalid=torch.zeros(4, dtype=torch.bool), eps=-1.0)),
        ("singleton", lambda: latent_mask(R4, G4, invalid=torch.zeros(4, dtype=torch.bool), singleton="mean")),  # type: ignore[arg-type]
    ],
)
def test_bad_input_names_the_argument(argument: str, call: Callable[[], Any]) -> None:
    _raises(argument, call)


def _reference_token_keep(key: torch.Tensor, eligible: torch.Tensor, frac: float) -> torch.Tensor:
    """The batch-level top-K by a full stable descending argsort (the implementation before the radix select)."""
    k_masked = torch.where(eligible, key, torch.full_like(key, float("-inf"))).reshape(-1)
    count = eligible.sum()
    budget = torch.where(count > 0, torch.floor(count.to(torch.float64) * frac + 0.5).long().clamp(min=1), count)
    order = torch.argsort(k_masked, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(k_masked.numel())
    return eligible & (ranks.reshape(key.shape) < budget)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_d3s_fast_token_selection_equals_full_sort(dtype: torch.dtype, seed: int) -> None:
    from rolloutopt.advantages.d3s import _token_keep, _token_keep_nonnegative

    g = gen(seed)
    b, t_ = 300, 7
    scale = torch.rand(b, 1, generator=g, dtype=dtype).round(decimals=1)  # ties between rows
    scale[::17] = 0.0
    h = torch.rand(b, t_, generator=g, dtype=dtype).round(decimals=2)  # ties within the bucket
    h[::5, 0] = -0.0
    h[3, 2] = 1e30 if dtype == torch.float32 else 1e300  # huge finite keys stay eligible
    m = torch.rand(b, t_, generator=g) > 0.3
    keep = torch.rand(b, generator=g) > 0.4
    h_garbage = h.clone()
    h_garbage[~m] = float("nan")  # masked-out entropies are never read
    for frac in (0.0001, 0.2, 0.5, 1.0):
        expected = _reference_token_keep(scale * h, m & keep[:, None], frac)
        assert torch.equal(_token_keep_nonnegative(scale, h_garbage, m, keep, frac), expected)
        assert torch.equal(_token_keep(scale * h, m & keep[:, None], frac, "batch"), expected)
    nan_key = scale * h
    nan_key[0, :3] = float("nan")
    nan_key[1, :2] = float("-inf")
    expected = _reference_token_keep(nan_key, m & keep[:, None], 0.3)
    assert torch.equal(_token_keep(nan_key, m & keep[:, None], 0.3, "batch"), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_d3s_one_sort_selection_equals_group_ranks(dtype: torch.dtype, seed: int) -> None:
    from rolloutopt.advantages.d3s import _select_balanced, _split_budget

    g = gen(seed)
    ids_ = torch.randint(0, 40, (400,), generator=g)
    a = torch.randn(400, generator=g, dtype=dtype).round(decimals=1)  # ties and zeros
    valid = torch.rand(400, generator=g) > 0.2
    groups = Groups(ids_)
    for v in (None, valid):
        vv = torch.ones(400, dtype=torch.bool) if v is None else v
        budget = torch.floor(groups.count(vv).to(torch.float64) * 0.6 + 0.5).long().clamp(min=1)
        pos, neg = vv & (a > 0), vv & (a < 0)
        p, q = _split_budget(budget, groups.count(pos), groups.count(neg), 0.5)
        top, bottom = groups.rank(a, pos, descending=True), groups.rank(a, neg)
        expected = (pos & (top < groups.broadcast(p))) | (neg & (bottom < groups.broadcast(q)))
        assert torch.equal(_select_balanced(a, groups, budget, v, 0.5), expected)
