"""One arena run: every allocator by name, in both budget units, every estimator, every loss preset under every
scenario, runs end to end on a tiny suite and policy; a run is deterministic per seed; bad specs are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

import rolloutopt.advantages as advantages
import rolloutopt.allocators as allocators
import rolloutopt.losses as losses
from rolloutopt.arena import TaskSuite
from rolloutopt.arena.base import BaseConfig
from rolloutopt.arena.run import SCENARIOS, RunSpec, run
from rolloutopt.arena.stops import STOP_METHODS
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


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", losses.names())
def test_every_loss_preset_runs_under_every_scenario(name: str, scenario: str) -> None:
    """Every preset by name, with the inputs it reads from the scenario's engine (versions, behaviour and top-K
    log-probs, confidence, ...), records its loss, gradient norm and clipped or masked fractions."""
    spec = RunSpec("loss", name, scenario=scenario, steps=2, prompts_per_step=4, group_size=4, eval_every=2)
    record = run(spec, SUITE, BASE)
    last = record["steps"][-1]
    assert last["rollouts"] == 32 and "loss" in last and "grad_norm" in last and "approx_kl" in last
    assert any(k.endswith("_frac") for k in last)
    assert record["spec"]["scenario"] == scenario


@pytest.mark.filterwarnings("ignore:rolloutopt. a group of size 1:UserWarning")
@pytest.mark.parametrize("name", STOP_METHODS)
def test_every_stop_method_runs_by_name(name: str) -> None:
    """Every stop, truncation and length rule the arena runs, replayed over each step's generation: the tokens it
    stops are not counted, its share of stopped rows and saved tokens is recorded."""
    spec = RunSpec("stop", name, steps=2, prompts_per_step=4, group_size=4, eval_every=2)
    record = run(spec, SUITE, BASE)
    last = record["steps"][-1]
    assert 0.0 <= last["stopped_frac"] <= 1.0 and 0.0 <= last["saved_frac"] <= 1.0
    # the first step generates from the base policy with the same seed as no rule: the rule keeps exactly the
    # tokens it did not save
    none = run(RunSpec("stop", "none", steps=1, prompts_per_step=4, group_size=4, eval_every=1), SUITE, BASE)
    first, full = record["steps"][0], none["steps"][0]["tokens"]
    assert first["tokens"] == round(full * (1 - first["saved_frac"]))


def test_stale_buffered_and_mismatched_engines_differ_from_sync() -> None:
    """Each scenario changes what the preset sees: the same seed under sync and under a stale, buffered or FP8
    engine gives different losses from the second step on (the first step of a stale run is on-policy); a buffered
    run records its rounds (resumed rollouts, off-policy fraction, aborted requests, ticks)."""
    runs = {sc: run(RunSpec("loss", "grpo", scenario=sc, steps=3, prompts_per_step=4, group_size=4, eval_every=3),
                    SUITE, BASE) for sc in SCENARIOS}  # fmt: skip
    sync = runs["sync"]["steps"][-1]["loss"]
    for sc in ("stale4", "april", "copris", "mismatch"):
        assert runs[sc]["steps"][-1]["loss"] != sync, sc
    for sc in ("april", "copris"):
        steps = runs[sc]["steps"]
        assert all(s["aborted_requests"] >= 0 and s["ticks"] > 0 for s in steps)
        assert steps[0]["off_policy_fraction"] == 0.0 and steps[0]["resumed_rollouts"] == 0.0


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
        ({"family": "loss", "method": "uniform"}, "method"),
        ({"family": "loss", "method": "grpo", "scenario": "stale2"}, "scenario"),
        ({"family": "allocator", "method": "uniform", "scenario": "april"}, "scenario"),
        ({"family": "stop", "method": "prune_opd"}, "method"),
    ],
)
def test_bad_spec(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InputError) as err:
        RunSpec(**kwargs)  # type: ignore[arg-type]
    assert err.value.argument == argument
