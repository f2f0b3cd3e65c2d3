"""Knapsack-RL's history-based per-prompt budget (:class:`Knapsack`, :func:`knapsack_value`).

Keeps each prompt's recent successes in its columns of a :class:`~rolloutopt.allocators.PromptTable` and gives
every prompt of the batch its own number of rollouts, in one request, before any rollout of the step.
Knapsack-RL, arXiv 2509.25849, code ``liziniu/KnapsackRL`` (read at ``ca5d5f5b7e933378d916d05d1aeb4ae9de929ee5``):
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
from rolloutopt.allocators._ids import _by_group, _sort_ids
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
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


def _row_counts(t: Tensor) -> Tensor:
    """The number of True per row of a bool matrix ``[k, W]`` (int64 ``[k]``).

    ``t.sum(1)`` widens every element to int64 first; for ``W % 8 == 0`` the bytes of each 8-wide chunk, each 0 or
    1, are added inside one int64 word instead (the chunk's value is below ``2**57``: no sign, no overflow, and
    each partial byte sum stays below 256)."""
    if t.shape[1] % 8 or not t.is_contiguous() or t.storage_offset() % 8:
        return t.sum(1)
    x = t.view(torch.int64)  # [k, W / 8]
    x = x + (x >> 32)
    x = x + (x >> 16)
    x = x + (x >> 8)
    return (x & 0xFF).sum(1)


class Knapsack(TableOwner):
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
        capacity: prompts kept in a private table (default None: 1,000,000; the least recently updated are
            evicted first and are then never seen again).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); Knapsack
            registers its reward store as owner ``"knapsack"``: ``tail`` (the last ``reward_window`` successes,
            newest first), ``filled`` (how many of them are filled), ``total`` (rewards seen) and ``rate`` (the
            estimate ``p`` of the last update); the caller saves a shared table once.

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
        capacity: int | None = None,
        table: PromptTable | None = None,
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
        self.success_threshold = _float(success_threshold, "success_threshold", -1e300, 1e300)
        self.reward_window = _int(reward_window, "reward_window", 1)
        self.min_rewards = _int(min_rewards, "min_rewards", 0)
        self._step = 0
        # the reward store: the last reward_window successes (newest first), how many of them are filled, the total
        # rewards seen and the estimate p of the last update. The fills (nothing filled, total 0, p = 0) are a
        # never-seen prompt's, so a row this owner has not seen needs no seen mask
        self._cols = open_table(
            table,
            capacity,
            "knapsack",
            {
                "tail": Column("bool", (self.reward_window,), False),
                "filled": Column("int", checks=("nonneg",)),  # <= reward_window and <= total: load_state_dict
                "total": Column("int", checks=("nonneg",)),
                "rate": Column("float", fill=0.0, checks=("prob",)),
            },
        )

    STATE: ClassVar[dict[str, Field]] = {"table": TableColumns.FIELD, "step": Field("integer", low=0)}
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`; the table validates the
    reward store's columns, its window width included)."""

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
        if self._cols.empty:
            total = torch.zeros(ids.shape, dtype=torch.long)
            rate = torch.zeros(ids.shape, dtype=_F64)
        else:
            # a stored row this owner has not seen holds the fills (total 0, p = 0): only its existence matters
            t_ids = self._cols.table.prompt_ids
            pos = torch.searchsorted(t_ids, ids).clamp_(max=t_ids.numel() - 1)
            found = t_ids.index_select(0, pos) == ids
            total = torch.where(found, self._cols["total"].index_select(0, pos), 0)
            rate = torch.where(found, self._cols["rate"].index_select(0, pos), 0.0)
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

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """One request: the Knapsack-RL counts of ``prompt_ids`` under ``budget`` rollouts (class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        sorted_ids, order = _sort_ids(ids)
        counts, reasons = self._allocate(sorted_ids, budget)
        reasons = torch.where(counts > 0, reasons, 6)
        return _OneShot(ids, budget, _unsort(counts, order), _unsort(reasons, order), self.reason_names)

    def update(self, result: AllocationResult) -> None:
        """Record each rolled-out prompt's group: the last ``reward_window`` successes, the total and the estimate
        ``p`` of each prompt (the code's ``update_sample_state``, once per prompt and step)."""
        result = _check_result(result)
        if not result.rewards.numel():
            self._step += 1
            return
        width = self.reward_window
        p = result.plan_prompt_ids.numel()
        group = result.group.long()
        n = torch.bincount(group, minlength=p)
        played = (n > 0).nonzero().squeeze(1)
        k, m = played.numel(), group.numel()
        success = result.rewards.detach().cpu().to(_F64) >= self.success_threshold
        # the rollouts by plan position (observation order within a group): the played prompts' groups follow one
        # another in increasing position, group j ending (exclusive) at end[j]; the i-th rollout of that order is
        # the (end[j] - 1 - i)-th newest of its group j
        g_sorted, perm = _by_group(group)
        ordered = success if perm is None else success.index_select(0, perm)
        ng = n.index_select(0, played)
        take = ng.clamp(max=width)  # the group's rollouts that enter the window: its newest
        end = torch.cumsum(ng, 0)
        step = torch.arange(m)
        # new rows: nothing filled, total 0 (every planned prompt played: its ids as they are, their sort is known)
        pos, order = self._cols.add(result.plan_prompt_ids if k == p else result.plan_prompt_ids[played])
        rows = torch.empty_like(pos).scatter_(0, order, pos)  # the row of each played prompt
        self._step += 1
        tail_col, filled_col = self._cols["tail"], self._cols["filled"]
        # buf row j: columns width - take[j] .. width - 1 hold group j's newest successes, newest first, columns
        # width .. 2 width - 1 the prompt's old window (newest first), so that its new window is the slice
        # buf[j, width - take[j] : 2 width - take[j]]; the last element takes the rollouts that do not enter
        w2 = 2 * width
        start = torch.arange(k) * w2 + width - take
        at = torch.empty(p, dtype=torch.long).index_copy_(0, played, start + end - 1)
        dest = at.index_select(0, g_sorted).sub_(step)
        big = (ng > width).nonzero().squeeze(1)  # groups larger than the window: only their newest width count
        if big.numel():
            # their older rollouts (the first ng - width of each, in the order above) go to the spare element
            cut = ng.index_select(0, big) - width
            total_cut = int(cut.sum())
            off = torch.cumsum(cut, 0) - cut
            older = torch.repeat_interleave(
                end.index_select(0, big) - ng.index_select(0, big) - off, cut, output_size=total_cut
            )
            older.add_(torch.arange(total_cut))
            dest.index_fill_(0, older, k * w2)
        buf = torch.zeros(k * w2 + 1, dtype=torch.bool).scatter_(0, dest, ordered)
        grid = buf[:-1].view(k, w2)
        grid[:, width:] = tail_col.index_select(0, rows)
        tail = grid.unfold(1, width, 1)[torch.arange(k), width - take]  # [k, width]
        filled = torch.clamp(filled_col.index_select(0, rows) + ng, max=width)
        # a window holds no success beyond its filled slots (new rows are empty, a loaded state is checked, and
        # each update keeps it so): the count of the filled ones is the row's
        hits = _row_counts(tail)
        # a group of at least width rollouts has its own rate (of exactly width: the pooled one, the same number)
        rate = hits.to(_F64) / filled.to(_F64)
        if big.numel():  # its successes: those in the window plus the older ones
            seg = torch.repeat_interleave(torch.arange(big.numel()), cut, output_size=total_cut)
            older_hits = torch.zeros(big.numel(), dtype=torch.long).index_add_(
                0, seg, ordered.index_select(0, older).long()
            )
            own = (hits.index_select(0, big) + older_hits).to(_F64) / ng.index_select(0, big).to(_F64)
            rate.index_copy_(0, big, own)
        tail_col.index_copy_(0, rows, tail)
        filled_col.index_copy_(0, rows, filled)
        self._cols["total"].index_add_(0, rows, ng)
        self._cols["rate"].index_copy_(0, rows, rate)

    def state_dict(self) -> dict[str, Any]:
        """The table (the reward store: ``tail [M, reward_window]`` bool, ``filled``, ``total`` ``[M]`` int64,
        ``rate [M]`` float64; the rows only when the table is private) and the step counter (copies)."""
        return dump_state({"table": self._cols.state(), "step": self._step})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "Knapsack")
        cols, at = self._cols.incoming(s["table"])
        filled, fix = cols["filled"], "pass the state_dict() of a Knapsack with this reward_window"
        if bool(((filled > self.reward_window) | (cols["total"] < filled)).any()):
            raise InputError(
                f"{at}[{self._cols.owner + '/filled'!r}]",
                f"counts in 0..{self.reward_window} (reward_window), <= total",
                "other counts",
                fix,
            )
        if filled.numel() and bool((cols["tail"] & (torch.arange(self.reward_window) >= filled[:, None])).any()):
            raise InputError(
                f"{at}[{self._cols.owner + '/tail'!r}]", "no success beyond a window's filled slots", "some", fix
            )
        self._cols.load(s["table"])
        self._step = s["step"]
