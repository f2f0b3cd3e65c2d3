"""The arena's report: tokens to target by hand, ratios and bootstrap intervals on synthetic records, verdicts,
the stability and fraction measures by hand, Spearman's correlation by hand, the synthetic ranking, and the written
summary and figures of all four families."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rolloutopt.arena._stats import ranks, spearman
from rolloutopt.arena.cohorts import MIN_SEEDS
from rolloutopt.arena.report import (
    FAMILIES,
    cohort,
    compare,
    proxy_correlation,
    to_target,
    verdict_sentence,
    write_report,
)
from rolloutopt.arena.report_measures import (
    TRUST_REGION_METRIC,
    collapsed,
    final_entropy,
    grad_spike_frac,
    measure_run,
    method_ms,
    stability,
    synthetic_ranking,
)
from rolloutopt.errors import InputError


def evals(acc: list[float], tokens_per_eval: float) -> list[dict[str, float]]:
    return [{"step": i, "accuracy": a, "tokens": i * tokens_per_eval, "rollouts": i * 10.0} for i, a in enumerate(acc)]


def record(
    method: str,
    seed: int,
    acc: list[float],
    tokens: float,
    family: str = "allocator",
    group_size: int = 8,
    steps: list[dict[str, float]] | None = None,
    **spec_extra: object,
) -> dict[str, object]:
    spec = {"family": family, "method": method, "unit": "rollouts", "seed": seed, "group_size": group_size}
    return {"spec": {**spec, **spec_extra}, "evals": evals(acc, tokens), "steps": steps or []}


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
    rows = {(r.method, r.cohort): r for r in compare(runs)}
    assert set(rows) == {("grpo", "g4"), ("rloo", "g4"), ("grpo", "g8"), ("rloo", "g8")}
    assert rows[("rloo", "g4")].tokens_ratio == pytest.approx(0.5) and rows[("rloo", "g8")].verdict == "better"
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


def test_cohorts_and_baselines_of_the_four_families() -> None:
    """A loss run's cohort is its scenario (an old record without one is "sync") and its baseline the grpo preset
    under the same scenario; a stop rule's cohort is "rollouts" and its baseline "none"."""
    assert cohort({"family": "allocator", "unit": "tokens"}) == "tokens"
    assert cohort({"family": "estimator", "group_size": 4}) == "g4"
    assert cohort({"family": "loss", "scenario": "stale16"}) == "stale16"
    assert cohort({"family": "loss"}) == "sync"
    assert cohort({"family": "stop"}) == "rollouts"
    assert {f: FAMILIES[f].baseline for f in FAMILIES} == {
        "allocator": "uniform", "estimator": "grpo", "loss": "grpo", "stop": "none"
    }  # fmt: skip
    with pytest.raises(InputError, match="family"):
        cohort({"family": "shaper"})
    runs = []
    for seed in range(3):
        for sc in ("sync", "stale4"):
            runs.append(record("grpo", seed, [0.2, 0.4, 0.6], 100.0, family="loss", scenario=sc))
            runs.append(record("dppo_kl", seed, [0.2, 0.4, 0.6], 50.0, family="loss", scenario=sc))
        runs.append(record("none", seed, [0.2, 0.4, 0.6], 100.0, family="stop"))
        runs.append(record("dot", seed, [0.2, 0.4, 0.6], 200.0, family="stop"))
    rows = {(r.family, r.cohort, r.method): r for r in compare(runs)}
    assert rows[("loss", "stale4", "dppo_kl")].tokens_ratio == pytest.approx(0.5)
    assert rows[("stop", "rollouts", "dot")].tokens_ratio == pytest.approx(2.0)
    assert rows[("stop", "rollouts", "dot")].verdict == "worse"
    with pytest.raises(InputError, match="none"):
        compare([record("dot", 0, [0.2, 0.6], 10.0, family="stop")])


