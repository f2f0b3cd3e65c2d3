"""The first ```python block of README.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    assert match is not None, "README.md has no ```python block"
    return match.group(1)


def test_readme_example_runs(capsys: object) -> None:
    code = first_python_block(README.read_text(encoding="utf-8"))
    namespace: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), namespace)


def test_readme_has_demo_marker() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert "<!-- demo-results -->" in lines
