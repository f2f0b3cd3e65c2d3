"""One arena run: every allocator by name, in both budget units, runs end to end on a tiny suite and policy;
a run is deterministic per seed; bad specs are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

import rolloutopt.advantages as advantages
import rolloutopt.allocators as allocators
from rolloutopt.arena import TaskSuite
from rolloutopt.arena.base import BaseConfig
from rolloutopt.arena.run import RunSpec, run
from rolloutopt.errors import InputError

SUITE = TaskSuite(ops=("reverse", "count"), lengths=(("reverse", (1, 2, 3)), ("count", (2, 3))), per_cell=12, holdout=3)
BASE = BaseConfig(hidden=16, steps=30, batch_size=16)


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("ROLLOUTOPT_CACHE", str(tmp_path_factory.getbasetemp() / "arena-cache"))


@pytest.mark.filterwarnings("ignore:GRESO.*epoch:UserWarning")
@pytest.mark.parametrize("unit", ["rollouts", "tokens"])
@pytest.mark.parametrize("name", allocators.names())
def test_every_allocator_runs_by_name(name: str, unit: str) -> None:
    spec = RunSpec("allocator", name, unit=unit, steps=2, prompts_per_step=4, group_size=4, pool=8, eval_every=1)
    record = run(spec, SUITE, BASE)
    assert [e["step"] for e in record["evals"]] == [0, 1, 2]
    last = record["steps"][-1]
    assert last["rollouts"] > 0 and last["tokens"] >= last["rollouts"] and 0.0 <= record["evals"][-1]["accuracy"] <= 1
    assert set(record["evals"][-1]["cells"]) <= {f"{op}/{n}" for op, n in SUITE.cells}


@pytest.mark.parametrize("name", advantages.names())
def test_every_estimator_runs_by_name(name: str) -> None:
    """Every estimator, with the inputs it declares (log-probs and mask, the base policy's log-probs, a prior,
    two rewards for the multi-reward ones), under GRPO's fixed groups."""
    spec = RunSpec("estimator", name, steps=2, prompts_per_step=4, group_size=4, pool=8, eval_every=2)
    record = run(spec, SUITE, BASE)
    assert record["steps"][-1]["rollouts"] == 32 and "loss" in record["steps"][-1]


def test_a_run_is_deterministic_per_seed(tmp_path: Path) -> None:
    spec = RunSpec("allocator", "vigor", steps=3, prompts_per_step=4, group_size=4, pool=8, eval_every=3)
    a, b = run(spec, SUITE, BASE), run(spec, SUITE, BASE)
    strip = [{k: v for k, v in s.items() if k != "method_seconds"} for s in a["steps"]]
    assert strip == [{k: v for k, v in s.items() if k != "method_seconds"} for s in b["steps"]]
    assert a["evals"] == b["evals"]
    other = run(RunSpec("allocator", "vigor", seed=1, steps=3, prompts_per_step=4, group_size=4, pool=8), SUITE, BASE)
    assert other["steps"][-1]["tokens"] != a["steps"][-1]["tokens"] or other["evals"] != a["evals"]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"family": "optimizer", "method": "adam"}, "family"),
        ({"family": "allocator", "method": "nope"}, "method"),
        ({"family": "estimator", "method": "uniform"}, "method"),
        ({"family": "allocator", "method": "uniform", "unit": "seconds"}, "unit"),
        ({"family": "allocator", "method": "uniform", "steps": 0}, "steps"),
        ({"family": "allocator", "method": "uniform", "pool": 2}, "group_size/pool"),
    ],
)
def test_bad_spec(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InputError) as err:
        RunSpec(**kwargs)  # type: ignore[arg-type]
    assert err.value.argument == argument
