"""The docs hold together: every relative link in README, CHANGELOG and ``docs/`` resolves (file and ``#anchor``),
README stays an entrance (at most 250 lines), and no doc or source file names an issue number.

Each check has a planted failure in a scratch folder that it must report.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def doc_files(root: Path = REPO) -> list[Path]:
    """README.md, CHANGELOG.md, every ``docs/**/*.md`` and the results index."""
    files = [root / "README.md", root / "CHANGELOG.md", *sorted((root / "docs").rglob("*.md")),
             root / "benchmarks" / "results" / "README.md"]
    return [f for f in files if f.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings (duplicates numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    inside = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
        if inside or not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every link outside code blocks and inline code."""
    found, inside = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if inside:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            found.append((i, m.group(1) or m.group(2)))
    return found


def broken(files: list[Path]) -> list[str]:
    """``file:line: target (why)`` for every relative link that does not resolve."""
    out = []
    for f in files:
        for line, target in links(f):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                out.append(f"{f.relative_to(f.parents[len(f.parents) - 1])}:{line}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                out.append(f"{f}:{line}: {target} (no heading #{frag})")
    return out


def test_every_relative_link_resolves():
    assert doc_files() and broken(doc_files()) == []


def test_a_broken_link_and_a_missing_anchor_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n\nSee [a](docs/a.md#there) and [b](docs/b.md) and [c](#top).\n"
                                        "```\n[not a link](nowhere.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Here\n")
    found = broken(doc_files(tmp_path))
    assert len(found) == 2 and "docs/b.md (no such file)" in found[1] and "no heading #there" in found[0], found


def test_readme_is_an_entrance():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: keep it an entrance, move the rest to docs/"
    assert "random" in "\n".join(lines[:40]).lower(), "the first screen says that the weights are random"


ISSUE = re.compile(r"\bissues? #?\d+\b|\bissue-\d+\b", re.I)


def issue_mentions(root: Path) -> list[str]:
    """``file:line`` of every issue number in the docs and the product code."""
    files = doc_files(root) + [p for pkg in ("patches", "cosmos_framework_ext", "miles_ext", "launchers", "benchmarks")
                               for p in (root / pkg).rglob("*") if p.suffix in (".py", ".sh", ".md", ".toml")]
    return [f"{p.relative_to(root)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if ISSUE.search(line)]


def test_no_issue_numbers_in_docs_or_code():
    assert issue_mentions(REPO) == []


def test_an_issue_number_is_found(tmp_path):
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "x.py").write_text('"""Fixed in issue 14."""\n')
    (tmp_path / "README.md").write_text("# x\n")
    assert issue_mentions(tmp_path) == ["patches/x.py:1"]


@pytest.mark.parametrize("heading,want", [("## The levers and their proofs", "the-levers-and-their-proofs"),
                                          ("### `summary.json`", "summaryjson"),
                                          ("## Cosmos3-Edge: main commands", "cosmos3-edge-main-commands")])
def test_slug(heading, want):
    assert slug(heading.lstrip("#")) == want
