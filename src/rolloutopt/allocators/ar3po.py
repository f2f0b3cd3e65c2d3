r"""AR3PO: staged rollout with response reuse (:class:`AR3PO`, :class:`ReusedResponses`, :func:`response_key`).

Speaks the protocol of :mod:`rolloutopt.allocators._base` (``plan`` -> ``next``/``observe`` -> ``finish`` ->
``update``), keeps its per-prompt state in a :class:`~rolloutopt.allocators.PromptTable` (``torch.searchsorted``
look-ups, no Python loop over prompts or rollouts) and checkpoints it with ``state_dict``/``load_state_dict``.

Provenance (``docs/methods/adaptive_alloc.md``): the paper has no public code; only its abstract and public
summaries were available. Every stage size, threshold, buffer policy and default below is **[reconstructed]** by
this project and is a keyword. Following the project rule (as :mod:`rolloutopt.allocators.gdro` resolved it), the
class raises an :class:`~rolloutopt.errors.InputError` naming ``experimental`` unless it is constructed with
``experimental=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_bool as _bool
from rolloutopt._validation import require_experimental
from rolloutopt.allocators._base import (
    SIGNALS,
    AllocationResult,
    Request,
    _choice,
    _int,
    _real,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._ids import _argsort_stable, _lookup
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._tracked import _budget_prefix, _success, _Tracked
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatP, IntB, IntP

__all__ = ["AR3PO", "ReusedResponses", "response_key"]

_SHIFT = 32
_ROW_MASK = (1 << _SHIFT) - 1


def response_key(step: int | Int[Tensor, " ..."], row: int | Int[Tensor, " ..."]) -> Int[Tensor, " ..."]:
    """The int64 key :class:`AR3PO` gives a generated rollout: ``step * 2**32 + row``.

    ``step`` is the allocator step the plan was made at (``result.metrics["step"]``) and ``row`` the rollout's
    row in that step's :class:`~rolloutopt.allocators.AllocationResult` (rows ``0 .. counts.sum() - 1`` are the
    generated rollouts, in the order they were observed). A trainer that keeps a response under this key can
    hand it back when :class:`AR3PO` reuses it (:meth:`_AR3POPlan.reused`).
    """
    return torch.as_tensor(step, dtype=torch.long) * (1 << _SHIFT) + torch.as_tensor(row, dtype=torch.long)


@dataclass(frozen=True)
class ReusedResponses:
    """The replayed responses an :class:`AR3PO` plan appended to its result.

    Attributes:
        rows: int64 ``[M]``, their rows in the result (all ``>= result.counts.sum()``: after the generated ones).
        prompt_ids: int64 ``[M]``, the prompt each belongs to.
        keys: int64 ``[M]``, the stored responses' :func:`response_key` (``keys >> 32`` is the step they were
            generated at, ``keys & (2**32 - 1)`` their row in that step's result).
    """

    rows: IntB
    prompt_ids: IntB
    keys: IntB


# -- AR3PO --------------------------------------------------------------------------------------------------------
_AR_NAMES = ("solved", "all_correct", "unsolved_reused", "unsolved_dropped", "cut_reused", "cut_dropped", "no_budget")


class _AR3POPlan(_Tracked):
    reason_names = _AR_NAMES
    track_extremes = False  # only successes are read

    def __init__(self, prompt_ids: Tensor, budget: int, owner: AR3PO) -> None:
        super().__init__(prompt_ids, budget)
        self.o = owner
        self.success_threshold = owner.success
        self.step = owner._step
        p = prompt_ids.numel()
        self.stage = 0
        self.active = torch.ones(p, dtype=torch.bool)
        self.cut = torch.zeros(p, dtype=torch.bool)
        # the buffer entries of the plan's prompts, read now (another owner of a shared table may move the rows
        # before this plan finishes)
        self._buf_key, self._buf_reward, self._buf_found = owner._entries(prompt_ids)
        self._reuse = torch.zeros(p, dtype=torch.bool)
        self._reused: ReusedResponses | None = None

    def decide(self) -> Request | None:
        o = self.o
        cand = self.active & (self._succ == 0) & (self._n < o._cap)
        if self.stage >= o.stages or not bool(cand.any()):
            self.active = torch.zeros_like(cand)
            return None
        want = torch.where(cand, (o._cap - self._n).clamp(max=o.k), 0)
        give = _budget_prefix(want, self._order, self.budget - self.spent)
        self.cut |= cand & (give == 0)
        self.active = give > 0
        self.stage += 1
        if not bool(self.active.any()):
            return None
        return self.request(self.active, give[self.active])

    def select(self) -> tuple[FloatB, IntP]:
        o = self.o
        n, succ = self._n, self._succ
        played = n > 0
        unsolved = played & (succ == 0)
        all_correct = played & (succ == n.double())
        reuse = unsolved & self._buf_found & o.reuse
        cut = self.cut & played
        reasons = torch.where(
            ~played,
            6,
            torch.where(
                all_correct,
                1,
                torch.where(~unsolved, 0, torch.where(cut, torch.where(reuse, 4, 5), torch.where(reuse, 2, 3))),
            ),
        )
        drop = (all_correct | (unsolved & ~reuse)) if o.drop_flat else torch.zeros_like(played)
        pos, _ = self.rollouts()
        self._reuse = reuse
        return (~drop).double().index_select(0, pos), reasons

    def finish(self) -> AllocationResult:
        res = super().finish()
        o = self.o
        rpos = self._reuse.nonzero().squeeze(1)
        keys, rew = self._buf_key[rpos], self._buf_reward[rpos]
        n_gen = res.rewards.numel()
        self._reused = ReusedResponses(torch.arange(n_gen, n_gen + rpos.numel()), self.prompt_ids[rpos], keys)
        played = self._n > 0
        # a rollout signal covers every row of the result: NaN for the reused rows (not generated this step)
        nan = torch.full((rpos.numel(),), math.nan)
        signals = {k: torch.cat([v, nan.to(v.dtype)]) if SIGNALS[k] == "rollout" else v for k, v in res.signals.items()}
        return replace(
            res,
            signals=signals,
            prompt_ids=torch.cat([res.prompt_ids, self.prompt_ids[rpos]]),
            group=torch.cat([res.group, rpos]),
            rewards=torch.cat([res.rewards, rew.to(res.rewards.dtype)]),
            weight=torch.cat([res.weight, torch.full((rpos.numel(),), o.reuse_weight, dtype=res.weight.dtype)]),
            metrics={
                **res.metrics,
                "step": torch.tensor(float(self.step), dtype=torch.float64),
                "stages": torch.tensor(float(self.stage), dtype=torch.float64),
                "reused": torch.tensor(float(rpos.numel()), dtype=torch.float64),
                "rollouts_per_prompt": (self._n.double().sum() / played.double().sum().clamp(min=1)),
            },
        )

    def reused(self) -> ReusedResponses:
        """The replayed responses appended to this plan's result (after :meth:`finish`)."""
        if self._reused is None:
            raise InputError("plan.reused", "a finished plan", "finish() not called yet", "call plan.finish() first")
        return self._reused


