"""``rolloutopt.errors`` and ``rolloutopt._validation``: the error type, the ``checks`` switch and the helpers
that every public function validates its arguments with."""

from __future__ import annotations

import pytest
import torch

import rolloutopt
from rolloutopt._validation import Dims, as_float, as_index, as_mask, checks_enabled, choice, describe, finite, positive
from rolloutopt.errors import InputError, RolloutOptError


# ------------------------------------------------------------------------------------------------- errors
def test_input_error_type_and_message() -> None:
    err = InputError("mask", "a bool tensor of shape [B, T]", "float32 tensor of shape (4, 7)", "pass mask.bool()")
    assert isinstance(err, ValueError)
    assert isinstance(err, RolloutOptError)
    assert isinstance(err, Exception)
    assert (err.argument, err.expected, err.got, err.fix) == (
        "mask",
        "a bool tensor of shape [B, T]",
        "float32 tensor of shape (4, 7)",
        "pass mask.bool()",
    )
    assert str(err) == (
        "mask: expected a bool tensor of shape [B, T], got float32 tensor of shape (4, 7). Fix: pass mask.bool()"
    )
    with pytest.raises(ValueError, match=r"^mask: "):
        raise err
    assert rolloutopt.InputError is InputError
    assert rolloutopt.RolloutOptError is RolloutOptError
    assert not issubclass(RolloutOptError, ValueError)


def test_describe() -> None:
    assert describe(torch.zeros(2, 3, dtype=torch.bfloat16)) == "bfloat16 tensor of shape (2, 3) on cpu"
    assert describe([1, 2]) == "list [1, 2]"
    assert len(describe("x" * 500)) == 120


# ------------------------------------------------------------------------------------------------- checks
def test_checks_global_switch() -> None:
    assert checks_enabled()
    assert rolloutopt.checks_enabled is checks_enabled
    rolloutopt.checks(False)
    assert not checks_enabled()
    rolloutopt.checks(True)
    assert checks_enabled()
    rolloutopt.checks(False)
    rolloutopt.checks()  # default: on
    assert checks_enabled()


def test_checks_context_manager_restores_previous() -> None:
    with rolloutopt.checks(False) as c:
        assert isinstance(c, rolloutopt.checks)
        assert not checks_enabled()
        with rolloutopt.checks(True):
            assert checks_enabled()
        assert not checks_enabled()
    assert checks_enabled()
    rolloutopt.checks(False)  # global off, then a block that turns it on restores "off"
    with rolloutopt.checks(True):
        assert checks_enabled()
    assert not checks_enabled()


def test_checks_restored_on_exception() -> None:
    with pytest.raises(RuntimeError, match=r"boom"), rolloutopt.checks(False):
        assert not checks_enabled()
        raise RuntimeError("boom")
    assert checks_enabled()


def test_checks_rejects_non_bool() -> None:
    with pytest.raises(InputError, match=r"^enabled: expected a bool"):
        rolloutopt.checks(0)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^enabled"):
        rolloutopt.checks("no")  # type: ignore[arg-type]
    assert checks_enabled()  # a rejected call leaves the setting alone


def test_checks_off_skips_checks_but_keeps_conversions() -> None:
    bad_shape = torch.zeros(3, dtype=torch.bfloat16)
    with rolloutopt.checks(False):
        out = as_float(bad_shape, "logp", Dims(), "B T")
        assert out.dtype == torch.float32
        m = as_mask(torch.tensor([[0, 1], [1, 0]]), "mask", Dims(), "B")  # wrong rank: not caught
        assert m.dtype == torch.bool
        assert m.tolist() == [[False, True], [True, False]]
        assert as_mask(torch.tensor([0.0, 2.0]), "mask").tolist() == [False, True]  # non-0/1: not caught
        assert as_index(torch.tensor([1.0, 2.0]), "group").dtype == torch.long  # float ids: not caught
        finite(torch.tensor([float("nan")]), "x")  # no raise
        as_float(torch.zeros(2), "x", device=torch.device("meta"))  # device not checked
    with pytest.raises(InputError, match=r"^logp"):
        as_float(bad_shape, "logp", Dims(), "B T")


def test_checks_off_public_function_converts() -> None:
    from rolloutopt.losses import aggregate

    per_token = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    with rolloutopt.checks(False):
        out = aggregate(per_token, torch.tensor([[1, 0], [1, 1]]), "token-mean")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(8.0 / 3.0))
    with pytest.raises(InputError, match=r"^mask"):
        aggregate(per_token, torch.ones(2, 3, dtype=torch.bool), "token-mean")
    with rolloutopt.checks(False), pytest.raises(RuntimeError):  # not an InputError: torch's own shape error
        aggregate(per_token, torch.ones(2, 3, dtype=torch.bool), "token-mean")


