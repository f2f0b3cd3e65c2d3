r"""ESPO — Early-Stopping PPO (arXiv 2605.29860): stop a rollout when its logit regret runs away.

ESPO stops generation once a *surrogate regret*, computed only from the log-probs the sampler already produced,
accumulates faster than expected. A stopped rollout is an *absorbing failure state* with a terminal reward, so
PPO/GAE concentrates the negative TD error near the detected failure step (``docs/methods/early_stop.md``).

- :func:`surrogate_regret`: :math:`g_t = \max_a \log\pi(a|s_t) - \log\pi(a_t|s_t) \ge 0`.
- :class:`ESPO`: the rule as the two digests describe it (needs a critic value :math:`V(s_t)` per step): EMA
  normalisation frozen during the rollout, exponential smoothing, threshold :math:`\beta\max(V, \epsilon_V)`,
  a stop-rate controller on :math:`\beta` and a critic warm-up gate.
- the critic-free variant reconstructed from the abstract, :class:`~rolloutopt.control.ESPOCriticFree`, is in
  :mod:`~rolloutopt.control.espo_critic_free`; :func:`~rolloutopt.control.absorbing_failure`, which rewrites
  rewards, ``done`` flags and the loss mask of a batch after a stop rule, in :mod:`~rolloutopt.control.absorbing`.

A generation loop::

    rule = ESPO()
    state = rule.init(batch_size)
    for t in range(max_new_tokens):
        ...  # sample; the engine has logp [N], topk_logp [N, K], the critic's values [N]
        state, stop = rule.step(state, logp=lp, topk_logp=topk, values=v, active=~finished)
    result = rule.finalize(state)
    seq_rewards = result.rewards(rewards)               # sequence rewards: r_fail on the stopped rows
    batch = absorbing_failure(rewards, mask, result)    # or token rewards, done and mask for GAE
    rule.update(state)                                  # batch boundary: EMA stats, beta
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import (
    Dims,
    as_float,
    checks_enabled,
    describe,
    finite,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._base import StepInputs, StopResult, StopRule, StopState
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatB, Scalar

__all__ = ["ESPO", "ESPOStats", "surrogate_regret"]

_DOCS = "docs/methods/early_stop.md"


# -- state checks (shared with control.espo_critic_free) -----------------------------------------------------------
def _float_state(state: Any, key: str, owner: str) -> float:
    value = state.get(key) if isinstance(state, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"state[{key!r}]", "a finite number", describe(value), f"pass {owner}.state_dict()")
    return float(value)


def _absorbing(res: StopResult, r_fail: float) -> StopResult:
    """``res`` with ESPO's terminal reward: ``r_fail`` on every stopped row (an absorbing failure state)."""
    reward = torch.full(res.stopped.shape, r_fail, dtype=torch.float32, device=res.stopped.device)
    return replace(res, terminal_reward=reward, terminal_rows=res.stopped.clone())


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
        r_fail: terminal reward of a stopped rollout, in :meth:`finalize`'s result (``result.rewards``,
            :func:`~rolloutopt.control.absorbing_failure`; default -1.0, digests).
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

    def finalize(self, state: StopState) -> StopResult:
        r""":meth:`~rolloutopt.control.StopRule.finalize` plus the absorbing-failure reward: ``terminal_reward`` is
        :math:`r_{fail}` on every stopped row (``terminal_rows``), so ``result.rewards(rewards)`` gives a stopped
        rollout :math:`r_{fail}` and leaves the others unchanged (ESPO, arXiv 2605.29860: a stopped rollout is an
        absorbing failure state with a terminal reward; token rewards: :func:`~rolloutopt.control.absorbing_failure`).
        """
        return _absorbing(super().finalize(state), self.r_fail)

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
