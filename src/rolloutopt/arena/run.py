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
``steps_per_epoch`` = the steps the candidate pools take to cover the train set. AR3PO's reused responses and DOTS's
replayed groups are trained on again with their stored tokens and behaviour log-probs
(:mod:`rolloutopt.arena.replay`).

The **loss** family trains every loss preset by name under a scenario (:data:`SCENARIOS`): synchronous
on-policy rollouts, rollouts ``k`` = 4 or 16 optimizer steps stale, an engine mismatch (the engine holds FP8
weights, :meth:`~rolloutopt.testbed.policy.TinyPolicy.quantized`), or partial rollouts driven by APRIL's or
CoPRIS's buffer (:mod:`rolloutopt.arena.buffers`: the scheduler picks what runs and what is resumed, the policy
continues a resumed response from its prefix); the engine and the preset's inputs come from
:class:`~rolloutopt.testbed.engine.ScenarioEngine`. The **stop** family replays a stop, truncation or length rule
over every generated batch (:mod:`rolloutopt.arena.stops`): a stopped row keeps its tokens up to the stop, the
rest count as never generated, and its reward and loss weights are the rule's.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rolloutopt import advantages, allocators, losses
from rolloutopt.allocators import AllocationResult, PromptHistory, Request, ResponseLengths, run_step
from rolloutopt.arena.base import BaseConfig, base_policy
from rolloutopt.arena.buffers import BUFFER_METRICS, BufferedEngine
from rolloutopt.arena.replay import ResponseStore, Reused, cat_rolls, map_roll
from rolloutopt.arena.tasks import TaskSuite
from rolloutopt.errors import InputError
from rolloutopt.testbed.engine import ScenarioEngine
from rolloutopt.testbed.policy import Rollouts, TinyPolicy
from rolloutopt.testbed.task import EOS, PAD
from rolloutopt.testbed.train import Scenario, preset_inputs

__all__ = ["FAMILIES", "SCENARIOS", "RunSpec", "run", "write_record"]

SELECTORS = ("dapo_dynamic_sampling", "dots", "dps", "depo", "greso", "hive", "pilot_commit", "prompt_gdro")
"""Allocators that choose prompts among more candidates than a batch holds (they see ``pool`` candidates a step);
the others spread a batch's budget over the batch's prompts (they see ``prompts_per_step``), as in their papers."""
_MULTI_REWARD = ("gdpo", "gd2po")
"""Estimators of several rewards per response ``[B, K]``."""

FAMILIES = ("allocator", "estimator", "loss", "stop")
"""The method families a run can compare: allocators, advantage estimators, loss presets (under a scenario), and
stop, truncation and length rules."""
SCENARIOS: dict[str, tuple[int, bool, str | None]] = {
    "sync": (0, False, None),
    "stale4": (4, False, None),
    "stale16": (16, False, None),
    "mismatch": (0, True, None),
    "april": (0, False, "april"),
    "copris": (0, False, "copris"),
}
"""Scenario name → (staleness in optimizer steps, FP8 engine mismatch, partial-rollout buffer of
:mod:`rolloutopt.arena.buffers` or None)."""


