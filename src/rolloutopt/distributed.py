"""Global loss denominators over a ``torch.distributed`` process group.

On data-parallel rank k, a loss normalised by the *local* token count weighs a token of a short micro-batch
more than one of a long micro-batch; the mean over ranks is then not the loss of the whole batch. Passing
the global counts from :func:`global_denominators` to :func:`rolloutopt.losses.policy_loss` (or
:func:`rolloutopt.losses.aggregate`) makes the per-rank losses sum to the global loss; ``world_size`` in the
result then compensates DDP's gradient averaging (verl's ``dp_size`` factor in ``agg_loss``).
"""

from __future__ import annotations

from typing import Any

import torch

from rolloutopt._validation import Dims, as_float, as_mask
from rolloutopt.groups import Groups, as_groups
from rolloutopt.losses.aggregation import Denominators
from rolloutopt.typing import BoolBT, FloatB, IntB

__all__ = ["global_denominators"]


def global_denominators(
    mask: BoolBT,
    *,
    group: Groups | IntB | None = None,
    seq_weight: FloatB | None = None,
    process_group: Any = None,
) -> Denominators:
    r"""Token, sequence and group counts of the global batch, summed over ``process_group`` with one all-reduce.

    .. math::  N_{tok} = \sum_{k}\sum_{i,t} m^{(k)}_{i,t}, \quad
               N_{seq} = \sum_k \#\{i : \textstyle\sum_t m^{(k)}_{i,t} > 0\}, \quad
               N_{grp} = \sum_k \#\{g : \textstyle\sum_{i \in g, t} m^{(k)}_{i,t} > 0\}

    Args:
        mask: this rank's loss mask ``[B, T]``.
        group: this rank's group ids ``[B]``, to count groups (``prompt-mean``); without it ``groups`` is None.
            A prompt whose rollouts are split over ranks is counted once per rank that holds some of them;
            keep a group on one rank (verl and TRL do) for the exact prompt mean.
        seq_weight: per-sequence weights ``[B]``; a row with weight 0 leaves every count, as in ``policy_loss``.
        process_group: the data-parallel group (default: the world). Without an initialised
            ``torch.distributed`` the local counts are returned with ``world_size=1``.

    Returns:
        :class:`~rolloutopt.losses.Denominators` with fp32 0-d tensors on the mask's device and the group's
        ``world_size``. The all-reduce is a collective: every rank must call it.
    """
    dims = Dims()
    m = as_mask(mask, "mask", dims, "B T")
    if seq_weight is not None:
        m = m & (as_float(seq_weight, "seq_weight", dims, "B", device=m.device) != 0)[:, None]
    lengths = m.sum(-1)
    counts = [lengths.sum(), (lengths > 0).sum()]
    if group is not None:
        g = as_groups(group, dims)
        counts.append((g.sum(lengths.to(torch.float32)) > 0).sum())
    stacked = torch.stack(counts).to(torch.float32)
    world_size = 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(stacked, group=process_group)
        world_size = torch.distributed.get_world_size(process_group)
    return Denominators(
        tokens=stacked[0],
        sequences=stacked[1],
        groups=stacked[2] if group is not None else None,
        world_size=world_size,
    )
