r"""Per-run stability and fraction measures of the arena's report, their medians over seeds, and the synthetic
testbed's ranking of the allocators.

Each measure is computed per run from its record (``{"spec", "steps", "evals"}``), then summarised over the seeds
of one (family, cohort, method) by the median (the collapse flag by the fraction of seeds):

- **Collapse** (:func:`collapsed`): the run's final held-out accuracy is more than :data:`COLLAPSE_DROP` (0.1,
  absolute) below its best evaluation (the base policy's evaluation at step 0 included). It is measured against
  the run's own peak, not against the base policy's start: a run that never improves but does not fall is slow,
  not collapsed, and a run that climbs and then loses what it learnt is collapsed even when it ends above the start.
- **Gradient-norm spikes** (:func:`grad_spike_frac`): the fraction of the steps with a loss step whose
  ``grad_norm`` (the pre-clipping global norm, averaged over the step's inner optimizer steps) exceeds
  :data:`SPIKE_FACTOR` (10) times the run's median ``grad_norm``. Relative to the run's own median, so that
  methods whose advantages have another scale are not all flagged.
- **Final entropy** (:func:`final_entropy`): the mean policy entropy (per loss token) over the last
  :data:`ENTROPY_WINDOW` (10) steps of the run that took a loss step.
- **Method time** (:func:`method_ms`): the median over steps of ``method_seconds`` (the time inside the allocator's
  plan and update, or the rule's decisions), in milliseconds.
- **Trust-region fraction** (:func:`trust_region_metric`, :func:`mean_metric`): the mean over steps of the
  fraction of loss tokens the loss's trust region (or masking correction) clipped or masked, read from the metric
  :data:`TRUST_REGION_METRIC` names for the run's loss preset (the method itself in the loss family, the spec's
  ``loss`` elsewhere).
- **Stop fractions**: the means over steps of ``stopped_frac`` (rollouts a stop rule ended early) and
  ``saved_frac`` (generated tokens it saved), for the stop family.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutopt.arena._stats import nanmedian
from rolloutopt.arena.cohorts import group_runs
from rolloutopt.errors import InputError

__all__ = [
    "COLLAPSE_DROP",
    "ENTROPY_WINDOW",
    "SPIKE_FACTOR",
    "TRUST_REGION_METRIC",
    "RunMeasures",
    "Stability",
    "collapsed",
    "final_entropy",
    "grad_spike_frac",
    "mean_metric",
    "measure_run",
    "method_ms",
    "stability",
    "synthetic_ranking",
    "trust_region_metric",
]

COLLAPSE_DROP = 0.1
"""A run collapsed when its final held-out accuracy is more than this (absolute) below its best evaluation."""
SPIKE_FACTOR = 10.0
"""A step's gradient norm is a spike above this multiple of the run's median gradient norm."""
ENTROPY_WINDOW = 10
"""The final entropy is the mean over this many last steps that took a loss step."""

TRUST_REGION_METRIC: dict[str, str] = {
    # the preset's own masking stage: the fraction of loss tokens it removed
    "dppo_kl": "dppo_masked_frac",  # the binary KL divergence mask
    "dppo_tv": "dppo_masked_frac",  # the binary total-variation divergence mask
    "dppo_predictive": "dppo_masked_frac",  # the predictive top-K KL mask
    "m2po": "m2po_masked_frac",  # the second-moment mask (no clip)
    "opsm": "opsm_masked_frac",  # off-policy sequence masking (tokens of the masked sequences)
    "tbpo": "tbpo_out_of_band_frac",  # sequences outside the trust band, dropped
    "icepop": "mis_oob_frac",  # masked IS: tokens whose weight is outside [0.5, 5]
    "decoupled_ppo": "mis_oob_frac",  # behaviour weights above 5 masked (AReaL's rejection)
    "tis": "tis_high_frac",  # importance weights truncated at the cap
    "sapo": "masked_frac",  # a soft gate: nothing is clipped, only a mask would remove tokens (0 by construction)
    # the others clip the ratio (PPO clip, clip-higher, CISPO's weight clip, ECHO's per-rollout width, SAT's
    # contracted endpoints, M2PO's adaptive bounds, GSPO's sequence ratio): the clipped-token fraction
    "grpo": "clipfrac",
    "dapo": "clipfrac",
    "dr_grpo": "clipfrac",
    "gspo": "clipfrac",
    "cispo": "clipfrac",
    "copris": "clipfrac",
    "cumulative": "clipfrac",
    "pnpo": "clipfrac",
    "m2po_clip": "clipfrac",
    "sat": "clipfrac",
    "echo_clip": "clipfrac",
}
"""Loss preset -> the step metric that is the fraction of tokens its trust region clipped or masked: the preset's own
masking metric where it has one, else ``clipfrac``. A preset not listed (registered later) reads ``clipfrac``."""


def collapsed(evals: list[dict[str, Any]]) -> bool:
    """Whether the run collapsed: its last held-out accuracy is more than :data:`COLLAPSE_DROP` below the best of its
    evaluations (step 0, the base policy, included). The drop is measured from the run's own peak, not from the
    base policy's start."""
    if not evals:
        raise InputError("evals", "at least one evaluation", "none", "pass the run's evals")
    best = max(float(e["accuracy"]) for e in evals)
    return float(evals[-1]["accuracy"]) < best - COLLAPSE_DROP


def _values(steps: list[dict[str, Any]], name: str) -> list[float]:
    """The finite values of ``name`` over the steps that have it."""
    out = []
    for s in steps:
        v = s.get(name)
        if v is not None and math.isfinite(float(v)):
            out.append(float(v))
    return out


