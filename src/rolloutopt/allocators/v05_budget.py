r"""V_{0.5}'s extra-budget request, the allocator side (:class:`V05Budget`).

Speaks the protocol of :mod:`rolloutopt.allocators._base` (``plan`` -> ``next``/``observe`` -> ``finish`` ->
``update``), keeps its per-prompt state in the columns of a bounded
:class:`~rolloutopt.allocators.table.PromptTable` (``torch.searchsorted`` look-ups, no Python loop over prompts or
rollouts) and checkpoints it with ``state_dict``/``load_state_dict``.

Provenance (``docs/methods/adaptive_alloc.md``): the paper has no public code; only its abstract and public
summaries were available. Every stage size, threshold and default below is **[reconstructed]** by this project and
is a keyword. Following the project rule (as :mod:`rolloutopt.allocators.gdro` resolved it), the class raises an
:class:`~rolloutopt.errors.InputError` naming ``experimental`` unless it is constructed with ``experimental=True``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import describe, require_experimental
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    _int,
    _real,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._tracked import _budget_prefix
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatP, IntP

__all__ = ["V05Budget"]

# -- V_{0.5} extra budget -------------------------------------------------------------------------------------------
_V_NAMES = ("initial", "extra", "capped", "no_budget")


class _V05Plan(Conversation):
    reason_names = _V_NAMES

    def __init__(self, prompt_ids: Tensor, budget: int, owner: V05Budget, prior: Tensor) -> None:
        super().__init__(prompt_ids, budget)
        self.o = owner
        self.prior = prior
        self.round = 0
        p = prompt_ids.numel()
        self._extra: Tensor | None = None
        self._capped = torch.zeros(p, dtype=torch.bool)
        self._got_extra = torch.zeros(p, dtype=torch.bool)

    def consume(self, output: Any) -> None:
        """Use a :class:`~rolloutopt.advantages.v05.V05Output` the trainer computed (its ``group_ids`` are this
        plan's prompt ids) for the next top-up round, instead of calling ``v05`` with the allocator's keywords."""
        from rolloutopt.advantages.v05 import V05Output

        if not isinstance(output, V05Output):
            raise InputError("output", "a V05Output (rolloutopt.advantages.v05)", describe(output), "pass v05(...)")
        extra = torch.zeros(self.prompt_ids.numel(), dtype=torch.long)
        extra[self.positions(output.group_ids.long().cpu())] = output.extra_rollouts.long().cpu()
        self._extra = extra

    def _request_from_v05(self) -> Tensor:
        from rolloutopt.advantages.v05 import v05

        o = self.o
        pos, r = self.rollouts()
        extra = torch.zeros(self.prompt_ids.numel(), dtype=torch.long)
        if pos.numel() == 0:
            return extra
        # groups labelled by plan position (each prompt's rollouts form one group either way; v05's per-group
        # request depends on the group's rewards and prior only): no id gather, no lookup of the output's ids,
        # and one request's positions come sorted, which v05's grouping takes without a sort
        out = v05(r, pos, self.prior.index_select(0, pos), experimental=True, max_extra=o.max_extra, **o.v05_kwargs)
        extra[out.group_ids] = out.extra_rollouts
        return extra

    def decide(self) -> Request | None:
        o = self.o
        if self.round == 0:
            self.round = 1
            give = _budget_prefix(torch.full_like(self._n, o.n), self._order, self.budget)
            return self.request(give > 0, give[give > 0]) if bool((give > 0).any()) else None
        if self.round > o.rounds:
            return None
        self.round += 1
        extra = self._extra if self._extra is not None else self._request_from_v05()
        self._extra = None
        extra = torch.where(self._n > 0, extra, 0)
        want = torch.minimum(extra, o._cap - self._n)
        give = _budget_prefix(want, self._order, self.budget - self.spent)
        self._capped |= (give < extra) & (extra > 0)
        self._got_extra |= give > 0
        return self.request(give > 0, give[give > 0]) if bool((give > 0).any()) else None

    def select(self) -> tuple[FloatB, IntP]:
        reasons = torch.where(self._n == 0, 3, torch.where(self._capped, 2, torch.where(self._got_extra, 1, 0)))
        return torch.ones(self.spent_observed, dtype=torch.float64), reasons


class V05Budget(TableOwner):
    r"""The allocator side of V_{0.5} (arXiv 2603.10848): ``n`` rollouts, then the extra rollouts ``v05`` asks for.

    ("Sequential OSLA budget allocation"; ``docs/methods/adaptive_alloc.md``). Round 0 gives every prompt ``n`` rollouts
    (the paper's group size 4); each of ``rounds`` top-up rounds then grants each prompt the one-step look-ahead
    request of :func:`rolloutopt.advantages.v05` computed on its rollouts so far,

    .. math::

        k_x = \min\{k \in [0, k_{max}] : \mathrm{MSE}(n_x + k) - \mathrm{MSE}(n_x + k + 1) < c\}, \qquad
        \mathrm{MSE}(m) = \frac{\hat\delta^2 \hat v}{m \hat\delta^2 + \hat v},

    clipped to ``n_max`` and to the budget (increasing-id order; the clipped prompts are ``"capped"``). The prior
    :math:`\hat b_0` of a prompt is the value-model prediction given with :meth:`set_prior`, else its mean reward
    over past steps (``update``), else ``unseen_prior``. A trainer with its own ``v05`` call (its own value model
    and keywords) hands the output to ``plan.consume(output)`` before the next ``plan.next()``; otherwise the plan
    calls ``v05(rewards, prompt ids, prior, experimental=True, max_extra=max_extra, **v05_kwargs)`` itself.

    **Reconstructed** (keywords): the whole budget rule (our reconstruction from the abstract and summaries),
    ``rounds=1``, the past-mean prior fallback and ``unseen_prior=0.5``; ``max_extra=4`` and ``cost=1e-3`` are
    ``v05``'s defaults. Every rollout is kept (weight 1). The budget is spent only as far as the requests go.

    Args:
        n: rollouts per prompt in round 0.
        max_extra: cap on the extra rollouts per prompt per round (``v05``'s ``max_extra``).
        rounds: top-up rounds (``v05`` is recomputed before each).
        n_min, n_max: caps: a prompt gets 0 or between ``n >= n_min`` and ``n_max`` rollouts (None: unbounded).
        unseen_prior: prior for a prompt with neither a value-model prediction nor history.
        v05_kwargs: further keywords of ``v05`` (``cost``, ``variance``, ``threshold``, ``fallback``, ...).
        experimental: must be True.
        capacity: prompts kept in a private table (default None: 1,000,000; least recently updated or given a
            prior evicted: an evicted prompt falls back to ``unseen_prior``).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); V05Budget
            registers ``value`` and ``has_value`` (the value-model prior and whether one was given), ``sum`` and
            ``count`` (past rewards) as owner ``"v05_budget"``, and the caller saves a shared table once.

    Edge cases: a budget below ``n * P`` gives round 0 to the lowest ids (the rest ``"no_budget"``) and leaves
    nothing for top-ups; ``rounds=0`` or ``max_extra=0`` is a fixed group of ``n``; rewards outside [0, 1] need
    ``v05_kwargs={"variance": "sample"}`` (``v05`` raises otherwise).
    """

    reference: ClassVar[str] = "arXiv 2603.10848 (V_{0.5}, the allocator side)"
    experimental: ClassVar[str | None] = "the sequential extra-budget rule is reconstructed"

    def __init__(
        self,
        *,
        n: int = 4,
        max_extra: int = 4,
        rounds: int = 1,
        n_min: int = 1,
        n_max: int | None = None,
        unseen_prior: float = 0.5,
        v05_kwargs: dict[str, Any] | None = None,
        experimental: bool = False,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        require_experimental(experimental, "V_{0.5}'s sequential extra-budget rule", "docs/methods/adaptive_alloc.md")
        _int(n, "n", 1)
        _int(max_extra, "max_extra", 0)
        _int(rounds, "rounds", 0)
        _int(n_min, "n_min", 1)
        _int(n_max, "n_max", 1, none=True)
        if n_min > n:
            raise InputError("n_min", f"n_min <= n = {n}", repr(n_min), "lower n_min or raise n")
        if n_max is not None and n_max < n:
            raise InputError("n_max", f"n_max >= n = {n}", repr(n_max), "raise n_max or lower n")
        _real(unseen_prior, "unseen_prior", 0.0, 1.0)
        kw = dict(v05_kwargs or {})
        if not isinstance(v05_kwargs, (dict, type(None))) or {"experimental", "max_extra", "valid"} & set(kw):
            raise InputError(
                "v05_kwargs", "a dict of v05 keywords (not experimental/max_extra/valid)", describe(v05_kwargs), "fix"
            )
        self.n, self.max_extra, self.rounds, self.n_min, self.n_max = n, max_extra, rounds, n_min, n_max
        self.unseen_prior, self.v05_kwargs = float(unseen_prior), kw
        self._cap = n_max if n_max is not None else 1 << 62
        self._cols = open_table(
            table,
            capacity,
            "v05_budget",
            {
                "value": Column("float", (), 0.0, ("prob",)),  # the value-model prior, where has_value
                "has_value": Column("bool", (), False),
                "sum": Column("float", (), 0.0, ("finite",)),  # past rewards' sum and count
                "count": Column("float", (), 0.0, ("nonneg",)),
            },
        )

    def set_prior(self, prompt_ids: IntP, prior: FloatP) -> None:
        """Store value-model predictions :math:`\\hat b_0` (float ``[P]``, clipped to [0, 1]) for ``prompt_ids``."""
        ids = as_prompt_ids(prompt_ids)
        if not isinstance(prior, Tensor) or not prior.is_floating_point() or prior.shape != ids.shape:
            raise InputError("prior", f"a float tensor [{ids.numel()}]", describe(prior), "one value per prompt id")
        p = prior.detach().cpu().double()
        if not bool(torch.isfinite(p).all()):
            raise InputError("prior", "finite values", describe(prior), "fix the value model's output")
        pos, order = self._cols.add(ids)
        self._cols["value"].index_copy_(0, pos, p[order].clamp(0.0, 1.0))
        self._cols["has_value"].index_fill_(0, pos, True)

    def prior(self, prompt_ids: IntP) -> FloatP:
        """The prior used for each prompt (float64 ``[P]``): value model, else past mean reward, else unseen."""
        ids = as_prompt_ids(prompt_ids)
        if self._cols.empty:
            return torch.full((ids.numel(),), self.unseen_prior, dtype=torch.float64)
        pos, seen = self._cols.find(ids)
        t = self._cols
        vm, has, s, c = t["value"][pos], t["has_value"][pos], t["sum"][pos], t["count"][pos]
        mean = torch.where(c > 0, (s / c.clamp(min=1)).clamp(0.0, 1.0), self.unseen_prior)
        return torch.where(seen, torch.where(has, vm, mean), self.unseen_prior)

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> _V05Plan:
        """``n`` rollouts each, then ``rounds`` top-ups from the ``v05`` request (class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        return _V05Plan(ids, check_budget(budget), self, self.prior(ids))

    def update(self, result: AllocationResult) -> None:
        """Accumulate each prompt's reward sum and count (the prior of prompts without a value-model prediction)."""
        result = _check_result(result, "V05Budget", _V_NAMES)
        p = result.plan_prompt_ids.numel()
        s = torch.zeros(p, dtype=torch.float64).index_add_(0, result.group, result.rewards.double())
        seen = result.counts > 0
        pos, order = self._cols.add(result.plan_prompt_ids[seen])
        self._cols["sum"].index_add_(0, pos, s[seen][order])
        self._cols["count"].index_add_(0, pos, result.counts[seen][order].double())

    STATE: ClassVar[dict[str, Field]] = {"table": TableColumns.FIELD}
    """The declared fields of :meth:`state_dict` (the table's columns are validated by the table: priors in
    [0, 1], finite sums, non-negative counts)."""

    def state_dict(self) -> dict[str, Any]:
        """The table (value-model priors and whether each prompt has one, reward sums and counts; the rows only when
        the table is private); copies."""
        return dump_state({"table": self._cols.state()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "V05Budget")
        self._cols.load(s["table"])
