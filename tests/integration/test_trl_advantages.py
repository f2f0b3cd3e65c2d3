"""Parity with TRL 1.16's GRPO group normalisation (``scale_rewards`` "group", "batch", "none").

TRL has no standalone advantage function: the normalisation is inline in
``GRPOTrainer._generate_and_score_completions`` (the ``multi_objective_aggregation == "sum_then_normalize"``
branch, about 25 lines between the reward computation and ``torch.nan_to_num``). Running the whole method on a
fake trainer would need a model, a tokenizer, an accelerator, generation and log-prob stubs (dozens of
attributes that change between TRL releases), so that would be the fragile choice. Instead these tests execute
TRL's own lines: they take the source of ``_generate_and_score_completions`` with ``inspect.getsource``, cut
the block from ``if self.multi_objective_aggregation == ...`` to ``advantages = torch.nan_to_num(...)``, check
that it still holds the expressions this comparison relies on (``rewards.view(-1, num_generations)``, ``nanstd``,
``std_rewards + 1e-4``), and ``exec`` it in the module's own globals (so ``torch`` and ``nanstd`` are TRL's) with
``self`` reduced to the four attributes the block reads. If TRL moves or rewrites the block the extraction test
fails loudly rather than comparing against a stale copy.

Compatible call: ``grpo(r, ids, eps=1e-4, scale={"group", "batch", None}[scale_rewards], valid=~r.isnan())`` on
the weighted sum of the reward functions. TRL's groups are consecutive blocks of ``num_generations``; its std is
the unbiased ``nanstd``; rows for which every reward function returned None (NaN) leave the statistics and get
advantage 0, which is our ``valid`` mask; a group left with one scorable row gets 0 (our ``singleton="zero"``).
"""

from __future__ import annotations

import inspect
import math
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rolloutopt.advantages import grpo

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

pytestmark = [pytest.mark.trl, pytest.mark.filterwarnings("ignore:rolloutopt. a group of size 1")]

START = 'if self.multi_objective_aggregation == "sum_then_normalize":'
END = "advantages = torch.nan_to_num(advantages, nan=0.0)"
EXPECTED = [
    "rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
    "rewards[unscorable_mask] = torch.nan",
    "torch.nanmean(rewards.view(-1, num_generations), dim=1)",
    "nanstd(rewards.view(-1, num_generations), dim=1)",
    'elif self.scale_rewards == "batch":',
    "nanstd(rewards).expand_as(rewards)",
    "advantages = rewards - mean_grouped_rewards",
    "advantages = advantages / (std_rewards + 1e-4)",
]
SCALE = {"group": "group", "batch": "batch", "none": None}


def trl_block() -> str:
    src = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions)
    lines = src.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == START)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == END)
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def test_trl_block_still_holds_the_normalisation() -> None:
    block = trl_block()
    for expr in EXPECTED:
        assert expr in block, f"TRL's advantage block changed: {expr!r} not found"
    compile(block, "<trl advantages>", "exec")


def trl_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, scale: str) -> Any:
    namespace: dict[str, Any] = dict(vars(trl_grpo))
    namespace.update(
        self=SimpleNamespace(
            multi_objective_aggregation="sum_then_normalize",
            scale_rewards=scale,
            reward_weights=weights,
            reward_funcs=[None] * len(weights),
        ),
        rewards_per_func=rewards_per_func,
        unscorable_mask=torch.isnan(rewards_per_func).all(dim=1),  # TRL's line just above the block
        num_generations=num_generations,
        device=torch.device("cpu"),
    )
    exec(compile(trl_block(), "<trl advantages>", "exec"), namespace)
    return namespace["advantages"]


def make(seed: int, groups: int, n: int, k: int, binary: bool, unscorable: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    b = groups * n
    per_func = (torch.rand(b, k, generator=gen) > 0.5).float() if binary else torch.randn(b, k, generator=gen)
    per_func[torch.rand(b, k, generator=gen) < 0.2] = math.nan  # one function returned None for this row
    per_func[torch.rand(b, generator=gen) < unscorable] = math.nan  # every function returned None
    return per_func


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize(("k", "binary", "unscorable"), [(1, False, 0.0), (1, True, 0.0), (2, False, 0.25)])
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_matches_trl(scale: str, n: int, k: int, binary: bool, unscorable: float, seed: int) -> None:
    per_func = make(seed, 12, n, k, binary, unscorable)
    weights = torch.tensor([1.0, 0.5][:k])
    theirs = trl_advantages(per_func.clone(), weights, n, scale)
    rewards = (per_func * weights).nansum(dim=1)
    scorable = ~torch.isnan(per_func).all(dim=1)
    rewards[~scorable] = math.nan
    ids = torch.arange(len(rewards)) // n  # consecutive blocks of num_generations
    valid = None if bool(scorable.all()) else scorable
    ours = grpo(rewards, ids, eps=1e-4, scale=SCALE[scale], valid=valid)  # type: ignore[arg-type]
    torch.testing.assert_close(ours.advantages, theirs, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.weight, scorable.float())


def test_zero_variance_and_singleton_groups_give_zero_like_trl() -> None:
    # groups of 4: all equal (0.1 four times), one scorable row, all unscorable, ordinary
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 2.0, math.nan, math.nan, math.nan] + [math.nan] * 4 + [1.0, 0, 0, 3])
    for scale in ("group", "batch", "none"):
        theirs = trl_advantages(rewards[:, None].clone(), torch.ones(1), 4, scale)
        ours = grpo(rewards, torch.arange(16) // 4, eps=1e-4, scale=SCALE[scale], valid=~rewards.isnan())  # type: ignore[arg-type]
        torch.testing.assert_close(ours.advantages, theirs, atol=1e-5, rtol=1e-5)
        assert torch.equal(ours.advantages[:12], torch.zeros(12))