# --------------------------------------------------------------------------------------------------- Dims
def test_dims_binds_and_names_the_source() -> None:
    dims = Dims()
    dims.check(torch.zeros(4, 7), "logp", "B T")
    assert (dims["B"], dims["T"]) == (4, 7)
    assert dims.sizes["B"] == (4, "logp")
    dims.check(torch.zeros(4, 7), "old_logp", "B T")
    dims.check(torch.zeros(4), "rewards", "B")
    assert dims.sizes["B"] == (4, "logp")  # the first binding stays
    with pytest.raises(InputError, match=r"^mask: expected shape \[B, T\] with B=4 \(from logp\), got .*\(3, 7\)"):
        dims.check(torch.zeros(3, 7), "mask", "B T")
    with pytest.raises(InputError, match=r"^mask: expected shape \[B, T\] with T=7 \(from logp\)"):
        dims.check(torch.zeros(4, 8), "mask", "B T")


def test_dims_rank_and_literal_sizes() -> None:
    dims = Dims()
    with pytest.raises(InputError, match=r"^rewards: expected a tensor of shape \[B\].*one value per sequence"):
        dims.check(torch.zeros(4, 2), "rewards", "B")
    with pytest.raises(InputError, match=r"^logp: expected a tensor of shape \[B, T\]"):
        dims.check(torch.zeros(4), "logp", "B T")
    dims.check(torch.zeros(4, 2), "pair", "B 2")
    with pytest.raises(InputError, match=r"^pair: expected size 2 in a \[B, 2\] tensor"):
        dims.check(torch.zeros(4, 3), "pair", "B 2")
    assert "2" not in dims.sizes


# ---------------------------------------------------------------------------------------------- as_float
@pytest.mark.parametrize(
    ("dtype", "want"),
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_as_float_dtypes(dtype: torch.dtype, want: torch.dtype) -> None:
    x = torch.tensor([0.5, -1.25], dtype=dtype)
    out = as_float(x, "logp")
    assert out.dtype == want
    assert out.tolist() == [0.5, -1.25]
    if dtype in (torch.float32, torch.float64):
        assert out is x  # no copy


def test_as_float_keeps_gradient() -> None:
    x = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    as_float(x, "logp").sum().backward()
    assert x.grad is not None
    assert x.grad.tolist() == [1.0, 1.0]


def test_as_float_bad() -> None:
    with pytest.raises(InputError, match=r"^logp: expected a floating tensor.*int64.*Fix: cast with logp.float\(\)"):
        as_float(torch.tensor([1, 2]), "logp")
    with pytest.raises(InputError, match=r"^logp: expected a floating tensor"):
        as_float(torch.tensor([True]), "logp")
    with pytest.raises(InputError, match=r"^logp: expected a torch.Tensor, got list"):
        as_float([1.0, 2.0], "logp")
    with pytest.raises(InputError, match=r"^logp: expected a tensor on meta"):
        as_float(torch.zeros(2), "logp", device=torch.device("meta"))
    with pytest.raises(InputError, match=r"^logp: expected a tensor of shape \[B, T\]"):
        as_float(torch.zeros(2), "logp", Dims(), "B T")


# ----------------------------------------------------------------------------------------------- as_mask
def test_as_mask_conversions() -> None:
    b = torch.tensor([[True, False]])
    assert as_mask(b, "mask") is b
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.uint8):
        m = as_mask(torch.tensor([[1, 0]], dtype=dtype), "mask")
        assert m.dtype == torch.bool
        assert m.tolist() == [[True, False]]


def test_as_mask_bad() -> None:
    with pytest.raises(InputError, match=r"^mask: expected a bool mask or a 0/1 tensor.*values other than 0 and 1"):
        as_mask(torch.tensor([1.0, 0.5]), "mask")
    with pytest.raises(InputError, match=r"^loss_mask: .*values other than 0 and 1"):
        as_mask(torch.tensor([-1, 1]), "loss_mask")
    with pytest.raises(InputError, match=r"^mask: expected shape \[B, T\] with B=2 \(from logp\)"):
        dims = Dims()
        dims.check(torch.zeros(2, 3), "logp", "B T")
        as_mask(torch.ones(3, 3, dtype=torch.bool), "mask", dims, "B T")
    with pytest.raises(InputError, match=r"^mask: expected a torch.Tensor"):
        as_mask([[1, 0]], "mask")
    with pytest.raises(InputError, match=r"^mask: expected a tensor on meta"):
        as_mask(torch.ones(2, dtype=torch.bool), "mask", device=torch.device("meta"))


