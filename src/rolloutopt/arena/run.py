"""One arena run: RL from the base policy on the task suite with one method by name, measured along the way.

A run is a :class:`RunSpec` (family, method, scenario, seed and the sizes). Every step the run offers the
allocator a random pool of train prompts and a budget (rollouts, or tokens through
:class:`~rolloutopt.allocators.ResponseLengths`), drives it with :func:`~rolloutopt.allocators.run_step`
(answering every signal it declares from the real generation: each response's length and mean token entropy, the
prompt's entropy from a prefill pass for a probe), computes the advantages over the result's groups, and takes
``inner_steps`` optimizer steps of the loss on the rollouts the allocator keeps (its weights scale each row).
Every ``eval_every`` steps it measures the held-out accuracy (greedy decoding). What a run records: per step the
cumulative rollouts and tokens, the mean reward, the loss metrics, the gradient norm and the entropy, and the
time spent inside the method (the allocator's plan and update); per evaluation the held-out accuracy, overall
and per cell. Everything random comes from generators seeded by the spec's seed.

Allocators run with their paper defaults (``experimental=True`` where reconstructed), except what the arena
must set: a group size ``n`` is the run's ``group_size`` (not V0.5's ``n``, its round-0 size); Pilot-Commit's pilot and commit sizes keep the paper's
1:3 ratio (32 + 96) at the run's group size; allocators that count epochs (GRESO, DEPO, E3) get
``steps_per_epoch`` = the steps the candidate pools take to cover the train set. AR3PO's reused responses enter
the allocator's own statistics but not the loss (the arena keeps no response store; their rows have no tokens).
"""

from __future__ import annotations

import copy
import inspect
import math
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from rolloutopt import advantages, allocators, losses
from rolloutopt.allocators import AllocationResult, PromptHistory, Request, ResponseLengths, run_step
from rolloutopt.arena.base import BaseConfig, base_policy
from rolloutopt.arena.tasks import TaskSuite
from rolloutopt.errors import InputError
from rolloutopt.testbed.policy import Rollouts, TinyPolicy
from rolloutopt.testbed.task import EOS, PAD

__all__ = ["FAMILIES", "RunSpec", "run"]

_KEPT_METRICS = ("clipfrac", "masked_frac", "approx_kl")
SELECTORS = ("dapo_dynamic_sampling", "dots", "dps", "depo", "greso", "hive", "pilot_commit", "prompt_gdro")
"""Allocators that choose prompts among more candidates than a batch holds (they see ``pool`` candidates a step);
the others spread a batch's budget over the batch's prompts (they see ``prompts_per_step``), as in their papers."""
_MULTI_REWARD = ("gdpo", "gd2po")
"""Estimators of several rewards per response ``[B, K]``."""
"""The loss metrics a run records per step (beside the loss, the gradient norm and the entropy)."""

FAMILIES = ("allocator", "estimator")
"""The method families a run can compare (loss presets under scenarios and the stop rules follow)."""


