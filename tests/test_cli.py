"""Tests of the command line: ``python -m rolloutopt demo``, for every loss preset, and its usage errors."""

from __future__ import annotations

import io
import math
import subprocess
import sys

import pytest

from rolloutopt import losses
from rolloutopt.cli import demo, demo_config, main, parse_args

# A short demo: 2 steps of 4 prompts x 4 rollouts, evaluated on 50 held-out prompts with one sample each.
SHORT = ["--steps", "2", "--prompts", "4", "--group-size", "4", "--holdout", "50", "--eval-samples", "1"]
ONE_STEP = ["--plain", "--steps", "1", "--prompts", "2", "--holdout", "20", "--eval-samples", "0"]


def test_demo_quick_prints_table() -> None:
    out = io.StringIO()
    assert main(["demo", "--quick", "--steps", "6"], out=out) == 0
    text = out.getvalue()
    for needle in ("held-out exact match", "train reward", "rollouts", "tokens generated", "time", "6/6"):
        assert needle in text, needle
    assert "with GRPO (seed 0)" in text and "simulated" not in text and "experimental" not in text


def test_demo_quick_default_runs() -> None:
    out = io.StringIO()
    assert main(["demo", "--quick"], out=out) == 0
    assert "held-out reward, greedy" in out.getvalue()


def test_demo_plain() -> None:
    out = io.StringIO()
    assert main(["demo", "--steps", "2", "--plain"], out=out) == 0
    text = out.getvalue()
    assert "step 2/2" in text and "tokens generated" in text


def test_default_demo_prints_the_numbers_of_the_code_before_presets_got_inputs() -> None:
    """``demo --steps 6 --plain`` printed these lines before the demo learnt to feed every preset (recorded from
    that code, seed 0, one thread); the default grpo run takes the same path, so they must not move."""
    out = io.StringIO()
    assert main(["demo", "--steps", "6", "--plain"], out=out) == 0
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    expected = [
        "step 1/6  reward 0.046",
        "step 2/6  reward 0.061",
        "step 3/6  reward 0.051",
        "step 4/6  reward 0.070",
        "step 5/6  reward 0.066",
        "step 6/6  reward 0.064",
        f"{'':48}{'start':>10}{'end':>10}",
        f"{'train reward, first / last 1 steps':48}{'0.046':>10}{'0.064':>10}",
        f"{'held-out reward, sampled (T=1)':48}{'0.045':>10}{'0.074':>10}",
        f"{'held-out reward, greedy':48}{'0.068':>10}{'0.109':>10}",
        f"{'held-out exact match, greedy':48}{'0.0%':>10}{'0.0%':>10}",
        f"{'steps':48}6",
        f"{'rollouts':48}768 (16 prompts x 8 per step)",
        f"{'loss':48}'grpo' preset, 2 inner steps per batch, Adam lr 0.003",
        f"{'tokens generated':48}4,190",
        f"{'policy parameters':48}70,926",
    ]
    assert lines[: len(expected)] == expected
    assert lines[len(expected)].startswith("time") and len(lines) == len(expected) + 1


@pytest.mark.parametrize("name", losses.names())
def test_every_preset_runs_in_the_demo(name: str) -> None:
    out = io.StringIO()
    result = demo(parse_args(["demo", "--loss", name, "--plain", *SHORT]), out)
    text = out.getvalue()
    assert len(result.steps) == 2 and "step 2/2" in text and "held-out exact match" in text
    for rec in result.steps:
        assert math.isfinite(rec.metrics["loss"]), rec.metrics
        assert math.isfinite(rec.metrics["grad_norm"])
    scen = result.scenario
    preset = losses.get(name)
    # Exactly the inputs the preset consumes were passed (the preset refuses any other one).
    consumed = set(preset.requires) | set(getattr(preset, "accepts", ()))
    assert set(scen.inputs) <= consumed and set(preset.requires) <= set(scen.inputs)
    assert ("simulated: " in text) == scen.simulated
    if scen.simulated:
        assert f"{'simulated':48}{scen.describe()}" in text
    if preset.experimental is not None:
        assert "is experimental" in text and f"{'experimental':48}{preset.experimental}" in text
    else:
        assert "experimental" not in text


