"""Pieces HIVE and DEPO share (``docs/methods/filters.md``): seeded tie-break keys and orders over sorted prompt
ids, the per-rollout ``entropy`` signal check, and the shift of a value into the bounded per-prompt history
windows both keep (in their :class:`~rolloutopt.allocators.table.PromptTable` columns).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rolloutopt._validation import describe
from rolloutopt.allocators._ids import _sort_ids
from rolloutopt.errors import InputError


# -- shared helpers ---------------------------------------------------------------------------------------------
def _keyed(ids: Tensor, gen: torch.Generator, store: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One sort of the candidates for two things: a seeded random tie-break order, and the candidates'
    positions in the sorted ``store`` ids with whether each is there (positions of absent ids are junk).

    The tie order ``seq`` lists candidate indices by a random rank drawn per prompt *id* (a permutation from
    ``gen`` applied in sorted-id order), so a permutation of the candidates permutes it with them."""
    q, order = _sort_ids(ids)
    seq = torch.empty_like(order)
    seq[torch.randperm(ids.numel(), generator=gen)] = order
    pos = torch.zeros_like(ids)
    found = torch.zeros(ids.shape, dtype=torch.bool)
    if store.numel():
        ps = torch.searchsorted(store, q).clamp(max=store.numel() - 1)
        pos[order] = ps
        found[order] = store[ps] == q
    return seq, pos, found


def _order(keys: list[Tensor], seq: Tensor, mask: Tensor) -> Tensor:
    """Indices of ``mask`` sorted ascending by ``keys[0]``, then ``keys[1]``, ..., then the tie order ``seq``
    (keys are full-length ``[P]``; stable sorts, last key first, starting from ``seq`` restricted to ``mask``)."""
    idx = seq[mask[seq]]
    for key in reversed(keys):
        idx = idx[key[idx].argsort(stable=True)]
    return idx


def _check_entropy(entropy: Any, n: int, name: str) -> Tensor:
    if not isinstance(entropy, Tensor) or not entropy.is_floating_point():
        raise InputError(name, f"a float tensor [{n}]", describe(entropy), f"pass {name}=torch.tensor(...).float()")
    if entropy.ndim != 1 or entropy.numel() != n:
        raise InputError(name, f"a 1-d tensor of {n} values", describe(entropy), "pass one value per row")
    e = entropy.detach().cpu().to(torch.float64)
    if not math.isfinite(float(e.sum())) and not bool(torch.isfinite(e).all()):  # a finite sum: all finite
        raise InputError(name, "finite values", f"{describe(entropy)} with NaN or inf", "fix the entropy")
    return e


def _shift_in(buf: Tensor, pos: Tensor, new: Tensor) -> Tensor:
    """Append ``new[i]`` to the window row ``buf[pos[i]]`` (oldest value dropped); ``pos`` distinct."""
    rows = torch.cat([buf.index_select(0, pos)[:, 1:], new.unsqueeze(1).to(buf.dtype)], dim=1)
    return buf.index_copy_(0, pos, rows)
