r"""What the arena's runs say: tokens- and rollouts-to-target against the baseline with bootstrap intervals, final
accuracy at the fixed budget, and figures.

**Target.** For each budget unit, the baseline is ``uniform`` (GRPO's fixed group size over the same candidate
pools). Its median held-out accuracy over seeds goes from :math:`a_0` (the base policy) to :math:`a_1` at the end;
the target is :math:`a_0 + 0.8\,(a_1 - a_0)`. A run's *tokens to target* is the cumulative number of generated
tokens at which its held-out accuracy first reaches the target, linearly interpolated between evaluations
(infinite when it never does); *rollouts to target* likewise.

**Ratio and interval.** A method's ratio is the median of its runs' tokens to target over the median of the
baseline's; the 95 % interval is the 2.5 and 97.5 percentiles of that ratio over 2,000 bootstrap draws that resample
the method's seeds and the baseline's seeds independently (seeded). A method is *better* only when the whole
interval is below 1, *worse* when it is above 1, and otherwise *not separable from the baseline*. The final
accuracy difference (method minus baseline, medians) gets the same bootstrap.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rolloutopt.errors import InputError

__all__ = ["Comparison", "compare", "load_runs", "to_target", "write_report"]

BASELINE = "uniform"
TARGET_FRACTION = 0.8
DRAWS = 2000


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


def _median(x: torch.Tensor) -> float:
    """The median of a 1-d tensor, averaging the two middle values (``inf`` counts as larger than any value)."""
    s = x.sort().values
    n = s.numel()
    return float(s[n // 2]) if n % 2 else float((s[n // 2 - 1] + s[n // 2]) / 2)


def _bootstrap(a: torch.Tensor, b: torch.Tensor, stat: Any, seed: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    ia = torch.randint(0, a.numel(), (DRAWS, a.numel()), generator=gen)
    ib = torch.randint(0, b.numel(), (DRAWS, b.numel()), generator=gen)
    values = torch.tensor([stat(a[ia[k]], b[ib[k]]) for k in range(DRAWS)], dtype=torch.float64)
    if bool(values.isnan().any()):  # some resample has no ratio: no interval
        return math.nan, math.nan
    lo, hi = torch.quantile(values.clamp(max=1e300), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return (math.inf if lo >= 1e300 else lo), (math.inf if hi >= 1e300 else hi)


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    num, den = _median(a), _median(b)
    if math.isinf(den) or den == 0:  # the baseline never reached the target, or the target is its start
        return math.nan if math.isinf(num) or num == den else math.inf if den == 0 else 0.0
    return num / den


def _delta(a: torch.Tensor, b: torch.Tensor) -> float:
    return _median(a) - _median(b)


@dataclass(frozen=True)
class Comparison:
    """One method in one budget unit against the baseline (see the module docstring)."""

    family: str
    method: str
    unit: str
    seeds: int
    target: float
    tokens_ratio: float
    tokens_interval: tuple[float, float]
    rollouts_ratio: float
    rollouts_interval: tuple[float, float]
    final_accuracy: float
    final_delta: float
    final_interval: tuple[float, float]
    reached: int

    @property
    def verdict(self) -> str:
        """``"better"``, ``"worse"`` or ``"not separable"`` (tokens to target; the interval decides)."""
        lo, hi = self.tokens_interval
        return "better" if hi < 1 else "worse" if lo > 1 else "not separable"


def compare(runs: list[dict[str, Any]]) -> list[Comparison]:
    """A :class:`Comparison` of every (family, method, unit) with at least one run, against ``uniform``."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        s = r["spec"]
        groups.setdefault((s["family"], s["method"], s["unit"]), []).append(r)
    out = []
    for unit in sorted({u for _, _, u in groups}):
        base = groups.get(("allocator", BASELINE, unit))
        if not base:
            raise InputError("runs", f"runs of the baseline {BASELINE!r} in unit {unit!r}", "none", "run them first")
        a0 = _median(torch.tensor([r["evals"][0]["accuracy"] for r in base]))
        a1 = _median(torch.tensor([r["evals"][-1]["accuracy"] for r in base]))
        target = a0 + TARGET_FRACTION * (a1 - a0)
        ref = {
            axis: torch.tensor([to_target(r["evals"], target, axis) for r in base]) for axis in ("tokens", "rollouts")
        }
        ref_final = torch.tensor([r["evals"][-1]["accuracy"] for r in base])
        for (family, method, u), rs in sorted(groups.items()):
            if u != unit:
                continue
            mine = {
                axis: torch.tensor([to_target(r["evals"], target, axis) for r in rs]) for axis in ("tokens", "rollouts")
            }
            final = torch.tensor([r["evals"][-1]["accuracy"] for r in rs])
            seed = sum(map(ord, f"{method}/{unit}"))
            out.append(
                Comparison(
                    family=family,
                    method=method,
                    unit=unit,
                    seeds=len(rs),
                    target=target,
                    tokens_ratio=_ratio(mine["tokens"], ref["tokens"]),
                    tokens_interval=_bootstrap(mine["tokens"], ref["tokens"], _ratio, seed),
                    rollouts_ratio=_ratio(mine["rollouts"], ref["rollouts"]),
                    rollouts_interval=_bootstrap(mine["rollouts"], ref["rollouts"], _ratio, seed + 1),
                    final_accuracy=_median(final),
                    final_delta=_delta(final, ref_final),
                    final_interval=_bootstrap(final, ref_final, _delta, seed + 2),
                    reached=int(torch.isfinite(mine["tokens"]).sum()),
                )
            )
    return out