@dataclass(frozen=True)
class RunSpec:
    """One run: ``method`` of ``family`` by its registered name, ``seed``, and the sizes.

    ``unit``: the budget unit, ``"rollouts"`` (``group_size * prompts_per_step`` rollouts a step) or
    ``"tokens"`` (that many rollouts at the prior expected length, :class:`~rolloutopt.allocators.ResponseLengths`
    learns the rest). Each step draws fresh train prompts: ``pool`` candidates for the allocators that select
    prompts (:data:`SELECTORS`: DAPO's dynamic sampling, DOTS, DPS, DEPO, GRESO, HIVE, Pilot-Commit, Prompt-GDRO),
    a batch of ``prompts_per_step`` for the others, which spread the budget over a batch (``uniform``: GRPO's
    ``group_size`` rollouts each; VIGOR, DARS, E3, V0.5, AERO, AR3PO, CoBA, Knapsack, Rollout-GDRO, XRPO).
    """

    family: str
    method: str
    seed: int = 0
    unit: str = "rollouts"
    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    pool: int = 32
    inner_steps: int = 2
    lr: float = 1e-3
    loss: str = "grpo"
    estimator: str = "grpo"
    eval_every: int = 10

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise InputError("family", f"one of {FAMILIES}", repr(self.family), "pick a family")
        if self.family == "allocator" and self.method not in allocators.names():
            raise InputError("method", "a registered allocator", repr(self.method), "see allocators.names()")
        if self.family == "estimator" and self.method not in advantages.names():
            raise InputError("method", "a registered advantage estimator", repr(self.method), "see advantages.names()")
        if self.unit not in ("rollouts", "tokens"):
            raise InputError("unit", "'rollouts' or 'tokens'", repr(self.unit), "pick one")
        for name in ("steps", "prompts_per_step", "inner_steps", "eval_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InputError(name, "an int >= 1", repr(getattr(self, name)), "raise it")
        if self.group_size < 2 or self.pool < self.prompts_per_step:
            raise InputError("group_size/pool", "group_size >= 2, pool >= prompts_per_step", repr(self), "fix")

    @property
    def key(self) -> str:
        """A file-name-safe name of the run: ``family-method-unit-seed`` (an estimator run: ``-g<group size>``
        before the seed)."""
        g = f"-g{self.group_size}" if self.family == "estimator" else ""
        return f"{self.family}-{self.method}-{self.unit}{g}-s{self.seed}"


def _allocator(spec: RunSpec, num_train: int) -> Any:
    if spec.family != "allocator":  # the other families run under GRPO's fixed groups
        return allocators.Uniform(n=spec.group_size)
    entry = allocators.entry(spec.method)
    kwargs: dict[str, Any] = {"experimental": True} if entry.experimental is not None else {}
    cls = allocators.get(spec.method)
    names = inspect.signature(cls).parameters
    if "n" in names and spec.method != "v05_budget":  # V0.5's n is its round-0 size (paper default 4), not a group
        kwargs["n"] = spec.group_size
    if "steps_per_epoch" in names:  # GRESO, DEPO, E3: an epoch is a pass of the candidate pools over the train set
        kwargs["steps_per_epoch"] = max(1, math.ceil(num_train / spec.pool))
    if spec.method == "pilot_commit":  # the paper's 32 + 96 at its ratio, scaled to the run's group size
        kwargs["n_pilot"] = max(1, spec.group_size // 4)
        kwargs["n_commit"] = spec.group_size - kwargs["n_pilot"]
    if "seed" in names:
        kwargs["seed"] = spec.seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # VIGOR warns that its defaults are reconstructed
        return cls(**kwargs)


class _Engine:
    """Generates the rollouts an allocator requests and keeps them, row for row in request order."""

    def __init__(self, suite: TaskSuite, policy: TinyPolicy, gen: torch.Generator) -> None:
        self.suite, self.policy, self.gen = suite, policy, gen
        self.parts: list[tuple[Tensor, Rollouts]] = []
        self.seconds = 0.0

    def __call__(self, request: Request) -> dict[str, Tensor] | None:
        start = time.perf_counter()
        try:
            if request.is_probe:
                return self._probe(request)
            ids = request.prompt_ids.repeat_interleave(request.counts)
            roll = self.policy.sample(self.suite.prompts(ids), self.suite.response_limit, generator=self.gen)
            self.parts.append((ids, roll))
            lengths = roll.mask.sum(1)
            out: dict[str, Tensor] = {"rewards": self.suite.reward(ids, roll.tokens, roll.mask)}
            if "tokens" in request.signals:
                out["tokens"] = lengths.double()
            if "entropy" in request.signals:
                out["entropy"] = (roll.entropy * roll.mask).sum(1) / lengths.clamp(min=1)
            return out
        finally:
            self.seconds += time.perf_counter() - start

    @torch.no_grad()
    def _probe(self, request: Request) -> dict[str, Tensor]:
        """Probe signals: the prompt's mean next-token entropy over its positions (one prefill pass)."""
        out: dict[str, Tensor] = {}
        if "prompt_entropy" in request.signals:
            prompts = self.suite.prompts(request.prompt_ids)
            logits, _ = self.policy(prompts)
            logsm = torch.log_softmax(logits.float(), -1)
            ent = -(logsm.exp() * logsm).sum(-1)
            real = prompts != PAD
            out["prompt_entropy"] = (ent * real).sum(1) / real.sum(1)
        return out

    def batch(self, result: AllocationResult) -> tuple[Tensor, Rollouts] | None:
        """The generated rows of ``result`` (its first ``counts.sum()`` rows, in request order) as one batch; None
        when nothing was generated."""
        if not self.parts:
            return None
        ids = torch.cat([i for i, _ in self.parts])
        width = max(r.tokens.shape[1] for _, r in self.parts)

        def cat(name: str, fill: float | int) -> Tensor:
            ts = [getattr(r, name) for _, r in self.parts]
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in ts])

        roll = Rollouts(tokens=cat("tokens", PAD), mask=cat("mask", False), logp=cat("logp", 0.0),
                        entropy=cat("entropy", 0.0))  # fmt: skip
        n = int(result.counts.sum())
        assert torch.equal(ids, result.prompt_ids[:n]), "the engine's rows follow the result's"
        return ids, roll


