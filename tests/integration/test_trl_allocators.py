"""Every registered allocator is either accepted by the TRL adapter or refused with the trainer limitation that
stops it (TRL generates once per generation batch; its generation step computes no response entropies)."""

from __future__ import annotations

import warnings

import pytest

import rolloutopt.allocators as allocators
from rolloutopt.errors import InputError
from rolloutopt.integrations.trl import _REFUSED_ALLOCATORS, _allocator_mode


@pytest.mark.parametrize("name", allocators.names())
def test_every_allocator_is_accepted_or_refused_with_its_reason(name: str) -> None:
    entry = allocators.entry(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        alloc = allocators.get(name)(**({"experimental": True} if entry.experimental is not None else {}))
    cls = type(alloc).__name__
    if cls in _REFUSED_ALLOCATORS:
        with pytest.raises(InputError) as err:
            _allocator_mode(alloc)
        assert err.value.argument == "allocator" and _REFUSED_ALLOCATORS[cls] in str(err.value)
    else:
        assert _allocator_mode(alloc) in ("select", "counts")
