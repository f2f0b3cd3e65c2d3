"""``rolloutopt.groups``: the ragged group structure and every segment reduction.

Hand-computed examples first, then hypothesis properties against a float64 per-group numpy loop written
independently of the library (ragged groups, size-1 groups, groups with no valid row), permutation and
relabelling invariances, dense fast path ≡ gather path ≡ general path, float64 gradchecks, and one test per
class of bad input.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups

D = torch.float64
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def f64(x: Any) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


def i64(x: Any) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def close(a: torch.Tensor, b: Any, atol: float = 1e-9) -> None:
    b = torch.as_tensor(np.asarray(b, dtype=np.float64)).to(a.dtype)
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-9)


def same(a: torch.Tensor, b: Any) -> None:
    assert a.tolist() == (b.tolist() if isinstance(b, torch.Tensor) else list(b))


# --------------------------------------------------------------------------------------------- hand examples
# ids:      7   -3    7  2**62  -3    7     -> unique [-3, 7, 2**62], sizes [2, 3, 1]
# x:        1    2    3    4     6   11
IDS = [7, -3, 7, 2**62, -3, 7]
X = [1.0, 2.0, 3.0, 4.0, 6.0, 11.0]
# valid leaves -3 with {2}, 7 with {1, 11}, 2**62 with nothing.
VALID = [True, True, False, False, False, True]


def test_structure_attributes() -> None:
    g = Groups(i64(IDS))
    same(g.ids, IDS)
    same(g.unique_ids, [-3, 7, 2**62])
    same(g.inverse, [1, 0, 1, 2, 0, 1])
    same(g.sizes, [2, 3, 1])
    same(g.offsets, [0, 2, 5, 6])
    same(g.order, [1, 4, 0, 2, 5, 3])
    same(g.position, [0, 0, 1, 0, 1, 2])
    assert (g.num_rows, g.num_groups) == (6, 3)
    assert g.dense_size is None
    assert (g.min_size, g.max_size) == (1, 3)
    assert all(t.dtype == torch.long for t in (g.ids, g.unique_ids, g.inverse, g.sizes, g.offsets, g.order))
    assert g.position.dtype == torch.long
    assert "num_groups=3" in repr(g)


def test_structure_sorted_and_dense() -> None:
    g = Groups(i64([-5, -5, 0, 0, 9, 9]))
    same(g.order, [0, 1, 2, 3, 4, 5])
    same(g.position, [0, 1, 0, 1, 0, 1])
    assert g.dense_size == 2
    g = Groups(i64([5, 1, 5, 1]))
    same(g.unique_ids, [1, 5])
    same(g.inverse, [1, 0, 1, 0])
    same(g.order, [1, 3, 0, 2])
    same(g.position, [0, 0, 1, 1])
    assert g.dense_size == 2
    one = Groups(i64([I64_MIN]))
    assert (one.num_groups, one.dense_size, one.min_size, one.max_size) == (1, 1, 1, 1)


def test_extreme_ids_and_other_int_dtypes() -> None:
    g = Groups(i64([I64_MAX, I64_MIN, 0, I64_MAX, -1]))
    same(g.unique_ids, [I64_MIN, -1, 0, I64_MAX])
    same(g.sizes, [1, 1, 1, 2])
    same(g.inverse, [3, 0, 2, 3, 1])
    g32 = Groups(torch.tensor([3, 1, 3], dtype=torch.int32))
    assert g32.ids.dtype == torch.long
    same(g32.inverse, [1, 0, 1])


def test_reductions_hand_computed() -> None:
    g, x = Groups(i64(IDS)), f64(X)
    same(g.count(), [2, 3, 1])
    close(g.sum(x), [8, 15, 4])
    close(g.mean(x), [4, 5, 4])
    close(g.var(x), [8, 28, 0])
    close(g.var(x, unbiased=False), [4, 56 / 3, 0])
    close(g.std(x), np.sqrt([8, 28, 0]))
    close(g.std(x, unbiased=False), np.sqrt([4, 56 / 3, 0]))
    close(g.min(x), [2, 1, 4])
    close(g.max(x), [6, 11, 4])
    close(g.median(x), [4, 3, 4])
    close(g.median(x, mode="lower"), [2, 3, 4])
    close(g.median(x, mode="upper"), [6, 3, 4])
    close(g.quantile(x, 0.25), [3, 2, 4])
    close(g.quantile(x, 0.0), [2, 1, 4])
    close(g.quantile(x, 1.0), [6, 11, 4])
    close(g.loo_mean(x), [7, 6, 6, 0, 2, 2])
    same(g.rank(x), [0, 0, 1, 0, 1, 2])
    same(g.rank(x, descending=True), [2, 1, 1, 0, 0, 0])
    perm, count = g.sort(x)
    same(perm, [1, 4, 0, 2, 5, 3])
    same(count, [2, 3, 1])
    close(g.broadcast(f64([10, 20, 30])), [20, 10, 20, 30, 10, 20])


def test_reductions_hand_computed_with_valid() -> None:
    g, x, v = Groups(i64(IDS)), f64(X), torch.tensor(VALID)
    same(g.count(v), [1, 2, 0])
    close(g.sum(x, v), [2, 12, 0])
    close(g.mean(x, v), [2, 6, 0])
    close(g.var(x, v), [0, 50, 0])
    close(g.var(x, v, unbiased=False), [0, 25, 0])
    close(g.std(x, v), [0, 50**0.5, 0])
    close(g.std(x, v, unbiased=False), [0, 5, 0])
    close(g.min(x, v), [2, 1, 0])
    close(g.max(x, v), [2, 11, 0])
    close(g.median(x, v), [2, 6, 0])
    close(g.median(x, v, mode="lower"), [2, 1, 0])
    close(g.median(x, v, mode="upper"), [2, 11, 0])
    close(g.quantile(x, 0.25, v), [2, 3.5, 0])
    # valid rows leave themselves out; invalid rows get the mean of their group's valid rows (0 if none)
    close(g.loo_mean(x, v), [11, 0, 6, 0, 2, 1])
    same(g.rank(x, v), [0, 0, -1, -1, -1, 1])
    same(g.rank(x, v, descending=True), [1, 0, -1, -1, -1, 0])
    perm, count = g.sort(x, v)
    same(perm, [1, 4, 0, 5, 2, 3])
    same(count, [1, 2, 0])


def test_valid_as_01_tensor_is_converted() -> None:
    g, x = Groups(i64(IDS)), f64(X)
    v = torch.tensor(VALID)
    for other in (v.long(), v.float(), v.to(torch.uint8)):
        close(g.mean(x, other), g.mean(x, v))
        same(g.count(other), g.count(v))


def test_ties_rank_by_row_position_and_median_of_ties() -> None:
    g = Groups(i64([0, 0, 0, 0]))
    x = f64([2.0, 1.0, 2.0, 1.0])
    same(g.rank(x), [2, 0, 3, 1])
    same(g.rank(x, descending=True), [0, 2, 1, 3])
    close(g.median(x), [1.5])
    close(g.median(x, mode="lower"), [1.0])
    close(g.median(x, mode="upper"), [2.0])


def test_dtypes() -> None:
    g = Groups(i64([0, 0, 1]))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.tensor([1.0, 2.0, 4.0], dtype=dtype)
        for out in (g.sum(x), g.mean(x), g.std(x), g.median(x), g.quantile(x, 0.5), g.loo_mean(x), g.max(x)):
            assert out.dtype == torch.float32
    assert g.mean(f64([1.0, 2.0, 4.0])).dtype == D
    assert g.count().dtype == g.count(torch.tensor([True, False, True])).dtype == torch.long
    assert g.rank(f64([1.0, 2.0, 4.0])).dtype == torch.long


def test_size_one_and_constant_groups_are_zero_not_nan() -> None:
    g = Groups(i64([0, 1, 1, 2, 2]))
    x = f64([5.0, 3.0, 3.0, 1.0, 2.0]).requires_grad_()
    v = torch.tensor([True, True, True, False, False])
    close(g.var(x), [0, 0, 0.5])
    close(g.var(x, unbiased=False), [0, 0, 0.25])
    close(g.loo_mean(x), [0, 3, 3, 2, 1])
    outs = [
        g.std(x),
        g.std(x, v),
        g.std(x, unbiased=False),
        g.mean(x, v),
        g.var(x, v),
        g.median(x, v),
        g.quantile(x, 0.3, v),
        g.min(x, v),
        g.max(x, v),
        g.loo_mean(x, v),
    ]
    for out in outs:
        assert torch.isfinite(out).all()
    torch.stack([o.sum() for o in outs]).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # std of a constant group: value 0 and gradient 0 (sqrt at 0 would give inf/NaN)
    y = f64([3.0, 3.0]).requires_grad_()
    Groups(i64([4, 4])).std(y).sum().backward()
    assert y.grad is not None
    same(y.grad, [0.0, 0.0])


def test_all_rows_invalid() -> None:
    g = Groups(i64([3, 1, 3]))
    x = f64([1.0, 2.0, 3.0])
    v = torch.zeros(3, dtype=torch.bool)
    for out in (g.sum(x, v), g.mean(x, v), g.var(x, v), g.std(x, v), g.min(x, v), g.max(x, v), g.median(x, v)):
        same(out, [0.0, 0.0])
    same(g.quantile(x, 0.7, v), [0.0, 0.0])
    same(g.loo_mean(x, v), [0.0, 0.0, 0.0])
    same(g.rank(x, v), [-1, -1, -1])
    same(g.count(v), [0, 0])


# ------------------------------------------------------------------------------------------ numpy oracle
def ref_stats(ids: np.ndarray, x: np.ndarray, valid: np.ndarray, q: float) -> dict[str, np.ndarray]:
    """Per-group statistics by a plain loop over the sorted unique ids (the documented conventions)."""
    out: dict[str, list[float]] = {
        k: [] for k in ("count", "sum", "mean", "var", "pvar", "std", "pstd", "min", "max", "med", "lo", "hi", "quant")
    }
    for u in sorted(set(ids.tolist())):
        v = np.sort(x[(ids == u) & valid])
        n = len(v)
        out["count"].append(n)
        out["sum"].append(v.sum() if n else 0.0)
        out["mean"].append(v.mean() if n else 0.0)
        out["var"].append(v.var(ddof=1) if n > 1 else 0.0)
        out["pvar"].append(v.var() if n > 0 else 0.0)
        out["std"].append(v.std(ddof=1) if n > 1 else 0.0)
        out["pstd"].append(v.std() if n > 0 else 0.0)
        out["min"].append(v.min() if n else 0.0)
        out["max"].append(v.max() if n else 0.0)
        out["med"].append(np.median(v) if n else 0.0)
        out["lo"].append(v[(n - 1) // 2] if n else 0.0)
        out["hi"].append(v[n // 2] if n else 0.0)
        out["quant"].append(np.quantile(v, q) if n else 0.0)
    return {k: np.asarray(val, dtype=np.float64) for k, val in out.items()}


def ref_rows(ids: np.ndarray, x: np.ndarray, valid: np.ndarray) -> dict[str, np.ndarray]:
    """Per-row leave-one-out mean and ordinal ranks (ties by row position), by a loop over rows."""
    b = len(ids)
    loo, rank, rank_desc = np.zeros(b), np.full(b, -1), np.full(b, -1)
    for i in range(b):
        peers = [j for j in range(b) if ids[j] == ids[i] and valid[j] and j != i]
        loo[i] = np.mean(x[peers]) if peers else 0.0
        if valid[i]:
            rank[i] = sum(1 for j in peers if (x[j], j) < (x[i], i))
            rank_desc[i] = sum(1 for j in peers if (-x[j], j) < (-x[i], i))
    return {"loo": loo, "rank": rank, "rank_desc": rank_desc}


def lib_stats(g: Groups, x: torch.Tensor, valid: torch.Tensor | None, q: float) -> dict[str, torch.Tensor]:
    return {
        "count": g.count(valid),
        "sum": g.sum(x, valid),
        "mean": g.mean(x, valid),
        "var": g.var(x, valid),
        "pvar": g.var(x, valid, unbiased=False),
        "std": g.std(x, valid),
        "pstd": g.std(x, valid, unbiased=False),
        "min": g.min(x, valid),
        "max": g.max(x, valid),
        "med": g.median(x, valid),
        "lo": g.median(x, valid, mode="lower"),
        "hi": g.median(x, valid, mode="upper"),
        "quant": g.quantile(x, q, valid),
    }


def lib_rows(g: Groups, x: torch.Tensor, valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {"loo": g.loo_mean(x, valid), "rank": g.rank(x, valid), "rank_desc": g.rank(x, valid, descending=True)}


values = st.one_of(
    st.integers(-4, 4).map(lambda v: v / 2),  # many ties
    st.floats(-100, 100, allow_nan=False, allow_infinity=False),
)


@st.composite
def batches(draw: st.DrawFn, dense: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ragged (or dense) groups with arbitrary int64 labels in shuffled row order; size-1 groups, groups with
    no valid row (one group may be blanked on purpose) and rows with tied values are all in reach."""
    n_groups = draw(st.integers(1, 5))
    if dense:
        sizes = [draw(st.integers(1, 4))] * n_groups
    else:
        sizes = draw(st.lists(st.integers(1, 5), min_size=n_groups, max_size=n_groups))
    labels = draw(st.lists(st.integers(I64_MIN, I64_MAX), min_size=n_groups, max_size=n_groups, unique=True))
    ids = np.repeat(np.asarray(labels, dtype=np.int64), sizes)
    b = len(ids)
    ids = ids[np.asarray(draw(st.permutations(range(b))), dtype=np.int64)]
    x = np.asarray(draw(st.lists(values, min_size=b, max_size=b)), dtype=np.float64)
    valid = np.asarray(draw(st.lists(st.booleans(), min_size=b, max_size=b)), dtype=bool)
    blank = draw(st.sampled_from([None, *labels]))
    if blank is not None:
        valid[ids == blank] = False
    return ids, x, valid


