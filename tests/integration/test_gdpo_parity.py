"""Parity of :func:`rolloutopt.advantages.gdpo.gdpo` with verl 0.9.1 and TRL 1.16 on identical inputs.

verl: ``core_algos.compute_gdpo_outcome_advantage`` is called as the trainer calls it, with ``config`` holding
``gdpo_reward_keys`` / ``gdpo_reward_weights``, the components in ``non_tensor_batch`` and a ``batch`` with
``prompts`` and ``attention_mask`` (from which verl places each component at the last response token). It runs
verl's GRPO per component (eps 1e-6, a singleton keeps ``r / (1 + eps)``), sums with the weights and applies
``masked_whiten`` over the response tokens. Compatible call: ``gdpo(r, ids, weights=w, final="token",
mask=response_mask, singleton="raw")``. Without ``config`` verl falls back to ``token_level_rewards`` (K = 1).

TRL: the GDPO branch (``multi_objective_aggregation == "normalize_then_sum"``) is inline in
``GRPOTrainer._generate_and_score_completions``. As in ``test_trl_advantages.py``, we cut TRL's own lines
from ``if self.multi_objective_aggregation == ...`` to ``advantages = torch.nan_to_num(...)`` with
``inspect.getsource``, assert that they still hold the expressions this comparison relies on, and ``exec`` them
in the module's globals (TRL's ``torch`` and ``nanstd``). Compatible call: ``gdpo(per_func, ids,
weights=reward_weights, valid=~per_func.isnan())`` (defaults: final="sequence", eps 1e-4 twice), on consecutive
groups of ``num_generations``. A reward function's None (NaN) leaves that component's group statistics and
contributes 0; a row where every function returned None leaves the batch statistics and gets 0.
"""

from __future__ import annotations

import importlib
import inspect
import math
import textwrap
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from rolloutopt.advantages.gdpo import gdpo

pytestmark = pytest.mark.filterwarnings("ignore:rolloutopt. a group of size 1")


def _optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


core_algos = _optional("verl.trainer.ppo.core_algos")
trl_grpo = _optional("trl.trainer.grpo_trainer")
needs_verl = pytest.mark.skipif(core_algos is None, reason="verl not installed")
needs_trl = pytest.mark.skipif(trl_grpo is None, reason="trl not installed")

T, P = 6, 3


# ------------------------------------------------------------------------------------------------ verl


