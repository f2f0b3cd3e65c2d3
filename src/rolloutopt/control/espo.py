r"""ESPO — Early-Stopping PPO (arXiv 2605.29860): stop a rollout when its logit regret runs away.

ESPO stops generation once a *surrogate regret*, computed only from the log-probs the sampler already produced,
accumulates faster than expected. A stopped rollout is an *absorbing failure state* with a terminal reward, so
PPO/GAE concentrates the negative TD error near the detected failure step (``docs/methods/early_stop.md``).

- :func:`surrogate_regret`: :math:`g_t = \max_a \log\pi(a|s_t) - \log\pi(a_t|s_t) \ge 0`.
- :class:`ESPO`: the rule as the two digests describe it (needs a critic value :math:`V(s_t)` per step): EMA
  normalisation frozen during the rollout, exponential smoothing, threshold :math:`\beta\max(V, \epsilon_V)`,
  a stop-rate controller on :math:`\beta` and a critic warm-up gate.
- :class:`ESPOCriticFree`: the critic-free variant reconstructed from the abstract (``experimental=True``):
  cumulative regret against a reference :math:`t\bar\rho + \kappa\sqrt t\,s_\rho` learned from successful rollouts.
- :func:`absorbing_failure`: rewrites rewards, ``done`` flags and the loss mask of a batch after a stop rule.

A generation loop::

    rule = ESPO()
    state = rule.init(batch_size)
    for t in range(max_new_tokens):
        ...  # sample; the engine has logp [N], topk_logp [N, K], the critic's values [N]
        state, stop = rule.step(state, logp=lp, topk_logp=topk, values=v, active=~finished)
    result = rule.finalize(state)
    batch = absorbing_failure(rewards, mask, result, r_fail=rule.r_fail)   # token rewards, done, mask for GAE
    rule.update(state)                                                      # batch boundary: EMA stats, beta
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import (
    Dims,
    as_float,
    as_mask,
    checks_enabled,
    describe,
    finite,
    require_experimental,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._base import StepInputs, StopResult, StopRule, StopState, truncate_mask
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, BoolBT, FloatAny, FloatB, FloatBT, PerSeqOrToken, Scalar

__all__ = [
    "ESPO",
    "AbsorbingFailure",
    "ESPOCriticFree",
    "ESPOStats",
    "absorbing_failure",
    "surrogate_regret",
]

_DOCS = "docs/methods/early_stop.md"


# -- hyper-parameter checks (shared with control.abstention) --------------------------------------------------------
def _float_state(state: Any, key: str, owner: str) -> float:
    value = state.get(key) if isinstance(state, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"state[{key!r}]", "a finite number", describe(value), f"pass {owner}.state_dict()")
    return float(value)


# -- the regret ------------------------------------------------------------------------------------------------------
def _regret(logp: Tensor, topk: Tensor) -> Tensor:
    return (topk.amax(dim=-1) - logp).clamp_min(0.0)


def surrogate_regret(logp: FloatB, topk_logp: Float[Tensor, "B topk"]) -> FloatB:
    r"""ESPO's per-token surrogate regret, the log-prob gap of the sampled token to the most likely one.

    .. math::
        g_t = \max\Big(\max_{a \in \text{top-}k} \log\pi(a|s_t) - \log\pi(a_t|s_t),\ 0\Big)

    Reference: ESPO, arXiv 2605.29860 (``docs/methods/early_stop.md``). The paper takes the max over the whole
    vocabulary; the engine's top-k log-probs (k >= 1) contain the argmax token, so the top-k's max stands in for
    the argmax log-prob exactly as long as the top-k is the true top-k of the sampling distribution. The clamp at
    0 absorbs a sampled log-prob that is (numerically) above the top-k's max. :math:`g_t = 0` when the sampled
    token is the argmax: a confidently wrong policy has no regret and is never stopped (the paper's caveat).

    Args:
        logp: log-prob of the sampled token, float ``[N]``.
        topk_logp: the top-k log-probs at the same step, float ``[N, K]`` with ``K >= 1`` (any order).

    Returns:
        ``g`` float32 ``[N]`` (float64 for float64 inputs), ``>= 0`` and finite. An empty batch gives ``[0]``.
    """
    dims = Dims()
    lp = as_float(logp, "logp", dims, "N")
    topk = as_float(topk_logp, "topk_logp", dims, "N K").to(lp.device)
    if checks_enabled():
        if topk.shape[1] == 0:
            raise InputError("topk_logp", "K >= 1 top-k log-probs per row", describe(topk), "pass k >= 1")
        finite(lp, "logp")
        finite(topk, "topk_logp")
    return _regret(lp, topk)


# -- ESPO (the digest rule) ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ESPOStats:
    """One batch's regret statistics and stop count, what :meth:`ESPO.update` learns from (all 0-d tensors).

    Sums, so that data-parallel ranks can ``all_reduce`` them before the update: ``tokens`` (live tokens seen),
    ``regret_sum`` and ``regret_sq_sum`` (of :math:`g_t` over those tokens), ``rows`` (rows that generated at
    least one token), ``stopped`` (rows the rule stopped), ``enabled_rows`` (rows generated with the rule
    enabled; the :math:`\\beta` controller moves only when this is > 0).
    """

    tokens: Scalar
    regret_sum: Scalar
    regret_sq_sum: Scalar
    rows: Scalar
    stopped: Scalar
    enabled_rows: Scalar


class ESPO(StopRule):
    r"""ESPO's streaming stop rule (the digest account): stop when smoothed normalised regret exceeds
    :math:`\beta\max(V, \epsilon_V)`.

    .. math::
        \tilde g_t = \operatorname{clip}\Big(\frac{g_t - \mu_g}{\sqrt{\sigma_g^2 + \delta}}, -c, c\Big), \qquad
        z_t = \alpha_s z_{t-1} + (1 - \alpha_s)\,\tilde g_t, \quad z_0 = 0, \\
        \text{stop at } t \iff \text{warm-up done} \wedge z_t > \beta\,\max\big(V_\phi(s_t), \epsilon_V\big)

    with :math:`g_t` from :func:`surrogate_regret`. :math:`\mu_g, \sigma_g^2, \beta` are frozen during a rollout
    and learnt at batch boundaries by :meth:`update`:

    .. math::
        \mu_g \leftarrow \alpha_{EMA}\mu_g + (1-\alpha_{EMA})\,\hat\mu, \quad
        \sigma_g^2 \leftarrow \alpha_{EMA}\sigma_g^2 + (1-\alpha_{EMA})\,\hat\sigma^2, \quad
        \beta \leftarrow \operatorname{clip}\big(\beta + \eta_\beta(\hat\rho_{stop} - \tau), \beta_{min},
        \beta_{max}\big)

    Reference: ESPO, arXiv 2605.29860; the rule, the warm-up gate and the defaults come from two digests of the
    paper (public summaries; ``docs/methods/early_stop.md``). No code is public.

    Inputs to :meth:`StopRule.step` (all required): ``logp [N]``, ``topk_logp [N, K]`` and ``values [N]``
    (the critic's :math:`V_\phi(s_t)` at the same step). Reason ``"regret"``. The per-row state holds ``z`` and
    the regret sums that :meth:`update` consumes (:meth:`batch_stats`).

    Warm-up gate: the rule stays disabled until the critic loss is stable — ``warmup_patience`` consecutive
    :meth:`observe_critic_loss` calls each with loss ``< warmup_loss`` *or* a change from the previous loss
    ``< warmup_delta`` (our reading of the digests' "3 consecutive steps < 0.5 or step-to-step change < 0.1") —
    and is forced on once :attr:`training_progress` reaches ``warmup_force`` (10% of training). It latches: once
    on, it stays on. Whether it is on is fixed per rollout at :meth:`StopRule.init` (a row generated while
    disabled never stops).

    Args:
        r_fail: terminal reward of a stopped rollout, for :func:`absorbing_failure` (default -1.0, digests).
        alpha_ema: :math:`\alpha_{EMA}`, the batch-boundary EMA of the regret statistics (0.99, digests).
        alpha_s: :math:`\alpha_s`, the within-rollout smoothing (0.9, digests).
        beta_init: initial :math:`\beta` (7.0, digests).
        eta_beta: :math:`\eta_\beta`, the controller's step (0.1, digests).
        target_stop_rate: :math:`\tau`, the target fraction of stopped rollouts (0.25, digests).
        beta_min, beta_max: the controller's clip range (1.0 and 20.0: ours, the digests give no values; with
            ``clip=5`` and :math:`\epsilon_V = 0.2` a :math:`\beta \ge 25` would never stop anything).
        eps_v: :math:`\epsilon_V`, the floor of the value in the threshold (0.2, digests).
        delta: :math:`\delta` in the normaliser (1e-6: ours; the oracle uses 0).
        clip: :math:`c`, the clip of the normalised regret (5.0: ours, as in our worked example; the digests give
            no value).
        mu_init, var_init: :math:`\mu_g, \sigma_g^2` before any batch (0 and 1: ours, the identity normaliser).
        seed_from_first_batch: the first :meth:`update` with tokens replaces ``mu_init``/``var_init`` by the
            batch statistics instead of an EMA step from them (True: ours — with :math:`\alpha_{EMA} = 0.99` the
            arbitrary initial values would otherwise dominate for ~100 batches).
        critic_warmup: apply the warm-up gate (True, digests); False enables the rule from the start.
        warmup_loss, warmup_delta, warmup_patience, warmup_force: the gate's thresholds (0.5, 0.1, 3, 0.1;
            digests).

    Edge cases: an all-inactive step changes nothing; an empty batch (``init(0)``) works; rows with
    ``V`` below :math:`\epsilon_V` use :math:`\epsilon_V`; the rule never fires before warm-up is done.
    Defaults not listed (``T_max = 8192``, lr 1e-6) belong to the trainer, not to the rule.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "regret")
    requires: ClassVar[tuple[str, ...]] = ("logp", "topk_logp", "values")
    extra_inputs: ClassVar[dict[str, tuple[str, str]]] = {"values": ("N", "float")}
    reference: ClassVar[str] = "arXiv 2605.29860 (ESPO; the rule and defaults from public summaries)"

    def __init__(
        self,
        *,
        r_fail: float = -1.0,
        alpha_ema: float = 0.99,
        alpha_s: float = 0.9,
        beta_init: float = 7.0,
        eta_beta: float = 0.1,
        target_stop_rate: float = 0.25,
        beta_min: float = 1.0,
        beta_max: float = 20.0,
        eps_v: float = 0.2,
        delta: float = 1e-6,
        clip: float = 5.0,
        mu_init: float = 0.0,
        var_init: float = 1.0,
        seed_from_first_batch: bool = True,
        critic_warmup: bool = True,
        warmup_loss: float = 0.5,
        warmup_delta: float = 0.1,
        warmup_patience: int = 3,
        warmup_force: float = 0.1,
    ) -> None:
        self.r_fail = _real(r_fail, "r_fail")
        self.alpha_ema = _real(alpha_ema, "alpha_ema", 0.0, 1.0)
        self.alpha_s = _real(alpha_s, "alpha_s", 0.0, 1.0)
        self.eta_beta = _real(eta_beta, "eta_beta", 0.0)
        self.target_stop_rate = _real(target_stop_rate, "target_stop_rate", 0.0, 1.0)
        self.beta_min = _real(beta_min, "beta_min", 0.0)
        self.beta_max = _real(beta_max, "beta_max", self.beta_min)
        self.beta_init = _real(beta_init, "beta_init", self.beta_min, self.beta_max)
        self.eps_v = _real(eps_v, "eps_v", 0.0)
        self.delta = _real(delta, "delta", 0.0)
        self.clip = _real(clip, "clip", 0.0, open_low=True)
        self.mu_init = _real(mu_init, "mu_init")
        self.var_init = _real(var_init, "var_init", 0.0)
        if self.var_init + self.delta <= 0:
            raise InputError("var_init", "var_init + delta > 0", f"{var_init} + {delta}", "use var_init=1.0")
        for name, flag in (("seed_from_first_batch", seed_from_first_batch), ("critic_warmup", critic_warmup)):
            if not isinstance(flag, bool):
                raise InputError(name, "a bool", describe(flag), f"pass {name}=True or False")
        self.seed_from_first_batch = seed_from_first_batch
        self.critic_warmup = critic_warmup
        self.warmup_loss = _real(warmup_loss, "warmup_loss")
        self.warmup_delta = _real(warmup_delta, "warmup_delta", 0.0)
        self.warmup_patience = _int(warmup_patience, "warmup_patience", 1)
        self.warmup_force = _real(warmup_force, "warmup_force", 0.0, 1.0)
        # cross-batch state
        self.mu = self.mu_init
        self.var = self.var_init
        self.beta = self.beta_init
        self.batches = 0
        self._warm = not critic_warmup
        self._streak = 0
        self._last_loss: float | None = None
        self._progress = 0.0

    # -- warm-up gate --------------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """Whether the warm-up is done (rollouts started from now on may be stopped)."""
        return self._warm

    @property
    def training_progress(self) -> float:
        """Fraction of training done, in ``[0, 1]``; set it (e.g. ``step / total_steps``) to force the rule on
        at ``warmup_force``."""
        return self._progress

    @training_progress.setter
    def training_progress(self, value: float) -> None:
        self._progress = _real(value, "training_progress", 0.0, 1.0)
        if self._progress >= self.warmup_force:
            self._warm = True

    def observe_critic_loss(self, loss: float | FloatAny) -> bool:
        """Feed one critic-loss value (one training step); return whether the rule is now enabled.

        A step is stable when ``loss < warmup_loss`` or ``|loss - previous| < warmup_delta``; ``warmup_patience``
        consecutive stable steps end the warm-up (it latches).
        """
        value = float(loss.detach().float().reshape(())) if isinstance(loss, Tensor) and loss.numel() == 1 else loss
        value = _real(value, "loss")
        stable = value < self.warmup_loss or (
            self._last_loss is not None and abs(value - self._last_loss) < self.warmup_delta
        )
        self._streak = self._streak + 1 if stable else 0
        self._last_loss = value
        if self._streak >= self.warmup_patience:
            self._warm = True
        return self._warm

    # -- the protocol --------------------------------------------------------------------------------------------
    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        super()._init(n, device, **inputs)
        zeros = torch.zeros(n, device=device)
        return {
            "z": zeros,
            "regret_sum": zeros.clone(),
            "regret_sq_sum": zeros.clone(),
            "enabled": torch.full((n,), self._warm, dtype=torch.bool, device=device),
        }

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        lp = x.need("logp", "ESPO")
        topk = x.need("topk_logp", "ESPO")
        v = x.need("values", "ESPO")
        if checks_enabled() and topk.shape[1] == 0:
            raise InputError("topk_logp", "K >= 1 top-k log-probs per row", describe(topk), "pass k >= 1")
        g = _regret(lp, topk)
        gn = ((g - self.mu) / math.sqrt(self.var + self.delta)).clamp(-self.clip, self.clip)
        e = state.extra
        live = x.live
        z = torch.where(live, self.alpha_s * e["z"] + (1.0 - self.alpha_s) * gn, e["z"])
        g_live = torch.where(live, g, torch.zeros_like(g))
        extra = {
            "z": z,
            "regret_sum": e["regret_sum"] + g_live,
            "regret_sq_sum": e["regret_sq_sum"] + g_live * g_live,
            "enabled": e["enabled"],
        }
        fire = e["enabled"] & (z > self.beta * v.clamp_min(self.eps_v))
        return extra, fire, 1

    # -- batch boundary ------------------------------------------------------------------------------------------
    def batch_stats(self, state: StopState) -> ESPOStats:
        """The sums :meth:`update` learns from, for one state (all-reduce them across ranks if needed)."""
        if not isinstance(state, StopState) or not {"regret_sum", "regret_sq_sum", "enabled"} <= set(state.extra):
            raise InputError("state", "a StopState produced by ESPO.step", describe(state), "pass ESPO's state")
        ran = state.steps > 0
        return ESPOStats(
            tokens=state.steps.sum().double(),
            regret_sum=state.extra["regret_sum"].double().sum(),
            regret_sq_sum=state.extra["regret_sq_sum"].double().sum(),
            rows=ran.sum().double(),
            stopped=state.stopped.sum().double(),
            enabled_rows=(ran & state.extra["enabled"]).sum().double(),
        )

    def update(self, batch: StopState | ESPOStats) -> dict[str, Tensor]:
        """Learn from a finished batch (its final state, or its :class:`ESPOStats`): EMA of the regret mean and
        variance over the batch's live tokens, then the :math:`\\beta` controller on the realised stop rate
        (stopped rows / rows that generated; only when the batch ran with the rule enabled).

        Returns detached 0-d metrics: ``regret_mean``, ``regret_var``, ``stop_rate``, ``beta``, ``mu``, ``var``.
        A batch without tokens changes nothing.
        """
        stats = batch if isinstance(batch, ESPOStats) else self.batch_stats(batch)
        tokens, rows = float(stats.tokens), float(stats.rows)
        mean = float(stats.regret_sum) / tokens if tokens > 0 else 0.0
        var = max(float(stats.regret_sq_sum) / tokens - mean * mean, 0.0) if tokens > 0 else 0.0
        rate = float(stats.stopped) / rows if rows > 0 else 0.0
        if tokens > 0:
            if self.batches == 0 and self.seed_from_first_batch:
                self.mu, self.var = mean, var
            else:
                a = self.alpha_ema
                self.mu = a * self.mu + (1.0 - a) * mean
                self.var = a * self.var + (1.0 - a) * var
            self.batches += 1
        if float(stats.enabled_rows) > 0:
            step = self.beta + self.eta_beta * (rate - self.target_stop_rate)
            self.beta = min(max(step, self.beta_min), self.beta_max)
        metrics = {"regret_mean": mean, "regret_var": var, "stop_rate": rate, "beta": self.beta}
        metrics |= {"mu": self.mu, "var": self.var}
        return {k: torch.tensor(v) for k, v in metrics.items()}

    STATE: ClassVar[dict[str, Field]] = {
        "mu": Field("real"),
        "var": Field("real", low=0.0),
        "beta": Field("real"),
        "batches": Field("integer", low=0),
        "warm": Field("any"),  # a Python bool: checked on load
        "streak": Field("integer", low=0),
        "last_loss": Field("any"),  # None before the first critic loss, else a finite float: checked on load
        "progress": Field("real", low=0.0, high=1.0),
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """Running statistics, :math:`\\beta`, the update count and the warm-up gate (plain Python values)."""
        return dump_state(
            {
                "mu": self.mu,
                "var": self.var,
                "beta": self.beta,
                "batches": self.batches,
                "warm": self._warm,
                "streak": self._streak,
                "last_loss": self._last_loss,
                "progress": self._progress,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "ESPO")
        last = None if s["last_loss"] is None else _float_state(s, "last_loss", "ESPO")
        if not isinstance(s["warm"], bool):
            raise InputError("state['warm']", "a bool", describe(s["warm"]), "pass ESPO.state_dict()")
        self.mu, self.var, self.beta = float(s["mu"]), float(s["var"]), float(s["beta"])
        self._progress, self._last_loss = float(s["progress"]), last
        self.batches, self._streak, self._warm = s["batches"], s["streak"], s["warm"]


# -- ESPO, critic-free variant ---------------------------------------------------------------------------------------
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
        r_fail: the terminal reward for :func:`absorbing_failure` (-1.0: ours, the digest rule's value; the
            abstract allows 0 or a negative value).
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


# -- the loss side ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AbsorbingFailure:
    """A batch rewritten by :func:`absorbing_failure`.

    Attributes:
        token_rewards: float32 ``[N, T]``; a stopped row has 0 everywhere except ``r_fail`` at its stop position.
        rewards: float32 ``[N]``; ``r_fail`` for stopped rows, the original sequence reward otherwise.
        done: bool ``[N, T]``; True at the terminal token of each row (the stop position of a stopped row, the
            last kept token of the others): GAE must not bootstrap past it.
        mask: bool ``[N, T]``; the loss mask truncated after each stop position (:func:`truncate_mask`).
        stopped: bool ``[N]``; the rows that became absorbing failures.
        metrics: detached 0-d tensors: ``stop_frac``, ``tokens_removed`` (masked-in tokens dropped by the stops).
    """

    token_rewards: FloatBT
    rewards: FloatB
    done: BoolBT
    mask: BoolBT
    stopped: BoolB
    metrics: dict[str, Tensor] = field(default_factory=dict)


def absorbing_failure(
    rewards: PerSeqOrToken, mask: BoolBT, result: StopResult, *, r_fail: float = -1.0
) -> AbsorbingFailure:
    r"""Turn rollouts a stop rule cut into absorbing failure states: terminal reward, ``done``, truncated mask.

    .. math::
        r_{i,t} = \begin{cases} r_{fail} & t = T^{stop}_i \\ 0 & t \ne T^{stop}_i \end{cases}
        \ \text{(stopped rows)}, \qquad r_{i,t} \text{ unchanged (other rows)}, \qquad
        \text{done}_{i,t} = [t = T^{end}_i]

    Reference: ESPO, arXiv 2605.29860 (``docs/methods/early_stop.md``, "loss-side effect"): no bootstrap beyond
    the stop, so GAE concentrates the negative TD error near the stop point; PPO/GAE then run unchanged. The
    terminal reward is **never** added to rows that finished normally. Works for any :class:`StopRule`'s result
    (e.g. :class:`~rolloutopt.control.abstention.Abstention` with ``r_fail=rule.r_abs``).

    Args:
        rewards: float ``[N]`` sequence rewards (placed on each row's last masked-in token) or ``[N, T]`` token
            rewards (kept as they are for rows that did not stop).
        mask: bool ``[N, T]``, the response mask before the stop rule.
        result: the rule's :meth:`~rolloutopt.control.StopRule.finalize` output for the same rows; a stopped row's
            position must be a masked-in token of ``mask``.
        r_fail: the terminal reward (default -1.0, the ESPO digests' value).

    Edge cases: a row with an empty mask gets zero token rewards and no ``done`` (its sequence reward stays in
    ``rewards``); with no stopped row the token rewards are the input's (placed, for ``[N]`` rewards); ``N = 0``
    or ``T = 0`` works.
    """
    dims = Dims()
    m = as_mask(mask, "mask", dims, "N T")
    fail = _real(r_fail, "r_fail")
    r = as_float(rewards, "rewards")
    if checks_enabled():
        if r.ndim == 1:
            dims.check(r, "rewards", "N")
        else:
            dims.check(r, "rewards", "N T")
        if not isinstance(result, StopResult):
            raise InputError("result", "a StopResult from rule.finalize()", describe(result), "pass rule.finalize()")
        if result.stopped.shape[0] != m.shape[0]:
            raise InputError(
                "result", f"a StopResult for N={m.shape[0]} rows", f"one for {result.stopped.shape[0]}", "same batch"
            )
    r = r.to(m.device).float()
    if checks_enabled():
        finite(r, "rewards", None if r.ndim == 1 else m)
    n, t_len = m.shape
    stopped = result.stopped.to(m.device)
    pos = result.position.to(m.device)
    cols = torch.arange(t_len, device=m.device)
    if checks_enabled() and bool(stopped.any()):
        bad = stopped & ((pos >= t_len) | ~m.gather(1, pos.clamp(0, max(t_len - 1, 0))[:, None]).squeeze(1))
        if t_len == 0 or bool(bad.any()):
            raise InputError(
                "result",
                "stop positions at masked-in tokens of mask",
                "a stopped row whose position is outside its mask",
                "pass the mask of the generation the rule observed",
            )
    new_mask = truncate_mask(m, result)
    # the last masked-in token of each row after truncation, -1 if none
    if t_len > 0:
        last = torch.where(new_mask, cols[None, :], torch.full_like(new_mask, -1, dtype=torch.long)).amax(dim=1)
    else:
        last = torch.full((n,), -1, dtype=torch.long, device=m.device)
    at_last = cols[None, :] == last[:, None]
    if r.ndim == 1:
        seq = r
        base = torch.where(at_last, r[:, None], torch.zeros((), device=m.device))
    else:
        seq = torch.where(m, r, torch.zeros((), device=m.device)).sum(dim=1)
        base = torch.where(m, r, torch.zeros((), device=m.device))
    fail_t = torch.where(at_last, torch.full((), fail, device=m.device), torch.zeros((), device=m.device))
    token_rewards = torch.where(stopped[:, None], fail_t, base)
    rewards_out = torch.where(stopped, torch.full_like(seq, fail), seq)
    done = at_last & (last >= 0)[:, None]
    removed = (m & ~new_mask).sum()
    metrics = {"stop_frac": stopped.float().sum() / max(n, 1), "tokens_removed": removed.float()}
    return AbsorbingFailure(
        token_rewards=token_rewards,
        rewards=rewards_out,
        done=done,
        mask=new_mask,
        stopped=stopped.clone(),
        metrics={k: v.detach() for k, v in metrics.items()},
    )