def check_against_reference(ids: np.ndarray, x: np.ndarray, valid: np.ndarray | None, q: float) -> None:
    g = Groups(torch.from_numpy(ids))
    xt = torch.from_numpy(x)
    vt = None if valid is None else torch.from_numpy(valid)
    vv = np.ones(len(ids), dtype=bool) if valid is None else valid
    want, got = ref_stats(ids, x, vv, q), lib_stats(g, xt, vt, q)
    for key in want:
        close(got[key].double(), want[key], atol=1e-8)
    want_rows, got_rows = ref_rows(ids, x, vv), lib_rows(g, xt, vt)
    for key in want_rows:
        close(got_rows[key].double(), want_rows[key], atol=1e-8)
    same(g.unique_ids, sorted(set(ids.tolist())))
    same(g.sizes, [int((ids == u).sum()) for u in sorted(set(ids.tolist()))])


@given(batches(), st.floats(0, 1))
def test_matches_numpy_loop(batch: tuple[np.ndarray, np.ndarray, np.ndarray], q: float) -> None:
    ids, x, valid = batch
    check_against_reference(ids, x, valid, q)
    check_against_reference(ids, x, None, q)


@given(batches(dense=True), st.floats(0, 1))
def test_matches_numpy_loop_dense(batch: tuple[np.ndarray, np.ndarray, np.ndarray], q: float) -> None:
    ids, x, valid = batch
    check_against_reference(ids, x, None, q)
    check_against_reference(ids, x, valid, q)
    srt = np.argsort(ids, kind="stable")
    check_against_reference(ids[srt], x[srt], None, q)


