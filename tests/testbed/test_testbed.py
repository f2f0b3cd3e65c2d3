"""Tests of the testbed: task reward, sampler convention, determinism, and that GRPO training improves reward."""

from __future__ import annotations

import math

import pytest
import torch

import rolloutopt
from rolloutopt.testbed import ReverseTask, TinyPolicy, TrainConfig, decode, encode, train
from rolloutopt.testbed.task import BOS, EOS, PAD, SEP


def _row(*tokens: int, width: int = 5) -> tuple[list[int], list[bool]]:
    toks = list(tokens) + [PAD] * (width - len(tokens))
    return toks, [True] * len(tokens) + [False] * (width - len(tokens))


def test_prompts_and_targets() -> None:
    task = ReverseTask(length=3, holdout=10)
    ids = torch.tensor([123, 7])
    assert task.prompts(ids).tolist() == [[BOS, 1, 2, 3, SEP], [BOS, 0, 0, 7, SEP]]
    assert task.targets(ids).tolist() == [[3, 2, 1], [7, 0, 0]]
    assert decode(task.prompts(ids)[0]) == "<bos>123="
    assert encode("321") == [3, 2, 1]
    train_ids, eval_ids = task.split()
    assert eval_ids.numel() == 10 and train_ids.numel() == 990
    assert set(train_ids.tolist()).isdisjoint(eval_ids.tolist())


def test_reward_hand_checked() -> None:
    task = ReverseTask(length=3, holdout=0)
    rows = [
        _row(3, 2, 1, EOS),  # correct: 1
        _row(3, 2, 9, EOS),  # two of three: 2/3
        _row(3, EOS),  # short answer: 1/3
        _row(3, 2, 1, 5, EOS),  # too long: 3 hits / 4
        _row(EOS),  # empty: 0
        _row(3, 2, 1, 4, 4),  # no <eos>, cut off: 3/5
        _row(1, 2, 3, EOS),  # the prompt copied, not reversed: middle digit only
    ]
    tokens = torch.tensor([r[0] for r in rows])
    mask = torch.tensor([r[1] for r in rows])
    ids = torch.full((len(rows),), 123)
    got = task.reward(ids, tokens, mask)
    expected = torch.tensor([1.0, 2 / 3, 1 / 3, 3 / 4, 0.0, 3 / 5, 1 / 3])
    torch.testing.assert_close(got, expected)


def test_reward_ignores_masked_tokens() -> None:
    task = ReverseTask(length=2, holdout=0)
    tokens = torch.tensor([[5, 4, EOS, 4]])
    mask = torch.tensor([[True, False, False, False]])  # only "5" counts: 1 hit of 2
    assert task.reward(torch.tensor([45]), tokens, mask).tolist() == [0.5]


