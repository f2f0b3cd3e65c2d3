"""The arena's response store: the allocators that train on stored responses again get them back.

Two allocators hand a step stored responses beside the fresh ones, through the finished plan
(:func:`~rolloutopt.allocators.run_step`'s ``on_finish``):

- :class:`~rolloutopt.allocators.AR3PO` appends reused responses to its result (rows from ``counts.sum()`` on, in
  their prompt's group, with the stored reward and ``reuse_weight``); ``plan.reused().keys`` are
  :func:`~rolloutopt.allocators.ar3po.response_key` ``(step, row)``: the allocator step that generated the
  response and its row in that step's result;
- :class:`~rolloutopt.allocators.DOTS` replays whole groups (``plan.replayed()``): per rollout the step that stored
  it (the allocator's update count), its prompt and its index in the group's observation order, and the stored
  reward; a replayed group is trained as a group of its own.

:class:`ResponseStore` keeps every generated row of every step (tokens, mask, the behaviour log-probs the engine
sampled them with, entropies, the generating version) and returns the rows a plan reuses, with their rewards,
groups and weights, so the loss trains on them off-policy with their stored log-probs as ``old_logp`` (as both
papers do). An allocator without stored responses gets nothing back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from rolloutopt.allocators import AllocationResult
from rolloutopt.testbed.policy import Rollouts
from rolloutopt.testbed.task import PAD
from rolloutopt.typing import FloatB, IntB, IntBT

__all__ = ["ResponseStore", "Reused", "cat_rolls", "map_roll"]


def map_roll(roll: Rollouts, fn: Callable[[Tensor], Tensor]) -> Rollouts:
    """``roll`` with ``fn`` applied to each of its tensors (the absent top-K stays None)."""
    return Rollouts(**{f.name: _apply(getattr(roll, f.name), fn) for f in fields(roll)})


def _rows_of(r: int) -> Callable[[Tensor], Tensor]:
    """A tensor's row ``r``, kept as a batch of one."""
    return lambda t: t[r : r + 1]


def _apply(x: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    return fn(x) if isinstance(x, Tensor) else x


def cat_rolls(rolls: list[Rollouts]) -> Rollouts:
    """The rows of ``rolls`` one after the other, right-padded to the widest (``<pad>`` tokens, False mask, zero
    log-probs and entropies; top-K kept only when every part has it)."""
    width = max(r.tokens.shape[1] for r in rolls)

    def cat(ts: list[Tensor], fill: float | int) -> Tensor:
        pad = [torch.nn.functional.pad(t, (0, 0) * (t.ndim - 2) + (0, width - t.shape[1]), value=fill) for t in ts]
        return torch.cat(pad)

    topk = all(r.topk_ids is not None and r.topk_logp is not None for r in rolls)
    return Rollouts(
        tokens=cat([r.tokens for r in rolls], PAD), mask=cat([r.mask for r in rolls], False),
        logp=cat([r.logp for r in rolls], 0.0), entropy=cat([r.entropy for r in rolls], 0.0),
        topk_ids=cat([r.topk_ids for r in rolls], PAD) if topk else None,  # type: ignore[misc]
        topk_logp=cat([r.topk_logp for r in rolls], 0.0) if topk else None,  # type: ignore[misc]
    )  # fmt: skip


@dataclass(frozen=True)
class Reused:
    """Stored rows a plan trains on again: ``ids`` ``[M]``, their ``roll`` and ``versions`` as generated, and the
    ``rewards``, ``group`` and ``weight`` ``[M]`` the step trains them with (``group``: the result's group for
    AR3PO's rows, new groups after the result's for DOTS's)."""

    ids: IntB
    roll: Rollouts
    versions: IntBT
    rewards: FloatB
    group: IntB
    weight: FloatB


class ResponseStore:
    """Every generated row of a run's steps, by step (see the module docstring)."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, Any]] = {}

    def add(self, step: int, ids: IntB, roll: Rollouts, versions: IntBT) -> None:
        """The rows generated at allocator step ``step`` (0-based: the updates before it), in result order."""
        roll = map_roll(roll, lambda t: t.cpu())
        within = torch.zeros_like(ids)
        for p in torch.unique(ids).tolist():  # each row's index among its prompt's rows, in observation order
            rows = (ids == p).nonzero().squeeze(1)
            within[rows] = torch.arange(rows.numel())
        self.steps[step] = {"ids": ids.cpu(), "roll": roll, "versions": versions.cpu(), "within": within.cpu()}

    def _rows(self, steps: list[int], rows: list[int]) -> tuple[Tensor, Rollouts, Tensor]:
        parts = []
        for s, r in zip(steps, rows, strict=True):
            rec = self.steps[s]
            parts.append((rec["ids"][r : r + 1], map_roll(rec["roll"], _rows_of(r)), rec["versions"][r : r + 1]))
        roll = cat_rolls([p[1] for p in parts])
        return torch.cat([p[0] for p in parts]), roll, _pad_versions([p[2] for p in parts], roll)

    def reused(self, plan: Any, result: AllocationResult) -> Reused | None:
        """The stored rows ``plan`` trains on again (AR3PO's reused rows, DOTS's replayed groups), or None."""
        if hasattr(plan, "reused"):
            got = plan.reused()
            if got.rows.numel() == 0:
                return None
            keys = got.keys
            ids, roll, versions = self._rows((keys >> 32).tolist(), (keys & ((1 << 32) - 1)).tolist())
            assert torch.equal(ids, got.prompt_ids), "a reused key names a row of another prompt"
            rows = got.rows
            return Reused(ids, roll, versions, result.rewards[rows].float(), result.group[rows],
                          result.weight[rows].float())  # fmt: skip
        if hasattr(plan, "replayed"):
            rep = plan.replayed()
            if rep.group.numel() == 0:
                return None
            steps = rep.steps[rep.group].tolist()
            prompts = rep.prompt_ids[rep.group].tolist()
            rows = []
            for s, p, i in zip(steps, prompts, rep.index.tolist(), strict=True):
                rec = self.steps[s]
                rows.append(int(((rec["ids"] == p) & (rec["within"] == i)).nonzero()[0, 0]))
            ids, roll, versions = self._rows(steps, rows)
            group = result.plan_prompt_ids.numel() + rep.group
            return Reused(ids, roll, versions, rep.rewards.float(), group, torch.ones(group.numel()))
        return None


def _pad_versions(parts: list[Tensor], roll: Rollouts) -> Tensor:
    """Per-row version tensors ``[1, T_i]`` padded (with each row's first version) to ``roll``'s width."""
    width = roll.tokens.shape[1]
    return torch.cat([torch.nn.functional.pad(v, (0, width - v.shape[1]), value=int(v[0, 0])) for v in parts])