@given(batches(), st.data())
def test_structure_invariants(batch: tuple[np.ndarray, np.ndarray, np.ndarray], data: st.DataObject) -> None:
    ids = torch.from_numpy(batch[0])
    g = Groups(ids)
    same(g.unique_ids[g.inverse], ids)
    same(g.inverse[g.order], torch.sort(g.inverse, stable=True).values)
    same(torch.sort(g.order).values, torch.arange(g.num_rows))
    same(g.offsets[1:] - g.offsets[:-1], g.sizes)
    assert int(g.offsets[-1]) == g.num_rows
    for r in range(g.num_rows):
        grp = int(g.inverse[r])
        members = g.order[g.offsets[grp] : g.offsets[grp + 1]].tolist()
        assert members == sorted(members)  # stable: rows of a group in row order
        assert members.index(r) == int(g.position[r])
    assert g.dense_size == (g.max_size if g.min_size == g.max_size else None)
    assert (g.min_size, g.max_size) == (int(g.sizes.min()), int(g.sizes.max()))


@given(batches(), st.data())
def test_row_permutation_permutes_results(batch: tuple[np.ndarray, np.ndarray, np.ndarray], data: Any) -> None:
    ids, x, valid = batch
    b = len(ids)
    p = torch.tensor(data.draw(st.permutations(range(b))), dtype=torch.long)
    x = np.random.default_rng(len(ids)).permutation(b).astype(np.float64)  # distinct values: ranks have no ties
    g, gp = Groups(torch.from_numpy(ids)), Groups(torch.from_numpy(ids)[p])
    xt, vt = torch.from_numpy(x), torch.from_numpy(valid)
    for v, vp in ((None, None), (vt, vt[p])):
        a, c = lib_stats(g, xt, v, 0.3), lib_stats(gp, xt[p], vp, 0.3)
        for key in a:
            close(c[key].double(), a[key].double(), atol=1e-8)
        ra, rc = lib_rows(g, xt, v), lib_rows(gp, xt[p], vp)
        for key in ra:
            close(rc[key].double(), ra[key][p].double(), atol=1e-8)


