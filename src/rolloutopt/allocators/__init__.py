"""Rollout budget allocators and prompt selectors (``DESIGN.md`` §4; ``specs/allocators.md``).

Every allocator speaks one protocol — ``plan(prompt_ids, budget)`` → ``next()``/``observe()`` → ``finish()`` →
``update(result)`` — implemented once in :class:`Conversation`; ``state_dict()``/``load_state_dict()``
checkpoint it.
"""

from __future__ import annotations

from rolloutopt.allocators import baselines
from rolloutopt.allocators._base import (
    AllocationResult,
    Allocator,
    Conversation,
    Request,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators.baselines import *  # noqa: F403

__all__ = ["AllocationResult", "Allocator", "Conversation", "Request", "as_prompt_ids", "check_budget"]
__all__ += baselines.__all__
