"""E3: a difficulty-ranked budget (:class:`E3Budget`, :func:`e3_counts`) and E3's entropy-targeting temperature
schedule (:class:`E3Temperature`, :func:`e3_temperature_step`).

The allocator speaks the protocol of :mod:`rolloutopt.allocators._base` and decides before rollout from a rank
kept across epochs (one request, arXiv 2505.18573). No Python loop over prompts or rollouts. See
``docs/methods/difficulty.md``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_bool as _bool
from rolloutopt._validation import describe
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    _int,
    _real,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._ids import _sort_ids
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatAny, FloatB, FloatP, IntP

__all__ = ["E3Budget", "E3Temperature", "e3_counts", "e3_temperature_step"]

_EPS = 1e-9  # ceil/floor tolerance: 24.000000001 must ceil to 24 (a DARS edge case)
_UNSEEN_RANK = -100.0  # E3's rank of a never-seen prompt (weight 0)


# -- validation helpers -------------------------------------------------------------------------------------------


def _greedy(headroom: Tensor, units: Tensor | int) -> Tensor:
    """Give ``units`` to the rows in order, each up to its ``headroom`` (E3's leftover loop, vectorised)."""
    before = torch.cumsum(headroom, 0) - headroom
    return (torch.as_tensor(units) - before).clamp(min=0).minimum(headroom)


# -- E3 budget ----------------------------------------------------------------------------------------------------
def e3_counts(rank: FloatP, budget: int, n_min: int, n_max: int, *, cap_share: bool = True) -> IntP:
    r"""E3's rollout counts from difficulty ranks (``get_rollout_n_per_prompt``, arXiv 2505.18573).

    Every prompt starts with :math:`n_{min}`; the spare budget :math:`S = N - P\,n_{min}` is split in proportion
    to the rank weights :math:`w_i = \max(\mathrm{rank}_i, 0)` (rank -100, never seen, weighs 0) and floored;
    leftover units go to the prompts in descending rank order (ties: the earlier row), each up to :math:`n_{max}`:

    .. math::

        c_i = n_{min} + \Big\lfloor S\,\frac{w_i}{\sum_j w_j} \Big\rfloor
        \quad (\texttt{cap\_share=False}: \text{the code, } \textstyle\sum_j w_j + 10^{-8}),

    ``cap_share=True`` (default) **fixes the code quirk**: the code never caps the
    proportional share at :math:`n_{max}`, so one very hard prompt can exceed it. Here the share is water-filled:
    :math:`\min(n_{max} - n_{min},\ S_k w_i / W_k)` where the :math:`k` highest-weight prompts are capped and
    :math:`S_k, W_k` are the spare and the weight left after them, then floored; the leftover rule is the code's.
    ``cap_share=False`` reproduces the code (counts may exceed ``n_max``).

    Args:
        rank: float ``[P]``, ranks in [0, 1) or -100 (rows in the order the counts should come back).
        budget: total rollouts; must be at least ``P * n_min`` (:class:`E3Budget` handles smaller budgets).
        n_min, n_max: per-prompt caps (``1 <= n_min <= n_max``).
        cap_share: clip and redistribute the proportional share (True) or reproduce the code (False).

    Returns:
        int64 ``[P]``; sums to ``min(budget, P * n_max)`` when ``cap_share`` (the code's version may leave units
        unspent only when every prompt is at ``n_max``). Empty ``rank`` gives an empty tensor.
    """
    if not isinstance(rank, Tensor) or not rank.is_floating_point() or rank.ndim != 1:
        raise InputError("rank", "a 1-d float tensor of ranks [P]", describe(rank), "pass E3Budget.ranks(ids)")
    if not bool(((rank == _UNSEEN_RANK) | ((rank >= 0) & (rank <= 1))).all()):
        raise InputError("rank", "ranks in [0, 1] or -100 (never seen)", describe(rank), "pass E3Budget.ranks(ids)")
    _int(n_min, "n_min", 1)
    _int(n_max, "n_max", n_min)
    check_budget(budget)
    p = rank.numel()
    if budget < p * n_min:
        raise InputError("budget", f">= P * n_min = {p * n_min}", repr(budget), "raise the budget or lower n_min")
    w = torch.where(rank == _UNSEEN_RANK, 0.0, rank.double()).clamp(min=0)
    spare = budget - p * n_min
    head = n_max - n_min
    wsum = float(w.sum())
    order = torch.sort(w, descending=True, stable=True).indices  # descending rank, ties: the earlier row
    if wsum <= 0:
        share = torch.zeros(p, dtype=torch.long)
    elif not cap_share:
        share = torch.floor(spare * (w / (wsum + 1e-8))).long()
    else:
        ws = w[order]
        m = int((ws > 0).sum())
        k_idx = torch.arange(m, dtype=torch.float64)
        s_k = spare - k_idx * head  # spare left when the first k are capped
        w_k = torch.flip(torch.cumsum(torch.flip(ws[:m], [0]), 0), [0])  # weight left from k on
        fits = s_k * ws[:m] <= head * w_k * (1 + 1e-12)
        k = int(torch.argmax(fits.long())) if bool(fits.any()) else m
        cont = torch.zeros(p, dtype=torch.float64)
        cont[:k] = head
        if k < m:
            cont[k:m] = float(s_k[k]) * ws[k:m] / float(w_k[k])
        share = torch.zeros(p, dtype=torch.long)
        share[order] = torch.floor(cont + _EPS).long().clamp(max=head)
    counts = n_min + share
    left = budget - int(counts.sum())
    if left > 0:
        counts[order] += _greedy((n_max - counts[order]).clamp(min=0), left)
    return counts


_E3_NAMES = ("ranked", "unseen", "capped", "no_budget")


class _E3Plan(Conversation):
    reason_names = _E3_NAMES

    def __init__(self, prompt_ids: Tensor, budget: int, counts: Tensor, reasons: Tensor) -> None:
        super().__init__(prompt_ids, budget)
        self._counts, self._reasons, self._sent = counts, reasons, False

    def decide(self) -> Request | None:
        if self._sent:
            return None
        self._sent = True
        keep = self._counts > 0
        return self.request(keep, self._counts[keep]) if bool(keep.any()) else None

    def select(self) -> tuple[FloatB, IntP]:
        return torch.ones(self.spent_observed, dtype=torch.float64), self._reasons


class E3Budget(TableOwner):
    r"""E3: more rollouts for prompts that ranked harder at the last epoch end (arXiv 2505.18573, EMNLP 2025).

    Code ``LiaoMengqi/E3-RL4LLMs`` (``e3/trainer/ray_trainer.py`` ``get_rollout_n_per_prompt``,
    ``e3/data/rl_dataset.py`` ``update_prompt_stats``/``update_rank``; ``docs/methods/difficulty.md``).

    *State*, per prompt id (columns of a :class:`~rolloutopt.allocators.PromptTable`): cumulative reward sum and
    rollout count over all steps, and a rank. At :meth:`end_epoch` the ranked prompts are sorted by mean reward,
    descending (ties: the lower id), and :math:`\mathrm{rank} = \mathrm{position}/K`, so 0 is the easiest. Which
    prompts are ranked, and so :math:`K` (at most ``capacity`` prompts are stored: an evicted one is unknown
    again):

    - ``dataset_ids=None`` (default): the *known* prompts (rolled out at least once, or ranked before);
      :math:`K` is their number. A prompt not rolled out before the last epoch end keeps rank -100 (weight 0:
      ``n_min`` plus any leftover) until the next epoch end that knows it. **This is not what the code does.**
    - ``dataset_ids`` given (the training set's prompt ids): **the code's rule**. The code's
      ``update_rank`` (``e3/data/rl_dataset.py``) sorts *every* data-set row, a row never rolled out keyed as
      mean reward 0 (``sample_count == 0``), and divides by the data-set size. So at an epoch end an unseen
      prompt gets a real rank, not -100: with rewards in [0, 1] it sorts with the all-wrong prompts, at the hard
      end (and, by Python's stable sort, before those of them with a higher row index). Here the union of the
      known ids and ``dataset_ids`` is ranked, an unknown id with mean 0, and :math:`K` is the size of that
      union (the data-set size when every rolled-out id is in ``dataset_ids``). The code's -100 is only the
      value before its first epoch end (no ``rank`` column in the data), as it is here.

    The caps follow the code's schedule: both start at ``n`` and after each epoch

    .. math::

        n_{min} \leftarrow \max(n_{min} - n_{update}, n_{low}), \qquad
        n_{max} \leftarrow \min(n_{max} + n_{update}, n_{high}).

    *Per plan*: one request with :func:`e3_counts` (``cap_share=True``: the proportional share is clipped at
    :math:`n_{max}` and redistributed, a deliberate fix of the code quirk; ``cap_share=False`` reproduces the code,
    whose counts can exceed ``n_max``). A budget below :math:`P\,n_{min}` gives :math:`n_{min}` to the
    ``budget // n_min`` hardest prompts (descending rank, ties the lower id) and runs :func:`e3_counts` on them;
    the others get ``"no_budget"`` (the project's rule; the code clips the budget up instead). The whole budget
    is spent up to :math:`P\,n_{max}`. Every rollout trains (weight 1).

    Epochs: call :meth:`end_epoch` at each epoch end, or pass ``steps_per_epoch`` and it runs after that many
    :meth:`update` calls.

    Defaults: the 7B launch script ``scripts/train_7b.sh`` (``n=8``, ``n_low=4``, ``n_high=12``, ``n_update=2``);
    the config file has ``n_low=2``, ``n_high=16``, ``n_update=0`` (caps frozen at ``n``: uniform). The
    temperature schedule is separate: :class:`E3Temperature`. The README's length bias is not implemented.

    Args:
        n: rollouts per prompt in epoch 1 (initial ``n_min = n_max = n`` unless given).
        n_low, n_high: bounds of the cap schedule (``n_low <= n_min``, ``n_max <= n_high``).
        n_update: cap change per epoch.
        n_min, n_max: initial caps (None: ``n``).
        cap_share: see above.
        steps_per_epoch: updates per epoch, or None (call :meth:`end_epoch`).
        dataset_ids: the training set's prompt ids (int ``[D]``, distinct, at most the table's capacity), to rank
            unseen prompts as the code does (see *State*); None ranks the known prompts only.
        seed: unused (the allocation is deterministic), kept for a uniform constructor.
        capacity: prompts kept in a private table (default None: 1,000,000; least recently updated evicted, and
            an evicted prompt is then unknown again: rank -100 until an epoch end that knows it).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); E3Budget
            registers ``sum``, ``count`` and ``rank`` as owner ``"e3_budget"``, and the caller saves a shared
            table once.

    Reasons: ``"ranked"`` (rank > 0 share), ``"unseen"`` (rank -100 or 0: ``n_min`` plus any leftover),
    ``"capped"`` (at ``n_max``, when ``n_max > n_min``), ``"no_budget"``.
    """

    reference: ClassVar[str] = "arXiv 2505.18573 (E3's difficulty-ranked budget); code LiaoMengqi/E3-RL4LLMs"
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        n: int = 8,
        n_low: int = 4,
        n_high: int = 12,
        n_update: int = 2,
        n_min: int | None = None,
        n_max: int | None = None,
        cap_share: bool = True,
        steps_per_epoch: int | None = None,
        dataset_ids: IntP | None = None,
        seed: int = 0,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        _int(n, "n", 1)
        _int(n_low, "n_low", 1)
        _int(n_high, "n_high", n_low)
        _int(n_update, "n_update", 0)
        _int(n_min, "n_min", 1, none=True)
        _int(n_max, "n_max", 1, none=True)
        lo = n if n_min is None else n_min
        hi = n if n_max is None else n_max
        if not n_low <= lo:
            raise InputError("n_min", f"n_low = {n_low} <= n_min", repr(lo), "raise n_min (or n) or lower n_low")
        if not lo <= hi <= n_high:
            raise InputError("n_max", f"n_min = {lo} <= n_max <= n_high = {n_high}", repr(hi), "fix the caps")
        _bool(cap_share, "cap_share")
        _int(steps_per_epoch, "steps_per_epoch", 1, none=True)
        _int(seed, "seed", 0)
        self.n, self.n_low, self.n_high, self.n_update = n, n_low, n_high, n_update
        self.cap_share, self.steps_per_epoch, self.seed = cap_share, steps_per_epoch, seed
        self.n_min, self.n_max = lo, hi
        self.dataset_ids: Tensor | None = None
        if dataset_ids is not None:
            ds = as_prompt_ids(dataset_ids, "dataset_ids")
            uniq = torch.unique(ds)  # sorted
            if uniq.numel() != ds.numel():  # as_prompt_ids skips this check when checks are off
                raise InputError("dataset_ids", "distinct prompt ids", describe(dataset_ids), "pass each id once")
            self.dataset_ids = uniq
        self._epoch = 0
        self._steps = 0
        self._cols = open_table(
            table,
            capacity,
            "e3_budget",
            {
                "sum": Column("float", (), 0.0, ("finite",)),
                "count": Column("int", (), 0, ("nonneg",)),
                # position / K in [0, 1), or -100 (no rank yet; also the fill): checked by load_state_dict
                "rank": Column("float", (), _UNSEEN_RANK, ("finite",)),
            },
        )
        if self.dataset_ids is not None and self.dataset_ids.numel() > self.table.capacity:
            raise InputError(
                "dataset_ids",
                f"at most the table's capacity = {self.table.capacity} prompts (every data-set prompt is ranked)",
                f"{self.dataset_ids.numel()} prompts",
                "raise capacity (or the shared PromptTable's)",
            )

    @property
    def epoch(self) -> int:
        """Epochs ended so far."""
        return self._epoch

    def ranks(self, prompt_ids: IntP) -> FloatP:
        """Current rank per prompt (float64 ``[P]``; -100 for prompts without one)."""
        return self._ranks(as_prompt_ids(prompt_ids))

    def _ranks(self, ids: Tensor) -> Tensor:
        if self._cols.empty:
            return torch.full(ids.shape, _UNSEEN_RANK, dtype=torch.float64)
        pos, seen = self._cols.find(ids)
        return torch.where(seen, self._cols["rank"][pos], _UNSEEN_RANK)

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """One request with the rank-proportional counts (see the class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        rank = self._ranks(ids)
        k = min(p, budget // self.n_min)
        counts = torch.zeros(p, dtype=torch.long)
        by_id = _sort_ids(ids)[1]  # rows by id: e3_counts breaks ties toward the earlier row
        sel = by_id
        if k < p:  # short budget: the k hardest (descending rank, ties the lower id)
            sel = by_id[torch.sort(rank[by_id], descending=True, stable=True).indices][:k]
            sel = sel[torch.sort(ids[sel]).indices]
        if k:
            counts[sel] = e3_counts(rank[sel], budget, self.n_min, self.n_max, cap_share=self.cap_share)
        w = (rank > 0) & (rank != _UNSEEN_RANK)
        reasons = torch.where(
            counts == 0, 3, torch.where((counts >= self.n_max) & (self.n_max > self.n_min), 2, torch.where(w, 0, 1))
        )
        return _E3Plan(ids, budget, counts, reasons)

    def update(self, result: AllocationResult) -> None:
        """Add the step's per-prompt reward sums and counts; end the epoch after ``steps_per_epoch`` updates."""
        _check_result(result)
        ids = result.plan_prompt_ids
        played = result.counts > 0
        s = torch.bincount(result.group, weights=result.rewards.double(), minlength=ids.numel()).double()
        if bool(played.any()):
            pos, order = self._cols.add(ids[played])  # a new prompt: sum 0, count 0, rank -100 (the fills)
            self._cols["sum"].index_add_(0, pos, s[played][order])
            self._cols["count"].index_add_(0, pos, result.counts[played][order])
        self._steps += 1
        if self.steps_per_epoch is not None and self._steps % self.steps_per_epoch == 0:
            self.end_epoch()

    def end_epoch(self) -> None:
        """Re-rank the prompts by mean reward (descending) and move the caps one step (``n_update``).

        Ranked: the known prompts, plus (if ``dataset_ids`` was given) every data-set id, an unseen one with
        mean reward 0 as in the code's ``update_rank``; see the class docstring."""
        cols = self._cols
        if self.dataset_ids is not None:
            new = self.dataset_ids
            if not cols.empty:
                new = new[~cols.find(new)[1]]
            if new.numel():
                cols.add(new)  # sum 0, count 0 (the fills): ranked as mean reward 0, as the code
        if not cols.empty:
            known = cols["seen"]
            rows = None if bool(known.all()) else known.nonzero().squeeze(1)  # a shared table: E3's rows only
            sums, cnt = cols["sum"], cols["count"]
            if rows is not None:
                sums, cnt = sums[rows], cnt[rows]
            k = sums.numel()
            mean = sums / cnt.double().clamp(min=1)
            order = torch.sort(mean, descending=True, stable=True).indices  # ids are sorted: ties -> lower id
            rank = torch.empty(k, dtype=torch.float64)
            rank[order] = torch.arange(k, dtype=torch.float64) / k
            if rows is None:
                cols["rank"] = rank
            else:
                cols["rank"][rows] = rank
        self.n_min = max(self.n_min - self.n_update, self.n_low)
        self.n_max = min(self.n_max + self.n_update, self.n_high)
        self._epoch += 1

    STATE: ClassVar[dict[str, Field]] = {
        "table": TableColumns.FIELD,
        "n_min": Field("integer", low=1),  # and n_low <= n_min <= n_max <= n_high (checked after load_state)
        "n_max": Field("integer", low=1),
        "epoch": Field("integer", low=0),
        "steps": Field("integer", low=0),
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`; the table validates its
    columns)."""

    def state_dict(self) -> dict[str, Any]:
        """The table (reward sums, counts, ranks; the rows only when the table is private), the caps, epoch and
        step counters (copies)."""
        return dump_state(
            {
                "table": self._cols.state(),
                "n_min": self.n_min,
                "n_max": self.n_max,
                "epoch": self._epoch,
                "steps": self._steps,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one);
        the caps must lie in this allocator's ``[n_low, n_high]`` and the ranks in ``[0, 1)`` or be -100 (for a
        shared table, the table loaded by the caller is checked)."""
        s = load_state(state, self.STATE, "E3Budget")
        cols, at = self._cols.incoming(s["table"])
        rank = cols["rank"]
        if bool(((rank != _UNSEEN_RANK) & ((rank < 0) | (rank >= 1))).any()):
            raise InputError(
                f"{at}[{self._cols.owner + '/rank'!r}]",
                f"ranks in [0, 1) or {_UNSEEN_RANK} (none)",
                describe(rank),
                "pass state_dict()",
            )
        if not self.n_low <= s["n_min"] <= self.n_high:
            raise InputError(
                "state['n_min']",
                f"n_low = {self.n_low} <= n_min <= n_high = {self.n_high}",
                repr(s["n_min"]),
                "pass the state_dict() of an E3Budget with the same n_low and n_high",
            )
        if not s["n_min"] <= s["n_max"] <= self.n_high:
            raise InputError(
                "state['n_max']",
                f"n_min = {s['n_min']} <= n_max <= n_high = {self.n_high}",
                repr(s["n_max"]),
                "pass the state_dict() of an E3Budget with the same n_low and n_high",
            )
        self._cols.load(s["table"])
        self.n_min, self.n_max = s["n_min"], s["n_max"]
        self._epoch, self._steps = s["epoch"], s["steps"]


# -- E3 temperature -----------------------------------------------------------------------------------------------
def e3_temperature_step(temperature: float, target_entropy: float, entropy: float, vocab_size: int) -> float:
    r"""One step of E3's entropy-targeting temperature rule (``temperature_scheduler.py``, arXiv 2505.18573).

    .. math::

        T \leftarrow T\Big(1 + T\,\frac{\ln(H^*/H)}{\ln V + \ln\ln V}\Big)

    (entropy below target raises T). No clipping here (the code has none; :class:`E3Temperature` clips).

    Args:
        temperature: current T (> 0).
        target_entropy: H* (> 0).
        entropy: the actor's mean token entropy of the last update, H (> 0).
        vocab_size: V (>= 3, so that ln ln V > 0).

    Returns:
        The new temperature (a float; may be <= 0 for H far above H* with a large T — clip it).
    """
    _real(temperature, "temperature", 0.0, math.inf, open_low=True)
    _real(target_entropy, "target_entropy", 0.0, math.inf, open_low=True)
    _real(entropy, "entropy", 0.0, math.inf, open_low=True)
    _int(vocab_size, "vocab_size", 3)
    factor = math.log(vocab_size) + math.log(math.log(vocab_size))
    t = float(temperature)
    return t * (1 + t * math.log(float(target_entropy) / float(entropy)) / factor)


class E3Temperature:
    r"""E3's sampling-temperature schedule: steer the policy entropy to a target (arXiv 2505.18573).

    Code ``e3/worker/temperature_scheduler.py`` (``TemperatureScheduler``). Call :meth:`step` once per
    training step with the actor's mean token entropy; read :attr:`temperature` for the next rollout.

    - During the first ``init_steps`` steps the entropies are only recorded; :math:`H^*` is their mean unless
      ``target_entropy`` is given.
    - Each later step applies :func:`e3_temperature_step`.
    - Annealing (``max_steps`` given; the code's ``enable_annealing``): from step
      :math:`s_a = \text{max\_steps} - \lfloor \text{max\_steps}\cdot\text{annealing\_ratio} \rfloor` on, after the
      update, :math:`H^* = H^*_0\,(f + (1-f)\,\tfrac12(1+\cos(\pi\,(s - s_a)/(\text{max\_steps} - s_a))))`,
      with :math:`f` = ``annealing_factor`` (applies to the next step's update, as in the code).
    - Clipping: the code has none; we add it. ``t_min=0.1``, ``t_max=2.0`` are the project's safety
      bounds (not from the paper; they bind only when the rule runs away); ``t_min=None, t_max=None`` reproduces
      the code exactly.

    Defaults from the code: ``init_temperature=1.0``, ``init_steps=1``, ``target_entropy=None``,
    ``annealing_ratio=0.4``, ``annealing_factor=0.9``; annealing off (``max_steps=None``).

    The keywords ``init_temperature``, ``init_steps``, ``target_entropy``, ``max_steps``, ``annealing_ratio``,
    ``annealing_factor``, ``t_min`` and ``t_max`` are described above.

    Args:
        vocab_size: V of the tokenizer (>= 3).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        init_temperature: float = 1.0,
        init_steps: int = 1,
        target_entropy: float | None = None,
        max_steps: int | None = None,
        annealing_ratio: float = 0.4,
        annealing_factor: float = 0.9,
        t_min: float | None = 0.1,
        t_max: float | None = 2.0,
    ) -> None:
        _int(vocab_size, "vocab_size", 3)
        _real(init_temperature, "init_temperature", 0.0, math.inf, open_low=True)
        _int(init_steps, "init_steps", 0)
        _real(target_entropy, "target_entropy", 0.0, math.inf, none=True, open_low=True)
        if init_steps == 0 and target_entropy is None:
            raise InputError("init_steps", ">= 1 when target_entropy is None", "0", "pass init_steps=1")
        _int(max_steps, "max_steps", 1, none=True)
        _real(annealing_ratio, "annealing_ratio", 0.0, 1.0)
        _real(annealing_factor, "annealing_factor", 0.0, 1.0)
        _real(t_min, "t_min", 0.0, math.inf, none=True, open_low=True)
        _real(t_max, "t_max", 0.0, math.inf, none=True, open_low=True)
        if t_min is not None and t_max is not None and t_min > t_max:
            raise InputError("t_max", f">= t_min = {t_min}", repr(t_max), "raise t_max")
        self.vocab_size, self.init_steps, self.max_steps = vocab_size, init_steps, max_steps
        self.annealing_ratio, self.annealing_factor = float(annealing_ratio), float(annealing_factor)
        self.t_min = None if t_min is None else float(t_min)
        self.t_max = None if t_max is None else float(t_max)
        self.temperature = float(init_temperature)
        self.target_entropy = None if target_entropy is None else float(target_entropy)
        self._initial_target = self.target_entropy
        self._steps = 1
        self._init_entropy: list[float] = []

    def step(self, entropy: float | FloatAny) -> float:
        """Record or act on one step's mean token entropy (a float, or a tensor whose mean is used);
        returns the temperature for the next rollout."""
        if isinstance(entropy, Tensor):
            if entropy.numel() == 0 or not entropy.is_floating_point():
                raise InputError("entropy", "a float or non-empty float tensor", describe(entropy), "pass the mean")
            entropy = float(entropy.double().mean())
        _real(entropy, "entropy", 0.0, math.inf, open_low=True)
        h = float(entropy)
        if self._steps <= self.init_steps:
            self._init_entropy.append(h)
        else:
            if self.target_entropy is None:
                self.target_entropy = sum(self._init_entropy) / len(self._init_entropy)
                self._initial_target = self.target_entropy
            t = e3_temperature_step(self.temperature, self.target_entropy, h, self.vocab_size)
            if self.t_min is not None:
                t = max(t, self.t_min)
            if self.t_max is not None:
                t = min(t, self.t_max)
            self.temperature = t
            if self.max_steps is not None:
                m = self.max_steps
                start = m - int(m * self.annealing_ratio)
                if self._steps >= start and m > start:
                    progress = (self._steps - start) / (m - start)
                    cos = 0.5 * (1 + math.cos(math.pi * progress))
                    f = self.annealing_factor
                    assert self._initial_target is not None
                    self.target_entropy = self._initial_target * ((1 - f) * cos + f)
        self._steps += 1
        return self.temperature

    STATE: ClassVar[dict[str, Field]] = {
        "temperature": Field("real"),  # unbounded: without t_min the rule may drive it to <= 0 (the code's quirk)
        "target_entropy": Field("any"),  # None (not yet known) or a finite number >= 0: checked by load_state_dict
        "initial_target": Field("any"),  # None or a finite number > 0: checked by load_state_dict
        "steps": Field("integer", low=1),
        "init_entropy": Field("any"),  # a list of finite numbers > 0 (recorded entropies): checked by load_state_dict
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """Temperature, targets, step counter and the recorded initial entropies."""
        return dump_state(
            {
                "temperature": self.temperature,
                "target_entropy": self.target_entropy,
                "initial_target": self._initial_target,
                "steps": self._steps,
                "init_entropy": list(self._init_entropy),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "E3Temperature")

        def number(x: Any, positive: bool) -> bool:
            ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            return ok and (x > 0 if positive else x >= 0)

        for key, positive in (("target_entropy", False), ("initial_target", True)):
            if s[key] is not None and not number(s[key], positive):
                want = f"None or a finite number {'> 0' if positive else '>= 0'}"
                raise InputError(f"state[{key!r}]", want, describe(s[key]), "pass E3Temperature.state_dict()")
        ent = s["init_entropy"]
        if not isinstance(ent, list) or not all(number(x, True) for x in ent):
            raise InputError(
                "state['init_entropy']",
                "a list of finite entropies > 0",
                describe(ent),
                "pass E3Temperature.state_dict()",
            )
        self.temperature = float(s["temperature"])
        self.target_entropy = None if s["target_entropy"] is None else float(s["target_entropy"])
        self._initial_target = None if s["initial_target"] is None else float(s["initial_target"])
        self._steps = s["steps"]
        self._init_entropy = [float(x) for x in ent]
