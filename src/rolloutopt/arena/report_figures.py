"""The arena report's figures (matplotlib, from the notebooks extra; nothing is drawn without it): per family and
cohort the accuracy curves and the tokens-to-target ratios, the loss presets' clipped-or-masked fractions per
scenario, and the stop rules' saved and stopped fractions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from rolloutopt.arena.cohorts import FAMILIES, SCENARIOS, Comparison, cohort
from rolloutopt.arena.report_measures import Stability

__all__ = ["figures"]


def figures(runs: list[dict[str, Any]], rows: list[Comparison], stab: list[Stability], out: Path) -> None:
    """Write every figure under ``out``: ``{family}_{cohort}_curves.png`` and ``{family}_{cohort}_ratios.png`` per
    cohort, ``loss_fractions.png`` (a grouped bar chart, presets x scenarios, of the fraction of tokens each preset's
    trust region clipped or masked) when there are loss runs, and ``stop_fractions.png`` (saved and stopped
    fractions per rule) when there are stop runs. Does nothing when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the figures need the notebooks extra
        return
    for family, unit in sorted({(r.family, r.cohort) for r in rows}):
        _curves(plt, runs, family, unit, out)
        _ratios(plt, [r for r in rows if (r.family, r.cohort) == (family, unit)], family, unit, out)
    loss = [s for s in stab if s.family == "loss"]
    if loss:
        _loss_fractions(plt, loss, out)
    stop = [s for s in stab if s.family == "stop"]
    if stop:
        _stop_fractions(plt, stop, out)


def _curves(plt: Any, runs: list[dict[str, Any]], family: str, unit: str, out: Path) -> None:
    fam = FAMILIES[family]
    base = fam.baseline
    mine = [r for r in runs if r["spec"]["family"] == family and cohort(r["spec"]) == unit]
    fig, ax = plt.subplots(figsize=(8, 5))
    for method in sorted({r["spec"]["method"] for r in mine}):
        rs = [r for r in mine if r["spec"]["method"] == method]
        n = min(len(r["evals"]) for r in rs)  # runs of one method share their evaluation steps
        x = torch.tensor([[e["tokens"] for e in r["evals"][:n]] for r in rs], dtype=torch.float64).mean(0)
        y = torch.tensor([[e["accuracy"] for e in r["evals"][:n]] for r in rs], dtype=torch.float64)
        style = {"color": "black", "linewidth": 2.5} if method == base else {"linewidth": 1, "alpha": 0.8}
        ax.plot(x.tolist(), y.median(0).values.tolist(), label=method, **style)
        if method == base and y.shape[0] > 1:
            ax.fill_between(x.tolist(), y.min(0).values.tolist(), y.max(0).values.tolist(), color="grey", alpha=0.2)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("held-out accuracy (median over seeds)")
    ax.set_title(f"{fam.title}, {fam.describe(unit).replace('`', '')} (band: {base}'s seed range)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / f"{family}_{unit}_curves.png", dpi=120)
    plt.close(fig)


def _ratios(plt: Any, rows: list[Comparison], family: str, unit: str, out: Path) -> None:
    fam = FAMILIES[family]
    cap = 3.0
    sub = sorted((r for r in rows if not math.isnan(r.tokens_ratio)), key=lambda r: r.tokens_ratio)
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
    ax.set_xlabel(f"tokens to target / {fam.baseline}'s (95% bootstrap interval; capped at {cap:g})")
    ax.set_title(f"{fam.title}, {fam.describe(unit).replace('`', '')}")
    fig.tight_layout()
    fig.savefig(out / f"{family}_{unit}_ratios.png", dpi=120)
    plt.close(fig)


def _loss_fractions(plt: Any, stab: list[Stability], out: Path) -> None:
    presets = sorted({s.method for s in stab})
    scenarios = sorted({s.cohort for s in stab}, key=lambda c: (SCENARIOS.index(c) if c in SCENARIOS else 99, c))
    value = {(s.method, s.cohort): s.trust_frac for s in stab}
    width = 0.8 / len(scenarios)
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(presets) * len(scenarios) ** 0.5), 5))
    for k, sc in enumerate(scenarios):
        xs = [i - 0.4 + (k + 0.5) * width for i in range(len(presets))]
        ys = [100 * value.get((p, sc), math.nan) for p in presets]
        ax.bar(xs, [0.0 if math.isnan(y) else y for y in ys], width, label=sc)
    ax.set_xticks(range(len(presets)), presets, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("tokens clipped or masked by the trust region (%, mean over steps, median over seeds)")
    ax.set_title("Loss presets: clipped or masked fraction per scenario")
    ax.legend(fontsize=7, title="scenario")
    fig.tight_layout()
    fig.savefig(out / "loss_fractions.png", dpi=120)
    plt.close(fig)


def _stop_fractions(plt: Any, stab: list[Stability], out: Path) -> None:
    sub = sorted(stab, key=lambda s: (-(0.0 if math.isnan(s.saved_frac) else s.saved_frac), s.method))
    ys = list(range(len(sub)))
    saved = [0.0 if math.isnan(s.saved_frac) else 100 * s.saved_frac for s in sub]
    stopped = [0.0 if math.isnan(s.stopped_frac) else 100 * s.stopped_frac for s in sub]
    fig, ax = plt.subplots(figsize=(8, max(3, 0.35 * len(sub) + 1.5)))
    ax.barh([y - 0.2 for y in ys], saved, 0.4, label="tokens saved", color="tab:blue")
    ax.barh([y + 0.2 for y in ys], stopped, 0.4, label="rollouts stopped", color="tab:orange")
    ax.set_yticks(ys, [s.method for s in sub], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% (mean over steps, median over seeds)")
    ax.set_title("Stop and length rules: saved tokens and stopped rollouts")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "stop_fractions.png", dpi=120)
    plt.close(fig)
