"""Every ```python block of README.md and docs/**/*.md runs as written.

A page is one session, read top to bottom: its blocks run in order in one namespace, so a later block may use
what an earlier block of the same page defined (as a reader pasting them into one interpreter would). Pages do
not share namespaces.

A block that deliberately cannot run here (it needs a GPU, verl's trainer, a multi-process launch, a real model)
carries an HTML comment on the line just above its fence::

    <!-- not-run: needs torch.distributed initialised on every rank -->
    ```python
    ...

Such a block is reported as a skipped test with its reason (``pytest -rs`` lists them); the reason may not be
empty. Every other block must run without raising.
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.DOTALL | re.MULTILINE
)
_NOT_RUN = re.compile(r"<!--\s*not-run:(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip_reason: str | None  # None: runs

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _dedent(body: str, indent: str) -> str:
    lines = body.splitlines(keepends=True)
    return "".join(line[len(indent) :] if line.startswith(indent) else line.lstrip(" \t") for line in lines)


def blocks(page: Path) -> list[Block]:
    """The ```python blocks of ``page`` in order, with the not-run reason written just above each."""
    text = page.read_text(encoding="utf-8")
    out = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        marker = _NOT_RUN.search(before)
        reason = marker.group("reason").strip() if marker else None
        out.append(Block(page, line, _dedent(match.group("body"), match.group("indent")), reason))
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
RUN_PAGES = sorted({b.page for b in ALL_BLOCKS if b.skip_reason is None})
SKIPPED = [b for b in ALL_BLOCKS if b.skip_reason is not None]


def test_there_are_examples() -> None:
    assert len(ALL_BLOCKS) > 20, f"found only {len(ALL_BLOCKS)} ```python blocks; is the fence pattern right?"


def test_every_not_run_block_says_why() -> None:
    empty = [b.id for b in SKIPPED if not b.skip_reason]
    assert not empty, f"<!-- not-run: ... --> markers without a reason: {empty}"


@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The page's runnable blocks, in order, in one namespace; a failure names the block's line."""
    monkeypatch.chdir(tmp_path)  # an example that writes a file writes it here
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": f"__docs_{page.stem}__"}
    for block in blocks(page):
        if block.skip_reason is not None:
            continue
        # a block line number that the traceback can point at: pad the code down to the fence's line
        code = "\n" * block.line + block.code
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # examples may trigger documented warnings (experimental, singleton)
            try:
                exec(compile(code, str(page), "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"the example at {block.id} raised {type(exc).__name__}: {exc}") from exc


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: b.id)
def test_not_run_examples_compile_and_say_why(block: Block) -> None:
    """A block that cannot run here (it needs a TRL training run or a process group) still compiles, names only
    what ``rolloutopt`` exports, and says why it is not run."""
    assert len(block.skip_reason.split()) >= 3, f"{block.id}: give the reason it is not run"
    tree = compile("\n" * block.line + block.code, block.id, "exec", flags=ast.PyCF_ONLY_AST)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rolloutopt"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block.id}: {node.module} has no {alias.name}"
