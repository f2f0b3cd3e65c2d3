"""Synthetic RL worlds for trying rolloutopt end to end on the CPU (a tool, not part of the core library).

:class:`ReverseTask` is a verifiable toy task, :class:`TinyPolicy` a small GRU policy whose sampler returns
rollouts in the library's tensor convention, and :func:`train` a short GRPO loop built from
:func:`rolloutopt.advantages.grpo` and a :mod:`rolloutopt.losses` preset. ``python -m rolloutopt demo`` runs it.
:class:`PromptPopulation` and :func:`run` are a model-free prompt population for comparing rollout allocators;
:class:`GenerationSimulator` is a token-level generation simulator (per-step signals with a latent failure point)
for comparing stop rules.
"""

from __future__ import annotations

from rolloutopt.testbed.generation import GenerationSimulator, SimulatedGeneration
from rolloutopt.testbed.policy import Rollouts, TinyPolicy
from rolloutopt.testbed.prompts import PromptPopulation, run
from rolloutopt.testbed.task import VOCAB, VOCAB_SIZE, ReverseTask, decode, encode
from rolloutopt.testbed.train import EvalResult, StepRecord, TrainConfig, TrainResult, evaluate, train

__all__ = [
    "VOCAB",
    "VOCAB_SIZE",
    "EvalResult",
    "GenerationSimulator",
    "PromptPopulation",
    "ReverseTask",
    "Rollouts",
    "SimulatedGeneration",
    "StepRecord",
    "TinyPolicy",
    "TrainConfig",
    "TrainResult",
    "decode",
    "encode",
    "evaluate",
    "run",
    "train",
]
