"""Every allocator against ``Uniform`` on the synthetic prompt population, and plan/update time at scale.

Part 1 (learning): ``rolloutopt.testbed.PromptPopulation`` (1,000 prompts, latent difficulty N(1, 2²) on the
logit scale, Bernoulli rewards; a prompt's pass rate rises with the rollouts it had in groups with reward
variance). Every step each allocator gets the same budget, 1,024 rollouts, and a fresh random pool of candidate
prompts; the baseline is GRPO's shape, ``Uniform(n=8)`` over 128 prompts, the others see 256 candidates (a
candidate costs nothing until it is rolled out) and decide. Printed: rollouts until the population's mean pass
rate reaches the target, as a ratio to ``Uniform`` (lower is better; median over seeds), and the fraction of
rollouts that landed in zero-variance groups. Experimental (reconstructed) allocators run with
``experimental=True``.

Part 2 (speed): 100,000 prompts; the allocator's history is first fed one step of 1,000,000 rollouts (10 per
prompt); then one ``plan`` conversation (plan, every next/observe, finish; the rewards are drawn beforehand) and
one ``update`` are timed (median of repeats). Target: under 50 ms each. DEPO requires one response entropy
per rollout (``plan.observe(request, rewards, entropy=...)``), which ``PromptPopulation`` does not model (it has
rewards, no responses): it gets seeded synthetic entropies, uniform on [0, 1) and independent of the reward,
passed with the rewards of each request (in Part 2 drawn with the rewards, outside the timed conversation), so
its Part 1 row shows the filter's mechanics with an uninformative explorability score, not DEPO's merit. The
V0.5 budget rule (``V05Budget``) runs standalone: with no trainer-supplied request its plan calls
``rolloutopt.advantages.v05`` itself (prior: past mean reward, 0.5 unseen), and that call is part of its plan
time. HIVE runs without prompt entropies (its probe is answered with nothing, so its stage 2 is skipped).

Part 3 (one table, token budgets): GRESO, DPS, Knapsack and CoBA, and a ``ResponseLengths``, share one
``PromptTable`` of 100,000 prompts; each step is planned with a ``TokenBudget`` (responses of 40-103 tokens). The
plan time includes ``lengths.budget`` (the candidates' expected lengths), not the draws; "lengths" is
``ResponseLengths.update``.

Run: ``python benchmarks/allocators.py`` (``--quick``: fewer seeds and steps; ``--speed-only``: Parts 2 and 3).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from rolloutopt import allocators as A
from rolloutopt.testbed import PromptPopulation, run

BUDGET = 1024
TARGET = 0.6
STEPS = 400


class SyntheticEntropies:
    """DEPO on the testbed: each rollout gets a seeded synthetic response entropy, uniform on [0, 1) and
    independent of its reward (``PromptPopulation`` has no responses), observed with the rewards of its request;
    everything else is DEPO's own. ``signals(request)`` draws them (Part 2 calls it outside the timed part and
    passes them to ``observe``); a request observed without them gets them drawn in ``observe`` (Part 1, where
    the testbed's ``run_step`` answers with rewards only)."""

    def __init__(self, inner: Any, seed: int = 0) -> None:
        self.inner = inner
        self.gen = torch.Generator().manual_seed(seed)

    def signals(self, request: A.Request) -> dict[str, torch.Tensor]:
        """The entropies of ``request``'s rollouts, ``[request.total]``, when it asks for them."""
        if "entropy" not in request.signals:
            return {}
        return {"entropy": torch.rand(request.total, generator=self.gen, dtype=torch.float64)}

    def plan(self, prompt_ids: torch.Tensor, budget: int) -> Any:
        return _WithEntropies(self.inner.plan(prompt_ids, budget), self)

    def update(self, result: Any) -> None:
        self.inner.update(result)  # reads result.signals["entropy"]

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.gen.set_state(state["gen"])


class _WithEntropies:
    """DEPO's conversation, with the synthetic entropies added to an ``observe`` that came without them."""

    def __init__(self, plan: Any, owner: SyntheticEntropies) -> None:
        self.plan = plan
        self.owner = owner

    def next(self) -> A.Request | None:
        return self.plan.next()

    def observe(self, request: A.Request, rewards: torch.Tensor | None, **signals: torch.Tensor) -> None:
        if "entropy" not in signals:
            signals.update(self.owner.signals(request))
        self.plan.observe(request, rewards, **signals)

    def finish(self) -> Any:
        return self.plan.finish()


def contenders() -> dict[str, Callable[[], Any]]:
    """Fresh allocator per run (paper defaults; experimental ones acknowledged), with its candidate pool size."""
    return {
        "Uniform (n=8)": lambda: A.Uniform(n=8),
        "DAPODynamicSampling": lambda: A.DAPODynamicSampling(seed=0),
        "VIGOR": lambda: A.VIGOR(experimental=True),
        "PilotCommit": lambda: A.PilotCommit(seed=0),
        "PromptGDRO": lambda: A.PromptGDRO(seed=0, experimental=True),
        "RolloutGDRO": lambda: A.RolloutGDRO(seed=0, experimental=True),
        "DPS": lambda: A.DPS(seed=0),
        "GRESO": lambda: A.GRESO(seed=0, steps_per_epoch=10, train_batch_size=128),
        "CoBA": lambda: A.CoBA(),
        "Knapsack": lambda: A.Knapsack(),
        "DARS": lambda: A.DARS(seed=0),
        "E3Budget": lambda: A.E3Budget(seed=0),
        "AR3PO": lambda: A.AR3PO(seed=0, experimental=True),
        "AERO": lambda: A.AERO(seed=0, experimental=True),
        "DOTS": lambda: A.DOTS(seed=0, experimental=True),
        "XRPO": lambda: A.XRPO(seed=0, experimental=True),
        "HIVE (no prompt entropy)": lambda: A.HIVE(seed=0, experimental=True),
        "DEPO (random entropy)": lambda: SyntheticEntropies(A.DEPO(seed=0), seed=0),
        "V05Budget": lambda: A.V05Budget(experimental=True),
    }


def learning(seeds: list[int], steps: int) -> None:
    print(f"Part 1: budget {BUDGET} rollouts/step, target mean pass rate {TARGET}, seeds {seeds}")
    print(f"| {'allocator':24} | {'rollouts to target (median)':>28} | {'vs Uniform':>10} | {'zero-var frac':>13} |")
    print(f"|{'-' * 26}|{'-' * 30}|{'-' * 12}|{'-' * 15}|")
    base: float | None = None
    for name, make in contenders().items():
        rollouts, zv, missed = [], [], 0
        for seed in seeds:
            pool = 128 if name.startswith("Uniform") else 256
            try:
                out = run(make(), PromptPopulation(seed=seed), BUDGET, steps, TARGET, pool_size=pool, seed=seed)
            except Exception as e:  # report, do not hide: an allocator that cannot run here says why
                print(f"| {name:24} | failed: {type(e).__name__}: {str(e)[:60]} |")
                break
            zv.append(out["zero_variance_frac"])
            if out["reached"]:
                rollouts.append(out["rollouts_to_target"])
            else:
                missed += 1
        else:
            med = statistics.median(rollouts) if rollouts else float("nan")
            if base is None:
                base = med
            note = f" ({missed} seeds missed)" if missed else ""
            ratio = med / base if base else float("nan")
            print(f"| {name:24} | {med:>20,.0f}{note:>8} | {ratio:9.2f}x | {statistics.mean(zv):13.3f} |", flush=True)


def speed(repeats: int) -> None:
    p = 100_000
    ids = torch.arange(p) * 7 + 3
    gen = torch.Generator().manual_seed(0)
    truth = torch.rand(p, generator=gen, dtype=torch.float64)
    print(f"\nPart 2: {p:,} prompts, history fed 1,000,000 rollouts first; median of {repeats}")
    print(f"| {'allocator':24} | {'plan ms':>9} | {'update ms':>9} | {'rollouts':>9} |")
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 11}|{'-' * 11}|")

    def converse(alloc: Any, budget: Any) -> tuple[Any, float]:
        """One step through ``run_step`` (no update); its time without the reward (and synthetic signal) draws:
        the engine's cost, not the allocator's. A probe (HIVE's prompt entropy) is answered with nothing, as the
        testbed does; a token plan gets 40 + id % 64 tokens per response."""
        drawing = [0.0]
        synthetic = getattr(alloc, "signals", lambda req: {})  # signals the testbed synthesises (DEPO's entropies)

        def generate(req: A.Request) -> Any:
            if req.is_probe:
                return None
            t1 = time.perf_counter()
            rep = req.prompt_ids.repeat_interleave(req.counts)
            out = {"rewards": torch.bernoulli(truth[torch.searchsorted(ids, rep)], generator=gen), **synthetic(req)}
            if "tokens" in req.signals:
                out["tokens"] = (40 + rep % 64).double()
            drawing[0] += time.perf_counter() - t1
            return out

        start = time.perf_counter()
        res = A.run_step(alloc, ids, budget, generate, update=False)
        return res, time.perf_counter() - start - drawing[0]

    for name, make in contenders().items():
        try:
            alloc = make()
            warm, _ = converse(alloc, 10 * p)  # feeds the history with ~1,000,000 rollouts
            alloc.update(warm)
            plans, updates, n = [], [], 0
            for _ in range(repeats):
                res, dt = converse(alloc, 8 * p)
                plans.append(dt * 1e3)
                t0 = time.perf_counter()
                alloc.update(res)
                updates.append((time.perf_counter() - t0) * 1e3)
                n = res.rewards.numel()
        except Exception as e:
            print(f"| {name:24} | failed: {type(e).__name__}: {str(e)[:60]} |")
            continue
        print(
            f"| {name:24} | {statistics.median(plans):9.1f} | {statistics.median(updates):9.1f} | {n:9,} |", flush=True
        )


