"""Loss aggregation: verl golden values (specs §1.2), prompt-mean, explicit denominators, edge cases."""

from __future__ import annotations

import pytest
import torch

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
