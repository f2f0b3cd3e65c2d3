"""``python -m rolloutopt arena``: run (or resume) an arena suite with a progress bar, then print a summary table.

Each finished run is a JSON file under ``--out`` (default ``benchmarks/results/arena/runs``); a run whose file
exists is skipped, so an interrupted suite is completed by running the same command again. ``--device cuda`` trains
on the GPUs (one process per GPU); ``--ray ADDRESS`` runs each run as a task on a Ray cluster (``auto``) or a local
Ray instance (``local``) instead of local processes.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
from pathlib import Path
from typing import Any, TextIO

from rolloutopt.arena.base import BaseConfig
from rolloutopt.arena.report import write_report
from rolloutopt.arena.report_readme import update_readme
from rolloutopt.arena.run import FAMILIES, SCENARIOS, RunSpec
from rolloutopt.arena.suite import FAMILY_STEPS, plan_runs, run_suite
from rolloutopt.errors import InputError

__all__ = ["add_parser", "main", "summary"]

DEFAULT_OUT = Path("benchmarks/results/arena/runs")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``arena`` subcommand to an ``argparse`` subparsers object."""
    p: argparse.ArgumentParser = sub.add_parser(
        "arena",
        help="compare methods side by side: RL from a warmed-up tiny policy on a graded digit-task suite",
        description="Runs every method of the chosen families by name (allocators at equal rollout and token "
        "budgets, advantage estimators at group sizes 4 and 8, loss presets under five scenarios, stop and length "
        "rules), over several seeds; resumable (finished runs are skipped).",
    )
    p.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES, help="families (default: all)")
    p.add_argument("--methods", nargs="+", default=None, metavar="NAME", help="only these methods (default: all)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds (default: 0-4)")
    p.add_argument("--units", nargs="+", default=["rollouts", "tokens"], choices=["rollouts", "tokens"])
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"RL steps per run (default per family: {', '.join(f'{k} {v}' for k, v in FAMILY_STEPS.items())})",
    )
    p.add_argument("--ramble", type=float, default=0.5, metavar="FRACTION",
                   help="base policy warmed up to ramble to the length limit on this fraction of the long prompts "
                   "(default 0.5, the committed default results' base; 0: a base that always stops, as in "
                   "benchmarks/results/arena/noramble; another base needs another --out)")  # fmt: skip
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS),
                   help="scenarios of the loss family (default: all)")  # fmt: skip
    p.add_argument(
        "--jobs", type=int, default=None, help="processes (default: 2 on the CPU, one per GPU with --device cuda)"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where each run trains and generates: cpu, cuda (every visible GPU, one process each) or cuda:N "
        "(default: cpu)",
    )
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run each run as a Ray task instead of local processes (needs pip install 'rolloutopt[ray]'): auto "
        "(the running cluster), local (a new Ray instance here) or ray://host:10001; --jobs is then ignored, "
        "Ray's scheduler fills the cluster (1 CPU a run, and 1 GPU with --device cuda)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"directory of the run files (default: {DEFAULT_OUT})")
    p.add_argument("--plain", action="store_true", help="plain text output even if rich is installed")
    p.add_argument("--no-report", action="store_true", help="skip summary.md and the figures (next to --out)")
    p.add_argument(
        "--readme",
        action="store_true",
        help="then rewrite the arena column of README.md's Features table (in the current directory) from --out",
    )
    return p


def summary(out_dir: Path) -> list[dict[str, Any]]:
    """Per (family, method, unit): runs, median final held-out accuracy, median tokens and rollouts generated."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for path in sorted(Path(out_dir).glob("*.json")):
        record = json.loads(path.read_text())
        spec = record["spec"]
        groups.setdefault((spec["family"], spec["method"], spec["unit"]), []).append(record)
    rows = []
    for (family, method, unit), records in sorted(groups.items()):
        final = [r["evals"][-1] for r in records]
        rows.append(
            {
                "family": family,
                "method": method,
                "unit": unit,
                "runs": len(records),
                "accuracy": statistics.median(f["accuracy"] for f in final),
                "start": statistics.median(r["evals"][0]["accuracy"] for r in records),
                "tokens": statistics.median(f["tokens"] for f in final),
                "rollouts": statistics.median(f["rollouts"] for f in final),
            }
        )
    return rows


def main(args: argparse.Namespace, out: TextIO | io.TextIOBase) -> None:
    """Run the suite of parsed ``arena`` arguments and print its summary."""
    try:
        sizes = {} if args.steps is None else {"steps": args.steps}
        specs = plan_runs(args.family, methods=args.methods, seeds=args.seeds, units=args.units,
                          scenarios=args.scenarios, **sizes)  # fmt: skip
        base = BaseConfig(ramble=args.ramble)
    except InputError as err:
        raise SystemExit(f"arena: {err}") from None
    run_args = {"jobs": args.jobs, "device": args.device, "ray_address": args.ray, "base": base}
    try:
        run_suite([], args.out, **run_args)  # checks the arguments (and that ray is installed) before any run
    except (InputError, ImportError) as err:
        raise SystemExit(f"arena: {err}") from None
    use_rich = not args.plain
    if use_rich:
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            use_rich = False
    if use_rich:
        console = Console(file=out)  # type: ignore[arg-type]
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task(f"arena ({len(specs)} runs)", total=len(specs))
            run_suite(specs, args.out, on_done=lambda s, p: progress.advance(bar), **run_args)
    else:
        done = [0]

        def tick(spec: RunSpec, path: Path) -> None:
            done[0] += 1
            print(f"[{done[0]}/{len(specs)}] {spec.key}", file=out, flush=True)

        run_suite(specs, args.out, on_done=tick, **run_args)
    print(f"{'family':10} {'method':22} {'unit':8} {'runs':>4} {'start':>6} {'final':>6} {'tokens':>9} {'rollouts':>9}",
          file=out)  # fmt: skip
    for row in summary(args.out):
        print(
            f"{row['family']:10} {row['method']:22} {row['unit']:8} {row['runs']:4d} {row['start']:6.3f} "
            f"{row['accuracy']:6.3f} {row['tokens']:9,.0f} {row['rollouts']:9,.0f}",
            file=out,
        )
    if not args.no_report:
        try:
            path = write_report(args.out, Path(args.out).parent)
        except InputError as err:  # e.g. the baseline's runs are not there yet
            print(f"no report: {err}", file=out)
        else:
            print(f"report: {path}", file=out)
    if args.readme:
        readme = Path("README.md")
        if not readme.exists():
            raise SystemExit(f"arena: --readme needs README.md in the current directory ({Path.cwd()})")
        try:
            readme.write_text(update_readme(readme, args.out), encoding="utf-8")
        except InputError as err:
            raise SystemExit(f"arena: {err}") from None
        print(f"readme: {readme.resolve()}", file=out)
