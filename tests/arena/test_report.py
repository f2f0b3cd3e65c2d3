"""The arena's report: tokens to target by hand, ratios and bootstrap intervals on synthetic records, verdicts,
and the written summary and figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rolloutopt.arena.report import compare, to_target, write_report
from rolloutopt.errors import InputError


def evals(acc: list[float], tokens_per_eval: float) -> list[dict[str, float]]:
    return [{"step": i, "accuracy": a, "tokens": i * tokens_per_eval, "rollouts": i * 10.0} for i, a in enumerate(acc)]


def record(
    method: str, seed: int, acc: list[float], tokens: float, family: str = "allocator", group_size: int = 8
) -> dict[str, object]:
    spec = {"family": family, "method": method, "unit": "rollouts", "seed": seed, "group_size": group_size}
    return {"spec": spec, "evals": evals(acc, tokens), "steps": []}


def test_tokens_to_target_by_hand() -> None:
    e = evals([0.2, 0.3, 0.5, 0.6], 100.0)
    assert to_target(e, 0.4, "tokens") == pytest.approx(150.0)  # halfway between 0.3 (100) and 0.5 (200)
    assert to_target(e, 0.3, "rollouts") == 10.0
    assert to_target(e, 0.2, "tokens") == 0.0
    assert to_target(e, 0.7, "tokens") == math.inf


def test_ratio_interval_and_verdict_on_synthetic_runs() -> None:
    """uniform goes 0.2 -> 0.6 (target 0.2 + 0.8 * 0.4 = 0.52) in 4 evaluations of 100 tokens: it reaches 0.52 at
    340 tokens (0.5 at 300, 0.6 at 400). "fast" has the same curve at 50 tokens per evaluation: ratio 0.5 on every
    seed, so the interval is [0.5, 0.5] and it is better; "same" is uniform's curve: ratio 1, not separable;
    "never" stays at 0.2: infinite, worse."""
    runs = []
    for seed in range(5):
        runs.append(record("uniform", seed, [0.2, 0.3, 0.4, 0.5, 0.6], 100.0))
        runs.append(record("fast", seed, [0.2, 0.3, 0.4, 0.5, 0.6], 50.0))
        runs.append(record("same", seed, [0.2, 0.3, 0.4, 0.5, 0.6], 100.0))
        runs.append(record("never", seed, [0.2, 0.2, 0.2, 0.2, 0.2], 100.0))
    rows = {r.method: r for r in compare(runs)}
    assert rows["uniform"].target == pytest.approx(0.52)
    assert rows["fast"].tokens_ratio == pytest.approx(0.5) and rows["fast"].tokens_interval == pytest.approx((0.5, 0.5))
    assert rows["fast"].rollouts_ratio == pytest.approx(1.0) and rows["fast"].verdict == "better"
    assert rows["same"].tokens_ratio == pytest.approx(1.0) and rows["same"].verdict == "not separable"
    assert math.isinf(rows["never"].tokens_ratio) and rows["never"].verdict == "worse" and rows["never"].reached == 0
    assert rows["never"].final_delta == pytest.approx(-0.4)
    with pytest.raises(InputError, match="baseline"):
        compare([record("fast", 0, [0.2, 0.6], 10.0)])


def test_write_report(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed in range(3):
        for method, tokens in (("uniform", 100.0), ("fast", 60.0)):
            rec = record(method, seed, [0.2, 0.4, 0.6], tokens + seed)
            (runs / f"{method}-{seed}.json").write_text(json.dumps(rec))
    path = write_report(runs, tmp_path / "out")
    text = path.read_text()
    assert "| fast | 3 | 3 |" in text and "better" in text and "Allocators, budget in rollouts" in text
    assert (tmp_path / "out" / "allocator_rollouts_curves.png").exists()
    assert (tmp_path / "out" / "allocator_rollouts_ratios.png").exists()


def test_estimators_are_compared_with_grpo_at_the_same_group_size() -> None:
    runs = []
    for seed in range(3):
        for g, tokens in ((4, 100.0), (8, 200.0)):
            runs.append(record("grpo", seed, [0.2, 0.4, 0.6], tokens, family="estimator", group_size=g))
            runs.append(record("rloo", seed, [0.2, 0.4, 0.6], tokens / 2, family="estimator", group_size=g))
    rows = {(r.method, r.unit): r for r in compare(runs)}
    assert set(rows) == {("grpo", "G=4"), ("rloo", "G=4"), ("grpo", "G=8"), ("rloo", "G=8")}
    assert rows[("rloo", "G=4")].tokens_ratio == pytest.approx(0.5) and rows[("rloo", "G=8")].verdict == "better"
    with pytest.raises(InputError, match="grpo"):
        compare([record("rloo", 0, [0.2, 0.6], 10.0, family="estimator")])


def test_draws_without_a_ratio_are_left_out_of_the_interval() -> None:
    """The baseline misses the target on 1 of 9 seeds and "slow" on 2: a draw has no ratio only when both medians
    are infinite (rare with 9 seeds), so an interval exists. When the baseline's median does not improve, the target
    is the start, every run reaches it at 0 tokens, no draw has a ratio and the interval is n/a."""
    runs = [record("uniform", s, [0.2, 0.4, 0.6] if s else [0.2, 0.2, 0.2], 100.0) for s in range(9)]
    runs += [record("slow", s, [0.2, 0.3, 0.6] if s > 1 else [0.2, 0.2, 0.2], 100.0) for s in range(9)]
    rows = {r.method: r for r in compare(runs)}
    lo, hi = rows["slow"].tokens_interval
    assert not math.isnan(lo) and lo <= rows["slow"].tokens_ratio <= hi
    sparse = [record("uniform", s, [0.2, 0.6] if s == 0 else [0.2, 0.2], 100.0) for s in range(3)]
    sparse += [record("slow", s, [0.2, 0.6] if s == 0 else [0.2, 0.2], 100.0) for s in range(3)]
    assert all(math.isnan(x) for x in {r.method: r for r in compare(sparse)}["slow"].tokens_interval)
