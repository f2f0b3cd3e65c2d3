"""A synthetic prompt population for comparing rollout allocators without a model.

:class:`PromptPopulation` holds ``P`` prompts, each with a latent difficulty and a pass probability; sampling a
prompt gives Bernoulli rewards, and :meth:`PromptPopulation.learn` raises each prompt's pass probability in
proportion to the learning signal the step gave it, following the GRPO gradient-variance argument: a group whose
rewards are all equal has zero advantages and teaches nothing, and a prompt's expected improvement per
informative rollout is :math:`p(1-p)` (the derivative of the pass rate with respect to its logit).
:func:`run` drives any allocator through the allocation protocol (``docs/api/allocators.md``) on a population and
reports how many rollouts it needed to reach a target mean pass rate.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._validation import check_real as _real
from rolloutopt._validation import describe
from rolloutopt.allocators import (
    AllocationResult,
    Allocator,
    Generated,
    Request,
    as_prompt_ids,
    check_budget,
    run_step,
)
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatB, FloatP, IntP

__all__ = ["PromptPopulation", "run"]


class PromptPopulation:
    r"""``P`` synthetic prompts with latent difficulty, Bernoulli rewards, and learning from informative groups.

    Prompt :math:`i` (id ``i``, ``0 <= i < P``) has a latent difficulty :math:`d_i \sim
    \mathcal N(\mu, \sigma^2)` drawn once from ``seed``, a logit :math:`\theta_i = -d_i` and a pass probability
    :math:`p_i = \sigma(\theta_i)`. A rollout of prompt :math:`i` earns reward 1 with probability :math:`p_i`,
    else 0 (:meth:`sample`). After a step, :meth:`learn` applies

    .. math::

        k_i = \sum_{j:\ \mathrm{prompt}(j) = i} w_j \,
              \big[\text{the rewards of } i\text{'s weighted rollouts in the step are not all equal}\big],
        \qquad
        \theta_i \leftarrow \theta_i + \eta\, k_i + \tau\, \eta\, \frac{\sum_l k_l}{P},

    where :math:`w_j` is the result's weight of rollout :math:`j` (0 for rollouts an allocator kept out of the
    loss) and only rollouts with :math:`w_j > 0` count. So, to first order in :math:`\eta`, prompt :math:`i`'s pass
    rate rises by :math:`\eta\, k_i\, p_i (1 - p_i)`: in proportion to the number of rollouts it had in groups
    with reward variance (GRPO's advantages vanish on zero-variance groups, as DAPO argues, arXiv 2503.14476
    §3.3), times :math:`p(1-p)`, the Bernoulli reward variance that scales the policy gradient of the pass rate.
    Working on the logit keeps every :math:`p_i` in [0, 1]. The optional transfer term (:math:`\tau`,
    ``transfer``, default 0) spreads a share of the total signal evenly over all prompts, a crude model of shared
    skill. This model is the library's own (``docs/methods/dynamic_sampling.md``); it is not taken from a
    paper and rewards no allocator in particular.

    Deterministic: the difficulties depend only on ``seed``; :meth:`sample` draws only from the generator it is
    given; :meth:`learn` is deterministic.

    Args:
        num_prompts: ``P`` (default 1000).
        difficulty_mean: :math:`\mu` (default 1.0: the median prompt starts at :math:`p = \sigma(-1) \approx 0.27`).
        difficulty_std: :math:`\sigma \ge 0` (default 2.0: many prompts start near 0 or 1, so zero-variance groups
            are common, as in real RLVR data).
        learning_rate: :math:`\eta \ge 0`, logit step per informative rollout (default 0.02).
        transfer: :math:`\tau \ge 0` (default 0.0).
        seed: seed of the difficulties (default 0).
        pass_rates: optional float ``[P]`` of initial pass probabilities in [0, 1] (overrides the drawn
            difficulties; 0 and 1 are absorbing: such a prompt never learns).
    """

    def __init__(
        self,
        *,
        num_prompts: int = 1000,
        difficulty_mean: float = 1.0,
        difficulty_std: float = 2.0,
        learning_rate: float = 0.02,
        transfer: float = 0.0,
        seed: int = 0,
        pass_rates: FloatP | None = None,
    ) -> None:
        if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1:
            raise InputError("num_prompts", "an int >= 1", describe(num_prompts), "pass e.g. num_prompts=1000")
        self.difficulty_mean = _real(difficulty_mean, "difficulty_mean")
        self.difficulty_std = _real(difficulty_std, "difficulty_std", low=0.0)
        self.learning_rate = _real(learning_rate, "learning_rate", low=0.0)
        self.transfer = _real(transfer, "transfer", low=0.0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise InputError("seed", "an int >= 0", describe(seed), "pass e.g. seed=0")
        self.seed = seed
        if pass_rates is None:
            g = torch.Generator().manual_seed(seed)
            d = self.difficulty_mean + self.difficulty_std * torch.randn(num_prompts, generator=g, dtype=torch.float64)
            self.difficulty = d
        else:
            if not isinstance(pass_rates, Tensor) or not pass_rates.is_floating_point() or pass_rates.ndim != 1:
                raise InputError("pass_rates", "a 1-d float tensor [P]", describe(pass_rates), "pass torch.tensor(p)")
            p0 = pass_rates.detach().cpu().to(torch.float64)
            if not bool(((p0 >= 0) & (p0 <= 1)).all()):
                raise InputError("pass_rates", "probabilities in [0, 1]", describe(pass_rates), "clamp to [0, 1]")
            num_prompts = p0.numel()
            self.difficulty = -torch.logit(p0)
        self.num_prompts = num_prompts
        self.prompt_ids = torch.arange(num_prompts)
        self._theta = -self.difficulty.clone()

    @property
    def pass_rates(self) -> FloatP:
        """Current pass probabilities, float64 ``[P]`` (a new tensor)."""
        return torch.sigmoid(self._theta)

    @property
    def mean_pass_rate(self) -> float:
        """Mean of :attr:`pass_rates` over the population."""
        return float(self.pass_rates.mean())

    def _index(self, prompt_ids: Int[Tensor, " N"], name: str) -> Int[Tensor, " N"]:
        ids = prompt_ids.long().cpu()
        if ids.numel() and not bool(((ids >= 0) & (ids < self.num_prompts)).all()):
            raise InputError(name, f"ids of this population (0..{self.num_prompts - 1})", "unknown ids", "check ids")
        return ids

    def sample(self, prompt_ids: IntP, counts: IntP, generator: torch.Generator) -> FloatB:
        """Bernoulli rewards (float32 0/1, ``[B]`` with ``B = counts.sum()``) for ``counts[r]`` rollouts of
        ``prompt_ids[r]``, ordered by row.

        Exactly the ``rewards`` that ``plan.observe(request, rewards)`` expects for a request. Draws only from
        ``generator``, so a seeded generator makes the rewards reproducible.
        """
        if not isinstance(prompt_ids, Tensor) or prompt_ids.is_floating_point() or prompt_ids.ndim != 1:
            raise InputError("prompt_ids", "an int64 tensor [R]", describe(prompt_ids), "pass request.prompt_ids")
        if not isinstance(counts, Tensor) or counts.is_floating_point() or counts.shape != prompt_ids.shape:
            raise InputError("counts", f"an int64 tensor [R] with R={prompt_ids.numel()}", describe(counts), "fix")
        if counts.numel() and int(counts.min()) < 0:
            raise InputError("counts", "non-negative counts", describe(counts), "pass request.counts")
        if not isinstance(generator, torch.Generator):
            raise InputError(
                "generator", "a torch.Generator", describe(generator), "pass torch.Generator().manual_seed(0)"
            )
        ids = self._index(prompt_ids, "prompt_ids")
        p = self.pass_rates[ids].repeat_interleave(counts.long().cpu())
        return torch.bernoulli(p, generator=generator).float()

    def signal(self, result: AllocationResult) -> FloatP:
        """The learning signal :math:`k_i` of every prompt, float64 ``[P]`` (class docstring), for ``result``."""
        if not isinstance(result, AllocationResult):
            raise InputError("result", "an AllocationResult (plan.finish())", describe(result), "pass plan.finish()")
        ids = self._index(result.prompt_ids, "result.prompt_ids")
        w = result.weight.detach().cpu().to(torch.float64)
        r = result.rewards.detach().cpu().to(torch.float64)
        on = w > 0
        big = torch.full((self.num_prompts,), -torch.inf, dtype=torch.float64)
        small = torch.full((self.num_prompts,), torch.inf, dtype=torch.float64)
        rmax = big.scatter_reduce(0, ids, torch.where(on, r, -torch.inf), "amax")
        rmin = small.scatter_reduce(0, ids, torch.where(on, r, torch.inf), "amin")
        varied = rmax > rmin
        k = torch.zeros(self.num_prompts, dtype=torch.float64).index_add_(0, ids, torch.where(on, w, 0.0))
        return torch.where(varied, k, 0.0)

    def learn(self, result: AllocationResult) -> FloatP:
        """Apply one step of learning from ``result`` (class docstring); returns the signal :math:`k` ``[P]``."""
        k = self.signal(result)
        step = self.learning_rate * k + self.transfer * self.learning_rate * k.sum() / self.num_prompts
        self._theta = self._theta + step
        return k

    def state_dict(self) -> dict[str, Any]:
        """The current logits (the difficulties are fixed by the constructor)."""
        return {"theta": self._theta.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        theta = state.get("theta") if isinstance(state, dict) else None
        if not isinstance(theta, Tensor) or theta.shape != (self.num_prompts,):
            raise InputError("state", f"a state_dict of a population of {self.num_prompts}", describe(state), "fix")
        self._theta = theta.detach().cpu().to(torch.float64).clone()


def run(
    allocator: Allocator,
    population: PromptPopulation,
    budget_per_step: int,
    steps: int,
    target: float,
    *,
    pool_size: int | None = None,
    seed: int = 0,
    stop_at_target: bool = True,
) -> dict[str, Any]:
    """Train ``population`` with ``allocator`` for up to ``steps`` steps; report the rollouts to reach ``target``.

    Each step: the pool is every prompt of the population (or, with ``pool_size``, a random subset of that
    size drawn from a generator seeded with ``seed``), one :func:`~rolloutopt.allocators.run_step` with every
    request answered by :meth:`PromptPopulation.sample` (same generator), then ``population.learn(result)``.
    The population has no response or prompt entropies: a probe is answered with nothing, and an allocator
    that *requires* response entropies (DEPO) gets synthetic ones, uniform in [0.5, 2] and independent of the
    rewards (from the same generator), so that it runs; its ranking by entropy then carries no information. The population is trained in place (pass a
    fresh one per run). With ``stop_at_target`` (default) the run ends at the first step after which the mean
    pass rate is ``>= target``.

    Returns a dict: ``reached`` (bool), ``rollouts_to_target`` and ``steps_to_target`` (cumulative rollouts and
    steps when the target was first reached, None if never), ``total_rollouts``, ``steps``,
    ``zero_variance_frac`` (rollouts in zero-variance groups — a prompt's rollouts of one step whose rewards are
    all equal — over all rollouts generated), ``kept_frac`` (rollouts with weight > 0 over all rollouts),
    ``initial_pass_rate``, ``final_pass_rate``, and the per-step curves ``pass_rate`` and ``rollouts``
    (cumulative).
    """
    check_budget(budget_per_step, "budget_per_step")
    if not isinstance(population, PromptPopulation):
        raise InputError("population", "a PromptPopulation", describe(population), "pass PromptPopulation(...)")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise InputError("steps", "an int >= 0", describe(steps), "pass e.g. steps=100")
    _real(target, "target")
    if pool_size is not None and (not isinstance(pool_size, int) or not 1 <= pool_size <= population.num_prompts):
        raise InputError("pool_size", f"None or an int in [1, {population.num_prompts}]", describe(pool_size), "fix")
    gen = torch.Generator().manual_seed(seed)
    needs_entropy = "entropy" in getattr(allocator, "requires", ())

    def generate(request: Request) -> Generated:
        if request.is_probe:
            return None  # the population has no prompt entropies: an allocator that only accepts them goes on
        rewards = population.sample(request.prompt_ids, request.counts, gen)
        if not needs_entropy:
            return rewards
        entropy = 0.5 + 1.5 * torch.rand(rewards.numel(), generator=gen, dtype=torch.float64)
        return {"rewards": rewards, "entropy": entropy}

    initial = population.mean_pass_rate
    total = zero_var = kept = 0
    reached_at: tuple[int, int] | None = None
    curve: list[float] = []
    rollouts: list[int] = []
    done = 0
    for step in range(steps):
        if pool_size is None:
            pool = population.prompt_ids
        else:
            pool = as_prompt_ids(torch.randperm(population.num_prompts, generator=gen)[:pool_size])
        result = run_step(allocator, pool, budget_per_step, generate)
        population.learn(result)
        # Generated rollouts only: an allocator may append reused responses (AR3PO's replay) after them.
        n = int(result.counts.sum())
        if n:
            r, g = result.rewards[:n].double(), result.group[:n]
            p = result.plan_prompt_ids.numel()
            rmax = torch.full((p,), -torch.inf, dtype=torch.float64).scatter_reduce(0, g, r, "amax")
            rmin = torch.full((p,), torch.inf, dtype=torch.float64).scatter_reduce(0, g, r, "amin")
            flat = (rmax == rmin)[g]
            zero_var += int(flat.sum())
            kept += int((result.weight[:n] > 0).sum())
        total += n
        done = step + 1
        rate = population.mean_pass_rate
        curve.append(rate)
        rollouts.append(total)
        if reached_at is None and rate >= target:
            reached_at = (total, done)
            if stop_at_target:
                break
    return {
        "reached": reached_at is not None,
        "rollouts_to_target": None if reached_at is None else reached_at[0],
        "steps_to_target": None if reached_at is None else reached_at[1],
        "total_rollouts": total,
        "steps": done,
        "zero_variance_frac": zero_var / total if total else 0.0,
        "kept_frac": kept / total if total else 0.0,
        "initial_pass_rate": initial,
        "final_pass_rate": population.mean_pass_rate,
        "pass_rate": curve,
        "rollouts": rollouts,
    }
