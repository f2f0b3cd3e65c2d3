"""rolloutopt.integrations.trl.GRPOTrainer against TRL 1.16's own GRPOTrainer, end to end on the CPU.

Everything is built in code, nothing is downloaded: a 1-layer Llama (hidden 16, vocabulary 64) with random
weights, a character-level ``PreTrainedTokenizerFast`` (``<pad>`` 0, ``<eos>`` 1), four prompts and a reward
function. Stock TRL and the adapter run with the same ``GRPOConfig`` and seed, so they sample the same
completions; with ``num_iterations=2`` and ``gradient_accumulation_steps=2`` TRL recomputes the old log-probs
and the second pass over a generation batch is off-policy, so the ratio differs from 1 and the clip fires.

- ``test_logged_losses_equal_stock_trl``: the dapo / grpo / dr_grpo presets (and a rolloutopt advantage
  estimator configured as TRL's normalisation) log the same losses and gradient norms as TRL's ``loss_type``.
- ``test_compute_loss_matches_trl_on_one_batch``: the ``_compute_loss`` override against TRL's, on one
  hand-made micro-batch with every optional tensor TRL can pass (old, reference and sampling log-probs, the vLLM
  IS ratio, a tool mask), the bias-corrected KL, the entropy bonus, GA = 2, 1 or a pretend 2 or 3 processes,
  train and eval: value and gradient.
- ``test_other_presets_run``: every other preset TRL can feed trains for two steps, finite, with metrics logged;
  presets needing inputs TRL lacks are refused at construction, naming the input.
- ``test_two_processes_equal_stock_trl``: two processes (``torch.distributed.run``, gloo): equal to stock TRL.
- MC-GRPO and GDPO through the advantage override; refused options; :func:`trl_denominators`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import rolloutopt.advantages as advantages
import rolloutopt.losses as losses
from rolloutopt.errors import InputError
from rolloutopt.losses import Denominators

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from trl.trainer.grpo_trainer import GRPOTrainer as StockTrainer  # noqa: E402

from rolloutopt.integrations.trl import GRPOTrainer, trl_denominators  # noqa: E402

pytestmark = [
    pytest.mark.trl,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 "
PROMPTS = ["abc", "hello", "xyz 1", "count"]


def tokenizer() -> Any:
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )


def model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return transformers.LlamaForCausalLM(cfg)


def reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Count of 'a' plus a small length term: varied within each group, so advantages are non-zero."""
    return [float(c.count("a")) + 0.1 * len(c) + 0.01 * sum(map(ord, c[:2])) for c in completions]


def config(**overrides: Any) -> Any:
    kw: dict[str, Any] = {
        "output_dir": tempfile.mkdtemp(prefix="rolloutopt-trl-"),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "use_vllm": False,
        "report_to": [],
        "logging_steps": 1,
        "seed": 0,
        "use_cpu": True,
        "save_strategy": "no",
        "learning_rate": 0.05,
        "disable_tqdm": True,
    }
    kw.update(overrides)
    return trl.GRPOConfig(**kw)


def train(cls: type, *, args: Any, **kwargs: Any) -> Any:
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = cls(
        model=model(), reward_funcs=reward, args=args, train_dataset=ds, processing_class=tokenizer(), **kwargs
    )
    trainer.train()
    return trainer


def step_logs(trainer: Any) -> list[dict[str, float]]:
    return [h for h in trainer.state.log_history if "loss" in h]


OFF_POLICY = {"num_iterations": 2, "gradient_accumulation_steps": 2, "max_steps": 3}

# (preset, TRL's matching settings, rolloutopt advantage or None)
PARITY = [
    ("dapo", {"loss_type": "dapo", "epsilon_high": 0.28}, None),
    ("grpo", {"loss_type": "grpo"}, None),
    ("dr_grpo", {"loss_type": "dr_grpo"}, None),
    # TRL's advantages: group mean and unbiased std over blocks of num_generations, eps 1e-4 added to the std
    ("dapo", {"loss_type": "dapo", "epsilon_high": 0.28}, functools.partial(advantages.grpo, eps=1e-4)),
    # objective=None keeps TRL's loss; only the advantages are rolloutopt's
    (None, {"loss_type": "grpo"}, functools.partial(advantages.grpo, eps=1e-4)),
]


@pytest.mark.parametrize(
    ("preset", "trl_kw", "advantage"), PARITY, ids=["dapo", "grpo", "dr_grpo", "dapo+grpo_adv", "trl+grpo_adv"]
)
def test_logged_losses_equal_stock_trl(preset: str | None, trl_kw: dict[str, Any], advantage: Any) -> None:
    args = {**OFF_POLICY, **trl_kw}
    stock = step_logs(train(StockTrainer, args=config(**args)))
    ours_trainer = train(GRPOTrainer, args=config(**args), objective=preset and losses.get(preset), advantage=advantage)
    ours = step_logs(ours_trainer)
    assert len(stock) == len(ours) == 3
    for s, o in zip(stock, ours, strict=True):
        assert_close(o["loss"], s["loss"], rtol=1e-5, atol=1e-6)  # losses near 0: fp32 noise of the advantages
        assert_close(o["grad_norm"], s["grad_norm"], rtol=1e-4, atol=1e-7)
        assert o.get("reward") == s.get("reward")  # the same completions were sampled (logged at generation)
        assert preset is None or math.isfinite(o["rolloutopt/pg_loss"])
    if preset is None:
        assert all("rolloutopt/pg_loss" not in o and "clip_ratio/low_mean" in o for o in ours)  # TRL's loss ran
        return
    # the comparison is not trivial: a loss is non-zero, the ratio moved and the clip fired somewhere
    assert any(abs(s["loss"]) > 1e-4 for s in stock)
    assert any(o["rolloutopt/ratio_max"] > 1.0 + 1e-3 for o in ours)
    assert any(o["rolloutopt/clip_low_frac"] + o["rolloutopt/clip_high_frac"] > 0 for o in ours)
    if advantage is not None:
        assert all(("rolloutopt/adv/reward_mean" in o) == ("reward" in o) for o in ours)  # at each generation