def _estimator_inputs(
    entry: Any,
    suite: TaskSuite,
    ids: Tensor,
    roll: Rollouts,
    prompts: Tensor,
    reference: TinyPolicy | None,
    history: PromptHistory | None,
) -> dict[str, Any]:
    """The inputs an estimator's registry ``entry`` requires, from the run: ``logp`` of the sampled responses (with
    their ``mask``, also when the estimator only accepts one: per-token log-probs need it), ``mask``,
    ``ref_logp`` of the base policy, ``prior`` the prompt's mean reward in the run so far (0.5 unseen)."""
    requires = entry.requires
    out: dict[str, Any] = {}
    if "mask" in requires or ("logp" in requires and "mask" in entry.accepts):
        out["mask"] = roll.mask
    if "logp" in requires:
        out["logp"] = roll.logp
    if "ref_logp" in requires:
        assert reference is not None
        with torch.no_grad():
            ref, _ = reference.log_probs(prompts, roll.tokens)
        out["ref_logp"] = torch.where(roll.mask, ref, torch.zeros_like(ref))
    if "prior" in requires:
        assert history is not None
        out["prior"] = history.lookup(ids).reward_mean.float()
    return out


@torch.no_grad()
def _evaluate(policy: TinyPolicy, suite: TaskSuite, ids: Tensor) -> dict[str, Any]:
    roll = policy.sample(suite.prompts(ids), suite.response_limit, temperature=0.0, generator=torch.Generator())
    r = suite.reward(ids, roll.tokens, roll.mask)
    cells: dict[str, list[float]] = {}
    for cell, value in zip(suite.describe_cells(ids), r.tolist(), strict=True):
        cells.setdefault(cell, []).append(value)
    return {"accuracy": float(r.mean()), "cells": {c: sum(v) / len(v) for c, v in cells.items()}}