@given(batches(), st.data())
def test_relabelling_ids_keeps_row_results(batch: tuple[np.ndarray, np.ndarray, np.ndarray], data: Any) -> None:
    ids, x, valid = batch
    labels = sorted(set(ids.tolist()))
    new = data.draw(st.lists(st.integers(I64_MIN, I64_MAX), min_size=len(labels), max_size=len(labels), unique=True))
    mapping = dict(zip(labels, new, strict=True))
    ids2 = np.asarray([mapping[i] for i in ids.tolist()], dtype=np.int64)
    g, g2 = Groups(torch.from_numpy(ids)), Groups(torch.from_numpy(ids2))
    xt, vt = torch.from_numpy(x), torch.from_numpy(valid)
    for v in (None, vt):
        a, c = lib_stats(g, xt, v, 0.6), lib_stats(g2, xt, v, 0.6)
        for key in a:
            close(g2.broadcast(c[key]).double(), g.broadcast(a[key]).double(), atol=1e-8)
        ra, rc = lib_rows(g, xt, v), lib_rows(g2, xt, v)
        for key in ra:
            close(rc[key].double(), ra[key].double(), atol=1e-8)


@given(batches(dense=True), st.floats(0, 1))
def test_dense_fast_path_equals_general_path(batch: tuple[np.ndarray, np.ndarray, np.ndarray], q: float) -> None:
    ids, x, _ = batch
    srt = np.argsort(ids, kind="stable")
    g_sorted = Groups(torch.from_numpy(ids[srt]))  # reshape fast path
    g_shuffled = Groups(torch.from_numpy(ids))  # gather fast path
    assert g_sorted.dense_size is not None and g_shuffled.dense_size == g_sorted.dense_size
    xs, xt = torch.from_numpy(x[srt]), torch.from_numpy(x)
    everyone = torch.ones(len(ids), dtype=torch.bool)  # a valid mask forces the general (scatter) path
    fast_sorted = lib_stats(g_sorted, xs, None, q)
    fast_gather = lib_stats(g_shuffled, xt, None, q)
    general = lib_stats(g_shuffled, xt, everyone, q)
    for key in general:
        close(fast_sorted[key].double(), general[key].double(), atol=1e-8)
        close(fast_gather[key].double(), general[key].double(), atol=1e-8)


