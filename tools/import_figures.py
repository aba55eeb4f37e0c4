"""The import graph's figures (issue 42): packages, upward imports, circles and private names imported
across modules, read from grimp's graph as tests/test_import_cycles.py reads it (every import counts,
those inside functions and under TYPE_CHECKING too).

    python tools/import_figures.py            # the four figures
    python tools/import_figures.py --list     # and every private name imported across modules

- packages: autoplan's packages (modules with submodules), the root included;
- upward imports: imports against the layers contracts of pyproject.toml (`lint-imports` checks the same);
- circles: strongly connected components of more than one module;
- private names: distinct (importer, module, name) of `from M import _x` where M is another autoplan
  module and `_x` a function, class or value of M (a private *module* such as `report/timeline/_drawing.py`
  is that package's, so `from autoplan.report.timeline import _drawing` does not count; its names do).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path

import grimp

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter's own dependency
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_import_cycles import import_circles  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def layers_contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]


def upward_imports(graph: grimp.ImportGraph) -> list[str]:
    found = []
    for contract in layers_contracts():
        layers = [grimp.Layer(*(m.strip() for m in layer.split("|")), independent=True)
                  for layer in contract["layers"]]
        containers = set(contract.get("containers", []))
        for dep in graph.find_illegal_dependencies_for_layers(layers=layers, containers=containers):
            for route in dep.routes:
                found.append(f"{dep.importer} -> {dep.imported} (via {' -> '.join(route.heads)})")
    return found


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def private_names(graph: grimp.ImportGraph) -> list[tuple[str, str, str, int]]:
    """(importer, module, name, line) of every private name imported from another autoplan module."""
    found = set()
    for module in sorted(graph.modules):
        spec = importlib.util.find_spec(module)
        tree = ast.parse(Path(spec.origin).read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == "autoplan" and node.module != module):
                continue
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and not is_module(f"{node.module}.{name}"):
                    found.add((module, node.module, name, node.lineno))
    firsts: dict[tuple[str, str, str], int] = {}
    for importer, source, name, line in sorted(found):
        firsts.setdefault((importer, source, name), line)
    return [(*key, line) for key, line in sorted(firsts.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list every private name imported across modules")
    args = parser.parse_args()
    graph = grimp.build_graph("autoplan", cache_dir=None)
    packages = sorted(m for m in graph.modules if Path(importlib.util.find_spec(m).origin).name == "__init__.py")
    upward, circles, private = upward_imports(graph), import_circles(), private_names(graph)
    print(f"packages: {len(packages)}; upward imports: {len(upward)}; circles: {len(circles)}; "
          f"private names imported across modules: {len(private)}")
    for line in upward:
        print("  upward:", line)
    for circle in circles:
        print("  circle:", "; ".join(circle))
    if args.list:
        for importer, source, name, line in private:
            print(f"  {importer}:{line} imports {source}.{name}")


if __name__ == "__main__":
    main()