@pytest.mark.parametrize("arch", ["gru", "transformer"])
def test_sampler_convention_and_logp_consistency(arch: str) -> None:
    task = ReverseTask(length=3, holdout=0)
    policy = TinyPolicy(32, arch=arch, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(0, 1000, 37)
    prompts = task.prompts(ids)
    roll = policy.sample(prompts, 5, temperature=1.3, generator=torch.Generator().manual_seed(2))
    b, t = roll.tokens.shape
    assert b == ids.numel() and 1 <= t <= 5
    assert roll.mask.dtype == torch.bool and roll.tokens.dtype == torch.int64
    assert roll.logp.shape == roll.entropy.shape == (b, t)
    # Right-padded: once a row's mask is False it stays False, and the last masked token is <eos> or the cap.
    m = roll.mask.int()
    assert bool((m[:, 1:] <= m[:, :-1]).all())
    assert bool(roll.mask[:, 0].all())
    assert bool((roll.tokens[~roll.mask] == PAD).all())
    lengths = roll.mask.sum(1)
    last = roll.tokens.gather(1, (lengths - 1)[:, None]).squeeze(1)
    assert bool(((last == EOS) | (lengths == 5)).all())
    assert bool((roll.logp[~roll.mask] == 0).all()) and bool((roll.logp[roll.mask] <= 0).all())
    # Log-probs and entropies equal the teacher-forced recomputation of the policy.
    logp, ent = policy.log_probs(prompts, roll.tokens, temperature=1.3)
    torch.testing.assert_close(logp[roll.mask], roll.logp[roll.mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[roll.mask], roll.entropy[roll.mask], atol=1e-5, rtol=1e-5)
    assert logp.requires_grad


def test_greedy_is_argmax() -> None:
    task = ReverseTask(length=2, holdout=0)
    policy = TinyPolicy(16, generator=torch.Generator().manual_seed(3))
    prompts = task.prompts(torch.arange(10))
    a = policy.sample(prompts, 4, temperature=0.0, generator=torch.Generator().manual_seed(0))
    b = policy.sample(prompts, 4, temperature=0.0, generator=torch.Generator().manual_seed(99))
    assert torch.equal(a.tokens, b.tokens)
    logits, _ = policy(prompts)
    assert torch.equal(a.tokens[:, 0], logits[:, -1].argmax(-1))


def test_init_and_sampling_do_not_touch_global_rng() -> None:
    state = torch.random.get_rng_state()
    policy = TinyPolicy(16, arch="transformer", generator=torch.Generator().manual_seed(0))
    policy.sample(ReverseTask(2, 0).prompts(torch.arange(4)), 3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(state, torch.random.get_rng_state())


def _tiny(**kw: object) -> TrainConfig:
    base: dict[str, object] = {
        "steps": 4,
        "prompts_per_step": 4,
        "group_size": 4,
        "hidden": 16,
        "length": 2,
        "holdout": 10,
        "eval_samples": 1,
    }
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def test_training_is_deterministic_for_a_seed() -> None:
    a, b, c = train(_tiny(seed=5)), train(_tiny(seed=5)), train(_tiny(seed=6))
    assert a.rewards == b.rewards and a.tokens == b.tokens
    assert a.steps[-1].metrics == b.steps[-1].metrics
    for pa, pb in zip(a.policy.parameters(), b.policy.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert (a.rewards, a.tokens) != (c.rewards, c.tokens)


def test_short_run_exercises_the_grpo_pipeline() -> None:
    seen: list[int] = []
    result = train(_tiny(steps=3, inner_steps=3), callback=lambda rec: seen.append(rec.step))
    assert seen == [0, 1, 2] and len(result.steps) == 3
    assert result.rollouts == 3 * 4 * 4
    assert result.tokens == sum(s.tokens for s in result.steps) > 0
    for rec in result.steps:
        for key in ("loss", "pg_loss", "clipfrac", "ratio_mean", "approx_kl", "entropy", "grad_norm"):
            assert math.isfinite(rec.metrics[key]), key
        assert 0.0 <= rec.reward <= 1.0
    # The first inner step is on-policy (ratio 1); later ones move the policy.
    assert result.steps[0].metrics["ratio_mean"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("loss", ["dapo", "cispo"])
def test_other_presets_run(loss: str) -> None:
    result = train(_tiny(steps=2, loss=loss))
    assert all(math.isfinite(s.metrics["loss"]) for s in result.steps)


def test_grpo_improves_reward() -> None:
    """The claim of the demo, on a smaller instance: RL alone takes reward from near chance to high."""
    cfg = TrainConfig(steps=60, prompts_per_step=16, group_size=8, length=3, holdout=200, eval_samples=2, seed=0)
    result = train(cfg)
    assert result.window("first", 5) < 0.2
    assert result.window("last", 5) > 0.7
    assert result.eval_after.greedy_reward > result.eval_before.greedy_reward + 0.5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("group_size", 1),
        ("steps", 0),
        ("prompts_per_step", 0),
        ("inner_steps", 0),
        ("lr", 0.0),
        ("temperature", float("nan")),
        ("length", 0),
        ("holdout", 10**6),
        ("arch", "lstm"),
    ],
)
def test_bad_config_raises(field: str, value: object) -> None:
    with pytest.raises(rolloutopt.InputError, match=field):
        TrainConfig(**{field: value})  # type: ignore[arg-type]


def test_bad_inputs_raise() -> None:
    with pytest.raises(rolloutopt.InputError):
        train(_tiny(loss="no-such-preset"))
    policy = TinyPolicy(8)
    prompts = ReverseTask(2, 0).prompts(torch.arange(3))
    with pytest.raises(rolloutopt.InputError, match="temperature"):
        policy.sample(prompts, 3, temperature=-1.0, generator=torch.Generator())
    with pytest.raises(rolloutopt.InputError, match="max_new_tokens"):
        policy.sample(prompts, 0, generator=torch.Generator())
    with pytest.raises(rolloutopt.InputError, match="prompts"):
        policy.sample(prompts.float(), 3, generator=torch.Generator())
    with pytest.raises(rolloutopt.InputError):
        ReverseTask(2, 0).reward(torch.arange(3), torch.zeros(3, 4, dtype=torch.int64), torch.ones(3, 5))
    with pytest.raises(rolloutopt.InputError):
        encode("12a")
