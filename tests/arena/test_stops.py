"""The arena's stop family: every runnable method replays on real rollouts of a tiny policy; hand-built cases give
the hand-computed mask and rewards; every rule of rolloutopt.control is either runnable or refused with a reason;
bad input is refused."""

from __future__ import annotations

import pytest
import torch

import rolloutopt.control as control
from rolloutopt.arena import TaskSuite
from rolloutopt.arena.base import BaseConfig, base_policy
from rolloutopt.arena.stops import LENGTH_RULES, REFUSED, STOP_METHODS, StopMethod, reference
from rolloutopt.errors import InputError
from rolloutopt.testbed.policy import Rollouts, TinyPolicy
from rolloutopt.testbed.task import EOS, PAD

SUITE = TaskSuite(ops=("reverse", "count"), lengths=(("reverse", (1, 2, 3)), ("count", (2, 3))), per_cell=12, holdout=3)
BASE = BaseConfig(hidden=16, steps=30, batch_size=16)
PROMPTS, GROUP = 4, 4

# the public functions of rolloutopt.control that are neither rules nor length functions
NOT_RULES = {"get", "entry", "names", "register", "replay", "surrogate_regret", "soft_value"}
NOT_RULES |= {"gradient_cosine", "kl_sign_alignment"}  # ADWIN's alignment measures


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> TinyPolicy:
    return base_policy(SUITE, BASE, directory=tmp_path_factory.mktemp("arena-cache"))


def _batch(
    policy: TinyPolicy, gen: torch.Generator, topk: int
) -> tuple[torch.Tensor, Rollouts, torch.Tensor, torch.Tensor]:
    train, _ = SUITE.split()
    ids = train[torch.randperm(train.numel(), generator=gen)[:PROMPTS]].repeat_interleave(GROUP)
    roll = policy.sample(SUITE.prompts(ids), SUITE.response_limit, generator=gen, topk=topk)
    rewards = SUITE.reward(ids, roll.tokens, roll.mask)
    return ids, roll, rewards, torch.arange(PROMPTS).repeat_interleave(GROUP)


@pytest.mark.parametrize("name", STOP_METHODS)
def test_every_method_runs_on_real_rollouts(policy: TinyPolicy, name: str) -> None:
    method = StopMethod(name, 0, group_size=GROUP, response_limit=SUITE.response_limit)
    rule = method.rule
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # two successive steps: a learning rule keeps its state
        ids, roll, rewards, group = _batch(policy, gen, method.topk)
        out = method.apply(ids, roll, rewards, group, SUITE.reward)
        b, t = roll.mask.shape
        assert out.mask.shape == (b, t) and out.mask.dtype == torch.bool
        assert not bool((out.mask & ~roll.mask).any())  # the kept tokens are generated tokens
        assert out.rewards.shape == (b,) and bool(torch.isfinite(out.rewards).all())
        assert out.seq_weight.shape == (b,) and bool((out.seq_weight >= 0).all())
        assert out.token_weight is None or (out.token_weight.shape == (b, t) and bool((out.token_weight >= 0).all()))
        assert 0.0 <= out.stopped_frac <= 1.0 and 0.0 <= out.saved_frac <= 1.0 and out.seconds >= 0.0
        assert not bool((out.mask & ~out.generated).any()) and not bool((out.generated & ~roll.mask).any())
        generated = int(out.generated.sum())
        assert out.saved_frac == pytest.approx(1.0 - generated / int(roll.mask.sum()))
        if name in ("dler_difficulty_penalty", "dot", "jet_reward", "soft_compression_penalty"):
            assert torch.equal(out.generated, roll.mask)  # acts after the group was generated: nothing saved
        if name in ("arrol", "duet_abort", "echo_pruning"):  # no terminal reward: a cut row is rescored by the suite
            cut = (out.mask != roll.mask).any(1)
            want = torch.where(cut, SUITE.reward(ids, roll.tokens, out.mask), rewards)
            assert torch.equal(out.rewards, want)
    assert method.rule is rule and method.calls == 2


