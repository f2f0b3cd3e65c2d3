"""A simulated rollout engine for a :class:`~rolloutopt.testbed.train.Scenario`: stale, partial or mismatched
rollouts of a :class:`TinyPolicy`, and the optional loss inputs a preset reads from such an engine.

Used by :func:`rolloutopt.testbed.train` and by the arena's loss family (:mod:`rolloutopt.arena`). Per training
step :meth:`ScenarioEngine.advance` takes the step's snapshot of the policy and builds the engines:

- **staleness** ``k``: the engine holds the policy of ``k`` training steps ago (fewer at the start of a run);
- **partial rollouts**: each response starts under the oldest of the last ``k + 1`` snapshots and switches to newer
  ones at random positions, up to the current policy, so the generating version changes inside a response (what
  a partial-rollout buffer such as APRIL's or CoPRIS's produces after weight updates);
- **mismatch**: every engine is a perturbed copy (``perturb(policy, generator)``; by default seeded weight noise of
  relative size ``scenario.mismatch``, :meth:`TinyPolicy.perturbed`).

:meth:`ScenarioEngine.sample` draws rollouts (with the engine's top-K log-probs where a preset reads them) and the
generating version of every token; :meth:`ScenarioEngine.loss_inputs` returns ``old_logp`` and the preset's inputs
(``behav_logp``, ``versions``, ``policy_version``, ``topk_behav_logp``, ``sampled_in_topk``, ``confidence``,
``max_len``, ``group``, ``ref_logp``); :meth:`ScenarioEngine.forward` the trained policy's log-probs and entropies
at every inner step (and ``topk_logp`` at the engine's top-K ids, ``entropy`` when the preset reads it).
A preset that reads ``behav_logp`` gets the trainer's recompute as ``old_logp`` (the decoupled form); any other
gets the engine's log-probs as ``old_logp`` (the coupled form: its trust region sees the engine's distance).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt.ratios import tail_confidence
from rolloutopt.testbed.policy import Rollouts, TinyPolicy, sample_from
from rolloutopt.typing import FloatBT, IntB, IntBT

__all__ = ["CONFIDENCE_TOPK", "ENGINE_INPUTS", "VERSION_INPUTS", "Scenario", "ScenarioEngine"]

CONFIDENCE_TOPK = 5
"""ECHO's token confidence is the mean probability of the top-5 tokens (arXiv 2602.02150)."""
ENGINE_INPUTS = ("behav_logp", "topk_behav_logp", "topk_logp", "sampled_in_topk")
VERSION_INPUTS = ("versions", "policy_version")
_TOPK_INPUTS = ("topk_logp", "topk_behav_logp", "sampled_in_topk")


@dataclass(frozen=True)
class Scenario:
    """What :func:`train` simulates for a preset, and the optional inputs it passes to the loss.

    Attributes:
        mismatch: relative weight noise of the rollout engine (0: the engine is the trainer's policy).
        staleness: policy versions the engine lags behind (0: on-policy rollouts).
        partial: whether responses switch policy version mid-way (partial rollouts).
        inputs: the optional inputs passed to the preset, sorted.
        experimental: why the preset is experimental (it then runs with ``experimental=True``), or None.
    """

    mismatch: float
    staleness: int
    partial: bool
    inputs: tuple[str, ...]
    experimental: str | None = None

    @property
    def simulated(self) -> bool:
        """Whether rollouts come from an engine other than the trained policy."""
        return self.mismatch > 0 or self.staleness > 0

    def describe(self) -> str:
        """One line, e.g. ``"engine mismatch (weight noise 0.05), staleness 2"``; empty when nothing is simulated."""
        parts = []
        if self.mismatch > 0:
            parts.append(f"engine mismatch (weight noise {self.mismatch:g})")
        if self.staleness > 0:
            kind = "partial rollouts, staleness up to" if self.partial else "staleness"
            parts.append(f"{kind} {self.staleness} step{'s' if self.staleness != 1 else ''}")
        return ", ".join(parts)


def _snapshot(policy: TinyPolicy) -> TinyPolicy:
    frozen = copy.deepcopy(policy)
    frozen.requires_grad_(False)
    return frozen


def _switch_points(b: int, width: int, switches: int, gen: torch.Generator) -> Tensor:
    """Source index ``[b, width]`` of a partial rollout: ``switches`` sorted random positions in ``[0, width]`` per
    row; the index at ``t`` is how many of them are ``<= t`` (0 = the oldest snapshot, ``switches`` = newest)."""
    cuts = torch.randint(0, width + 1, (b, switches), generator=gen).sort(-1).values
    return (cuts[:, None, :] <= torch.arange(width)[None, :, None]).sum(-1)


