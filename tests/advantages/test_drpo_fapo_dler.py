"""Reward shaping: DRPO (arXiv 2510.04474), FAPO (arXiv 2510.22543), DLER batch normalisation and truncation penalty.

Oracles computed by hand following the authors' code (DRPO: ``Optimization-AI/DRPO@405f702``
``verl/verl/trainer/ppo/core_algos.py::compute_policy_loss_drpo``; FAPO: ``volcengine/verl@dfc9b534``
``recipe/fapo/reward_fn_reasoning.py``) and our own, hypothesis properties against float64 per-group loops written
from the formulas, DRPO gradient parity with a port of the paper's code (``Optimization-AI/DRPO@405f702``
``compute_policy_loss_drpo``), DLER parity with verl's REINFORCE++-baseline on one-token responses, gradchecks
and one test per class of bad input.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.advantages import dr_grpo, grpo, names, reinforce_pp_baseline
from rolloutopt.advantages.dler import dler_normalise, truncation_penalty
from rolloutopt.advantages.drpo import drpo, drpo_trust_penalty
from rolloutopt.advantages.fapo import fapo_penalty
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses import Denominators, policy_loss

from .helpers import D, close, ids, t


def mask_of(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def test_registered() -> None:
    assert {"drpo", "dler_normalise"} <= set(names())
    assert {"fapo_penalty", "truncation_penalty"} <= set(rolloutopt.advantages.SHAPERS.names())


# --------------------------------------------------------------------------------------------------- DRPO


def naive_drpo(
    correct: list[bool], group: list[int], scores: list[float], lengths: list[int], max_len: int, lam: float, tau: float
) -> list[float]:
    """Per-group loop in float64 from DRPO's formulas: A = w on positives, -softmax(s/tau) on negatives."""
    out = [0.0] * len(correct)
    for gid in set(group):
        rows = [i for i in range(len(group)) if group[i] == gid and lengths[i] > 0]
        pos = [i for i in rows if correct[i]]
        neg = [i for i in rows if not correct[i]]
        if not pos or not neg:
            continue
        zs = [0.0 if math.isinf(lam) else (1 - lengths[i] / max_len) / lam for i in pos]
        top = max(zs)
        ew = [math.exp(z - top) for z in zs]
        for i, e in zip(pos, ew, strict=True):
            out[i] = e / sum(ew)
        ys = [scores[j] / tau for j in neg]
        top = max(ys)
        en = [math.exp(y - top) for y in ys]
        for j, e in zip(neg, en, strict=True):
            out[j] = -e / sum(en)
    return out


def test_drpo_spec_oracle() -> None:
    # DRPO: two correct rollouts with L/L_max = 0.2 and 0.4, lambda = 0.1 -> weight ratio e^2: w = [0.8808, 0.1192]
    m = mask_of([2, 4, 3], 10)
    lp = torch.full((3, 10), -0.5)
    out = drpo(t([1.0, 1.0, 0.0]), ids([0, 0, 0]), lp, m, max_len=10)
    close(out.advantages, [0.8808, 0.1192, -1.0], atol=1e-4)
    close(out.advantages[0] / out.advantages[1], math.exp(2.0))
    close(out.weight, [1.0, 1.0, 1.0])
    # a group with only correct answers contributes exactly 0 (and weight 0), but still counts as a question
    out = drpo(
        t([1.0, 1.0, 1.0, 1.0, 0.0]), ids([5, 5, 9, 9, 9]), torch.zeros(5, 10), mask_of([2, 4, 2, 4, 1], 10), max_len=10
    )
    assert out.advantages[:2].eq(0).all() and out.weight[:2].eq(0).all()
    close(out.metrics["num_questions"], 2.0)
    close(out.metrics["skipped_group_frac"], 0.5)
    close(out.metrics["excluded_frac"], 0.4)


def test_drpo_own_oracle_negatives() -> None:
    # negatives with scores s = [-1, -2] (length-normalised), tau = 10: softmax(-0.1, -0.2) = [0.52498, 0.47502];
    # tau = 1: softmax(-1, -2) = [0.73106, 0.26894]. One positive gets weight 1 whatever its length.
    lp = t([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0], [-3.0, 0.0, 0.0]])
    m = mask_of([2, 3, 1], 3)
    r = t([0.0, 0.0, 1.0])
    close(drpo(r, ids([1, 1, 1]), lp, m, max_len=4).advantages, [-0.52498, -0.47502, 1.0])
    close(drpo(r, ids([1, 1, 1]), lp, m, max_len=4, tau=1.0).advantages, [-0.73106, -0.26894, 1.0])


