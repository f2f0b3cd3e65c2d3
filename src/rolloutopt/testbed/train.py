"""A short, seeded GRPO run on the reverse task: sample, score, :func:`rolloutopt.advantages.grpo`, the
``"grpo"`` loss preset with a few PPO-style inner steps on each batch, Adam.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rolloutopt import advantages, losses
from rolloutopt.errors import InputError
from rolloutopt.testbed.policy import TinyPolicy
from rolloutopt.testbed.task import ReverseTask

__all__ = ["EvalResult", "StepRecord", "TrainConfig", "TrainResult", "evaluate", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """Settings of :func:`train`; the defaults are the ``demo`` run."""

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
    policy: TinyPolicy, task: ReverseTask, prompt_ids: Tensor, *, samples: int, temperature: float, seed: int
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
    """Run GRPO on :class:`~rolloutopt.testbed.task.ReverseTask` with a :class:`TinyPolicy`, on the CPU.

    Each step draws ``prompts_per_step`` training prompts, samples ``group_size`` responses to each, scores
    them, computes :func:`rolloutopt.advantages.grpo` over the groups and takes ``inner_steps`` Adam steps of
    the ``config.loss`` preset on that batch (``old_logp`` are the sampler's log-probs). Everything random
    comes from generators seeded by ``config.seed``. ``callback`` is called after every step.
    """
    cfg = config if config is not None else TrainConfig()
    loss_fn = losses.get(cfg.loss)
    task = ReverseTask(cfg.length, cfg.holdout, seed=cfg.seed)
    train_ids, eval_ids = task.split()
    if eval_ids.numel() == 0:
        eval_ids = train_ids
    init_gen = torch.Generator().manual_seed(cfg.seed)
    policy = TinyPolicy(cfg.hidden, arch=cfg.arch, generator=init_gen)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    sample_gen = torch.Generator().manual_seed(cfg.seed + 1)
    eval_seed = cfg.seed + 2
    group = torch.arange(cfg.prompts_per_step, dtype=torch.int64).repeat_interleave(cfg.group_size)

    start = time.perf_counter()
    before = evaluate(policy, task, eval_ids, samples=cfg.eval_samples, temperature=cfg.temperature, seed=eval_seed)
    records: list[StepRecord] = []
    total_tokens = 0
    for step in range(cfg.steps):
        pick = torch.randint(train_ids.numel(), (cfg.prompts_per_step,), generator=sample_gen)
        ids = train_ids[pick].repeat_interleave(cfg.group_size)
        prompts = task.prompts(ids)
        roll = policy.sample(prompts, task.max_response_len, temperature=cfg.temperature, generator=sample_gen)
        rewards = task.reward(ids, roll.tokens, roll.mask)
        adv = advantages.grpo(rewards, group)
        sums: dict[str, float] = {}
        for _ in range(cfg.inner_steps):
            logp, entropy = policy.log_probs(prompts, roll.tokens, temperature=cfg.temperature)
            out = loss_fn(logp, roll.logp, adv.advantages, roll.mask, entropy=entropy, entropy_coef=cfg.entropy_coef)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()  # type: ignore[no-untyped-call]
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            opt.step()
            for k, v in {**out.metrics, "loss": out.loss.detach(), "grad_norm": grad_norm}.items():
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
    )
