"""The README's ``arena`` column: equal to what the committed runs give (it cannot drift from the results), every
arena method in some row, idempotent, and the cell texts of hand-made runs."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from rolloutopt.arena import cli
from rolloutopt.arena.report import SCENARIOS
from rolloutopt.arena.report_readme import (
    SHORT_REASONS,
    arena_keys,
    method_cells,
    readme_cells,
    readme_rows,
    row_cell,
    row_keys,
    update_readme,
)
from rolloutopt.arena.stops import REFUSED
from rolloutopt.cli import main
from rolloutopt.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUNS = ROOT / "benchmarks" / "results" / "arena" / "runs"

NO_ROW = {
    ("stop", "none"),  # the stop family's baseline, generation without a rule
    ("stop", "count_steps"),  # Step-GRPO's step counter (a helper)
    ("stop", "dler_difficulty_budget"),  # the budget of dler_difficulty_penalty
    ("stop", "repeated_ngram_share"),  # Stable-OPD's repetition score
    ("stop", "truncate_mask"),  # the mask cut every streaming rule applies
}
"""The methods the arena knows (runs or refuses) that have no row of their own in the Features table."""


def record(
    family: str, method: str, seed: int, acc: list[float], tokens: float, steps: list[dict[str, float]] | None = None,
    **spec: Any,
) -> dict[str, Any]:  # fmt: skip
    evals = [{"step": i, "accuracy": a, "tokens": i * tokens, "rollouts": i * 10.0} for i, a in enumerate(acc)]
    spec = {"family": family, "method": method, "seed": seed, "unit": "rollouts", **spec}
    return {"spec": spec, "evals": evals, "steps": steps or []}


def write(runs: list[dict[str, Any]], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for i, r in enumerate(runs):
        (out / f"{i:04d}.json").write_text(json.dumps(r))
    return out


CURVE = [0.2, 0.3, 0.4, 0.5, 0.6]
FLAT = [0.2, 0.2, 0.2, 0.2, 0.2]


@pytest.fixture
def tiny_runs(tmp_path: Path) -> Path:
    """Allocators: ``greso`` reaches the target with half uniform's tokens at the rollout budget (better) and as
    uniform at the token budget; ``pilot_commit`` never reaches it (worse) and has no token-budget runs. Estimators:
    ``rloo`` equals ``grpo`` at G = 4, no G = 8 runs. Loss presets: ``dapo`` equals ``grpo`` in every scenario,
    ``gspo`` too except under ``stale16`` where it never reaches the target. Stop rules: ``dot`` equals ``none`` and
    saves a quarter of the tokens."""
    runs = []
    for seed in range(3):
        for unit in ("rollouts", "tokens"):
            runs.append(record("allocator", "uniform", seed, CURVE, 100.0, unit=unit))
            runs.append(record("allocator", "greso", seed, CURVE, 50.0 if unit == "rollouts" else 100.0, unit=unit))
        runs.append(record("allocator", "pilot_commit", seed, FLAT, 100.0, unit="rollouts"))
        runs.append(record("estimator", "grpo", seed, CURVE, 100.0, unit="rollouts", group_size=4))
        runs.append(record("estimator", "rloo", seed, CURVE, 100.0, unit="rollouts", group_size=4))
        for sc in SCENARIOS:
            runs.append(record("loss", "grpo", seed, CURVE, 100.0, unit="rollouts", scenario=sc))
            runs.append(record("loss", "dapo", seed, CURVE, 100.0, unit="rollouts", scenario=sc))
            runs.append(record("loss", "gspo", seed, FLAT if sc == "stale16" else CURVE, 100.0, scenario=sc))
        runs.append(record("stop", "none", seed, CURVE, 100.0, unit="rollouts"))
        runs.append(record("stop", "dot", seed, CURVE, 100.0, [{"saved_frac": 0.25}, {"saved_frac": 0.25}]))
    return write(runs, tmp_path / "runs")


def test_cells_of_hand_made_runs(tiny_runs: Path) -> None:
    cells = method_cells(tiny_runs)
    assert cells[("allocator", "greso")] == (
        "rollouts: better than `uniform`, 0.50x tokens to target [0.50, 0.50]; tokens: not separable"
    )
    assert cells[("allocator", "pilot_commit")] == (
        "rollouts: worse than `uniform`, ∞x tokens to target [∞, ∞]; tokens: not run yet"
    )
    assert cells[("allocator", "uniform")] == "the baseline of the allocator family"
    assert cells[("allocator", "dps")] == "not run yet"
    assert cells[("estimator", "rloo")] == "G=4: not separable; G=8: not run yet"
    assert cells[("loss", "dapo")] == "not separable from `grpo` in 6 scenarios"
    assert cells[("loss", "gspo")] == (
        "stale16: worse than `grpo`, ∞x tokens to target [∞, ∞]; sync, stale4, mismatch, april, copris: not separable"
    )
    assert cells[("stop", "dot")] == "saves 25.0% tokens, not separable from `none`"
    assert cells[("stop", "none")] == "the baseline of the stop family"
    assert cells[("stop", "arrol")] == "not run yet"
    assert cells[("stop", "esr")] == "refused: needs a teacher"
    assert cells[("stop", "espo")] == "refused: needs a critic"
    assert set(arena_keys()) <= set(cells)


def test_a_cohort_without_its_baseline_is_not_run_yet_and_two_seeds_are_too_few(tmp_path: Path) -> None:
    runs = [record("allocator", "greso", s, CURVE, 100.0, unit="rollouts") for s in range(3)]
    runs += [record("allocator", m, s, CURVE, 100.0, unit="tokens") for s in range(2) for m in ("uniform", "greso")]
    cells = method_cells(write(runs, tmp_path / "runs"))
    assert cells[("allocator", "greso")] == "tokens: too few seeds; rollouts: not run yet"
    runs += [record("allocator", m, 2, CURVE, 100.0, unit="tokens") for m in ("uniform", "greso")]
    cells = method_cells(write(runs, tmp_path / "runs3"))
    assert cells[("allocator", "greso")] == "tokens: not separable; rollouts: not run yet"


def test_every_refused_rule_has_a_short_reason() -> None:
    assert set(REFUSED) <= set(SHORT_REASONS), "add the new refusal's few words to SHORT_REASONS"


def test_row_keys_read_the_module_cell() -> None:
    assert row_keys("advantages / `advantages.dr_grpo`, loss preset `dr_grpo`") == [
        ("estimator", "dr_grpo"),
        ("loss", "dr_grpo"),
    ]
    assert row_keys("allocators / `allocators.GRESO`, `allocators.PromptTable`") == [("allocator", "greso")]
    assert row_keys("control / `control.ESPO`, `control.absorbing_failure`; `control.ESPOCriticFree`") == [
        ("stop", "espo"),
        ("stop", "absorbing_failure"),
        ("stop", "espo_critic_free"),
    ]
    assert row_keys("ratios / `ratios.DPPO(predictive=True)`; preset `dppo_predictive`") == [
        ("loss", "dppo_predictive")
    ]
    assert row_keys("kernels / `kernels.token_logprobs`") == []
    assert row_cell([], {}) == "—"


def test_every_arena_method_is_in_a_readme_row() -> None:
    named = {k for row in readme_rows(README.read_text(encoding="utf-8")) for k in row.keys}
    assert set(arena_keys()) - named == NO_ROW


SMALL = """# x

