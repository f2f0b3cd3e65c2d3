"""SIRI — interleaved compression and expansion of the maximum rollout length (arXiv 2509.25176; reconstructed).

:func:`siri_max_length` is a schedule (a plain function, not a registered rule). Provenance:
``docs/methods/length_rules.md``.
"""

from __future__ import annotations

import math

from rolloutopt._length_rules import _DOCS, _experimental
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt.errors import InputError

__all__ = ["siri_max_length"]


def siri_max_length(step: int, *, l_lo: int, l_hi: int, period: int, experimental: bool = False) -> int:
    r"""SIRI's maximum rollout length at training step ``step``: a cosine between ``l_lo`` and ``l_hi``.

    .. math::  L(t) = L_{lo} + (L_{hi} - L_{lo})\,\frac{1 - \cos(2\pi\,(t \bmod P) / P)}{2}

    rounded to the nearest int (halves up). It starts in compression (:math:`L(0) = L_{lo}`), reaches the
    expanded end :math:`L(P/2) = L_{hi}` after half a period and returns to :math:`L(P) = L_{lo}`; it rises
    monotonically on :math:`[0, P/2]` and falls on :math:`[P/2, P]`. SIRI-low / SIRI-high checkpoints are the
    ones taken at ``step % period == 0`` and ``period // 2``.

    Reference: SIRI, arXiv 2509.25176 (compression and expansion phases alternate under a *cosine* length
    scheduler). **Reconstructed** (``experimental=True`` required): the exact
    form above, starting in compression; the paper's :math:`L_{lo}`, :math:`L_{hi}` and :math:`P` are not known,
    so they have no defaults.

    Args:
        step: the training step, an int >= 0.
        l_lo: the compressed maximum length (an int >= 1).
        l_hi: the expanded maximum length (an int >= ``l_lo``).
        period: the period :math:`P` in steps (an int >= 1; even for an exact :math:`L(P/2) = L_{hi}`).
        experimental: must be True.

    Returns:
        The maximum response length for this step, an int in ``[l_lo, l_hi]``.
    """
    _experimental(experimental, "SIRI's cosine length schedule", _DOCS)
    t = _int(step, "step", low=0)
    lo = _int(l_lo, "l_lo", low=1)
    hi = _int(l_hi, "l_hi", low=1)
    p = _int(period, "period", low=1)
    if hi < lo:
        raise InputError("l_hi", f"an int >= l_lo = {lo}", repr(hi), "swap l_lo and l_hi")
    phase = (t % p) / p
    value = lo + (hi - lo) * (1.0 - math.cos(2.0 * math.pi * phase)) / 2.0
    return min(hi, max(lo, math.floor(value + 0.5)))