def make_verl(seed: int, case: str, k: int, binary: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    if case == "equal":
        sizes = torch.full((12,), 4)
    else:  # ragged, with groups of one
        sizes = torch.randint(1, 9, (15,), generator=gen)
        sizes[:3] = 1
    gid = torch.repeat_interleave(torch.randperm(10_000, generator=gen)[: len(sizes)], sizes)
    gid = gid[torch.randperm(len(gid), generator=gen)]
    b = len(gid)
    if binary:
        comps = (torch.rand(b, k, generator=gen) > 0.5).float()
    else:
        comps = torch.randn(b, k, generator=gen) * torch.tensor([1.0, 5.0, 0.3][:k]) + 1
    lengths = torch.randint(1, T + 1, (b,), generator=gen)
    lengths[:2] = 0  # empty responses: no tokens, but verl still counts them in the group statistics
    mask = torch.arange(T)[None, :] < lengths[:, None]
    attention = torch.cat([torch.ones(b, P, dtype=torch.long), mask.long()], dim=1)
    index = np.array([f"uid-{i:05d}" for i in gid.tolist()], dtype=object)
    weights = [1.0, 0.5, 2.0][:k]
    return {"comps": comps, "mask": mask, "attention": attention, "index": index, "ids": gid, "weights": weights}


def verl_gdpo(batch: dict[str, Any], weights: list[float] | None) -> torch.Tensor:
    assert core_algos is not None
    keys = [f"r{j}" for j in range(batch["comps"].shape[1])]
    config: dict[str, Any] = {"gdpo_reward_keys": keys}
    if weights is not None:
        config["gdpo_reward_weights"] = weights
    b = batch["comps"].shape[0]
    adv, ret = core_algos.compute_gdpo_outcome_advantage(
        token_level_rewards=torch.zeros(b, T),
        response_mask=batch["mask"].float(),
        index=batch["index"],
        config=config,
        non_tensor_batch={key: batch["comps"][:, j].numpy() for j, key in enumerate(keys)},
        batch={"prompts": torch.zeros(b, P, dtype=torch.long), "attention_mask": batch["attention"]},
    )
    assert torch.equal(adv, ret)
    return adv  # type: ignore[no-any-return]


@pytest.mark.verl
@needs_verl
def test_verl_registers_gdpo() -> None:
    assert core_algos is not None
    assert core_algos.get_adv_estimator_fn("gdpo") is core_algos.compute_gdpo_outcome_advantage


@pytest.mark.verl
@needs_verl
@pytest.mark.parametrize("case", ["equal", "ragged"])
@pytest.mark.parametrize(("k", "binary"), [(2, True), (2, False), (3, False), (1, False)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("weighted", [True, False])
def test_gdpo_matches_verl(case: str, k: int, binary: bool, seed: int, weighted: bool) -> None:
    batch = make_verl(seed, case, k, binary)
    weights = batch["weights"] if weighted else None
    theirs = verl_gdpo(batch, weights)
    ours = gdpo(batch["comps"], batch["ids"], weights=weights, final="token", mask=batch["mask"], singleton="raw")
    assert ours.advantages.shape == theirs.shape
    torch.testing.assert_close(ours.advantages, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.verl
@needs_verl
def test_verl_fallback_without_keys_is_k1() -> None:
    assert core_algos is not None
    batch = make_verl(3, "ragged", 1, False)
    b = batch["comps"].shape[0]
    tlr = torch.zeros(b, T)
    tlr[:, 0] = batch["comps"][:, 0]
    adv, _ = core_algos.compute_gdpo_outcome_advantage(
        token_level_rewards=tlr, response_mask=batch["mask"].float(), index=batch["index"]
    )
    ours = gdpo(batch["comps"], batch["ids"], final="token", mask=batch["mask"], singleton="raw")
    torch.testing.assert_close(ours.advantages, adv, atol=1e-5, rtol=1e-5)


@pytest.mark.verl
@needs_verl
def test_verl_differences_are_pinned() -> None:
    # one masked-in token: verl's masked_var raises; we return 0
    batch = make_verl(0, "equal", 2, True)
    batch["mask"] = torch.zeros_like(batch["mask"])
    batch["mask"][5, 0] = True
    batch["attention"] = torch.cat([batch["attention"][:, :P], batch["mask"].long()], dim=1)
    with pytest.raises(ValueError, match="sum of the mask is one"):
        verl_gdpo(batch, None)
    ours = gdpo(batch["comps"], batch["ids"], final="token", mask=batch["mask"], singleton="raw")
    assert torch.equal(ours.advantages, torch.zeros_like(ours.advantages))
    # singletons: verl keeps r / (1 + eps) per component; our default gives the rollout 0
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [3.0, 2.0]])
    ids = torch.tensor([0, 0, 0, 7])
    single: dict[str, Any] = {
        "comps": comps,
        "mask": torch.ones(4, T, dtype=torch.bool),
        "attention": torch.ones(4, P + T, dtype=torch.long),
        "index": np.array(["a", "a", "a", "b"], dtype=object),
    }
    theirs = verl_gdpo(single, None)
    assert theirs[3].abs().min() > 0.1
    ours_default = gdpo(comps, ids, final="token", mask=single["mask"]).advantages
    assert torch.equal(ours_default[3], torch.zeros(T))
    raw = gdpo(comps, ids, final="token", mask=single["mask"], singleton="raw")
    torch.testing.assert_close(raw.advantages, theirs, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- TRL

START = 'if self.multi_objective_aggregation == "sum_then_normalize":'
END = "advantages = torch.nan_to_num(advantages, nan=0.0)"
EXPECTED = [
    'elif self.multi_objective_aggregation == "normalize_then_sum":',
    "grouped = rewards_per_func.view(-1, num_generations, len(self.reward_funcs))",
    "mean_k = torch.nanmean(grouped, dim=1, keepdim=True)",
    "std_k = nanstd(grouped, dim=1, keepdim=True)",
    "reward_k = (grouped - mean_k) / (std_k + 1e-4)",
    "rewards = (reward_k * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)",
    "rewards[unscorable_mask] = torch.nan",
    "std_rewards = nanstd(rewards).expand_as(rewards)",
    "advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)",
]


def trl_block() -> str:
    assert trl_grpo is not None
    src = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions)
    lines = src.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == START)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == END)
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def trl_gdpo(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    assert trl_grpo is not None
    namespace: dict[str, Any] = dict(vars(trl_grpo))
    namespace.update(
        self=SimpleNamespace(
            multi_objective_aggregation="normalize_then_sum",
            scale_rewards="group",
            reward_weights=weights,
            reward_funcs=[None] * len(weights),
        ),
        rewards_per_func=rewards_per_func,
        unscorable_mask=torch.isnan(rewards_per_func).all(dim=1),  # TRL's line just above the block
        num_generations=num_generations,
        device=torch.device("cpu"),
    )
    exec(compile(trl_block(), "<trl gdpo>", "exec"), namespace)
    return namespace["advantages"]  # type: ignore[no-any-return]


@pytest.mark.trl
@needs_trl
def test_trl_block_still_holds_gdpo() -> None:
    block = trl_block()
    for expr in EXPECTED:
        assert expr in block, f"TRL's GDPO block changed: {expr!r} not found"
    compile(block, "<trl gdpo>", "exec")


def make_trl(seed: int, groups: int, n: int, k: int, binary: bool, missing: float, unscorable: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    b = groups * n
    per_func = (torch.rand(b, k, generator=gen) > 0.5).float() if binary else torch.randn(b, k, generator=gen) * 2
    per_func[torch.rand(b, k, generator=gen) < missing] = math.nan  # one function returned None for this row
    per_func[torch.rand(b, generator=gen) < unscorable] = math.nan  # every function returned None
    return per_func


@pytest.mark.trl
@needs_trl
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize(
    ("k", "binary", "missing", "unscorable"),
    [(2, True, 0.0, 0.0), (2, False, 0.0, 0.0), (3, False, 0.2, 0.0), (2, True, 0.2, 0.25), (1, False, 0.0, 0.0)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_gdpo_matches_trl(n: int, k: int, binary: bool, missing: float, unscorable: float, seed: int) -> None:
    per_func = make_trl(seed, 10, n, k, binary, missing, unscorable)
    weights = torch.tensor([1.0, 0.5, 2.0][:k])
    theirs = trl_gdpo(per_func.clone(), weights, n)
    ids = torch.arange(len(per_func)) // n  # consecutive blocks of num_generations
    valid = ~per_func.isnan()
    ours = gdpo(per_func, ids, weights=weights, valid=valid)
    torch.testing.assert_close(ours.advantages, theirs, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.weight, valid.any(1).float())
    # the same on shuffled rows with relabelled ids (TRL can only take consecutive blocks)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    moved = gdpo(per_func[perm], ids[perm] * 7919 - 3, weights=weights, valid=valid[perm])
    torch.testing.assert_close(moved.advantages, theirs[perm], atol=1e-5, rtol=1e-5)


@pytest.mark.trl
@needs_trl
def test_trl_zero_variance_and_unscorable_groups() -> None:
    nan = math.nan
    per_func = torch.tensor(
        [[0.1, 1.0], [0.1, 1.0], [0.1, 1.0], [0.1, 1.0]]  # all equal
        + [[2.0, nan], [nan, nan], [nan, nan], [nan, nan]]  # one scorable row
        + [[nan, nan]] * 4  # nothing scorable
        + [[1.0, 0.0], [0.0, 3.0], [0.0, nan], [3.0, 1.0]]
    )
    theirs = trl_gdpo(per_func.clone(), torch.ones(2), 4)
    ours = gdpo(per_func, torch.arange(16) // 4, valid=~per_func.isnan())
    torch.testing.assert_close(ours.advantages, theirs, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours.advantages[:12], torch.zeros(12))
