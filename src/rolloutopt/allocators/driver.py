"""One step of any allocator: the conversation driven by a ``generate(request)`` callable.

The testbed, the trainer adapters and the notebooks run allocators through :func:`run_step`, so that every
registered allocator — one-shot or multi-round, with or without signals — is driven the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from rolloutopt._validation import describe
from rolloutopt.allocators._base import AllocationResult, Request
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.errors import InputError
from rolloutopt.typing import IntP

__all__ = ["Generated", "run_step"]

Generated = Tensor | Mapping[str, Tensor | None] | None
"""What ``generate(request)`` returns: the rewards ``[n]`` alone; or a mapping with ``"rewards"`` and the signals
the request asks for (``request.signals``: a rollout signal ``[n]``, a prompt signal ``[R]``); for a probe
request (``request.is_probe``) a mapping of the measured signals ``[R]`` without rewards, or None when the
trainer cannot measure them (an allocator that only accepts a probe signal then goes on without it)."""


def run_step(
    allocator: Any,
    prompt_ids: IntP,
    budget: int | TokenBudget,
    generate: Callable[[Request], Generated],
    *,
    update: bool = True,
    on_finish: Callable[[Any, AllocationResult], None] | None = None,
) -> AllocationResult:
    """Run one step of ``allocator``: plan, answer every request with ``generate``, finish, and update.

    .. code-block:: python

        plan = allocator.plan(prompt_ids, budget)
        while (request := plan.next()) is not None:
            answer = generate(request)              # rewards, or {"rewards": ..., "entropy": ...}
            plan.observe(request, rewards, **signals)
        result = plan.finish()
        on_finish(plan, result)                     # if given
        allocator.update(result)                    # unless update=False

    ``generate`` is called once per request, in order; a multi-round allocator (top-ups, dynamic sampling)
    calls it several times in a step, a one-shot allocator once, an allocator with a probe signal (HIVE's
    prompt entropy) first with a probe request (``request.is_probe``: counts all 0). Each answer must carry the
    signals the allocator requires (``request.signals`` lists every signal it reads); ``observe`` refuses a
    missing required signal and any signal the request did not ask for.

    Args:
        allocator: any allocator (:func:`rolloutopt.allocators.get` returns their classes).
        prompt_ids: the candidate prompts, int64 ``[P]``.
        budget: the step's budget: rollouts (an int) or a :class:`~rolloutopt.allocators.TokenBudget` (then
            ``generate`` must return each rollout's ``tokens``; :mod:`rolloutopt.allocators.tokens`).
        generate: ``request -> Generated`` (see :data:`Generated`).
        update: call ``allocator.update(result)`` (default); False leaves it to the caller, e.g. to update on
            one data-parallel rank's merged result.
        on_finish: ``on_finish(plan, result)``, called once the plan is finished and before the update: where a
            trainer reads what a plan hands back beside its result, the stored responses to train on again
            (:class:`~rolloutopt.allocators.AR3PO`'s ``plan.reused()``, :class:`~rolloutopt.allocators.DOTS`'s
            ``plan.replayed()``).

    Returns:
        The step's :class:`~rolloutopt.allocators.AllocationResult`.
    """
    if not callable(generate):
        raise InputError("generate", "a callable request -> rewards (or a mapping)", describe(generate), "pass one")
    if on_finish is not None and not callable(on_finish):
        raise InputError("on_finish", "None or a callable (plan, result) -> None", describe(on_finish), "pass one")
    plan = allocator.plan(prompt_ids, budget)
    while (request := plan.next()) is not None:
        rewards, signals = _split(generate(request), request)
        plan.observe(request, rewards, **signals)
    result: AllocationResult = plan.finish()
    if on_finish is not None:
        on_finish(plan, result)
    if update:
        allocator.update(result)
    return result


def _split(answer: Generated, request: Request) -> tuple[Tensor | None, dict[str, Tensor]]:
    """``(rewards, signals)`` from what ``generate`` returned for ``request``."""
    if answer is None or isinstance(answer, Tensor):
        return answer, {}
    if not isinstance(answer, Mapping):
        raise InputError(
            "generate",
            "a callable returning rewards [n], a mapping {'rewards': ..., signal: ...}, or None for a probe",
            f"a return value {describe(answer)}",
            "return torch.tensor(rewards) or a dict",
        )
    signals = {k: v for k, v in answer.items() if k != "rewards" and v is not None}
    rewards = answer.get("rewards")
    if not request.is_probe and rewards is None:
        raise InputError("rewards", "the 'rewards' of the requested rollouts", "a mapping without them", "add them")
    return rewards, signals
