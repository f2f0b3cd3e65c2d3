"""Tests of the command line: ``python -m rolloutopt demo``."""

from __future__ import annotations

import io

import pytest

import rolloutopt
from rolloutopt.cli import main


def test_demo_quick_prints_table() -> None:
    out = io.StringIO()
    assert main(["demo", "--quick", "--steps", "6"], out=out) == 0
    text = out.getvalue()
    for needle in ("held-out exact match", "train reward", "rollouts", "tokens generated", "time", "6/6"):
        assert needle in text, needle


def test_demo_quick_default_runs() -> None:
    out = io.StringIO()
    assert main(["demo", "--quick"], out=out) == 0
    assert "held-out reward, greedy" in out.getvalue()


def test_demo_plain() -> None:
    out = io.StringIO()
    assert main(["demo", "--steps", "2", "--plain"], out=out) == 0
    text = out.getvalue()
    assert "step 2/2" in text and "tokens generated" in text


def test_bad_arguments() -> None:
    with pytest.raises(rolloutopt.InputError, match="steps"):
        main(["demo", "--steps", "0"], out=io.StringIO())
    with pytest.raises(SystemExit):
        main([], out=io.StringIO())
