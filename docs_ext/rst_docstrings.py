"""Griffe extension for the docs build: render the reST constructs of rolloutopt's Google-style docstrings.

The docstrings are Google style with a little reST: ``.. math::`` blocks, ``:math:`...``` roles, Sphinx
cross-reference roles (``:class:`~rolloutopt.x.Y```, ``:func:``, ``:meth:``, ...) and simple tables. Before
mkdocstrings renders a docstring, this extension rewrites them into what Markdown, pymdownx.arithmatex and
mkdocs-autorefs understand:

- ``.. math:: X`` (with indented continuation lines) becomes a ``$$ ... $$`` display block;
- ``:math:`x``` becomes ``\\(x\\)`` (inline arithmatex);
- ``:class:`~a.b.C``` becomes an *optional* autorefs link titled ``C`` (``a.b.C`` without ``~``) to the
  object's documented anchor; a target that is not documented renders as plain code, without a warning;
- reST simple tables (``====  ====`` borders) become Markdown tables;
- a Google ``Args:`` item that names several parameters (``rewards, group, valid: as in grpo``, a numpydoc
  habit Google style lacks) is repeated once per name, so that griffe matches each to the signature.

It lives outside ``docs/`` so that mkdocs does not copy it into the site, and it only touches the in-memory
docstrings of the documentation build; the source files are never modified.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|mod|attr|data|exc|obj|const):`(?P<target>[^`]+)`")
_MATH_ROLE = re.compile(r":math:`(?P<tex>[^`]+)`")
_MATH_DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\. math::\s*(?P<rest>.*)$")
_TABLE_BORDER = re.compile(r"^\s*=+(?:\s+=+)+\s*$")


_MULTI_ARG = re.compile(r"^(?P<pad>\s+)(?P<names>\w+(?:\s*,\s*\w+)+):(?P<desc>\s.*)$")
_SECTION = re.compile(r"^\s*(?:Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters):\s*$")


def _multi_args(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_args = False
    section_pad = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        if _SECTION.match(line):
            in_args, section_pad = True, _indent(line)
        elif in_args and line.strip() and _indent(line) <= section_pad:
            in_args = False
        m = _MULTI_ARG.match(line) if in_args else None
        if not m:
            out.append(line)
            i += 1
            continue
        item = [m["desc"]]
        i += 1
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) > len(m["pad"]):
            item.append("\n" + lines[i])
            i += 1
        for name in (n.strip() for n in m["names"].split(",")):
            out.extend(f"{m['pad']}{name}:{''.join(item)}".split("\n"))
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _math_blocks(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = _MATH_DIRECTIVE.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        pad = m["indent"]
        body = [m["rest"].strip()] if m["rest"].strip() else []
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(pad)):
            if not lines[i].strip():
                # a blank line ends the block unless more indented math follows it
                nxt = next((j for j in range(i, len(lines)) if lines[j].strip()), None)
                if nxt is None or _indent(lines[nxt]) <= len(pad) or not body:
                    break
            body.append(lines[i].strip())
            i += 1
        if out and out[-1].strip():
            out.append("")
        out.extend([f"{pad}$$", *(f"{pad}{b}" for b in body if b), f"{pad}$$", ""])
        while i < len(lines) and not lines[i].strip():
            i += 1
    return out


def _columns(border: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def _cells(line: str, cols: list[tuple[int, int]]) -> list[str]:
    cells: list[str] = []
    pos = 0
    for k in range(len(cols)):
        if k + 1 < len(cols):
            cut = max(cols[k + 1][0], pos)
            while cut < len(line) and not line[cut - 1].isspace():
                cut += 1  # a cell that overruns its column ends at the next space
        else:
            cut = len(line)
        cells.append(" ".join(line[pos:cut].split()))
        pos = cut
    return cells


def _tables(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not _TABLE_BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        cols = _columns(lines[i])
        pad = " " * _indent(lines[i])
        segments: list[list[list[str]]] = [[]]
        i += 1
        while i < len(lines):
            if _TABLE_BORDER.match(lines[i]):
                i += 1
                more = i < len(lines) and lines[i].strip() and not _TABLE_BORDER.match(lines[i])
                if more and len(segments) == 1:
                    segments.append([])
                    continue
                break
            if lines[i].strip():
                segments[-1].append(_cells(lines[i], cols))
            i += 1
        header = [" ".join(col) for col in zip(*segments[0], strict=False)] if len(segments) == 2 else [""] * len(cols)
        rows = segments[-1]

        def esc(cell: str) -> str:
            return cell.replace("|", "\\|")

        if out and out[-1].strip():
            out.append("")
        out.append(pad + "| " + " | ".join(esc(c) for c in header) + " |")
        out.append(pad + "|" + "|".join("---" for _ in cols) + "|")
        out.extend(pad + "| " + " | ".join(esc(c) for c in row) + " |" for row in rows)
        out.append("")
    return out


def _resolve(obj: griffe.Object, target: str) -> str:
    if "." in target and target.split(".")[0] in {"rolloutopt", "torch"}:
        return target
    scopes: list[Any] = [obj]
    parent = obj.parent
    while parent is not None:
        scopes.append(parent)
        parent = parent.parent
    head = target.split(".")[0]
    for scope in scopes:
        try:
            base = scope.resolve(head)
        except (
            NameError,
            AttributeError,
            ValueError,
            KeyError,
            griffe.AliasResolutionError,
            griffe.NameResolutionError,
        ):
            continue
        return base + target[len(head) :]
    return target


def convert(text: str, obj: griffe.Object) -> str:
    """The docstring ``text`` of ``obj`` with its reST constructs rewritten for Markdown."""
    lines = _multi_args(_tables(_math_blocks(text.split("\n"))))
    text = "\n".join(lines)
    text = _MATH_ROLE.sub(lambda m: "\\(" + m["tex"] + "\\)", text)

    def role(m: re.Match[str]) -> str:
        target = m["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~").rstrip("()")
        title = target.split(".")[-1] if short else target
        ident = _resolve(obj, target)
        return f'<autoref identifier="{ident}" optional><code>{title}</code></autoref>'

    return _ROLE.sub(role, text)


class RstDocstrings(griffe.Extension):
    """Rewrite every docstring of the loaded package once it is fully loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[int] = set()

        def walk(obj: griffe.Object) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = convert(obj.docstring.value, obj)
            for member in obj.members.values():
                if not member.is_alias:
                    walk(member)  # type: ignore[arg-type]

        walk(pkg)