def test_drpo_lam_inf_is_disco_and_threshold_and_bool() -> None:
    m = mask_of([1, 3, 5, 2], 6)
    lp = torch.zeros(4, 6)
    out = drpo(t([1.0, 1.0, 1.0, 0.0]), ids([0, 0, 0, 0]), lp, m, max_len=6, lam=float("inf"))
    close(out.advantages, [1 / 3, 1 / 3, 1 / 3, -1.0])
    close(out.metrics["positive_ess_frac"], 1.0)
    soft = drpo(t([0.9, 0.7, 0.6, 0.1]), ids([0, 0, 0, 0]), lp, m, max_len=6, threshold=0.5)
    hard = drpo(torch.tensor([True, True, True, False]), ids([0, 0, 0, 0]), lp, m, max_len=6)
    close(soft.advantages, hard.advantages)


def test_drpo_valid_and_empty_rows() -> None:
    m = mask_of([2, 3, 0, 4], 5)
    lp = -torch.rand(4, 5)
    lp[2] = float("nan")  # an all-masked row may hold garbage
    out = drpo(t([1.0, 0.0, 1.0, float("nan")]), ids([0, 0, 0, 0]), lp, m, max_len=5, valid=torch.tensor([1, 1, 1, 0]))
    close(out.advantages, [1.0, -1.0, 0.0, 0.0])
    close(out.weight, [1.0, 1.0, 0.0, 0.0])
    close(out.metrics["excluded_frac"], 0.5)


def test_drpo_no_valid_group_is_zero() -> None:
    out = drpo(t([1.0, 1.0, 0.0]), ids([0, 0, 1]), torch.zeros(3, 2), torch.ones(3, 2), max_len=2)
    assert out.advantages.eq(0).all() and out.weight.eq(0).all()
    close(out.metrics["excluded_frac"], 1.0)


def reference_drpo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    eos_mask: torch.Tensor,
    uid: torch.Tensor,
    seq_level_rewards: torch.Tensor,
    delta: float,
    beta: float,
    tau: float,
    lam: float,
    kl_type: str,
) -> torch.Tensor:
    """Port of Optimization-AI/DRPO@405f702 ``compute_policy_loss_drpo`` (single process; verl masked_mean)."""

    def masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return (x * m).sum() / (m.sum() + 1e-8)

    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    if kl_type == "low_var_kl":
        ppo_kl = masked_mean(-negative_approx_kl + ratio - 1, eos_mask)
    else:
        ppo_kl = masked_mean(-negative_approx_kl, eos_mask)
    scores = (log_prob * eos_mask).sum(dim=1) / eos_mask.sum(dim=1)
    length_ratio = eos_mask.sum(dim=1) / eos_mask.size(-1)
    _, indices = uid.sort()
    nq = uid.unique().numel()
    nr = uid.size(0) // nq
    gs = scores[indices].view(nq, nr)
    gr = seq_level_rewards[indices].view(nq, nr)
    gl = length_ratio[indices].view(nq, nr)
    pos, neg = gr == 1, gr == 0
    valid = (pos.sum(dim=1) != 0) & (neg.sum(dim=1) != 0)
    if valid.sum() > 0:
        gs, gl, pos, neg = gs[valid], gl[valid], pos[valid], neg[valid]
        neg_max, _ = (gs / tau).masked_fill(~neg, float("-inf")).max(dim=-1, keepdim=True)
        neg_max = torch.where(neg_max == float("-inf"), torch.zeros_like(neg_max), neg_max)
        neg_exp = torch.exp(((gs / tau) - neg_max.detach()) * neg) * neg
        neg_sum = neg_exp.sum(dim=-1, keepdim=True)
        nlme = neg_sum / (neg_sum.detach() + torch.finfo(neg_sum.dtype).eps)
        weight = torch.exp((1 - gl) / lam)
        pg = (weight * (gs - tau * nlme) * pos).sum(dim=1, keepdim=True) / (weight * pos).sum(dim=1, keepdim=True)
        pg_loss = pg.sum() / nq
    else:
        pg_loss = torch.tensor(0.0) * scores.mean()
    constraint = torch.maximum(beta * (ppo_kl - delta), torch.zeros_like(ppo_kl)).detach() * ppo_kl
    return -pg_loss + constraint


