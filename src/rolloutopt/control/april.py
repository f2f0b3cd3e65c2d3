"""APRIL — active partial rollouts (``RLsys-Foundation/APRIL`` on slime; ``docs/methods/partial_rollouts.md``).

:class:`APRILBuffer` over-provisions groups, stops at the target, aborts the rest and recycles the unfinished
groups into the next round. It speaks the event API of :class:`~rolloutopt.control.PartialScheduler`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._validation import check_int as _check_int
from rolloutopt._validation import describe
from rolloutopt.control._partial_records import _DISCARDED
from rolloutopt.control.partial import PartialScheduler
from rolloutopt.errors import InputError

__all__ = ["APRILBuffer"]


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

    def _check_extra(self, extra: dict[str, Any], rollouts: dict[int, Any], groups: dict[int, list[int]]) -> None:
        # the accepted groups are trained at end_round: each must be held (the queues may name stale ids)
        for key in ("accepted", "extra"):
            if any(g not in groups for g in extra[key]):
                raise InputError(
                    f"state['extra'][{key!r}]", "ids of held groups", repr(extra[key]), "pass state_dict()"
                )

    def _load_extra(self, state: dict[str, Any]) -> None:
        self._buffer = deque(int(g) for g in state["buffer"])
        self._fresh = deque(int(p) for p in state["fresh"])
        self._remaining = int(state["remaining"])
        self._submitted = [int(g) for g in state["submitted"]]
        self._accepted = [int(g) for g in state["accepted"]]
        self._extra = [int(g) for g in state["extra"]]
        self._to_start = deque(int(r) for r in state["to_start"])
