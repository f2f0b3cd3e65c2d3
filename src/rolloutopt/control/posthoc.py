"""The registry of post-hoc rule functions (``rolloutopt.control.posthoc.get``, ...).

A post-hoc rule is called once on a finished batch, ``get(name)(**inputs, **hyper_parameters)``, and returns the
rewritten batch: DOT (:mod:`~rolloutopt.control.dot`), JET's reward (:mod:`~rolloutopt.control.jet`), the DLER
penalties (:mod:`rolloutopt.advantages.dler`), the soft compression penalty
(:mod:`~rolloutopt.control.soft_compression`) and Step-GRPO's step-aware reward. It is a second registry beside
:data:`rolloutopt.control.REGISTRY` because the rules are called differently: no construction, no state, one
call per batch. :mod:`rolloutopt.control` fills it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rolloutopt.registry import Entry, Registry

__all__: list[str] = []

REGISTRY: Registry[Callable[..., Any]] = Registry("post-hoc rule")
"""The post-hoc rule functions by name (``get("dot")(rewards=..., lengths=..., group=..., experimental=True)``);
filled by :mod:`rolloutopt.control`, which also registers Step-GRPO's :func:`~rolloutopt.control.step_aware_reward`.
Each entry's ``requires`` are the batch tensors the function cannot run without (passing None raises an
:class:`~rolloutopt.errors.InputError` naming it), ``accepts`` the optional ones (``mask``)."""


def get(name: str) -> Callable[..., Any]:
    """The post-hoc rule function registered as ``name`` (an :class:`~rolloutopt.errors.InputError` lists them)."""
    return REGISTRY.get(name)


def entry(name: str) -> Entry[Callable[..., Any]]:
    """The :class:`~rolloutopt.registry.Entry` of post-hoc rule ``name`` (function, ``requires``, ``accepts``,
    ``reference``, ``experimental``)."""
    return REGISTRY.entry(name)


def names() -> list[str]:
    """Names of every registered post-hoc rule, sorted."""
    return REGISTRY.names()


def register(
    name: str,
    fn: Callable[..., Any],
    *,
    requires: tuple[str, ...] = (),
    accepts: tuple[str, ...] = (),
    reference: str = "",
    experimental: str | None = None,
    overwrite: bool = False,
) -> Callable[..., Any]:
    """Register a post-hoc rule function with its declarations; a different function under a taken name raises
    unless ``overwrite``."""
    return REGISTRY.register(
        name,
        fn,
        requires=requires,
        accepts=accepts,
        reference=reference,
        experimental=experimental,
        overwrite=overwrite,
    )
