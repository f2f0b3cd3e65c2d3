"""Loss aggregation: verl golden values (``agg_loss``, measured on verl 0.9.1), prompt-mean, explicit denominators,
edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses import AGG_MODES, Denominators, aggregate

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 2.5),
        ("token-sum", 10.0),
        ("seq-mean-token-sum", 5.0),
        ("seq-mean-token-mean", 3.0),
        ("seq-mean-token-sum-norm", 10.0 / 6.0),
    ],
)
def test_verl_golden_values(mode: str, expected: float) -> None:
    out = aggregate(LOSS, MASK, mode, max_len=3)  # type: ignore[arg-type]
    assert out.shape == ()
    assert float(out) == pytest.approx(expected, rel=1e-6)


def test_masked_values_do_not_enter() -> None:
    garbage = LOSS.clone()
    garbage[1, 1:] = torch.tensor([float("nan"), float("inf")])
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert torch.equal(aggregate(garbage, MASK, mode, max_len=3), aggregate(LOSS, MASK, mode, max_len=3))  # type: ignore[arg-type]


def test_default_mode_is_token_mean_and_mask_may_be_01() -> None:
    assert float(aggregate(LOSS, MASK)) == 2.5
    assert float(aggregate(LOSS, MASK.long())) == 2.5
    assert float(aggregate(LOSS, MASK.float())) == 2.5


def test_seq_mean_token_sum_norm_uses_max_len_not_padded_width() -> None:
    # same numbers padded to width 5: the result must not change (max_len is a constant)
    padded = torch.cat([LOSS, torch.full((2, 2), 7.0)], 1)
    pmask = torch.cat([MASK, torch.zeros(2, 2, dtype=torch.bool)], 1)
    assert float(aggregate(padded, pmask, "seq-mean-token-sum-norm", max_len=3)) == pytest.approx(10 / 6)
    assert float(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_len=10)) == pytest.approx(10 / 20)


def test_prompt_mean_hand_example() -> None:
    # rows 0, 2 in group 7; row 1 in group -3; row 3 in group 9 has no token
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 0.0, 0.0], [100.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    group = torch.tensor([7, -3, 7, 9])
    # group 7: (1+2+3+6)/4 = 3 ; group -3: (4+5)/2 = 4.5 ; group 9 empty, leaves the count -> (3+4.5)/2
    out = aggregate(per_token, mask, "prompt-mean", group=group)
    assert float(out) == pytest.approx(3.75)
    assert float(aggregate(per_token, mask, "prompt-mean", group=Groups(group))) == pytest.approx(3.75)
    # explicit group count and world size
    out = aggregate(per_token, mask, "prompt-mean", group=group, denominators=Denominators(groups=5, world_size=2))
    assert float(out) == pytest.approx(7.5 / 5 * 2)


def test_prompt_mean_differs_from_token_mean() -> None:
    per_token = torch.tensor([[1.0, 1.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    assert float(aggregate(per_token, mask, "prompt-mean", group=torch.tensor([0, 1]))) == pytest.approx(2.0)
    assert float(aggregate(per_token, mask, "prompt-mean", group=torch.tensor([0, 0]))) == pytest.approx(5 / 3)


@pytest.mark.parametrize(
    ("mode", "denominators", "expected"),
    [
        ("token-mean", Denominators(tokens=8), 10 / 8),
        ("token-mean", Denominators(tokens=8, world_size=4), 10 / 8 * 4),
        ("token-mean", Denominators(tokens=torch.tensor(20.0)), 0.5),
        ("token-sum", Denominators(world_size=3), 30.0),
        ("token-sum", Denominators(tokens=100), 10.0),  # token-sum has no denominator
        ("seq-mean-token-sum", Denominators(sequences=4), 10 / 4),
        ("seq-mean-token-sum", Denominators(sequences=4, world_size=2), 10 / 4 * 2),
        ("seq-mean-token-mean", Denominators(sequences=6), 6 / 6),
        ("seq-mean-token-sum-norm", Denominators(sequences=5), 10 / (5 * 3)),
        ("seq-mean-token-mean", Denominators(tokens=1000), 3.0),  # tokens do not enter a sequence mode
    ],
)
def test_explicit_denominators(mode: str, denominators: Denominators, expected: float) -> None:
    out = aggregate(LOSS, MASK, mode, denominators=denominators, max_len=3)  # type: ignore[arg-type]
    assert float(out) == pytest.approx(expected, rel=1e-6)


def test_rank_losses_sum_to_global_loss() -> None:
    # split rows over 2 "ranks"; with global denominators and world_size, the mean over ranks is the global loss
    torch.manual_seed(0)
    per_token = torch.randn(6, 4)
    mask = torch.rand(6, 4) > 0.3
    mask[5] = False
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        full = aggregate(per_token, mask, mode, max_len=4)  # type: ignore[arg-type]
        d = Denominators(tokens=mask.sum(), sequences=(mask.sum(-1) > 0).sum(), world_size=2)
        parts = [aggregate(per_token[s], mask[s], mode, denominators=d, max_len=4) for s in (slice(0, 2), slice(2, 6))]  # type: ignore[arg-type]
        torch.testing.assert_close((parts[0] + parts[1]) / 2, full)


@pytest.mark.parametrize("mode", [m for m in AGG_MODES if m != "prompt-mean"])
def test_empty_batch_gives_zero(mode: str) -> None:
    out = aggregate(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool), mode, max_len=3)  # type: ignore[arg-type]
    assert out.shape == () and float(out) == 0.0
    out = aggregate(torch.full((2, 3), 5.0), torch.zeros(2, 3, dtype=torch.bool), mode, max_len=3)  # type: ignore[arg-type]
    assert float(out) == 0.0


def test_all_masked_prompt_mean_gives_zero() -> None:
    out = aggregate(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), "prompt-mean", group=torch.tensor([0, 1]))
    assert float(out) == 0.0


def test_all_masked_rows_leave_sequence_counts() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    assert float(aggregate(per_token, mask, "seq-mean-token-sum")) == pytest.approx(5.0)
    assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", max_len=3)) == pytest.approx(10 / 6)
    assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx(2.5)


def test_denominator_mask() -> None:
    # a token removed from the numerator can stay in the denominators
    keep = MASK.clone()
    keep[0, 2] = False
    assert float(aggregate(LOSS, keep, "token-mean")) == pytest.approx(7 / 3)
    assert float(aggregate(LOSS, keep, "token-mean", denominator_mask=MASK)) == pytest.approx(7 / 4)
    assert float(aggregate(LOSS, keep, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2)
    assert float(aggregate(LOSS, keep, "seq-mean-token-mean", denominator_mask=MASK)) == pytest.approx((1 + 4) / 2)
    # a row emptied by the keep mask still counts as a sequence when it stays in the denominator
    keep[1, 0] = False
    assert float(aggregate(LOSS, keep, "seq-mean-token-sum")) == pytest.approx(3.0)
    assert float(aggregate(LOSS, keep, "seq-mean-token-sum", denominator_mask=MASK)) == pytest.approx(1.5)
    g = torch.tensor([0, 0])
    assert float(aggregate(LOSS, keep, "prompt-mean", group=g, denominator_mask=MASK)) == pytest.approx(3 / 4)


def test_gradient_of_token_mean() -> None:
    x = LOSS.clone().requires_grad_()
    aggregate(x, MASK, "seq-mean-token-mean").backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0.0, 0.0]]))


def test_half_precision_upcast() -> None:
    out = aggregate(LOSS.bfloat16(), MASK)
    assert out.dtype == torch.float32 and float(out) == 2.5
    assert aggregate(LOSS.double(), MASK).dtype == torch.float64


def test_unknown_mode() -> None:
    with pytest.raises(InputError) as e:
        aggregate(LOSS, MASK, "mean")  # type: ignore[arg-type]
    assert e.value.argument == "mode"
    assert "token-mean" in str(e.value)


@pytest.mark.parametrize("max_len", [None, 0, -3, 2.5, "3"])
def test_missing_or_bad_max_len(max_len: object) -> None:
    with pytest.raises(InputError) as e:
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_len=max_len)  # type: ignore[arg-type]
    assert e.value.argument == "max_len"


def test_prompt_mean_needs_group() -> None:
    with pytest.raises(InputError) as e:
        aggregate(LOSS, MASK, "prompt-mean")
    assert e.value.argument == "group"
    with pytest.raises(InputError) as e:
        aggregate(LOSS, MASK, "prompt-mean", group=torch.tensor([0, 1, 2]))
    assert e.value.argument == "group"


@pytest.mark.parametrize("world_size", [0, -1, 1.0, 2.5, "2", None])
def test_bad_world_size(world_size: object) -> None:
    with pytest.raises(InputError) as e:
        Denominators(world_size=world_size)  # type: ignore[arg-type]
    assert e.value.argument == "Denominators.world_size"


def test_bad_tensors() -> None:
    with pytest.raises(InputError) as e:
        aggregate(LOSS, MASK[:, :2])
    assert e.value.argument == "mask"
    with pytest.raises(InputError) as e:
        aggregate(LOSS, MASK.long() * 2)
    assert e.value.argument == "mask"
    with pytest.raises(InputError) as e:
        aggregate(LOSS.long(), MASK)
    assert e.value.argument == "per_token"
    with pytest.raises(InputError) as e:
        aggregate(LOSS[0], MASK[0])
    assert e.value.argument == "per_token"
    with pytest.raises(InputError) as e:
        aggregate(LOSS, MASK, denominator_mask=MASK[:1])
    assert e.value.argument == "denominator_mask"


def test_bools_are_not_counts() -> None:
    with pytest.raises(InputError, match="world_size"):
        Denominators(world_size=True)
    with pytest.raises(InputError, match="max_len"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_len=True)


# ------------------------------------------------------------------------------------ hypothesis properties

D = torch.float64
GARBAGE = [math.inf, -math.inf, math.nan, 1e300]


def _fl(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)


def _mask_rows(draw: st.DrawFn, b: int, n: int) -> list[list[bool]]:
    rows = []
    for _ in range(b):
        kind = draw(st.sampled_from(["none", "all", "random", "random"]))
        rows.append(
            [False] * n
            if kind == "none"
            else [True] * n
            if kind == "all"
            else draw(st.lists(st.booleans(), min_size=n, max_size=n))
        )
    return rows


@st.composite
def agg_batches(draw: st.DrawFn, min_b: int = 1) -> dict[str, object]:
    """Ragged batch: per_token [B, T] fp64, mask (with all-masked rows), group ids, max_len, optional dm."""
    b, n = draw(st.integers(min_b, 6)), draw(st.integers(1, 8))
    x = draw(st.lists(_fl(-100.0, 100.0), min_size=b * n, max_size=b * n))
    labels = draw(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=b, unique=True))
    group = [draw(st.sampled_from(labels)) for _ in range(b)]
    dm = draw(st.one_of(st.none(), st.just(_mask_rows(draw, b, n))))
    return {
        "x": torch.tensor(x, dtype=D).view(b, n),
        "mask": torch.tensor(_mask_rows(draw, b, n)),
        "group": torch.tensor(group),
        "max_len": draw(st.integers(1, 16)),
        "dm": None if dm is None else torch.tensor(dm),
    }


def _agg(batch: dict[str, object], mode: str, x: torch.Tensor | None = None, **kw: object) -> torch.Tensor:
    return aggregate(
        batch["x"] if x is None else x,  # type: ignore[arg-type]
        batch["mask"],  # type: ignore[arg-type]
        mode,  # type: ignore[arg-type]
        group=batch["group"],  # type: ignore[arg-type]
        max_len=batch["max_len"],  # type: ignore[arg-type]
        denominator_mask=batch["dm"],  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _loop_reference(batch: dict[str, object], mode: str) -> float:
    """The module docstring's formulas, one Python loop per sum (math.fsum)."""
    x, m, g = batch["x"].tolist(), batch["mask"].tolist(), batch["group"].tolist()  # type: ignore[union-attr]
    dm = m if batch["dm"] is None else batch["dm"].tolist()  # type: ignore[union-attr]
    b, n = len(x), len(x[0])
    row_sum = [math.fsum(x[i][j] for j in range(n) if m[i][j]) for i in range(b)]
    row_len = [sum(dm[i]) for i in range(b)]
    n_tokens = max(sum(row_len), 1)
    n_seqs = max(sum(1 for ln in row_len if ln > 0), 1)
    if mode == "token-mean":
        return math.fsum(row_sum) / n_tokens
    if mode == "token-sum":
        return math.fsum(row_sum)
    if mode == "seq-mean-token-mean":
        return math.fsum(row_sum[i] / max(row_len[i], 1) for i in range(b)) / n_seqs
    if mode == "seq-mean-token-sum":
        return math.fsum(row_sum) / n_seqs
    if mode == "seq-mean-token-sum-norm":
        return math.fsum(row_sum) / (n_seqs * batch["max_len"])  # type: ignore[operator]
    assert mode == "prompt-mean"
    per_group, n_groups = [], 0
    for label in sorted(set(g)):
        rows = [i for i in range(b) if g[i] == label]
        count = sum(row_len[i] for i in rows)
        per_group.append(math.fsum(row_sum[i] for i in rows) / max(count, 1))
        n_groups += count > 0
    return math.fsum(per_group) / max(n_groups, 1)


