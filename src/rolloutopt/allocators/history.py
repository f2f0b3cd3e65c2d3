"""The shared prompt history: bounded, checkpointable per-prompt statistics keyed by stable int64 prompt ids.

Every history-based allocator (GRESO, DPS, E3, CoBA, DOTS, HIVE, DEPO, Knapsack, the GDRO bins; see
``docs/methods/dynamic_sampling.md``) reads the same few per-prompt facts: how often a prompt was rolled out and
solved, when it was last seen, a smoothed pass rate, the last few group outcomes and how many consecutive groups
came back all-correct or all-wrong. :class:`PromptHistory` keeps them once, for any number of allocators, in
columns of a :class:`~rolloutopt.allocators.PromptTable` (sorted by prompt id, lookup is one
``torch.searchsorted``, a hard ``capacity`` and least-recent eviction), with ``state_dict`` /
``load_state_dict`` that round-trip exactly.

:func:`stable_prompt_ids` turns string ids (``"{data_source}_{index}"``, a hash of the prompt text, ...) into
int64 ids that are identical across processes, machines and Python runs (unlike ``hash(str)``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_int as _check_int
from rolloutopt._validation import checks_enabled, choice, describe
from rolloutopt.allocators._base import AllocationResult
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatP, IntB, IntP

__all__ = ["SUCCESS_PRESETS", "PromptHistory", "PromptStats", "stable_prompt_ids"]

Compare = Literal[">=", ">", "==", "<=", "<"]
Unseen = Literal["prior", "nan", "raise"]
RunBasis = Literal["rollout", "mean"]

SUCCESS_PRESETS: dict[str, dict[str, Any]] = {
    "exact": {"success_threshold": 1.0, "success_compare": "==", "failure_threshold": None, "run_basis": "rollout"},
    "dps": {"success_threshold": 1.0, "success_compare": ">=", "failure_threshold": None, "run_basis": "rollout"},
    "greso": {
        "success_threshold": 0.98,
        "success_compare": ">=",
        "failure_threshold": 0.11,
        "failure_compare": "<=",
        "run_basis": "mean",
    },
}
"""Success rules of the papers, as :class:`PromptHistory` keywords (``PromptHistory(**SUCCESS_PRESETS["greso"])``).

- ``"exact"``: a rollout succeeds iff its reward is exactly 1.0 (CoBA-RL ``BetaAllocator``, Pilot-Commit ``acc``;
  ``recipe/coba_rl/budget_allocators.py``, ``recipe/pc/pc_ray_trainer.py``).
- ``"dps"``: success iff ``acc >= 1`` (DPS ``task_sampler.py``) — the default; equal to ``"exact"`` for
  rewards in [0, 1].
- ``"greso"``: GRESO's hard-coded thresholds: a *group* counts as all-correct when its mean reward is
  ``>= 0.98`` and as all-wrong when it is ``<= 0.11`` (0.11 tolerates a 0.1 partial reward for a wrong answer),
  so the run lengths are computed on group means (``run_basis="mean"``); a rollout counts as a success iff its
  reward is ``>= 0.98``.
