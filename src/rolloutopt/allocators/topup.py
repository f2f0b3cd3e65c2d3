"""Within-step top-up allocators: :class:`VIGOR` (variance-guided rounds) and :class:`PilotCommit` (pilot, then
commit).

Both speak the protocol of :mod:`rolloutopt.allocators._base` (``plan`` → ``next``/``observe`` → ``finish`` →
``update``) and issue several requests per plan: a first stage on every prompt, then further rollouts for the
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

from rolloutopt._validation import check_state, describe, require_experimental
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    _argsort_stable,
    _check_result,
    _choice,
    _int,
    _real,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatB, IntB, IntP

__all__ = ["VIGOR", "PilotCommit", "vigor_speedup"]

_BIG = 1 << 62


# -- validation helpers -------------------------------------------------------------------------------------------


def _caps(n_min: Any, n_max: Any) -> None:
    _int(n_min, "n_min", 1)
    _int(n_max, "n_max", 1, none=True)
    if n_max is not None and n_max < n_min:
        raise InputError("n_max", f"n_max >= n_min = {n_min}", repr(n_max), "raise n_max or lower n_min")


class _Tracked(Conversation):
    """A conversation that also tracks, per planned prompt, the min and max reward (when ``track_extremes``, for
    :meth:`group_stats`) and the successes so far (when ``track_successes``), updated from each observed request
    only, so a round never re-reads every rollout."""

    success_threshold = 1.0
    track_extremes = True
    track_successes = True

    def __init__(self, prompt_ids: Tensor, budget: int) -> None:
        super().__init__(prompt_ids, budget)
        p = prompt_ids.numel()
        self._hi = torch.full((p,), -math.inf, dtype=torch.float64)
        self._lo = torch.full((p,), math.inf, dtype=torch.float64)
        self._succ = torch.zeros(p, dtype=torch.float64)
        self._stats: tuple[Tensor, Tensor, Tensor] | None = None  # group_stats() since the last observe

    def on_observe(self, pos: IntB, r: FloatB) -> None:
        """Update the per-prompt extremes and successes from the request just observed."""
        self._stats = None
        if self.track_extremes:
            self._hi.scatter_reduce_(0, pos, r, "amax")
            self._lo.scatter_reduce_(0, pos, r, "amin")
        if self.track_successes:
            self._succ.index_add_(0, pos, (r >= self.success_threshold).double())
        self.observed(pos, r)

    def observed(self, pos: Tensor, r: Tensor) -> None:
        """Hook: the rollouts of the request just observed (prompt positions, rewards)."""

    def group_stats(self) -> tuple[Tensor, Tensor, Tensor]:
        """Per planned prompt: count, mean, population variance (exactly 0 where every reward is equal); computed
        once per observed request (read-only tensors)."""
        if self._stats is not None:
            return self._stats
        n, s, ss = self.totals()
        nf = n.double().clamp(min=1)
        mean = s / nf
        assert self.track_extremes, "group_stats needs track_extremes"
        flat = (n == 0) | (self._hi == self._lo)
        var = torch.where(flat, 0.0, (ss / nf - mean * mean).clamp(min=0.0))
        self._stats = (n, mean, var)
        return n, mean, var


def _rank(score: Tensor, by_id: Tensor) -> Tensor:
    """Positions sorted by ``score`` descending, ties toward the lower prompt id (``by_id``: positions by id)."""
    return by_id.index_select(0, _argsort_stable(score.index_select(0, by_id), descending=True))


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

    def plan(self, prompt_ids: IntP, budget: int) -> Conversation:
        """Warm start, then variance-guided top-up rounds (see the class docstring)."""
        return _VIGORPlan(as_prompt_ids(prompt_ids), check_budget(budget), self)

    def update(self, result: AllocationResult) -> None:
        """Nothing to learn: VIGOR decides within the step."""
        _check_result(result)

    def state_dict(self) -> dict[str, Any]:
        """No state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state."""


# -- Pilot-Commit -------------------------------------------------------------------------------------------------
_FRESH, _PILOT, _KEPT, _CARRIED, _COMMITTED, _COMMITTED_CARRIED, _TOO_CORRECT, _TOO_INCORRECT, _EVICTED = range(9)
_PC_NAMES = ("committed", "committed_carried", "buffered", "too_correct", "too_incorrect", "evicted", "not_piloted")
_PC_CODE = torch.tensor([6, 6, 2, 2, 0, 1, 3, 4, 5])  # state -> index into _PC_NAMES


class _PilotCommitPlan(_Tracked):
    reason_names = _PC_NAMES
    track_extremes = False  # only successes are read

    def __init__(self, prompt_ids: Tensor, budget: int, owner: PilotCommit) -> None:
        super().__init__(prompt_ids, budget)
        self.o = owner
        self.success_threshold = owner.success
        p = prompt_ids.numel()
        self.state = torch.full((p,), _FRESH, dtype=torch.long)
        self.std = torch.zeros(p, dtype=torch.float64)
        self.added = torch.full((p,), owner._step, dtype=torch.long)
        # insertion order into the code's buffer dict within a step (its tie-break): the order of piloting
        self.seq = torch.zeros(p, dtype=torch.long)
        self._seq_next = 0
        self.state[torch.isin(prompt_ids, owner._evicted)] = _EVICTED
        if owner._buf_ids.numel():
            pos = torch.searchsorted(owner._buf_ids, prompt_ids).clamp(max=owner._buf_ids.numel() - 1)
            hit = (owner._buf_ids[pos] == prompt_ids) & (self.state == _FRESH)
            self.state[hit] = _CARRIED
            self.std[hit] = owner._buf_std[pos[hit]]
            self.added[hit] = owner._buf_step[pos[hit]]
            self.seq[hit] = owner._buf_order[pos[hit]]
        self.committed = 0
        self.rounds = 0
        self._piloting = torch.zeros(0, dtype=torch.long)  # positions piloted by the last request (state _PILOT)
        self._pilot_round = torch.full((p,), -1, dtype=torch.long)  # the request that piloted each prompt
        self._sizes: list[int] = []  # rollouts of each observed request

    def observed(self, pos: Tensor, r: Tensor) -> None:
        self._sizes.append(pos.numel())  # classification happens at the next decide()

    def _is_pilot(self) -> Tensor:
        """Per observed rollout: was its prompt piloting when it was observed (a pilot rollout)? Request ``k``
        pilots exactly the prompts whose ``_pilot_round`` is ``k``."""
        pos, _ = self.rollouts()
        req = torch.repeat_interleave(torch.arange(len(self._sizes)), torch.tensor(self._sizes, dtype=torch.long))
        return self._pilot_round.index_select(0, pos) == req

    def _classify(self) -> None:
        pil = self._piloting  # the prompts in state _PILOT: those the last request piloted
        if pil.numel() == 0:
            return
        self._piloting = pil[:0]
        o = self.o
        m = self._succ[pil] / self._n[pil].double().clamp(min=1)  # a piloting prompt has only pilot rollouts so far
        keep = (m >= o.p_lower) & (m <= 1 - o.p_upper)
        self.state[pil] = torch.where(keep, _KEPT, torch.where(m > 1 - o.p_upper, _TOO_CORRECT, _TOO_INCORRECT))
        self.std[pil] = (m * (1 - m)).clamp(min=0).sqrt()

    def decide(self) -> Request | None:
        o = self.o
        self._classify()
        needed = _BIG if o.batch_size is None else o.batch_size - self.committed
        remaining = self.budget - self.spent
        if needed <= 0 or remaining <= 0 or self.rounds >= o.max_rounds:
            return None
        in_buf = (self.state == _KEPT) | (self.state == _CARRIED)
        if o.buffer_sampling == "max_variance":  # pilot std, then recency, both descending; then pilot order
            buf = in_buf.nonzero().squeeze(1)
            buf = buf[_argsort_stable(self.seq[buf])]
            buf = buf[_argsort_stable(self.added[buf], descending=True)]
            buf = buf[_argsort_stable(self.std[buf], descending=True)]
        else:
            buf = in_buf.nonzero().squeeze(1)
            buf = buf[torch.randperm(buf.numel(), generator=o._gen)]
        c = min(needed, buf.numel(), remaining // o.n_commit)
        fresh = (self.state == _FRESH).nonzero().squeeze(1)  # in the given (data loader) order
        per_pilot = o.n_pilot + (o.n_commit if o.reserve_commit else 0)
        g = min(fresh.numel(), o.gen_batch_size or _BIG, (remaining - c * o.n_commit) // per_pilot)
        if o.divisible_by > 1 and c > 0:  # the code shrinks the commit batch only (a GPU-count hook)
            cs = torch.arange(c + 1)
            ok = ((g * o.n_pilot + cs * o.n_commit) % o.divisible_by == 0).nonzero()
            c = int(ok.max()) if ok.numel() else 0
        if g == 0 and c == 0:
            return None
        self.rounds += 1
        pilot, commit = fresh[:g], buf[:c]
        self.state[commit] = torch.where(self.state[commit] == _CARRIED, _COMMITTED_CARRIED, _COMMITTED)
        self.state[pilot] = _PILOT
        self._piloting = pilot
        self._pilot_round[pilot] = self.rounds - 1  # this request's index
        self.seq[pilot] = self._seq_next + torch.arange(g)
        self._seq_next += g
        self.committed += c
        counts = torch.cat([torch.full((g,), o.n_pilot), torch.full((c,), o.n_commit)]).long()
        return self.request(torch.cat([pilot, commit]), counts)

    def select(self) -> tuple[FloatB, IntP]:
        self._classify()
        o = self.o
        pos, r = self.rollouts()
        weight = ((self.state == _COMMITTED) | (self.state == _COMMITTED_CARRIED)).double().index_select(0, pos)
        m_eff = o.n_pilot_eff
        if m_eff is not None and m_eff < o.n_pilot and pos.numel():
            st = self.state[pos]
            # max-variance down-sampling of each committed prompt's pilot rollouts to m_eff (as close to half 1s,
            # half 0s as the counts allow; uniformly at random among equals), on those rollouts only
            pilot = self._is_pilot()
            ok = ((r >= o.success) & pilot).long()
            ones = torch.zeros(self.prompt_ids.numel(), dtype=torch.long).index_add_(0, pos, ok)
            zeros = o.n_pilot - ones
            idx = ((st == _COMMITTED) & pilot).nonzero().squeeze(1)
            pp, s = pos[idx], (r[idx] >= o.success).long()
            need1 = torch.full_like(ones, m_eff // 2)
            need1 = torch.where(ones < need1, ones, torch.where(zeros < m_eff - need1, m_eff - zeros, need1))
            need = torch.where(s == 1, need1[pp], m_eff - need1[pp])
            key = (pp * 2 + s).double() + torch.rand(idx.numel(), generator=o._gen, dtype=torch.float64)
            order = torch.sort(key).indices
            seg = (pp * 2 + s)[order]
            first = torch.ones_like(seg, dtype=torch.bool)
            first[1:] = seg[1:] != seg[:-1]
            ar = torch.arange(seg.numel())
            rank = torch.empty_like(ar)
            rank[order] = ar - torch.cummax(torch.where(first, ar, 0), 0).values
            weight[idx[rank >= need]] = 0.0
        return weight, _PC_CODE[self.state]

    def finish(self) -> AllocationResult:
        res = super().finish()
        o = self.o
        return replace(
            res,
            metrics={
                **res.metrics,
                "rounds": torch.tensor(float(self.rounds)),
                "committed": torch.tensor(float(self.committed)),
                "batch_full": torch.tensor(float(o.batch_size is None or self.committed >= o.batch_size)),
            },
        )


class PilotCommit:
    r"""Pilot-Commit: pilot every prompt with a few rollouts, then commit the rest of the budget to the useful ones.

    arXiv 2605.26606 ("Spend Your Rollouts Where It Counts"; code ``databricks/pilot-commit``,
    ``recipe/pc/pc_ray_trainer.py``, ``replay_buffer.py``; ``docs/methods/topup.md``). Per round (one request):

    1. **Pilot** the next ``gen_batch_size`` fresh prompts (the given order) with ``n_pilot`` rollouts each.
    2. **Classify** each by its pilot success rate :math:`m` (success: ``reward >= success``):

       .. math::

           \text{keep if } p_{lower} \le m \le 1 - p_{upper};\quad \text{too correct if } m > 1 - p_{upper};\quad
           \text{too incorrect if } m < p_{lower};\quad \text{evict if } m \ge p_{solve}.

       Kept prompts enter the buffer with their pilot std :math:`\sqrt{m(1-m)}`; too-incorrect ones are just not
       kept (deferred: a later plan may pilot them again); evicted ids are skipped by every later plan.
    3. **Commit**, in the same request as the next pilot: take ``min(needed, |buffer|)`` buffered prompts
       (``"max_variance"``: pilot std, then recency, both descending, then the order of piloting, as the code's
       stable sort of its insertion-ordered buffer dict; ``"random"``: seeded)
       and roll each out ``n_commit`` more times. The training group is ``n_pilot_eff`` pilot rollouts (chosen
       to be as close to half 1s and half 0s as the counts allow, at random among equals) plus the ``n_commit``
       fresh ones; every other rollout gets weight 0.
    4. Repeat until ``batch_size`` prompts are committed, the fresh prompts or the budget run out, or
       ``max_rounds`` rounds were made (the code raises there; this plan stops and reports
       ``metrics["batch_full"] = 0``).

    Across steps (``update``): kept prompts that were not committed stay in the buffer with their step and are
    committed without a new pilot when a later plan lists them (reason ``"committed_carried"``: the trainer
    appends the pilot responses it kept from the step where the prompt was ``"buffered"``; the result holds only
    the new rollouts); entries older than ``max_off_steps`` steps are flushed after each step; the buffer holds at
    most ``buffer_size`` prompts (the newest). :meth:`buffered_ids` and :meth:`evicted_ids` tell a trainer which
    prompts to re-list and which to drop.

    Defaults: the paper's 1.5B launch script (``train_scripts/pc_qwen2.5-1.5b_p32c96.sh``): ``n_pilot=32``,
    ``n_commit=96``, ``p_upper=0.25``, ``p_lower=0.125``, ``p_solve=1.0``, ``buffer_sampling="max_variance"``;
    the config file (``pc_trainer.yaml``) has ``p_lower=0.25``, ``p_solve=None``, ``n_pilot=8``,
    ``buffer_sampling="random"``; both have ``max_off_steps=4``, ``max_rounds=10``, ``buffer_size=100000``,
    ``n_pilot_eff=None`` (all pilot rollouts train). ``success=1.0`` (the code's exact-1.0 ``acc``).

    Budget (rollouts; the project's adaptation, the code has none): commits come first (``n_commit`` each while
    the budget lasts); a pilot is started only if the budget can also commit it (``reserve_commit=True``), so a
    plan never pilots prompts it could not train on. The budget is not always spent: what is left when no prompt
    can be piloted or committed stays unspent (``metrics["budget_used_frac"]``). ``divisible_by`` shrinks the
    commit batch so each request's total is a multiple of it (the code's GPU-count rule).

    Left out: the end-of-epoch buffer flush and the per-epoch (rather than per-step) application of evictions
    (the protocol has no epochs: evictions apply from the next plan), the code's ``most_recent`` /
    ``least_recent`` buffer orders, and down-sampling of carried pilot responses (the trainer holds them).

    Args:
        n_pilot, n_commit: rollouts per prompt in the pilot and the commit stage.
        n_pilot_eff: pilot rollouts kept in a committed group (None: all ``n_pilot``).
        p_upper, p_lower, p_solve: the thresholds above (``p_solve=None`` disables eviction).
        batch_size: prompts to commit per plan (B; None: as many as the budget allows).
        gen_batch_size: prompts piloted per round (None: as many as the budget allows).
        buffer_sampling: "max_variance" or "random".
        max_off_steps, buffer_size, max_rounds, divisible_by: as above.
        reserve_commit: pilot only what the budget can also commit.
        success: reward threshold of a success.
        n_min, n_max: caps: every trained group has ``n_pilot_eff + n_commit >= n_min`` rollouts and no prompt
            gets more than ``n_pilot + n_commit <= n_max`` (checked at construction).
        seed: seeds the generator used for ``"random"`` buffer sampling and the pilot down-sampling.

    Reasons: ``"committed"``, ``"committed_carried"``, ``"buffered"`` (kept, not committed: pilot rollouts have
    weight 0, keep them for a later step), ``"too_correct"``, ``"too_incorrect"``, ``"evicted"`` (skipped),
    ``"not_piloted"`` (budget, rounds or batch full).
    """

    reference: ClassVar[str] = "arXiv 2605.26606 (Pilot-Commit); code databricks/pilot-commit"
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        n_pilot: int = 32,
        n_commit: int = 96,
        n_pilot_eff: int | None = None,
        p_upper: float = 0.25,
        p_lower: float = 0.125,
        p_solve: float | None = 1.0,
        batch_size: int | None = None,
        gen_batch_size: int | None = None,
        buffer_sampling: str = "max_variance",
        max_off_steps: int = 4,
        buffer_size: int = 100_000,
        max_rounds: int = 10,
        divisible_by: int = 1,
        reserve_commit: bool = True,
        success: float = 1.0,
        n_min: int = 2,
        n_max: int | None = None,
        seed: int = 0,
    ) -> None:
        _int(n_pilot, "n_pilot", 1)
        _int(n_commit, "n_commit", 1)
        _int(n_pilot_eff, "n_pilot_eff", 0, none=True)
        if n_pilot_eff is not None and n_pilot_eff > n_pilot:
            raise InputError("n_pilot_eff", f"<= n_pilot = {n_pilot}", repr(n_pilot_eff), "lower it or pass None")
        _real(p_upper, "p_upper", 0.0, 1.0)
        _real(p_lower, "p_lower", 0.0, 1.0)
        if p_lower > 1 - p_upper:
            raise InputError("p_lower", f"<= 1 - p_upper = {1 - p_upper}", repr(p_lower), "narrow the thresholds")
        _real(p_solve, "p_solve", 0.0, 1.0, none=True)
        _int(batch_size, "batch_size", 1, none=True)
        _int(gen_batch_size, "gen_batch_size", 1, none=True)
        _choice(buffer_sampling, "buffer_sampling", ("max_variance", "random"))
        _int(max_off_steps, "max_off_steps", 0)
        _int(buffer_size, "buffer_size", 0)
        _int(max_rounds, "max_rounds", 1)
        _int(divisible_by, "divisible_by", 1)
        if not isinstance(reserve_commit, bool):
            raise InputError("reserve_commit", "a bool", describe(reserve_commit), "pass True or False")
        if not isinstance(success, (int, float)) or isinstance(success, bool) or not math.isfinite(success):
            raise InputError("success", "a finite number (reward threshold)", describe(success), "pass success=1.0")
        _caps(n_min, n_max)
        eff = n_pilot if n_pilot_eff is None else n_pilot_eff
        if eff + n_commit < n_min:
            raise InputError("n_min", f"<= n_pilot_eff + n_commit = {eff + n_commit}", repr(n_min), "lower n_min")
        if n_max is not None and n_pilot + n_commit > n_max:
            raise InputError("n_max", f">= n_pilot + n_commit = {n_pilot + n_commit}", repr(n_max), "raise n_max")
        _int(seed, "seed", 0)
        self.n_pilot, self.n_commit, self.n_pilot_eff = n_pilot, n_commit, n_pilot_eff
        self.p_upper, self.p_lower = float(p_upper), float(p_lower)
        self.p_solve = None if p_solve is None else float(p_solve)
        self.batch_size, self.gen_batch_size, self.buffer_sampling = batch_size, gen_batch_size, buffer_sampling
        self.max_off_steps, self.buffer_size, self.max_rounds = max_off_steps, buffer_size, max_rounds
        self.divisible_by, self.reserve_commit, self.success = divisible_by, reserve_commit, float(success)
        self.n_min, self.n_max, self.seed = n_min, n_max, seed
        self._gen = torch.Generator().manual_seed(seed)
        self._step = 0
        self._buf_ids = torch.zeros(0, dtype=torch.long)
        self._buf_std = torch.zeros(0, dtype=torch.float64)
        self._buf_step = torch.zeros(0, dtype=torch.long)
        self._buf_order = torch.zeros(0, dtype=torch.long)  # pilot order within the entry's step (tie-break)
        self._evicted = torch.zeros(0, dtype=torch.long)

    def plan(self, prompt_ids: IntP, budget: int) -> Conversation:
        """Pilot/commit rounds over ``prompt_ids`` (fresh prompts in data-loader order, plus any buffered ids)."""
        return _PilotCommitPlan(as_prompt_ids(prompt_ids), check_budget(budget), self)

    def buffered_ids(self) -> IntP:
        """Prompt ids in the buffer (kept, not yet committed), sorted; list them in a later plan to commit them."""
        return self._buf_ids.clone()

    def evicted_ids(self) -> IntP:
        """Prompt ids evicted for good (pilot success rate >= ``p_solve``), sorted."""
        return self._evicted.clone()

    def update(self, result: AllocationResult) -> None:
        """Buffer the kept, uncommitted prompts; drop committed ones; evict solved ones; flush stale entries."""
        _check_result(result, "PilotCommit", _PC_NAMES)
        reasons, ids = result.reasons, result.plan_prompt_ids
        p, pos, r = ids.numel(), result.group, result.rewards
        # Pilot rollouts: every rollout of a buffered / too-correct / too-incorrect prompt of this plan; for a
        # committed prompt, its first n_pilot rollouts (needed only when p_solve <= 1 - p_upper lets a kept prompt
        # be evicted, so only then is the per-prompt occurrence index computed).
        only_pilot = (reasons == 2) | (reasons == 3) | (reasons == 4)
        is_pilot = only_pilot[pos]
        piloted = only_pilot
        if self.p_solve is not None and self.p_solve <= 1 - self.p_upper:
            piloted = only_pilot | (reasons == 0)
            order = torch.sort(pos, stable=True).indices
            start = torch.cumsum(result.counts, 0) - result.counts
            occ = torch.empty_like(pos)
            occ[order] = torch.arange(pos.numel()) - start[pos[order]]
            is_pilot = is_pilot | ((reasons == 0)[pos] & (occ < self.n_pilot))
        succ = torch.zeros(p, dtype=torch.float64).index_add_(0, pos, ((r >= self.success) & is_pilot).double())
        cnt = torch.zeros(p, dtype=torch.float64).index_add_(0, pos, is_pilot.double())
        m = succ / cnt.clamp(min=1)
        new = (reasons == 2) & (cnt > 0)
        # pilot order of this step (the code's buffer-dict insertion order): a prompt's first rollout index,
        # since each request lists its pilots first, in the order piloted
        first = torch.full((p,), pos.numel(), dtype=torch.long).scatter_reduce(
            0, pos, torch.arange(pos.numel()), "amin"
        )
        drop = ids[(reasons == 1) | (reasons == 0)]
        keep_old = ~torch.isin(self._buf_ids, drop)
        bid = torch.cat([self._buf_ids[keep_old], ids[new]])
        bstd = torch.cat([self._buf_std[keep_old], (m * (1 - m)).clamp(min=0).sqrt()[new]])
        bstep = torch.cat([self._buf_step[keep_old], torch.full((int(new.sum()),), self._step, dtype=torch.long)])
        bord = torch.cat([self._buf_order[keep_old], first[new]])
        fresh = self._step - bstep <= self.max_off_steps
        bid, bstd, bstep, bord = bid[fresh], bstd[fresh], bstep[fresh], bord[fresh]
        if bid.numel() > self.buffer_size:  # keep the newest entries (ties: the lower id)
            o = torch.sort(bid).indices
            o = o[torch.sort(bstep[o], descending=True, stable=True).indices][: self.buffer_size]
            bid, bstd, bstep, bord = bid[o], bstd[o], bstep[o], bord[o]
        o = torch.sort(bid).indices
        self._buf_ids, self._buf_std, self._buf_step, self._buf_order = bid[o], bstd[o], bstep[o], bord[o]
        if self.p_solve is not None:
            gone = ids[piloted & (cnt > 0) & (m >= self.p_solve)]
            self._evicted = torch.unique(torch.cat([self._evicted, gone]))
        self._step += 1

    def state_dict(self) -> dict[str, Any]:
        """Buffer (ids, pilot std, step added, pilot order), evicted ids, step counter and generator state (copies)."""
        return {
            "step": self._step,
            "buffer_ids": self._buf_ids.clone(),
            "buffer_std": self._buf_std.clone(),
            "buffer_step": self._buf_step.clone(),
            "buffer_order": self._buf_order.clone(),
            "evicted": self._evicted.clone(),
            "generator": self._gen.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        keys = {"step", "buffer_ids", "buffer_std", "buffer_step", "buffer_order", "evicted", "generator"}
        if isinstance(state, dict) and "buffer_order" not in state and isinstance(state.get("buffer_ids"), Tensor):
            # a state saved before buffer_order existed: ties among equal (std, step) fall back to the lower id
            state = {**state, "buffer_order": torch.zeros_like(state["buffer_ids"], dtype=torch.long)}
        check_state(state, keys, "PilotCommit")
        self._step = int(state["step"])
        self._buf_ids = state["buffer_ids"].clone().long()
        self._buf_std = state["buffer_std"].clone().double()
        self._buf_step = state["buffer_step"].clone().long()
        self._buf_order = state["buffer_order"].clone().long()
        self._evicted = state["evicted"].clone().long()
        self._gen.set_state(state["generator"])
