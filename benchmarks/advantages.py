"""Every advantage estimator on 65,536 rollouts, timed against ``grpo`` in the same run.

Cases: (a) equal groups of 8 in consecutive order and (b) ragged groups of random sizes 1–32 in shuffled order.
Each estimator gets the inputs it needs (binary correctness rewards, K = 3 reward components, per-token
log-probs, entropies and a right-padded mask with T = 8), built once; a ``Groups`` is built once per case and
passed to every call, as a training step would. Times are medians over repeats after a warmup, with input
validation on (the default), one torch thread. Our target: every estimator within 5x of ``grpo``. The
``grpo + to_tokens`` row (not an estimator) shows what writing one ``[B, T]`` tensor costs next to ``grpo``'s
``[B]`` work: estimators that read or write ``[B, T]`` tensors pay that several times.

Run: ``python benchmarks/advantages.py``.
"""

from __future__ import annotations

import platform
import warnings
from collections.abc import Callable
from typing import Any

import torch

from _common import B, T, case_ids, timeit  # benchmarks/ is on sys.path when run as a script
from rolloutopt import advantages as A
from rolloutopt.groups import Groups

K = 3
REPEATS = 20


def make_case(case: str, gen: torch.Generator) -> dict[str, Any]:
    ids = case_ids(case, gen)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    correct = (torch.rand(B, generator=gen) > 0.5).float()
    logp = -torch.rand(B, T, generator=gen) * 3
    g = Groups(ids)
    return {
        "g": g,
        "binary": correct,
        "continuous": correct + 0.3 * torch.randn(B, generator=gen),
        "components": torch.stack(
            [correct, (torch.rand(B, generator=gen) > 0.3).float(), torch.rand(B, generator=gen)], 1
        ),
        "logp": logp,
        "ref_logp": logp + 0.1 * torch.randn(B, T, generator=gen),
        "entropy": torch.rand(B, T, generator=gen) * 2,
        "mask": mask,
        "lengths": lengths,
        "flawed": torch.rand(B, generator=gen) > 0.8,
        "prior": g.broadcast((g.mean(correct) + 0.2 * torch.randn(g.num_groups, generator=gen)).clamp(0.05, 0.95)),
        "answers": torch.randint(0, 4, (B,), generator=gen),
        "invalid": torch.rand(B, generator=gen) > 0.9,
        "adv": A.grpo(correct, g, singleton="raw").advantages,
    }


def estimators(d: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    g, r, rc, m = d["g"], d["binary"], d["continuous"], d["mask"]
    nat_gen = torch.Generator().manual_seed(1)
    return {
        "grpo": lambda: A.grpo(rc, g),
        "grpo + to_tokens": lambda: A.to_tokens(A.grpo(rc, g).advantages, m),  # context: [B, T] output cost
        "mc_grpo": lambda: A.mc_grpo(rc, g, singleton="pivot"),
        "gapo": lambda: A.gapo(rc, g),
        "drpo": lambda: A.drpo(r, g, d["logp"], m, max_len=T),
        "fapo_penalty": lambda: A.fapo_penalty(r, d["flawed"]),
        "dler_normalise": lambda: A.dler_normalise(r, g),
        "truncation_penalty": lambda: A.truncation_penalty(r, d["lengths"], budget=T - 1),
        "gdpo (sequence)": lambda: A.gdpo(d["components"], g),
        "gdpo (token)": lambda: A.gdpo(d["components"], g, final="token", mask=m),
        "gd2po": lambda: A.gd2po(d["components"], g, m),
        "ace": lambda: A.ace(r, g, d["logp"], d["ref_logp"], mask=m, experimental=True),
        "xrpo_sharpen": lambda: A.xrpo_sharpen(r, g, d["logp"], mask=m),
        "v05": lambda: A.v05(r, g, d["prior"], experimental=True),
        "dare_rewards": lambda: A.dare_rewards(d["answers"], g, experimental=True),
        "d3s": lambda: A.d3s(d["adv"], g, d["entropy"], m, progress=0.5),
        "nat_weights": lambda: A.nat_weights(m, generator=nat_gen),
        "latent_mask": lambda: A.latent_mask(rc, g, invalid=d["invalid"]),
        "rloo": lambda: A.rloo(rc, g),
        "reinforce_pp_baseline": lambda: A.reinforce_pp_baseline(rc, g, m),
    }


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="rolloutopt: a group of size 1")
    gen = torch.Generator().manual_seed(0)
    print(f"B={B}, T={T}, K={K}, torch {torch.__version__}, threads 1, {platform.processor() or platform.machine()}")
    print(f"| {'estimator':22} | {'equal ms':>9} | {'vs grpo':>8} | {'ragged ms':>9} | {'vs grpo':>8} |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 10}|{'-' * 11}|{'-' * 10}|")
    results: dict[str, dict[str, float]] = {}
    for case in ("equal", "ragged"):
        fns = estimators(make_case(case, gen))
        for name, fn in fns.items():
            results.setdefault(name, {})[case] = timeit(fn, REPEATS)
    for name, row in results.items():
        eq, rg = row["equal"], row["ragged"]
        ratio_eq, ratio_rg = eq / results["grpo"]["equal"], rg / results["grpo"]["ragged"]
        print(f"| {name:22} | {eq:9.2f} | {ratio_eq:7.1f}x | {rg:9.2f} | {ratio_rg:7.1f}x |")


if __name__ == "__main__":
    main()
