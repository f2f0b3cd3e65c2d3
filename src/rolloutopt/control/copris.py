"""CoPRIS — concurrency-controlled partial rollouts (arXiv 2511.05589; ``docs/methods/partial_rollouts.md``).

:class:`CoPRISScheduler` keeps a fixed pool of requests in flight, stops at the target and requeues the partial
outputs at the front; its cross-stage importance sampling reads the segment-wise recompute buffer of
:class:`~rolloutopt.control.PartialScheduler` (``needs_recompute`` / ``record_recompute``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._validation import check_int as _check_int
from rolloutopt.control.partial import PartialScheduler
from rolloutopt.errors import InputError

__all__ = ["CoPRISScheduler"]


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

    def _check_extra(self, extra: dict[str, Any], rollouts: dict[int, Any], groups: dict[int, list[int]]) -> None:
        # the kept groups are trained at end_round: each must be held (the queue may name stale ids)
        if any(g not in groups for g in extra["kept"]):
            raise InputError("state['extra']['kept']", "ids of held groups", repr(extra["kept"]), "pass state_dict()")

    def _load_extra(self, state: dict[str, Any]) -> None:
        self._queue = deque(int(r) for r in state["queue"])
        self._kept = [int(g) for g in state["kept"]]