## Features

| method | paper | area / module | compared against | tested in |
|---|---|---|---|---|
| GRESO | 2506.02177 | allocators / `allocators.GRESO` | authors' code | `tests/a.py` |
| Dr.GRPO | 2503.20783 | advantages / `advantages.dr_grpo`, loss preset `dr_grpo` | trainer | `tests/b.py` |
| Kernel | — | kernels / `kernels.token_logprobs` | reference | `tests/c.py` |

## After
"""


def test_update_readme_adds_the_column_and_is_idempotent(tiny_runs: Path, tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text(SMALL)
    once = update_readme(path, tiny_runs)
    lines = once.splitlines()
    assert lines[4] == "| method | paper | area / module | compared against | arena | tested in |"
    assert lines[5] == "|---|---|---|---|---|---|"
    assert lines[6] == (
        "| GRESO | 2506.02177 | allocators / `allocators.GRESO` | authors' code | rollouts: better than `uniform`, "
        "0.50x tokens to target [0.50, 0.50]; tokens: not separable | `tests/a.py` |"
    )
    assert lines[7].split(" | ")[4] == "estimator `dr_grpo`: not run yet<br>loss `dr_grpo`: not run yet"
    assert lines[8].split(" | ")[4] == "—"
    assert once.endswith("## After\n") and path.read_text() == SMALL  # the file itself is not written
    path.write_text(once)
    assert update_readme(path, tiny_runs) == once
    assert readme_cells(once) == {
        k: v
        for k, v in method_cells(tiny_runs).items()
        if k in {("allocator", "greso"), *row_keys("`advantages.dr_grpo` `dr_grpo`")}
    }


def test_update_readme_needs_the_features_table(tmp_path: Path, tiny_runs: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text("# nothing here\n")
    with pytest.raises(InputError, match="Features table"):
        update_readme(path, tiny_runs)


def test_the_cli_rewrites_the_readme_of_the_current_directory(
    tiny_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "run_suite", lambda specs, out_dir, **kwargs: [])  # the runs are there already
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text(SMALL)
    out = io.StringIO()
    argv = ["arena", "--methods", "uniform", "--seeds", "0", "--plain", "--no-report", "--readme"]
    assert main([*argv, "--out", str(tiny_runs)], out=out) == 0
    assert (tmp_path / "README.md").read_text() == update_readme(tmp_path / "README.md", tiny_runs)
    assert "| arena |" in (tmp_path / "README.md").read_text()
    assert f"readme: {tmp_path / 'README.md'}" in out.getvalue()
    (tmp_path / "README.md").unlink()
    with pytest.raises(SystemExit, match=r"needs README\.md"):
        main([*argv, "--out", str(tiny_runs)], out=io.StringIO())


def test_the_committed_readme_states_the_committed_results() -> None:
    """README.md's arena column is what the runs under benchmarks/results/arena/runs give: after new runs, rerun
    ``python -m rolloutopt arena --readme`` (or write ``update_readme``'s text) and commit both."""
    text = README.read_text(encoding="utf-8")
    assert update_readme(README, RUNS) == text, (
        "README's arena column is stale: run python -m rolloutopt arena --readme"
    )
