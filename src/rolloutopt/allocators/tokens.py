r"""Budgets in tokens: :class:`TokenBudget` and the per-prompt expected response lengths it is converted with.

Compute is tokens: a prompt whose answers run 4,000 tokens costs 20x one whose answers run 200. Every allocator
accepts a :class:`TokenBudget` wherever it accepts a rollout budget (``plan(prompt_ids, TokenBudget(...))``); the
budget is converted to rollouts through the expected response length :math:`\hat L_i` of each candidate prompt,
which :class:`ResponseLengths` learns from the ``tokens`` signal (each response's length) and keeps in a
:class:`~rolloutopt.allocators.PromptTable`::

    lengths = ResponseLengths(prior=512.0)                       # or ResponseLengths(prior=512.0, table=table)
    result = run_step(allocator, ids, lengths.budget(200_000, ids), generate)   # generate returns "tokens"
    lengths.update(result)

**The conversion** (the same for every allocator, since none of the papers prices a rollout by its length):
a plan of a token budget :math:`T` over candidates with expected lengths :math:`\hat L` starts with the rollout
budget :math:`\lfloor T / \bar L \rfloor`, :math:`\bar L = \mathrm{mean}_i \hat L_i` (the allocator's own rule then
spreads it). After each observed request the plan re-prices the rest: its rollout budget becomes the rollouts
spent plus :math:`\lfloor (T - t) / \ell \rfloor`, where :math:`t` is the tokens generated so far in the step and
:math:`\ell = t / n` their mean length per rollout (at least 1). So a multi-round allocator (top-ups, dynamic
sampling, pilot then commit) keeps generating until the tokens run out, and a one-round allocator spends
:math:`\lfloor T / \bar L \rfloor` rollouts. In token mode the plan requires the ``tokens`` signal with every
generating request, and the result reports ``metrics["tokens"]``, ``metrics["token_budget"]`` and
``budget_used_frac`` in tokens (which can exceed 1 by at most the last request's overshoot: lengths are known
only after generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rolloutopt._state import dump_state, load_state
from rolloutopt._validation import check_int, check_real, describe
from rolloutopt.allocators._base import AllocationResult, as_prompt_ids
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatP, IntP

__all__ = ["ResponseLengths", "TokenBudget"]


@dataclass(frozen=True)
class _Lengths:
    """Per prompt ``[P]``: the expected length and whether it was measured (False: a fill)."""

    expected: FloatP
    seen: Tensor


class ResponseLengths(TableOwner):
    r"""Per-prompt expected response length in tokens, learnt from the ``tokens`` signal; makes token budgets.

    .. math::

        \hat L_i \leftarrow \begin{cases} \bar\ell_i & \text{first step with rollouts of } i \\
        \beta\,\hat L_i + (1 - \beta)\,\bar\ell_i & \text{afterwards} \end{cases}

    where :math:`\bar\ell_i` is the mean length of prompt :math:`i`'s rollouts of the step (``result.signals
    ["tokens"]``; rows without a length, AR3PO's reused responses, are skipped). An exponential average because
    response lengths drift during RL training (they grow with reasoning, shrink under length penalties); the
    default :math:`\beta = 0.5` is this library's choice (no paper prices rollouts by length). A prompt never
    measured gets the mean :math:`\hat L` of the measured prompts among the candidates, else of every measured
    prompt in the table, else ``prior``.

    Args:
        prior: the expected length before anything is measured (tokens, > 0; e.g. half the max response length).
        decay: :math:`\beta \in [0, 1)` (default 0.5).
        capacity: prompts kept in a private table (default None: 1,000,000).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (columns ``mean``, ``steps`` as owner
            ``"lengths"``; default None: a private one).
    """

    def __init__(
        self, *, prior: float, decay: float = 0.5, capacity: int | None = None, table: PromptTable | None = None
    ) -> None:
        self.prior = check_real(prior, "prior", 0.0, 1e12, "pass e.g. prior=512.0", open_low=True)
        self.decay = check_real(decay, "decay", 0.0, 1.0, "pass e.g. decay=0.5", open_high=True)
        self._cols = open_table(
            table,
            capacity,
            "lengths",
            {"mean": Column("float", fill=0.0, checks=("nonneg",)), "steps": Column("int", checks=("nonneg",))},
        )

    STATE = {"table": TableColumns.FIELD}  # noqa: RUF012 (the declared fields of state_dict)

    def _lengths(self, ids: Tensor) -> _Lengths:
        if self._cols.empty:
            return _Lengths(
                torch.full(ids.shape, self.prior, dtype=torch.float64), torch.zeros(ids.shape, dtype=torch.bool)
            )
        pos, seen = self._cols.find(ids)
        seen = seen & (self._cols["steps"].index_select(0, pos) > 0)
        mean = self._cols["mean"].index_select(0, pos)
        if bool(seen.any()):
            fill = float(mean[seen].mean())
        else:
            known = self._cols["steps"] > 0
            fill = float(self._cols["mean"][known].mean()) if bool(known.any()) else self.prior
        return _Lengths(torch.where(seen, mean, fill), seen)

    def expected(self, prompt_ids: IntP) -> FloatP:
        """float64 ``[P]``: :math:`\\hat L` of ``prompt_ids`` (distinct int64 ids), with the fills above."""
        return self._lengths(as_prompt_ids(prompt_ids)).expected

    def budget(self, tokens: int, prompt_ids: IntP) -> TokenBudget:
        """A :class:`TokenBudget` of ``tokens`` for a plan over ``prompt_ids`` (the same tensor, same order)."""
        return TokenBudget(check_int(tokens, "tokens", 0, "pass the step's token budget"), self.expected(prompt_ids))

    def update(self, result: AllocationResult) -> None:
        """Learn from a step's result: each rolled-out prompt's mean ``tokens`` (required in ``result.signals``)."""
        result = _check_result(result)
        tokens = result.signals.get("tokens")
        if tokens is None:
            raise InputError(
                "result.signals['tokens']",
                "each rollout's response length (the tokens signal)",
                "a result without it",
                "plan with a TokenBudget (it requires tokens), or observe tokens=... with every request",
            )
        t = tokens.detach().cpu().double()
        group = result.group
        if bool(torch.isnan(t).any()):  # reused responses (AR3PO) have no length: skip them
            ok = ~torch.isnan(t)
            t, group = t[ok], group[ok]
        if t.numel() and float(t.min()) < 0:
            raise InputError("result.signals['tokens']", "non-negative lengths", describe(tokens), "fix the lengths")
        p = result.plan_prompt_ids.numel()
        n = torch.bincount(group, minlength=p)
        s = torch.bincount(group, weights=t, minlength=p)
        got = n > 0
        if not bool(got.any()):
            return
        pos, order = self._cols.add(result.plan_prompt_ids[got])
        step_mean = (s[got] / n[got])[order]
        first = self._cols["steps"].index_select(0, pos) == 0
        old = self._cols["mean"].index_select(0, pos)
        self._cols["mean"].index_copy_(
            0, pos, torch.where(first, step_mean, self.decay * old + (1 - self.decay) * step_mean)
        )
        self._cols["steps"].index_add_(0, pos, torch.ones_like(pos))

    def state_dict(self) -> dict[str, Any]:
        """The table entry (the rows when the table is private)."""
        return dump_state({"table": self._cols.state()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, validated (an ``InputError`` names a bad field)."""
        s = load_state(state, self.STATE, "ResponseLengths")
        self._cols.load(s["table"])
