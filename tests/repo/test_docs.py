"""The docs agree with themselves: README's table of current figures is docs/results.md's (one
figure, one place: results.md is where it is written), and no page links to a missing file."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TABLE = re.compile(r"<!-- current-table:begin[^>]*-->\n(.*?)\n<!-- current-table:end -->", re.S)


def _table(path: Path) -> str:
    found = TABLE.findall(path.read_text())
    assert len(found) == 1, f"{path}: expected one current-table block, found {len(found)}"
    return found[0]


def test_readme_table_is_the_one_in_results():
    assert _table(REPO / "README.md") == _table(REPO / "docs" / "results.md"), (
        "README.md's current table differs from docs/results.md's: copy it from docs/results.md"
    )


def test_relative_links_resolve():
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