def test_verdict_sentence() -> None:
    runs = []
    for seed in range(5):
        runs.append(record("uniform", seed, [0.2, 0.3, 0.4, 0.5, 0.6], 100.0))
        runs.append(record("fast", seed, [0.2, 0.3, 0.4, 0.5, 0.6], 50.0))
        runs.append(record("quick", seed, [0.2, 0.3, 0.4, 0.5, 0.6], 60.0))
        runs.append(record("same", seed, [0.2, 0.3, 0.4, 0.5, 0.6], 100.0))
        runs.append(record("never", seed, [0.2, 0.2, 0.2, 0.2, 0.2], 100.0))
    rows = compare(runs)
    assert verdict_sentence(rows) == (
        "`fast` and `quick` reach the target with fewer tokens than `uniform` beyond seed noise; `never` needs more "
        "(interval above 1); the rest are not separable from `uniform`."
    )
    same = [r for r in rows if r.method in ("uniform", "same")]
    assert verdict_sentence(same) == (
        "No method reaches the target with fewer tokens than `uniform` beyond seed noise; none needs more: all 1 are "
        "not separable from `uniform`."
    )
    with pytest.raises(InputError, match="one"):
        verdict_sentence([])


def test_fewer_than_three_seeds_get_no_verdict() -> None:
    """A method twice as fast as uniform on every seed is better with 3 seeds each; with 2 of its own, or with 3
    against a baseline of 2, the bootstrap interval is a point and the verdict is "too few seeds", said so in the
    sentence; a baseline with 2 seeds leaves its whole cohort without a verdict."""
    curve = [0.2, 0.3, 0.4, 0.5, 0.6]
    runs = [record("uniform", s, curve, 100.0) for s in range(3)]
    runs += [record("fast", s, curve, 50.0) for s in range(3)] + [record("twice", s, curve, 50.0) for s in range(2)]
    runs += [record("slow", s, curve, 200.0) for s in range(3)]
    rows = {r.method: r for r in compare(runs)}
    assert MIN_SEEDS == 3
    assert rows["fast"].verdict == "better" and rows["twice"].verdict == "too few seeds"
    assert rows["twice"].tokens_interval == pytest.approx((0.5, 0.5)) and rows["twice"].baseline_seeds == 3
    assert verdict_sentence(list(rows.values())) == (
        "`fast` reaches the target with fewer tokens than `uniform` beyond seed noise; `slow` needs more (interval "
        "above 1); `twice` has fewer than 3 seeds, too few for a verdict."
    )
    thin = [r for r in runs if not (r["spec"]["method"] == "uniform" and r["spec"]["seed"] == 2)]
    rows = {r.method: r for r in compare(thin)}
    assert {r.verdict for r in rows.values()} == {"too few seeds"}
    assert verdict_sentence(list(rows.values())) == (
        "`uniform` has 2 of the 3 seeds a verdict needs: no verdict in this cohort yet."
    )


def test_stability_measures_by_hand() -> None:
    """Collapse: 0.40 at best, 0.28 at the end is more than 0.1 below (collapsed); 0.31 is not; a run whose best is
    its start (0.30) and ends at 0.19 collapsed too. Spikes: grad norms [1] * 8 + [2, 20] and one step without a loss
    step: median 1, only 20 > 10 x 1, so 1 of 10. Final entropy: entropies 1..12 (one step without): the last 10
    are 3..12, mean 7.5. Method time: median of 1, 3, 2 ms = 2 ms."""
    assert collapsed(evals([0.25, 0.40, 0.28], 1.0))
    assert not collapsed(evals([0.25, 0.40, 0.31], 1.0))
    assert collapsed(evals([0.30, 0.25, 0.19], 1.0))
    with pytest.raises(InputError, match="evals"):
        collapsed([])
    grads = [{"grad_norm": g} for g in [1.0] * 8 + [2.0, 20.0]]
    assert grad_spike_frac([*grads, {"reward": 0.5}]) == pytest.approx(0.1)
    assert math.isnan(grad_spike_frac([{"reward": 0.5}]))
    ent = [{"entropy": float(e)} for e in range(1, 13)]
    assert final_entropy([*ent[:5], {"reward": 0.0}, *ent[5:]]) == pytest.approx(7.5)
    assert method_ms([{"method_seconds": s} for s in (0.001, 0.003, 0.002)]) == pytest.approx(2.0)


