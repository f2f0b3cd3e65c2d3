r"""Value-based abstention: dynamic mid-generation abstention (arXiv 2604.18419).

The rule looks at a rollout only at *checkpoints* and asks one question there: is this partial rollout worth
finishing? (``docs/methods/early_stop.md``.)

- :class:`Abstention`: every ``every`` tokens, estimate the value :math:`\hat V(s_t)` of the partial rollout and
  abstain (stop, terminal reward :math:`r_{abs}`) when :math:`\hat V < r_{abs}`. The estimate is either given by
  the engine (extra input ``values``) or computed by a pluggable estimator, by default the KL-regularised soft
  value :func:`soft_value` over the rewards of a few cheap continuations (extra input ``continuation_rewards``).

It reads its checkpoint inputs only at the rows due at that step: other rows may hold anything (NaN included)
and a stopped row is never evaluated again. :meth:`Abstention.due` tells the engine which rows need the (costly)
inputs at the next step. ARRoL's quality-head pruning, the other checkpoint rule, is in
:mod:`~rolloutopt.control.arrol`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt._validation import Dims, as_float, checks_enabled, describe, finite, require_experimental
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import check_real as _real
from rolloutopt.control._base import StepInputs, StopResult, StopState
from rolloutopt.control._checkpoint import _KINDS, _CheckpointRule, _output
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, FloatB

__all__ = ["Abstention", "SoftValue", "ValueEstimator", "soft_value"]

#: A value estimator for :class:`Abstention`: ``(inputs, due bool [N]) -> V_hat float [N]``; only the ``due`` rows
#: of the result are read (and only they need valid inputs).
ValueEstimator = Callable[[StepInputs, BoolB], FloatB]


def _soft_value(r: Tensor, beta: float) -> Tensor:
    return beta * (torch.logsumexp(r / beta, dim=-1) - math.log(r.shape[-1]))


def soft_value(rewards: Float[Tensor, "B J"], *, beta: float = 1.0) -> FloatB:
    r"""The KL-regularised soft value of a state from the rewards of a few continuations sampled from it.

    .. math::
        \hat V(s_t) = \beta \log \frac1J \sum_{j=1}^J \exp(r_j / \beta)

    the value of the KL-regularised objective (temperature :math:`\beta`) estimated from :math:`J` continuations;
    it lies between their mean (:math:`\beta \to \infty`) and their max (:math:`\beta \to 0`). Reference:
    "Knowing When to Quit", arXiv 2604.18419 (``docs/methods/early_stop.md``); the paper derives an efficient
    approximation of :math:`V`; this form is our **reconstruction** of it.

    Args:
        rewards: float ``[N, J]``, ``J >= 1`` continuation rewards per row.
        beta: :math:`\beta > 0` (default 1.0: ours, the paper's value is unknown).

    Returns:
        float32 ``[N]``; computed with ``logsumexp``, finite for finite rewards. ``N = 0`` gives ``[0]``.
    """
    b = _real(beta, "beta", 0.0, open_low=True)
    r = as_float(rewards, "rewards", Dims(), "N J")
    if checks_enabled():
        if r.shape[1] == 0:
            raise InputError("rewards", "J >= 1 continuation rewards per row", describe(r), "pass [N, J] with J >= 1")
        finite(r, "rewards")
    return _soft_value(r, b)


@dataclass(frozen=True, kw_only=True)
class SoftValue:
    """The default :class:`Abstention` estimator: :func:`soft_value` over the extra input ``continuation_rewards``.

    ``beta``: the temperature (1.0, ours). ``inputs`` declares the extra input it reads (``[N, J]``); rows that are
    not due may hold anything.
    """

    beta: float = 1.0

    def __post_init__(self) -> None:
        _real(self.beta, "beta", 0.0, open_low=True)

    @property
    def inputs(self) -> dict[str, tuple[str, str]]:
        """The extra step inputs this estimator reads: ``continuation_rewards`` float ``[N, J]``."""
        return {"continuation_rewards": ("N J", "float")}

    def __call__(self, x: StepInputs, due: BoolB) -> FloatB:
        r = x.need("continuation_rewards", "SoftValue")
        if checks_enabled() and r.shape[1] == 0:
            raise InputError("continuation_rewards", "J >= 1 rewards per row", describe(r), "pass [N, J], J >= 1")
        r = torch.where(due[:, None], r, torch.zeros((), dtype=r.dtype, device=r.device))
        return _soft_value(r, self.beta)


class Abstention(_CheckpointRule):
    r"""Dynamic mid-generation abstention [reconstructed schedule and estimator]: stop when the estimated value of
    the partial rollout falls below the abstention reward.

    .. math::
        \text{at } t \in \{K, 2K, \dots\}: \quad \text{abstain} \iff \hat V(s_t) < r_{abs}

    (:math:`t` counts the row's generated tokens, the current one included.) An abstained rollout outputs
    "abstain" and earns :math:`r_{abs}`: :meth:`finalize` puts it in the result (``result.rewards(rewards)`` for
    sequence rewards, :func:`~rolloutopt.control.absorbing_failure` for token rewards). Reference: "Knowing When to Quit", arXiv 2604.18419
    (``docs/methods/early_stop.md``): the rule :math:`V < r_{abs}` is the paper's (proven optimal in its
    regularised view); the check every :math:`K` tokens and the estimators are **reconstructed**, so
    ``experimental=True`` is required.

    The value at a checkpoint comes from, in this order: the extra input ``values [N]`` when given (a value head
    run by the engine); else the ``estimator`` (default :class:`SoftValue`: :func:`soft_value` over the extra
    input ``continuation_rewards [N, J]``). An estimator is called with ``(inputs, due)`` and only its ``due``
    rows are read; it is called only when the inputs it declares (its ``inputs`` attribute, or
    ``estimator_inputs``) were passed, so the engine passes them at checkpoint steps only (see :meth:`due`). A
    stopped row is never due again, so it is never evaluated again. At a step with due rows and no value source,
    ``step`` raises (checks on) or does not stop them (checks off).

    Args:
        r_abs: :math:`r_{abs}`, the abstention reward; required (it sets the compute–information trade-off; the
            paper gives no default).
        every: :math:`K`, tokens between checkpoints (32: ours).
        estimator: a :data:`ValueEstimator` (default ``SoftValue(beta=beta)``).
        estimator_inputs: the extra step inputs a custom estimator reads, ``name -> (shape spec, kind)`` like
            :attr:`StopRule.extra_inputs` (default: the estimator's ``inputs`` attribute, else none).
        beta: the default estimator's temperature (1.0: ours).
        experimental: must be True.

    Edge cases: inactive rows are never checked; an all-inactive step is a no-op; ``init(0)`` works. The per-row
    state keeps ``value`` (the last checkpoint's estimate, 0 before any) and ``checks`` (checkpoints evaluated).
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "abstain")
    #: read at checkpoint steps only: ``values``, else the estimator's inputs (a custom estimator's replace
    #: ``continuation_rewards`` in the instance's ``accepts``)
    accepts: ClassVar[tuple[str, ...]] = ("values", "continuation_rewards")
    #: the default estimator's inputs; a custom estimator's declared inputs are accepted as well
    extra_inputs: ClassVar[dict[str, tuple[str, str]]] = {
        "values": ("N", "float"),
        "continuation_rewards": ("N J", "float"),
    }
    reference: ClassVar[str] = "arXiv 2604.18419 (Knowing When to Quit: dynamic mid-generation abstention)"
    experimental: ClassVar[str | None] = "the checkpoint schedule and the value estimator are reconstructed"

    def __init__(
        self,
        *,
        r_abs: float,
        every: int = 32,
        estimator: ValueEstimator | None = None,
        estimator_inputs: dict[str, tuple[str, str]] | None = None,
        beta: float = 1.0,
        experimental: bool = False,
    ) -> None:
        require_experimental(experimental, "the abstention schedule and value estimator", "docs/methods/early_stop.md")
        self.r_abs = _real(r_abs, "r_abs")
        self.every = _int(every, "every", 1)
        if estimator is not None and not callable(estimator):
            raise InputError("estimator", "a callable (inputs, due) -> [N]", describe(estimator), "pass a function")
        self.estimator: ValueEstimator = SoftValue(beta=beta) if estimator is None else estimator
        declared = getattr(self.estimator, "inputs", {}) if estimator_inputs is None else estimator_inputs
        if not isinstance(declared, dict) or any(
            not isinstance(k, str) or k == "values" or not isinstance(v, tuple) or len(v) != 2 or v[1] not in _KINDS
            for k, v in declared.items()
        ):
            raise InputError(
                "estimator_inputs",
                "a dict name -> (shape spec, 'float' | 'int' | 'bool'), without 'values'",
                describe(declared),
                "e.g. {'hidden': ('N D', 'float')}",
            )
        self._estimator_keys = tuple(declared)
        self._due_inputs = {"values": ("N", "float"), **declared}  # what step() accepts besides extra_inputs
        self.__dict__["accepts"] = tuple(self._due_inputs)  # this instance's checkpoint inputs

    def _due_mask(self, state: StopState, live: Tensor) -> Tensor:
        return live & ((state.steps + 1) % self.every == 0)

    def due(self, state: StopState, active: BoolB | None = None) -> BoolB:
        """Bool ``[N]``: the rows evaluated at the next ``step`` (live and at a checkpoint), i.e. the rows for which
        the engine must provide the checkpoint inputs. ``active`` bool ``[N]`` as for ``step`` (default all)."""
        return self._due_rows(state, active)

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        super()._init(n, device, **inputs)
        return {"value": torch.zeros(n, device=device), "checks": torch.zeros(n, dtype=torch.long, device=device)}

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        due = self._due_mask(state, x.live)
        values = x.extra.get("values")
        if values is not None:
            v = values
        elif all(k in x.extra for k in self._estimator_keys):
            v = _output(self.estimator(x, due), state.batch_size, due, "estimator")
        else:
            if checks_enabled() and bool(due.any()):
                missing = [k for k in self._estimator_keys if k not in x.extra]
                raise InputError(
                    "values",
                    f"values [N] or the estimator's inputs ({', '.join(missing)}) at a checkpoint step",
                    "none of them",
                    "pass them at the steps where rule.due(state) has a True row",
                )
            due = torch.zeros_like(due)
            v = state.extra["value"]
        fire = due & (v < self.r_abs)
        extra = {
            "value": torch.where(due, v, state.extra["value"]),
            "checks": state.extra["checks"] + due.long(),
        }
        return extra, fire, 1

    def finalize(self, state: StopState) -> StopResult:
        r""":meth:`~rolloutopt.control.StopRule.finalize` plus the abstention reward: ``terminal_reward`` is
        :math:`r_{abs}` on the abstained rows (``terminal_rows``), so ``result.rewards(rewards)`` gives them
        :math:`r_{abs}` and leaves the others unchanged (arXiv 2604.18419: an abstained rollout earns
        :math:`r_{abs}`)."""
        res = super().finalize(state)
        rows = res.stopped & (res.reason == 1)
        reward = torch.full(rows.shape, self.r_abs, dtype=torch.float32, device=rows.device)
        return replace(res, terminal_reward=reward, terminal_rows=rows)
