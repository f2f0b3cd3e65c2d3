"""Name registries, one shape for every family: estimators, shapers, loss presets, allocators, stop rules.

Trainers whose configs hold strings look methods up here. Every family module (``rolloutopt.advantages``,
``rolloutopt.losses``, ``rolloutopt.allocators``, ``rolloutopt.control``) exposes the same four functions over
its :class:`Registry`:

- ``get(name)`` returns the registered object, used the same way in every family: ``get(name)(...)`` calls
  the estimator or the preset, or constructs the allocator or the rule;
- ``entry(name)`` returns its :class:`Entry`: the object with what it declares — ``requires`` (the inputs
  beyond the family's common ones that it cannot run without), ``accepts`` (optional inputs it consumes),
  ``reference`` (paper, authors' code, trainers) and ``experimental`` (why it is partly reconstructed, or
  None);
- ``names()`` lists the names, sorted; ``register(name, obj, ...)`` adds one.

The declarations are read from the object (attributes ``requires``, ``accepts``, ``reference``,
``experimental``) unless given to ``register``. Registering a name twice with a different object raises, so
built-ins cannot be replaced by accident (verl's ``register_adv_est`` behaviour); pass ``overwrite=True`` to
replace one deliberately. Lookup is case-sensitive.

Families of plain functions (advantage estimators, reward shapers, selectors) keep a :class:`MethodRegistry`:
``register(name, fn, requires=..., accepts=...)`` wraps the function in a :class:`Method`, which is what
``get(name)`` returns. Calling it checks the call against the declarations — a missing required input, an input
the method does not consume, an unknown keyword and a missing ``experimental=True`` all raise an
:class:`~rolloutopt.errors.InputError` naming the argument — and then calls the plain function, unchanged.
Keywords of the function that are not declared inputs are its hyper-parameters and pass through.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rolloutopt.errors import InputError

__all__ = ["STANDARD_INPUTS", "Entry", "Method", "MethodRegistry", "Registry", "check_inputs"]

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered method: the object and its declarations.

    Attributes:
        name: the registry name (snake_case of the class or function name).
        obj: the callable or class that ``get(name)`` returns.
        requires: inputs the method cannot run without (beyond its family's common ones).
        accepts: optional inputs the method consumes when given.
        reference: where the method comes from (arXiv id, authors' code, trainers).
        experimental: why the method is partly reconstructed (it then needs ``experimental=True``), or None.
    """

    name: str
    obj: T
    requires: tuple[str, ...] = ()
    accepts: tuple[str, ...] = ()
    reference: str = ""
    experimental: str | None = None