def test_trust_region_and_stop_fractions_by_hand() -> None:
    """A loss run reads its preset's own masking metric (dppo_kl: dppo_masked_frac, mean of 0.1 and 0.3 = 0.2); an
    allocator run reads the spec's loss (grpo: clipfrac). Over two seeds the fraction of collapsed seeds is 1/2 and
    the other measures are medians (0.2 and 0.4: 0.3)."""
    steps = [
        {"dppo_masked_frac": 0.1, "clipfrac": 0.9, "stopped_frac": 0.5, "saved_frac": 0.25},
        {"dppo_masked_frac": 0.3, "clipfrac": 0.9, "stopped_frac": 0.0, "saved_frac": 0.75},
    ]
    m = measure_run(record("dppo_kl", 0, [0.2, 0.4], 1.0, family="loss", steps=steps))
    assert m.trust_metric == "dppo_masked_frac" and m.trust_frac == pytest.approx(0.2)
    assert m.stopped_frac == pytest.approx(0.25) and m.saved_frac == pytest.approx(0.5)
    a = measure_run(record("greso", 0, [0.2, 0.4], 1.0, steps=steps, loss="grpo"))
    assert a.trust_metric == "clipfrac" and a.trust_frac == pytest.approx(0.9)
    assert {"dppo_kl", "m2po", "tbpo", "icepop", "opsm", "grpo"} <= set(TRUST_REGION_METRIC)
    other = [{**s, "dppo_masked_frac": 0.4} for s in steps]
    runs = [
        record("dppo_kl", 0, [0.2, 0.5, 0.3], 1.0, family="loss", steps=steps),  # 0.5 -> 0.3: collapsed
        record("dppo_kl", 1, [0.2, 0.5, 0.5], 1.0, family="loss", steps=other),
    ]
    (s,) = stability(runs, cohort)
    assert (s.cohort, s.seeds, s.collapse_frac) == ("sync", 2, 0.5)
    assert s.trust_frac == pytest.approx(0.3)


def test_spearman_by_hand() -> None:
    """x = 1..5, y = [5, 6, 7, 8, 7]: y's ranks are [1, 2, 3.5, 5, 3.5] (the two 7s share ranks 3 and 4); centred
    ranks [-2, -1, 0, 1, 2] and [-2, -1, 0.5, 2, 0.5]: covariance 8, variances 10 and 9.5, rho = 8 / sqrt(95)."""
    assert ranks([5.0, 6.0, 7.0, 8.0, 7.0]) == [1.0, 2.0, 3.5, 5.0, 3.5]
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, math.inf, math.inf]) == pytest.approx(1.5 / math.sqrt(3))  # ∞ ties rank last
    assert math.isnan(spearman([1, 2], [1, 1])) and math.isnan(spearman([1], [2]))
    with pytest.raises(InputError):
        spearman([1, 2], [1])


TABLE = """Some text.

| allocator                |  rollouts to target (median) | vs Uniform | zero-var frac |
|--------------------------|------------------------------|------------|---------------|
| Uniform (n=8)            |              105,472         |      1.00x |         0.322 |
| DPS                      |               99,328         |      0.94x |         0.266 |
| GRESO                    |               91,136         |      0.86x |         0.253 |
| HIVE (no prompt entropy) |               79,936 (2 seeds missed) |      0.76x |         0.182 |

| allocator | vs Uniform |
|---|---|
| DPS | 9.99x |
"""