# ---------------------------------------------------------------------------------------------------------------
# _compute_loss on one micro-batch: the override against TRL's method, on the same trainer and model


def one_batch(b: int = 6, p: int = 3, t: int = 7) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([0, 1, 3, 7, 5, 7])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    tool = torch.ones(b, t, dtype=torch.long)
    tool[3, 2:4] = 0  # tool-output tokens: attended to, not trained on
    return {
        "prompt_ids": torch.randint(2, 40, (b, p), generator=gen),
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": torch.randint(2, 40, (b, t), generator=gen),
        "completion_mask": mask,
        "tool_mask": tool,
        "advantages": torch.tensor([0.5, -1.3, 0.2, -0.5, -2.2, 0.3]),  # both signs where ratios leave the band
        "num_items_in_batch": torch.tensor(61),  # the whole generation batch (two micro-batches, here spg = 2)
        "noise": torch.randn(3, b, t, generator=gen),
    }


def with_logps(trainer: Any, batch: dict[str, Any], *, vllm: bool, beta: float) -> dict[str, Any]:
    inputs = {k: v for k, v in batch.items() if k != "noise"}
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, att, inputs["completion_ids"].size(1)
        )
    noise = batch["noise"]
    inputs["old_per_token_logps"] = logp + 0.5 * noise[0]  # ratios in e^{±1}: both clip sides fire
    if beta:
        inputs["ref_per_token_logps"] = logp + 0.3 * noise[1]
    if vllm:
        inputs["sampling_per_token_logps"] = logp + 0.2 * noise[2]
        inputs["importance_sampling_ratio"] = torch.exp(0.2 * noise[2]).clamp(max=2.0)
    return inputs


class PretendWorld:
    """The trainer's accelerator, reporting ``n`` processes (gathers stay local): TRL's P in the normalisers."""

    def __init__(self, accelerator: Any, n: int) -> None:
        self._inner, self.num_processes = accelerator, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def loss_and_grads(fn: Any, trainer: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    loss = fn(trainer.model, inputs)
    return loss.detach(), list(torch.autograd.grad(loss, params, allow_unused=True))


@pytest.mark.parametrize(
    ("preset", "trl_kw"),
    [
        ("dapo", {"loss_type": "dapo", "epsilon_high": 0.28}),
        ("grpo", {"loss_type": "grpo"}),
        ("dr_grpo", {"loss_type": "dr_grpo"}),
        ("dapo", {"loss_type": "bnpo", "epsilon_high": 0.28}),
    ],
    ids=["dapo", "grpo", "dr_grpo", "bnpo"],
)
def test_compute_loss_matches_trl_on_one_batch(preset: str, trl_kw: dict[str, Any]) -> None:
    args = config(gradient_accumulation_steps=2, steps_per_generation=1, entropy_coef=0.01, **trl_kw)  # GA/spg = 2
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = GRPOTrainer(
        model=model(), reward_funcs=reward, args=args, train_dataset=ds, processing_class=tokenizer(),
        objective=losses.get(preset),
    )  # fmt: skip
    batch = one_batch()
    seen = 0
    real = trainer.accelerator
    cases = [(True, True, 0.04, True, 1), (True, False, 0.04, False, 3), (False, True, 0.0, True, 2)]
    for training, vllm, beta, bias, procs in cases:
        trainer.accelerator = PretendWorld(real, procs) if procs > 1 else real
        trainer.model.train(training)
        trainer.current_gradient_accumulation_steps = 2
        trainer.beta, trainer.use_vllm = beta, vllm
        trainer.args.use_bias_correction_kl = bias
        inputs = with_logps(trainer, batch, vllm=vllm, beta=beta)
        want = loss_and_grads(functools.partial(StockTrainer._compute_loss, trainer), trainer, inputs)
        trainer._metrics["train"].clear()
        got = loss_and_grads(trainer._compute_loss, trainer, inputs)
        assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
        for g, w in zip(got[1], want[1], strict=True):
            if w is None:
                assert g is None or not g.any()
                continue
            seen += 1
            assert_close(g, w, rtol=1e-4, atol=1e-7)
        metrics = trainer._metrics["train" if training else "eval"]
        assert metrics["rolloutopt/clip_low_frac"] and metrics["rolloutopt/clip_high_frac"]
        assert metrics["rolloutopt/clip_low_frac"][-1] > 0 and metrics["rolloutopt/clip_high_frac"][-1] > 0
    trainer.accelerator = real
    assert seen > 0


# ---------------------------------------------------------------------------------------------------------------
# every other preset


TRL_INPUTS = {"behav_logp"}  # available from TRL, but only with vLLM (sampling_per_token_logps) or a rollout_func
SUPPLIED = {"max_len"}  # the adapter passes max_completion_length


def test_other_presets_run() -> None:
    done, refused = [], []
    for name in losses.names():
        if name in ("dapo", "grpo", "dr_grpo"):
            continue
        preset = losses.get(name)
        kw = {"experimental": True} if preset.experimental else {}
        if set(preset.requires) - SUPPLIED:  # behav_logp needs vLLM; versions, top-K and confidence are not in TRL
            with pytest.raises(InputError) as err:
                train(GRPOTrainer, args=config(), objective=preset, **kw)
            missing = [r for r in preset.requires if r not in TRL_INPUTS] or ["behav_logp"]
            assert any(m in str(err.value) for m in missing), str(err.value)
            refused.append(name)
            continue
        trainer = train(GRPOTrainer, args=config(num_iterations=2, max_steps=2), objective=preset, **kw)
        logs = step_logs(trainer)
        assert len(logs) == 2
        for log in logs:
            assert math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"])
            assert math.isfinite(log["rolloutopt/pg_loss"]) and "rolloutopt/ratio_mean" in log
        assert logs[1]["rolloutopt/ratio_max"] != 1.0  # the second pass is off-policy
        done.append(name)
    assert {"cispo", "gspo", "sapo", "m2po_clip", "opsm", "dppo_tv", "cumulative", "pnpo"} <= set(done)
    assert {"tis", "icepop", "m2po", "copris", "echo_clip", "dppo_predictive"} <= set(refused)


@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_use_fused_equals_trl_log_probs(preset: str) -> None:
    """``use_fused=True`` (rolloutopt.kernels.token_logprobs from the last hidden state and lm_head, temperature
    0.7) trains like TRL's own fused LM head: same logged losses, gradient norms and entropies, off-policy, with
    the entropy bonus (so the entropy's gradient counts). ``bf16=False``: GRPOConfig's default bf16 autocast runs
    TRL's head in bf16, while the kernel runs outside autocast in the weight's dtype (fp32 here), a bf16-sized
    difference (~1e-3) that would hide real errors."""
    args = {**OFF_POLICY, "temperature": 0.7, "entropy_coef": 0.01, "bf16": False}
    if preset == "dapo":
        args["epsilon_high"] = 0.28
    plain = step_logs(train(GRPOTrainer, args=config(**args), objective=preset))
    fused = step_logs(train(GRPOTrainer, args=config(**args), objective=preset, use_fused=True))
    assert len(plain) == len(fused) == 3
    for p, f in zip(plain, fused, strict=True):
        assert_close(f["loss"], p["loss"], rtol=1e-4, atol=1e-6)
        assert_close(f["grad_norm"], p["grad_norm"], rtol=1e-4, atol=1e-6)
        assert_close(f["rolloutopt/entropy"], p["rolloutopt/entropy"], rtol=1e-5, atol=1e-6)
    assert any(abs(p["loss"]) > 1e-4 for p in plain)


def test_use_fused_refuses_rescaled_heads() -> None:
    net = model()
    net.config.final_logit_softcapping = 30.0
    with pytest.raises(InputError, match=r"^use_fused:.*final_logit_softcapping"):
        GRPOTrainer(
            model=net, reward_funcs=reward, args=config(), processing_class=tokenizer(), objective="dapo",
            train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}), use_fused=True,
        )  # fmt: skip


