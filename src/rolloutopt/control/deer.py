r"""DEER — self-truncation by early exit at reasoning-transition markers (arXiv 2504.15895).

:class:`DEER` (streaming :class:`~rolloutopt.control.StopRule`): at a transition marker ("Wait"-style tokens)
the engine probes a trial answer and passes its confidence; the row exits when it is confident. Reconstructed
from the abstract (``experimental=True``). Provenance and worked examples: ``docs/methods/truncation_rules.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from jaxtyping import Int
from torch import Tensor

from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._base import StopState
from rolloutopt.control._markers import _check_flag, _markers, _ProbeGate

__all__ = ["DEER"]


class DEER(_ProbeGate):
    r"""Self-truncation by early exit at reasoning-transition markers (DEER-style): exit when a trial answer is confident.

    At a transition marker ("Wait"-style tokens, ids given by the user) of a live row that has generated at least
    ``min_tokens`` tokens, the engine induces a trial answer (e.g. by an answer-forcing suffix) and passes its
    confidence :math:`c` (the mean token probability of the trial answer) as ``confidence``:

    .. math::
        \text{exit (reason "early_exit") if } c \ge \lambda .

    The kept prefix ends with the marker token (``length = position + 1``). Engines that *replace* the marker by
    the answer inducer, as DEER does with "Wait", drop that last token (``length - 1``).

    Reference: "Dynamic Early Exit in Reasoning Models" (DEER), arXiv 2504.15895.
    **Reconstructed** from the abstract ("monitors model behavior at potential reasoning transition points
    (e.g. "Wait" tokens) and dynamically terminates ... when the model exhibits high confidence in a trial
    answer"), hence ``experimental=True`` is required. The confidence definition, the threshold and the warm-up
    are our choices.

    Args:
        markers: transition-marker token ids (non-empty).
        threshold: :math:`\lambda` in (0, 1]. Default 0.95 — ours.
        min_tokens: no probe before the row has generated this many tokens (the marker included). Default 0 — ours.
        experimental: must be True.

    Inputs of :meth:`~rolloutopt.control.StopRule.step`: ``tokens`` int ``[N]`` (required), ``active`` bool ``[N]``, ``confidence`` float
    ``[N]`` in [0, 1] at the probed rows. ``probe_rows(state, *, tokens, active=None)`` returns the bool ``[N]``
    rows to probe at this step; ``finalize`` adds ``markers_mean`` and ``probes_mean`` to the metrics.

    Edge cases: an all-inactive batch changes nothing; N = 0 works; a row without markers never exits.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "early_exit")
    reference: ClassVar[str] = "arXiv 2504.15895 (DEER: Dynamic Early Exit in Reasoning Models)"
    experimental: ClassVar[str | None] = "the early exit is reconstructed from DEER's abstract"

    def __init__(
        self,
        *,
        markers: Sequence[int] | Int[Tensor, " _"],
        threshold: float = 0.95,
        min_tokens: int = 0,
        experimental: bool = False,
    ) -> None:
        _check_flag(
            experimental,
            "",
            "the self-truncation early exit (DEER, from its abstract)",
            "docs/methods/truncation_rules.md",
        )
        self.markers = _markers(markers)
        _real(threshold, "threshold", 0.0, 1.0, open_low=True)
        _int(min_tokens, "min_tokens", 0)
        self.threshold = float(threshold)
        self.min_tokens = min_tokens
        self._marker_cache = {}

    def _eligible(self, state: StopState, count: Tensor) -> Tensor:
        return state.steps + 1 >= self.min_tokens
