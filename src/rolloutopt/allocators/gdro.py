r"""Multi-Adversary GDRO (arXiv 2601.19280): a prompt-side and a rollout-side adversary over the difficulty bins of
:mod:`rolloutopt.allocators.gdro_bins`.

Provenance (``docs/methods/gdro.md``): no public code. From the abstract and public summaries: difficulty bins
come from a real-time pass@k estimate with hysteresis; two *independent* games; Prompt-GDRO is an EMA-debiased
multiplicative-weights bandit over bins; Rollout-GDRO is a shadow price over discrete rollout arms
``n_min..n_max`` under a fixed *mean* rollout budget, with a square-root optimal allocation. Every update
equation and every default below is **[reconstructed]** by this project; each is a keyword.

Experimental flag. Reconstructed methods need ``experimental=True`` (otherwise an
:class:`~rolloutopt.errors.InputError`): the paper's defaults are unknown, so there is nothing to construct
silently (unlike :class:`~rolloutopt.allocators.VIGOR`, whose abstract fixes its default rule, so that ``VIGOR()``
works and warns). :class:`PromptGDRO` and :class:`RolloutGDRO` take keyword arguments only and our suggested
defaults, and need ``experimental=True``; ``PromptGDRO()`` raises an ``InputError`` naming ``experimental`` and
saying how to acknowledge the reconstruction.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import choice, describe, positive, require_experimental
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    OneShotPlan,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._gdro_ema import (
    _bin_ema_fields,
    _BinEMA,
    _check_bins,
    _classifier,
    _common,
    _hardness,
    _id_keys,
    _mw_probs,
    _visit_stats,
)
from rolloutopt.allocators._ids import _sort_ids
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.gdro_bins import (
    _DOCS,
    _F64,
    DifficultyClassifier,
    _arms,
    _arms_of,
    _unit,
    shadow_price_update,
)
from rolloutopt.allocators.table import PromptTable, TableOwner
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatP, IntP

__all__ = ["PromptGDRO", "RolloutGDRO"]


# ------------------------------------------------------------------------------------------------ Prompt-GDRO


class _PromptPlan(OneShotPlan):
    reason_names = ("selected", "not_selected", "no_budget")


class PromptGDRO(TableOwner):
    r"""Prompt-GDRO: an EMA-debiased multiplicative-weights adversary over difficulty bins picks the prompts.

    Per bin :math:`b` the allocator keeps an EMA of the *mean* per-prompt hardness :math:`h` of the bin's prompts
    in each step (intensive, so frequent bins do not win by count), debiased Adam-style, and samples

    .. math::  \hat s_b = \frac{s_b}{1 - \beta^{t_b}}, \qquad q_b \propto e^{\eta \hat s_b}, \qquad
               q \leftarrow (1 - \gamma) q + \gamma / B

    over the :math:`B` bins present among the candidates. Each candidate :math:`i` in bin :math:`b_i` gets weight
    :math:`q_{b_i} / m_{b_i}` (:math:`m_b` candidates in bin :math:`b`: "draw a bin from q, then a prompt uniformly
    in it"); :math:`M` prompts are drawn without replacement by Gumbel-top-:math:`M` on the log weights (successive
    sampling: a bin's share matches :math:`q_b` while :math:`M \ll m_b`; when a bin runs out its mass moves to the
    others). Every selected prompt gets the same ``n`` rollouts, in one request.

    Reference: Multi-Adversary GDRO, arXiv 2601.19280 (EMA-debiased MW over pass@k bins: from the summaries). The
    hardness signal, the defaults ``eta = 1, beta = 0.9, gamma = 0.05`` (our suggestions), the
    without-replacement draw and the budget rules are **[reconstructed]** (``docs/methods/gdro.md``); hence
    ``experimental=True``.

    Budget: with :math:`P` candidates and budget :math:`N`, the group size is ``n`` and :math:`M = \min(P,
    \lfloor N / n\rfloor)` prompts are selected, so :math:`nM \le N` rollouts are requested (all of the budget when
    ``n`` divides it and the pool is large enough). If the pool is small (:math:`Pn < N`) every candidate is
    selected and the group size grows to :math:`\min(n_{max}, \lfloor N/P \rfloor)`; if the budget cannot fill one
    group of ``n``, one prompt gets the whole budget when it is at least ``n_min``, else nothing is requested.
    Reasons per candidate: ``selected``, ``not_selected`` (not drawn), ``no_budget`` (the budget is below
    ``n_min``). Every rollout is kept (weight 1); zero-variance groups stay in with GRPO's zero advantage.

    Unseen prompts are binned by the classifier's ``unseen`` policy; a bin without updates scores like the best
    scored present bin (0 when none), so new bins are explored.

    Args:
        n: rollouts per selected prompt (default 8, the usual GRPO group size; [reconstructed]).
        n_min: smallest group when the budget is below ``n`` (default ``n``: then nothing is requested).
        n_max: largest group when the pool is too small for the budget (default ``n``: then the rest is unspent).
        eta: inverse temperature :math:`\eta \ge 0` (default 1.0).
        beta: EMA decay :math:`\beta \in [0, 1)` (default 0.9).
        gamma: uniform mixing :math:`\gamma \in [0, 1]` (default 0.05).
        hardness: the per-prompt signal from rewards: ``"fail_rate"`` (default, :math:`1 - c/n`) or
            ``"variance"`` (:math:`\hat p(1 - \hat p)`); :meth:`update` also takes explicit per-prompt values
            (e.g. the trainer's per-prompt loss).
        classifier: the :class:`DifficultyClassifier` this allocator owns and updates (default: one with its
            defaults). Do not share one instance between two allocators: both would update it.
        seed: seed of the allocator's own ``torch.Generator`` (default 0).
        experimental: must be True (see above).
        capacity: prompts the default classifier keeps in a private table (default None: 1,000,000; the least
            recently visited are forgotten first); None when ``classifier`` is given.
        table: a shared :class:`~rolloutopt.allocators.PromptTable` for the default classifier (default None: a
            private one), which registers ``ema``, ``bin`` and ``streak`` as owner ``"promptgdro"``; the caller
            saves a shared table once. None when ``classifier`` is given (construct it with ``table=``).
    """

    accepts: ClassVar[tuple[str, ...]] = ("hardness",)
    reference: ClassVar[str] = "arXiv 2601.19280 (Multi-Adversary GDRO, the prompt adversary)"
    experimental: ClassVar[str | None] = (
        "the EMA-debiased multiplicative-weights rule over difficulty bins is reconstructed"
    )

    def __init__(
        self,
        *,
        n: int = 8,
        n_min: int | None = None,
        n_max: int | None = None,
        eta: float = 1.0,
        beta: float = 0.9,
        gamma: float = 0.05,
        hardness: Literal["fail_rate", "variance"] = "fail_rate",
        classifier: DifficultyClassifier | None = None,
        seed: int = 0,
        experimental: bool = False,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        require_experimental(experimental, "Prompt-GDRO (EMA-debiased MW over difficulty bins)", _DOCS)
        self.n = _int(n, "n", 1)
        self.n_min = self.n if n_min is None else _int(n_min, "n_min", 1)
        self.n_max = self.n if n_max is None else _int(n_max, "n_max", 1)
        if self.n_min > self.n:
            raise InputError("n_min", f"n_min <= n = {self.n}", describe(n_min), "lower n_min")
        if self.n_max < self.n:
            raise InputError("n_max", f"n_max >= n = {self.n}", describe(n_max), "raise n_max")
        self.beta, self.eta, self.gamma, self.seed = _common(beta, eta, gamma, hardness, seed)
        self.hardness = hardness
        self.classifier = _classifier(classifier, capacity, table, "promptgdro")
        self._cols = self.classifier._cols  # the per-prompt state is the classifier's
        self._scores = _BinEMA(self.classifier.num_bins, self.beta)
        self._gen = torch.Generator().manual_seed(self.seed)

    def bin_probs(self, prompt_ids: IntP | None = None) -> Float[Tensor, " K"]:
        """The sampling distribution :math:`q` over bins, float64 ``[K]`` (over the bins present among
        ``prompt_ids`` when given, else over all bins)."""
        k = self.classifier.num_bins
        if prompt_ids is None:
            present = torch.ones(k, dtype=torch.bool)
        else:
            present = torch.bincount(self.classifier.bins(prompt_ids), minlength=k) > 0
        return _mw_probs(self._scores, present, self.eta, self.gamma)

    def loss_weights(self, prompt_ids: IntP) -> FloatP:
        r"""The equivalent loss reweighting :math:`q_{b_i} / \pi_{b_i}` per prompt (``[P]``, float64), with
        :math:`\pi_b` the share of ``prompt_ids`` in bin :math:`b`: train on all of them, weighted, instead of
        sampling."""
        bins = self.classifier.bins(prompt_ids)
        k = self.classifier.num_bins
        m = torch.bincount(bins, minlength=k).to(_F64)
        q = _mw_probs(self._scores, m > 0, self.eta, self.gamma)
        return q[bins] / (m[bins] / max(bins.numel(), 1))

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Select prompts by the bin adversary and give each ``n`` rollouts, in one request (class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        counts = torch.zeros(p, dtype=torch.long)
        reasons = torch.full((p,), 1, dtype=torch.long)
        if p == 0:
            return _PromptPlan(ids, budget, counts, reasons, accepts=self.accepts)
        if p * self.n <= budget:
            m, size = p, min(self.n_max, budget // p)
        elif budget >= self.n:
            m, size = budget // self.n, self.n
        elif budget >= self.n_min:
            m, size = 1, budget
        else:
            return _PromptPlan(ids, budget, counts, torch.full((p,), 2, dtype=torch.long), accepts=self.accepts)
        sort = _sort_ids(ids)
        bins = self.classifier._bins_at(*self.classifier._find(ids))  # the sort of ids is remembered
        k = self.classifier.num_bins
        mass = torch.bincount(bins, minlength=k).to(_F64)
        q = _mw_probs(self._scores, mass > 0, self.eta, self.gamma)
        keys = _id_keys(sort[1], self._gen)
        score = torch.log(q[bins] / mass[bins]) - torch.log(-torch.log(keys))
        chosen = score.topk(m).indices if m < p else torch.arange(p)
        counts[chosen] = size
        reasons[chosen] = 0
        return _PromptPlan(ids, budget, counts, reasons, accepts=self.accepts)

    def update(self, result: AllocationResult) -> None:
        """Learn from a step: per bin (the bin each prompt had when planned) one EMA step towards the mean hardness
        of its visited prompts, then one classifier visit per visited prompt.

        The hardness is the reward-based signal (``hardness=`` of the constructor), or the ``hardness`` signal
        when the trainer observed it with the rewards (``plan.observe(request, rewards, hardness=...)``, one
        value per request row; ``result.signals["hardness"]`` ``[P]``), which replaces it.
        """
        n, c, visited = _visit_stats(result, self.classifier.success_threshold)
        h = _hardness(self.hardness, n, c, visited, result.signals.get("hardness"), n.numel())
        ids = result.plan_prompt_ids[visited]
        bins = self.classifier._visit(ids, n[visited], c[visited])  # the bins before the visit: as planned
        self._scores.update(bins, h)

    STATE: ClassVar[dict[str, Field]] = {
        "scores": Field("nested", fields=_bin_ema_fields("finite")),
        "classifier": Field("nested", fields=DifficultyClassifier.STATE),
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (the bin count must also equal the classifier's ``num_bins``,
    checked by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """Bin scores, classifier state and the generator state (copies)."""
        return dump_state(
            {
                "scores": self._scores.state(),
                "classifier": self.classifier._state(),
                "generator": self._gen.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one); the
        allocator then continues exactly as the saved one would."""
        s = load_state(state, self.STATE, "PromptGDRO")
        _check_bins(s, ("scores",), self.classifier)
        self.classifier._assign(s["classifier"], "state['classifier']")
        self._scores.load(s["scores"])
        self._gen.set_state(s["generator"])


# ----------------------------------------------------------------------------------------------- Rollout-GDRO


class _RolloutPlan(OneShotPlan):
    reason_names = ("allocated", "trimmed_to_budget", "no_budget")

    def __init__(
        self,
        prompt_ids: Tensor,
        budget: int,
        counts: Tensor,
        reasons: Tensor,
        metrics: dict[str, Tensor],
        **signals: Any,
    ) -> None:
        super().__init__(prompt_ids, budget, counts, reasons, **signals)
        self._metrics = metrics

    def finish(self) -> AllocationResult:
        result = super().finish()
        result.metrics.update(self._metrics)
        return result


def _fit_budget(bins: Tensor, a: Tensor, arms: Tensor, keys: Tensor, budget: int, n_min: int, n_max: int) -> Tensor:
    """Per-prompt counts: each prompt's bin arm, cut to the budget by the same marginal values the controller uses.

    First as many prompts as the budget allows get ``n_min`` (all of them, or the highest ``a`` first, ties by the
    random key); then the units ``k = n_min+1..arm_b`` of each bin, worth ``a_b / (k (k-1))`` to each of its
    prompts, are granted in decreasing value (ties: smaller k, then smaller bin) until the budget runs out; the last
    level is split among that bin's prompts by the random key. Without a cut every prompt gets its arm.
    """
    p = bins.numel()
    k_bins = a.numel()
    x = torch.zeros(p, dtype=torch.long)
    if budget >= n_min * p:
        sel = torch.ones(p, dtype=torch.bool)
    else:
        order = keys.argsort()
        order = order[(-a[bins[order]]).argsort(stable=True)]
        sel = torch.zeros(p, dtype=torch.bool)
        sel[order[: budget // n_min]] = True
    x[sel] = n_min
    rest = budget - n_min * int(sel.sum())
    if n_max == n_min or rest <= 0:
        return x
    m = torch.bincount(bins[sel], minlength=k_bins)
    k = torch.arange(n_min + 1, n_max + 1)
    valid = (k[:, None] <= arms[None, :]) & (m[None, :] > 0)  # [L, K], level-major
    value = torch.where(valid, a[None, :] / (k * (k - 1)).to(_F64)[:, None], torch.full((k.numel(), k_bins), -1.0))
    mult = torch.where(valid, m[None, :], torch.zeros_like(m)[None, :]).flatten()
    order = (-value.flatten()).argsort(stable=True)[: int(valid.sum())]  # valid levels (values >= 0) come first
    cum = mult[order].cumsum(0)
    n_full = int((cum <= rest).sum())  # cum is increasing: the granted levels are a prefix of the order
    granted = torch.zeros(k.numel() * k_bins, dtype=torch.long)
    granted[order[:n_full]] = 1
    g = granted.view(k.numel(), k_bins).sum(0)  # full levels granted per bin (a prefix in k)
    x = x + torch.where(sel, g[bins], torch.zeros_like(x))
    if n_full < order.numel():
        r = rest - (int(cum[n_full - 1]) if n_full else 0)
        b_star = int(order[n_full]) % k_bins
        cand = sel & (bins == b_star)
        pick = torch.where(cand, keys, torch.full_like(keys, 2.0)).argsort()[:r]
        x[pick] += 1
    return x


class RolloutGDRO(TableOwner):
    r"""Rollout-GDRO: a shadow-price controller spreads rollouts across difficulty bins at a fixed mean budget.

    Per bin :math:`b` a variance proxy :math:`v_b` and an adversarial weight :math:`w_b` give :math:`a_b = w_b
    v_b`; at shadow price :math:`\mu` each bin plays the arm (:func:`shadow_price_arms`)

    .. math::  n_b = \arg\max_{n_{min} \le n \le n_{max}} a_b\Bigl(\frac{1}{n_{min}} - \frac{1}{n}\Bigr) - \mu n,
               \qquad \mu \leftarrow \max\bigl(0, \mu + \eta_\mu\,c\,(\textstyle\sum_b \pi_b n_b - \bar n)\bigr)

    (:func:`shadow_price_update`, after the step, with :math:`\pi_b` the candidates' bin shares). Its fixed point
    approximates the square-root rule :math:`n_b = \bar n \sqrt{a_b} / \sum_j \pi_j \sqrt{a_j}`
    (:func:`sqrt_allocation`; tested on a stationary problem). :math:`v_b = \hat p_b(1 - \hat p_b)` from a
    debiased EMA of the bin's mean success rate (``variance="pbar"``, the default) or the debiased EMA of
    the mean per-prompt :math:`\hat p(1-\hat p)` (``"mean"``); a bin never updated gets ``unseen_variance``.
    :math:`w_b = B q_b` from the rollout side's *own* EMA-debiased exponential weights over bin hardness (the two
    games are independent; as :class:`PromptGDRO`, ``weights="adversarial"``) or 1 (``"uniform"``).

    Reference: Multi-Adversary GDRO, arXiv 2601.19280 (shadow price over arms ``n_min..n_max``, fixed mean budget,
    square-root allocation: from the summaries). The objective, the controller, every default and the budget cut
    are **[reconstructed]** (``docs/methods/gdro.md``); hence ``experimental=True``.

    Budget: the mean budget is :math:`\bar n` = ``n_bar`` (default None: ``budget / P`` each step, compute-neutral
    with :class:`~rolloutopt.allocators.Uniform`, clipped to ``[n_min, n_max]`` so that the price stays bounded
    when a step's budget cannot reach the arms); ``budget`` is a hard cap. The controller's arms are requested
    as proposed when they fit; otherwise they are cut by the controller's own marginal values (``trimmed_to_budget``),
    and when even ``n_min`` each does not fit, the prompts of the highest-:math:`a_b` bins get ``n_min`` and the
    rest nothing (``no_budget``). It spends at most the budget and less when :math:`\mu` is above the price at which
    the budget binds; the dual step then lowers :math:`\mu`. Every rollout is kept (weight 1). The result's metrics
    add ``mu`` (the price used), ``n_bar``, ``proposed_mean_n`` and ``price_scale`` (the dual step's :math:`c`),
    which :meth:`update` reads.

    Args:
        n_min, n_max: the arms (defaults 2 and 16, [reconstructed]; ``n_min >= 2`` so every group has a variance).
        n_bar: the fixed mean budget in rollouts per prompt, or None (see above).
        step: ``"relative"`` (default, [reconstructed]) scales each dual step by :math:`\mu^\star/\bar n`, with
            :math:`\mu^\star = (\sum_b \pi_b\sqrt{a_b}/\bar n)^2` the step's closed-form price, so that
            ``eta_mu`` is dimensionless and the price neither crawls nor cycles whatever the scale of
            :math:`a_b`; ``"additive"`` is the plain reconstructed rule, with ``eta_mu`` in price units. With a
            constant additive step the price cycles when :math:`\eta_\mu |\bar n_t - \bar n|` exceeds the gap
            between the prices of neighbouring arms (about :math:`2\mu^\star/\bar n`): hard bins with small
            :math:`a_b` make that gap tiny.
        eta_mu: dual step :math:`\eta_\mu \ge 0`; default None: 0.2 with ``step="relative"`` (each step moves the price by
            :math:`0.2\,\mu^\star` times the relative violation :math:`(\bar n_t - \bar n)/\bar n`), 1e-4 with
            ``"additive"`` (sized for :math:`a_b \approx 0.1` and :math:`\bar n \approx 8`).
        mu_init: the initial price (default 0: the first steps propose ``n_max`` and are cut to the budget).
        eta, beta, gamma, hardness: the rollout adversary's exponential weights, as :class:`PromptGDRO`.
        weights: ``"adversarial"`` (default) or ``"uniform"``.
        variance: ``"pbar"`` (default) or ``"mean"``.
        unseen_variance: :math:`v_b` of a bin without updates (default 0.25, the largest Bernoulli variance).
        classifier: the :class:`DifficultyClassifier` this allocator owns (default: one with its defaults).
        seed: seed of the allocator's own ``torch.Generator`` (tie-breaks of the budget cut; default 0).
        experimental: must be True (see above).
        capacity, table: the default classifier's table, as :class:`PromptGDRO` (owner ``"rolloutgdro"``).
    """

    accepts: ClassVar[tuple[str, ...]] = ("hardness",)
    reference: ClassVar[str] = "arXiv 2601.19280 (Multi-Adversary GDRO, the rollout adversary)"
    experimental: ClassVar[str | None] = "the shadow-price controller over rollout arms is reconstructed"

    def __init__(
        self,
        *,
        n_min: int = 2,
        n_max: int = 16,
        n_bar: float | None = None,
        step: Literal["relative", "additive"] = "relative",
        eta_mu: float | None = None,
        mu_init: float = 0.0,
        eta: float = 1.0,
        beta: float = 0.9,
        gamma: float = 0.05,
        hardness: Literal["fail_rate", "variance"] = "fail_rate",
        weights: Literal["adversarial", "uniform"] = "adversarial",
        variance: Literal["pbar", "mean"] = "pbar",
        unseen_variance: float = 0.25,
        classifier: DifficultyClassifier | None = None,
        seed: int = 0,
        experimental: bool = False,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        require_experimental(experimental, "Rollout-GDRO (shadow-price controller over rollout arms)", _DOCS)
        self.n_min, self.n_max = _arms(n_min, n_max)
        if n_bar is not None:
            positive(n_bar, "n_bar")
            if not self.n_min <= n_bar <= self.n_max:
                raise InputError(
                    "n_bar",
                    f"a mean budget in [n_min, n_max] = [{n_min}, {n_max}]",
                    describe(n_bar),
                    "set n_bar inside the arms",
                )
        self.n_bar = None if n_bar is None else float(n_bar)
        choice(step, "step", ("relative", "additive"))
        self.step = step
        if eta_mu is None:
            eta_mu = 0.2 if step == "relative" else 1e-4
        positive(eta_mu, "eta_mu", strict=False)
        positive(mu_init, "mu_init", strict=False)
        self.eta_mu = float(eta_mu)
        self.beta, self.eta, self.gamma, self.seed = _common(beta, eta, gamma, hardness, seed)
        self.hardness = hardness
        choice(weights, "weights", ("adversarial", "uniform"))
        choice(variance, "variance", ("pbar", "mean"))
        self.weights, self.variance = weights, variance
        self.unseen_variance = _unit(unseen_variance, "unseen_variance", closed_low=True, closed_high=True)
        self.classifier = _classifier(classifier, capacity, table, "rolloutgdro")
        self._cols = self.classifier._cols  # the per-prompt state is the classifier's
        k = self.classifier.num_bins
        self.mu = float(mu_init)
        self._scores = _BinEMA(k, self.beta)
        self._rate = _BinEMA(k, self.beta)
        self._gen = torch.Generator().manual_seed(self.seed)

    def bin_values(self, prompt_ids: IntP) -> tuple[Float[Tensor, " K"], Float[Tensor, " K"], Int[Tensor, " K"]]:
        r"""For the bins present among ``prompt_ids``: :math:`a_b = w_b v_b`, the shares :math:`\pi_b` and the
        controller's arms at the current :math:`\mu` (each float64/int64 ``[K]``; absent bins have
        :math:`\pi_b = 0`)."""
        bins = self.classifier.bins(prompt_ids)
        return self._values(bins)

    def _values(self, bins: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k = self.classifier.num_bins
        m = torch.bincount(bins, minlength=k).to(_F64)
        present = m > 0
        rate = self._rate.debiased()
        v = rate * (1 - rate) if self.variance == "pbar" else rate
        v = torch.where(torch.isnan(v), torch.full_like(v, self.unseen_variance), v).clamp(min=0.0)
        if self.weights == "adversarial":
            w = _mw_probs(self._scores, present, self.eta, self.gamma) * present.sum().to(_F64)
        else:
            w = torch.ones(k, dtype=_F64)
        a = torch.where(present, w * v, torch.zeros_like(v))
        pi = m / m.sum().clamp(min=1)
        return a, pi, _arms_of(a, self.mu, self.n_min, self.n_max)

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """The controller's arm for each prompt's bin, cut to ``budget`` if needed, in one request."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        sort = _sort_ids(ids)
        bins = self.classifier._bins_at(*self.classifier._find(ids))  # the sort of ids is remembered
        a, pi, arms = self._values(bins)
        n_bar = self.n_bar if self.n_bar is not None else min(max(budget / max(p, 1), self.n_min), self.n_max)
        keys = _id_keys(sort[1], self._gen)
        counts = _fit_budget(bins, a, arms, keys, budget, self.n_min, self.n_max)
        proposed = arms[bins]
        reasons = torch.where(counts == 0, 2, torch.where(counts < proposed, 1, 0))
        metrics = {
            "mu": torch.tensor(self.mu, dtype=_F64),
            "n_bar": torch.tensor(float(n_bar), dtype=_F64),
            "proposed_mean_n": (pi * arms.to(_F64)).sum(),
            "price_scale": ((pi * a.sqrt()).sum() / n_bar) ** 2 / n_bar
            if self.step == "relative"
            else torch.tensor(1.0, dtype=_F64),
        }
        return _RolloutPlan(ids, budget, counts, reasons, metrics, accepts=self.accepts)

    def update(self, result: AllocationResult) -> None:
        """Learn from a step: the dual step on :math:`\\mu` (from the result's ``proposed_mean_n`` and ``n_bar``),
        one EMA step of each bin's success rate (or variance) and hardness (bins as planned), then one classifier
        visit per visited prompt. An observed ``hardness`` signal replaces the reward-based adversary signal, as
        in :meth:`PromptGDRO.update`."""
        n, c, visited = _visit_stats(result, self.classifier.success_threshold)
        if not {"proposed_mean_n", "n_bar", "price_scale"} <= set(result.metrics):
            raise InputError(
                "result",
                "the result of a RolloutGDRO plan",
                "a result without its metrics",
                "update with the result of this allocator's own plan",
            )
        h = _hardness(self.hardness, n, c, visited, result.signals.get("hardness"), n.numel())
        ids = result.plan_prompt_ids[visited]
        bins = self.classifier._visit(ids, n[visited], c[visited])  # the bins before the visit: as planned
        rate = c[visited].to(_F64) / n[visited].to(_F64)
        self._rate.update(bins, rate if self.variance == "pbar" else rate * (1 - rate))
        self._scores.update(bins, h)
        if result.plan_prompt_ids.numel():
            self.mu = shadow_price_update(
                self.mu,
                float(result.metrics["proposed_mean_n"]),
                float(result.metrics["n_bar"]),
                eta_mu=self.eta_mu,
                scale=float(result.metrics["price_scale"]),
            )

    STATE: ClassVar[dict[str, Field]] = {
        "mu": Field("real", low=0.0),
        "scores": Field("nested", fields=_bin_ema_fields("finite")),
        "rate": Field("nested", fields=_bin_ema_fields("prob")),
        "classifier": Field("nested", fields=DifficultyClassifier.STATE),
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (the bin count must also equal the classifier's ``num_bins``,
    checked by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """The price, bin EMAs, classifier state and generator state (copies)."""
        return dump_state(
            {
                "mu": self.mu,
                "scores": self._scores.state(),
                "rate": self._rate.state(),
                "classifier": self.classifier._state(),
                "generator": self._gen.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one); the
        allocator then continues exactly as the saved one would."""
        s = load_state(state, self.STATE, "RolloutGDRO")
        _check_bins(s, ("scores", "rate"), self.classifier)
        self.classifier._assign(s["classifier"], "state['classifier']")
        self._scores.load(s["scores"])
        self._rate.load(s["rate"])
        self._gen.set_state(s["generator"])
        self.mu = float(s["mu"])
