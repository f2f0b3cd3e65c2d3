"""Rollout budget allocators and prompt selectors (``docs/api/allocators.md``).

Every allocator speaks one protocol — ``plan(prompt_ids, budget)`` → ``next()``/``observe()`` → ``finish()`` →
``update(result)`` — implemented once in :class:`Conversation` and driven by :func:`run_step` given a
``generate(request)`` callable. What an allocator learns from beyond rewards (:data:`SIGNALS`) travels with
``observe`` and in ``result.signals``. ``state_dict()``/``load_state_dict()`` checkpoint it.
:class:`PromptTable` is the one bounded per-prompt store that allocators share (a checkpoint holds it once);
:class:`PromptHistory` the common statistics kept in it. A budget is rollouts (an int) or tokens
(:class:`TokenBudget`, with the expected lengths :class:`ResponseLengths` learns).
"""

from __future__ import annotations

from rolloutopt.allocators import (
    aero,
    ar3po,
    baselines,
    coba,
    dars,
    depo,
    dots,
    dps,
    dynamic,
    e3,
    gdro,
    gdro_bins,
    greso,
    history,
    hive,
    knapsack,
    pilot_commit,
    table,
    tokens,
    v05_budget,
    vigor,
    xrpo,
)
from rolloutopt.allocators._base import (
    SIGNALS,
    AllocationResult,
    Allocator,
    Conversation,
    OneShotPlan,
    Request,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators.aero import *  # noqa: F403
from rolloutopt.allocators.ar3po import *  # noqa: F403
from rolloutopt.allocators.baselines import *  # noqa: F403
from rolloutopt.allocators.coba import *  # noqa: F403
from rolloutopt.allocators.dars import *  # noqa: F403
from rolloutopt.allocators.depo import *  # noqa: F403
from rolloutopt.allocators.dots import *  # noqa: F403
from rolloutopt.allocators.dps import *  # noqa: F403
from rolloutopt.allocators.driver import Generated, run_step
from rolloutopt.allocators.dynamic import *  # noqa: F403
from rolloutopt.allocators.e3 import *  # noqa: F403
from rolloutopt.allocators.gdro import *  # noqa: F403
from rolloutopt.allocators.gdro_bins import *  # noqa: F403
from rolloutopt.allocators.greso import *  # noqa: F403
from rolloutopt.allocators.history import *  # noqa: F403
from rolloutopt.allocators.hive import *  # noqa: F403
from rolloutopt.allocators.knapsack import *  # noqa: F403
from rolloutopt.allocators.pilot_commit import *  # noqa: F403
from rolloutopt.allocators.table import *  # noqa: F403
from rolloutopt.allocators.tokens import *  # noqa: F403
from rolloutopt.allocators.v05_budget import *  # noqa: F403
from rolloutopt.allocators.vigor import *  # noqa: F403
from rolloutopt.allocators.xrpo import *  # noqa: F403

__all__ = [
    "SIGNALS",
    "AllocationResult",
    "Allocator",
    "Conversation",
    "Generated",
    "OneShotPlan",
    "Request",
    "as_prompt_ids",
    "check_budget",
    "run_step",
]
__all__ += baselines.__all__
__all__ += history.__all__
__all__ += table.__all__
__all__ += tokens.__all__
__all__ += dynamic.__all__
__all__ += vigor.__all__
__all__ += pilot_commit.__all__
__all__ += gdro_bins.__all__
__all__ += gdro.__all__
__all__ += dps.__all__
__all__ += greso.__all__
__all__ += coba.__all__
__all__ += knapsack.__all__
__all__ += dars.__all__
__all__ += e3.__all__
__all__ += ar3po.__all__
__all__ += aero.__all__
__all__ += v05_budget.__all__
__all__ += dots.__all__
__all__ += xrpo.__all__
__all__ += hive.__all__
__all__ += depo.__all__

from rolloutopt.registry import Registry  # noqa: E402

REGISTRY: Registry[type] = Registry("allocator")
"""Allocator classes by name, the snake_case of the class name, for trainers whose configs hold strings
(``get("dps")(n=8)``). Each entry declares ``requires`` (the signals beyond rewards that ``plan``/``update``
cannot run without, e.g. DEPO's ``entropy``), ``accepts`` (the signals they read when given), ``reference``
(arXiv id, authors' code) and ``experimental`` (why the allocator is reconstructed and needs
``experimental=True``, or None)."""

for _name, _cls in (
    ("uniform", Uniform),  # noqa: F405
    ("dapo_dynamic_sampling", DAPODynamicSampling),  # noqa: F405
    ("vigor", VIGOR),  # noqa: F405
    ("pilot_commit", PilotCommit),  # noqa: F405
    ("prompt_gdro", PromptGDRO),  # noqa: F405
    ("rollout_gdro", RolloutGDRO),  # noqa: F405
    ("dps", DPS),  # noqa: F405
    ("greso", GRESO),  # noqa: F405
    ("coba", CoBA),  # noqa: F405
    ("knapsack", Knapsack),  # noqa: F405
    ("dars", DARS),  # noqa: F405
    ("e3_budget", E3Budget),  # noqa: F405
    ("ar3po", AR3PO),  # noqa: F405
    ("aero", AERO),  # noqa: F405
    ("dots", DOTS),  # noqa: F405
    ("xrpo", XRPO),  # noqa: F405
    ("hive", HIVE),  # noqa: F405
    ("depo", DEPO),  # noqa: F405
    ("v05_budget", V05Budget),  # noqa: F405
):
    REGISTRY.register(_name, _cls)


# The family's four registry functions are the registry's own (rolloutopt.registry.Registry): get(name) returns the
# class, entry(name) its Entry (requires, accepts, reference, experimental), names() and register(name, cls).
get = REGISTRY.get
entry = REGISTRY.entry
names = REGISTRY.names
register = REGISTRY.register

__all__ += ["REGISTRY", "entry", "get", "names", "register"]
