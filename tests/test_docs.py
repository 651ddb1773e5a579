"""The map lives in the repo, and every reference into it points at something that exists.

The design notes once lived in ../shared/DESIGN.md, which a clone does not have; code and the
README now point at sections of the files in docs/. A reference goes stale when the section it
names is renamed or moved, so every kind the repo uses is checked:

- ``docs/<file>.md`` and ``docs/<file>.md#<section>`` anywhere (paths from the repository root);
- Markdown links ``[text](path#section)`` in ``.md`` files (paths from the linking file);
- ``README "Section"`` / ``README 'Section'``: a README heading that holds those words;
- ``§N``: numbered sections of the old design file, which no document has any more.
"""
from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
DOC_REF = re.compile(r"(?<![\w/.-])(docs/[\w.-]+\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
README_REF = re.compile(r"README[ ,]+[\"']([^\"'\n]+)[\"']")
SECTION_SIGN = re.compile(r"§\s*\d[\d.]*")
FENCE = re.compile(r"^\s*(```|~~~)")


def _repo_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    files = []
    for name in listed:
        path = ROOT / name
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def _headings(markdown: str) -> list[str]:
    """The heading lines' text, outside fenced code blocks (a ``# comment`` there is no heading)."""
    headings, fenced = [], False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            headings.append(line.lstrip("#").strip())
    return headings


def _anchor(heading: str) -> str:
    # GitHub's rule: lower case, drop punctuation but hyphens and underscores, spaces become hyphens.
    return re.sub(r"[^\w -]", "", heading.lower()).replace(" ", "-")


@cache
def _anchors_of(path: Path) -> frozenset[str]:
    return frozenset(_anchor(h) for h in _headings(path.read_text(encoding="utf-8")))


def _missing(target: Path, section: str | None) -> str | None:
    """Why ``target#section`` does not resolve, or None when it does."""
    if not target.is_file():
        return "no such file"
    if section and target.suffix == ".md" and section not in _anchors_of(target):
        return f"no heading #{section} in {target.relative_to(ROOT)}"
    return None


def stale_references(path: Path, text: str) -> list[str]:
    """Every reference in ``text`` (the contents of ``path``) whose target does not exist."""
    stale = []
    for n, line in enumerate(text.splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{n}"
        for m in DOC_REF.finditer(line):
            why = _missing(ROOT / m.group(1), m.group(2))
            if why:
                stale.append(f"{where}: {m.group(0)}: {why}")
        if path.suffix == ".md":
            for m in MD_LINK.finditer(line):
                link = m.group(1)
                if re.match(r"[a-z]+:", link):          # http:, https:, mailto:
                    continue
                file_part, _, section = link.partition("#")
                target = (path.parent / file_part).resolve() if file_part else path
                why = _missing(target, section or None)
                if why:
                    stale.append(f"{where}: ({link}): {why}")
        for m in README_REF.finditer(line):
            headings = [h.lower() for h in _headings((ROOT / "README.md").read_text(encoding="utf-8"))]
            if not any(m.group(1).lower() in h for h in headings):
                stale.append(f"{where}: {m.group(0)}: no README heading holds {m.group(1)!r}")
        for m in SECTION_SIGN.finditer(line):
            stale.append(f"{where}: {m.group(0)}: numbered sections are gone; cite docs/<file>.md#<section>")
    return stale


def test_no_reference_to_the_old_design_file():
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in _repo_text_files() if not p.is_relative_to(ROOT / "docs")
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "DESIGN.md" in line]
    assert hits == [], "point these at docs/architecture.md#<section> instead:\n" + "\n".join(hits)


def test_the_architecture_doc_has_the_sections_code_cites_most():
    assert {"request-flow", "failure-handling", "liveness", "security"} <= _anchors_of(DOC)


def test_every_reference_to_a_document_or_section_exists():
    stale = [s for p in _repo_text_files() for s in stale_references(p, p.read_text(encoding="utf-8"))]
    assert stale == [], "stale references (rename the reference or restore the section):\n" + "\n".join(stale)


def test_a_stale_reference_of_each_kind_is_caught():
    code = ROOT / "router" / "dispatch.py"
    text = ("see docs/architecture.md#request-flow, docs/architecture.md#gone,\n"
            "docs/nothing.md, DESIGN §3.7 and README 'Security' but README 'No such heading'\n")
    assert stale_references(code, text) == [
        "router/dispatch.py:1: docs/architecture.md#gone: no heading #gone in docs/architecture.md",
        "router/dispatch.py:2: docs/nothing.md: no such file",
        "router/dispatch.py:2: README 'No such heading': no README heading holds 'No such heading'",
        "router/dispatch.py:2: §3.7: numbered sections are gone; cite docs/<file>.md#<section>",
    ]
    readme = ROOT / "README.md"
    links = "[ok](docs/cluster.md#layout) [bad](docs/cluster.md#nowhere) [gone](#no-heading) [web](https://x.org/#y)\n"
    assert stale_references(readme, links) == [
        "README.md:1: docs/cluster.md#nowhere: no heading #nowhere in docs/cluster.md",
        "README.md:1: (docs/cluster.md#nowhere): no heading #nowhere in docs/cluster.md",
        "README.md:1: (#no-heading): no heading #no-heading in README.md",
    ]
