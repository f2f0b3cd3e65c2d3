"""ADWIN (control/adwin.py): the horizon controller and its alignment measures — oracles by hand, properties,
state round trips, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    ADWINHorizon,
    gradient_cosine,
    kl_sign_alignment,
)
from rolloutopt.errors import InputError


def _adwin(**kw: Any) -> ADWINHorizon:
    return ADWINHorizon(experimental=True, **kw)


def test_adwin_oracle() -> None:
    ctl = _adwin(h0=512, h_max=1500, tau_lo=0.5, tau_hi=0.9, beta_up=2.0, beta_down=0.5, staleness=2)
    assert ctl.observe(0.3, version=4, current_version=5) == 1024  # a < tau_lo: doubled
    assert ctl.observe(torch.tensor(0.3), version=5, current_version=5) == 1500  # 2048 capped at h_max
    assert ctl.observe(0.0, version=1, current_version=5) == 1500  # 4 > S=2 versions old: ignored
    assert ctl.observe(0.7, version=5, current_version=6) == 1500  # between thresholds: keep
    saved = ctl.state_dict()
    assert ctl.observe(0.95, version=6, current_version=6) == 750  # a >= tau_hi: shrink
    assert ctl.n_stale == 1 and ctl.n_probes == 5
    assert ctl.probes[2] == (1, 0.0, False, 1500) and ctl.probes[-1] == (6, 0.95, True, 750)
    fresh = _adwin(h0=512, h_max=1500, tau_lo=0.5, tau_hi=0.9, beta_up=2.0, beta_down=0.5, staleness=2)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert fresh.observe(0.95, version=6, current_version=6) == 750
    assert fresh.state_dict() == ctl.state_dict()
    # shrinking stops at h_min; the probe log is bounded
    small = _adwin(h0=100, h_min=64, history=2)
    for _ in range(3):
        small.observe(1.0, version=0, current_version=0)
    assert small.horizon == 64 and len(small.probes) == 2
    assert [_adwin(probe_every=10).probe_due(s) for s in (0, 5, 10, 20)] == [True, False, True, True]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-1, 1), st.integers(0, 4)), max_size=12))
def test_prop_adwin_bounds_and_staleness(probes: list[tuple[float, int]]) -> None:
    ctl = _adwin(h0=256, h_min=64, h_max=4096, staleness=1)
    for step, (a, age) in enumerate(probes):
        before = ctl.horizon
        after = ctl.observe(a, version=step, current_version=step + age)
        assert ctl.h_min <= after <= ctl.h_max
        if age > 1:
            assert after == before
        elif a < ctl.tau_lo:
            assert after >= before
        elif a >= ctl.tau_hi:
            assert after <= before
        else:
            assert after == before


def test_alignment_helpers_hand() -> None:
    p = torch.tensor([[1.0, -1.0, 2.0, 0.0]])
    f = torch.tensor([[2.0, 1.0, -1.0, 0.0]])
    m = torch.ones(1, 4, dtype=torch.bool)
    assert float(kl_sign_alignment(p, f, m, horizon=3)) == pytest.approx(1 / 3)  # agree at t=0 only
    assert float(kl_sign_alignment(p, f, m, horizon=4)) == pytest.approx(2 / 4)  # 0 and 0 agree
    assert float(kl_sign_alignment(p, f, torch.tensor([[1, 0, 0, 1]]), horizon=9)) == 1.0
    assert float(kl_sign_alignment(p, f, m, horizon=0)) == 1.0  # nothing compared
    assert float(kl_sign_alignment(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), horizon=2)) == 1.0
    nan_outside = torch.tensor([[1.0, -1.0, float("nan"), 0.0]])
    assert float(kl_sign_alignment(nan_outside, f, m, horizon=2)) == pytest.approx(0.5)  # NaN beyond H is fine
    assert float(gradient_cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))) == 0.0
    assert float(gradient_cosine(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 4.0]))) == pytest.approx(1.0)
    assert float(gradient_cosine([torch.tensor([1.0]), torch.tensor([[1.0]])], [torch.tensor([-1.0, -1.0])])) == (
        pytest.approx(-1.0)
    )
    assert float(gradient_cosine(torch.zeros(3), torch.ones(3))) == 0.0
    assert float(gradient_cosine([], [])) == 0.0


def test_adwin_bad_input() -> None:
    with pytest.raises(InputError, match="experimental"):
        ADWINHorizon()
    for kw, name in (
        ({"h_min": 0}, "h_min"),
        ({"h_min": 64, "h_max": 32}, "h_max"),
        ({"h0": 10}, "h0"),
        ({"h0": 10_000}, "h0"),
        ({"tau_lo": -2.0}, "tau_lo"),
        ({"tau_hi": 0.4}, "tau_hi"),
        ({"beta_up": 0.5}, "beta_up"),
        ({"beta_down": 1.5}, "beta_down"),
        ({"staleness": -1}, "staleness"),
        ({"probe_every": 0}, "probe_every"),
        ({"history": -1}, "history"),
    ):
        with pytest.raises(InputError, match=name):
            _adwin(**kw)
    ctl = _adwin()
    with pytest.raises(InputError, match="alignment"):
        ctl.observe(1.5, version=0, current_version=0)
    with pytest.raises(InputError, match="alignment"):
        ctl.observe(float("nan"), version=0, current_version=0)
    with pytest.raises(InputError, match="alignment"):
        ctl.observe(torch.zeros(2), version=0, current_version=0)
    with pytest.raises(InputError, match="current_version"):
        ctl.observe(0.5, version=3, current_version=2)
    with pytest.raises(InputError, match="version"):
        ctl.observe(0.5, version=-1, current_version=2)
    with pytest.raises(InputError, match="step"):
        ctl.probe_due(-1)
    with pytest.raises(InputError, match="state"):
        ctl.load_state_dict({"horizon": 10, "probes": [], "n_probes": 0, "n_stale": 0})  # below h_min
    with pytest.raises(InputError, match="state"):
        ctl.load_state_dict({"horizon": 100})
    assert ctl.horizon == 512 and ctl.n_probes == 0
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(InputError, match="full_kl"):
        kl_sign_alignment(torch.zeros(1, 2), torch.zeros(1, 3), m, horizon=1)
    with pytest.raises(InputError, match="prefix_kl"):
        kl_sign_alignment(torch.tensor([[float("inf"), 0.0]]), torch.zeros(1, 2), m, horizon=1)
    with pytest.raises(InputError, match="horizon"):
        kl_sign_alignment(torch.zeros(1, 2), torch.zeros(1, 2), m, horizon=-1)
    with pytest.raises(InputError, match="g_full"):
        gradient_cosine(torch.zeros(2), torch.zeros(3))
    with pytest.raises(InputError, match="g_prefix"):
        gradient_cosine("grad", torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="g_full"):
        gradient_cosine(torch.ones(2), torch.tensor([1.0, float("nan")]))
