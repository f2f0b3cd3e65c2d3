r"""What the arena's runs say: tokens- and rollouts-to-target against the baseline with bootstrap intervals, final
accuracy at the fixed budget, stability measures, the fractions of tokens clipped, masked or stopped, the papers'
claims beside the measured ratios, the synthetic testbed's ranking against the arena's, and figures.

**Families and cohorts** (:data:`FAMILIES`). Runs are compared within a *cohort* of their family, against the
family's baseline method in the same cohort: an allocator at its budget unit (``rollouts`` or ``tokens``) against
``uniform``; an estimator at its group size (``g4``, ``g8``) against ``grpo``; a loss preset under its scenario
(``sync``, ``stale4``, ``stale16``, ``mismatch``, ``april``, ``copris``; records without one are ``sync``) against the
``grpo`` preset under the same scenario; a stop, truncation or length rule (one cohort, ``rollouts``) against
``none``, generation without a rule.

**Target.** The baseline's median held-out accuracy over seeds goes from :math:`a_0` (the base policy) to
:math:`a_1` at the end; the target is :math:`a_0 + 0.8\,(a_1 - a_0)`. A run's *tokens to target* is the cumulative
number of generated tokens at which its held-out accuracy first reaches the target, linearly interpolated between
evaluations (infinite when it never does); *rollouts to target* likewise.

**Ratio and interval.** A method's ratio is the median of its runs' tokens to target over the median of the
baseline's; the 95 % interval is the 2.5 and 97.5 percentiles of that ratio over 2,000 bootstrap draws that resample
the method's seeds and the baseline's seeds independently (seeded); a draw in which neither the method nor the
baseline reaches the target has no ratio and is left out, and the interval is n/a when more than 10 % of the draws
are. A method is *better* only when the whole interval is below 1, *worse* when it is above 1, and otherwise *not
separable from the baseline*; a method or baseline with fewer than 3 seeds
(:data:`~rolloutopt.arena.cohorts.MIN_SEEDS`) gets no verdict (*too few seeds*). The final accuracy difference (method minus baseline, medians) gets the same
bootstrap. **A baseline that does not improve** (:math:`a_1 \le a_0`, e.g. ``grpo`` on rollouts 16 steps stale)
leaves no target to reach (every run is at it at step 0); in such a cohort the final accuracy difference decides
the verdict (better when its whole interval is above 0, worse when below).

**Stability and fractions** (:mod:`rolloutopt.arena.report_measures`): the fraction of seeds that collapsed (final
held-out accuracy more than 0.1 below the run's own best evaluation), the fraction of steps with a gradient-norm
spike (above 10x the run's median), the final entropy, the median method time per step, the fraction of tokens the
loss's trust region clipped or masked, and the stop rules' stopped and saved fractions; medians over seeds.

**Synthetic proxy** (:func:`proxy_correlation`): Spearman's rank correlation between the allocators' rollouts-to-
target ratios on the synthetic prompt population (``benchmarks/results/allocators.md``) and in the arena.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from rolloutopt.arena._stats import bootstrap, delta, median, ratio, spearman
from rolloutopt.arena.claims import CLAIMS
from rolloutopt.arena.cohorts import FAMILIES, MIN_SEEDS, SCENARIOS, Comparison, Family, cohort, cohort_key, group_runs
from rolloutopt.arena.report_measures import Stability, stability, synthetic_ranking
from rolloutopt.errors import InputError

__all__ = [
    "FAMILIES",
    "SCENARIOS",
    "Comparison",
    "Family",
    "cohort",
    "compare",
    "load_runs",
    "proxy_correlation",
    "to_target",
    "verdict_sentence",
    "write_report",
]

TARGET_FRACTION = 0.8
_SYNTHETIC = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "allocators.md"


def load_runs(out_dir: str | Path) -> list[dict[str, Any]]:
    """Every run record (JSON) under ``out_dir``, sorted by file name."""
    paths = sorted(Path(out_dir).glob("*.json"))
    return [json.loads(p.read_text()) for p in paths]


def to_target(evals: list[dict[str, Any]], target: float, axis: str) -> float:
    """Cumulative ``axis`` (``"tokens"`` or ``"rollouts"``) at which ``accuracy`` first reaches ``target``,
    interpolated linearly between the evaluations; ``inf`` when it never does."""
    prev = None
    for e in evals:
        if e["accuracy"] >= target:
            if prev is None or e["accuracy"] == prev["accuracy"]:
                return float(e[axis])
            frac = (target - prev["accuracy"]) / (e["accuracy"] - prev["accuracy"])
            return float(prev[axis] + frac * (e[axis] - prev[axis]))
        prev = e
    return math.inf


def compare(runs: list[dict[str, Any]]) -> list[Comparison]:
    """A :class:`Comparison` of every (family, cohort, method) with at least one run, against the family's baseline
    in the same cohort (:data:`FAMILIES`); an :class:`~rolloutopt.errors.InputError` when a cohort has no baseline
    run or a family is unknown."""
    groups = group_runs(runs)
    out = []
    for family, unit in sorted({(f, c) for f, c, _ in groups}, key=lambda fc: cohort_key(*fc)):
        name = FAMILIES[family].baseline
        base = groups.get((family, unit, name))
        if not base:
            raise InputError("runs", f"runs of the baseline {name!r} ({family}, {unit})", "none", "run them first")
        a0 = median(torch.tensor([r["evals"][0]["accuracy"] for r in base]))
        a1 = median(torch.tensor([r["evals"][-1]["accuracy"] for r in base]))
        target = a0 + TARGET_FRACTION * (a1 - a0)
        measure = "tokens" if a1 > a0 else "final"  # a baseline that does not improve has no target to reach
        ref = {
            axis: torch.tensor([to_target(r["evals"], target, axis) for r in base]) for axis in ("tokens", "rollouts")
        }
        ref_final = torch.tensor([r["evals"][-1]["accuracy"] for r in base])
        for (fam, u, method), rs in sorted(groups.items()):
            if (fam, u) != (family, unit):
                continue
            mine = {
                axis: torch.tensor([to_target(r["evals"], target, axis) for r in rs]) for axis in ("tokens", "rollouts")
            }
            final = torch.tensor([r["evals"][-1]["accuracy"] for r in rs])
            seed = sum(map(ord, f"{family}/{method}/{unit}"))
            out.append(
                Comparison(
                    family=family,
                    method=method,
                    cohort=unit,
                    seeds=len(rs),
                    baseline_seeds=len(base),
                    target=target,
                    tokens_ratio=ratio(mine["tokens"], ref["tokens"]),
                    tokens_interval=bootstrap(mine["tokens"], ref["tokens"], ratio, seed),
                    rollouts_ratio=ratio(mine["rollouts"], ref["rollouts"]),
                    rollouts_interval=bootstrap(mine["rollouts"], ref["rollouts"], ratio, seed + 1),
                    final_accuracy=median(final),
                    final_delta=delta(final, ref_final),
                    final_interval=bootstrap(final, ref_final, delta, seed + 2),
                    reached=int(torch.isfinite(mine["tokens"]).sum()),
                    measure=measure,
                )
            )
    return out


def _names(methods: list[str]) -> str:
    quoted = [f"`{m}`" for m in methods]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def verdict_sentence(rows: list[Comparison]) -> str:
    """One sentence on the comparisons of one cohort: the methods that need fewer tokens to reach the target than the
    baseline beyond noise (the whole interval below 1), those that need more (above 1), that the rest are not
    separable from the baseline, and which have too few seeds for a verdict (all of them when the baseline has)."""
    if not rows or len({(r.family, r.cohort) for r in rows}) != 1:
        raise InputError("rows", "the comparisons of one (family, cohort)", f"{len(rows)} rows", "split them")
    base = FAMILIES[rows[0].family].baseline
    others = sorted((r for r in rows if r.method != base), key=lambda r: r.method)
    better = [r.method for r in others if r.verdict == "better"]
    worse = [r.method for r in others if r.verdict == "worse"]
    if rows[0].baseline_seeds < MIN_SEEDS:
        return (
            f"`{base}` has {rows[0].baseline_seeds} of the {MIN_SEEDS} seeds a verdict needs: no verdict in this "
            "cohort yet."
        )
    few = [r.method for r in others if r.verdict == "too few seeds"]
    rest = len(others) - len(better) - len(worse) - len(few)
    parts = []
    final = rows[0].measure == "final"
    if final:
        parts.append(f"`{base}` ends no better than it started, so the final accuracy decides")
        what, more = "a higher final accuracy than", "lower (interval below 0)"
    else:
        what, more = "the target with fewer tokens than", "more (interval above 1)"
    if better:
        verb = (
            ("ends with" if len(better) == 1 else "end with") if final else ("reaches" if len(better) == 1 else "reach")
        )
        parts.append(f"{_names(better)} {verb} {what} `{base}` beyond seed noise")
    else:
        parts.append(f"no method {'ends with' if final else 'reaches'} {what} `{base}` beyond seed noise")
    if worse:
        verb = ("ends" if len(worse) == 1 else "end") if final else ("needs" if len(worse) == 1 else "need")
        parts.append(f"{_names(worse)} {verb} {more}")
    if rest and (better or worse):
        parts.append(f"the rest are not separable from `{base}`")
    elif rest:
        parts.append(f"none {'ends lower' if final else 'needs more'}: all {rest} are not separable from `{base}`")
    if few:
        has = "has" if len(few) == 1 else "have"
        parts.append(f"{_names(few)} {has} fewer than {MIN_SEEDS} seeds, too few for a verdict")
    text = "; ".join(parts) + "."
    return text[0].upper() + text[1:]


def proxy_correlation(rows: list[Comparison], synthetic: dict[str, float]) -> tuple[float, list[str]]:
    """Spearman's rank correlation between ``synthetic`` (allocator -> rollouts-to-target ratio on the synthetic
    population, :func:`~rolloutopt.arena.report_measures.synthetic_ranking`) and the arena's median rollouts-to-
    target ratios of the allocators at the rollout budget, over the allocators with a ratio in both (an arena ratio
    of ``inf``, never reached, ranks last); returns the correlation and those allocators."""
    arena = {
        r.method: r.rollouts_ratio
        for r in rows
        if r.family == "allocator" and r.cohort == "rollouts" and not math.isnan(r.rollouts_ratio)
    }
    common = sorted(set(arena) & set(synthetic))
    return spearman([synthetic[m] for m in common], [arena[m] for m in common]), common


def _fmt(x: float) -> str:
    return "∞" if math.isinf(x) else "n/a" if math.isnan(x) else f"{x:.2f}"


def _ratio_cell(x: float, interval: tuple[float, float]) -> str:
    """A ratio and its interval, ``1.21x [1.05, 1.40]``; ``—`` when there is no ratio (no target to reach)."""
    return "—" if math.isnan(x) else f"{_fmt(x)}x [{_fmt(interval[0])}, {_fmt(interval[1])}]"


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _claim(family: str, method: str) -> str:
    c = CLAIMS.get((family, method))
    if c is None:
        return "—"
    notes = ([f"arXiv {c.arxiv}"] if c.arxiv else []) + ([] if c.quantitative else ["qualitative"])
    return f"{c.text} ({'; '.join(notes)})"


def _stability_table(family: str, sub: list[Stability]) -> list[str]:
    stop = family == "stop"
    head = "| method | collapsed seeds | grad-norm spikes | final entropy | method ms/step | clipped or masked |"
    head += " stopped | tokens saved |" if stop else ""
    lines = [head, "|---" * (8 if stop else 6) + "|"]
    for s in sorted(sub, key=lambda s: s.method):
        row = (
            f"| {s.method} | {s.collapse_frac * s.seeds:.0f}/{s.seeds} | {_pct(s.spike_frac)} | "
            f"{_fmt(s.final_entropy)} | {_fmt(s.method_ms)} | {_pct(s.trust_frac)} (`{s.trust_metric}`) |"
        )
        if stop:
            row += f" {_pct(s.stopped_frac)} | {_pct(s.saved_frac)} |"
        lines.append(row)
    return lines


def _proxy_section(rows: list[Comparison], path: Path | None) -> list[str]:
    lines = ["## Synthetic proxy vs the arena", ""]
    if path is None or not path.exists():
        return [*lines, f"No synthetic results at {path}: nothing to compare.", ""]
    rho, common = proxy_correlation(rows, synthetic_ranking(path))
    lines.append(
        f"Spearman rank correlation between the allocators' rollouts-to-target ratios to `uniform` on the synthetic "
        f"`PromptPopulation` (`benchmarks/results/allocators.md`) and their median ratios here (rollout budget): "
        f"**{_fmt(rho)}** over {len(common)} allocators present in both (an allocator that never reaches the "
        f"target here ranks last; ties share their average rank; 1 is the same order, 0 none, -1 the reverse). "
        f"The synthetic testbed stays the fast proxy for screening allocators (seconds a run, no policy); this "
        f"number says how far its ranking carries over to a real policy on this workload."
    )
    return [*lines, ""]


def write_report(runs_dir: str | Path, out_dir: str | Path, synthetic: str | Path | None = _SYNTHETIC) -> Path:
    """Write ``summary.md`` under ``out_dir`` and, when matplotlib is installed, the figures
    (``{family}_{cohort}_curves.png``, ``{family}_{cohort}_ratios.png``, ``loss_fractions.png``,
    ``stop_fractions.png``); return the summary's path.

    Per family and cohort: the comparison table with the papers' claims (:data:`~rolloutopt.arena.claims.CLAIMS`),
    one verdict sentence, and the stability and fraction table. Then the synthetic proxy's rank correlation with the
    arena, from ``synthetic`` (``benchmarks/results/allocators.md`` of the repository by default; the section says
    so when the file is absent or ``synthetic`` is None)."""
    runs = load_runs(runs_dir)
    rows = compare(runs)
    stab = {(s.family, s.cohort, s.method): s for s in stability(runs, cohort)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Arena: every method against its family's baseline",
        "",
        "Ratios are medians over seeds of tokens (rollouts) to the target accuracy over the baseline's, with 95% "
        "bootstrap intervals; *better*/*worse* only when the whole tokens interval is below/above 1. Stability: "
        "seeds whose final held-out accuracy fell more than 0.1 below their own best evaluation (collapsed), steps "
        "whose gradient norm exceeded 10x the run's median (spikes), mean entropy over the last 10 steps, median "
        "method time per step, mean fraction of tokens the loss's trust region clipped or masked (its metric in "
        "backticks); medians over seeds. *Paper claims* paraphrase the method's paper as documented in this "
        "repository (qualitative where the repository quotes no number); they were measured on other models and "
        "tasks, not on this workload.",
        "",
    ]
    for family, unit in sorted({(r.family, r.cohort) for r in rows}, key=lambda fc: cohort_key(*fc)):
        fam = FAMILIES[family]
        sub = [r for r in rows if (r.family, r.cohort) == (family, unit)]
        final = sub[0].measure == "final"
        what = (
            "final accuracy decides: the baseline ends no better than it started"
            if final
            else (f"target held-out accuracy {sub[0].target:.3f}")
        )
        lines += [
            f"## {fam.title}, {fam.describe(unit)}: against `{fam.baseline}` ({what})",
            "",
            "| method | seeds | reached | tokens to target (ratio, 95% CI) | rollouts to target | final acc. | "
            "Δ final vs baseline (95% CI) | verdict | paper claims |",
            "|---|---|---|---|---|---|---|---|---|",
        ]

        def order(r: Comparison) -> float:
            if r.measure == "final":
                return -r.final_delta
            return r.tokens_ratio if not math.isnan(r.tokens_ratio) else math.inf

        for r in sorted(sub, key=order):
            lo, hi = r.tokens_interval
            rlo, rhi = r.rollouts_interval
            dlo, dhi = r.final_interval
            lines.append(
                f"| {r.method} | {r.seeds} | {r.reached} | {_ratio_cell(r.tokens_ratio, (lo, hi))} | "
                f"{_ratio_cell(r.rollouts_ratio, (rlo, rhi))} | {r.final_accuracy:.3f} | "
                f"{r.final_delta:+.3f} [{dlo:+.3f}, {dhi:+.3f}] | {r.verdict} | {_claim(family, r.method)} |"
            )
        lines += ["", f"**Verdict.** {verdict_sentence(sub)}", "", "Stability and fractions:", ""]
        lines += _stability_table(family, [stab[(family, unit, r.method)] for r in sub])
        lines.append("")
    lines += _proxy_section(rows, None if synthetic is None else Path(synthetic))
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    from rolloutopt.arena.report_figures import figures

    figures(runs, rows, list(stab.values()), out)
    return path
