r"""DEPO's online pre-rollout prompt filter (arXiv 2509.01321): :class:`DEPO`, :func:`depo_group_scores`.

Picks, before rollout, which candidate prompts of a step get a group of ``n`` rollouts, from per-prompt history
kept in bounded, checkpointable tensors aligned with sorted int64 prompt ids (one ``torch.searchsorted`` per
lookup, no Python loop over prompts or rollouts).

The online explorability filter of ``txy77/DEPO`` (``verl/trainer/rollout_purning/rollout_purning.py``,
``Rollout_Purning.purning_by_entropy``), with the code's replay-by-padding of least-explored prompts. The offline
curation (PageRank-weighted DPP, normal difficulty sampling) is out of scope: it is a one-off dataset selection
over sample embeddings, not an allocator. :func:`depo_group_scores` is the code's per-epoch score, vectorised.
See ``docs/methods/filters.md``.

DEPO requires the per-rollout *response entropies* (the mean token entropy of each response), the ``entropy``
signal: each request asks for it (``request.signals``), the trainer passes it with the rewards
(``plan.observe(request, rewards, entropy=...)``, float ``[n]`` aligned with the rewards) and ``update`` reads
``result.signals["entropy"]``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from jaxtyping import Bool
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
from rolloutopt.allocators._filters import _check_entropy, _keyed, _order, _shift_in
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatG, FloatP, IntB, IntP

__all__ = ["DEPO", "depo_group_scores"]


class _DEPOPlan(OneShotPlan):
    reason_names = ("selected", "unseen", "epoch_zero", "padded", "filtered", "over_budget")


# -- DEPO -------------------------------------------------------------------------------------------------------
def depo_group_scores(
    group: IntB,
    correct: Bool[Tensor, " B"],
    entropy: FloatB,
    *,
    num_groups: int,
    neg_pos_ratio: float = 0.5,
    eps: float = 1e-8,
) -> FloatG:
    r"""DEPO's explorability score of each group (one prompt's rollouts in one epoch), vectorised.

    With :math:`m`, :math:`s` the mean and population standard deviation of the group's correctness,
    :math:`A^+ = (1 - m) / (s + \epsilon)`, :math:`A^- = -m / (s + \epsilon)` and :math:`\bar H_+` the mean
    entropy of the correct responses (0 when there are none, as in the code):

    .. math::

        \mathrm{score} = \sum_{i\,\text{correct}} |A^+ H_i|
            + \sum_{i\,\text{wrong},\ H_i \le \rho \bar H_+} |A^- H_i| ,

    so high-entropy failures (:math:`H_i > \rho \bar H_+`) do not count. Reference: arXiv 2509.01321, code
    ``txy77/DEPO`` ``Rollout_Purning.purning_by_entropy``. An all-correct or
    all-wrong group scores 0 (its advantages are 0).

    Args:
        group: int64 ``[N]``, each rollout's group in ``0..num_groups-1``.
        correct: bool ``[N]``, whether each rollout is correct.
        entropy: float ``[N]``, each response's (mean token) entropy.
        num_groups: number of groups G (groups without rollouts score 0).
        neg_pos_ratio: :math:`\rho` (0.5, third-party re-implementation; the repository's value is unverified).
        eps: :math:`\epsilon` (code 1e-8).

    Returns:
        float32 ``[G]`` (float64 for a float64 ``entropy``; computed in float64).
    """
    if not isinstance(group, Tensor) or group.is_floating_point() or group.dtype == torch.bool or group.ndim != 1:
        raise InputError("group", "an int64 tensor [N]", describe(group), "pass the rollouts' group indices")
    n = group.numel()
    if not isinstance(correct, Tensor) or correct.dtype != torch.bool or tuple(correct.shape) != (n,):
        raise InputError("correct", f"a bool tensor [{n}]", describe(correct), "pass rewards >= threshold")
    e = _check_entropy(entropy, n, "entropy")
    num_groups = _check_int(num_groups, "num_groups", 0, "pass the number of groups")
    if n and (int(group.min()) < 0 or int(group.max()) >= num_groups):
        raise InputError("group", f"indices in [0, {num_groups})", describe(group), "pass num_groups > group.max()")
    neg_pos_ratio = _check_float(neg_pos_ratio, "neg_pos_ratio", -1e300, 1e300, "pass e.g. 0.5")
    eps = _check_float(eps, "eps", 0.0, 1.0, "pass e.g. 1e-8", open_low=True)
    out = _depo_scores(group.long(), correct, e, num_groups, neg_pos_ratio, eps)
    return out if entropy.dtype == torch.float64 else out.float()


def _depo_scores(group: Tensor, correct: Tensor, e: Tensor, g: int, ratio: float, eps: float) -> Tensor:
    c = correct.double()
    cnt = torch.bincount(group, minlength=g).double()
    n_pos = torch.bincount(group, weights=c, minlength=g)
    m = n_pos / cnt.clamp(min=1)
    s = (m * (1 - m)).clamp(min=0).sqrt()
    a_pos = (1 - m) / (s + eps)
    a_neg = m / (s + eps)
    mean_pos = torch.bincount(group, weights=e * c, minlength=g) / n_pos.clamp(min=1)
    keep_neg = ~correct & (e <= (ratio * mean_pos).index_select(0, group))
    e_abs = e.abs()
    pos_sum = torch.bincount(group, weights=e_abs * c, minlength=g)
    neg_sum = torch.bincount(group, weights=e_abs * keep_neg.double(), minlength=g)
    return a_pos.abs() * pos_sum + a_neg.abs() * neg_sum


class DEPO(TableOwner):
    r"""DEPO's online explorability filter with its replay of least-explored prompts (arXiv 2509.01321).

    Each prompt keeps the explorability scores (:func:`depo_group_scores`) of its last ``history_k`` rolled-out
    groups and its exploration count (groups ever rolled out). At a step of epoch :math:`t` with candidates
    ``prompt_ids``:

    - epoch 0: every candidate is kept (reason ``"epoch_zero"``);
    - otherwise candidates with no history are kept (``"unseen"``), and of the :math:`K` others the top
      :math:`\lfloor K \cdot \mathrm{thr} \rfloor` by (score descending, exploration count ascending) are kept
      (``"selected"``), with

      .. math::

          \mathrm{thr} = \mathrm{clamp}(\text{init\_ratio} - \text{decay}\cdot t,\ \text{min\_ratio},\ 1),
          \qquad \mathrm{score} = \frac{1}{w} \sum_{j=1}^{w} \mathrm{score}_j
          \ (\text{the last } w = \min(\text{history\_k}, \text{count}) \text{ groups});

    - replay: the kept set is padded up to a multiple of ``pad_multiple`` (the code's GPU count) with the
      remaining prompts of least exploration count (ties: higher score) (``"padded"``); the rest are
      ``"filtered"``.

    The kept prompts, in the order unseen, selected, padded (unseen prompts, and every prompt at epoch 0, in a
    seeded random order per prompt id, so the plan does not depend on the candidates' order), get ``n`` rollouts
    each until the budget runs out (:func:`~rolloutopt.allocators.dps._fill`: a partial group of at least
    ``n_min`` at the budget's edge, leftovers spread up to ``n_max``); kept prompts the budget does not reach are
    ``"over_budget"``. Remaining ties are broken by a seeded random rank per prompt id.

    Reference: ``txy77/DEPO`` ``verl/trainer/rollout_purning/rollout_purning.py`` (``docs/methods/filters.md``).
    Defaults: ``history_k = 5``, ``init_ratio = 1.0``, ``decay = 0.01``, ``neg_pos_ratio = 0.5`` from a
    third-party re-implementation (the repository's config values are unverified); ``min_ratio = 0.40`` and
    ``eps = 1e-8`` are the code's constants; ``n = 8`` and ``pad_multiple = 1`` (no padding) are this project's.

    Deliberate differences from the code: the per-prompt trace (per-epoch lists of correct/wrong entropies that
    grow without bound) is replaced by the last ``history_k`` epoch scores and a count, which is equivalent for
    the rule and bounded (``history_k + 1`` numbers per prompt); the code selects by position in a deduplicated
    ``set`` of dataset indices (which can pick the wrong batch rows), this selects by prompt id; each ``update``
    appends one score per rolled-out prompt (one "epoch" entry; the code appends one per epoch).

    Args:
        n: rollouts per kept prompt; n_min, n_max: per-prompt caps (default ``n``; ``n_min <= n <= n_max``).
        history_k: window of epoch scores (5).
        init_ratio, decay, min_ratio: the keep-ratio schedule (1.0, 0.01, 0.40).
        neg_pos_ratio: failures with entropy above this times the correct responses' mean entropy are ignored
            (0.5).
        eps: the advantage denominators' epsilon (1e-8).
        correct_threshold: a rollout is correct iff its reward ``>=`` this (1.0: exact success for 0/1 rewards).
        pad_multiple: pad the kept set to a multiple of this (the code's ``total_gpus``; 1 disables padding).
        steps_per_epoch: None: the epoch is what :meth:`set_epoch` last said (0 until then, so everything is
            kept); an int: ``epoch = steps // steps_per_epoch`` after each ``update``.
        seed: seed of the tie-break generator.
        capacity: prompts kept in a private table (default None: 1,000,000; least recently updated evicted).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); DEPO registers
            ``scores`` and ``count`` as owner ``"depo"``, and the caller saves a shared table once.

    Budget: never more than ``budget``; it spends all of it only when the kept prompts can absorb it (up to
    ``n_max`` each). Response entropies are required: ``plan.observe(request, rewards, entropy=...)``.

    Edge cases: an empty pool or a zero budget requests nothing; a planned prompt that got no rollouts keeps its
    history unchanged.
    """

    requires: ClassVar[tuple[str, ...]] = ("entropy",)
    reference: ClassVar[str] = "arXiv 2509.01321 (DEPO, the online explorability filter); code txy77/DEPO"
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        n: int = 8,
        n_min: int | None = None,
        n_max: int | None = None,
        history_k: int = 5,
        init_ratio: float = 1.0,
        decay: float = 0.01,
        min_ratio: float = 0.40,
        neg_pos_ratio: float = 0.5,
        eps: float = 1e-8,
        correct_threshold: float = 1.0,
        pad_multiple: int = 1,
        steps_per_epoch: int | None = None,
        seed: int = 0,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        self.n, self.n_min, self.n_max = _group_sizes(n, n_min, n_max)
        self.history_k = _check_int(history_k, "history_k", 1, "pass e.g. history_k=5")
        self.init_ratio = _check_float(init_ratio, "init_ratio", 0.0, 1e6, "pass e.g. init_ratio=1.0")
        self.decay = _check_float(decay, "decay", 0.0, 1e6, "pass e.g. decay=0.01")
        self.min_ratio = _check_float(min_ratio, "min_ratio", 0.0, 1.0, "pass e.g. min_ratio=0.4 (code)")
        self.neg_pos_ratio = _check_float(neg_pos_ratio, "neg_pos_ratio", -1e300, 1e300, "pass e.g. 0.5")
        self.eps = _check_float(eps, "eps", 0.0, 1.0, "pass e.g. eps=1e-8 (code)", open_low=True)
        self.correct_threshold = _check_float(correct_threshold, "correct_threshold", -1e300, 1e300, "pass 1.0")
        self.pad_multiple = _check_int(pad_multiple, "pad_multiple", 1, "pass the GPU count, or 1")
        if steps_per_epoch is not None:
            steps_per_epoch = _check_int(steps_per_epoch, "steps_per_epoch", 1, "pass None or the steps in an epoch")
        self.steps_per_epoch = steps_per_epoch
        self.seed = _check_int(seed, "seed", 0, "pass a non-negative int")
        self.epoch = 0
        self.steps = 0
        self._gen = torch.Generator().manual_seed(self.seed)
        self._cols = open_table(
            table,
            capacity,
            "depo",
            {
                "scores": Column("float", (self.history_k,), math.nan, ("finite_or_nan",)),  # NaN: an empty slot
                "count": Column("int", checks=("nonneg",)),
            },
        )

    def set_epoch(self, epoch: int) -> None:
        """Tell the filter the current epoch (epoch 0 keeps everything; the keep ratio decays with it)."""
        self.epoch = _check_int(epoch, "epoch", 0, "pass the epoch number, from 0")

    @property
    def keep_ratio(self) -> float:
        """This epoch's ``thr = clamp(init_ratio - decay * epoch, min_ratio, 1)``."""
        return max(self.min_ratio, min(1.0, self.init_ratio - self.decay * self.epoch))

    def scores(self, prompt_ids: IntP) -> tuple[FloatP, IntP]:
        """Per prompt ``[P]``: the window-mean explorability score (float64, NaN if unseen), exploration count."""
        return self._scores_of(as_prompt_ids(prompt_ids))

    def _scores_of(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        if self._cols.empty:
            return torch.full(ids.shape, math.nan, dtype=torch.float64), torch.zeros_like(ids)
        pos, found = self._cols.find(ids)
        return self._scores_at(pos, found)

    def _scores_at(self, pos: Tensor, found: Tensor) -> tuple[Tensor, Tensor]:
        if self._cols.empty:
            return torch.full(pos.shape, math.nan, dtype=torch.float64), torch.zeros_like(pos)
        # a row another owner of a shared table added holds the fills: NaN scores and count 0, as unseen
        score = torch.where(found, torch.nanmean(self._cols["scores"][pos], dim=1), math.nan)
        return score, torch.where(found, self._cols["count"][pos], 0)

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Filter the candidates ``prompt_ids`` (see the class docstring), then one request of ``n`` each."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        seq, at, found = _keyed(ids, self._gen, self._cols.table.prompt_ids)
        reasons = torch.full((p,), 4, dtype=torch.long)
        if self.epoch == 0:
            order = seq
            reasons[:] = 2
        else:
            score, count = self._scores_at(at, found)
            unseen = count == 0
            seen = ~unseen
            k = int(seen.sum())
            top_n = int(k * self.keep_ratio)
            ranked = _order([-score, count], seq, seen)
            top = ranked[:top_n]
            rest = ranked[top_n:]
            kept = (p - k) + top_n
            pad = (-kept) % self.pad_multiple
            if pad:
                left = torch.zeros(p, dtype=torch.bool)
                left[rest] = True
                padded = _order([count, -score], seq, left)[:pad]
            else:
                padded = rest[:0]
            unseen_idx = seq[unseen[seq]]
            order = torch.cat([unseen_idx, top, padded])
            reasons[unseen_idx] = 1
            reasons[top] = 0
            reasons[padded] = 3
        counts = torch.zeros(p, dtype=torch.long)
        counts[order] = _fill(order.numel(), budget, self.n, self.n_min, self.n_max)
        reasons = torch.where((counts == 0) & (reasons != 4), 5, reasons)
        return _DEPOPlan(ids, budget, counts, reasons, requires=self.requires)

    def update(self, result: AllocationResult) -> None:
        """Append each rolled-out prompt's explorability score, from the rewards and ``result.signals["entropy"]``
        (required: each rollout's mean token entropy, observed with its rewards)."""
        result = _check_result(result)
        entropy = result.signals.get("entropy")
        if entropy is None:
            raise InputError(
                "entropy",
                "the entropy signal in result.signals: DEPO requires each rollout's mean token entropy",
                "a result without it",
                "pass plan.observe(request, rewards, entropy=...) for every request",
            )
        e = _check_entropy(entropy, result.rewards.numel(), "entropy")
        p = result.plan_prompt_ids.numel()
        correct = result.rewards >= self.correct_threshold
        score = _depo_scores(result.group, correct, e, p, self.neg_pos_ratio, self.eps)
        rolled = result.counts > 0
        ids = result.plan_prompt_ids[rolled]
        pos, order = self._cols.add(ids)
        self._cols["scores"] = _shift_in(self._cols["scores"], pos, score[rolled][order])
        self._cols["count"][pos] += 1
        self.steps += 1
        if self.steps_per_epoch is not None:
            self.epoch = self.steps // self.steps_per_epoch

    STATE: ClassVar[dict[str, Field]] = {
        "table": TableColumns.FIELD,
        "epoch": Field("integer", low=0),
        "steps": Field("integer", low=0),
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (the table's columns are validated by the table: NaN marks an
    empty window slot, whose width must equal ``history_k``)."""

    def state_dict(self) -> dict[str, Any]:
        """The table (score windows ``[M, history_k]`` and counts; the rows only when the table is private), the
        epoch, steps and the generator; copies."""
        return dump_state(
            {
                "table": self._cols.state(),
                "epoch": self.epoch,
                "steps": self.steps,
                "generator": self._gen.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one),
        with windows of this allocator's ``history_k``."""
        s = load_state(state, self.STATE, "DEPO")
        self._cols.load(s["table"])
        self.epoch, self.steps = s["epoch"], s["steps"]
        self._gen.set_state(s["generator"])
