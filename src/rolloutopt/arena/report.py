r"""What the arena's runs say: tokens- and rollouts-to-target against the baseline with bootstrap intervals, final
accuracy at the fixed budget, and figures.

**Target.** For each budget unit, the baseline is ``uniform`` (GRPO's fixed group size over the same candidate
pools). Its median held-out accuracy over seeds goes from :math:`a_0` (the base policy) to :math:`a_1` at the end;
the target is :math:`a_0 + 0.8\,(a_1 - a_0)`. A run's *tokens to target* is the cumulative number of generated
tokens at which its held-out accuracy first reaches the target, linearly interpolated between evaluations
(infinite when it never does); *rollouts to target* likewise.

**Ratio and interval.** A method's ratio is the median of its runs' tokens to target over the median of the
baseline's; the 95 % interval is the 2.5 and 97.5 percentiles of that ratio over 2,000 bootstrap draws that resample
the method's seeds and the baseline's seeds independently (seeded); a draw in which neither the method nor the
baseline reaches the target has no ratio and is left out, and the interval is n/a when more than 10 % of the draws
are. A method is *better* only when the whole
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

BASELINES = {"allocator": "uniform", "estimator": "grpo"}
TARGET_FRACTION = 0.8
DRAWS = 2000
DEFINED = 0.9
"""An interval needs a ratio in at least this fraction of the bootstrap draws (else it is n/a)."""


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
    defined = ~values.isnan()  # a resample whose method and baseline both never reach the target has no ratio
    if float(defined.double().mean()) < DEFINED:
        return math.nan, math.nan
    values = values[defined]
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


def _cohort(spec: dict[str, Any]) -> str:
    """Runs compared with each other: an allocator's budget unit, an estimator's group size."""
    return spec["unit"] if spec["family"] == "allocator" else f"G={spec['group_size']}"


def compare(runs: list[dict[str, Any]]) -> list[Comparison]:
    """A :class:`Comparison` of every (family, method, cohort) with at least one run, against the family's baseline
    in the same cohort: ``uniform`` at the same budget unit, or the ``grpo`` estimator at the same group size."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        s = r["spec"]
        groups.setdefault((s["family"], _cohort(s), s["method"]), []).append(r)
    out = []
    for family, unit in sorted({(f, c) for f, c, _ in groups}):
        name = BASELINES[family]
        base = groups.get((family, unit, name))
        if not base:
            raise InputError("runs", f"runs of the baseline {name!r} ({family}, {unit})", "none", "run them first")
        a0 = _median(torch.tensor([r["evals"][0]["accuracy"] for r in base]))
        a1 = _median(torch.tensor([r["evals"][-1]["accuracy"] for r in base]))
        target = a0 + TARGET_FRACTION * (a1 - a0)
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
    lines = ["# Arena: every method against its family's baseline", ""]
    for family, unit in sorted({(r.family, r.unit) for r in rows}):
        sub = [r for r in rows if (r.family, r.unit) == (family, unit)]
        what = f"budget in {unit}" if family == "allocator" else f"group size {unit[2:]}"
        lines += [
            f"## {family.capitalize()}s, {what}: against `{BASELINES[family]}` (target held-out accuracy "
            f"{sub[0].target:.3f})",
            "",
            "| method | seeds | reached | tokens to target (ratio, 95% CI) | rollouts to target | final acc. | "
            "Δ final vs baseline (95% CI) | verdict |",
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
    for family, unit in sorted({(r.family, r.unit) for r in rows}):
        base = BASELINES[family]
        tag = f"{family}_{unit.replace('G=', 'g')}"
        what = f"budget in {unit}" if family == "allocator" else f"group size {unit[2:]}"
        mine = [r for r in runs if r["spec"]["family"] == family and _cohort(r["spec"]) == unit]
        fig, ax = plt.subplots(figsize=(8, 5))
        for method in sorted({r["spec"]["method"] for r in mine}):
            rs = [r for r in mine if r["spec"]["method"] == method]
            x = torch.tensor([[e["tokens"] for e in r["evals"]] for r in rs], dtype=torch.float64).mean(0)
            y = torch.tensor([[e["accuracy"] for e in r["evals"]] for r in rs], dtype=torch.float64)
            style = {"color": "black", "linewidth": 2.5} if method == base else {"linewidth": 1, "alpha": 0.8}
            ax.plot(x.tolist(), y.median(0).values.tolist(), label=method, **style)
            if method == base and y.shape[0] > 1:
                ax.fill_between(x.tolist(), y.min(0).values.tolist(), y.max(0).values.tolist(), color="grey", alpha=0.2)
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("held-out accuracy (median over seeds)")
        ax.set_title(f"{family.capitalize()}s, {what} (band: {base}'s seed range)")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(out / f"{tag}_curves.png", dpi=120)
        plt.close(fig)
        cap = 3.0
        sub = [r for r in rows if (r.family, r.unit) == (family, unit) and not math.isnan(r.tokens_ratio)]
        sub.sort(key=lambda r: r.tokens_ratio)
        ratios = [min(r.tokens_ratio, cap) for r in sub]
        lo = [0.0 if math.isnan(r.tokens_interval[0]) else max(v - min(r.tokens_interval[0], cap), 0.0)
              for r, v in zip(sub, ratios, strict=True)]  # fmt: skip
        hi = [0.0 if math.isnan(r.tokens_interval[1]) else max(min(r.tokens_interval[1], cap) - v, 0.0)
              for r, v in zip(sub, ratios, strict=True)]  # fmt: skip
        colors = ["tab:green" if r.verdict == "better" else "tab:red" if r.verdict == "worse" else "tab:grey"
                  for r in sub]  # fmt: skip
        fig, ax = plt.subplots(figsize=(8, 5))
        ys = list(range(len(sub)))
        ax.barh(ys, ratios, xerr=[lo, hi], color=colors)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_yticks(ys, [r.method for r in sub], fontsize=7)
        ax.set_xlabel(f"tokens to target / {base}'s (95% bootstrap interval; capped at {cap:g})")
        ax.set_title(f"{family.capitalize()}s, {what}")
        fig.tight_layout()
        fig.savefig(out / f"{tag}_ratios.png", dpi=120)
        plt.close(fig)
