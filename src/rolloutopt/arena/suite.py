"""Many arena runs: planned from families, methods, seeds and units, spread over processes, each written to its own
JSON file as it finishes, and skipped when its file exists (a suite interrupted half-way resumes where it stopped).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from rolloutopt import advantages, allocators
from rolloutopt._validation import check_int, describe
from rolloutopt.arena.base import BaseConfig, base_policy
from rolloutopt.arena.run import FAMILIES, RunSpec, run
from rolloutopt.arena.tasks import TaskSuite
from rolloutopt.errors import InputError

__all__ = ["plan_runs", "run_suite"]


def plan_runs(
    families: Sequence[str] = FAMILIES,
    *,
    methods: Sequence[str] | None = None,
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    units: Sequence[str] = ("rollouts", "tokens"),
    group_sizes: Sequence[int] = (4, 8),
    **sizes: Any,
) -> list[RunSpec]:
    """The runs of a suite, seed-major (so a suite stopped early has every method at the first seeds):

    - allocators: every allocator (or those of ``methods``) × ``units``;
    - estimators: every estimator (or those of ``methods``) × ``group_sizes``, in rollouts, at the same 128 rollouts a step
      (``128 // G`` prompts of ``G`` rollouts; the baseline is ``grpo`` at the same ``G``).

    ``sizes``: :class:`RunSpec` fields (``steps``, ...), the same for every run."""
    specs = []
    for family in families:
        if family not in FAMILIES:
            raise InputError("families", f"names from {FAMILIES}", repr(family), "pick a family")
    known = {"allocator": allocators.names(), "estimator": advantages.names()}
    if methods is not None:
        unknown = [m for m in methods if not any(m in known[f] for f in families)]
        if unknown:
            raise InputError("methods", f"names of the families {tuple(families)}", repr(unknown), "see names()")
    for seed in seeds:
        for family in families:
            if family == "allocator":
                names = known[family] if methods is None else [m for m in methods if m in known[family]]
                specs += [RunSpec(family, n, seed=seed, unit=u, **sizes) for n in names for u in units]
            else:
                names = known[family] if methods is None else [m for m in methods if m in known[family]]
                for g in group_sizes:
                    per_step = max(1, 128 // g)
                    shape = {"group_size": g, "prompts_per_step": per_step, "pool": max(per_step, 32)}
                    specs += [RunSpec(family, n, seed=seed, **{**shape, **sizes}) for n in names]
    return specs


def _one(spec: RunSpec, suite: TaskSuite, base: BaseConfig, path: str) -> str:
    torch.set_num_threads(1)
    record = run(spec, suite, base)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return path


def run_suite(
    specs: Sequence[RunSpec],
    out_dir: str | Path,
    *,
    suite: TaskSuite | None = None,
    base: BaseConfig | None = None,
    jobs: int = 2,
    on_done: Callable[[RunSpec, Path], None] | None = None,
) -> list[Path]:
    """Run every spec whose ``out_dir/<spec.key>.json`` is absent, ``jobs`` processes at a time (one torch thread
    each), and return the paths of all specs' files. ``on_done(spec, path)`` is called as each finishes (and for
    each skipped one). The base policy is built (or loaded) once, before the workers start."""
    check_int(jobs, "jobs", 1, "pass e.g. jobs=2")
    if not isinstance(out_dir, (str, Path)):
        raise InputError("out_dir", "a directory path", describe(out_dir), "pass e.g. 'benchmarks/results/arena/runs'")
    suite = TaskSuite() if suite is None else suite
    base = BaseConfig() if base is None else base
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_policy(suite, base)  # cached for the workers
    paths = {spec: out / f"{spec.key}.json" for spec in specs}
    todo = [s for s in specs if not paths[s].exists()]
    for spec in specs:
        if spec not in todo and on_done is not None:
            on_done(spec, paths[spec])
    if jobs == 1:
        for spec in todo:
            _one(spec, suite, base, str(paths[spec]))
            if on_done is not None:
                on_done(spec, paths[spec])
        return list(paths.values())
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        running: dict[Future[str], RunSpec] = {}
        queue = list(todo)
        while queue or running:
            while queue and len(running) < jobs:
                spec = queue.pop(0)
                running[pool.submit(_one, spec, suite, base, str(paths[spec]))] = spec
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                spec = running.pop(fut)
                fut.result()  # a failed run raises here, after the finished ones were written
                if on_done is not None:
                    on_done(spec, paths[spec])
    return list(paths.values())
