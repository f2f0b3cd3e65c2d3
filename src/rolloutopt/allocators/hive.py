r"""HIVE's pre-rollout prompt filter from history (arXiv 2603.25184): :class:`HIVE`.

Picks, before rollout, which candidate prompts of a step get a group of ``n`` rollouts, from per-prompt history
kept in the columns of a bounded, checkpointable :class:`~rolloutopt.allocators.table.PromptTable` (one
``torch.searchsorted`` per lookup, no Python loop over prompts or rollouts). Stage 1 keeps prompts whose recent
mean reward is in a band, ranked by their historical response entropy; stage 2 prunes survivors whose *prompt
entropy* (measured now by the caller, a prefill-only forward pass) fell against the value stored with their
history. No public code; every rule and default is **[reconstructed]**, hence ``experimental=True``. See
``docs/methods/filters.md``.

HIVE accepts the per-rollout *response entropies* (the ``entropy`` signal: ``plan.observe(request, rewards,
entropy=...)``, float ``[n]`` aligned with the rewards; ``update`` reads ``result.signals["entropy"]``). Its prompt
entropy is a probe signal: its plan first sends a probe request (``request.is_probe``, counts 0) and the trainer
answers ``plan.observe(probe, None, prompt_entropy=...)`` (float ``[R]``, one per probed prompt) or
``observe(probe, None)`` when it cannot measure it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import choice, require_experimental
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
from rolloutopt.allocators._filters import _check_entropy, _keyed, _order, _shift_in
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatP, IntP

__all__ = ["HIVE"]

_DOCS = "docs/methods/filters.md"


class _HIVEPlan(Conversation):
    """HIVE's conversation: a probe for the stage-1 survivors' prompt entropy (skipped when none survives), then
    one request of ``n`` per selected prompt; every rollout kept."""

    reason_names = ("selected", "out_of_band", "entropy_pruned", "over_budget")

    def __init__(self, hive: HIVE, ids: Tensor, budget: int) -> None:
        super().__init__(ids, budget, accepts=HIVE.accepts)
        self._hive = hive
        self._stage1, self._keyed = hive._stage1(ids)
        self._probed = False
        self._reasons: Tensor | None = None
        self._sent = False

    def decide(self) -> Request | None:
        if not self._probed:
            self._probed = True
            if bool(self._stage1.any()):
                return self.probe(self._stage1, ("prompt_entropy",))
        if self._sent:
            return None
        self._sent = True
        h_now = self.signal("prompt_entropy")
        if h_now is not None and bool(torch.isnan(h_now[self._stage1]).any()):
            raise InputError(
                "prompt_entropy", "a value for every probed prompt", "NaN for some", "measure every probed prompt"
            )
        if self._hive.stage2 == "top" and h_now is None and bool(self._stage1.any()):
            raise InputError(
                "prompt_entropy",
                "the probe answered with prompt_entropy=... (HIVE(stage2='top') ranks by it)",
                "a probe answered without it",
                "pass plan.observe(probe, None, prompt_entropy=...)",
            )
        counts, self._reasons = self._hive._decide(self.prompt_ids, self.budget, self._stage1, h_now, self._keyed)
        keep = counts > 0
        return self.request(keep, counts[keep]) if bool(keep.any()) else None

    def select(self) -> tuple[Tensor, Tensor]:
        assert self._reasons is not None  # finish() comes after next() returned None, which decides first
        return torch.ones(self.spent_observed, dtype=torch.float64), self._reasons


# -- HIVE -------------------------------------------------------------------------------------------------------
class HIVE(TableOwner):
    r"""HIVE: history-informed pre-filter plus online prompt-entropy pruning (arXiv 2603.25184). **[reconstructed]**

    Every rule below is the project's reconstruction from the abstract and summaries (``docs/methods/filters.md``);
    each knob is a keyword and ``experimental=True`` is required. Per prompt, the last ``window`` rolled
    out groups' mean reward and mean response entropy are kept, and the prompt entropy measured the last time it
    was selected.

    - **Stage 1** (history): a seen prompt passes iff its window-mean reward :math:`\bar r` satisfies
      :math:`p_\text{lo} \le \bar r \le p_\text{hi}`; unseen prompts always pass. Survivors are ranked by
      historical response entropy :math:`\bar H`, descending (unseen first, seen without recorded entropy
      last).
    - **Stage 2** (online): the plan's first request is a probe of the stage-1 survivors for their prompt
      entropy :math:`h` (``request.is_probe``; the mean token-level predictive entropy over the prompt tokens
      from one prefill pass of the current policy), answered with ``plan.observe(probe, None,
      prompt_entropy=h)``, float ``[R]``:

      - ``stage2="drop"``: drop a survivor whose stored prompt entropy :math:`h_0` exists and
        :math:`h_0 - h > \delta\,|h_0|` (``"entropy_pruned"``); a probe answered without ``prompt_entropy``
        skips stage 2;
      - ``stage2="top"``: rank the stage-1 survivors by :math:`h`, descending (the budget then keeps the
        top ones).

    The ranked survivors get ``n`` rollouts each until the budget runs out (partial group of at least ``n_min``
    at the edge, leftovers spread up to ``n_max``); the rest are ``"over_budget"``. Stage 2 never adds prompts:
    ``|stage 2| <= |stage 1| <= |pool|``. Remaining ties are broken by a seeded random rank per prompt id.

    Args:
        n: rollouts per selected prompt (8, project default); n_min, n_max: per-prompt caps (default ``n``).
        p_lo, p_hi: the reward band (0.1, 0.9, project default).
        window: groups of history per prompt (4, project default).
        delta: relative prompt-entropy drop that prunes (0.1, project default).
        stage2: ``"drop"`` (default) or ``"top"``.
        seed: seed of the tie-break generator.
        experimental: must be True (every rule is reconstructed).
        capacity: prompts kept in a private table (default None: 1,000,000; least recently updated evicted).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); HIVE registers
            ``reward``, ``entropy`` (windows of ``window``) and ``prompt_entropy`` as owner ``"hive"``, and the
            caller saves a shared table once.

    Budget: never more than ``budget``; all of it only when enough prompts survive. Response entropies are
    optional: ``plan.observe(request, rewards, entropy=...)`` (without them the entropy ranking falls back to
    ties). With ``stage2="top"`` the probe must be answered with ``prompt_entropy``.

    Edge cases: an empty pool or a zero budget requests nothing; a prompt that got no rollouts keeps its
    history (the prompt entropy of a selected prompt is stored at ``plan``).
    """

    accepts: ClassVar[tuple[str, ...]] = ("entropy", "prompt_entropy")
    reference: ClassVar[str] = "arXiv 2603.25184 (HIVE: history-informed, online-verified prompt selection)"
    experimental: ClassVar[str | None] = "the band filter, the entropy ranking and the pruning are reconstructed"

    def __init__(
        self,
        *,
        n: int = 8,
        n_min: int | None = None,
        n_max: int | None = None,
        p_lo: float = 0.1,
        p_hi: float = 0.9,
        window: int = 4,
        delta: float = 0.1,
        stage2: Literal["drop", "top"] = "drop",
        seed: int = 0,
        experimental: bool = False,
        capacity: int | None = None,
        table: PromptTable | None = None,
    ) -> None:
        require_experimental(experimental, "HIVE (band filter, entropy ranking, prompt-entropy pruning)", _DOCS)
        self.n, self.n_min, self.n_max = _group_sizes(n, n_min, n_max)
        self.p_lo = _check_float(p_lo, "p_lo", -1e300, 1e300, "pass e.g. p_lo=0.1")
        self.p_hi = _check_float(p_hi, "p_hi", self.p_lo, 1e300, "pass p_hi >= p_lo, e.g. 0.9")
        self.window = _check_int(window, "window", 1, "pass e.g. window=4")
        self.delta = _check_float(delta, "delta", 0.0, 1e6, "pass e.g. delta=0.1")
        choice(stage2, "stage2", ("drop", "top"))
        self.stage2 = stage2
        self.seed = _check_int(seed, "seed", 0, "pass a non-negative int")
        self._gen = torch.Generator().manual_seed(self.seed)
        window_col = Column("float", (self.window,), math.nan, ("finite_or_nan",))  # NaN: an empty slot
        self._cols = open_table(
            table,
            capacity,
            "hive",
            {
                "reward": window_col,
                "entropy": window_col,  # NaN also where the trainer did not observe the response entropies
                "prompt_entropy": Column("float", (), math.nan, ("finite_or_nan",)),  # NaN: none stored
            },
        )

    def history(self, prompt_ids: IntP) -> tuple[FloatP, FloatP, FloatP]:
        """Per prompt, float64 ``[P]``: window-mean reward, window-mean response entropy, stored prompt entropy
        (NaN where there is none)."""
        return self._history(as_prompt_ids(prompt_ids))

    def _history(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self._cols.empty:
            nan = torch.full(ids.shape, math.nan, dtype=torch.float64)
            return nan, nan.clone(), nan.clone()
        pos, found = self._cols.find(ids)
        return self._history_at(pos, found)

    def _history_at(self, pos: Tensor, found: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self._cols.empty:
            nan = torch.full(pos.shape, math.nan, dtype=torch.float64)
            return nan, nan.clone(), nan.clone()
        # a row another owner of a shared table added holds the fills (NaN): no history, as unseen
        c = self._cols
        r = torch.where(found, torch.nanmean(c["reward"][pos], dim=1), math.nan)
        h = torch.where(found, torch.nanmean(c["entropy"][pos], dim=1), math.nan)
        return r, h, torch.where(found, c["prompt_entropy"][pos], math.nan)

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Stage 1; a probe request for the survivors' prompt entropy (stage 2); then one request of ``n`` per
        survivor (see the class docstring)."""
        return _HIVEPlan(self, as_prompt_ids(prompt_ids), check_budget(budget))

    def _decide(
        self, ids: Tensor, budget: int, stage1: Tensor, h_now: Tensor | None, keyed: Any
    ) -> tuple[Tensor, Tensor]:
        """Stage 2 and the counts, once the probe is answered (``h_now``: float64 ``[P]`` or None)."""
        p = ids.numel()
        seq, at, found, store = keyed
        if self._cols.table.prompt_ids is not store and not self._cols.empty:
            at, found = self._cols.find(ids)  # rows were inserted or evicted since the plan: look up again
        r, h_hist, h_stored = self._history_at(at, found)
        seen = ~torch.isnan(r)
        reasons = torch.where(stage1, 0, 1)
        if h_now is not None and self.stage2 == "drop":
            pruned = stage1 & ~torch.isnan(h_stored) & (h_stored - h_now > self.delta * h_stored.abs())
            reasons = torch.where(pruned, 2, reasons)
        if self.stage2 == "top":  # h_now is None only when nothing survived stage 1 (no probe was sent)
            key = -h_now if h_now is not None else torch.zeros(p, dtype=torch.float64)
        else:
            key = -torch.where(~seen, math.inf, torch.where(torch.isnan(h_hist), -math.inf, h_hist))
        order = _order([key], seq, reasons == 0)
        counts = torch.zeros(p, dtype=torch.long)
        counts[order] = _fill(order.numel(), budget, self.n, self.n_min, self.n_max)
        reasons = torch.where((reasons == 0) & (counts == 0), 3, reasons)
        if h_now is not None:
            chosen = counts > 0
            pos, srt = self._cols.add(ids[chosen])
            self._cols["prompt_entropy"][pos] = h_now[chosen][srt]
        return counts, reasons

    def _stage1(self, ids: Tensor) -> tuple[Tensor, Any]:
        """The stage-1 survivors ``[P]`` bool and the candidates' tie order, history positions, and the table's
        ids they index (the positions go stale when another owner of a shared table inserts rows)."""
        store = self._cols.table.prompt_ids
        seq, at, found = _keyed(ids, self._gen, store)
        r = self._history_at(at, found)[0]
        seen = ~torch.isnan(r)
        return ~seen | ((r >= self.p_lo) & (r <= self.p_hi)), (seq, at, found, store)

    def update(self, result: AllocationResult) -> None:
        """Append each rolled-out prompt's group mean reward (and mean response entropy, from
        ``result.signals["entropy"]`` when the trainer observed it) to its window."""
        result = _check_result(result)
        entropy = result.signals.get("entropy")
        p = result.plan_prompt_ids.numel()
        cnt = result.counts.clamp(min=1).double()
        mean_r = torch.bincount(result.group, weights=result.rewards.double(), minlength=p) / cnt
        if entropy is None:
            mean_h = torch.full((p,), math.nan, dtype=torch.float64)
        else:
            e = _check_entropy(entropy, result.rewards.numel(), "entropy")
            mean_h = torch.bincount(result.group, weights=e, minlength=p) / cnt
        rolled = result.counts > 0
        pos, order = self._cols.add(result.plan_prompt_ids[rolled])
        self._cols["reward"] = _shift_in(self._cols["reward"], pos, mean_r[rolled][order])
        self._cols["entropy"] = _shift_in(self._cols["entropy"], pos, mean_h[rolled][order])

    STATE: ClassVar[dict[str, Field]] = {
        "table": TableColumns.FIELD,
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (the table's columns are validated by the table: NaN marks an
    empty window slot or a missing entropy; the windows' width must equal ``window``)."""

    def state_dict(self) -> dict[str, Any]:
        """The table (reward and entropy windows ``[M, window]``, stored prompt entropies; the rows only when the
        table is private) and the generator; copies."""
        return dump_state({"table": self._cols.state(), "generator": self._gen.get_state()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one),
        with windows of this allocator's ``window``."""
        s = load_state(state, self.STATE, "HIVE")
        self._cols.load(s["table"])
        self._gen.set_state(s["generator"])
