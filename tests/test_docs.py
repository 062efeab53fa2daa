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
