r"""Partial-rollout scheduling: APRIL and CoPRIS (``docs/methods/partial_rollouts.md``).

A partial-rollout scheduler decides *when a rollout round ends* and *what happens to the unfinished
rollouts*. It never generates: the engine loop tells it what happened, through a small event API shared by
both schedulers::

    sched.begin_round(prompt_ids, policy_version=v)     # fresh prompts for this round; v = engine weights
    while not sched.done:
        reqs = sched.next_requests()                     # start these (buffered partials first, then fresh)
        ...                                              # engine: prompt + reqs.prefix[i], reqs.max_new_tokens[i]
        sched.finish(request_id, tokens, behav_logp, reward=r)   # new tokens of one finished request
    for q in sched.running_requests().request_ids:       # abort_all: abort them in the engine,
        sched.abort(int(q), tokens, behav_logp)          # then report what each generated
    result = sched.end_round()                           # finished groups as a padded batch + removed rollouts
    todo = sched.needs_recompute()                       # optional (CoPRIS): before the optimizer step,
    sched.record_recompute(todo.rollout_ids, logp, policy_version=v)  # the trainer's recompute of the partials

Units. A *rollout* is one sample of a prompt; a *group* holds the ``n`` samples of one prompt and is trained
only when all ``n`` are finished. Every start of a rollout is a *request* with its own ``request_id`` (a
resumed rollout gets a new one, so a late answer to an aborted request can never be mistaken for the resumed
one). A request resumes a rollout: the engine continues ``prompt + prefix`` and may generate at most
``max_new_tokens`` = (max response length − tokens already generated) tokens; a request with
``max_new_tokens = 0`` must not be sent to the engine — score the prefix and call ``finish`` with no
tokens: the rollout is then TRUNCATED (APRIL's rule).

Storage. Each rollout keeps its generated token ids, the engine's per-token behaviour log-probs, the policy
version of every token (so that any off-policy correction can be applied downstream) and a
segment-wise recompute buffer (CoPRIS, ``record_recompute``: only positions beyond the stored length are
appended, the prefix is never overwritten). The batch of ``end_round`` carries ``versions`` ``[B, T]`` and
``behav_logp`` ``[B, T]`` (the stored recompute on its prefix, the engine's log-probs beyond it), ready for
``policy_loss(..., proximal=CoPRISProximal(), behav_logp=batch.behav_logp, versions=batch.versions,
policy_version=v)`` (``docs/methods/offpolicy.md``).

Nothing is lost. A rollout, once created, is at every moment in exactly one place: held by the scheduler
(``held_ids``), returned finished in one batch, or reported removed in a ``Removed`` record
(zero-variance group filtered, unfinished group discarded without partial rollouts, or evicted by the bound
on buffered rollouts or on staleness), reasons in ``REMOVAL_REASONS``. Removal is always of whole groups.

Storage is per rollout (rollouts are ragged: one tensor of token ids, log-probs, versions per rollout, on the
CPU); there is no Python loop over tokens. Nothing is random, so there is no seed: the order of events
decides everything. ``state_dict()`` / ``load_state_dict()`` round-trip exactly, mid-round included.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from jaxtyping import Float, Int
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from rolloutopt._validation import check_int as _check_int
from rolloutopt._validation import check_state, describe, finite
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, BoolBT, FloatAny, FloatB, FloatBT, IntB, IntBT, IntP

__all__ = [
    "REMOVAL_REASONS",
    "STATUS_NAMES",
    "APRILBuffer",
    "CoPRISScheduler",
    "PartialBatch",
    "PartialScheduler",
    "Removed",
    "Requests",
    "RoundResult",
]

#: Status of a held rollout: never started, running, aborted with a partial response, finished (EOS),
#: finished at the length cap.
STATUS_NAMES: tuple[str, ...] = ("pending", "running", "partial", "completed", "truncated")
_PENDING, _RUNNING, _PARTIAL, _COMPLETED, _TRUNCATED = range(5)

#: Why a rollout was removed without being returned in a batch (index = ``Removed.reason``).
REMOVAL_REASONS: tuple[str, ...] = ("filtered", "discarded", "evicted_capacity", "evicted_stale")
_FILTERED, _DISCARDED, _EVICT_CAP, _EVICT_STALE = range(4)

_EVICTION = ("oldest", "newest")


# ---------------------------------------------------------------------------------------------- outputs


@dataclass(frozen=True, kw_only=True)
class Requests:
    """Requests to start now, from ``APRILBuffer.next_requests`` / ``CoPRISScheduler.next_requests``.

    All ``[K]`` int64 tensors, K requests (K = 0 is an empty, valid answer).

    Attributes:
        request_ids: id to pass back to ``finish``/``abort``; unique over the scheduler's life.
        rollout_ids: the rollout each request continues (stable across rounds).
        prompt_ids: the prompt of each rollout (the caller's ids).
        group: the scheduler's group key (unique per group, even when a prompt id repeats).
        sample: index of the rollout inside its group, ``0..n-1``.
        max_new_tokens: the most tokens the engine may generate: max response length − ``prefix`` length; 0
            means "do not generate: score the prefix and ``finish`` with no tokens" (TRUNCATED).
        prefix: the tokens already generated, one int64 tensor per request (empty for a fresh rollout); the
            engine continues ``prompt + prefix``. Read-only: these are the stored tensors, not copies.
    """

    request_ids: Int[Tensor, " K"]
    rollout_ids: Int[Tensor, " K"]
    prompt_ids: Int[Tensor, " K"]
    group: Int[Tensor, " K"]
    sample: Int[Tensor, " K"]
    max_new_tokens: Int[Tensor, " K"]
    prefix: tuple[Int[Tensor, " _"], ...]

    def __len__(self) -> int:
        return len(self.prefix)


@dataclass(frozen=True, kw_only=True)
class PartialBatch:
    """Rollouts as a right-padded batch: the finished groups of a round, or the partials awaiting a recompute.

    ``B`` rollouts, ``T`` = longest response. Groups are contiguous, samples in order inside a group.

    Attributes:
        rollout_ids, prompt_ids, group, sample: int64 ``[B]`` (``group`` is the scheduler's group key: use it as
            the ``group`` argument of an advantage estimator).
        lengths: int64 ``[B]`` tokens generated.
        rewards: float32 ``[B]`` (NaN for an unfinished rollout).
        truncated: bool ``[B]``, the rollout stopped at the length cap (TRUNCATED).
        tokens: int64 ``[B, T]`` token ids, 0-padded.
        mask: bool ``[B, T]``, True on generated tokens.
        versions: int64 ``[B, T]`` policy version that generated each token; -1 on padding.
        engine_logp: float32 ``[B, T]`` the engine's behaviour log-probs as reported; 0 on padding.
        stored_logp: float32 ``[B, T]`` the segment-wise recompute buffer (``record_recompute``), valid on
            the first ``stored_len`` positions, 0 elsewhere (CoPRIS pads with 0).
        stored_len: int64 ``[B]``.
        behav_logp: float32 ``[B, T]`` = ``stored_logp`` on the first ``stored_len`` positions and
            ``engine_logp`` beyond: per token, the log-prob of the policy version that generated it. With
            ``versions`` and the trainer's recompute as ``old_logp`` this is what
            :class:`~rolloutopt.ratios.CoPRISProximal` reads.
    """

    rollout_ids: IntB
    prompt_ids: IntB
    group: IntB
    sample: IntB
    lengths: IntB
    rewards: FloatB
    truncated: BoolB
    tokens: IntBT
    mask: BoolBT
    versions: IntBT
    engine_logp: FloatBT
    stored_logp: FloatBT
    stored_len: IntB
    behav_logp: FloatBT

    def __len__(self) -> int:
        return int(self.rollout_ids.numel())


@dataclass(frozen=True, kw_only=True)
class Removed:
    """Rollouts removed without being trained, all ``[R]`` int64; ``reason`` indexes ``REMOVAL_REASONS``."""

    rollout_ids: Int[Tensor, " R"]
    prompt_ids: Int[Tensor, " R"]
    group: Int[Tensor, " R"]
    reason: Int[Tensor, " R"]

    def __len__(self) -> int:
        return int(self.rollout_ids.numel())


@dataclass(frozen=True, kw_only=True)
class RoundResult:
    """What ``end_round`` returns.

    Attributes:
        batch: the finished groups to train on (``PartialBatch``).
        removed: every rollout removed since the previous ``end_round`` (filter, discard, eviction).
        unused_prompts: int64 fresh prompt ids given to ``begin_round`` and never started (APRIL; give them
            back to the data source). Empty for CoPRIS, which queues every prompt it is given.
        metrics: detached 0-d tensors — ``batch_groups``, ``batch_rollouts``, ``batch_tokens``,
            ``off_policy_tokens`` (batch tokens generated under an older version than the round's),
            ``off_policy_fraction``, ``resumed_rollouts``, ``truncated_rollouts``, ``staleness_max``,
            ``aborted_requests``, ``held_rollouts``, ``held_groups``, ``total_off_policy_tokens``
            (cumulative, APRIL's counter) and ``removed_<reason>`` per reason.
    """

    batch: PartialBatch
    removed: Removed
    unused_prompts: IntP
    metrics: dict[str, Tensor] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- storage


@dataclass(slots=True)
class _Rollout:
    prompt: int
    group: int
    sample: int
    status: int
    tokens: Tensor  # int64 [L]
    logp: Tensor  # float32 [L], the engine's
    versions: Tensor  # int64 [L]
    stored: Tensor  # float32 [S], S <= L: segment-wise recompute buffer
    reward: float
    oldest: int  # smallest version among the tokens (sys.maxsize-like sentinel when none)


_NO_VERSION = 2**62
_ROLLOUT_FIELDS = ("prompt", "group", "sample", "status", "tokens", "logp", "versions", "stored", "reward", "oldest")


def _empty_batch() -> PartialBatch:
    i = torch.zeros(0, dtype=torch.long)
    it = torch.zeros(0, 0, dtype=torch.long)
    f = torch.zeros(0, 0)
    return PartialBatch(
        rollout_ids=i,
        prompt_ids=i,
        group=i,
        sample=i,
        lengths=i,
        rewards=torch.zeros(0),
        truncated=torch.zeros(0, dtype=torch.bool),
        tokens=it,
        mask=torch.zeros(0, 0, dtype=torch.bool),
        versions=it,
        engine_logp=f,
        stored_logp=f,
        stored_len=i,
        behav_logp=f,
    )


def _pad(parts: list[Tensor], width: int, value: float) -> Tensor:
    out = pad_sequence(parts, batch_first=True, padding_value=value)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]), value=value)
    return out


class PartialScheduler:
    """The event API shared by :class:`APRILBuffer` and :class:`CoPRISScheduler`; not used on its own.

    It holds the storage, the request bookkeeping, batch assembly, eviction and checkpointing. A subclass
    decides which requests start (:meth:`next_requests`), when the round is :attr:`done`, and what
    :meth:`end_round` returns and keeps. Keyword arguments as documented on the subclasses.
    """

    _extra_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        n_samples_per_prompt: int,
        max_new_tokens: int,
        filter_groups: bool,
        max_buffered: int | None,
        max_staleness: int | None,
        eviction: str,
    ) -> None:
        _check_int(n_samples_per_prompt, "n_samples_per_prompt", 1)
        _check_int(max_new_tokens, "max_new_tokens", 1)
        if not isinstance(filter_groups, bool):
            raise InputError("filter_groups", "a bool", describe(filter_groups), "pass True or False")
        _check_int(max_buffered, "max_buffered", 0, none=True)
        _check_int(max_staleness, "max_staleness", 0, none=True)
        if eviction not in _EVICTION:
            raise InputError("eviction", f"one of {_EVICTION}", describe(eviction), "pass eviction='oldest'")
        self.n_samples_per_prompt = n_samples_per_prompt
        self.max_new_tokens = max_new_tokens
        self.filter_groups = filter_groups
        self.max_buffered = max_buffered
        self.max_staleness = max_staleness
        self.eviction = eviction
        self._rollouts: dict[int, _Rollout] = {}
        self._groups: dict[int, list[int]] = {}  # group key -> rollout ids (sample order)
        self._running: dict[int, int] = {}  # request id -> rollout id (start order)
        self._aborted: list[int] = []  # rollout ids aborted this round, in report order
        self._removed: list[tuple[int, int, int, int]] = []  # (rollout, prompt, group, reason) since end_round
        self._next_rollout = 0
        self._next_group = 0
        self._next_request = 0
        self._version: int | None = None
        self._open = False
        self._total_off_policy = 0

    # -- to implement -----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Whether the round's target is reached (the stop event): abort what runs and call ``end_round``."""
        raise NotImplementedError

    def _check_begin(self, prompts: list[int]) -> None:
        pass

    def _begin(self, prompts: list[int]) -> None:
        raise NotImplementedError

    def _select(self, limit: int | None) -> list[int]:
        raise NotImplementedError

    def _accept(self, group: int) -> None:
        raise NotImplementedError

    def _reject(self, group: int) -> None:
        raise NotImplementedError

    def _close(self) -> tuple[list[int], list[int]]:
        """Batch group keys and unused fresh prompts; requeue or discard everything else."""
        raise NotImplementedError

    def _purge(self) -> None:
        """Drop removed rollouts/groups from the subclass's queues."""
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        return {
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "max_new_tokens": self.max_new_tokens,
            "filter_groups": self.filter_groups,
            "max_buffered": self.max_buffered,
            "max_staleness": self.max_staleness,
            "eviction": self.eviction,
        }

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra(self, state: dict[str, Any]) -> None:
        pass

    # -- public read-only views -------------------------------------------------------------------------
    @property
    def policy_version(self) -> int | None:
        """The version given to the latest ``begin_round`` (None before the first round)."""
        return self._version

    @property
    def round_open(self) -> bool:
        """Whether a round is open (between ``begin_round`` and ``end_round``)."""
        return self._open

    @property
    def in_flight(self) -> int:
        """Number of requests started and not yet finished or aborted."""
        return len(self._running)

    def running_requests(self) -> Requests:
        """The requests started and not yet reported, in start order (what ``abort_all`` must abort).

        ``prefix`` and ``max_new_tokens`` are as they were when each request started.
        """
        return self._requests(list(self._running), list(self._running.values()))

    def held_ids(self) -> Int[Tensor, " N"]:
        """Rollout ids the scheduler holds now (pending, running, partial, or finished awaiting their group)."""
        return torch.tensor(sorted(self._rollouts), dtype=torch.long)

    # -- helpers ----------------------------------------------------------------------------------------
    def _require_open(self, what: str) -> None:
        if not self._open:
            raise InputError(what, "an open round", "no open round", "call begin_round(...) first")

    def _new_group(self, prompt: int) -> int:
        g = self._next_group
        self._next_group += 1
        rids = list(range(self._next_rollout, self._next_rollout + self.n_samples_per_prompt))
        self._next_rollout += self.n_samples_per_prompt
        self._groups[g] = rids
        for s, r in enumerate(rids):
            self._rollouts[r] = _Rollout(
                prompt=prompt,
                group=g,
                sample=s,
                status=_PENDING,
                tokens=torch.zeros(0, dtype=torch.long),
                logp=torch.zeros(0),
                versions=torch.zeros(0, dtype=torch.long),
                stored=torch.zeros(0),
                reward=math.nan,
                oldest=_NO_VERSION,
            )
        return g

    def _remove_group(self, group: int, reason: int) -> None:
        for r in self._groups.pop(group):
            rec = self._rollouts.pop(r)
            self._removed.append((r, rec.prompt, group, reason))

    def _unfinished(self, group: int) -> list[int]:
        return [r for r in self._groups[group] if self._rollouts[r].status in (_PENDING, _PARTIAL)]

    def _complete(self, group: int) -> None:
        """All samples of ``group`` are finished: filter (zero reward variance) or accept."""
        if self.filter_groups:
            rewards = [self._rollouts[r].reward for r in self._groups[group]]
            if len(rewards) > 1 and max(rewards) == min(rewards):
                self._remove_group(group, _FILTERED)
                self._reject(group)
                return
        self._accept(group)

    def _segment(
        self, request_id: Any, tokens: Any, behav_logp: Any, policy_version: Any
    ) -> tuple[int, Tensor, Tensor, Tensor]:
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            raise InputError("request_id", "an int (from Requests.request_ids)", describe(request_id), "pass int(id)")
        self._require_open("request_id")
        rid = self._running.get(request_id)
        if rid is None:
            raise InputError(
                "request_id",
                "the id of a running request",
                f"{request_id}, which is unknown, already finished or aborted, or from an earlier round",
                "report each request started by next_requests exactly once, with finish or abort",
            )
        if not isinstance(tokens, Tensor) or tokens.ndim != 1 or tokens.is_floating_point() or tokens.is_complex():
            raise InputError("tokens", "a 1-d integer tensor [L] of new token ids", describe(tokens), "pass ids[L]")
        if tokens.dtype == torch.bool:
            raise InputError("tokens", "a 1-d integer tensor [L] of new token ids", describe(tokens), "cast to long")
        n = tokens.numel()
        if not isinstance(behav_logp, Tensor) or not behav_logp.is_floating_point() or behav_logp.shape != (n,):
            raise InputError(
                "behav_logp",
                f"a 1-d float tensor [L={n}] (one log-prob per new token)",
                describe(behav_logp),
                "pass the engine's log-prob of every new token",
            )
        finite(behav_logp, "behav_logp")
        rec = self._rollouts[rid]
        room = self.max_new_tokens - rec.tokens.numel()
        if n > room:
            raise InputError(
                "tokens",
                f"at most max_new_tokens={room} new tokens for this request",
                f"{n} tokens",
                "respect the request's max_new_tokens",
            )
        if policy_version is None:
            assert self._version is not None
            versions = torch.full((n,), self._version, dtype=torch.long)
        elif isinstance(policy_version, int) and not isinstance(policy_version, bool):
            versions = torch.full((n,), policy_version, dtype=torch.long)
        elif (
            isinstance(policy_version, Tensor)
            and policy_version.shape == (n,)
            and not policy_version.is_floating_point()
            and policy_version.dtype != torch.bool
        ):
            versions = policy_version.detach().to("cpu", torch.long)
        else:
            raise InputError(
                "policy_version",
                f"None, an int, or an int tensor [L={n}]",
                describe(policy_version),
                "pass the version of the weights that generated the tokens",
            )
        return rid, tokens.detach().to("cpu", torch.long), behav_logp.detach().to("cpu", torch.float32), versions

    def _append(self, rid: int, tokens: Tensor, logp: Tensor, versions: Tensor) -> _Rollout:
        rec = self._rollouts[rid]
        if tokens.numel():
            rec.tokens = torch.cat([rec.tokens, tokens])
            rec.logp = torch.cat([rec.logp, logp])
            rec.versions = torch.cat([rec.versions, versions])
            rec.oldest = min(rec.oldest, int(versions.min()))
        return rec

    # -- the event API ----------------------------------------------------------------------------------
    def begin_round(self, prompt_ids: IntP, *, policy_version: int) -> None:
        """Open a round: fresh prompt ids ``[P]`` for it, and the version of the engine's weights.

        Held rollouts whose oldest token is more than ``max_staleness`` versions behind ``policy_version``
        are evicted now (whole groups; reported by this round's ``end_round``).

        Args:
            prompt_ids: int64 ``[P]`` fresh prompt ids (may be empty; repeats are allowed, each is a group).
            policy_version: int, not below the previous round's.
        """
        if self._open:
            raise InputError("begin_round", "a closed round", "a round still open", "call end_round() first")
        if not isinstance(prompt_ids, Tensor) or prompt_ids.ndim != 1 or prompt_ids.is_floating_point():
            raise InputError("prompt_ids", "a 1-d int64 tensor [P]", describe(prompt_ids), "pass torch.tensor(ids)")
        if prompt_ids.dtype == torch.bool or prompt_ids.is_complex():
            raise InputError("prompt_ids", "a 1-d int64 tensor [P]", describe(prompt_ids), "cast with .long()")
        low = 0 if self._version is None else self._version
        if not isinstance(policy_version, int) or isinstance(policy_version, bool) or policy_version < low:
            raise InputError(
                "policy_version",
                f"an int >= {low} (versions never decrease)",
                describe(policy_version),
                "pass the version of the engine's current weights",
            )
        prompts = [int(p) for p in prompt_ids.tolist()]
        self._check_begin(prompts)
        self._version = policy_version
        if self.max_staleness is not None:
            stale = [
                g
                for g, rids in self._groups.items()
                if policy_version - min(self._rollouts[r].oldest for r in rids) > self.max_staleness
            ]
            for g in stale:
                self._remove_group(g, _EVICT_STALE)
            if stale:
                self._purge()
        self._aborted = []
        self._open = True
        self._begin(prompts)

    def next_requests(self, limit: int | None = None) -> Requests:
        """The requests to start now (possibly none); at most ``limit`` of them when given.

        Resumed rollouts come first, then fresh ones (see the subclass for the exact policy). Every returned
        request must later be reported once, with :meth:`finish` or :meth:`abort` (or left running until
        :meth:`end_round`, which treats it as aborted with no new tokens). After the stop event (:attr:`done`)
        the answer is empty. When it is empty while nothing is in flight and the round is not done, the
        prompts ran out: call :meth:`end_round` (the batch then holds fewer groups than the target).
        """
        self._require_open("next_requests")
        _check_int(limit, "limit", 0, none=True)
        rids = self._select(limit)
        reqs = list(range(self._next_request, self._next_request + len(rids)))
        self._next_request += len(rids)
        out = self._requests(reqs, rids)
        for q, r in zip(reqs, rids, strict=True):
            self._running[q] = r
            self._rollouts[r].status = _RUNNING
        return out

    def _requests(self, reqs: list[int], rids: list[int]) -> Requests:
        recs = [self._rollouts[r] for r in rids]

        def col(values: Iterable[int]) -> Tensor:
            return torch.tensor(list(values), dtype=torch.long)

        return Requests(
            request_ids=col(reqs),
            rollout_ids=col(rids),
            prompt_ids=col(rec.prompt for rec in recs),
            group=col(rec.group for rec in recs),
            sample=col(rec.sample for rec in recs),
            max_new_tokens=col(self.max_new_tokens - rec.tokens.numel() for rec in recs),
            prefix=tuple(rec.tokens for rec in recs),
        )

    def finish(
        self,
        request_id: int,
        tokens: Int[Tensor, " T"],
        behav_logp: Float[Tensor, " T"],
        *,
        reward: float | FloatAny,
        policy_version: int | Int[Tensor, " T"] | None = None,
    ) -> None:
        """A request finished: its new tokens ``[L]``, their behaviour log-probs ``[L]`` and the reward.

        The rollout is TRUNCATED when its total length reaches the max response length, else COMPLETED. When
        the last sample of its group finishes, the group is filtered (``filter_groups``: all rewards equal ->
        removed, reason ``filtered``) or accepted.

        Args:
            request_id: from :attr:`Requests.request_ids`; must be running.
            tokens: int ``[L]`` the tokens this request generated (not the prefix); L may be 0.
            behav_logp: float ``[L]`` the engine's log-prob of each of them.
            reward: finite float, the reward of the whole rollout (prefix + new tokens).
            policy_version: None (the round's version), an int, or an int ``[L]`` tensor (weights updated
                in flight).
        """
        rid, tok, lp, ver = self._segment(request_id, tokens, behav_logp, policy_version)
        if isinstance(reward, Tensor) and reward.numel() == 1 and reward.is_floating_point():
            reward = float(reward)
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
            raise InputError("reward", "a finite float", describe(reward), "pass the rollout's scalar reward")
        del self._running[request_id]
        rec = self._append(rid, tok, lp, ver)
        rec.reward = float(reward)
        rec.status = _TRUNCATED if rec.tokens.numel() >= self.max_new_tokens else _COMPLETED
        if all(self._rollouts[r].status >= _COMPLETED for r in self._groups[rec.group]):
            self._complete(rec.group)

    def abort(
        self,
        request_id: int,
        tokens: Int[Tensor, " T"],
        behav_logp: Float[Tensor, " T"],
        *,
        policy_version: int | Int[Tensor, " T"] | None = None,
    ) -> None:
        """A running request was aborted: keep what it generated (``tokens`` ``[L]``, ``behav_logp`` ``[L]``).

        Args as in :meth:`finish`, without ``reward``. The rollout becomes PARTIAL and is resumed later (or
        discarded at ``end_round`` by an APRIL buffer without ``partial_rollout``).
        """
        rid, tok, lp, ver = self._segment(request_id, tokens, behav_logp, policy_version)
        del self._running[request_id]
        rec = self._append(rid, tok, lp, ver)
        rec.status = _PARTIAL
        self._aborted.append(rid)

    def end_round(self) -> RoundResult:
        """Close the round: return the finished groups as a batch and report every removed rollout.

        Requests still running are treated as aborted with no new tokens. Unfinished groups are kept for the
        next round (or discarded, per the subclass); then, if more than ``max_buffered`` rollouts are held,
        whole groups are evicted (``eviction='oldest'``: lowest group key, i.e. created first; ``'newest'``:
        the reverse) until at most ``max_buffered`` remain.
        """
        self._require_open("end_round")
        for r in self._running.values():
            self._rollouts[r].status = _PARTIAL
            self._aborted.append(r)
        self._running.clear()
        batch_groups, unused = self._close()
        batch_rids = [r for g in batch_groups for r in self._groups[g]]
        batch = self._assemble(batch_rids)
        for g in batch_groups:
            for r in self._groups.pop(g):
                del self._rollouts[r]
        if self.max_buffered is not None and len(self._rollouts) > self.max_buffered:
            order = sorted(self._groups, reverse=self.eviction == "newest")
            held = len(self._rollouts)
            for g in order:
                if held <= self.max_buffered:
                    break
                held -= len(self._groups[g])
                self._remove_group(g, _EVICT_CAP)
        self._purge()
        removed = self._removed
        self._removed = []
        self._open = False
        assert self._version is not None
        stale = batch.mask & (batch.versions < self._version)
        off = int(stale.sum())
        self._total_off_policy += off
        n_tok = int(batch.mask.sum())
        reason = torch.tensor([x[3] for x in removed], dtype=torch.long)
        metrics = {
            "batch_groups": torch.tensor(float(len(batch_groups))),
            "batch_rollouts": torch.tensor(float(len(batch_rids))),
            "batch_tokens": torch.tensor(float(n_tok)),
            "off_policy_tokens": torch.tensor(float(off)),
            "off_policy_fraction": torch.tensor(off / n_tok if n_tok else 0.0),
            "resumed_rollouts": stale.any(1).sum().float(),
            "truncated_rollouts": batch.truncated.sum().float(),
            "staleness_max": torch.tensor(
                float(self._version - int(batch.versions[batch.mask].min())) if n_tok else 0.0
            ),
            "aborted_requests": torch.tensor(float(len(self._aborted))),
            "held_rollouts": torch.tensor(float(len(self._rollouts))),
            "held_groups": torch.tensor(float(len(self._groups))),
            "total_off_policy_tokens": torch.tensor(float(self._total_off_policy)),
        }
        for i, name in enumerate(REMOVAL_REASONS):
            metrics[f"removed_{name}"] = (reason == i).sum().float()
        self._aborted = []

        def col(k: int) -> Tensor:
            return torch.tensor([x[k] for x in removed], dtype=torch.long)

        return RoundResult(
            batch=batch,
            removed=Removed(rollout_ids=col(0), prompt_ids=col(1), group=col(2), reason=reason),
            unused_prompts=torch.tensor(unused, dtype=torch.long),
            metrics=metrics,
        )

    # -- the CoPRIS recompute buffer ---------------------------------------------------------------------
    def needs_recompute(self) -> PartialBatch:
        """Held, not running rollouts with tokens beyond their recompute buffer, as a batch (rollout id order).

        CoPRIS recomputes old log-probs of these under the current policy after each round (before the
        optimizer step, so that they come from the version that generated the new segment) and hands them to
        :meth:`record_recompute`.
        """
        rids = [
            r
            for r, rec in sorted(self._rollouts.items())
            if rec.status != _RUNNING and rec.tokens.numel() > rec.stored.numel()
        ]
        return self._assemble(rids)

    def record_recompute(self, rollout_ids: IntB, logp: FloatBT, *, policy_version: int) -> dict[str, Tensor]:
        r"""Append a recompute of old log-probs to each rollout's segment-wise buffer (CoPRIS).

        .. math::  \text{stored}_i \leftarrow \operatorname{concat}(\text{stored}_i[0{:}S_i],\
                   \text{logp}_i[S_i{:}L_i])

        with :math:`S_i` the stored length and :math:`L_i` the tokens generated: the prefix is never
        overwritten, so each token keeps the log-prob of the first recompute after it was generated. Reference:
        CoPRIS arXiv 2511.05589, ``777pomingzi/CoPRIS@43ee8c7`` ``ray_trainer.py`` (``uid2old_log_prob``).

        Args:
            rollout_ids: int64 ``[R]`` distinct held rollouts, none running.
            logp: float ``[R, T]`` recompute, ``T >= L_i`` (positions beyond ``L_i`` are ignored).
            policy_version: int, the version the recompute used; tokens generated under another version are
                counted in the returned ``version_mismatch_tokens`` (their stored value is not that of the
                generating policy).

        Returns:
            metrics: ``appended_tokens`` and ``version_mismatch_tokens`` (0-d tensors). Edge cases: R = 0 is a
            no-op; a rollout already fully stored appends nothing.
        """
        if not isinstance(rollout_ids, Tensor) or rollout_ids.ndim != 1 or rollout_ids.is_floating_point():
            raise InputError("rollout_ids", "a 1-d int64 tensor [R]", describe(rollout_ids), "pass batch.rollout_ids")
        ids = [int(r) for r in rollout_ids.tolist()]
        if len(set(ids)) != len(ids):
            raise InputError("rollout_ids", "distinct rollout ids", describe(rollout_ids), "deduplicate")
        bad = [r for r in ids if r not in self._rollouts or self._rollouts[r].status == _RUNNING]
        if bad:
            raise InputError(
                "rollout_ids",
                "held rollouts that are not running",
                f"{bad[:5]} (unknown, returned, or running)",
                "pass the ids of needs_recompute()",
            )
        if not isinstance(logp, Tensor) or not logp.is_floating_point() or logp.ndim != 2 or logp.shape[0] != len(ids):
            raise InputError("logp", f"a float tensor [R={len(ids)}, T]", describe(logp), "pass one row per rollout")
        if not isinstance(policy_version, int) or isinstance(policy_version, bool):
            raise InputError("policy_version", "an int", describe(policy_version), "pass the recompute's version")
        recs = [self._rollouts[r] for r in ids]
        need = max((rec.tokens.numel() for rec in recs), default=0)
        if logp.shape[1] < need:
            raise InputError("logp", f"at least T={need} columns (the longest response)", describe(logp), "pad")
        lp = logp.detach().to("cpu", torch.float32)
        appended = mismatch = 0
        for i, rec in enumerate(recs):
            s, n = rec.stored.numel(), rec.tokens.numel()
            if n > s:
                seg = lp[i, s:n]
                finite(seg, "logp")
                rec.stored = torch.cat([rec.stored, seg.clone()])
                appended += n - s
                mismatch += int((rec.versions[s:n] != policy_version).sum())
        return {
            "appended_tokens": torch.tensor(float(appended)),
            "version_mismatch_tokens": torch.tensor(float(mismatch)),
        }

    def _assemble(self, rids: list[int]) -> PartialBatch:
        if not rids:
            return _empty_batch()
        recs = [self._rollouts[r] for r in rids]
        lengths = torch.tensor([rec.tokens.numel() for rec in recs], dtype=torch.long)
        width = int(lengths.max())
        tokens = _pad([rec.tokens for rec in recs], width, 0)
        mask = torch.arange(width)[None, :] < lengths[:, None]
        stored = _pad([rec.stored for rec in recs], width, 0.0)
        stored_len = torch.tensor([rec.stored.numel() for rec in recs], dtype=torch.long)
        engine = _pad([rec.logp for rec in recs], width, 0.0)
        prefix = torch.arange(width)[None, :] < stored_len[:, None]

        def col(values: Iterable[int]) -> Tensor:
            return torch.tensor(list(values), dtype=torch.long)

        return PartialBatch(
            rollout_ids=col(rids),
            prompt_ids=col(rec.prompt for rec in recs),
            group=col(rec.group for rec in recs),
            sample=col(rec.sample for rec in recs),
            lengths=lengths,
            rewards=torch.tensor([rec.reward for rec in recs], dtype=torch.float32),
            truncated=torch.tensor([rec.status == _TRUNCATED for rec in recs], dtype=torch.bool),
            tokens=tokens,
            mask=mask,
            versions=_pad([rec.versions for rec in recs], width, -1),
            engine_logp=engine,
            stored_logp=stored,
            stored_len=stored_len,
            behav_logp=torch.where(prefix, stored, engine),
        )

    # -- checkpointing -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: tensors and plain Python containers (``torch.save``-able)."""
        rollouts = {
            r: {
                k: (v.clone() if isinstance(v, Tensor) else v)
                for k, v in ((k, getattr(rec, k)) for k in _ROLLOUT_FIELDS)
            }
            for r, rec in self._rollouts.items()
        }
        return {
            "kind": type(self).__name__,
            "config": self._config(),
            "rollouts": rollouts,
            "groups": {g: list(rids) for g, rids in self._groups.items()},
            "running": [[q, r] for q, r in self._running.items()],
            "aborted": list(self._aborted),
            "removed": [list(x) for x in self._removed],
            "counters": [self._next_rollout, self._next_group, self._next_request, self._total_off_policy],
            "version": self._version,
            "open": self._open,
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of a scheduler of the same class and configuration."""
        keys = {
            "kind",
            "config",
            "rollouts",
            "groups",
            "running",
            "aborted",
            "removed",
            "counters",
            "version",
            "open",
            "extra",
        }
        check_state(state, keys, type(self).__name__)
        if state["kind"] != type(self).__name__ or state["config"] != self._config():
            raise InputError(
                "state",
                f"the state of a {type(self).__name__} with config {self._config()}",
                f"{state['kind']} with config {state['config']}",
                "construct the scheduler with the same arguments",
            )
        if not isinstance(state["extra"], dict) or set(state["extra"]) != set(self._extra_keys):
            raise InputError(
                "state['extra']", f"keys {self._extra_keys}", describe(state["extra"]), "pass state_dict()"
            )
        try:
            self._rollouts = {
                int(r): _Rollout(**{k: (d[k].clone() if isinstance(d[k], Tensor) else d[k]) for k in _ROLLOUT_FIELDS})
                for r, d in state["rollouts"].items()
            }
        except (KeyError, TypeError, AttributeError) as e:
            raise InputError(
                "state['rollouts']", "rollout records of state_dict()", repr(e), "pass state_dict()"
            ) from e
        self._groups = {int(g): [int(r) for r in rids] for g, rids in state["groups"].items()}
        self._running = {int(q): int(r) for q, r in state["running"]}
        self._aborted = [int(r) for r in state["aborted"]]
        self._removed = [(int(a), int(b), int(c), int(d)) for a, b, c, d in state["removed"]]
        self._next_rollout, self._next_group, self._next_request, self._total_off_policy = (
            int(x) for x in state["counters"]
        )
        self._version = None if state["version"] is None else int(state["version"])
        self._open = bool(state["open"])
        self._load_extra(state["extra"])


# ------------------------------------------------------------------------------------------------- APRIL


class APRILBuffer(PartialScheduler):
    r"""APRIL's active partial rollouts: over-provision groups, stop at the target, abort, recycle the rest.

    A round (from ``RLsys-Foundation/APRIL`` on slime: ``slime/rollout/sglang_example.py``
    ``generate_rollout_async``/``abort``, ``buffer.py`` ``pop_first``):

    - while (in-flight + accepted groups) :math:`<` ``rollout_batch_size``, submit ``over_sampling_batch_size``
      groups, taken from the buffer first (FIFO, ``pop_first``), then from the round's fresh prompts;
    - a group is accepted when all its ``n`` samples are finished; with ``filter_groups`` a group whose rewards
      are all equal (zero variance) is removed (``filtered``) and the in-flight count drops by one, so another
      submission may follow;
    - at ``rollout_batch_size`` accepted groups the stop event fires (``done``): abort the rest and call
      ``end_round``; the batch is exactly those groups, sorted by creation order (slime sorts by the sample
      ``index`` it assigns when a group is created; for fresh prompts that is the order of ``prompt_ids``);
    - with ``partial_rollout`` every other submitted group (partial text, finished samples and all) goes to
      the back of the buffer, in the order its first sample was aborted; resumed groups regenerate only their
      unfinished samples, with ``max_new_tokens`` reduced by the tokens already generated (0 -> TRUNCATED).
      Without it, those groups are removed (``discarded``).

    .. math::  \text{off-policy fraction} = \frac{\#\{(i,t) \in \text{batch} : v_{i,t} < v\}}{\#\text{batch tokens}}

    There is no paper id: the reference is the code (and its README). APRIL applies no importance correction;
    the batch still carries ``versions`` and ``behav_logp`` so that one
    can be applied downstream.

    Defaults (the APRIL launch script ``run-qwen3-4B-dapo-partial.sh``): ``rollout_batch_size=32``,
    ``over_sampling_batch_size=64``, ``n_samples_per_prompt=8``, ``max_new_tokens=16384`` (max response
    length); ``partial_rollout=True`` (the flag under study). Library choices, not in the reference code:
    ``filter_groups=False`` (slime's dynamic-sampling filter is optional), ``max_buffered`` / ``max_staleness``
    bounds with ``eviction`` (None: unbounded, as in the reference), groups that finish after the target is
    reached are buffered instead of dropped (slime drops them silently), and ``end_round`` before the stop
    event returns the accepted groups so far (fewer than the target; see ``metrics['batch_groups']``).

    Args:
        rollout_batch_size: groups per batch (the target), >= 1.
        over_sampling_batch_size: groups per submission, >= 1.
        n_samples_per_prompt: samples per group, >= 1.
        max_new_tokens: max response length, >= 1.
        partial_rollout: keep unfinished groups for the next round (True) or discard them.
        filter_groups: drop zero-variance groups (singleton groups are never dropped).
        max_buffered: most rollouts held after ``end_round`` (None: no bound); whole groups are evicted.
        max_staleness: evict held groups whose oldest token is more than this many versions behind the new
            round's ``policy_version`` (None: never).
        eviction: ``'oldest'`` or ``'newest'`` groups first.

    Edge cases: an empty round (no prompts, empty buffer) returns an empty batch; ``n_samples_per_prompt=1``
    makes every group a singleton (never filtered).
    """

    _extra_keys = ("buffer", "fresh", "remaining", "submitted", "accepted", "extra", "to_start")

    def __init__(
        self,
        *,
        rollout_batch_size: int = 32,
        over_sampling_batch_size: int = 64,
        n_samples_per_prompt: int = 8,
        max_new_tokens: int = 16384,
        partial_rollout: bool = True,
        filter_groups: bool = False,
        max_buffered: int | None = None,
        max_staleness: int | None = None,
        eviction: str = "oldest",
    ) -> None:
        _check_int(rollout_batch_size, "rollout_batch_size", 1)
        _check_int(over_sampling_batch_size, "over_sampling_batch_size", 1)
        if not isinstance(partial_rollout, bool):
            raise InputError("partial_rollout", "a bool", describe(partial_rollout), "pass True or False")
        super().__init__(
            n_samples_per_prompt=n_samples_per_prompt,
            max_new_tokens=max_new_tokens,
            filter_groups=filter_groups,
            max_buffered=max_buffered,
            max_staleness=max_staleness,
            eviction=eviction,
        )
        self.rollout_batch_size = rollout_batch_size
        self.over_sampling_batch_size = over_sampling_batch_size
        self.partial_rollout = partial_rollout
        self._buffer: deque[int] = deque()  # group keys, FIFO
        self._fresh: deque[int] = deque()  # this round's fresh prompt ids
        self._remaining = 0  # in-flight + accepted groups this round (slime's remaining_batch_size)
        self._submitted: list[int] = []
        self._accepted: list[int] = []
        self._extra: list[int] = []  # accepted after the target was reached
        self._to_start: deque[int] = deque()  # rollout ids of submitted groups not started yet

    @property
    def done(self) -> bool:
        """``rollout_batch_size`` groups accepted this round."""
        return len(self._accepted) >= self.rollout_batch_size

    def buffered_groups(self) -> Int[Tensor, " G"]:
        """Group keys in the buffer, FIFO order (the next submission pops from the front)."""
        return torch.tensor(list(self._buffer), dtype=torch.long)

    def _config(self) -> dict[str, Any]:
        return {
            **super()._config(),
            "rollout_batch_size": self.rollout_batch_size,
            "over_sampling_batch_size": self.over_sampling_batch_size,
            "partial_rollout": self.partial_rollout,
        }

    def _begin(self, prompts: list[int]) -> None:
        self._fresh = deque(prompts)
        self._remaining = 0
        self._submitted, self._accepted, self._extra = [], [], []
        self._to_start = deque()

    def _select(self, limit: int | None) -> list[int]:
        while not self.done and self._remaining < self.rollout_batch_size and (self._buffer or self._fresh):
            for _ in range(self.over_sampling_batch_size):
                if self._buffer:
                    g = self._buffer.popleft()
                elif self._fresh:
                    g = self._new_group(self._fresh.popleft())
                else:
                    break
                self._submitted.append(g)
                self._remaining += 1
                todo = self._unfinished(g)
                if todo:
                    self._to_start.extend(todo)
                else:  # a recycled group that had finished: accepted (or filtered) on submission
                    self._complete(g)
        out: list[int] = []
        if self.done:
            return out
        while self._to_start and (limit is None or len(out) < limit):
            r = self._to_start.popleft()
            if r in self._rollouts:
                out.append(r)
        return out

    def _accept(self, group: int) -> None:
        (self._accepted if not self.done else self._extra).append(group)

    def _reject(self, group: int) -> None:
        self._remaining -= 1

    def _close(self) -> tuple[list[int], list[int]]:
        batch = sorted(self._accepted)  # creation order: slime sorts by the sample index it assigns on creation
        taken = set(self._accepted)
        first: dict[int, int] = {}
        for i, r in enumerate(self._aborted):
            if r in self._rollouts:
                first.setdefault(self._rollouts[r].group, i)
        rest = [g for g in self._submitted if g not in taken and g in self._groups]
        rest.sort(key=lambda g: first.get(g, len(self._aborted)))  # stable: then submission order
        if self.partial_rollout:
            self._buffer.extend(rest)
        else:
            for g in rest:
                self._remove_group(g, _DISCARDED)
        unused = list(self._fresh)
        self._fresh = deque()
        self._remaining = 0
        self._submitted, self._accepted, self._extra = [], [], []
        self._to_start = deque()
        return batch, unused

    def _purge(self) -> None:
        self._buffer = deque(g for g in self._buffer if g in self._groups)
        self._to_start = deque(r for r in self._to_start if r in self._rollouts)
        self._submitted = [g for g in self._submitted if g in self._groups]

    def _extra_state(self) -> dict[str, Any]:
        return {
            "buffer": list(self._buffer),
            "fresh": list(self._fresh),
            "remaining": self._remaining,
            "submitted": list(self._submitted),
            "accepted": list(self._accepted),
            "extra": list(self._extra),
            "to_start": list(self._to_start),
        }

    def _load_extra(self, state: dict[str, Any]) -> None:
        self._buffer = deque(int(g) for g in state["buffer"])
        self._fresh = deque(int(p) for p in state["fresh"])
        self._remaining = int(state["remaining"])
        self._submitted = [int(g) for g in state["submitted"]]
        self._accepted = [int(g) for g in state["accepted"]]
        self._extra = [int(g) for g in state["extra"]]
        self._to_start = deque(int(r) for r in state["to_start"])


# ------------------------------------------------------------------------------------------------ CoPRIS


class CoPRISScheduler(PartialScheduler):
    r"""CoPRIS's concurrency-controlled partial rollout: a fixed pool of requests, stop at the target, requeue.

    A round (``777pomingzi/CoPRIS@43ee8c7``
    ``verl/experimental/agent_loop/agent_loop.py``, ``verl/trainer/ppo/ray_trainer.py``, arXiv 2511.05589):

    - ``begin_round`` appends the gen batch (``gen_batch_size`` prompts × ``n`` samples) to the request queue;
    - ``next_requests`` returns as many requests from the queue front as keep ``pool_size`` in flight, so
      each finished request is replaced by the next one (constant concurrency);
    - when all ``n`` samples of a uid (group) are finished it is *kept*, unless ``filter_groups`` is on and its
      rewards are all equal (removed, ``filtered``: its buffers cleared); at ``train_batch_size`` kept groups
      the stop event fires (``done``);
    - ``end_round`` cancels what runs: the partial outputs go to the *front* of the queue (in abort-report
      order), followed by the requests never started; the batch holds the first ``train_batch_size`` kept
      groups, in the order they were kept. Groups kept beyond that (finished after the stop event) stay held
      and head the next round's kept list, as CoPRIS's ``kept_prompt_uids[train_batch_size:]`` does, so the
      next round may be done at once.

    Cross-stage importance sampling (loss side: ``docs/methods/offpolicy.md``). After each round call
    ``record_recompute`` with the trainer's recompute for ``needs_recompute``; each rollout's buffer
    grows by the new suffix only,

    .. math::  \ell^{beh}_{i,t} = \text{recompute}^{(v_{i,t})}_{i,t},

    the log-prob under the version that generated token t. The batch's ``behav_logp`` and ``versions`` go
    straight to ``policy_loss(..., old_logp=recompute, behav_logp=batch.behav_logp, versions=batch.versions,
    policy_version=v, proximal=CoPRISProximal())``.

    Defaults: ``pool_size=128`` (the code's default; the script uses 1024), ``train_batch_size=64``,
    ``gen_batch_size=128``, ``n_samples_per_prompt=8``, ``max_new_tokens=15360`` (``run_CoPRIS.sh``);
    ``filter_groups=False`` (verl's ``filter_groups.enable`` default). Library choices, not in the reference
    code: ``max_buffered`` / ``max_staleness`` with ``eviction`` (None: unbounded, as in the reference), and
    singleton groups (``n_samples_per_prompt=1``) are never filtered (verl's DAPO rule; CoPRIS's
    ``len(set(rewards)) == 1`` would drop every one of them).

    Args:
        train_batch_size: kept groups that fire the stop event, >= 1.
        gen_batch_size: prompts per ``begin_round`` (``prompt_ids`` must hold exactly this many, or none
            when the queue is to be drained), >= 1.
        n_samples_per_prompt: samples per group, >= 1.
        pool_size: requests in flight, >= 1.
        max_new_tokens: max response length, >= 1.
        filter_groups: drop zero-variance groups (singleton groups are never dropped).
        max_buffered: most rollouts held after ``end_round``, the queue included (None: no bound).
        max_staleness: evict held groups whose oldest token is more than this many versions behind.
        eviction: ``'oldest'`` or ``'newest'`` groups first.

    Edge cases: an empty queue gives no request and an empty batch; groups are never split by eviction.
    """

    _extra_keys = ("queue", "kept")

    def __init__(
        self,
        *,
        train_batch_size: int = 64,
        gen_batch_size: int = 128,
        n_samples_per_prompt: int = 8,
        pool_size: int = 128,
        max_new_tokens: int = 15360,
        filter_groups: bool = False,
        max_buffered: int | None = None,
        max_staleness: int | None = None,
        eviction: str = "oldest",
    ) -> None:
        _check_int(train_batch_size, "train_batch_size", 1)
        _check_int(gen_batch_size, "gen_batch_size", 1)
        _check_int(pool_size, "pool_size", 1)
        super().__init__(
            n_samples_per_prompt=n_samples_per_prompt,
            max_new_tokens=max_new_tokens,
            filter_groups=filter_groups,
            max_buffered=max_buffered,
            max_staleness=max_staleness,
            eviction=eviction,
        )
        self.train_batch_size = train_batch_size
        self.gen_batch_size = gen_batch_size
        self.pool_size = pool_size
        self._queue: deque[int] = deque()  # rollout ids: partials first, then never started
        self._kept: list[int] = []

    @property
    def done(self) -> bool:
        """``train_batch_size`` groups kept this round."""
        return len(self._kept) >= self.train_batch_size

    def queued_ids(self) -> Int[Tensor, " N"]:
        """Rollout ids waiting in the request queue, front first."""
        return torch.tensor(list(self._queue), dtype=torch.long)

    def _config(self) -> dict[str, Any]:
        return {
            **super()._config(),
            "train_batch_size": self.train_batch_size,
            "gen_batch_size": self.gen_batch_size,
            "pool_size": self.pool_size,
        }

    def _check_begin(self, prompts: list[int]) -> None:
        if len(prompts) not in (0, self.gen_batch_size):
            raise InputError(
                "prompt_ids",
                f"{self.gen_batch_size} prompt ids (gen_batch_size) or none",
                f"{len(prompts)} ids",
                "pass one gen batch per round",
            )

    def _begin(self, prompts: list[int]) -> None:
        for p in prompts:
            self._queue.extend(self._groups[self._new_group(p)])

    def _select(self, limit: int | None) -> list[int]:
        out: list[int] = []
        if self.done:
            return out
        k = self.pool_size - len(self._running)
        if limit is not None:
            k = min(k, limit)
        while self._queue and len(out) < k:
            r = self._queue.popleft()
            if r in self._rollouts:
                out.append(r)
        return out

    def _accept(self, group: int) -> None:
        self._kept.append(group)

    def _reject(self, group: int) -> None:
        pass

    def _close(self) -> tuple[list[int], list[int]]:
        # CoPRIS trains kept_prompt_uids[:train_batch_size] and carries the rest to the next step
        batch, self._kept = self._kept[: self.train_batch_size], self._kept[self.train_batch_size :]
        cancelled = [r for r in self._aborted if r in self._rollouts]
        self._queue = deque(cancelled + list(self._queue))
        return batch, []

    def _purge(self) -> None:
        self._queue = deque(r for r in self._queue if r in self._rollouts)
        self._kept = [g for g in self._kept if g in self._groups]

    def _extra_state(self) -> dict[str, Any]:
        return {"queue": list(self._queue), "kept": list(self._kept)}

    def _load_extra(self, state: dict[str, Any]) -> None:
        self._queue = deque(int(r) for r in state["queue"])
        self._kept = [int(g) for g in state["kept"]]
