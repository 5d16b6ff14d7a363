"""Docs and code cite what a reader can open: files of this repository, or upstream sources by name.

Notes that live outside the repository (design notes, research files) are not citations a user
can follow; paths into this repository must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvobserve.simulate.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = sorted(
    p
    for d in ("kvobserve", "tests", "benchmarks", "scripts", "alerts", "dashboards", "deploy")
    for p in (ROOT / d).rglob("*")
    if p.is_file()
    and p.suffix in {".py", ".md", ".yml", ".yaml", ".sh", ".toml"}
    and "fixtures" not in p.parts
)
OUTSIDE = re.compile(r"research/[\w.-]+|\bDESIGN\.md\b|\bSTYLE\.md\b")
REPO_PATH = re.compile(
    r"`((?:docs|kvobserve|tests|alerts|dashboards|deploy|examples|scripts|benchmarks|fuzz)/[\w./*-]+)`"
)


def test_no_citation_of_notes_outside_the_repository() -> None:
    found = {
        str(p.relative_to(ROOT)): sorted(set(OUTSIDE.findall(p.read_text(errors="replace"))))
        for p in [*DOCS, *CODE]
        if p != Path(__file__)
    }
    assert not {k: v for k, v in found.items() if v}, "cited, but not in the repository"


def test_repository_paths_in_docs_exist() -> None:
    missing = []
    checked = 0
    for path in DOCS:
        text = path.read_text()
        checked += len(REPO_PATH.findall(text))
        missing += [
            f"{path.name}: {p}"
            for p in REPO_PATH.findall(text)
            if not list(ROOT.glob(p.rstrip("/")))
        ]
        links = re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", text)
        missing += [f"{path.name}: {link}" for link in links if not (path.parent / link).exists()]
    assert not missing
    assert checked >= 20  # the pattern finds the paths the docs cite


def test_simulator_doc_lists_every_profile() -> None:
    text = (ROOT / "docs" / "simulator.md").read_text()
    section = text.split("## Fault profiles", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert sorted(rows) == sorted(PROFILES)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_a_heading_find_it() -> None:
    """`[x](page.md#anchor)` and `[x](#anchor)` in the docs name a heading that exists."""
    prose = {p.name: re.sub(r"```.*?```", "", p.read_text(), flags=re.S) for p in DOCS}
    anchors = {n: {_slug(h) for h in re.findall(r"^#+ (.*)$", t, re.M)} for n, t in prose.items()}
    broken = [
        (name, f"{target}#{anchor}")
        for name, text in prose.items()
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md|)#([\w-]+)\)", text)
        if anchor not in anchors.get(Path(target).name if target else name, {anchor})
    ]
    assert not broken, "links to headings that do not exist"
