"""MkDocs hook: the arena's committed results in the docs.

``docs/arena.md`` holds the marker ``<!-- arena-summary -->``; this hook replaces it with
``benchmarks/results/arena/summary.md`` (without its title) and publishes the figures next to it
(``benchmarks/results/arena/*.png`` as ``arena/<name>.png``), so the page always shows the committed results,
written by ``python -m rolloutopt arena`` (``rolloutopt.arena.report``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "arena"
MARKER = "<!-- arena-summary -->"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File(f"arena/{png.name}", str(RESULTS.parent), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if MARKER not in markdown:
        return markdown
    summary = RESULTS / "summary.md"
    if not summary.exists():
        return markdown.replace(MARKER, "*No arena results are committed yet: run `make arena`.*")
    body = "\n".join(line for line in summary.read_text().splitlines() if not line.startswith("# "))
    figures = "\n\n".join(f"![{png.stem}](arena/{png.name})" for png in sorted(RESULTS.glob("*.png")))
    return markdown.replace(MARKER, body.replace("## ", "### ") + "\n\n" + figures)
