"""DOTS with Rollout Replay: difficulty-targeted selection and a buffer of reusable groups (:class:`DOTS`,
:class:`DOTSPlan`, :class:`ReplayedGroups`).

Difficulty-targeted Online daTa Selection with Rollout Replay, arXiv 2506.05316 (NeurIPS 2025); code
``ASTRAL-Group/data-efficient-llm-rl`` (read at ``59df9187b7786c0058316f886b77c13c8608c533``:
``rl_training/verl/verl/trainer/ppo/ray_trainer_teacher_replay.py``, ``teacher_utils.py``,
``rl_training/run_bash/final_ds_teacher_replay.sh``); ``docs/methods/replay.md``.

Per-prompt labels live in a bounded :class:`~rolloutopt.allocators.table.PromptTable` column (sorted int64 prompt
ids looked up with ``torch.searchsorted``); the replay buffer and the reference set are bounded too. No Python loop
over prompts or rollouts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import describe, require_experimental
from rolloutopt.allocators._base import (
    AllocationResult,
    OneShotPlan,
    _check_float,
    _check_int,
    _fill,
    _group_sizes,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._ids import _by_group, _lookup
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._tracked import _rank
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatP, IntB, IntP

__all__ = ["DOTS", "DOTSPlan", "ReplayedGroups"]

_F64 = torch.float64


# -- DOTS -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayedGroups:
    """Groups drawn from the replay buffer for this step (reused rollouts, off-policy).

    Per group ``[G]``: ``keys`` (int64, unique per stored group, increasing in insertion order), ``prompt_ids``,
    ``steps`` (the ``update`` count when the group was stored: the trainer's step that generated it), ``counts``.
    Per rollout ``[M = counts.sum()]``: ``group`` (``0..G-1``), ``index`` (the rollout's position within its
    original group, in observation order) and ``rewards`` (float32; the buffer keeps them in float64). The
    trainer keeps the responses and their behaviour log-probs keyed by ``(steps, prompt_ids, index)`` (or by
    ``keys``) and fetches them with these.
    """

    keys: Int[Tensor, " G"]
    prompt_ids: Int[Tensor, " G"]
    steps: Int[Tensor, " G"]
    counts: Int[Tensor, " G"]
    group: IntB
    index: IntB
    rewards: FloatB

    @property
    def num_groups(self) -> int:
        """Number of replayed groups."""
        return int(self.keys.numel())


class DOTSPlan(OneShotPlan):
    """A DOTS step: one request for the fresh prompts; :meth:`replayed` returns the reused groups.

    Reasons per planned prompt: ``"selected"`` (a full group), ``"partial_group"`` (the leftover budget,
    ``>= n_min``), ``"not_selected"``, ``"displaced_by_replay"`` (drawn among the first ``B`` but its slot went
    to a replayed group). ``predicted`` holds the predicted success probability of every candidate ``[P]``.
    """

    reason_names = ("selected", "partial_group", "not_selected", "displaced_by_replay")

    def __init__(
        self, prompt_ids: IntP, budget: int, counts: IntP, reasons: IntP, predicted: FloatP, rep: ReplayedGroups
    ) -> None:
        super().__init__(prompt_ids, budget, counts, reasons)
        self.predicted = predicted
        self._replayed = rep

    def replayed(self) -> ReplayedGroups:
        """The groups reused from the replay buffer this step (train on them with their stored log-probs)."""
        return self._replayed

    def finish(self) -> AllocationResult:
        res = super().finish()
        rep = self._replayed
        return replace(
            res,
            metrics={
                **res.metrics,
                "replayed_groups": torch.tensor(float(rep.num_groups), dtype=_F64),
                "replayed_rollouts": torch.tensor(float(rep.group.numel()), dtype=_F64),
            },
        )


def _empty_replay(width: int) -> dict[str, Tensor]:
    return {
        "keys": torch.zeros(0, dtype=torch.long),
        "prompt_ids": torch.zeros(0, dtype=torch.long),
        "steps": torch.zeros(0, dtype=torch.long),
        "counts": torch.zeros(0, dtype=torch.long),
        "rewards": torch.zeros(0, width, dtype=_F64),
    }


def _tail_by_id(ids: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest ``ids``, in increasing id order (the tail a FIFO fed in id order keeps)."""
    if ids.numel() > k:
        sel = torch.topk(ids, k).indices
        return sel[ids[sel].argsort()]
    return ids.argsort()


class DOTS(TableOwner):
    r"""DOTS + Rollout Replay: pick prompts whose predicted success rate is near 1/2; reuse recent groups.

    **Selection.** Each candidate gets a predicted success probability :math:`\hat p` and a score
    :math:`-|\hat p - \alpha|`; prompts are drawn without replacement with probabilities
    :math:`\mathrm{softmax}(\text{score} / \tau)` (the code's ``torch.multinomial``):

    .. math::  w_q = \frac{\exp(-|\hat p_q - \alpha| / \tau)}{\sum_{q'} \exp(-|\hat p_{q'} - \alpha| / \tau)}

    drawn here as a Gumbel top-k over the logits (the same distribution, in log space, never underflows). With
    ``tau = 1e-3`` a prompt 0.05 farther from 1/2 than another has relative weight :math:`e^{-50}`: nearly a hard
    top-k around :math:`\alpha`.

    **Rollout replay** (``buffer_rule="code"``, the default, as ``select_buffer`` in
    ``ray_trainer_teacher_replay.py``). A step of :math:`B = \lfloor \text{budget} / n \rfloor` groups generates
    only :math:`B - k` fresh groups and reuses :math:`k = \min(\lfloor (1 - \sigma) B \rfloor, |\text{buffer}|)`
    groups drawn uniformly without replacement (the code's ``"random"`` strategy), fetched with
    :meth:`DOTSPlan.replayed`; no group is replayed before ``warmup_steps`` updates (2: the code's first selection
    round of :math:`\mu = 2` steps has no replay). ``update`` then (1) keeps the newest
    :math:`\max(\text{buffer\_size} - \lfloor \sigma B \rfloor, 0)` stored groups (:math:`B` of the last plan),
    (2) appends *every* fresh group of the step, all-0 and all-1 groups included (the code's zero-variance filter
    is commented out), in prompt-id order, and (3) keeps only the newest group of each prompt. The buffer thus
    holds at most ``buffer_size - floor(sigma B)`` older groups plus the step's fresh ones.
    ``buffer_rule="paper"`` is this library's earlier reading of the paper: only groups whose rewards are not all
    equal enter a plain FIFO of at most ``buffer_size`` groups (a prompt may be stored several times), replay
    starts as soon as the buffer is not empty (``warmup_steps`` defaults to 0). Reused groups are off-policy:
    train on them with their stored behaviour log-probs.

    **Predictor** (pluggable: embedding regression, a GP or a per-prompt Beta all fit). The code predicts
    :math:`\hat p` with a frozen embedding LLM, an attention adapter (learned projections) over a reference set of
    256 prompts rolled out 8 times, a calibration MLP and a linear fit on the reference set. Here:

    - default (no embeddings): a prompt rolled out before predicts its last group success rate; an unseen prompt
      predicts the mean label of the reference set (uniform similarity; ``prior`` while the set is empty);
    - ``embeddings=`` (``[D, E]`` float, one row per ``embedding_ids`` entry, like the code's precomputed
      embedding file): the **attention-free** similarity regression
      :math:`\hat p_q = \sum_k \mathrm{softmax}_k(\cos(e_q, e_k) / T)\, y_k` over the reference set, then the
      code's linear calibration fitted on the reference points (``calibrate``), clipped to [0, 1]. The learned
      projections and the calibration MLP are replaced by the identity and cosine similarity: this predictor is
      **[reconstructed]** and needs ``experimental=True``;
    - ``predictor=``: any callable ``prompt_ids int64 [P] -> float [P]`` (clipped to [0, 1]).

    The reference set is **[reconstructed]** as the ``ref_size`` most recently rolled-out groups (their success
    rates are the "adaptive difficulty" labels), instead of a dedicated reference rollout each round: it costs no
    budget and stays current. Selection happens every step (the code selects :math:`\mu B` prompts every
    :math:`\mu = 2` steps; pass a pool of :math:`\mu B` prompts to ``plan`` to emulate it).

    Reference: arXiv 2506.05316 (NeurIPS 2025), ``docs/methods/replay.md``. Defaults from
    ``final_ds_teacher_replay.sh``: ``alpha = 0.5``, ``tau = 1e-3``, ``sigma = 0.5``, ``buffer_size = 512``,
    ``ref_size = 256``, ``n = 8`` (``rollout.n``).

    Args:
        n: rollouts per fresh prompt (8). ``n_min``/``n_max`` as in :class:`~rolloutopt.allocators.dps.DPS`
            (default ``n``): leftover budget becomes a partial group if ``>= n_min``, then extra rollouts up to
            ``n_max`` each; the buffer stores groups of up to ``n_max`` rollouts.
        alpha: target success rate :math:`\alpha` in [0, 1] (0.5).
        tau: softmax temperature (1e-3), > 0.
        replay: turn Rollout Replay on (True).
        sigma: fraction of fresh groups per step, in (0, 1] (0.5). ``sigma = 1`` never replays.
        buffer_size: buffer capacity in groups (512, see ``buffer_rule``); 0 disables the buffer.
        buffer_rule: ``"code"`` (default: the authors' code; newest group per prompt, no variance filter, truncated
            before the append) or ``"paper"`` (a FIFO of the groups with unequal rewards).
        warmup_steps: updates before the first replay (default 2 with ``"code"``, 0 with ``"paper"``), >= 0.
        ref_size: reference-set size (256), >= 1.
        success_threshold: labels and the buffer's "all equal" test use the raw rewards when None (default, the
            code's mean reward); otherwise the success rate of ``reward >= success_threshold``.
        prior: prediction while no reference label exists (0.5).
        embeddings, embedding_ids: optional prompt embeddings ``[D, E]`` and their int64 ids ``[D]`` (needs
            ``experimental=True``); every planned prompt must have one.
        similarity_temperature: :math:`T` of the similarity softmax (0.05, [reconstructed]).
        calibrate: fit :math:`y \approx a \hat p + b` on the reference set and apply it (True, as the code).
        predictor: optional callable replacing the built-in predictors.
        seed: seed of the generator behind the draws.
        experimental: must be True when ``embeddings`` are given.
        capacity: prompts whose last label is kept, in a private table (default None: 1,000,000; least recently
            updated evicted: an evicted prompt predicts as an unseen one).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); DOTS registers
            ``label`` (each prompt's last group success rate) as owner ``"dots"``, and the caller saves a shared
            table once. The embeddings are configuration, not table state: they stay with the allocator.

    Budget: one request of at most ``budget`` rollouts; it spends ``(B - k) n`` with the defaults (all of it
    when no group is replayed and ``n`` divides the budget). Every fresh rollout is kept (weight 1).

    Edge cases: an empty pool or ``budget < n_min`` requests nothing (and replays nothing). Replayed groups stay
    in the buffer (evicted only by truncation, or by a newer group of the same prompt with ``"code"``), so a group
    may be replayed more than once. A group replayed in this step is not pushed again by ``update`` (only fresh
    rollouts enter ``result``). ``buffer_size = 0`` stores nothing (with ``"code"`` the authors' code would then
    keep the last step's batch; a deliberate difference: 0 means "off" here).
    """

    reference: ClassVar[str] = "arXiv 2506.05316 (DOTS + Rollout Replay); code ASTRAL-Group/data-efficient-llm-rl"
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        n: int = 8,
        n_min: int | None = None,
        n_max: int | None = None,
        alpha: float = 0.5,
        tau: float = 1e-3,
        replay: bool = True,
        sigma: float = 0.5,
        buffer_size: int = 512,
        buffer_rule: Literal["code", "paper"] = "code",
        warmup_steps: int | None = None,
        ref_size: int = 256,
        success_threshold: float | None = None,
        prior: float = 0.5,
        embeddings: Float[Tensor, "P d"] | None = None,
        embedding_ids: IntP | None = None,
        similarity_temperature: float = 0.05,
        calibrate: bool = True,
        predictor: Callable[[IntP], FloatP] | None = None,
        seed: int = 0,
        experimental: bool = False,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        self.n, self.n_min, self.n_max = _group_sizes(n, n_min, n_max)
        self.alpha = _check_float(alpha, "alpha", 0.0, 1.0, "pass alpha=0.5 (the code)")
        self.tau = _check_float(tau, "tau", 0.0, 1e6, "pass tau=1e-3 (the code)", open_low=True)
        if not isinstance(replay, bool):
            raise InputError("replay", "a bool", describe(replay), "pass True or False")
        self.replay = replay
        self.sigma = _check_float(sigma, "sigma", 0.0, 1.0, "pass sigma=0.5 (the code)", open_low=True)
        self.buffer_size = _check_int(buffer_size, "buffer_size", 0, "pass buffer_size=512 (the code)")
        if buffer_rule not in ("code", "paper"):
            raise InputError("buffer_rule", "'code' or 'paper'", describe(buffer_rule), "pass buffer_rule='code'")
        self.buffer_rule = buffer_rule
        default_warmup = 2 if buffer_rule == "code" else 0
        self.warmup_steps = (
            default_warmup
            if warmup_steps is None
            else _check_int(warmup_steps, "warmup_steps", 0, "pass warmup_steps=2 (the code's first round)")
        )
        self.ref_size = _check_int(ref_size, "ref_size", 1, "pass ref_size=256 (the code)")
        if success_threshold is not None:
            success_threshold = _check_float(success_threshold, "success_threshold", -1e300, 1e300, "pass 1.0")
        self.success_threshold = success_threshold
        self.prior = _check_float(prior, "prior", 0.0, 1.0, "pass prior=0.5")
        self.similarity_temperature = _check_float(
            similarity_temperature, "similarity_temperature", 0.0, 1e6, "pass e.g. 0.05", open_low=True
        )
        if not isinstance(calibrate, bool):
            raise InputError("calibrate", "a bool", describe(calibrate), "pass True or False")
        self.calibrate = calibrate
        if predictor is not None and not callable(predictor):
            raise InputError(
                "predictor", "None or a callable ids -> [P] floats", describe(predictor), "pass a function"
            )
        self.predictor = predictor
        self._emb: Tensor | None = None
        self._emb_ids = torch.zeros(0, dtype=torch.long)
        if embeddings is not None or embedding_ids is not None:
            require_experimental(experimental, "DOTS's attention-free similarity predictor", "docs/methods/replay.md")
            self._set_embeddings(embeddings, embedding_ids)
        self.seed = _check_int(seed, "seed", 0, "pass a non-negative int")
        self._gen = torch.Generator().manual_seed(self.seed)
        self._step = 0
        self._next_key = 0
        # the last group success rate of each prompt (0 where this owner has not seen the prompt: read it through
        # the seen mask of find, never as a label)
        self._cols = open_table(table, capacity, "dots", {"label": Column("float", (), 0.0, ("finite",))})
        self._ref_ids = torch.zeros(0, dtype=torch.long)
        self._ref_labels = torch.zeros(0, dtype=_F64)
        self._buf = _empty_replay(self.n_max)
        self._planned_groups = 0  # B of the last plan: the "code" rule truncates to buffer_size - floor(sigma B)
        self.STATE = {
            "step": Field("integer", low=0),
            "next_key": Field("integer", low=0),
            "table": TableColumns.FIELD,  # labels: group mean rewards (success rates with a threshold)
            "ref_ids": Field("int", ("R",)),  # a FIFO: unsorted, a prompt may repeat
            "ref_labels": Field("float", ("R",), ("finite",)),
            # G stored groups, oldest first; keys < next_key and counts <= n_max, checked after load_state
            "buffer": Field(
                "nested",
                fields={
                    "keys": Field("int", ("G",), ("ids", "nonneg")),
                    "prompt_ids": Field("int", ("G",)),
                    "steps": Field("int", ("G",), ("nonneg",)),
                    "counts": Field("int", ("G",), ("nonneg",)),
                    "rewards": Field("float", ("G", self.n_max), ("finite",)),
                },
            ),
            "planned_groups": Field("integer", low=0),
            "generator": Field("generator"),
        }

    STATE: dict[str, Field]
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`; built per instance: the
    buffer's width is ``n_max``)."""

    def _set_embeddings(self, embeddings: Any, embedding_ids: Any) -> None:
        if not isinstance(embeddings, Tensor) or embeddings.ndim != 2 or not embeddings.is_floating_point():
            raise InputError("embeddings", "a float tensor [D, E]", describe(embeddings), "pass one row per prompt")
        ids = as_prompt_ids(embedding_ids, "embedding_ids")
        if ids.numel() != embeddings.shape[0]:
            raise InputError(
                "embedding_ids", f"{embeddings.shape[0]} ids (one per embedding row)", describe(embedding_ids), "align"
            )
        e = embeddings.detach().cpu().to(_F64)
        if not bool(torch.isfinite(e).all()):
            raise InputError("embeddings", "finite values", "NaN or inf", "fix the embeddings")
        e = e / e.norm(dim=1, keepdim=True).clamp(min=1e-12)
        self._emb_ids, order = ids.sort()
        self._emb = e[order]

    # -- prediction ---------------------------------------------------------------------------------------------
    def _embed(self, ids: Tensor, name: str) -> Tensor:
        assert self._emb is not None
        pos, found = _lookup(self._emb_ids, ids)
        if not bool(found.all()):
            raise InputError(name, "prompt ids that have an embedding", "ids without one", "add them to embeddings")
        return self._emb[pos]

    def predict(self, prompt_ids: IntP) -> FloatP:
        r"""Predicted success probability of each prompt, float64 ``[P]`` in [0, 1] (see the class docstring)."""
        return self._predict(as_prompt_ids(prompt_ids))

    def _predict(self, ids: Tensor) -> Tensor:
        if self.predictor is not None:
            p = self.predictor(ids)
            if not isinstance(p, Tensor) or p.shape != ids.shape or not p.is_floating_point():
                raise InputError("predictor", f"a float tensor of shape {tuple(ids.shape)}", describe(p), "fix it")
            p = p.detach().cpu().to(_F64)
            if not bool(torch.isfinite(p).all()):
                raise InputError("predictor", "finite predictions", "NaN or inf", "fix the predictor")
            return p.clamp(0.0, 1.0)
        k = self._ref_ids.numel()
        if self._emb is not None:
            if k == 0:
                self._embed(ids, "prompt_ids")  # validates coverage
                return torch.full(ids.shape, self.prior, dtype=_F64)
            ref = self._embed(self._ref_ids, "reference ids")
            y = self._ref_labels
            t = self.similarity_temperature
            pred = torch.softmax(self._embed(ids, "prompt_ids") @ ref.T / t, dim=1) @ y
            if self.calibrate:
                x = torch.softmax(ref @ ref.T / t, dim=1) @ y
                xm, ym = x.mean(), y.mean()
                var = ((x - xm) ** 2).sum()
                slope = torch.where(var > 1e-12, ((x - xm) * (y - ym)).sum() / var.clamp(min=1e-12), 0.0)
                pred = slope * pred + (ym - slope * xm)
            return pred.clamp(0.0, 1.0)
        fallback = self._ref_labels.mean() if k else torch.tensor(self.prior, dtype=_F64)
        if self._cols.empty:
            return fallback.expand(ids.shape).clone()
        pos, seen = self._cols.find(ids)
        return torch.where(seen, self._cols["label"].index_select(0, pos), fallback)

    # -- the protocol ---------------------------------------------------------------------------------------------
    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> DOTSPlan:
        """Draw fresh prompts near ``alpha`` and replayed groups from the buffer (see the class docstring)."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        pred = self._predict(ids)
        by_id = ids.argsort()
        groups = budget // self.n
        buf_len = int(self._buf["keys"].numel())
        k = min(math.floor((1.0 - self.sigma) * groups + 1e-9), buf_len) if self.replay and p else 0
        if budget < self.n_min or p == 0 or self._step < self.warmup_steps:
            k = 0
        self._planned_groups = groups
        # Gumbel top-k over the logits, noise drawn in prompt-id order (a permutation of the pool permutes the plan)
        logits = -(pred - self.alpha).abs() / self.tau
        u = torch.rand(p, generator=self._gen, dtype=_F64).clamp(1e-300, 1.0 - 1e-16)
        noise = torch.empty(p, dtype=_F64)
        noise[by_id] = -torch.log(-torch.log(u))
        order = _rank(logits + noise, by_id)
        ranked = _fill(p, budget - k * self.n, self.n, self.n_min, self.n_max)
        counts = torch.zeros(p, dtype=torch.long)
        counts[order] = ranked
        rank = torch.arange(p)
        full = min(p, (budget - k * self.n) // self.n)
        rank_reason = torch.where(rank < full, 0, torch.where(ranked > 0, 1, torch.where(rank < min(groups, p), 3, 2)))
        reasons = torch.empty(p, dtype=torch.long)
        reasons[order] = rank_reason
        return DOTSPlan(ids, budget, counts, reasons, pred, self._draw_replay(k))

    def _draw_replay(self, k: int) -> ReplayedGroups:
        buf = self._buf
        if k > 0:
            pick = torch.randperm(int(buf["keys"].numel()), generator=self._gen)[:k].sort().values
        else:
            pick = torch.zeros(0, dtype=torch.long)
        counts = buf["counts"][pick]
        group = torch.repeat_interleave(torch.arange(pick.numel()), counts)
        starts = torch.cumsum(counts, 0) - counts
        index = torch.arange(group.numel()) - starts[group]
        return ReplayedGroups(
            keys=buf["keys"][pick],
            prompt_ids=buf["prompt_ids"][pick],
            steps=buf["steps"][pick],
            counts=counts,
            group=group,
            index=index,
            rewards=(buf["rewards"][pick][group, index] if group.numel() else torch.zeros(0, dtype=_F64)).float(),
        )

    def update(self, result: AllocationResult) -> None:
        """Record the step's group success rates (labels, reference set) and push the fresh groups to the buffer
        (every group with ``buffer_rule="code"``, those with unequal rewards with ``"paper"``)."""
        result = _check_result(result)
        p = result.plan_prompt_ids.numel()
        counts = result.counts
        values = result.rewards if self.success_threshold is None else (result.rewards >= self.success_threshold)
        values = values.to(_F64)
        rate = torch.bincount(result.group, weights=values, minlength=p).to(_F64) / counts.clamp(min=1)
        played = counts > 0
        # labels: a table column, overwritten by the newest rate; reference FIFO in prompt-id order
        ids_played = result.plan_prompt_ids[played]
        rate_played = rate[played]
        pos, order = self._cols.add(ids_played)
        self._cols["label"].index_copy_(0, pos, rate_played[order])
        tail = _tail_by_id(ids_played, self.ref_size)
        self._ref_ids = torch.cat([self._ref_ids, ids_played[tail]])[-self.ref_size :]
        self._ref_labels = torch.cat([self._ref_labels, rate_played[tail]])[-self.ref_size :]
        if self.buffer_size > 0:
            self._push(result, values, played)
        self._step += 1

    def _push(self, result: AllocationResult, values: Tensor, played: Tensor) -> None:
        p = result.plan_prompt_ids.numel()
        code = self.buffer_rule == "code"
        if code:
            cand = played.nonzero().squeeze(1)  # every group: the code's all-0/all-1 filter is commented out
            cand = cand[result.plan_prompt_ids[cand].argsort()]
        else:
            hi = torch.full((p,), -math.inf, dtype=_F64).scatter_reduce(0, result.group, values, "amax")
            lo = torch.full((p,), math.inf, dtype=_F64).scatter_reduce(0, result.group, values, "amin")
            cand = (played & (hi > lo)).nonzero().squeeze(1)
            cand = cand[_tail_by_id(result.plan_prompt_ids[cand], self.buffer_size)]  # id order; the tail survives
        g = cand.numel()
        old = self._buf
        if code:  # truncate before the append, to buffer_size - floor(sigma B) groups
            keep = max(self.buffer_size - math.floor(self.sigma * self._planned_groups + 1e-9), 0)
            start = max(int(old["keys"].numel()) - keep, 0)
            old = {key: v[start:] for key, v in old.items()}
        if g == 0:
            self._buf = old
            return
        slot = torch.full((p,), -1, dtype=torch.long)
        slot[cand] = torch.arange(g)
        rows = (slot[result.group] >= 0).nonzero().squeeze(1)  # in observation order
        gs = slot[result.group[rows]]
        gs_sorted, perm = _by_group(gs)
        gcounts = torch.bincount(gs, minlength=g)
        starts = torch.cumsum(gcounts, 0) - gcounts
        within = torch.arange(gs.numel()) - starts[gs_sorted]
        rewards = torch.zeros(g, self.n_max, dtype=_F64)
        fits = within < self.n_max
        values_sorted = result.rewards[rows if perm is None else rows[perm]].to(_F64)
        if bool(fits.all()):  # no group larger than n_max (the usual case): no compaction
            rewards[gs_sorted, within] = values_sorted
        else:
            rewards[gs_sorted[fits], within[fits]] = values_sorted[fits]
        new = {
            "keys": self._next_key + torch.arange(g),
            "prompt_ids": result.plan_prompt_ids[cand],
            "steps": torch.full((g,), self._step, dtype=torch.long),
            "counts": gcounts.clamp(max=self.n_max),
            "rewards": rewards,
        }
        self._next_key += g
        merged = {key: torch.cat([old[key], new[key]]) for key in new}
        if code:  # the newest group of each prompt survives, in buffer order
            ids = merged["prompt_ids"]
            _, inv = torch.unique(ids, return_inverse=True)
            pos = torch.arange(ids.numel())
            last = torch.full((int(inv.max()) + 1,), -1, dtype=torch.long).scatter_reduce(0, inv, pos, "amax")
            survive = last[inv] == pos
            self._buf = {key: v[survive] for key, v in merged.items()}
        else:
            self._buf = {key: v[-self.buffer_size :] for key, v in merged.items()}

    def replay_buffer(self) -> dict[str, Shaped[Tensor, "G ..."]]:
        """A copy of the buffer: ``keys``, ``prompt_ids``, ``steps``, ``counts`` ``[G]``, ``rewards [G, n_max]``
        (zero-padded past ``counts``), oldest first."""
        return {k: v.clone() for k, v in self._buf.items()}

    def state_dict(self) -> dict[str, Any]:
        """The table (labels; the rows only when the table is private), reference set, replay buffer, counters
        (``planned_groups``: :math:`B` of the last plan, which the ``"code"`` buffer rule truncates with) and the
        generator state (copies; embeddings are config)."""
        return dump_state(
            {
                "step": self._step,
                "next_key": self._next_key,
                "table": self._cols.state(),
                "ref_ids": self._ref_ids.clone(),
                "ref_labels": self._ref_labels.clone(),
                "buffer": self.replay_buffer(),
                "planned_groups": self._planned_groups,
                "generator": self._gen.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "DOTS")
        buf = s["buffer"]
        if buf["keys"].numel() and int(buf["keys"][-1]) >= s["next_key"]:
            raise InputError(
                "state['buffer']['keys']", f"keys below next_key={s['next_key']}", "a key not below it", "pass state"
            )
        if bool((buf["counts"] > self.n_max).any()):
            raise InputError(
                "state['buffer']['counts']", f"counts <= n_max={self.n_max}", "a larger count", "pass state_dict()"
            )
        self._cols.load(s["table"])
        self._step = s["step"]
        self._next_key = s["next_key"]
        self._ref_ids = s["ref_ids"]
        self._ref_labels = s["ref_labels"]
        self._buf = buf
        self._planned_groups = s["planned_groups"]
        self._gen.set_state(s["generator"])
