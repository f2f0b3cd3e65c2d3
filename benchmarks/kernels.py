"""The fused kernels + policy_loss against the naive path: peak extra memory and time of forward + backward, on CPU.

Two parts. **Hidden states** (``--part linear``): the naive path is what trainers do today: full logits ``hidden @ weight.T`` ``[N, V]``, divided by the temperature
in place, ``log_softmax``, ``gather`` of the sampled token, then ``policy_loss`` on the ``[B, T]`` log-probs and
``backward``. The fused path is ``token_logprobs(hidden, weight, targets)`` (the chunked torch backend, the CPU
default) followed by the same ``policy_loss`` and ``backward``. Rows marked ``+H`` also compute the entropy
(naive: ``-Σ p log p`` over the full log-softmax) and put it in the loss (``entropy_coef=1e-3``), so its exact
gradient runs too. **Logits** (``--part logits``): given the model's logits ``[N, V]`` (fp32, a leaf standing
for the model output), the naive path is ``log_softmax(logits / T)``, ``gather``, ``-Σ p log p``, ``policy_loss``
and ``backward`` (which allocates ``dlogits`` ``[N, V]``); the fused path is ``logits_logprobs`` (chunked torch
backend, ``dlogits`` written in place into the logits) and the same ``policy_loss``, entropy in the loss on both.

Memory: every variant runs in its own fresh Python process (``subprocess``, one after the other, never in
parallel). The child builds the inputs, runs the variant once on a tiny shape (so libraries, thread pools and
allocator arenas exist), then records its resident set size, resets the kernel's peak-RSS counter (writing ``5``
to ``/proc/self/clear_refs`` resets ``VmHWM``), runs forward + backward and reads ``VmHWM``. Peak extra memory =
``VmHWM`` − the RSS before the call: every byte the call touched beyond the inputs, at its worst moment,
including the gradients ``dh`` ``[N, d]`` and ``dW`` ``[V, d]`` that both paths must produce. RSS rather than a
count of torch allocations, because it is what the machine runs out of; torch's CPU allocator returns large
blocks to the OS on free (glibc ``mmap``), so RSS follows live tensors, and any allocator slack can only make a
path look worse. The "workspace" column subtracts the fp32 ``dh`` and ``dW`` (what no implementation avoids); at
the logits level nothing is subtracted — ``dlogits`` is part of the comparison (in place it costs nothing).

Time: wall time and process CPU time (all threads) of the same forward + backward (median over ``--repeats``
calls; the first call is the memory one), torch's default thread count. The ratios are against the naive path
measured in the same run. On a shared machine the CPU-time ratio is the steadier one: a process that waits for
a core does not accumulate CPU time (OpenMP spin-waits still count, on both paths alike). "mem n/o" is naive
peak / ours, "o/n" ours / naive.
Targets (the project's): peak extra memory independent of N and at least 8x below naive at V = 151,936; time no
worse than 1.5x naive on CPU.

Run: ``python benchmarks/kernels.py`` (about 12 minutes on an idle 2-core machine: ~10 for the hidden-state part,
whose naive path at N = 4,096, V = 151,936 needs about 10 GiB, ~2 for the logits part); ``--part linear`` or
``--part logits`` runs one part; ``--quick`` divides N and V by 8.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from rolloutopt import losses
from rolloutopt.kernels import logits_logprobs, token_logprobs

D = 1024
T = 512  # positions per sequence: logp [N] is viewed as [N / T, T] for policy_loss
TEMPERATURE = 0.7
ENTROPY_COEF = 1e-3
# (V, N, entropy): two N at each V show the peak does not grow with N
CASES = [
    (32_768, 8_192, False),
    (32_768, 2_048, False),
    (32_768, 2_048, True),
    (151_936, 4_096, False),
    (151_936, 1_024, False),
]
# the logits part, entropy always in the loss: two N at each V again
LOGIT_CASES = [
    (32_768, 8_192),
    (32_768, 2_048),
    (151_936, 2_048),
    (151_936, 512),
]
WIDTHS = (7, 5, 8, 8, 9, 7, 7, 9, 9, 9, 7)


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def _inputs(level: str, n: int, v: int, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    b = max(n // T, 1)
    t = n // b
    x: dict[str, Any] = {
        "targets": torch.randint(0, v, (n,), generator=gen),
        "old_logp": -3.0 * torch.rand(b, t, generator=gen) - 0.5,
        "advantages": torch.randn(b, generator=gen),
        "mask": torch.arange(t)[None, :] < torch.randint(t // 4, t + 1, (b, 1), generator=gen),
    }
    if level == "linear":
        x["hidden"] = torch.randn(n, D, generator=gen).requires_grad_()
        x["weight"] = (torch.randn(v, D, generator=gen) / D**0.5).requires_grad_()
    else:  # the model's logits (a leaf), and a pristine copy to restore them between calls (in place)
        x["pristine"] = 2.0 * torch.randn(n, v, generator=gen)
        x["logits"] = x["pristine"].clone().requires_grad_()
    return x


def _step(level: str, path: str, entropy: bool, x: dict[str, Any]) -> float:
    """One forward + backward; returns the loss value. Gradients land in the leaves' ``.grad``."""
    b, t = x["old_logp"].shape
    if level == "logits":
        x["logits"].grad = None
        if path == "naive":
            lp_all = torch.log_softmax(x["logits"] / TEMPERATURE, -1)
            logp = lp_all.gather(1, x["targets"][:, None]).squeeze(1)
            ent = -(lp_all.exp() * lp_all).sum(-1)
            del lp_all
        else:
            logp, ent = logits_logprobs(x["logits"], x["targets"], temperature=TEMPERATURE)
    else:
        x["hidden"].grad = None
        x["weight"].grad = None
        if path == "naive":
            logits = x["hidden"] @ x["weight"].t()
            logits.div_(TEMPERATURE)
            lp_all = torch.log_softmax(logits, -1)
            del logits
            logp = lp_all.gather(1, x["targets"][:, None]).squeeze(1)
            ent = -(lp_all.exp() * lp_all).sum(-1) if entropy else None
            del lp_all
        else:
            logp, ent = token_logprobs(
                x["hidden"], x["weight"], x["targets"], temperature=TEMPERATURE, with_entropy=entropy
            )
    out = losses.policy_loss(
        logp.view(b, t),
        x["old_logp"],
        x["advantages"],
        x["mask"],
        entropy=None if ent is None or not entropy else ent.view(b, t),
        entropy_coef=ENTROPY_COEF if entropy else 0.0,
    )
    out.loss.backward()
    return float(out.loss.detach())


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: warm-up on a tiny shape, then the measured calls."""
    level = spec["level"]
    _step(level, spec["path"], spec["entropy"], _inputs(level, 64, 1024))  # load kernels, thread pools
    x = _inputs(level, spec["n"], spec["v"])
    gc.collect()
    before = _rss_kib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    times, cpu, losses_ = [], [], []
    for i in range(spec["repeats"]):
        if level == "logits" and i:
            with torch.no_grad():
                x["logits"].grad = None
                x["logits"].copy_(x["pristine"])  # the fused path wrote dlogits into them
        t0, c0 = time.perf_counter(), time.process_time()
        losses_.append(_step(level, spec["path"], spec["entropy"], x))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if i == 0:
            peak = _hwm_kib() - before
    grads = 4 * (x["hidden"].numel() + x["weight"].numel()) if level == "linear" else 0  # fp32 dh + dW
    return {
        "peak_mib": peak / 1024,
        "grads_mib": grads / 2**20,
        "ms": statistics.median(times) * 1e3,
        "cpu_ms": statistics.median(cpu) * 1e3,
        "loss": losses_[0],
    }


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def row(cells: list[str]) -> str:
    return "| " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, WIDTHS, strict=True)) + " |"


def table(level: str, cases: list[tuple[int, int, bool]], scale: int, repeats: int) -> None:
    head = ["V", "N", "path", "peak MiB", "workspace", "wall s", "CPU s", "mem n/o", "wall o/n", "CPU o/n", "loss Δ"]
    print(row(head))
    print("|" + "|".join("-" * (w + 2) for w in WIDTHS) + "|")
    for v, n, entropy in cases:
        v, n = v // scale, n // scale
        res = {}
        for path in ("naive", "fused"):
            spec = {"level": level, "path": path, "n": n, "v": v, "entropy": entropy, "repeats": repeats}
            res[path] = run_child(spec)
        base = res["naive"]
        for path, r in res.items():
            name = path + (" +H" if entropy else "")
            ratios = ["—", "—", "—", "—"]
            if path == "fused":
                delta = abs(r["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12)
                ratios = [
                    f"{base['peak_mib'] / max(r['peak_mib'], 1e-3):.1f}x",
                    f"{r['ms'] / base['ms']:.2f}x",
                    f"{r['cpu_ms'] / base['cpu_ms']:.2f}x",
                    f"{delta:.0e}",
                ]
            cells = [str(v), str(n), name, f"{r['peak_mib']:.0f}", f"{r['peak_mib'] - r['grads_mib']:.0f}"]
            print(row([*cells, f"{r['ms'] / 1e3:.1f}", f"{r['cpu_ms'] / 1e3:.1f}", *ratios]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N and V divided by 8")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per variant (median); default 1")
    parser.add_argument("--part", choices=("all", "linear", "logits"), default="all", help="which part to run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return
    scale = 8 if args.quick else 1
    print(
        f"d={D}, T={TEMPERATURE}, fp32, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, repeats {args.repeats}"
    )
    if args.part in ("all", "linear"):
        print("\nHidden states: token_logprobs + policy_loss vs hidden @ W.T, log_softmax, gather, policy_loss\n")
        table("linear", CASES, scale, args.repeats)
    if args.part in ("all", "logits"):
        print("\nLogits: logits_logprobs (in place) + policy_loss vs log_softmax, gather, entropy, policy_loss\n")
        table("logits", [(v, n, True) for v, n in LOGIT_CASES], scale, args.repeats)


if __name__ == "__main__":
    main()