def _close(a: torch.Tensor, b: torch.Tensor | float, scale: float = 1.0) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=D), rtol=1e-10, atol=1e-10 * scale)


@given(agg_batches())
def test_prop_matches_loop_reference(batch: dict[str, object]) -> None:
    for mode in AGG_MODES:
        out = _agg(batch, mode)
        assert out.shape == () and out.dtype == D
        _close(out, _loop_reference(batch, mode))


@given(agg_batches(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_prop_finite_output_and_gradient(batch: dict[str, object], dtype: torch.dtype) -> None:
    x = batch["x"].to(dtype).requires_grad_(True)  # type: ignore[union-attr]
    for mode in AGG_MODES:
        x.grad = None
        out = _agg(batch, mode, x)
        assert out.dtype == torch.float32 and torch.isfinite(out)
        out.backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()


@given(agg_batches(), st.data())
def test_prop_row_permutation_and_group_relabelling(batch: dict[str, object], data: st.DataObject) -> None:
    x = batch["x"]
    assert isinstance(x, torch.Tensor)
    perm = torch.tensor(data.draw(st.permutations(list(range(x.shape[0])))))
    labels = sorted(set(batch["group"].tolist()))  # type: ignore[union-attr]
    new = data.draw(st.lists(st.integers(-(2**62), 2**62), min_size=len(labels), max_size=len(labels), unique=True))
    relabel = dict(zip(labels, new, strict=True))
    permuted = {
        **batch,
        "x": x[perm],
        "mask": batch["mask"][perm],  # type: ignore[index]
        "group": torch.tensor([relabel[int(i)] for i in batch["group"][perm]]),  # type: ignore[index]
        "dm": None if batch["dm"] is None else batch["dm"][perm],  # type: ignore[index]
    }
    scale = float(x.abs().sum()) + 1
    for mode in AGG_MODES:
        _close(_agg(permuted, mode), _agg(batch, mode), scale)


@given(agg_batches(), st.data())
def test_prop_masked_out_values_do_not_matter(batch: dict[str, object], data: st.DataObject) -> None:
    x, mask = batch["x"], batch["mask"]
    assert isinstance(x, torch.Tensor) and isinstance(mask, torch.Tensor)
    junk = torch.tensor(data.draw(st.lists(st.sampled_from(GARBAGE), min_size=x.numel(), max_size=x.numel())))
    bad = torch.where(mask, x, junk.view_as(x).to(D))
    for mode in AGG_MODES:
        grads = []
        for v in (x, bad):
            leaf = v.clone().requires_grad_(True)
            out = _agg(batch, mode, leaf)
            out.backward()
            assert leaf.grad is not None
            grads.append((out.detach(), leaf.grad))
        assert torch.equal(grads[0][0], grads[1][0]), mode
        assert torch.equal(grads[0][1], grads[1][1]), mode
        assert torch.equal(grads[1][1][~mask], torch.zeros_like(grads[1][1][~mask])), mode


@given(agg_batches(), _fl(-10.0, 10.0), st.data())
def test_prop_linear_in_per_token(batch: dict[str, object], a: float, data: st.DataObject) -> None:
    x = batch["x"]
    assert isinstance(x, torch.Tensor)
    y = torch.tensor(data.draw(st.lists(_fl(-100.0, 100.0), min_size=x.numel(), max_size=x.numel())), dtype=D)
    y = y.view_as(x)
    scale = 11 * (float(x.abs().sum()) + float(y.abs().sum()) + 1)
    for mode in AGG_MODES:
        _close(_agg(batch, mode, a * x + y), a * _agg(batch, mode) + _agg(batch, mode, y), scale)


@given(agg_batches(min_b=2), st.data())
def test_prop_two_ranks_with_global_denominators_average_to_whole_batch(
    batch: dict[str, object], data: st.DataObject
) -> None:
    x, mask, group = batch["x"], batch["mask"], batch["group"]
    assert isinstance(x, torch.Tensor) and isinstance(mask, torch.Tensor) and isinstance(group, torch.Tensor)
    dm = mask if batch["dm"] is None else batch["dm"]
    assert isinstance(dm, torch.Tensor)
    labels = sorted(set(group.tolist()))
    b = x.shape[0]
    # rows to rank 0: any non-empty proper subset; for prompt-mean whole groups go to one rank
    rows = data.draw(st.lists(st.booleans(), min_size=b, max_size=b).filter(lambda r: 0 < sum(r) < len(r)))
    lengths = dm.sum(-1)
    counts = {g: int(lengths[group == g].sum()) for g in labels}
    d = Denominators(
        tokens=dm.sum(),
        sequences=(lengths > 0).sum(),
        groups=sum(1 for c in counts.values() if c > 0),
        world_size=2,
    )
    scale = float(x.abs().sum()) + 1

    def split(sel: torch.Tensor) -> dict[str, object]:
        return {
            **batch,
            "x": x[sel],
            "mask": mask[sel],
            "group": group[sel],
            "dm": None if batch["dm"] is None else dm[sel],
        }

    for mode in AGG_MODES:
        if mode == "prompt-mean":
            if len(labels) < 2:
                continue
            on0 = data.draw(st.lists(st.booleans(), min_size=len(labels), max_size=len(labels)))
            on0 = on0 if 0 < sum(on0) < len(on0) else [True] + [False] * (len(labels) - 1)
            sel = torch.tensor([on0[labels.index(int(g))] for g in group])
        else:
            sel = torch.tensor(rows)
        parts = [_agg(split(s), mode, denominators=d) for s in (sel, ~sel)]
        _close((parts[0] + parts[1]) / 2, _agg(batch, mode), scale)


@settings(max_examples=20)
@given(agg_batches())
def test_prop_gradcheck(batch: dict[str, object]) -> None:
    x = batch["x"].clone().requires_grad_(True)  # type: ignore[union-attr]
    for mode in AGG_MODES:
        assert torch.autograd.gradcheck(lambda v, mode=mode: _agg(batch, mode, v), (x,))
