"""MkDocs hook: the arena's committed results in the docs.

``docs/arena.md`` holds the marker ``<!-- arena-summary -->``; this hook replaces it with
``benchmarks/results/arena/summary.md`` (without its title) and publishes the figures next to it
(``benchmarks/results/arena/*.png`` as ``arena/<name>.png``), so the page always shows the committed results,
written by ``python -m rolloutopt arena`` (``rolloutopt.arena.report``). The first heading of each family's
results gets the anchor ``arena-<family>`` (``arena-allocator``, ``arena-estimator``, ``arena-loss``,
``arena-stop``). The result sets beside the default suite (:data:`EXTRA`: the longer runs, the runs from a base
policy that does not ramble) replace their own markers, ``<!-- arena-<name>-summary -->``, the same way.

Each method page (``docs/methods/*.md``) gets an "In the arena" section, before its API section (the ``:::``
blocks) or at its end: for every arena method the page documents
(:func:`rolloutopt.arena.report_readme.page_keys`), its result as README.md's Features table states it (the
``arena`` column, :func:`rolloutopt.arena.report_readme.readme_cells`, filled from the committed runs by
``python -m rolloutopt arena --readme``) and a link to its family's results on the arena page.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "arena"
README = ROOT / "README.md"
MARKER = "<!-- arena-summary -->"
EXTRA = {
    "long": "make arena-long",
    "noramble": "python -m rolloutopt arena --ramble 0 --scenarios sync stale4 stale16 mismatch --out "
    "benchmarks/results/arena/noramble/runs",
}
"""Result sets beside the default suite: ``benchmarks/results/arena/<name>/``, shown where ``docs/arena.md`` holds
``<!-- arena-<name>-summary -->``."""
FAMILY_WORDS = {"allocator": "allocators", "estimator": "estimators", "loss": "loss presets", "stop": "stop rules"}


def on_files(files: Files, config: Any) -> Files:
    extra = [png for name in EXTRA for png in sorted((RESULTS / name).glob("*.png"))]
    for png in [*sorted(RESULTS.glob("*.png")), *extra]:
        name = png.relative_to(RESULTS).as_posix()
        files.append(File(f"arena/{name}", str(RESULTS.parent), config["site_dir"], config["use_directory_urls"]))
    return files


def extra_section(markdown: str, name: str, directory: Path | None = None) -> str:
    """``docs/arena.md`` with ``<!-- arena-<name>-summary -->`` replaced by that result set's summary
    (``benchmarks/results/arena/<name>/summary.md``, or ``directory``'s; headings four levels down, without anchors)
    and figures; a note when it is not committed."""
    where = RESULTS / name if directory is None else directory
    marker = f"<!-- arena-{name}-summary -->"
    if marker not in markdown:
        return markdown
    path = where / "summary.md"
    if not path.exists():
        return markdown.replace(marker, f"*These results are not committed yet: run {EXTRA[name]}.*")
    body = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("# "))
    figures = "\n\n".join(f"![{name} {png.stem}](arena/{name}/{png.name})" for png in sorted(where.glob("*.png")))
    return markdown.replace(marker, body.replace("## ", "#### ") + "\n\n" + figures)


def _titles() -> dict[str, str]:
    """Family -> the title its headings in summary.md start with (``rolloutopt.arena.report.FAMILIES``)."""
    from rolloutopt.arena.report import FAMILIES

    return {name: fam.title for name, fam in FAMILIES.items()}


def _families(summary: str) -> list[str]:
    """The families with a section in ``summary``, in order."""
    out = []
    for line in summary.splitlines():
        for family, title in _titles().items():
            if line.startswith(f"## {title},") and family not in out:
                out.append(family)
    return out


def arena_page(markdown: str, summary: str | None) -> str:
    """``docs/arena.md`` with the marker replaced by ``summary`` (None: not committed yet), each family's first
    heading anchored as ``arena-<family>``."""
    if summary is None:
        return markdown.replace(MARKER, "*No arena results are committed yet: run `make arena`.*")
    lines, seen = [], set()
    for line in summary.splitlines():
        if line.startswith("# "):
            continue
        for family, title in _titles().items():
            if line.startswith(f"## {title},") and family not in seen:
                seen.add(family)
                line += f" {{ #arena-{family} }}"
        lines.append(line)
    body = "\n".join(lines)
    figures = "\n\n".join(f"![{png.stem}](arena/{png.name})" for png in sorted(RESULTS.glob("*.png")))
    return markdown.replace(MARKER, body.replace("## ", "### ") + "\n\n" + figures)


def method_page(markdown: str, readme: str, summary: str | None) -> str:
    """A method page with its "In the arena" section (see the module docstring); unchanged when it documents no
    arena method or README.md has no ``arena`` column."""
    from rolloutopt.arena.report_readme import page_keys, readme_cells

    cells = readme_cells(readme)
    keys = [k for k in page_keys(markdown, readme) if k in cells]
    if not keys:
        return markdown
    anchored = set(_families(summary or ""))
    items = []
    for family, method in keys:
        link = "../arena.md" + (f"#arena-{family}" if family in anchored else "")
        items.append(f"- `{method}` ({FAMILY_WORDS.get(family, family)}): {cells[(family, method)]} ([arena]({link}))")
    section = (
        "## In the arena\n\n"
        "How the methods of this page did in the [arena](../arena.md), the library's side-by-side comparison on a "
        "tiny real policy: tokens to the target accuracy as a ratio to the family's baseline, with a 95% bootstrap "
        "interval over seeds where the method is better or worse beyond seed noise.\n\n" + "\n".join(items) + "\n"
    )
    api = re.search(r"^#+ [^\n]*\n+(?=::: )", markdown, flags=re.MULTILINE) or re.search(
        r"^(?=::: )", markdown, flags=re.MULTILINE
    )
    if api is None:
        return markdown.rstrip("\n") + "\n\n" + section
    return markdown[: api.start()] + section + "\n" + markdown[api.start() :]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    summary_path = RESULTS / "summary.md"
    summary = summary_path.read_text() if summary_path.exists() else None
    if MARKER in markdown:
        page = arena_page(markdown, summary)
        for name in EXTRA:
            page = extra_section(page, name)
        return page
    if page.file.src_uri.startswith("methods/") and README.exists():
        return method_page(markdown, README.read_text(encoding="utf-8"), summary)
    return markdown
