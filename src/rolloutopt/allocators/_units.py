"""Budget units: a budget is rollouts (an int) or tokens (:class:`TokenBudget`); :func:`check_budget` turns either
into the rollouts a plan starts with (``docs/api/allocators.md``, :mod:`rolloutopt.allocators.tokens`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rolloutopt._validation import check_int, describe
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatP


@dataclass(frozen=True)
class TokenBudget:
    """A step's budget in tokens: ``tokens`` (an int >= 0) and ``expected``, float ``[P]``, the expected response
    length of each candidate prompt, aligned with the ``prompt_ids`` given to ``plan`` (finite, > 0). Made by
    :meth:`~rolloutopt.allocators.ResponseLengths.budget`; how a plan spends it: :mod:`rolloutopt.allocators.tokens`.
    """

    tokens: int
    expected: FloatP

    def __post_init__(self) -> None:
        check_int(self.tokens, "tokens", 0, "pass the step's token budget")
        e = self.expected
        if not isinstance(e, Tensor) or not e.is_floating_point() or e.ndim != 1:
            raise InputError("expected", "a float tensor [P] of expected lengths", describe(e), "use lengths.budget()")
        if e.numel() and not bool(((e > 0) & torch.isfinite(e)).all()):
            raise InputError("expected", "finite lengths > 0", describe(e), "use ResponseLengths.budget()")

    @property
    def rollouts(self) -> int:
        """The opening rollout budget: ``floor(tokens / mean(expected))`` (0 for no candidates)."""
        return int(self.tokens // float(self.expected.double().mean())) if self.expected.numel() else 0


class _Rollouts(int):
    """A rollout budget converted from a :class:`TokenBudget` (an ``int``: every allocator plans with it as
    usual); the plan it reaches reads ``source`` and re-prices its budget as tokens are spent."""

    source: TokenBudget


def check_budget(budget: Any, name: str = "budget") -> int:
    """Validate a budget: a non-negative int (rollouts) or a :class:`TokenBudget`, returned as rollouts (an int
    that carries the token budget to the plan; :mod:`rolloutopt.allocators.tokens`)."""
    if isinstance(budget, TokenBudget):
        out = _Rollouts(budget.rollouts)
        out.source = budget
        return out
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise InputError(
            name,
            "a non-negative int (rollouts) or a TokenBudget",
            describe(budget),
            "pass e.g. budget=8 * len(prompts)",
        )
    return budget
