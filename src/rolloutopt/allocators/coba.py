"""CoBA-RL's history-based per-prompt budget: a heap greedy on a capability-oriented value (:class:`CoBA`,
:func:`coba_beta_params`).

Reads each prompt's past success rate from a :class:`~rolloutopt.allocators.PromptHistory` and gives every prompt
of the batch its own number of rollouts, in one request, before any rollout of the step. CoBA-RL, arXiv
2602.03048, code ``Within-yao/CoBA-RL`` ``recipe/coba_rl/budget_allocators.py`` (``BetaAllocator``). See
``docs/methods/budget.md``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from jaxtyping import Real
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import check_real as _float
from rolloutopt.allocators._base import AllocationResult, Conversation, as_prompt_ids, check_budget
from rolloutopt.allocators._budget import _F64, _OneShot, _short, _spread, _top_units_by_key, _unsort
from rolloutopt.allocators._ids import _sort_ids
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.history import PromptHistory
from rolloutopt.allocators.table import PromptTable, TableOwner
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, IntP

__all__ = ["CoBA", "coba_beta_params"]


def _uniform(budget: int, p: int, n_min: int, n_max: int) -> Tensor:
    """The codes' uniform split (``budget // p`` each, the first ``budget % p`` one more), capped at ``n_max``;
    below ``n_min`` per prompt, :func:`_short`."""
    if p == 0:
        return torch.zeros(0, dtype=torch.long)
    if budget < p * n_min:
        return _short(budget, p, n_min, n_max)
    return _spread(budget, torch.ones(p, dtype=torch.bool), torch.full((p,), n_max, dtype=torch.long))


# -- CoBA-RL ------------------------------------------------------------------------------------------------------
def coba_beta_params(failure_rate: float, beta_params_sum: float = 7.0) -> tuple[float, float]:
    r"""CoBA-RL's capability schedule: the Beta shape from the window-averaged failure rate ``f``.

    .. math::

        f' = \begin{cases} \sigma(10 (f - 0.5)) & f \le 0.5 \\ f & \text{otherwise} \end{cases}, \qquad
        \alpha = \mathrm{clip}(1 + (S - 2) f', 1, S - 1), \qquad \beta = S - \alpha.

    Reference: arXiv 2602.03048, ``BetaAllocator._update_beta_params_sample_based_sliding_window``
    (``docs/methods/budget.md``). Oracle (by hand, following that code): ``f = 0.8, S = 7`` gives ``(5, 2)``;
    ``f = 0.3`` gives ``(1.596, 5.404)``.

    Args:
        failure_rate: ``f`` in ``[0, 1]``.
        beta_params_sum: ``S > 2`` (code default 7; the 7B script uses 11).
    """
    f = _float(failure_rate, "failure_rate", 0.0, 1.0)
    s = _float(beta_params_sum, "beta_params_sum", 2.0, 1e6, open_low=True)
    if f <= 0.5:
        f = 1.0 / (1.0 + math.exp(-10.0 * (f - 0.5)))
    alpha = min(max(1.0 + (s - 2.0) * f, 1.0), s - 1.0)
    return alpha, s - alpha


class CoBA(TableOwner):
    r"""CoBA-RL: per-prompt rollout counts from a capability-oriented value, by heap greedy.

    Every prompt's success rate :math:`p_i` (successes over rollouts in the last ``window`` steps it was rolled
    out; a reward counts as a success iff it is exactly 1.0; :math:`p_i = 0.5` if never seen) enters the value

    .. math::

        V(N, p) = \bigl(1 - e^{-N p (1 - p) / \tau}\bigr)\,\mathrm{Beta}(p; \alpha, \beta),
        \qquad p \leftarrow \mathrm{clip}(p, s, 1 - s),

        \tau = \tau_{min} + (\tau_{max} - \tau_{min})\,\mathrm{clip}(\mathrm{Var}(p) / v_{max}, 0, 1),

    with :math:`\mathrm{Var}(p)` the population variance of the clipped rates of the exploration tier and
    :math:`(\alpha, \beta)` from :func:`coba_beta_params` after every step (the average per-prompt success rate of
    the step, averaged over the last ``window`` steps, gives the failure rate; start ``(S - 2, 2)``).
    ``plan(prompt_ids, T)`` (``M`` prompts):

    1. No prompt seen: the uniform split of ``T``. ``T < M n_{min}``: see "deliberate fixes".
    2. Everyone starts at ``n_min``. Tiers: very hard (:math:`p < 0.05`), very easy (:math:`p > 0.99`),
       exploration (the rest).
    3. Exploration budget :math:`\lfloor \rho (T - M n_{min}) \rfloor`, :math:`\rho = 0.8` (``exploration_
       budget_ratio``) if the exploration tier holds more than ``M / 2`` prompts, else
       :math:`0.6 + (\rho - 0.6) \cdot 2 E / M`.
    4. Heap greedy over the exploration tier: one rollout at a time to the largest marginal gain
       :math:`V(N + 1, p) - V(N, p)` while :math:`N < n_{max}`. Vectorised exactly (:func:`_top_units`): the
       gains are non-increasing in ``N``, so the greedy takes the largest ones, ties by smaller prompt id (the
       heap's index order on the id-sorted batch). The gains are evaluated in the closed form
       :math:`\mathrm{Beta}(p)\,e^{-N c}(1 - e^{-c})`, :math:`c = p(1-p)/\tau`, which is monotone in floating
       point; the code's difference of two rounded values can differ in the last bits.
    5. The budget left goes to the very hard tier, then exploration, then very easy, each by floored shares
       :math:`\propto (1 - p)^{w}` (``weight_alpha``) and one uniform top-up pass, capped at ``n_max``.

    Reference: arXiv 2602.03048; code ``Within-yao/CoBA-RL`` ``recipe/coba_rl/budget_allocators.py``
    (``BetaAllocator``); defaults from its signature (``docs/methods/budget.md``).

    Deliberate fixes:

    - **Step 5 shares** are floored from the tier's *starting* leftover. The code recomputes each share from the
      *running* leftover inside its loop, so earlier prompts get more than their weight (an order effect that
      cannot be vectorised without a loop over prompts).
    - **Caps**: the code's uniform splits (no prompt seen, ``T < M n_min``) ignore ``n_low``/``n_up``. Here the
      split is capped at ``n_max``, and a budget below ``M n_min`` gives ``n_min`` to the first
      ``T // n_min`` prompts (smallest ids) and spreads the rest over them; so every count is 0 or in
      ``[n_min, n_max]`` (reason ``"short_budget"``).
    - **Order**: "the first prompts" of every remainder rule and the heap's ties are by prompt id.

    Budget: never more than ``T``. It spends all of it unless the caps bind: step 5 makes one capped uniform
    pass per tier, as the code does, so a leftover can stay unused (the code leaves it unused too), and a
    budget below ``M n_min`` can leave a remainder below ``n_min``. Every
    rollout is kept (weight 1). Reasons: ``"explore"``, ``"very_hard"``, ``"very_easy"``, ``"uniform"`` (no
    prompt seen), ``"short_budget"``, ``"no_budget"`` (0 rollouts).

    Args:
        n_min: ``n_low``, rollouts every prompt starts with (code 2).
        n_max: ``n_up``, the most rollouts of one prompt (code 32; the 7B script 128).
        window: ``W``, steps in the per-prompt and the global sliding windows (code 3; the 7B script 1).
        tau_min, tau_max: the temperature range (code 3 and 12).
        var_max: ``v_max`` (code 0.1667).
        exploration_budget_ratio: ``rho`` (code 0.8).
        weight_alpha: ``w`` of step 5 (code 1).
        beta_params_sum: ``S`` (code 7; the 7B script 11).
        smoothing: ``s``, the clip of ``p`` in the value (code ``smoothing_factor = 0.01``).
        capacity: prompts kept in a private table (default None: 1,000,000; least recently seen evicted).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one). CoBA registers
            its history's columns as owner ``"coba"``; the table is then saved once by the caller, not in
            :meth:`state_dict`.

    Edge cases: an empty batch or a zero budget requests nothing. Prompts absent from the step's result keep
    their window. The history is bounded by ``capacity`` (``W`` groups per prompt).
    """

    reference: ClassVar[str] = "arXiv 2602.03048 (CoBA-RL); code Within-yao/CoBA-RL"
    experimental: ClassVar[str | None] = None

    reason_names = ("explore", "very_hard", "very_easy", "uniform", "short_budget", "no_budget")

    def __init__(
        self,
        *,
        n_min: int = 2,
        n_max: int = 32,
        window: int = 3,
        tau_min: float = 3.0,
        tau_max: float = 12.0,
        var_max: float = 0.1667,
        exploration_budget_ratio: float = 0.8,
        weight_alpha: float = 1.0,
        beta_params_sum: float = 7.0,
        smoothing: float = 0.01,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        self.n_min = _int(n_min, "n_min", 1)
        self.n_max = _int(n_max, "n_max", 1)
        if self.n_max < self.n_min:
            raise InputError("n_max", f"n_max >= n_min = {n_min}", repr(n_max), "raise n_max or lower n_min")
        self.window = _int(window, "window", 1)
        self.tau_min = _float(tau_min, "tau_min", 0.0, 1e12, open_low=True)
        self.tau_max = _float(tau_max, "tau_max", 0.0, 1e12, open_low=True)
        if self.tau_max < self.tau_min:
            raise InputError("tau_max", f"tau_max >= tau_min = {tau_min}", repr(tau_max), "raise tau_max")
        self.var_max = _float(var_max, "var_max", 0.0, 1e12, open_low=True)
        self.exploration_budget_ratio = _float(exploration_budget_ratio, "exploration_budget_ratio", 0.0, 1.0)
        self.weight_alpha = _float(weight_alpha, "weight_alpha", 0.0, 1e6)
        self.beta_params_sum = _float(beta_params_sum, "beta_params_sum", 2.0, 1e6, open_low=True)
        self.smoothing = _float(smoothing, "smoothing", 0.0, 0.5, open_low=True, open_high=True)
        self.history = PromptHistory.from_preset(
            "exact", window=self.window, capacity=capacity, table=table, name="coba"
        )
        self._cols = self.history._cols
        self.alpha = self.beta_params_sum - 2.0
        self.beta = 2.0
        self._rates = torch.zeros(0, dtype=_F64)  # per-step average success rates, oldest first (<= window)
        self._rated = 0  # updates with rollouts (each pushed one rate)
        self._step = 0
        s = self.beta_params_sum
        self.STATE = {
            "history": Field("nested", fields=self.history.STATE),
            # R = min(window, rated), alpha/beta the Beta shape of these rates: checked after load_state
            "rates": Field("float", ("R",), ("prob",)),
            # alpha: S - 2 before the first update, then clipped to [1, S - 1]; beta: S - alpha (>= 1 up to rounding)
            "alpha": Field("real", low=min(s - 2.0, 1.0), high=s - 1.0),
            "beta": Field("real", low=0.5, high=s),
            "rated": Field("integer", low=0),
            "step": Field("integer", low=0),
        }

    STATE: dict[str, Field]
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`; built per instance: the
    history's window and the Beta bounds of ``beta_params_sum``)."""

    # -- the value --------------------------------------------------------------------------------------------
    def _log_pdf(self, p: Tensor) -> Tensor:
        a, b = self.alpha, self.beta
        log_b = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
        return (a - 1.0) * torch.log(p) + (b - 1.0) * torch.log1p(-p) - log_b

    def value(self, n: Real[Tensor, " ..."], p: FloatAny, tau: float) -> FloatAny:
        """:math:`V(N, p)` with the current Beta shape (float64; ``p`` clipped to ``[s, 1 - s]``)."""
        pc = p.to(_F64).clamp(self.smoothing, 1.0 - self.smoothing)
        return -torch.expm1(-n.to(_F64) * pc * (1.0 - pc) / tau) * torch.exp(self._log_pdf(pc))

    def _tau(self, p: Tensor) -> float:
        pc = p.clamp(self.smoothing, 1.0 - self.smoothing)
        var = float(((pc - pc.mean()) ** 2).mean())
        return self.tau_min + (self.tau_max - self.tau_min) * min(max(var / self.var_max, 0.0), 1.0)

    def _greedy(self, p: Tensor, units: int) -> Tensor:
        """Extra rollouts (above ``n_min``) of the exploration prompts ``p`` ``[E]`` from the heap greedy."""
        tau = self._tau(p)

        def gains(q: Tensor, cols: int) -> Tensor:
            pc = q.clamp(self.smoothing, 1.0 - self.smoothing)
            c = pc * (1.0 - pc) / tau
            log_pdf, scale = self._log_pdf(pc)[:, None], (-torch.expm1(-c))[:, None]
            levels = torch.arange(self.n_min, self.n_min + cols, dtype=_F64)
            return torch.exp(log_pdf - levels[None, :] * c[:, None]) * scale

        return _top_units_by_key(p, gains, self.n_max - self.n_min, units)

    def _weighted(self, rem: int, tier: Tensor, counts: Tensor, p: Tensor) -> tuple[Tensor, int]:
        avail = tier & (counts < self.n_max)
        if rem <= 0 or not bool(avail.any()):
            return counts, rem
        room = self.n_max - counts
        w = torch.where(avail, (1.0 - p.clamp(1e-6, 1.0 - 1e-6)) ** self.weight_alpha, 0.0)
        total = float(w.sum())
        if total > 0:
            share = torch.floor(rem * w / total).long()
            give = torch.minimum(share, room)
            counts = counts + give
            rem -= int(give.sum())
            room = self.n_max - counts
            avail = avail & (counts < self.n_max)
        give = _spread(rem, avail, room)
        return counts + give, rem - int(give.sum())

    def _allocate(self, ids: Tensor, budget: int) -> tuple[Tensor, Tensor]:
        m = ids.numel()
        seen, p = self.history._window_pass_rate(ids)  # p: 0.5 where unseen (the history's prior fill)
        if m == 0:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        if not bool(seen.any()) or budget < m * self.n_min:
            counts = _uniform(budget, m, self.n_min, self.n_max)
            reason = 3 if budget >= m * self.n_min else 4
            return counts, torch.where(counts > 0, reason, 5)
        counts = torch.full((m,), self.n_min, dtype=torch.long)
        hard, easy = p < 0.05, p > 0.99
        explore = ~hard & ~easy
        reasons = torch.where(hard, 1, torch.where(easy, 2, 0))
        rem = budget - m * self.n_min
        if rem == 0:
            return counts, reasons
        e = int(explore.sum())
        if e > 0:
            rho = self.exploration_budget_ratio
            ratio = rho if e > m / 2 else 0.6 + (rho - 0.6) * (e / m * 2)
        else:
            ratio = 0.6
        units = int(rem * ratio)
        if e > 0 and units > 0:
            extra = self._greedy(p[explore], units)
            counts[explore] += extra
            rem -= int(extra.sum())
        for tier in (hard, explore, easy):
            counts, rem = self._weighted(rem, tier, counts, p)
        return counts, reasons

    # -- the protocol -----------------------------------------------------------------------------------------
    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """One request: the CoBA-RL counts of ``prompt_ids`` under ``budget`` rollouts (class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        sorted_ids, order = _sort_ids(ids)
        counts, reasons = self._allocate(sorted_ids, budget)
        return _OneShot(ids, budget, _unsort(counts, order), _unsort(reasons, order), self.reason_names)

    def update(self, result: AllocationResult) -> None:
        """Push the step into the per-prompt windows and update the Beta shape from the step's success rates."""
        result = _check_result(result)
        got = result.counts > 0
        if bool(got.any()):
            succ = torch.bincount(
                result.group, weights=(result.rewards == 1.0).to(_F64), minlength=result.counts.numel()
            )
            avg = float((succ[got] / result.counts[got].to(_F64)).mean())
            self._rates = torch.cat([self._rates, torch.tensor([avg], dtype=_F64)])[-self.window :]
            self._rated += 1
            self.alpha, self.beta = coba_beta_params(
                min(max(1.0 - float(self._rates.mean()), 0.0), 1.0), self.beta_params_sum
            )
        self.history.update_from_result(result, step=self._step)
        self._step += 1

    def state_dict(self) -> dict[str, Any]:
        """The history, the global window, the Beta shape, the updates with rollouts and the step counter (copies)."""
        return dump_state(
            {
                "history": self.history.state_dict(),
                "rates": self._rates.clone(),
                "alpha": self.alpha,
                "beta": self.beta,
                "rated": self._rated,
                "step": self._step,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "CoBA")
        # one rate per update with rollouts, the last window of them
        if s["rated"] > s["step"]:
            raise InputError("state['rated']", f"<= step = {s['step']}", repr(s["rated"]), "pass CoBA.state_dict()")
        rates, want_n = s["rates"], min(s["rated"], self.window)
        if rates.numel() != want_n:
            raise InputError(
                "state['rates']",
                f"{want_n} rates (one per update with rollouts, at most window={self.window})",
                f"{rates.numel()} rates",
                "pass the state_dict() of a CoBA with this window",
            )
        # the Beta shape is a function of the rates (update): a truncated or foreign window, or a shape saved with
        # another beta_params_sum, does not give the saved one
        if rates.numel():
            want = coba_beta_params(min(max(1.0 - float(rates.mean()), 0.0), 1.0), self.beta_params_sum)
        else:
            want = (self.beta_params_sum - 2.0, 2.0)
        for key, value in (("alpha", want[0]), ("beta", want[1])):
            if float(s[key]) != value:
                raise InputError(
                    f"state[{key!r}]",
                    f"{value!r}, the Beta shape of the saved rates (beta_params_sum={self.beta_params_sum})",
                    repr(s[key]),
                    "pass the state_dict() of a CoBA with this beta_params_sum",
                )
        self.history._load(s["history"], "state['history']")
        self._rates, self._rated = s["rates"], s["rated"]
        self.alpha, self.beta = float(s["alpha"]), float(s["beta"])
        self._step = s["step"]