def test_dense_path_is_taken_and_agrees_on_shuffled_rows() -> None:
    g = Groups(i64([2, 9, 2, 9, 9, 2]))
    x = f64([4.0, -1.0, 0.5, 3.0, 2.0, 8.0])
    assert g.dense_size == 3 and not g.rows_sorted
    everyone = torch.ones(6, dtype=torch.bool)
    close(g.median(x), [4.0, 2.0])
    close(g.median(x), g.median(x, everyone))
    close(g.var(x), g.var(x, everyone))
    close(g.min(x), [0.5, -1.0])
    close(g.max(x), [8.0, 3.0])
    close(g.quantile(x, 0.75), g.quantile(x, 0.75, everyone))


# ------------------------------------------------------------------------------------------------ gradients
def _gradcheck_inputs() -> list[tuple[Groups, torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for ids, valid in (
        ([3, -1, 3, 8, -1, 3, 5], None),
        ([3, -1, 3, 8, -1, 3, 5], [True, True, True, False, True, False, True]),
        ([1, 0, 1, 0, 1, 0], None),  # dense, gather path
        ([1, 0, 1, 0, 1, 0], [True, False, True, True, True, True]),
    ):
        b = len(ids)
        x = (torch.randperm(b, generator=gen).to(D) + 0.3 * torch.rand(b, generator=gen, dtype=D)).requires_grad_()
        cases.append((Groups(i64(ids)), x, None if valid is None else torch.tensor(valid)))
    return cases


@pytest.mark.parametrize(
    "name",
    ["mean", "std", "std_pop", "loo_mean", "median", "median_lower", "quantile"],
)
def test_gradcheck(name: str) -> None:
    for g, x, v in _gradcheck_inputs():
        fns = {
            "mean": lambda t, g=g, v=v: g.mean(t, v),
            "std": lambda t, g=g, v=v: g.std(t, v),
            "std_pop": lambda t, g=g, v=v: g.std(t, v, unbiased=False),
            "loo_mean": lambda t, g=g, v=v: g.loo_mean(t, v),
            "median": lambda t, g=g, v=v: g.median(t, v),
            "median_lower": lambda t, g=g, v=v: g.median(t, v, mode="lower"),
            "quantile": lambda t, g=g, v=v: g.quantile(t, 0.3, v),
        }
        assert torch.autograd.gradcheck(fns[name], (x,), eps=1e-6, atol=1e-6)


def test_mean_gradient_hand_computed() -> None:
    x = f64([1.0, 2.0, 3.0]).requires_grad_()
    Groups(i64([0, 0, 1])).mean(x, torch.tensor([True, False, True])).sum().backward()
    assert x.grad is not None
    same(x.grad, [1.0, 0.0, 1.0])


# --------------------------------------------------------------------------------------------- bad inputs
def test_float_ids() -> None:
    with pytest.raises(InputError, match=r"^group: .*int64"):
        Groups(torch.tensor([0.0, 1.0]))
    with pytest.raises(InputError, match=r"^group"):
        Groups(torch.tensor([True, False]))


def test_two_d_ids() -> None:
    with pytest.raises(InputError, match=r"^group: .*1-d"):
        Groups(i64([[0, 1], [1, 0]]))
    with pytest.raises(InputError, match=r"^group"):
        Groups(i64(3))


def test_empty_ids() -> None:
    with pytest.raises(InputError, match=r"^group: .*at least one id"):
        Groups(torch.zeros(0, dtype=torch.long))


def test_ids_not_a_tensor() -> None:
    with pytest.raises(InputError, match=r"^group: .*torch.Tensor"):
        Groups([0, 1])  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["sum", "mean", "var", "std", "min", "max", "median", "loo_mean", "rank", "sort"])
def test_wrong_length_x_and_valid(method: str) -> None:
    g = Groups(i64([0, 0, 1]))
    fn = getattr(g, method)
    with pytest.raises(InputError, match=r"^x: .*B=3"):
        fn(f64([1.0, 2.0]))
    with pytest.raises(InputError, match=r"^x: "):
        fn(f64([[1.0, 2.0, 3.0]]))
    with pytest.raises(InputError, match=r"^valid: .*B=3"):
        fn(f64([1.0, 2.0, 3.0]), torch.tensor([True, False]))
    with pytest.raises(InputError, match=r"^valid: .*0 and 1"):
        fn(f64([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(InputError, match=r"^valid: .*0 and 1"):
        fn(f64([1.0, 2.0, 3.0]), torch.tensor([2, 0, 1]))


def test_wrong_valid_for_count_and_quantile() -> None:
    g = Groups(i64([0, 0, 1]))
    with pytest.raises(InputError, match=r"^valid: .*B=3"):
        g.count(torch.tensor([True, True, True, True]))
    with pytest.raises(InputError, match=r"^valid: .*0 and 1"):
        g.count(torch.tensor([3, 0, 1]))
    with pytest.raises(InputError, match=r"^x: .*B=3"):
        g.quantile(f64([1.0]), 0.5)
    with pytest.raises(InputError, match=r"^valid: "):
        g.quantile(f64([1.0, 2.0, 3.0]), 0.5, torch.tensor([True]))


def test_non_float_x() -> None:
    with pytest.raises(InputError, match=r"^x: .*floating"):
        Groups(i64([0, 0, 1])).mean(i64([1, 2, 3]))


def test_bad_quantile_and_mode() -> None:
    g, x = Groups(i64([0, 0, 1])), f64([1.0, 2.0, 3.0])
    for q in (-0.1, 1.5, float("nan"), "0.5"):
        with pytest.raises(InputError, match=r"^q: "):
            g.quantile(x, q)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^mode: .*'average'"):
        g.median(x, mode="middle")  # type: ignore[arg-type]


def test_as_groups() -> None:
    from rolloutopt._validation import Dims

    g = Groups(i64([0, 1, 1]))
    assert as_groups(g) is g
    same(as_groups(i64([4, 2, 4])).unique_ids, [2, 4])
    dims = Dims()
    dims.check(f64([1.0, 2.0]), "rewards", "B")
    with pytest.raises(InputError, match=r"^group: expected 2 ids \(B from rewards\), got 3 ids"):
        as_groups(g, dims)
    fresh = Dims()
    as_groups(g, fresh)
    assert fresh["B"] == 3


def test_checks_off_skips_shape_checks_but_keeps_conversions() -> None:
    g = Groups(i64([0, 0, 1]))
    with rolloutopt.checks(False):
        out = g.mean(torch.tensor([1.0, 3.0, 5.0], dtype=torch.bfloat16), torch.tensor([1, 0, 1]))
    assert out.dtype == torch.float32
    close(out.double(), [1.0, 5.0])


def test_broadcast_wrong_length() -> None:
    g = Groups(i64([0, 0, 1]))
    close(g.broadcast(f64([[1.0, 2.0], [3.0, 4.0]])), [[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]])  # [G, K] is fine
    with pytest.raises(InputError, match=r"^stat: .*G=2"):
        g.broadcast(f64([1.0, 2.0, 3.0]))  # a per-row tensor, not per-group
    with pytest.raises(InputError, match=r"^stat: "):
        g.broadcast(f64(1.0))


def test_from_labels_hand_computed() -> None:
    g = Groups.from_labels(np.array(["b", "b", "a", "c", "a"], dtype=object))
    assert g.ids.tolist() == [1, 1, 4, 3, 4]
    assert g.sizes.tolist() == [2, 1, 2]
    assert g.mean(torch.tensor([1.0, 3.0, 4.0, 7.0, 6.0])).tolist() == [2.0, 7.0, 5.0]
    blocks = Groups.from_labels(["u1"] * 3 + ["u0"] * 3)  # consecutive blocks: sorted ids, identity order
    assert blocks.ids.tolist() == [2, 2, 2, 5, 5, 5]
    assert blocks.dense_size == 3
    assert blocks.order.tolist() == list(range(6))


@given(st.lists(st.integers(-5, 5), min_size=1, max_size=40))
def test_from_labels_same_partition_as_int_ids(labels: list[int]) -> None:
    from_labels = Groups.from_labels([f"uid-{x}" for x in labels])
    from_ids = Groups(torch.tensor(labels))
    x = torch.linspace(-1, 1, len(labels))
    # Same partition of rows: every per-row statistic agrees, whatever the numbering of the groups.
    torch.testing.assert_close(from_labels.broadcast(from_labels.mean(x)), from_ids.broadcast(from_ids.mean(x)))
    assert (from_labels.position == from_ids.position).all()
    assert sorted(from_labels.sizes.tolist()) == sorted(from_ids.sizes.tolist())


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        ("abc", "labels"),
        (torch.arange(3), "labels"),
        (np.zeros((2, 2)), "labels"),
        ([[1], [2]], "labels"),
        ([], "group"),
    ],
)
def test_from_labels_bad_input(labels: Any, match: str) -> None:
    with pytest.raises(InputError, match=match):
        Groups.from_labels(labels)


def test_quantile_rejects_bool_q() -> None:
    with pytest.raises(InputError, match="q"):
        Groups(torch.tensor([0, 0, 1])).quantile(torch.tensor([1.0, 2.0, 3.0]), True)
