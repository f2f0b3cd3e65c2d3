"""``import rolloutopt`` stays light: no triton, no trainer package, fast after torch, and it works
with none of them installed. Each check runs in a fresh interpreter, so that other tests' imports do not count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

HEAVY = ("triton", "trl", "verl", "transformers")

IMPORT_ALL = textwrap.dedent(
    """
    import json, pkgutil, sys, time
    import torch  # the baseline: rolloutopt's own cost is measured after it
    t0 = time.perf_counter()
    import rolloutopt
    t1 = time.perf_counter()
    modules = []
    for info in pkgutil.walk_packages(rolloutopt.__path__, "rolloutopt."):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # `python -m rolloutopt` runs the CLI
            continue
        if info.name.endswith("_triton"):  # Triton kernel modules: imported only when backend="triton" runs
            continue
        __import__(info.name)
        modules.append(info.name)
    t2 = time.perf_counter()
    heavy = sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))
    print(json.dumps({"top": t1 - t0, "all": t2 - t0, "modules": modules, "heavy": heavy}))
    """
)

BLOCKED = textwrap.dedent(
    """
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HEAVY:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Block())
    """
)


def run(code: str) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n" + code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_import_is_light_and_fast() -> None:
    result = json.loads(run(IMPORT_ALL))
    assert result["heavy"] == [], f"import rolloutopt pulled in {result['heavy']}"
    expected = {"rolloutopt.groups", "rolloutopt.errors", "rolloutopt.distributed", "rolloutopt.losses.aggregation"}
    assert expected <= set(result["modules"])
    # "well under a second after torch": a loose guard against a heavy import creeping in (2 s leaves room for a
    # loaded shared machine); the time to import every module is not bounded (kernels, integrations are opt-in)
    assert result["top"] < 2.0, f"import rolloutopt took {result['top']:.2f} s after torch"


def test_import_works_without_triton_and_trainers() -> None:
    result = json.loads(run(BLOCKED + IMPORT_ALL))
    assert result["heavy"] == []
    assert "rolloutopt.groups" in result["modules"]


def test_blocker_is_effective() -> None:
    """The blocked run above means something only if the blocker does block."""
    out = run(BLOCKED + "try:\n    import triton\nexcept ModuleNotFoundError:\n    print('blocked')\n")
    assert out == "blocked"
