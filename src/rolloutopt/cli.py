"""Command line of rolloutopt: ``python -m rolloutopt demo`` (a short GRPO run on a toy task, on the CPU).

``rich`` (the ``demo`` extra) draws the progress bar and the result table; without it the output is plain text.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch

from rolloutopt.errors import InputError

__all__ = ["main"]

QUICK_STEPS = 40


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutopt", description="rolloutopt command line tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a tiny policy with GRPO on a toy verifiable task (reverse a digit string), on the CPU",
        description="A short, seeded RL run: rolloutopt.advantages.grpo + the 'grpo' loss preset.",
    )
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: 150, --quick: 40)")
    demo.add_argument("--seed", type=int, default=0, help="seed of every generator (default: 0)")
    demo.add_argument("--quick", action="store_true", help=f"a {QUICK_STEPS}-step smoke run")
    demo.add_argument("--loss", default="grpo", help="loss preset name (default: grpo)")
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    demo.add_argument("--plain", action="store_true", help="plain text output even if rich is installed")
    return parser


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
    return [
        ("steps", f"{len(result.steps)}"),
        ("rollouts", f"{result.rollouts:,} ({cfg.prompts_per_step} prompts x {cfg.group_size} per step)"),
        ("loss", f"'{cfg.loss}' preset, {cfg.inner_steps} inner steps per batch, Adam lr {cfg.lr:g}"),
        ("tokens generated", f"{result.tokens:,}"),
        ("policy parameters", f"{result.num_params:,}"),
        ("time", f"{result.seconds:.1f} s"),
    ]


def _demo_plain(config: Any, train: Callable[..., Any], out: TextIO) -> Any:
    n = config.steps
    every = max(1, n // 10)

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


def _demo_rich(config: Any, train: Callable[..., Any], out: TextIO) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(file=out)
    columns = (
        TextColumn("[bold]GRPO[/bold]"),
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
    table = Table(title=f"rolloutopt demo: reverse {cfg.length} digits with GRPO (seed {cfg.seed})")
    table.caption = f"held-out: {cfg.holdout} prompts never trained on"
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
        run.add_row(name, v)
    console.print(run)
    return result


def demo(args: argparse.Namespace, out: TextIO) -> Any:
    """Run the demo training (``rolloutopt.testbed.train``) and print a progress bar and a result table."""
    from rolloutopt.testbed import TrainConfig, train

    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else TrainConfig.steps)
    config = TrainConfig(steps=steps, seed=args.seed, loss=args.loss)
    if args.threads < 1:
        raise InputError("--threads", "an int >= 1", repr(args.threads), "pass e.g. --threads 1")
    torch.set_num_threads(args.threads)
    use_rich = not args.plain
    if use_rich:
        try:
            import rich  # noqa: F401
        except ImportError:
            use_rich = False
    return _demo_rich(config, train, out) if use_rich else _demo_plain(config, train, out)


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Entry point of ``rolloutopt`` / ``python -m rolloutopt``; returns the exit status."""
    args = _parser().parse_args(None if argv is None else list(argv))
    stream = out if out is not None else sys.stdout
    if args.command == "demo":
        demo(args, stream)
    return 0
