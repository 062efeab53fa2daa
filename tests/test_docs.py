"""The reliability document points at tests and benchmarks that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).parent.parent


def test_every_test_and_benchmark_the_reliability_document_cites_exists() -> None:
    doc = (REPO / "docs" / "reliability.md").read_text()
    cited = re.findall(r"`(test_\w+\.py)(?:::(\w+))?`", doc)
    assert len(cited) >= 20
    for file, name in cited:
        source = (REPO / "tests" / file).read_text()
        assert not name or f"def {name}(" in source, f"{file}::{name}"
    for script in re.findall(r"`(benchmarks/\w+\.py)`", doc):
        assert (REPO / script).is_file(), script


DOCS = REPO / "docs"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_in_the_readme_and_docs_reaches_a_file_and_heading_that_exist() -> None:
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    checked = 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.MULTILINE)
                assert anchor in {_anchor(h) for h in headings}, f"{page.name}: {target}"
            checked += 1
    assert checked >= 15


def test_the_readme_links_every_page_of_the_docs() -> None:
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", (REPO / "README.md").read_text()))
    assert linked == {p.name for p in DOCS.glob("*.md")}


def test_the_readmes_first_sixty_lines_set_up_run_and_instrument() -> None:
    first = "\n".join((REPO / "README.md").read_text().splitlines()[:60])
    for needed in ("bash scripts/demo.sh", "bash scripts/test.sh", "root", "pip install",
                   "dcp_otel.instrument()", "opentelemetry-instrument", ".venv/bin/dcp-otel report out/demo/traces"):  # fmt: skip
        assert needed in first, needed
