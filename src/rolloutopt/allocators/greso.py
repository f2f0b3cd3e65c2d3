"""GRESO — pre-rollout probabilistic skipping of prompts whose recent groups had zero variance.

Reference: "Act Only When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective Rollouts"
(GRESO), arXiv 2506.02177; code ``Infini-AI-Lab/GRESO``: ``verl/trainer/ttis/presampling_selector.py``
(``DataProfiler.easy_probabilistic_skip`` / ``hard_probabilistic_skip``) and ``verl/trainer/ppo/ray_trainer.py``
(``fit``: the self-tuning ``p_easy``/``p_hard`` and the adaptive sampling batch size); launch script
``train-scripts/math_qwen_1_5b_dm_greso.sh``; ``docs/methods/greso.md``.

The per-prompt trace of the code (a list of (epoch, group mean) pairs that grows without bound) is replaced by
the two run lengths the rule reads, which is equivalent for it: two int64 columns of a bounded
:class:`~rolloutopt.allocators.table.PromptTable` (sorted prompt ids, looked up with ``torch.searchsorted``),
O(1) memory per prompt and no Python loop over prompts.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, ClassVar

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import describe
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
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
from rolloutopt.typing import FloatAny, FloatB, FloatP, IntB, IntP

__all__ = ["GRESO", "greso_skip_probability"]


def greso_skip_probability(run_length: Int[Tensor, " ..."], p: float, *, floor: float = 0.01) -> FloatAny:
    r"""GRESO's skip probability of a prompt whose last ``run_length`` groups were all easy (or all hard).

    .. math::

        P_\text{skip}(k) = 1 - \max\!\left(p^{k},\ \text{floor}\right),

    so a prompt with no such run (:math:`k = 0`) is never skipped and any prompt is re-tried with probability at
    least ``floor`` (code: 0.01). Reference: arXiv 2506.02177, ``DataProfiler.easy_probabilistic_skip``.

    Args:
        run_length: int ``[P]`` (any shape), :math:`k \ge 0`.
        p: the exploration probability ``p_easy`` or ``p_hard``, in ``[0, 1]``.
        floor: the least keep probability (code 0.01).

    Returns:
        float64 tensor of the shape of ``run_length``.
    """
    if not isinstance(run_length, Tensor) or run_length.is_floating_point() or run_length.dtype == torch.bool:
        raise InputError("run_length", "an integer tensor", describe(run_length), "pass run lengths as int64")
    if bool((run_length < 0).any()):
        raise InputError("run_length", "non-negative run lengths", "negative values", "count runs from 0")
    p = _check_float(p, "p", 0.0, 1.0, "pass p in [0, 1]")
    floor = _check_float(floor, "floor", 0.0, 1.0, "pass e.g. floor=0.01")
    keep = torch.pow(torch.tensor(p, dtype=torch.float64), run_length.to(torch.float64))
    return 1.0 - keep.clamp(min=floor)


class _GRESOPlan(Conversation):
    reason_names = ("kept", "zero_variance", "surplus", "skip_easy", "skip_hard", "not_reached")

    def __init__(self, owner: GRESO, prompt_ids: Tensor, budget: int, skip_easy: Tensor, skip_hard: Tensor) -> None:
        super().__init__(prompt_ids, budget)
        self._o = owner
        self._skip_easy = skip_easy
        self._skip_hard = skip_hard
        self._eligible = (~(skip_easy | skip_hard)).nonzero().flatten()
        self._cursor = 0
        self._reached = 0  # planned positions [0, _reached) were read (the dataloader got that far)
        self._batch = owner.sampling_batch_size
        self._last = False
        self._done = False
        self._round_pos: Tensor | None = None
        self._hi = torch.full((prompt_ids.numel(),), -torch.inf, dtype=torch.float64)
        self._lo = torch.full((prompt_ids.numel(),), torch.inf, dtype=torch.float64)
        self.rounds = 0
        self.batch_sizes: list[int] = []

    def on_observe(self, pos: IntB, rewards: FloatB) -> None:
        self._hi.scatter_reduce_(0, pos, rewards, "amax")
        self._lo.scatter_reduce_(0, pos, rewards, "amin")

    def _zero_variance(self) -> Tensor:
        """Per planned prompt: rolled out and all its rewards equal (bool ``[P]``)."""
        return (self._n > 0) & (self._hi == self._lo)

    def decide(self) -> Request | None:
        o = self._o
        if self._done:
            return None
        if self._round_pos is not None:  # the round just observed decides whether and how much to sample again
            if not o.filter_zero_variance:
                self._done = True
                return None
            zv = self._zero_variance()
            kept = int(((self._n > 0) & ~zv).sum())
            if kept >= o.train_batch_size or self._last:
                self._done = True
                return None
            z = float(zv[self._round_pos].double().mean())
            missing = (o.train_batch_size - kept) * o.n
            if z < 1.0:
                estimate = int(missing / (1.0 - z) / o.n * o.oversample)
                self._last = estimate <= o.sampling_batch_size
            else:  # the code divides by zero here; sample a full batch again instead
                estimate = o.sampling_batch_size
            self._batch = max(min(estimate, o.sampling_batch_size), o.min_sampling_batch_size)
        rest = self._eligible[self._cursor :]
        lb = o.loader_batch_size
        if lb is None:
            take = rest[: self._batch]
        else:  # the code's granularity: whole loader batches until their survivors reach the round size
            last = int(rest[min(self._batch, rest.numel()) - 1]) // lb if rest.numel() else 0
            take = rest[rest // lb <= last]
        remaining = self.budget - self.spent
        counts = _fill(take.numel(), min(remaining, take.numel() * o.n), o.n, o.n_min, o.n_max)
        go = counts > 0
        if not bool(go.any()):
            self._done = True
            return None
        take, counts = take[go], counts[go]
        reached = int(take[-1]) + 1
        if lb is not None and bool(go.all()):  # the whole last loader batch was read
            reached = min(self.prompt_ids.numel(), (reached - 1) // lb * lb + lb)
        self._cursor += take.numel()
        self._reached = max(self._reached, reached)
        self._round_pos = take
        self.rounds += 1
        self.batch_sizes.append(int(take.numel()))
        return self.request(take, counts)

    def _kept(self) -> tuple[Tensor, Tensor]:
        rolled = self._n > 0
        if not self._o.filter_zero_variance:
            return rolled, torch.zeros_like(rolled)
        zv = self._zero_variance()
        varied = rolled & ~zv
        kept = varied & (torch.cumsum(varied.long(), 0) <= self._o.train_batch_size)
        return kept, zv

    def select(self) -> tuple[FloatB, IntP]:
        pos, _ = self.rollouts()
        kept, zv = self._kept()
        rolled = self._n > 0
        reached = torch.zeros_like(rolled)
        reached[: self._reached] = True
        reasons = torch.full((self.prompt_ids.numel(),), 5, dtype=torch.long)
        reasons[reached & self._skip_hard] = 4
        reasons[reached & self._skip_easy] = 3
        reasons[rolled] = 2
        reasons[rolled & zv] = 1
        reasons[kept] = 0
        return kept.double().index_select(0, pos), reasons

    def finish(self) -> AllocationResult:
        result = super().finish()
        reasons = result.reasons
        reached = reasons != 5
        rolled = result.counts > 0
        f64 = torch.float64
        zero = torch.tensor(0.0, dtype=f64)
        extra = {
            "rounds": torch.tensor(float(self.rounds), dtype=f64),
            "skip_easy_frac": (reasons[reached] == 3).to(f64).mean() if bool(reached.any()) else zero,
            "skip_hard_frac": (reasons[reached] == 4).to(f64).mean() if bool(reached.any()) else zero,
            "zero_variance_frac": (reasons[rolled] == 1).to(f64).mean() if bool(rolled.any()) else zero,
            "kept_prompts": (reasons == 0).to(f64).sum(),
            "p_easy": torch.tensor(self._o.p_easy, dtype=f64),
            "p_hard": torch.tensor(self._o.p_hard, dtype=f64),
        }
        return dataclasses.replace(result, metrics={**result.metrics, **extra})


class GRESO(TableOwner):
    r"""GRESO: skip, before rollout, prompts whose recent groups were all solved or all failed, with a probability.

    Per prompt, :math:`k_e` counts its last consecutive rolled-out groups with mean reward
    :math:`\ge 0.98` and :math:`k_h` those with mean :math:`\le 0.11` (at most one is non-zero). ``plan`` draws,
    for each candidate,

    .. math::

        \text{skip\_easy} \sim \mathrm{Bernoulli}\big(1 - \max(p_e^{k_e}, 0.01)\big), \quad
        \text{else skip\_hard} \sim \mathrm{Bernoulli}\big(1 - \max(p_h^{k_h}, 0.01)\big)

    (:func:`greso_skip_probability`); a prompt never rolled out is never skipped. The surviving candidates are
    rolled out in their given order (the dataloader's) with DAPO dynamic sampling: ``n`` rollouts each, in rounds
    of ``sampling_batch_size`` prompts; zero-variance groups get weight 0; once ``train_batch_size`` prompts with
    variance are collected the step ends and later ones are ``"surplus"`` (weight 0, the code's
    ``select_batch_slice``). Between rounds the next round's size adapts to what is missing:

    .. math::

        B_\text{next} = \mathrm{clamp}\!\left(\Big\lfloor 1.25\,\frac{R}{(1 - z)\,n} \Big\rfloor,\ 64,\
        \text{sampling\_batch\_size}\right),

    :math:`R` the missing trajectories, :math:`z` the zero-variance fraction of the last round; when the estimate
    is at most ``sampling_batch_size`` that round is the last and a short batch is accepted.

    **Round granularity.** By default a round is exactly the next :math:`B` surviving candidates (the last
    dataloader batch may be split between rounds). The code cannot split: its dataloader yields batches of
    ``data.train_batch_size`` prompts (32 in the script), each is skip-filtered, and survivors accumulate until
    there are at least :math:`B`; the round is *all* of them, so it overshoots :math:`B` by up to one loader
    batch. ``loader_batch_size=32`` reproduces that (candidates are read in consecutive blocks of that many, in
    the given order). Still left out: the code then trims a round to a multiple of ``n_gpus_per_node``,
    discarding the rest for the epoch, and carries a part-filled accumulation into the next epoch.

    After each step
    (``update``), from epoch ``adapt_from_epoch`` on, the exploration probabilities track their targets
    (:math:`\text{target}/3` easy, :math:`2\,\text{target}/3` hard):

    .. math::

        p \leftarrow \begin{cases} \max(p - 0.01,\ p_\min) & \text{ratio} \ge \text{target} \\
        \min(p + 0.01,\ p_\max) & \text{otherwise,} \end{cases}

    the ratio being the fraction of the step's rolled-out groups that were all-correct (easy) or all-wrong
    (hard).

    Reference: arXiv 2506.02177; code ``Infini-AI-Lab/GRESO`` (``presampling_selector.py``, ``ray_trainer.py``
    ``fit``), script ``math_qwen_1_5b_dm_greso.sh`` (``docs/methods/greso.md``). Defaults: ``p_easy = p_hard
    = 0.5``, ``min_p = 0.05``, ``max_p = 0.95``, step 0.01, ``target_zero_variance = 0.25``, floor 0.01 and the
    thresholds 0.98 / 0.11 (code); ``n = 8``, ``train_batch_size = 256``, ``sampling_batch_size = 384``
    (script); 1.25 and 64 (code; the floor is ``min(64, sampling_batch_size)`` here, where the code's
    hard-coded 64 would exceed a smaller ``sampling_batch_size``).

    Code behaviour kept deliberately: **p adapts only after epoch 0**
    (``epoch > 0`` in the code, ``adapt_from_epoch = 1`` here; tell the allocator the epoch with
    :meth:`set_epoch`, as with a ``DistributedSampler``, or pass ``steps_per_epoch``). The step's ratio
    counters reset every step, epoch 0 included, as in the code. If neither is done, p would silently stay at
    its initial value forever, so ``update`` **warns once** (``UserWarning``) when a prompt is rolled out a
    second time while the epoch is still below ``adapt_from_epoch``: in a dataloader that is the sign of a new
    epoch nobody announced. A warning rather than an error, because an RL engineer expects a long run not to
    die mid-training over a schedule knob (and a sampler with replacement repeats prompts legitimately);
    calling :meth:`set_epoch` once (``set_epoch(0)`` included) silences it.

    **Units.** ``train_batch_size``, ``sampling_batch_size``, ``min_sampling_batch_size`` and
    ``loader_batch_size`` count *prompts*; ``plan``'s ``budget`` counts *rollouts* (a full round costs
    ``sampling_batch_size * n``).

    Deliberate differences: the trace is kept as two run lengths (equivalent for the rule, bounded); the easy
    and hard ratios count zero-variance groups with mean ``>= easy_threshold`` / ``<= hard_threshold`` (the code
    counts groups of exact 1.0 / exact 0.1 rewards — its format-error reward 0 is not "hard" there; the same
    for 0/1 rewards apart from that), as a fraction of groups (the code weights by rollouts; equal for a fixed
    ``n``); a step that rolled out nothing leaves p unchanged (the code divides by zero); a round whose groups
    all had zero variance is followed by a full ``sampling_batch_size`` round (the code divides by zero).
    Skip draws are made for every candidate at ``plan`` time from the allocator's generator (the code draws as
    it reaches each prompt, from the global RNG); reasons report skips only for candidates the step reached.

    Args:
        n: rollouts per prompt (script 8).
        n_min: smallest group (default ``n``): at the budget's edge a partial group of at least ``n_min`` is
            requested for the next candidate.
        n_max: largest group (default ``n``; must be ``>= n``). GRESO keeps the code's fixed group size, so
            no group exceeds ``n`` (a round's budget is at most ``n`` per prompt).
        train_batch_size: prompts (not rollouts) with variance to collect per step (script 256).
        sampling_batch_size: prompts per rollout round, and the cap of the adaptive size (script 384).
        min_sampling_batch_size: the adaptive size's floor, in prompts (None: ``min(64, sampling_batch_size)``;
            the code's 64).
        loader_batch_size: None (default): rounds of exactly the adaptive size. An int (the code's
            dataloader batch, script 32): rounds of whole blocks of that many candidates, as the code.
        oversample: the adaptive size's safety factor (code 1.25).
        filter_zero_variance: DAPO dynamic sampling (default True, the GRESO setting); False runs one round of
            ``sampling_batch_size`` prompts and keeps every rollout.
        p_easy, p_hard: initial exploration probabilities (0.5); min_p, max_p, p_step: their bounds and step.
        target_zero_variance: target zero-variance rate (0.25): easy target a third, hard two thirds.
        easy_threshold, hard_threshold: group-mean thresholds of the run lengths (0.98, 0.11, for 0/1 rewards;
            0.11 tolerates the code's 0.1 wrong-answer reward).
        floor: least keep probability (0.01).
        adapt_from_epoch: first epoch in which p adapts (code: after epoch 0, so 1).
        steps_per_epoch: None (default): the epoch is what :meth:`set_epoch` last said (0 until then, so p never
            adapts unless the trainer calls it). An int: the epoch advances by itself, ``epoch = steps //
            steps_per_epoch`` after each ``update`` (e.g. ``len(dataset) // train_batch_size``).
        seed: seed of the skip draws' generator.
        capacity: prompts kept in a private table (default None: 1,000,000; least recently updated evicted, and
            an evicted prompt is then never skipped, as one never rolled out).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); GRESO registers
            ``k_easy`` and ``k_hard`` as owner ``"greso"``, and the caller saves a shared table once.

    Budget: never more than ``budget`` rollouts; a round requests at most what is left (full groups, then a
    partial group per ``n_min``), so the step may stop short of ``train_batch_size`` when the budget or the
    candidates run out; it does not try to spend all of it. Reasons: ``"kept"``, ``"zero_variance"``,
    ``"surplus"``, ``"skip_easy"``, ``"skip_hard"``, ``"not_reached"`` (skipped draws of candidates the step
    never reached are reported as ``"not_reached"``).

    Edge cases: an empty pool or a zero budget requests nothing; a planned prompt that got no rollouts leaves
    its run lengths unchanged. State: two int64 per prompt rolled out (at most ``capacity`` prompts),
    ``p_easy``, ``p_hard``, the epoch, the step count and the generator.
    """

    reference: ClassVar[str] = "arXiv 2506.02177 (GRESO); code Infini-AI-Lab/GRESO"
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        n: int = 8,
        n_min: int | None = None,
        n_max: int | None = None,
        train_batch_size: int = 256,
        sampling_batch_size: int = 384,
        min_sampling_batch_size: int | None = None,
        loader_batch_size: int | None = None,
        oversample: float = 1.25,
        filter_zero_variance: bool = True,
        p_easy: float = 0.5,
        p_hard: float = 0.5,
        min_p: float = 0.05,
        max_p: float = 0.95,
        p_step: float = 0.01,
        target_zero_variance: float = 0.25,
        easy_threshold: float = 0.98,
        hard_threshold: float = 0.11,
        floor: float = 0.01,
        adapt_from_epoch: int = 1,
        steps_per_epoch: int | None = None,
        seed: int = 0,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        self.n, self.n_min, self.n_max = _group_sizes(n, n_min, n_max)
        self.train_batch_size = _check_int(train_batch_size, "train_batch_size", 1, "pass e.g. 256 (script)")
        self.sampling_batch_size = _check_int(sampling_batch_size, "sampling_batch_size", 1, "pass e.g. 384")
        if min_sampling_batch_size is None:  # the code's 64, but never above the round size
            min_sampling_batch_size = min(64, self.sampling_batch_size)
        self.min_sampling_batch_size = _check_int(
            min_sampling_batch_size, "min_sampling_batch_size", 1, "pass e.g. 64 (code), in prompts"
        )
        if self.min_sampling_batch_size > self.sampling_batch_size:
            raise InputError(
                "min_sampling_batch_size",
                f"<= sampling_batch_size = {self.sampling_batch_size} (both count prompts per round, not rollouts; "
                f"a round requests prompts * n = {self.sampling_batch_size} * {self.n} rollouts, and the plan's "
                "budget counts rollouts)",
                repr(min_sampling_batch_size),
                f"pass min_sampling_batch_size <= {self.sampling_batch_size}, or leave it None "
                f"(min(64, sampling_batch_size)), or raise sampling_batch_size",
            )
        if loader_batch_size is not None:
            loader_batch_size = _check_int(
                loader_batch_size, "loader_batch_size", 1, "pass None or the dataloader's batch size in prompts (32)"
            )
        self.loader_batch_size = loader_batch_size
        self.oversample = _check_float(oversample, "oversample", 0.0, 1e6, "pass e.g. 1.25", open_low=True)
        if not isinstance(filter_zero_variance, bool):
            raise InputError("filter_zero_variance", "a bool", describe(filter_zero_variance), "pass True or False")
        self.filter_zero_variance = filter_zero_variance
        self.min_p = _check_float(min_p, "min_p", 0.0, 1.0, "pass e.g. 0.05")
        self.max_p = _check_float(max_p, "max_p", self.min_p, 1.0, "pass min_p <= max_p <= 1")
        self.p_easy = _check_float(p_easy, "p_easy", 0.0, 1.0, "pass e.g. 0.5")
        self.p_hard = _check_float(p_hard, "p_hard", 0.0, 1.0, "pass e.g. 0.5")
        self.p_step = _check_float(p_step, "p_step", 0.0, 1.0, "pass e.g. 0.01")
        self.target_zero_variance = _check_float(target_zero_variance, "target_zero_variance", 0.0, 1.0, "pass 0.25")
        self.easy_threshold = _check_float(easy_threshold, "easy_threshold", -1e300, 1e300, "pass 0.98")
        self.hard_threshold = _check_float(hard_threshold, "hard_threshold", -1e300, self.easy_threshold, "pass 0.11")
        self.floor = _check_float(floor, "floor", 0.0, 1.0, "pass 0.01")
        self.adapt_from_epoch = _check_int(adapt_from_epoch, "adapt_from_epoch", 0, "pass 1 (the code)")
        if steps_per_epoch is not None:
            steps_per_epoch = _check_int(steps_per_epoch, "steps_per_epoch", 1, "pass None or the steps in an epoch")
        self.steps_per_epoch = steps_per_epoch
        self.seed = _check_int(seed, "seed", 0, "pass a non-negative int")
        self.epoch = 0
        self.steps = 0
        self._epoch_told = False  # set_epoch was called (the trainer manages epochs)
        self._warned_epoch = False
        self._gen = torch.Generator().manual_seed(self.seed)
        self._cols = open_table(
            table,
            capacity,
            "greso",
            {  # 0: no run (a prompt never rolled out, or evicted)
                "k_easy": Column("int", checks=("nonneg",)),
                "k_hard": Column("int", checks=("nonneg",)),
            },
        )

    @property
    def target_easy(self) -> float:
        """The easy zero-variance target, ``target_zero_variance / 3`` (code)."""
        return self.target_zero_variance / 3

    @property
    def target_hard(self) -> float:
        """The hard zero-variance target, ``target_zero_variance * 2 / 3`` (code)."""
        return self.target_zero_variance * 2 / 3

    def set_epoch(self, epoch: int) -> None:
        """Tell the allocator the current epoch (p adapts only from ``adapt_from_epoch`` on)."""
        self.epoch = _check_int(epoch, "epoch", 0, "pass the epoch number, from 0")
        self._epoch_told = True

    def run_lengths(self, prompt_ids: IntP) -> tuple[IntP, IntP]:
        """Easy and hard run lengths ``k_e``, ``k_h`` of each prompt, int64 ``[P]`` each (0 if never rolled out)."""
        return self._run_lengths(as_prompt_ids(prompt_ids))

    def _run_lengths(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        if self._cols.empty:
            return torch.zeros_like(ids), torch.zeros_like(ids)
        pos, seen = self._cols.find(ids)
        return torch.where(seen, self._cols["k_easy"][pos], 0), torch.where(seen, self._cols["k_hard"][pos], 0)

    def skip_probabilities(self, prompt_ids: IntP) -> tuple[FloatP, FloatP]:
        """Per prompt, float64 ``[P]``: the easy skip probability and the hard one (drawn if easy does not skip)."""
        return self._skip_probabilities(as_prompt_ids(prompt_ids))

    def _skip_probabilities(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        k_e, k_h = self._run_lengths(ids)
        return (
            greso_skip_probability(k_e, self.p_easy, floor=self.floor),
            greso_skip_probability(k_h, self.p_hard, floor=self.floor),
        )

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Draw the skips for the candidates ``prompt_ids`` (in dataloader order), then roll out in rounds."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        pe, ph = self._skip_probabilities(ids)
        u = torch.rand(2, ids.numel(), generator=self._gen, dtype=torch.float64)
        skip_easy = u[0] < pe
        skip_hard = ~skip_easy & (u[1] < ph)
        return _GRESOPlan(self, ids, budget, skip_easy, skip_hard)

    def update(self, result: AllocationResult) -> None:
        """Extend the run lengths of every rolled-out prompt, then (from ``adapt_from_epoch``) adapt p."""
        result = _check_result(result)
        p = result.plan_prompt_ids.numel()
        counts = result.counts
        rolled = counts > 0
        r = result.rewards.double()
        total = torch.bincount(result.group, weights=r, minlength=p)
        mean = total / counts.clamp(min=1)
        hi = torch.full((p,), -torch.inf, dtype=torch.float64).scatter_reduce(0, result.group, r, "amax")
        lo = torch.full((p,), torch.inf, dtype=torch.float64).scatter_reduce(0, result.group, r, "amin")
        ids = result.plan_prompt_ids[rolled]
        m = mean[rolled]
        if (
            not self._warned_epoch
            and not self._epoch_told
            and self.steps_per_epoch is None
            and self.epoch < self.adapt_from_epoch
            and not self._cols.empty
            and bool(self._cols.find(ids)[1].any())
        ):
            self._warned_epoch = True
            warnings.warn(
                f"GRESO: a prompt was rolled out again while the epoch is still {self.epoch}: p_easy/p_hard adapt "
                f"only from epoch {self.adapt_from_epoch} on, and nothing has told this allocator the epoch, so they "
                "will never adapt. Call set_epoch(epoch) at each epoch start (set_epoch(0) once to silence this if "
                "the repeat is intended), or pass steps_per_epoch",
                UserWarning,
                stacklevel=2,
            )
        pos, order = self._cols.add(ids)
        m = m[order]
        k_easy, k_hard = self._cols["k_easy"], self._cols["k_hard"]
        k_easy[pos] = torch.where(m >= self.easy_threshold, k_easy[pos] + 1, 0)
        k_hard[pos] = torch.where(m <= self.hard_threshold, k_hard[pos] + 1, 0)
        groups = int(rolled.sum())
        if self.epoch >= self.adapt_from_epoch and groups > 0:
            zv = rolled & (hi == lo)
            easy_ratio = float((zv & (mean >= self.easy_threshold)).sum()) / groups
            hard_ratio = float((zv & (mean <= self.hard_threshold)).sum()) / groups
            self.p_hard = self._step(self.p_hard, hard_ratio >= self.target_hard)
            self.p_easy = self._step(self.p_easy, easy_ratio >= self.target_easy)
        self.steps += 1
        if self.steps_per_epoch is not None:
            self.epoch = self.steps // self.steps_per_epoch

    def _step(self, p: float, above: bool) -> float:
        return max(p - self.p_step, self.min_p) if above else min(p + self.p_step, self.max_p)

    STATE: ClassVar[dict[str, Field]] = {
        "table": TableColumns.FIELD,
        "p_easy": Field("real", low=0.0, high=1.0),
        "p_hard": Field("real", low=0.0, high=1.0),
        "epoch": Field("integer", low=0),
        "steps": Field("integer", low=0),
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`; the table validates its
    run-length columns)."""

    def state_dict(self) -> dict[str, Any]:
        """The table (run lengths ``k_easy``, ``k_hard``; the rows only when the table is private), p_easy,
        p_hard, epoch, steps and the generator; copies."""
        return dump_state(
            {
                "table": self._cols.state(),
                "p_easy": self.p_easy,
                "p_hard": self.p_hard,
                "epoch": self.epoch,
                "steps": self.steps,
                "generator": self._gen.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "GRESO")
        self._cols.load(s["table"])
        self.p_easy, self.p_hard = float(s["p_easy"]), float(s["p_hard"])
        self.epoch, self.steps = s["epoch"], s["steps"]
        self._gen.set_state(s["generator"])
