"""No import circle between autoplan's modules (issue 30): the layers contract (test_import_layers.py)
keeps imports running downward between layers, this keeps them acyclic inside a layer too (a module
and its sibling importing each other, graph/source.py and graph/hf.py before issue 30).

Every import counts, the ones inside functions and under TYPE_CHECKING as well (grimp, the import
graph import-linter builds): a lazy import hides a circle from Python's import machinery, not from a
reader. A circle is reported as its modules in order, each with the line that imports the next.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx

ROOT = Path(__file__).resolve().parent.parent


def import_circles(package: str = "autoplan") -> list[list[str]]:
    """One circle per strongly connected component of the package's import graph of more than one
    module, as `a -> b -> ... -> a` with each import's line; empty when the graph is acyclic."""
    graph = grimp.build_graph(package, cache_dir=None)
    imports = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            imports.add_edge(module, imported)
    circles = []
    for component in sorted(sorted(c) for c in nx.strongly_connected_components(imports) if len(c) > 1):
        cycle = nx.find_cycle(imports.subgraph(component), source=component[0])
        steps = []
        for importer, imported in cycle:
            lines = sorted(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))
            steps.append(f"{importer} (line {lines[0] if lines else '?'}) -> {imported}")
        circles.append(steps)
    return circles


def _circles_in(root: Path) -> subprocess.CompletedProcess:
    """`import_circles()` on the package under `root`, in a fresh interpreter (its own sys.modules)."""
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{ROOT}")
    code = ("import sys; from tests.test_import_cycles import import_circles; circles = import_circles(); "
            "print('\\n'.join('; '.join(c) for c in circles)); sys.exit(1 if circles else 0)")
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def test_no_import_circle_between_modules():
    circles = import_circles()
    assert not circles, "import circles (first: " + "; ".join(circles[0]) + f"), {len(circles)} in all"


def test_a_deliberate_circle_is_found(tmp_path):
    shutil.copytree(ROOT / "autoplan", tmp_path / "autoplan", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "autoplan" / "models" / "bounds.py", "a") as f:  # bounds <- config <- bounds
        f.write("\n\ndef _late():\n    from autoplan.models import config  # noqa: F401\n")
    proc = _circles_in(tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "autoplan.models.bounds (line " in proc.stdout and "-> autoplan.models.config" in proc.stdout, proc.stdout
