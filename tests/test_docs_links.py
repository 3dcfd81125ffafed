"""The README and docs/ hold together: every relative link and image names a file or folder that
exists, every `#anchor` names a heading of its target page (GitHub's slugs), every docs page is
reachable from docs/index.md, and the README stays a map (at most 10,000 characters).

Pure Python over the Markdown sources; links inside fenced code blocks and inline code are not
links and are ignored. External links (http, https, mailto) are not fetched.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
INDEX = DOCS / "index.md"
README = ROOT / "README.md"
README_MAX_CHARS = 10_000

EXTERNAL = re.compile(r"^(?:https?://|mailto:)", re.IGNORECASE)
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)
# [text](target "title") and ![alt](target): text may hold one level of brackets
# (an image inside a link: [![alt](img.png)](page.md)).
INLINE_LINK = re.compile(
    r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
REF_DEF = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(<[^>]*>|\S+)")
REF_USE = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\[([^\]]*)\]")
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def strip_fences(text: str) -> list[str]:
    """The file's lines with those of fenced code blocks (and the fences) blanked."""
    out: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None:
            if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
                fence = m.group(1)
                out.append("")
                continue
            out.append(line)
        else:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
                fence = None
            out.append("")
    return out


def strip_code_spans(text: str) -> str:
    """Inline code blanked, paragraph by paragraph (a code span never crosses a blank line);
    newlines are kept so that positions still map to lines."""
    paragraphs = re.split(r"(\n[ \t]*\n)", text)
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731
    return "".join(CODE_SPAN.sub(blank, p) for p in paragraphs)


def prose(path: Path) -> str:
    """The file's text without fenced code and inline code."""
    return strip_code_spans("\n".join(strip_fences(path.read_text(encoding="utf-8"))))


def heading_text(raw: str) -> str:
    """A heading's text as GitHub renders it: code spans keep their content, links and images
    their text, emphasis markers and HTML tags go."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), raw)
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("*", "")
    return text.strip()


def slug(text: str) -> str:
    """GitHub's heading slug (github-slugger): lowercase; every character that is not a letter,
    a digit, a mark, `_`, `-` or a space removed; each space becomes a hyphen."""
    kept = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in "-_ " or cat[0] in "LNM" or cat == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """Every anchor a Markdown file offers: its headings' slugs (a repeated slug gets -1, -2,
    ...) and explicit `<a name=...>` / `id=...` anchors."""
    lines = strip_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found: set[str] = set()

    def add(text: str) -> None:
        base = slug(heading_text(text))
        name = base
        if base in seen:
            n = seen[base]
            while True:
                n += 1
                name = f"{base}-{n}"
                if name not in seen:
                    break
            seen[base] = n
        seen.setdefault(name, 0)
        found.add(name)

    for i, line in enumerate(lines):
        m = ATX.match(line)
        if m:
            add(m.group(2) or "")
        elif SETEXT.match(line) and i > 0 and lines[i - 1].strip() and not ATX.match(lines[i - 1]):
            if line.strip()[0] == "=" or not re.match(r"^ {0,3}[-*+] |^ {0,3}\d+[.)] ", lines[i - 1]):
                add(lines[i - 1])
        found.update(HTML_ANCHOR.findall(line))
    return frozenset(found)


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition, and of
    every reference use whose label is not defined (as `[label]` with nothing to resolve)."""
    text = prose(path)
    found: list[tuple[int, str]] = []
    line_of = lambda pos: text.count("\n", 0, pos) + 1  # noqa: E731
    for m in INLINE_LINK.finditer(text):
        found.append((line_of(m.start()), m.group(2)))
        # an image inside the link text: [![alt](img.png)](page.md)
        for inner in INLINE_LINK.finditer(m.group(1)):
            found.append((line_of(m.start()), inner.group(2)))
    defs: dict[str, str] = {}
    for n, line in enumerate(text.split("\n"), start=1):
        d = REF_DEF.match(line)
        if d:
            defs[d.group(1).strip().lower()] = d.group(2)
            found.append((n, d.group(2)))
    for m in REF_USE.finditer(text):
        label = (m.group(2) or m.group(1)).strip().lower()
        if label not in defs:
            found.append((line_of(m.start()), f"[{label}] (undefined reference)"))
    return found