"""

_MASK63 = (1 << 63) - 1


def stable_prompt_ids(strings: Sequence[str]) -> IntP:
    r"""Stable int64 prompt ids from string ids: the first 8 bytes of BLAKE2b, little-endian, top bit cleared.

    .. math::

        \mathrm{id}(s) = \mathrm{int}_{\text{little}}\big(\mathrm{blake2b}_{8}(\mathrm{utf8}(s))\big)
        \bmod 2^{63}

    The ids are non-negative int64 values and identical across processes, machines and Python runs (Python's
    ``hash(str)`` is salted per process). Two distinct strings collide with probability about
    :math:`n^2 / 2^{64}` for :math:`n` strings (about :math:`5 \cdot 10^{-8}` for a million prompts).
    This is a helper run once per dataset (a Python loop over the strings, since hashing is per string), not a
    hot-path function. Keys used by the reference codes: GRESO ``"{data_source}_{index}"``, DPS and E3 the
    dataset index.

    Args:
        strings: a sequence of ``str`` (any length, including empty strings).

    Returns:
        int64 ``[len(strings)]``, on the CPU. An empty sequence gives an empty tensor.

    Raises:
        InputError: ``strings`` is a bare ``str`` or contains a non-``str`` item.
    """
    if isinstance(strings, (str, bytes)) or not isinstance(strings, Sequence):
        raise InputError("strings", "a sequence of str", describe(strings), "pass a list of string ids")
    out = []
    for s in strings:
        if not isinstance(s, str):
            raise InputError("strings", "a sequence of str", f"an item {describe(s)}", "convert the ids with str()")
        digest = hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") & _MASK63)
    return torch.tensor(out, dtype=torch.long).reshape(-1)


@dataclass(frozen=True)
class PromptStats:
    """Per-prompt statistics returned by :meth:`PromptHistory.lookup`, every field ``[P]`` (window fields ``[P, W]``).

    Attributes:
        prompt_ids: int64 ``[P]``, the ids looked up, in the given order.
        seen: bool ``[P]``, whether the prompt is in the history (never seen, or evicted, gives False).
        rollouts: int64, rollouts observed in total (0 when unseen).
        successes: int64, rollouts that met the success rule (0 when unseen).
        groups: int64, updates (steps) in which the prompt was rolled out (0 when unseen).
        reward_mean: float64, mean reward over every observed rollout (the unseen fill when unseen).
        pass_rate: float64, ``successes / rollouts`` (the unseen fill when unseen).
        ema_pass_rate: float64, exponential moving average of the per-group pass rate (the unseen fill).
        last_step: int64, the ``step`` of the last update that saw the prompt (-1 when unseen).
        correct_run: int64, consecutive most recent groups that were all-correct (0 when unseen).
        wrong_run: int64, consecutive most recent groups that were all-wrong (0 when unseen).
        flat_run: int64, consecutive most recent groups whose rewards were all equal (zero variance).
        window: float64 ``[P, W]``, mean reward of the last ``W`` groups, most recent first; slots beyond
            ``window_count`` hold 0.
        window_rollouts: int64 ``[P, W]``, rollouts in each of those groups (0 in empty slots).
        window_successes: int64 ``[P, W]``, successes in each of those groups (0 in empty slots).
        window_count: int64, number of filled window slots (``min(groups, W)``).
        window_pass_rate: float64, successes over rollouts in the window (CoBA's sliding-window ``p``; the
            unseen fill when unseen).
    """

    prompt_ids: IntP
    seen: Bool[Tensor, " P"]
    rollouts: IntP
    successes: IntP
    groups: IntP
    reward_mean: FloatP
    pass_rate: FloatP
    ema_pass_rate: FloatP
    last_step: IntP
    correct_run: IntP
    wrong_run: IntP
    flat_run: IntP
    window: Float[Tensor, "P W"]
    window_rollouts: Int[Tensor, "P W"]
    window_successes: Int[Tensor, "P W"]
    window_count: IntP
    window_pass_rate: FloatP

    @property
    def window_mask(self) -> Bool[Tensor, "P W"]:
        """bool ``[P, W]``: True on the filled window slots."""
        w = self.window.shape[1]
        return torch.arange(w) < self.window_count[:, None]


_INT_FIELDS = ("rollouts", "successes", "groups", "last_step", "correct_run", "wrong_run", "flat_run")
_FLOAT_FIELDS = ("reward_sum", "ema")
_WINDOW_FIELDS = ("window", "window_rollouts", "window_successes")
_FIELDS = (*_INT_FIELDS, *_FLOAT_FIELDS, *_WINDOW_FIELDS)
_COMPARES = (">=", ">", "==", "<=", "<")


def _compare(x: Tensor, op: str, threshold: float) -> Tensor:
    if op == ">=":
        return x >= threshold
    if op == ">":
        return x > threshold
    if op == "==":
        return x == threshold
    if op == "<=":
        return x <= threshold
    return x < threshold


def _check_number(value: Any, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise InputError(name, "a real number", describe(value), f"pass e.g. {name}=1.0")
    return float(value)


class PromptHistory:
    r"""Bounded per-prompt statistics keyed by stable int64 prompt ids, updated from batches of rollouts.

    An update takes the step's rollouts — ``prompt_ids`` ``[N]`` (one per rollout, any order, a prompt may
    repeat) and ``rewards`` ``[N]`` — groups them by prompt with one ``torch.unique`` and segment sums (no Python
    loop over prompts or rollouts) and, for every prompt :math:`i` in the batch with :math:`n_i` rollouts,
    :math:`s_i` successes and mean reward :math:`\bar r_i`, sets

    .. math::

        \mathrm{rollouts}_i \mathrel{+}= n_i, \quad \mathrm{successes}_i \mathrel{+}= s_i, \quad
        \mathrm{groups}_i \mathrel{+}= 1, \quad \mathrm{last\_step}_i = \mathrm{step},

        \mathrm{ema}_i \leftarrow \begin{cases} s_i / n_i & \text{first group} \\
        \beta\,\mathrm{ema}_i + (1-\beta)\, s_i / n_i & \text{otherwise} \end{cases}

    pushes :math:`(\bar r_i, n_i, s_i)` at the front of a fixed window of the last ``window`` groups, and updates
    three run lengths: ``correct_run`` (+1 if the group was all-correct, else reset to 0), ``wrong_run`` (+1 if
    all-wrong, else 0) and ``flat_run`` (+1 if all rewards in the group were equal, else 0). All rollouts of a
    prompt in one update form one group (call ``update`` once per training step). Reference: the state the
    history-based methods keep (GRESO arXiv 2506.02177, DPS 2603.10887, CoBA-RL 2602.03048, ...); the
    data layout and the defaults below are this library's choices, not a paper's.

    **Success rule** (explicit, since the papers disagree; presets in :data:`SUCCESS_PRESETS`). A rollout is a
    *success* iff ``reward <success_compare> success_threshold`` and a *failure* iff
    ``reward <failure_compare> failure_threshold`` (``failure_threshold=None``: iff it is not a success). With
    ``run_basis="rollout"`` a group is all-correct when every rollout is a success and all-wrong when every
    rollout is a failure; with ``run_basis="mean"`` the two rules are applied to the group's mean reward instead
    (GRESO: mean ``>= 0.98`` / ``<= 0.11``). Paper presets: CoBA-RL and Pilot-Commit ``reward == 1.0``
    (``success_compare="=="``); DPS ``acc >= 1`` (the default); GRESO ``>= 0.98`` and ``<= 0.11`` on group means.

    **Never-seen prompts** (``unseen``; each paper has its own convention, so the allocator decides
    what to do with them — the history only reports ``seen=False``): ``"prior"`` (default) fills
    ``pass_rate``, ``ema_pass_rate``, ``window_pass_rate`` and ``reward_mean`` with ``prior_pass_rate``
    (default 0.5, CoBA-RL's value for a missing ``p``); ``"nan"`` fills them with NaN (an explicit "unknown";
    the only way a NaN leaves this class); ``"raise"`` raises :class:`~rolloutopt.errors.InputError` naming the
    unknown ids. Counts and run lengths are 0, ``last_step`` is -1 and the window is empty in every mode.

    **Bounded memory.** The statistics are columns of a :class:`~rolloutopt.allocators.PromptTable` (private, or
    shared with other allocators via ``table=``): at most ``capacity`` prompts are stored (memory
    :math:`O(\mathrm{capacity} \cdot W)`). When an update brings new prompts into a full table, the prompts not
    in the current batch are evicted least recently updated first (an internal update counter, so a non-monotone
    ``step`` cannot confuse it), ties by smaller prompt id. An evicted prompt is unseen again. A single update
    with more than ``capacity`` distinct prompts raises.

    Args:
        capacity: maximum number of stored prompts of a private table (default None: 1,000,000).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); the history
            registers its columns as owner ``name``.
        window: ``W``, number of recent groups kept per prompt (default 8).
        ema_decay: :math:`\beta \in [0, 1)` of the pass-rate EMA (default 0.9).
        success_threshold: threshold of the success rule (default 1.0).
        success_compare: comparison of the success rule, one of ``">="`` (default), ``">"``, ``"=="``, ``"<="``,
            ``"<"``.
        failure_threshold: threshold of the failure rule (default None: failure = not success).
        failure_compare: comparison of the failure rule (default ``"<="``).
        run_basis: ``"rollout"`` (default) or ``"mean"``, see above.
        unseen: ``"prior"`` (default), ``"nan"`` or ``"raise"``, see above.
        prior_pass_rate: the fill for unseen prompts with ``unseen="prior"`` (default 0.5).
        name: the owner name in the table (default ``"history"``; CoBA passes ``"coba"``).

    Example::

        hist = PromptHistory(window=4)
        hist.update(torch.tensor([7, 7, 9, 9]), torch.tensor([1.0, 0.0, 0.0, 0.0]), step=0)
        s = hist.lookup(torch.tensor([7, 9, 11]))   # s.pass_rate == [0.5, 0.0, 0.5], s.seen == [T, T, F]
    """

    def __init__(
        self,
        *,
        capacity: int | None = None,
        table: PromptTable | None = None,
        window: int = 8,
        ema_decay: float = 0.9,
        success_threshold: float = 1.0,
        success_compare: Compare = ">=",
        failure_threshold: float | None = None,
        failure_compare: Compare = "<=",
        run_basis: RunBasis = "rollout",
        unseen: Unseen = "prior",
        prior_pass_rate: float = 0.5,
        name: str = "history",
    ) -> None:
        self.window = _check_int(window, "window", 1)
        beta = _check_number(ema_decay, "ema_decay")
        if not 0.0 <= beta < 1.0:
            raise InputError("ema_decay", "a number in [0, 1)", describe(ema_decay), "pass e.g. ema_decay=0.9")
        self.ema_decay = beta
        self.success_threshold = _check_number(success_threshold, "success_threshold")
        choice(success_compare, "success_compare", _COMPARES)
        self.success_compare: Compare = success_compare
        self.failure_threshold = (
            None if failure_threshold is None else _check_number(failure_threshold, "failure_threshold")
        )
        choice(failure_compare, "failure_compare", _COMPARES)
        self.failure_compare: Compare = failure_compare
        choice(run_basis, "run_basis", ("rollout", "mean"))
        self.run_basis: RunBasis = run_basis
        choice(unseen, "unseen", ("prior", "nan", "raise"))
        self.unseen: Unseen = unseen
        prior = _check_number(prior_pass_rate, "prior_pass_rate")
        if not 0.0 <= prior <= 1.0:
            raise InputError("prior_pass_rate", "a number in [0, 1]", describe(prior_pass_rate), "pass e.g. 0.5")
        self.prior_pass_rate = prior
        self._cols = open_table(table, capacity, name, _history_columns(self.window))
        self.STATE = {"config": Field("any"), "table": TableColumns.FIELD}

    STATE: dict[str, Field]
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`). An allocator that holds
    a history nests it: ``Field("nested", fields=history.STATE)``."""

    @classmethod
    def from_preset(cls, preset: str, **kwargs: Any) -> PromptHistory:
        """A history with a paper's success rule (:data:`SUCCESS_PRESETS`); ``kwargs`` override any keyword."""
        choice(preset, "preset", tuple(SUCCESS_PRESETS))
        return cls(**{**SUCCESS_PRESETS[preset], **kwargs})

    @property
    def table(self) -> PromptTable:
        """The :class:`~rolloutopt.allocators.PromptTable` that holds the statistics (private or shared)."""
        return self._cols.table

    @property
    def capacity(self) -> int:
        """The table's capacity (at most this many prompts are stored)."""
        return self._cols.table.capacity

    @property
    def prompt_ids(self) -> IntP:
        """int64 ``[M]``: the prompts this history has seen and still stores, sorted."""
        if self._cols.empty:
            return self._cols.table.prompt_ids
        return self._cols.table.prompt_ids[self._cols["seen"]]

    def __len__(self) -> int:
        return int(self.prompt_ids.numel())

    def _success(self, r: Tensor) -> Tensor:
        return _compare(r, self.success_compare, self.success_threshold)

    def _failure(self, r: Tensor, success: Tensor) -> Tensor:
        if self.failure_threshold is None:
            return ~success
        return _compare(r, self.failure_compare, self.failure_threshold)

    # -- the public API -------------------------------------------------------------------------------------
    def update(self, prompt_ids: IntB, rewards: FloatB, *, step: int) -> None:
        """Ingest one step's rollouts: ``prompt_ids`` int64 ``[N]`` (one per rollout) and ``rewards`` float ``[N]``.

        All rollouts of a prompt form one group (see the class docstring for every statistic). Rollouts kept
        out of the loss by an allocator (weight 0) are still observations of the prompt and are counted.
        ``step`` (an int >= 0) is stored as ``last_step``. An empty batch only advances nothing.

        Raises:
            InputError: ``prompt_ids`` not integer 1-d, ``rewards`` not float or not ``[N]``, non-finite rewards,
                a negative or non-int ``step``, or more than ``capacity`` distinct prompts in the batch.
        """
        if not isinstance(prompt_ids, Tensor) or prompt_ids.is_floating_point() or prompt_ids.dtype == torch.bool:
            raise InputError("prompt_ids", "an int64 tensor [N], one id per rollout", describe(prompt_ids), "pass ids")
        if prompt_ids.ndim != 1:
            raise InputError("prompt_ids", "a 1-d tensor [N]", describe(prompt_ids), "flatten prompt_ids")
        if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
            raise InputError("rewards", "a float tensor [N]", describe(rewards), "pass torch.tensor(rewards).float()")
        if rewards.shape != prompt_ids.shape:
            raise InputError(
                "rewards",
                f"a 1-d tensor [N] with N={prompt_ids.numel()} (from prompt_ids)",
                describe(rewards),
                "pass one reward per rollout",
            )
        _check_int(step, "step", 0)
        ids = prompt_ids.detach().long().cpu()
        r = rewards.detach().cpu().to(torch.float64)
        if checks_enabled() and not bool(torch.isfinite(r).all()):
            raise InputError("rewards", "finite rewards", f"{describe(rewards)} with NaN or inf", "fix the scorer")
        if ids.numel() == 0:
            return
        uniq, inv = torch.unique(ids, return_inverse=True)
        self._ingest(uniq, inv, r, step)

    def update_from_result(self, result: AllocationResult, *, step: int) -> None:
        """:meth:`update` from an allocator's :class:`~rolloutopt.allocators.AllocationResult` (every rollout).

        Uses the result's group index (positions into ``plan_prompt_ids``, which are distinct) instead of a
        ``torch.unique`` over the rollouts, so it is cheaper than ``update(result.prompt_ids, result.rewards)``
        and gives identical statistics.
        """
        _check_result(result)
        _check_int(step, "step", 0)
        r = result.rewards.detach().cpu().to(torch.float64)
        # a finite sum proves every reward finite (one cheap reduction); otherwise check them all
        if checks_enabled() and not math.isfinite(float(r.sum())) and not bool(torch.isfinite(r).all()):
            raise InputError("result.rewards", "finite rewards", describe(result.rewards), "fix the scorer")
        if r.numel() == 0:
            return
        plan_ids = result.plan_prompt_ids.long().cpu()
        group = result.group.long().cpu()
        present = torch.zeros(plan_ids.numel(), dtype=torch.bool).index_fill_(0, group, True)
        rows = present.nonzero().squeeze(1)
        uniq, order = plan_ids.index_select(0, rows).sort()
        remap = torch.full((plan_ids.numel(),), -1, dtype=torch.long)
        remap.index_copy_(0, rows.index_select(0, order), torch.arange(uniq.numel()))
        self._ingest(uniq, remap.index_select(0, group), r, step)

    def _ingest(self, uniq: Tensor, inv: Tensor, r: Tensor, step: int) -> None:
        u = uniq.numel()
        if u > self.capacity:
            raise InputError(
                "prompt_ids",
                f"at most capacity={self.capacity} distinct prompts in one update",
                f"{u} distinct prompts",
                "raise capacity or update in smaller batches",
            )
        success = self._success(r)
        failure = self._failure(r, success)
        n = torch.bincount(inv, minlength=u)
        s = torch.zeros(u, dtype=torch.long).index_add_(0, inv, success.long())
        if self.failure_threshold is None:  # failure = not success
            fails = n - s
        else:
            fails = torch.zeros(u, dtype=torch.long).index_add_(0, inv, failure.long())
        rsum = torch.zeros(u, dtype=torch.float64).index_add_(0, inv, r)
        rmax = torch.full((u,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, inv, r, "amax")
        rmin = torch.full((u,), torch.inf, dtype=torch.float64).scatter_reduce_(0, inv, r, "amin")
        mean = rsum / n
        if self.run_basis == "rollout":
            all_correct, all_wrong = s == n, fails == n
        else:
            all_correct = self._success(mean)
            all_wrong = self._failure(mean, all_correct)
        flat = rmax == rmin
        rate = s.double() / n

        pos, _ = self._cols.add(
            uniq
        )  # uniq is sorted: the rows come out in its order = self._cols.add(uniq)  # uniq is sorted: order is the identity
        # the store rows of the batch's prompts are distinct: index_add_/index_copy_ touch each row once
        f = self._cols
        first = f["groups"].index_select(0, pos) == 0
        f["rollouts"].index_add_(0, pos, n)
        f["successes"].index_add_(0, pos, s)
        f["groups"].index_add_(0, pos, torch.ones_like(n))
        f["reward_sum"].index_add_(0, pos, rsum)
        f["last_step"].index_fill_(0, pos, step)
        ema = torch.where(first, rate, self.ema_decay * f["ema"].index_select(0, pos) + (1.0 - self.ema_decay) * rate)
        f["ema"].index_copy_(0, pos, ema)
        for name, hit in (("correct_run", all_correct), ("wrong_run", all_wrong), ("flat_run", flat)):
            f[name].index_copy_(0, pos, torch.where(hit, f[name].index_select(0, pos) + 1, 0))
        for name, value in (("window", mean), ("window_rollouts", n), ("window_successes", s)):
            old = f[name].index_select(0, pos)
            f[name].index_copy_(0, pos, torch.cat([value[:, None].to(old.dtype), old[:, :-1]], dim=1))

    def lookup(self, prompt_ids: IntP) -> PromptStats:
        """The statistics of ``prompt_ids`` (int64 ``[P]``, any ids, repeats allowed), as a :class:`PromptStats`.

        Unseen (never updated, or evicted) prompts get ``seen=False`` and the fills of the ``unseen`` policy
        (class docstring). Does not change the history (a lookup is not a "use" for eviction).
        """
        if not isinstance(prompt_ids, Tensor) or prompt_ids.is_floating_point() or prompt_ids.dtype == torch.bool:
            raise InputError("prompt_ids", "an int64 tensor [P]", describe(prompt_ids), "pass torch.tensor(ids)")
        if prompt_ids.ndim != 1:
            raise InputError("prompt_ids", "a 1-d tensor [P]", describe(prompt_ids), "flatten prompt_ids")
        ids = prompt_ids.long().cpu()
        if self._cols.empty:
            pos, seen = torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.bool)
        else:
            pos, seen = self._cols.find(ids)
        if self.unseen == "raise" and not bool(seen.all()):
            missing = ids[~seen][:5].tolist()
            raise InputError(
                "prompt_ids",
                "prompts seen by the history (unseen='raise')",
                f"unknown ids such as {missing}",
                "update the history first or construct it with unseen='prior'",
            )
        f = self._cols
        if self._cols.empty:
            p, w = ids.numel(), self.window
            g = {name: torch.zeros(p, dtype=torch.long) for name in _INT_FIELDS}
            g.update({name: torch.zeros(p, dtype=torch.float64) for name in _FLOAT_FIELDS})
            g["window"] = torch.zeros(p, w, dtype=torch.float64)
            g["window_rollouts"] = torch.zeros(p, w, dtype=torch.long)
            g["window_successes"] = torch.zeros(p, w, dtype=torch.long)
        elif bool(seen.all()):
            g = {name: f[name].index_select(0, pos) for name in _FIELDS}
        else:
            g = {
                name: torch.where(seen.view(-1, *[1] * (f[name].ndim - 1)), f[name].index_select(0, pos), 0)
                for name in _FIELDS
            }
        fill = torch.tensor(torch.nan if self.unseen == "nan" else self.prior_pass_rate, dtype=torch.float64)
        roll = g["rollouts"]
        denom = roll.clamp(min=1).double()
        wr, ws = g["window_rollouts"].sum(1), g["window_successes"].sum(1)
        return PromptStats(
            prompt_ids=ids,
            seen=seen,
            rollouts=roll,
            successes=g["successes"],
            groups=g["groups"],
            reward_mean=torch.where(seen, g["reward_sum"] / denom, fill),
            pass_rate=torch.where(seen, g["successes"].double() / denom, fill),
            ema_pass_rate=torch.where(seen, g["ema"], fill),
            last_step=torch.where(seen, g["last_step"], -1),
            correct_run=g["correct_run"],
            wrong_run=g["wrong_run"],
            flat_run=g["flat_run"],
            window=g["window"],
            window_rollouts=g["window_rollouts"],
            window_successes=g["window_successes"],
            window_count=g["groups"].clamp(max=self.window),
            window_pass_rate=torch.where(seen & (wr > 0), ws.double() / wr.clamp(min=1).double(), fill),
        )

    def _window_pass_rate(self, prompt_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(seen, window_pass_rate)`` of :meth:`lookup` (same values, same ``unseen`` policy) without gathering
        the other fields: what CoBA-RL and Knapsack-RL read."""
        stats_ids = prompt_ids.long().cpu()
        if self.unseen == "raise" or self._cols.empty:
            stats = self.lookup(stats_ids)
            return stats.seen, stats.window_pass_rate
        pos, seen = self._cols.find(stats_ids)
        f = self._cols
        wr = f["window_rollouts"].index_select(0, pos).sum(1)
        ws = f["window_successes"].index_select(0, pos).sum(1)
        if not bool(seen.all()):
            wr, ws = torch.where(seen, wr, 0), torch.where(seen, ws, 0)
        fill = torch.tensor(torch.nan if self.unseen == "nan" else self.prior_pass_rate, dtype=torch.float64)
        return seen, torch.where(seen & (wr > 0), ws.double() / wr.clamp(min=1).double(), fill)

    # -- checkpointing --------------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "ema_decay": self.ema_decay,
            "success_threshold": self.success_threshold,
            "success_compare": self.success_compare,
            "failure_threshold": self.failure_threshold,
            "failure_compare": self.failure_compare,
            "run_basis": self.run_basis,
            "unseen": self.unseen,
            "prior_pass_rate": self.prior_pass_rate,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: the configuration and the table (its rows when private)."""
        return dump_state({"config": self._config(), "table": self._cols.state()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, validated field by field (an ``InputError`` names a bad one); the
        configuration must equal this history's."""
        s = load_state(state, self.STATE, "PromptHistory")
        self._load(s, "state")

    def _load(self, s: dict[str, Any], name: str) -> None:
        """Restore the output ``s`` of :func:`~rolloutopt._state.load_state` (``name``: the path of the history's
        state, e.g. ``"state['history']"`` for an allocator that nests one)."""
        config, want = s["config"], self._config()
        same = isinstance(config, dict) and set(config) == set(want)
        same = same and all(type(config[k]) is type(v) and config[k] == v for k, v in want.items())
        if not same:
            raise InputError(
                f"{name}['config']",
                f"a state saved with the same configuration {want}",
                f"configuration {config if isinstance(config, dict) else describe(config)}",
                "construct the PromptHistory with the saved configuration (state['config'])",
            )
        self._cols.load(s["table"], f"{name}['table']")


def _history_columns(window: int) -> dict[str, Column]:
    """The table columns of a history of ``window`` slots."""
    return {
        # counters, and last_step (the step of an update, >= 0; -1 is reported for unseen prompts by lookup)
        **{name: Column("int", checks=("nonneg",)) for name in _INT_FIELDS},
        "reward_sum": Column("float", checks=("finite",)),
        "ema": Column("float", checks=("nonneg",)),  # an average of pass rates in [0, 1]
        "window": Column("float", (window,), checks=("finite",)),  # mean rewards (any finite reward)
        "window_rollouts": Column("int", (window,), checks=("nonneg",)),
        "window_successes": Column("int", (window,), checks=("nonneg",)),
    }
