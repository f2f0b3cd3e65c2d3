"""Name registries: trainers whose configs hold strings look up estimators, presets and allocators here.

One :class:`Registry` per kind of object (``rolloutopt.advantages``, ``rolloutopt.losses``, and later
allocators); later modules register into the same registries. Registering a name twice with a different
object raises, so built-ins cannot be replaced by accident (verl's ``register_adv_est`` behaviour); pass
``overwrite=True`` to replace one deliberately. Lookup is case-sensitive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from rolloutopt.errors import InputError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to objects of one kind, with clear errors for unknown and duplicate names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T, *, overwrite: bool = False) -> T:
        """Bind ``name`` to ``obj``; the same object again is a no-op, a different one raises unless ``overwrite``."""
        if not isinstance(name, str) or not name:
            raise InputError("name", "a non-empty string", repr(name), f"name the {self.kind}")
        current = self._items.get(name)
        if current is not None and current is not obj and not overwrite:
            raise InputError(
                "name",
                f"a {self.kind} name that is not registered yet",
                f"{name!r}, already bound to {current!r}",
                "choose another name, or pass overwrite=True to replace it",
            )
        self._items[name] = obj
        return obj

    def decorator(self, name: str) -> Callable[[T], T]:
        """``@registry.decorator("name")`` registers the decorated object under ``name``."""

        def wrap(obj: T) -> T:
            return self.register(name, obj)

        return wrap

    def get(self, name: str) -> T:
        """The object bound to ``name``; an :class:`InputError` listing the known names otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise InputError(
                "name",
                f"a registered {self.kind}: {', '.join(self.names())}",
                repr(name),
                f"use one of the listed names or register yours with rolloutopt's {self.kind} registry",
            ) from None

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items  # an unhashable name is absent, not a TypeError