def test_none_is_the_identity(policy: TinyPolicy) -> None:
    ids, roll, rewards, group = _batch(policy, torch.Generator().manual_seed(1), 0)
    out = StopMethod("none", 3, group_size=GROUP, response_limit=SUITE.response_limit).apply(
        ids, roll, rewards, group, SUITE.reward
    )
    assert torch.equal(out.mask, roll.mask) and torch.equal(out.rewards, rewards)
    assert torch.equal(out.seq_weight, torch.ones(rewards.shape)) and out.token_weight is None
    assert out.stopped_frac == 0.0 and out.saved_frac == 0.0


def _rollouts(tokens: list[list[int]], logp: list[list[float]], top1: list[list[float]] | None = None) -> Rollouts:
    tok = torch.tensor(tokens)
    mask = tok != PAD
    lp = torch.tensor(logp) * mask
    top = None if top1 is None else (torch.tensor(top1) * mask)[..., None]
    ids = None if top is None else torch.zeros(top.shape, dtype=torch.long)
    return Rollouts(tokens=tok, mask=mask, logp=lp, entropy=torch.zeros(lp.shape), topk_ids=ids, topk_logp=top)


def _count_reward(ids: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A stand-in suite reward: 10 x the kept length (to see which rows were rescored)."""
    return mask.sum(1).float() * 10.0


IDS = torch.tensor([0, 1])
ONE_GROUP = torch.tensor([0, 0])


def test_espo_critic_free_stops_where_the_regret_leaves_the_band() -> None:
    """With the band forced to 0 (rho_bar = s_rho = kappa = 0, no smoothing, t_min 1) the row stops at its first
    token with a positive regret (t = 1: regret 0.5) and earns r_fail = -1; the other row never regrets."""
    roll = _rollouts(
        [[1, 2, 3, EOS], [4, 5, EOS, PAD]],
        [[-0.1, -1.0, -0.2, -0.3], [-0.2, -0.3, -0.4, 0.0]],
        [[-0.1, -0.5, -0.2, -0.3], [-0.2, -0.3, -0.4, 0.0]],
    )
    options = {"rho_bar": 0.0, "s_rho": 0.0, "kappa": 0.0, "smoothing": 0.0, "t_min": 1}
    method = StopMethod("espo_critic_free", 0, group_size=2, response_limit=4, options=options)
    out = method.apply(IDS, roll, torch.tensor([1.0, 1.0]), ONE_GROUP, _count_reward)
    assert out.mask.tolist() == [[True, True, False, False], [True, True, True, False]]
    assert out.rewards.tolist() == [-1.0, 1.0]  # the terminal reward wins over the rescoring
    assert out.stopped_frac == 0.5 and out.saved_frac == pytest.approx(2 / 7)
    assert isinstance(method.rule, control.ESPOCriticFree) and method.rule.batches == 1  # learnt from row 1


def test_echo_prunes_the_lowest_branch_and_the_suite_rescores_it() -> None:
    """threshold 1, window 1, warm-up 1: both branches of the tree are candidates at t = 0 with equal confidence;
    one branch must stay, so row 0 (first by row id) is pruned after one token, rescored by reward_fn."""
    roll = _rollouts([[1, 2, EOS], [3, 4, EOS]], [[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    options = {"threshold": 1.0, "window": 1, "min_tokens": 1}
    method = StopMethod("echo_pruning", 0, group_size=2, response_limit=3, options=options)
    out = method.apply(IDS, roll, torch.tensor([0.0, 1.0]), ONE_GROUP, _count_reward)
    assert out.mask.tolist() == [[True, False, False], [True, True, True]]
    assert out.rewards.tolist() == [10.0, 1.0]
    assert out.seq_weight.tolist() == [1.0, 1.0] and out.saved_frac == pytest.approx(2 / 6)


def test_duet_aborts_or_keeps_marker_less_rows_past_the_horizon() -> None:
    """Horizon 1, answer marker <eos>: a row answering at once is kept whole (weight 1); every other row is gated
    after one token: aborted (weight 0, one token kept) or a survivor (kept whole, weight 1/p = 20)."""
    tokens = [[EOS, PAD, PAD]] + [[1, 2, EOS]] * 15
    roll = _rollouts(tokens, [[-0.5] * 3] * 16)
    method = StopMethod("duet_abort", 7, group_size=16, response_limit=3, options={"horizon": 1})
    out = method.apply(torch.arange(16), roll, torch.ones(16), torch.zeros(16, dtype=torch.long), _count_reward)
    assert out.seq_weight[0] == 1.0 and out.mask[0].tolist() == [True, False, False] and out.rewards[0] == 1.0
    for i in range(1, 16):
        if out.seq_weight[i] == 0.0:
            assert out.mask[i].tolist() == [True, False, False] and out.rewards[i] == 10.0
        else:
            assert out.seq_weight[i] == pytest.approx(20.0) and out.mask[i].all() and out.rewards[i] == 1.0


def test_dler_cuts_the_over_long_row_and_zeroes_its_reward() -> None:
    roll = _rollouts([[1, 2, 3, EOS], [4, EOS, PAD, PAD]], [[-0.1] * 4, [-0.1] * 4])
    method = StopMethod("dler_truncation_penalty", 0, group_size=2, response_limit=4, options={"max_len": 2})
    out = method.apply(IDS, roll, torch.tensor([1.0, 1.0]), ONE_GROUP, _count_reward)
    assert out.mask.tolist() == [[True, True, False, False], [True, True, False, False]]
    assert out.rewards.tolist() == [0.0, 1.0] and out.stopped_frac == 0.5 and out.saved_frac == pytest.approx(2 / 6)
    assert torch.equal(out.generated, out.mask)  # a length cap known before sampling: the cut tokens are never made
    default = StopMethod("dler_truncation_penalty", 0, group_size=2, response_limit=9)
    assert default._posthoc_kwargs["max_len"] == 4  # the arena's H = response_limit // 2


def test_every_rule_is_runnable_or_refused() -> None:
    assert not set(STOP_METHODS) & set(REFUSED)
    assert set(control.names()) <= set(STOP_METHODS) | set(REFUSED)
    assert set(LENGTH_RULES) <= set(STOP_METHODS) | set(REFUSED)
    assert set(control.posthoc.names()) <= set(LENGTH_RULES)
    functions = {n for n in control.__all__ if n[0].islower() and callable(getattr(control, n))}
    assert functions - NOT_RULES <= set(LENGTH_RULES), "a new length function: run it or refuse it"
    assert set(REFUSED) <= set(control.names()) | set(LENGTH_RULES)
    assert set(STOP_METHODS) - {"none"} <= set(control.names()) | set(control.posthoc.names())
    assert all(isinstance(why, str) and len(why) > 20 for why in REFUSED.values())
    assert reference("none") == "" and all(
        "arXiv" in reference(n) or "abstract" in reference(n) for n in STOP_METHODS[1:]
    )


@pytest.mark.parametrize(("name", "word"), [("espo", "critic"), ("deer", "transition"), ("prune_opd", "teacher")])
def test_a_refused_name_says_why(name: str, word: str) -> None:
    with pytest.raises(InputError) as err:
        StopMethod(name, group_size=4, response_limit=9)
    assert err.value.argument == "name" and word in str(err.value) and "refused" in str(err.value)


def test_bad_input(policy: TinyPolicy) -> None:
    with pytest.raises(InputError, match="STOP_METHODS") as err:
        StopMethod("nope", group_size=4, response_limit=9)
    assert err.value.argument == "name"
    for kwargs, argument in (
        ({"seed": -1}, "seed"),
        ({"group_size": 0}, "group_size"),
        ({"response_limit": 0}, "response_limit"),
        ({"options": {"markers": (1,)}}, "options"),
    ):
        with pytest.raises(InputError) as err:
            StopMethod("duet_abort", **{"group_size": 4, "response_limit": 9, **kwargs})  # type: ignore[arg-type]
        assert err.value.argument == argument
    ids, roll, rewards, group = _batch(policy, torch.Generator().manual_seed(2), 0)
    method = StopMethod("espo_critic_free", group_size=GROUP, response_limit=SUITE.response_limit)
    with pytest.raises(InputError, match="topk") as err:  # sampled without the top-K log-probs the rule reads
        method.apply(ids, roll, rewards, group, SUITE.reward)
    assert err.value.argument == "roll"
    dot = StopMethod("dot", group_size=GROUP, response_limit=SUITE.response_limit)
    with pytest.raises(InputError) as err:
        dot.apply(ids, roll, rewards[:-1], group, SUITE.reward)
    assert err.value.argument == "rewards"
