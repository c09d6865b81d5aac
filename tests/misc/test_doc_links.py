"""Every link in the README and the docs resolves: relative links to a file that exists, ``#anchors`` to a heading.

Anchors follow GitHub's rules for headings (github-slugger): the heading's text
as rendered (code spans and link texts kept, markup dropped), lower-cased, every
character but letters, digits, ``_``, ``-`` and spaces removed, each space made a
``-``; a heading that repeats an earlier slug gets ``-1``, ``-2``, ... Links and
headings inside code (fenced blocks, code spans) are not links. External
``http(s)`` links are not fetched (no network): only their form is checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "node_modules", "build", "dist"}


def markdown_files() -> list[Path]:
    """The README, docs/ and every other Markdown file of the repository (not in a virtualenv or build folder)."""
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts[:-1])
        and not any(part.startswith(".") for part in p.relative_to(ROOT).parts[:-1])
    )


FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# [text](target "title") and ![alt](target): the text may hold one level of brackets; the target, one of parentheses
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?((?:[^()\s<>]|\([^()\s]*\))*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
AUTOLINK = re.compile(r"<((?:https?|ftp|mailto):[^>\s]*)>")
HTML_ATTR = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']*)[\"']", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"<[a-z][^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
HTML_TAG = re.compile(r"<[^>]+>")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fence = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE_OPEN.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)) :].strip():
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((number, line))
    return out


def rendered_text(inline: str) -> str:
    """A heading's text as GitHub renders it: code spans' contents, links' texts, no HTML tags or escapes."""
    spans: list[str] = []

    def keep(m: re.Match[str]) -> str:
        spans.append(m.group(2).strip() if m.group(2).strip() else m.group(2))
        return f"\x00{len(spans) - 1}\x00"

    text = CODE_SPAN.sub(keep, inline)
    text = INLINE_LINK.sub(lambda m: m.group(1), text)
    text = HTML_TAG.sub("", text)
    text = re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", text)
    return re.sub("\x00(\\d+)\x00", lambda m: spans[int(m.group(1))], text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's rendered text (without the suffix of a repeated heading)."""
    kept = "".join(ch for ch in heading.strip().lower() if ch.isalnum() or ch in "-_ ")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file defines: its headings' slugs (repeats numbered) and HTML ``id``/``name``s."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            base = slug(rendered_text(m.group(2) or ""))
            name, n = base, seen.get(base, 0)
            while name in out:
                n += 1
                name = f"{base}-{n}"
            seen[base] = n
            out.add(name)
        out.update(a.lower() for a in HTML_ANCHOR.findall(line))
    return out


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code: inline, image, reference definitions, autolinks, HTML."""
    found = []
    lines = prose_lines(text)
    # join the prose (a link's text may wrap onto the next line), keeping each character's line number
    joined, line_of = "", []
    for number, line in lines:
        joined += line + "\n"
        line_of.extend([number] * (len(line) + 1))
    prose = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), joined)  # (same length: line numbers hold)
    for pattern, group in ((INLINE_LINK, 2), (AUTOLINK, 1), (HTML_ATTR, 1)):
        for m in pattern.finditer(prose):
            found.append((line_of[m.start()], m.group(group)))
    for number, line in lines:
        m = REFERENCE_DEF.match(line)
        if m:
            found.append((number, m.group(1)))
    return sorted(found)


def problems(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the links of ``path`` (a file of the repository at ``root``): one line each."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root)
    out = []
    for number, target in links(text):
        where = f"{rel}:{number}: {target!r}"
        parts = urlsplit(target)
        if parts.scheme in ("http", "https"):
            host = parts.hostname or ""
            if not re.fullmatch(r"[a-z0-9-]+(\.[a-z0-9-]+)+(:\d+)?", host) or " " in target:
                out.append(f"{where}: not a well-formed URL")
            continue
        if parts.scheme == "mailto":
            if not re.fullmatch(r"[^@\s]+@[^@\s]+\.[a-z]+", parts.path):
                out.append(f"{where}: not a well-formed address")
            continue
        if parts.scheme or parts.netloc:
            out.append(f"{where}: a scheme other than http(s) or mailto")
            continue
        if not parts.path and not parts.fragment:
            out.append(f"{where}: an empty link")
            continue
        file = (
            path
            if not parts.path
            else (root / unquote(parts.path).lstrip("/") if parts.path.startswith("/") else path.parent / unquote(parts.path))
        )
        file = file.resolve()
        if not file.is_relative_to(root.resolve()):
            out.append(f"{where}: outside the repository")
            continue
        if not file.exists():
            out.append(f"{where}: no such file ({file.relative_to(root.resolve())})")
            continue
        if parts.fragment:
            fragment = unquote(parts.fragment)
            if file.suffix.lower() == ".md":
                if fragment.lower() not in anchors(file.read_text(encoding="utf-8")):
                    out.append(f"{where}: no heading or anchor '#{fragment}' in {file.relative_to(root.resolve())}")
            elif file.is_dir() or not re.fullmatch(r"L\d+(-L\d+)?", fragment):
                out.append(f"{where}: an anchor into a file that is not Markdown (only #L<line> is meaningful there)")
    return out


FILES = markdown_files()


def test_the_readme_and_the_docs_are_checked() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert "README.md" in names and "docs/loader.md" in names and "docs/observability.md" in names
    assert sum(len(links(p.read_text(encoding="utf-8"))) for p in FILES) > 50


@pytest.mark.parametrize("path", FILES, ids=[p.relative_to(ROOT).as_posix() for p in FILES])
def test_every_link_resolves(path: Path) -> None:
    found = problems(path)
    assert not found, "broken links:\n" + "\n".join(found)


# ---- the checker itself -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        # as GitHub renders them (anchors seen in this repository's docs and on github.com)
        ("Issue 25: the accounting's overhead (2026-11-25, 21:01-21:05 UTC)", "issue-25-the-accountings-overhead-2026-11-25-2101-2105-utc"),
        ("Coming from FFCV", "coming-from-ffcv"),
        ("`num_workers`: threads in the Loader, processes in the writer", "num_workers-threads-in-the-loader-processes-in-the-writer"),
        ('`stats()["accounting"]`', "statsaccounting"),
        ("The [cache](remote.md) and *you*", "the-cache-and-you"),
        ("A -- B", "a----b"),
        ("Ünïcode café — ok", "ünïcode-café--ok"),
        ("snake_case\\_name", "snake_case_name"),
    ],
)
def test_anchors_follow_githubs_rules(heading: str, anchor: str) -> None:
    assert anchor in anchors(f"# {heading}\n")


def test_repeated_headings_are_numbered_and_code_is_no_heading_nor_link() -> None:
    text = "# Notes\n## Notes\n### Notes ###\n```python\n# not a heading\n[nor](a-link.md)\n```\n`[code](span.md)` [real](x.md)\n"
    assert anchors(text) == {"notes", "notes-1", "notes-2"}
    assert links(text) == [(8, "x.md")]


def test_a_link_that_wraps_and_reference_definitions_are_found() -> None:
    text = 'see [the\nguide](guide.md#part "title") and <https://example.org/a>\n\n[ref]: other.md\n<a href="page.md">x</a>\n'
    assert links(text) == [(1, "guide.md#part"), (2, "https://example.org/a"), (4, "other.md"), (5, "page.md")]


def test_broken_links_are_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Its part\n", encoding="utf-8")
    (tmp_path / "code.py").write_text("x = 1\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n"
        "[ok](other.md#its-part) [ok](#page) [ok](../code.py#L1) [ok](/docs/other.md) [ok](https://example.org/x?y=1#z)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [self](#nothing) [out](../../etc/passwd)\n"
        "[url](https://example..org/x) [line](../code.py#top) [empty]()\n",
        encoding="utf-8",
    )
    found = problems(page, tmp_path)
    assert len(found) == 7, found
    for expected in ("'missing.md': no such file", "'other.md#nowhere': no heading", "'#nothing': no heading", "outside the repository",
                     "not a well-formed URL", "'../code.py#top': an anchor into a file", "'': an empty link"):  # fmt: skip
        assert any(expected in line for line in found), (expected, found)
    assert all(line.startswith("docs/page.md:3") or line.startswith("docs/page.md:4") for line in found), found
