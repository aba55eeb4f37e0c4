"""Split autoplan/runtime/ by concern (issue 42 item 4), as a script so that it can be run again on a tree
that changed meanwhile: `python tools/split_runtime.py --dry-run` prints what it would do, without it does it.

It (1) `git mv`s each module of `MOVES` to its new path (a runtime module the table does not name stops it
before anything moves: place it in the table by hand), (2) rewrites every mention of a moved module in the
tracked files (dotted `autoplan.runtime.x` names, `from autoplan.runtime import x`, `runtime/x.py` paths,
`"runtime" / "x.py"` path expressions), and (3) adds the runtime's packages to the import-linter contracts
in pyproject.toml. Run twice, the second run finds nothing to do.

Where each module goes, and why (the packages' layers, highest first, are `RUNTIME_LAYERS`):

- `launcher/`: launching and supervising a job: the checks before any process starts (preflight, machine,
  job_file, optim_config, datasets), the ranks the launcher spawns and watches (launch, ranks, rendezvous,
  faults) and the training loop each rank runs (training). machine.py imports no torch, so `autoplan run`
  still refuses a plan this machine cannot hold before torch loads: no package `__init__` on its way
  imports anything ([Note: the refusal before torch] in machine.py).
- `api.py` stays the runtime's entry (`partition`): it applies every step below and builds the executor, so
  it sits above both; the package's `__init__` still exports `partition`, `PartitionedModel`, `run_plan`,
  `PipelineExecutor`, `Stage`, `ActionRecord` and `PartitionError` lazily.
- `execution/`: running a step: the pipeline executor and its point-to-point transfers (executor, comm), the
  running model `PartitionedModel` (partitioned), activation recomputation, which wraps a stage's forward
  in the executor's `Stage` (recompute), and the gradients' global-norm clipping (clipping).
- `checkpoint/` (already a package): state in and out; the full model's weights copied into a rank
  (weights) and a checkpoint written as a transformers directory (hf_export) join it.
- `parallel/`: applying the plan's parallelism to this rank's model, each a step `partition` calls: the
  pipeline split (split), the device mesh (mesh), tp (tensor_parallel, tensor_parallel_graph), dp and FSDP
  (data_parallel, fsdp), cp (context), ep and expert tp (experts, expert_tp, routed_experts), mixed
  precision (precision), ZeRO-1's optimizer-state sharding over dp (optimizer), and the refusal all of
  them raise (errors). The checkpoint code reads the boxes of tp shards and ZeRO-1's inner optimizer,
  so parallel/ sits below checkpoint/.
- `autoplan/calibrate/`: GPU calibration (calibrate, calibrate_kernels, calibrate_collectives,
  calibrate_fit) and the measure of what a rank holds that checks cost/memory.py (measure). It feeds the
  cost model, but it cannot sit in `autoplan.cost`'s layer: the command takes the runtime's timeout bound
  (preflight.MAX_TIMEOUT_S) and the collective curves spawn ranks with the launcher's `LocalJob`
  (ranks.py), and measure reads the checkpoint's `local_optimizer`; so it is a package of its own on the
  layer above the runtime, apart from the search and the runtime's internals, and its output format stays
  cost/calibration.py.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

RUNTIME = "autoplan/runtime"

# Current file -> its new path, both from the repository root (a path equal to its key stays).
MOVES: dict[str, str] = {
    # launching and supervising
    "autoplan/runtime/launch.py": "autoplan/runtime/launcher/launch.py",
    "autoplan/runtime/ranks.py": "autoplan/runtime/launcher/ranks.py",
    "autoplan/runtime/rendezvous.py": "autoplan/runtime/launcher/rendezvous.py",
    "autoplan/runtime/preflight.py": "autoplan/runtime/launcher/preflight.py",
    "autoplan/runtime/machine.py": "autoplan/runtime/launcher/machine.py",
    "autoplan/runtime/training.py": "autoplan/runtime/launcher/training.py",
    "autoplan/runtime/faults.py": "autoplan/runtime/launcher/faults.py",
    "autoplan/runtime/datasets.py": "autoplan/runtime/launcher/datasets.py",
    "autoplan/runtime/optim_config.py": "autoplan/runtime/launcher/optim_config.py",
    "autoplan/runtime/job_file.py": "autoplan/runtime/launcher/job_file.py",
    # the entry: partition(model, plan)
    "autoplan/runtime/__init__.py": "autoplan/runtime/__init__.py",
    "autoplan/runtime/api.py": "autoplan/runtime/api.py",
    # executing
    "autoplan/runtime/executor.py": "autoplan/runtime/execution/executor.py",
    "autoplan/runtime/comm.py": "autoplan/runtime/execution/comm.py",
    "autoplan/runtime/partitioned.py": "autoplan/runtime/execution/partitioned.py",
    "autoplan/runtime/recompute.py": "autoplan/runtime/execution/recompute.py",
    "autoplan/runtime/clipping.py": "autoplan/runtime/execution/clipping.py",
    # each dimension's partition-time and per-step hooks (issue 42 item 2): called by partition and by
    # PartitionedModel.step, and calling recompute's apply, so they sit with the step
    "autoplan/runtime/dimensions": "autoplan/runtime/execution/dimensions",
    # state in and out
    "autoplan/runtime/checkpoint": "autoplan/runtime/checkpoint",
    "autoplan/runtime/weights.py": "autoplan/runtime/checkpoint/weights.py",
    "autoplan/runtime/hf_export.py": "autoplan/runtime/checkpoint/hf_export.py",
    # parallelizing
    "autoplan/runtime/split.py": "autoplan/runtime/parallel/split.py",
    "autoplan/runtime/mesh.py": "autoplan/runtime/parallel/mesh.py",
    "autoplan/runtime/errors.py": "autoplan/runtime/parallel/errors.py",
    "autoplan/runtime/tensor_parallel.py": "autoplan/runtime/parallel/tensor_parallel.py",
    "autoplan/runtime/tensor_parallel_graph.py": "autoplan/runtime/parallel/tensor_parallel_graph.py",
    "autoplan/runtime/data_parallel.py": "autoplan/runtime/parallel/data_parallel.py",
    "autoplan/runtime/fsdp.py": "autoplan/runtime/parallel/fsdp.py",
    "autoplan/runtime/context.py": "autoplan/runtime/parallel/context.py",
    "autoplan/runtime/experts.py": "autoplan/runtime/parallel/experts.py",
    "autoplan/runtime/expert_tp.py": "autoplan/runtime/parallel/expert_tp.py",
    "autoplan/runtime/routed_experts.py": "autoplan/runtime/parallel/routed_experts.py",
    "autoplan/runtime/precision.py": "autoplan/runtime/parallel/precision.py",
    "autoplan/runtime/optimizer.py": "autoplan/runtime/parallel/optimizer.py",
    # calibration (the cost model's inputs), a package of its own above the runtime
    "autoplan/runtime/calibrate.py": "autoplan/calibrate/calibrate.py",
    "autoplan/runtime/calibrate_kernels.py": "autoplan/calibrate/calibrate_kernels.py",
    "autoplan/runtime/calibrate_collectives.py": "autoplan/calibrate/calibrate_collectives.py",
    "autoplan/runtime/calibrate_fit.py": "autoplan/calibrate/calibrate_fit.py",
    "autoplan/runtime/measure.py": "autoplan/calibrate/measure.py",
}

# The new packages' __init__.py: a docstring, no imports (importing `autoplan.runtime.launcher.machine`
# must load no torch).
NEW_PACKAGES: dict[str, str] = {
    "autoplan/runtime/launcher": (
        "Launching and supervising a job: the checks before any process starts, the local ranks, their\n"
        "process group and the training loop each runs (docs/architecture.md, \"Launch\").\n\n"
        "Nothing is imported here: `autoplan run` imports machine.py before torch loads."),
    "autoplan/runtime/execution": (
        "Running a step: the pipeline executor and its transfers, the running `PartitionedModel`, the\n"
        "dimensions' hooks it calls (dimensions/), recomputation and gradient clipping (docs/architecture.md, \"A schedule is data\")."),
    "autoplan/runtime/parallel": (
        "The plan's parallelism applied to this rank's model: each module is one step `partition`\n"
        "(runtime/api.py) calls, in the order that file gives."),
    "autoplan/calibrate": (
        "`autoplan calibrate`: what this machine's GPU (or CPU) achieves, measured and fitted into the\n"
        "parameters the cost model reads (cost/calibration.py), and what a rank holds, measured against\n"
        "cost/memory.py (measure.py)."),
}

# The runtime's packages, highest first: a package imports only from those below it.
RUNTIME_LAYERS = ["launcher", "api", "execution", "checkpoint", "parallel"]
RUNTIME_CONTRACT = f'''
[[tool.importlinter.contracts]]
name = "the runtime's packages: launching, the entry, executing, checkpoints, parallelizing (docs/architecture.md)"
type = "layers"
containers = ["autoplan.runtime"]
layers = [{", ".join(f'"{layer}"' for layer in RUNTIME_LAYERS)}]
'''
RUNTIME_LAYER_LINE = '    "autoplan.api | autoplan.runtime | autoplan.published",'
CALIBRATE_LAYER_LINE = '    "autoplan.calibrate",  # measures the machine, for the cost model; spawns with the launcher\n'
FORBIDDEN_SOURCES = 'source_modules = ["autoplan.runtime"]'
# tests/test_import_layers.py counts the contracts kept.
CONTRACT_COUNTS = {'"2 kept, 0 broken"': '"3 kept, 0 broken"', '"1 kept, 1 broken"': '"2 kept, 1 broken"'}

ME = "tools/split_runtime.py"
SKIPPED_SUFFIXES = (".gz", ".png", ".jpg", ".pt", ".bin", ".npy", ".safetensors", ".pdf", ".svg")


def git(*args: str, capture: bool = True) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=capture, text=True).stdout


def module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def unplaced(root: Path) -> list[str]:
    """Runtime modules and packages the table does not name (a module added since it was written)."""
    placed = set(MOVES) | set(NEW_PACKAGES)
    found = []
    for entry in sorted((root / RUNTIME).iterdir()):
        rel = entry.relative_to(root).as_posix()
        if entry.name == "__pycache__" or (entry.is_file() and entry.suffix != ".py"):
            continue
        if rel not in placed:
            found.append(rel)
    return found


def plan_moves(root: Path) -> list[tuple[str, str]]:
    """The moves still to do; stops on a table entry found at neither of its paths, or at both."""
    todo, errors = [], []
    for src, dst in MOVES.items():
        if src == dst:
            if not (root / src).exists():
                errors.append(f"{src} is in the table but not in the tree")
            continue
        at_src, at_dst = (root / src).exists(), (root / dst).exists()
        if at_src and at_dst:
            errors.append(f"{src} and {dst} both exist")
        elif at_src:
            todo.append((src, dst))
        elif not at_dst:
            errors.append(f"{src} is in the table but neither it nor {dst} is in the tree")
    if errors:
        sys.exit("split_runtime: " + "; ".join(errors))
    return todo


def renames() -> tuple[dict[str, str], dict[str, str]]:
    """(old dotted module -> new, old path from autoplan/ -> new) for every module the table moves."""
    modules, paths = {}, {}
    for src, dst in MOVES.items():
        if src != dst:
            modules[module_of(src)] = module_of(dst)
            paths[src.removeprefix("autoplan/")] = dst.removeprefix("autoplan/")
    return modules, paths


def rewriters() -> list[tuple[re.Pattern, callable]]:
    modules, paths = renames()
    dotted = re.compile(r"(?<![\w.])(" + "|".join(re.escape(m) for m in sorted(modules, key=len, reverse=True))
                        + r")(?!\w)")
    # `runtime/x.py` (from the package) or `autoplan/runtime/x.py` (from the root), not another project's
    # `deepspeed/runtime/utils.py`
    names = "|".join(re.escape(p.removeprefix("runtime/")) for p in sorted(paths, key=len, reverse=True))
    from_root = re.compile(r"(?<![\w./-])autoplan/runtime/(" + names + r")(?![\w/])")
    from_package = re.compile(r"(?<![\w./-])runtime/(" + names + r")(?![\w/])")
    # `ROOT / "autoplan" / "runtime" / "split.py"` in the tests
    parts = re.compile(r'"runtime" / "(' + names + r')"')

    def quoted(new: str) -> str:
        return " / ".join(f'"{p}"' for p in new.split("/"))

    return [
        (dotted, lambda m: modules[m.group(1)]),
        (from_root, lambda m: "autoplan/" + paths["runtime/" + m.group(1)]),
        (from_package, lambda m: paths["runtime/" + m.group(1)]),
        (parts, lambda m: quoted(paths["runtime/" + m.group(1)])),
    ]


def rewrite_package_imports(text: str, path: str) -> str:
    """`from autoplan.runtime import machine, run_plan` -> one import per package the names now live in."""
    if "from autoplan.runtime import" not in text:
        return text
    modules, _ = renames()
    moved = {old.rsplit(".", 1)[1]: new.rsplit(".", 1)[0] for old, new in modules.items()}
    try:
        tree = ast.parse(text)
    except SyntaxError:
        sys.exit(f"split_runtime: cannot parse {path} to rewrite its `from autoplan.runtime import`")
    lines = text.splitlines(keepends=True)
    for node in sorted(ast.walk(tree), key=lambda n: -getattr(n, "lineno", 0)):
        if not (isinstance(node, ast.ImportFrom) and node.module == "autoplan.runtime" and node.level == 0
                and any(a.name in moved for a in node.names)):
            continue
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        if first[:node.col_offset].strip() or last[node.end_col_offset:].strip():
            sys.exit(f"split_runtime: {path}:{node.lineno}: rewrite this `from autoplan.runtime import` by hand")
        groups: dict[str, list[str]] = defaultdict(list)
        for alias in node.names:
            name = alias.name + (f" as {alias.asname}" if alias.asname else "")
            groups[moved.get(alias.name, "autoplan.runtime")].append(name)
        indent = first[:node.col_offset]
        new = "".join(f"{indent}from {package} import {', '.join(names)}\n" for package, names in sorted(groups.items()))
        lines[node.lineno - 1:node.end_lineno] = [new]
    return "".join(lines)


def rewrite_text(text: str, path: str) -> str:
    for pattern, replacement in rewriters():
        text = pattern.sub(replacement, text)
    if path.endswith(".py"):
        text = rewrite_package_imports(text, path)
    return text


def rewrite_pyproject(text: str) -> str:
    if RUNTIME_CONTRACT.strip() in text:
        return text
    if RUNTIME_LAYER_LINE not in text or FORBIDDEN_SOURCES not in text:
        sys.exit("split_runtime: pyproject.toml's import-linter contracts changed; add the runtime's by hand "
                 f"(RUNTIME_CONTRACT in {ME})")
    text = text.replace(RUNTIME_LAYER_LINE, CALIBRATE_LAYER_LINE + RUNTIME_LAYER_LINE, 1)
    text = text.replace(FORBIDDEN_SOURCES, 'source_modules = ["autoplan.runtime", "autoplan.calibrate"]', 1)
    end = text.index(FORBIDDEN_SOURCES.replace('"]', '", "autoplan.calibrate"]'))
    end = text.index("\n\n", end)  # after the forbidden contract
    return text[:end] + "\n" + RUNTIME_CONTRACT.rstrip("\n") + text[end:]


def rewrite_layer_test(text: str) -> str:
    for old, new in CONTRACT_COUNTS.items():
        text = text.replace(old, new)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the moves and rewrites, change nothing")
    parser.add_argument("--diff", action="store_true", help="with --dry-run: print each rewrite's diff")
    args = parser.parse_args()
    root = Path(git("rev-parse", "--show-toplevel").strip())
    os.chdir(root)

    missing = unplaced(root)
    if missing:
        sys.exit("split_runtime: not in the table (MOVES in tools/split_runtime.py), place each by hand and "
                 "run again: " + ", ".join(missing))
    todo = plan_moves(root)
    tracked = set(git("ls-files", "--", RUNTIME).split())
    untracked = [src for src, _ in todo if src not in tracked and not any(t.startswith(src + "/") for t in tracked)]
    if untracked:
        sys.exit("split_runtime: not tracked by git (add or drop them first): " + ", ".join(untracked))

    for src, dst in todo:
        print(f"move {src} -> {dst}")
        if args.dry_run:
            continue
        package = Path(dst).parent
        package.mkdir(parents=True, exist_ok=True)
        init = package / "__init__.py"
        if package.as_posix() in NEW_PACKAGES and not init.exists():
            init.write_text(f'"""{NEW_PACKAGES[package.as_posix()]}\n"""\n')
            git("add", init.as_posix())
        git("mv", src, dst)
    for package in NEW_PACKAGES:
        if not args.dry_run and not (root / package / "__init__.py").exists():
            sys.exit(f"split_runtime: {package} has no __init__.py")

    # With --dry-run the files are still at their old paths: read them there.
    contract_added = RUNTIME_CONTRACT.strip() not in (root / "pyproject.toml").read_text()
    changed = []
    for path in git("ls-files").split():
        if path == ME or path.endswith(SKIPPED_SUFFIXES) or not (root / path).is_file():
            continue
        try:
            old = (root / path).read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite_text(old, path)
        if path == "pyproject.toml":
            new = rewrite_pyproject(new)
        if path == "tests/test_import_layers.py" and contract_added:
            new = rewrite_layer_test(new)
        if new == old:
            continue
        changed.append(path)
        diff_lines = [(a, b) for a, b in zip(old.splitlines(), new.splitlines()) if a != b]
        print(f"rewrite {path}: {len(diff_lines)} lines" if len(old.splitlines()) == len(new.splitlines())
              else f"rewrite {path}")
        if args.dry_run:
            if args.diff:
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), path, path))
            continue
        (root / path).write_text(new)
    if not todo and not changed:
        print("split_runtime: nothing to do (already split)")
    elif not args.dry_run:
        py = [p for p in changed if p.endswith(".py")]
        if py:  # a renamed module can leave an import block out of order
            subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "--select", "I001", "--fix", *py])
        print(f"split_runtime: {len(todo)} moved, {len(changed)} files rewritten; now run `lint-imports` and "
              "`python -m pytest -q tests/test_import_layers.py tests/test_import_cycles.py "
              "tests/test_architecture_doc.py`")


if __name__ == "__main__":
    main()
