"""Partial-rollout buffers in the arena: a round in decoding ticks by hand (APRIL and CoPRIS), the batch of a real
round (prefixes resumed by the policy, versions, behaviour log-probs, nothing lost), and bad inputs."""

from __future__ import annotations

import pytest
import torch

from rolloutopt.arena import TaskSuite
from rolloutopt.arena.base import BaseConfig, base_policy
from rolloutopt.arena.buffers import BufferedEngine, Segment, drive_round, make_scheduler
from rolloutopt.control import APRILBuffer, CoPRISScheduler, Requests
from rolloutopt.errors import InputError
from rolloutopt.testbed.engine import ScenarioEngine
from rolloutopt.testbed.train import Scenario

SUITE = TaskSuite(ops=("reverse", "count"), lengths=(("reverse", (1, 2, 3)), ("count", (2, 3))), per_cell=12, holdout=3)
BASE = BaseConfig(hidden=16, steps=30, batch_size=16)


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("ROLLOUTOPT_CACHE", str(tmp_path_factory.getbasetemp() / "arena-cache"))


def scripted(lengths: dict[tuple[int, int, int], int]) -> tuple[list[list[int]], object]:
    """A generator of segments whose length is ``lengths[(prompt, sample, prefix length)]`` (tokens 1, 2, ...,
    log-prob -0.5 each, reward 1 for prompt 100), recording each start's prompts."""
    starts: list[list[int]] = []

    def generate(reqs: Requests) -> list[Segment]:
        starts.append(reqs.prompt_ids.tolist())
        out = []
        for p, s, pre in zip(reqs.prompt_ids.tolist(), reqs.sample.tolist(), reqs.prefix, strict=True):
            m = lengths[(p, s, pre.numel())]
            out.append(Segment(torch.arange(1, m + 1), torch.full((m,), -0.5), float(p == 100), {}))
        return out

    return starts, generate


def test_an_april_round_in_ticks_by_hand() -> None:
    """APRIL, 1 group per batch, 2 submitted, 2 samples. Round 0 (version 0): prompt 200's samples take 2 and 8
    tokens, prompt 100's 3 and 5; all four start at tick 0, finish at 2, 3, 5: group 100 is complete at tick 5
    (the stop event), 200's second sample is aborted with 5 of its 8 tokens. Generated: 2 + 3 + 5 + 5 = 15.
    Round 1 (version 1): the buffered group 200 goes first (its unfinished sample resumes after its 5 tokens and
    takes 3 more), then fresh prompt 300 (4 and 6 tokens): at tick 3 group 200 is complete, 300's samples are
    aborted with 3 tokens each; its batch is group 200, the resumed sample's tokens of version 0 then 1."""
    sched = APRILBuffer(rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=2, max_new_tokens=10)
    starts, gen = scripted({(100, 0, 0): 3, (100, 1, 0): 5, (200, 0, 0): 2, (200, 1, 0): 8, (200, 1, 5): 3,
                            (300, 0, 0): 4, (300, 1, 0): 6})  # fmt: skip
    r0 = drive_round(sched, torch.tensor([100, 200]), 0, gen)  # type: ignore[arg-type]
    assert starts == [[100, 100, 200, 200]] and r0.ticks == 5 and r0.generated == 15
    b = r0.result.batch
    assert b.prompt_ids.tolist() == [100, 100] and b.lengths.tolist() == [3, 5] and b.rewards.tolist() == [1.0, 1.0]
    assert r0.result.metrics["aborted_requests"] == 1
    r1 = drive_round(sched, torch.tensor([300, 400]), 1, gen)  # type: ignore[arg-type]
    assert starts[1] == [200, 300, 300] and r1.ticks == 3 and r1.generated == 3 + 3 + 3
    b = r1.result.batch
    assert b.prompt_ids.tolist() == [200, 200] and b.lengths.tolist() == [2, 8]
    assert b.versions[1, :8].tolist() == [0] * 5 + [1] * 3 and b.versions[0, :2].tolist() == [0, 0]
    assert r1.result.unused_prompts.tolist() == [400]
    assert r1.result.metrics["off_policy_fraction"] == pytest.approx(7 / 10)  # 2 + 5 of the 10 tokens are version 0


