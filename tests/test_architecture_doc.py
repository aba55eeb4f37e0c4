"""docs/architecture.md is the map of the code (issue 30): every path it names exists, and every public
module of the package is named on it, so a module moved or added without the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoplan"
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _exists(path: str) -> bool:
    """A path as the page writes it: from the package (`graph/trace.py`) or inside a package the line
    is about (`timeline/` on the report's line), or from the repository root (`docs/`, `tests/...`)."""
    return any((base / path).exists() for base in (ROOT, PACKAGE, *[d for d in PACKAGE.iterdir() if d.is_dir()]))


def test_every_path_on_the_page_exists():
    paths = set(re.findall(r"(?<![\w./-])((?:[a-z_]+/)+(?:[a-z_]+\.py)?)(?![\w])", DOC))
    assert len(paths) > 30, f"the page names only {len(paths)} paths: is the pattern still right?"
    missing = sorted(p for p in paths if not _exists(p))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_public_module_is_on_the_page():
    modules = [f for f in PACKAGE.rglob("*.py") if not f.name.startswith("_")]
    assert len(modules) > 80
    unnamed = sorted(f.relative_to(PACKAGE).as_posix() for f in modules
                     if f.name not in DOC and f.relative_to(PACKAGE).as_posix() not in DOC)
    assert not unnamed, f"modules docs/architecture.md does not name (add them to the map): {unnamed}"