@pytest.mark.parametrize("kl_type", ["kl", "low_var_kl"])
def test_drpo_gradient_matches_paper_code(kl_type: str) -> None:
    gen = torch.Generator().manual_seed(0)
    groups, n, width = 5, 6, 12
    uid = torch.arange(groups).repeat_interleave(n)[torch.randperm(groups * n, generator=gen)]
    rewards = (torch.rand(groups * n, generator=gen) < 0.5).to(D)
    rewards[uid == 0] = 1.0  # one all-correct group (skipped, still counted)
    lengths = torch.randint(1, width + 1, (groups * n,), generator=gen)
    m = mask_of(lengths.tolist(), width).to(D)
    old = -torch.rand(groups * n, width, generator=gen, dtype=D) * 3
    base = old - 0.02 - 0.05 * torch.rand(groups * n, width, generator=gen, dtype=D)  # KL above delta

    lp_ref = base.clone().requires_grad_(True)
    ref = reference_drpo_loss(old, lp_ref, m, uid, rewards, 1e-4, 1e3, 10.0, 0.1, kl_type)
    ref.backward()

    lp = base.clone().requires_grad_(True)
    out = drpo(rewards, uid, lp.detach(), m, max_len=width)
    pl = policy_loss(
        lp,
        None,
        out.advantages,
        m,
        trust=None,
        agg="seq-mean-token-mean",
        denominators=Denominators(sequences=out.metrics["num_questions"]),
        seq_weight=out.weight,
    )
    loss = pl.loss + drpo_trust_penalty(lp, old, m, kl_type=kl_type)  # type: ignore[arg-type]
    loss.backward()
    assert lp.grad is not None and lp_ref.grad is not None
    assert drpo_trust_penalty(lp, old, m, kl_type=kl_type) > 0  # type: ignore[arg-type]  # the hinge is active
    torch.testing.assert_close(lp.grad, lp_ref.grad, atol=1e-7, rtol=1e-6)


@st.composite
def drpo_batches(draw: Any) -> tuple[list[bool], list[int], list[list[float]], list[int], int]:
    b = draw(st.integers(1, 12))
    width = draw(st.integers(1, 6))
    group = draw(st.lists(st.integers(-3, 3), min_size=b, max_size=b))
    correct = draw(st.lists(st.booleans(), min_size=b, max_size=b))
    lengths = draw(st.lists(st.integers(0, width), min_size=b, max_size=b))
    logp = draw(st.lists(st.lists(st.floats(-50, 0), min_size=width, max_size=width), min_size=b, max_size=b))
    return correct, group, logp, lengths, width


@given(drpo_batches(), st.sampled_from([1e-3, 0.1, 2.0, float("inf")]), st.sampled_from([0.01, 1.0, 10.0]))
def test_drpo_matches_loop_on_ragged_groups(batch: Any, lam: float, tau: float) -> None:
    correct, group, logp, lengths, width = batch
    lp = torch.tensor(logp, dtype=D)
    m = mask_of(lengths, width)
    scores = [(sum(row[:n]) / n if n else 0.0) for row, n in zip(logp, lengths, strict=True)]
    expect = naive_drpo(correct, group, scores, lengths, width, lam, tau)
    out = drpo(torch.tensor(correct), ids(group), lp, m, max_len=width, lam=lam, tau=tau)
    assert torch.isfinite(out.advantages).all()
    close(out.advantages, torch.tensor(expect, dtype=D), atol=1e-9)
    # every valid group's coefficients sum to 0 (positives +1, negatives -1)
    g = Groups(ids(group))
    close(g.sum(out.advantages), torch.zeros(g.num_groups, dtype=D), atol=1e-9)
    # a relabelled, permuted batch gives the permuted advantages
    perm = torch.randperm(len(group))
    relabel = ids([7 * x + 100 for x in group])
    out_p = drpo(torch.tensor(correct)[perm], relabel[perm], lp[perm], m[perm], max_len=width, lam=lam, tau=tau)
    close(out_p.advantages, out.advantages[perm], atol=1e-9)
    # shifting every log-prob of the batch by a constant leaves the negatives' softmax unchanged
    out_s = drpo(torch.tensor(correct), ids(group), lp - 3.0, m, max_len=width, lam=lam, tau=tau)
    close(out_s.advantages, out.advantages, atol=1e-9)


def test_drpo_dense_equals_ragged_path() -> None:
    gen = torch.Generator().manual_seed(3)
    uid = torch.arange(4).repeat_interleave(5)
    r = (torch.rand(20, generator=gen) < 0.5).float()
    m = mask_of(torch.randint(1, 9, (20,), generator=gen).tolist(), 8)
    lp = -torch.rand(20, 8, generator=gen)
    dense = drpo(r, Groups(uid), lp, m, max_len=8)
    # same rows, one extra singleton row forces the ragged path
    ragged = drpo(
        torch.cat([r, t([1.0])]), torch.cat([uid, ids([99])]), torch.cat([lp, lp[:1]]), torch.cat([m, m[:1]]), max_len=8
    )
    close(ragged.advantages[:20], dense.advantages)


