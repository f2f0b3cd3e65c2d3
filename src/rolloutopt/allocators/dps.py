"""DPS — Dynamics-Predictive Sampling: a per-prompt hidden Markov model picks prompts before rollout.

Reference: "Dynamics-Predictive Sampling", arXiv 2603.10887 (ICLR 2026); code ``maoyixiu/DPS``,
``recipe/dps/task_sampler.py`` (``BayesianHMMSampler``); ``docs/methods/dps.md``.

Each prompt's *solving state* is one of three: S1 unsolved (group success 0), S2 partially solved
(0 < success < 1), S3 solved (success 1). A prompt carries Dirichlet pseudo-counts ``alpha`` of its 3x3
transition matrix and a predictive distribution ``pi`` of its state at the next visit; observations are
deterministic (the success rate names the state), so filtering is exact. Before rollout the prompts with the
highest predicted probability of S2 — the only state whose group has a non-zero GRPO advantage — are picked.

The state of every prompt planned (at most ``capacity`` of them) lives in the columns of a bounded
:class:`~rolloutopt.allocators.table.PromptTable` (``alpha [K, 3, 3]``, ``pi [K, 3]``, ... aligned with sorted
int64 ids), looked up with ``torch.searchsorted``: no Python loop over prompts.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import describe
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    OneShotPlan,
    _check_float,
    _check_int,
    _fill,
    _group_sizes,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import IntP

__all__ = ["DPS"]

# Named Dirichlet priors of the code (``task_sampler.py``); entry [j, i] is the pseudo-count of i -> j.
_NAMED_ALPHA: dict[str, list[list[float]]] = {
    "progress": [[1.0, 0.5, 0.5], [1.0, 1.0, 0.5], [1.0, 1.0, 1.0]],
    "stability": [[1.0, 0.5, 0.5], [0.5, 1.0, 0.5], [0.5, 0.5, 1.0]],
    "local": [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]],
}
_NAMED_PI: dict[str, list[float]] = {
    "uniform": [1 / 3, 1 / 3, 1 / 3],
    "1": [1.0, 0.0, 0.0],
    "2": [0.0, 1.0, 0.0],
    "3": [0.0, 0.0, 1.0],
}


# -- helpers shared with rolloutopt.allocators.greso and .e3 (private) -----------------------------------------
def _sum3(x: Tensor, dim: int) -> Tensor:
    """Sum over an axis of size 3, written out (torch's reduction over a tiny axis is several times slower)."""
    return x.select(dim, 0) + x.select(dim, 1) + x.select(dim, 2)


def _group_stats(result: AllocationResult, success_threshold: float | None) -> tuple[Tensor, Tensor]:
    """Per planned prompt: rollouts it got (int64 ``[P]``) and its group mean of the (binarised) reward."""
    r = result.rewards.double()
    values = r if success_threshold is None else (r >= success_threshold).double()
    total = torch.bincount(result.group, weights=values, minlength=result.plan_prompt_ids.numel())
    return result.counts, total / result.counts.clamp(min=1)


# -- the plan ---------------------------------------------------------------------------------------------------
class _DPSPlan(OneShotPlan):
    reason_names = ("selected", "partial_group", "not_selected")

    def __init__(self, prompt_ids: Tensor, budget: int, counts: Tensor, reasons: Tensor, scores: Tensor) -> None:
        super().__init__(prompt_ids, budget, counts, reasons)
        self.scores = scores


class DPS(TableOwner):
    r"""Dynamics-Predictive Sampling: pick the prompts most likely to be *partially solved* at the next visit.

    Every prompt's solving state :math:`s \in \{S_1, S_2, S_3\}` (group success rate 0, in between, 1) is a
    hidden Markov chain with its own transition matrix under a Dirichlet prior, :math:`\alpha_{ji}` the
    pseudo-count of :math:`i \to j`. With :math:`P(\alpha)_{ji} = \alpha_{ji} / \sum_{j'} \alpha_{j'i}`:

    .. math::

        \text{predict:}\quad \pi \leftarrow \frac{P(\alpha)\,\pi_\text{new}}{\lVert P(\alpha)\,\pi_\text{new}
        \rVert_1}, \qquad
        C = \frac{\pi_\text{new}\,\pi_\text{before}^\top \odot P(\alpha)}
        {\mathbf 1^\top (\pi_\text{new}\,\pi_\text{before}^\top \odot P(\alpha))\mathbf 1},

    .. math::

        \alpha \leftarrow \lambda\,\alpha + (1 - \lambda)\,\alpha_0 + \eta\,C, \qquad
        \pi_\text{before} \leftarrow \pi_\text{new},

    applied in ``update`` to every prompt ever planned (the code's order: ``alpha`` first, then the
    prediction with the new ``alpha``). A prompt rolled out this step has
    :math:`\pi_\text{new} = \mathrm{onehot}(s)` and :math:`\eta = 1`; every other known prompt has
    :math:`\pi_\text{new} = \pi` (its current prediction) and :math:`\eta = 0`, so its counts decay towards
    the prior and its prediction keeps diffusing through the expected transition matrix. ``plan`` ranks the
    candidates by :math:`\pi[S_2]` (``strategy="topk"``), by :math:`\pi[S_2] + w H(\pi)` with
    :math:`H(\pi) = -\sum \pi \log(\pi + 10^{-10})` (``"topk+entropy"``), or at random (``"uniform"``), and
    gives the best ``budget // n`` of them ``n`` rollouts each, in one request.

    Reference: arXiv 2603.10887 (ICLR 2026); code ``maoyixiu/DPS`` ``recipe/dps/task_sampler.py``
    (``BayesianHMMSampler``), defaults from ``recipe/dps/config/our_trainer.yaml`` (``docs/methods/dps.md``).

    Code quirks, reproduced deliberately:

    - **Every known prompt decays every step** (O(#known) per ``update``, vectorised: a few milliseconds
      per 10^4 prompts). A lazy per-access decay would be faster but is not the code's filter when
      ``decay < 1`` (the prediction diffuses through a different matrix each step), so it is not offered.
    - **A prompt becomes known when it is planned**, not only when it is rolled out: the code registers every
      candidate of ``sample_batch`` and then decays it with the rest. ``update`` registers every
      ``result.plan_prompt_ids`` entry. A never-planned prompt carries the prior ``pi`` (with the uniform prior,
      :math:`\pi[S_2] = 1/3`, so fresh prompts compete with learned ones).

    Deliberate fixes: where the soft count :math:`C` has zero mass (a one-hot ``prior_pi`` off its support)
    the code divides 0 by 0 and writes NaN into ``alpha``; here :math:`C = 0` (no count). Ties in the score
    keep the order of ``prompt_ids`` (a stable sort; the code's ``np.argsort`` leaves it unspecified).

    Args:
        n: rollouts per selected prompt (the scripts' ``rollout.n = 8``).
        n_min: smallest group requested (default ``n``): budget left after the full groups, if at least
            ``n_min``, goes to the next-ranked prompt as a partial group (reason ``"partial_group"``).
        n_max: largest group (default ``n``): budget still left is spread over the selected prompts, best
            first, up to ``n_max`` each. The defaults give the code's fixed group size.
        strategy: ``"topk"`` (config default), ``"topk+entropy"`` or ``"uniform"``.
        entropy_weight: ``w`` of ``"topk+entropy"`` (config ``hmm_entropy_weight = 0``).
        prior_alpha: ``alpha_0``: a float (every entry; config ``hmm_prior_alpha = 1.0``), one of the code's
            named priors ``"progress"``, ``"stability"``, ``"local"``, or a ``[3, 3]`` tensor (entry ``[j, i]``
            is the pseudo-count of ``i -> j``; non-negative, every column sum positive).
        prior_pi: the prior state distribution of an unseen prompt: ``"uniform"`` (config), ``"1"``, ``"2"``,
            ``"3"`` (one-hot, the code's names), or a ``[3]`` tensor (non-negative, normalised here).
        decay: :math:`\lambda`, ``hmm_transition_decay_ratio``: config 1.0 (no decay); the scripts use 0.7
            (MATH, R1-Distill-1.5B) and 0.5 (Countdown).
        learning_rate: :math:`\eta` (code: 1.0).
        transitions: ``"learned"`` (the paper: Dirichlet counts learned online) or ``"fixed"``: ``alpha`` stays
            at ``prior_alpha`` (no counts, no decay) while the filter still runs — the predictive prior of a
            rolled-out prompt is then :math:`P(\alpha_0)\,\mathrm{onehot}(s)`.
        no_update: the code's ``hmm_no_update``: ``update`` does nothing at all and every prompt keeps the
            prior (the selection then only breaks ties).
        success_threshold: a rollout succeeds when its reward is ``>= success_threshold`` (the code binarises
            ``acc >= 1``, default 1.0); the group success rate names the state (0 -> S1, 1 -> S3, else S2).
            ``None`` uses the raw group mean reward (the code's ``metric="score"``).
        seed: seed of the generator behind ``strategy="uniform"``.
        capacity: prompts kept in a private table (default None: 1,000,000; least recently planned evicted, and
            an evicted prompt is then unknown again: it carries the prior).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); DPS registers
            ``alpha``, ``pi``, ``pi_before`` and ``sampled_times`` as owner ``"dps"`` (0 on rows it has not
            planned), and the caller saves a shared table once.

    Budget: one request; it spends ``n * min(P, budget // n)`` rollouts with the defaults (at most ``n - 1``
    stay unspent, or fewer than ``P`` groups exist), all of it when ``n_min``/``n_max`` allow. Every rollout
    is kept (weight 1). Reasons: ``"selected"``, ``"partial_group"``, ``"not_selected"``.

    Edge cases: an empty candidate pool or ``budget < n_min`` requests nothing. ``update`` ignores planned
    prompts that got no rollouts (beyond registering them). The state grows with the number of distinct
    prompts planned (the dataset), 23 numbers each, up to ``capacity`` prompts.
    """

    reference: ClassVar[str] = "arXiv 2603.10887 (DPS, Dynamics-Predictive Sampling); code maoyixiu/DPS"
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        n: int = 8,
        n_min: int | None = None,
        n_max: int | None = None,
        strategy: Literal["topk", "topk+entropy", "uniform"] = "topk",
        entropy_weight: float = 0.0,
        prior_alpha: float | str | Float[Tensor, "3 3"] = 1.0,
        prior_pi: str | Float[Tensor, " 3"] = "uniform",
        decay: float = 1.0,
        learning_rate: float = 1.0,
        transitions: Literal["learned", "fixed"] = "learned",
        no_update: bool = False,
        success_threshold: float | None = 1.0,
        seed: int = 0,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        self.n, self.n_min, self.n_max = _group_sizes(n, n_min, n_max)
        if strategy not in ("topk", "topk+entropy", "uniform"):
            raise InputError("strategy", "'topk', 'topk+entropy' or 'uniform'", repr(strategy), "pick one of them")
        self.strategy = strategy
        self.entropy_weight = _check_float(entropy_weight, "entropy_weight", -1e6, 1e6, "pass e.g. 0.0")
        self.prior_alpha = self._as_prior_alpha(prior_alpha)
        self.prior_pi = self._as_prior_pi(prior_pi)
        self.decay = _check_float(decay, "decay", 0.0, 1.0, "pass 1.0 (config), 0.7 or 0.5 (scripts)")
        self.learning_rate = _check_float(learning_rate, "learning_rate", 0.0, 1e6, "pass 1.0 (the code)")
        if transitions not in ("learned", "fixed"):
            raise InputError("transitions", "'learned' or 'fixed'", repr(transitions), "pick one of them")
        self.transitions = transitions
        if not isinstance(no_update, bool):
            raise InputError("no_update", "a bool", describe(no_update), "pass True or False")
        self.no_update = no_update
        if success_threshold is not None:
            success_threshold = _check_float(success_threshold, "success_threshold", -1e300, 1e300, "pass 1.0")
        self.success_threshold = success_threshold
        self.seed = _check_int(seed, "seed", 0, "pass a non-negative int")
        self._gen = torch.Generator().manual_seed(self.seed)
        # the fills (0) mark a row DPS has not planned: update writes the priors when it first registers one
        self._cols = open_table(
            table,
            capacity,
            "dps",
            {
                "alpha": Column("float", (3, 3), 0.0, ("nonneg",)),
                "pi": Column("float", (3,), 0.0, ("prob",)),
                "pi_before": Column("float", (3,), 0.0, ("prob",)),
                "sampled_times": Column("int", (), 0, ("nonneg",)),
            },
        )

    @staticmethod
    def _as_prior_alpha(value: Any) -> Tensor:
        if isinstance(value, str):
            if value not in _NAMED_ALPHA:
                raise InputError(
                    "prior_alpha",
                    f"a float, one of {sorted(_NAMED_ALPHA)} or a [3, 3] tensor",
                    repr(value),
                    "pass e.g. prior_alpha=1.0",
                )
            return torch.tensor(_NAMED_ALPHA[value], dtype=torch.float64)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            v = _check_float(value, "prior_alpha", 0.0, 1e300, "pass a positive float", open_low=True)
            return torch.full((3, 3), v, dtype=torch.float64)
        if not isinstance(value, Tensor) or value.shape != (3, 3) or not value.is_floating_point():
            raise InputError(
                "prior_alpha",
                "a float, a named prior or a float [3, 3] tensor",
                describe(value),
                "pass e.g. prior_alpha=1.0",
            )
        a = value.detach().cpu().to(torch.float64).clone()
        if not bool(torch.isfinite(a).all()) or bool((a < 0).any()) or bool((a.sum(0) <= 0).any()):
            raise InputError(
                "prior_alpha",
                "finite non-negative pseudo-counts, every column sum positive",
                f"{a.tolist()}",
                "fix the prior",
            )
        return a

    @staticmethod
    def _as_prior_pi(value: Any) -> Tensor:
        if isinstance(value, str):
            if value not in _NAMED_PI:
                raise InputError(
                    "prior_pi",
                    f"one of {sorted(_NAMED_PI)} or a [3] tensor",
                    repr(value),
                    "pass e.g. prior_pi='uniform'",
                )
            return torch.tensor(_NAMED_PI[value], dtype=torch.float64)
        if not isinstance(value, Tensor) or value.shape != (3,) or not value.is_floating_point():
            raise InputError(
                "prior_pi", "a named prior or a float [3] tensor", describe(value), "pass e.g. prior_pi='uniform'"
            )
        p = value.detach().cpu().to(torch.float64).clone()
        if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or float(p.sum()) <= 0:
            raise InputError(
                "prior_pi", "finite non-negative probabilities with a positive sum", f"{p.tolist()}", "fix the prior"
            )
        return p / p.sum()

    # -- reading the state ------------------------------------------------------------------------------------
    def predictive(self, prompt_ids: IntP) -> Float[Tensor, "P 3"]:
        """The predictive state distribution ``pi`` of each prompt, float64 ``[P, 3]`` (the prior if unknown)."""
        return self._predictive(as_prompt_ids(prompt_ids))

    def _predictive(self, ids: Tensor) -> Tensor:
        if self._cols.empty:
            return self.prior_pi.repeat(ids.numel(), 1)
        pos, seen = self._cols.find(ids)
        return torch.where(seen[:, None], self._cols["pi"][pos], self.prior_pi)

    def transition_counts(self, prompt_ids: IntP) -> Float[Tensor, "P 3 3"]:
        """The Dirichlet pseudo-counts ``alpha`` of each prompt, float64 ``[P, 3, 3]`` (the prior if unknown)."""
        ids = as_prompt_ids(prompt_ids)
        if self._cols.empty:
            return self.prior_alpha.repeat(ids.numel(), 1, 1)
        pos, seen = self._cols.find(ids)
        return torch.where(seen[:, None, None], self._cols["alpha"][pos], self.prior_alpha)

    def sampled_times(self, prompt_ids: IntP) -> IntP:
        """How many steps each prompt was rolled out in, int64 ``[P]`` (0 if unknown)."""
        ids = as_prompt_ids(prompt_ids)
        if self._cols.empty:
            return torch.zeros_like(ids)
        pos, seen = self._cols.find(ids)
        return torch.where(seen, self._cols["sampled_times"][pos], 0)

    @property
    def num_known(self) -> int:
        """Number of prompts with a stored state (planned, and not evicted since)."""
        return int(self._cols["seen"].sum())

    # -- the protocol -----------------------------------------------------------------------------------------
    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Rank the candidates ``prompt_ids`` by the predictive prior and give the best ones ``n`` rollouts."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        pi = self._predictive(ids)
        if self.strategy == "uniform":
            order = torch.randperm(p, generator=self._gen)
            scores = torch.zeros(p, dtype=torch.float64)
        else:
            scores = pi[:, 1].clone()
            if self.strategy == "topk+entropy":
                scores = scores - self.entropy_weight * (pi * torch.log(pi + 1e-10)).sum(-1)
            order = torch.sort(scores, descending=True, stable=True).indices
        ranked = _fill(p, budget, self.n, self.n_min, self.n_max)
        counts = torch.zeros(p, dtype=torch.long)
        counts[order] = ranked
        rank_reason = torch.full((p,), 2, dtype=torch.long)
        rank_reason[: min(p, budget // self.n)] = 0
        rank_reason[(ranked > 0) & (rank_reason == 2)] = 1
        reasons = torch.empty(p, dtype=torch.long)
        reasons[order] = rank_reason
        return _DPSPlan(ids, budget, counts, reasons, scores)

    def update(self, result: AllocationResult) -> None:
        """Filter every known prompt one step: observed prompts condition on their state, the rest diffuse."""
        result = _check_result(result)
        if self.no_update:
            return
        counts, rate = _group_stats(result, self.success_threshold)
        cols, planned = self._cols, result.plan_prompt_ids
        # the planned prompts DPS has not registered yet (new rows, or rows another owner of the table added)
        fresh = ~cols.find(planned)[1] if not cols.empty else torch.ones(planned.shape, dtype=torch.bool)
        plan_pos, order = cols.add(planned)
        if bool(fresh.any()):  # they start at the priors (their columns hold the fills, 0)
            new = plan_pos[fresh[order]]
            cols["alpha"][new] = self.prior_alpha
            cols["pi"][new] = self.prior_pi
            cols["pi_before"][new] = self.prior_pi
        seen = counts[order] > 0  # in sorted-id order, so that every gather and scatter below is sequential
        pos = plan_pos[seen]
        rate = rate[order][seen]
        state = torch.where(rate == 0, 0, torch.where(rate == 1, 2, 1))
        onehot = torch.nn.functional.one_hot(state, 3).to(torch.float64)
        pi_new = cols["pi"].clone()
        pi_new[pos] = onehot
        alpha = cols["alpha"]
        if self.transitions == "learned":
            # Soft transition counts, only where eta != 0 (the code multiplies the others' C by lr = 0). With a
            # one-hot pi_new = e_s, C is zero outside row s: C[s, i] = pi_before[i] P[s, i] / sum_i (same).
            # (Sums over the size-3 axes are written out: torch's small-axis reductions are several times slower.)
            a_obs = alpha[pos]
            row = a_obs.gather(1, state[:, None, None].expand(-1, 1, 3)).squeeze(1) / _sum3(a_obs, 1)
            joint = cols["pi_before"][pos] * row
            mass = _sum3(joint, 1)[:, None]
            soft = torch.where(mass > 0, joint / mass.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
            if self.decay != 1.0:
                alpha = alpha * self.decay
                alpha.add_((1.0 - self.decay) * self.prior_alpha)
            else:
                alpha = alpha.clone()
            counts9 = (onehot[:, :, None] * (self.learning_rate * soft)[:, None, :]).reshape(-1, 9)
            flat = alpha.view(-1, 9)
            flat[pos] += counts9
        # P(alpha) pi_new, with P = alpha / column sums: pi_next_j = sum_i alpha_ji (pi_new_i / colsum_i)
        pi_next = torch.bmm(alpha, (pi_new / _sum3(alpha, 1))[:, :, None]).squeeze(-1)
        pi_next = pi_next / _sum3(pi_next, 1)[:, None]
        known = cols["seen"]
        if not bool(known.all()):  # rows other owners of a shared table added keep DPS's fills (0)
            alpha = torch.where(known[:, None, None], alpha, 0.0)
            pi_next = torch.where(known[:, None], pi_next, 0.0)
            pi_new = torch.where(known[:, None], pi_new, 0.0)
        cols["alpha"], cols["pi"], cols["pi_before"] = alpha, pi_next, pi_new
        cols["sampled_times"][pos] += 1

    STATE: ClassVar[dict[str, Field]] = {
        "table": TableColumns.FIELD,
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (the table validates its columns; every column of ``alpha`` of
    a registered prompt must also have a positive sum, checked by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """The table (``alpha [M, 3, 3]``, ``pi [M, 3]``, ``pi_before [M, 3]``, ``sampled_times [M]``; the rows
        only when the table is private) and the generator state; copies."""
        return dump_state({"table": self._cols.state(), "generator": self._gen.get_state()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one),
        with every column of a registered prompt's ``alpha`` summing to a positive count (the transition matrix
        divides by it; for a shared table, the table loaded by the caller is checked)."""
        s = load_state(state, self.STATE, "DPS")
        cols, at = self._cols.incoming(s["table"])
        alpha, known = cols["alpha"], cols["seen"]
        if bool(((alpha.sum(1) <= 0) & known[:, None]).any()):
            raise InputError(
                f"{at}[{self._cols.owner + '/alpha'!r}]",
                "finite non-negative counts, every column sum positive for a registered prompt",
                "a column summing to 0",
                "pass DPS.state_dict()",
            )
        self._cols.load(s["table"])
        self._gen.set_state(s["generator"])
