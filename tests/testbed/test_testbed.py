"""Tests of the testbed: task reward, sampler convention, determinism, that GRPO training improves reward, and
the simulated rollout engines (mismatch, staleness, partial rollouts, top-K) that feed every loss preset."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

import rolloutopt
from rolloutopt import losses
from rolloutopt.losses import KL, Preset
from rolloutopt.ratios import StageContext, tail_confidence
from rolloutopt.registry import Registry
from rolloutopt.testbed import ReverseTask, TinyPolicy, TrainConfig, decode, encode, train
from rolloutopt.testbed.policy import sample_from
from rolloutopt.testbed.task import BOS, EOS, PAD, SEP, VOCAB_SIZE
from rolloutopt.testbed.train import MISMATCH, STALENESS, SUPPLIED_INPUTS, scenario


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


# --------------------------------------------------------------------------------------------- the default run


def test_default_run_repeats_the_numbers_of_the_code_before_presets_got_inputs() -> None:
    """``train(TrainConfig(steps=3))`` (the demo's settings, seed 0, one thread), recorded from the loop before it
    learnt to feed every preset: the plain grpo path must not change by a single sample."""
    result = train(TrainConfig(steps=3))
    assert result.rewards == pytest.approx([0.0462239608168602, 0.0611979141831398, 0.05091145634651184], abs=1e-9)
    assert result.tokens == 2057
    losses_seen = [s.metrics["loss"] for s in result.steps]
    assert losses_seen == pytest.approx([0.001559416763484478, -0.010451124981045723, -0.008178381249308586], rel=1e-5)
    b, a = result.eval_before, result.eval_after
    assert (b.greedy_accuracy, a.greedy_accuracy) == (0.0, 0.0)
    assert (b.greedy_reward, b.sampled_reward) == pytest.approx((0.06816667318344116, 0.04452500119805336), abs=1e-7)
    assert (a.greedy_reward, a.sampled_reward) == pytest.approx((0.06599999964237213, 0.06425833702087402), abs=1e-7)
    assert not result.scenario.simulated and result.scenario.inputs == ()


# ------------------------------------------------------------------------------------------ sampling engines


def _policies(arch: str, n: int = 2, hidden: int = 16) -> list[TinyPolicy]:
    return [TinyPolicy(hidden, arch=arch, generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]


@pytest.mark.parametrize("arch", ["gru", "transformer"])
def test_sample_from_one_policy_is_the_method(arch: str) -> None:
    (policy,) = _policies(arch, 1)
    prompts = ReverseTask(3, 0).prompts(torch.arange(0, 1000, 53))
    a = policy.sample(prompts, 5, temperature=1.2, generator=torch.Generator().manual_seed(4))
    b = sample_from([policy], prompts, 5, temperature=1.2, generator=torch.Generator().manual_seed(4))
    for x, y in ((a.tokens, b.tokens), (a.mask, b.mask), (a.logp, b.logp), (a.entropy, b.entropy)):
        assert torch.equal(x, y)
    assert a.topk_ids is None and a.topk_logp is None


@pytest.mark.parametrize("arch", ["gru", "transformer"])
def test_sample_from_switches_policy_per_token(arch: str) -> None:
    """Each token's log-prob is that of the policy ``source`` names at its position: teacher-forcing the sampled
    text through both policies and selecting by ``source`` gives the sampler's log-probs and entropies."""
    p0, p1 = _policies(arch)
    prompts = ReverseTask(3, 0).prompts(torch.arange(0, 1000, 41))
    b, width = prompts.shape[0], 5
    source = (torch.arange(width)[None, :] >= torch.arange(b)[:, None] % (width + 1)).long()  # switch at row % 6
    roll = sample_from(
        [p0, p1], prompts, width, temperature=1.0, generator=torch.Generator().manual_seed(5), source=source
    )
    t = roll.tokens.shape[1]
    with torch.no_grad():
        lp0, ent0 = p0.log_probs(prompts, roll.tokens)
        lp1, ent1 = p1.log_probs(prompts, roll.tokens)
    use1 = source[:, :t].bool()
    m = roll.mask
    torch.testing.assert_close(torch.where(use1, lp1, lp0)[m], roll.logp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.where(use1, ent1, ent0)[m], roll.entropy[m], atol=1e-5, rtol=1e-5)
    # All-0 / all-1 sources are the single policies with the same random stream.
    for j, p in enumerate((p0, p1)):
        one = p.sample(prompts, width, generator=torch.Generator().manual_seed(5))
        both = sample_from(
            [p0, p1], prompts, width, generator=torch.Generator().manual_seed(5), source=torch.full((b, width), j)
        )
        assert torch.equal(one.tokens, both.tokens)
        torch.testing.assert_close(one.logp, both.logp, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["gru", "transformer"])
def test_sample_from_continues_a_prefix(arch: str) -> None:
    """Forcing each row's first tokens of a sample (fewer than it has, so never its <eos>) and sampling on with the
    same generator gives that very sample back (forced positions consume their draw), log-probs and top-K too; a
    row without prefix is sampled as without any."""
    (policy,) = _policies(arch, 1)
    prompts = ReverseTask(3, 0).prompts(torch.arange(0, 1000, 37))
    full = sample_from([policy], prompts, 6, temperature=1.3, generator=torch.Generator().manual_seed(8), topk=3)
    lengths = full.mask.sum(1)
    plen = torch.minimum(torch.arange(prompts.shape[0]) % 4, lengths - 1)
    assert int(plen.max()) > 0 and int(plen.min()) == 0
    prefix = torch.where(full.mask, full.tokens, PAD)[:, : int(plen.max())]
    again = sample_from([policy], prompts, 6, temperature=1.3, generator=torch.Generator().manual_seed(8), topk=3,
                        prefix=prefix, prefix_len=plen)  # fmt: skip
    assert torch.equal(again.tokens, full.tokens) and torch.equal(again.mask, full.mask)
    torch.testing.assert_close(again.logp, full.logp, atol=1e-6, rtol=1e-6)
    assert again.topk_ids is not None and full.topk_ids is not None and torch.equal(again.topk_ids, full.topk_ids)
    # a different continuation after the same prefix: the prefix is kept, the rest is drawn anew
    other = sample_from([policy], prompts, 6, temperature=1.3, generator=torch.Generator().manual_seed(9),
                        prefix=prefix, prefix_len=plen)  # fmt: skip
    forced = torch.arange(prefix.shape[1])[None, :] < plen[:, None]
    assert torch.equal(other.tokens[:, : prefix.shape[1]][forced], prefix[forced])


def test_sample_from_refuses_a_bad_prefix() -> None:
    (policy,) = _policies("transformer", 1)
    prompts = ReverseTask(2, 0).prompts(torch.arange(3))
    gen = torch.Generator()
    two = torch.full((3, 2), 1, dtype=torch.int64)
    bad = [
        ({"prefix": two}, "prefix/prefix_len"),
        ({"prefix": two, "prefix_len": torch.tensor([1, 1])}, "prefix/prefix_len"),
        ({"prefix": two, "prefix_len": torch.tensor([1, 5, 0])}, "prefix/prefix_len"),  # >= max_new_tokens
        ({"prefix": two, "prefix_len": torch.tensor([1, 3, 0])}, "prefix_len"),  # longer than the prefix tensor
        ({"prefix": torch.tensor([[1, EOS]] * 3), "prefix_len": torch.tensor([2, 0, 0])}, "prefix"),
        ({"prefix": two.float(), "prefix_len": torch.tensor([1, 1, 1])}, "prefix/prefix_len"),
    ]
    for kwargs, argument in bad:
        with pytest.raises(rolloutopt.InputError) as err:
            sample_from([policy], prompts, 5, generator=gen, **kwargs)  # type: ignore[arg-type]
        assert err.value.argument == argument, kwargs


def test_sample_from_records_the_top_k() -> None:
    (policy,) = _policies("transformer", 1)
    prompts = ReverseTask(3, 0).prompts(torch.arange(0, 1000, 61))
    roll = policy.sample(prompts, 5, temperature=1.3, generator=torch.Generator().manual_seed(6), topk=4)
    assert roll.topk_ids is not None and roll.topk_logp is not None
    b, t = roll.tokens.shape
    assert roll.topk_ids.shape == roll.topk_logp.shape == (b, t, 4) and roll.topk_ids.dtype == torch.int64
    m = roll.mask
    with torch.no_grad():
        logsm = policy.log_softmax(prompts, roll.tokens, temperature=1.3)
    torch.testing.assert_close(logsm.gather(-1, roll.topk_ids)[m], roll.topk_logp[m], atol=1e-5, rtol=1e-5)
    assert bool((roll.topk_logp[m][:, :-1] >= roll.topk_logp[m][:, 1:]).all())  # most likely first
    assert bool((roll.topk_logp[m].max(-1).values >= roll.logp[m] - 1e-6).all())
    torch.testing.assert_close(roll.topk_logp[m][:, 0], logsm[m].max(-1).values, atol=1e-5, rtol=1e-5)
    assert bool((roll.topk_ids[~m] == PAD).all()) and bool((roll.topk_logp[~m] == 0).all())


def test_sample_from_bad_inputs() -> None:
    p0, p1 = _policies("transformer")
    (g,) = _policies("gru", 1)
    prompts = ReverseTask(2, 0).prompts(torch.arange(3))
    gen = torch.Generator()
    with pytest.raises(rolloutopt.InputError, match="source"):
        sample_from([p0, p1], prompts, 3, generator=gen)
    with pytest.raises(rolloutopt.InputError, match="source"):
        sample_from([p0, p1], prompts, 3, generator=gen, source=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(rolloutopt.InputError, match="source"):
        sample_from([p0, p1], prompts, 3, generator=gen, source=torch.full((3, 3), 2))
    with pytest.raises(rolloutopt.InputError, match="policies"):
        sample_from([p0, g], prompts, 3, generator=gen, source=torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(rolloutopt.InputError, match="policies"):
        sample_from([], prompts, 3, generator=gen)
    for k in (-1, VOCAB_SIZE + 1):
        with pytest.raises(rolloutopt.InputError, match="topk"):
            p0.sample(prompts, 3, generator=gen, topk=k)


def test_perturbed_engine() -> None:
    """Relative weight noise: each tensor moves by about ``scale`` times its RMS; seeded; the original untouched."""
    (policy,) = _policies("transformer", 1, hidden=32)
    before = [p.detach().clone() for p in policy.parameters()]
    same = policy.perturbed(0.0, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), same.parameters(), strict=True))
    a = policy.perturbed(0.1, torch.Generator().manual_seed(1))
    b = policy.perturbed(0.1, torch.Generator().manual_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not any(p.requires_grad for p in a.parameters())
    assert all(torch.equal(x, y) for x, y in zip(before, policy.parameters(), strict=True))
    for (name, w), n in zip(policy.named_parameters(), a.parameters(), strict=True):
        w = w.detach()
        rms = float(w.pow(2).mean().sqrt())
        if w.numel() >= 256 and rms > 0:
            rel = float((n - w).pow(2).mean().sqrt()) / rms
            assert 0.08 < rel < 0.12, name
    with pytest.raises(rolloutopt.InputError, match="scale"):
        policy.perturbed(-0.1, torch.Generator())
    with pytest.raises(rolloutopt.InputError, match="scale"):
        policy.perturbed(float("nan"), torch.Generator())


# ------------------------------------------------------------------------------ scenarios and preset inputs


def test_scenario_defaults_follow_what_each_preset_is_for() -> None:
    none = scenario(TrainConfig())
    assert (none.mismatch, none.staleness, none.partial, none.inputs) == (0.0, 0, False, ())
    assert not none.simulated and none.describe() == ""
    assert scenario(TrainConfig(loss="dr_grpo")).inputs == ("max_len",)
    tis = scenario(TrainConfig(loss="tis"))
    assert (tis.mismatch, tis.staleness, tis.inputs) == (MISMATCH, 0, ("behav_logp",))
    assert tis.describe() == "engine mismatch (weight noise 0.05)"
    sat = scenario(TrainConfig(loss="sat"))
    assert (sat.mismatch, sat.staleness, sat.partial) == (0.0, STALENESS, False)
    assert "behav_logp" in sat.inputs and sat.experimental is not None
    assert sat.describe() == "staleness 2 steps"
    copris = scenario(TrainConfig(loss="copris"))
    assert copris.partial and copris.staleness == STALENESS and {"versions", "behav_logp"} <= set(copris.inputs)
    assert copris.describe() == "partial rollouts, staleness up to 2 steps"
    pred = scenario(TrainConfig(loss="dppo_predictive"))
    assert pred.mismatch == MISMATCH and {"topk_logp", "topk_behav_logp"} <= set(pred.inputs)
    assert scenario(TrainConfig(loss="echo_clip")).inputs == ("confidence",)
    assert scenario(TrainConfig(loss="dppo_tv")).mismatch == MISMATCH
    # Explicit values override; entropy is passed only when the bonus is on.
    off = scenario(TrainConfig(loss="tis", mismatch=0.0, staleness=0))
    assert not off.simulated and off.inputs == ("behav_logp",)
    both = scenario(TrainConfig(loss="grpo", mismatch=0.01, staleness=1))
    assert both.describe() == "engine mismatch (weight noise 0.01), staleness 1 step"
    assert scenario(TrainConfig(entropy_coef=0.01)).inputs == ("entropy",)


@pytest.mark.parametrize("name", losses.names())
def test_every_preset_gets_what_it_requires_and_nothing_it_does_not_consume(name: str) -> None:
    scen = scenario(TrainConfig(loss=name))
    preset = losses.get(name)
    assert set(preset.requires) <= set(scen.inputs) <= set(preset.requires) | set(getattr(preset, "accepts", ()))
    assert set(scen.inputs) <= set(SUPPLIED_INPUTS)
    assert scen.experimental == preset.experimental


@dataclass
class _Probe:
    """A proximal stage that declares inputs and records every context it sees (``old_logp`` passes through)."""

    requires: tuple[str, ...]
    accepts: tuple[str, ...] = ()
    seen: list[StageContext] = field(default_factory=list)

    def __call__(self, ctx: StageContext) -> Tensor:
        self.seen.append(ctx)
        assert ctx.old_logp is not None
        return ctx.old_logp


@pytest.fixture
def probe_preset(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Register a preset around a :class:`_Probe` for one test (the real registry is restored afterwards)."""

    def make(probe: _Probe, name: str = "probe", **config: Any) -> str:
        registry: Registry[Preset] = Registry("loss preset")
        for n in losses.names():
            registry.register(n, losses.get(n))
        registry.register(name, Preset(name, "a test probe", {"proximal": probe, "agg": "token-mean", **config}))
        monkeypatch.setattr(losses, "PRESETS", registry)
        return name

    return make


def _masked(x: Tensor, ctx: StageContext) -> Tensor:
    return x[ctx.mask]


def test_engine_mismatch_feeds_behav_logp(probe_preset: Any) -> None:
    probe = _Probe(requires=("behav_logp",))
    name = probe_preset(probe)
    result = train(_tiny(loss=name, steps=2, inner_steps=2))
    assert result.scenario.mismatch == MISMATCH and result.scenario.inputs == ("behav_logp",)
    assert len(probe.seen) == 4
    for i, ctx in enumerate(probe.seen):
        assert ctx.behav_logp is not None and ctx.old_logp is not None
        gap = (_masked(ctx.old_logp, ctx) - _masked(ctx.behav_logp, ctx)).abs()
        assert float(gap.max()) > 1e-3  # the engine is not the trainer
        if i % 2 == 0:  # first inner step: old_logp is the trainer's recompute with the real weights
            torch.testing.assert_close(_masked(ctx.logp, ctx), _masked(ctx.old_logp, ctx), atol=1e-5, rtol=1e-5)
    probe.seen.clear()
    train(_tiny(loss=name, steps=1, inner_steps=1, mismatch=0.0))
    (ctx,) = probe.seen
    assert ctx.behav_logp is not None and ctx.old_logp is not None
    torch.testing.assert_close(_masked(ctx.behav_logp, ctx), _masked(ctx.old_logp, ctx), atol=1e-5, rtol=1e-5)


def test_staleness_feeds_a_lagging_engine(probe_preset: Any) -> None:
    """Staleness 2, no mismatch: steps 0-2 sample from version 0, step 3 from version 1; ``behav_logp`` equals the
    recompute only at step 0 (when version 0 is the trained policy)."""
    probe = _Probe(requires=("behav_logp",))
    name = probe_preset(probe)
    result = train(_tiny(loss=name, steps=4, inner_steps=1, mismatch=0.0, staleness=2))
    assert result.scenario.describe() == "staleness 2 steps"
    gaps = []
    for ctx in probe.seen:
        assert ctx.behav_logp is not None and ctx.old_logp is not None
        gaps.append(float((_masked(ctx.old_logp, ctx) - _masked(ctx.behav_logp, ctx)).abs().max()))
    assert gaps[0] < 1e-5 and min(gaps[1:]) > 1e-4


def test_partial_rollouts_change_version_inside_responses(probe_preset: Any) -> None:
    probe = _Probe(requires=("versions", "behav_logp"), accepts=("policy_version",))
    name = probe_preset(probe)
    result = train(_tiny(loss=name, steps=4, inner_steps=1, prompts_per_step=8))
    scen = result.scenario
    assert scen.partial and scen.staleness == STALENESS and scen.mismatch == 0.0
    assert scen.inputs == ("behav_logp", "policy_version", "versions")
    mixed = 0
    for step, ctx in enumerate(probe.seen):
        assert ctx.versions is not None and ctx.behav_logp is not None and ctx.old_logp is not None
        assert ctx.policy_version == step
        v, m = ctx.versions, ctx.mask
        assert bool((v[m] >= max(0, step - STALENESS)).all()) and bool((v[m] <= step).all())
        assert bool((v[:, 1:] >= v[:, :-1]).all())  # a response only moves to newer versions
        current = m & (v == step)
        # Tokens of the current version: behaviour = recompute (no mismatch); older ones differ after step 0.
        torch.testing.assert_close(ctx.behav_logp[current], ctx.old_logp[current], atol=1e-5, rtol=1e-5)
        if step > 0:
            older = m & (v < step)
            assert bool(older.any())
            assert float((ctx.behav_logp[older] - ctx.old_logp[older]).abs().max()) > 1e-4
        lo = torch.where(m, v, torch.full_like(v, 10**6)).amin(-1)
        hi = torch.where(m, v, torch.full_like(v, -1)).amax(-1)
        mixed += int((lo < hi).sum())
    assert mixed > 0  # some responses span two versions


def test_top_k_and_confidence_inputs(probe_preset: Any) -> None:
    probe = _Probe(requires=("topk_logp", "topk_behav_logp", "confidence"), accepts=("sampled_in_topk",))
    name = probe_preset(probe)
    result = train(_tiny(loss=name, steps=1, inner_steps=1, topk=6, mismatch=0.0))
    assert result.scenario.inputs == ("confidence", "sampled_in_topk", "topk_behav_logp", "topk_logp")
    (ctx,) = probe.seen
    top, beh, conf = ctx.topk_logp, ctx.topk_behav_logp, ctx.confidence
    assert top is not None and beh is not None and conf is not None
    b, t = ctx.mask.shape
    assert top.shape == beh.shape == (b, t, 6) and conf.shape == (b,)
    m = ctx.mask
    torch.testing.assert_close(top[m], beh[m], atol=1e-5, rtol=1e-5)  # same policy, before the update
    assert bool((beh[m][:, :-1] >= beh[m][:, 1:]).all())
    # Confidence: mean probability of the top 5 of 14 tokens, so in [1/14, 1/5] at every position.
    assert bool((conf >= 1 / VOCAB_SIZE - 1e-6).all()) and bool((conf <= 0.2 + 1e-6).all())
    sampled = ctx.extra["sampled_in_topk"]
    assert sampled.shape == (b, t) and bool((sampled <= m).all())
    hit = (ctx.logp[..., None] - beh).abs().min(-1).values < 1e-5
    assert bool((sampled[m] <= hit[m]).all())
    # With the mismatch on, the engine's top-K log-probs differ from the trained policy's at the same ids.
    probe.seen.clear()
    train(_tiny(loss=name, steps=1, inner_steps=1, topk=6, mismatch=MISMATCH))
    (ctx,) = probe.seen
    assert ctx.topk_logp is not None and ctx.topk_behav_logp is not None
    assert float((ctx.topk_logp.detach() - ctx.topk_behav_logp)[ctx.mask].abs().max()) > 1e-3


def test_token_confidence_is_the_top5_mean_on_a_hand_example() -> None:
    """ECHO's token confidence here is the mean probability of the top-5 tokens; on a uniform distribution over
    the 14 tokens it is 1/14, on a one-hot one 1/5 (the other four are 0), and the tail mean averages them."""
    uniform = torch.full((1, 2, 5), math.log(1 / VOCAB_SIZE))
    peaked = torch.tensor([[[0.0, -1e4, -1e4, -1e4, -1e4]] * 2])
    for logp, expected in ((uniform, 1 / VOCAB_SIZE), (peaked, 0.2)):
        conf = tail_confidence(logp.exp().mean(-1), torch.ones(1, 2, dtype=torch.bool))
        torch.testing.assert_close(conf, torch.tensor([expected]))


def test_reference_logp_is_the_initial_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preset with a KL stage gets ``ref_logp`` from the initial policy: the KL term is 0 on the first step (the
    policy has not moved) and positive once it has."""
    registry: Registry[Preset] = Registry("loss preset")
    registry.register("grpo_kl", Preset("grpo_kl", "a test preset", {**losses.get("grpo").config, "kl": KL(coef=0.1)}))
    monkeypatch.setattr(losses, "PRESETS", registry)
    result = train(_tiny(loss="grpo_kl", steps=3, inner_steps=1))
    assert result.scenario.inputs == ("ref_logp",) and not result.scenario.simulated
    kl = [s.metrics["kl"] for s in result.steps]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[2] > 1e-6


def test_bad_scenario_config_raises(probe_preset: Any) -> None:
    for field_name, value in (("mismatch", -0.1), ("mismatch", float("nan")), ("staleness", -1), ("staleness", 1.5)):
        with pytest.raises(rolloutopt.InputError, match=field_name):
            TrainConfig(**{field_name: value})  # type: ignore[arg-type]
    for k in (0, VOCAB_SIZE + 1):
        with pytest.raises(rolloutopt.InputError, match="topk"):
            TrainConfig(topk=k)
    with pytest.raises(rolloutopt.InputError, match="loss"):
        TrainConfig(loss="no-such-preset")
    name = probe_preset(_Probe(requires=("a_custom_input",)), name="custom")
    with pytest.raises(rolloutopt.InputError, match="a_custom_input"):
        TrainConfig(loss=name)
