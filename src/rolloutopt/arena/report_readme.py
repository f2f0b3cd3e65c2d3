"""The arena's results in the README's Features table (its ``arena`` column) and on the method pages of the docs.

Every method the arena knows has one short result text (:func:`method_cells`), keyed by ``(family, method)``:

- an arena method with runs: per cohort, its tokens-to-target ratio against the family's baseline with the 95 %
  bootstrap interval where the report's verdict (:attr:`~rolloutopt.arena.report.Comparison.verdict`) is *better*
  or *worse*, ``too few seeds`` where the method or the baseline has fewer than
  :data:`~rolloutopt.arena.cohorts.MIN_SEEDS` runs, else ``not separable``; ``not separable from `uniform``` when
  every cohort is; the cohorts without runs (or whose baseline has none yet) are ``not run yet``; a stop rule adds the fraction of tokens it saved;
- the family's baseline: ``the baseline of the ... family``;
- a stop or length rule the arena refuses (:data:`~rolloutopt.arena.stops.REFUSED`): ``refused:`` and a short
  reason (:data:`SHORT_REASONS`).

A README row's methods are read from its ``area / module`` cell (:func:`row_keys`): ``advantages.x`` with ``x`` a
registered estimator, ``allocators.X`` with ``X`` a registered allocator's class, ``control.X`` naming a stop rule
the arena runs or refuses (a class or a function), and a bare backticked loss preset name (``preset `dr_grpo```).
:func:`update_readme` fills the ``arena`` column (after ``compared against``) from a runs directory; rows without an
arena method get ``—``. The docs hook (``docs_ext/arena_results.py``) reads the column back (:func:`readme_cells`)
and adds, to each method page, the results of the README rows whose objects the page's API section renders
(:func:`page_keys`).
"""

from __future__ import annotations

import importlib
import math
import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutopt.arena.report import FAMILIES, SCENARIOS, Comparison, cohort, compare, load_runs
from rolloutopt.arena.report_measures import stability
from rolloutopt.errors import InputError

__all__ = [
    "COHORTS",
    "SHORT_REASONS",
    "Row",
    "arena_keys",
    "method_cells",
    "page_keys",
    "readme_cells",
    "readme_rows",
    "row_cell",
    "row_keys",
    "row_objects",
    "update_readme",
]

Key = tuple[str, str]
"""``(family, method)``."""

COHORTS: dict[str, tuple[str, ...]] = {
    "allocator": ("rollouts", "tokens"),
    "estimator": ("g4", "g8"),
    "loss": SCENARIOS,
    "stop": ("rollouts",),
}
"""The cohorts of the default suite per family, in report order (a cohort missing from the runs is "not run yet")."""

SHORT_REASONS: dict[str, str] = {
    "abstention": "needs a value estimate (a critic or sampled continuations)",
    "adwin_horizon": "needs a teacher",
    "deer": "needs reasoning-transition markers",
    "espo": "needs a critic",
    "esr": "needs a teacher",
    "prune_opd": "needs a teacher",
    "prune_opd_window": "needs a teacher",
    "stable_opd": "needs a teacher",
    "step_grpo_truncation": "needs step markers",
    "step_aware_reward": "needs step markers",
    "siri_max_length": "its schedule has no paper defaults",
    "popd_horizon": "needs a teacher",
    "topd_horizon": "needs a teacher",
    "esr_mask": "needs a teacher",
    "jet_truncation_points": "cuts a reasoning prefix; arena responses have none",
    "jet_group_layout": "the layout of JET's truncated variants; arena responses have no reasoning to cut",
    "dler_difficulty_budget": "the budget of `dler_difficulty_penalty`, not a rule",
    "truncate_mask": "a helper, not a rule",
    "count_steps": "needs step markers",
    "absorbing_failure": "a helper for token-level GAE; the arena's loss takes sequence rewards",
    "egae": "needs a critic",
    "repeated_ngram_share": "needs a teacher",
}
"""Refused rule -> a few words of its reason (:data:`~rolloutopt.arena.stops.REFUSED` gives the whole reason); a
refused rule not listed gets the reason's first clause."""

