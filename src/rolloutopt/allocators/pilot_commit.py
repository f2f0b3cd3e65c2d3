"""Within-step top-up by pilot, then commit: :class:`PilotCommit`.

Speaks the protocol of :mod:`rolloutopt.allocators._base` (``plan`` → ``next``/``observe`` → ``finish`` →
``update``) and issues several requests per plan: a pilot stage on every prompt, then further rollouts for the
prompts whose pilot rewards say they carry a learning signal (``docs/methods/topup.md``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import FORMAT_KEY, Field, dump_state, load_state
from rolloutopt._validation import describe
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
from rolloutopt.allocators._ids import _argsort_stable
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._tracked import _BIG, _caps, _Tracked
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, IntP

__all__ = ["PilotCommit"]

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

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
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

    STATE: ClassVar[dict[str, Field]] = {
        "step": Field("integer", low=0),
        "buffer_ids": Field("int", ("M",), ("ids",)),
        "buffer_std": Field("float", ("M",), ("prob",)),  # sqrt(m (1 - m)) of a pilot success rate m: in [0, 1/2]
        "buffer_step": Field("int", ("M",), ("nonneg",)),
        # optional: states saved before buffer_order existed (and before format versions were written) lack it;
        # load_state_dict fills zeros (ties among equal (std, step) fall back to the lower id) and refuses a
        # versioned state without it
        "buffer_order": Field("int", ("M",), ("nonneg",), optional=True),
        "evicted": Field("int", ("E",), ("ids",)),
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """Buffer (ids, pilot std, step added, pilot order), evicted ids, step counter and generator state (copies)."""
        return dump_state(
            {
                "step": self._step,
                "buffer_ids": self._buf_ids.clone(),
                "buffer_std": self._buf_std.clone(),
                "buffer_step": self._buf_step.clone(),
                "buffer_order": self._buf_order.clone(),
                "evicted": self._evicted.clone(),
                "generator": self._gen.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one).

        A state without ``buffer_order`` (saved before it existed, so without a format version either) loads with
        zeros there: ties among equal (std, step) fall back to the lower id."""
        s = load_state(state, self.STATE, "PilotCommit")
        if "buffer_order" not in s and FORMAT_KEY in state:
            raise InputError(
                "state['buffer_order']",
                "the pilot order of the buffer (every versioned PilotCommit.state_dict() has it)",
                "a missing key",
                "pass PilotCommit.state_dict()",
            )
        if s["buffer_step"].numel() and int(s["buffer_step"].max()) >= s["step"]:
            raise InputError(
                "state['buffer_step']",
                f"steps before the state's step counter {s['step']} (entries are added by a finished step)",
                f"a step up to {int(s['buffer_step'].max())}",
                "pass PilotCommit.state_dict()",
            )
        order = s.get("buffer_order")
        self._step = s["step"]
        self._buf_ids, self._buf_std, self._buf_step = s["buffer_ids"], s["buffer_std"], s["buffer_step"]
        self._buf_order = torch.zeros_like(self._buf_ids) if order is None else order
        self._evicted = s["evicted"]
        self._gen.set_state(s["generator"])
