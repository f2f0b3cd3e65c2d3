"""Input validation shared by every public function, and the global ``checks`` switch.

Validation happens once, at the boundary of a public function. Conversions that the arithmetic needs (half
precision to fp32, 0/1 masks to bool) always run; the checks that can raise — shapes, dtypes, devices, mask
values and finiteness of masked-in values — run only while :func:`checks_enabled` is true. Checks that read
tensor values (mask values, finiteness) cost one host synchronisation each, which is why production and
``torch.compile`` paths turn them off with ``rolloutopt.checks(False)``.
"""

from __future__ import annotations

import math
from types import TracebackType
from typing import Any, Literal, overload

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatBTb

__all__ = [
    "Dims",
    "as_float",
    "as_index",
    "as_mask",
    "as_seq_or_token",
    "check_bool",
    "check_int",
    "check_log_probs",
    "check_real",
    "check_state",
    "checks",
    "checks_enabled",
    "describe",
    "finite",
    "refuse_compiling",
    "require_experimental",
]

_ENABLED = [True]


def checks_enabled() -> bool:
    """Whether rolloutopt validates inputs (True unless turned off with :class:`checks`)."""
    return _ENABLED[0]


class checks:  # noqa: N801 - used like a function: rolloutopt.checks(False)
    """Turn input validation on or off: a global switch and a context manager.

    ``rolloutopt.checks(False)`` turns validation off from now on; ``with rolloutopt.checks(False): ...``
    turns it off inside the block and restores the previous setting on exit. Conversions (fp32 upcast,
    bool masks) still run with checks off; only the checks that can raise are skipped.
    """

    def __init__(self, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise InputError("enabled", "a bool", type(enabled).__name__, "pass True or False")
        self._previous = _ENABLED[0]
        _ENABLED[0] = enabled

    def __enter__(self) -> checks:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _ENABLED[0] = self._previous


def describe(x: Any) -> str:
    """A short description of a value for error messages: dtype, shape and device of a tensor."""
    if isinstance(x, Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}"[:120]


def _require_tensor(x: Any, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise InputError(name, "a torch.Tensor", describe(x), f"pass {name} as a tensor (torch.as_tensor)")
    return x


class Dims:
    """Binds symbolic dimension names (``"B T"``) across the arguments of one call and checks them.

    The first argument that mentions a name fixes its size; later arguments must agree. Error messages name
    the argument that fixed the size, so a mismatch reads like ``mask: expected shape [B, T] with B=4 (from
    logp), got ...``.
    """

    def __init__(self) -> None:
        self.sizes: dict[str, tuple[int, str]] = {}

    def __getitem__(self, dim: str) -> int:
        return self.sizes[dim][0]

    def check(self, x: Shaped[Tensor, " ..."], name: str, spec: str) -> None:
        """Check that ``x`` has the shape ``spec`` (names separated by spaces) and bind new names."""
        dims = spec.split()
        if x.ndim != len(dims):
            raise InputError(
                name,
                f"a tensor of shape [{', '.join(dims)}]",
                describe(x),
                f"reshape {name} to [{', '.join(dims)}]" + (" (one value per sequence)" if dims == ["B"] else ""),
            )
        for dim, size in zip(dims, x.shape, strict=True):
            if dim.isdigit():
                if size != int(dim):
                    raise InputError(name, f"size {dim} in a [{', '.join(dims)}] tensor", describe(x), "fix the shape")
                continue
            bound = self.sizes.get(dim)
            if bound is None:
                self.sizes[dim] = (int(size), name)
            elif bound[0] != size:
                raise InputError(
                    name,
                    f"shape [{', '.join(dims)}] with {dim}={bound[0]} (from {bound[1]})",
                    describe(x),
                    f"pass tensors whose {dim} dimensions agree",
                )


def _check_device(x: Tensor, name: str, device: torch.device | None) -> None:
    if device is not None and x.device != device:
        raise InputError(name, f"a tensor on {device}", describe(x), f"move {name} with .to({str(device)!r})")


def as_float(
    x: Any,
    name: str,
    dims: Dims | None = None,
    spec: str | None = None,
    *,
    device: torch.device | None = None,
) -> FloatAny:
    """Validate a floating tensor and return it in fp32 (float64 stays float64, for gradcheck).

    bf16 and fp16 inputs are upcast, so that arithmetic runs in fp32 (the tensor convention, ``docs/guide.md``).
    """
    if checks_enabled():
        x = _require_tensor(x, name)
        if not x.is_floating_point():
            raise InputError(
                name, "a floating tensor (fp32, bf16, fp16 or fp64)", describe(x), f"cast with {name}.float()"
            )
        if dims is not None and spec is not None:
            dims.check(x, name, spec)
        _check_device(x, name, device)
    t: Tensor = x
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def as_seq_or_token(x: Any, name: str, dims: Dims, *, device: torch.device | None = None) -> FloatBTb:
    """Validate a per-sequence ``[B]`` or per-token ``[B, T]`` float tensor; return it as ``[B, 1]`` or ``[B, T]``."""
    t = as_float(x, name, device=device)
    if t.ndim == 1:
        dims.check(t, name, "B")
        return t[:, None]
    dims.check(t, name, "B T")
    return t


def as_mask(
    mask: Any,
    name: str,
    dims: Dims | None = None,
    spec: str | None = None,
    *,
    device: torch.device | None = None,
) -> Bool[Tensor, " ..."]:
    """Validate a mask and return it as bool: bool, or 0/1 floats or ints (converted)."""
    if checks_enabled():
        mask = _require_tensor(mask, name)
        if dims is not None and spec is not None:
            dims.check(mask, name, spec)
        _check_device(mask, name, device)
        refuse_compiling()
        if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
            raise InputError(
                name,
                "a bool mask or a 0/1 tensor",
                f"{describe(mask)} with values other than 0 and 1",
                f"pass {name} as a bool tensor (True where a token counts); use weights for soft masks",
            )
    m: Tensor = mask
    return m if m.dtype == torch.bool else m != 0


def as_index(
    group: Any, name: str, dims: Dims | None = None, spec: str = "B", *, device: torch.device | None = None
) -> Int[Tensor, " ..."]:
    """Validate integer ids ``[B]`` (any integer dtype; returned as int64)."""
    if checks_enabled():
        group = _require_tensor(group, name)
        if group.is_floating_point() or group.is_complex() or group.dtype == torch.bool:
            raise InputError(name, "an int64 tensor of ids", describe(group), f"cast with {name}.long()")
        if dims is not None:
            dims.check(group, name, spec)
        _check_device(group, name, device)
    return group.long()  # type: ignore[no-any-return]


LOGP_MAX = 0.01
"""Largest log-prob accepted at a masked-in position: log-probs are <= 0, and the margin absorbs the rounding of
a low-precision log-softmax; a probability passed for a log-prob is almost always above it."""


def check_log_probs(x: Float[Tensor, "*#shape"], name: str, mask: Shaped[Tensor, "*#shape"]) -> None:
    """Raise unless every masked-in value of the log-probs ``x`` is finite and <= :data:`LOGP_MAX` (one host sync;
    skipped while checks are off)."""
    if not checks_enabled():
        return
    refuse_compiling()
    xd = x.detach()
    bad = (~torch.isfinite(xd) | (xd > LOGP_MAX)) & mask
    if bool(bad.any()):
        finite(x, name, mask)  # a non-finite value gets finite's message
        where = torch.nonzero(bad)[0].tolist()
        raise InputError(
            name,
            f"log-probabilities (<= 0; values up to {LOGP_MAX} are tolerated as rounding) at masked-in positions",
            f"{describe(x)} with {int(bad.sum())} value(s) above {LOGP_MAX}, first {float(xd[tuple(where)]):.4g} "
            f"at index {tuple(where)}",
            f"pass natural-log probabilities of the sampled tokens (e.g. {name}.log() if these are probabilities)",
        )


def refuse_compiling() -> None:
    """Raise an :class:`InputError` saying to use ``rolloutopt.checks(False)`` while ``torch.compile`` traces the
    caller: the checks that read tensor values (mask values, finiteness, log-prob range) cannot be traced.

    Called by every such check. Without ``fullgraph`` the error reaches the caller as it is; with
    ``fullgraph=True`` torch reports it inside its ``Unsupported`` error ("raised exception InputError(...)").
    """
    if torch.compiler.is_compiling():
        raise InputError(
            "checks",
            "rolloutopt.checks(False) around a function traced by torch.compile (validation reads tensor values)",
            "checks enabled while compiling",
            "wrap the compiled call in `with rolloutopt.checks(False):` (call it once eagerly to validate, if wanted)",
        )


def finite(
    x: Shaped[Tensor, "*#shape"],
    name: str,
    mask: Shaped[Tensor, "*#shape"] | None = None,
    *,
    exclude: str | None = "mask",
) -> None:
    """Raise if a masked-in value of ``x`` is NaN or infinite (skipped while checks are off).

    ``exclude`` names the caller's keyword that leaves entries out (the advice in the message): ``"mask"``
    (default, the losses' mask), another keyword such as ``"valid"`` (the advantage estimators' row mask), or
    None when the caller has no such keyword.
    """
    if not checks_enabled():
        return
    refuse_compiling()
    bad = ~torch.isfinite(x.detach())
    if mask is not None:
        bad = bad & mask
    if bool(bad.any()):
        where = torch.nonzero(bad)[0].tolist()
        if exclude is None:
            fix = f"fix the producer of {name}"
        elif exclude == "mask":
            fix = f"fix the producer of {name}, or mask those positions out"
        else:
            fix = f"fix the producer of {name}, or leave those rows out with {exclude}="
        raise InputError(
            name,
            "finite values at masked-in positions",
            f"{describe(x)} with {int(bad.sum())} non-finite value(s), first at index {tuple(where)}",
            fix,
        )


def positive(value: float, name: str, *, strict: bool = True) -> None:
    """Raise unless a hyper-parameter is a positive (or, with ``strict=False``, non-negative) number."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value > 0 if strict else value >= 0)
    if not ok:
        raise InputError(
            name, "a positive number" if strict else "a non-negative number", describe(value), f"set {name} accordingly"
        )


@overload
def check_int(x: Any, name: str, low: int, fix: str | None = None, *, none: Literal[False] = False) -> int: ...
@overload
def check_int(x: Any, name: str, low: int, fix: str | None = None, *, none: bool) -> int | None: ...
def check_int(x: Any, name: str, low: int, fix: str | None = None, *, none: bool = False) -> int | None:
    """Return the hyper-parameter ``x`` if it is an int ``>= low`` (or None, with ``none=True``); raise an
    InputError naming it otherwise (``fix``: the advice in the message, default "set <name> to an int >= low")."""
    if none and x is None:
        return None
    if not isinstance(x, int) or isinstance(x, bool) or x < low:
        expected = f"{'None or ' if none else ''}an int >= {low}"
        raise InputError(name, expected, describe(x), fix or f"set {name} to an int >= {low}")
    return x


@overload
def check_real(
    x: Any,
    name: str,
    low: float = ...,
    high: float = ...,
    fix: str | None = None,
    *,
    open_low: bool = ...,
    open_high: bool = ...,
    none: Literal[False] = False,
) -> float: ...
@overload
def check_real(
    x: Any,
    name: str,
    low: float = ...,
    high: float = ...,
    fix: str | None = None,
    *,
    open_low: bool = ...,
    open_high: bool = ...,
    none: bool,
) -> float | None: ...
def check_real(
    x: Any,
    name: str,
    low: float = -math.inf,
    high: float = math.inf,
    fix: str | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
    none: bool = False,
) -> float | None:
    """Return the hyper-parameter ``x`` as a float if it is a finite number in the interval ``[low, high]`` (ends
    open with ``open_low``/``open_high``; None allowed with ``none=True``); raise an InputError naming it otherwise
    (``fix``: the advice in the message, default "set <name> inside the interval")."""
    if none and x is None:
        return None
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))
    if ok:
        v = float(x)
        ok = (v > low if open_low else v >= low) and (v < high if open_high else v <= high)
    if not ok:
        interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        expected = f"{'None or ' if none else ''}a finite number in {interval}"
        raise InputError(name, expected, describe(x), fix or f"set {name} inside {interval}")
    return float(x)


def check_bool(x: Any, name: str) -> bool:
    """Return the flag ``x`` if it is a bool; raise an InputError naming it otherwise."""
    if not isinstance(x, bool):
        raise InputError(name, "a bool", describe(x), f"pass {name}=True or {name}=False")
    return x


def check_state(state: Any, keys: set[str], owner: str, name: str = "state") -> dict[str, Any]:
    """Return ``state`` if it is a dict with exactly ``keys`` (a ``load_state_dict`` argument); raise otherwise."""
    if not isinstance(state, dict) or set(state) != keys:
        raise InputError(name, f"a dict with keys {sorted(keys)}", describe(state), f"pass {owner}.state_dict()")
    return state


def choice(value: Any, name: str, options: tuple[Any, ...]) -> None:
    """Raise unless ``value`` is one of ``options``."""
    if value not in options:
        raise InputError(
            name,
            f"one of {', '.join(map(repr, options))}",
            describe(value),
            f"pick one of the listed values for {name}",
        )


def require_experimental(flag: Any, what: str, docs: str, *, argument: str = "experimental") -> None:
    """Raise unless ``flag is True``: ``what`` is reconstructed (described on the docs page ``docs``, e.g.
    ``"docs/methods/trust_regions.md"``), not taken from a primary source, so the caller must acknowledge it with
    ``experimental=True``."""
    if flag is not True:
        raise InputError(
            argument,
            f"experimental=True: {what} is reconstructed, not taken from a primary source, and may change when one is "
            "checked",
            repr(flag),
            f"pass experimental=True to acknowledge the reconstruction (see {docs})",
        )
