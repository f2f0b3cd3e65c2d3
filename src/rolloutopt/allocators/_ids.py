"""Sorted int64 prompt-id stores the allocators share: a memoised id sort (:func:`_sort_ids`), a fast stable
argsort (:func:`_argsort_stable`), and look-up and insertion in a sorted id table (:func:`_locate`,
:func:`_lookup`, :func:`_insert`), all ``torch.searchsorted``, no Python loop over prompts.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor


def _argsort_stable(x: Tensor, *, descending: bool = False) -> Tensor:
    """``torch.sort(x, descending=descending, stable=True).indices``, several times faster for float64 without
    NaN: sorted as int64 keys that order doubles as their values do (the bit pattern, the magnitude bits flipped
    for negatives; ``+ 0.0`` first makes ``-0.0`` equal to ``0.0``), which torch sorts by radix. Other dtypes,
    or a NaN, take ``torch.sort`` itself."""
    if x.dtype == torch.float64 and x.numel() > 1:
        lo = float(x.min())  # NaN if any value is NaN
        if lo >= 0:  # non-negative: the bit patterns already order the values
            key = (x + 0.0).view(torch.int64)
            return torch.sort(key.neg() if descending else key, stable=True).indices
        if lo == lo:
            bits = (x + 0.0).view(torch.int64)
            key = torch.where(bits < 0, bits ^ ((1 << 63) - 1), bits)
            return torch.sort(key.neg_() if descending else key, stable=True).indices
    return torch.sort(x, descending=descending, stable=True).indices


_sorts: list[tuple[weakref.ref[Tensor], int, Tensor, Tensor]] = []  # the last few sorts, most recent last
_SORTS_KEPT = 4


def _sort_ids(ids: Tensor) -> tuple[Tensor, Tensor]:
    """``ids.sort()`` (values, indices), remembered for the last few tensors sorted: validating a plan's prompt
    ids, looking them up in a sorted table and the conversation's id order all need the same sort (and a plan
    that also looks up its sorted ids must not evict the sort of the ids it was given). The memo is keyed by the
    tensor's identity and its in-place version counter, so a modified or new tensor is sorted afresh. An
    already sorted tensor costs one comparison pass. The returned tensors are shared: read them, never modify
    them in place."""
    for entry in reversed(_sorts):
        if entry[0]() is ids and entry[1] == ids._version:
            return entry[2], entry[3]
    if ids.numel() < 2 or bool((ids[1:] >= ids[:-1]).all()):
        values, order = ids, torch.arange(ids.numel(), device=ids.device)
    else:
        values, order = ids.sort()
    _sorts.append((weakref.ref(ids), ids._version, values, order))
    del _sorts[:-_SORTS_KEPT]
    return values, order


def _locate(sorted_ids: Tensor, query: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Look ``query`` up in ``sorted_ids`` in sorted-query order: ``(pos, found, order)`` where ``pos[i]`` is the
    position of ``query[order[i]]`` (junk where ``found[i]`` is False). Sorted queries walk the table in order,
    about twice as fast as random ones, and the positions come out increasing, so that the gathers and scatters
    that follow are sequential too."""
    q, order = _sort_ids(query)
    k = sorted_ids.numel()
    if k == 0:
        return torch.zeros_like(q), torch.zeros(q.shape, dtype=torch.bool), order
    pos = torch.searchsorted(sorted_ids, q).clamp(max=k - 1)
    return pos, sorted_ids[pos] == q, order


_last_lookup: tuple[weakref.ref[Tensor], int, weakref.ref[Tensor], int, Tensor, Tensor] | None = None


def _lookup(sorted_ids: Tensor, query: Tensor) -> tuple[Tensor, Tensor]:
    """Positions of ``query`` in ``sorted_ids`` and whether each is there (positions of absent ids are junk).

    Remembered for the last pair of tensors looked up (by identity and in-place version, as :func:`_sort_ids`):
    the owners of a shared :class:`~rolloutopt.allocators.PromptTable` (and a token budget's expected lengths)
    look the same candidates up in the same table in one step, and pay for one binary search. The caller gets
    its own copies."""
    global _last_lookup
    memo = _last_lookup
    if (
        memo is not None
        and memo[0]() is sorted_ids
        and memo[1] == sorted_ids._version
        and memo[2]() is query
        and memo[3] == query._version
    ):
        return memo[4].clone(), memo[5].clone()
    pos_s, found_s, order = _locate(sorted_ids, query)
    pos = torch.empty_like(pos_s).scatter_(0, order, pos_s)
    found = torch.empty_like(found_s).scatter_(0, order, found_s)
    _last_lookup = (weakref.ref(sorted_ids), sorted_ids._version, weakref.ref(query), query._version, pos, found)
    return pos.clone(), found.clone()


def _insert(
    sorted_ids: Tensor, new_ids: Tensor, fields: list[tuple[Tensor, Tensor]]
) -> tuple[Tensor, list[Tensor], Tensor, Tensor]:
    """Add the distinct ``new_ids`` absent from ``sorted_ids``; each field grows by its fill row. Stays sorted.

    Returns the merged ids, the merged fields, and the increasing positions ``pos`` of ``new_ids[order]`` in the
    merged ids together with ``order`` (see :func:`_locate`).
    """
    pos, found, order = _locate(sorted_ids, new_ids)
    add = new_ids[order[~found]]
    if add.numel() == 0:
        return sorted_ids, [f for f, _ in fields], pos, order
    ids, perm = torch.cat([sorted_ids, add]).sort()
    out = [torch.cat([f, fill.expand(add.numel(), *fill.shape).to(f.dtype)])[perm] for f, fill in fields]
    pos, _, order = _locate(ids, new_ids)
    return ids, out, pos, order


def _by_group(gs: Tensor) -> tuple[Tensor, Tensor | None]:
    """Rows ordered by group, observation order kept within one: ``(gs_sorted, perm)`` with ``perm`` None when
    ``gs`` is already non-decreasing (a one-request plan observes its rollouts grouped: one pass to see it),
    otherwise ``torch.sort(gs, stable=True)``."""
    if gs.numel() < 2 or bool((gs[1:] >= gs[:-1]).all()):
        return gs, None
    gs_sorted, perm = torch.sort(gs, stable=True)
    return gs_sorted, perm