def _kept(name: str) -> bool:
    """The loss metrics a run records per step (beside the loss, the gradient norm and the entropy): the
    approximate KL and every clipped or masked fraction."""
    return name == "approx_kl" or name == "clipfrac" or name.endswith("_frac")


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
    scenario: str = "sync"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise InputError("family", f"one of {FAMILIES}", repr(self.family), "pick a family")
        if self.family == "allocator" and self.method not in allocators.names():
            raise InputError("method", "a registered allocator", repr(self.method), "see allocators.names()")
        if self.family == "estimator" and self.method not in advantages.names():
            raise InputError("method", "a registered advantage estimator", repr(self.method), "see advantages.names()")
        if self.family == "loss" and self.method not in losses.names():
            raise InputError("method", "a registered loss preset", repr(self.method), "see losses.names()")
        if self.family == "stop":
            from rolloutopt.arena.stops import check_method

            check_method(self.method, "method")
        if self.scenario not in SCENARIOS:
            raise InputError("scenario", f"one of {tuple(SCENARIOS)}", repr(self.scenario), "pick a scenario")
        if SCENARIOS[self.scenario][2] is not None and self.family != "loss":
            raise InputError(
                "scenario", "a buffer scenario only for the loss family", repr(self.scenario), "use 'sync'"
            )
        if self.unit not in ("rollouts", "tokens"):
            raise InputError("unit", "'rollouts' or 'tokens'", repr(self.unit), "pick one")
        for name in ("steps", "prompts_per_step", "inner_steps", "eval_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InputError(name, "an int >= 1", repr(getattr(self, name)), "raise it")
        if self.group_size < 2 or self.pool < self.prompts_per_step:
            raise InputError("group_size/pool", "group_size >= 2, pool >= prompts_per_step", repr(self), "fix")

    @property
    def key(self) -> str:
        """A file-name-safe name of the run: ``family-method-unit-seed`` (an estimator run: ``-g<group size>``,
        a scenario other than ``sync``: ``-<scenario>``, before the seed)."""
        g = f"-g{self.group_size}" if self.family == "estimator" else ""
        scen = f"-{self.scenario}" if self.scenario != "sync" else ""
        return f"{self.family}-{self.method}-{self.unit}{g}{scen}-s{self.seed}"


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


def _to(roll: Rollouts, device: torch.device | str) -> Rollouts:
    """``roll`` with every tensor on ``device``."""
    return map_roll(roll, lambda t: t.to(device))


def _truncate(roll: Rollouts, mask: Tensor) -> Rollouts:
    """``roll`` kept where ``mask`` (a subset of its mask): padding tokens and zero log-probs elsewhere."""
    m = mask.to(roll.mask.device)
    out = {"tokens": torch.where(m, roll.tokens, torch.full_like(roll.tokens, PAD)), "mask": m}
    for name in ("logp", "entropy"):
        out[name] = torch.where(m, getattr(roll, name), torch.zeros_like(getattr(roll, name)))
    if roll.topk_ids is not None and roll.topk_logp is not None:
        out["topk_ids"] = torch.where(m[..., None], roll.topk_ids, torch.full_like(roll.topk_ids, PAD))
        out["topk_logp"] = torch.where(m[..., None], roll.topk_logp, torch.zeros_like(roll.topk_logp))
    return Rollouts(**out)


class _Engine:
    """Generates the rollouts an allocator requests through the scenario's engine (and the stop rule, if any) and
    keeps them, row for row in request order."""

    def __init__(
        self, suite: TaskSuite, policy: TinyPolicy, gen: torch.Generator, scenario: ScenarioEngine, stop: Any
    ) -> None:
        self.suite, self.policy, self.gen, self.scenario, self.stop = suite, policy, gen, scenario, stop
        self.device = next(policy.parameters()).device
        self.parts: list[dict[str, Any]] = []
        self.seconds = self.stop_seconds = 0.0
        self.rows = self.stopped_rows = 0
        self.full_tokens = self.saved_tokens = 0

    def __call__(self, request: Request) -> dict[str, Tensor] | None:
        start = time.perf_counter()
        try:
            if request.is_probe:
                return self._probe(request)
            ids = request.prompt_ids.repeat_interleave(request.counts)
            prompts = self.suite.prompts(ids).to(self.device)
            roll, versions = self.scenario.sample(prompts, self.suite.response_limit, self.gen)
            rewards = self.suite.reward(ids, roll.tokens.cpu(), roll.mask.cpu())
            part: dict[str, Any] = {"ids": ids, "versions": versions, "seq_weight": None, "token_weight": None,
                                    "generated": roll.mask.sum(1)}  # fmt: skip
            if self.stop is not None:
                group = torch.arange(request.prompt_ids.numel()).repeat_interleave(request.counts)
                outcome = self.stop.apply(ids, _to(roll, "cpu"), rewards, group, self.suite.reward)
                self.stop_seconds += outcome.seconds
                self.rows += ids.numel()
                self.stopped_rows += round(outcome.stopped_frac * ids.numel())
                generated = outcome.generated.sum(1)
                self.full_tokens += roll.num_tokens
                self.saved_tokens += roll.num_tokens - int(generated.sum())
                roll = _truncate(roll, outcome.mask)
                part["generated"] = generated
                rewards = outcome.rewards.float()
                part["seq_weight"] = outcome.seq_weight.float()
                if outcome.token_weight is not None:
                    part["token_weight"] = outcome.token_weight.float()
            part["roll"] = roll
            self.parts.append(part)
            lengths = part["generated"].cpu()
            out: dict[str, Tensor] = {"rewards": rewards}
            if "tokens" in request.signals:
                out["tokens"] = lengths.double()
            if "entropy" in request.signals:
                out["entropy"] = ((roll.entropy * roll.mask).sum(1).cpu() / lengths.clamp(min=1)).float()
            return out
        finally:
            self.seconds += time.perf_counter() - start

    @torch.no_grad()
    def _probe(self, request: Request) -> dict[str, Tensor]:
        """Probe signals: the prompt's mean next-token entropy over its positions (one prefill pass)."""
        out: dict[str, Tensor] = {}
        if "prompt_entropy" in request.signals:
            prompts = self.suite.prompts(request.prompt_ids).to(self.device)
            logits, _ = self.policy(prompts)
            logsm = torch.log_softmax(logits.float(), -1)
            ent = -(logsm.exp() * logsm).sum(-1)
            real = prompts != PAD
            out["prompt_entropy"] = ((ent * real).sum(1) / real.sum(1)).cpu()
        return out

    def batch(self, result: AllocationResult) -> dict[str, Any] | None:
        """The generated rows of ``result`` (its first ``counts.sum()`` rows, in request order) as one batch:
        ``ids``, ``roll`` (the tokens in the loss), ``versions``, ``generated`` (the number of tokens generated:
        more than ``roll``'s when a post-hoc rule truncated after generation), and the stop rule's ``seq_weight`` /
        ``token_weight`` (None without); None when nothing was generated."""
        if not self.parts:
            return None
        ids = torch.cat([p["ids"] for p in self.parts])
        roll = cat_rolls([p["roll"] for p in self.parts])
        width = roll.tokens.shape[1]

        def cat(ts: list[Tensor], fill: float | int) -> Tensor:
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in ts])

        n = int(result.counts.sum())
        assert torch.equal(ids, result.prompt_ids[:n]), "the engine's rows follow the result's"
        out = {"ids": ids, "roll": roll, "versions": cat([p["versions"] for p in self.parts], 0),
               "generated": int(sum(int(p["generated"].sum()) for p in self.parts))}  # fmt: skip
        for name in ("seq_weight", "token_weight"):
            if any(p[name] is not None for p in self.parts):
                ones = [torch.ones(p["ids"].numel()) if name == "seq_weight" else torch.ones(p["roll"].mask.shape)
                        for p in self.parts]  # fmt: skip
                vals = [p[name] if p[name] is not None else o for p, o in zip(self.parts, ones, strict=True)]
                out[name] = torch.cat(vals) if name == "seq_weight" else cat(vals, 0.0)
            else:
                out[name] = None
        return out


