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

import rolloutopt.advantages as advantages
from rolloutopt.advantages import grpo
from rolloutopt.errors import InputError

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


# ---------------------------------------------------------------- estimators by name at TRL's advantage point


def bare_trainer(advantage: Any, experimental: bool = False) -> Any:
    """The adapter's trainer object without TRL's ``__init__`` (no model): enough for its estimator check."""
    from rolloutopt.integrations import trl as ro_trl

    trainer = object.__new__(ro_trl.GRPOTrainer)
    trainer._ro_advantage = advantage
    trainer._ro_experimental = experimental
    trainer._ro_adv_kwargs = {}
    trainer._ro_multi_reward = False
    return trainer


def trl_config(multi: bool) -> Any:
    aggregation = "normalize_then_sum" if multi else "sum_then_normalize"
    return SimpleNamespace(scale_rewards="group", multi_objective_aggregation=aggregation)


@pytest.mark.parametrize("name", advantages.names())
def test_every_estimator_is_accepted_or_refused_with_its_missing_input(name: str) -> None:
    """TRL's advantage point has the gathered rewards, the groups and the scorable rows: an estimator that
    requires more is refused at construction naming it; the others run on exactly what the adapter passes."""
    est = advantages.get(name)
    multi = est.reward_dims == "B K"
    trainer = bare_trainer(advantages.get(name), experimental=True)
    required = [*est.requires, *est.hyper_required]
    if required:
        with pytest.raises(InputError, match=f"^advantage: .*also requires {required[0]}"):
            trainer._check_advantage(trl_config(multi))
        return
    trainer._check_advantage(trl_config(multi))
    assert trainer._ro_multi_reward is multi
    assert ("valid" in trainer._ro_adv_kwargs) == ("valid" in est.accepts)
    per_func = make(3, 6, 4, 2, binary=False, unscorable=0.25)
    weights = torch.tensor([1.0, 0.5])
    valid = ~torch.isnan(per_func).all(dim=1)
    kw: dict[str, Any] = {"valid": valid} if "valid" in trainer._ro_adv_kwargs else {}
    if multi:
        rewards, kw["weights"] = per_func.nan_to_num(0.0), weights
    else:
        rewards = (per_func * weights).nansum(dim=1)
    group = torch.arange(len(rewards)) // 4
    out = trainer._ro_advantage(rewards, group, **kw, experimental=True)  # the adapter's call
    assert isinstance(out, advantages.AdvantageOutput) and out.advantages.shape == (len(rewards),)


def test_experimental_estimator_needs_the_trainer_flag() -> None:
    def plain(rewards: torch.Tensor, group: Any, *, valid: Any = None) -> advantages.AdvantageOutput:
        return grpo(rewards, group, valid=valid)

    try:
        advantages.register("tmp_trl_exp", plain, accepts=("valid",), experimental="a reconstructed detail")
        with pytest.raises(InputError, match=r"^experimental: expected experimental=True for the 'tmp_trl_exp'"):
            bare_trainer(advantages.get("tmp_trl_exp"))._check_advantage(trl_config(False))
        trainer = bare_trainer(advantages.get("tmp_trl_exp"), experimental=True)
        trainer._check_advantage(trl_config(False))
        assert trainer._ro_adv_kwargs == {"valid": True, "experimental": True}
    finally:
        advantages.REGISTRY._items.pop("tmp_trl_exp", None)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("fapo_penalty", "is a reward shaper, not an estimator"),
        ("d3s", "is a selector, not an estimator"),
        ("nope", "use one of the listed names"),
    ],
)
def test_a_name_that_is_not_an_estimator_is_refused(name: str, match: str) -> None:
    from rolloutopt.integrations.trl import GRPOTrainer

    with pytest.raises(InputError, match=f"^advantage: expected the name of an advantage estimator.*{match}"):
        GRPOTrainer(advantage=name)  # refused before TRL's own __init__ (no model needed)