_TOKEN = re.compile(r"`([^`]+)`")
_NAME = re.compile(r"^[a-z_]+(\.[A-Za-z_][A-Za-z_0-9]*)+$")
_HEADER = "| method | paper | area / module | compared against |"
_COLUMN = "arena"
_AFTER = "compared against"
_MODULE = "area / module"
_SEP = "<br>"


def arena_keys() -> dict[Key, str]:
    """Every method the arena knows -> ``"run"`` (its registered allocators, estimators, loss presets and the stop
    rules it runs, :data:`~rolloutopt.arena.stops.STOP_METHODS`) or ``"refused"``
    (:data:`~rolloutopt.arena.stops.REFUSED`)."""
    from rolloutopt import advantages, allocators, losses
    from rolloutopt.arena.stops import REFUSED, STOP_METHODS

    out: dict[Key, str] = {}
    for family, names in (
        ("allocator", allocators.names()),
        ("estimator", advantages.names()),
        ("loss", losses.names()),
        ("stop", list(STOP_METHODS)),
    ):
        out.update({(family, n): "run" for n in names})
    out.update({("stop", n): "refused" for n in REFUSED if ("stop", n) not in out})
    return out


def _fmt(x: float) -> str:
    return "∞" if math.isinf(x) else "n/a" if math.isnan(x) else f"{x:.2f}"


def _label(family: str, c: str) -> str:
    return f"G={c[1:]}" if family == "estimator" else c


def _short_reason(name: str) -> str:
    from rolloutopt.arena.stops import REFUSED

    if name in SHORT_REASONS:
        return SHORT_REASONS[name]
    return re.split(r"[;:(]", REFUSED[name], maxsplit=1)[0].strip()


def _text(family: str, method: str, rows: dict[str, Comparison], saved: float) -> str:
    """The result text of one arena method from its comparisons per cohort (see the module docstring)."""
    base = FAMILIES[family].baseline
    if method == base:
        return f"the baseline of the {family} family" + ("" if rows else ", not run yet")
    if not rows:
        return "not run yet"
    cohorts = [*COHORTS.get(family, ()), *sorted(set(rows) - set(COHORTS.get(family, ())))]
    present = [c for c in cohorts if c in rows]
    missing = [c for c in cohorts if c not in rows]
    separable = [c for c in present if rows[c].verdict in ("better", "worse")]
    few = [c for c in present if rows[c].verdict == "too few seeds"]
    rest = [c for c in present if rows[c].verdict == "not separable"]
    parts = []
    for c in separable:
        r = rows[c]
        label = f"{_label(family, c)}: " if len(cohorts) > 1 else ""
        if r.measure == "final":  # the baseline did not improve: the final accuracy decided
            lo, hi = r.final_interval
            parts.append(
                f"{label}{r.verdict} than `{base}`, final accuracy {r.final_delta:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            )
        else:
            lo, hi = r.tokens_interval
            parts.append(
                f"{label}{r.verdict} than `{base}`, {_fmt(r.tokens_ratio)}x tokens to target [{_fmt(lo)}, {_fmt(hi)}]"
            )
    if rest and not separable and not missing and not few:
        where = f" in {len(rest)} scenarios" if family == "loss" and len(rest) > 1 else ""
        parts.append(f"not separable from `{base}`{where}")
    elif rest:
        parts.append(f"{', '.join(_label(family, c) for c in rest)}: not separable")
    if few:
        parts.append(f"{', '.join(_label(family, c) for c in few)}: too few seeds")
    if missing:
        parts.append(f"{', '.join(_label(family, c) for c in missing)}: not run yet")
    text = "; ".join(parts)
    if family == "stop" and not math.isnan(saved):
        text = f"saves {100 * saved:.1f}% tokens, {text}"
    return text


def method_cells(runs_dir: str | Path) -> dict[Key, str]:
    """``(family, method)`` -> its result text (see the module docstring), for every method of :func:`arena_keys`
    and every method with runs under ``runs_dir``. Each cohort is compared on its own (the report's
    :func:`~rolloutopt.arena.report.compare`, so the same ratios and intervals as ``summary.md``); a cohort whose
    baseline has no run yet is left out (its methods' cohort reads ``not run yet``)."""
    runs = [r for r in load_runs(runs_dir) if r["spec"]["family"] in FAMILIES]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["spec"]["family"], cohort(r["spec"])), []).append(r)
    rows: dict[Key, dict[str, Comparison]] = {}
    for (family, c), rs in sorted(groups.items()):
        try:
            comparisons = compare(rs)
        except InputError:  # the baseline has no run in this cohort yet
            continue
        for comp in comparisons:
            rows.setdefault((family, comp.method), {})[c] = comp
    saved = {s.method: s.saved_frac for s in stability([r for r in runs if r["spec"]["family"] == "stop"], cohort)}
    known = arena_keys()
    out: dict[Key, str] = {}
    for key in [*known, *sorted(set(rows) - set(known))]:
        family, method = key
        if known.get(key) == "refused":
            out[key] = f"refused: {_short_reason(method)}"
        else:
            out[key] = _text(family, method, rows.get(key, {}), saved.get(method, math.nan))
    return out