class AR3PO(TableOwner):
    r"""AR3PO: adaptive multi-stage rollout plus reuse of a buffered correct response (arXiv 2509.25808).

    See ``docs/methods/adaptive_alloc.md``. Verified (abstract, summaries): rollout is multi-stage, a prompt stops
    receiving rollouts once a stage yields a correct response, so hard prompts get more; when every rollout of a
    prompt is wrong, a previously generated correct response for it is taken from a replay buffer and put into the
    group so that its advantage is not zero. Stage :math:`s = 1..S` gives :math:`k` rollouts to every still-active
    prompt:

    .. math::

        \text{active}_{s+1}(x) = \text{active}_s(x) \wedge \textstyle\sum_{j \le s k} \mathbb 1[r_j \ge
        \text{success}] = 0, \qquad n(x) \le \min(kS, n_{max}).

    After the last stage, a prompt with no correct response gets its buffered response appended (reason
    ``"unsolved_reused"``; the training group has :math:`n + 1` members) or is dropped (weight 0,
    ``"unsolved_dropped"``); a prompt whose stage-1 group is all correct carries no signal and is dropped
    (``"all_correct"``); ``drop_flat=False`` keeps both with weight 1 (zero advantage downstream).

    **Reconstructed** (all keywords): ``k=4`` and ``stages=4`` (our choices), the budget rule (a stage
    goes to the active prompts in increasing-id order while the budget lasts; the rest are ``"cut_*"``, prompts
    that cannot get stage 1 are ``"no_budget"``), the buffer (per prompt, the ``"latest"`` or a ``"random"``
    correct generated response of the latest step that had one; at most ``buffer_size`` prompts, the most
    recently stored kept, ties to the lower id; entries older than ``max_age`` steps dropped; a reused entry
    stays), ``reuse_weight`` (1.0) and ``success`` (1.0, the exact-1 rule of verifiable rewards).

    Budget: AR3PO spends *at most* ``budget`` (it stops solved prompts early, which is its point; a budget of
    ``k * stages * P`` never binds). ``result.counts`` and ``metrics["rollouts"]`` count generated rollouts only.

    Reused responses (how a trainer gets them): the result holds them as extra rows *after* the generated ones
    (``result.rewards.numel() = counts.sum() + metrics["reused"]``), with their prompt's ``group``, the stored
    reward and weight ``reuse_weight``. ``plan.reused()`` gives their rows and :func:`response_key` keys. A
    trainer stores the response (tokens and behaviour log-probs: it is off-policy) of every generated rollout
    whose key is in :meth:`replay` after :meth:`update`, may free the
    others, and pastes the stored response in at each reused row.

    Args:
        k: rollouts per prompt per stage (>= ``n_min``).
        stages: maximum number of stages :math:`S`.
        reuse: append buffered correct responses to unsolved groups (False: plain adaptive rollout).
        reuse_weight: weight of a reused row in the result.
        buffer: ``"latest"`` or ``"random"`` (seeded) choice of the stored correct response.
        buffer_size: maximum number of prompts in the buffer.
        max_age: drop entries stored more than this many steps ago (None: never).
        drop_flat: weight 0 for groups without signal (stage-1 all correct, unsolved without a reuse).
        success: reward threshold of a correct response.
        n_min, n_max: caps: a prompt gets 0 or between ``k >= n_min`` and ``n_max`` generated rollouts
            (``n_max=None``: ``k * stages``; the last stage is shortened to fit ``n_max``).
        seed: seeds the generator of ``buffer="random"``.
        experimental: must be True (see the module docstring).
        capacity: prompts kept in a private table (default None: 1,000,000; the least recently stored are
            evicted first, their entries lost).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); AR3PO registers
            the buffer's ``key`` and ``reward`` (NaN: no entry) as owner ``"ar3po"``, and the caller saves a shared
            table once.

    Edge cases: an empty plan or a zero budget requests nothing (every prompt ``"no_budget"``); rewards need not
    be binary (correct means ``reward >= success``).
    """

    reference: ClassVar[str] = "arXiv 2509.25808 (AR3PO: adaptive rollout and response reuse)"
    experimental: ClassVar[str | None] = (
        "the stages, the budget rule and the reuse buffer are reconstructed from the abstract"
    )

    def __init__(
        self,
        *,
        k: int = 4,
        stages: int = 4,
        reuse: bool = True,
        reuse_weight: float = 1.0,
        buffer: Literal["latest", "random"] = "latest",
        buffer_size: int = 1_000_000,
        max_age: int | None = None,
        drop_flat: bool = True,
        success: float = 1.0,
        n_min: int = 1,
        n_max: int | None = None,
        seed: int = 0,
        experimental: bool = False,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        require_experimental(
            experimental, "AR3PO's stages, budget rule and replay buffer", "docs/methods/adaptive_alloc.md"
        )
        _int(k, "k", 1)
        _int(stages, "stages", 1)
        _bool(reuse, "reuse")
        _real(reuse_weight, "reuse_weight", 0.0, math.inf)
        _choice(buffer, "buffer", ("latest", "random"))
        _int(buffer_size, "buffer_size", 0)
        _int(max_age, "max_age", 0, none=True)
        _bool(drop_flat, "drop_flat")
        self.success = _success(success)
        _int(n_min, "n_min", 1)
        _int(n_max, "n_max", 1, none=True)
        if n_min > k:
            raise InputError("n_min", f"n_min <= k = {k} (stage 1 gives k rollouts)", repr(n_min), "lower n_min")
        if n_max is not None and n_max < k:
            raise InputError("n_max", f"n_max >= k = {k}", repr(n_max), "raise n_max or lower k")
        _int(seed, "seed", 0)
        self.k, self.stages, self.reuse, self.reuse_weight = k, stages, reuse, float(reuse_weight)
        self.buffer, self.buffer_size, self.max_age, self.drop_flat = buffer, buffer_size, max_age, drop_flat
        self.n_min, self.n_max, self.seed = n_min, n_max, seed
        self._cap = k * stages if n_max is None else min(n_max, k * stages)
        self._gen = torch.Generator().manual_seed(seed)
        self._step = 0
        # the buffer, one entry per prompt: the stored response's key (its step is key >> 32) and reward; a NaN
        # reward (the fill) marks a prompt without an entry
        self._cols = open_table(
            table,
            capacity,
            "ar3po",
            {
                "key": Column("int", checks=("nonneg",)),
                "reward": Column("float", fill=math.nan, checks=("finite_or_nan",)),
            },
        )

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> _AR3POPlan:
        """Stages of ``k`` rollouts over ``prompt_ids`` until each is solved or out of stages (class docstring)."""
        return _AR3POPlan(as_prompt_ids(prompt_ids), check_budget(budget), self)

    def _entries(self, prompt_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(keys, rewards, has)`` of ``prompt_ids``: their buffer entries and whether each has one (the keys and
        rewards of the others are junk)."""
        p = prompt_ids.numel()
        if self._cols.empty:
            empty = torch.zeros(p, dtype=torch.bool)
            return torch.zeros(p, dtype=torch.long), torch.zeros(p, dtype=torch.float64), empty
        # a row this owner has not seen holds a NaN reward (the fill), as a prompt without an entry: no seen mask
        pos, found = _lookup(self._cols.table.prompt_ids, prompt_ids)
        rew = self._cols["reward"].index_select(0, pos)
        return self._cols["key"].index_select(0, pos), rew, found & ~torch.isnan(rew)

    def _has(self) -> Tensor:
        """bool ``[M]``: the table rows holding a buffer entry."""
        return self._cols["seen"] & ~torch.isnan(self._cols["reward"])

    def replay(self) -> tuple[IntP, IntP, FloatP]:
        """The buffer, sorted by prompt id: ``(prompt_ids, keys, rewards)`` (copies; keys: :func:`response_key`)."""
        has = self._has()
        return self._cols.table.prompt_ids[has], self._cols["key"][has], self._cols["reward"][has]

    def update(self, result: AllocationResult) -> None:
        """Store, per prompt with a correct generated rollout, one of them (``buffer``); bound the buffer."""
        result = _check_result(result, "AR3PO", _AR_NAMES)
        step = int(result.metrics["step"])
        gen = int(result.counts.sum())
        r, g = result.rewards[:gen], result.group[:gen]
        p = result.plan_prompt_ids.numel()
        ok = r >= self.success
        rows = torch.arange(gen)
        score = rows.double() if self.buffer == "latest" else torch.rand(gen, generator=self._gen, dtype=torch.float64)
        score = torch.where(ok, score, -math.inf)
        best = torch.full((p,), -math.inf, dtype=torch.float64).scatter_reduce(0, g, score, "amax")
        hit = ok & (score == best[g])
        row_of = torch.full((p,), -1, dtype=torch.long).scatter_reduce(0, g[hit], rows[hit], "amax")
        has = row_of >= 0
        new_rows = row_of[has]
        if bool(has.any()):
            pos, order = self._cols.add(result.plan_prompt_ids[has])  # an entry replaces the prompt's old one
            self._cols["key"].index_copy_(0, pos, response_key(step, new_rows[order]))
            self._cols["reward"].index_copy_(0, pos, result.rewards[new_rows[order]].double())
        if not self._cols.empty and (self.max_age is not None or self.buffer_size < len(self._cols.table)):
            entry = self._has()
            drop = torch.zeros_like(entry)
            stp = self._cols["key"] >> _SHIFT
            if self.max_age is not None:
                drop = entry & (step - stp > self.max_age)
                entry = entry & ~drop
            rows = entry.nonzero().squeeze(1)  # increasing ids
            if rows.numel() > self.buffer_size:  # keep the most recently stored, ties to the lower id
                o = _argsort_stable(stp[rows], descending=True)
                drop[rows[o[self.buffer_size :]]] = True
            if bool(drop.any()):
                self._cols["reward"].masked_fill_(drop, math.nan)
                self._cols["key"].masked_fill_(drop, 0)
        self._step = max(self._step, step + 1)

    STATE: ClassVar[dict[str, Field]] = {
        "step": Field("integer", low=0),
        "table": TableColumns.FIELD,
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`; the table validates its
    columns, and each entry's key must name a step before ``step``)."""

    def state_dict(self) -> dict[str, Any]:
        """Step counter, the table (the buffer's keys and rewards; the rows only when the table is private) and
        the generator state (copies)."""
        return dump_state({"step": self._step, "table": self._cols.state(), "generator": self._gen.get_state()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "AR3PO")
        cols, at = self._cols.incoming(s["table"])
        entry = cols["seen"] & ~torch.isnan(cols["reward"])
        steps = cols["key"][entry] >> _SHIFT
        if steps.numel() and int(steps.max()) >= s["step"]:
            raise InputError(
                f"{at}[{self._cols.owner + '/key'!r}]",
                f"response keys of steps before the state's step counter {s['step']} (entries are stored by a "
                "finished step)",
                f"a step up to {int(steps.max())}",
                "pass AR3PO.state_dict()",
            )
        self._cols.load(s["table"])
        self._step = s["step"]
        self._gen.set_state(s["generator"])
