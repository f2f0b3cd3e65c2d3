"""MC-GRPO and GAPO robust baselines.

Hand-computed examples; transcriptions of the authors' code paths (MC-GRPO: ``lotusroot-kim/MC-GRPO@da07745``,
``src/open_r1/grpo_trainer_math.py`` / ``grpo_trainer_gsm.py`` ``_generate_and_score_completions``, the dense
``view(-1, G + 1).median(dim=1)`` path; GAPO: ``TsingZ0/verl-GAPO@58f42b55``
``find_shortest_covering_subarray``), written here because neither codebase is installable; float64 per-group
Python loops written independently of the library; hypothesis properties; gradchecks; bad input; and a Monte
Carlo reproduction of MC-GRPO's motivation (fewer advantage sign flips than GRPO under heavy-tailed rewards at
small G).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.advantages import get, names
from rolloutopt.advantages.median import gapo, mc_grpo
from rolloutopt.advantages.reference import grpo
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses import policy_loss

from .helpers import SINGLETON_WARNING, D, ids, relabel_map, t


def close(a: torch.Tensor, b: object, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)
    torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------- independent oracles


def _lower_median(xs: list[float]) -> float:
    return sorted(xs)[(len(xs) - 1) // 2]


def naive_mc(
    rewards: list[float],
    group: list[int],
    *,
    valid: list[bool] | None = None,
    scale: str | None = "mad_or_std",
    eps: float = 1e-3,
    unbiased: bool = True,
    pivot: str = "rank",
    rescale_nonzero: bool = False,
) -> tuple[list[float], list[float]]:
    """Per-group loop: lower median, MAD (the std where it is 0 for "mad_or_std"), the pivot at rank
    (n - 1) // 2 of the rows sorted by (reward, row) ("rank") or the lowest tied row ("first"), and the GSM8K
    trainer's n / #nonzero factor on |A| > 1e-6."""
    ok = valid if valid is not None else [True] * len(rewards)
    members: dict[int, list[int]] = {}
    for i, gid in enumerate(group):
        if ok[i]:
            members.setdefault(gid, []).append(i)
    adv, weight = [0.0] * len(rewards), [0.0] * len(rewards)
    for rows in members.values():
        xs = [rewards[i] for i in rows]
        m = _lower_median(xs)
        mad = _lower_median([abs(x - m) for x in xs])
        n = len(xs)
        mu = sum(xs) / n
        sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1 if unbiased else n)) if n > (1 if unbiased else 0) else 0
        s = {"mad": mad + eps, "std": sd + eps, "mad_or_std": (mad if mad > 0 else sd) + eps, None: 1.0}[scale]
        s = s if s > 0 else 1.0
        ranked = sorted(rows, key=lambda i: (rewards[i], i))
        piv = ranked[(n - 1) // 2] if pivot == "rank" else min(i for i in rows if rewards[i] == m)
        a = {i: (rewards[i] - m) / s for i in rows}
        if rescale_nonzero:
            nonzero = [i for i in rows if abs(a[i]) > 1e-6]
            for i in nonzero:
                a[i] *= n / len(nonzero)
        for i in rows:
            adv[i] = a[i]
            weight[i] = 0.0 if i == piv else 1.0
    return adv, weight


def naive_gapo(
    rewards: list[float],
    group: list[int],
    *,
    valid: list[bool] | None = None,
    tau: float = 0.5,
    center: str = "median",
    normalize: bool = True,
    unbiased: bool = True,
    eps: float = 1e-6,
    singleton: str = "zero",
) -> list[float]:
    """Per-group loop of the GAPO code's behaviour (``find_shortest_covering_subarray``): sorted Python floats,
    windows of ``ceil(n * (100 tau) / 100)`` values, strict "<" keeps the first shortest window."""
    ok = valid if valid is not None else [True] * len(rewards)
    members: dict[int, list[int]] = {}
    for i, gid in enumerate(group):
        if ok[i]:
            members.setdefault(gid, []).append(i)
    out = [0.0] * len(rewards)
    for rows in members.values():
        xs = [rewards[i] for i in rows]
        n = len(xs)
        if n == 1:
            out[rows[0]] = 0.0 if singleton == "zero" else (xs[0] / (1 + eps) if normalize else xs[0])
            continue
        k = math.ceil(n * (tau * 100) / 100)
        srt = sorted(xs)
        best, start = math.inf, 0
        for j in range(n - k + 1):
            width = srt[j + k - 1] - srt[j]
            if width < best:
                best, start = width, j
        w = srt[start : start + k]
        if center == "median":
            q = w[k // 2] if k % 2 == 1 else (w[k // 2 - 1] + w[k // 2]) / 2
        else:
            q = w[0] + sum(x - w[0] for x in w) / k
        d = math.sqrt(sum((x - q) ** 2 for x in xs) / (n - 1 if unbiased else n))
        scale = d + eps if d + eps > 0 else 1.0  # eps = 0 on an all-equal group: every deviation is 0
        for i in rows:
            out[i] = (rewards[i] - q) / scale if normalize else rewards[i] - q
    return out


def reference_mc_dense(rewards: torch.Tensor, n: int, *, gsm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The MC-GRPO code's training-mode path (``lotusroot-kim/MC-GRPO@da07745``, ``_generate_and_score_completions``
    of ``grpo_trainer_math.py``; ``gsm``: of ``grpo_trainer_gsm.py``), transcribed: ``view(-1, G + 1)``,
    ``median(dim=1)``, MAD + 1e-3, no std division, the row at ``median.indices`` dropped; the GSM8K trainer then
    multiplies each group's advantages that are not ``isclose(A, 0, atol=1e-6)`` by (G + 1) / their count, in
    a Python loop over groups. Returns (advantages, keep mask)."""
    grouped = rewards.view(-1, n)
    med = grouped.median(dim=1)
    mad = (grouped - med.values[:, None]).abs().median(dim=1).values + 1e-3
    adv = (grouped - med.values[:, None]) / mad[:, None]
    if gsm:
        for row in adv:
            nonzero = ~torch.isclose(row, torch.zeros_like(row), atol=1e-6)
            if int(nonzero.sum()) > 0:
                row[nonzero] = row[nonzero] * (row.numel() / int(nonzero.sum()))
    drop = torch.zeros_like(grouped, dtype=torch.bool).scatter_(1, med.indices[:, None], True)
    return adv.reshape(-1), ~drop.reshape(-1)


# --------------------------------------------------------------------------------------- MC-GRPO oracles


def test_mc_grpo_binary_oracle_default_is_bounded_and_mad_is_the_code() -> None:
    # [0, 1, 1]: median 1 (rank (3 - 1) // 2 = 1 of [0, 1, 1]: row 1), MAD = lower median of [1, 0, 0] = 0.
    # default: MAD 0 -> the std, sqrt(1/3) = 0.57735: A_0 = -1 / (0.57735 + 0.001) = -1.72906.
    out = mc_grpo(t([0.0, 1.0, 1.0]), ids([0, 0, 0]))
    close(out.advantages, [-1 / (math.sqrt(1 / 3) + 1e-3), 0.0, 0.0])
    close(out.advantages[0], -1.72906, atol=1e-5)
    assert torch.equal(out.weight, t([1.0, 0.0, 1.0]))  # row 1 is the pivot, two rows carry gradient
    close(out.metrics["pivot_frac"], 1 / 3)
    close(out.metrics["zero_mad_group_frac"], 1.0)
    close(out.metrics["median_tie_group_frac"], 1.0)
    # scale="mad" is the authors' code: MAD + 1e-3 = 0.001, so A_0 = -1000
    code = mc_grpo(t([0.0, 1.0, 1.0]), ids([0, 0, 0]), scale="mad")
    close(code.advantages, [-1000.0, 0.0, 0.0])
    assert torch.equal(code.weight, out.weight)


def test_mc_grpo_continuous_oracle() -> None:
    # [0.2, 0.5, 0.9] -> median 0.5, MAD = median(0.3, 0, 0.4) = 0.3 > 0: every scale="mad*" gives
    # A = [-0.3/0.301, 0, 0.4/0.301].
    for scale in ("mad_or_std", "mad"):
        out = mc_grpo(t([0.2, 0.5, 0.9], D), ids([4, 4, 4]), scale=scale)  # type: ignore[arg-type]
        close(out.advantages, [-0.3 / 0.301, 0.0, 0.4 / 0.301], atol=1e-12, rtol=1e-12)
        assert torch.equal(out.weight, t([1.0, 0.0, 1.0], D))
        close(out.metrics["zero_mad_group_frac"], 0.0)


def test_mc_grpo_pivot_rules_differ_only_among_tied_rows() -> None:
    # [1, 1, 1, 1, 0] (G = 4): sorted by (reward, row): 0 (row 4), 1 (row 0), 1 (row 1), 1 (row 2), 1 (row 3);
    # rank (5 - 1) // 2 = 2 is row 1 ("rank", the code's torch.median index); the lowest tied row is row 0.
    r, g = t([1.0, 1.0, 1.0, 1.0, 0.0]), ids([0] * 5)
    rank, first = mc_grpo(r, g), mc_grpo(r, g, pivot="first")
    assert rank.weight.tolist() == [1, 0, 1, 1, 1]
    assert first.weight.tolist() == [0, 1, 1, 1, 1]
    assert torch.equal(rank.advantages, first.advantages)
    # MAD 0 -> std of [1, 1, 1, 1, 0] = sqrt(0.2) = 0.44721: A_4 = -1 / 0.448214 = -2.23108
    close(rank.advantages, [0, 0, 0, 0, -1 / (math.sqrt(0.2) + 1e-3)])
    close(rank.advantages[4], -2.23108, atol=1e-5)
    assert r.median(0).indices.item() == 1  # torch.median on the CPU picks the same row as "rank"
    # the code: -1 / 0.001 = -1000; the GSM8K trainer's rescale: 1 non-zero of 5 -> x 5 = -5000
    close(mc_grpo(r, g, scale="mad").advantages, [0, 0, 0, 0, -1000.0])
    close(mc_grpo(r, g, scale="mad", rescale_nonzero=True).advantages, [0, 0, 0, 0, -5000.0])
    close(mc_grpo(r, g, rescale_nonzero=True).advantages, [0, 0, 0, 0, -5 / (math.sqrt(0.2) + 1e-3)])


def test_mc_grpo_rescale_nonzero_hand_examples() -> None:
    # [0.1, 0.5, 0.9]: median 0.5, MAD = median(0.4, 0, 0.4) = 0.4 -> A = [-0.4, 0, 0.4] / 0.401; two non-zero
    # of three -> x 1.5: [-0.6/0.401, 0, 0.6/0.401] = [-1.496259, 0, 1.496259].
    out = mc_grpo(t([0.1, 0.5, 0.9], D), ids([0, 0, 0]), rescale_nonzero=True)
    close(out.advantages, [-0.6 / 0.401, 0.0, 0.6 / 0.401], atol=1e-12, rtol=1e-12)
    close(out.advantages[2], 1.496259, atol=1e-6)
    # [0.5, 0.2, 0.5, 0.9, 0.5], scale="mad": sorted .2 (row 1), .5 (rows 0, 2, 4), .9 (row 3): median .5, pivot
    # row 2 (rank 2); |dev| sorted [0, 0, 0, .3, .4] -> MAD 0: A = [0, -300, 0, 400, 0]; 2 of 5 non-zero -> x 2.5.
    gsm = mc_grpo(t([0.5, 0.2, 0.5, 0.9, 0.5], D), ids([0] * 5), scale="mad", rescale_nonzero=True)
    close(gsm.advantages, [0.0, -750.0, 0.0, 1000.0, 0.0], atol=1e-9, rtol=1e-9)
    assert gsm.weight.tolist() == [1, 1, 0, 1, 1]
    # all-equal groups have no non-zero advantage: left at 0; invalid rows count in neither n nor the non-zeros
    flat = mc_grpo(t([0.3, 0.3, 0.3]), ids([0, 0, 0]), rescale_nonzero=True)
    assert torch.equal(flat.advantages, torch.zeros(3))
    masked = mc_grpo(
        t([0.1, 0.5, 0.9, 7.0], D), ids([0] * 4), rescale_nonzero=True, valid=torch.tensor([True, True, True, False])
    )
    close(masked.advantages, [-0.6 / 0.401, 0.0, 0.6 / 0.401, 0.0], atol=1e-12, rtol=1e-12)


def test_mc_grpo_hand_example_ragged() -> None:
    # group 7, n = 5: [3, -1, 7, 2, 2] sorted [-1, 2, 2, 3, 7] -> median 2 (rows 3 and 4; rank 2 is row 4, the
    #   lowest tied row is row 3); |dev| = [1, 3, 5, 0, 0] sorted [0, 0, 1, 3, 5] -> MAD 1.
    # group -2, n = 4 (even): [.4, .1, .3, .8] -> lower median .3 (row 7); |dev| sorted [0, .1, .2, .5] -> MAD .1.
    # group 9, n = 2: [5, 2] -> lower median 2 (row 10), |dev| sorted [0, 3] -> MAD 0: the default divides by
    #   the std 3/sqrt(2) = 2.12132 + 0.001, scale="mad" by 0.001.
    r = t([3.0, -1.0, 7.0, 2.0, 2.0, 0.4, 0.1, 0.3, 0.8, 5.0, 2.0], D)
    g = ids([7, 7, 7, 7, 7, -2, -2, -2, -2, 9, 9])
    s1, s2, s3 = 1.001, 0.101, 3 / math.sqrt(2) + 0.001
    expected = [1 / s1, -3 / s1, 5 / s1, 0, 0, 0.1 / s2, -0.2 / s2, 0, 0.5 / s2, 3 / s3, 0]
    out = mc_grpo(r, g)
    close(out.advantages, expected, atol=1e-9, rtol=1e-9)
    close(out.advantages[9], 1.413547, atol=1e-6)
    assert out.weight.tolist() == [1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0]
    assert mc_grpo(r, g, pivot="first").weight.tolist() == [1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0]
    close(mc_grpo(r, g, scale="mad").advantages, [*expected[:9], 3 / 0.001, 0], atol=1e-9, rtol=1e-9)
    close(out.metrics["pivot_frac"], 3 / 11)
    close(out.metrics["zero_mad_group_frac"], 1 / 3)
    close(out.metrics["median_tie_group_frac"], 1 / 3)
    # std option: group std over all G + 1 rollouts (pivot included), + eps
    sd = statistics.stdev([0.2, 0.5, 0.9])
    close(
        mc_grpo(t([0.2, 0.5, 0.9], D), ids([0, 0, 0]), scale="std").advantages,
        [-0.3 / (sd + 1e-3), 0, 0.4 / (sd + 1e-3)],
    )
    pop = statistics.pstdev([0.2, 0.5, 0.9])
    std_pop = mc_grpo(t([0.2, 0.5, 0.9], D), ids([0, 0, 0]), scale="std", unbiased=False, eps=0.0)
    close(std_pop.advantages, [-0.3 / pop, 0, 0.4 / pop])
    close(mc_grpo(t([0.2, 0.5, 0.9], D), ids([0, 0, 0]), scale=None).advantages, [-0.3, 0.0, 0.4])


@pytest.mark.parametrize("n", [3, 4, 5, 9])
def test_mc_grpo_matches_reference_code_path(n: int) -> None:
    # scale="mad" against the transcribed code (CPU torch.median): advantages and dropped rows, pivot for pivot,
    # on continuous rewards and on binary and few-level rewards with many tied medians; the GSM8K rescale too.
    gen = torch.Generator().manual_seed(n)
    levels = torch.tensor([0.0, 1.0, 1.5, 2.0, 3.0])  # the GSM8K accuracy (0, 1.5, 2) + format (0, 1) sums
    for r in (
        torch.rand(64 * n, generator=gen),
        (torch.rand(64 * n, generator=gen) > 0.5).float(),
        levels[torch.randint(0, 5, (64 * n,), generator=gen)],
    ):
        g = torch.arange(64).repeat_interleave(n)
        for gsm in (False, True):
            adv, keep = reference_mc_dense(r, n, gsm=gsm)
            out = mc_grpo(r, g, scale="mad", rescale_nonzero=gsm)
            close(out.advantages, adv)
            assert torch.equal(out.weight.bool(), keep)
        assert out.weight.view(-1, n).sum(1).eq(n - 1).all()  # G rows per prompt carry gradient
        close(out.metrics["pivot_frac"], 1 / n)
        # interleaved groups (each group's rows keep their relative order): the same rows are dropped
        perm = torch.arange(64 * n).view(64, n).t().reshape(-1)
        moved = mc_grpo(r[perm], g[perm], scale="mad")
        assert torch.equal(moved.weight, out.weight[perm])


def test_mc_grpo_pivot_leaves_the_loss() -> None:
    # policy_loss(seq_weight=weight) equals the loss on the rows left after deleting the pivots (the code's way).
    gen = torch.Generator().manual_seed(1)
    r = torch.rand(12, generator=gen, dtype=D)
    g = torch.arange(4).repeat_interleave(3)
    out = mc_grpo(r, g)
    logp = torch.randn(12, 5, generator=gen, dtype=D) * 0.1 - 1
    old = logp + torch.randn(12, 5, generator=gen, dtype=D) * 0.05
    mask = torch.rand(12, 5, generator=gen) > 0.2
    mask[:, 0] = True
    keep = out.weight.bool()
    for agg in ("token-mean", "seq-mean-token-mean"):
        weighted = policy_loss(logp, old, out.advantages, mask, agg=agg, seq_weight=out.weight).loss
        dropped = policy_loss(logp[keep], old[keep], out.advantages[keep], mask[keep], agg=agg).loss
        close(weighted, dropped, atol=1e-12, rtol=1e-12)


def test_mc_grpo_default_keeps_a_binary_reward_loss_bounded() -> None:
    # Tied binary rewards (MAD 0 in every group): the code's scale gives |A| = 1000 and a loss of order 100; the
    # default keeps |A| <= sqrt(2 (n - 1)) and the loss of the same order as GRPO's.
    gen = torch.Generator().manual_seed(5)
    r = (torch.rand(48, generator=gen) < 0.3).float()
    g = torch.arange(16).repeat_interleave(3)
    logp = (torch.randn(48, 6, generator=gen) * 0.1 - 1).requires_grad_()
    mask = torch.ones(48, 6, dtype=torch.bool)
    losses = {}
    for scale in ("mad_or_std", "mad"):
        out = mc_grpo(r, g, scale=scale)  # type: ignore[arg-type]
        losses[scale] = policy_loss(logp, logp.detach(), out.advantages, mask, seq_weight=out.weight).loss
    assert float(mc_grpo(r, g).advantages.abs().max()) <= math.sqrt(2 * 2)
    assert abs(float(losses["mad_or_std"].detach())) < 3.0
    assert abs(float(losses["mad"].detach())) > 100.0


def test_mc_grpo_all_equal_and_singletons() -> None:
    r = t([0.3, 0.3, 0.3, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 2.0])
    g = ids([0, 0, 0, 1, 1, 1, 1, 2, 2, 2])
    out = mc_grpo(r, g)
    assert torch.equal(out.advantages[:7], torch.zeros(7))  # all-equal: exactly 0
    # the pivot is still dropped: rank 1 of each all-equal group, the median 1.0 (row 8) of the last
    assert out.weight.tolist() == [1, 0, 1, 1, 0, 1, 1, 1, 0, 1]
    assert mc_grpo(r, g, pivot="first").weight.tolist() == [0, 1, 1, 0, 1, 1, 1, 1, 0, 1]
    close(out.metrics["zero_variance_group_frac"], 2 / 3)
    with pytest.raises(InputError) as err:
        mc_grpo(t([1.0, 0.0, 2.0]), ids([0, 0, 5]))
    assert err.value.argument == "group"
    with pytest.raises(InputError):  # a singleton made by the valid mask
        mc_grpo(t([1.0, 0.0, 2.0]), ids([0, 0, 0]), valid=torch.tensor([True, False, False]))
    for rule in ("rank", "first"):
        r4, g4 = t([1.0, 0.0, 2.0, 4.0]), ids([0, 0, 0, 5])
        lone = mc_grpo(r4, g4, singleton="pivot", pivot=rule)  # type: ignore[arg-type]
        assert lone.advantages[3].item() == 0.0
        assert lone.weight[3].item() == 0.0
        close(lone.metrics["singleton_group_frac"], 0.5)
    with rolloutopt.checks(False):  # no host sync with checks off: a singleton is its own pivot
        assert mc_grpo(t([1.0, 0.0, 2.0, 4.0]), ids([0, 0, 0, 5])).weight[3].item() == 0.0


@pytest.mark.parametrize("fill", [5.0, math.nan, math.inf])
def test_mc_grpo_invalid_rows(fill: float) -> None:
    r = t([1.0, 0.0, fill, 0.5, 0.0, 0.2, 2.0, 9.0])
    g = ids([0, 0, 0, 0, 1, 1, 1, 1])
    valid = torch.tensor([True, True, False, True, True, True, True, False])
    keep = valid.nonzero().squeeze(1)
    for rule in ("rank", "first"):
        out = mc_grpo(r, g, valid=valid, pivot=rule)  # type: ignore[arg-type]
        ref = mc_grpo(r[keep], g[keep], pivot=rule)  # type: ignore[arg-type]
        close(out.advantages[keep], ref.advantages)
        assert torch.equal(out.weight[keep], ref.weight)
        assert out.advantages[~valid].eq(0).all() and out.weight[~valid].eq(0).all()
        close(out.metrics["pivot_frac"], 2 / 6)
        assert all(torch.isfinite(m) and m.ndim == 0 and not m.requires_grad for m in out.metrics.values())
    nothing = mc_grpo(r.nan_to_num(), g, valid=torch.zeros(8, dtype=torch.bool))
    assert nothing.advantages.eq(0).all() and nothing.weight.eq(0).all()
    assert all(torch.isfinite(m) for m in nothing.metrics.values())


def test_nan_reward_message_names_the_valid_keyword() -> None:
    for fn in (mc_grpo, gapo):
        with pytest.raises(InputError) as err:
            fn(t([1.0, math.nan, 0.0]), ids([0, 0, 0]))
        assert err.value.argument == "rewards"
        assert "valid=" in err.value.fix and "mask those positions" not in err.value.fix
        out = fn(t([1.0, math.nan, 0.0, 0.5]), ids([0, 0, 0, 0]), valid=torch.tensor([True, False, True, True]))
        assert torch.isfinite(out.advantages).all()


@pytest.mark.parametrize(
    "call",
    [
        lambda r, g, v: mc_grpo(r, g, valid=v),
        lambda r, g, v: mc_grpo(r, g, scale="mad", pivot="first", rescale_nonzero=True, valid=v),
        lambda r, g, v: gapo(r, g, valid=v),
        lambda r, g, v: gapo(r, g, center="mean", singleton="raw", valid=v),
    ],
)
@pytest.mark.parametrize("masked", [False, True])
def test_empty_batch_gives_empty_outputs_and_zero_metrics(call: Callable[..., Any], masked: bool) -> None:
    r = torch.zeros(0, dtype=D, requires_grad=True)
    v = torch.zeros(0, dtype=torch.bool) if masked else None
    out = call(r, ids([]), v)
    assert out.advantages.shape == (0,) and out.weight.shape == (0,) and out.advantages.dtype == D
    full = call(t([0.0, 1.0, 0.5], D), ids([0, 0, 0]), None if v is None else torch.ones(3, dtype=torch.bool))
    assert set(out.metrics) == set(full.metrics)
    assert all(m.ndim == 0 and float(m) == 0.0 and not m.requires_grad for m in out.metrics.values())
    loss = policy_loss(torch.zeros(0, 4), torch.zeros(0, 4), out.advantages, torch.zeros(0, 4, dtype=torch.bool))
    assert float(loss.loss.detach()) == 0.0
    out.advantages.sum().backward()  # still part of the graph of the (empty) rewards
    assert r.grad is not None and r.grad.shape == (0,)
    with rolloutopt.checks(False):
        assert call(r.detach(), ids([]), v).advantages.shape == (0,)
    with pytest.raises(InputError) as err:  # the shapes are still checked
        call(t([1.0]), ids([]), v)
    assert err.value.argument == "group"


# ------------------------------------------------------------------------------------------ GAPO oracles

GAPO_R = [0.0, 0.1, 0.2, 0.3, 0.9, 1.0, 1.0, 1.0]


def test_gapo_hand_oracle() -> None:
    # tau 0.5 -> k 4; best window [.9, 1, 1, 1] (range .1); Q = 1; d = sqrt(2.95/7).
    out = gapo(t(GAPO_R), ids([3] * 8))
    close(out.advantages, [-1.5404, -1.3864, -1.2323, -1.0783, -0.1540, 0, 0, 0], atol=1e-4)
    d = math.sqrt(2.95 / 7)
    close(gapo(t(GAPO_R, D), ids([3] * 8)).advantages, [(x - 1.0) / (d + 1e-6) for x in GAPO_R], atol=1e-12)
    assert (out.advantages <= 0).all()  # the dense cluster sits at the top
    close(
        grpo(t(GAPO_R), ids([3] * 8)).advantages,
        [-1.249, -1.027, -0.805, -0.583, 0.750, 0.972, 0.972, 0.972],
        atol=1e-3,
    )
    assert torch.equal(out.weight, torch.ones(8))
    close(out.metrics["interval_frac"], 0.5)
    close(out.metrics["interval_width_mean"], 0.1)
    close(out.metrics["baseline_shift_mean"], 1.0 - sum(GAPO_R) / 8)
    close(out.metrics["excluded_frac"], 0.0)


def test_gapo_hand_examples() -> None:
    # n = 6, tau .5 -> k = 3; sorted [0, 1, 2, 2.5, 3, 10]; widths [2, 1.5, 1, 7.5] -> window [2, 2.5, 3], Q = 2.5.
    r = t([10.0, 2.0, 0.0, 3.0, 1.0, 2.5], D)
    g = ids([0] * 6)
    d = math.sqrt(sum((x - 2.5) ** 2 for x in r.tolist()) / 5)
    close(gapo(r, g).advantages, [(x - 2.5) / (d + 1e-6) for x in r.tolist()])
    close(gapo(r, g, normalize=False).advantages, [x - 2.5 for x in r.tolist()])
    close(gapo(r, g, center="mean").advantages, [(x - 2.5) / (d + 1e-6) for x in r.tolist()])  # mean = median here
    # even k: tau 2/3 -> k = 4: widths [2.5, 2, 8] -> [1, 2, 2.5, 3]; median (2 + 2.5)/2 = 2.25; mean 2.125.
    dev = [x - 2.25 for x in r.tolist()]
    close(gapo(r, g, tau=2 / 3, normalize=False).advantages, dev)
    close(gapo(r, g, tau=2 / 3, center="mean", normalize=False).advantages, [x - 2.125 for x in r.tolist()])
    pop = math.sqrt(sum(x * x for x in dev) / 6)
    close(gapo(r, g, tau=2 / 3, unbiased=False, eps=0.0).advantages, [x / pop for x in dev])
    # ties between windows keep the first (strict "<"): [0, 1, 2, 3], k = 2 -> window [0, 1], Q = 0.5
    close(gapo(t([3.0, 2.0, 1.0, 0.0], D), ids([0] * 4), normalize=False).advantages, [2.5, 1.5, 0.5, -0.5])
    # tau = 1: the whole group, Q = its (average) median
    close(gapo(r, g, tau=1.0, normalize=False).advantages, [x - 2.25 for x in r.tolist()])


def test_gapo_covering_size_matches_the_code() -> None:
    # n = 20, tau = .55: the code's ceil(20 * 55.00000000000001 / 100) = 12, a naive ceil(20 * .55) = 11.
    assert math.ceil(20 * 0.55) == 11
    assert math.ceil(20 * (0.55 * 100) / 100) == 12
    r = torch.arange(20, dtype=D).flip(0)  # equal spacing: every window has the same width, the first wins
    g = ids([0] * 20)
    # k = 12 -> window [0..11], median (5 + 6)/2 = 5.5 (k = 11 would give 5).
    close(gapo(r, g, tau=0.55, normalize=False).advantages, r - 5.5)
    close(torch.tensor(naive_gapo(r.tolist(), g.tolist(), tau=0.55, normalize=False), dtype=D), r - 5.5)


def test_gapo_singletons_all_equal_and_invalid() -> None:
    r = t([1.0, 0.0, 2.5, 0.7, 0.7, 0.7])
    g = ids([0, 0, 5, 2, 2, 2])
    with pytest.warns(UserWarning, match="size 1"):
        zero = gapo(r, g)  # the implicit default warns ...
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(gapo(r, g, singleton="zero").advantages, zero.advantages)  # ... an explicit "zero" not
    assert zero.advantages[2].item() == 0.0
    assert torch.equal(zero.advantages[3:], torch.zeros(3))  # all-equal: exactly 0
    close(zero.metrics["singleton_group_frac"], 1 / 3)
    close(zero.metrics["zero_variance_group_frac"], 1 / 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raw = gapo(r, g, singleton="raw")
        close(raw.advantages[2], 2.5 / (1 + 1e-6))  # the code's (verl's) convention: Q = 0, d = 1
        assert gapo(r, g, singleton="raw", normalize=False).advantages[2].item() == 2.5
    close(raw.advantages[:2], gapo(r[:2], g[:2]).advantages)  # the singleton does not change its siblings
    # all-equal windows of the mean variant are exact too (window mean shifted by its first value)
    tenth = torch.full((7,), 0.1)
    assert torch.equal(gapo(tenth, ids([1] * 7), center="mean").advantages, torch.zeros(7))
    # invalid rows
    for fill in (5.0, math.nan):
        rr = t([1.0, 0.0, fill, 0.5, 0.2, 4.0])
        gg = ids([0, 0, 0, 0, 1, 1])
        valid = torch.tensor([True, True, False, True, True, True])
        keep = valid.nonzero().squeeze(1)
        out = gapo(rr, gg, valid=valid)
        close(out.advantages[keep], gapo(rr[keep], gg[keep]).advantages)
        assert out.advantages[2].item() == 0.0 and out.weight[2].item() == 0.0
        assert all(torch.isfinite(m) and m.ndim == 0 and not m.requires_grad for m in out.metrics.values())
    nothing = gapo(t([1.0, 2.0]), ids([0, 0]), valid=torch.zeros(2, dtype=torch.bool))
    assert nothing.advantages.eq(0).all() and all(torch.isfinite(m) for m in nothing.metrics.values())


def test_registry_and_groups_object() -> None:
    r3, g3 = t([0.0, 1.0, 0.5]), ids([0, 0, 0])
    for name, fn in (("mc_grpo", mc_grpo), ("gapo", gapo)):  # the registered method computes the function
        assert torch.equal(get(name)(r3, g3).advantages, fn(r3, g3).advantages)
    assert {"mc_grpo", "gapo"} <= set(names())
    gen = torch.Generator().manual_seed(3)
    r = torch.randn(40, generator=gen)
    g = torch.randint(-5, 9, (40,), generator=gen)
    groups = Groups(g)
    a, b = mc_grpo(r, groups, singleton="pivot"), mc_grpo(r, g, singleton="pivot")
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.weight, b.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(gapo(r, groups).advantages, gapo(r, g).advantages)
    assert mc_grpo(t([0.0, 1.0, 2.0]).bfloat16(), ids([0, 0, 0])).advantages.dtype == torch.float32
    assert gapo(t([0.0, 1.0, 2.0], D), ids([0, 0, 0])).advantages.dtype == D


# ----------------------------------------------------------------------------------------- bad input

R4, G4 = t([1.0, 0.0, 0.5, 1.0]), ids([0, 0, 0, 0])


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("rewards", lambda: mc_grpo(R4[:, None], G4)),
        ("rewards", lambda: gapo(ids([1, 0, 0, 1]), G4)),
        ("rewards", lambda: mc_grpo([1.0, 0.0, 0.5, 1.0], G4)),
        ("rewards", lambda: mc_grpo(t([1.0, math.nan, 0.0, 1.0]), G4)),
        ("rewards", lambda: gapo(t([1.0, 0.0, math.inf, 1.0]), G4)),
        ("group", lambda: mc_grpo(R4, ids([0, 0, 1]))),
        ("group", lambda: gapo(R4, G4.float())),
        ("group", lambda: mc_grpo(R4, ids([0, 0, 0, 1]))),  # a singleton
        ("scale", lambda: mc_grpo(R4, G4, scale="iqr")),
        ("eps", lambda: mc_grpo(R4, G4, eps=-1e-3)),
        ("eps", lambda: mc_grpo(R4, G4, scale="mad", eps=0.0)),  # a MAD of 0 beside a non-zero deviation
        ("eps", lambda: gapo(R4, G4, eps=math.nan)),
        ("singleton", lambda: mc_grpo(R4, G4, singleton="zero")),
        ("pivot", lambda: mc_grpo(R4, G4, pivot="lowest")),
        ("pivot", lambda: mc_grpo(R4, G4, pivot=None)),
        ("rescale_nonzero", lambda: mc_grpo(R4, G4, rescale_nonzero=1)),
        ("rewards", lambda: mc_grpo(ids([]), ids([]))),  # an empty batch is still validated
        ("group", lambda: gapo(t([]), ids([]).float())),
        ("valid", lambda: mc_grpo(t([]), ids([]), valid=torch.ones(2, dtype=torch.bool))),
        ("eps", lambda: mc_grpo(t([]), ids([]), scale="mad", eps=0.0)),
        ("singleton", lambda: gapo(R4, G4, singleton="raise")),
        ("tau", lambda: gapo(R4, G4, tau=0.0)),
        ("tau", lambda: gapo(R4, G4, tau=1.5)),
        ("tau", lambda: gapo(R4, G4, tau=50)),  # a percentage, as the code's internal tau
        ("tau", lambda: gapo(R4, G4, tau=True)),
        ("center", lambda: gapo(R4, G4, center="mode")),
        ("normalize", lambda: gapo(R4, G4, normalize="std")),
        ("valid", lambda: mc_grpo(R4, G4, valid=torch.ones(3, dtype=torch.bool))),
        ("valid", lambda: gapo(R4, G4, valid=torch.tensor([0, 1, 2, 1]))),
    ],
)
def test_bad_input_names_the_argument(argument: str, call: Callable[[], Any]) -> None:
    with pytest.raises(InputError) as err:
        call()
    assert err.value.argument == argument, str(err.value)
    assert isinstance(err.value, ValueError)


# ------------------------------------------------------------------------------------------- properties


@st.composite
def batches(draw: st.DrawFn, *, min_size: int = 1, max_size: int = 7, equal: bool = False) -> dict[str, Any]:
    n_groups = draw(st.integers(1, 5))
    if equal:
        sizes = [draw(st.integers(max(min_size, 2), max_size))] * n_groups
    else:
        sizes = draw(st.lists(st.integers(min_size, max_size), min_size=n_groups, max_size=n_groups))
    labels = draw(st.lists(st.integers(-(2**40), 2**40), min_size=n_groups, max_size=n_groups, unique=True))
    group = [lab for lab, k in zip(labels, sizes, strict=True) for _ in range(k)]
    b = len(group)
    kind = draw(st.sampled_from(["binary", "dyadic", "float"]))
    values = {
        "binary": st.sampled_from([0.0, 1.0]),
        "dyadic": st.integers(-40, 40).map(lambda x: x / 8),  # exact in binary: ties and exact shifts
        "float": st.floats(-10, 10, width=32),
    }[kind]
    rewards = draw(st.lists(values, min_size=b, max_size=b))
    perm = draw(st.permutations(list(range(b))))
    valid = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=b, max_size=b)))
    return {"rewards": rewards, "group": [group[i] for i in perm], "valid": valid, "kind": kind}


def _tensors(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    v = None if batch["valid"] is None else torch.tensor(batch["valid"])
    return torch.tensor(batch["rewards"], dtype=D), torch.tensor(batch["group"]), v


MC_KW: list[dict[str, Any]] = [
    {},
    {"scale": "mad"},
    {"scale": "mad", "pivot": "first", "rescale_nonzero": True},
    {"scale": "std", "pivot": "first"},
    {"scale": "mad_or_std", "unbiased": False, "rescale_nonzero": True},
    {"scale": None},
]
GAPO_KW: list[dict[str, Any]] = [
    {},
    {"center": "mean"},
    {"tau": 0.7, "normalize": False},
    {"tau": 0.3, "unbiased": False, "singleton": "raw"},
    {"tau": 1.0, "eps": 0.0},
]


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches())
def test_matches_naive_loops(batch: dict[str, Any]) -> None:
    r, g, v = _tensors(batch)
    for kw in MC_KW:
        out = mc_grpo(r, g, valid=v, singleton="pivot", **kw)
        adv, weight = naive_mc(batch["rewards"], batch["group"], valid=batch["valid"], **kw)
        torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=D), atol=1e-9, rtol=1e-9, msg=str(kw))
        assert out.weight.tolist() == weight
    for kw in GAPO_KW:
        expected = naive_gapo(batch["rewards"], batch["group"], valid=batch["valid"], **kw)
        got = gapo(r, g, valid=v, **kw).advantages
        torch.testing.assert_close(got, torch.tensor(expected, dtype=D), atol=1e-9, rtol=1e-9, msg=str(kw))


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches(), data=st.data())
def test_permutation_and_relabelling(batch: dict[str, Any], data: st.DataObject) -> None:
    b = len(batch["rewards"])
    perm = data.draw(st.permutations(list(range(b))))
    labels = sorted(set(batch["group"]))
    relabel = relabel_map(data, labels)
    moved = {
        "rewards": [batch["rewards"][i] for i in perm],
        "group": [relabel[batch["group"][i]] for i in perm],
        "valid": None if batch["valid"] is None else [batch["valid"][i] for i in perm],
    }
    idx = torch.tensor(perm)
    (r, g, v), (r2, g2, v2) = _tensors(batch), _tensors(moved)
    for kw in MC_KW:
        base, other = (
            mc_grpo(r, g, valid=v, singleton="pivot", **kw),
            mc_grpo(r2, g2, valid=v2, singleton="pivot", **kw),
        )
        torch.testing.assert_close(other.advantages, base.advantages[idx], atol=1e-10, rtol=1e-10)
        # which tied row is the pivot follows row order; tie-invariant: the weight per group and the pivot's value
        per_row, per_row2 = (
            Groups(g).broadcast(Groups(g).sum(base.weight)),
            Groups(g2).broadcast(Groups(g2).sum(other.weight)),
        )
        assert torch.equal(per_row2, per_row[idx])
        assert sorted(r2[(other.weight == 0) & (v2 if v2 is not None else True)].tolist()) == sorted(
            r[(base.weight == 0) & (v if v is not None else True)].tolist()
        )
        for key in base.metrics:
            torch.testing.assert_close(other.metrics[key], base.metrics[key])
    for kw in GAPO_KW:
        torch.testing.assert_close(gapo(r2, g2, valid=v2, **kw).advantages, gapo(r, g, valid=v, **kw).advantages[idx])


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches(equal=True))
def test_dense_fast_path_equals_ragged_path(batch: dict[str, Any]) -> None:
    r, g, _ = _tensors(batch)
    everything = torch.ones(len(r), dtype=torch.bool)  # a valid mask forces the ragged path
    assert Groups(g).dense_size is not None
    for kw in MC_KW:
        dense, ragged = mc_grpo(r, g, **kw), mc_grpo(r, g, valid=everything, **kw)
        torch.testing.assert_close(dense.advantages, ragged.advantages, atol=1e-8, rtol=1e-8)  # std: summation order
        assert torch.equal(dense.weight, ragged.weight)
    for kw in GAPO_KW:
        torch.testing.assert_close(gapo(r, g, **kw).advantages, gapo(r, g, valid=everything, **kw).advantages)


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches(), shift=st.integers(-1000, 1000), power=st.integers(-3, 3))
def test_affine_invariance(batch: dict[str, Any], shift: int, power: int) -> None:
    # A(c r + b; eps c) = A(r; eps) for c > 0 (exact powers of two and integer shifts on dyadic rewards keep
    # every comparison exact, so the same pivot and window are chosen); unscaled variants scale by c.
    batch = {**batch, "rewards": [round(x * 8) / 8 for x in batch["rewards"]]}  # dyadic
    r, g, v = _tensors(batch)
    c = 2.0**power
    moved = r * c + shift
    for kw in MC_KW:
        base = mc_grpo(r, g, valid=v, singleton="pivot", **kw)
        other = mc_grpo(moved, g, valid=v, singleton="pivot", **{**kw, "eps": 1e-3 * c})
        factor = c if kw.get("scale", "mad") is None else 1.0
        torch.testing.assert_close(other.advantages, base.advantages * factor, atol=1e-9, rtol=1e-9)
        assert torch.equal(other.weight, base.weight)
    for kw in GAPO_KW:
        base_adv = gapo(r, g, valid=v, **kw).advantages
        other_adv = gapo(moved, g, valid=v, **{**kw, "eps": kw.get("eps", 1e-6) * c}).advantages
        n = Groups(g).broadcast(Groups(g).count(v))
        single = n == 1  # verl's singleton convention (A = r) is not shift invariant
        factor = 1.0 if kw.get("normalize", True) else c
        torch.testing.assert_close(other_adv[~single], base_adv[~single] * factor, atol=1e-9, rtol=1e-9)


@given(batch=batches(min_size=2))
def test_gapo_interval_limits(batch: dict[str, Any]) -> None:
    # tau <= 1/n: one-point windows all have width 0, the first wins -> Q = the group minimum;
    # tau = 1: the window is the whole group -> Q = its median (average of the two middle values).
    r, g, v = _tensors(batch)
    groups = Groups(g)
    n = groups.count(v)
    if v is not None and bool((n == 1).any()):
        return
    tiny = gapo(r, g, valid=v, tau=1e-9, normalize=False).advantages
    torch.testing.assert_close(tiny, (r - groups.broadcast(groups.min(r, v))) * (1.0 if v is None else v))
    full = gapo(r, g, valid=v, tau=1.0, normalize=False).advantages
    torch.testing.assert_close(full, (r - groups.broadcast(groups.median(r, v))) * (1.0 if v is None else v))


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(
    rewards=st.lists(st.floats(-(2.0**60), 2.0**60, width=32), min_size=1, max_size=24),
    group=st.lists(st.integers(0, 3), min_size=24, max_size=24),
    valid=st.lists(st.booleans(), min_size=24, max_size=24),
)
def test_finite_for_every_finite_input(rewards: list[float], group: list[int], valid: list[bool]) -> None:
    b = len(rewards)
    r, g, v = torch.tensor(rewards), torch.tensor(group[:b]), torch.tensor(valid[:b])
    for vv in (None, v):
        outs = [mc_grpo(r, g, valid=vv, singleton="pivot", **kw) for kw in MC_KW]
        outs += [gapo(r, g, valid=vv, **kw) for kw in GAPO_KW]
        for out in outs:
            assert torch.isfinite(out.advantages).all() and torch.isfinite(out.weight).all()
            assert all(torch.isfinite(m) for m in out.metrics.values())


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    g = ids([0, 0, 0, 4, 4, 4, 4, 9, 9, 2, 2, 2, 2, 2])
    valid = torch.ones(14, dtype=torch.bool)
    valid[10] = False
    r = torch.randn(14, dtype=D, generator=gen, requires_grad=True)
    fns: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda x: mc_grpo(x, g).advantages,
        lambda x: mc_grpo(x, g, scale="std", valid=valid).advantages,
        lambda x: mc_grpo(x, g, scale=None).advantages,
        lambda x: gapo(x, g).advantages,
        lambda x: gapo(x, g, center="mean", tau=0.6, valid=valid).advantages,
        lambda x: gapo(x, g, normalize=False, tau=0.3).advantages,
    ]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (r,))


# ------------------------------------------------------------------ MC-GRPO's motivation: fewer sign flips


def _sign_flip_rates(size: int, noise: str, prompts: int = 20_000, seed: int = 0) -> tuple[float, float]:
    """Monte Carlo over ``prompts`` prompts at once (one call per estimator).

    Rollout i of prompt p has true quality ``q = mu_p + z_i`` (``mu_p ~ N(0, 4)``, ``z_i ~ N(0, 1)``) and
    observed reward ``r = q + e_i``: ``e`` a heavy-tailed partial-credit/format term, either Student-t with
    2 degrees of freedom scaled by 0.5 (``"student_t"``) or a rare large outlier, ±8 with probability 0.05
    (``"outlier"``). The true expected-reward advantage of rollout i is ``q_i - mu_p = z_i``. A sign flip is
    ``sign(A_i) != sign(z_i)``, counted over rollouts that carry gradient: median baseline (mc_grpo) on
    ``size + 1`` rollouts with the pivot excluded, mean baseline (grpo) on the first ``size`` of them. Binary
    rewards cannot show the effect (the median of binary rewards is a majority vote, not a location estimate
    under heavy tails), so the rewards are continuous.
    """
    gen = torch.Generator().manual_seed(seed)
    n = size + 1
    mu = 2.0 * torch.randn(prompts, 1, generator=gen, dtype=D)
    z = torch.randn(prompts, n, generator=gen, dtype=D)
    if noise == "student_t":  # t_2 = N / sqrt(chi2_2 / 2), from normals only (the generator stays explicit)
        chi2 = torch.randn(prompts, n, 2, generator=gen, dtype=D).pow(2).sum(-1)
        e = 0.5 * torch.randn(prompts, n, generator=gen, dtype=D) / (chi2 / 2).sqrt()
    else:
        hit = torch.rand(prompts, n, generator=gen, dtype=D) < 0.05
        sign = torch.where(torch.rand(prompts, n, generator=gen, dtype=D) < 0.5, -1.0, 1.0)
        e = 8.0 * hit * sign
    r = mu + z + e
    g = torch.arange(prompts).repeat_interleave(n)
    med = mc_grpo(r.reshape(-1), g)
    carries = med.weight.bool()
    flips_med = (torch.sign(med.advantages) != torch.sign(z.reshape(-1)))[carries].double().mean()
    mean = grpo(r[:, :size].reshape(-1), torch.arange(prompts).repeat_interleave(size))
    flips_mean = (torch.sign(mean.advantages) != torch.sign(z[:, :size].reshape(-1))).double().mean()
    assert int(carries.sum()) == prompts * size  # G rollouts per prompt carry gradient in both
    # context only (not asserted): the mean baseline on all G + 1 rollouts, every one carrying gradient
    every = grpo(r.reshape(-1), g)
    flips_every = (torch.sign(every.advantages) != torch.sign(z.reshape(-1))).double().mean()
    return float(flips_med), float(flips_mean), float(flips_every)


@pytest.mark.parametrize("noise", ["student_t", "outlier"])
@pytest.mark.parametrize("size", [2, 4])
def test_median_baseline_flips_fewer_signs(size: int, noise: str) -> None:
    med, mean, every = _sign_flip_rates(size, noise)
    msg = (
        f"G={size} noise={noise}: sign-flip rate median(G+1, pivot out)={med:.4f} vs mean(G)={mean:.4f} "
        f"[context: mean(G+1)={every:.4f}]"
    )
    print(msg)
    assert med < mean - 0.02, msg


@given(batch=batches(min_size=2, max_size=5))
def test_mc_grpo_pivot_rules(batch: dict[str, Any]) -> None:
    # "first": the lowest tied row; "rank": the row at position (n - 1) // 2 of a stable sort by reward, which
    # is the tied row number (n - 1) // 2 - #(rows below the median) in row order. Both hold the lower median.
    r, g, v = _tensors(batch)
    groups = Groups(g)
    n = groups.count(v)
    if v is not None and bool((n == 1).any()):
        return
    ok = v if v is not None else torch.ones(len(r), dtype=torch.bool)
    med = groups.broadcast(groups.median(r, v, mode="lower"))
    tied = (r == med) & ok
    rows = torch.arange(len(r))
    below = groups.broadcast(groups.count((r < med) & ok))
    tied_before = torch.zeros(len(r), dtype=torch.long)  # tied rows of the group with a lower row index
    for i in range(len(r)):
        tied_before[i] = int((tied & (g == g[i]) & (rows < i)).sum())
    h = groups.broadcast(torch.div(n - 1, 2, rounding_mode="floor"))
    expected = {"first": tied & (tied_before == 0), "rank": tied & (tied_before == h - below)}
    for rule, want in expected.items():
        out = mc_grpo(r, g, valid=v, pivot=rule)  # type: ignore[arg-type]
        pivot = (out.weight == 0) & ok
        assert torch.equal(pivot, want), rule
        assert torch.equal(groups.count(pivot), (n > 0).long())  # one pivot per group with valid rows


@given(
    sizes=st.lists(st.integers(2, 9), min_size=1, max_size=6),
    data=st.data(),
    low=st.floats(-100, 100),
    gap=st.floats(1e-3, 100),
    unbiased=st.booleans(),
)
def test_mc_grpo_default_is_bounded_on_two_valued_rewards(
    sizes: list[int], data: st.DataObject, low: float, gap: float, unbiased: bool
) -> None:
    # Two-valued rewards (binary correctness, any two levels) always have MAD 0; the default then divides by the
    # std, so |A| <= range / std <= sqrt(2 (n - 1)) (sqrt(2 n) for the population std), whatever eps.
    g = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    hi = data.draw(st.lists(st.booleans(), min_size=len(g), max_size=len(g)))
    r = torch.where(torch.tensor(hi), low + gap, low).to(D)
    eps = data.draw(st.sampled_from([0.0, 1e-3, 1.0]))
    out = mc_grpo(r, g, unbiased=unbiased, eps=eps)
    n = torch.tensor(sizes, dtype=D).repeat_interleave(torch.tensor(sizes))
    bound = (2 * (n - 1)).sqrt() if unbiased else (2 * n).sqrt()
    assert bool((out.advantages.abs() <= bound * (1 + 1e-9)).all())
    assert float(out.metrics["zero_mad_group_frac"]) == 1.0


# ------------------------------------------------------------------------- the integer segment sort


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("equal", [False, True])
def test_segment_sort_is_groups_sort(dtype: torch.dtype, masked: bool, equal: bool) -> None:
    # The sort behind both estimators (integer keys: a radix sort from 32,768 rows on) gives exactly the
    # permutation of Groups.sort: ties (many, and -0.0 against 0.0) in row order, invalid rows last.
    from rolloutopt.advantages.median import _segment_sort

    gen = torch.Generator().manual_seed(7)
    b = 40_000
    ids = torch.arange(b // 8).repeat_interleave(8) if equal else torch.randint(-50, 5000, (b,), generator=gen)
    ids = ids[torch.randperm(b, generator=gen)]
    values = torch.tensor([-2.5, -1.0, -0.0, 0.0, 0.5, 3.0, -3e38, 3e38], dtype=dtype)
    x = torch.where(
        torch.rand(b, generator=gen) < 0.5,
        values[torch.randint(0, 8, (b,), generator=gen)],
        torch.randn(b, generator=gen, dtype=dtype),
    )
    valid = torch.rand(b, generator=gen) > 0.2 if masked else None
    g = Groups(ids)
    perm, key = _segment_sort(g, x, valid)
    assert torch.equal(perm, g.sort(x, valid)[0])
    assert torch.equal(key, x if valid is None else torch.where(valid, x, math.inf))
    with rolloutopt.checks(False):  # NaNs (of either sign) sort last, as torch.sort puts them, ties in row order
        y = torch.where(torch.rand(b, generator=gen) < 0.1, torch.tensor(-math.nan, dtype=dtype), x)
        y = torch.where(torch.rand(b, generator=gen) < 0.1, torch.tensor(math.nan, dtype=dtype), y)
        assert torch.equal(_segment_sort(g, y, valid)[0], g.sort(y, valid)[0])
        assert torch.equal(_segment_sort(g, y.abs(), valid, nonneg=True)[0], g.sort(y.abs(), valid)[0])


def test_large_batch_matches_small_batches() -> None:
    # 40,000 rollouts (radix-sorted) give the same outputs as each group computed on its own (comparison-sorted).
    gen = torch.Generator().manual_seed(11)
    sizes = torch.randint(1, 20, (4000,), generator=gen)
    ids = torch.repeat_interleave(torch.arange(4000), sizes)
    b = ids.numel()
    r = torch.randint(-4, 5, (b,), generator=gen).float() / 4  # ties
    order = torch.randperm(b, generator=gen)
    ids, r = ids[order], r[order]
    big = mc_grpo(r, ids, singleton="pivot")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        big_gapo = gapo(r, ids)
        for gid in (0, 1, 2, 3, 1234, 3999):
            rows = (ids == gid).nonzero().squeeze(1)
            small = mc_grpo(r[rows], ids[rows], singleton="pivot")
            assert torch.equal(big.advantages[rows], small.advantages)
            assert torch.equal(big.weight[rows], small.weight)
            assert torch.equal(big_gapo.advantages[rows], gapo(r[rows], ids[rows]).advantages)
