r"""ESPO's critic-free variant (arXiv 2605.29860), reconstructed from the abstract (``experimental=True``).

:class:`ESPOCriticFree`: stop when the smoothed cumulative surrogate regret (:func:`~rolloutopt.control.surrogate_regret`)
leaves a reference band :math:`t\bar\rho + \kappa\sqrt t\,s_\rho` learned from successful rollouts. The rule
as the digests describe it (with a critic) is :class:`~rolloutopt.control.ESPO` (:mod:`~rolloutopt.control.espo`);
the loss-side rewrite of a stopped rollout is :func:`~rolloutopt.control.absorbing_failure`
(:mod:`~rolloutopt.control.absorbing`). Provenance and worked examples: ``docs/methods/early_stop.md``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import Dims, as_mask, checks_enabled, describe, require_experimental
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import check_real as _real
from rolloutopt.control._base import StepInputs, StopResult, StopRule, StopState
from rolloutopt.control.espo import _DOCS, _absorbing, _float_state, _regret
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB

__all__ = ["ESPOCriticFree"]


class ESPOCriticFree(StopRule):
    r"""ESPO without a critic [reconstructed]: stop when smoothed cumulative regret exceeds a reference band.

    .. math::
        C_t = \sum_{\tau \le t} \rho_\tau, \qquad S_t = a\,S_{t-1} + (1 - a)\,C_t,\ S_0 = 0, \\
        \text{stop at the first } t \ge t_{min} \text{ with } S_t > t\,\bar\rho + \kappa\sqrt t\,s_\rho

    with :math:`\rho_t` the surrogate regret (:func:`surrogate_regret`) and :math:`t` the number of tokens the row
    generated (the current one included). :math:`\bar\rho, s_\rho` are the per-token regret mean and standard
    deviation of *completed, successful* rollouts, learnt by :meth:`update` (EMA across batches, the first batch
    replacing the initial values when none were given). Until a reference exists the rule never fires.

    Reference: ESPO, arXiv 2605.29860. **Reconstructed** from the abstract only (``docs/methods/early_stop.md``,
    "critic-free variant"): the paper's values for this form are unknown, so every keyword default is ours and
    ``experimental=True`` is required. The reference is global (one :math:`\bar\rho, s_\rho`), not per task.

    Args:
        kappa: :math:`\kappa`, the band width in reference standard deviations (3.0: ours, as in our worked example).
        t_min: no stop before this many tokens (10: ours, as in our worked example).
        smoothing: :math:`a`, the EMA coefficient on :math:`C_t` (0.9: ours, like ESPO's :math:`\alpha_s`;
            0 disables smoothing).
        rho_bar, s_rho: an initial reference (None: none until the first :meth:`update`).
        ref_alpha: the EMA of the reference across batches (0.99: ours).
        r_fail: the terminal reward of a stopped rollout, in :meth:`finalize`'s result (-1.0: ours, the digest
            rule's value; the abstract allows 0 or a negative value).
        experimental: must be True.

    Edge cases: a row whose sampled token is always the argmax has :math:`\rho = 0` and never stops; inactive rows
    do not change; an empty batch works.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "regret")
    requires: ClassVar[tuple[str, ...]] = ("logp", "topk_logp")
    reference: ClassVar[str] = "arXiv 2605.29860 (ESPO, the critic-free variant of its abstract)"
    experimental: ClassVar[str | None] = "the critic-free variant is reconstructed from ESPO's abstract"

    def __init__(
        self,
        *,
        kappa: float = 3.0,
        t_min: int = 10,
        smoothing: float = 0.9,
        rho_bar: float | None = None,
        s_rho: float | None = None,
        ref_alpha: float = 0.99,
        r_fail: float = -1.0,
        experimental: bool = False,
    ) -> None:
        require_experimental(experimental, "ESPO's critic-free variant", _DOCS)
        self.kappa = _real(kappa, "kappa", 0.0)
        self.t_min = _int(t_min, "t_min", 1)
        self.smoothing = _real(smoothing, "smoothing", 0.0, 1.0)
        if self.smoothing == 1.0:
            raise InputError("smoothing", "a number in [0, 1)", "1.0", "use e.g. smoothing=0.9")
        if (rho_bar is None) != (s_rho is None):
            raise InputError("rho_bar", "rho_bar and s_rho both given or both None", describe(rho_bar), "pass both")
        self.rho_bar = None if rho_bar is None else _real(rho_bar, "rho_bar", 0.0)
        self.s_rho = None if s_rho is None else _real(s_rho, "s_rho", 0.0)
        self.ref_alpha = _real(ref_alpha, "ref_alpha", 0.0, 1.0)
        self.r_fail = _real(r_fail, "r_fail")
        self.batches = 0

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        super()._init(n, device, **inputs)
        zeros = torch.zeros(n, device=device)
        return {"cum": zeros, "smooth": zeros.clone(), "regret_sq_sum": zeros.clone()}

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        lp = x.need("logp", "ESPOCriticFree")
        topk = x.need("topk_logp", "ESPOCriticFree")
        if checks_enabled() and topk.shape[1] == 0:
            raise InputError("topk_logp", "K >= 1 top-k log-probs per row", describe(topk), "pass k >= 1")
        rho = torch.where(x.live, _regret(lp, topk), torch.zeros_like(lp))
        e = state.extra
        cum = e["cum"] + rho
        a = self.smoothing
        smooth = torch.where(x.live, a * e["smooth"] + (1.0 - a) * cum, e["smooth"])
        extra = {"cum": cum, "smooth": smooth, "regret_sq_sum": e["regret_sq_sum"] + rho * rho}
        if self.rho_bar is None or self.s_rho is None:
            return extra, torch.zeros_like(x.live), 1
        t = (state.steps + 1).to(smooth.dtype)
        fire = (t >= self.t_min) & (smooth > t * self.rho_bar + self.kappa * t.sqrt() * self.s_rho)
        return extra, fire, 1

    def finalize(self, state: StopState) -> StopResult:
        r""":meth:`~rolloutopt.control.StopRule.finalize` plus the absorbing-failure reward: ``terminal_reward`` is
        :math:`r_{fail}` on every stopped row (``terminal_rows``), as for :class:`~rolloutopt.control.ESPO`
        (arXiv 2605.29860); ``result.rewards(rewards)`` applies it."""
        return _absorbing(super().finalize(state), self.r_fail)

    def update(self, state: StopState, success: BoolB) -> dict[str, Tensor]:
        """Learn the reference from a finished batch: the pooled per-token regret mean and standard deviation of
        rows that completed (were not stopped, generated >= 1 token) with ``success`` True (bool ``[N]``).

        Returns detached 0-d metrics ``rho_bar``, ``s_rho``, ``ref_tokens``. A batch without such a row changes
        nothing.
        """
        if not isinstance(state, StopState) or not {"cum", "regret_sq_sum"} <= set(state.extra):
            raise InputError("state", "a StopState produced by ESPOCriticFree.step", describe(state), "pass its state")
        dims = Dims()
        dims.sizes["N"] = (state.batch_size, "state")
        ok = as_mask(success, "success", dims, "N").to(state.stopped.device)
        use = ok & ~state.stopped & (state.steps > 0)
        n = float(torch.where(use, state.steps, torch.zeros_like(state.steps)).sum())
        if n > 0:
            s1 = float(torch.where(use, state.extra["cum"], torch.zeros_like(state.extra["cum"])).double().sum())
            sq = state.extra["regret_sq_sum"]
            s2 = float(torch.where(use, sq, torch.zeros_like(sq)).double().sum())
            mean = s1 / n
            std = math.sqrt(max(s2 / n - mean * mean, 0.0))
            if self.rho_bar is None or self.s_rho is None:
                self.rho_bar, self.s_rho = mean, std
            else:
                a = self.ref_alpha
                self.rho_bar = a * self.rho_bar + (1.0 - a) * mean
                self.s_rho = a * self.s_rho + (1.0 - a) * std
            self.batches += 1
        out = {"ref_tokens": n, "rho_bar": self.rho_bar or 0.0, "s_rho": self.s_rho or 0.0}
        return {k: torch.tensor(v) for k, v in out.items()}

    STATE: ClassVar[dict[str, Field]] = {
        "rho_bar": Field("any"),  # None before the first reference, else a finite float >= 0: checked on load
        "s_rho": Field("any"),  # likewise (None exactly when rho_bar is None)
        "batches": Field("integer", low=0),
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """The reference (``rho_bar``, ``s_rho``; None before any) and the update count."""
        return dump_state({"rho_bar": self.rho_bar, "s_rho": self.s_rho, "batches": self.batches})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "ESPOCriticFree")
        if (s["rho_bar"] is None) != (s["s_rho"] is None):
            raise InputError("state", "rho_bar and s_rho both None or both numbers", describe(s), "pass state_dict()")
        ref = [None if s[k] is None else _float_state(s, k, "ESPOCriticFree") for k in ("rho_bar", "s_rho")]
        for key, value in zip(("rho_bar", "s_rho"), ref, strict=True):
            if value is not None and value < 0.0:
                raise InputError(f"state[{key!r}]", "a number >= 0", repr(value), "pass ESPOCriticFree.state_dict()")
        self.rho_bar, self.s_rho = ref
        self.batches = s["batches"]
