"""XRPO's hierarchical rollout planner: uncertainty-reduction priority plus an exploration bonus (:class:`XRPO`,
:func:`t_quantile`).

arXiv 2510.06672 (the advantage side is :func:`rolloutopt.advantages.xrpo_sharpen`). Its rule is
**[reconstructed]** from the paper's abstract and public summaries and needs ``experimental=True``;
``docs/methods/replay.md``. Per-prompt state lives in sorted int64 id tensors looked up with
``torch.searchsorted``. No Python loop over prompts or rollouts.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import torch
from jaxtyping import Real
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import require_experimental
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    _check_float,
    _check_int,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._tracked import _rank
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatB, IntP

__all__ = ["XRPO", "t_quantile"]

_F64 = torch.float64
_XRPO_DOCS = "docs/methods/replay.md"


# -- XRPO -------------------------------------------------------------------------------------------------------
def t_quantile(q: float, df: Real[Tensor, " ..."]) -> FloatAny:
    r"""Quantile :math:`t_{q,\nu}` of Student's t distribution, float64, for ``df`` :math:`\nu \ge 1` (elementwise).

    Exact for :math:`\nu = 1` (:math:`\tan(\pi(q - 1/2))`) and :math:`\nu = 2`
    (:math:`(2q-1)/\sqrt{2q(1-q)}`); for :math:`\nu \ge 3` the Cornish–Fisher expansion in
    :math:`z = \Phi^{-1}(q)` to :math:`O(\nu^{-4})` (Abramowitz & Stegun 26.7.5; relative error below 0.3% at
    :math:`\nu = 3, q = 0.975`, shrinking fast with :math:`\nu`). ``df < 1`` gives NaN. (scipy is not a dependency.)
    """
    nu = df.to(_F64)
    z = torch.special.ndtri(torch.tensor(q, dtype=_F64))
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    nus = nu.clamp(min=1.0)
    cf = z + g1 / nus + g2 / nus**2 + g3 / nus**3 + g4 / nus**4
    one = torch.tan(torch.tensor(math.pi * (q - 0.5), dtype=_F64))
    two = torch.tensor((2 * q - 1) / math.sqrt(2 * q * (1 - q)), dtype=_F64)
    out = torch.where(nu == 1, one, torch.where(nu == 2, two, cf))
    return torch.where(nu >= 1, out, torch.nan)


class _XRPOPlan(Conversation):
    reason_names = ("base", "extra", "capped", "no_budget")

    def __init__(self, prompt_ids: Tensor, budget: int, cfg: XRPO) -> None:
        super().__init__(prompt_ids, budget)
        self.cfg = cfg
        p = prompt_ids.numel()
        self._base = max(cfg.n_base, cfg.n_min)
        k = min(p, budget // self._base)
        self._base_counts = torch.zeros(p, dtype=torch.long)
        self._base_counts[self._order[:k]] = self._base  # short budget: the lowest prompt ids get a base group
        self._round = 0

    def priority(self) -> Tensor:
        """Per planned prompt: :math:`\\Delta h_q + \\lambda\\sqrt{\\log(1 + T)/n_q}` (0-count prompts: -inf)."""
        cfg = self.cfg
        n, s, ss = self.totals()
        nf = n.to(_F64)
        mean = s / nf.clamp(min=1)
        var = ((ss - nf * mean * mean) / (nf - 1).clamp(min=1)).clamp(min=0.0)
        sd = torch.where(n >= 2, var.sqrt(), 0.0).clamp(min=cfg.s_floor)
        q = 1.0 - cfg.alpha / 2
        h_now = torch.where(n >= 2, t_quantile(q, (nf - 1).clamp(min=1)) * sd / nf.clamp(min=1).sqrt(), 0.0)
        h_next = t_quantile(q, nf.clamp(min=1)) * sd / (nf + 1).sqrt()
        delta = torch.where(n >= 2, h_now - h_next, 0.0)
        total = float(self.spent_observed)
        bonus = cfg.lam * torch.sqrt(math.log1p(total) / nf.clamp(min=1))
        return torch.where(n > 0, delta + bonus, -math.inf)

    def decide(self) -> Request | None:
        cfg = self.cfg
        self._round += 1
        if self._round == 1:
            keep = self._base_counts > 0
            return self.request(keep, self._base_counts[keep]) if bool(keep.any()) else None
        remaining = self.budget - self.spent
        n = self._n
        eligible = (n > 0) & (n < cfg.n_max)
        e = int(eligible.sum())
        if remaining <= 0 or e == 0:
            return None
        size = cfg.round_size if cfg.round_size is not None else max(1, -(-int((n > 0).sum()) // 4))
        m = min(size, remaining, e)
        ranked = _rank(torch.where(eligible, self.priority(), -math.inf), self._order)[:m]
        return self.request(ranked, torch.ones(m, dtype=torch.long))

    def select(self) -> tuple[FloatB, IntP]:
        n = self._n
        reasons = torch.where(
            n == 0, 3, torch.where((n >= self.cfg.n_max) & (n > self._base), 2, torch.where(n > self._base, 1, 0))
        )
        return torch.ones(self.spent_observed, dtype=torch.float64), reasons

    def finish(self) -> AllocationResult:
        res = super().finish()
        return replace(res, metrics={**res.metrics, "rounds": torch.tensor(float(max(self._round - 2, 0)), dtype=_F64)})


class XRPO:
    r"""XRPO's rollout allocator: a base group per prompt, then extra rollouts to the largest expected uncertainty cut.

    The uncertainty of prompt :math:`q`'s mean reward after :math:`n_q` rollouts is the half-width of the
    Student-t confidence interval; the priority of one more rollout is the half-width it is expected to remove,
    plus a UCB-style exploration bonus:

    .. math::

        h_q(n) = t_{1-\alpha/2,\,n-1}\,\frac{s_q}{\sqrt n}, \qquad
        \Pi_q = \underbrace{h_q(n_q) - t_{1-\alpha/2,\,n_q}\frac{s_q}{\sqrt{n_q + 1}}}_{\Delta h_q}
        + \lambda \sqrt{\frac{\log(1 + T)}{n_q}}

    with :math:`s_q` the sample standard deviation of the prompt's rewards so far (unbiased; floored at
    ``s_floor``), :math:`T` the rollouts observed so far in the step. Rounds give one more rollout to each of the
    ``round_size`` prompts with the highest :math:`\Pi_q` (ties to the lower prompt id) until the budget is spent
    or every prompt is at ``n_max``.

    Reference: XRPO, arXiv 2510.06672 (Bamba et al.), the exploration component ("hierarchical rollout
    planning"). The half-width :math:`h_q(n_q)` is as public summaries quote the paper. **[Reconstructed]** (the
    paper's text and code ``UIUC-MLSys/XRPO`` could not be read here; every default below is our choice, hence
    ``experimental=True``): the expected-reduction form of :math:`\Delta h_q` with :math:`s_q` held fixed, the
    bonus's form and :math:`\lambda`, the base group ``n_base``, the round size, ``s_floor``, and the t
    quantile's Cornish–Fisher approximation (:func:`t_quantile`). The paper's in-context seeding of all-fail
    prompts is a prompt-rewriting step, outside an allocator.

    Args:
        n_base: base rollouts per prompt in the first request (8, [reconstructed]).
        n_min: smallest group (default ``n_base``; the base group is ``max(n_base, n_min)``).
        n_max: largest group (32, [reconstructed]).
        alpha: confidence level :math:`\alpha` of the interval (0.05, a 95% interval).
        lam: exploration weight :math:`\lambda \ge 0` (0.05, [reconstructed]; 0 gives the pure uncertainty rule).
        round_size: prompts topped up per round, one rollout each (default: a quarter of the prompts with a
            base group, rounded up; [reconstructed]).
        s_floor: lower bound on :math:`s_q` (0.0): with 0, a zero-variance group gains only the bonus.
        seed: generator seed (the rule is deterministic; the generator is kept for the protocol).
        experimental: must be True (see above).

    Budget: spends all of it unless every planned prompt reaches ``n_max`` (or ``budget < n_min``). With a budget
    below ``P * n_base`` the lowest prompt ids get the base groups and no prompt is topped up beyond what is
    left. Every rollout is kept (weight 1). Reasons: ``"base"``, ``"extra"``, ``"capped"``, ``"no_budget"``.
    Stateless across steps.
    """

    reference: ClassVar[str] = "arXiv 2510.06672 (XRPO, the hierarchical rollout planner)"
    experimental: ClassVar[str | None] = (
        "the priority, the exploration bonus and the defaults are reconstructed from the abstract"
    )

    def __init__(
        self,
        *,
        n_base: int = 8,
        n_min: int | None = None,
        n_max: int = 32,
        alpha: float = 0.05,
        lam: float = 0.05,
        round_size: int | None = None,
        s_floor: float = 0.0,
        seed: int = 0,
        experimental: bool = False,
    ) -> None:
        require_experimental(
            experimental,
            "the XRPO allocation rule (priority, bonus, defaults, from arXiv 2510.06672's abstract)",
            _XRPO_DOCS,
        )
        self.n_base = _check_int(n_base, "n_base", 1, "pass e.g. n_base=8")
        self.n_min = self.n_base if n_min is None else _check_int(n_min, "n_min", 1, "pass e.g. n_min=2")
        self.n_max = _check_int(n_max, "n_max", 1, "pass e.g. n_max=32")
        if self.n_max < max(self.n_base, self.n_min):
            raise InputError(
                "n_max", f"n_max >= max(n_base, n_min) = {max(self.n_base, self.n_min)}", repr(n_max), "raise it"
            )
        self.alpha = _check_float(alpha, "alpha", 0.0, 1.0, "pass alpha=0.05", open_low=True)
        if self.alpha >= 1.0:
            raise InputError("alpha", "a number in (0, 1)", repr(alpha), "pass alpha=0.05")
        self.lam = _check_float(lam, "lam", 0.0, 1e6, "pass lam=0.05")
        self.round_size = None if round_size is None else _check_int(round_size, "round_size", 1, "pass e.g. 64")
        self.s_floor = _check_float(s_floor, "s_floor", 0.0, 1e6, "pass s_floor=0.0")
        self.seed = _check_int(seed, "seed", 0, "pass a non-negative int")
        self._gen = torch.Generator().manual_seed(self.seed)

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Base groups, then rounds of uncertainty-reduction top-ups (see the class docstring)."""
        return _XRPOPlan(as_prompt_ids(prompt_ids), check_budget(budget), self)

    def update(self, result: AllocationResult) -> None:
        """Nothing to learn across steps (the priority is computed within the step)."""
        _check_result(result)

    STATE: ClassVar[dict[str, Field]] = {"generator": Field("generator")}
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """The generator state."""
        return dump_state({"generator": self._gen.get_state()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, validated (an ``InputError`` names a bad field)."""
        s = load_state(state, self.STATE, "XRPO")
        self._gen.set_state(s["generator"])