def test_synthetic_ranking(tmp_path: Path) -> None:
    path = tmp_path / "allocators.md"
    path.write_text(TABLE)
    assert synthetic_ranking(path) == {"uniform": 1.0, "dps": 0.94, "greso": 0.86, "hive": 0.76}
    real = synthetic_ranking(Path(__file__).parents[2] / "benchmarks" / "results" / "allocators.md")
    assert len(real) == 19 and real["uniform"] == 1.0 and real["dapo_dynamic_sampling"] == 0.90
    path.write_text("no table")
    with pytest.raises(InputError, match="vs Uniform"):
        synthetic_ranking(path)
    path.write_text(TABLE.replace("GRESO   ", "Unknown "))
    with pytest.raises(InputError, match="Unknown"):
        synthetic_ranking(path)


def test_proxy_correlation() -> None:
    """Arena rollouts-to-target ratios: dps 0.5 (reaches 0.52 at 8 rollouts, uniform at 16), greso 1, hive ∞ (never),
    uniform 1: ranks [1, 2.5, 4, 2.5] (dps, greso, hive, uniform). Synthetic ratios 0.94, 0.86, 0.76, 1.0: ranks
    [3, 2, 1, 4]. Centred: [-1.5, 0, 1.5, 0] and [0.5, -0.5, -1.5, 1.5]: covariance -3, variances 4.5 and 5,
    rho = -3 / sqrt(22.5). "x" is not in the arena and is left out."""
    runs = []
    for seed in range(3):
        runs.append(record("uniform", seed, [0.2, 0.4, 0.6], 100.0))
        runs.append(record("dps", seed, [0.2, 0.6, 0.6], 100.0))
        runs.append(record("greso", seed, [0.2, 0.4, 0.6], 100.0))
        runs.append(record("hive", seed, [0.2, 0.2, 0.2], 100.0))
    synthetic = {"uniform": 1.0, "dps": 0.94, "greso": 0.86, "hive": 0.76, "x": 2.0}
    rho, common = proxy_correlation(compare(runs), synthetic)
    assert common == ["dps", "greso", "hive", "uniform"]
    assert rho == pytest.approx(-3 / math.sqrt(22.5))


