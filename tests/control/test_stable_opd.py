"""Stable-OPD (control/stable_opd.py): the monitor and the repeated n-gram share — oracles by hand, properties,
state round trips, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.control import (
    StableOPD,
    repeated_ngram_share,
)
from rolloutopt.errors import InputError


def _stable(**kw: Any) -> StableOPD:
    return StableOPD(experimental=True, **kw)


def test_stable_opd_oracle() -> None:
    lengths = torch.full((10,), 50)
    three = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    two = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    d = _stable(tau_trunc=0.2).observe(lengths, three)
    assert d.tripped and d.reasons == ("truncation",) and d.truncated_frac == pytest.approx(0.3)
    assert d.kl_multiplier == 2.0 and d.mix_ratio == 0.25
    d = _stable(tau_trunc=0.2).observe(lengths, two)
    assert not d.tripped and d.reasons == () and d.kl_multiplier == 1.0 and d.mix_ratio == 0.0


def test_stable_opd_jump_kl_schedule_and_round_trip() -> None:
    mon = _stable(tau_trunc=0.5, delta=0.1, window=2, kl_up=2.0, kl_decay=0.5, kl_max=4.0)
    lengths = torch.full((20,), 8)

    def trunc(k: int) -> torch.Tensor:
        return torch.arange(20) < k

    assert not mon.observe(lengths, trunc(0)).tripped  # 0.0, no history
    d = mon.observe(lengths, trunc(3))  # 0.15 - min(0.0) > 0.1: jump
    assert d.reasons == ("jump",) and d.kl_multiplier == 2.0
    saved = mon.state_dict()
    d = mon.observe(lengths, trunc(11))  # 0.55: truncation and jump (0.55 - 0.0 > 0.1)
    assert d.reasons == ("truncation", "jump") and d.kl_multiplier == 4.0
    d = mon.observe(lengths, trunc(11))  # 0.55: truncation; history [0.15, 0.55] -> jump 0.4
    assert d.tripped and d.kl_multiplier == 4.0  # capped
    d = mon.observe(lengths, trunc(10))  # 0.5 not > 0.5; history [0.55, 0.55]: no jump -> decay
    assert not d.tripped and d.kl_multiplier == 2.0 and d.mix_ratio == 0.0
    assert mon.observe(lengths, trunc(10)).kl_multiplier == 1.0
    assert mon.observe(lengths, trunc(10)).kl_multiplier == 1.0  # never below 1
    fresh = _stable(tau_trunc=0.5, delta=0.1, window=2, kl_up=2.0, kl_decay=0.5, kl_max=4.0)
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    replayed = [fresh.observe(lengths, trunc(k)) for k in (11, 11, 10)]
    assert [r.kl_multiplier for r in replayed] == [4.0, 4.0, 2.0] and fresh.trips == 3
    # an empty batch never trips on truncation
    assert not _stable().observe(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool)).tripped


def test_repeated_ngram_share_hand() -> None:
    tokens = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 1, 1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 8, [1] * 6 + [0, 0]], dtype=torch.bool)
    # row 0: 5 four-grams, 4 distinct -> 1/5; row 1: 5 distinct -> 0; row 2: 3 valid four-grams, 1 distinct -> 2/3
    assert repeated_ngram_share(tokens, mask).tolist() == pytest.approx([0.2, 0.0, 2 / 3])
    assert repeated_ngram_share(tokens[:, :3], mask[:, :3]).tolist() == [0.0, 0.0, 0.0]  # T < n
    assert repeated_ngram_share(tokens, mask, n=1).tolist() == pytest.approx([0.5, 0.0, 5 / 6])
    # a hole in the mask breaks the n-grams that span it: 2 + 4 valid bigrams, all (1, 1) -> 5/6
    holed = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert repeated_ngram_share(torch.ones(1, 9, dtype=torch.long), holed, n=2).tolist() == pytest.approx([5 / 6])
    # in the monitor: batch mean over rows with >= 4 tokens, default mask t < lengths
    mon = _stable(tau_rep=0.25)
    d = mon.observe(torch.tensor([8, 8, 6]), torch.zeros(3, dtype=torch.bool), tokens=tokens)
    assert d.repetition == pytest.approx((0.2 + 0.0 + 2 / 3) / 3) and d.reasons == ("repetition",)
    d = _stable().observe(torch.tensor([8, 3, 3]), torch.zeros(3, dtype=torch.bool), tokens=tokens)
    assert d.repetition == pytest.approx(0.2) and not d.tripped  # rows 1, 2 are too short; tau_rep None


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 4), st.integers(0, 12), st.integers(1, 4), st.integers(0, 10_000))
def test_prop_repeated_ngram_share_matches_reference(b: int, t: int, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 3, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    got = repeated_ngram_share(tokens, mask, n=n)
    want = []
    for i in range(b):
        grams = [tuple(tokens[i, j : j + n].tolist()) for j in range(t - n + 1) if bool(mask[i, j : j + n].all())]
        want.append((len(grams) - len(set(grams))) / len(grams) if grams else 0.0)
    assert got.tolist() == pytest.approx(want)
    if b:
        perm = torch.randperm(b, generator=g)
        assert torch.equal(repeated_ngram_share(tokens[perm], mask[perm], n=n), got[perm])


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(0, 10), st.integers(0, 10_000))
def test_prop_stable_opd_permutation_invariant(b: int, t: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    truncated = lengths == t
    tokens = torch.randint(0, 3, (b, t), generator=g)
    perm = torch.randperm(b, generator=g)
    a, c = _stable(tau_rep=0.5), _stable(tau_rep=0.5)
    for _ in range(2):
        d1 = a.observe(lengths, truncated, tokens=tokens)
        d2 = c.observe(lengths[perm], truncated[perm], tokens=tokens[perm])
        assert (d1.tripped, d1.reasons, d1.kl_multiplier, d1.mix_ratio) == (
            d2.tripped,
            d2.reasons,
            d2.kl_multiplier,
            d2.mix_ratio,
        )
        assert d1.truncated_frac == d2.truncated_frac and d1.repetition == pytest.approx(d2.repetition)
        assert d1.tripped == (d1.truncated_frac > 0.2 or d1.repetition > 0.5 or "jump" in d1.reasons)


def test_stable_opd_bad_input() -> None:
    with pytest.raises(InputError, match="experimental"):
        StableOPD()
    for kw, name in (
        ({"tau_trunc": 1.5}, "tau_trunc"),
        ({"delta": -0.1}, "delta"),
        ({"window": 0}, "window"),
        ({"kl_up": 0.5}, "kl_up"),
        ({"kl_decay": 0.0}, "kl_decay"),
        ({"kl_max": 0.5}, "kl_max"),
        ({"mix_ratio": 2.0}, "mix_ratio"),
        ({"tau_rep": 2.0}, "tau_rep"),
        ({"ngram": 0}, "ngram"),
    ):
        with pytest.raises(InputError, match=name):
            _stable(**kw)
    mon = _stable()
    ell, tr = torch.tensor([3, 4]), torch.tensor([True, False])
    with pytest.raises(InputError, match="truncated"):
        mon.observe(ell, tr[:1])
    with pytest.raises(InputError, match="truncated"):
        mon.observe(ell, torch.tensor([0.5, 1.0]))
    with pytest.raises(InputError, match="lengths"):
        mon.observe(torch.tensor([-1, 2]), tr)
    with pytest.raises(InputError, match="lengths"):
        mon.observe(ell.float(), tr)
    with pytest.raises(InputError, match="tokens"):
        mon.observe(ell, tr, tokens=torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(InputError, match="tokens"):
        mon.observe(ell, tr, tokens=torch.zeros(2, 4))
    with pytest.raises(InputError, match="mask"):
        mon.observe(ell, tr, mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(InputError, match="mask"):
        mon.observe(ell, tr, tokens=torch.zeros(2, 4, dtype=torch.long), mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(InputError, match="state"):
        mon.load_state_dict({"history": [0.1]})
    assert mon.steps == 0  # nothing was recorded by the failed calls
    with pytest.raises(InputError, match="n"):
        repeated_ngram_share(torch.zeros(2, 4, dtype=torch.long), n=0)
