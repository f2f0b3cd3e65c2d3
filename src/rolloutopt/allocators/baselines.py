"""Reference allocators: :class:`Uniform` (every prompt gets the same number of rollouts)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    OneShotPlan,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.errors import InputError
from rolloutopt.typing import IntP

__all__ = ["Uniform"]


class _UniformPlan(OneShotPlan):
    reason_names = ("uniform", "remainder", "no_budget")


def _uniform_counts(p: int, budget: int, n: int | None) -> tuple[Tensor, Tensor]:
    if p == 0:  # no prompt: nothing to request, whatever the budget
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    per, extra = (budget // p, budget % p) if n is None else (min(n, budget // p), 0)
    counts = torch.full((p,), per, dtype=torch.long)
    counts[:extra] += 1
    reasons = torch.where(counts == 0, 2, torch.where(torch.arange(p) < extra, 1, 0))
    return counts, reasons


class Uniform:
    """The baseline: every prompt gets the same number of rollouts, in one request.

    ``n=None`` (default) spreads the budget evenly, the first ``budget % P`` prompts (in the given order) get one
    more (reason ``"remainder"``); ``n=k`` gives every prompt exactly ``k`` rollouts (GRPO's fixed group size),
    or ``budget // P`` when the budget is smaller. Prompts that get nothing are reported as ``"no_budget"``.
    Every rollout is kept (weight 1). Stateless: ``update`` does nothing and the state dict is empty.
    """

    reference: ClassVar[str] = "arXiv 2402.03300 (GRPO's fixed group size): the baseline"
    experimental: ClassVar[str | None] = None

    def __init__(self, *, n: int | None = None) -> None:
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise InputError("n", "None or an int >= 1 (rollouts per prompt)", repr(n), "pass e.g. n=8")
        self.n = n

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """One request: ``budget`` spread over ``prompt_ids`` (see the class docstring)."""
        ids, budget = as_prompt_ids(prompt_ids), check_budget(budget)
        return _UniformPlan(ids, budget, *_uniform_counts(ids.numel(), budget, self.n))

    def update(self, result: AllocationResult) -> None:
        """Nothing to learn."""
        _check_result(result)

    STATE: ClassVar[dict[str, Field]] = {}
    """The declared fields of :meth:`state_dict`: none (stateless; only the format version is saved)."""

    def state_dict(self) -> dict[str, Any]:
        """No state: only the format version."""
        return dump_state({})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state; a state with any key (or another format version) is an ``InputError``."""
        load_state(state, self.STATE, "Uniform")
