"""History-based per-prompt budgets: CoBA-RL (heap greedy on a capability-oriented value) and Knapsack-RL.

Both allocators read each prompt's past success rate from a :class:`~rolloutopt.allocators.PromptHistory` and
give every prompt of the batch its own number of rollouts, in one request, before any rollout of the step.

- :class:`CoBA` — CoBA-RL, arXiv 2602.03048, code ``Within-yao/CoBA-RL``
  ``recipe/coba_rl/budget_allocators.py`` (``BetaAllocator``).
- :class:`Knapsack` — Knapsack-RL, arXiv 2509.25849, code ``liziniu/KnapsackRL`` (read at
  ``ca5d5f5b7e933378d916d05d1aeb4ae9de929ee5``): ``verl/trainer/ppo/exploration_utils.py``
  (``sampling_budget_by_knapsack``, ``solve_by_dp``) and the per-prompt estimate of
  ``verl/utils/dataset/rl_dataset.py`` (``update_sample_state``, ``get_sample_state``). See
  ``docs/methods/budget.md``.

Both greedy/DP solvers reduce to "take the ``R`` largest marginal gains of a ``[E, L]`` table whose rows are
non-increasing" (:func:`_top_units`): one ``torch.kthvalue`` and a cumulative tie cut, no loop over prompts.
Every plan works on the prompts sorted by id, so "the first prompts" of the codes' remainder rules and the
heap's tie-breaking by index mean *smallest prompt id first*: a permutation of ``prompt_ids`` permutes the plan
and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Bool, Float, Real
from torch import Tensor

from rolloutopt._validation import check_int as _int
from rolloutopt._validation import check_real as _float
from rolloutopt._validation import check_state, describe
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    _check_result,
    _lookup,
    _sort_ids,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators.history import PromptHistory
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatB, FloatP, IntP

__all__ = ["CoBA", "Knapsack", "coba_beta_params", "knapsack_value"]

_F64 = torch.float64


# -- validation helpers -------------------------------------------------------------------------------------------
# -- shared vectorised pieces -------------------------------------------------------------------------------------
def _top_units(gains: Tensor, r: int) -> Tensor:
    """Units per row taken by a heap greedy on ``gains`` ``[E, L]`` (rows non-increasing), ``r`` units in all.

    The heap pops the largest gain, ties by smaller row, and pushes the row's next gain; with non-increasing rows
    it takes exactly the ``r`` largest entries, ties in row-major order. Here: the ``r``-th largest value ``t``
    (``torch.kthvalue``), every entry ``> t``, and the first ``r - #(> t)`` entries ``== t`` in row-major order.
    Returns int64 ``[E]`` (each in ``[0, L]``, summing to ``min(r, E * L)``).
    """
    e, length = gains.shape
    total = e * length
    if r <= 0 or total == 0:
        return torch.zeros(e, dtype=torch.long)
    if r >= total:
        return torch.full((e,), length, dtype=torch.long)
    flat = gains.reshape(-1)
    t = torch.kthvalue(flat, total - r + 1).values
    above = flat > t
    tie = flat == t
    need = r - above.sum()
    take = above | (tie & (torch.cumsum(tie, 0) <= need))
    return take.view(e, length).sum(1)


def _top_units_lazy(gain_fn: Callable[[int], Tensor], length: int, r: int, first: int = 16) -> Tensor:
    """:func:`_top_units` on ``gain_fn(L')`` (the first ``L'`` columns of the full ``[E, length]`` table), with
    ``L'`` doubled until no row takes all ``L'`` columns (or ``L' = length``). Exact: a row that stops before
    column ``L'`` has every later gain ``<=`` its first untaken one, which the cut already rejected."""
    cols = min(length, first)
    while True:
        counts = _top_units(gain_fn(cols), r)
        if cols >= length or not bool((counts >= cols).any()):
            return counts
        cols = min(length, 2 * cols)


def _top_units_grouped(g: Tensor, inv: Tensor, mult: Tensor, r: int) -> Tensor:
    """:func:`_top_units` on the ``[E, L]`` table whose row ``i`` is ``g[inv[i]]`` (``g`` ``[U, L]``, ``mult[u]``
    rows equal to ``g[u]``), without building it: the cut value from a weighted sort of the ``U * L`` entries,
    then per row the entries above it and, in row order, as many entries equal to it as ``r`` still allows
    (the row-major tie rule of :func:`_top_units`: only how many ties each row takes matters). Same result as
    :func:`_top_units` on the expanded table, whatever the rows (no monotonicity needed)."""
    e, length = inv.numel(), g.shape[1]
    total = e * length
    if r <= 0 or total == 0:
        return torch.zeros(e, dtype=torch.long)
    if r >= total:
        return torch.full((e,), length, dtype=torch.long)
    vals, order = g.reshape(-1).sort(descending=True)
    weight = mult.repeat_interleave(length)[order]
    t = vals[torch.searchsorted(torch.cumsum(weight, 0), r)]  # the r-th largest entry of the expanded table
    above = (g > t).sum(1)
    tie = (g == t).sum(1)
    need = r - int((above * mult).sum())
    tie_rows = tie[inv]
    before = torch.cumsum(tie_rows, 0) - tie_rows
    return above[inv] + torch.minimum((need - before).clamp(min=0), tie_rows)


def _top_units_by_key(key: Tensor, gain_fn: Callable[[Tensor, int], Tensor], length: int, r: int) -> Tensor:
    """:func:`_top_units_lazy` on the table whose row ``i`` is ``gain_fn(key, L')[i]``, a function of ``key[i]``
    alone (elementwise torch ops whose result does not depend on the element's position: exp, log, expm1,
    arithmetic; not ``torch.pow``, whose vectorised and scalar paths can differ), evaluated once per distinct key: success rates take few distinct values, so
    the table has a few hundred rows instead of one per prompt. Identical counts (the rows of equal keys are the
    same floats); with many distinct keys (over a quarter of the rows) the expanded table is cheaper and used."""
    e = key.numel()
    if e == 0 or r <= 0:
        return torch.zeros(e, dtype=torch.long)
    if key.dtype == _F64:  # group by bit pattern: an int64 unique is faster, and splitting -0.0 from 0.0 is harmless
        bits, inv, mult = torch.unique(key.contiguous().view(torch.int64), return_inverse=True, return_counts=True)
        uniq = bits.view(_F64)
    else:
        uniq, inv, mult = torch.unique(key, return_inverse=True, return_counts=True)
    if 4 * uniq.numel() > e or bool(uniq.isnan().any()):
        return _top_units_lazy(lambda cols: gain_fn(key, cols), length, r)
    cols = min(length, 16)
    while True:
        g = gain_fn(uniq, cols)
        if bool(g.isnan().any()):
            return _top_units_lazy(lambda cols: gain_fn(key, cols), length, r)
        counts = _top_units_grouped(g, inv, mult, r)
        if cols >= length or not bool((counts >= cols).any()):
            return counts
        cols = min(length, 2 * cols)


def _spread(amount: int, mask: Tensor, room: Tensor) -> Tensor:
    """The codes' uniform split of ``amount`` over ``mask`` (``amount // k`` each, the first ``amount % k`` in
    order one more), each capped by ``room``; int64 ``[P]`` (0 outside ``mask``). One pass, as in the codes."""
    k = int(mask.sum())
    out = torch.zeros(mask.shape, dtype=torch.long)
    if k == 0 or amount <= 0:
        return out
    rank = torch.cumsum(mask.long(), 0) - 1
    give = amount // k + (rank < amount % k).long()
    return torch.where(mask, torch.minimum(give, room), out)


def _short(budget: int, p: int, n_min: int, n_max: int) -> Tensor:
    """A budget below ``p * n_min``: the first ``budget // n_min`` prompts get ``n_min``, the rest of the budget is
    spread one by one over them (capped at ``n_max``). Every non-zero count is in ``[n_min, n_max]``."""
    k = min(p, budget // n_min)
    counts = torch.zeros(p, dtype=torch.long)
    counts[:k] = n_min
    chosen = torch.arange(p) < k
    return counts + _spread(budget - k * n_min, chosen, torch.full((p,), n_max - n_min, dtype=torch.long))


def _uniform(budget: int, p: int, n_min: int, n_max: int) -> Tensor:
    """The codes' uniform split (``budget // p`` each, the first ``budget % p`` one more), capped at ``n_max``;
    below ``n_min`` per prompt, :func:`_short`."""
    if p == 0:
        return torch.zeros(0, dtype=torch.long)
    if budget < p * n_min:
        return _short(budget, p, n_min, n_max)
    return _spread(budget, torch.ones(p, dtype=torch.bool), torch.full((p,), n_max, dtype=torch.long))


class _OneShot(Conversation):
    """One request with precomputed counts; reasons fixed at plan time; every rollout kept (weight 1)."""

    def __init__(
        self, prompt_ids: Tensor, budget: int, counts: Tensor, reasons: Tensor, names: tuple[str, ...]
    ) -> None:
        super().__init__(prompt_ids, budget)
        self.counts = counts
        self._reasons = reasons
        self.reason_names = names
        self._sent = False

    def decide(self) -> Request | None:
        if self._sent:
            return None
        self._sent = True
        keep = self.counts > 0
        if not bool(keep.any()):
            return None
        return self.request(keep, self.counts[keep])

    def select(self) -> tuple[FloatB, IntP]:
        return torch.ones(self.spent_observed, dtype=torch.float64), self._reasons


def _unsort(values: Tensor, order: Tensor) -> Tensor:
    out = torch.empty_like(values)
    out[order] = values
    return out


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


class CoBA:
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
        capacity: prompts kept in the history (bounded memory; least recently seen evicted).

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
        capacity: int = 1_000_000,
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
        self.history = PromptHistory.from_preset("exact", window=self.window, capacity=_int(capacity, "capacity", 1))
        self.alpha = self.beta_params_sum - 2.0
        self.beta = 2.0
        self._rates = torch.zeros(0, dtype=_F64)  # per-step average success rates, oldest first (<= window)
        self._step = 0

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
    def plan(self, prompt_ids: IntP, budget: int) -> Conversation:
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
            self.alpha, self.beta = coba_beta_params(
                min(max(1.0 - float(self._rates.mean()), 0.0), 1.0), self.beta_params_sum
            )
        self.history.update_from_result(result, step=self._step)
        self._step += 1

    def state_dict(self) -> dict[str, Any]:
        """The history, the global window, the Beta shape and the step counter (copies)."""
        return {
            "history": self.history.state_dict(),
            "rates": self._rates.clone(),
            "alpha": self.alpha,
            "beta": self.beta,
            "step": self._step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        keys = {"history", "rates", "alpha", "beta", "step"}
        check_state(state, keys, "CoBA")
        self.history.load_state_dict(state["history"])
        self._rates = state["rates"].clone().to(_F64)
        self.alpha, self.beta = float(state["alpha"]), float(state["beta"])
        self._step = int(state["step"])


# -- Knapsack-RL --------------------------------------------------------------------------------------------------
def knapsack_value(n: Real[Tensor, " ..."], p: FloatAny) -> FloatAny:
    r"""Knapsack-RL's value of ``N`` rollouts at success rate ``p``: :math:`(1 - p^N - (1 - p)^N)\,p(1 - p)^2`.

    The first factor is the chance that the group is not all one outcome, :math:`p(1-p)^2` the information
    term. Reference: arXiv 2509.25849, ``solve_by_dp`` (``docs/methods/budget.md``). Oracle (by hand):
    ``V(2, 0.5) = 0.0625``, ``V(4, 0.5) = 0.109375``. Float64; broadcasts ``n`` and ``p``.
    """
    pp, nn = p.to(_F64), n.to(_F64)
    return (1.0 - pp**nn - (1.0 - pp) ** nn) * pp * (1.0 - pp) ** 2


class Knapsack:
    r"""Knapsack-RL: per-prompt rollout counts maximising :math:`\sum_i V(N_i, p_i)` under the step's budget.

    **Per-prompt estimate** (the code's ``update_sample_state`` with its defaults ``epoch_estimation`` and
    ``robust_epoch_estimation``): a reward ``>= success_threshold`` succeeds. After each group, ``p`` is the group's
    success rate when the group has at least ``reward_window`` (16) rollouts, else the success rate of the last
    ``reward_window`` rewards of the prompt (this group's and, newest first, the older groups'; all of them while
    fewer exist). A prompt is *valid* once it has ``min_rewards`` (8) rewards in total; until then it is treated as
    never seen (base ``n``, reason ``"unseen"``, :math:`p = 0` for the surplus). ``reward_window=1,
    min_rewards=1`` gives the last group's rate from the first group on (the rule before the code was read; the
    code's own settings allow it). Base allocation: ``n_min`` for :math:`0 < p < 1` (an *effective* item),
    ``negative_n`` for :math:`p = 0`, ``positive_n`` for :math:`p = 1`, ``n`` for a prompt that is not valid.
    Then, with the leftover ``B``:

    - no effective item: ``B`` is split uniformly over the :math:`p = 0` prompts (else over all prompts);
    - else (``allow_fallback``): the effective items' estimated need
      :math:`\sum_i \lfloor \min(n_{max}, c_i) \rfloor`, :math:`c_i = \ln(1 - a) / \ln \max(p_i, 1 - p_i)`
      (``cost="probability"``, rollouts for a non-zero gradient with probability ``a``) or
      :math:`1 / (p_i(1 - p_i)) - 1` (``"expectation"``); if it is below ``B`` the surplus is split uniformly
      over the :math:`p = 0` prompts (else over the non-effective ones) and ``B`` shrinks to the need;
    - the DP: :math:`k_i \in [0, n_{max} - n_{min}]` extra units per effective item, :math:`\sum k_i = B` (or
      as much as fits), maximising :math:`\sum_i f_i(k_i)` with :math:`f_i(k) = V(n_{min} + k, p_i)`.

    The DP's objective is separable and concave in :math:`k_i` (:math:`V` is concave in ``N``), so the DP's
    optimum is the greedy on marginal gains, vectorised exactly over prompts (:func:`_top_units`, ties by
    prompt id; the gains in the closed form
    :math:`p(1-p)^2 (p^N (1 - p) + (1 - p)^N p)`). Tested against a transcription of ``solve_by_dp``: equal
    objective and total (the DP breaks exact ties differently).

    **The code's quirk "the DP scores k = 0 as 0"** is **fixed** by
    default: ``no_extra="value"`` scores :math:`k = 0` as :math:`V(n_{min}, p)`, the knapsack of the paper.
    ``no_extra="zero"`` reproduces the code (:math:`f_i(0) = 0`), which biases the DP towards giving every
    effective item at least one extra rollout; it is still concave, so the same greedy solves it.

    Reference: arXiv 2509.25849; code ``liziniu/KnapsackRL@ca5d5f5b7e933378d916d05d1aeb4ae9de929ee5``
    (``verl/trainer/ppo/exploration_utils.py``: ``sampling_budget_by_knapsack``, ``solve_by_dp``;
    ``verl/utils/dataset/rl_dataset.py``: ``update_sample_state``; ``examples/knapsack_trainer/
    run_knapsack_grpo_7b.sh``); ``docs/methods/budget.md``.

    Reproduced code details: a prompt that is not valid counts as a :math:`p = 0` prompt for the surplus (the
    code's rate array holds 0 for it); ``min_rewards=0`` makes every prompt valid, a never-seen one with
    :math:`p = 0`, as the code's ``min_buffer_length=0``. Deliberate fixes: every count is capped at ``n_max``
    (the code's surplus splits and its spread of DP-infeasible budget have no cap); a budget below the base
    allocation (the code fails its assertion) gives ``n_min`` to the first ``budget // n_min`` prompts by id
    (reason ``"short_budget"``); no prompt for the surplus (the code divides by zero) keeps the surplus in the DP; the code's reset of every
    count to ``n`` when nothing is effective and no prompt has :math:`p = 0` (which fails its own assertion
    unless the budget is ``P n``) is a uniform split over all prompts. Float64 costs (the code's are float32).

    Budget: never more than the budget; all of it unless the caps bind (the surplus split is one capped pass,
    and the DP places at most ``n_max - n_min`` extra per effective item; the rest stays unused). Every rollout
    is kept (weight 1). Reasons: ``"effective"``, ``"unsolved"`` (p = 0), ``"solved"`` (p = 1), ``"unseen"``,
    ``"surplus"`` (a non-effective prompt that got surplus), ``"short_budget"``, ``"no_budget"``.

    Args:
        n: rollouts of a prompt that is not valid (never seen, or fewer than ``min_rewards`` rewards; the code's
            ``n``; the budget is ``P n`` by default there, here the plan's ``budget``). Default 8.
        n_min: ``min_n`` (code default 2).
        n_max: ``max_n``, the cap of every prompt (the code has no working default; its docstring says ``n``,
            which would leave no room to reallocate; default 128 here so the paper's 93 rollouts fit).
        alpha: ``a``, confidence of the probability cost (code 0.9).
        cost: ``"probability"`` (code default) or ``"expectation"``.
        negative_n, positive_n: base of ``p = 0`` / ``p = 1`` prompts (code: ``min_n``).
        allow_fallback: the surplus rule (code True).
        no_extra: ``"value"`` (fix, default) or ``"zero"`` (the code's quirk).
        success_threshold: a reward ``>=`` it is a success (default 1.0).
        reward_window: the code's ``reward_buffer_length`` (16): a group smaller than it is pooled with the
            prompt's previous rewards up to this many; >= 1.
        min_rewards: the code's ``min_buffer_length`` (8): rewards a prompt needs before its ``p`` is used; >= 0.
        capacity: prompts kept in the history (and in the reward store aligned with it).

    Edge cases: an empty batch or a zero budget requests nothing; ``update`` ignores prompts with no rollouts.
    """

    reference: ClassVar[str] = "arXiv 2509.25849 (Knapsack-RL); code liziniu/KnapsackRL"
    experimental: ClassVar[str | None] = None

    reason_names = ("effective", "unsolved", "solved", "unseen", "surplus", "short_budget", "no_budget")

    def __init__(
        self,
        *,
        n: int = 8,
        n_min: int = 2,
        n_max: int = 128,
        alpha: float = 0.9,
        cost: Literal["probability", "expectation"] = "probability",
        negative_n: int | None = None,
        positive_n: int | None = None,
        allow_fallback: bool = True,
        no_extra: Literal["value", "zero"] = "value",
        success_threshold: float = 1.0,
        reward_window: int = 16,
        min_rewards: int = 8,
        capacity: int = 1_000_000,
    ) -> None:
        self.n_min = _int(n_min, "n_min", 1)
        self.n_max = _int(n_max, "n_max", 1)
        if self.n_max < self.n_min:
            raise InputError("n_max", f"n_max >= n_min = {n_min}", repr(n_max), "raise n_max or lower n_min")
        self.n = _int(n, "n", 1)
        if not self.n_min <= self.n <= self.n_max:
            raise InputError("n", f"n_min <= n <= n_max = {self.n_max}", repr(n), "pass n within the caps")
        self.alpha = _float(alpha, "alpha", 0.0, 1.0, open_low=True, open_high=True)
        if cost not in ("probability", "expectation"):
            raise InputError("cost", "'probability' or 'expectation'", repr(cost), "pick one of them")
        self.cost = cost
        self.negative_n = self.n_min if negative_n is None else _int(negative_n, "negative_n", self.n_min)
        self.positive_n = self.n_min if positive_n is None else _int(positive_n, "positive_n", self.n_min)
        for name, v in (("negative_n", self.negative_n), ("positive_n", self.positive_n)):
            if v > self.n_max:
                raise InputError(name, f"<= n_max = {self.n_max}", repr(v), f"lower {name}")
        if not isinstance(allow_fallback, bool):
            raise InputError("allow_fallback", "a bool", describe(allow_fallback), "pass True or False")
        self.allow_fallback = allow_fallback
        if no_extra not in ("value", "zero"):
            raise InputError("no_extra", "'value' (fix) or 'zero' (the code)", repr(no_extra), "pick one of them")
        self.no_extra = no_extra
        st = _float(success_threshold, "success_threshold", -1e300, 1e300)
        self.history = PromptHistory(window=1, success_threshold=st, capacity=_int(capacity, "capacity", 1))
        self.reward_window = _int(reward_window, "reward_window", 1)
        self.min_rewards = _int(min_rewards, "min_rewards", 0)
        self._step = 0
        # the reward store, aligned with the history's sorted ids: the last reward_window successes (newest first),
        # how many of them are filled, the total rewards seen and the estimate p of the last update
        self._rewards = _empty_rewards(self.reward_window)

    def gains(self, p: FloatP, cols: int | None = None) -> Float[Tensor, "P cols"]:
        """Marginal gains ``[E, cols]`` of the effective items (column ``k``: the ``(k+1)``-th extra unit; ``cols``
        defaults to ``n_max - n_min``)."""
        pp = p.to(_F64)[:, None]
        q = 1.0 - pp
        cols = self.n_max - self.n_min if cols is None else cols
        levels = torch.arange(self.n_min, self.n_min + cols, dtype=_F64)[None, :]
        c = pp * q * q
        g = c * (torch.exp(levels * torch.log(pp)) * q + torch.exp(levels * torch.log(q)) * pp)
        if self.no_extra == "zero" and g.shape[1] > 0:
            g[:, 0] = knapsack_value(torch.tensor(self.n_min + 1), p.to(_F64))
        return g

    def _costs(self, p: Tensor) -> Tensor:
        if self.cost == "probability":
            return math.log(1.0 - self.alpha) / torch.log(torch.maximum(p, 1.0 - p))
        return 1.0 / (p * (1.0 - p)) - 1.0

    def estimates(self, prompt_ids: IntP) -> tuple[Bool[Tensor, " P"], FloatP]:
        """``(valid, p)`` per prompt ``[P]``: valid once ``min_rewards`` rewards were seen; ``p`` the code's estimate
        (0 where not valid; see the class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        store = self._rewards
        if store["prompt_ids"].numel() == 0:
            total = torch.zeros(ids.shape, dtype=torch.long)
            rate = torch.zeros(ids.shape, dtype=_F64)
        else:
            pos, found = _lookup(store["prompt_ids"], ids)
            total = torch.where(found, store["total"][pos], 0)
            rate = torch.where(found, store["rate"][pos], 0.0)
        valid = total >= self.min_rewards
        return valid, torch.where(valid, rate, 0.0)

    def _allocate(self, ids: Tensor, budget: int) -> tuple[Tensor, Tensor]:
        m = ids.numel()
        seen, p = self.estimates(ids)
        eff = seen & (p > 0) & (p < 1)
        zero = seen & (p == 0)
        one = seen & (p == 1)
        reasons = torch.where(eff, 0, torch.where(zero, 1, torch.where(one, 2, 3)))
        base = torch.where(
            eff, self.n_min, torch.where(zero, self.negative_n, torch.where(one, self.positive_n, self.n))
        )
        rem = budget - int(base.sum())
        if rem < 0:
            counts = _short(budget, m, self.n_min, self.n_max)
            return counts, torch.where(counts > 0, 5, 6)
        counts = base.clone()
        zeroish = ~seen | zero  # the code's rate array holds 0 for prompts that are not valid
        if rem > 0 and not bool(eff.any()):
            target = zeroish if bool(zeroish.any()) else torch.ones(m, dtype=torch.bool)
            give = _spread(rem, target, self.n_max - counts)
            return counts + give, torch.where(give > 0, 4, reasons)
        surplus_to = torch.zeros(m, dtype=torch.bool)
        if rem > 0 and self.allow_fallback:
            need = int(torch.floor(torch.clamp(self._costs(p[eff]), max=float(self.n_max))).sum())
            if need < rem:
                cand = zeroish if bool(zeroish.any()) else ~eff
                if bool(cand.any()):
                    give = _spread(rem - need, cand, self.n_max - counts)
                    counts = counts + give
                    surplus_to = give > 0
                    rem -= int(give.sum())
        pe = p[eff]
        if self.no_extra == "zero":
            # column 0 then holds knapsack_value, whose torch.pow is not elementwise-reproducible (vectorised and
            # scalar paths can differ in the last bit, by position): keep the table of every item, as before
            extra = _top_units_lazy(lambda cols: self.gains(pe, cols), self.n_max - self.n_min, rem)
        else:
            extra = _top_units_by_key(pe, self.gains, self.n_max - self.n_min, rem)
        counts[eff] += extra
        return counts, torch.where(surplus_to, 4, reasons)

    def plan(self, prompt_ids: IntP, budget: int) -> Conversation:
        """One request: the Knapsack-RL counts of ``prompt_ids`` under ``budget`` rollouts (class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        sorted_ids, order = _sort_ids(ids)
        counts, reasons = self._allocate(sorted_ids, budget)
        reasons = torch.where(counts > 0, reasons, 6)
        return _OneShot(ids, budget, _unsort(counts, order), _unsort(reasons, order), self.reason_names)

    def update(self, result: AllocationResult) -> None:
        """Record each rolled-out prompt's group: the history, then the last ``reward_window`` successes, the total
        and the estimate ``p`` of each prompt (the code's ``update_sample_state``, once per prompt and step)."""
        result = _check_result(result)
        self.history.update_from_result(result, step=self._step)
        self._step += 1
        ids = self.history.prompt_ids  # sorted; the prompts of this result are never evicted
        old = self._rewards
        width = self.reward_window
        if old["prompt_ids"].numel():
            pos, found = _lookup(old["prompt_ids"], ids)
            keep = found.view(-1, 1)
            store = {
                key: torch.where(keep if v.ndim == 2 else found, v[pos], torch.zeros((), dtype=v.dtype))
                for key, v in old.items()
            }
        else:
            store = _empty_rewards(width, ids.numel())
        store["prompt_ids"] = ids
        if result.rewards.numel():
            p = result.plan_prompt_ids.numel()
            n = torch.bincount(result.group, minlength=p)
            played = (n > 0).nonzero().squeeze(1)
            slot = torch.full((p,), -1, dtype=torch.long)
            slot[played] = torch.arange(played.numel())
            success = self.history._success(result.rewards.detach().cpu().to(_F64))
            gs = slot[result.group]
            gs_sorted, perm = torch.sort(gs, stable=True)  # rollouts by group, in observation order within one
            ng = n[played]
            starts = torch.cumsum(ng, 0) - ng
            newest_first = ng[gs_sorted] - 1 - (torch.arange(gs.numel()) - starts[gs_sorted])
            fresh = torch.zeros(played.numel(), width, dtype=torch.bool)
            fits = newest_first < width
            fresh[gs_sorted[fits], newest_first[fits]] = success[perm][fits]
            rows = _lookup(ids, result.plan_prompt_ids[played])[0]
            col = torch.arange(width)[None, :]
            shift = col - ng[:, None]
            tail = torch.where(shift >= 0, store["tail"][rows].gather(1, shift.clamp(min=0)), fresh)
            filled = torch.clamp(store["filled"][rows] + ng, max=width)
            pooled = (tail & (col < filled[:, None])).sum(1).to(_F64) / filled.to(_F64)
            own = torch.zeros(played.numel(), dtype=_F64).index_add_(0, gs, success.to(_F64)) / ng.to(_F64)
            store["tail"][rows] = tail
            store["filled"][rows] = filled
            store["total"][rows] += ng
            store["rate"][rows] = torch.where(ng >= width, own, pooled)
        self._rewards = store

    def state_dict(self) -> dict[str, Any]:
        """The history, the reward store (``rewards``: ``prompt_ids [N]``, ``tail [N, reward_window]`` bool,
        ``filled``, ``total`` ``[N]`` int64, ``rate [N]`` float64) and the step counter (copies)."""
        return {
            "history": self.history.state_dict(),
            "rewards": {key: v.clone() for key, v in self._rewards.items()},
            "step": self._step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (validated; a bad ``rewards`` field raises an InputError naming it)."""
        check_state(state, {"history", "rewards", "step"}, "Knapsack")
        rewards = state["rewards"]
        fields = set(_empty_rewards(1))
        if not isinstance(rewards, dict) or set(rewards) != fields:
            raise InputError(
                "state['rewards']", f"a dict with keys {sorted(fields)}", describe(rewards), "pass state_dict()"
            )
        for key in sorted(fields):
            if not isinstance(rewards[key], Tensor):
                raise InputError(f"state['rewards']['{key}']", "a tensor", describe(rewards[key]), "pass state_dict()")
        size = rewards["prompt_ids"].numel()
        shapes = {"prompt_ids": (size,), "tail": (size, self.reward_window), "filled": (size,), "total": (size,)}
        shapes["rate"] = (size,)
        for key, shape in shapes.items():
            if tuple(rewards[key].shape) != shape:
                raise InputError(
                    f"state['rewards']['{key}']",
                    f"shape {shape} (reward_window={self.reward_window})",
                    describe(rewards[key]),
                    "pass the state_dict() of a Knapsack with this reward_window",
                )
        filled = rewards["filled"]
        if bool(((filled < 0) | (filled > self.reward_window) | (rewards["total"] < filled)).any()):
            raise InputError(
                "state['rewards']['filled']", f"counts in 0..{self.reward_window}, <= total", "other", "pass state"
            )
        history = PromptHistory(
            window=1, success_threshold=self.history.success_threshold, capacity=self.history.capacity
        )
        history.load_state_dict(state["history"])
        if not torch.equal(history.prompt_ids, rewards["prompt_ids"].long().cpu()):
            raise InputError(
                "state['rewards']['prompt_ids']", "the history's prompt ids", "other ids", "pass state_dict()"
            )
        self.history = history
        self._rewards = {
            "prompt_ids": rewards["prompt_ids"].long().cpu().clone(),
            "tail": rewards["tail"].cpu().bool().clone(),
            "filled": rewards["filled"].cpu().long().clone(),
            "total": rewards["total"].cpu().long().clone(),
            "rate": rewards["rate"].cpu().to(_F64).clone(),
        }
        self._step = int(state["step"])


def _empty_rewards(width: int, size: int = 0) -> dict[str, Tensor]:
    return {
        "prompt_ids": torch.zeros(size, dtype=torch.long),
        "tail": torch.zeros(size, width, dtype=torch.bool),
        "filled": torch.zeros(size, dtype=torch.long),
        "total": torch.zeros(size, dtype=torch.long),
        "rate": torch.zeros(size, dtype=_F64),
    }
