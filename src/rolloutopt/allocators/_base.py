"""The allocation protocol every allocator speaks (``docs/api/allocators.md``), and the bookkeeping they share.

A step is a short conversation::

    plan = allocator.plan(prompt_ids, budget)    # int64 [P] candidate prompts, budget in rollouts
    while (request := plan.next()) is not None:  # which prompts, how many more rollouts each
        plan.observe(request, rewards)           # float [request.counts.sum()], ordered by request row
    result = plan.finish()                       # rollouts to train on, with groups, weights and reasons
    allocator.update(result)                     # learn from this step

:class:`Conversation` implements the bookkeeping once (pending request, validation of observations, budget
accounting, assembling the result); an allocator's plan subclasses it and decides only *what to request next*
(:meth:`Conversation.decide`) and *which rollouts to keep* (:meth:`Conversation.select`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float, Shaped
from torch import Tensor

from rolloutopt._validation import check_int, check_real, checks_enabled, describe
from rolloutopt.allocators._ids import _sort_ids
from rolloutopt.allocators._units import TokenBudget, check_budget
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatP, IntB, IntP, Scalar

__all__ = [
    "SIGNALS",
    "AllocationResult",
    "Allocator",
    "Conversation",
    "OneShotPlan",
    "Request",
    "TokenBudget",
    "as_prompt_ids",
    "check_budget",
]


SIGNALS: dict[str, str] = {
    "entropy": "rollout",
    "tokens": "rollout",
    "hardness": "prompt",
    "prompt_entropy": "probe",
}
"""What an allocator may learn from beyond rewards, by name, and how each travels through the conversation.

- ``"rollout"`` signals come with the rewards, one value per generated rollout (``[n]`` for a request of ``n``
  rollouts, in reward order): ``entropy`` (each response's mean token entropy), ``tokens`` (each response's
  length in tokens);
