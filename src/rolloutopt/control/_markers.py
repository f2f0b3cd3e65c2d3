"""Private machinery of the marker- and probe-gated stop rules (``docs/methods/truncation_rules.md``).

The marker-id check and the per-device marker cache (:class:`_MarkerMixin`, Step-GRPO, DEER, DUET), the
experimental-flag check and the stable row ids (DUET, ECHO), and the probe gate that Step-GRPO's dynamic
truncated rollout and DEER share (:class:`_ProbeGate`: count markers, say where to probe, read ``confidence``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_index,
    checks_enabled,
    describe,
    require_experimental,
)
from rolloutopt.control._base import StepInputs, StopResult, StopRule, StopState
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, IntB

_DOCS = "docs/methods/truncation_rules.md"


# -- hyper-parameter checks -----------------------------------------------------------------------------------------
def _markers(markers: Any, name: str = "markers") -> tuple[int, ...]:
    if isinstance(markers, Tensor):
        if markers.is_floating_point() or markers.is_complex() or markers.dtype == torch.bool or markers.ndim != 1:
            raise InputError(name, "token ids: a 1-d int tensor or a sequence of ints", describe(markers), "fix it")
        markers = markers.tolist()
    if isinstance(markers, (str, bytes)) or not isinstance(markers, Sequence):
        raise InputError(
            name,
            "a non-empty sequence of token ids (ints)",
            describe(markers),
            f"tokenize the marker strings and pass their ids, e.g. {name}=(271, 14524)",
        )
    ids = tuple(markers)
    if not ids or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise InputError(
            name, "a non-empty sequence of non-negative int token ids", describe(markers), "pass the markers' token ids"
        )
    return tuple(sorted(set(ids)))


def _check_flag(flag: Any, owner: str, what: str, where: str) -> None:
    require_experimental(flag, what, where, argument=f"{owner}experimental" if owner else "experimental")


class _MarkerMixin:
    """Marker token ids as a tensor, cached per device (no host-to-device copy per step)."""

    markers: tuple[int, ...]
    _marker_cache: dict[torch.device, Tensor]

    def _at_marker(self, tokens: Tensor) -> Tensor:
        t = self._marker_cache.get(tokens.device)
        if t is None:
            t = torch.tensor(self.markers, dtype=torch.long, device=tokens.device)
            self._marker_cache[tokens.device] = t
        return torch.isin(tokens, t)


def _row_id(row_id: Any, n: int, device: torch.device) -> Tensor:
    if row_id is None:
        return torch.arange(n, dtype=torch.long, device=device)
    dims = Dims()
    dims.sizes["N"] = (n, "batch_size")
    return as_index(row_id, "row_id", dims, "N").to(device)


# ========================================================================= probe-gated rules (Step-GRPO, DEER)
class _ProbeGate(_MarkerMixin, StopRule):
    """Shared machinery of the probe-gated rules: count markers, say where to probe, read ``confidence``."""

    requires: ClassVar[tuple[str, ...]] = ("tokens",)
    #: needed at the probe points only (``probe_rows``); ignored elsewhere
    accepts: ClassVar[tuple[str, ...]] = ("confidence",)
    extra_inputs: ClassVar[dict[str, tuple[str, str]]] = {"confidence": ("N", "float")}
    threshold: float

    def _eligible(self, state: StopState, count: Tensor) -> Tensor:
        raise NotImplementedError

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        super()._init(n, device, **inputs)
        z = torch.zeros(n, dtype=torch.long, device=device)
        return {"markers": z, "probes": z.clone()}

    def _probe(self, state: StopState, x: StepInputs) -> tuple[Tensor, Tensor]:
        tokens = x.need("tokens", type(self).__name__)
        at = x.live & self._at_marker(tokens)
        count = state.extra["markers"] + at.long()
        return at & self._eligible(state, count), count

    def probe_rows(self, state: StopState, *, tokens: IntB, active: BoolB | None = None) -> BoolB:
        """Bool ``[N]``: the rows the engine must probe at this step (live, at a marker, past the warm-up).

        Call it with the token ids just sampled, run the answer-forcing probe for those rows, then call
        :meth:`~rolloutopt.control.StopRule.step` with the same ``tokens`` and ``confidence=``. Rows not flagged need no probe (any finite
        ``confidence`` value is ignored for them).
        """
        if not isinstance(state, StopState):
            raise InputError("state", "a StopState from rule.init()", describe(state), "call rule.init(batch_size)")
        x = self._inputs(state, None, None, None, tokens, active, {})
        return self._probe(state, x)[0]

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        probe, count = self._probe(state, x)
        conf = x.extra.get("confidence")
        if conf is None:
            if checks_enabled() and bool(probe.any()):
                raise InputError(
                    "confidence",
                    f"a float tensor [N]: {int(probe.sum())} row(s) are at a probe point this step",
                    "None",
                    "probe the rows rule.probe_rows(...) returns and pass confidence= to step()",
                )
            fire = torch.zeros_like(probe)
        else:
            if checks_enabled():
                bad = probe & ((conf < 0) | (conf > 1))
                if bool(bad.any()):
                    raise InputError(
                        "confidence",
                        "probabilities in [0, 1] at the probed rows (the mean token probability of the probe answer)",
                        f"{describe(conf)} with {int(bad.sum())} value(s) outside [0, 1]",
                        "pass exp(mean log-prob) or the mean of the answer tokens' probabilities",
                    )
            fire = probe & (conf >= self.threshold)
        extra = {"markers": count, "probes": state.extra["probes"] + probe.long()}
        return extra, fire, 1

    def finalize(self, state: StopState) -> StopResult:
        """:meth:`StopRule.finalize` plus ``markers_mean`` and ``probes_mean`` (per row) in the metrics."""
        res = super().finalize(state)
        n = max(state.batch_size, 1)
        metrics = dict(res.metrics)
        metrics["markers_mean"] = (state.extra["markers"].float().sum() / n).detach()
        metrics["probes_mean"] = (state.extra["probes"].float().sum() / n).detach()
        return replace(res, metrics=metrics)
