"""Knapsack-RL's history-based per-prompt budget (:class:`Knapsack`, :func:`knapsack_value`).

Reads each prompt's past success rate from a :class:`~rolloutopt.allocators.PromptHistory` and gives every prompt
of the batch its own number of rollouts, in one request, before any rollout of the step. Knapsack-RL, arXiv
2509.25849, code ``liziniu/KnapsackRL`` (read at ``ca5d5f5b7e933378d916d05d1aeb4ae9de929ee5``):
``verl/trainer/ppo/exploration_utils.py`` (``sampling_budget_by_knapsack``, ``solve_by_dp``) and the per-prompt
estimate of ``verl/utils/dataset/rl_dataset.py`` (``update_sample_state``, ``get_sample_state``). See
``docs/methods/budget.md``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Bool, Float, Real
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import check_real as _float
from rolloutopt._validation import describe
from rolloutopt.allocators._base import AllocationResult, Conversation, as_prompt_ids, check_budget
from rolloutopt.allocators._budget import _F64, _OneShot, _short, _spread, _top_units_by_key, _top_units_lazy, _unsort
from rolloutopt.allocators._ids import _by_group, _lookup, _sort_ids
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators.history import PromptHistory
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatP, IntP

__all__ = ["Knapsack", "knapsack_value"]


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
        self.STATE = {
            "history": Field("nested", fields=self.history.STATE),
            # aligned with the history's prompts (M); filled <= reward_window and <= total, checked after load_state
            "rewards": Field(
                "nested",
                fields={
                    "prompt_ids": Field("int", ("M",), ("ids",)),
                    "tail": Field("bool", ("M", self.reward_window)),
                    "filled": Field("int", ("M",), ("nonneg",)),
                    "total": Field("int", ("M",), ("nonneg",)),
                    "rate": Field("float", ("M",), ("prob",)),
                },
            ),
            "step": Field("integer", low=0),
        }

    STATE: dict[str, Field]
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`; built per instance: the
    reward store's width is ``reward_window``)."""

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
        if torch.equal(old["prompt_ids"], ids):  # no prompt entered or left the history: update in place
            store = old
        elif old["prompt_ids"].numel():
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
            gs_sorted, perm = _by_group(gs)  # rollouts by group, in observation order within one
            ordered = success if perm is None else success[perm]
            ng = n[played]
            starts = torch.cumsum(ng, 0) - ng
            newest_first = ng[gs_sorted] - 1 - (torch.arange(gs.numel()) - starts[gs_sorted])
            fresh = torch.zeros(played.numel() * width, dtype=torch.bool)
            fits = newest_first < width
            flat = gs_sorted * width + newest_first
            if bool(fits.all()):  # every group no larger than the window (the usual case): no compaction
                fresh[flat] = ordered
            else:
                fresh[flat[fits]] = ordered[fits]
            fresh = fresh.view(played.numel(), width)
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
        return dump_state(
            {
                "history": self.history.state_dict(),
                "rewards": {key: v.clone() for key, v in self._rewards.items()},
                "step": self._step,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "Knapsack")
        rewards = s["rewards"]
        filled = rewards["filled"]
        if bool(((filled > self.reward_window) | (rewards["total"] < filled)).any()):
            raise InputError(
                "state['rewards']['filled']", f"counts in 0..{self.reward_window}, <= total", "other", "pass state"
            )
        self.history._check_loaded(s["history"], "state['history']")
        if not torch.equal(s["history"]["prompt_ids"], rewards["prompt_ids"]):
            raise InputError(
                "state['rewards']['prompt_ids']", "the history's prompt ids", "other ids", "pass state_dict()"
            )
        self.history._assign(s["history"])
        self._rewards = rewards
        self._step = s["step"]


def _empty_rewards(width: int, size: int = 0) -> dict[str, Tensor]:
    return {
        "prompt_ids": torch.zeros(size, dtype=torch.long),
        "tail": torch.zeros(size, width, dtype=torch.bool),
        "filled": torch.zeros(size, dtype=torch.long),
        "total": torch.zeros(size, dtype=torch.long),
        "rate": torch.zeros(size, dtype=_F64),
    }
