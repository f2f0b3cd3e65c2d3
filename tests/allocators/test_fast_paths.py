"""The vectorised fast paths agree exactly with the general computations they replace."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.allocators import AERO, PromptHistory
from rolloutopt.allocators._budget import _top_units, _top_units_by_key, _top_units_grouped, _top_units_lazy
from rolloutopt.allocators._ids import _argsort_stable, _sort_ids
from rolloutopt.allocators.aero import _beyond_limit, _within_rank

F64 = torch.float64


def _rank_reference(seg: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Rank within segment by (key, position): a loop, for the oracle only."""
    out = torch.empty_like(seg)
    for i in range(seg.numel()):
        same = (seg == seg[i]).nonzero().squeeze(1).tolist()
        ki = float(key[i])
        out[i] = sum(
            1
            for j in same
            if (float(key[j]) < ki or (float(key[j]) == ki and j < i) or (ki != ki and key[j] == key[j]))
            or (ki != ki and float(key[j]) != float(key[j]) and j < i)
        )
    return out


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 40), segs=st.integers(1, 6), sort=st.booleans())
def test_within_rank_matches_reference(seed: int, n: int, segs: int, sort: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    seg = torch.randint(0, segs, (n,), generator=g) * (1 if seed % 3 else 7919)
    if sort:
        seg = seg.sort().values
    kind = seed % 4
    if kind == 0:  # seeded uniforms: the one-sort path
        key = torch.rand(n, generator=g, dtype=F64)
    elif kind == 1:  # uniforms equal in their top bits: the collision check must fall back
        key = (0.25 + torch.randint(0, 3, (n,), generator=g).to(F64) * 2.0**-52).clamp(max=1 - 2**-53)
    elif kind == 2:  # ties and values outside [0, 1): the two-sort path
        key = torch.randint(-2, 3, (n,), generator=g).to(F64)
    else:  # NaN and inf keys
        key = torch.rand(n, generator=g, dtype=F64)
        if n:
            key[torch.randint(0, n, (2,), generator=g)] = float("nan")
            key[torch.randint(0, n, (1,), generator=g)] = float("inf")
    rank = _rank_reference(seg, key)
    assert torch.equal(_within_rank(seg, key), rank)
    limit = torch.randint(0, 4, (max(int(seg.max()) + 1, 1) if n else 1,), generator=g)
    cut, cut_seg = _beyond_limit(seg, key, limit)
    want = (rank >= limit[seg]).nonzero().squeeze(1)
    assert sorted(cut.tolist()) == want.tolist() and torch.equal(cut_seg, seg[cut])


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(
        st.sampled_from([0.0, -0.0, 0.5, 1e-310, -1e-310, 3.0, float("inf"), -float("inf"), 2.5, -1.0, -2.5]),
        max_size=30,
    ),
    nan=st.booleans(),
)
def test_argsort_stable_matches_torch(values: list[float], nan: bool) -> None:
    x = torch.tensor(values + ([float("nan")] if nan else []), dtype=F64)
    for desc in (False, True):
        assert torch.equal(_argsort_stable(x, descending=desc), torch.sort(x, descending=desc, stable=True).indices)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 12),
    distinct=st.integers(1, 4),
    length=st.integers(1, 6),
    frac=st.floats(0.0, 1.2),
)
def test_grouped_top_units_equal_the_expanded_table(
    seed: int, rows: int, distinct: int, length: int, frac: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 4, (distinct, length), generator=g).to(F64)  # ties, rows in any order
    inv = torch.randint(0, distinct, (rows,), generator=g)
    mult = torch.bincount(inv, minlength=distinct)
    r = int(frac * rows * length)
    present = mult > 0
    remap = torch.cumsum(present.long(), 0) - 1  # _top_units_grouped expects every table row used
    got = _top_units_grouped(table[present], remap[inv], mult[present], r)
    assert torch.equal(got, _top_units(table[inv], r))


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), e=st.integers(0, 60), length=st.integers(1, 70), frac=st.floats(0.0, 1.1))
def test_top_units_by_key_equals_the_lazy_table(seed: int, e: int, length: int, frac: float) -> None:
    g = torch.Generator().manual_seed(seed)
    key = torch.randint(1, 6, (e,), generator=g).to(F64) / 6  # few distinct success rates
    if seed % 5 == 0:
        key = torch.rand(e, generator=g, dtype=F64)  # many distinct: the expanded path

    def gains(p: torch.Tensor, cols: int) -> torch.Tensor:
        levels = torch.arange(2, 2 + cols, dtype=F64)[None, :]
        return p[:, None] * (1 - p[:, None]) * torch.exp(-levels * p[:, None])

    r = int(frac * e * length)
    want = _top_units_lazy(lambda cols: gains(key, cols), length, r)
    assert torch.equal(_top_units_by_key(key, gains, length, r), want)


def test_sort_memo_follows_in_place_changes() -> None:
    ids = torch.tensor([5, 1, 9, 3])
    assert _sort_ids(ids)[0].tolist() == [1, 3, 5, 9]
    ids[0] = 0
    assert _sort_ids(ids)[0].tolist() == [0, 1, 3, 9]
    other = torch.tensor([2, 1])
    assert _sort_ids(other)[1].tolist() == [1, 0]


def test_aero_grid_and_full_posterior_tables_agree() -> None:
    """AERO sizes groups on the grid of distinct posteriors; with many distinct ones it uses the full table."""
    g = torch.Generator().manual_seed(0)
    alloc = AERO(experimental=True, seed=0)
    for a, b in (
        (torch.randint(1, 5, (400,), generator=g).to(F64), torch.randint(1, 5, (400,), generator=g).to(F64)),
        (torch.rand(400, generator=g, dtype=F64) * 9 + 0.1, torch.rand(400, generator=g, dtype=F64) * 9 + 0.1),
    ):
        full = alloc._group_sizes(a, b)
        ua, ia = torch.unique(a, return_inverse=True)
        ub, ib = torch.unique(b, return_inverse=True)
        grid = alloc._group_sizes(ua.repeat_interleave(ub.numel()), ub.repeat(ua.numel()))
        row = ia * ub.numel() + ib
        for x, y in zip(full, grid, strict=True):
            assert torch.equal(x, y[row])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 1000), window=st.integers(1, 4), unseen=st.sampled_from(["prior", "nan"]))
def test_history_window_pass_rate_equals_lookup(seed: int, window: int, unseen: str) -> None:
    g = torch.Generator().manual_seed(seed)
    h = PromptHistory(window=window, unseen=unseen)  # type: ignore[arg-type]
    for step in range(3):
        ids = torch.randint(0, 30, (40,), generator=g)
        h.update(ids, torch.randint(0, 2, (40,), generator=g).double(), step=step)
    query = torch.randint(0, 45, (25,), generator=g)
    seen, rate = h._window_pass_rate(query)
    stats = h.lookup(query)
    assert torch.equal(seen, stats.seen)
    assert torch.equal(rate.isnan(), stats.window_pass_rate.isnan())
    assert torch.equal(rate.nan_to_num(-1.0), stats.window_pass_rate.nan_to_num(-1.0))