def test_trust_penalty_gradcheck_and_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 4, generator=gen, dtype=D)
    lp = (old - 0.1 - 0.05 * torch.rand(3, 4, generator=gen, dtype=D)).requires_grad_(True)
    m = mask_of([4, 2, 3], 4)
    delta, beta = 1e-4, 1e3
    for kt in ("kl", "low_var_kl"):
        # the value is sg(beta * hinge) * KL; its gradient is that of the squared hinge beta/2 * max(KL - delta, 0)^2
        (grad,) = torch.autograd.grad(drpo_trust_penalty(lp, old, m, kl_type=kt), lp)  # type: ignore[arg-type]
        x = torch.where(m, lp - old, torch.zeros_like(lp))
        k = -x if kt == "kl" else torch.expm1(x) - x
        kl = (k * m).sum() / m.sum()
        (expect,) = torch.autograd.grad(beta / 2 * (kl - delta).clamp(min=0) ** 2, lp)
        torch.testing.assert_close(grad, expect)
    close(drpo_trust_penalty(old, old, m), 0.0)  # no divergence, no penalty
    close(drpo_trust_penalty(old, old, torch.zeros(3, 4, dtype=torch.bool)), 0.0)


def test_drpo_bad_input() -> None:
    m, lp, r, g = mask_of([1, 2], 3), torch.zeros(2, 3), t([1.0, 0.0]), ids([0, 0])
    cases: list[tuple[str, Any]] = [
        ("rewards", lambda: drpo(t([1.0, 0.5]), g, lp, m, max_len=3)),  # non-binary without threshold
        ("max_len", lambda: drpo(r, g, lp, m, max_len=0)),
        ("max_len", lambda: drpo(r, g, lp, mask_of([1, 3], 3), max_len=2)),  # a response longer than L_max
        ("lam", lambda: drpo(r, g, lp, m, max_len=3, lam=-1.0)),
        ("tau", lambda: drpo(r, g, lp, m, max_len=3, tau=float("inf"))),
        ("threshold", lambda: drpo(r, g, lp, m, max_len=3, threshold=float("nan"))),
        ("mask", lambda: drpo(r, g, lp, mask_of([1, 2, 3], 3), max_len=3)),
        ("group", lambda: drpo(r, t([0.0, 0.0]), lp, m, max_len=3)),
        ("logp", lambda: drpo(r, g, torch.full((2, 3), float("nan")), m, max_len=3)),
        ("kl_type", lambda: drpo_trust_penalty(lp, lp, m, kl_type="k2")),  # type: ignore[arg-type]
        ("old_logp", lambda: drpo_trust_penalty(lp, torch.zeros(2, 2), m)),
    ]
    for arg, call in cases:
        with pytest.raises(InputError, match=arg):
            call()


# --------------------------------------------------------------------------------------------------- FAPO


def test_fapo_spec_oracle() -> None:
    # FAPO: (clean, flawed, wrong, wrong) = [1, 0, -1, -1] -> mean -0.25 -> the flawed Dr.GRPO advantage is +0.25
    out = fapo_penalty(t([1.0, 1.0, -1.0, -1.0]), torch.tensor([False, True, False, False]))
    close(out.rewards, [1.0, 0.0, -1.0, -1.0])
    close(dr_grpo(out.rewards, ids([0] * 4)).advantages[1], 0.25)
    # [1, 1, 0, -1] -> mean 0.25 -> flawed advantage -0.25; GenRM first-error indices (-1 = none)
    out = fapo_penalty(t([1.0, 1.0, 1.0, -1.0]), ids([-1, -1, 3, 0]))  # the flag on a wrong rollout is ignored
    close(out.rewards, [1.0, 1.0, 0.0, -1.0])
    close(dr_grpo(out.rewards, ids([0] * 4)).advantages[2], -0.25)
    close(out.metrics["flawed_positive_frac"], 1 / 3)
    close(out.metrics["penalised_frac"], 0.25)


def test_fapo_own_oracle_lam_and_valid() -> None:
    out = fapo_penalty(t([1.0, 1.0, 0.0]), torch.tensor([True, True, True]), lam=0.4, valid=torch.tensor([1, 0, 1]))
    close(out.rewards, [0.6, 1.0, 0.0])  # invalid rows unchanged; 0 is not correct (correct_above=0)
    close(fapo_penalty(t([1.0, -1.0]), torch.tensor([True, True]), lam=0.0).rewards, [1.0, -1.0])
    close(fapo_penalty(t([0.5, 0.2]), torch.tensor([True, True]), correct_above=0.3).rewards, [-0.5, 0.2])


@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.integers(-1, 5)), min_size=1, max_size=16), st.floats(0, 10))
def test_fapo_properties(rows: list[tuple[float, int]], lam: float) -> None:
    r = torch.tensor([x for x, _ in rows], dtype=D)
    f = ids([k for _, k in rows])
    out = fapo_penalty(r, f, lam=lam).rewards
    assert torch.isfinite(out).all()
    expect = [x - lam * (x > 0 and k != -1) for x, k in rows]
    close(out, torch.tensor(expect, dtype=D), atol=1e-9)
    perm = torch.randperm(len(rows))
    close(fapo_penalty(r[perm], f[perm], lam=lam).rewards, out[perm])
    if bool((r.abs() > 1e-3).all()):  # the penalty is a step at the correctness threshold
        x0 = r.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda x: fapo_penalty(x, f, lam=lam).rewards, (x0,))