def test_experimental_preset_needs_acknowledgement() -> None:
    with pytest.raises(InputError, match="experimental"):
        GRPOTrainer(model=model(), reward_funcs=reward, args=config(), objective="pnpo")


# ---------------------------------------------------------------------------------------------------------------
# MC-GRPO through the advantage override


def test_mc_grpo_advantages_and_pivot_denominator() -> None:
    captured: list[dict[str, Any]] = []
    rewards: list[torch.Tensor] = []

    class Capture(GRPOTrainer):
        def _calculate_rewards(self, *a: Any) -> torch.Tensor:
            out = super()._calculate_rewards(*a)
            rewards.append(out.clone())
            return out

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            captured.append({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})
            return out

    args = config(num_generations=5, per_device_train_batch_size=5, max_steps=2)  # G + 1 = 5 per prompt
    trainer = train(Capture, args=args, objective="dapo", advantage="mc_grpo")
    assert len(captured) == 2
    for out, rpf in zip(captured, rewards, strict=True):
        r = rpf.sum(1)
        group = torch.arange(r.numel()) // 5
        ref = advantages.mc_grpo(r, group)
        assert_close(out["advantages"], ref.advantages)
        assert_close(out["rolloutopt_seq_weight"], ref.weight)
        assert int((out["rolloutopt_seq_weight"] == 0).sum()) == 1  # one prompt, one pivot
        lengths = (out["completion_mask"]).sum(1)
        assert int(out["num_items_in_batch"]) == int((lengths * (ref.weight != 0)).sum())
    logs = step_logs(trainer)
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["rolloutopt/adv/pivot_frac"] == pytest.approx(0.2) for h in logs)


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [len(c) / 8.0 for c in completions]


def test_gdpo_sees_each_reward_function() -> None:
    """A multi-reward estimator gets TRL's [N, K] rewards and reward_weights (per-function normalisation)."""
    seen: list[tuple[torch.Tensor, Any]] = []

    def spy(rewards: torch.Tensor, group: torch.Tensor, **kw: Any) -> Any:
        seen.append((rewards.clone(), kw.get("weights")))
        return advantages.gdpo(rewards, group, **kw)

    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    args = config(reward_weights=[1.0, 0.5])
    trainer = GRPOTrainer(
        model=model(), reward_funcs=[reward, length_reward], args=args, train_dataset=ds,
        processing_class=tokenizer(), objective="grpo", advantage=functools.partial(advantages.gdpo),
    )  # fmt: skip
    trainer._ro_advantage = functools.partial(spy)  # the same checks passed for gdpo; spy on the call
    trainer.train()
    assert len(seen) == 2
    for rewards, weights in seen:
        assert rewards.shape == (4, 2)
        assert_close(weights, torch.tensor([1.0, 0.5]))
    assert all(math.isfinite(h["loss"]) for h in step_logs(trainer))


