"""Within-step top-up by variance-guided rounds: :class:`VIGOR`.

Speaks the protocol of :mod:`rolloutopt.allocators._base` (``plan`` → ``next``/``observe`` → ``finish`` →
``update``) and issues several requests per plan: a first stage on every prompt, then further rollouts for the
prompts whose first rewards say they carry a learning signal (``docs/methods/topup.md``).
:func:`vigor_speedup` is the closed-form speed-up of the square-root allocation under Pareto-distributed
variance.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import describe, require_experimental
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    _choice,
    _int,
    _real,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._tracked import _BIG, _caps, _rank, _Tracked
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatB, IntP

__all__ = ["VIGOR", "vigor_speedup"]


# -- VIGOR --------------------------------------------------------------------------------------------------------
def vigor_speedup(alpha: float | FloatAny) -> float | FloatAny:
    r"""Closed-form speed-up of the square-root allocation over uniform allocation, variance ~ Pareto(alpha).

    .. math::

        S(\alpha) = \frac{\mathbb E[\sigma^2]}{(\mathbb E[\sigma])^2}
                  = \frac{(\alpha - \tfrac12)^2}{\alpha(\alpha - 1)}, \qquad \alpha > 1.

    Derivation (``docs/methods/topup.md``, a **project derivation** that matches VIGOR's claim, arXiv
    "VarIance Guided Online Rollout allocation", in form only): with :math:`n_i \propto \sigma_i` (the optimum of
    :math:`\min \sum_i \sigma_i^2/n_i` s.t. :math:`\sum_i n_i = N`) the total variance is
    :math:`(\sum_i\sigma_i)^2/N`; uniform allocation gives :math:`M\sum_i\sigma_i^2/N`. Rollouts needed for equal
    variance therefore shrink by :math:`\mathbb E[\sigma^2]/(\mathbb E[\sigma])^2`. If :math:`\sigma^2` is Pareto
    with shape :math:`\alpha` (scale :math:`x_m`), :math:`\sigma` is Pareto with shape :math:`2\alpha`, so
    :math:`\mathbb E[\sigma^2] = \alpha x_m/(\alpha-1)` and :math:`\mathbb E[\sigma] = 2\alpha\sqrt{x_m}/(2\alpha-1)`.

    Values: 1.125 at alpha = 2, 4/3 at 1.5, 1.8 at 1.25; it tends to 1 as alpha -> inf and grows without bound as
    alpha -> 1. The paper's own formula (which also depends on the number of refinement rounds) is not public.

    Args:
        alpha: Pareto shape, a float or a floating tensor of any shape; every value must be > 1.

    Returns:
        The speed-up, same type (and shape, dtype) as ``alpha``.
    """
    if isinstance(alpha, Tensor):
        if not alpha.is_floating_point():
            raise InputError("alpha", "a floating tensor", describe(alpha), "cast with alpha.double()")
        if not bool((alpha > 1).all()) or not bool(torch.isfinite(alpha).all()):
            raise InputError("alpha", "finite values > 1 (a Pareto shape with finite mean)", describe(alpha), "fix")
        return (alpha - 0.5) ** 2 / (alpha * (alpha - 1))
    _real(alpha, "alpha", 1.0, math.inf, open_low=True)
    a = float(alpha)
    return (a - 0.5) ** 2 / (a * (a - 1))


def _greedy_marginal(v: Tensor, n: Tensor, cap: Tensor, units: int, by_id: Tensor) -> Tensor:
    """Exact heap-greedy of ``units`` rollouts by marginal gain ``v/((n+j)(n+j+1))``, ties to the lower prompt id.

    Vectorised: a bisection on the threshold gain (every gain strictly above it is taken), then the remaining units
    go one each to the prompts with the best next gain. ``v``, ``n`` (>= 1), ``cap`` (max extra per prompt) are
    ``[P]``; prompts with ``v == 0`` or ``cap == 0`` get nothing.
    """
    vf, nf = v.double(), n.double()
    cap = torch.where(v > 0, cap.clamp(max=units), 0)
    out = torch.zeros_like(n)
    if int(cap.sum()) <= units:
        return cap

    def gain(j: Tensor) -> Tensor:
        m = nf + j.double()
        return vf / (m * (m + 1))

    def count_gt(lam: float) -> Tensor:
        t = vf / lam
        est = torch.ceil((torch.sqrt(1 + 4 * t) - 1) / 2 - nf).clamp(min=0)
        est = torch.minimum(est.nan_to_num(posinf=float(_BIG)).long(), cap)
        for _ in range(2):  # exact correction of the float estimate: est = #{j < cap : gain(j) > lam}
            est = est + ((est < cap) & (gain(est) > lam)).long()
            est = est - ((est > 0) & (gain(est - 1) <= lam)).long()
        return torch.where(cap > 0, est, 0)

    lo, hi = 0.0, float(gain(torch.zeros_like(n)).max())
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        total = int(count_gt(mid).sum())
        if total > units:
            lo = mid
        else:
            hi = mid
            if total == units:
                break
    out = count_gt(hi)
    rest = units - int(out.sum())
    if rest > 0:
        nxt = torch.where(out < cap, gain(out), -1.0)
        best = _rank(nxt, by_id)[:rest]
        out[best] += 1
    return out


class _VIGORPlan(_Tracked):
    reason_names = ("initial", "top_up", "capped", "zero_variance", "no_budget")
    track_successes = False  # only the extremes (zero variance) are read

    def __init__(self, prompt_ids: Tensor, budget: int, cfg: VIGOR) -> None:
        super().__init__(prompt_ids, budget)
        self.cfg = cfg
        p = prompt_ids.numel()
        self._warm = max(cfg.n_init, cfg.n_min)
        k = min(p, budget // self._warm)
        self._warm_counts = torch.zeros(p, dtype=torch.long)
        self._warm_counts[self._order[:k]] = self._warm  # short budget: the lowest prompt ids are warmed
        self._round = 0
        self._chunk = 0
        self._static: Tensor | None = None

    def _score(self) -> Tensor:
        n, mean, var = self.group_stats()
        cfg = self.cfg
        if cfg.prior is not None:
            a, b = cfg.prior
            nf = n.double()
            c = mean * nf
            return torch.where(n > 0, (c + a) * (nf - c + b) / (nf + a + b) ** 2, 0.0)
        if cfg.variance == "unbiased":
            return torch.where(n > 1, var * n.double() / (n.double() - 1).clamp(min=1), 0.0)
        return var

    def decide(self) -> Request | None:
        cfg = self.cfg
        self._round += 1
        if self._round == 1:
            keep = self._warm_counts > 0
            return self.request(keep, self._warm_counts[keep]) if bool(keep.any()) else None
        remaining = self.budget - self.spent
        if remaining <= 0:
            return None
        if self._round == 2:
            self._chunk = cfg.chunk if cfg.chunk is not None else max(1, -(-remaining // cfg.rounds))
            if cfg.mode == "static":
                self._static = self._score()
        score = self._static if self._static is not None else self._score()
        n = self._n
        head = (cfg.n_max - n) if cfg.n_max is not None else None
        eligible = (n > 0) & (score > 0) if head is None else (n > 0) & (score > 0) & (head > 0)
        order = self._order
        sub = order.index_select(0, eligible.index_select(0, order).nonzero().squeeze(1))  # eligible, by id
        if sub.numel() == 0:
            return None
        units = min(self._chunk, remaining)
        amount = torch.zeros_like(n)
        if cfg.rule == "marginal":
            cap = torch.full_like(sub, _BIG) if head is None else head[sub]
            amount[sub] = _greedy_marginal(score[sub], n[sub], cap, units, torch.arange(sub.numel()))
        else:
            ranked = _rank(score, sub)  # the eligible by score, descending, ties to the lower id
            k = max(1, math.ceil(cfg.top_frac * sub.numel()))
            s_sorted = score.index_select(0, ranked)
            m = int((s_sorted >= s_sorted[k - 1]).sum())  # the top k, ties at the k-th included
            share = torch.full((m,), units // m, dtype=torch.long) + (torch.arange(m) < units % m).long()
            top = ranked[:m]
            if head is not None:
                share = torch.minimum(share, head[top])
            go = (share > 0).nonzero().squeeze(1)
            rows, counts = top.index_select(0, go), share.index_select(0, go)
            by_pos = torch.sort(rows).indices  # the request lists prompts by position, as a mask would
            return self.request(rows.index_select(0, by_pos), counts.index_select(0, by_pos))
        give = amount > 0
        return self.request(give, amount[give])

    def select(self) -> tuple[FloatB, IntP]:
        n, _, var = self.group_stats()
        cfg = self.cfg
        capped = (n >= cfg.n_max) if cfg.n_max is not None else torch.zeros_like(n, dtype=torch.bool)
        reasons = torch.where(
            n == 0,
            4,
            torch.where(capped & (n > self._warm), 2, torch.where(n > self._warm, 1, torch.where(var == 0, 3, 0))),
        )
        return torch.ones(self.spent_observed, dtype=torch.float64), reasons

    def finish(self) -> AllocationResult:
        res = super().finish()
        n, _, var = self.group_stats()
        played = n > 0
        zero = (played & (var == 0)).double().sum() / played.double().sum().clamp(min=1)
        return replace(
            res,
            metrics={**res.metrics, "rounds": torch.tensor(float(max(self._round - 1, 0))), "zero_variance_frac": zero},
        )


class VIGOR:
    r"""VIGOR: warm-start every prompt, then add rollouts in rounds to the groups with the highest reward variance.

    From the abstract of "VarIance Guided Online Rollout allocation" (``docs/methods/topup.md``):
    begin with a few rollouts for every prompt and iteratively allocate more to those with the highest group
    reward variance until a fixed total budget is reached. Round 0 gives :math:`n_0` rollouts to every prompt;
    each following round hands out a chunk of :math:`\Delta` rollouts by the *rule*:

    .. math::

        \text{"variance" (default): } \text{the top } \lceil f\,E \rceil \text{ eligible prompts by } s_i^2
        \text{ (ties at the cut included) share } \Delta \text{ evenly;}
        \qquad
        \text{"marginal": } \Delta \text{ units, one at a time, to } \arg\max_i \frac{s_i^2}{n_i(n_i+1)}.

    :math:`s_i^2` is the group's population variance (``variance="population"``, equal to
    :math:`\hat p(1-\hat p)` for 0/1 rewards; ``"unbiased"`` divides by :math:`n_i-1`). A prompt is eligible when
    :math:`s_i^2 > 0` and it is below ``n_max``; zero-variance groups after warm-up get nothing more. Rounds
    continue until the budget is spent or no prompt is eligible, so the budget is always spent unless every
    group is flat or capped (``metrics["budget_used_frac"]``). Every rollout is kept (weight 1).

    **Reconstructed** (no public code; the abstract fixes only the literal rule): ``n_init`` (2), ``rounds`` (4:
    the post-warm-up budget is split into that many chunks; ``chunk`` overrides), ``top_frac`` (0.5), the
    population variance, tie-breaking toward the lower prompt id (which keeps the plan
    equivariant under a permutation of the prompts), the lowest-id-first warm start when the budget cannot warm
    every prompt, ``mode`` ("online": re-estimate after every round, the "O" of VIGOR; "static": keep the
    warm-up estimate). The defaults follow the abstract's literal rule, so ``VIGOR()`` works and warns once
    (``experimental=True`` silences the warning). The options that go beyond the abstract — ``rule="marginal"``
    (the marginal-score rule :math:`g_i = s_i^2/(n_i(n_i+1))`) and ``prior`` (a Beta-smoothed variance
    :math:`(c+a)(n-c+b)/(n+a+b)^2` that lets flat groups be re-probed) — require ``experimental=True``.

    Args:
        n_init: warm-start rollouts per prompt (>= 2 so a variance exists; raised to ``n_min``).
        rounds: number of chunks the post-warm-up budget is split into (ignored when ``chunk`` is given).
        chunk: rollouts per refinement round (:math:`\Delta`, the engine's batch granularity), or None.
        top_frac: fraction of the eligible prompts that share a round's chunk under ``rule="variance"``.
        rule: "variance" (the abstract) or "marginal" (experimental).
        mode: "online" (default) or "static".
        variance: "population" (default) or "unbiased".
        prior: ``(a, b)`` Beta pseudo-counts for a smoothed variance (experimental), or None.
        n_min, n_max: per-prompt caps; a prompt gets 0 or between ``n_min`` and ``n_max`` rollouts.
        experimental: acknowledge the reconstruction (see above).

    Edge cases: a budget below ``P * n_init`` warms the lowest ids first and the rest get ``"no_budget"``;
    ``budget < n_init`` requests nothing. Reasons: ``"initial"`` (warm-up only, variance > 0 but outranked),
    ``"top_up"``, ``"capped"`` (topped up to ``n_max``), ``"zero_variance"``, ``"no_budget"``. Stateless across
    steps and deterministic: no seed is needed; ``update`` does nothing and the state dict is empty.
    """

    reference: ClassVar[str] = (
        "VIGOR, variance-guided online rollout allocation (abstract only, no public code; "
        "VIGOR() warns that its defaults are reconstructed)"
    )
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        n_init: int = 2,
        rounds: int = 4,
        chunk: int | None = None,
        top_frac: float = 0.5,
        rule: str = "variance",
        mode: str = "online",
        variance: str = "population",
        prior: tuple[float, float] | None = None,
        n_min: int = 2,
        n_max: int | None = None,
        experimental: bool = False,
    ) -> None:
        _int(n_init, "n_init", 2)
        _int(rounds, "rounds", 1)
        _int(chunk, "chunk", 1, none=True)
        _real(top_frac, "top_frac", 0.0, 1.0, open_low=True)
        _choice(rule, "rule", ("variance", "marginal"))
        _choice(mode, "mode", ("online", "static"))
        _choice(variance, "variance", ("population", "unbiased"))
        if prior is not None:
            if not (isinstance(prior, tuple) and len(prior) == 2):
                raise InputError("prior", "None or a tuple (a, b) of positive numbers", describe(prior), "e.g. (1, 1)")
            _real(prior[0], "prior", 0.0, math.inf, open_low=True)
            _real(prior[1], "prior", 0.0, math.inf, open_low=True)
        _caps(n_min, n_max)
        if n_max is not None and max(n_init, n_min) > n_max:
            raise InputError("n_max", f"n_max >= n_init = {n_init}", repr(n_max), "raise n_max or lower n_init")
        if rule != "variance" or prior is not None:
            require_experimental(
                experimental,
                "VIGOR's marginal-score rule and prior-smoothed variance (beyond the abstract)",
                "docs/methods/topup.md",
            )
        elif experimental is not True:
            warnings.warn(
                "VIGOR: n_init, rounds, top_frac and the variance estimator are reconstructed (no public code; see "
                "docs/methods/topup.md); pass experimental=True to acknowledge",
                UserWarning,
                stacklevel=2,
            )
        self.n_init, self.rounds, self.chunk, self.top_frac = n_init, rounds, chunk, float(top_frac)
        self.rule, self.mode, self.variance = rule, mode, variance
        self.prior = (float(prior[0]), float(prior[1])) if prior is not None else None
        self.n_min, self.n_max = n_min, n_max

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Warm start, then variance-guided top-up rounds (see the class docstring)."""
        return _VIGORPlan(as_prompt_ids(prompt_ids), check_budget(budget), self)

    def update(self, result: AllocationResult) -> None:
        """Nothing to learn: VIGOR decides within the step."""
        _check_result(result)

    STATE: ClassVar[dict[str, Field]] = {}
    """The declared fields of :meth:`state_dict`: none (stateless; only the format version is saved)."""

    def state_dict(self) -> dict[str, Any]:
        """No state: only the format version."""
        return dump_state({})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state; a state with any key (or another format version) is an ``InputError``."""
        load_state(state, self.STATE, "VIGOR")
