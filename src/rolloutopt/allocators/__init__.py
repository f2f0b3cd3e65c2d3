"""Rollout budget allocators and prompt selectors (``DESIGN.md`` §4; ``specs/allocators.md``).

Every allocator speaks one protocol — ``plan(prompt_ids, budget)`` → ``next()``/``observe()`` → ``finish()`` →
``update(result)`` — implemented once in :class:`Conversation`; ``state_dict()``/``load_state_dict()``
checkpoint it. :class:`PromptHistory` is the shared, bounded per-prompt store.
"""

from __future__ import annotations

from rolloutopt.allocators import (
    adaptive,
    baselines,
    budget,
    difficulty,
    dps,
    dynamic,
    filters,
    gdro,
    greso,
    history,
    replay,
    topup,
)
from rolloutopt.allocators._base import (
    AllocationResult,
    Allocator,
    Conversation,
    OneShotPlan,
    Request,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators.adaptive import *  # noqa: F403
from rolloutopt.allocators.baselines import *  # noqa: F403
from rolloutopt.allocators.budget import *  # noqa: F403
from rolloutopt.allocators.difficulty import *  # noqa: F403
from rolloutopt.allocators.dps import *  # noqa: F403
from rolloutopt.allocators.dynamic import *  # noqa: F403
from rolloutopt.allocators.filters import *  # noqa: F403
from rolloutopt.allocators.gdro import *  # noqa: F403
from rolloutopt.allocators.greso import *  # noqa: F403
from rolloutopt.allocators.history import *  # noqa: F403
from rolloutopt.allocators.replay import *  # noqa: F403
from rolloutopt.allocators.topup import *  # noqa: F403

__all__ = ["AllocationResult", "Allocator", "Conversation", "OneShotPlan", "Request", "as_prompt_ids", "check_budget"]
__all__ += baselines.__all__
__all__ += history.__all__
__all__ += dynamic.__all__
__all__ += topup.__all__
__all__ += gdro.__all__
__all__ += dps.__all__
__all__ += greso.__all__
__all__ += budget.__all__
__all__ += difficulty.__all__
__all__ += adaptive.__all__
__all__ += replay.__all__
__all__ += filters.__all__
