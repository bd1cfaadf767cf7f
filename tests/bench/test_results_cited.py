"""Every benchmark result committed under bench/results/ is cited where readers look: a
figure nobody can trace to a page is noise, and a page citing a missing file is a dead link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _text() -> str:
    return "\n".join(p.read_text() for p in PAGES if p.is_file())


def test_every_result_file_is_cited_in_the_docs_or_the_bench_readme():
    text = _text()
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.stem not in text)
    assert not uncited, f"cite these in docs/ or bench/README.md, or remove them: {uncited}"


def test_every_cited_result_file_exists():
    cited = set(re.findall(r"bench/results/([\w.-]+\.(?:json|png))", _text()))
    missing = sorted(name for name in cited if not (RESULTS / name).is_file())
    assert not missing, f"cited but not in bench/results/: {missing}"
