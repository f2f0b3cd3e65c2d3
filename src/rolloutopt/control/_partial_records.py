"""What the partial-rollout schedulers hand back, and how they store a rollout (:mod:`~rolloutopt.control.partial`).

:class:`Requests` (requests to start), :class:`PartialBatch` (rollouts as a right-padded batch), :class:`Removed`
(rollouts removed without being trained, reasons in :data:`REMOVAL_REASONS`) and :class:`RoundResult` (what
``end_round`` returns); the per-rollout storage record and the batch assembly (padding) that
:class:`~rolloutopt.control.PartialScheduler` uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from jaxtyping import Int
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from rolloutopt.typing import BoolB, BoolBT, FloatB, FloatBT, IntB, IntBT, IntP

__all__ = ["REMOVAL_REASONS", "STATUS_NAMES", "PartialBatch", "Removed", "Requests", "RoundResult"]

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


def _assemble(rollouts: dict[int, _Rollout], rids: list[int]) -> PartialBatch:
    """The rollouts ``rids`` (held in ``rollouts``) as a right-padded :class:`PartialBatch`, in that order: the
    stored recompute on each prefix and the engine's log-probs beyond it make ``behav_logp``."""
    if not rids:
        return _empty_batch()
    recs = [rollouts[r] for r in rids]
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