# ---------------------------------------------------------------------------------------------------------------
# two processes (torch.distributed.run, gloo on the CPU): the gathers, the process slices and P

TWO_PROCESS_SCRIPT = """
import functools, json, os, sys
sys.path.insert(0, {here!r})
import test_trl_trainer as t
from trl.trainer.grpo_trainer import GRPOTrainer as Stock
from rolloutopt.integrations.trl import GRPOTrainer
import rolloutopt.advantages as advantages
import rolloutopt.losses as losses
args = dict(num_iterations=2, gradient_accumulation_steps=2, max_steps=2, epsilon_high=0.28)
runs = {{
    "stock": (Stock, {{}}),
    "dapo": (GRPOTrainer, {{"objective": losses.get("dapo")}}),
    "dapo+grpo_adv": (GRPOTrainer, {{"objective": "dapo", "advantage": functools.partial(advantages.grpo, eps=1e-4)}}),
}}
out = {{}}
for name, (cls, kw) in runs.items():
    trainer = t.train(cls, args=t.config(**args), **kw)
    assert trainer.accelerator.num_processes == 2
    out[name] = [[h["loss"], h["grad_norm"], h.get("rolloutopt/ratio_max", 0.0)] for h in t.step_logs(trainer)]
if os.environ["RANK"] == "0":
    print("RESULT " + json.dumps(out))
"""


def test_two_processes_equal_stock_trl(tmp_path: Any) -> None:
    """Under 2 processes (each with its own prompts) the adapter logs stock TRL's losses and gradient norms."""
    here = str(pathlib.Path(__file__).parent)
    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESS_SCRIPT.format(here=here))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"  # no tokenizer thread pool left running at a rank's exit
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT ") :])
    assert len(res["stock"]) == 2
    for name in ("dapo", "dapo+grpo_adv"):
        for s, o in zip(res["stock"], res[name], strict=True):
            assert_close(o[0], s[0], rtol=1e-5, atol=1e-6)
            assert_close(o[1], s[1], rtol=1e-4, atol=1e-7)
    assert any(abs(s[0]) > 1e-4 for s in res["stock"]) and any(o[2] > 1.0 + 1e-3 for o in res["dapo"])


# ---------------------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    ("kwargs", "overrides", "argument"),
    [
        ({"allocator": object()}, {}, "allocator"),
        ({"use_fused": "yes"}, {}, "use_fused"),
        ({"use_fused": True, "objective": None}, {}, "use_fused"),
        ({}, {"loss_type": "cispo"}, "loss_type"),
        ({}, {"loss_type": "grpo"}, "loss_type"),  # dapo's token-mean is not grpo's normalisation
        ({}, {"importance_sampling_level": "sequence"}, "importance_sampling_level"),
        ({}, {"delta": 3.0}, "delta"),
        ({}, {"top_entropy_quantile": 0.5}, "top_entropy_quantile"),
        ({}, {"off_policy_mask_threshold": 0.1}, "off_policy_mask_threshold"),
        ({}, {"use_adaptive_entropy": True}, "use_adaptive_entropy"),
        ({}, {"epsilon_high": 0.3}, "epsilon_high"),
        ({"advantage": "grpo"}, {"scale_rewards": "batch"}, "scale_rewards"),
        ({"advantage": "reinforce_pp_baseline"}, {}, "advantage"),
        ({"advantage": "fapo_penalty"}, {}, "advantage"),
        ({"objective": functools.partial(losses.policy_loss, agg="prompt-mean")}, {}, "objective"),
        ({"objective": "tis"}, {}, "behav_logp"),
        ({"objective": "tis"}, {"use_vllm": True}, "vllm_importance_sampling_correction"),
        ({"objective": "echo_clip"}, {}, "objective"),
        ({"objective": functools.partial(losses.get("dapo"), kl=losses.KL())}, {}, "beta"),
    ],
)
def test_refused_options(kwargs: dict[str, Any], overrides: dict[str, Any], argument: str) -> None:
    kw = {"objective": "dapo", **kwargs}
    with pytest.raises(InputError, match=f"^{argument}:"):
        GRPOTrainer(model=model(), reward_funcs=reward, args=config(**overrides), **kw)


def test_matching_epsilon_is_accepted() -> None:
    """TRL's epsilon_high equal to the preset's clip (dapo: 0.28) is accepted; the objective clips."""
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = GRPOTrainer(
        model=model(), reward_funcs=reward, args=config(epsilon_high=0.28), train_dataset=ds,
        processing_class=tokenizer(), objective="dapo",
    )  # fmt: skip
    assert trainer.epsilon_high == 0.28


# ---------------------------------------------------------------------------------------------------------------
# trl_denominators: TRL's normalisers, by hand


def test_trl_denominators_by_hand() -> None:
    common = {"num_items_in_batch": 400.0, "rows": 6, "tokens": 30, "steps_per_generation": 2, "num_processes": 4}
    # dapo: S / (N/P · GA/spg) = S · P / (N·GA/spg) -> tokens = 400·3/2 = 600, world_size = 4
    d = trl_denominators("token-mean", loss_type="dapo", grad_accum=3, training=True, **common)
    assert d == Denominators(tokens=600.0, world_size=4)
    # eval: neither GA nor spg
    d = trl_denominators("token-mean", loss_type="dapo", grad_accum=3, training=False, **common)
    assert d == Denominators(tokens=400.0, world_size=4)
    assert trl_denominators("token-mean", loss_type="bnpo", grad_accum=3, training=True, **common) == Denominators(
        tokens=90
    )
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"):
        got = trl_denominators(agg, loss_type="dapo", grad_accum=3, training=True, **common)
        assert got == Denominators(sequences=18)
    assert trl_denominators("token-sum", loss_type="dapo", grad_accum=3, training=True, **common) == Denominators(
        world_size=4
    )
    with pytest.raises(InputError, match=r"^objective:"):
        trl_denominators("prompt-mean", loss_type="dapo", grad_accum=1, training=True, **common)


