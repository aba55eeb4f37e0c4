"""Imports run downward: the layers of docs/architecture.md are an import-linter contract
(pyproject.toml, [tool.importlinter]); `lint-imports` keeps it, and breaks it when a module imports
from a layer above its own (issue 30)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package under `root`, with that checkout's pyproject.toml, no cache."""
    env = dict(os.environ, PYTHONPATH=str(root))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", str(root / "pyproject.toml")], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_its_layers():
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-1000:]
    assert "3 kept, 0 broken" in proc.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "autoplan", tmp_path / "autoplan", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "autoplan" / "cost" / "ops.py", "a") as f:  # the cost model reaching up to the CLI
        f.write("\nfrom autoplan import cli  # noqa: E402,F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-1000:]
    assert "BROKEN" in proc.stdout and "autoplan.cost.ops -> autoplan.cli" in proc.stdout


def test_the_runtime_reaching_into_the_search_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "autoplan", tmp_path / "autoplan", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "autoplan" / "runtime" / "parallel" / "split.py", "a") as f:  # allowed by the layers alone
        f.write("\nfrom autoplan.search import space  # noqa: E402,F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-1000:]
    assert "2 kept, 1 broken" in proc.stdout and "autoplan.runtime.parallel.split -> autoplan.search.space" in proc.stdout


@pytest.mark.parametrize("module, line, broken", [
    # the analysis reaching into the built-in models (issue 30: models apart from analysis)
    ("graph/blocks.py", "from autoplan.models import build_model", "autoplan.graph.blocks -> autoplan.models"),
    # a built-in model reaching up to the sources that wrap it (what made graph/source.py and hf.py a circle)
    ("models/build.py", "from autoplan.sources import hf", "autoplan.models.build -> autoplan.sources.hf"),
])
def test_the_analysis_and_the_models_stay_below_the_sources(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "autoplan", tmp_path / "autoplan", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "autoplan" / module, "a") as f:
        f.write(f"\n{line}  # noqa: E402,F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-1000:]
    assert "2 kept, 1 broken" in proc.stdout and broken in proc.stdout, proc.stdout[-2000:]
