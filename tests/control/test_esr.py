"""ESR (control/esr.py): the prefix stop rule and its loss mask — properties, oracles by hand, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    ESR,
    esr_mask,
    replay,
)
from rolloutopt.errors import InputError


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 6), st.integers(0, 12), st.integers(1, 8), st.integers(0, 10_000))
def test_prop_esr(b: int, t: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    live = torch.arange(t)[None, :] < lengths[:, None]  # EOS after `length` tokens
    rule = ESR(n=n)
    res = replay(rule, mask=live) if t else rule.finalize(rule.init(b))
    assert bool((res.length <= n).all())
    assert torch.equal(res.length, torch.clamp(lengths, max=n))
    assert torch.equal(res.stopped, lengths >= n)
    assert all(r == "prefix_limit" for r, s in zip(res.reasons(), res.stopped.tolist(), strict=True) if s)
    m = esr_mask(live, lengths, n=n)
    assert torch.equal(m.sum(-1), torch.clamp(lengths, max=n))
    assert torch.equal(esr_mask(live, n=n), m)
    # permutation and all-inactive no-op
    if b and t:
        perm = torch.randperm(b, generator=g)
        assert torch.equal(replay(rule, mask=live[perm]).position, res.position[perm])
        none = replay(rule, mask=torch.zeros(b, t, dtype=torch.bool))
        assert not none.stopped.any() and (none.length == 0).all()


def test_esr_hand_and_bad_input() -> None:
    res = replay(ESR(n=3), mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool))
    assert res.position.tolist() == [2, -1] and res.length.tolist() == [3, 2]
    assert res.reasons() == ["prefix_limit", "running"]
    assert ESR().n == 100
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert esr_mask(mask, torch.tensor([4, 1]), n=2).int().tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    with pytest.raises(InputError, match="n"):
        ESR(n=0)
    with pytest.raises(InputError, match="lengths"):
        esr_mask(mask, torch.tensor([1, 2, 3]))
    with pytest.raises(InputError, match="lengths"):
        esr_mask(mask, torch.tensor([1, -2]))
    with pytest.raises(InputError, match="mask"):
        esr_mask(torch.full((2, 5), 0.5))
    with pytest.raises(InputError, match="n"):
        esr_mask(mask, n=0)
