"""The pieces shared by the checkpoint stop rules (:mod:`~rolloutopt.control.abstention`,
:mod:`~rolloutopt.control.arrol`): a base class that validates checkpoint-only inputs at the due rows only, the
estimator-output check, and the input kinds an estimator may declare."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_mask, checks_enabled, describe, finite
from rolloutopt.control._base import StepInputs, StopRule, StopState, extra_input
from rolloutopt.errors import InputError

__all__: list[str] = []


class _CheckpointRule(StopRule):
    """Validates the checkpoint-only inputs (``_due_inputs``) at the due rows only; the others are not read."""

    _due_inputs: dict[str, tuple[str, str]]

    def _due_mask(self, state: StopState, live: Tensor) -> Tensor:
        raise NotImplementedError

    def _bound_dims(self) -> dict[str, tuple[int, str]]:
        return {}

    def _due_rows(self, state: StopState, active: Any) -> Tensor:
        if not isinstance(state, StopState):
            raise InputError("state", "a StopState from rule.init()", describe(state), "call rule.init(batch_size)")
        dims = Dims()
        dims.sizes["N"] = (state.batch_size, "state")
        act = (
            torch.ones_like(state.stopped)
            if active is None
            else as_mask(active, "active", dims, "N").to(state.stopped.device)
        )
        return self._due_mask(state, act & ~state.stopped)

    def _inputs(
        self,
        state: StopState,
        logp: Any,
        entropy: Any,
        topk_logp: Any,
        tokens: Any,
        active: Any,
        inputs: dict[str, Any],
    ) -> StepInputs:
        mine = {k: inputs.pop(k) for k in list(inputs) if k in self._due_inputs}
        x = super()._inputs(state, logp, entropy, topk_logp, tokens, active, inputs)
        if not mine:
            return x
        due = self._due_mask(state, x.live)
        dims = Dims()
        dims.sizes["N"] = (state.batch_size, "state")
        dims.sizes.update(self._bound_dims())
        extra = dict(x.extra)
        for key, value in mine.items():
            if value is not None:
                extra[key] = extra_input(value, key, self._due_inputs[key], dims, due)
        return replace(x, extra=extra)


def _output(v: Any, n: int, due: Tensor, name: str) -> Tensor:
    if checks_enabled():
        if not isinstance(v, Tensor) or tuple(v.shape) != (n,) or not v.is_floating_point():
            raise InputError(name, f"a float tensor of shape [{n}] from the estimator", describe(v), "return [N]")
        finite(v, name, due.to(v.device))
    out: Tensor = v
    return out.to(due.device).float()


_KINDS = ("float", "int", "bool")
