"""A short, seeded GRPO run on the reverse task: sample, score, :func:`rolloutopt.advantages.grpo`, a loss
preset (``"grpo"`` by default) with a few PPO-style inner steps on each batch, Adam.

Any registered preset runs: the loop passes exactly the optional inputs the preset consumes (its ``requires``
and ``accepts``) and, when those involve a rollout engine that is not the trained policy, simulates the setting
the preset was built for (:func:`scenario`):

- **engine mismatch**: the engine samples from :meth:`TinyPolicy.perturbed`, a copy with seeded weight noise of
  relative size ``mismatch``; ``behav_logp`` are its log-probs of the sampled tokens, ``old_logp`` the trainer's
  recompute with the real weights;
- **staleness**: the engine holds the policy of ``staleness`` training steps (policy versions) ago; ``versions``
  records the generating version of every token and ``policy_version`` the trained one;
- **partial rollouts** (presets that read per-token ``versions``, e.g. CoPRIS): each response starts under an
  older snapshot and switches to newer ones at random positions, up to the current policy, so the version
  changes inside a response;
- ``topk_behav_logp`` / ``topk_logp``: the engine's top-K log-probs at its top-K ids and the trained policy's at
  the same ids; ``confidence``: the rollout's tail confidence (mean top-5 probability, ECHO's definition);
  ``max_len``: the generation limit; ``ref_logp``: the initial policy, for presets with a KL stage.

A preset that does not read ``behav_logp`` but runs under a scenario gets the engine's log-probs as ``old_logp``
(the coupled form: its trust region sees the engine's distance). Without a scenario the loop is the plain
on-policy GRPO demo, unchanged: ``old_logp`` are the sampler's log-probs.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rolloutopt import advantages, losses
from rolloutopt._validation import check_int, check_real
from rolloutopt.errors import InputError
from rolloutopt.testbed.engine import ENGINE_INPUTS, VERSION_INPUTS, Scenario, ScenarioEngine
from rolloutopt.testbed.policy import TinyPolicy
from rolloutopt.testbed.task import VOCAB_SIZE, ReverseTask
from rolloutopt.typing import IntP

__all__ = [
    "MISMATCH",
    "STALENESS",
    "SUPPLIED_INPUTS",
    "EvalResult",
    "Scenario",
    "StepRecord",
    "TrainConfig",
    "TrainResult",
    "evaluate",
    "preset_inputs",
    "scenario",
    "train",
]

MISMATCH = 0.05
"""Default relative weight noise of a mismatched rollout engine (:meth:`TinyPolicy.perturbed`)."""
STALENESS = 2
"""Default number of policy versions (training steps) a stale rollout engine lags behind."""

SUPPLIED_INPUTS: tuple[str, ...] = (
    "behav_logp",
    "versions",
    "policy_version",
    "topk_logp",
    "topk_behav_logp",
    "sampled_in_topk",
    "confidence",
    "max_len",
    "ref_logp",
    "group",
    "entropy",
)
"""The optional loss inputs the loop can supply; a preset that requires any other one is refused."""

_STALE_PRESETS = frozenset({"decoupled_ppo", "m2po", "m2po_clip", "sat", "cumulative", "pnpo"})
"""Presets built for stale rollouts whose inputs do not say so (they read at most ``behav_logp``): AReaL's
decoupled PPO, M2PO (both forms), SAT and the prefix ratios."""
_MISMATCH_PRESETS = frozenset({"dppo_tv", "dppo_kl"})
"""Presets built for an engine mismatch that read no engine input (DPPO takes the engine's log-probs as
``old_logp``)."""


@dataclass(frozen=True)
class TrainConfig:
    """Settings of :func:`train`; the defaults are the ``demo`` run.

    ``mismatch`` (relative weight noise of the rollout engine, >= 0) and ``staleness`` (policy versions the
    engine lags behind, >= 0) default to None: the scenario the ``loss`` preset was built for (:func:`scenario`);
    a value overrides it (0 turns it off). ``topk`` is K of the top-K inputs (``topk_logp``, ``topk_behav_logp``).
    """

    steps: int = 150
    prompts_per_step: int = 16
    group_size: int = 8
    inner_steps: int = 2
    lr: float = 3e-3
    temperature: float = 1.0
    hidden: int = 64
    arch: str = "transformer"
    length: int = 4
    holdout: int = 500
    loss: str = "grpo"
    mismatch: float | None = None
    staleness: int | None = None
    topk: int = 8
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    eval_samples: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (
            ("steps", 1),
            ("prompts_per_step", 1),
            ("group_size", 2),
            ("inner_steps", 1),
            ("hidden", 1),
            ("eval_samples", 0),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                fix = "GRPO needs at least two rollouts per prompt" if name == "group_size" else "raise it"
                raise InputError(name, f"an int >= {low}", repr(value), fix)
        for name in ("lr", "temperature", "max_grad_norm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InputError(name, "a finite float > 0", repr(value), "pass a positive value")
        if self.arch not in ("gru", "transformer"):
            raise InputError("arch", "'gru' or 'transformer'", repr(self.arch), "pick one")
        if not isinstance(self.seed, int):
            raise InputError("seed", "an int", repr(self.seed), "pass e.g. 0")
        ReverseTask(self.length, self.holdout)  # validates length and holdout
        check_real(self.mismatch, "mismatch", 0.0, fix="pass e.g. 0.05, 0 for no mismatch, None for auto", none=True)
        check_int(self.staleness, "staleness", 0, "pass e.g. 2, 0 for on-policy rollouts, None for auto", none=True)
        check_int(self.topk, "topk", 1, f"pass an int in [1, {VOCAB_SIZE}], e.g. 8")
        if self.topk > VOCAB_SIZE:
            raise InputError("topk", f"an int in [1, {VOCAB_SIZE}]", repr(self.topk), f"pass at most {VOCAB_SIZE}")
        if not isinstance(self.entropy_coef, (int, float)) or not math.isfinite(self.entropy_coef):
            raise InputError("entropy_coef", "a finite float", repr(self.entropy_coef), "pass e.g. 0.0")
        scenario(self)  # validates the loss name and that the loop can supply the preset's inputs


def preset_inputs(loss: str, entropy_coef: float = 0.0) -> tuple[str, ...]:
    """The optional inputs (of :data:`SUPPLIED_INPUTS`) the loop passes to the preset ``loss``, sorted.

    They are its ``requires`` and ``accepts`` (the inputs every configuration accepts, ``seq_weight``,
    ``is_weights`` and ``denominators``, are not passed), plus ``entropy`` when ``entropy_coef != 0``. An
    InputError names an unknown preset, or a required input the loop cannot supply.
    """
    if not isinstance(loss, str) or loss not in losses.PRESETS:
        raise InputError(
            "loss",
            f"a registered loss preset ({', '.join(losses.names())})",
            repr(loss),
            "pick one of the listed names, or register yours with rolloutopt.losses.register",
        )
    preset = losses.get(loss)
    requires = tuple(getattr(preset, "requires", ()))
    accepts = tuple(getattr(preset, "accepts", ()))
    missing = [n for n in requires if n not in SUPPLIED_INPUTS]
    if missing:
        raise InputError(
            "loss",
            f"a preset whose required inputs the testbed supplies ({', '.join(SUPPLIED_INPUTS)})",
            f"{loss!r}, which requires {', '.join(missing)}",
            "train it in your own loop, or pick another preset",
        )
    consumed = {n for n in (*requires, *accepts) if n in SUPPLIED_INPUTS and n != "entropy"}
    if entropy_coef != 0 or "entropy" in requires:
        consumed.add("entropy")
    return tuple(sorted(consumed))


def scenario(config: TrainConfig) -> Scenario:
    """The scenario :func:`train` simulates for ``config`` and the optional inputs it passes to the preset.

    The preset's consumed inputs are :func:`preset_inputs`. Defaults (``config.mismatch`` / ``config.staleness`` None): staleness
    :data:`STALENESS` for presets that read ``versions`` or ``policy_version`` and for the presets built for stale
    rollouts (decoupled PPO, M2PO, SAT, the prefix ratios); otherwise a mismatch :data:`MISMATCH` for presets that
    read the engine's log-probs (``behav_logp``, top-K) and for DPPO's divergence masks; nothing for the others.
    Presets that read ``versions`` get partial rollouts. An InputError names a required input the loop cannot
    supply.
    """
    consumed = set(preset_inputs(config.loss, config.entropy_coef))
    preset = losses.get(config.loss)
    stale = bool(consumed & set(VERSION_INPUTS)) or config.loss in _STALE_PRESETS
    engine = bool(consumed & set(ENGINE_INPUTS)) or config.loss in _MISMATCH_PRESETS
    staleness = (STALENESS if stale else 0) if config.staleness is None else config.staleness
    mismatch = (MISMATCH if engine and not stale else 0.0) if config.mismatch is None else float(config.mismatch)
    return Scenario(
        mismatch=mismatch,
        staleness=staleness,
        partial=staleness > 0 and "versions" in consumed,
        inputs=tuple(sorted(consumed)),
        experimental=getattr(preset, "experimental", None),
    )


@dataclass(frozen=True)
class StepRecord:
    """One training step: mean reward of its rollouts, tokens generated, and the loss metrics (floats)."""

    step: int
    reward: float
    tokens: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class EvalResult:
    """Evaluation on the held-out prompts: greedy exact-match accuracy and mean reward of sampled answers."""

    greedy_accuracy: float
    greedy_reward: float
    sampled_reward: float


@dataclass(frozen=True)
class TrainResult:
    """What :func:`train` returns."""

    config: TrainConfig
    steps: list[StepRecord]
    eval_before: EvalResult
    eval_after: EvalResult
    rollouts: int
    tokens: int
    seconds: float
    num_params: int
    policy: TinyPolicy = field(repr=False)
    scenario: Scenario = field(default_factory=lambda: Scenario(0.0, 0, False, ()))

    @property
    def rewards(self) -> list[float]:
        """Mean training reward of every step."""
        return [s.reward for s in self.steps]

    def window(self, which: str, k: int = 10) -> float:
        """Mean training reward over the ``"first"`` or ``"last"`` ``k`` steps."""
        r = self.rewards[:k] if which == "first" else self.rewards[-k:]
        return sum(r) / len(r)


@torch.no_grad()
def evaluate(
    policy: TinyPolicy, task: ReverseTask, prompt_ids: IntP, *, samples: int, temperature: float, seed: int
) -> EvalResult:
    """Greedy accuracy and reward, and mean reward of ``samples`` sampled answers per prompt, on ``prompt_ids``."""
    prompts = task.prompts(prompt_ids)
    greedy = policy.sample(
        prompts, task.max_response_len, temperature=0.0, generator=torch.Generator().manual_seed(seed)
    )
    r = task.reward(prompt_ids, greedy.tokens, greedy.mask)
    sampled = float("nan")
    if samples > 0:
        ids = prompt_ids.repeat_interleave(samples)
        roll = policy.sample(
            task.prompts(ids),
            task.max_response_len,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed + 1),
        )
        sampled = float(task.reward(ids, roll.tokens, roll.mask).mean())
    return EvalResult(
        greedy_accuracy=float((r == 1).float().mean()), greedy_reward=float(r.mean()), sampled_reward=sampled
    )


def train(config: TrainConfig | None = None, *, callback: Callable[[StepRecord], None] | None = None) -> TrainResult:
    """Run GRPO advantages and the ``config.loss`` preset on :class:`~rolloutopt.testbed.task.ReverseTask` with a
    :class:`TinyPolicy`, on the CPU.

    Each step draws ``prompts_per_step`` training prompts, samples ``group_size`` responses to each, scores
    them, computes :func:`rolloutopt.advantages.grpo` over the groups and takes ``inner_steps`` Adam steps of
    the preset on that batch. Without a scenario (:func:`scenario`), ``old_logp`` are the sampler's log-probs;
    with one, the rollout engine is a perturbed and/or stale copy of the policy and the preset gets the inputs it
    consumes (see the module docstring). Experimental presets run with ``experimental=True``. Everything random
    comes from generators seeded by ``config.seed``. ``callback`` is called after every step.
    """
    cfg = config if config is not None else TrainConfig()
    loss_fn = losses.get(cfg.loss)
    scen = scenario(cfg)
    task = ReverseTask(cfg.length, cfg.holdout, seed=cfg.seed)
    train_ids, eval_ids = task.split()
    if eval_ids.numel() == 0:
        eval_ids = train_ids
    init_gen = torch.Generator().manual_seed(cfg.seed)
    policy = TinyPolicy(cfg.hidden, arch=cfg.arch, generator=init_gen)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    sample_gen = torch.Generator().manual_seed(cfg.seed + 1)
    eval_seed = cfg.seed + 2
    reference = copy.deepcopy(policy).requires_grad_(False) if "ref_logp" in scen.inputs else None
    engine = ScenarioEngine(
        scen, generator=torch.Generator().manual_seed(cfg.seed + 3), topk=cfg.topk, temperature=cfg.temperature,
        reference=reference,
    )  # fmt: skip
    group = torch.arange(cfg.prompts_per_step, dtype=torch.int64).repeat_interleave(cfg.group_size)
    width = task.max_response_len
    call_kw: dict[str, Any] = {"entropy_coef": cfg.entropy_coef}
    if scen.experimental is not None:
        call_kw["experimental"] = True

    start = time.perf_counter()
    before = evaluate(policy, task, eval_ids, samples=cfg.eval_samples, temperature=cfg.temperature, seed=eval_seed)
    records: list[StepRecord] = []
    total_tokens = 0
    for step in range(cfg.steps):
        pick = torch.randint(train_ids.numel(), (cfg.prompts_per_step,), generator=sample_gen)
        ids = train_ids[pick].repeat_interleave(cfg.group_size)
        prompts = task.prompts(ids)
        engine.advance(policy, step)
        roll, versions = engine.sample(prompts, width, sample_gen)
        mask = roll.mask
        rewards = task.reward(ids, roll.tokens, mask)
        adv = advantages.grpo(rewards, group)
        old_logp, inputs = engine.loss_inputs(policy, prompts, roll, versions, group=group, max_len=width)

        sums: dict[str, float] = {}
        for _ in range(cfg.inner_steps):
            logp, entropy = engine.forward(policy, prompts, roll, inputs)
            out = loss_fn(logp, old_logp, adv.advantages, mask, **call_kw, **inputs)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()  # type: ignore[no-untyped-call]
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            opt.step()
            metrics = {**out.metrics, "loss": out.loss.detach(), "grad_norm": grad_norm}
            if "entropy" not in metrics:
                ent = entropy.detach()
                metrics["entropy"] = torch.where(mask, ent, torch.zeros_like(ent)).sum() / mask.sum().clamp(min=1)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        n_tok = roll.num_tokens
        total_tokens += n_tok
        record = StepRecord(
            step=step,
            reward=float(rewards.mean()),
            tokens=n_tok,
            metrics={k: v / cfg.inner_steps for k, v in sums.items()},
        )
        records.append(record)
        if callback is not None:
            callback(record)
    after = evaluate(policy, task, eval_ids, samples=cfg.eval_samples, temperature=cfg.temperature, seed=eval_seed)
    seconds = time.perf_counter() - start
    return TrainResult(
        config=cfg,
        steps=records,
        eval_before=before,
        eval_after=after,
        rollouts=cfg.steps * cfg.prompts_per_step * cfg.group_size,
        tokens=total_tokens,
        seconds=seconds,
        num_params=sum(p.numel() for p in policy.parameters()),
        policy=policy,
        scenario=scen,
    )
