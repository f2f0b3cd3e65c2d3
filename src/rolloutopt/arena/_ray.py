"""Arena runs as Ray tasks: one remote task per spec, scheduled by Ray on a cluster (or a local Ray instance).

Used by :func:`rolloutopt.arena.suite.run_suite` when it is given ``ray_address``. Each task returns its run's
record; the driver writes the record's JSON file as the task finishes (atomically, as the process pool does), so a
suite interrupted half-way resumes from the files exactly as without Ray. The base policy is built (or loaded) once
by the driver and shipped to the tasks through Ray's object store: every node runs from the same weights, and no
node retrains it. The nodes need ``rolloutopt`` installed (the same version and the same torch as the driver).

Ray is imported only when a suite runs with it (``pip install 'rolloutopt[ray]'``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rolloutopt._validation import check_int, describe
from rolloutopt.arena.base import BaseConfig, _key, base_policy, cache_dir
from rolloutopt.arena.run import RunSpec, run, write_record
from rolloutopt.arena.tasks import TaskSuite
from rolloutopt.errors import InputError

__all__ = ["import_ray", "run_with_ray"]


def import_ray() -> Any:
    """The ``ray`` module; an ImportError naming the extra that installs it when it is missing."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("running the arena on Ray needs the ray package: pip install 'rolloutopt[ray]'") from err
    return ray


def _seed_cache(suite: TaskSuite, base: BaseConfig, state: dict[str, torch.Tensor]) -> None:
    """Put the driver's base-policy weights in this node's cache (atomically) unless they are there already."""
    where = cache_dir()
    path = where / f"base-{_key(suite, base)}.pt"
    if path.exists():
        return
    where.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(state, tmp)
    tmp.replace(path)


def _task(
    spec: RunSpec, suite: TaskSuite, base: BaseConfig, state: dict[str, torch.Tensor], device: str, threads: int
) -> dict[str, Any]:
    """One remote run: its record (the driver writes it)."""
    torch.set_num_threads(threads)
    _seed_cache(suite, base, state)
    return run(spec, suite, base, device=device)


def run_with_ray(
    todo_specs: Sequence[RunSpec],
    paths: Mapping[RunSpec, Path],
    suite: TaskSuite,
    base: BaseConfig,
    *,
    address: str | None,
    device: str = "cpu",
    num_cpus_per_run: int = 1,
    num_gpus_per_run: float = 0,
    on_done: Callable[[RunSpec, Path], None] | None = None,
) -> list[Path]:
    """Run every spec of ``todo_specs`` as one Ray task and write its record at ``paths[spec]`` as it finishes.

    ``address``: passed to ``ray.init`` (``"auto"``: the running cluster this machine belongs to; ``"local"``: a new
    Ray instance on this machine; ``"ray://host:10001"``: a Ray client; None: a running cluster if there is one,
    else a local instance). When Ray is already initialised in this process, that instance is used and
    ``address`` is ignored; Ray is shut down at the end only when this call started it.
    ``num_cpus_per_run`` / ``num_gpus_per_run``: the resources each task asks Ray for (the run uses that many
    torch threads); Ray starts as many tasks at once as the cluster's free resources allow. A task given a GPU
    sees it as ``"cuda"`` (Ray sets ``CUDA_VISIBLE_DEVICES``), so pass ``device="cuda"`` rather than ``"cuda:N"``.
    ``on_done(spec, path)`` is called as each file is written. A failed run raises its error after every other
    task has finished and been written (so a rerun resumes with only the failed ones). Returns the written paths.
    """
    check_int(num_cpus_per_run, "num_cpus_per_run", 1, "pass e.g. 1")
    if isinstance(num_gpus_per_run, bool) or not isinstance(num_gpus_per_run, (int, float)) or num_gpus_per_run < 0:
        raise InputError("num_gpus_per_run", "a number >= 0", describe(num_gpus_per_run), "pass e.g. 1 (0: CPU runs)")
    missing = [s.key for s in todo_specs if s not in paths]
    if missing:
        raise InputError("paths", "a path for every spec", f"none for {missing[:3]}", "pass paths[spec] for each")

    ray = import_ray()
    written: list[Path] = []
    if not todo_specs:
        return written
    started = not ray.is_initialized()
    if started:
        ray.init(address=address)
    try:
        state = ray.put({k: v.detach().cpu() for k, v in base_policy(suite, base).state_dict().items()})
        remote = ray.remote(num_cpus=num_cpus_per_run, num_gpus=num_gpus_per_run)(_task)
        pending = {remote.remote(spec, suite, base, state, device, num_cpus_per_run): spec for spec in todo_specs}
        error: BaseException | None = None
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                spec = pending.pop(ref)
                try:
                    record = ray.get(ref)
                except Exception as err:  # keep writing the others; the first failure is raised at the end
                    error = error or err
                    continue
                written.append(write_record(record, paths[spec]))
                if on_done is not None:
                    on_done(spec, paths[spec])
        if error is not None:
            raise error
        return written
    finally:
        if started:
            ray.shutdown()
