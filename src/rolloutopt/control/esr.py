r"""ESR (arXiv 2605.27028): Early Stopping Rollout for on-policy distillation.

:class:`ESR` (streaming :class:`~rolloutopt.control.StopRule`) keeps a fixed prefix of N = 100 tokens, and
:func:`esr_mask` builds the loss mask. N = 100 comes from a summary; no ``experimental`` flag is needed.
Provenance and worked examples: ``docs/methods/opd_horizon.md``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_index,
    as_mask,
    checks_enabled,
    describe,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt.control._base import StepInputs, StopRule, StopState
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolBT, IntB

__all__ = ["ESR", "esr_mask"]


class ESR(StopRule):
    r"""Early Stopping Rollout for OPD: keep only the first N response tokens of every student rollout.

    .. math::
        \text{stop at } t = N - 1 \qquad(\text{every row keeps } \min(N, \ell_i) \text{ tokens})

    The rule is ``max_new_tokens = N`` as a stop rule (reason ``"prefix_limit"``), so one generation loop can run
    it beside the others; a row that emits EOS earlier (``active`` False) is used as is. The distillation loss
    (reverse KL against the teacher) runs on those tokens only — :func:`esr_mask` builds the mask — and no reward
    is needed, the OPD signal being per token. Reference: ESR, arXiv 2605.27028 ("off-policy teacher decay":
    a teacher continuing a long student prefix degrades); N = 100 is the default reported by one summary
    (``docs/methods/opd_horizon.md``).

    Args:
        n: N >= 1, the prefix length (default 100).

    Requires no input (it counts each row's tokens). Edge cases: an all-inactive step changes nothing; N = 1 stops
    after one token.
    """

    reason_names = ("running", "prefix_limit")
    reference: ClassVar[str] = "arXiv 2605.27028 (ESR: early stopping rollout for OPD)"

    def __init__(self, *, n: int = 100) -> None:
        self.n = _int(n, "n", 1)

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        return state.extra, state.steps + 1 >= self.n, 1


def esr_mask(mask: BoolBT, lengths: IntB | None = None, *, n: int = 100) -> BoolBT:
    r"""ESR's loss mask: the first ``min(N, length)`` response tokens of every row.

    .. math::
        m'_{i,t} = m_{i,t} \wedge t < \min(N, \ell_i)

    Args:
        mask: bool ``[B, T]`` the loss mask (right-padded responses).
        lengths: int ``[B]`` response lengths (optional; without it the mask alone bounds the row).
        n: N >= 1 (default 100, arXiv 2605.27028 per one summary).

    Returns:
        bool ``[B, T]``; with ``mask = t < lengths`` every row covers exactly ``min(N, length)`` tokens. An empty
        batch gives an empty mask.
    """
    _int(n, "n", 1)
    dims = Dims()
    m = as_mask(mask, "mask", dims, "B T")
    t = torch.arange(m.shape[1], device=m.device)[None, :]
    keep = m & (t < n)
    if lengths is not None:
        ell = as_index(lengths, "lengths", dims, "B").to(m.device)
        if checks_enabled() and bool((ell < 0).any()):
            raise InputError("lengths", "non-negative lengths", describe(lengths), "pass response lengths")
        keep = keep & (t < ell[:, None])
    return keep
