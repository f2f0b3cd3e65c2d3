"""POPD/TOPD (control/opd_schedules.py): the short-to-long horizon schedules — oracles by hand, properties,
bad input."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    popd_horizon,
    topd_horizon,
)
from rolloutopt.errors import InputError


def test_popd_topd_oracle() -> None:
    kw: dict[str, Any] = {"h0": 512, "l_max": 8192, "t_ramp": 100, "experimental": True}
    assert [popd_horizon(s, **kw) for s in (0, 50, 100, 150)] == [512, 4352, 8192, 8192]
    assert popd_horizon(1, h0=1, l_max=2, t_ramp=2, experimental=True) == 2  # 1.5 rounds half up
    assert popd_horizon(0, h0=8, l_max=64, t_ramp=0, experimental=True) == 64
    st_kw: dict[str, Any] = {"h0": 512, "l_max": 8192, "shape": "staircase", "k": 10, "experimental": True}
    assert [popd_horizon(s, **st_kw) for s in (0, 9, 10, 35, 40, 10**6)] == [512, 512, 1024, 4096, 8192, 8192]
    assert topd_horizon(8192) == 819 and topd_horizon(4096) == 410 and topd_horizon(5) == 1
    assert topd_horizon(100, frac=1.0) == 100


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 1000),
    st.integers(0, 5000),
    st.integers(0, 300),
    st.integers(1, 50),
    st.lists(st.integers(0, 1000), min_size=2, max_size=6),
)
def test_prop_popd_non_decreasing(h0: int, extra: int, t_ramp: int, k: int, steps: list[int]) -> None:
    l_max = h0 + extra
    for shape in ("linear", "staircase"):
        hs = [
            popd_horizon(s, h0=h0, l_max=l_max, t_ramp=t_ramp, shape=shape, k=k, experimental=True)  # type: ignore[arg-type]
            for s in sorted(steps)
        ]
        assert hs == sorted(hs) and all(h0 <= h <= l_max for h in hs)
        if shape == "staircase" or t_ramp > 0:
            assert popd_horizon(0, h0=h0, l_max=l_max, t_ramp=t_ramp, shape=shape, k=k, experimental=True) == h0  # type: ignore[arg-type]


def test_popd_topd_bad_input() -> None:
    kw: dict[str, Any] = {"h0": 512, "l_max": 8192, "t_ramp": 100}
    with pytest.raises(InputError, match="experimental"):
        popd_horizon(0, **kw)
    for bad, name in (
        ({"h0": 0}, "h0"),
        ({"l_max": 100}, "l_max"),
        ({"t_ramp": None}, "t_ramp"),
        ({"t_ramp": -1}, "t_ramp"),
        ({"shape": "cosine"}, "shape"),
        ({"shape": "staircase"}, "k"),
        ({"shape": "staircase", "k": 0}, "k"),
    ):
        with pytest.raises(InputError, match=name):
            popd_horizon(0, **{**kw, **bad, "experimental": True})
    with pytest.raises(InputError, match="step"):
        popd_horizon(-1, **kw, experimental=True)
    with pytest.raises(InputError, match="l_max"):
        topd_horizon(0)
    with pytest.raises(InputError, match="frac"):
        topd_horizon(100, frac=0.0)
    with pytest.raises(InputError, match="frac"):
        topd_horizon(100, frac=1.5)
