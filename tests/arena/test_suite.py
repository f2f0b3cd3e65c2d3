"""Arena suites: planned seed-major, each run written to its own JSON, finished runs skipped on resume; the CLI."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rolloutopt import losses
from rolloutopt.arena import TaskSuite
from rolloutopt.arena.base import BaseConfig
from rolloutopt.arena.cli import summary
from rolloutopt.arena.run import SCENARIOS, RunSpec
from rolloutopt.arena.stops import STOP_METHODS
from rolloutopt.arena.suite import FAMILY_STEPS, plan_runs, run_suite
from rolloutopt.cli import main
from rolloutopt.errors import InputError

SUITE = TaskSuite(ops=("reverse",), lengths=(("reverse", (1, 2, 3)),), per_cell=12, holdout=3)
BASE = BaseConfig(hidden=16, steps=20, batch_size=16)
SIZES = {"steps": 1, "prompts_per_step": 4, "group_size": 4, "pool": 8}


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUTOPT_CACHE", str(tmp_path / "cache"))


def test_plan_is_seed_major_over_methods_and_units() -> None:
    specs = plan_runs(methods=["uniform", "dps"], seeds=[0, 1], units=["rollouts", "tokens"], steps=5)
    assert [s.key for s in specs[:4]] == [
        "allocator-uniform-rollouts-s0", "allocator-uniform-tokens-s0",
        "allocator-dps-rollouts-s0", "allocator-dps-tokens-s0",
    ]  # fmt: skip
    assert len(specs) == 8 and {s.seed for s in specs[4:]} == {1} and all(s.steps == 5 for s in specs)
    with pytest.raises(InputError, match="families"):
        plan_runs(["optimizers"])
    est = plan_runs(["estimator"], methods=["grpo", "rloo"], seeds=[0], group_sizes=[4, 8])
    assert [s.key for s in est] == [
        "estimator-grpo-rollouts-g4-s0", "estimator-rloo-rollouts-g4-s0",
        "estimator-grpo-rollouts-g8-s0", "estimator-rloo-rollouts-g8-s0",
    ]  # fmt: skip
    assert [(s.group_size * s.prompts_per_step) for s in est] == [128] * 4


def test_plan_of_the_loss_and_stop_families() -> None:
    """Every preset under every scenario (40 steps by default), every runnable stop rule (60 steps)."""
    loss = plan_runs(["loss"], methods=["grpo", "tis"], seeds=[0], scenarios=["sync", "stale16"])
    assert [s.key for s in loss] == [
        "loss-grpo-rollouts-s0", "loss-tis-rollouts-s0",
        "loss-grpo-rollouts-stale16-s0", "loss-tis-rollouts-stale16-s0",
    ]  # fmt: skip
    assert all(s.steps == FAMILY_STEPS["loss"] for s in loss)
    assert len(plan_runs(["loss"], seeds=[0])) == len(losses.names()) * len(SCENARIOS)
    stop = plan_runs(["stop"], seeds=[0, 1])
    assert [s.method for s in stop[: len(STOP_METHODS)]] == list(STOP_METHODS) and len(stop) == 2 * len(STOP_METHODS)
    assert plan_runs(["stop"], seeds=[0], steps=7)[0].steps == 7
    with pytest.raises(InputError, match="scenarios"):
        plan_runs(["loss"], scenarios=["stale2"])


def test_a_suite_resumes_where_it_stopped(tmp_path: Path) -> None:
    specs = plan_runs(methods=["uniform", "greso"], seeds=[0], units=["rollouts"], **SIZES)
    done: list[str] = []
    paths = run_suite(specs, tmp_path / "runs", suite=SUITE, base=BASE, jobs=1, on_done=lambda s, p: done.append(s.key))
    assert done == [s.key for s in specs] and all(p.exists() for p in paths)
    first = json.loads(paths[0].read_text())
    assert first["spec"]["method"] == "uniform" and len(first["steps"]) == 1
    stamp = paths[0].stat().st_mtime_ns
    paths[1].unlink()  # an interrupted suite: the second run never finished
    run_suite(specs, tmp_path / "runs", suite=SUITE, base=BASE, jobs=1)
    assert paths[1].exists() and paths[0].stat().st_mtime_ns == stamp  # the finished one was skipped
    rows = summary(tmp_path / "runs")
    assert [(r["method"], r["runs"]) for r in rows] == [("greso", 1), ("uniform", 1)]
    # the same directory for another base policy or other sizes: refused, naming what differs
    with pytest.raises(InputError, match=r"ramble=0.5 \(now 0.0\)") as err:
        run_suite(specs, tmp_path / "runs", suite=SUITE, base=BaseConfig(hidden=16, steps=20, batch_size=16,
                                                                          ramble=0.0), jobs=1)  # fmt: skip
    assert err.value.argument == "out_dir"
    longer = plan_runs(methods=["uniform"], seeds=[0], units=["rollouts"], **{**SIZES, "steps": 2})
    with pytest.raises(InputError, match=r"steps=1 \(now 2\)"):
        run_suite(longer, tmp_path / "runs", suite=SUITE, base=BASE, jobs=1)


def test_two_processes_write_the_same_records_as_one(tmp_path: Path) -> None:
    specs = plan_runs(methods=["uniform", "dps"], seeds=[0], units=["rollouts"], **SIZES)
    one = run_suite(specs, tmp_path / "one", suite=SUITE, base=BASE, jobs=1)
    two = run_suite(specs, tmp_path / "two", suite=SUITE, base=BASE, jobs=2)

    def evals(p: Path) -> object:
        return json.loads(p.read_text())["evals"]

    assert [evals(p) for p in one] == [evals(p) for p in two]


def test_the_cli_runs_and_summarises(tmp_path: Path) -> None:
    out = io.StringIO()
    argv = ["arena", "--methods", "uniform", "--seeds", "0", "--units", "rollouts", "--steps", "1", "--jobs", "1",
            "--out", str(tmp_path / "runs"), "--plain"]  # fmt: skip
    assert main(argv, out=out) == 0
    text = out.getvalue()
    assert "[1/1] allocator-uniform-rollouts-s0" in text and "allocator  uniform" in text and "report: " in text
    assert (tmp_path / "summary.md").exists()
    with pytest.raises(SystemExit):
        main(["arena", "--methods", "nope", "--out", str(tmp_path / "x"), "--plain"], out=out)


def test_bad_suite_arguments(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="jobs"):
        run_suite([RunSpec("allocator", "uniform")], tmp_path, jobs=0)
    with pytest.raises(InputError, match="out_dir"):
        run_suite([RunSpec("allocator", "uniform")], 3)  # type: ignore[arg-type]