# ---------------------------------------------------------------------------------------------- as_index
def test_as_index() -> None:
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        out = as_index(torch.tensor([3, 1], dtype=dtype), "group")
        assert out.dtype == torch.long
        assert out.tolist() == [3, 1]
    big = torch.tensor([2**62, -(2**62)])
    assert as_index(big, "group").tolist() == [2**62, -(2**62)]
    with pytest.raises(InputError, match=r"^group: expected an int64 tensor of ids.*float32.*group.long\(\)"):
        as_index(torch.tensor([1.0]), "group")
    with pytest.raises(InputError, match=r"^group: expected an int64"):
        as_index(torch.tensor([True]), "group")
    with pytest.raises(InputError, match=r"^group: expected a torch.Tensor"):
        as_index([1, 2], "group")
    dims = Dims()
    dims.check(torch.zeros(3), "rewards", "B")
    with pytest.raises(InputError, match=r"^group: expected shape \[B\] with B=3 \(from rewards\)"):
        as_index(torch.tensor([1, 2]), "group", dims)


# ------------------------------------------------------------------------------------------------ finite
def test_finite() -> None:
    finite(torch.tensor([1.0, 2.0]), "x")
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    with pytest.raises(
        InputError, match=r"^logp: expected finite values.*2 non-finite value\(s\), first at index \(0, 1\)"
    ):
        finite(x, "logp")
    mask = torch.tensor([[True, False], [True, True]])
    with pytest.raises(InputError, match=r"1 non-finite value\(s\), first at index \(1, 0\)"):
        finite(x, "logp", mask)
    finite(x, "logp", torch.tensor([[True, False], [False, True]]))  # non-finite values masked out
    finite(torch.tensor([float("-inf")]).requires_grad_(), "x", torch.tensor([False]))


# ---------------------------------------------------------------------------------------- positive, choice
def test_positive() -> None:
    positive(0.2, "eps")
    positive(3, "eps")
    positive(0, "beta", strict=False)
    positive(0.0, "beta", strict=False)
    for bad in (0, 0.0, -1.0, float("nan"), True, "0.2", None):
        with pytest.raises(InputError, match=r"^eps: expected a positive number"):
            positive(bad, "eps")  # type: ignore[arg-type]
    for bad in (-0.1, float("nan"), False):
        with pytest.raises(InputError, match=r"^beta: expected a non-negative number"):
            positive(bad, "beta", strict=False)  # type: ignore[arg-type]


def test_choice() -> None:
    choice("token-mean", "mode", ("token-mean", "seq-mean-token-mean"))
    choice(2, "k", (1, 2))
    with pytest.raises(InputError, match=r"^mode: expected one of 'token-mean', 'seq-mean-token-mean', got str 'x'"):
        choice("x", "mode", ("token-mean", "seq-mean-token-mean"))
    with pytest.raises(InputError, match=r"^level: "):
        choice("Token", "level", ("token", "sequence"))  # case-sensitive


def test_check_int_and_check_real() -> None:
    from rolloutopt._validation import check_int, check_real

    assert check_int(3, "n", 1) == 3 and check_int(None, "n", 1, none=True) is None
    assert check_real(1, "x", 0.0, 1.0) == 1.0 and isinstance(check_real(1, "x"), float)
    assert check_real(None, "x", none=True) is None
    for bad in (0, True, 1.5, "2", None):
        with pytest.raises(InputError, match=r"^n: .*int >= 1"):
            check_int(bad, "n", 1)
    for bad, kw in ((0.0, {"open_low": True}), (1.0, {"open_high": True}), (float("nan"), {}), (2.0, {}), (True, {})):
        with pytest.raises(InputError, match=r"^x: .*\[?\(?0\.0, 1\.0"):
            check_real(bad, "x", 0.0, 1.0, **kw)


def test_check_state_check_bool_and_fix() -> None:
    from rolloutopt._validation import check_bool, check_int, check_real, check_state

    state = {"a": 1, "b": 2}
    assert check_state(state, {"a", "b"}, "Thing") is state
    with pytest.raises(InputError, match=r"^state: .*\['a', 'b'\].*Thing\.state_dict\(\)"):
        check_state({"a": 1}, {"a", "b"}, "Thing")
    with pytest.raises(InputError, match=r"^scores: "):
        check_state([], {"a"}, "Thing", "scores")
    assert check_bool(True, "flag") is True
    with pytest.raises(InputError, match=r"^flag: .*a bool"):
        check_bool(1, "flag")
    with pytest.raises(InputError, match=r"pass n=8"):
        check_int(0, "n", 1, "pass n=8")
    with pytest.raises(InputError, match=r"pass x=0.5"):
        check_real(2.0, "x", 0.0, 1.0, "pass x=0.5")
