"""``python -m rolloutopt arena``: ``--device`` and ``--ray`` reach the suite; a bad value is a clean error."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rolloutopt.arena import TaskSuite, cli, suite
from rolloutopt.arena.base import BaseConfig
from rolloutopt.arena.run import RunSpec
from rolloutopt.arena.suite import run_suite
from rolloutopt.cli import main, parse_args
from rolloutopt.errors import InputError

SUITE = TaskSuite(ops=("reverse",), lengths=(("reverse", (1, 2, 3)),), per_cell=12, holdout=3)
BASE = BaseConfig(hidden=16, steps=20, batch_size=16)
SIZES: dict[str, Any] = {"steps": 1, "prompts_per_step": 4, "group_size": 4, "pool": 8}
ARGS = ["arena", "--methods", "uniform", "--seeds", "0", "--units", "rollouts", "--steps", "1", "--plain"]


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUTOPT_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``run_suite`` as the CLI sees it, replaced by a recorder of its arguments."""
    seen: list[dict[str, Any]] = []

    def fake(specs: list[RunSpec], out_dir: Path, **kwargs: Any) -> list[Path]:
        seen.append({"specs": list(specs), "out_dir": out_dir, **kwargs})
        return []

    monkeypatch.setattr(cli, "run_suite", fake)
    return seen


def test_the_defaults_are_the_cpu_and_local_processes() -> None:
    args = parse_args(["arena"])
    assert (args.device, args.ray, args.jobs) == ("cpu", None, None)


def test_device_and_ray_are_passed_through(calls: list[dict[str, Any]], tmp_path: Path) -> None:
    out = io.StringIO()
    argv = [*ARGS, "--device", "cuda:1", "--ray", "auto", "--out", str(tmp_path / "runs"), "--no-report"]
    assert main(argv, out=out) == 0
    ran = [c for c in calls if c["specs"]]
    assert len(ran) == 1 and [s.key for s in ran[0]["specs"]] == ["allocator-uniform-rollouts-s0"]
    assert (ran[0]["device"], ran[0]["ray_address"], ran[0]["jobs"]) == ("cuda:1", "auto", None)
    assert main([*ARGS, "--jobs", "3", "--out", str(tmp_path / "runs"), "--no-report"], out=out) == 0
    assert (calls[-1]["device"], calls[-1]["ray_address"], calls[-1]["jobs"]) == ("cpu", None, 3)


def test_a_bad_device_is_a_clean_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="arena: device: expected a torch device string, got 'gpu0'"):
        main([*ARGS, "--device", "gpu0", "--out", str(tmp_path / "runs")], out=io.StringIO())
    assert not (tmp_path / "runs").exists()  # refused before anything ran
    with pytest.raises(InputError, match="device"):
        run_suite([RunSpec("allocator", "uniform")], tmp_path, device="cuda:x")
    with pytest.raises(InputError, match="device"):
        run_suite([RunSpec("allocator", "uniform")], tmp_path, device=0)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clean_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="CUDA device of this machine"):
        main([*ARGS, "--device", "cuda", "--out", str(tmp_path / "runs")], out=io.StringIO())


def test_missing_ray_is_a_clean_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SystemExit, match=r"pip install 'rolloutopt\[ray\]'"):
        main([*ARGS, "--ray", "auto", "--out", str(tmp_path / "runs")], out=io.StringIO())


def test_the_device_reaches_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def fake_run(spec: RunSpec, suite_: Any = None, base: Any = None, **kwargs: Any) -> dict[str, Any]:
        seen.append(kwargs)
        return {"spec": spec.key}

    monkeypatch.setattr(suite, "run", fake_run)
    spec = RunSpec("allocator", "uniform", **SIZES)
    run_suite([spec], tmp_path / "cpu", suite=SUITE, base=BASE, jobs=1)
    assert seen == [{"device": "cpu"}]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run_suite([spec], tmp_path / "gpu", suite=SUITE, base=BASE, device="cuda:0")  # jobs: 1 per GPU, in-process
    assert seen[-1] == {"device": "cuda:0"} and (tmp_path / "gpu" / f"{spec.key}.json").exists()


def test_jobs_default_to_one_process_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [suite._default_jobs(d) for d in ("cpu", "cuda", "cuda:2")] == [2, 4, 1]
