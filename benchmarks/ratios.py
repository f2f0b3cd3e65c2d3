"""Every loss preset through ``policy_loss``: forward + backward time against ``grpo`` and against verl 0.9.1.

Shape: B = 512 sequences, T = 4,096 positions (right-padded, lengths uniform in [1, T]), fp32, one torch
thread, checks on (the default). Each preset gets every input it may need, built once: proximal, behaviour
(rollout-engine) and reference log-probs with realistic mismatch, per-token policy versions (up to 4 behind),
top-K log-probs (K = 20) and a per-sequence confidence. A call is ``preset(...)`` followed by
``loss.backward()``; times are medians over repeats after a warm-up. The ``verl`` column runs verl 0.9.1's own
loss on the same tensors (for ``tis`` and ``icepop``: verl's rollout-correction helper computing the weights,
then its ``vanilla`` loss with them), as ``verl/workers/utils/losses.py`` calls it.

Both columns are measured twice: with input validation on (the default: finiteness and mask checks cost a few
host synchronisations) and with ``rolloutopt.checks(False)`` (the production / ``torch.compile`` setting).
Our target: no preset more than 2x ``grpo``, except where the method needs a second pass.

Run: ``python benchmarks/ratios.py`` (add ``--quick`` for B = 64).
"""

from __future__ import annotations

import argparse
import platform
import warnings
from collections.abc import Callable
from typing import Any

import torch

import rolloutopt
from _common import timeit  # benchmarks/ is on sys.path when run as a script
from rolloutopt import losses

K = 20
REPEATS = 7
WIDTHS = (16, 7, 7, 13, 7, 7, 9, 8)
NO_DUAL = 1e9


def make_inputs(b: int, t: int, gen: torch.Generator) -> dict[str, Any]:
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -3.0 * torch.rand(b, t, generator=gen) - 0.01
    behav = old + 0.05 * torch.randn(b, t, generator=gen)  # rollout-engine mismatch
    logp = old + 0.1 * torch.randn(b, t, generator=gen)  # a few optimiser steps away from old
    versions = 10 - torch.randint(0, 5, (b, 1), generator=gen) + (torch.arange(t)[None, :] * 3 // t)
    topk_behav = torch.log_softmax(torch.randn(b, t, K, generator=gen), -1) - 0.5
    return {
        "logp": logp,
        "old_logp": old,
        "advantages": torch.randn(b, generator=gen),
        "mask": mask,
        "behav_logp": behav,
        "versions": versions.clamp(max=12),
        "policy_version": 12,
        "topk_behav_logp": topk_behav,
        "topk_logp": topk_behav + 0.05 * torch.randn(b, t, K, generator=gen),
        "confidence": torch.rand(b, generator=gen),
    }


def ours(name: str, x: dict[str, Any]) -> Callable[[], Any]:
    preset = losses.get(name)
    kwargs: dict[str, Any] = {k: x[k] for k in preset.requires}
    if "behav_logp" not in kwargs:
        kwargs["behav_logp"] = x["behav_logp"]
    if preset.config.get("agg") == "seq-mean-token-sum-norm":
        kwargs["max_len"] = x["mask"].shape[1]
    if preset.experimental is not None:
        kwargs["experimental"] = True

    def run() -> None:
        lp = x["logp"].clone().requires_grad_()
        preset(lp, x["old_logp"], x["advantages"], x["mask"], **kwargs).loss.backward()

    return run


def verl_runs(x: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    try:
        from verl.trainer.ppo import core_algos, rollout_corr_helper
        from verl.workers.config import ActorConfig
    except ImportError:
        return {}
    adv = x["advantages"][:, None].expand_as(x["logp"])
    mask = x["mask"].float()

    def config(**kw: Any) -> Any:
        return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **kw)

    def loss(name: str, agg: str, cfg: Any, threshold: str | float | None = None) -> Callable[[], Any]:
        fn = core_algos.get_policy_loss_fn(name)

        def run() -> None:
            weights = None
            if threshold is not None:
                w, _ = rollout_corr_helper.compute_rollout_correction_weights(
                    x["old_logp"] - x["behav_logp"], mask, rollout_is="token", rollout_is_threshold=threshold
                )
                weights = w
            lp = x["logp"].clone().requires_grad_()
            out, _ = fn(
                old_log_prob=x["old_logp"], log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode=agg,
                config=cfg, rollout_is_weights=weights,
            )  # fmt: skip
            out.backward()

        return run

    vanilla = config(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=NO_DUAL)
    return {
        "grpo": loss("vanilla", "seq-mean-token-mean", vanilla),
        "dapo": loss("vanilla", "token-mean", config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=NO_DUAL)),
        "gspo": loss("gspo", "seq-mean-token-mean", config(clip_ratio_low=3e-4, clip_ratio_high=4e-4)),
        "cispo": loss("cispo", "token-mean", config(clip_ratio_low=10.0, clip_ratio_high=0.2)),
        "sapo": loss("sapo", "seq-mean-token-mean", config()),
        "tis": loss("vanilla", "token-mean", config(clip_ratio_c=NO_DUAL), threshold=2.0),
        "icepop": loss("vanilla", "token-mean", config(clip_ratio_c=NO_DUAL), threshold="0.5_5.0"),
        "dr_grpo": loss("vanilla", "seq-mean-token-sum-norm", vanilla),
        "dppo_tv": loss("dppo_tv", "seq-mean-token-sum-norm", config(clip_ratio_low=0.15, clip_ratio_high=0.15)),
        "dppo_kl": loss("dppo_kl", "seq-mean-token-sum-norm", config(clip_ratio_low=0.05, clip_ratio_high=0.05)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B = 64 instead of 512")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    b, t = (64 if args.quick else 512), 4096
    x = make_inputs(b, t, torch.Generator().manual_seed(0))
    print(
        f"B={b}, T={t}, K={K}, fp32, torch {torch.__version__}, threads 1, {platform.processor() or platform.machine()}"
    )
    head = ("preset", "ms", "vs grpo", "checks off ms", "vs grpo", "verl ms", "ours/verl", "off/verl")
    print("| " + " | ".join(f"{h:>{w}}" for h, w in zip(head, WIDTHS, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in WIDTHS) + "|")
    verl = verl_runs(x)
    base = timeit(ours("grpo", x), REPEATS)
    with rolloutopt.checks(False):
        base_off = timeit(ours("grpo", x), REPEATS)
    for name in losses.names():
        ms = base if name == "grpo" else timeit(ours(name, x), REPEATS)
        with rolloutopt.checks(False):
            off = base_off if name == "grpo" else timeit(ours(name, x), REPEATS)
        row = [name, f"{ms:.1f}", f"{ms / base:.2f}x", f"{off:.1f}", f"{off / base_off:.2f}x"]
        if name in verl:
            vms = timeit(verl[name], REPEATS)
            row += [f"{vms:.1f}", f"{ms / vms:.2f}x", f"{off / vms:.2f}x"]
        else:
            row += ["—", "—", "—"]
        print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(row, WIDTHS, strict=True)) + " |", flush=True)


if __name__ == "__main__":
    main()