def _resolve(token: str) -> Any:
    """The object ``rolloutopt.<token>`` names (``advantages.grpo``, ``allocators.GRESO``), or None."""
    head, *rest = token.split(".")
    if head not in ("advantages", "allocators", "control", "losses", "ratios"):
        return None
    try:
        obj: Any = importlib.import_module(f"rolloutopt.{head}")
        for part in rest:
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj


def _tokens(module_cell: str) -> list[str]:
    return [t.split("(")[0].strip() for t in _TOKEN.findall(module_cell)]


def row_keys(module_cell: str) -> list[Key]:
    """The arena methods a README row names in its ``area / module`` cell, in order (see the module docstring)."""
    from rolloutopt import advantages, allocators, control, losses

    by_class = {allocators.get(n).__name__: n for n in allocators.names()}
    rules = {control.get(n).__name__: n for n in control.names()}
    stops = {m for (f, m) in arena_keys() if f == "stop"}
    out: list[Key] = []
    for token in _tokens(module_cell):
        head, _, name = token.partition(".")
        key: Key | None = None
        if head == "advantages" and name in advantages.names():
            key = ("estimator", name)
        elif head == "allocators" and name in by_class:
            key = ("allocator", by_class[name])
        elif head == "control" and rules.get(name, name) in stops:
            key = ("stop", rules.get(name, name))
        elif not name and token in losses.names():
            key = ("loss", token)
        if key is not None and key not in out:
            out.append(key)
    return out


def row_objects(module_cell: str) -> list[str]:
    """The dotted paths a README row's objects are documented under: each object's module and, for a class or
    function, ``module.qualname`` (``rolloutopt.allocators.greso``, ``rolloutopt.allocators.greso.GRESO``)."""
    out: list[str] = []
    for token in _tokens(module_cell):
        if not _NAME.match(token):
            continue
        obj = _resolve(token)
        if obj is None:
            continue
        if isinstance(obj, types.ModuleType):
            out.append(obj.__name__)
            continue
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str):
            out.append(module)
            if isinstance(qualname, str):
                out.append(f"{module}.{qualname}")
    return out


def row_cell(keys: list[Key], cells: dict[Key, str]) -> str:
    """A README row's ``arena`` cell: ``—`` without arena methods, the method's text for one, else each method's
    text prefixed with its name (and family when the row's methods span families), separated by ``<br>``."""
    keys = [k for k in keys if k in cells]
    if not keys:
        return "—"
    if len(keys) == 1:
        return cells[keys[0]]
    one_family = len({f for f, _ in keys}) == 1
    return _SEP.join(f"{'' if one_family else f + ' '}`{m}`: {cells[(f, m)]}" for f, m in keys)


