"""Ratios, trust regions and off-policy corrections: the stages :func:`rolloutopt.losses.policy_loss` composes.

- ratio constructions (``log_ratio(logp, old_logp, mask)``): :class:`TokenRatio`, :class:`GSPORatio`, the
  cumulative and prefix-normalised ratios (:mod:`~rolloutopt.ratios.prefix`);
- proximal-policy stages (build ``old_logp``): A-3PO interpolation, CoPRIS cross-stage concatenation
  (:mod:`~rolloutopt.ratios.proximal`);
- trust regions (``(ratio, log_ratio, advantages, logp, *, ctx) -> TrustOutput``): :class:`PPOClip`,
  :class:`CISPO`, :class:`SAPO`, M2PO (:mod:`~rolloutopt.ratios.m2po`), SAT
  (:mod:`~rolloutopt.ratios.sat`), TBPO (:mod:`~rolloutopt.ratios.tbpo`), ECHO (:mod:`~rolloutopt.ratios.echo`),
  DPPO (:mod:`~rolloutopt.ratios.dppo`);
- off-policy corrections (``(ctx) -> CorrectionOutput``): truncated and masked IS, IcePop, OPSM, rejection
  filters (:mod:`~rolloutopt.ratios.corrections`), decoupled PPO's behaviour weight.

Each stage config is a frozen dataclass beside the pure function it wraps; :class:`StageContext` carries the
validated inputs a stage may read.
"""

from __future__ import annotations

from rolloutopt.ratios import corrections, dppo, echo, m2po, prefix, proximal, reference, sat, tbpo
from rolloutopt.ratios.context import (
    CorrectionOutput,
    MaskOutput,
    StageContext,
    as_weights,
    masked_max,
    masked_mean,
    masked_quantiles,
)
from rolloutopt.ratios.corrections import *  # noqa: F403
from rolloutopt.ratios.dppo import *  # noqa: F403
from rolloutopt.ratios.echo import *  # noqa: F403
from rolloutopt.ratios.m2po import *  # noqa: F403
from rolloutopt.ratios.prefix import *  # noqa: F403
from rolloutopt.ratios.proximal import *  # noqa: F403
from rolloutopt.ratios.reference import *  # noqa: F403
from rolloutopt.ratios.sat import *  # noqa: F403
from rolloutopt.ratios.tbpo import *  # noqa: F403

__all__ = [
    "CorrectionOutput",
    "MaskOutput",
    "StageContext",
    "as_weights",
    "masked_max",
    "masked_mean",
    "masked_quantiles",
]
__all__ += reference.__all__
__all__ += corrections.__all__
__all__ += proximal.__all__
__all__ += prefix.__all__
__all__ += m2po.__all__
__all__ += sat.__all__
__all__ += tbpo.__all__
__all__ += dppo.__all__
__all__ += echo.__all__