def _names(value: Any, what: str, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InputError(what, "a tuple of input names", repr(value), f"declare {what} of {name!r} as a tuple of str")
    out = tuple(value)
    if not all(isinstance(v, str) and v for v in out):
        raise InputError(what, "a tuple of input names", repr(value), f"declare {what} of {name!r} as a tuple of str")
    return out


def _check_name(name: Any, kind: str) -> None:
    if not isinstance(name, str) or not name:
        raise InputError("name", "a non-empty string", repr(name), f"name the {kind}")


class Registry(Generic[T]):
    """A mapping from names to objects of one kind, with clear errors for unknown and duplicate names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Entry[T]] = {}

    def register(
        self,
        name: str,
        obj: T,
        *,
        requires: Iterable[str] | None = None,
        accepts: Iterable[str] | None = None,
        reference: str | None = None,
        experimental: str | None = None,
        overwrite: bool = False,
    ) -> T:
        """Bind ``name`` to ``obj``; the same object again is a no-op, a different one raises unless ``overwrite``.

        ``requires``, ``accepts``, ``reference`` and ``experimental`` default to the object's attributes of the
        same names (empty when it has none).
        """
        _check_name(name, self.kind)
        current = self._items.get(name)
        if current is not None and current.obj is not obj and not overwrite:
            raise InputError(
                "name",
                f"a {self.kind} name that is not registered yet",
                f"{name!r}, already bound to {current.obj!r}",
                "choose another name, or pass overwrite=True to replace it",
            )
        ref = getattr(obj, "reference", "") if reference is None else reference
        exp = getattr(obj, "experimental", None) if experimental is None else experimental
        if not isinstance(ref, str):
            ref = ""
        if exp is not None and not isinstance(exp, str):
            exp = None  # e.g. a dataclass field default of another type: the object declares no reason
        self._items[name] = Entry(
            name,
            obj,
            _names(getattr(obj, "requires", ()) if requires is None else requires, "requires", name),
            _names(getattr(obj, "accepts", ()) if accepts is None else accepts, "accepts", name),
            ref,
            exp,
        )
        return obj

    def decorator(self, name: str, **declared: Any) -> Callable[[T], T]:
        """``@registry.decorator("name", requires=...)`` registers the decorated object under ``name``."""

        def wrap(obj: T) -> T:
            return self.register(name, obj, **declared)

        return wrap

    def entry(self, name: str) -> Entry[T]:
        """The :class:`Entry` bound to ``name``; an :class:`InputError` listing the known names otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise InputError(
                "name",
                f"a registered {self.kind}: {', '.join(self.names())}",
                repr(name),
                f"use one of the listed names or register yours with rolloutopt's {self.kind} registry",
            ) from None

    def get(self, name: str) -> T:
        """The object bound to ``name``; an :class:`InputError` listing the known names otherwise."""
        return self.entry(name).obj

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._items)

    def entries(self) -> list[Entry[T]]:
        """Every entry, sorted by name."""
        return [self._items[n] for n in self.names()]

    def users(self, input_name: str) -> list[str]:
        """Names of the entries that require or accept the input ``input_name``."""
        return [e.name for e in self.entries() if input_name in e.requires or input_name in e.accepts]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items  # an unhashable name is absent, not a TypeError


def check_inputs(
    given: Mapping[str, Any],
    *,
    requires: Iterable[str],
    accepts: Iterable[str],
    by: str,
    users: Callable[[str], list[str]] | None = None,
    kind: str = "method",
    fix_missing: Callable[[str], str] | None = None,
    allow_unused: bool = False,
) -> None:
    """Refuse a call whose inputs do not match what the method declares.

    Args:
        given: the optional inputs passed, by name (a value of None counts as not passed).
        requires: inputs the method cannot run without: a missing one raises, naming it.
        accepts: further inputs the method consumes when given.
        by: the method, for the messages (e.g. ``"the 'grpo' preset"``).
        users: for an unused input, the names of the methods that would consume it (for the message).
        kind: what those methods are, for the message (``"preset"``, ``"estimator"``).
        fix_missing: the advice for a missing required input (default ``"pass <name>=..."``).
        allow_unused: let inputs that nothing consumes pass (for trainer adapters that always pass
            everything); missing required inputs still raise.
    """
    required = tuple(requires)
    passed = {k for k, v in given.items() if v is not None}
    for name in required:
        if name not in passed:
            fix = fix_missing(name) if fix_missing is not None else f"pass {name}=..."
            raise InputError(name, f"{name}=..., required by {by}", "None", fix)
    if allow_unused:
        return
    consumed = set(required) | set(accepts)
    for name in sorted(passed - consumed):
        others = users(name) if users is not None else []
        hint = f" (the {kind}{'s' if len(others) > 1 else ''} {', '.join(others)} would)" if others else ""
        raise InputError(
            name,
            f"only inputs that {by} consumes ({', '.join(sorted(consumed)) or 'none beyond the common ones'})",
            f"{name}=..., which nothing configured reads{hint}",
            f"drop {name}, choose a method that uses it, or pass allow_unused=True to ignore it on purpose",
        )


# ------------------------------------------------------------------------------------------- function families

