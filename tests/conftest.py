"""Shared test settings: hypothesis profiles (fewer examples in CI, same properties) and common fixtures."""

from __future__ import annotations

import os

# The Triton kernels are tested on CPU tensors under Triton's interpreter, which must be on before triton is first
# imported by anything (verl, liger, torch.compile import it too, during collection): triton.language's own jitted
# helpers are built at import. An explicit TRITON_INTERPRET=0 (a GPU runner) is left alone.
os.environ.setdefault("TRITON_INTERPRET", "1")

import _shapecheck  # noqa: I001 - the shape checker's import hook goes in before rolloutopt is imported
import pytest
import torch
from hypothesis import HealthCheck, settings

_shapecheck.install()

import rolloutopt  # noqa: E402

settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _checks_on() -> None:
    """Every test starts with input validation on (a test that turns it off cannot leak)."""
    with rolloutopt.checks(True):
        yield
