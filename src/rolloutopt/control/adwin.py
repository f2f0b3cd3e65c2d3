r"""ADWIN (arXiv 2605.28396): adaptive windows for horizon-aware on-policy distillation.

:class:`ADWINHorizon` adapts the training horizon from delayed full-rollout probes, with staleness control;
:func:`kl_sign_alignment` and :func:`gradient_cosine` are its alignment measures (not the ADWIN concept-drift
detector, which shares the name). Reconstructed from the abstract (``experimental=True``). Provenance and
worked examples: ``docs/methods/opd_horizon.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    describe,
    finite,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._opd import _experimental, _round
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolBT, FloatAny, FloatBT, Scalar

__all__ = ["ADWINHorizon", "gradient_cosine", "kl_sign_alignment"]


def kl_sign_alignment(prefix_kl: FloatBT, full_kl: FloatBT, mask: BoolBT, *, horizon: int) -> Scalar:
    r"""ADWIN's cheap alignment proxy [reconstructed]: agreement of per-token reverse-KL signs on the first H
    positions.

    .. math::
        a = \frac{\sum_{i,\,t < H} m_{i,t}\,\mathbb 1[\operatorname{sign} p_{i,t} = \operatorname{sign} f_{i,t}]}
        {\sum_{i,\,t < H} m_{i,t}}

    ``prefix_kl`` is the per-token signal of the prefix update and ``full_kl`` that of the full-rollout probe at
    the same positions — e.g. per-token reverse KL :math:`\log\pi_s - \log\pi_t`, or its return-to-go summed up to
    ``H`` and up to the end of the rollout respectively. Reference: ADWIN, arXiv 2605.28396 (the proxy is our
    reconstruction, ``docs/methods/opd_horizon.md``). Zero counts as its own sign.

    Args:
        prefix_kl, full_kl: float ``[B, T]``.
        mask: bool ``[B, T]``.
        horizon: H >= 0, the prefix length compared.

    Returns:
        0-d fp32 tensor in [0, 1]; 1 when no position is compared (empty batch, H = 0, all masked): no
        disagreement was observed, so check the count at the call site if that matters.
    """
    _int(horizon, "horizon", 0)
    dims = Dims()
    p = as_float(prefix_kl, "prefix_kl", dims, "B T")
    f = as_float(full_kl, "full_kl", dims, "B T").to(p.device)
    m = as_mask(mask, "mask", dims, "B T").to(p.device)
    m = m & (torch.arange(p.shape[1], device=p.device)[None, :] < horizon)
    finite(p, "prefix_kl", m)
    finite(f, "full_kl", m)
    agree = (torch.sign(p) == torch.sign(f)) & m
    n = m.sum()
    return torch.where(n > 0, agree.sum().float() / n.clamp(min=1).float(), torch.ones((), device=p.device))


def gradient_cosine(g_prefix: FloatAny | Sequence[FloatAny], g_full: FloatAny | Sequence[FloatAny]) -> Scalar:
    r"""Cosine between the prefix and the full-rollout OPD gradients: ADWIN's alignment.

    .. math::
        a = \frac{\langle g_{prefix}, g_{full} \rangle}{\lVert g_{prefix}\rVert\,\lVert g_{full}\rVert}

    Each argument is a tensor or a sequence of tensors (per-parameter gradients, flattened and concatenated in
    order; the two must match in total size). Reference: ADWIN, arXiv 2605.28396 (``docs/methods/opd_horizon.md``).
    Returns a 0-d fp32 tensor in [-1, 1]; 0 when either gradient is zero or empty.
    """

    def flat(g: Tensor | Sequence[Tensor], name: str) -> Tensor:
        parts = [g] if isinstance(g, Tensor) else list(g) if isinstance(g, Sequence) else None
        if parts is None or not all(isinstance(x, Tensor) for x in parts):
            raise InputError(name, "a tensor or a sequence of tensors", describe(g), "pass the gradients")
        if not parts:
            return torch.zeros(0)
        out = torch.cat([as_float(x, name).reshape(-1).double() for x in parts])
        finite(out, name)
        return out

    a, b = flat(g_prefix, "g_prefix"), flat(g_full, "g_full")
    if a.numel() != b.numel():
        raise InputError("g_full", f"{a.numel()} elements in all (as g_prefix)", f"{b.numel()}", "pass matching grads")
    b = b.to(a.device)
    na, nb = a.norm(), b.norm()
    den = na * nb
    cos = torch.where(den > 0, (a @ b) / den.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(den))
    return cos.clamp(-1.0, 1.0).float()


def _probe(p: Any, h_min: int, h_max: int) -> tuple[int, float, bool, int] | None:
    """A logged probe ``[version, alignment, applied, horizon]`` of a state dict, or None if it is not one."""
    if not isinstance(p, (list, tuple)) or len(p) != 4:
        return None
    v, a, applied, h = p
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (v, h))
    real = isinstance(a, (int, float)) and not isinstance(a, bool) and -1.0 <= a <= 1.0
    if not ints or not real or not isinstance(applied, bool) or v < 0 or not h_min <= h <= h_max:
        return None
    return (v, float(a), applied, h)


class ADWINHorizon:
    r"""ADWIN horizon controller for OPD [reconstructed]: adapt the training prefix length H from delayed probes.

    .. math::
        H \leftarrow \begin{cases} \max(H_{min}, \operatorname{round}(H\,\beta_{down})) & a \ge \tau_{hi} \\
        \min(H_{max}, \operatorname{round}(H\,\beta_{up})) & a < \tau_{lo} \\ H & \text{otherwise} \end{cases}
        \qquad \text{for probes with } v_{now} - v_{probe} \le S

    Training uses short, teacher-anchored prefixes of H tokens. Every ``probe_every`` steps (:meth:`probe_due`) the
    trainer generates full rollouts for a small probe subset off the critical path and, when they are scored,
    reports the alignment ``a`` between the prefix and the full-rollout update (:func:`gradient_cosine`, or the
    cheaper :func:`kl_sign_alignment`) with the policy version that produced the probe
    (:meth:`observe`). A high alignment means the prefix suffices (shrink, or keep with ``beta_down = 1``); a
    low one means the prefix misleads (grow). Probes older than ``staleness`` versions are recorded and ignored.

    Not the ADWIN (adaptive windowing) concept-drift detector of Bifet & Gavaldà, which shares the name. Reference:
    "Adaptive Windows for horizon-aware OPD", arXiv 2605.28396 (abstract: online admissibility, delayed
    full-rollout probes, staleness control, up to 4.1x lower training cost); the update rule and every default
    are **reconstructed** (``docs/methods/opd_horizon.md``), hence ``experimental=True``.

    Args:
        h0: initial horizon [reconstructed; default 512].
        h_min, h_max: bounds [reconstructed; defaults 64, 8192].
        tau_hi: shrink/keep at or above it [reconstructed; default 0.9].
        tau_lo: grow below it [reconstructed; default 0.5].
        beta_up: growth factor >= 1 [reconstructed; default 2].
        beta_down: shrink factor in (0, 1] [reconstructed; default 0.5; 1 keeps H].
        staleness: S, the oldest usable probe in policy versions [reconstructed; default 2].
        probe_every: P, steps between probes [reconstructed; default 10].
        history: probe results kept in the log (a bounded queue; default 64).
        experimental: must be True.

    Alignments lie in [-1, 1] (a cosine; the sign agreement is in [0, 1]). Called once per probe result, not per
    token: :meth:`observe` (``alignment``, ``version`` and ``current_version`` required).
    """

    requires: ClassVar[tuple[str, ...]] = ("alignment", "version", "current_version")
    reference: ClassVar[str] = "arXiv 2605.28396 (ADWIN: adaptive windows for horizon-aware OPD)"
    experimental: ClassVar[str | None] = "the horizon update rule, its thresholds and the defaults are reconstructed"

    def __init__(
        self,
        *,
        h0: int = 512,
        h_min: int = 64,
        h_max: int = 8192,
        tau_hi: float = 0.9,
        tau_lo: float = 0.5,
        beta_up: float = 2.0,
        beta_down: float = 0.5,
        staleness: int = 2,
        probe_every: int = 10,
        history: int = 64,
        experimental: bool = False,
    ) -> None:
        _experimental(experimental, "ADWINHorizon (update rule, thresholds, defaults)")
        self.h_min = _int(h_min, "h_min", 1)
        self.h_max = _int(h_max, "h_max", self.h_min)
        self.h0 = _int(h0, "h0", self.h_min)
        if self.h0 > self.h_max:
            raise InputError("h0", f"an int in [h_min, h_max] = [{h_min}, {h_max}]", describe(h0), "fix h0")
        self.tau_lo = _real(tau_lo, "tau_lo", -1.0, 1.0)
        self.tau_hi = _real(tau_hi, "tau_hi", self.tau_lo, 1.0)
        self.beta_up = _real(beta_up, "beta_up", 1.0, math.inf, open_high=True)
        self.beta_down = _real(beta_down, "beta_down", 0.0, 1.0, open_low=True)
        self.staleness = _int(staleness, "staleness", 0)
        self.probe_every = _int(probe_every, "probe_every", 1)
        self.max_history = _int(history, "history", 0)
        self.horizon = self.h0
        self.probes: list[tuple[int, float, bool, int]] = []
        self.n_probes = 0
        self.n_stale = 0
        self.STATE: dict[str, Field] = {
            "horizon": Field("integer", low=self.h_min, high=self.h_max),
            "probes": Field("any"),  # a list of [version, alignment, applied, horizon] lists: checked on load
            "n_probes": Field("integer", low=0),
            "n_stale": Field("integer", low=0),
        }
        """The declared fields of :meth:`state_dict` (the horizon's bounds from the constructor)."""

    def probe_due(self, step: int) -> bool:
        """Whether training step ``step`` (>= 0) should launch a full-rollout probe (every ``probe_every``)."""
        return _int(step, "step", 0) % self.probe_every == 0

    def observe(self, alignment: float | FloatAny, *, version: int, current_version: int) -> int:
        """Apply one probe's alignment (float or 0-d tensor) produced at policy ``version``; return the new H.

        The probe is logged as ``(version, alignment, applied, horizon)`` in ``self.probes`` (bounded queue);
        a probe with ``current_version - version > staleness`` is logged with ``applied=False`` and leaves H.
        """
        if isinstance(alignment, Tensor):
            if alignment.numel() != 1:
                raise InputError("alignment", "a number or a 1-element tensor", describe(alignment), "pass a scalar")
            alignment = float(alignment)
        a = _real(alignment, "alignment", -1.0, 1.0)
        v = _int(version, "version", 0)
        now = _int(current_version, "current_version", v)
        self.n_probes += 1
        applied = now - v <= self.staleness
        if not applied:
            self.n_stale += 1
        elif a >= self.tau_hi:
            self.horizon = max(self.h_min, _round(self.horizon * self.beta_down))
        elif a < self.tau_lo:
            self.horizon = min(self.h_max, _round(self.horizon * self.beta_up))
        if self.max_history:
            self.probes = [*self.probes, (v, a, applied, self.horizon)][-self.max_history :]
        return self.horizon

    def state_dict(self) -> dict[str, Any]:
        """``{"horizon", "probes", "n_probes", "n_stale"}`` (plain Python values)."""
        return dump_state(
            {
                "horizon": self.horizon,
                "probes": [list(p) for p in self.probes],
                "n_probes": self.n_probes,
                "n_stale": self.n_stale,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "ADWINHorizon")
        probes = [_probe(p, self.h_min, self.h_max) for p in s["probes"]] if isinstance(s["probes"], list) else None
        if probes is None or None in probes or len(probes) > self.max_history:
            raise InputError(
                "state['probes']",
                f"at most {self.max_history} probes [version >= 0, alignment in [-1, 1], applied, horizon in "
                f"[{self.h_min}, {self.h_max}]]",
                describe(s["probes"]),
                "pass ADWINHorizon.state_dict()",
            )
        if s["n_stale"] > s["n_probes"]:
            raise InputError(
                "state['n_stale']", f"at most n_probes = {s['n_probes']}", repr(s["n_stale"]), "pass state_dict()"
            )
        self.horizon, self.n_probes, self.n_stale = s["horizon"], s["n_probes"], s["n_stale"]
        self.probes = [p for p in probes if p is not None]
