"""Many arena runs: planned from families, methods, seeds and units, spread over processes, each written to its own
JSON file as it finishes, and skipped when its file exists (a suite interrupted half-way resumes where it stopped).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from rolloutopt import advantages, allocators, losses
from rolloutopt._validation import check_int, describe
from rolloutopt.arena.base import BaseConfig, base_policy
from rolloutopt.arena.run import FAMILIES, SCENARIOS, RunSpec, run, write_record
from rolloutopt.arena.tasks import TaskSuite
from rolloutopt.errors import InputError

__all__ = ["plan_runs", "run_suite"]


FAMILY_STEPS = {"allocator": 60, "estimator": 60, "loss": 40, "stop": 60}
"""RL steps per run of each family in the default suite (sized so that ``make arena`` fits 2 hours on 2 cores;
the loss family has 6 scenarios per preset, hence shorter runs)."""


def plan_runs(
    families: Sequence[str] = FAMILIES,
    *,
    methods: Sequence[str] | None = None,
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    units: Sequence[str] = ("rollouts", "tokens"),
    group_sizes: Sequence[int] = (4, 8),
    scenarios: Sequence[str] = tuple(SCENARIOS),
    **sizes: Any,
) -> list[RunSpec]:
    """The runs of a suite, seed-major (so a suite stopped early has every method at the first seeds):

    - allocators: every allocator (or those of ``methods``) × ``units``;
    - estimators: every estimator (or those of ``methods``) × ``group_sizes``, in rollouts, at the same 128 rollouts
      a step (``128 // G`` prompts of ``G`` rollouts; the baseline is ``grpo`` at the same ``G``);
    - loss presets: every preset (or those of ``methods``) × ``scenarios`` (the baseline is ``grpo`` in the same
      scenario);
    - stop rules: every rule the arena runs (:data:`rolloutopt.arena.stops.STOP_METHODS`, or those of
      ``methods``; the baseline is ``none``, no rule).

    ``sizes``: :class:`RunSpec` fields (``steps``, ...), the same for every run; ``steps`` defaults to
    :data:`FAMILY_STEPS`."""
    from rolloutopt.arena.stops import STOP_METHODS

    specs = []
    for family in families:
        if family not in FAMILIES:
            raise InputError("families", f"names from {FAMILIES}", repr(family), "pick a family")
    for name in scenarios:
        if name not in SCENARIOS:
            raise InputError("scenarios", f"names from {tuple(SCENARIOS)}", repr(name), "pick scenarios")
    known = {"allocator": allocators.names(), "estimator": advantages.names(), "loss": losses.names(),
             "stop": list(STOP_METHODS)}  # fmt: skip
    if methods is not None:
        unknown = [m for m in methods if not any(m in known[f] for f in families)]
        if unknown:
            raise InputError("methods", f"names of the families {tuple(families)}", repr(unknown), "see names()")
    for seed in seeds:
        for family in families:
            names = known[family] if methods is None else [m for m in methods if m in known[family]]
            fam = {"steps": FAMILY_STEPS[family], **sizes}
            if family == "allocator":
                specs += [RunSpec(family, n, seed=seed, unit=u, **fam) for n in names for u in units]
            elif family == "estimator":
                for g in group_sizes:
                    per_step = max(1, 128 // g)
                    shape = {"group_size": g, "prompts_per_step": per_step, "pool": max(per_step, 32)}
                    specs += [RunSpec(family, n, seed=seed, **{**shape, **fam}) for n in names]
            elif family == "loss":
                specs += [RunSpec(family, n, seed=seed, scenario=sc, **fam) for sc in scenarios for n in names]
            else:
                specs += [RunSpec(family, n, seed=seed, **fam) for n in names]
    return specs


_WORKER_DEVICE: str | None = None
"""In a pool worker given a GPU of its own (``device="cuda"`` with several GPUs): that GPU, e.g. ``"cuda:1"``."""


def _pin(slots: Any) -> None:
    """Pool worker initializer: take the next GPU index from ``slots`` (one worker per GPU, round robin)."""
    global _WORKER_DEVICE
    _WORKER_DEVICE = f"cuda:{slots.get()}"


def _one(spec: RunSpec, suite: TaskSuite, base: BaseConfig, path: str, device: str = "cpu") -> str:
    torch.set_num_threads(1)
    if device == "cuda" and _WORKER_DEVICE is not None:
        device = _WORKER_DEVICE
    write_record(run(spec, suite, base, device=device), path)
    return path


def _plain(config: Any) -> dict[str, Any]:
    """A config dataclass as its JSON record holds it (tuples as lists)."""
    return dict(json.loads(json.dumps(asdict(config))))


def _check_record(path: Path, spec: RunSpec, suite: TaskSuite, base: BaseConfig) -> None:
    """Refuse to resume over a run file made with another spec, task suite or base policy: a file name holds the
    family, method, unit, scenario and seed only, so a suite of other sizes or another base policy (``--steps``,
    ``--ramble``) pointed at the same directory would otherwise skip runs that are not its own. Fields a record
    lacks (written before they existed) count as their defaults."""
    record = json.loads(path.read_text())
    for name, config, default in (("spec", spec, RunSpec(spec.family, spec.method)), ("suite", suite, TaskSuite()),
                                  ("base", base, BaseConfig())):  # fmt: skip
        want, got = _plain(config), {**_plain(default), **record.get(name, {})}
        diff = sorted(k for k in want if want[k] != got.get(k))
        if diff:
            raise InputError(
                "out_dir",
                f"run files of this suite only ({path.name} is the run {spec.key})",
                f"{path} made with another {name}: " + ", ".join(f"{k}={got.get(k)!r} (now {want[k]!r})" for k in diff),
                "pass another out_dir (--out) for other sizes or another base policy, or remove the old files",
            )


def _check_device(device: Any) -> str:
    """``device`` as torch spells it (``"cpu"``, ``"cuda"``, ``"cuda:1"``); an InputError when torch does not
    parse it."""
    fix = "pass e.g. 'cpu', 'cuda' or 'cuda:0'"
    if not isinstance(device, str):
        raise InputError("device", "a device string", describe(device), fix)
    try:
        return str(torch.device(device))
    except (RuntimeError, ValueError):
        raise InputError("device", "a torch device string", repr(device), fix) from None


def _default_jobs(device: str) -> int:
    """2 processes on the CPU; on CUDA one per GPU: every visible GPU for ``"cuda"``, 1 for ``"cuda:N"``."""
    if not device.startswith("cuda"):
        return 2
    return max(1, torch.cuda.device_count()) if device == "cuda" else 1


def run_suite(
    specs: Sequence[RunSpec],
    out_dir: str | Path,
    *,
    suite: TaskSuite | None = None,
    base: BaseConfig | None = None,
    jobs: int | None = None,
    on_done: Callable[[RunSpec, Path], None] | None = None,
    device: str = "cpu",
    ray_address: str | None = None,
) -> list[Path]:
    """Run every spec whose ``out_dir/<spec.key>.json`` is absent, ``jobs`` processes at a time (one torch thread
    each), and return the paths of all specs' files. ``on_done(spec, path)`` is called as each finishes (and for
    each skipped one). The base policy is built (or loaded) once, before the workers start.

    ``device``: where each run trains and generates, a torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
    ``jobs`` defaults to 2 on the CPU and to one process per GPU on CUDA: with ``"cuda"``, one per visible GPU,
    each process pinned to its own GPU (``jobs`` above the GPU count shares them round robin); with ``"cuda:N"``,
    1 (more processes share that GPU).

    ``ray_address``: run each spec as one Ray task instead (:func:`rolloutopt.arena._ray.run_with_ray`; needs
    ``pip install 'rolloutopt[ray]'``): ``"auto"`` joins the cluster this machine belongs to, ``"local"`` starts
    a Ray instance on this machine, ``"ray://host:10001"`` connects a Ray client. Ray's scheduler decides how
    many run at once (each task asks for 1 CPU, and 1 GPU on CUDA, where the task sees its GPU as ``"cuda"``);
    ``jobs`` is then ignored. The driver writes each file as its task finishes, so resuming works the same.
    """
    device = _check_device(device)
    if jobs is None:
        jobs = _default_jobs(device) if ray_address is None else 1
    check_int(jobs, "jobs", 1, "pass e.g. jobs=2")
    if ray_address is not None and not isinstance(ray_address, str):
        raise InputError("ray_address", "None or a Ray address string", describe(ray_address), "pass e.g. 'auto'")
    if ray_address is not None:
        from rolloutopt.arena._ray import import_ray

        import_ray()  # a missing ray fails here, before the base policy is built
    if not isinstance(out_dir, (str, Path)):
        raise InputError("out_dir", "a directory path", describe(out_dir), "pass e.g. 'benchmarks/results/arena/runs'")
    gpus = torch.cuda.device_count() if device.startswith("cuda") and ray_address is None else 0
    if device.startswith("cuda") and ray_address is None:  # a Ray cluster's GPUs are on its nodes, not checked here
        index = torch.device(device).index
        if gpus == 0 or (index is not None and index >= gpus):
            raise InputError("device", f"a CUDA device of this machine ({gpus} visible)", repr(device),
                             "pass device='cpu', or run on a machine with a GPU")  # fmt: skip
    suite = TaskSuite() if suite is None else suite
    base = BaseConfig() if base is None else base
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_policy(suite, base)  # cached for the workers
    paths = {spec: out / f"{spec.key}.json" for spec in specs}
    todo = [s for s in specs if not paths[s].exists()]
    for spec in specs:
        if spec not in todo:
            _check_record(paths[spec], spec, suite, base)
    for spec in specs:
        if spec not in todo and on_done is not None:
            on_done(spec, paths[spec])
    if ray_address is not None:
        from rolloutopt.arena._ray import run_with_ray

        run_with_ray(todo, paths, suite, base, address=ray_address, device=device,
                     num_gpus_per_run=1 if device.startswith("cuda") else 0, on_done=on_done)  # fmt: skip
        return list(paths.values())
    if jobs == 1:
        for spec in todo:
            _one(spec, suite, base, str(paths[spec]), device)
            if on_done is not None:
                on_done(spec, paths[spec])
        return list(paths.values())
    ctx = get_context("spawn")
    pinned: dict[str, Any] = {}
    if device == "cuda" and gpus > 1:  # one worker per GPU: each takes its index at start
        slots = ctx.Queue()
        for k in range(jobs):
            slots.put(k % gpus)
        pinned = {"initializer": _pin, "initargs": (slots,)}
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, **pinned) as pool:
        running: dict[Future[str], RunSpec] = {}
        queue = list(todo)
        while queue or running:
            while queue and len(running) < jobs:
                spec = queue.pop(0)
                running[pool.submit(_one, spec, suite, base, str(paths[spec]), device)] = spec
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                spec = running.pop(fut)
                fut.result()  # a failed run raises here, after the finished ones were written
                if on_done is not None:
                    on_done(spec, paths[spec])
    return list(paths.values())
