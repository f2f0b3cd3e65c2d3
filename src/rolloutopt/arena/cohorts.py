"""How the arena's report groups runs: each family's cohorts and baseline (:data:`FAMILIES`), and the
:class:`Comparison` of one method in one cohort against that baseline (computed by
:func:`rolloutopt.arena.report.compare`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolloutopt.arena.run import SCENARIOS as _RUN_SCENARIOS
from rolloutopt.errors import InputError

__all__ = ["FAMILIES", "MIN_SEEDS", "SCENARIOS", "Comparison", "Family", "cohort", "cohort_key", "group_runs"]

MIN_SEEDS = 3
"""The fewest seeds, of the method and of its baseline each, on which :attr:`Comparison.verdict` judges: with 1 or 2
the bootstrap resamples (nearly) one value and its interval collapses to a point, so any difference would read as
*better* or *worse*."""

SCENARIOS = tuple(_RUN_SCENARIOS)
"""The loss family's scenarios, in report order (a record without ``scenario`` is ``sync``)."""


@dataclass(frozen=True)
class Family:
    """How the report groups one family's runs: ``cohort(spec)`` names the runs compared with each other,
    ``baseline`` the method every other one is compared with in its cohort, ``title`` the section heading and
    ``describe(cohort)`` the cohort's words in it."""

    cohort: Callable[[dict[str, Any]], str]
    baseline: str
    title: str
    describe: Callable[[str], str]


FAMILIES: dict[str, Family] = {
    "allocator": Family(lambda s: str(s["unit"]), "uniform", "Allocators", lambda c: f"budget in {c}"),
    "estimator": Family(lambda s: f"g{s['group_size']}", "grpo", "Estimators", lambda c: f"group size {c[1:]}"),
    "loss": Family(lambda s: str(s.get("scenario", "sync")), "grpo", "Loss presets", lambda c: f"scenario `{c}`"),
    "stop": Family(lambda s: "rollouts", "none", "Stop and length rules", lambda c: f"budget in {c}"),
}
"""Family -> its cohort function, baseline and headings."""


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise InputError("spec['family']", f"one of {tuple(FAMILIES)}", repr(name), "add it to report.FAMILIES")
    return FAMILIES[name]


def cohort(spec: dict[str, Any]) -> str:
    """The cohort of a run's spec: its family's :attr:`Family.cohort`."""
    return _family(spec["family"]).cohort(spec)


def cohort_key(family: str, c: str) -> tuple[int, int, str]:
    """Report order: families as in :data:`FAMILIES`, scenarios as in :data:`SCENARIOS`, else by name."""
    order = list(FAMILIES).index(family) if family in FAMILIES else len(FAMILIES)
    return order, SCENARIOS.index(c) if c in SCENARIOS else len(SCENARIOS), c


@dataclass(frozen=True)
class Comparison:
    """One method in one cohort against its family's baseline (see the module docstring)."""

    family: str
    method: str
    cohort: str
    seeds: int
    baseline_seeds: int
    target: float
    tokens_ratio: float
    tokens_interval: tuple[float, float]
    rollouts_ratio: float
    rollouts_interval: tuple[float, float]
    final_accuracy: float
    final_delta: float
    final_interval: tuple[float, float]
    reached: int
    measure: str = "tokens"

    @property
    def verdict(self) -> str:
        """``"better"``, ``"worse"`` or ``"not separable"``, decided by the interval of :attr:`measure`: tokens to
        target (better when the whole interval is below 1), or, in a cohort whose baseline ends no better than it
        started (``measure == "final"``: the target is the start, every run "reaches" it at step 0), the final
        accuracy's difference to the baseline (better when the whole interval is above 0). ``"too few seeds"``
        when the method or the baseline has fewer than :data:`MIN_SEEDS` runs."""
        if min(self.seeds, self.baseline_seeds) < MIN_SEEDS:
            return "too few seeds"
        if self.measure == "final":
            lo, hi = self.final_interval
            return "better" if lo > 0 else "worse" if hi < 0 else "not separable"
        lo, hi = self.tokens_interval
        return "better" if hi < 1 else "worse" if lo > 1 else "not separable"


def group_runs(
    runs: list[dict[str, Any]], by: Callable[[dict[str, Any]], str] = cohort
) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """The run records by (family, cohort, method), in the order they come; ``by(spec)`` names a run's cohort."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        s = r["spec"]
        groups.setdefault((s["family"], by(s), s["method"]), []).append(r)
    return groups