def test_fapo_bad_input() -> None:
    r = t([1.0, -1.0])
    cases: list[tuple[str, Any]] = [
        ("is_flawed", lambda: fapo_penalty(r, t([1.0, 0.0]))),
        ("is_flawed", lambda: fapo_penalty(r, ids([-2, 0]))),
        ("is_flawed", lambda: fapo_penalty(r, ids([0, 0, 0]))),
        ("is_flawed", lambda: fapo_penalty(r, [True, False])),
        ("lam", lambda: fapo_penalty(r, ids([0, 0]), lam=-1.0)),
        ("correct_above", lambda: fapo_penalty(r, ids([0, 0]), correct_above=float("nan"))),
        ("rewards", lambda: fapo_penalty(t([float("inf"), 0.0]), ids([0, 0]))),
        ("rewards", lambda: fapo_penalty(ids([1, 0]), ids([0, 0]))),
    ]
    for arg, call in cases:
        with pytest.raises(InputError, match=arg):
            call()


# --------------------------------------------------------------------------------------------------- DLER


def naive_dler(
    rewards: list[float], group: list[int], std_of: str = "advantages", unbiased: bool = True, eps: float = 0.0
) -> list[float]:
    means = {
        gid: sum(r for r, g in zip(rewards, group, strict=True) if g == gid) / group.count(gid) for gid in set(group)
    }
    centred = [r - means[g] for r, g in zip(rewards, group, strict=True)]
    x = centred if std_of == "advantages" else rewards
    n = len(x)
    mu = sum(x) / n
    var = sum((v - mu) ** 2 for v in x) / max(n - (1 if unbiased else 0), 1)
    std = math.sqrt(var)
    shift = mu if std_of == "advantages" else 0.0
    return [(c - shift) / (std + eps) if std + eps > 0 else 0.0 for c in centred]


def test_dler_own_oracle() -> None:
    # [1, 0 | 1, 1, 0, 0]: centred [.5, -.5 | .5, .5, -.5, -.5], batch mean 0, unbiased var 6 * .25 / 5 = 0.3,
    # std 0.5477226 -> A = +-0.5 / 0.5477226 = +-0.9128709 (GRPO's group std would give +-0.7071 and +-0.8660)
    out = dler_normalise(t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), ids([0, 0, 1, 1, 1, 1]), eps=0.0)
    close(out.advantages, [0.9128709, -0.9128709, 0.9128709, 0.9128709, -0.9128709, -0.9128709])
    close(out.metrics["batch_std"], math.sqrt(0.3))
    # an all-correct group adds zeros to the batch: [1, 1 | 1, 0] -> centred [0, 0, .5, -.5], std sqrt(.5/3)
    out = dler_normalise(t([1.0, 1.0, 1.0, 0.0]), ids([0, 0, 1, 1]), eps=0.0)
    close(out.advantages, [0.0, 0.0, 1.2247449, -1.2247449])
    close(out.metrics["zero_variance_group_frac"], 0.5)
    # batch="informative" (dynamic sampling) leaves it out of the statistics: std sqrt(.5) -> +-0.7071068
    out = dler_normalise(t([1.0, 1.0, 1.0, 0.0]), ids([0, 0, 1, 1]), eps=0.0, batch="informative")
    close(out.advantages, [0.0, 0.0, 0.7071068, -0.7071068])


def test_dler_is_reinforce_pp_baseline_on_one_token_responses() -> None:
    # REINFORCE++-baseline whitens group-centred rewards over all tokens (eps inside the sqrt); with one token
    # per response that is DLER's batch std. reinforce_pp_baseline is compared with verl in tests/integration.
    gen = torch.Generator().manual_seed(1)
    r = torch.rand(20, generator=gen, dtype=D)
    g = torch.arange(5).repeat_interleave(4)
    pp = reinforce_pp_baseline(r, g, torch.ones(20, 1, dtype=torch.bool), eps=0.0).advantages[:, 0]
    close(dler_normalise(r, g, eps=0.0).advantages, pp, atol=1e-12)


@pytest.mark.verl
def test_dler_matches_verl_reinforce_pp_baseline_on_one_token_responses() -> None:
    # verl whitens group-centred scores over all tokens; with one token per response that is DLER's batch std
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    gen = torch.Generator().manual_seed(0)
    gid = torch.randint(0, 6, (48,), generator=gen)
    gid = gid[torch.isin(gid, gid.unique(return_counts=True)[0][gid.unique(return_counts=True)[1] > 1])]
    scores = torch.randint(0, 2, (gid.numel(),), generator=gen).float()
    index = np.array([f"uid-{i}" for i in gid.tolist()], dtype=object)
    adv, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        scores[:, None], torch.ones(gid.numel(), 1), index, epsilon=1e-6
    )
    ours = dler_normalise(scores, gid, eps=0.0).advantages
    torch.testing.assert_close(ours, adv[:, 0], atol=1e-5, rtol=1e-5)


