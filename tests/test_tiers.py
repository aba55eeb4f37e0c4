"""The cases tests/conftest.py moves to the `extended` tier, or marks `long` ([Note: test tiers]), still
exist: a renamed test or parameter would otherwise fall back into the default suite (or into CI's run)
unnoticed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import EXTENDED_CASES, LONG_CASES

ROOT = Path(__file__).resolve().parent.parent


def test_every_case_moved_to_the_extended_tier_names_a_test_and_a_parameter_that_exist():
    missing = []
    for node_id, reason in {**EXTENDED_CASES, **LONG_CASES}.items():
        assert reason.strip() and "kept:" in reason, node_id  # every group names what stays in the default tier
        path, _, rest = node_id.partition("::")
        function, _, param = rest.partition("[")
        source = ROOT / path
        if not source.is_file():
            missing.append(node_id)
            continue
        tree = ast.parse(source.read_text())
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        strings = {str(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, (str, int))}
        if function not in functions:
            missing.append(node_id)
            continue
        arguments = {a.arg for a in functions[function].args.args}
        param = param.rstrip("]")
        # An id is a literal of the file ("hsdp") or pytest's generated ARGNAME + INDEX per argument ("pins1-expected1").
        generated = [re.fullmatch(r"([A-Za-z_]+?)(\d+)", piece) for piece in param.split("-")]
        if param and not _joined_literals(param, strings) and not all(m and m.group(1) in arguments for m in generated):
            missing.append(node_id)
    assert not missing, missing


def _joined_literals(param: str, strings: set[str]) -> bool:
    """Whether `param` is literals of the file joined by "-", as pytest joins the ids of several
    arguments ("pp2-zb-h1" and "bf16" make "pp2-zb-h1-bf16")."""
    pieces = param.split("-")
    ends = {0}  # how many pieces a run of literals can cover
    for end in range(1, len(pieces) + 1):
        if any("-".join(pieces[start:end]) in strings for start in ends if start < end):
            ends.add(end)
    return len(pieces) in ends


def test_the_default_run_leaves_the_extended_tier_out_and_ci_runs_it_but_the_long_cases():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "-m 'not extended and not export'" in pyproject
    ci = (ROOT / ".ci" / "run").read_text()
    assert """python -m pytest -m "extended and not long" """ in ci and "--deselect" not in ci
