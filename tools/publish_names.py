"""Private names imported across modules made part of their module's interface (issue 42 item 4): each
name of `RENAMES` loses its underscore (or takes a clearer name) in the module that defines it and in
every file that reaches it there (`from M import _x`, `M._x`, `mock.patch("M._x")`), so no module imports
another's private name. As a script, like tools/split_runtime.py (run that first), so that it can be run
again on a tree that changed meanwhile: `--dry-run` prints the files it would change.

It stops, before changing anything, where a new name is already a word in a file it would rewrite (a
local variable of that name would be shadowed), or where a file it would rewrite defines a private name
of the same spelling itself. The names left private are those a module keeps for itself.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

# module -> {private name: public name}
RENAMES: dict[str, dict[str, str]] = {
    "autoplan.runtime.checkpoint.format": {"_STEP_DIR": "STEP_DIR", "_rank_key": "rank_key", "_one_line": "one_line"},
    "autoplan.runtime.checkpoint.integrity": {"_check_structure": "check_structure", "_open": "open_checkpoint",
                                              "_file_entry": "file_entry", "_Damaged": "Damaged"},
    "autoplan.runtime.checkpoint.planners": {"_save_planner": "save_planner", "_load_planner": "load_planner",
                                             "_Pieces": "Pieces", "_pieces": "pieces_of",
                                             "_with_pieces": "with_pieces", "_Placeholder": "Placeholder"},
    "autoplan.runtime.checkpoint.reader": {"_dcp_load": "dcp_load", "_cause": "root_cause"},
    "autoplan.runtime.checkpoint.state": {"_model_state": "model_state", "_unheld_names": "unheld_names",
                                          "_rank_state": "rank_state", "_canonical": "canonical_name",
                                          "_param_names": "param_names"},
    "autoplan.runtime.launcher.faults": {"_Fault": "Fault", "_parse_faults": "parse_faults",
                                         "_sigkill_self": "sigkill_self", "_inject": "inject", "_poison": "poison"},
    "autoplan.runtime.launcher.preflight": {"_note": "print_note"},
    "autoplan.runtime.launcher.rendezvous": {"_loopback_process_group": "loopback_process_group",
                                             "_loopback_interface": "loopback_interface"},
    "autoplan.runtime.launcher.training": {"_train": "train_rank"},
    "autoplan.models.common": {"_embedding": "make_embedding"},
    "autoplan.models.spec": {"_did_you_mean": "did_you_mean"},
    "autoplan.report.timeline.png": {"_pyplot": "load_pyplot"},
    "autoplan.report.timeline.model": {"_bubble": "bubble_share"},
    "autoplan.sources.user": {"_templates_from_examples": "templates_from_examples"},
}

ME = "tools/publish_names.py"
DIRS = ("autoplan/", "tests/", "benchmarks/", "examples/")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def reaches(text: str, module: str, old: str) -> bool:
    """Whether a file takes `old` from `module`: `from module import old`, `module.old` (a mock.patch
    string too), or `base.old` where it imports the module itself (`from package import base`)."""
    package, _, base = module.rpartition(".")
    imports = re.findall(rf"from {re.escape(module)} import (\([^)]*\)|[^\n]*)", text)
    if any(re.search(rf"(?<!\w){re.escape(old)}(?!\w)", names) for names in imports):
        return True
    if re.search(rf"{re.escape(module)}\.{re.escape(old)}(?!\w)", text):
        return True
    imports_module = re.search(rf"from {re.escape(package)} import (\([^)]*|[^\n]*)\b{base}\b", text)
    return bool(imports_module and re.search(rf"(?<![\w.]){base}\.{re.escape(old)}(?!\w)", text))


def names_in(text: str) -> set[str]:
    """The identifiers of a Python file's code (not its strings or comments)."""
    try:
        return {t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NAME}
    except (tokenize.TokenError, SyntaxError):
        return set(re.findall(r"\w+", text))


def with_all(text: str, names: list[str]) -> str:
    """`text` with `names` added to its `__all__` (where it declares one; the module's own order kept)."""
    tree = ast.parse(text)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
                and isinstance(node.value, ast.List)):
            listed = [e.value for e in node.value.elts]
            added = [n for n in sorted(names) if n not in listed]
            if not added:
                return text
            lines = text.splitlines(keepends=True)
            items, rows = [f'"{n}"' for n in listed + added], ["__all__ = ["]
            for item in items:
                piece = item + ", "
                if len(rows[-1]) + len(piece) > 110:
                    rows[-1] = rows[-1].rstrip()
                    rows.append(" " * 11)
                rows[-1] += piece
            rows[-1] = rows[-1].removesuffix(", ") + "]"
            lines[node.lineno - 1:node.end_lineno] = ["\n".join(rows) + "\n"]
            return "".join(lines)
    return text


def plan(root: Path) -> dict[str, str]:
    """path -> new text, or exit naming each collision."""
    files = {p: (root / p).read_text() for p in git("ls-files", *DIRS).split()
             if p.endswith(".py") and p != ME and (root / p).is_file()}
    new_texts, problems = {}, []
    for module, names in RENAMES.items():
        defining = module.replace(".", "/") + ".py"
        if defining not in files:
            problems.append(f"{defining} not found (run tools/split_runtime.py first?)")
            continue
        for old, new in names.items():
            word = re.compile(rf"(?<![\w]){re.escape(old)}(?!\w)")
            scope = [defining] + [p for p, t in files.items() if p != defining
                                  and reaches(new_texts.get(p, t), module, old)]
            if not word.search(files[defining]):
                continue  # done already
            for path in scope:
                text = new_texts.get(path, files[path])
                if new in names_in(text):
                    problems.append(f"{path}: {new} (for {module}.{old}) is already a name there")
                if path != defining and re.search(rf"^\s*(def |class ){re.escape(old)}\b|^{re.escape(old)} =", text,
                                                  re.M):
                    problems.append(f"{path} defines its own {old}")
                new_texts[path] = word.sub(new, text)
        if defining in new_texts:
            new_texts[defining] = with_all(new_texts[defining], list(names.values()))
    if problems:
        sys.exit("publish_names: " + "; ".join(problems))
    return {p: t for p, t in new_texts.items() if t != files[p]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the files it would change, change nothing")
    args = parser.parse_args()
    root = Path(git("rev-parse", "--show-toplevel").strip())
    os.chdir(root)
    changes = plan(root)
    for path, text in sorted(changes.items()):
        print(f"rewrite {path}")
        if not args.dry_run:
            (root / path).write_text(text)
    if not changes:
        print("publish_names: nothing to do")
    elif not args.dry_run:  # a renamed name can leave an import list out of order
        subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "--select", "I001", "--fix", *changes])


if __name__ == "__main__":
    main()