def test_write_report_with_every_family(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    steps = [{"step": 1, "grad_norm": 1.0, "entropy": 0.3, "method_seconds": 0.002, "clipfrac": 0.05,
              "dppo_masked_frac": 0.02, "stopped_frac": 0.4, "saved_frac": 0.3}]  # fmt: skip
    recs = []
    for seed in range(3):
        recs.append(record("uniform", seed, [0.2, 0.4, 0.6], 100.0 + seed, steps=steps))
        recs.append(record("greso", seed, [0.2, 0.4, 0.6], 60.0 + seed, steps=steps))
        for sc in ("sync", "mismatch"):
            recs.append(record("grpo", seed, [0.2, 0.4, 0.6], 100.0, family="loss", steps=steps, scenario=sc))
            recs.append(record("dppo_kl", seed, [0.2, 0.4, 0.6], 100.0, family="loss", steps=steps, scenario=sc))
        recs.append(record("none", seed, [0.2, 0.4, 0.6], 100.0, family="stop", steps=steps))
        recs.append(record("dot", seed, [0.2, 0.4, 0.6], 70.0, family="stop", steps=steps))
    for k, rec in enumerate(recs):
        (runs / f"{k:03d}.json").write_text(json.dumps(rec))
    table = tmp_path / "allocators.md"
    table.write_text(TABLE)
    out = tmp_path / "out"
    text = write_report(runs, out, synthetic=table).read_text()
    assert "## Loss presets, scenario `sync`: against `grpo`" in text and "scenario `mismatch`" in text
    assert "## Stop and length rules, budget in rollouts: against `none`" in text
    assert text.index("scenario `sync`") < text.index("scenario `mismatch`")  # the scenarios' order
    assert "| paper claims |" in text and "up to 78% fewer tokens on AIME-24" in text and "arXiv 2601.03969" in text
    assert "**Verdict.** `greso` reaches the target with fewer tokens than `uniform` beyond seed noise." in text
    assert "| dppo_kl | 0/3 | 0.0% | 0.30 | 2.00 | 2.0% (`dppo_masked_frac`) |" in text
    assert "| dot | 0/3 | 0.0% | 0.30 | 2.00 | 5.0% (`clipfrac`) | 40.0% | 30.0% |" in text
    assert "## Synthetic proxy vs the arena" in text and "over 2 allocators present in both" in text
    assert "stays the fast proxy" in text
    names = {p.name for p in out.iterdir()}
    for tag in ("allocator_rollouts", "loss_sync", "loss_mismatch", "stop_rollouts"):
        assert {f"{tag}_curves.png", f"{tag}_ratios.png"} <= names
    assert {"loss_fractions.png", "stop_fractions.png"} <= names
    no_proxy = write_report(runs, tmp_path / "out2", synthetic=None).read_text()
    assert "nothing to compare" in no_proxy


def test_a_baseline_that_does_not_improve_hands_the_verdict_to_the_final_accuracy() -> None:
    """grpo falls from 0.3 to 0.2 on every seed; a preset that ends at 0.3 on every seed is better by the final
    accuracy (+0.1, the whole bootstrap interval above 0), one that ends at 0.1 worse; tokens to target are 0 for
    both (the target 0.22 is below the start)."""

    def rec(method: str, end: float, seed: int) -> dict[str, Any]:
        evals = [{"step": 0, "rollouts": 0, "tokens": 0, "accuracy": 0.3},
                 {"step": 10, "rollouts": 100, "tokens": 500, "accuracy": end}]  # fmt: skip
        spec = {"family": "loss", "method": method, "seed": seed, "scenario": "stale16", "unit": "rollouts"}
        return {"spec": spec, "steps": [], "evals": evals}

    runs = [rec(m, e, s) for m, e in (("grpo", 0.2), ("tis", 0.3), ("m2po", 0.1)) for s in range(3)]
    rows = {r.method: r for r in compare(runs)}
    assert rows["tis"].measure == "final" and rows["tis"].final_delta == pytest.approx(0.1)
    assert (
        rows["tis"].verdict == "better" and rows["m2po"].verdict == "worse" and rows["grpo"].verdict == "not separable"
    )
    text = verdict_sentence(list(rows.values()))
    assert "final accuracy decides" in text and "`tis` ends with a higher final accuracy" in text


def test_the_bootstrap_equals_its_loop_over_draws() -> None:
    """The draws are computed at once; each equals ``stat`` of that draw's resamples, computed one by one (same
    generator, same draws), including infinite tokens-to-target and the draws with no ratio left out."""
    from rolloutopt.arena import _stats

    tokens = (torch.tensor([300.0, 420.0, math.inf, 380.0, 510.0]), torch.tensor([400.0, math.inf, 460.0, 350.0]))
    accuracy = torch.tensor([0.31, 0.42, 0.38, 0.29, 0.35])  # the final accuracies that delta compares
    for stat, seed, (a, b) in ((_stats.ratio, 3, tokens), (_stats.delta, 4, (accuracy, accuracy.flip(0)[:4]))):
        gen = torch.Generator().manual_seed(seed)
        ia = torch.randint(0, a.numel(), (_stats.DRAWS, a.numel()), generator=gen)
        ib = torch.randint(0, b.numel(), (_stats.DRAWS, b.numel()), generator=gen)
        loop = torch.tensor([stat(a[ia[k]], b[ib[k]]) for k in range(_stats.DRAWS)], dtype=torch.float64)
        loop = loop[~loop.isnan()].clamp(max=1e300)
        want = torch.quantile(loop, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        want = [math.inf if w >= 1e300 else w for w in want]
        assert _stats.bootstrap(a, b, stat, seed) == pytest.approx(tuple(want), nan_ok=True)
    with pytest.raises(InputError, match="stat"):
        _stats.bootstrap(accuracy, accuracy, lambda x, y: 0.0, 0)
