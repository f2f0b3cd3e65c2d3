r"""Partial-rollout scheduling: the event API APRIL and CoPRIS share (``docs/methods/partial_rollouts.md``).

A partial-rollout scheduler decides *when a rollout round ends* and *what happens to the unfinished
rollouts*. It never generates: the engine loop tells it what happened, through a small event API shared by
both schedulers (:class:`PartialScheduler`; APRIL in :mod:`~rolloutopt.control.april`, CoPRIS in
:mod:`~rolloutopt.control.copris`)::

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
from collections.abc import Iterable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rolloutopt._validation import check_int as _check_int
from rolloutopt._validation import describe, finite
from rolloutopt.control._partial_records import (
    _COMPLETED,
    _EVICT_CAP,
    _EVICT_STALE,
    _EVICTION,
    _FILTERED,
    _NO_VERSION,
    _PARTIAL,
    _PENDING,
    _RUNNING,
    _TRUNCATED,
    REMOVAL_REASONS,
    PartialBatch,
    Removed,
    Requests,
    RoundResult,
    _assemble,
    _Rollout,
)
from rolloutopt.control._partial_state import _PartialCheckpoint
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatBT, IntB, IntP

__all__ = ["PartialScheduler"]


class PartialScheduler(_PartialCheckpoint):
    """The event API shared by :class:`APRILBuffer` and :class:`CoPRISScheduler`; not used on its own.

    It holds the storage, the request bookkeeping, batch assembly, eviction and checkpointing (:meth:`state_dict`
    and :meth:`load_state_dict`, from ``control/_partial_state.py``). A subclass
    decides which requests start (:meth:`next_requests`), when the round is :attr:`done`, and what
    :meth:`end_round` returns and keeps. Keyword arguments as documented on the subclasses.
    """

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
        batch = _assemble(self._rollouts, batch_rids)
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
        return _assemble(self._rollouts, rids)

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