def test_dler_std_of_rewards_is_lite_ppo_and_trl_batch_scaling() -> None:
    r, g = t([1.0, 0.0, 0.3, 0.9, 0.9, 0.2, 0.5]), ids([3, 3, 1, 1, 1, 8, 8])
    close(dler_normalise(r, g, std_of="rewards", eps=1e-4).advantages, grpo(r, g, scale="batch", eps=1e-4).advantages)


@st.composite
def reward_batches(draw: Any) -> tuple[list[float], list[int]]:
    b = draw(st.integers(1, 16))
    rewards = draw(st.lists(st.floats(-1e3, 1e3), min_size=b, max_size=b))
    group = draw(st.lists(st.integers(-3, 3), min_size=b, max_size=b))
    return rewards, group


@given(reward_batches(), st.sampled_from(["advantages", "rewards"]), st.booleans())
def test_dler_properties(batch: Any, std_of: str, unbiased: bool) -> None:
    rewards, group = batch
    r, g = torch.tensor(rewards, dtype=D), ids(group)
    out = dler_normalise(r, g, std_of=std_of, unbiased=unbiased, eps=1e-6)  # type: ignore[arg-type]
    assert torch.isfinite(out.advantages).all()
    close(out.advantages, torch.tensor(naive_dler(rewards, group, std_of, unbiased, 1e-6), dtype=D), atol=1e-6)
    perm = torch.randperm(len(group))
    relabel = ids([5 * x - 11 for x in group])
    out_p = dler_normalise(r[perm], relabel[perm], std_of=std_of, unbiased=unbiased)  # type: ignore[arg-type]
    close(out_p.advantages, out.advantages[perm], atol=1e-6)
    if std_of == "advantages":
        shift = torch.tensor([7.0 * x for x in group], dtype=D)  # per-group reward shift
        out_s = dler_normalise(r + shift, g, unbiased=unbiased)
        close(out_s.advantages, out.advantages, atol=1e-5)
        big = out.metrics["batch_std"] > 1e-3
        if bool(big):
            out_k = dler_normalise(3.0 * r, g, unbiased=unbiased, eps=0.0)
            close(out_k.advantages, dler_normalise(r, g, unbiased=unbiased, eps=0.0).advantages, atol=1e-6)


def test_dler_dense_equals_ragged_and_valid() -> None:
    r = t([0.1, 0.7, 0.2, 0.9, 0.4, 0.4])
    dense = dler_normalise(r, Groups(ids([0, 0, 1, 1, 2, 2])))
    ragged = dler_normalise(
        torch.cat([r, t([float("nan")])]), ids([0, 0, 1, 1, 2, 2, 9]), valid=torch.tensor([1, 1, 1, 1, 1, 1, 0])
    )
    close(ragged.advantages[:6], dense.advantages)
    close(ragged.advantages[6], 0.0)
    close(ragged.weight, [1.0] * 6 + [0.0])
    close(ragged.metrics["excluded_frac"], 1 / 7)
    # an all-equal batch and a batch of singletons give 0, finite
    close(dler_normalise(t([0.1] * 16), ids([0] * 8 + [1] * 8)).advantages, torch.zeros(16))
    close(dler_normalise(t([1.0, 0.0, 3.0]), ids([0, 1, 2])).advantages, torch.zeros(3))


def test_dler_gradcheck() -> None:
    r = torch.tensor([0.3, 0.9, 0.1, 0.5, 0.8], dtype=D, requires_grad=True)
    g = ids([0, 0, 1, 1, 1])
    for std_of in ("advantages", "rewards"):
        assert torch.autograd.gradcheck(
            lambda x, s=std_of: dler_normalise(x, g, std_of=s).advantages,
            (r,),  # type: ignore[misc]
        )


def test_truncation_penalty_oracle() -> None:
    # budget 10: lengths [10, 11, 12, 5] -> the 10-token response fits, 11 and 12 are truncated to reward 0
    out = truncation_penalty(t([1.0, 1.0, 0.0, 1.0]), ids([10, 11, 12, 5]), budget=10)
    close(out.rewards, [1.0, 0.0, 0.0, 1.0])
    close(out.metrics["truncated_frac"], 0.5)
    close(out.metrics["truncated_correct_frac"], 1 / 3)
    # per-rollout budgets (Difficulty-Aware DLER) and a custom truncated reward
    out = truncation_penalty(t([1.0, 1.0]), t([8.0, 8.0]), budget=ids([8, 4]), truncated_reward=-1.0)
    close(out.rewards, [1.0, -1.0])
    # DLER's recipe: truncate, then normalise over the batch
    shaped = truncation_penalty(t([1.0, 1.0, 1.0, 0.0]), ids([3, 9, 4, 2]), budget=5).rewards
    close(dler_normalise(shaped, ids([0, 0, 1, 1]), eps=0.0).advantages, [0.8660254, -0.8660254, 0.8660254, -0.8660254])