def run(
    spec: RunSpec, suite: TaskSuite | None = None, base: BaseConfig | None = None, *, progress: Any = None
) -> dict[str, Any]:
    """Run ``spec`` and return its record (JSON-serialisable): the spec, per-step and per-evaluation rows.

    ``progress``: an optional callable ``progress(step)`` called after every step.
    """
    suite = TaskSuite() if suite is None else suite
    base = BaseConfig() if base is None else base
    policy = copy.deepcopy(base_policy(suite, base))
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=spec.lr)
    train_ids, eval_ids = suite.split()
    gen = torch.Generator().manual_seed(spec.seed)
    sample_gen = torch.Generator().manual_seed(spec.seed + 1)
    alloc = _allocator(spec, train_ids.numel())
    lengths = ResponseLengths(prior=suite.response_limit / 2)
    loss_fn = losses.get(spec.loss)
    est_name = spec.method if spec.family == "estimator" else spec.estimator
    estimator = advantages.get(est_name)
    est_entry = advantages.entry(est_name)
    est_kwargs: dict[str, Any] = {"experimental": True} if est_entry.experimental is not None else {}
    reference = copy.deepcopy(policy).requires_grad_(False) if "ref_logp" in est_entry.requires else None
    history = PromptHistory(unseen="prior") if "prior" in est_entry.requires else None
    params = inspect.signature(estimator).parameters
    needs_len = "max_len" in params and params["max_len"].default is inspect.Parameter.empty  # DRPO
    multi = est_name in _MULTI_REWARD
    rollouts_per_step = spec.group_size * spec.prompts_per_step
    steps: list[dict[str, Any]] = []
    evals = [{"step": 0, "rollouts": 0, "tokens": 0, **_evaluate(policy, suite, eval_ids)}]
    total_rollouts = total_tokens = 0
    for step in range(1, spec.steps + 1):
        width = spec.pool if spec.family == "allocator" and spec.method in SELECTORS else spec.prompts_per_step
        pool = train_ids[torch.randperm(train_ids.numel(), generator=gen)[:width]]
        engine = _Engine(suite, policy, sample_gen)
        budget: Any = rollouts_per_step
        t0 = time.perf_counter()
        if spec.unit == "tokens":
            budget = lengths.budget(int(rollouts_per_step * lengths.prior), pool)
        policy.eval()
        result = run_step(alloc, pool, budget, engine)
        if spec.unit == "tokens":
            lengths.update(result)
        method_seconds = time.perf_counter() - t0 - engine.seconds
        policy.train()
        batch = engine.batch(result)
        n = 0 if batch is None else batch[0].numel()
        total_rollouts += n
        total_tokens += 0 if batch is None else batch[1].num_tokens
        metrics: dict[str, float] = {}
        if batch is not None and bool((result.weight[:n] > 0).any()):
            ids, roll = batch
            rewards = result.rewards[:n].float()
            group = result.group[:n]
            prompts = suite.prompts(ids)
            inputs = _estimator_inputs(est_entry, suite, ids, roll, prompts, reference, history)
            if needs_len or ("max_len" in params and "mask" in inputs):  # the response limit
                inputs["max_len"] = suite.response_limit
            if multi:  # two rewards per response: the exact answer, and stopping with <eos> (a format reward)
                stopped = ((roll.tokens == EOS) & roll.mask).any(1).float()
                inputs["rewards"] = torch.stack([rewards, stopped], dim=1)
            adv = estimator(inputs.pop("rewards", rewards), group, **inputs, **est_kwargs).advantages
            if history is not None:
                history.update(ids, rewards, step=step)
            weight = result.weight[:n].float()
            for _ in range(spec.inner_steps):
                logp, entropy = policy.log_probs(prompts, roll.tokens)
                out = loss_fn(logp, roll.logp, adv, roll.mask, seq_weight=weight)
                opt.zero_grad(set_to_none=True)
                out.loss.backward()  # type: ignore[no-untyped-call]
                grad = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
                opt.step()
                values = {k: float(v) for k, v in out.metrics.items() if k in _KEPT_METRICS}
                values.update(loss=float(out.loss.detach()), grad_norm=grad)
                for k, x in values.items():
                    metrics[k] = metrics.get(k, 0.0) + x / spec.inner_steps
            ent = (entropy.detach() * roll.mask).sum() / roll.mask.sum().clamp(min=1)
            metrics["entropy"] = float(ent)
        steps.append(
            {
                "step": step,
                "rollouts": total_rollouts,
                "tokens": total_tokens,
                "reward": float(result.rewards[:n].mean()) if n else math.nan,
                "kept_frac": float(result.metrics["kept_frac"]),
                "method_seconds": method_seconds,
                **metrics,
            }
        )
        if step % spec.eval_every == 0 or step == spec.steps:
            evals.append({"step": step, "rollouts": total_rollouts, "tokens": total_tokens,
                          **_evaluate(policy, suite, eval_ids)})  # fmt: skip
        if progress is not None:
            progress(step)
    return {"spec": asdict(spec), "suite": asdict(suite), "base": asdict(base), "steps": steps, "evals": evals}