class ScenarioEngine:
    """The rollout engine of ``scenario`` (see the module docstring).

    ``topk``: K of the top-K inputs; ``record_topk``: record at least this many top-K log-probs in every rollout
    (for a stop rule that reads them); ``temperature``: sampling temperature (the trained policy's log-probs use the
    same); ``generator``: the scenario's randomness (switch points, the perturbation), separate from sampling;
    ``perturb``: how a mismatched engine is built from a policy, every step (given, it applies whatever
    ``scenario.mismatch``; default: weight noise of relative size ``scenario.mismatch`` when that is > 0); ``reference``: the policy whose log-probs are ``ref_logp`` (presets with a KL stage).
    """

    def __init__(
        self,
        scenario: Scenario,
        *,
        generator: torch.Generator,
        topk: int = 8,
        record_topk: int = 0,
        temperature: float = 1.0,
        perturb: Callable[[TinyPolicy, torch.Generator], TinyPolicy] | None = None,
        reference: TinyPolicy | None = None,
    ) -> None:
        self.scenario = scenario
        self.needs = set(scenario.inputs)
        self.temperature = temperature
        self.generator = generator
        self.mismatched = perturb is not None or scenario.mismatch > 0
        self.perturb = perturb if perturb is not None else (lambda p, g: p.perturbed(scenario.mismatch, g))
        self.reference = reference
        self.n_topk = topk if self.needs & set(_TOPK_INPUTS) else 0
        self.n_sample_topk = max(self.n_topk, CONFIDENCE_TOPK if "confidence" in self.needs else 0, record_topk)
        self.snapshots: deque[TinyPolicy] = deque(maxlen=scenario.staleness + 1)
        self.engines: list[TinyPolicy] = []
        self.step = 0

    def advance(self, policy: TinyPolicy, step: int) -> None:
        """Begin training step ``step`` (the trained policy's version): the engines that generate this step."""
        self.step = step
        engines = [policy]
        if self.scenario.staleness > 0:
            self.snapshots.append(_snapshot(policy))
            engines = list(self.snapshots) if self.scenario.partial else [self.snapshots[0]]
        if self.mismatched:
            engines = [self.perturb(e, self.generator) for e in engines]
        self.engines = engines

    @property
    def oldest_version(self) -> int:
        """The version of the oldest engine of this step."""
        return self.step - (len(self.snapshots) - 1) if self.scenario.staleness > 0 else self.step

    def sample(
        self,
        prompts: Int[Tensor, "B L"],
        width: int,
        generator: torch.Generator,
        *,
        prefix: Int[Tensor, "B P"] | None = None,
        prefix_len: IntB | None = None,
    ) -> tuple[Rollouts, IntBT]:
        """Rollouts of ``prompts [B, L]`` (at most ``width`` tokens) and the generating version ``[B, T]`` (int64)
        of every token; ``prefix``/``prefix_len`` continue responses already begun
        (:func:`~rolloutopt.testbed.policy.sample_from`; the versions then count the prefix as this step's)."""
        if not self.engines:
            raise RuntimeError("call advance() before sample()")
        source = None
        if len(self.engines) > 1:
            source = _switch_points(prompts.shape[0], width, len(self.engines) - 1, self.generator)
        roll = sample_from(
            self.engines, prompts, width, temperature=self.temperature, generator=generator, source=source,
            topk=self.n_sample_topk, prefix=prefix, prefix_len=prefix_len,
        )  # fmt: skip
        versions = torch.full(roll.mask.shape, self.oldest_version, dtype=torch.int64, device=roll.mask.device)
        if source is not None:
            versions = versions + source[:, : roll.mask.shape[1]].to(versions.device)
        return roll, versions

    def loss_inputs(
        self,
        policy: TinyPolicy,
        prompts: Int[Tensor, "B L"],
        roll: Rollouts,
        versions: IntBT,
        *,
        group: IntB,
        max_len: int,
    ) -> tuple[FloatBT, dict[str, Any]]:
        """``old_logp`` and the preset's optional inputs for a batch of this step (see the module docstring)."""
        needs, mask = self.needs, roll.mask
        inputs: dict[str, Any] = {}
        stage_inputs: dict[str, Any] = {}
        old_logp = roll.logp
        if "behav_logp" in needs:
            with torch.no_grad():
                recompute, _ = policy.log_probs(prompts, roll.tokens, temperature=self.temperature)
            old_logp = torch.where(mask, recompute, torch.zeros_like(recompute))
            inputs["behav_logp"] = roll.logp
        if "versions" in needs:
            inputs["versions"] = versions
        if "policy_version" in needs:
            inputs["policy_version"] = self.step
        if self.n_sample_topk > 0:
            assert roll.topk_ids is not None and roll.topk_logp is not None
            topk_ids = roll.topk_ids[..., : self.n_topk]
            if "topk_behav_logp" in needs:
                inputs["topk_behav_logp"] = roll.topk_logp[..., : self.n_topk]
            if "sampled_in_topk" in needs:
                stage_inputs["sampled_in_topk"] = (topk_ids == roll.tokens[..., None]).any(-1) & mask
            if "confidence" in needs:
                token_conf = roll.topk_logp[..., :CONFIDENCE_TOPK].exp().mean(-1)
                inputs["confidence"] = tail_confidence(token_conf, mask)
        if "max_len" in needs:
            inputs["max_len"] = max_len
        if "group" in needs:
            inputs["group"] = group
        if "ref_logp" in needs:
            if self.reference is None:
                raise RuntimeError("the preset reads ref_logp: pass reference= to the engine")
            with torch.no_grad():
                inputs["ref_logp"], _ = self.reference.log_probs(prompts, roll.tokens, temperature=self.temperature)
        if stage_inputs:
            inputs["stage_inputs"] = stage_inputs
        return old_logp, inputs

    def forward(
        self, policy: TinyPolicy, prompts: Int[Tensor, "B L"], roll: Rollouts, inputs: dict[str, Any]
    ) -> tuple[FloatBT, FloatBT]:
        """The trained policy's log-probs and entropies ``[B, T]`` of the sampled tokens (with gradients); sets
        ``inputs["topk_logp"]`` (at the engine's top-K ids) and ``inputs["entropy"]`` where the preset reads them."""
        if "topk_logp" in self.needs:
            assert roll.topk_ids is not None
            logsm = policy.log_softmax(prompts, roll.tokens, temperature=self.temperature)
            logp = logsm.gather(-1, roll.tokens[..., None]).squeeze(-1)
            entropy = -(logsm.exp() * logsm).sum(-1)
            inputs["topk_logp"] = logsm.gather(-1, roll.topk_ids[..., : self.n_topk])
        else:
            logp, entropy = policy.log_probs(prompts, roll.tokens, temperature=self.temperature)
        if "entropy" in self.needs:
            inputs["entropy"] = entropy
        return logp, entropy
