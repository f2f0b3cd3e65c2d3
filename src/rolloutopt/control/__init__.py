"""Rollout control: stop rules, truncation and length rules, partial-rollout scheduling (``specs/rollout_control.md``).

Everything is engine-agnostic (it sees per-step log-probs, entropies, top-k log-probs, token ids and an ``active``
mask — never a model), vectorised over the live batch, and checkpointable.

- streaming stop rules (decide during generation; :class:`StopRule`: ``init`` → ``step``… → ``finalize``):
  ESPO (:mod:`~rolloutopt.control.espo`), value-based abstention and the ARRoL quality head
  (:mod:`~rolloutopt.control.value`), confidence- and marker-gated truncation (:mod:`~rolloutopt.control.truncation`),
  the on-policy-distillation horizon rules (:mod:`~rolloutopt.control.opd`);
- post-hoc truncation and length rules (decide after generation; return a :class:`TruncationOutput`):
  :mod:`~rolloutopt.control.posthoc`;
- partial-rollout scheduling (APRIL, CoPRIS): :mod:`~rolloutopt.control.partial`.
"""

from __future__ import annotations

from rolloutopt.control import _base, espo, opd, partial, posthoc, truncation, value
from rolloutopt.control._base import *  # noqa: F403
from rolloutopt.control.espo import *  # noqa: F403
from rolloutopt.control.opd import *  # noqa: F403
from rolloutopt.control.partial import *  # noqa: F403
from rolloutopt.control.posthoc import *  # noqa: F403
from rolloutopt.control.truncation import *  # noqa: F403
from rolloutopt.control.value import *  # noqa: F403

__all__: list[str] = []
__all__ += _base.__all__
__all__ += espo.__all__
__all__ += value.__all__
__all__ += truncation.__all__
__all__ += opd.__all__
__all__ += posthoc.__all__
__all__ += partial.__all__
