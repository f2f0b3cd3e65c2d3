"""SIRI's cosine max-length schedule (our reconstruction): an oracle and hypothesis properties."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from rolloutopt.control import (
    siri_max_length,
)

from .length_rules_helpers import PROPS, X


def test_siri_oracle() -> None:
    kw = {"l_lo": 1000, "l_hi": 5000, "period": 8, **X}
    assert siri_max_length(0, **kw) == 1000
    assert siri_max_length(4, **kw) == 5000
    assert siri_max_length(8, **kw) == 1000
    assert siri_max_length(2, **kw) == 3000  # (1 - cos(pi/2)) / 2 = 1/2
    assert siri_max_length(12, **kw) == 5000  # periodic


@PROPS
@given(st.integers(1, 4000), st.integers(0, 4000), st.integers(1, 40))
def test_siri_bounded_periodic_monotone(lo: int, extra: int, period: int) -> None:
    hi = lo + extra
    seq = [siri_max_length(s, l_lo=lo, l_hi=hi, period=period, **X) for s in range(2 * period + 1)]
    assert all(lo <= x <= hi for x in seq)
    assert seq[: period + 1] == seq[period:]
    half, back = period // 2, (period + 1) // 2
    assert all(a <= b for a, b in itertools.pairwise(seq[: half + 1]))  # expansion: rising to L_hi
    assert all(a >= b for a, b in itertools.pairwise(seq[back : period + 1]))  # compression: falling to L_lo