def _fmt(x: float) -> str:
    return "∞" if math.isinf(x) else "n/a" if math.isnan(x) else f"{x:.2f}"


def write_report(runs_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``summary.md`` (one table per unit) and, when matplotlib is installed, ``curves_<unit>.png`` and
    ``ratios_<unit>.png`` under ``out_dir``; return the summary's path."""
    runs = load_runs(runs_dir)
    rows = compare(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Arena: allocators against GRPO's uniform groups", ""]
    for unit in sorted({r.unit for r in rows}):
        sub = [r for r in rows if r.unit == unit]
        lines += [
            f"## Budget in {unit} (target held-out accuracy {sub[0].target:.3f})",
            "",
            "| method | seeds | reached | tokens to target (ratio, 95% CI) | rollouts to target | final acc. | "
            "Δ final vs uniform (95% CI) | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(sub, key=lambda r: r.tokens_ratio if not math.isnan(r.tokens_ratio) else math.inf):
            lo, hi = r.tokens_interval
            rlo, rhi = r.rollouts_interval
            dlo, dhi = r.final_interval
            lines.append(
                f"| {r.method} | {r.seeds} | {r.reached} | {_fmt(r.tokens_ratio)}x [{_fmt(lo)}, {_fmt(hi)}] | "
                f"{_fmt(r.rollouts_ratio)}x [{_fmt(rlo)}, {_fmt(rhi)}] | {r.final_accuracy:.3f} | "
                f"{r.final_delta:+.3f} [{dlo:+.3f}, {dhi:+.3f}] | {r.verdict} |"
            )
        lines.append("")
    path = out / "summary.md"
    path.write_text("\n".join(lines))
    _figures(runs, rows, out)
    return path


def _figures(runs: list[dict[str, Any]], rows: list[Comparison], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the figures need the notebooks extra
        return
    for unit in sorted({r.unit for r in rows}):
        fig, ax = plt.subplots(figsize=(8, 5))
        methods = sorted({r["spec"]["method"] for r in runs if r["spec"]["unit"] == unit})
        for method in methods:
            rs = [r for r in runs if r["spec"]["unit"] == unit and r["spec"]["method"] == method]
            x = torch.tensor([[e["tokens"] for e in r["evals"]] for r in rs], dtype=torch.float64).mean(0)
            y = torch.tensor([[e["accuracy"] for e in r["evals"]] for r in rs], dtype=torch.float64)
            med = y.median(0).values
            style = {"color": "black", "linewidth": 2.5} if method == BASELINE else {"linewidth": 1, "alpha": 0.8}
            ax.plot(x.tolist(), med.tolist(), label=method, **style)
            if method == BASELINE and y.shape[0] > 1:
                ax.fill_between(x.tolist(), y.min(0).values.tolist(), y.max(0).values.tolist(), color="grey", alpha=0.2)
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("held-out accuracy (median over seeds)")
        ax.set_title(f"Allocators, budget in {unit} (band: uniform's seed range)")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out / f"curves_{unit}.png", dpi=120)
        plt.close(fig)
        sub = sorted(
            (r for r in rows if r.unit == unit and not math.isnan(r.tokens_ratio)), key=lambda r: r.tokens_ratio
        )
        fig, ax = plt.subplots(figsize=(8, 5))
        ys = list(range(len(sub)))
        ratios = [min(r.tokens_ratio, 3.0) for r in sub]
        lo = [max(r.tokens_ratio - min(r.tokens_interval[0], 3.0), 0.0) for r in sub]
        hi = [max(min(r.tokens_interval[1], 3.0) - min(r.tokens_ratio, 3.0), 0.0) for r in sub]
        colors = [
            "tab:green" if r.verdict == "better" else "tab:red" if r.verdict == "worse" else "tab:grey" for r in sub
        ]
        ax.barh(ys, ratios, xerr=[lo, hi], color=colors)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(ys, [r.method for r in sub], fontsize=7)
        ax.set_xlabel("tokens to target / uniform's (95% bootstrap interval; capped at 3)")
        ax.set_title(f"Allocators, budget in {unit}")
        fig.tight_layout()
        fig.savefig(out / f"ratios_{unit}.png", dpi=120)
        plt.close(fig)