# ---------------------------------------------------------------------------------------------------------------
# behaviour log-probs from a rollout_func (TRL's sampling_per_token_logps without vLLM)


def fake_engine(prompts: list[str], trainer: Any) -> dict[str, Any]:
    """A stand-in rollout engine: random completions (seeded) and log-probs near the untrained model's (≈ log 1/64).

    TRL's ``rollout_func`` contract: one completion per prompt row, ``logprobs`` per completion token (None where
    the engine could not score a token; the adapter treats it as on-policy).
    """
    gen = torch.Generator().manual_seed(len(trainer._logs["prompt"]))
    tok = trainer.processing_class
    out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for prompt in prompts:
        n = int(torch.randint(2, 9, (1,), generator=gen))
        ids = torch.randint(2, 40, (n,), generator=gen).tolist()
        out["prompt_ids"].append(tok(prompt)["input_ids"])
        out["completion_ids"].append(ids)
        out["logprobs"].append((-math.log(64) + 0.3 * torch.randn(n, generator=gen)).tolist())
    out["logprobs"][0][0] = None  # a token the engine could not score (vLLM's None): TRL makes it NaN
    return out


def test_behaviour_logprob_presets_run_with_a_rollout_func() -> None:
    names = [n for n in losses.names() if losses.get(n).requires == ("behav_logp",)]
    assert {"tis", "icepop", "decoupled_ppo", "m2po"} <= set(names)
    for name in names:
        preset = losses.get(name)
        kw = {"experimental": True} if preset.experimental else {}
        args = config(num_iterations=2, max_steps=2)
        trainer = train(GRPOTrainer, args=args, objective=preset, rollout_func=fake_engine, **kw)
        logs = step_logs(trainer)
        assert len(logs) == 2, name
        for log in logs:
            assert math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"]), name
            assert math.isfinite(log["rolloutopt/pg_loss"]), name
        if "correction" in preset.config:  # the behaviour weights were computed from the engine's log-probs
            assert any(log["rolloutopt/is_weight_mean"] != 1.0 for log in logs), name


# ---------------------------------------------------------------------------------------------------------------
# allocator=: a prompt selector chooses each generation batch's prompts from a candidate pool

ALLOC_PROMPTS = ["abc", "hello", "xyz 1", "count", "aaa", "b2", "tea a", "zz"]


def selector_run(
    allocator: Any, *, pool: int | None = None, per_device: int = 4, advantage: Any = None
) -> tuple[Any, list[list[str]], list[list[float]]]:
    """Three steps, 2 prompts × 2 generations per generation batch, from 8 prompts; records what was scored."""
    seen: list[list[str]] = []
    scored: list[list[float]] = []

    def recording_reward(completions: list[str], prompts: list[str], **kwargs: Any) -> list[float]:
        out = reward(completions)
        seen.append(list(prompts))
        scored.append(out)
        return out

    ds = datasets.Dataset.from_dict({"prompt": ALLOC_PROMPTS})
    args = config(num_generations=2, per_device_train_batch_size=per_device, max_steps=3)
    trainer = GRPOTrainer(
        model=model(), reward_funcs=recording_reward, args=args, train_dataset=ds, processing_class=tokenizer(),
        objective="dapo", allocator=allocator, allocator_pool=pool, advantage=advantage,
    )  # fmt: skip
    trainer.train()
    return trainer, seen, scored


class Spy:
    """Records every ``update`` result of the allocator class it is mixed into."""

    results: list[Any]

    def update(self, result: Any) -> None:
        self.results.append(result)
        super().update(result)  # type: ignore[misc]


def spy(make: Any) -> Any:
    cls = make.func
    obj = type(f"Spy{cls.__name__}", (Spy, cls), {})(**make.keywords)
    obj.results = []
    return obj