def grad_spike_frac(steps: list[dict[str, Any]]) -> float:
    """The fraction of the steps with a ``grad_norm`` (those that took a loss step) whose gradient norm is above
    :data:`SPIKE_FACTOR` times the median over those steps (two middle values averaged); NaN when no step has one."""
    g = _values(steps, "grad_norm")
    if not g:
        return math.nan
    ref = nanmedian(g)
    return sum(v > SPIKE_FACTOR * ref for v in g) / len(g)


def final_entropy(steps: list[dict[str, Any]]) -> float:
    """The mean ``entropy`` over the last :data:`ENTROPY_WINDOW` steps that have one; NaN when none has."""
    e = _values(steps, "entropy")[-ENTROPY_WINDOW:]
    return sum(e) / len(e) if e else math.nan


def method_ms(steps: list[dict[str, Any]]) -> float:
    """The median over steps of ``method_seconds``, in milliseconds; NaN without steps."""
    return 1000 * nanmedian(_values(steps, "method_seconds"))


def mean_metric(steps: list[dict[str, Any]], name: str) -> float:
    """The mean of the step metric ``name`` over the steps that have it; NaN when none has."""
    v = _values(steps, name)
    return sum(v) / len(v) if v else math.nan


def trust_region_metric(spec: dict[str, Any]) -> str:
    """The step metric holding the fraction of tokens the run's loss clipped or masked (:data:`TRUST_REGION_METRIC`
    of the loss preset: the method in the loss family, the spec's ``loss`` elsewhere, ``grpo`` when absent)."""
    preset = spec["method"] if spec["family"] == "loss" else spec.get("loss", "grpo")
    return TRUST_REGION_METRIC.get(preset, "clipfrac")


@dataclass(frozen=True)
class RunMeasures:
    """The measures of one run (see the module docstring); NaN where the run has nothing to measure."""

    collapsed: bool
    spike_frac: float
    final_entropy: float
    method_ms: float
    trust_metric: str
    trust_frac: float
    stopped_frac: float
    saved_frac: float


def measure_run(record: dict[str, Any]) -> RunMeasures:
    """Every measure of one run record."""
    steps = record["steps"]
    metric = trust_region_metric(record["spec"])
    return RunMeasures(
        collapsed=collapsed(record["evals"]),
        spike_frac=grad_spike_frac(steps),
        final_entropy=final_entropy(steps),
        method_ms=method_ms(steps),
        trust_metric=metric,
        trust_frac=mean_metric(steps, metric),
        stopped_frac=mean_metric(steps, "stopped_frac"),
        saved_frac=mean_metric(steps, "saved_frac"),
    )


@dataclass(frozen=True)
class Stability:
    """The measures of one (family, cohort, method) over its seeds: the fraction of seeds that collapsed, and the
    median over seeds of every other measure (NaN runs left out)."""

    family: str
    method: str
    cohort: str
    seeds: int
    collapse_frac: float
    spike_frac: float
    final_entropy: float
    method_ms: float
    trust_metric: str
    trust_frac: float
    stopped_frac: float
    saved_frac: float


def stability(runs: list[dict[str, Any]], cohort: Callable[[dict[str, Any]], str]) -> list[Stability]:
    """:class:`Stability` of every (family, cohort, method) in ``runs``, sorted; ``cohort(spec)`` names a run's
    cohort (the report's family table)."""
    groups = {key: [measure_run(r) for r in rs] for key, rs in group_runs(runs, cohort).items()}
    out = []
    for (family, c, method), ms in sorted(groups.items()):
        metrics = sorted({m.trust_metric for m in ms})
        out.append(
            Stability(
                family=family,
                method=method,
                cohort=c,
                seeds=len(ms),
                collapse_frac=sum(m.collapsed for m in ms) / len(ms),
                spike_frac=nanmedian([m.spike_frac for m in ms]),
                final_entropy=nanmedian([m.final_entropy for m in ms]),
                method_ms=nanmedian([m.method_ms for m in ms]),
                trust_metric="/".join(metrics),
                trust_frac=nanmedian([m.trust_frac for m in ms]),
                stopped_frac=nanmedian([m.stopped_frac for m in ms]),
                saved_frac=nanmedian([m.saved_frac for m in ms]),
            )
        )
    return out


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def synthetic_ranking(path: str | Path) -> dict[str, float]:
    """The synthetic :class:`~rolloutopt.testbed.PromptPopulation` results of ``benchmarks/results/allocators.md``:
    registered allocator name -> rollouts to target as a ratio to ``Uniform`` (its "vs Uniform" column).

    The file's first table with a "vs Uniform" column is read (the latest run's Part 1); a row's label (``DPS``,
    ``HIVE (no prompt entropy)``, ``Uniform (n=8)``) is matched to the allocator whose class has that name. An
    :class:`~rolloutopt.errors.InputError` when there is no such table or a label matches no allocator.
    """
    from rolloutopt import allocators

    by_class = {allocators.get(n).__name__: n for n in allocators.names()}
    lines = Path(path).read_text().splitlines()
    header = next((i for i, line in enumerate(lines) if line.lstrip().startswith("|") and "vs Uniform" in line), None)
    if header is None:
        raise InputError("path", "a markdown table with a 'vs Uniform' column", str(path), "pass allocators.md")
    cols = [c.strip() for c in lines[header].strip().strip("|").split("|")]
    at = cols.index("vs Uniform")
    out: dict[str, float] = {}
    for line in lines[header + 1 :]:
        if not line.lstrip().startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-", ":"}:  # the separator row
            continue
        label = cells[0].split("(")[0].strip()
        name = by_class.get(label, _snake(label))
        if name not in allocators.names():
            raise InputError("path", "rows labelled by allocator class names", repr(cells[0]), "fix the table")
        out[name] = float(cells[at].rstrip("x"))
    return out
