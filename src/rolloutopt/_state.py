"""State as data: declared fields, one validation for every ``load_state_dict``.

A stateful object (an allocator, a stop rule, a buffer) declares the fields of its ``state_dict()`` once, as a
dict of :class:`Field`, and loads with :func:`load_state`, which checks everything a corrupted or foreign state
could get wrong before anything is assigned: the keys (none missing, none unknown), each tensor's dtype kind,
rank and shape (a dimension named by a letter is shared by every field that names it, so a truncated id column
cannot pass), the values (finite, non-negative, sorted distinct ids), ints and generator states, nested dicts,
and the format version. A bad state is an :class:`~rolloutopt.errors.InputError` naming the field
(``state['ids']``), and nothing runs on it. The returned dict holds copies in canonical dtypes (float64, int64,
bool), loadable from ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from rolloutopt._validation import describe
from rolloutopt.errors import InputError

__all__ = ["FORMAT_KEY", "Field", "dump_state", "load_state"]

FORMAT_KEY = "format"
"""The key of the format version in every declared state dict."""

Kind = Literal["float", "int", "bool", "integer", "real", "generator", "nested", "any"]
Check = Literal["finite", "nonneg", "ids", "finite_or_nan", "prob"]
_DTYPES = {"float": torch.float64, "int": torch.long, "bool": torch.bool}


@dataclass(frozen=True)
class Field:
    """One declared field of a state dict.

    ``kind``: ``"float"``, ``"int"`` or ``"bool"`` for a tensor (with ``shape``: dimension names, bound across
    the fields of one state, or fixed sizes), ``"integer"``/``"real"`` for a Python number (``low``/``high``),
    ``"generator"`` for a ``torch.Generator`` state, ``"nested"`` for a dict with its own ``fields``, ``"any"``
    for a value the owner validates itself. ``checks`` on tensor values: ``"finite"``, ``"finite_or_nan"`` (NaN
    marks a missing value; no inf), ``"nonneg"`` (>= 0, no NaN), ``"prob"`` (in [0, 1]), ``"ids"`` (sorted
    distinct). ``optional``: the key may be absent (a field added in a later version; the owner supplies the
    default).
    """

    kind: Kind
    shape: tuple[str | int, ...] = ()
    checks: tuple[Check, ...] = ()
    low: float | None = None
    high: float | None = None
    fields: dict[str, Field] | None = None
    optional: bool = False


def dump_state(fields: dict[str, Any], version: int = 1) -> dict[str, Any]:
    """``fields`` with the format version under :data:`FORMAT_KEY` (what ``state_dict()`` returns)."""
    return {**fields, FORMAT_KEY: version}


def load_state(
    state: Any, spec: dict[str, Field], owner: str, *, version: int = 1, name: str = "state"
) -> dict[str, Any]:
    """Validate ``state`` against the declared ``spec`` of ``owner`` and return its fields as fresh copies.

    A state without :data:`FORMAT_KEY` is accepted as version 1 (the states saved before versions were
    written); any other version than ``version`` is refused.
    """
    if not isinstance(state, dict):
        raise InputError(name, f"a dict from {owner}.state_dict()", describe(state), f"pass {owner}.state_dict()")
    dims: dict[str, int] = {}
    return _load(state, spec, owner, name, dims, version)


def _load(
    state: dict[str, Any], spec: dict[str, Field], owner: str, name: str, dims: dict[str, int], version: int = 1
) -> dict[str, Any]:
    """The keys and fields of one (possibly nested) dict; a nested state may carry its own format version 1."""
    fmt = state.get(FORMAT_KEY, 1)
    if type(fmt) is not int or fmt != version:
        raise InputError(
            f"{name}[{FORMAT_KEY!r}]",
            f"format version {version}",
            repr(fmt),
            f"pass a {owner}.state_dict() of this version",
        )
    keys = set(state) - {FORMAT_KEY}
    unknown = sorted(keys - set(spec))
    missing = sorted(k for k, f in spec.items() if k not in state and not f.optional)
    if unknown or missing:
        got = (f"unknown keys {unknown}" if unknown else "") + (" and " if unknown and missing else "")
        got += f"missing keys {missing}" if missing else ""
        raise InputError(name, f"the keys of a {owner}.state_dict(): {sorted(spec)}", got, f"pass {owner}.state_dict()")
    out: dict[str, Any] = {}
    for key, field in spec.items():
        if key in state:
            out[key] = _value(state[key], field, owner, f"{name}[{key!r}]", dims)
    return out


def _value(x: Any, field: Field, owner: str, name: str, dims: dict[str, int]) -> Any:
    fix = f"pass {owner}.state_dict()"
    if field.kind == "any":
        return x
    if field.kind == "nested":
        assert field.fields is not None
        if not isinstance(x, dict):
            raise InputError(name, "a dict", describe(x), fix)
        return _load(x, field.fields, owner, name, dims)
    if field.kind == "generator":
        if not isinstance(x, Tensor) or x.dtype != torch.uint8 or x.ndim != 1:
            raise InputError(name, "a torch.Generator state (uint8 tensor)", describe(x), fix)
        try:
            torch.Generator().set_state(x)
        except RuntimeError as exc:
            raise InputError(name, "a torch.Generator state", f"an invalid one ({exc})", fix) from exc
        return x.clone()
    if field.kind in ("integer", "real"):
        ok = isinstance(x, int) and not isinstance(x, bool)
        ok = ok or (field.kind == "real" and isinstance(x, float) and math.isfinite(x))
        if not ok or (field.low is not None and x < field.low) or (field.high is not None and x > field.high):
            span = (
                f" in [{field.low}, {field.high}]"
                if field.high is not None
                else f" >= {field.low}"
                if field.low is not None
                else ""
            )
            raise InputError(name, f"{'an int' if field.kind == 'integer' else 'a finite number'}{span}", repr(x), fix)
        return x
    return _tensor(x, field, name, fix, dims)


def _tensor(x: Any, field: Field, name: str, fix: str, dims: dict[str, int]) -> Tensor:
    kind = field.kind
    if not isinstance(x, Tensor):
        raise InputError(name, f"a {kind} tensor", describe(x), fix)
    ok = {"float": x.is_floating_point(), "int": not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool,
          "bool": x.dtype == torch.bool}[kind]  # fmt: skip
    if not ok or x.ndim != len(field.shape):
        raise InputError(name, f"a {kind} tensor of rank {len(field.shape)}", describe(x), fix)
    for i, d in enumerate(field.shape):
        size = int(x.shape[i])
        want = d if isinstance(d, int) else dims.setdefault(d, size)
        if size != want:
            raise InputError(name, f"dimension {i} of {want} (as the other fields of the state)", describe(x), fix)
    t = x.detach().clone().to(_DTYPES[kind])
    for check in field.checks:
        if kind == "float" and check in ("finite", "nonneg", "prob") and not bool(torch.isfinite(t).all()):
            raise InputError(name, "finite values", f"{describe(x)} with NaN or inf", fix)
        if kind == "float" and check == "finite_or_nan" and bool(torch.isinf(t).any()):
            raise InputError(name, "finite values or NaN", f"{describe(x)} with inf", fix)
        if check == "nonneg" and t.numel() and bool((t < 0).any()):
            raise InputError(name, "non-negative values", f"{describe(x)} with negative values", fix)
        if check == "prob" and t.numel() and bool(((t < 0) | (t > 1)).any()):
            raise InputError(name, "values in [0, 1]", describe(x), fix)
        if check == "ids" and t.numel() > 1 and not bool((t[1:] > t[:-1]).all()):
            raise InputError(name, "sorted distinct ids", "unsorted or repeated ids", fix)
    return t
