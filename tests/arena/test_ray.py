"""Arena suites on Ray: a local Ray instance writes the same run files as the in-process runner."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from rolloutopt.arena import TaskSuite
from rolloutopt.arena._ray import import_ray, run_with_ray
from rolloutopt.arena.base import BaseConfig
from rolloutopt.arena.run import RunSpec
from rolloutopt.arena.suite import plan_runs, run_suite
from rolloutopt.errors import InputError

SUITE = TaskSuite(ops=("reverse",), lengths=(("reverse", (1, 2, 3)),), per_cell=12, holdout=3)
BASE = BaseConfig(hidden=16, steps=20, batch_size=16)
SIZES: dict[str, Any] = {"steps": 2, "prompts_per_step": 4, "group_size": 4, "pool": 8}


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUTOPT_CACHE", str(tmp_path / "cache"))


def _deterministic(path: Path) -> dict[str, Any]:
    """A run file without its timings (``method_seconds``), the only part that differs between identical runs."""
    record: dict[str, Any] = json.loads(path.read_text())
    for row in record["steps"]:
        row.pop("method_seconds")
    return record


def test_a_local_ray_instance_writes_the_same_records(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    specs = plan_runs(methods=["uniform", "dps"], seeds=[0], units=["rollouts"], **SIZES)
    local = run_suite(specs, tmp_path / "local", suite=SUITE, base=BASE, jobs=1)
    done: list[str] = []
    remote = run_suite(specs, tmp_path / "ray", suite=SUITE, base=BASE, ray_address="local",
                       on_done=lambda s, p: done.append(s.key))  # fmt: skip
    assert sorted(done) == sorted(s.key for s in specs)
    assert [p.name for p in remote] == [p.name for p in local]
    assert [_deterministic(p) for p in remote] == [_deterministic(p) for p in local]
    assert not ray.is_initialized()  # the suite started Ray, and shut it down
    assert not list((tmp_path / "ray").glob("*.tmp*"))  # written atomically
    # resuming: every file exists, so nothing runs (and Ray is not even started)
    again: list[str] = []
    run_suite(
        specs, tmp_path / "ray", suite=SUITE, base=BASE, ray_address="local", on_done=lambda s, p: again.append(s.key)
    )
    assert again == [s.key for s in specs] and not ray.is_initialized()


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'rolloutopt\[ray\]'"):
        import_ray()
    spec = RunSpec("allocator", "uniform", **SIZES)
    with pytest.raises(ImportError, match="rolloutopt"):
        run_suite([spec], tmp_path, suite=SUITE, base=BASE, ray_address="auto")


def test_bad_ray_arguments(tmp_path: Path) -> None:
    spec = RunSpec("allocator", "uniform", **SIZES)
    with pytest.raises(InputError, match="paths"):
        run_with_ray([spec], {}, SUITE, BASE, address="local")
    with pytest.raises(InputError, match="num_gpus_per_run"):
        run_with_ray([spec], {spec: tmp_path / "x.json"}, SUITE, BASE, address="local", num_gpus_per_run=-1)
    with pytest.raises(InputError, match="ray_address"):
        run_suite([spec], tmp_path, suite=SUITE, base=BASE, ray_address=3)  # type: ignore[arg-type]
