"""The test suite runs rolloutopt under jaxtyping's import hook with beartype as the type checker.

Every function and method of the package (nested functions excepted) is wrapped by ``jaxtyping.jaxtyped`` with
beartype, so a call whose arguments or result contradict the signature's annotations — a ``FloatBT`` that is
``[B, 1]``, a ``B`` that differs between two arguments, an ``int`` where the signature says ``Tensor`` — fails
the test that made it. ``install()`` must run before ``rolloutopt`` is first imported (``tests/conftest.py``
calls it); ``ROLLOUTOPT_SHAPECHECK=0`` turns it off, for timing the suite without it.

The library's own validation stays the error users see. When the checker refuses the *arguments* of a call,
the function is called again unchecked: if it raises (an ``InputError`` from the boundary validation, say),
that exception propagates, as it would for a user, who runs without the hook; only if the function accepts
what its signature refuses is the checker's error raised, because then the signature lies. A refused *result*
is always raised.

Not instrumented, with the reason: functions defined inside other functions (a wrapper per closure creation
would dominate the suite's time), Triton kernels (``triton.jit`` compiles the function's own source and
globals), and every call made while ``torch.compile`` traces (the checks are Python-side and data-dependent).
A test keeps :func:`unresolved` empty: a function whose annotations do not resolve at run time would go
unchecked.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import typing
from collections.abc import Callable
from typing import Any

import jaxtyping
import torch
from beartype import BeartypeConf, beartype

ENABLED = os.environ.get("ROLLOUTOPT_SHAPECHECK", "1") != "0"
"""Whether the suite runs under the checker (``ROLLOUTOPT_SHAPECHECK=0`` turns it off)."""

CHECKER = beartype(conf=BeartypeConf(is_pep484_tower=True))
"""beartype, with ``int`` accepted where ``float`` is annotated (PEP 484's numeric tower)."""

INSTRUMENTED: dict[str, Callable[..., Any]] = {}
"""``module.qualname`` -> function, for every function the checker wraps (a test resolves their annotations)."""


def unresolved() -> list[str]:
    """``module.qualname: error`` of every instrumented function whose annotations do not resolve at run time.

    Resolved after the modules have finished executing (a method may name its own class); a test keeps this
    empty, so that no signature is silently unchecked.
    """
    out = []
    for name, fn in INSTRUMENTED.items():
        try:
            typing.get_type_hints(fn, include_extras=True)
        except Exception as error:  # any failure to resolve leaves the signature unchecked
            out.append(f"{name}: {type(error).__name__}: {error}")
    return out


_COLLECT = os.environ.get("ROLLOUTOPT_SHAPECHECK_COLLECT", "")
_SEEN: set[str] = set()
_PARAMETERS_REFUSED = "Type-check error whilst checking the parameters"
_jaxtyped = jaxtyping.jaxtyped


def _is_triton_kernel(fn: Callable[..., Any]) -> bool:
    try:
        head = inspect.getsource(fn).split("def ", 1)[0]
    except (OSError, TypeError):
        return False
    return "triton.jit" in head


def _lenient(fn: Callable[..., Any], typechecker: Any) -> Callable[..., Any]:
    checked = _jaxtyped(fn, typechecker=typechecker)
    INSTRUMENTED[f"{fn.__module__}.{fn.__qualname__}"] = fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            return checked(*args, **kwargs)
        except jaxtyping.TypeCheckError as violation:
            if _COLLECT:  # record each lie once, keep going (for a survey of the whole suite)
                params = str(violation).startswith(_PARAMETERS_REFUSED)
                result = fn(*args, **kwargs) if params else None  # raises, as for a user, when fn refuses too
                text = " ".join(str(violation).split())
                key = text.split("Called with")[0][:400]
                if key not in _SEEN:
                    _SEEN.add(key)
                    with open(_COLLECT, "a") as f:
                        f.write(f"{fn.__module__}.{fn.__qualname__}\t{key}\n")
                return result if params else fn(*args, **kwargs)  # a survey: a refused result is computed again
            if not str(violation).startswith(_PARAMETERS_REFUSED):
                raise
            fn(*args, **kwargs)  # the library's own error, if it refuses these arguments too, is what users see
            raise violation from None  # the function accepted what its signature refuses: the signature lies

    return call


def _decorate(obj: Any, typechecker: Any) -> Any:
    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj) and "__init__" in vars(obj):
            obj.__init__ = _lenient(obj.__init__, typechecker)
        return obj
    if not inspect.isfunction(obj) or "<locals>" in obj.__qualname__ or _is_triton_kernel(obj):
        return obj
    return _lenient(obj, typechecker)


def jaxtyped(fn: Any = None, *, typechecker: Any) -> Any:
    """Stands in for ``jaxtyping.jaxtyped`` in the decorator the import hook inserts into every definition."""
    if fn is None:
        return functools.partial(_decorate, typechecker=typechecker)
    return _decorate(fn, typechecker)


def install() -> bool:
    """Install the hook for ``rolloutopt`` (before its first import); returns whether it is on."""
    if not ENABLED:
        return False
    import sys

    if any(name == "rolloutopt" or name.startswith("rolloutopt.") for name in sys.modules):
        raise RuntimeError("tests/_shapecheck.install() must run before rolloutopt is imported")
    jaxtyping.jaxtyped = jaxtyped  # the hook's inserted decorator reads this attribute when a module executes
    jaxtyping.install_import_hook("rolloutopt", "_shapecheck.CHECKER")
    return True
