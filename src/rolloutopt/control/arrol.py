r"""ARRoL's quality-head pruning (arXiv 2603.24840).

The rule looks at a rollout only at a *checkpoint* and asks one question there: is this partial rollout worth
finishing? (``docs/methods/early_stop.md``.)

- :class:`ARRoL`: over-generate each group, and at checkpoint position :math:`L_c` prune inside each
  group so that the survivors' predicted positive fraction is closest to :math:`\rho`; the predictor is a
  logistic head trained on the fly (:meth:`ARRoL.train_head`) whose weights and label buffer
  checkpoint with the rule.

It reads its checkpoint inputs only at the rows due at that step: other rows may hold anything (NaN included)
and a stopped row is never evaluated again. :meth:`ARRoL.due` tells the engine which rows need the (costly)
inputs at the next step. Value-based abstention, the other checkpoint rule, is in
:mod:`~rolloutopt.control.abstention`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import (
    Dims,
    as_float,
    as_index,
    as_mask,
    checks_enabled,
    describe,
    finite,
    require_experimental,
)
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import check_real as _real
from rolloutopt.control._base import StepInputs, StopResult, StopState
from rolloutopt.control._checkpoint import _CheckpointRule
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import BoolB, FloatB

__all__ = ["ARRoL"]


class ARRoL(_CheckpointRule):
    r"""ARRoL's online rollout pruning [reconstructed]: a logistic quality head scores partial rollouts at
    :math:`L_c` and each group keeps :math:`n` survivors whose predicted positive fraction is closest to
    :math:`\rho`.

    .. math::
        q_i = \sigma(w^\top h_i + b), \qquad n_g = \lceil \text{keep\_frac} \cdot n'_g \rceil, \qquad
        k_g = \min\big(|C_g|,\ \max(n_g - o_g, 0)\big), \\
        k^+_g = \operatorname{clip}\big(\lfloor \rho k_g + \tfrac12 \rfloor,\ k_g - |C^-_g|,\ |C^+_g|\big),
        \qquad k^-_g = k_g - k^+_g

    where :math:`C_g` are the group's rows reaching token :math:`L_c` at this step (split by :math:`q \ge`
    ``threshold`` into predicted positives :math:`C^+_g` and negatives :math:`C^-_g`), :math:`n'_g` the group's
    size at :meth:`StopRule.init` and :math:`o_g` its rows that are neither stopped nor candidates (finished
    early, or not yet at :math:`L_c`: they count as survivors). The :math:`k^+_g` *least* confident positives (smallest
    :math:`q`) and the :math:`k^-_g` least confident negatives (largest :math:`q`) survive; the others are pruned,
    the most confident of the surplus class first (reason ``"pruned"``; kept length :math:`L_c`; row weight 0 in
    :meth:`finalize`'s result: pruned rollouts leave the loss).

    Reference: ARRoL, arXiv 2603.24840 (``docs/methods/early_stop.md``). The head, the target ratio and BCE
    training on final correctness come from the abstract and summaries; everything else — over-generation by
    ``1 / keep_frac``, the keep count, the rounding, counting early-finished rows as survivors, the label buffer,
    the optimiser — is **reconstructed** (the repository holds no code), so ``experimental=True`` is required.

    Inputs, read at the checkpoint rows only and needed only at steps where a row is due (:meth:`due`; steps
    without them cost next to nothing): ``features [N, D]`` (e.g. the policy's last hidden state at :math:`L_c`,
    preferably normalised; record them, they are what :meth:`train_head` learns from), or ``scores [N]``
    (success probabilities from elsewhere; they take precedence over the head). :meth:`StopRule.init` takes
    ``group=`` (int ids ``[N]`` or a :class:`~rolloutopt.groups.Groups`).
    Until the head has been trained on ``min_labels`` labels, the scores are uniform draws from the rule's
    generator (made at :meth:`StopRule.init`): pruning is random, group sizes are already the target's.

    Args:
        dim: :math:`D`, the feature width (required).
        keep_frac: :math:`n / n'` (0.5: ours; over-generate ``n' = n / keep_frac`` rollouts per prompt).
        checkpoint: :math:`L_c`, the token count at which rows are scored (128: ours).
        rho: the target positive fraction (0.5, summary: "about rho = 0.5").
        threshold: the class boundary on :math:`q` (0.5: ours).
        lr: SGD step of :meth:`train_head` (0.1: ours); ``train_steps`` (20: ours) minibatches of ``train_batch``
            (256: ours) drawn with the rule's generator from the label buffer.
        buffer_size: labels kept, FIFO (4096: ours; "a small buffer", summary).
        min_labels: labels needed before the head is used (64: ours).
        seed: the generator's seed (0). ``device``: where the head and its buffer live (CPU).
        experimental: must be True.

    Edge cases: singleton groups keep their row (:math:`\lceil \text{keep\_frac}\rceil = 1`); ``keep_frac=1``
    never prunes; ties in :math:`q` are broken by row order; inactive rows are never candidates; ``init(0)`` works.
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "pruned")
    requires: ClassVar[tuple[str, ...]] = ("group",)
    #: read at the checkpoint step only (``scores`` take precedence over the head's ``features``)
    accepts: ClassVar[tuple[str, ...]] = ("features", "scores")
    extra_inputs: ClassVar[dict[str, tuple[str, str]]] = {"features": ("N D", "float"), "scores": ("N", "float")}
    init_inputs: ClassVar[dict[str, tuple[str, str]]] = {"group": ("N", "int")}
    reference: ClassVar[str] = "arXiv 2603.24840 (ARRoL: online rollout pruning with a learned quality head)"
    experimental: ClassVar[str | None] = "the pruning rule, the keep count and the head's training are reconstructed"

    def __init__(
        self,
        *,
        dim: int,
        keep_frac: float = 0.5,
        checkpoint: int = 128,
        rho: float = 0.5,
        threshold: float = 0.5,
        lr: float = 0.1,
        train_steps: int = 20,
        train_batch: int = 256,
        buffer_size: int = 4096,
        min_labels: int = 64,
        seed: int = 0,
        device: torch.device | str | None = None,
        experimental: bool = False,
    ) -> None:
        require_experimental(experimental, "ARRoL's pruning rule and head training", "docs/methods/early_stop.md")
        self.dim = _int(dim, "dim", 1)
        self.keep_frac = _real(keep_frac, "keep_frac", 0.0, 1.0, open_low=True)
        self.checkpoint = _int(checkpoint, "checkpoint", 1)
        self.rho = _real(rho, "rho", 0.0, 1.0)
        self.threshold = _real(threshold, "threshold", 0.0, 1.0)
        self.lr = _real(lr, "lr", 0.0, open_low=True)
        self.train_steps = _int(train_steps, "train_steps", 0)
        self.train_batch = _int(train_batch, "train_batch", 1)
        self.buffer_size = _int(buffer_size, "buffer_size", 1)
        self.min_labels = _int(min_labels, "min_labels", 0)
        self.seed = _int(seed, "seed", 0)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._due_inputs = dict(self.extra_inputs)
        self._gen = torch.Generator().manual_seed(self.seed)
        self.weight = torch.zeros(self.dim, device=self.device)
        self.bias = torch.zeros((), device=self.device)
        self._buf_x = torch.zeros(self.buffer_size, self.dim, device=self.device)
        self._buf_y = torch.zeros(self.buffer_size, device=self.device)
        self._count = 0  # labels in the buffer
        self._next = 0  # ring position of the next label
        self.trained = 0  # train_head calls that ran SGD steps

    # -- the head ------------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether the head is used (trained at least once, on at least ``min_labels`` labels)."""
        return self.trained > 0 and self._count >= self.min_labels

    def predict(self, features: Float[Tensor, "B d"]) -> FloatB:
        """The head's success probability :math:`\\sigma(w^\\top h + b)` for features ``[M, D]``, float32 ``[M]``."""
        dims = Dims()
        dims.sizes["D"] = (self.dim, "dim")
        f = as_float(features, "features", dims, "M D")
        if checks_enabled():
            finite(f, "features")
        return self._predict(f)

    def _predict(self, f: Tensor) -> Tensor:
        w, b = self.weight.to(f.device), self.bias.to(f.device)
        return torch.sigmoid(f.float() @ w + b)

    def train_head(self, features: Float[Tensor, "B d"], labels: BoolB) -> dict[str, Tensor]:
        """Add completed rollouts' (features at :math:`L_c`, final correctness) to the FIFO buffer and run
        ``train_steps`` SGD steps of the mean binary cross-entropy on minibatches drawn from it.

        .. math::
            \\mathcal L = -\\frac1m \\sum_i y_i \\log q_i + (1-y_i)\\log(1-q_i), \\qquad
            w \\leftarrow w - \\eta\\,\\frac1m \\sum_i (q_i - y_i)\\,h_i, \\quad b \\leftarrow b - \\eta\\,\\frac1m
            \\sum_i (q_i - y_i)

        Args:
            features: float ``[M, D]``; labels: ``[M]`` bool or 0/1 (``M = 0`` adds nothing).

        Returns detached 0-d metrics: ``loss`` (mean BCE over the buffer after training, 0 when empty),
        ``labels`` (labels in the buffer).
        """
        dims = Dims()
        dims.sizes["D"] = (self.dim, "dim")
        f = as_float(features, "features", dims, "M D").to(self.device).float()
        y = as_mask(labels, "labels", dims, "M").to(self.device).float()
        if checks_enabled():
            finite(f, "features")
        m = f.shape[0]
        if m > self.buffer_size:
            f, y, m = f[-self.buffer_size :], y[-self.buffer_size :], self.buffer_size
        if m > 0:
            slots = (self._next + torch.arange(m, device=self.device)) % self.buffer_size
            self._buf_x[slots] = f
            self._buf_y[slots] = y
            self._next = (self._next + m) % self.buffer_size
            self._count = min(self._count + m, self.buffer_size)
        if self._count > 0 and self.train_steps > 0:
            size = min(self.train_batch, self._count)
            for _ in range(self.train_steps):  # the optimiser's own loop, not a loop over rows
                idx = torch.randint(self._count, (size,), generator=self._gen).to(self.device)
                xb, yb = self._buf_x[idx], self._buf_y[idx]
                err = torch.sigmoid(xb @ self.weight + self.bias) - yb
                self.weight = self.weight - self.lr * (err @ xb) / size
                self.bias = self.bias - self.lr * err.mean()
            self.trained += 1
        loss = torch.zeros((), device=self.device)
        if self._count > 0:
            logits = self._buf_x[: self._count] @ self.weight + self.bias
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, self._buf_y[: self._count])
        return {"loss": loss.detach(), "labels": torch.tensor(float(self._count))}

    # -- the protocol --------------------------------------------------------------------------------------------
    def _due_mask(self, state: StopState, live: Tensor) -> Tensor:
        return live & (state.steps + 1 == self.checkpoint)

    def due(self, state: StopState, active: BoolB | None = None) -> BoolB:
        """Bool ``[N]``: the rows evaluated at the next ``step`` (live and at a checkpoint), i.e. the rows for which
        the engine must provide the checkpoint inputs. ``active`` bool ``[N]`` as for ``step`` (default all)."""
        return self._due_rows(state, active)

    def _bound_dims(self) -> dict[str, tuple[int, str]]:
        return {"D": (self.dim, "dim")}

    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        group = inputs.pop("group", None)
        super()._init(n, device, **inputs)
        if group is None:
            raise InputError("group", "group ids [N] (or a Groups)", "None", "pass rule.init(n, group=ids)")
        if isinstance(group, Groups):
            g = group
            if g.num_rows != n:
                raise InputError("group", f"a Groups of {n} rows", repr(g), "pass one group id per row")
            inverse, sizes = g.inverse.to(device), g.sizes.to(device)
        else:
            dims = Dims()
            dims.sizes["N"] = (n, "batch_size")
            ids = as_index(group, "group", dims, "N")
            if n == 0:
                inverse = torch.zeros(0, dtype=torch.long, device=device)
                sizes = torch.zeros(0, dtype=torch.long, device=device)
            else:
                g = Groups(ids)
                inverse, sizes = g.inverse.to(device), g.sizes.to(device)
        size = sizes.index_select(0, inverse)
        quota = torch.ceil(self.keep_frac * size.double() - 1e-9).long().clamp_min(1)
        noise = torch.rand(n, generator=self._gen).to(device)
        return {"group": inverse, "quota": quota, "noise": noise, "score": torch.zeros(n, device=device)}

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, int]:
        e = state.extra
        cand = self._due_mask(state, x.live)
        scores = x.extra.get("scores")
        features = x.extra.get("features")
        if scores is None and features is None:  # not a checkpoint step for any row: nothing to do
            if checks_enabled() and bool(cand.any()):
                raise InputError(
                    "features",
                    "features [N, D] (or scores [N]) at the checkpoint step",
                    "None",
                    "pass them at the steps where rule.due(state) has a True row",
                )
            return e, torch.zeros_like(cand), 1
        if scores is not None:
            q = scores
        elif not self.ready:
            q = e["noise"]
        else:
            assert features is not None
            q = self._predict(features)
        q = torch.where(cand, q, torch.zeros((), dtype=q.dtype, device=q.device)).float()
        fire = cand & ~self._keep(e["group"], e["quota"], cand, q, state.stopped)
        extra = {**e, "score": torch.where(cand, q, e["score"])}
        return extra, fire, 1

    def _keep(self, grp: Tensor, quota: Tensor, cand: Tensor, q: Tensor, stopped: Tensor) -> Tensor:
        n = grp.shape[0]
        dev = grp.device
        pos = q >= self.threshold

        def per_group(mask: Tensor) -> Tensor:  # [N] counts per dense group index (G <= N)
            return torch.zeros(n, dtype=torch.long, device=dev).index_add_(0, grp, mask.long())

        c_all, c_pos = per_group(cand), per_group(cand & pos)
        c_oth = per_group(~stopped & ~cand)
        quota_g = torch.zeros(n, dtype=torch.long, device=dev).scatter_(0, grp, quota)
        k = torch.minimum((quota_g - c_oth).clamp_min(0), c_all)
        kp = torch.floor(self.rho * k.double() + 0.5).long()
        kp = torch.maximum(torch.minimum(kp, c_pos), k - (c_all - c_pos))
        kn = k - kp
        # rank of each candidate inside (group, class), least confident first: one stable sort of the composite
        # key segment * 4 + confidence key (in [-1, 1]; float64 keeps float32 scores distinct)
        key = torch.where(pos, q, -q).clamp(-1.0, 1.0)
        seg = torch.where(cand, grp * 2 + pos.long(), torch.full_like(grp, 2 * n))
        order = torch.argsort(seg.double() * 4.0 + key.double(), stable=True)
        counts = torch.zeros(2 * n + 1, dtype=torch.long, device=dev).index_add_(0, seg, torch.ones_like(seg))
        starts = torch.cumsum(counts, 0) - counts
        ranked = torch.arange(n, device=dev) - starts.index_select(0, seg.index_select(0, order))
        rank = torch.empty_like(ranked).scatter_(0, order, ranked)
        limit = torch.where(pos, kp.index_select(0, grp), kn.index_select(0, grp))
        return cand & (rank < limit)

    def finalize(self, state: StopState) -> StopResult:
        r""":meth:`~rolloutopt.control.StopRule.finalize` plus ``row_weight``: 0 for the pruned rows, 1 for the
        survivors, so ``result.loss_weights(mask)`` trains on the survivors only.

        .. math::
            a_i = [\text{row } i \text{ not pruned}]

        ARRoL (arXiv 2603.24840) re-batches the remaining rollouts for the log-probability computation and the
        policy update: a pruned rollout, which has no final reward, does not enter the loss.
        """
        res = super().finalize(state)
        pruned = res.stopped & (res.reason == 1)
        return replace(res, row_weight=(~pruned).float())

    # -- checkpoint ----------------------------------------------------------------------------------------------
    STATE: ClassVar[dict[str, Field]] = {
        "buffer_x": Field("float", ("S", "D"), ("finite",)),  # first: its (S, D) is checked, the rest must agree
        "buffer_y": Field("float", ("S",), ("prob",)),
        "weight": Field("float", ("D",), ("finite",)),
        "bias": Field("float", (), ("finite",)),
        "count": Field("integer", low=0),
        "next": Field("integer", low=0),
        "trained": Field("integer", low=0),
        "generator": Field("generator"),
    }
    """The declared fields of :meth:`state_dict` (D and S must be the constructor's ``dim`` and ``buffer_size``)."""

    def state_dict(self) -> dict[str, Any]:
        """Head weights, the label buffer (with its fill and ring position), the training count and the
        generator state (copies)."""
        return dump_state(
            {
                "weight": self.weight.clone(),
                "bias": self.bias.clone(),
                "buffer_x": self._buf_x.clone(),
                "buffer_y": self._buf_y.clone(),
                "count": self._count,
                "next": self._next,
                "trained": self.trained,
                "generator": self._gen.get_state(),
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "ARRoL")
        fix = "construct ARRoL with the same dim and buffer_size, and pass its state_dict()"
        if tuple(s["buffer_x"].shape) != (self.buffer_size, self.dim):
            raise InputError(
                "state['buffer_x']",
                f"shape ({self.buffer_size}, {self.dim}) (buffer_size, dim)",
                describe(state["buffer_x"]),
                fix,
            )
        for key, high in (("count", self.buffer_size), ("next", self.buffer_size - 1)):
            if s[key] > high:
                raise InputError(f"state[{key!r}]", f"an int in [0, {high}]", repr(s[key]), fix)
        self.weight = s["weight"].float().to(self.device)
        self.bias = s["bias"].float().to(self.device)
        self._buf_x = s["buffer_x"].float().to(self.device)
        self._buf_y = s["buffer_y"].float().to(self.device)
        self._count, self._next, self.trained = s["count"], s["next"], s["trained"]
        self._gen.set_state(s["generator"])
