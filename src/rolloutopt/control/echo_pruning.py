r"""ECHO's online confidence-based pruning of rollout-tree branches (arXiv 2602.02150).

:class:`ECHOPruning` (streaming :class:`~rolloutopt.control.StopRule`) terminates persistently low-confidence
branches of a rollout tree while each tree keeps ``min_branches``. Reconstructed from the abstract and a public
summary (``experimental=True``). ECHO's confidence-adaptive clip is :mod:`rolloutopt.ratios.echo`. Provenance and worked
examples: ``docs/methods/truncation_rules.md``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rolloutopt._validation import (
    Dims,
    as_index,
    describe,
)
from rolloutopt._validation import (
    check_int as _int,
)
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.control._base import StepInputs, StopRule, StopState
from rolloutopt.control._markers import _check_flag, _row_id
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import FloatB

__all__ = ["ECHOPruning"]

_SIGNALS = ("sampled_prob", "exp_neg_entropy", "topk_mean_prob")


# ============================================================================================ ECHO (2602.02150)
class ECHOPruning(StopRule):
    r"""ECHO's online confidence-based pruning: terminate persistently low-confidence branches of a rollout tree.

    Rows are branches; ``group`` (given to :meth:`~rolloutopt.control.StopRule.init`) says which tree each belongs to. Per token a confidence
    :math:`c_t` (``signal``) enters a moving window of the last :math:`W` tokens,

    .. math::
        \bar c_{i,t} = \frac{1}{\min(n_i, W)} \sum_{s = t - \min(n_i, W) + 1}^{t} c_{i,s},
        \qquad c_t \in \{\, p(y_t),\ e^{-H_t},\ \tfrac1k\textstyle\sum_{v \in \mathrm{top}k} p_t(v) \,\},

    and a live branch becomes a candidate when :math:`\bar c < \tau` has held for ``patience`` consecutive tokens
    and it has generated at least ``min_tokens`` tokens. Candidates are terminated (reason ``"low_confidence"``)
    lowest :math:`\bar c` first (ties by ``row_id``) while their tree keeps at least ``min_branches`` branches
    not stopped by this rule (finished and not-yet-started rows count as kept).

    Reference: ECHO (Entropy-Confidence Hybrid GRPO), arXiv 2602.02150.
    **Reconstructed** from the abstract ("online confidence-based pruning to terminate persistently
    low-confidence branches") and a public summary (token confidence as the mean top-k probability, window
    smoothing); the window rule, the persistence test, the floor on branches and all defaults are ours, hence
    ``experimental=True`` is required.

    Args:
        threshold: :math:`\tau`. Default 0.5 — ours, for the default signal. ``"topk_mean_prob"`` is at most
            :math:`1/k`: scale :math:`\tau` with it.
        window: :math:`W >= 1` tokens. Default 32 — ours.
        patience: consecutive low tokens needed (>= 1). Default 1 — ours (the window already smooths).
        min_tokens: warm-up before a branch can be pruned; None means ``window``. Default None.
        min_branches: branches kept per tree (>= 0). Default 1.
        signal: ``"sampled_prob"`` (default; :math:`e^{\log p(y_t)}`, needs ``logp``), ``"exp_neg_entropy"``
            (needs ``entropy``) or ``"topk_mean_prob"`` (the summary's ECHO token confidence; needs
            ``topk_logp``).
        experimental: must be True.

    :meth:`~rolloutopt.control.StopRule.init` takes ``group`` int ``[N]`` (required: tree ids) and an optional ``row_id`` int ``[N]`` (unique
    tie-break keys, default the row index; permuting rows together with their ``group`` and ``row_id`` permutes
    the decisions). Per-row state: the window ``buf`` ``[N, W]``, the low streak ``low``.

    Edge cases: an all-inactive batch changes nothing; N = 0 works; a singleton tree with ``min_branches >= 1``
    is never pruned; ``min_branches=0`` prunes every candidate.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "low_confidence")
    #: for the default ``signal="sampled_prob"``; an instance requires the one standard input its signal reads
    requires: ClassVar[tuple[str, ...]] = ("logp", "group")
    accepts: ClassVar[tuple[str, ...]] = ("row_id",)
    init_inputs: ClassVar[dict[str, tuple[str, str]]] = {"group": ("N", "int"), "row_id": ("N", "int")}
    reference: ClassVar[str] = "arXiv 2602.02150 (ECHO's online confidence-based pruning)"
    experimental: ClassVar[str | None] = "the window rule, the persistence test and the branch floor are reconstructed"

    def __init__(
        self,
        *,
        threshold: float = 0.5,
        window: int = 32,
        patience: int = 1,
        min_tokens: int | None = None,
        min_branches: int = 1,
        signal: Literal["sampled_prob", "exp_neg_entropy", "topk_mean_prob"] = "sampled_prob",
        experimental: bool = False,
    ) -> None:
        _check_flag(
            experimental,
            "",
            "ECHO's confidence-based branch pruning (from the abstract)",
            "docs/methods/truncation_rules.md",
        )
        _real(threshold, "threshold", 0.0, 1.0)
        _int(window, "window", 1)
        _int(patience, "patience", 1)
        _int(min_tokens, "min_tokens", 0, none=True)
        _int(min_branches, "min_branches", 0)
        if signal not in _SIGNALS:
            raise InputError("signal", f"one of {_SIGNALS}", describe(signal), "pass signal='sampled_prob'")
        self.threshold = float(threshold)
        self.window = window
        self.patience = patience
        self.min_tokens = window if min_tokens is None else min_tokens
        self.min_branches = min_branches
        self.signal = signal
        # the one standard input this instance's signal reads, and the tree ids (StopRule checks self.requires)
        signal_input = {"sampled_prob": "logp", "exp_neg_entropy": "entropy", "topk_mean_prob": "topk_logp"}[signal]
        self.__dict__["requires"] = (signal_input, "group")

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        group = inputs.pop("group", None)
        row_id = _row_id(inputs.pop("row_id", None), n, device)
        super()._init(n, device, **inputs)
        if group is None:
            raise InputError("group", "tree ids [N] (int)", "None", "pass init(n, group=tree_id_of_each_row)")
        dims = Dims()
        dims.sizes["N"] = (n, "batch_size")
        gid = as_index(group, "group", dims, "N").to(device)
        tree = Groups(gid).inverse if n > 0 else gid
        order = torch.argsort(row_id, stable=True)
        return {
            "tree": tree,
            "tie_order": order,
            "buf": torch.zeros(n, self.window, dtype=torch.float32, device=device),
            "low": torch.zeros(n, dtype=torch.long, device=device),
            "confidence": torch.ones(n, dtype=torch.float32, device=device),
        }

    def _signal(self, x: StepInputs) -> Tensor:
        name = "ECHOPruning"
        if self.signal == "sampled_prob":
            c = x.need("logp", name).clamp(max=0.0).exp()
        elif self.signal == "exp_neg_entropy":
            c = (-x.need("entropy", name).clamp(min=0.0)).exp()
        else:
            c = x.need("topk_logp", name).clamp(max=0.0).exp().mean(dim=-1)
        return c.float()

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        e = state.extra
        live = x.live
        n = state.batch_size
        c = self._signal(x)
        slot = (state.steps % self.window)[:, None]
        old = e["buf"].gather(1, slot)
        buf = e["buf"].scatter(1, slot, torch.where(live[:, None], c[:, None], old))
        seen = (state.steps + live.long()).clamp(max=self.window)
        mean = torch.where(live, buf.sum(dim=1) / seen.clamp(min=1).to(buf.dtype), e["confidence"])
        low = torch.where(live, torch.where(mean < self.threshold, e["low"] + 1, 0), e["low"])
        cand = live & (low >= self.patience) & (state.steps + 1 >= self.min_tokens)
        # rank the candidates of each tree by (mean, row_id): two stable sorts on top of the row_id order
        tree = e["tree"]
        key = torch.where(cand, mean, torch.full_like(mean, math.inf))
        order = e["tie_order"]
        order = order.index_select(0, torch.argsort(key.index_select(0, order), stable=True))
        order = order.index_select(0, torch.argsort(tree.index_select(0, order), stable=True))
        size = torch.zeros(n, dtype=torch.long, device=tree.device).index_add_(0, tree, torch.ones_like(tree))
        start = torch.cumsum(size, 0) - size
        pos = torch.arange(n, device=tree.device) - start.index_select(0, tree.index_select(0, order))
        rank = torch.empty_like(pos).scatter_(0, order, pos)
        kept = torch.zeros(n, dtype=torch.long, device=tree.device).index_add_(0, tree, (~state.stopped).long())
        allowed = (kept - self.min_branches).clamp(min=0)
        fire = cand & (rank < allowed.index_select(0, tree))
        extra = {"tree": tree, "tie_order": e["tie_order"], "buf": buf, "low": low, "confidence": mean}
        return extra, fire, 1

    def confidence(self, state: StopState) -> FloatB:
        """The current windowed confidence :math:`\\bar c` float32 ``[N]`` (1 before a row's first token)."""
        if not isinstance(state, StopState):
            raise InputError("state", "a StopState from rule.init()", describe(state), "pass the state step() returned")
        return state.extra["confidence"].clone()
