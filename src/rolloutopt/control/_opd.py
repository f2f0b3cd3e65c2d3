"""Private helpers of the on-policy-distillation (OPD) horizon rules (``docs/methods/opd_horizon.md``): the
experimental-flag check of the reconstructed rules and the half-up rounding of the horizon schedules.
"""

from __future__ import annotations

import math
from typing import Any

from rolloutopt._validation import require_experimental

_DOCS = "docs/methods/opd_horizon.md"


# -- hyper-parameter checks ---------------------------------------------------------------------------------------
def _round(x: float) -> int:
    """Round half up (``floor(x + 0.5)``): the horizon schedules' rounding."""
    return math.floor(x + 0.5)


def _experimental(flag: Any, what: str) -> None:
    require_experimental(flag, what, _DOCS)