@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.integers(0, 50)), min_size=1, max_size=16), st.integers(1, 50))
def test_truncation_properties(rows: list[tuple[float, int]], budget: int) -> None:
    r = torch.tensor([x for x, _ in rows], dtype=D)
    lengths = ids([n for _, n in rows])
    out = truncation_penalty(r, lengths, budget=budget).rewards
    close(out, torch.tensor([x if n <= budget else 0.0 for x, n in rows], dtype=D))
    perm = torch.randperm(len(rows))
    close(truncation_penalty(r[perm], lengths[perm], budget=budget).rewards, out[perm])
    assert torch.autograd.gradcheck(
        lambda x: truncation_penalty(x, lengths, budget=budget).rewards, (r.clone().requires_grad_(True),)
    )


def test_dler_and_truncation_bad_input() -> None:
    r = t([1.0, 0.0])
    cases: list[tuple[str, Any]] = [
        ("std_of", lambda: dler_normalise(r, ids([0, 0]), std_of="group")),  # type: ignore[arg-type]
        ("batch", lambda: dler_normalise(r, ids([0, 0]), batch="filtered")),  # type: ignore[arg-type]
        ("eps", lambda: dler_normalise(r, ids([0, 0]), eps=-1.0)),
        ("group", lambda: dler_normalise(r, ids([0, 0, 0]))),
        ("rewards", lambda: dler_normalise(t([float("nan"), 0.0]), ids([0, 0]))),
        ("valid", lambda: dler_normalise(r, ids([0, 0]), valid=t([0.5, 1.0]))),
        ("budget", lambda: truncation_penalty(r, ids([1, 2]), budget=0)),
        ("budget", lambda: truncation_penalty(r, ids([1, 2]), budget=ids([1, 0]))),
        ("budget", lambda: truncation_penalty(r, ids([1, 2]), budget=2.5)),  # type: ignore[arg-type]
        ("lengths", lambda: truncation_penalty(r, ids([1, -2]), budget=2)),
        ("lengths", lambda: truncation_penalty(r, ids([1, 2, 3]), budget=2)),
        ("truncated_reward", lambda: truncation_penalty(r, ids([1, 2]), budget=2, truncated_reward=float("nan"))),
    ]
    for arg, call in cases:
        with pytest.raises(InputError, match=arg):
            call()


def test_truncation_penalty_empty_batch_and_nan_message() -> None:
    # B = 0: empty shaped rewards and every metric 0 (the mean of no reward is reported as 0, not NaN)
    out = truncation_penalty(t([]), ids([]), budget=4)
    assert out.rewards.shape == (0,)
    assert all(m.ndim == 0 and float(m) == 0.0 for m in out.metrics.values())
    out = truncation_penalty(t([]), ids([]), budget=ids([]))
    assert all(torch.isfinite(m) for m in out.metrics.values())
    # truncation_penalty has no row mask: the advice is to fix the rewards, not to mask them
    with pytest.raises(InputError) as err:
        truncation_penalty(t([1.0, float("nan")]), ids([1, 2]), budget=4)
    assert err.value.argument == "rewards" and "mask" not in err.value.fix and "valid" not in err.value.fix


def test_nan_reward_messages_name_the_valid_keyword() -> None:
    m, lp = mask_of([1, 2], 3), -torch.rand(2, 3)
    for call in (
        lambda r: fapo_penalty(r, torch.tensor([False, True])),
        lambda r: dler_normalise(r, ids([0, 0])),
        lambda r: drpo(r, ids([0, 0]), lp, m, max_len=3, threshold=0.5),
    ):
        with pytest.raises(InputError) as err:
            call(t([1.0, float("nan")]))
        assert err.value.argument == "rewards"
        assert "valid=" in err.value.fix and "mask those positions" not in err.value.fix, err.value.fix


EMPTY_CALLS: list[Any] = [
    lambda r, g, v: dler_normalise(r, g, valid=v),
    lambda r, g, v: dler_normalise(r, g, std_of="rewards", batch="informative", valid=v),
    lambda r, g, v: drpo(
        r, g, torch.zeros(r.shape[0], 4), torch.zeros(r.shape[0], 4, dtype=torch.bool), max_len=4, valid=v
    ),
    lambda r, g, v: drpo(
        r > 0, g, torch.zeros(r.shape[0], 4), torch.zeros(r.shape[0], 4, dtype=torch.bool), max_len=4, lam=math.inf
    ),
]


