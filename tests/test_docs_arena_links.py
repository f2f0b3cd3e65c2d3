"""The docs hook (``docs_ext/arena_results.py``): each method page gets its arena results with a link to its family's
section of the arena page, and the arena page gets those anchors."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from rolloutopt.arena.report_readme import arena_keys, page_keys

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

SUMMARY = """# Arena: every method against its family's baseline

## Allocators, budget in rollouts: against `uniform` (target held-out accuracy 0.348)

| method | verdict |
|---|---|

## Allocators, budget in tokens: against `uniform` (target held-out accuracy 0.354)

## Estimators, group size 4: against `grpo` (target held-out accuracy 0.345)
"""

README_SAMPLE = """| method | paper | area / module | compared against | arena | tested in |
|---|---|---|---|---|---|
| GRESO | 2506.02177 | allocators / `allocators.GRESO` | authors' code | not separable from `uniform` | `t.py` |
| Dr.GRPO | x | advantages / `advantages.dr_grpo`, loss preset `dr_grpo` | trainer | estimator `dr_grpo`: \
not separable from `grpo`<br>loss `dr_grpo`: not run yet | `t.py` |
"""

PAGE = """# GRESO: skipping prompts that recently gave no signal

`rolloutopt.allocators.greso.GRESO` skips some prompts.

## API

::: rolloutopt.allocators.greso
"""


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("arena_results", ROOT / "docs_ext" / "arena_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_page_naming_greso_links_its_arena_row(hook: ModuleType) -> None:
    out = hook.method_page(PAGE, README_SAMPLE, SUMMARY)
    line = "- `greso` (allocators): not separable from `uniform` ([arena](../arena.md#arena-allocator))"
    assert line in out
    assert out.index("## In the arena") < out.index("## API") < out.index("::: rolloutopt.allocators.greso")


def test_a_family_without_a_section_links_the_page(hook: ModuleType) -> None:
    page = "# Reference methods: GRPO, Dr.GRPO\n\ntext\n"  # no API blocks: the rows its title names
    out = hook.method_page(page, README_SAMPLE, SUMMARY)
    assert "- `dr_grpo` (estimators): not separable from `grpo` ([arena](../arena.md#arena-estimator))" in out
    assert "- `dr_grpo` (loss presets): not run yet ([arena](../arena.md))" in out
    assert out.startswith(page.rstrip("\n")) and out.rstrip().endswith("([arena](../arena.md))")


def test_pages_without_arena_methods_or_column_are_unchanged(hook: ModuleType) -> None:
    kernels = "# Kernels\n\n## API\n\n::: rolloutopt.kernels.token_logprobs\n"
    assert hook.method_page(kernels, README_SAMPLE, SUMMARY) == kernels
    no_column = README_SAMPLE.replace(" arena |", "").replace("|---|---|---|---|---|---|", "|---|---|---|---|---|")
    assert hook.method_page(PAGE, no_column, SUMMARY) == PAGE


def test_the_arena_page_anchors_each_family(hook: ModuleType) -> None:
    out = hook.arena_page("intro\n\n<!-- arena-summary -->\n", SUMMARY)
    assert (
        "### Allocators, budget in rollouts: against `uniform` (target held-out accuracy 0.348) { #arena-allocator }"
        in out
    )
    assert "budget in tokens: against `uniform` (target held-out accuracy 0.354)\n" in out  # only the first heading
    assert "group size 4: against `grpo` (target held-out accuracy 0.345) { #arena-estimator }" in out
    assert "# Arena: every method" not in out
    assert "No arena results" in hook.arena_page("<!-- arena-summary -->", None)


def test_every_arena_method_is_on_a_method_page() -> None:
    """Every method the arena runs or refuses is documented on some page under docs/methods (found through the
    README rows its API blocks render), except the baselines and the helpers without a README row."""
    on_pages = set()
    for page in sorted((ROOT / "docs" / "methods").glob("*.md")):
        on_pages |= set(page_keys(page.read_text(encoding="utf-8"), README))
    assert page_keys((ROOT / "docs" / "methods" / "greso.md").read_text(encoding="utf-8"), README) == [
        ("allocator", "greso")
    ]
    missing = set(arena_keys()) - on_pages
    assert missing == {
        ("allocator", "uniform"),
        ("stop", "none"),
        ("stop", "count_steps"),
        ("stop", "dler_difficulty_budget"),
        ("stop", "repeated_ngram_share"),
        ("stop", "truncate_mask"),
    }


def test_the_long_runs_replace_their_marker(hook: ModuleType, tmp_path: Path) -> None:
    """``<!-- arena-long-summary -->`` becomes the longer runs' summary (headings four levels down) and figures, or a
    note to run ``make arena-long`` when none is committed."""
    page = "intro\n\n<!-- arena-long-summary -->\n\nend"
    out = hook.extra_section(page, "long", tmp_path)
    assert "make arena-long" in out and "<!-- arena-long-summary -->" not in out
    (tmp_path / "summary.md").write_text("# title\n\n## Allocators, budget in rollouts\n\nbody\n")
    (tmp_path / "allocator_rollouts_curves.png").write_bytes(b"")
    out = hook.extra_section(page, "long", tmp_path)
    assert "#### Allocators, budget in rollouts" in out and "# title" not in out
    assert "![long allocator_rollouts_curves](arena/long/allocator_rollouts_curves.png)" in out
    assert hook.extra_section("no marker", "long", tmp_path) == "no marker"