@dataclass(frozen=True)
class Row:
    """One row of the README's Features table: its method and module cells, its ``arena`` cell (``""`` when the
    table has no such column) and the arena methods it names."""

    method: str
    module: str
    arena: str
    keys: list[Key]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> tuple[int, int]:
    """The Features table's header line and the line after its last row."""
    start = next((i for i, line in enumerate(lines) if line.startswith(_HEADER)), None)
    if start is None:
        raise InputError("readme", f"a Features table whose header starts with {_HEADER!r}", "none", "pass README.md")
    end = start + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def readme_rows(text: str) -> list[Row]:
    """The rows of the README's Features table (see :class:`Row`)."""
    lines = text.splitlines()
    start, end = _table(lines)
    header = _cells(lines[start])
    at = header.index(_COLUMN) if _COLUMN in header else None
    out = []
    for line in lines[start + 2 : end]:
        cells = _cells(line)
        module = cells[header.index(_MODULE)]
        out.append(Row(cells[0], module, "" if at is None else cells[at], row_keys(module)))
    return out


def readme_cells(text: str) -> dict[Key, str]:
    """The result texts written in the README's ``arena`` column, read back per ``(family, method)`` (the inverse
    of :func:`row_cell`); empty when the table has no ``arena`` column."""
    out: dict[Key, str] = {}
    for row in readme_rows(text):
        if not row.arena or row.arena == "—" or not row.keys:
            continue
        if len(row.keys) == 1:
            out[row.keys[0]] = row.arena
            continue
        for key, part in zip(row.keys, row.arena.split(_SEP), strict=False):
            out[key] = part.split(": ", 1)[1] if ": " in part else part
    return out


def update_readme(readme_path: str | Path, runs_dir: str | Path) -> str:
    """The text of ``readme_path`` with the Features table's ``arena`` column (after ``compared against``; added
    when absent) filled from the runs under ``runs_dir`` (:func:`method_cells`, :func:`row_cell`). Idempotent; the
    file itself is not written."""
    text = Path(readme_path).read_text(encoding="utf-8")
    lines = text.splitlines()
    start, end = _table(lines)
    header = _cells(lines[start])
    if _COLUMN not in header:
        at = header.index(_AFTER) + 1
        lines[start] = "| " + " | ".join([*header[:at], _COLUMN, *header[at:]]) + " |"
        lines[start + 1] = "|" + "---|" * (len(header) + 1)
        for i in range(start + 2, end):
            cells = _cells(lines[i])
            lines[i] = "| " + " | ".join([*cells[:at], "", *cells[at:]]) + " |"
        header = _cells(lines[start])
    at, module = header.index(_COLUMN), header.index(_MODULE)
    cells_by_key = method_cells(runs_dir)
    for i in range(start + 2, end):
        cells = _cells(lines[i])
        cells[at] = row_cell(row_keys(cells[module]), cells_by_key)
        lines[i] = "| " + " | ".join(cells) + " |"
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def page_keys(markdown: str, readme_text: str) -> list[Key]:
    """The arena methods a docs page documents: those of the README rows (:func:`readme_rows`) one of whose objects
    (:func:`row_objects`) the page renders with a ``::: path`` block (the object itself or its whole module); a page
    without such blocks (the reference page) documents the rows whose method its title lists (``# ...: GRPO, RLOO``
    documents the rows ``GRPO (...)`` and ``RLOO``)."""
    directives = {m.group(1).strip() for m in re.finditer(r"^::: *(\S+)", markdown, flags=re.MULTILINE)}
    rows = readme_rows(readme_text)
    out: list[Key] = []
    if directives:
        matched = [r for r in rows if r.keys and directives & set(row_objects(r.module))]
    else:
        title = next((line[2:] for line in markdown.splitlines() if line.startswith("# ")), "")
        names = [n.strip().lower() for n in re.split(r",| and ", title.split(":", 1)[-1]) if n.strip()]
        matched = [r for r in rows if r.keys and any(_starts(r.method.lower(), n) for n in names)]
    for r in matched:
        out += [k for k in r.keys if k not in out]
    return out


def _starts(method: str, name: str) -> bool:
    return method.startswith(name) and (len(method) == len(name) or not method[len(name)].isalnum())