def test_scenario_is_reported_and_can_be_overridden() -> None:
    out = io.StringIO()
    result = demo(parse_args(["demo", "--loss", "tis", *ONE_STEP]), out)
    assert result.scenario.mismatch == 0.05 and result.scenario.staleness == 0
    assert "simulated: engine mismatch (weight noise 0.05)" in out.getvalue()
    out = io.StringIO()
    result = demo(parse_args(["demo", "--loss", "tis", *ONE_STEP, "--mismatch", "0", "--staleness", "3"]), out)
    assert (result.scenario.mismatch, result.scenario.staleness) == (0.0, 3)
    assert "simulated: staleness 3 steps" in out.getvalue()
    out = io.StringIO()
    result = demo(parse_args(["demo", "--loss", "tis", *ONE_STEP, "--mismatch", "0"]), out)
    assert not result.scenario.simulated and "simulated" not in out.getvalue()
    out = io.StringIO()
    demo(parse_args(["demo", "--loss", "grpo", *ONE_STEP, "--staleness", "1"]), out)
    assert "simulated: staleness 1 step\n" in out.getvalue()


def test_rich_table_names_the_scenario() -> None:
    pytest.importorskip("rich")
    out = io.StringIO()
    demo(parse_args(["demo", "--loss", "sat", *ONE_STEP[1:]]), out)
    text = " ".join(out.getvalue().split())  # rich wraps long lines at the console width
    assert "reverse 4 digits with GRPO + 'sat' (seed 0)" in text
    assert "simulated: staleness 2 steps" in text and "is experimental" in text


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv, out=io.StringIO())
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("rolloutopt demo: error: ") or lines[-1].startswith("rolloutopt: error: ")
    return lines[-1]


def test_unknown_loss_is_a_usage_error_listing_the_names(capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["demo", "--loss", "nonexistent"], capsys)
    assert "nonexistent" in line
    for name in losses.names():
        assert repr(name) in line, name


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--steps", "0"),
        ("--steps", "x"),
        ("--seed", "1.5"),
        ("--threads", "0"),
        ("--mismatch", "-0.1"),
        ("--mismatch", "nan"),
        ("--mismatch", "inf"),
        ("--staleness", "-1"),
        ("--topk", "0"),
        ("--topk", "15"),
        ("--prompts", "0"),
        ("--group-size", "1"),
        ("--holdout", "-1"),
        ("--eval-samples", "-1"),
    ],
)
def test_bad_flag_is_a_usage_error(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["demo", flag, value], capsys)
    assert f"argument {flag}" in line and value in line


def test_missing_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    _usage_error([], capsys)


def test_configuration_the_demo_refuses_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    line = _usage_error(["demo", "--holdout", "10000"], capsys)  # the 4-digit task has 10,000 prompts
    assert line.startswith("rolloutopt demo: error: holdout: expected an int in [0, 10000)")


def test_demo_config_maps_the_flags() -> None:
    cfg = demo_config(parse_args(["demo", "--quick", "--seed", "3", "--loss", "dapo", "--topk", "4", *SHORT]))
    assert (cfg.steps, cfg.seed, cfg.loss, cfg.topk, cfg.prompts_per_step, cfg.group_size) == (2, 3, "dapo", 4, 4, 4)
    assert (cfg.holdout, cfg.eval_samples) == (50, 1)
    assert cfg.mismatch is None and cfg.staleness is None
    assert demo_config(parse_args(["demo", "--quick"])).steps == 40


def test_module_entry_point_usage_error() -> None:
    """``python -m rolloutopt demo --loss nonexistent``: exit status 2, one usage line, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "rolloutopt", "demo", "--loss", "nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert "error: argument --loss: invalid choice: 'nonexistent'" in proc.stderr
