"""The map lives in the repo: docs/architecture.md, and nothing outside docs/ points elsewhere.

The design notes once lived in ../shared/DESIGN.md, which a clone does not have; code and the
README now point at docs/architecture.md sections. Anchors cited as ``docs/architecture.md#x``
must name a heading that exists.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
ANCHOR = re.compile(r"docs/architecture\.md#([a-z0-9-]+)")


def _repo_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    files = []
    for name in listed:
        path = ROOT / name
        if name.startswith("docs/") or path == Path(__file__).resolve() or not path.is_file():
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def _heading_anchors(markdown: str) -> set[str]:
    # GitHub's rule: lower case, drop punctuation but hyphens, spaces become hyphens.
    return {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.splitlines() if line.startswith("#")}


def test_no_reference_to_the_old_design_file_outside_docs():
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in _repo_text_files()
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "DESIGN.md" in line]
    assert hits == [], "point these at docs/architecture.md#<section> instead:\n" + "\n".join(hits)


def test_every_cited_section_of_the_architecture_doc_exists():
    anchors = _heading_anchors(DOC.read_text(encoding="utf-8"))
    assert {"request-flow", "failure-handling", "liveness", "security"} <= anchors
    cited = {(m.group(1), str(p.relative_to(ROOT))) for p in [*_repo_text_files(), DOC]
             for m in ANCHOR.finditer(p.read_text(encoding="utf-8"))}
    missing = sorted(f"{path}: #{anchor}" for anchor, path in cited if anchor not in anchors)
    assert missing == [], "no such heading in docs/architecture.md:\n" + "\n".join(missing)
