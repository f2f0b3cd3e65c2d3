"""Every streaming stop rule on the generation simulator: tokens saved and premature stops; then ``step`` time.

Part 1 (savings): ``rolloutopt.testbed.generation.GenerationSimulator`` with its defaults (horizon 1,024 tokens,
median length 400, 8 rollouts per prompt, top-k 20, prompt pass rates sigma(N(0, 2^2)), a latent failure point
in every failing rollout after which the signals degrade; see its docstring). Per seed, 64 prompts = 512
rollouts are drawn; every stop rule in ``rolloutopt.control`` is driven over them with
``rolloutopt.control.replay`` (``active`` = the simulator's mask), fed the inputs it declares. Printed, as means
over the seeds (with the standard deviation across seeds): the fraction of tokens saved against running every
rollout to EOS or the horizon, the stop rate, the premature-stop rate (stops at a position before the row's
cutoff, ``SimulatedGeneration.cutoff``: before the failure point of a failing rollout; anywhere in a successful
rollout, except that an answer-extracting stop — Step-GRPO's "confident", DEER's "early_exit", DUET's
"answered" — is justified from the answer token on), the share of successful rollouts stopped prematurely, and
the share of "doomed" tokens (after failure points) saved. ``Oracle`` stops every failing rollout at its failure
point. Rules that learn across batches get calibration batches first (drawn from the same seed's generator;
ESPO: its warm-up gate forced open and 3 batches of ``update``; ESPO critic-free: 1 batch of ``update``; ARRoL:
2 batches of ``train_head``). Reconstructed rules run with ``experimental=True``; other settings are the
constructors' defaults except where the table says. Then DOT (post-hoc) on the all-correct groups.

Part 2 (speed): one ``step`` of every rule on a live batch of 4,096 rows with top-k 20 (inputs drawn from the
simulator, 64 steps cycled; the state is re-initialised every 128 steps, the rule's checkpoint steps included),
median and mean over the timed steps, with ``rolloutopt.checks(False)`` and with checks on, one torch thread;
Prune-OPD is fed the top-k overlap ``[N]`` an engine computes (its one input); the baseline is ``topk_logp.max(-1)`` on the same ``[4096, 20]`` tensor, timed right after every step (the
"vs baseline" column is the ratio of the medians, so that load drift cancels). Target: under 1 ms.

Run: ``python benchmarks/control.py`` (``--quick``: fewer seeds and steps).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import rolloutopt
from rolloutopt import control as C
from rolloutopt.testbed.generation import GenerationSimulator, SimulatedGeneration

PROMPTS = 64
MARKERS = (1,)  # the simulator's default transition-marker id ("Wait")
ANSWERS = (2,)  # its default answer-marker id (a closing \boxed{})
R_ABS = 0.1  # Abstention's abstention reward (required; no paper default): abstain below a 10% value
FEATURES = 4  # ARRoL head features: running mean regret, running mean entropy, value, marker rate


def features(b: SimulatedGeneration) -> torch.Tensor:
    """Per-token features ``[N, T, 4]`` a quality head could read at its checkpoint (running means so far)."""
    count = torch.arange(1, b.max_tokens + 1, dtype=torch.float32)[None, :]
    regret = (b.topk_logp[..., 0] - b.logp).cumsum(-1) / count
    entropy = b.entropy.cumsum(-1) / count
    markers = torch.isin(b.tokens, torch.tensor(MARKERS)).float().cumsum(-1) / count * 10
    return torch.stack([regret, entropy / 4, b.values, markers], dim=-1)


def topk_overlap(b: SimulatedGeneration, k: int) -> torch.Tensor:
    """Student/teacher top-k overlap ``[N, T]`` over the first ``k`` ids, as an engine would pass it to PruneOPD."""
    s, t = b.topk_ids[..., :k], b.teacher_topk_ids[..., :k]
    return (s[..., :, None] == t[..., None, :]).sum((-1, -2)).clamp(max=k).float() / k


@dataclass
class Recipe:
    """How to build a rule, which per-token inputs to feed it, and which of its stop reasons keep an answer."""

    make: Callable[[], C.StopRule]
    feed: Callable[[SimulatedGeneration], dict[str, torch.Tensor]]
    init: Callable[[SimulatedGeneration], dict[str, Any]] = lambda b: {}
    answer_reasons: tuple[str, ...] = ()
    calibrate: Callable[[C.StopRule, Callable[[], SimulatedGeneration]], None] | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def std(b: SimulatedGeneration) -> dict[str, torch.Tensor]:
    return {"logp": b.logp, "entropy": b.entropy, "topk_logp": b.topk_logp, "tokens": b.tokens}


def calibrate_espo(rule: Any, draw: Callable[[], SimulatedGeneration]) -> None:
    rule.training_progress = 1.0  # the critic warm-up gate is over (forced on at 10% of training)
    with rolloutopt.checks(False):
        for _ in range(3):
            b = draw()
            state = drive(rule, b, RECIPES_BY_CLASS[type(rule).__name__])
            rule.update(state)


def calibrate_espo_steady(rule: Any, draw: Callable[[], SimulatedGeneration]) -> None:
    calibrate_espo(rule, draw)
    b = draw()
    lo, hi = rule.beta_min, rule.beta_max
    with rolloutopt.checks(False):
        for _ in range(8):  # bisection on beta: the stop rate falls as beta rises
            rule.beta = (lo + hi) / 2
            rate = float(drive(rule, b, RECIPES_BY_CLASS["ESPO"]).stopped.float().mean())
            lo, hi = (rule.beta, hi) if rate > rule.target_stop_rate else (lo, rule.beta)
    rule.beta = (lo + hi) / 2
    STEADY_BETA.append(rule.beta)


def calibrate_critic_free(rule: Any, draw: Callable[[], SimulatedGeneration]) -> None:
    with rolloutopt.checks(False):
        b = draw()
        state = drive(rule, b, RECIPES_BY_CLASS["ESPOCriticFree"])
        rule.update(state, b.success)


def calibrate_arrol(rule: Any, draw: Callable[[], SimulatedGeneration]) -> None:
    for _ in range(2):
        b = draw()
        at = rule.checkpoint - 1
        reach = b.length > at
        rule.train_head(features(b)[reach, at], b.success[reach])


def recipes(t_max: int) -> dict[str, Recipe]:
    """One or more recipes per rule class (the key is the table row)."""
    return {
        "ESPO": Recipe(
            lambda: C.ESPO(),
            lambda b: {**std(b), "values": b.values},
            calibrate=calibrate_espo,
            note="defaults; warm-up forced open; 3 update batches",
        ),
        "ESPO (steady-state beta)": Recipe(
            lambda: C.ESPO(),
            lambda b: {**std(b), "values": b.values},
            calibrate=calibrate_espo_steady,
            note="beta set by bisection where the stop rate of a calibration batch is the controller's target 0.25, "
            "its fixed point (the controller moves beta by 0.1 x (stop rate - 0.25) per batch, about 0.01 here, so "
            "it takes hundreds of batches to get there)",
            extra={"cls": "ESPO"},
        ),
        "ESPOCriticFree": Recipe(
            lambda: C.ESPOCriticFree(experimental=True),
            std,
            calibrate=calibrate_critic_free,
            note="reference from 1 batch",
        ),
        "Abstention": Recipe(
            lambda: C.Abstention(r_abs=R_ABS, experimental=True),
            lambda b: {**std(b), "values": b.values},
            note=f"r_abs={R_ABS} (required; ours), values = critic",
        ),
        "ARRoL": Recipe(
            lambda: C.ARRoL(dim=FEATURES, experimental=True),
            lambda b: {**std(b), "features": features(b)},
            init=lambda b: {"group": b.group},
            calibrate=calibrate_arrol,
            note="head trained on 2 batches; keep_frac 0.5",
        ),
        "StepGRPOTruncation": Recipe(
            lambda: C.StepGRPOTruncation(markers=MARKERS, experimental=True),
            lambda b: {**std(b), "confidence": b.confidence},
            answer_reasons=("confident",),
        ),
        "DEER": Recipe(
            lambda: C.DEER(markers=MARKERS, experimental=True),
            lambda b: {**std(b), "confidence": b.confidence},
            answer_reasons=("early_exit",),
        ),
        "DUETAbort": Recipe(
            lambda: C.DUETAbort(markers=ANSWERS, experimental=True),
            std,
            answer_reasons=("answered",),
            note="horizon 4096 > T: the gate never fires",
        ),
        f"DUETAbort (horizon={t_max // 2})": Recipe(
            lambda: C.DUETAbort(markers=ANSWERS, horizon=t_max // 2, experimental=True),
            std,
            answer_reasons=("answered",),
            note="horizon scaled to T/2",
            extra={"cls": "DUETAbort"},
        ),
        "ECHOPruning": Recipe(
            lambda: C.ECHOPruning(experimental=True),
            std,
            init=lambda b: {"group": b.group},
            note="trees = prompt groups",
        ),
        "PruneOPD": Recipe(
            lambda: C.PruneOPD(experimental=True),
            lambda b: {"overlap": topk_overlap(b, 8)},
            note="the engine passes the top-8 overlap [N] it computed (PruneOPD.overlap on the same ids)",
        ),
        "ESR": Recipe(lambda: C.ESR(), std, note="n=100"),
    }


RECIPES_BY_CLASS: dict[str, Recipe] = {}
ONLY: list[str] = []
STEADY_BETA: list[
    float
] = []  # the betas the steady-state ESPO row found, per seed  # --only: run the rows whose name contains one of these


def drive(rule: C.StopRule, b: SimulatedGeneration, recipe: Recipe) -> C.StopState:
    """The generation loop (as ``replay``), returning the final state (calibration needs it)."""
    per_token = recipe.feed(b)
    state = rule.init(b.num_rows, **recipe.init(b))
    for t in range(b.max_tokens):
        state, _ = rule.step(state, active=b.mask[:, t], **{k: v[:, t] for k, v in per_token.items()})
    return state


def stop_rules() -> list[str]:
    """Class names of every streaming rule (StopRule subclass) in the ``rolloutopt.control`` registry."""
    return sorted(e.obj.__name__ for e in C.REGISTRY.entries() if issubclass(e.obj, C.StopRule))


def score(b: SimulatedGeneration, res: C.StopResult, answer_reasons: tuple[str, ...]) -> dict[str, float]:
    codes = [res.reason_names.index(r) for r in answer_reasons]
    answer = torch.isin(res.reason, torch.tensor(codes, dtype=torch.long)) if codes else False
    kept = b.kept_tokens(res.stopped, res.position)
    prem = b.premature(res.stopped, res.position, answer)
    return metrics(b, kept, res.stopped, prem)


def metrics(b: SimulatedGeneration, kept: torch.Tensor, stopped: torch.Tensor, prem: torch.Tensor) -> dict[str, float]:
    total = float(b.length.sum())
    fail = ~b.success
    doomed = torch.where(fail, b.length - b.fail_at, 0)
    saved_doomed = torch.where(fail, (b.length - kept.clamp_min(b.fail_at)).clamp_min(0), 0)
    return {
        "saved": 1.0 - float(kept.sum()) / total,
        "stop": float(stopped.float().mean()),
        "premature": float(prem.float().mean()),
        "succ_lost": float(prem[b.success].float().mean()) if bool(b.success.any()) else 0.0,
        "doomed_saved": float(saved_doomed.sum()) / max(float(doomed.sum()), 1.0),
    }


def fmt(values: list[float]) -> str:
    m = statistics.mean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:5.2f} ({s:4.2f})"


#: The two settings of Part 1: the simulator's defaults, and a weaker failure signal.
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "weak signal": {"gap_failed": 1.4, "overlap_failed": 0.65, "value_noise": 0.35, "marker_rate_failed": 0.01},
}


def savings(seeds: list[int]) -> None:
    available = stop_rules()
    print(f"stop rules in rolloutopt.control: {', '.join(available)}")
    for label, kw in SETTINGS.items():
        sim = GenerationSimulator(**kw)
        table = recipes(sim.max_tokens)
        RECIPES_BY_CLASS.clear()
        for name, r in table.items():
            RECIPES_BY_CLASS.setdefault(r.extra.get("cls", name), r)
        missing = [n for n in available if n not in RECIPES_BY_CLASS]
        if missing:
            print(f"not driven (no recipe in this script): {', '.join(missing)}")
        given = ", ".join(f"{k}={v}" for k, v in kw.items()) or "all defaults"
        print(
            f"\nPart 1 ({label}): GenerationSimulator({given}) (T={sim.max_tokens}, top-k {sim.top_k}), {PROMPTS} "
            f"prompts x {sim.group_size} = {PROMPTS * sim.group_size} rollouts per seed, seeds {seeds}; "
            "mean (sd over seeds)"
        )
        batches = table_for(sim, table, available, seeds)
        if label == "defaults":
            notes = "; ".join(f"{n}: {r.note}" for n, r in table.items() if r.note)
            dot_batches = batches
    print("\nNotes: " + notes)
    dot_part(dot_batches)


def table_for(
    sim: GenerationSimulator, table: dict[str, Recipe], available: list[str], seeds: list[int]
) -> dict[int, SimulatedGeneration]:
    head = ["rule", "tokens saved", "stop rate", "premature", "succ. lost", "doomed saved"]
    print("| " + " | ".join(f"{h:>12}" if i else f"{h:34}" for i, h in enumerate(head)) + " |")
    print("|" + "|".join("-" * (36 if i == 0 else 14) for i in range(len(head))) + "|")
    rows: dict[str, dict[str, list[float]]] = {}
    batches: dict[int, SimulatedGeneration] = {}
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        batches[seed] = sim.sample(PROMPTS, gen)
    # the oracle: stop every failing rollout at its failure point
    for seed in seeds:
        b = batches[seed]
        fail = ~b.success
        kept = torch.where(fail, torch.minimum(b.fail_at + 1, b.length), b.length)
        m = metrics(b, kept, fail, torch.zeros_like(fail))
        for k, v in m.items():
            rows.setdefault("Oracle (stop at the failure point)", {}).setdefault(k, []).append(v)
    emit("Oracle (stop at the failure point)", rows)
    for name, recipe in table.items():
        if ONLY and not any(o in name for o in ONLY):
            continue
        if recipe.extra.get("part") == "speed":
            continue
        cls = recipe.extra.get("cls", name)
        if cls not in available:
            print(f"| {name:34} | not in rolloutopt.control |")
            continue
        try:
            for seed in seeds:
                b = batches[seed]
                rule = recipe.make()
                if recipe.calibrate is not None:
                    cal = torch.Generator().manual_seed(10_000 + seed)
                    recipe.calibrate(rule, lambda cal=cal: sim.sample(PROMPTS, cal))
                per_token = recipe.feed(b)
                res = C.replay(rule, mask=b.mask, init=recipe.init(b), **per_token)
                for k, v in score(b, res, recipe.answer_reasons).items():
                    rows.setdefault(name, {}).setdefault(k, []).append(v)
        except Exception as e:  # report, do not hide
            print(f"| {name:34} | failed: {type(e).__name__}: {str(e)[:90]} |")
            continue
        emit(name, rows)
    if STEADY_BETA:
        print(f"(steady-state ESPO beta per seed: {', '.join(f'{x:.2f}' for x in STEADY_BETA)})")
        STEADY_BETA.clear()
    return batches


def emit(name: str, rows: dict[str, dict[str, list[float]]]) -> None:
    r = rows[name]
    cells = [fmt(r[k]) for k in ("saved", "stop", "premature", "succ_lost", "doomed_saved")]
    print(f"| {name:34} | " + " | ".join(f"{c:>12}" for c in cells) + " |", flush=True)


def dot_part(batches: dict[int, SimulatedGeneration]) -> None:
    print(
        "\nDOT on the default setting's batches (post-hoc, rolloutopt.control.dot, experimental=True, defaults: IQR fence k=1.5, groups >= 4)"
    )
    print(f"| {'seed':>4} | {'all-correct groups':>18} | {'rows truncated':>14} | {'tokens removed (easy)':>21} |")
    print(f"|{'-' * 6}|{'-' * 20}|{'-' * 16}|{'-' * 23}|")
    fracs = []
    for seed, b in batches.items():
        out = C.dot(b.rewards, b.length, b.group, mask=b.mask, experimental=True)
        g = b.group
        wrong = torch.zeros(int(g.max()) + 1).index_add_(0, g, (~b.success).float())
        easy_row = (wrong == 0)[g]
        easy_tokens = float(b.length[easy_row].sum())
        removed = float((b.length - out.lengths)[easy_row].sum())
        frac = removed / easy_tokens if easy_tokens else 0.0
        fracs.append(frac)
        n_easy = int((wrong == 0).sum())
        print(f"| {seed:>4} | {n_easy:>9} of {int(g.max()) + 1:>5} | {int(out.truncated.sum()):>14} | {frac:>21.3f} |")
    print(f"mean tokens removed on easy groups: {statistics.mean(fracs):.3f}")


# ------------------------------------------------------------------------------------------------ Part 2: speed
def speed(rounds: int, check_modes: tuple[bool, ...] = (False, True)) -> None:
    n, per_round = 4096, 128
    sim = GenerationSimulator(max_tokens=64, length_median=10_000.0)  # every row live for the 64 steps
    b = sim.sample(n // sim.group_size, torch.Generator().manual_seed(0))
    feats = features(b)
    table = recipes(per_round)
    topk = b.topk_logp[:, 0].contiguous()

    def bare() -> None:
        topk.max(-1)

    times = []
    for _ in range(rounds * per_round):
        t0 = time.perf_counter()
        bare()
        times.append(time.perf_counter() - t0)
    base = statistics.median(times) * 1e3
    print(f"\nPart 2: step time, {n} live rows, top-k {sim.top_k}, {rounds * per_round} steps per rule, one thread")
    print(f"baseline topk_logp.max(-1) on [{n}, {sim.top_k}]: median {base * 1e3:.1f} us")
    head = (
        "| rule                               | off median ms | off mean ms | off checkpoint ms | vs baseline "
        "| on median ms | on mean ms |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|")
    for name, recipe in table.items():
        if ONLY and not any(o in name for o in ONLY):
            continue
        if "cls" in recipe.extra and recipe.extra.get("part") != "speed":  # variants: timed as the rule itself
            continue
        cols: list[str] = []
        try:
            for checks_on in check_modes:
                rule = recipe.make()
                per_token = recipe.feed(b)
                if "features" in per_token:
                    per_token["features"] = feats
                prepare_for_speed(rule, b, recipe)
                med, mean, ckpt, paired = time_rule(rule, b, recipe, per_token, rounds, per_round, checks_on, bare)
                if checks_on:
                    cols.append(f"{med:12.3f} | {mean:10.3f}")
                else:
                    cols.append(f"{med:13.3f} | {mean:11.3f} | " + (f"{ckpt:17.3f}" if ckpt else f"{'-':>17}"))
                    cols.append(f"{med / paired:10.1f}x")
        except Exception as e:
            print(f"| {name:34} | failed: {type(e).__name__}: {str(e)[:90]} |")
            continue
        print(f"| {name:34} | " + " | ".join(cols) + " |", flush=True)
    times = []
    for _ in range(rounds * per_round):
        t0 = time.perf_counter()
        bare()
        times.append(time.perf_counter() - t0)
    print(f"baseline again after the rules: median {statistics.median(times) * 1e6:.1f} us")


def prepare_for_speed(rule: Any, b: SimulatedGeneration, recipe: Recipe) -> None:
    """Put a learning rule in its trained regime (so its step does the full work)."""
    name = type(rule).__name__
    if name == "ESPO":
        rule.training_progress = 1.0
        rule.mu, rule.var = 1.0, 4.0
    elif name == "ESPOCriticFree":
        rule.rho_bar, rule.s_rho = 0.4, 1.0
    elif name == "ARRoL":
        f = features(b)[:, -1]
        rule.train_head(f, b.success)


def time_rule(
    rule: C.StopRule,
    b: SimulatedGeneration,
    recipe: Recipe,
    per_token: dict[str, torch.Tensor],
    rounds: int,
    per_round: int,
    checks_on: bool,
    bare: Callable[[], None],
) -> tuple[float, float, float | None, float]:
    """Median and mean ms of ``step`` over the timed steps, the median over checkpoint steps (None if none), and
    the median ms of the baseline op timed right after every step (paired, so that load drift cancels)."""
    t_len = b.max_tokens
    steps = [{k: v[:, t].contiguous() for k, v in per_token.items()} for t in range(t_len)]
    active = torch.ones(b.num_rows, dtype=torch.bool)
    init = recipe.init(b)
    due_keys = set(getattr(rule, "_due_inputs", {})) if hasattr(rule, "due") else set()
    times, ckpt, base = [], [], []
    with rolloutopt.checks(checks_on):
        for r in range(rounds + 1):  # round 0 is a warm-up
            state = rule.init(b.num_rows, **init)
            for t in range(per_round):
                x = steps[t % t_len]
                at_checkpoint = False
                if due_keys:  # checkpoint inputs only at checkpoint steps, as the rule's docs ask (due() untimed)
                    due = rule.due(state, active)  # type: ignore[attr-defined]
                    at_checkpoint = bool(due.any())
                    if not at_checkpoint:
                        x = {k: v for k, v in x.items() if k not in due_keys}
                t0 = time.perf_counter()
                state, _ = rule.step(state, active=active, **x)
                dt = time.perf_counter() - t0
                t1 = time.perf_counter()
                bare()
                db = time.perf_counter() - t1
                if r:
                    base.append(db)
                    times.append(dt)
                    if at_checkpoint:
                        ckpt.append(dt)
    at = statistics.median(ckpt) * 1e3 if ckpt else None
    return statistics.median(times) * 1e3, statistics.mean(times) * 1e3, at, statistics.median(base) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=("1", "2", "both"), default="both")
    parser.add_argument("--only", default="", help="comma-separated substrings of the rule rows to run")
    args = parser.parse_args()
    ONLY.extend(o for o in args.only.split(",") if o)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    now = datetime.datetime.now(datetime.UTC).strftime("%a %b %d %H:%M:%S UTC %Y")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{now}; torch {torch.__version__}, threads 1, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load:.1f}"
    )
    if args.part in ("1", "both"):
        savings([0, 1] if args.quick else [0, 1, 2, 3, 4])
    if args.part in ("2", "both"):
        speed(1 if args.quick else 3)


if __name__ == "__main__":
    main()
