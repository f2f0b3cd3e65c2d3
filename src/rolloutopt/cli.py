"""Command line of rolloutopt: ``python -m rolloutopt demo`` (a short RL run on a toy task, on the CPU).

``--loss NAME`` runs any registered loss preset; the testbed supplies the inputs the preset consumes and simulates
the setting it was built for (an engine mismatch, stale or partial rollouts; :func:`rolloutopt.testbed.train.
scenario`), which ``--mismatch`` and ``--staleness`` override. ``rich`` (the ``demo`` extra) draws the progress
bar and the result table; without it the output is plain text. Bad arguments are usage errors (exit status 2).
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any, TextIO, cast

import torch

from rolloutopt import losses
from rolloutopt.errors import InputError
from rolloutopt.testbed.task import VOCAB_SIZE

__all__ = ["demo", "demo_config", "main", "parse_args"]

QUICK_STEPS = 40


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def _topk(text: str) -> int:
    value = _int_at_least(1)(text)
    if value > VOCAB_SIZE:
        raise argparse.ArgumentTypeError(f"expected an int in [1, {VOCAB_SIZE}] (the vocabulary size), got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="rolloutopt", description="rolloutopt command line tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a tiny policy with RL on a toy verifiable task (reverse a digit string), on the CPU",
        description="A short, seeded RL run: rolloutopt.advantages.grpo + a loss preset ('grpo' by default). "
        "Presets that read a rollout engine's log-probs, policy versions or top-K log-probs run under a "
        "simulated engine mismatch or stale (partial) rollouts; the result table says which.",
    )
    names = losses.names()
    demo.add_argument("--steps", type=_int_at_least(1), default=None, help="training steps (default: 150, --quick: 40)")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of every generator (default: 0)")
    demo.add_argument("--quick", action="store_true", help=f"a {QUICK_STEPS}-step smoke run")
    demo.add_argument(
        "--loss", default="grpo", choices=names, metavar="NAME", help=f"loss preset (default: grpo): {', '.join(names)}"
    )
    demo.add_argument(
        "--mismatch",
        type=_non_negative_float,
        default=None,
        metavar="SCALE",
        help="relative weight noise of the rollout engine, an engine/trainer mismatch (default: 0.05 for presets "
        "built for one, e.g. tis, icepop, dppo_tv; 0 otherwise; 0 turns it off)",
    )
    demo.add_argument(
        "--staleness",
        type=_int_at_least(0),
        default=None,
        metavar="K",
        help="rollouts from the policy K training steps behind (default: 2 for presets built for stale or partial "
        "rollouts, e.g. decoupled_ppo, copris, m2po; 0 otherwise)",
    )
    demo.add_argument("--topk", type=_topk, default=8, metavar="K", help="K of the top-K log-prob inputs (default: 8)")
    demo.add_argument("--prompts", type=_int_at_least(1), default=16, help="prompts per step (default: 16)")
    demo.add_argument("--group-size", type=_int_at_least(2), default=8, help="rollouts per prompt (default: 8)")
    demo.add_argument(
        "--holdout", type=_int_at_least(0), default=500, help="held-out prompts, never trained on (default: 500)"
    )
    demo.add_argument(
        "--eval-samples",
        type=_int_at_least(0),
        default=4,
        help="sampled answers per held-out prompt in the evaluation (default: 4; 0 skips the sampled reward)",
    )
    demo.add_argument("--threads", type=_int_at_least(1), default=1, help="torch CPU threads (default: 1)")
    demo.add_argument("--plain", action="store_true", help="plain text output even if rich is installed")
    from rolloutopt.arena.cli import add_parser

    add_parser(sub)
    return parser, demo


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line (``sys.argv[1:]`` when None); a bad argument exits with a usage error (status 2)."""
    return _parsers()[0].parse_args(None if argv is None else list(argv))


def demo_config(args: argparse.Namespace) -> Any:
    """The :class:`~rolloutopt.testbed.TrainConfig` of parsed ``demo`` arguments (an InputError when invalid)."""
    from rolloutopt.testbed import TrainConfig

    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else TrainConfig.steps)
    if not isinstance(args.threads, int) or args.threads < 1:
        raise InputError("--threads", "an int >= 1", repr(args.threads), "pass e.g. --threads 1")
    return TrainConfig(
        steps=steps,
        seed=args.seed,
        loss=args.loss,
        mismatch=args.mismatch,
        staleness=args.staleness,
        topk=args.topk,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        holdout=args.holdout,
        eval_samples=args.eval_samples,
    )