@pytest.mark.parametrize("which", ["dps", "greso", "greso_pad", "gdro"])
def test_selector_allocator_chooses_the_trained_prompts(which: str) -> None:
    from rolloutopt.allocators import DPS, GRESO, PromptGDRO

    pool_size = 6
    if which == "dps":
        make: Any = functools.partial(DPS, n=2, seed=3)
    elif which == "gdro":
        make = functools.partial(PromptGDRO, n=2, seed=3, experimental=True)
    else:
        # greso_pad: p_easy = floor = 0 skips every prompt with an easy run (mean reward >= 1) for sure, and a pool
        # of 2 then leaves the selector short of the 2 prompts a generation batch holds: padding fills it
        pad = which == "greso_pad"
        pool_size = 2 if pad else 6
        make = functools.partial(
            GRESO, n=2, filter_zero_variance=False, sampling_batch_size=2, min_sampling_batch_size=1,
            easy_threshold=1.0, hard_threshold=0.5, seed=3, p_easy=0.0 if pad else 0.5, min_p=0.0,
            floor=0.0 if pad else 0.01,
        )  # fmt: skip
    alloc = spy(make)
    trainer, seen, scored = selector_run(alloc, pool=pool_size)
    logs = step_logs(trainer)
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in logs)
    assert len(alloc.results) == 3 == len(seen)  # one plan, one update per generation batch
    replay = make()  # the same allocator, same seed, fed the same pools and rewards, selects the same prompts
    gen = torch.Generator().manual_seed(0)  # args.seed
    for res, prompts, rewards in zip(alloc.results, seen, scored, strict=True):
        pool = torch.randperm(len(ALLOC_PROMPTS), generator=gen)[:pool_size]
        plan = replay.plan(pool, 4)
        req = plan.next()
        assert req is not None and req.counts.tolist() == [2] * req.prompt_ids.numel()
        # the prompts trained are the ones selected, in request order, each num_generations times
        selected = res.prompt_ids.tolist()
        assert selected == req.prompt_ids.repeat_interleave(2).tolist()
        assert prompts[: len(selected)] == [ALLOC_PROMPTS[i] for i in selected]
        # update got TRL's rewards of those rollouts
        assert_close(res.rewards, torch.tensor(rewards[: len(selected)], dtype=torch.float32))  # fp32 results
        plan.observe(req, res.rewards)
        assert plan.next() is None
        replay.update(plan.finish())
        # padding (when the selector chose fewer than 2 prompts): unselected candidates of the same pool
        padding = prompts[len(selected) :]
        assert len(prompts) == 4 and set(padding) <= {ALLOC_PROMPTS[int(i)] for i in pool} - set(
            prompts[: len(selected)]
        )
    padded = [h["rolloutopt/alloc/padded_prompts"] for h in logs]
    assert padded == [(4 - r.prompt_ids.numel()) // 2 for r in alloc.results]
    assert (sum(padded) > 0) == (which == "greso_pad")
    if which == "dps":  # the allocator's state changed: every selected prompt was rolled out and counted
        ids = torch.cat([r.plan_prompt_ids[r.counts > 0] for r in alloc.results])
        assert alloc.num_known > 0
        assert int(alloc.sampled_times(torch.unique(ids)).sum()) == 6
        assert_close(alloc.predictive(torch.arange(8)), replay.predictive(torch.arange(8)))
    elif which == "gdro":  # the adversary's distribution moved away from uniform, as the replay's did
        assert_close(alloc.bin_probs(), replay.bin_probs())
        fresh = make().bin_probs()
        assert not torch.allclose(alloc.bin_probs(), fresh)
    else:
        assert alloc.steps == 3 == replay.steps
        for a, b in zip(alloc.run_lengths(torch.arange(8)), replay.run_lengths(torch.arange(8)), strict=True):
            assert a.tolist() == b.tolist()
        assert sum(int(x.sum()) for x in alloc.run_lengths(torch.arange(8))) > 0


def test_allocators_trl_cannot_run_are_refused() -> None:
    from rolloutopt.allocators import DEPO, DOTS, DPS, GRESO, VIGOR, DAPODynamicSampling, Uniform

    ds = datasets.Dataset.from_dict({"prompt": ALLOC_PROMPTS})

    def build(alloc: Any, **kw: Any) -> Any:
        args = config(num_generations=2, per_device_train_batch_size=4)
        return GRPOTrainer(
            model=model(), reward_funcs=reward, args=args, train_dataset=ds, processing_class=tokenizer(),
            allocator=alloc, **kw,
        )  # fmt: skip

    with pytest.raises(InputError, match=r"^allocator:.*VIGOR.*several generation rounds"):
        build(VIGOR())
    with pytest.raises(InputError, match=r"^advantage:.*Uniform"):  # unequal groups need the estimator's grouping
        build(Uniform())
    with pytest.raises(InputError, match=r"^allocator:.*replay=False"):
        build(DOTS(), advantage="grpo")
    with pytest.raises(InputError, match=r"^allocator:.*DAPODynamicSampling"):
        build(DAPODynamicSampling())
    with pytest.raises(InputError, match=r"^allocator:.*DEPO, which requires each response's mean token entropy"):
        build(DEPO(n=2), advantage="grpo")
    with pytest.raises(InputError, match=r"^allocator:.*filter_zero_variance"):
        build(GRESO(n=2))
    with pytest.raises(InputError, match=r"^allocator:.*num_generations"):
        build(DPS(n=4))
    with pytest.raises(InputError, match=r"^allocator:.*sampling_batch_size"):
        build(GRESO(n=2, filter_zero_variance=False, sampling_batch_size=1, min_sampling_batch_size=1))
    with pytest.raises(InputError, match=r"^allocator_pool:"):
        build(DPS(n=2), allocator_pool=1)
    with pytest.raises(InputError, match=r"^allocator_pool:"):
        build(DPS(n=2), allocator_pool=9)
    with pytest.raises(InputError, match=r"^name:.*nope"):  # the allocator registry lists the names
        build("nope")
    with pytest.raises(InputError, match=r"^allocator_kwargs:"):
        build(DPS(n=2), allocator_kwargs={"seed": 1})
    built = build("greso", allocator_kwargs={"seed": 1})  # a selector by name: n = num_generations, no DAPO rounds
    assert type(built._ro_allocator).__name__ == "GRESO" and built._ro_allocator.n == 2
    assert built._ro_allocator.filter_zero_variance is False


@pytest.mark.parametrize("n", [None, 1], ids=["uneven", "padded"])
def test_count_allocator_presents_allocated_counts_with_weights(n: int | None) -> None:
    """A per-prompt-count allocator (Uniform over a pool of 3: counts [2, 1, 1]; with n=1: [1, 1, 1] plus one
    padding row): TRL generates the request's rows, the advantages use the plan's groups (one per prompt, padding
    rows alone), padding rows have weight 0 (out of the loss and of num_items_in_batch), the plan is fed TRL's
    rewards."""
    from rolloutopt.allocators import Uniform

    alloc = spy(functools.partial(Uniform, n=n))
    trainer, seen, scored = selector_run(alloc, pool=3, advantage=functools.partial(advantages.grpo, eps=1e-4))
    logs = step_logs(trainer)
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    gen = torch.Generator().manual_seed(0)  # args.seed: the pools the adapter drew
    shown = list(trainer._logs["advantages"])[-4:]  # the last generation batch's advantages × weights
    for res, prompts, rewards in zip(alloc.results, seen, scored, strict=True):
        pool = torch.randperm(len(ALLOC_PROMPTS), generator=gen)[:3]
        want_counts = [2, 1, 1] if n is None else [1, 1, 1]
        assert res.counts.tolist() == want_counts and res.plan_prompt_ids.tolist() == pool.tolist()
        rows = pool.repeat_interleave(torch.tensor(want_counts)).tolist()
        assert prompts[: len(rows)] == [ALLOC_PROMPTS[i] for i in rows]
        if n == 1:  # one padding row: a pool prompt again (no unselected candidate is left)
            assert len(prompts) == 4 and prompts[3] in {ALLOC_PROMPTS[i] for i in pool}
        assert_close(res.rewards, torch.tensor(rewards[: len(rows)], dtype=torch.float32))  # fp32 results
    group = torch.tensor([0, 0, 1, 2] if n is None else [0, 1, 2, 3])
    weight = torch.tensor([1.0, 1.0, 1.0, 1.0] if n is None else [1.0, 1.0, 1.0, 0.0])
    want = advantages.grpo(torch.tensor(scored[-1]), group, eps=1e-4).advantages * weight
    assert_close(torch.tensor(shown), want, rtol=1e-5, atol=1e-6)
    assert (want != 0).sum() == (2 if n is None else 0)  # only the pair forms a group with variance
    assert [h["rolloutopt/alloc/padded_rows"] for h in logs] == [0.0 if n is None else 1.0] * 3


def test_hive_runs_with_its_probe_answered_without_prompt_entropy() -> None:
    """HIVE's plan first probes the prompts for their prompt entropy; TRL has no prefill pass there, so the adapter
    answers the probe without it (stage 2 skipped) and HIVE allocates from its history: one rollout per prompt of
    the pool of 3 (n=1) that passes its reward band, the rest of the batch weight-0 padding rows."""
    from rolloutopt.allocators import HIVE

    alloc = spy(functools.partial(HIVE, n=1, experimental=True))
    trainer, _, scored = selector_run(alloc, pool=3, advantage=functools.partial(advantages.grpo, eps=1e-4))
    logs = step_logs(trainer)
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert alloc.results[0].counts.tolist() == [1, 1, 1]  # all unseen: every prompt passes stage 1
    for res, rewards, log in zip(alloc.results, scored, logs, strict=True):
        n = int(res.counts.sum())
        assert set(res.counts.tolist()) <= {0, 1} and "prompt_entropy" not in res.signals
        assert {res.reason_names[int(r)] for r in res.reasons} <= {"selected", "out_of_band"}  # never pruned
        assert_close(res.rewards, torch.tensor(rewards[:n], dtype=torch.float32))
        assert log["rolloutopt/alloc/padded_rows"] == 4.0 - n


TWO_PROCESS_ALLOC_SCRIPT = """
import functools, json, os, sys
sys.path.insert(0, {here!r})
import torch
import test_trl_trainer as t
from rolloutopt.allocators import DPS
alloc = t.spy(functools.partial(DPS, n=2, seed=3))
trainer, seen, scored = t.selector_run(alloc, pool=6, per_device=2)
assert trainer.accelerator.num_processes == 2
out = dict(
    seen=seen, scored=scored,
    ids=[r.prompt_ids.tolist() for r in alloc.results], rewards=[r.rewards.tolist() for r in alloc.results],
    pi=alloc.predictive(torch.arange(8)).tolist(), loss=[h["loss"] for h in t.step_logs(trainer)],
)
with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:  # not stdout: ranks interleave
    json.dump(out, f)
trainer.accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()
os._exit(0)  # results are on disk: skip interpreter teardown (a C++ thread joined at exit can abort a rank)
"""


def test_selector_allocator_two_processes(tmp_path: Any) -> None:
    """Two processes (gloo): both allocators plan and learn identically; each process trains its slice."""
    here = str(pathlib.Path(__file__).parent)
    script = tmp_path / "two_alloc.py"
    script.write_text(TWO_PROCESS_ALLOC_SCRIPT.format(here=here, out=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"  # no tokenizer thread pool left running at a rank's exit
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    a, b = res
    assert a["ids"] == b["ids"] and a["rewards"] == b["rewards"] and a["pi"] == b["pi"]
    assert len(a["ids"]) == 3 and all(math.isfinite(x) for x in a["loss"])
    for step, ids in enumerate(a["ids"]):
        assert len(ids) == 4  # 2 prompts x 2 generations, no padding
        # process 0 trained the first half of the global batch, process 1 the second
        assert a["seen"][step] + b["seen"][step] == [ALLOC_PROMPTS[i] for i in ids]
        assert_close(a["rewards"][step], a["scored"][step] + b["scored"][step])


# ---------------------------------------------------------------------------------------------------------------
# accelerate launch, 2 CPU processes: each rank's loss is the single-process loss of its share

EQUAL_PROMPTS = ["abc", "hey", "xyz", "cnt"]  # one prompt length: concatenating the ranks' rows needs no re-padding

ACCELERATE_SCRIPT = """
import json, os, sys
sys.path.insert(0, {here!r})
import torch
import datasets
import test_trl_trainer as t
from rolloutopt.integrations.trl import GRPOTrainer

class Capture(GRPOTrainer):
    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if not getattr(self, "captured", False):
            self.captured = True
            rank = self.accelerator.process_index
            saved = {{k: v.detach().cpu() for k, v in inputs.items() if torch.is_tensor(v)}}
            torch.save({{"inputs": saved, "loss": loss.detach().cpu()}}, os.path.join({out!r}, f"rank{{rank}}.pt"))
        return loss

ds = datasets.Dataset.from_dict({{"prompt": t.EQUAL_PROMPTS}})
args = t.config(per_device_train_batch_size=2, num_generations=2, max_steps=2, num_iterations=2,
                **{trl_kw!r})
trainer = Capture(model=t.model(), reward_funcs=t.reward, args=args, train_dataset=ds,
                  processing_class=t.tokenizer(), objective={preset!r})
trainer.train()
assert trainer.accelerator.num_processes == 2 and trainer.accelerator.distributed_type.value == "MULTI_CPU"
logs = [h["loss"] for h in t.step_logs(trainer)]
with open(os.path.join({out!r}, f"logs{{trainer.accelerator.process_index}}.json"), "w") as f:
    json.dump(logs, f)  # a file, not stdout: the ranks' lines can interleave
trainer.accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()
os._exit(0)  # results are on disk: skip interpreter teardown (a C++ thread joined at exit can abort a rank)
"""


@pytest.mark.parametrize(
    ("preset", "trl_kw"),
    [("dapo", {"loss_type": "dapo", "epsilon_high": 0.28}), ("grpo", {"loss_type": "grpo"})],
    ids=["dapo", "grpo"],
)
def test_accelerate_two_cpu_processes_match_one_process(tmp_path: Any, preset: str, trl_kw: dict[str, Any]) -> None:
    """``accelerate launch --num_processes 2`` on the CPU: two steps complete, and the first micro-batch's loss and
    gradient on each rank average (DDP's all-reduce mean) to the single-process loss and gradient on both ranks'
    rows together — the global denominators make the data-parallel split invisible."""
    here = str(pathlib.Path(__file__).parent)
    script = tmp_path / "accel.py"
    script.write_text(ACCELERATE_SCRIPT.format(here=here, out=str(tmp_path), preset=preset, trl_kw=trl_kw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"  # no tokenizer thread pool left running at a rank's exit
    accelerate = pathlib.Path(sys.executable).with_name("accelerate")
    # --multi_gpu selects accelerate's torch.distributed launcher (its --cpu path needs mpirun); the script's
    # GRPOConfig(use_cpu=True) then makes the Accelerator a MULTI_CPU (gloo) world
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads((tmp_path / f"logs{r}.json").read_text()) for r in (0, 1)]
    assert len(logged) == 2 and all(len(x) == 2 and all(math.isfinite(v) for v in x) for x in logged)

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    ds = datasets.Dataset.from_dict({"prompt": EQUAL_PROMPTS})
    args = config(per_device_train_batch_size=4, num_generations=2, **trl_kw)
    trainer = GRPOTrainer(
        model=model(), reward_funcs=reward, args=args, train_dataset=ds, processing_class=tokenizer(),
        objective=preset,
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    real = trainer.accelerator
    # each rank's share, recomputed here as a pretend 2-process world: the loss that rank computed
    for r in ranks:
        trainer.accelerator = PretendWorld(real, 2)
        assert_close(loss_and_grads(trainer._compute_loss, trainer, r["inputs"])[0], r["loss"], rtol=1e-5, atol=1e-7)
    # the identity, in float64 (in fp32 the attention's summation order differs between batch sizes 2 and 4 by
    # ~1e-3 relative on gradients that cancel across a group): mean over ranks == one process on all rows
    trainer.model.double()
    shares = [{k: v.double() if v.is_floating_point() else v for k, v in r["inputs"].items()} for r in ranks]
    per_rank = [loss_and_grads(trainer._compute_loss, trainer, share) for share in shares]
    trainer.accelerator = real
    width = max(sh["completion_ids"].size(1) for sh in shares)  # each process pads to its own longest completion

    def rows(key: str) -> torch.Tensor:  # completions right-padded to one width (harmless: causal, masked out)
        parts = [sh[key] for sh in shares]
        if parts[0].dim() == 2 and not key.startswith("prompt"):
            parts = [torch.nn.functional.pad(x, (0, width - x.size(1))) for x in parts]
        return torch.cat(parts)

    both = {k: rows(k) for k in shares[0] if shares[0][k].dim() >= 1}
    both["num_items_in_batch"] = shares[0]["num_items_in_batch"]
    assert torch.equal(both["num_items_in_batch"], shares[1]["num_items_in_batch"])  # global, all-reduced
    loss, grads = loss_and_grads(trainer._compute_loss, trainer, both)
    assert_close(loss, (per_rank[0][0] + per_rank[1][0]) / 2, rtol=1e-9, atol=1e-12)
    compared = 0
    for g, g0, g1 in zip(grads, per_rank[0][1], per_rank[1][1], strict=True):
        if g is None:
            continue
        assert_close(g, (g0 + g1) / 2, rtol=1e-6, atol=1e-7)  # TRL computes the log-softmax in fp32
        compared += int(g.abs().max() > 1e-4)  # the loss is ~0 on-policy (zero-mean advantages); its gradient is not
    assert compared > 0