def resolve(source: Path, target: str) -> tuple[Path | None, str]:
    """The file a relative target names (None for a same-page anchor) and its anchor."""
    target = target.strip("<>")
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    if not path_part:
        return None, unquote(anchor)
    base = ROOT if path_part.startswith("/") else source.parent
    return (base / path_part.lstrip("/")).resolve(), unquote(anchor)


def link_problems(path: Path) -> list[str]:
    problems = []
    for line, target in links(path):
        where = f"{rel(path)}:{line}: link ({target})"
        if target.endswith("(undefined reference)"):
            problems.append(f"{where}: no definition for this reference label")
            continue
        if not target.strip("<>"):
            problems.append(f"{where}: empty target")
            continue
        if EXTERNAL.match(target.strip("<>")):
            continue
        dest, anchor = resolve(path, target)
        page = path if dest is None else dest
        if dest is not None and not dest.exists():
            problems.append(f"{where}: {rel(dest)} does not exist")
            continue
        if anchor and page.is_file() and page.suffix.lower() == ".md":
            if anchor.lower() not in anchors(page):
                problems.append(f"{where}: {rel(page)} has no heading with anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=rel)
def test_links_resolve(path: Path) -> None:
    problems = link_problems(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_in_the_index() -> None:
    assert INDEX.exists(), "docs/index.md does not exist"
    linked = set()
    for _, target in links(INDEX):
        if EXTERNAL.match(target.strip("<>")):
            continue
        dest, _ = resolve(INDEX, target)
        if dest is not None:
            linked.add(dest)
    pages = sorted([*DOCS.glob("*.md"), *(DOCS / "design").glob("*.md")])
    missing = [rel(p) for p in pages if p.resolve() != INDEX.resolve() and p.resolve() not in linked]
    assert not missing, "docs/index.md does not link these pages: " + ", ".join(missing)


def test_readme_is_a_map() -> None:
    size = len(README.read_bytes())  # bytes, as `wc -c` counts: never fewer than characters
    assert size <= README_MAX_CHARS, (
        f"README.md is {size} characters, over {README_MAX_CHARS}: move the details into docs/"
    )
    targets = set()
    for _, target in links(README):
        dest, _ = resolve(README, target) if not EXTERNAL.match(target) else (None, "")
        if dest is not None:
            targets.add(dest)
    assert INDEX.resolve() in targets, "README.md does not link docs/index.md"


def test_the_checker_itself() -> None:
    """Slugs, code stripping and link parsing as GitHub reads them (guards the rules above)."""
    assert slug(heading_text("Lag and `max_lag`")) == "lag-and-max_lag"
    assert slug(heading_text("Code as a task: `task.name: code`")) == "code-as-a-task-taskname-code"
    assert slug(heading_text("Tools: what a call costs (`benchmarks/tools.py`)")) == (
        "tools-what-a-call-costs-benchmarkstoolspy"
    )
    assert slug(heading_text("Loading and publishing: host memory per rank (FSDP2)")) == (
        "loading-and-publishing-host-memory-per-rank-fsdp2"
    )
    assert slug(heading_text("A -> B")) == "a---b"
    text = "see `[a](x.md)` and [b](y.md#z)\n\n```\n[c](w.md)\n```\n"
    lines = "\n".join(strip_fences(text))
    assert [m.group(2) for m in INLINE_LINK.finditer(strip_code_spans(lines))] == ["y.md#z"]
    assert [m.group(2) for m in INLINE_LINK.finditer("[![alt](i.png)](p.md)")] == ["p.md"]