STANDARD_INPUTS: frozenset[str] = frozenset(
    {
        "rewards",
        "group",
        "advantages",
        "mask",
        "valid",
        "logp",
        "old_logp",
        "behav_logp",
        "ref_logp",
        "topk_logp",
        "topk_behav_logp",
        "entropy",
        "prompt_ids",
    }
)
"""The library's standard tensor names. A parameter of a registered function with one of these names must be
declared as an input (a family's common input, ``requires`` or ``accepts``): it can never pass as a
hyper-parameter, unchecked."""

_KNOWN_INPUTS: set[str] = set(STANDARD_INPUTS)  # grows with the inputs that every Method declares
_RESERVED = ("experimental", "allow_unused")
F = TypeVar("F", bound=Callable[..., Any])


def _a(kind: str) -> str:
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def _return_class(fn: Callable[..., Any]) -> type | None:
    """The class named by ``fn``'s return annotation, or None (no annotation, or one that does not resolve)."""
    try:
        hint = typing.get_type_hints(fn).get("return")
    except Exception:  # an annotation naming what the module does not import at run time: nothing declared
        return None
    return hint if isinstance(hint, type) else None


def _rebuild(cls: type[Method], values: dict[str, Any]) -> Method:
    return cls(**values)


@dataclass(frozen=True)
class Method:
    """A registered function behind its declarations: ``method(*args, **kwargs)`` checks the call, then calls it.

    What :meth:`MethodRegistry.get` returns. Positional arguments bind to the function's positional parameters
    in order, keywords by name; the keywords are then sorted into

    - the family's ``common`` inputs (e.g. ``rewards`` and ``group`` for estimators), passed on as given;
    - declared inputs (``requires`` and ``accepts``): per-rollout or per-token tensors such as ``mask``,
      ``logp``, ``valid``. A missing required one raises, naming it; a value of None counts as not passed;
    - hyper-parameters: every other parameter of the function, passed through (one without a default must be
      given);
    - ``experimental`` (required ``True`` when :attr:`experimental` gives a reason; forwarded to functions that
      take it) and ``allow_unused`` (drop inputs the method does not consume instead of raising, for trainer
      adapters that pass everything they have).

    Anything else raises an :class:`~rolloutopt.errors.InputError` naming it, never a ``TypeError``: an input
    the method does not consume (a standard or declared input name; the message lists the methods that would
    use it) or an unknown keyword (a misspelt hyper-parameter).

    Attributes:
        name: the registry name.
        fn: the plain function, unchanged (``rolloutopt.advantages.grpo`` is ``get("grpo").fn``).
        requires: inputs beyond the common ones that the function cannot run without.
        accepts: further inputs it consumes when given.
        reference: where the method comes from (arXiv id, authors' code at a commit, trainers that ship it).
        experimental: why the method is partly reconstructed (calls then need ``experimental=True``), or None.
        kind: the family, for messages (``"advantage estimator"``, ``"reward shaper"``, ``"selector"``).
        common: the inputs every method of the family takes first, positionally (checked by the function).
        registry: the registry it belongs to (for the list of methods that would use an unconsumed input).
        hyper: the function's hyper-parameters (its parameters that are neither inputs nor ``experimental``).
        hyper_required: the hyper-parameters without a default.
        returns: the class the function's return annotation names, or None.

    The instance carries the function's ``__doc__``, and ``inspect.signature`` shows the function's signature.
    """

    name: str
    fn: Callable[..., Any]
    requires: tuple[str, ...] = ()
    accepts: tuple[str, ...] = ()
    reference: str = ""
    experimental: str | None = None
    kind: str = "method"
    common: tuple[str, ...] = ()
    registry: MethodRegistry[Any] | None = field(default=None, compare=False, repr=False)
    hyper: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    hyper_required: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    returns: type | None = field(default=None, init=False, compare=False, repr=False)
    _positional: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    _positional_only: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    _var_keyword: bool = field(default=False, init=False, compare=False, repr=False)
    _takes_experimental: bool = field(default=False, init=False, compare=False, repr=False)
    _signed: bool = field(default=True, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        what = f"the {self.kind} {self.name!r}"
        if not callable(self.fn):
            raise InputError("fn", "a function", repr(self.fn), f"register a callable as {what}")
        fn_name = getattr(self.fn, "__name__", repr(self.fn))
        requires = _names(self.requires, "requires", self.name)
        accepts = _names(self.accepts, "accepts", self.name)
        common = _names(self.common, "common", self.name)
        for attr, value in (("requires", requires), ("accepts", accepts), ("common", common)):
            object.__setattr__(self, attr, value)
        if not isinstance(self.reference, str):
            raise InputError("reference", "a string", repr(self.reference), f"describe where {what} comes from")
        if self.experimental is not None and (not isinstance(self.experimental, str) or not self.experimental):
            raise InputError(
                "experimental", "the reason (a non-empty string) or None", repr(self.experimental), f"explain {what}"
            )
        declared = requires + accepts
        for names, where in (
            (set(requires) & set(accepts), "requires and accepts"),
            (set(declared) & set(common), "the common inputs and requires/accepts"),
        ):
            if names:
                first = sorted(names)[0]
                raise InputError(first, f"each input declared once for {what}", f"{first} in {where}", "list it once")
        for reserved in _RESERVED:
            if reserved in declared:
                raise InputError(reserved, f"an input name other than {reserved!r}", reserved, "rename the input")
        try:
            sig: inspect.Signature | None = inspect.signature(self.fn)
        except (TypeError, ValueError):  # a callable without a signature: its keywords cannot be checked
            sig = None
        if sig is None:
            object.__setattr__(self, "_signed", False)
        else:
            params = sig.parameters
            kinds = inspect.Parameter
            named = [n for n, p in params.items() if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
            positional = tuple(
                n for n, p in params.items() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
            )
            var_kw = any(p.kind == kinds.VAR_KEYWORD for p in params.values())
            if positional[: len(common)] != common:
                raise InputError(
                    "fn",
                    f"{_a(self.kind)} taking ({', '.join(common)}, ...) first",
                    f"{fn_name}({', '.join(positional[: max(len(common), 1) + 1])}, ...)",
                    "register it with the registry of its family (estimators, reward shapers, selectors)",
                )
            if not var_kw:
                for n in declared:
                    if n not in named:
                        raise InputError(
                            "requires" if n in requires else "accepts",
                            f"inputs that {fn_name} takes ({', '.join(named)})",
                            n,
                            f"declare only parameters of {fn_name}",
                        )
            for n in named:
                if n in STANDARD_INPUTS and n not in common and n not in declared:
                    raise InputError(
                        "accepts",
                        f"every input of {fn_name} declared (its parameter {n!r} is a standard input name)",
                        f"requires={requires}, accepts={accepts}",
                        f"declare {n} in requires (no default) or accepts (optional)",
                    )
            hyper = tuple(n for n in named if n not in common and n not in declared and n != "experimental")
            no_default = tuple(n for n in hyper if params[n].default is inspect.Parameter.empty)
            object.__setattr__(self, "hyper", hyper)
            object.__setattr__(self, "hyper_required", no_default)
            object.__setattr__(self, "_positional", positional)
            object.__setattr__(
                self, "_positional_only", tuple(n for n in named if params[n].kind == kinds.POSITIONAL_ONLY)
            )
            object.__setattr__(self, "_var_keyword", var_kw)
            object.__setattr__(self, "_takes_experimental", "experimental" in named)
        object.__setattr__(self, "returns", _return_class(self.fn))
        object.__setattr__(self, "__doc__", getattr(self.fn, "__doc__", None))
        object.__setattr__(self, "__wrapped__", self.fn)  # inspect.signature(method) shows the function's
        object.__setattr__(self, "__name__", fn_name)
        _KNOWN_INPUTS.update(declared, common)

    def __reduce__(self) -> tuple[Any, ...]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name != "registry"}
        return (_rebuild, (type(self), values))

    def _users(self, input_name: str) -> tuple[str, list[str]]:
        return (self.kind, []) if self.registry is None else self.registry.would_use(input_name)

    def _keywords(self) -> str:
        inputs = ", ".join((*self.requires, *self.accepts)) or "none"
        return f"inputs {inputs}; hyper-parameters {', '.join(self.hyper) or 'none'}"

    def _flags(self, experimental: Any, allow_unused: Any, by: str) -> None:
        for flag, flag_name in ((experimental, "experimental"), (allow_unused, "allow_unused")):
            if not isinstance(flag, bool):
                raise InputError(flag_name, "a bool", repr(flag), f"pass {flag_name}=True or False")
        if self.experimental is not None and not experimental:
            raise InputError(
                "experimental",
                f"experimental=True for {by}: {self.experimental}",
                repr(experimental),
                "pass experimental=True to acknowledge the reconstruction (the docstring says what is reconstructed)",
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Check the call against the declarations (see the class docstring), then return ``fn(...)``."""
        by = f"the {self.name!r} {self.kind}"
        if not self._signed:  # nothing to check the keywords against: only the flags
            self._flags(kwargs.get("experimental", False), kwargs.get("allow_unused", False), by)
            return self.fn(*args, **{k: v for k, v in kwargs.items() if k not in _RESERVED})
        if len(args) > len(self._positional):
            raise InputError(
                "args",
                f"at most {len(self._positional)} positional arguments for {by} ({', '.join(self._positional)})",
                str(len(args)),
                "pass the other inputs and the hyper-parameters by keyword",
            )
        given = dict(zip(self._positional, args, strict=False))
        for key in kwargs:
            if key in given:
                raise InputError(key, "one value", "a positional and a keyword value", f"pass {key} once")
        given.update(kwargs)
        experimental = given.pop("experimental", False)
        self._flags(experimental, given.get("allow_unused", False), by)
        allow_unused = given.pop("allow_unused", False)
        for name in self.common:
            if name not in given:
                raise InputError(
                    name,
                    f"{name} for {by} (every {self.kind} is called as f({', '.join(self.common)}, **inputs))",
                    "nothing",
                    f"pass {name}",
                )
        declared = (*self.requires, *self.accepts)
        inputs: dict[str, Any] = {}
        call: dict[str, Any] = {}
        for key, value in given.items():
            if key in self.common or key in self.hyper:
                call[key] = value
            elif key in declared:
                inputs[key] = value
                if value is not None:  # None counts as not passed: the function's own default applies
                    call[key] = value
            elif key in _KNOWN_INPUTS or self._users(key)[1]:
                inputs[key] = value  # an input the method does not consume: check_inputs refuses it
            elif self._var_keyword:
                call[key] = value
            else:
                raise InputError(
                    key, f"a keyword of {by}: {self._keywords()}", f"{key}=...", "remove it or fix its spelling"
                )
        unused = sorted(k for k, v in inputs.items() if v is not None and k not in declared)
        kind, users = self._users(unused[0]) if unused else (self.kind, [])
        check_inputs(
            inputs,
            requires=self.requires,
            accepts=self.accepts,
            by=by,
            users=lambda _: users,
            kind=kind,
            allow_unused=allow_unused,
        )
        for name in self.hyper_required:
            if name not in call:
                raise InputError(
                    name, f"{name}=..., a hyper-parameter of {by} without default", "nothing", f"pass {name}=..."
                )
        if self._takes_experimental:
            call["experimental"] = experimental
        leading = []
        for name in self._positional_only:
            if name not in call:
                break
            leading.append(call.pop(name))
        return self.fn(*leading, **call)


M = TypeVar("M", bound=Method)


class MethodRegistry(Registry[M]):
    """The registry of a family of plain functions: ``register(name, fn, ...)`` stores ``fn`` as a :class:`Method`.

    Args:
        kind: the family, for messages (``"advantage estimator"``).
        method: the :class:`Method` class to wrap functions in (a subclass may add declarations).
        common: the inputs every method of the family takes first, positionally (``("rewards", "group")``).
        result: the class every method must return (checked against the return annotation), or None.

    ``related`` lists the registries of neighbouring families: an input no method of this one consumes names
    the methods there that would (``entropy`` passed to an estimator names the selector ``d3s``).
    """

    def __init__(self, kind: str, method: type[M], *, common: Sequence[str] = (), result: type | None = None) -> None:
        super().__init__(kind)
        self.method = method
        self.common = tuple(common)
        self.result = result
        self.related: list[MethodRegistry[Any]] = []

    def register(
        self,
        name: str,
        obj: Callable[..., Any],
        *,
        requires: Iterable[str] | None = None,
        accepts: Iterable[str] | None = None,
        reference: str | None = None,
        experimental: str | None = None,
        overwrite: bool = False,
        **declared: Any,
    ) -> M:
        """Wrap ``obj`` (a function, or a :class:`Method` to re-register) and bind it to ``name``.

        The declarations default to ``obj``'s attributes of the same names (a :class:`Method`'s fields; empty
        for a plain function); further keywords are fields of the family's :class:`Method` class. Registering the
        same function with the same declarations again is a no-op; anything else under a taken name raises
        unless ``overwrite``. A function whose return annotation is not the family's result class raises.
        """
        _check_name(name, self.kind)
        fn = obj.fn if isinstance(obj, Method) else obj
        ref = getattr(obj, "reference", "") if reference is None else reference
        exp = getattr(obj, "experimental", None) if experimental is None else experimental
        base = {f.name for f in dataclasses.fields(Method) if f.init}
        own = {f.name for f in dataclasses.fields(self.method) if f.init} - base
        for key in declared:
            if key not in own:
                raise InputError(
                    key,
                    f"a declaration of {_a(self.kind)}: requires, accepts, reference, experimental"
                    + "".join(f", {k}" for k in sorted(own)),
                    f"{key}=...",
                    "remove it or fix its spelling",
                )
        extra = {k: getattr(obj, k) for k in own if hasattr(obj, k)}
        extra.update(declared)
        method = self.method(
            name=name,
            fn=fn,
            requires=_names(getattr(obj, "requires", ()) if requires is None else requires, "requires", name),
            accepts=_names(getattr(obj, "accepts", ()) if accepts is None else accepts, "accepts", name),
            reference=ref if isinstance(ref, str) else "",
            experimental=exp,
            kind=self.kind,
            common=self.common,
            registry=self,
            **extra,
        )
        if self.result is not None and method.returns is not None and not issubclass(method.returns, self.result):
            raise InputError(
                "obj",
                f"{_a(self.kind)} returning {self.result.__name__}",
                f"{name!r}, which returns {method.returns.__name__}",
                "register it with the registry of its family (e.g. reward shapers or selectors)",
            )
        current = self._items.get(name)
        if current is not None and current.obj == method:
            return current.obj
        super().register(name, method, overwrite=overwrite)
        return method

    def decorator(self, name: str, **declared: Any) -> Callable[[F], F]:
        """``@registry.decorator("name", requires=...)`` registers the function and leaves it plain."""

        def wrap(fn: F) -> F:
            self.register(name, fn, **declared)
            return fn

        return wrap

    def would_use(self, input_name: str) -> tuple[str, list[str]]:
        """The methods that consume ``input_name`` and their kind: this registry's, else the related ones'.

        Returns ``(kind, names)``: ``(self.kind, names)`` when a method of this registry consumes the input;
        otherwise the methods of the related registries (``(their kind, names)`` when they are all of one
        registry, ``("method", ["<kind> <name>", ...])`` when of several), or ``(self.kind, [])``.
        """
        own = self.users(input_name)
        if own:
            return self.kind, own
        found = [(reg.kind, reg.users(input_name)) for reg in self.related]
        found = [(k, names) for k, names in found if names]
        if len(found) == 1:
            return found[0]
        return ("method", [f"{k} {n}" for k, names in found for n in names]) if found else (self.kind, [])
