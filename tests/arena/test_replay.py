"""The arena's response store: AR3PO's reused rows and DOTS's replayed groups come back from the steps that
generated them, by hand; a real AR3PO or DOTS run trains on them; an allocator without stored responses gets
nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rolloutopt.allocators import AllocationResult
from rolloutopt.allocators.ar3po import ReusedResponses, response_key
from rolloutopt.allocators.dots import ReplayedGroups
from rolloutopt.arena import TaskSuite
from rolloutopt.arena.base import BaseConfig
from rolloutopt.arena.replay import ResponseStore, cat_rolls
from rolloutopt.arena.run import RunSpec, run
from rolloutopt.testbed.policy import Rollouts
from rolloutopt.testbed.task import PAD

SUITE = TaskSuite(ops=("reverse", "count"), lengths=(("reverse", (1, 2, 3)), ("count", (2, 3))), per_cell=12, holdout=3)
BASE = BaseConfig(hidden=16, steps=30, batch_size=16)


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("ROLLOUTOPT_CACHE", str(tmp_path_factory.getbasetemp() / "arena-cache"))


def roll(lengths: list[int], base: int) -> Rollouts:
    """Rows whose tokens are ``base + row`` repeated ``lengths[row]`` times, log-prob ``-(base + row) / 100``."""
    t = max(lengths)
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    val = (base + torch.arange(len(lengths)))[:, None].expand(-1, t)
    return Rollouts(tokens=torch.where(mask, val, PAD), mask=mask, logp=torch.where(mask, -val / 100.0, 0.0),
                    entropy=mask.float())  # fmt: skip


def result(rewards: list[float], group: list[int], weight: list[float], plan_ids: list[int]) -> AllocationResult:
    return AllocationResult(
        prompt_ids=torch.tensor(plan_ids)[torch.tensor(group)], group=torch.tensor(group),
        rewards=torch.tensor(rewards), weight=torch.tensor(weight), plan_prompt_ids=torch.tensor(plan_ids),
        counts=torch.bincount(torch.tensor(group), minlength=len(plan_ids)), reasons=torch.zeros(len(plan_ids),
        dtype=torch.long), reason_names=("x",),
    )  # fmt: skip


@dataclass
class AR3POLike:
    got: ReusedResponses

    def reused(self) -> ReusedResponses:
        return self.got


@dataclass
class DOTSLike:
    got: ReplayedGroups

    def replayed(self) -> ReplayedGroups:
        return self.got


def test_the_store_returns_the_rows_a_plan_reuses_by_hand() -> None:
    """Step 0 generated prompts 7, 7, 9 (rows 0-2), step 1 prompts 9, 7 (rows 0-1). AR3PO reuses step 0's row 2
    (prompt 9) as row 3 of a result: that row's tokens (12, twice), log-prob -0.12 and the result's reward, group and
    weight. DOTS replays step 0's group of prompt 7 (indices 1 then 0: rows 1 and 0) and step 1's of prompt 9
    (index 0: row 0): new groups after the result's 2 planned prompts, DOTS's stored rewards, weight 1."""
    store = ResponseStore()
    store.add(0, torch.tensor([7, 7, 9]), roll([1, 3, 2], 10), torch.zeros(3, 3, dtype=torch.long))
    store.add(1, torch.tensor([9, 7]), roll([4, 1], 20), torch.ones(2, 4, dtype=torch.long))
    res = result([1.0, 0.0, 1.0, 0.5], [0, 0, 1, 1], [1.0, 1.0, 1.0, 0.7], [7, 9])
    keys = response_key(0, torch.tensor([2]))
    got = store.reused(AR3POLike(ReusedResponses(torch.tensor([3]), torch.tensor([9]), keys)), res)
    assert got is not None and got.ids.tolist() == [9] and got.roll.tokens[got.roll.mask].tolist() == [12, 12]
    assert got.roll.logp[got.roll.mask].tolist() == pytest.approx([-0.12, -0.12]) and got.rewards.tolist() == [0.5]
    assert got.group.tolist() == [1] and got.weight.tolist() == pytest.approx([0.7])
    rep = ReplayedGroups(keys=torch.tensor([4, 5]), prompt_ids=torch.tensor([7, 9]), steps=torch.tensor([0, 1]),
                         counts=torch.tensor([2, 1]), group=torch.tensor([0, 0, 1]), index=torch.tensor([1, 0, 0]),
                         rewards=torch.tensor([0.0, 1.0, 1.0]))  # fmt: skip
    got = store.reused(DOTSLike(rep), res)
    assert got is not None and got.ids.tolist() == [7, 7, 9]
    assert got.roll.tokens[:, 0].tolist() == [11, 10, 20] and got.roll.mask.sum(1).tolist() == [3, 1, 4]
    assert (
        got.group.tolist() == [2, 2, 3] and got.rewards.tolist() == [0.0, 1.0, 1.0] and got.weight.tolist() == [1] * 3
    )
    assert got.versions[:, 0].tolist() == [0, 0, 1]
    assert store.reused(object(), res) is None
    none = ReusedResponses(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                           torch.zeros(0, dtype=torch.long))  # fmt: skip
    assert store.reused(AR3POLike(none), res) is None


def test_cat_rolls_pads_to_the_widest() -> None:
    both = cat_rolls([roll([1], 1), roll([3, 2], 5)])
    assert both.tokens.tolist() == [[1, PAD, PAD], [5, 5, 5], [6, 6, PAD]] and both.topk_ids is None
    assert both.mask.sum().item() == 6 and both.logp[0, 1:].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("name", ["ar3po", "dots"])
def test_a_run_trains_on_the_stored_responses(name: str, tmp_path: Path) -> None:
    """DOTS replays groups from its third step on (two warm-up updates), AR3PO reuses a stored correct response for
    a prompt whose group failed: the step records the rows trained again; an allocator without a store none."""
    spec = RunSpec("allocator", name, steps=6, prompts_per_step=4, group_size=4, pool=8, eval_every=6)
    steps = run(spec, SUITE, BASE)["steps"]
    assert sum(s["reused_rows"] for s in steps) > 0
    if name == "dots":
        assert [s["reused_rows"] for s in steps[:2]] == [0.0, 0.0]
    plain = run(RunSpec("allocator", "uniform", steps=2, prompts_per_step=4, group_size=4, eval_every=2), SUITE, BASE)
    assert [s["reused_rows"] for s in plain["steps"]] == [0.0, 0.0]
