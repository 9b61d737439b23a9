"""Every relative link in the repository's documents resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "results" / "README.md"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve(doc):
    for target in LINK.findall(doc.read_text()):
        if "://" in target:
            continue
        assert (doc.parent / target).exists(), f"{doc.name}: {target}"