def shared(repeats: int) -> None:
    """Part 3: allocators sharing one PromptTable at 100k prompts, and token budgets (ResponseLengths on the same
    table): plan and update time of each owner, median of ``repeats``."""
    p = 100_000
    ids = torch.arange(p) * 7 + 3
    gen = torch.Generator().manual_seed(0)
    truth = torch.rand(p, generator=gen, dtype=torch.float64)
    table = A.PromptTable(capacity=2 * p)
    owners = {
        "GRESO": A.GRESO(seed=0, steps_per_epoch=10, train_batch_size=128, table=table),
        "DPS": A.DPS(seed=0, table=table),
        "Knapsack": A.Knapsack(table=table),
        "CoBA": A.CoBA(table=table),
    }
    lengths = A.ResponseLengths(prior=64.0, table=table)
    print(f"\nPart 3: {p:,} prompts, {len(owners)} allocators and ResponseLengths on one PromptTable; token budget")
    print(
        f"| {'allocator (shared table)':24} | {'plan ms':>9} | {'update ms':>9} | {'lengths ms':>10} | {'tokens':>11} |"
    )
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 11}|{'-' * 12}|{'-' * 13}|")

    drawing = [0.0]

    def generate(req: A.Request) -> Any:
        t0 = time.perf_counter()
        rep = req.prompt_ids.repeat_interleave(req.counts)
        r = torch.bernoulli(truth[torch.searchsorted(ids, rep)], generator=gen)
        out = {"rewards": r, "tokens": (40 + rep % 64).double()}
        drawing[0] += time.perf_counter() - t0
        return out

    for name, alloc in owners.items():
        plans, updates, lens, tokens = [], [], [], 0.0
        for k in range(repeats + 1):
            drawing[0] = 0.0
            t0 = time.perf_counter()
            budget = lengths.budget(8 * p * 72, ids)  # the expected lengths are part of a token plan's cost
            res = A.run_step(alloc, ids, budget, generate, update=False)
            t1 = time.perf_counter()
            alloc.update(res)
            t2 = time.perf_counter()
            lengths.update(res)
            t3 = time.perf_counter()
            if k:  # the first step fills the table
                plans.append((t1 - t0 - drawing[0]) * 1e3)  # the conversation without the reward and length draws
                updates.append((t2 - t1) * 1e3)
                lens.append((t3 - t2) * 1e3)
                tokens = float(res.metrics["tokens"])
        print(
            f"| {name:24} | {statistics.median(plans):9.1f} | {statistics.median(updates):9.1f} | "
            f"{statistics.median(lens):10.1f} | {tokens:11,.0f} |",
            flush=True,
        )
    print(f"table: {len(table):,} prompts, owners {', '.join(table.owners)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--speed-only", action="store_true", help="skip Part 1 (learning)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, threads 1, {platform.processor() or platform.machine()}")
    if not args.speed_only:
        learning([0, 1] if args.quick else [0, 1, 2], 150 if args.quick else STEPS)
    speed(2 if args.quick else 5)
    shared(2 if args.quick else 5)


if __name__ == "__main__":
    main()