def _rows(result: Any) -> list[tuple[str, str, str]]:
    k = max(1, min(10, len(result.steps) // 4))
    b, a = result.eval_before, result.eval_after
    return [
        (
            f"train reward, first / last {k} steps",
            f"{result.window('first', k):.3f}",
            f"{result.window('last', k):.3f}",
        ),
        ("held-out reward, sampled (T=1)", f"{b.sampled_reward:.3f}", f"{a.sampled_reward:.3f}"),
        ("held-out reward, greedy", f"{b.greedy_reward:.3f}", f"{a.greedy_reward:.3f}"),
        ("held-out exact match, greedy", f"{b.greedy_accuracy:.1%}", f"{a.greedy_accuracy:.1%}"),
    ]


def _summary(result: Any) -> list[tuple[str, str]]:
    cfg = result.config
    scen = result.scenario
    rows = [
        ("steps", f"{len(result.steps)}"),
        ("rollouts", f"{result.rollouts:,} ({cfg.prompts_per_step} prompts x {cfg.group_size} per step)"),
        ("loss", f"'{cfg.loss}' preset, {cfg.inner_steps} inner steps per batch, Adam lr {cfg.lr:g}"),
    ]
    if scen.simulated:
        rows.append(("simulated", scen.describe()))
    if scen.inputs:
        rows.append(("loss inputs", ", ".join(scen.inputs)))
    if scen.experimental is not None:
        rows.append(("experimental", scen.experimental))
    rows += [
        ("tokens generated", f"{result.tokens:,}"),
        ("policy parameters", f"{result.num_params:,}"),
        ("time", f"{result.seconds:.1f} s"),
    ]
    return rows


def _notes(config: Any) -> list[str]:
    from rolloutopt.testbed.train import scenario

    scen = scenario(config)
    notes = []
    if scen.experimental is not None:
        notes.append(
            f"note: the {config.loss!r} preset is experimental: {scen.experimental}; "
            "the demo runs it with experimental=True"
        )
    if scen.simulated:
        notes.append(f"simulated: {scen.describe()}")
    return notes


def _title(cfg: Any) -> str:
    method = "GRPO" if cfg.loss == "grpo" else f"GRPO + '{cfg.loss}'"
    return f"rolloutopt demo: reverse {cfg.length} digits with {method} (seed {cfg.seed})"


def _demo_plain(config: Any, train: Callable[..., Any], out: TextIO | io.TextIOBase) -> Any:
    n = config.steps
    every = max(1, n // 10)
    for note in _notes(config):
        print(note, file=out, flush=True)

    def report(rec: Any) -> None:
        if (rec.step + 1) % every == 0 or rec.step + 1 == n:
            print(f"step {rec.step + 1}/{n}  reward {rec.reward:.3f}", file=out, flush=True)

    result = train(config, callback=report)
    print(f"{'':48}{'start':>10}{'end':>10}", file=out)
    for name, s, e in _rows(result):
        print(f"{name:48}{s:>10}{e:>10}", file=out)
    for name, v in _summary(result):
        print(f"{name:48}{v}", file=out)
    return result


def _demo_rich(config: Any, train: Callable[..., Any], out: TextIO | io.TextIOBase) -> Any:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(file=cast(IO[str], out))  # a TextIOBase (StringIO) writes str like any IO[str]
    for note in _notes(config):
        console.print(escape(note), style="yellow" if note.startswith("note") else None)
    label = "GRPO" if config.loss == "grpo" else escape(config.loss)
    columns = (
        TextColumn(f"[bold]{label}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.3f}  clipfrac {task.fields[clipfrac]:.3f}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("train", total=config.steps, reward=0.0, clipfrac=0.0)

        def report(rec: Any) -> None:
            progress.update(bar, advance=1, reward=rec.reward, clipfrac=rec.metrics.get("clipfrac", 0.0))

        result = train(config, callback=report)

    cfg = result.config
    table = Table(title=escape(_title(cfg)))
    caption = f"held-out: {cfg.holdout} prompts never trained on"
    if result.scenario.simulated:
        caption += f"\nsimulated: {result.scenario.describe()}"
    table.caption = escape(caption)
    table.add_column("metric")
    table.add_column("start", justify="right")
    table.add_column("end", justify="right", style="bold green")
    for name, s, e in _rows(result):
        table.add_row(name, s, e)
    console.print(table)
    run = Table(show_header=False, title="run")
    run.add_column("what")
    run.add_column("value")
    for name, v in _summary(result):
        run.add_row(name, escape(v))
    console.print(run)
    return result


def demo(args: argparse.Namespace, out: TextIO | io.TextIOBase) -> Any:
    """Run the demo training (``rolloutopt.testbed.train``), print a progress bar and a result table, and return
    the :class:`~rolloutopt.testbed.TrainResult`."""
    from rolloutopt.testbed import train

    config = demo_config(args)
    torch.set_num_threads(args.threads)
    use_rich = not args.plain
    if use_rich:
        try:
            import rich  # noqa: F401
        except ImportError:
            use_rich = False
    return _demo_rich(config, train, out) if use_rich else _demo_plain(config, train, out)


def main(argv: Sequence[str] | None = None, *, out: TextIO | io.TextIOBase | None = None) -> int:
    """Entry point of ``rolloutopt`` / ``python -m rolloutopt``; returns the exit status.

    A bad argument, or a combination the demo refuses, is a one-line usage error on stderr (``SystemExit(2)``).
    """
    parser, demo_parser = _parsers()
    args = parser.parse_args(None if argv is None else list(argv))
    stream = out if out is not None else sys.stdout
    if args.command == "demo":
        try:
            demo_config(args)
        except InputError as err:
            demo_parser.error(str(err))
        demo(args, stream)
    elif args.command == "arena":
        from rolloutopt.arena.cli import main as arena_main

        arena_main(args, stream)
    return 0
