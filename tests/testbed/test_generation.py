"""The token-level generation simulator: determinism, shapes and dtypes, consistency of the signals, the ground
truth (signals degrade after the failure point), premature-stop bookkeeping by hand, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rolloutopt.control import ESR, replay
from rolloutopt.errors import InputError
from rolloutopt.testbed.generation import GenerationSimulator, SimulatedGeneration

SMALL = {"max_tokens": 128, "length_median": 60.0, "top_k": 8, "vocab_size": 512}


def batch(seed: int = 0, prompts: int = 16, **kw: Any) -> SimulatedGeneration:
    return GenerationSimulator(**{**SMALL, **kw}).sample(prompts, torch.Generator().manual_seed(seed))


def test_determinism_for_a_seed_and_no_global_rng() -> None:
    torch.manual_seed(0)
    before = torch.rand(1)
    a = batch(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), before)  # the global RNG was not touched by sample()
    b, c = batch(3), batch(4)
    for name in SimulatedGeneration.__dataclass_fields__:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.logp, c.logp)


def test_shapes_dtypes_and_ranges() -> None:
    b = batch(0, prompts=5, group_size=4)
    n, t, k = 20, 128, 8
    assert (b.num_rows, b.max_tokens) == (n, t)
    for name in ("logp", "entropy", "values", "confidence"):
        x = getattr(b, name)
        assert x.shape == (n, t) and x.dtype == torch.float32 and bool(torch.isfinite(x).all()), name
    assert b.topk_logp.shape == (n, t, k) and b.topk_logp.dtype == torch.float32
    for name in ("topk_ids", "teacher_topk_ids"):
        assert getattr(b, name).shape == (n, t, k) and getattr(b, name).dtype == torch.int64
    assert b.tokens.shape == (n, t) and b.tokens.dtype == torch.int64
    assert b.mask.dtype == torch.bool and b.degraded.dtype == torch.bool
    for name in ("group", "length", "fail_at", "answer_at"):
        assert getattr(b, name).shape == (n,) and getattr(b, name).dtype == torch.int64, name
    assert b.success.dtype == torch.bool and b.rewards.dtype == torch.float32
    assert b.group.tolist() == [i // 4 for i in range(n)]
    assert bool(((b.values >= 0) & (b.values <= 1)).all()) and bool(((b.confidence > 0) & (b.confidence < 1)).all())
    assert bool(((b.length >= 16) & (b.length <= t)).all())
    assert torch.equal(b.mask.sum(-1), b.length)
    assert torch.equal(b.rewards, b.success.float())


def test_distribution_is_consistent() -> None:
    b = batch(1)
    lp = b.topk_logp
    assert bool((lp.diff(dim=-1) <= 0).all())  # sorted descending
    assert bool((lp.exp().sum(-1) <= 1 + 1e-5).all())  # top-k mass at most 1
    assert bool((b.logp <= lp[..., 0] + 1e-6).all())  # the sampled token is never above the max
    assert bool((b.entropy >= 0).all())
    # the sampled token's log-prob is one of the top-k values, or below the k-th (a tail token)
    in_top = (lp == b.logp[..., None]).any(-1)
    assert bool((in_top | (b.logp < lp[..., -1])).all())
    # where the sampled token is in the top-k (and not a special token), its id is at that rank
    rank = (lp == b.logp[..., None]).float().argmax(-1)
    at = b.topk_ids.gather(-1, rank[..., None])[..., 0]
    assert bool((~in_top | (at == b.tokens)).all())
    # ids are distinct per step, student and teacher alike
    for ids in (b.topk_ids, b.teacher_topk_ids):
        assert bool((ids.sort(-1).values.diff(dim=-1) != 0).all())


def test_special_tokens_and_lengths() -> None:
    sim = GenerationSimulator(**SMALL, eos_id=7, marker_ids=(3, 5), answer_ids=(9,))
    b = sim.sample(32, torch.Generator().manual_seed(2))
    rows = torch.arange(b.num_rows)
    # EOS exactly at length - 1 of finished rows, nowhere else inside the response
    fin = b.finished
    assert bool((b.tokens[rows[fin], b.length[fin] - 1] == 7).all())
    inside_eos = (b.tokens == 7) & b.mask
    assert int(inside_eos.sum()) == int(fin.sum())
    assert bool(b.finished[b.success].all())  # successful rows always finish
    # the answer marker exactly at answer_at, and only there
    has = b.answer_at >= 0
    assert bool(has[b.success].all())
    assert bool((b.tokens[rows[has], b.answer_at[has]] == 9).all())
    assert int(((b.tokens == 9) & b.mask).sum()) == int(has.sum())
    # failing rows fail at or before their answer; ordinary ids never collide with special ones
    f = ~b.success
    assert bool((b.fail_at[f] >= 0).all()) and bool((b.fail_at[f] < b.length[f]).all())
    assert bool(((b.fail_at[f] <= b.answer_at[f]) | (b.answer_at[f] < 0)).all())
    assert bool((b.fail_at[b.success] == -1).all())
    special = torch.tensor([3, 5, 7, 9])
    ordinary = ~torch.isin(b.tokens, special)
    assert bool((b.tokens[ordinary] >= 0).all()) and bool((b.tokens < 512).all())
    # a special id in the teacher's top-k is the student's sampled token kept at the same rank
    teacher_special = torch.isin(b.teacher_topk_ids, special)
    assert bool((~teacher_special | (b.teacher_topk_ids == b.topk_ids)).all())
    # markers appear, and degraded is exactly "failing and t >= fail_at"
    assert int(torch.isin(b.tokens, torch.tensor([3, 5])).sum()) > 0
    t = torch.arange(b.max_tokens)
    expected = ~b.success[:, None] & (t[None, :] >= b.fail_at[:, None])
    assert torch.equal(b.degraded, expected)


def row_means(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    return (x * where).sum(-1) / where.sum(-1)


def test_signals_degrade_after_the_failure_point() -> None:
    """Within each failing row, the mean of a signal after its failure point minus the mean before it; over rows,
    the mean difference is many standard errors in the degrading direction (paired by row, so the per-row
    spread ``gap_row_std`` cancels)."""
    b = GenerationSimulator(max_tokens=512, length_median=200.0).sample(64, torch.Generator().manual_seed(11))
    before, after = ~b.degraded & b.mask, b.degraded & b.mask
    rows = (before.sum(-1) >= 10) & (after.sum(-1) >= 10)
    assert int(rows.sum()) > 100
    regret = b.topk_logp[..., 0] - b.logp
    overlap = (b.topk_ids[..., :, None] == b.teacher_topk_ids[..., None, :]).flatten(-2).sum(-1).float()
    marker = (b.tokens == 1).float()
    for name, x, sign in (
        ("regret", regret, 1),
        ("entropy", b.entropy, 1),
        ("sampled prob", b.logp.exp(), -1),
        ("top-1 prob", b.topk_logp[..., 0].exp(), -1),
        ("values", b.values, -1),
        ("teacher overlap", overlap, -1),
        ("markers", marker, 1),
    ):
        diff = sign * (row_means(x, after) - row_means(x, before))[rows]
        se = diff.std() / diff.numel() ** 0.5
        assert float(diff.mean()) > 5 * float(se), (name, float(diff.mean()), float(se))
    # success rows vs failing rows, over the whole response: mean value higher for success
    assert float(b.values[b.success[:, None] & b.mask].mean()) > float(b.values[~b.success[:, None] & b.mask].mean())


def test_no_degradation_when_the_gaps_are_equal() -> None:
    """The control: with gap_failed = gap_ok the entropy does not move at the failure point (paired, within 4 se)."""
    sim = GenerationSimulator(max_tokens=512, length_median=200.0, gap_ok=1.5, gap_failed=1.5)
    b = sim.sample(64, torch.Generator().manual_seed(11))
    before, after = ~b.degraded & b.mask, b.degraded & b.mask
    rows = (before.sum(-1) >= 10) & (after.sum(-1) >= 10)
    diff = (row_means(b.entropy, after) - row_means(b.entropy, before))[rows]
    assert abs(float(diff.mean())) < 4 * float(diff.std() / diff.numel() ** 0.5)


def test_premature_and_kept_tokens_by_hand() -> None:
    b = batch(5, prompts=4)
    succ = int(torch.nonzero(b.success)[0])
    fail = int(torch.nonzero(~b.success)[0])
    f, a = int(b.fail_at[fail]), int(b.answer_at[succ])
    n = b.num_rows
    stopped = torch.zeros(n, dtype=torch.bool)
    position = torch.full((n,), -1)
    stopped[[succ, fail]] = True
    # a failing row stopped exactly at its failure point: justified; one token before: premature
    position[fail], position[succ] = f, a
    prem = b.premature(stopped, position)
    assert not bool(prem[fail]) and bool(prem[succ])  # abandoning a success is premature wherever it happens
    assert not bool(b.premature(stopped, position, answer=True)[succ])  # an answer exit at its answer is fine
    position[succ] = a - 1
    assert bool(b.premature(stopped, position, answer=True)[succ])
    if f > 0:
        position[fail] = f - 1
        assert bool(b.premature(stopped, position)[fail])
    assert int(b.premature(stopped, position).sum()) <= 2  # rows not stopped are never premature
    kept = b.kept_tokens(stopped, position)
    assert int(kept[succ]) == a and int(kept[fail]) == int(position[fail]) + 1
    others = torch.ones(n, dtype=torch.bool)
    others[[succ, fail]] = False
    assert torch.equal(kept[others], b.length[others])


def test_replay_with_a_rule_gives_the_expected_savings() -> None:
    """ESR(n) keeps min(n, length) tokens of every row: the simulator's bookkeeping agrees with the rule's."""
    b = batch(6)
    res = replay(ESR(n=40), mask=b.mask, tokens=b.tokens)
    kept = b.kept_tokens(res.stopped, res.position)
    assert torch.equal(kept, b.length.clamp_max(40))
    assert torch.equal(kept, res.length)


def test_empty_batch() -> None:
    b = batch(0, prompts=0)
    assert b.num_rows == 0 and b.mask.shape == (0, 128) and b.topk_logp.shape == (0, 128, 8)
    assert b.premature(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize(
    ("kw", "arg"),
    [
        ({"max_tokens": 1}, "max_tokens"),
        ({"group_size": 0}, "group_size"),
        ({"top_k": 0}, "top_k"),
        ({"vocab_size": 20, "top_k": 10}, "vocab_size"),
        ({"pass_logit_std": -1.0}, "pass_logit_std"),
        ({"length_median": 0.0}, "length_median"),
        ({"length_sigma": float("nan")}, "length_sigma"),
        ({"fail_length_factor": 0.5}, "fail_length_factor"),
        ({"min_length": 1}, "min_length"),
        ({"min_length": 2000}, "min_length"),
        ({"fail_frac": (0.5, 0.2)}, "fail_frac"),
        ({"fail_frac": (0.1, 0.6)}, "fail_frac"),
        ({"answer_frac": (0.5, 1.5)}, "answer_frac"),
        ({"answer_frac": 0.5}, "answer_frac"),
        ({"gap_ok": 0.0}, "gap_ok"),
        ({"gap_failed": -1.0}, "gap_failed"),
        ({"eos_id": -1}, "eos_id"),
        ({"eos_id": 40000}, "eos_id"),
        ({"marker_ids": ()}, "marker_ids"),
        ({"marker_ids": "Wait"}, "marker_ids"),
        ({"marker_ids": (0,)}, "marker_ids"),
        ({"answer_ids": (1.5,)}, "answer_ids"),
        ({"marker_rate": 1.5}, "marker_rate"),
        ({"overlap_ok": -0.1}, "overlap_ok"),
        ({"value_noise": True}, "value_noise"),
        ({"confidence_std": -1.0}, "confidence_std"),
    ],
)
def test_bad_hyper_parameters(kw: dict[str, Any], arg: str) -> None:
    with pytest.raises(InputError) as err:
        GenerationSimulator(**kw)
    assert err.value.argument == arg


def test_bad_sample_and_bookkeeping_inputs() -> None:
    sim = GenerationSimulator(**SMALL)
    with pytest.raises(InputError, match="num_prompts"):
        sim.sample(-1, torch.Generator())
    with pytest.raises(InputError, match="generator"):
        sim.sample(2, 0)  # type: ignore[arg-type]
    b = sim.sample(2, torch.Generator().manual_seed(0))
    with pytest.raises(InputError, match="position"):
        b.premature(torch.zeros(b.num_rows, dtype=torch.bool), torch.zeros(3, dtype=torch.long))
    with pytest.raises(InputError, match="stopped"):
        b.kept_tokens([False] * b.num_rows, torch.zeros(b.num_rows, dtype=torch.long))  # type: ignore[arg-type]