def _keep_plan(plans: list[Any]) -> Callable[[Any, AllocationResult], None]:
    """A ``run_step`` ``on_finish`` that appends the finished plan to ``plans``."""

    def keep(plan: Any, result: AllocationResult) -> None:
        plans.append(plan)

    return keep


def _with_reused(batch: dict[str, Any] | None, reused: Reused) -> dict[str, Any]:
    """``batch`` (the step's generated rows, or None) followed by the stored rows a plan trains on again; the
    tokens generated stay the step's."""
    if batch is None:
        return {"ids": reused.ids, "roll": reused.roll, "versions": reused.versions, "generated": 0,
                "seq_weight": None, "token_weight": None}  # fmt: skip
    assert batch["seq_weight"] is None and batch["token_weight"] is None, "an allocator run has no stop rule"
    dev = batch["roll"].tokens.device
    roll = cat_rolls([batch["roll"], _to(reused.roll, dev)])
    width = roll.tokens.shape[1]
    versions = torch.cat([torch.nn.functional.pad(v.to(dev), (0, width - v.shape[1]), value=int(v.min()))
                          for v in (batch["versions"], reused.versions)])  # fmt: skip
    return {**batch, "ids": torch.cat([batch["ids"], reused.ids]), "roll": roll, "versions": versions}


