r"""Stable-OPD (arXiv 2604.08527): the length-inflation monitor of on-policy distillation.

:class:`StableOPD` (batch-level monitor, called once per training step) detects truncation collapse and
repetition, raises the reference-KL coefficient and asks for a rollout mixture (:class:`StableOPDDecision`);
:func:`repeated_ngram_share` is its repetition score. Reconstructed from the abstract (``experimental=True``).
Provenance and worked examples: ``docs/methods/opd_horizon.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
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
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._opd import _experimental
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, BoolBT, FloatB, IntB, IntBT

__all__ = ["StableOPD", "StableOPDDecision", "repeated_ngram_share"]


def repeated_ngram_share(tokens: IntBT, mask: BoolBT | None = None, *, n: int = 4) -> FloatB:
    r"""Share of repeated n-grams per rollout: the repetition score of Stable-OPD.

    .. math::
        \mathrm{rep}_i = \frac{G_i - |\{\text{distinct } n\text{-grams of row } i\}|}{G_i}

    :math:`G_i` counts the n-grams of row ``i`` whose ``n`` tokens are all masked in; a row without any has score
    0. Exact (``torch.unique`` over ``(row, n-gram)`` tuples, no hashing), vectorised over the batch. Reference:
    Stable-OPD, arXiv 2604.08527 ("repetition saturation"); the 4-gram share is our choice
    (``docs/methods/opd_horizon.md``).

    Args:
        tokens: int ``[B, T]`` token ids.
        mask: bool ``[B, T]`` (default all True).
        n: the n-gram length (default 4).

    Returns:
        float ``[B]`` in ``[0, 1)``. Edge cases: ``T < n``, an empty batch, or an all-masked row give 0.
    """
    _int(n, "n", 1)
    dims = Dims()
    tok = as_index(tokens, "tokens", dims, "B T")
    m = torch.ones_like(tok, dtype=torch.bool) if mask is None else as_mask(mask, "mask", dims, "B T").to(tok.device)
    b, t = tok.shape
    out = torch.zeros(b, device=tok.device)
    if t < n or b == 0:
        return out
    grams = tok.unfold(1, n, 1)  # [B, G, n]
    valid = m.unfold(1, n, 1).all(-1)  # [B, G]
    rows = torch.arange(b, device=tok.device)[:, None, None].expand(b, grams.shape[1], 1)
    keys = torch.cat([rows, grams], dim=-1)[valid]  # [M, n + 1]
    total = valid.sum(-1)
    if keys.shape[0] == 0:
        return out
    distinct = torch.bincount(torch.unique(keys, dim=0)[:, 0], minlength=b)
    return (total - distinct).float() / total.clamp(min=1).float()


@dataclass(frozen=True)
class StableOPDDecision:
    """What :meth:`StableOPD.observe` decided for the next training step.

    ``tripped`` (bool), ``reasons`` (which triggers fired: ``"truncation"``, ``"jump"``, ``"repetition"``),
    ``kl_multiplier`` (multiply the reference-KL coefficient by it), ``mix_ratio`` (fraction of the next batch to
    draw from the reference policy or the teacher; 0 when not tripped), ``truncated_frac`` and ``repetition`` (the
    batch statistics), ``metrics`` (detached 0-d tensors).
    """

    tripped: bool
    reasons: tuple[str, ...]
    kl_multiplier: float
    mix_ratio: float
    truncated_frac: float
    repetition: float
    metrics: dict[str, Tensor] = field(default_factory=dict)


class StableOPD:
    r"""Stable-OPD's length-inflation monitor [reconstructed]: detect truncation collapse, then stabilise.

    .. math::
        f_s = \frac{1}{B}\sum_i \mathbb 1[\text{row } i \text{ hit the max length}], \qquad
        \text{trip}_s = f_s > \tau_{trunc} \ \vee\ f_s - \min_{s-w \le j < s} f_j > \delta
        \ \vee\ \overline{\mathrm{rep}}_s > \tau_{rep}, \\
        \kappa_s = \begin{cases} \min(\kappa_{max}, \kappa_{s-1}\,u) & \text{trip} \\
        \max(1, \kappa_{s-1}\,d) & \text{otherwise} \end{cases}, \qquad
        \text{mix}_s = \text{mix\_ratio} \cdot \mathbb 1[\text{trip}_s]

    A batch-level monitor called once per training step (not a streaming rule). When truncated, max-length
    rollouts start to dominate the batch ("truncation collapse") — more than ``tau_trunc`` of them, or a jump of
    more than ``delta`` over the smallest fraction of the last ``window`` steps — it multiplies the reference-KL
    coefficient by ``kl_up`` (the returned ``kl_multiplier`` is cumulative, capped at ``kl_max``) and asks that a
    fraction ``mix_ratio`` of the next batch come from a reference policy or the teacher (rollout mixture
    distillation). The repetition score (:func:`repeated_ngram_share`, batch mean over rows with an n-gram) is
    reported always and trips the monitor only when ``tau_rep`` is set.

    Reference: Stable-OPD, "Demystifying OPD: Length Inflation and Stabilization", arXiv 2604.08527. The abstract
    names the failure mode and the two fixes (reference-based divergence constraint, rollout mixture); the
    triggers, the schedule and every default are **reconstructed** (the abstract does not give the exact
    schedule), hence ``experimental=True``.

    Args:
        tau_trunc: truncated-fraction threshold [reconstructed; default 0.2].
        delta: jump threshold within the window [reconstructed; default 0.1].
        window: steps of history for the jump [reconstructed; default 5].
        kl_up: KL multiplier growth on a trip, >= 1 [reconstructed; default 2].
        kl_decay: multiplier decay on a quiet step, in (0, 1] [reconstructed; default 1: the raised coefficient
            stays].
        kl_max: cap on the cumulative multiplier [reconstructed; default 16].
        mix_ratio: fraction of the batch mixed in on a trip, in [0, 1] (reconstructed; default 0.25).
        tau_rep: repetition threshold, or None (default) to only report the score.
        ngram: n of the repetition score [reconstructed; default 4].
        experimental: must be True.

    Called once per training step, not per token: :meth:`observe` (``lengths`` and ``truncated`` required,
    ``tokens`` and ``mask`` optional).

    Edge cases: an empty batch has ``truncated_frac = 0`` (it never trips on truncation); the first step has no
    history, so it cannot trip on a jump.
    """

    requires: ClassVar[tuple[str, ...]] = ("lengths", "truncated")
    accepts: ClassVar[tuple[str, ...]] = ("tokens", "mask")
    reference: ClassVar[str] = "arXiv 2604.08527 (Stable-OPD: Demystifying OPD, length inflation and stabilization)"
    experimental: ClassVar[str | None] = "the triggers, the KL schedule and the mixture ratio are reconstructed"

    def __init__(
        self,
        *,
        tau_trunc: float = 0.2,
        delta: float = 0.1,
        window: int = 5,
        kl_up: float = 2.0,
        kl_decay: float = 1.0,
        kl_max: float = 16.0,
        mix_ratio: float = 0.25,
        tau_rep: float | None = None,
        ngram: int = 4,
        experimental: bool = False,
    ) -> None:
        _experimental(experimental, "StableOPD (triggers, KL schedule, mixture ratio)")
        self.tau_trunc = _real(tau_trunc, "tau_trunc", 0.0, 1.0)
        self.delta = _real(delta, "delta", 0.0, 1.0)
        self.window = _int(window, "window", 1)
        self.kl_up = _real(kl_up, "kl_up", 1.0, math.inf, open_high=True)
        self.kl_decay = _real(kl_decay, "kl_decay", 0.0, 1.0, open_low=True)
        self.kl_max = _real(kl_max, "kl_max", 1.0, math.inf, open_high=True)
        self.mix_ratio = _real(mix_ratio, "mix_ratio", 0.0, 1.0)
        self.tau_rep = None if tau_rep is None else _real(tau_rep, "tau_rep", 0.0, 1.0)
        self.ngram = _int(ngram, "ngram", 1)
        self.history: list[float] = []
        self.kl_multiplier = 1.0
        self.steps = 0
        self.trips = 0
        self.STATE: dict[str, Field] = {
            "history": Field("any"),  # a list of Python floats (the last ``window`` fractions): checked on load
            "kl_multiplier": Field("real", low=1.0, high=self.kl_max),
            "steps": Field("integer", low=0),
            "trips": Field("integer", low=0),
        }
        """The declared fields of :meth:`state_dict` (the multiplier's cap from the constructor)."""

    def observe(
        self, lengths: IntB, truncated: BoolB, *, tokens: IntBT | None = None, mask: BoolBT | None = None
    ) -> StableOPDDecision:
        """Record one batch and decide the next step's KL multiplier and mixture ratio.

        Args:
            lengths: int ``[B]`` response lengths (>= 0).
            truncated: bool ``[B]``, True where the rollout hit the max length.
            tokens: int ``[B, T]`` response ids, for the repetition score (optional).
            mask: bool ``[B, T]`` (default ``t < lengths``).

        One host sync (the batch statistics become Python floats): a per-training-step monitor, not a hot path.
        """
        dims = Dims()
        ell = as_index(lengths, "lengths", dims, "B")
        trunc = as_mask(truncated, "truncated", dims, "B")
        if checks_enabled() and bool((ell < 0).any()):
            raise InputError("lengths", "non-negative lengths", describe(lengths), "pass response lengths")
        b = ell.numel()
        frac = float(trunc.sum()) / b if b else 0.0
        rep_t = torch.zeros((), dtype=torch.float32)
        if tokens is not None:
            tok = as_index(tokens, "tokens", dims, "B T")
            if mask is None:
                m = torch.arange(tok.shape[1], device=tok.device)[None, :] < ell.to(tok.device)[:, None]
            else:
                m = as_mask(mask, "mask", dims, "B T").to(tok.device)
            score = repeated_ngram_share(tok, m, n=self.ngram)
            has = m.long().sum(-1) >= self.ngram
            rep_t = (score * has).sum() / has.sum().clamp(min=1)
        elif mask is not None:
            raise InputError("mask", "None when tokens is None", describe(mask), "pass tokens= with mask=")
        rep = float(rep_t)
        reasons: list[str] = []
        if frac > self.tau_trunc:
            reasons.append("truncation")
        if self.history and frac - min(self.history) > self.delta:
            reasons.append("jump")
        if self.tau_rep is not None and rep > self.tau_rep:
            reasons.append("repetition")
        tripped = bool(reasons)
        if tripped:
            self.kl_multiplier = min(self.kl_max, self.kl_multiplier * self.kl_up)
            self.trips += 1
        else:
            self.kl_multiplier = max(1.0, self.kl_multiplier * self.kl_decay)
        self.history = [*self.history, frac][-self.window :]
        self.steps += 1
        mix = self.mix_ratio if tripped else 0.0
        metrics = {
            "stable_opd/truncated_frac": torch.tensor(frac),
            "stable_opd/repetition": rep_t.detach().float(),
            "stable_opd/length_mean": ell.double().mean().float() if b else torch.tensor(0.0),
            "stable_opd/tripped": torch.tensor(float(tripped)),
            "stable_opd/kl_multiplier": torch.tensor(self.kl_multiplier),
            "stable_opd/mix_ratio": torch.tensor(mix),
        }
        return StableOPDDecision(tripped, tuple(reasons), self.kl_multiplier, mix, frac, rep, metrics)

    def state_dict(self) -> dict[str, Any]:
        """``{"history", "kl_multiplier", "steps", "trips"}`` (plain Python values)."""
        return dump_state(
            {
                "history": list(self.history),
                "kl_multiplier": self.kl_multiplier,
                "steps": self.steps,
                "trips": self.trips,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "StableOPD")
        hist = s["history"]
        if not isinstance(hist, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0 for v in hist
        ):
            raise InputError(
                "state['history']", "a list of truncated fractions in [0, 1]", describe(hist), "pass state_dict()"
            )
        if s["trips"] > s["steps"]:
            raise InputError("state['trips']", f"at most steps = {s['steps']}", repr(s["trips"]), "pass state_dict()")
        self.history = [float(v) for v in hist][-self.window :]
        self.kl_multiplier, self.steps, self.trips = float(s["kl_multiplier"]), s["steps"], s["trips"]
