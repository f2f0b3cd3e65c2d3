r"""DUET's marker-gated abort with importance reweighting (arXiv 2605.08441).

:class:`DUETAbort` (streaming :class:`~rolloutopt.control.StopRule`): stop shortly after an answer marker; past
a horizon without one, abort all but a kept sample, whose importance weights (``row_weight`` of the result of
:meth:`DUETAbort.finalize`) keep the loss unbiased. The gate draws are a counter-based hash of (seed, generation, row id). Reconstructed from
the abstract and a public summary (``experimental=True``). Provenance and worked examples:
``docs/methods/truncation_rules.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import Dims, as_index, checks_enabled, describe
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import check_real as _real
from rolloutopt.control._base import StepInputs, StopResult, StopRule, StopState
from rolloutopt.control._markers import _check_flag, _MarkerMixin, _markers, _row_id
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

__all__ = ["DUETAbort"]

_MASK32 = 0xFFFFFFFF


# -- a counter-based uniform: u(seed, epoch, row_id), so that decisions follow rows, not batch positions ------------
def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x < 2**32`` without int64 overflow (the constant split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: Tensor) -> Tensor:
    """The 'lowbias32' integer hash (C. Wellons) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _hash32_int(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _dense_groups(group: Any, n: int, device: torch.device) -> Tensor:
    """Dense group index ``[N]`` in ``[0, G)`` of int ids ``[N]`` or a :class:`~rolloutopt.groups.Groups`."""
    if isinstance(group, Groups):
        if checks_enabled() and group.num_rows != n:
            raise InputError("group", f"a Groups of {n} rows", repr(group), "pass one group id per row")
        return group.inverse.to(device)
    dims = Dims()
    dims.sizes["N"] = (n, "batch_size")
    ids = as_index(group, "group", dims, "N").to(device)
    return Groups(ids).inverse if n > 0 else ids


def _uniform(seed: int, epoch: int, row_id: Tensor) -> Tensor:
    """Per-row uniforms in [0, 1) that depend only on (seed, epoch, row id): float32 ``[N]``."""
    key = _hash32_int((seed & _MASK32) ^ _hash32_int((seed >> 32) ^ _hash32_int(epoch + 0x9E3779B9)))
    x = _hash32((row_id & _MASK32) ^ key)
    x = _hash32(x ^ ((row_id >> 32) & _MASK32))
    return ((x >> 8).to(torch.float32)) * (1.0 / (1 << 24))


# ============================================================================================ DUET (2605.08441)
class DUETAbort(_MarkerMixin, StopRule):
    r"""DUET's marker-gated abort: stop after an answer marker; past a horizon without one, abort all but a sample.

    Per row, with answer-marker ids :math:`\mathcal M` (a closing ``\boxed{}``, a closing code fence, an answer
    span), horizon :math:`H`, keep probability :math:`p` and tail :math:`k`:

    - the row stops :math:`k` tokens after its first marker token (reason ``"answered"``; ``answer_tail=None``
      never stops it there);
    - a row that reaches :math:`H` tokens without a marker is gated once: with :math:`u_i \sim U[0, 1)`, it is
      aborted there (reason ``"aborted"``) if :math:`u_i \ge p`, and otherwise continues to EOS as a survivor;
    - the importance weights (``row_weight`` of :meth:`finalize`'s result) make the kept rollouts an unbiased
      sample of the full-length ones:

    .. math::
        w_i = \begin{cases} 1/p & \text{survived the gate} \\ w_{abort} & \text{aborted} \\ 1 & \text{otherwise}
        \end{cases}, \qquad \mathbb E[w_i f(y_i)] = \mathbb E[f(y_i)] \text{ for } w_{abort} = 0,

    optionally self-normalised per group, :math:`\tilde w_i = w_i\, n_g / \sum_{j \in g} w_j` (0 where
    :math:`\sum_{j \in g} w_j = 0`), over the ``group`` ids given to ``init``. ``result.loss_weights(mask)``
    multiplies them into the truncated mask; or pass ``result.row_weight`` as ``seq_weight`` to
    :func:`~rolloutopt.losses.policy_loss`.

    Randomness: :math:`u_i` is a counter-based hash of (``seed``, the rule's ``init`` count, the row's
    ``row_id``), drawn at :meth:`~rolloutopt.control.StopRule.init` and kept in the state: no global RNG, identical for a seed, and a row keeps
    its draw when rows are permuted together with their ``row_id`` (default: the row index).

    Reference: DUET, arXiv 2605.08441. **Reconstructed** from the abstract ("a
    marker-gated abort rule with importance reweighting to set when to stop them") and a public summary
    (abort of marker-less tails past a horizon, a kept sample continued to EOS with importance weighting, keep
    probability 0.05, stop shortly after a marker); the exact gate, the weights and the other defaults are ours,
    hence ``experimental=True`` is required.

    Args:
        markers: answer-marker token ids (non-empty).
        horizon: :math:`H >= 1`, tokens after which a marker-less row is gated (the summary's horizon plus grace
            window). Default 4096 — ours.
        keep_prob: :math:`p \in (0, 1]`. Default 0.05 (the public summary of DUET).
        answer_tail: :math:`k >= 0` tokens kept after the first marker before stopping, or None. Default 0 — ours
            (right for closing markers; raise it for opening ones).
        aborted_weight: :math:`w_{abort} \in [0, 1]`. Default 0.0 (aborted rollouts leave the loss; unbiased).
        self_normalize: self-normalise the weights per group; ``init`` then requires ``group`` (and refuses it
            otherwise). Default False.
        seed: int seed of the gate draws. Default 0.
        experimental: must be True.

    Inputs of :meth:`~rolloutopt.control.StopRule.step`: ``tokens`` int ``[N]`` (required), ``active`` bool
    ``[N]``. :meth:`~rolloutopt.control.StopRule.init` takes an optional ``row_id`` int ``[N]`` (stable rollout
    ids) and, with ``self_normalize=True`` only (then required), ``group`` int ``[N]`` or a
    :class:`~rolloutopt.groups.Groups` (kept in the state as a dense index). Cross-batch state
    (:meth:`state_dict`): the seed and the number of ``init`` calls.

    Edge cases: an all-inactive batch changes nothing; N = 0 works; ``keep_prob=1`` never aborts (all weights 1);
    a group whose rows were all aborted gets weights 0 under self-normalisation.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "answered", "aborted")
    requires: ClassVar[tuple[str, ...]] = ("tokens",)
    #: for the default ``self_normalize=False``; an instance built with ``self_normalize=True`` requires ``group``
    accepts: ClassVar[tuple[str, ...]] = ("row_id",)
    init_inputs: ClassVar[dict[str, tuple[str, str]]] = {"row_id": ("N", "int"), "group": ("N", "int")}
    reference: ClassVar[str] = "arXiv 2605.08441 (DUET's marker-gated abort)"
    experimental: ClassVar[str | None] = "the gate, the weights and the defaults are reconstructed from the abstract"

    def __init__(
        self,
        *,
        markers: Sequence[int] | Int[Tensor, " _"],
        horizon: int = 4096,
        keep_prob: float = 0.05,
        answer_tail: int | None = 0,
        aborted_weight: float = 0.0,
        self_normalize: bool = False,
        seed: int = 0,
        experimental: bool = False,
    ) -> None:
        _check_flag(
            experimental,
            "",
            "DUET's marker-gated abort (from the abstract and a summary)",
            "docs/methods/truncation_rules.md",
        )
        self.markers = _markers(markers)
        _int(horizon, "horizon", 1)
        _real(keep_prob, "keep_prob", 0.0, 1.0, open_low=True)
        _int(answer_tail, "answer_tail", 0, none=True)
        _real(aborted_weight, "aborted_weight", 0.0, 1.0)
        if not isinstance(self_normalize, bool):
            raise InputError("self_normalize", "a bool", describe(self_normalize), "pass True or False")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InputError("seed", "an int", describe(seed), "pass e.g. seed=0")
        self.horizon = horizon
        self.keep_prob = float(keep_prob)
        self.answer_tail = answer_tail
        self.aborted_weight = float(aborted_weight)
        self.self_normalize = self_normalize
        if self_normalize:  # the group ids of the self-normalisation are an init input of this instance
            self.__dict__["requires"] = ("tokens", "group")
        self.seed = seed
        self.epoch = 0
        self._marker_cache = {}

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        row_id = _row_id(inputs.pop("row_id", None), n, device)
        group = inputs.pop("group", None)
        super()._init(n, device, **inputs)
        extra: dict[str, Tensor] = {}
        if group is not None:
            if not self.self_normalize:
                raise InputError(
                    "group",
                    "None: the rule was built with self_normalize=False (nothing reads the groups)",
                    describe(group),
                    "drop group=, or build DUETAbort(..., self_normalize=True) to normalise the weights per group",
                )
            extra["group"] = _dense_groups(group, n, device)
        u = _uniform(self.seed, self.epoch, row_id)
        self.epoch += 1
        return {
            "u": u,
            "first_marker": torch.full((n,), -1, dtype=torch.long, device=device),
            "survived": torch.zeros(n, dtype=torch.bool, device=device),
            **extra,
        }

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        tokens = x.need("tokens", "DUETAbort")
        t = state.steps  # index of this step's token
        first = state.extra["first_marker"]
        first = torch.where(x.live & (first < 0) & self._at_marker(tokens), t, first)
        has = first >= 0
        tail = self.answer_tail
        answered = torch.zeros_like(has) if tail is None else x.live & has & (t - first >= tail)
        gate = x.live & ~has & (t + 1 == self.horizon)
        keep = state.extra["u"] < self.keep_prob
        abort = gate & ~keep
        extra = {**state.extra, "first_marker": first, "survived": state.extra["survived"] | (gate & keep)}
        return extra, answered | abort, torch.where(answered, 1, 2)

    def finalize(self, state: StopState) -> StopResult:
        r""":meth:`~rolloutopt.control.StopRule.finalize` plus the importance weights as ``row_weight`` and
        ``survived_frac`` (rows past the gate) in the metrics.

        .. math::
            w_i = \begin{cases} 1/p & \text{survived the gate} \\ w_{abort} & \text{aborted} \\ 1 &
            \text{otherwise} \end{cases}, \qquad
            \tilde w_i = \frac{w_i\, n_g}{\sum_{j \in g} w_j} \ (0 \text{ where } \textstyle\sum_{j \in g} w_j = 0)

        self-normalised (:math:`\tilde w`) over the ``group`` given to ``init`` when the rule was built with
        ``self_normalize=True``. ``result.loss_weights(mask)`` applies them (DUET, arXiv 2605.08441).
        """
        res = super().finalize(state)
        metrics = dict(res.metrics)
        metrics["survived_frac"] = (state.extra["survived"].float().sum() / max(state.batch_size, 1)).detach()
        one = torch.ones(state.batch_size, dtype=torch.float32, device=state.reason.device)
        w = torch.where(state.extra["survived"], one / self.keep_prob, one)
        w = torch.where(state.reason == 2, one * self.aborted_weight, w)
        if self.self_normalize:
            if "group" not in state.extra:
                raise InputError(
                    "state",
                    "a StopState of a DUETAbort built with self_normalize=True",
                    "one without group",
                    "pass the state that this rule's init(n, group=...) started",
                )
            grp = state.extra["group"]
            total = torch.zeros_like(w).index_add_(0, grp, w).index_select(0, grp)
            n_g = torch.zeros_like(w).index_add_(0, grp, one).index_select(0, grp)
            w = torch.where(total > 0, w * n_g / total.clamp(min=torch.finfo(w.dtype).tiny), torch.zeros_like(w))
        return replace(res, metrics=metrics, row_weight=w)

    STATE: ClassVar[dict[str, Field]] = {"seed": Field("integer"), "epoch": Field("integer", low=0)}
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """``{"seed", "epoch"}``: the seed and how many generations :meth:`~rolloutopt.control.StopRule.init` has started."""
        return dump_state({"seed": self.seed, "epoch": self.epoch})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "DUETAbort")
        self.seed, self.epoch = s["seed"], s["epoch"]
