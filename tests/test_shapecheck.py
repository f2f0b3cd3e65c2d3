"""The suite runs the package under jaxtyping's runtime checker, and the public signatures carry shape aliases.

``tests/_shapecheck.py`` instruments every function of ``rolloutopt`` at import (conftest). These tests check
that the instrumentation is on and complete (no function whose annotations do not resolve), that it catches a
signature that lies while leaving the library's own errors to the user, and that no public function or public
method annotates a tensor as a bare ``Tensor``: each says its shape with an alias of :mod:`rolloutopt.typing`
(or an inline jaxtyping annotation).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from typing import Any

import jaxtyping
import pytest
import torch
from torch import Tensor

import _shapecheck
import rolloutopt
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatBT

needs_checker = pytest.mark.skipif(not _shapecheck.ENABLED, reason="ROLLOUTOPT_SHAPECHECK=0: the checker is off")

_TRITON_MODULES = ("rolloutopt.kernels._logits_logprobs_triton", "rolloutopt.kernels._token_logprobs_triton")


def _modules() -> list[Any]:
    out = []
    for info in pkgutil.walk_packages(rolloutopt.__path__, "rolloutopt."):
        if info.name in _TRITON_MODULES:
            continue  # imported only by the Triton backend; its kernels are not instrumented (triton.jit)
        out.append(importlib.import_module(info.name))
    return out


def _public_callables() -> list[tuple[str, Any]]:
    """``(qualified name, function)`` of every public function and public-class method defined in the package."""
    found = []
    for mod in _modules():
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj):
                found.append((f"{mod.__name__}.{name}", obj))
            elif inspect.isclass(obj):
                for attr, fn in vars(obj).items():
                    if inspect.isfunction(fn) and (not attr.startswith("_") or attr in ("__init__", "__call__")):
                        found.append((f"{mod.__name__}.{name}.{attr}", fn))
    return found


def _bare_tensor(hint: Any) -> bool:
    """Whether an annotation is ``Tensor`` itself, alone, in a union or in a tuple (not ``dict[str, Tensor]``)."""
    if hint is Tensor:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, tuple) or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        return any(_bare_tensor(arg) for arg in typing.get_args(hint))
    return False


def test_every_public_tensor_argument_carries_a_shape() -> None:
    bare = []
    for qualname, fn in _public_callables():
        hints = typing.get_type_hints(fn, include_extras=True)
        bare += [f"{qualname}: {p}" for p, h in hints.items() if _bare_tensor(h)]
    assert not bare, "annotate these with an alias of rolloutopt.typing (or inline jaxtyping):\n" + "\n".join(bare)


@needs_checker
def test_the_package_is_instrumented_and_every_annotation_resolves() -> None:
    for mod in _modules():
        assert mod  # imported: the hook has wrapped its functions
    assert not (missing := _shapecheck.unresolved()), "\n".join(missing)
    instrumented = set(_shapecheck.INSTRUMENTED)
    for name in (
        "rolloutopt.advantages.reference.grpo",
        "rolloutopt.losses.policy.policy_loss",
        "rolloutopt.groups.Groups.broadcast",
        "rolloutopt.ratios.reference.ppo_clip_loss",
    ):
        assert name in instrumented, name


def _lies(x: FloatBT) -> FloatB:
    """Says ``[B, T]``, accepts anything with a first dimension."""
    return x.sum(-1) if x.ndim == 2 else x


def _refuses(x: FloatBT) -> FloatB:
    """Says ``[B, T]`` and refuses anything else itself, as the library's boundary validation does."""
    if x.ndim != 2:
        raise InputError("x", "a [B, T] tensor", f"shape {tuple(x.shape)}", "pass per-token values")
    return x.sum(-1)


def _wrong_result(x: FloatBT) -> FloatB:
    return x  # returns [B, T] where the signature says [B]


@needs_checker
def test_a_signature_that_lies_fails_and_the_librarys_own_error_wins() -> None:
    lies = _shapecheck._lenient(_lies, _shapecheck.CHECKER)
    refuses = _shapecheck._lenient(_refuses, _shapecheck.CHECKER)
    wrong = _shapecheck._lenient(_wrong_result, _shapecheck.CHECKER)
    ok = torch.ones(2, 3)
    assert lies(ok).shape == (2,) and refuses(ok).shape == (2,)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'x'"):
        lies(torch.ones(2))  # the function accepts a [B] tensor that its signature refuses
    with pytest.raises(InputError, match="x: expected a \\[B, T\\] tensor"):
        refuses(torch.ones(2))  # the user-facing error, not the checker's
    with pytest.raises(jaxtyping.TypeCheckError, match="return"):
        wrong(ok)


def _pair(a: FloatBT, b: FloatBT) -> FloatBT:
    del b  # accepts any second tensor
    return a


@needs_checker
def test_dimensions_are_bound_across_the_arguments_of_one_call() -> None:
    pair = _shapecheck._lenient(_pair, _shapecheck.CHECKER)
    assert pair(torch.ones(2, 3), torch.ones(2, 3)).shape == (2, 3)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'b'"):
        pair(torch.ones(2, 3), torch.ones(2, 4))  # T is 3 for a, so b's T must be 3 too
