r"""POPD and TOPD (arXiv 2605.31490, "Are Full Rollouts Necessary for OPD?"): short-to-long OPD horizon schedules.

:func:`popd_horizon` (progressive OPD; the schedule shape is reconstructed, ``experimental=True``) widens the
horizon gradually; :func:`topd_horizon` (truncated OPD) is a fixed fraction of the full horizon (10%, the
abstract's figure). Run the horizon with :class:`~rolloutopt.control.ESR` or the engine's ``max_new_tokens``.
Provenance and worked examples: ``docs/methods/opd_horizon.md``.
"""

from __future__ import annotations

from typing import Literal

from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt._validation import (
    describe,
)
from rolloutopt.control._opd import _experimental, _round
from rolloutopt.errors import InputError

__all__ = ["popd_horizon", "topd_horizon"]


def popd_horizon(
    step: int,
    *,
    h0: int,
    l_max: int,
    t_ramp: int | None = None,
    shape: Literal["linear", "staircase"] = "linear",
    k: int | None = None,
    experimental: bool = False,
) -> int:
    r"""Progressive OPD (POPD) [reconstructed]: the rollout horizon at training step ``step``, short to long.

    .. math::
        H_{linear}(t) = \operatorname{round}\Big(H_0 + (L_{max} - H_0)\min\big(1, \tfrac{t}{T_{ramp}}\big)\Big),
        \qquad H_{staircase}(t) = \min\big(L_{max}, H_0\, 2^{\lfloor t / K \rfloor}\big)

    Non-decreasing in ``t``, ``H(0) = H_0``, and ``L_max`` from ``T_ramp`` on (linear). Rounding is half up.
    Reference: "Are Full Rollouts Necessary for OPD?", arXiv 2605.31490 (POPD widens the horizon gradually, up to
    3x better training efficiency); the paper's schedule shape is not known — both shapes are **reconstructed**
    (``docs/methods/opd_horizon.md``), hence ``experimental=True``. Run the horizon with ``ESR(n=H)`` or the
    engine's ``max_new_tokens``.

    Args:
        step: training step t >= 0.
        h0: H_0 >= 1, the initial horizon (required; our worked example uses 512).
        l_max: L_max >= h0, the full horizon (required; oracle 8192).
        t_ramp: T_ramp >= 0, steps of the linear ramp (required for ``"linear"``; 0 gives L_max at once).
        shape: ``"linear"`` (default) or ``"staircase"`` (doubling every K steps).
        k: K >= 1, steps per stair (required for ``"staircase"``).
        experimental: must be True.
    """
    _experimental(experimental, "the POPD schedule shape")
    t = _int(step, "step", 0)
    h = _int(h0, "h0", 1)
    top = _int(l_max, "l_max", h)
    if shape == "linear":
        if t_ramp is None:
            raise InputError("t_ramp", "an int >= 0 for shape='linear'", "None", "pass e.g. t_ramp=100")
        ramp = _int(t_ramp, "t_ramp", 0)
        frac = 1.0 if ramp == 0 else min(1.0, t / ramp)
        return min(top, _round(h + (top - h) * frac))
    if shape == "staircase":
        if k is None:
            raise InputError("k", "an int >= 1 for shape='staircase'", "None", "pass e.g. k=50")
        stairs = t // _int(k, "k", 1)
        return top if stairs >= top.bit_length() else min(top, h * 2**stairs)
    raise InputError("shape", "one of 'linear', 'staircase'", describe(shape), "pass shape='linear'")


def topd_horizon(l_max: int, *, frac: float = 0.1) -> int:
    r"""Truncated OPD (TOPD): a fixed rollout horizon, a fraction of the full one.

    .. math::
        H = \max\big(1, \operatorname{round}(\text{frac}\cdot L_{max})\big)

    Reference: "Are Full Rollouts Necessary for OPD?", arXiv 2605.31490 (TOPD matches OPD with only 10% of the
    rollout horizon); ``frac = 0.1`` is the abstract's figure (``docs/methods/opd_horizon.md``). Rounding is half
    up.

    Args:
        l_max: L_max >= 1, the full horizon.
        frac: in (0, 1] (default 0.1).
    """
    top = _int(l_max, "l_max", 1)
    f = _real(frac, "frac", 0.0, 1.0, open_low=True)
    return max(1, _round(f * top))