@pytest.mark.parametrize("call", EMPTY_CALLS)
@pytest.mark.parametrize("masked", [False, True])
def test_empty_batch_gives_empty_outputs_and_zero_metrics(call: Any, masked: bool) -> None:
    r = torch.zeros(0)
    v = torch.zeros(0, dtype=torch.bool) if masked else None
    out = call(r, ids([]), v)
    assert out.advantages.shape == (0,) and out.weight.shape == (0,) and out.advantages.dtype == torch.float32
    full = call(t([1.0, 0.0, 1.0, 0.0]), ids([0, 0, 1, 1]), None if v is None else torch.ones(4, dtype=torch.bool))
    assert set(out.metrics) == set(full.metrics)
    assert all(m.ndim == 0 and float(m) == 0.0 for m in out.metrics.values())  # num_questions too
    with rolloutopt.checks(False):
        assert call(r, ids([]), v).advantages.shape == (0,)
    assert fapo_penalty(r, torch.zeros(0, dtype=torch.bool)).rewards.shape == (0,)
    with pytest.raises(InputError) as err:  # still validated: logp's B must be 0 too
        drpo(r, ids([]), torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.bool), max_len=4)
    assert err.value.argument == "logp"


def test_checks_off_gives_the_same_numbers() -> None:
    r, g, m, lp = t([1.0, 0.0, 1.0, 0.0]), ids([0, 0, 1, 1]), mask_of([1, 2, 3, 1], 3), -torch.rand(4, 3)
    calls = [
        lambda: drpo(r, g, lp, m, max_len=3).advantages,
        lambda: fapo_penalty(r, ids([0, -1, -1, 2])).rewards,
        lambda: dler_normalise(r, g).advantages,
        lambda: truncation_penalty(r, ids([1, 2, 3, 1]), budget=2).rewards,
    ]
    on = [c() for c in calls]
    with rolloutopt.checks(False):
        off = [c() for c in calls]
    for a, b in zip(on, off, strict=True):
        close(a, b)


def test_drpo_finiteness_certificate_and_unsorted_dense_groups() -> None:
    # The fast check certifies finiteness from the row sums; non-finite values outside the mask, or a finite row
    # whose sum overflows, must not raise, and a non-finite masked-in value still raises, naming logp.
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    logp = torch.tensor([[-1.0, -2.0], [-1.5, math.nan], [-3e38, -3e38], [-0.5, -0.5]])
    out = drpo(r, torch.tensor([7, 7, 3, 3]), logp, mask, max_len=2)
    assert torch.isfinite(out.advantages[:2]).all()
    bad = logp.clone()
    bad[3, 1] = math.inf
    with pytest.raises(InputError, match="logp"):
        drpo(r, torch.tensor([7, 7, 3, 3]), bad, mask, max_len=2)
    # equal-sized groups in shuffled row order take the gather path of the local dense reductions
    ids = torch.tensor([5, 2, 5, 2, 9, 9])
    r6 = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    lp6 = -torch.rand(6, 3, generator=torch.Generator().manual_seed(0))
    m6 = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    dense = drpo(r6, Groups(ids), lp6, m6, max_len=3)
    perm = torch.argsort(ids, stable=True)
    ref = drpo(r6[perm], Groups(ids[perm]), lp6[perm], m6[perm], max_len=3)
    torch.testing.assert_close(dense.advantages[perm], ref.advantages)
    torch.testing.assert_close(dense.weight[perm], ref.weight)


def test_drpo_checks_of_rows_without_tokens() -> None:
    # A row without tokens is neither positive nor negative: a non-binary reward there is accepted (the combined
    # check sends it to the exact checks, which pass), a non-finite one still raises, as does any at a valid row.
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    logp = torch.tensor([[-1.0, -2.0], [-1.5, 0.0], [0.0, 0.0]])
    g = torch.tensor([0, 0, 0])
    out = drpo(torch.tensor([1.0, 0.0, 0.5]), g, logp, mask, max_len=2)
    assert out.weight.tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(InputError, match="rewards"):
        drpo(torch.tensor([1.0, 0.0, math.inf]), g, logp, mask, max_len=2)
    with pytest.raises(InputError, match="rewards"):
        drpo(torch.tensor([1.0, 0.5, 0.0]), g, logp, mask, max_len=2)
    with pytest.raises(InputError, match="max_len"):
        drpo(torch.tensor([1.0, 0.0, 0.0]), g, logp, mask, max_len=1)
    # invalid rows are not checked at all
    valid = torch.tensor([True, True, False])
    drpo(torch.tensor([1.0, 0.0, math.nan]), g, logp, mask, max_len=2, valid=valid)
