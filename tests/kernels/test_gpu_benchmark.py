"""``benchmarks/kernels_gpu.py --dry-run`` runs every section at tiny shapes on CPU (torch backend)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = (
    "correct/logits_logprobs",
    "correct/fused_policy_loss",
    "correct/token_logprobs",
    "bench/logits",
    "bench/fused_linear",
)


def test_gpu_benchmark_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "kernels_gpu.md"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels_gpu.py"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "FAILED" not in res.stdout, res.stdout[-3000:]
    table = out.read_text()
    for section in SECTIONS:
        assert f"## {section}" in table
    assert "PASS" in table and "FAIL" not in table
    # every registered preset is checked (fp32 and bf16)
    from rolloutopt.losses import names

    for name in names():
        assert f"| {name} float32 |" in table and f"| {name} bfloat16 |" in table, name
