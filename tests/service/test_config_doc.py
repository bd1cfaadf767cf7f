"""The docs stay true to the code: docs/configuration.md is what services/cli/config_doc.py
writes from the flag table (as tests/service/test_proto.py checks the generated stubs), README.md
stays a landing page, and every relative link in README.md and docs/ leads to a file."""

from __future__ import annotations

import re
from pathlib import Path

from services.cli import config_doc
from services.cli.cli_flags import FLAGS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIG_PAGE = DOCS / "configuration.md"
README_MAX_LINES = 200
# [text](target) and ![alt](target), the target up to a space or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def test_configuration_page_is_current() -> None:
    assert CONFIG_PAGE.read_text() == config_doc.render(), (
        "docs/configuration.md is stale: run `make docs`"
    )


def test_configuration_page_lists_every_flag_with_its_env_twin() -> None:
    page = config_doc.render()
    for flag in FLAGS:
        assert f"`{flag.option}`" in page, flag.option
        assert f"`{flag.env}`" in page, flag.env


def test_every_section_has_a_title_and_notes() -> None:
    used = {flag.target.split(".")[0] for flag in FLAGS}
    assert used <= set(config_doc.TITLES), used - set(config_doc.TITLES)
    assert set(config_doc.NOTES) <= set(config_doc.TITLES)


def test_readme_is_a_landing_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    text = "\n".join(lines)
    # the two commands of a fresh machine, as .ci/run and `make help` know them
    assert "make serve" in text and "make test" in text


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens."""
    anchors = set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_relative_link_points_at_an_existing_file() -> None:
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