- ``"prompt"`` signals come with the rewards, one value per request row (``[R]``): ``hardness`` (a per-prompt
  hardness the trainer measured, e.g. the prompt's mean loss);
- ``"probe"`` signals are measured *before* generation: the allocator sends a probe request (``counts`` all 0,
  ``signals`` naming what to measure) and the answer carries one value per row and no rewards:
  ``prompt_entropy`` (the current policy's mean token entropy over the prompt, one prefill pass).

An allocator declares the signals it cannot run without (``requires``) and those it reads when given
(``accepts``); every request names the signals to collect for it (``request.signals``), ``observe`` refuses
a missing required signal and any signal the request did not ask for, and the result carries what was
collected (``result.signals``), which ``update`` reads."""


@dataclass(frozen=True)
class Request:
    """Rollouts to generate: ``counts[r]`` more samples of prompt ``prompt_ids[r]`` (both int64 ``[R]``).

    ``signals`` names what to collect with the rewards (see :data:`SIGNALS`). A *probe* request
    (:attr:`is_probe`: every count 0, only probe signals) asks for measurements of the prompts and no rollouts.
    """

    prompt_ids: IntP
    counts: IntP
    signals: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        """Number of rollouts requested (``counts.sum()``)."""
        return int(self.counts.sum())

    @property
    def is_probe(self) -> bool:
        """Whether this request measures the prompts (probe signals) instead of generating rollouts."""
        return bool(self.signals) and all(SIGNALS.get(s) == "probe" for s in self.signals)


@dataclass(frozen=True)
class AllocationResult:
    """What a step produced, per rollout and per planned prompt.

    Per rollout (``[N]``, in the order the rewards were observed): ``prompt_ids``, ``group`` (the prompt's
    position in the plan, ``0..P-1``, so rollouts of one prompt from several requests share it), ``rewards``
    (float32; float64 only when every ``observe`` got float64 rewards — the statistics an allocator keeps are
    accumulated in float64 either way), ``weight`` (same dtype; 0 for rollouts kept out of the loss, e.g. a
    zero-variance group dropped by dynamic sampling).
    An allocator that reuses stored responses (AR3PO) appends them after the generated rows, so
    ``counts.sum()`` (rollouts generated, what the budget paid for) can be less than ``rewards.numel()``.
    Per planned prompt (``[P]``, the order given to ``plan``): ``plan_prompt_ids``, ``counts`` (rollouts it
    got), ``reasons`` (int codes into ``reason_names``, why it got them). ``metrics``: detached 0-d tensors
    (``rollouts``, ``budget_used_frac`` in the budget's unit, ``kept_frac``; ``tokens`` when the ``tokens`` signal
    was collected, ``token_budget`` for a :class:`TokenBudget`).
    ``signals``: what was collected beyond rewards (:data:`SIGNALS`): a ``"rollout"`` signal per generated rollout
    ``[counts.sum()]`` in reward order, a ``"prompt"`` or ``"probe"`` signal per planned prompt ``[P]`` (NaN for a
    prompt it was not measured for).
    """

    prompt_ids: IntB
    group: IntB
    rewards: FloatB
    weight: FloatB
    plan_prompt_ids: IntP
    counts: IntP
    reasons: IntP
    reason_names: tuple[str, ...]
    metrics: dict[str, Scalar] = field(default_factory=dict)
    signals: dict[str, Float[Tensor, " _"]] = field(default_factory=dict)

    def reason_of(self, prompt_id: int) -> str:
        """The reason recorded for one planned prompt (a convenience for logs and tests)."""
        hit = (self.plan_prompt_ids == prompt_id).nonzero()
        if hit.numel() == 0:
            raise InputError("prompt_id", "a prompt id of this plan", repr(prompt_id), "use result.plan_prompt_ids")
        return self.reason_names[int(self.reasons[int(hit[0, 0])])]


@runtime_checkable
class Allocator(Protocol):
    """An allocator: keyword-only construction with the paper's defaults, a plan per step, an update after it."""

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation: ...

    def update(self, result: AllocationResult) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def as_prompt_ids(prompt_ids: IntP, name: str = "prompt_ids") -> IntP:
    """Validate distinct int64 prompt ids ``[P]`` (any integer dtype is accepted and returned as int64 on CPU)."""
    if not isinstance(prompt_ids, Tensor):
        raise InputError(name, "an int64 tensor of prompt ids [P]", describe(prompt_ids), "pass torch.tensor(ids)")
    if prompt_ids.is_floating_point() or prompt_ids.is_complex() or prompt_ids.dtype == torch.bool:
        raise InputError(name, "integer prompt ids", describe(prompt_ids), f"cast with {name}.long()")
    if prompt_ids.ndim != 1:
        raise InputError(name, "a 1-d tensor [P]", describe(prompt_ids), f"flatten {name}")
    ids = prompt_ids.long().cpu()
    if checks_enabled() and ids.numel() > 1:
        ordered = _sort_ids(ids)[0]
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise InputError(
                name, "distinct prompt ids", f"{describe(prompt_ids)} with repeats", "deduplicate the prompts"
            )
    return ids


# -- hyper-parameter checks shared by the allocators --------------------------------------------------------------
_int = _check_int = check_int  # hyper-parameter checks shared with the rest of the library (rolloutopt._validation)
_real = _check_float = check_real


def _choice(x: Any, name: str, options: tuple[str, ...]) -> None:
    if x not in options:
        raise InputError(name, f"one of {options}", describe(x), f"pass {name}={options[0]!r}")


def _cat(parts: list[Tensor], empty: Tensor) -> Tensor:
    """Concatenate, without the copy ``torch.cat`` makes of a single part."""
    return empty if not parts else parts[0] if len(parts) == 1 else torch.cat(parts)


class Conversation:
    """One step's plan: the request/observe bookkeeping shared by every allocator, vectorised.

    Subclasses implement :meth:`decide` (the next request, or None when done; it may read :meth:`totals` and
    :meth:`rollouts`) and may override :meth:`select` (weights and reasons at the end). The base class enforces
    the protocol: one pending request at a time, ``observe`` gets exactly that request and ``counts.sum()``
    finite rewards, the total requested never exceeds ``budget`` (an allocator bug raises ``AssertionError``),
    and ``finish`` is called once, after the last request. No Python loop over prompts or rollouts.

    Attributes:
        prompt_ids: the planned prompts, int64 ``[P]``.
        budget: the step's budget in rollouts.
        spent: rollouts requested so far.
    """

    reason_names: tuple[str, ...] = ("allocated",)

    def __init__(
        self, prompt_ids: IntP, budget: int, *, requires: tuple[str, ...] = (), accepts: tuple[str, ...] = ()
    ) -> None:
        self.prompt_ids = prompt_ids
        self._budget = int(budget)
        self.spent = 0
        self._token_budget: TokenBudget | None = getattr(budget, "source", None)
        self._tokens = 0.0  # tokens generated so far (token budgets)
        if self._token_budget is not None:
            if self._token_budget.expected.numel() != prompt_ids.numel():
                raise InputError(
                    "budget",
                    f"a TokenBudget with one expected length per planned prompt ({prompt_ids.numel()})",
                    f"{self._token_budget.expected.numel()} expected lengths",
                    "make it with lengths.budget(tokens, prompt_ids) for the same prompt_ids",
                )
            requires = requires if "tokens" in requires else (*requires, "tokens")
        self.requires = requires
        self.accepts = accepts
        # the signals every generating request collects (rollout and prompt kinds; probes name their own)
        self._collect = tuple(s for s in (*requires, *accepts) if SIGNALS[s] != "probe")
        self._rollout_signals: dict[str, list[Tensor]] = {}
        self._prompt_signals: dict[str, Tensor] = {}  # name -> float64 [P], NaN where not measured
        self._generating_requests = 0  # observed requests with rollouts (a rollout signal must come with each)
        self._by_id: tuple[Tensor, Tensor] | None = None  # prompt_ids.sort(), made on first use
        p = prompt_ids.numel()
        self._n = torch.zeros(p, dtype=torch.long)
        self._sum = torch.zeros(p, dtype=torch.float64)
        self._sumsq = torch.zeros(p, dtype=torch.float64)
        self._unfolded: list[tuple[Tensor, Tensor]] = []  # observed, not yet added to _sum/_sumsq (totals())
        self._pending: Request | None = None
        self._issued: tuple[Request, Tensor] | None = None  # the last request made by request(), with its rows
        self._known: tuple[Request, Tensor] | None = None  # the pending request with its rows, when issued so
        self._log_pos: list[Tensor] = []
        self._log_rewards: list[Tensor] = []
        self._all_f64: bool | None = None  # every observed reward tensor float64 (None: nothing observed yet)
        self._finished = False

    @property
    def budget(self) -> int:
        """The step's budget in rollouts; with a :class:`TokenBudget`, re-priced after every observed request:
        rollouts spent plus the tokens left over the step's mean tokens per rollout so far
        (:mod:`rolloutopt.allocators.tokens`)."""
        tb = self._token_budget
        n = self.spent_observed
        if tb is None or n == 0:
            return self._budget
        per = max(self._tokens / n, 1.0)
        return self.spent + max(0, int((tb.tokens - self._tokens) // per))

    @property
    def _sorted(self) -> Tensor:
        """``prompt_ids`` sorted (made on first use)."""
        return self._sort()[0]

    @property
    def _order(self) -> Tensor:
        """Positions of the planned prompts by increasing id (``prompt_ids.sort().indices``, made on first use)."""
        return self._sort()[1]

    def _sort(self) -> tuple[Tensor, Tensor]:
        if self._by_id is None:
            self._by_id = _sort_ids(self.prompt_ids)
        return self._by_id

    def positions(self, ids: IntP) -> IntP:
        """Positions ``0..P-1`` of ``ids`` in ``self.prompt_ids`` (every id must be planned)."""
        ordered, order = self._sort()
        pos = torch.searchsorted(ordered, ids).clamp(max=max(ordered.numel() - 1, 0))
        if checks_enabled() and ids.numel() and not bool((ordered[pos] == ids).all()):
            raise InputError("prompt_ids", "ids of this plan's prompts", "unknown ids", "request planned prompts only")
        return order[pos]

    def request(self, rows: IntP | Bool[Tensor, " _"], counts: IntP) -> Request:
        """A request for the planned prompts at ``rows`` (positions into ``prompt_ids``, int64 ``[R]``, or a bool
        mask ``[P]``) with ``counts`` ``[R]``, collecting the plan's declared rollout and prompt signals. Same as
        ``Request(self.prompt_ids[rows], counts, signals)``, except that the plan remembers the positions, so
        :meth:`observe` needs no id lookup when :meth:`decide` returns it."""
        pos = rows.nonzero().squeeze(1) if rows.dtype == torch.bool else rows
        req = Request(self.prompt_ids[pos], counts, self._collect)
        self._issued = (req, pos)
        return req

    def probe(self, rows: IntP | Bool[Tensor, " _"], signals: tuple[str, ...]) -> Request:
        """A probe request: measure ``signals`` (probe kind, :data:`SIGNALS`) for the prompts at ``rows``, no
        rollouts. Its answer, ``observe(request, None, **measured)``, is read with :meth:`signal`."""
        assert signals and all(SIGNALS[s] == "probe" for s in signals), "allocator bug: not probe signals"
        pos = rows.nonzero().squeeze(1) if rows.dtype == torch.bool else rows
        req = Request(self.prompt_ids[pos], torch.zeros(pos.numel(), dtype=torch.long), signals)
        self._issued = (req, pos)
        return req

    def signal(self, name: str) -> Float[Tensor, " _"] | None:
        """What was observed so far of signal ``name``: float64 ``[P]`` for a prompt or probe signal (NaN where
        not measured), ``[N]`` in observation order for a rollout signal; None if it never came."""
        if SIGNALS[name] == "rollout":
            parts = self._rollout_signals.get(name)
            return None if parts is None else torch.cat(parts).double()
        return self._prompt_signals.get(name)

    # -- to implement ---------------------------------------------------------------------------------------
    def decide(self) -> Request | None:
        """The next request (prompt ids from ``self.prompt_ids``, counts >= 1), or None when the plan is done."""
        raise NotImplementedError

    def on_observe(self, pos: IntB, rewards: FloatB) -> None:
        """Hook, called at the end of every ``observe``: the request's rollouts as prompt positions ``[n]`` (into
        ``prompt_ids``) and float64 rewards ``[n]`` (default: nothing). For statistics a plan keeps itself."""

    def select(self) -> tuple[FloatB, IntP]:
        """Per observed rollout weight ``[N]`` and per planned prompt reason code ``[P]`` (default: keep all)."""
        return torch.ones(self.spent_observed, dtype=torch.float64), torch.zeros(
            self.prompt_ids.numel(), dtype=torch.long
        )

    # -- what a subclass reads ------------------------------------------------------------------------------
    @property
    def spent_observed(self) -> int:
        """Rollouts observed so far."""
        return int(self._n.sum())

    def totals(self) -> tuple[IntP, FloatP, FloatP]:
        """Per planned prompt ``[P]``: rollouts observed (int64), sum and sum of squares of their rewards (fp64).

        The sums are folded in on demand (a plan that never asks does not pay for them), request by request in
        observation order, so they are the same floats as if every ``observe`` had added its rewards at once."""
        for pos, r in self._unfolded:
            self._sum.index_add_(0, pos, r)
            self._sumsq.index_add_(0, pos, r * r)
        self._unfolded = []
        return self._n, self._sum, self._sumsq

    def rollouts(self) -> tuple[IntB, FloatB]:
        """Every observed rollout so far: prompt position ``[N]`` (into ``prompt_ids``) and float64 reward ``[N]``.

        Read-only: the tensors are the plan's log (concatenated once, then reused)."""
        if len(self._log_pos) > 1:
            self._log_pos, self._log_rewards = [torch.cat(self._log_pos)], [torch.cat(self._log_rewards)]
        return (
            _cat(self._log_pos, torch.zeros(0, dtype=torch.long)),
            _cat(self._log_rewards, torch.zeros(0, dtype=torch.float64)),
        )

    @property
    def result_dtype(self) -> torch.dtype:
        """The dtype of the result's ``rewards`` and ``weight``: float64 when every ``observe`` got float64
        rewards (and there was one), float32 otherwise."""
        return torch.float64 if self._all_f64 else torch.float32

    # -- the protocol ---------------------------------------------------------------------------------------
    def next(self) -> Request | None:
        """The next request, or None: then call :meth:`finish`."""
        if self._finished:
            raise InputError("plan", "a plan that is not finished", "finish() already called", "start a new plan")
        if self._pending is not None:
            raise InputError(
                "plan.next", "observe(request, rewards) for the pending request first", "a pending request", "observe"
            )
        req = self.decide()
        if req is None:
            return None
        assert req.prompt_ids.dtype == torch.long and req.counts.dtype == torch.long, "allocator bug: dtypes"
        assert req.is_probe or bool((req.counts >= 1).all()), "allocator bug: a request row with count < 1"
        assert self.spent + req.total <= self.budget, "allocator bug: request exceeds the budget"
        self.spent += req.total
        self._pending = req
        issued, self._issued = self._issued, None
        self._known = issued if issued is not None and issued[0] is req else None
        return req

    def observe(self, request: Request, rewards: FloatB | None, **signals: Shaped[Tensor, " _"]) -> None:
        """Record the rewards of ``request``: a float tensor of ``request.counts.sum()`` values, row by row, with
        the signals the request names (``request.signals``, see :data:`SIGNALS`): a rollout signal ``[n]`` aligned
        with ``rewards``, a prompt signal ``[R]`` aligned with ``request.prompt_ids``. A probe request
        (``request.is_probe``) is answered with ``rewards=None`` and its measurements ``[R]``.

        A required signal that is missing, and any signal the request did not ask for, is an ``InputError``:
        nothing is silently ignored. An optional signal must come with every request of the step or with none.
        """
        if self._pending is None or request is not self._pending:
            raise InputError(
                "request",
                "the request returned by the last plan.next()",
                "another request" if self._pending is not None else "no pending request",
                "observe each request once, in order",
            )
        self._observe_signals(request, signals)
        if request.is_probe:
            if rewards is not None and (not isinstance(rewards, Tensor) or rewards.numel() != 0):
                raise InputError(
                    "rewards", "None for a probe request (it generates nothing)", describe(rewards), "pass None"
                )
            known = self._known
            rows = known[1] if known is not None and known[0] is request else self.positions(request.prompt_ids)
            self._store_signals(request, signals, rows)
            self._pending = None
            self._known = None
            return
        if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
            raise InputError("rewards", "a float tensor", describe(rewards), "pass torch.tensor(rewards).float()")
        if rewards.ndim != 1 or rewards.numel() != request.total:
            raise InputError(
                "rewards",
                f"a 1-d tensor of request.counts.sum() = {request.total} rewards, ordered by request row",
                describe(rewards),
                "pass one reward per requested rollout",
            )
        self._all_f64 = rewards.dtype == torch.float64 and self._all_f64 is not False
        r = rewards.detach().cpu().to(torch.float64)
        # a NaN or inf makes the sum non-finite; a finite sum proves every reward finite (one cheap reduction)
        if not math.isfinite(float(r.sum())) and not bool(torch.isfinite(r).all()):
            raise InputError("rewards", "finite rewards", f"{describe(rewards)} with NaN or inf", "fix the scorer")
        known = self._known
        rows = known[1] if known is not None and known[0] is request else self.positions(request.prompt_ids)
        counts = request.counts
        if rows.numel() and int(counts.min()) == int(counts.max()):  # equal groups: a broadcast copy
            pos = rows[:, None].expand(rows.numel(), int(counts[0])).reshape(-1)
        else:
            pos = rows.repeat_interleave(counts)
        self._n.index_add_(0, rows, counts)
        self._unfolded.append((pos, r))
        self._log_pos.append(pos)
        self._log_rewards.append(r)
        self._store_signals(request, signals, rows)
        if "tokens" in signals:
            self._tokens += float(signals["tokens"].detach().double().sum())
        self._pending = None
        self._known = None
        self.on_observe(pos, r)

    def _observe_signals(self, request: Request, signals: dict[str, Any]) -> None:
        """Validate the signals of one ``observe`` against the request (nothing is stored yet)."""
        asked = request.signals
        for name, value in signals.items():
            if name not in asked:
                raise InputError(
                    name,
                    f"only the signals the request asks for ({', '.join(asked) or 'none'}; request.signals)",
                    f"{name}=...",
                    f"drop {name}=",
                )
            n = request.total if SIGNALS[name] == "rollout" else request.prompt_ids.numel()
            what = "rollout of the request" if SIGNALS[name] == "rollout" else "row of the request"
            if not isinstance(value, Tensor) or value.ndim != 1 or value.numel() != n or value.dtype == torch.bool:
                raise InputError(name, f"a 1-d number tensor of {n} values, one per {what}", describe(value), "fix it")
            if checks_enabled() and not bool(torch.isfinite(value.detach().double()).all()):
                raise InputError(name, "finite values", f"{describe(value)} with NaN or inf", f"fix the {name}")
            if name == "tokens" and checks_enabled() and value.numel() and float(value.min()) < 0:
                raise InputError(name, "response lengths >= 0", describe(value), "pass each response's token count")
        for name in asked:
            if name in self.requires and name not in signals:
                raise InputError(
                    name, f"{name}=... with this request (the allocator requires it)", "nothing", f"pass {name}="
                )
        if not request.is_probe:
            for name in asked:
                if (
                    SIGNALS[name] == "rollout"
                    and self._generating_requests
                    and ((name in signals) != (name in self._rollout_signals))
                ):
                    raise InputError(
                        name,
                        "the signal with every request of the step or with none",
                        "given for some requests only",
                        f"pass {name}= with every request, or never",
                    )

    def _store_signals(self, request: Request, signals: dict[str, Any], rows: Tensor) -> None:
        for name, value in signals.items():
            v = value.detach().cpu()
            if SIGNALS[name] == "rollout":
                self._rollout_signals.setdefault(name, []).append(v)
            else:
                stored = self._prompt_signals.get(name)
                if stored is None:
                    stored = torch.full((self.prompt_ids.numel(),), math.nan, dtype=torch.float64)
                    self._prompt_signals[name] = stored
                stored.index_copy_(0, rows, v.double())
        if not request.is_probe:
            self._generating_requests += 1

    def finish(self) -> AllocationResult:
        """Assemble the step's :class:`AllocationResult` (after ``next()`` returned None)."""
        if self._pending is not None:
            raise InputError("plan.finish", "no pending request", "a request without observe()", "observe it first")
        if self._finished:
            raise InputError("plan.finish", "a single call", "a second call", "use the result of the first call")
        self._finished = True
        pos, rewards = self.rollouts()
        weight, reasons = self.select()
        n = pos.numel()
        kept = int(torch.count_nonzero(weight)) if n else 0
        dtype = self.result_dtype
        signals = {name: self._rollout_signal(name, n, dtype) for name in self._rollout_signals}
        if not self._generating_requests:  # nothing generated: a required rollout signal is there, empty
            for name in self.requires:
                if SIGNALS[name] == "rollout":
                    signals[name] = torch.full((n,), math.nan, dtype=dtype)
        signals.update({name: v.to(dtype) for name, v in self._prompt_signals.items()})
        f64 = torch.float64
        tb = self._token_budget
        used = n / max(self.budget, 1) if tb is None else self._tokens / max(tb.tokens, 1)
        metrics = {
            "rollouts": torch.tensor(float(n), dtype=f64),
            "budget_used_frac": torch.tensor(used, dtype=f64),
            "kept_frac": torch.tensor(kept / n if n else 0.0, dtype=f64),
        }
        if "tokens" in self._rollout_signals:
            metrics["tokens"] = torch.tensor(self._tokens, dtype=f64)
        if tb is not None:
            metrics["token_budget"] = torch.tensor(float(tb.tokens), dtype=f64)
        return AllocationResult(
            prompt_ids=self.prompt_ids.index_select(0, pos),
            group=pos,
            rewards=rewards.to(dtype),
            weight=weight.to(dtype),
            plan_prompt_ids=self.prompt_ids,
            counts=self._n.clone(),
            reasons=reasons,
            reason_names=self.reason_names,
            metrics=metrics,
            signals=signals,
        )

    def _rollout_signal(self, name: str, n: int, dtype: torch.dtype) -> Tensor:
        """A rollout signal over the result's rows: the generated rollouts' values, then NaN for rows an
        allocator appended that were not generated this step (AR3PO's reused responses)."""
        v = torch.cat([p.to(dtype) for p in self._rollout_signals[name]])
        if v.numel() < n:
            v = torch.cat([v, torch.full((n - v.numel(),), math.nan, dtype=dtype)])
        return v


class OneShotPlan(Conversation):
    """A plan that is a single request with counts and reasons decided up front; every rollout is kept.

    The shape of every pre-rollout allocator (Uniform, DPS, Prompt-GDRO, HIVE, DEPO, ...): subclass it to name
    the reasons (``reason_names``) and pass the per-prompt ``counts`` (int64 ``[P]``, 0 = not requested) and
    ``reasons`` (int64 ``[P]``).
    """

    def __init__(self, prompt_ids: IntP, budget: int, counts: IntP, reasons: IntP, **signals: Any) -> None:
        super().__init__(prompt_ids, budget, **signals)
        self._counts = counts
        self._reasons = reasons
        self._sent = False

    def decide(self) -> Request | None:
        """The one request (the prompts with a positive count), then None."""
        if self._sent:
            return None
        self._sent = True
        keep = self._counts > 0
        if not bool(keep.any()):
            return None
        return self.request(keep, self._counts[keep])

    def select(self) -> tuple[FloatB, IntP]:
        """Every rollout kept, the reasons decided up front."""
        return torch.ones(self.spent_observed, dtype=torch.float64), self._reasons


# -- group sizes shared by the allocators -------------------------------------------------------------------------
def _group_sizes(n: Any, n_min: Any, n_max: Any) -> tuple[int, int, int]:
    """Validate the group size ``n`` and the per-prompt caps ``n_min <= n <= n_max`` (None means ``n``)."""
    n = _check_int(n, "n", 1, "pass the rollouts per prompt, e.g. n=8")
    n_min = n if n_min is None else _check_int(n_min, "n_min", 1, "pass 1 <= n_min <= n")
    n_max = n if n_max is None else _check_int(n_max, "n_max", 1, "pass n_max >= n")
    if n_min > n:
        raise InputError("n_min", f"n_min <= n = {n}", repr(n_min), "lower n_min or raise n")
    if n_max < n:
        raise InputError("n_max", f"n_max >= n = {n}", repr(n_max), "raise n_max or lower n")
    return n, n_min, n_max


def _fill(length: int, budget: int, n: int, n_min: int, n_max: int) -> Tensor:
    """Rollouts for ``length`` ranked prompts (best first) out of ``budget``: int64 ``[length]``.

    The first ``budget // n`` prompts get a full group of ``n``. What is left, ``r < n`` when prompts remain,
    goes to the next prompt as a partial group if ``r >= n_min``; then anything still left is spread one by one
    over the full groups, best first, up to ``n_max`` each. With ``n_min = n_max = n`` (every default) this is
    the papers' fixed group size and at most ``n - 1`` rollouts stay unspent. Every non-zero count lies in
    ``[n_min, n_max]`` and the counts sum to at most ``budget``.
    """
    counts = torch.zeros(length, dtype=torch.long)
    full = min(length, budget // n)
    counts[:full] = n
    rest = budget - full * n
    if full < length and rest >= n_min:
        counts[full] = rest
        rest = 0
    if full > 0 and rest > 0 and n_max > n:
        extra = torch.full((full,), rest // full, dtype=torch.long)
        extra[: rest % full] += 1
        counts[:full] += extra.clamp(max=n_max - n)
    return counts