class _Estimator:
    """The run's advantage estimator by name, called with the inputs its registry entry declares: ``logp`` of the
    sampled responses (with their ``mask``, also when the estimator only accepts one: per-token log-probs need it),
    ``mask``, ``ref_logp`` of the base policy, ``prior`` the prompt's mean reward in the run so far (0.5 unseen),
    ``max_len`` the response limit, and for GDPO/GD2PO two rewards per response (the exact answer, and stopping
    with ``<eos>``, a format reward)."""

    def __init__(self, name: str, suite: TaskSuite, base: TinyPolicy) -> None:
        self.fn = advantages.get(name)
        self.entry = advantages.entry(name)
        self.suite = suite
        self.kwargs: dict[str, Any] = {"experimental": True} if self.entry.experimental is not None else {}
        self.reference = copy.deepcopy(base).requires_grad_(False) if "ref_logp" in self.entry.requires else None
        self.history = PromptHistory(unseen="prior") if "prior" in self.entry.requires else None
        params = inspect.signature(self.fn).parameters
        self.needs_len = "max_len" in params and params["max_len"].default is inspect.Parameter.empty  # DRPO
        self.takes_len = "max_len" in params
        self.multi = name in _MULTI_REWARD

    def __call__(self, ids: Tensor, roll: Rollouts, rewards: Tensor, group: Tensor, step: int) -> Tensor:
        """The advantages ``[B]`` or ``[B, T]`` of a batch (CPU tensors); updates the running prior."""
        requires, accepts = self.entry.requires, self.entry.accepts
        inputs: dict[str, Any] = {}
        if "mask" in requires or ("logp" in requires and "mask" in accepts):
            inputs["mask"] = roll.mask
        if "logp" in requires:
            inputs["logp"] = roll.logp
        if "ref_logp" in requires:
            assert self.reference is not None
            with torch.no_grad():
                ref, _ = self.reference.log_probs(self.suite.prompts(ids), roll.tokens)
            inputs["ref_logp"] = torch.where(roll.mask, ref, torch.zeros_like(ref))
        if "prior" in requires:
            assert self.history is not None
            inputs["prior"] = self.history.lookup(ids).reward_mean.float()
        if self.needs_len or (self.takes_len and "mask" in inputs):  # the response limit
            inputs["max_len"] = self.suite.response_limit
        if self.multi:
            stopped = ((roll.tokens == EOS) & roll.mask).any(1).float()
            rewards = torch.stack([rewards, stopped], dim=1)
        adv = self.fn(rewards, group, **inputs, **self.kwargs).advantages
        if self.history is not None:
            self.history.update(ids, rewards if not self.multi else rewards[:, 0], step=step)
        return adv


def _survivors_advantages(
    estimator: _Estimator, batch: dict[str, Any], rewards: Tensor, group: Tensor, weight: Tensor, step: int
) -> Tensor:
    """The advantages of a batch, computed over the rows a stop rule kept (weight > 0; ARRoL and DUET give pruned
    or aborted rows weight 0 and re-batch the survivors): the other rows get advantage 0 and carry no loss."""
    roll = _to(batch["roll"], "cpu")
    keep = weight > 0
    if batch["seq_weight"] is None or bool(keep.all()):
        return estimator(batch["ids"], roll, rewards, group, step)
    adv = estimator(batch["ids"][keep], map_roll(roll, lambda t: t[keep]), rewards[keep], group[keep], step)
    out = torch.zeros((keep.numel(), *adv.shape[1:]), dtype=adv.dtype)
    if adv.ndim == 2 and adv.shape[1] != roll.mask.shape[1]:  # token advantages over the survivors' width
        out = torch.zeros((keep.numel(), roll.mask.shape[1]), dtype=adv.dtype)
        out[keep, : adv.shape[1]] = adv
    else:
        out[keep] = adv
    return out