def test_a_copris_round_keeps_the_pool_full() -> None:
    """CoPRIS, 1 kept group ends a round, 2 requests in flight, 2 samples, gen batch of 2 prompts. Tick 0 starts
    100/0 (1 token) and 100/1 (4); at tick 1 200/0 (2 tokens) replaces 100/0; at 3 200/1 (6) replaces 200/0; at 4
    100/1 finishes: group 100 is kept, the stop event, 200/1 is aborted after 1 token and goes to the front of the
    queue."""
    sched = CoPRISScheduler(train_batch_size=1, gen_batch_size=2, n_samples_per_prompt=2, pool_size=2,
                            max_new_tokens=10)  # fmt: skip
    starts, gen = scripted({(100, 0, 0): 1, (100, 1, 0): 4, (200, 0, 0): 2, (200, 1, 0): 6})
    r = drive_round(sched, torch.tensor([100, 200]), 0, gen)  # type: ignore[arg-type]
    assert starts == [[100, 100], [200], [200]] and r.ticks == 4 and r.generated == 1 + 4 + 2 + 1
    assert r.result.batch.prompt_ids.tolist() == [100, 100]
    assert len(sched.queued_ids()) == 1 and len(sched.held_ids()) == 2


def test_a_generator_that_breaks_the_contract_is_refused() -> None:
    sched = APRILBuffer(rollout_batch_size=1, over_sampling_batch_size=1, n_samples_per_prompt=1, max_new_tokens=2)
    with pytest.raises(InputError, match="generate"):
        drive_round(sched, torch.tensor([1]), 0, lambda reqs: [])
    sched = APRILBuffer(rollout_batch_size=1, over_sampling_batch_size=1, n_samples_per_prompt=1, max_new_tokens=2)
    long = Segment(torch.arange(3), torch.zeros(3), 0.0, {})
    with pytest.raises(InputError, match="at most 2"):
        drive_round(sched, torch.tensor([1]), 0, lambda reqs: [long])
    with pytest.raises(InputError, match="kind"):
        make_scheduler("slime", groups=1, group_size=1, response_limit=4)


@pytest.mark.parametrize("kind", ["april", "copris"])
def test_real_rounds_resume_prefixes_and_lose_nothing(kind: str) -> None:
    """Three rounds with the base policy: each batch holds whole groups (4 of 4 samples), every row's tokens are its
    whole response with its reward, the versions never exceed the round's and are older only on a resumed prefix,
    the behaviour log-probs of each version's tokens are those of the policy that generated them (one policy here,
    so the policy's own log-probs), and every generated token is in a batch or still held by the scheduler."""
    policy = base_policy(SUITE, BASE)
    scen = ScenarioEngine(Scenario(0.0, 0, False, ()), generator=torch.Generator().manual_seed(0))
    eng = BufferedEngine(kind, SUITE, scen, groups=3, group_size=4)
    train, _ = SUITE.split()
    gen = torch.Generator().manual_seed(1)
    trained = generated = 0
    for version in range(3):
        scen.advance(policy, version)
        out = eng.step(policy, train[version * 6 : version * 6 + eng.fresh], version, gen)
        generated += out["generated"]
        roll = out["roll"]
        assert roll is not None and roll.tokens.shape[0] == 12 and out["group"].bincount().tolist() == [4, 4, 4]
        assert torch.equal(out["rewards"], SUITE.reward(out["ids"], roll.tokens, roll.mask))
        m = roll.mask
        assert bool((out["versions"][m] <= version).all())
        with torch.no_grad():
            logp, _ = policy.log_probs(SUITE.prompts(out["ids"]), roll.tokens)
        torch.testing.assert_close(roll.logp[m], logp[m], atol=1e-5, rtol=1e-5)
        assert roll.entropy.shape == m.shape and bool((roll.entropy[m] >= 0).all())
        trained += int(m.sum())
    held = sum(int(r.numel()) for r in [eng.sched._rollouts[i].tokens for i in eng.sched.held_ids().tolist()])
    assert generated == trained + held
    assert set(eng.kept) <= set(eng.sched.held_ids().tolist())
