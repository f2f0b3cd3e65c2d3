"""DAPO dynamic sampling: oversample, drop zero-variance groups, refill with fresh prompts (arXiv 2503.14476).

The reference behaviour most trainers ship (verl ``algorithm.filter_groups``, NeMo-RL ``use_dynamic_sampling``,
SkyRL ``dynamic_sampling.type=filter``, slime ``check_reward_nonzero_std``): see ``docs/methods/dynamic_sampling.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_int as _check_int
from rolloutopt._validation import choice, describe
from rolloutopt.allocators._base import (
    AllocationResult,
    Conversation,
    Request,
    as_prompt_ids,
    check_budget,
)
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators._units import TokenBudget
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, IntP

__all__ = ["DAPODynamicSampling"]

Shortfall = Literal["raise", "keep"]

_KEPT, _ZERO_VARIANCE, _SURPLUS, _NOT_NEEDED, _NO_BUDGET = range(5)


class _DAPOPlan(Conversation):
    """One step of dynamic sampling: rounds of ``gen_batch_size`` fresh prompts × ``n`` rollouts."""

    reason_names = ("kept", "zero_variance", "surplus", "not_needed", "no_budget")

    def __init__(
        self,
        prompt_ids: Tensor,
        budget: int,
        queue: Tensor,
        *,
        batch_size: int,
        n: int,
        gen_batch_size: int,
        max_num_gen_batches: int,
        on_shortfall: Shortfall,
    ) -> None:
        super().__init__(prompt_ids, budget)
        p = prompt_ids.numel()
        self._queue = queue  # plan positions in sampling order
        self._rank = torch.full((p,), p, dtype=torch.long)  # sampling rank of each position (p: never sampled)
        self._rank[queue] = torch.arange(p)
        self._varied = torch.zeros(p, dtype=torch.bool)  # rewards not all equal (or a singleton group)
        self._b, self._group_n, self._gen = batch_size, n, gen_batch_size
        self._max_rounds, self._on_shortfall = max_num_gen_batches, on_shortfall
        self._cursor = 0
        self.rounds = 0
        self.kept = 0

    def observe(self, request: Request, rewards: FloatB | None, **signals: Tensor) -> None:
        super().observe(request, rewards, **signals)  # validates the rewards first (DAPO requests no signals)
        assert rewards is not None  # not a probe: observe refused None
        r = rewards.detach().cpu().to(torch.float64).view(-1, self._group_n)
        # keep iff the rewards are not all equal (or n == 1): the intent of verl's np.std(metric) > 0, which
        # differs on equal non-dyadic rewards (seven 0.1s: np.std = 1.4e-17 > 0, verl keeps; we drop)
        varied = (r.amax(1) > r.amin(1)) | (self._group_n == 1)
        self._varied[self.positions(request.prompt_ids)] = varied
        self.kept += int(varied.sum())

    def decide(self) -> Request | None:
        if self.kept >= self._b:
            return None
        if self._max_rounds > 0 and self.rounds >= self._max_rounds:
            if self._on_shortfall == "raise":
                raise InputError(
                    "max_num_gen_batches",
                    f"at least batch_size={self._b} groups with reward variance within {self._max_rounds} rounds",
                    f"{self.kept} groups after {self.rounds} rounds",
                    "raise max_num_gen_batches (0 = unlimited), or pass on_shortfall='keep' to train on fewer groups",
                )
            return None
        k = min(self._gen, self._queue.numel() - self._cursor, (self.budget - self.spent) // self._group_n)
        if k <= 0:
            return None
        pos = self._queue[self._cursor : self._cursor + k]
        self._cursor += k
        self.rounds += 1
        return self.request(pos, torch.full((k,), self._group_n, dtype=torch.long))

    def _keep(self) -> Tensor:
        # the first batch_size varied groups in sampling order (verl truncates the concatenated batch)
        varied_in_order = self._varied[self._queue]
        rank_among_varied = torch.cumsum(varied_in_order.long(), 0)
        keep_in_order = varied_in_order & (rank_among_varied <= self._b)
        keep = torch.zeros_like(self._varied)
        keep[self._queue] = keep_in_order
        return keep

    def select(self) -> tuple[FloatB, IntP]:
        pos, _ = self.rollouts()
        keep = self._keep()
        sampled = self._rank < self._cursor
        reasons = torch.where(
            keep,
            _KEPT,
            torch.where(
                self._varied,
                _SURPLUS,
                torch.where(sampled, _ZERO_VARIANCE, _NOT_NEEDED if self.kept >= self._b else _NO_BUDGET),
            ),
        )
        return keep.double().index_select(0, pos), reasons

    def finish(self) -> AllocationResult:
        result = super().finish()
        sampled = int(self._cursor)
        zero_var = sampled - int(self._varied.sum())
        n_rollouts = max(result.rewards.numel(), 1)
        metrics = {
            **result.metrics,
            "rounds": torch.tensor(float(self.rounds)),
            "sampled_groups": torch.tensor(float(sampled)),
            "kept_groups": torch.tensor(float(min(self.kept, self._b))),
            "zero_variance_groups": torch.tensor(float(zero_var)),
            "zero_variance_frac": torch.tensor(zero_var * self._group_n / n_rollouts, dtype=torch.float64),
            "target_reached": torch.tensor(float(self.kept >= self._b)),
        }
        return dataclasses.replace(result, metrics=metrics)


class DAPODynamicSampling:
    r"""DAPO dynamic sampling: sample rounds of fresh prompts, drop zero-variance groups, refill to ``batch_size``.

    Reference: DAPO, arXiv 2503.14476 (§3.3 "Dynamic Sampling"); the rule is verl's ``recipe/dapo``
    (``dapo_ray_trainer.py``, ``algorithm.filter_groups``). Each round takes the
    next ``gen_batch_size`` prompts of a seeded random order of ``prompt_ids`` and requests ``n`` rollouts for
    each. A group :math:`g` is kept iff its rewards are not all equal,

    .. math::

        \mathrm{keep}_g = \big[\max_i r_{g,i} > \min_i r_{g,i}\big] \lor [n = 1]

    This is the *intent* of verl's test ``np.std(metric) > 0 or len(metric) == 1``, not an equivalent of it:
    the two agree on 0/1 (and any dyadic) rewards, but for equal non-dyadic rewards NumPy's float64 std rounds
    to a tiny positive number (seven rewards of 0.1: ``np.std`` = 1.4e-17), so verl *keeps* such a group, whose
    GRPO advantages are all zero, and we *drop* it (a deliberate difference). Rounds continue until at least
    ``batch_size`` groups
    are kept; then the kept groups are truncated, in sampling order, to exactly ``batch_size`` (verl's
    ``batch[:train_batch_size * n]``). The step ends early when the budget cannot pay for one more group
    (``(budget - spent) // n == 0``), when every prompt of the pool has been sampled, or after
    ``max_num_gen_batches`` rounds (0: unlimited), where verl raises: ``on_shortfall="raise"`` (default) raises
    :class:`~rolloutopt.errors.InputError` naming ``max_num_gen_batches`` as verl does, ``"keep"`` returns the
    groups kept so far. Budget or pool exhaustion never raises (the budget is the caller's explicit cap): the
    result has fewer than ``batch_size`` kept groups and ``metrics["target_reached"] == 0``.

    Budget (rollouts, exact): the plan never requests more than ``budget``; every request is ``n`` rollouts per
    prompt, a round shrinks to ``(budget - spent) // n`` prompts when the budget runs low, so no group is ever
    left unfilled; it does not always spend the whole budget (it stops once ``batch_size`` groups are kept, and
    leaves a remainder smaller than ``n``). Every sampled prompt gets exactly ``n`` rollouts, so the per-prompt
    caps are ``n_min = n_max = n``.

    Result: weight 1 on the rollouts of the kept groups, 0 elsewhere. Reasons per planned prompt: ``"kept"``,
    ``"zero_variance"`` (sampled, all rewards equal: dropped), ``"surplus"`` (sampled with variance after the
    batch was full: dropped, as verl's truncation drops it), ``"not_needed"`` (never sampled, the target was
    reached), ``"no_budget"`` (never sampled, and the target was not reached: budget, pool or round limit ran
    out). Metrics: ``rounds``, ``sampled_groups``, ``kept_groups``, ``zero_variance_groups``,
    ``zero_variance_frac`` (rollouts in zero-variance groups over rollouts generated), ``target_reached``.

    Order: ``shuffle=True`` samples prompts in a random order drawn from the allocator's own generator over the
    *sorted* ids, so permuting ``prompt_ids`` permutes the result's per-prompt fields and changes nothing else;
    ``shuffle=False`` takes prompts in the given order (a dataloader that already shuffles). State across steps:
    only the generator (the method keeps no per-prompt state; ``update`` does nothing).

    Args:
        batch_size: ``B``, groups with reward variance to collect (verl ``data.train_batch_size``; default 512,
            ``train_prompt_bsz`` of verl's DAPO launch scripts, ``recipe/dapo/*.sh``).
        n: rollouts per prompt (``rollout.n``; default 16, ``n_resp_per_prompt`` of the DAPO script).
        gen_batch_size: prompts per round (verl ``data.gen_batch_size``; default None: ``3 * batch_size``, the
            DAPO script's ``gen_prompt_bsz = train_prompt_bsz * 3``).
        max_num_gen_batches: round limit (default 10, the DAPO script; 0 = unlimited as in verl).
        on_shortfall: ``"raise"`` (default, verl) or ``"keep"`` when the round limit is hit first.
        shuffle: sample prompts in a seeded random order (default True) or in the given order.
        seed: seed of the allocator's ``torch.Generator`` (never the global RNG).

    Edge cases: ``n = 1`` keeps every group (no filtering, as verl); an empty pool or a budget below ``n``
    gives an empty result (no request); ``max``/``min`` are exact comparisons, so rewards differing in the last
    bit count as varied and bit-identical rewards never do (whatever ``np.std`` rounds them to).

    Example::

        alloc = DAPODynamicSampling(batch_size=4, n=8, gen_batch_size=6, seed=0)
        plan = alloc.plan(pool_ids, budget=10 * 6 * 8)
        while (req := plan.next()) is not None:
            plan.observe(req, score(req))
        result = plan.finish()   # result.weight: 1 on the 4 * 8 rollouts to train on
    """

    reference: ClassVar[str] = "arXiv 2503.14476 (DAPO, dynamic sampling); verl recipe/dapo"
    experimental: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        batch_size: int = 512,
        n: int = 16,
        gen_batch_size: int | None = None,
        max_num_gen_batches: int = 10,
        on_shortfall: Shortfall = "raise",
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.batch_size = _check_int(batch_size, "batch_size", 1, "pass e.g. batch_size=512 (prompts per step)")
        self.n = _check_int(n, "n", 1, "pass e.g. n=16 (rollouts per prompt)")
        if gen_batch_size is None:
            gen_batch_size = 3 * self.batch_size
        self.gen_batch_size = _check_int(gen_batch_size, "gen_batch_size", 1, "pass e.g. 3 * batch_size, or None")
        self.max_num_gen_batches = _check_int(
            max_num_gen_batches, "max_num_gen_batches", 0, "pass e.g. 10 (0 = unlimited)"
        )
        choice(on_shortfall, "on_shortfall", ("raise", "keep"))
        self.on_shortfall: Shortfall = on_shortfall
        if not isinstance(shuffle, bool):
            raise InputError("shuffle", "a bool", describe(shuffle), "pass shuffle=True or False")
        self.shuffle = shuffle
        self.seed = _check_int(seed, "seed", 0, "pass e.g. seed=0")
        self._gen = torch.Generator().manual_seed(self.seed)

    def plan(self, prompt_ids: IntP, budget: int | TokenBudget) -> Conversation:
        """Start a step over the candidate pool ``prompt_ids`` (int64 ``[P]``, distinct) with ``budget`` rollouts."""
        ids = as_prompt_ids(prompt_ids)
        budget = check_budget(budget)
        p = ids.numel()
        if self.shuffle:
            by_id = torch.argsort(ids)
            queue = by_id[torch.randperm(p, generator=self._gen)]
        else:
            queue = torch.arange(p)
        return _DAPOPlan(
            ids,
            budget,
            queue,
            batch_size=self.batch_size,
            n=self.n,
            gen_batch_size=self.gen_batch_size,
            max_num_gen_batches=self.max_num_gen_batches,
            on_shortfall=self.on_shortfall,
        )

    def update(self, result: AllocationResult) -> None:
        """Nothing to learn: dynamic sampling keeps no state across steps."""
        _check_result(result)

    STATE: ClassVar[dict[str, Field]] = {"generator": Field("generator")}
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """The generator state (the only state)."""
        return dump_state({"generator": self._gen.get_state().clone()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, validated field by field (an ``InputError`` names a bad one)."""
        s = load_state(state, self.STATE, "DAPODynamicSampling")
        self._gen.set_state(s["generator"])