@torch.no_grad()
def _evaluate(policy: TinyPolicy, suite: TaskSuite, ids: Tensor) -> dict[str, Any]:
    dev = next(policy.parameters()).device
    prompts = suite.prompts(ids).to(dev)
    roll = policy.sample(prompts, suite.response_limit, temperature=0.0, generator=torch.Generator(device=dev))
    r = suite.reward(ids, roll.tokens.cpu(), roll.mask.cpu())
    cells: dict[str, list[float]] = {}
    for cell, value in zip(suite.describe_cells(ids), r.tolist(), strict=True):
        cells.setdefault(cell, []).append(value)
    return {"accuracy": float(r.mean()), "cells": {c: sum(v) / len(v) for c, v in cells.items()}}


def run(
    spec: RunSpec,
    suite: TaskSuite | None = None,
    base: BaseConfig | None = None,
    *,
    progress: Any = None,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Run ``spec`` and return its record (JSON-serialisable): the spec, per-step and per-evaluation rows.

    ``progress``: an optional callable ``progress(step)`` called after every step. ``device``: where the policy
    generates and trains (e.g. ``"cuda"``); rewards, the allocator and the estimator run on the CPU. Results on
    another device follow its own random streams (the same seed on CPU and GPU gives different runs).
    """
    suite = TaskSuite() if suite is None else suite
    base = BaseConfig() if base is None else base
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InputError("device", "a torch device", repr(device), "pass e.g. 'cpu' or 'cuda'") from None
    start_policy = copy.deepcopy(base_policy(suite, base))
    policy = copy.deepcopy(start_policy).to(dev)
    policy.train()
    opt = torch.optim.Adam(policy.parameters(), lr=spec.lr)
    train_ids, eval_ids = suite.split()
    gen = torch.Generator().manual_seed(spec.seed)
    sample_gen = torch.Generator(device=dev).manual_seed(spec.seed + 1)
    alloc = _allocator(spec, train_ids.numel())
    lengths = ResponseLengths(prior=suite.response_limit / 2)
    loss_name = spec.method if spec.family == "loss" else spec.loss
    loss_fn = losses.get(loss_name)
    call_kw: dict[str, Any] = {"experimental": True} if getattr(loss_fn, "experimental", None) else {}
    estimator = _Estimator(spec.method if spec.family == "estimator" else spec.estimator, suite, start_policy)
    stop = None
    if spec.family == "stop":
        from rolloutopt.arena.stops import StopMethod

        stop = StopMethod(spec.method, spec.seed, group_size=spec.group_size, response_limit=suite.response_limit)
    staleness, fp8, buffer = SCENARIOS[spec.scenario]
    inputs_used = preset_inputs(loss_name)
    scen = Scenario(0.0, staleness, False, inputs_used, getattr(loss_fn, "experimental", None))
    scen_engine = ScenarioEngine(
        scen, generator=torch.Generator().manual_seed(spec.seed + 3), record_topk=0 if stop is None else stop.topk,
        perturb=(lambda p, g: p.quantized()) if fp8 else None,
        reference=copy.deepcopy(policy).requires_grad_(False) if "ref_logp" in inputs_used else None,
    )  # fmt: skip
    rollouts_per_step = spec.group_size * spec.prompts_per_step
    store = ResponseStore() if spec.family == "allocator" else None
    buffered = None
    if buffer is not None:
        buffered = BufferedEngine(buffer, suite, scen_engine, groups=spec.prompts_per_step, group_size=spec.group_size)
    steps: list[dict[str, Any]] = []
    evals = [{"step": 0, "rollouts": 0, "tokens": 0, **_evaluate(policy, suite, eval_ids)}]
    total_rollouts = total_tokens = 0
    for step in range(1, spec.steps + 1):
        policy.eval()
        scen_engine.advance(policy, step)
        if buffered is not None:
            fresh = train_ids[torch.randperm(train_ids.numel(), generator=gen)[: buffered.fresh]]
            got = buffered.step(policy, fresh, step, sample_gen)
            batch = got if got["roll"] is not None else None
            n = 0 if batch is None else got["ids"].numel()
            rewards, group = (got["rewards"], got["group"]) if batch is not None else (torch.zeros(0), torch.zeros(0))
            weight, kept_frac = torch.ones(n), 1.0
            method_seconds = got["seconds"]
            metrics: dict[str, float] = {k: got["metrics"][k] for k in BUFFER_METRICS}
        else:
            width = spec.pool if spec.family == "allocator" and spec.method in SELECTORS else spec.prompts_per_step
            pool = train_ids[torch.randperm(train_ids.numel(), generator=gen)[:width]]
            engine = _Engine(suite, policy, sample_gen, scen_engine, stop)
            budget: Any = rollouts_per_step
            t0 = time.perf_counter()
            if spec.unit == "tokens":
                budget = lengths.budget(int(rollouts_per_step * lengths.prior), pool)
            plans: list[Any] = []
            metrics = {}
            result = run_step(alloc, pool, budget, engine, on_finish=_keep_plan(plans))
            if spec.unit == "tokens":
                lengths.update(result)
            method_seconds = time.perf_counter() - t0 - engine.seconds + engine.stop_seconds
            batch = engine.batch(result)
            n = 0 if batch is None else batch["ids"].numel()
            rewards, group, weight = result.rewards[:n].float(), result.group[:n], result.weight[:n].float()
            if store is not None:  # AR3PO's reused responses, DOTS's replayed groups: trained on again
                if batch is not None:
                    store.add(step - 1, batch["ids"], batch["roll"], batch["versions"])
                reused = store.reused(plans[0], result)
                metrics["reused_rows"] = 0.0 if reused is None else float(reused.ids.numel())
                if reused is not None:
                    batch = _with_reused(batch, reused)
                    rewards, group = torch.cat([rewards, reused.rewards]), torch.cat([group, reused.group])
                    weight = torch.cat([weight, reused.weight])
            kept_frac = float(result.metrics["kept_frac"])
            if stop is not None:
                metrics["stopped_frac"] = engine.stopped_rows / max(engine.rows, 1)
                metrics["saved_frac"] = engine.saved_tokens / max(engine.full_tokens, 1)
        policy.train()
        total_rollouts += n
        total_tokens += 0 if batch is None else batch["generated"]
        if batch is not None and bool((weight > 0).any()):
            if batch["seq_weight"] is not None:
                weight = weight * batch["seq_weight"]
            adv = _survivors_advantages(estimator, batch, rewards, group, weight, step)
            prompts = suite.prompts(batch["ids"]).to(dev)
            old_logp, inputs = scen_engine.loss_inputs(
                policy, prompts, batch["roll"], batch["versions"], group=group.to(dev), max_len=suite.response_limit
            )
            if batch["token_weight"] is not None:
                inputs["is_weights"] = batch["token_weight"].to(dev)
            for _ in range(spec.inner_steps):
                logp, entropy = scen_engine.forward(policy, prompts, batch["roll"], inputs)
                out = loss_fn(logp, old_logp, adv.to(dev), batch["roll"].mask, seq_weight=weight.to(dev),
                              **call_kw, **inputs)  # fmt: skip
                opt.zero_grad(set_to_none=True)
                out.loss.backward()  # type: ignore[no-untyped-call]
                grad = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0))
                opt.step()
                values = {k: float(v) for k, v in out.metrics.items() if _kept(k)}
                values.update(loss=float(out.loss.detach()), grad_norm=grad)
                for k, x in values.items():
                    metrics[k] = metrics.get(k, 0.0) + x / spec.inner_steps
            mask = batch["roll"].mask
            metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        steps.append(
            {
                "step": step,
                "rollouts": total_rollouts,
                "tokens": total_tokens,
                "reward": float(rewards[:n].mean()) if n else math.nan,
                "kept_frac": kept_frac,
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


def write_record(record: dict[str, Any], path: str | Path) -> Path:
    """Write a run's ``record`` as JSON at ``path`` atomically (a temporary file, then ``os.replace``), so that an
    interrupted suite never leaves a partial file that a resume would skip."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return Path(path)
