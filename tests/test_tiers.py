"""The cases tests/conftest.py moves to the `extended` tier ([Note: test tiers]) still exist: a renamed
test or parameter would otherwise fall back into the default suite unnoticed (or vanish from CI)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import EXTENDED_CASES

ROOT = Path(__file__).resolve().parent.parent


def test_every_case_moved_to_the_extended_tier_names_a_test_and_a_parameter_that_exist():
    missing = []
    for node_id, reason in EXTENDED_CASES.items():
        assert reason.strip() and "kept:" in reason, node_id  # every group names what stays in the default tier
        path, _, rest = node_id.partition("::")
        function, _, param = rest.partition("[")
        source = ROOT / path
        if not source.is_file():
            missing.append(node_id)
            continue
        tree = ast.parse(source.read_text())
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        if function not in functions:
            missing.append(node_id)
            continue
        arguments = {a.arg for a in functions[function].args.args}
        param = param.rstrip("]")
        # An id is a literal of the file ("hsdp") or pytest's generated ARGNAME + INDEX per argument ("pins1-expected1").
        generated = [re.fullmatch(r"([A-Za-z_]+?)(\d+)", piece) for piece in param.split("-")]
        if param and param not in strings and not all(m and m.group(1) in arguments for m in generated):
            missing.append(node_id)
    assert not missing, missing


def test_the_default_run_leaves_the_extended_tier_out_and_ci_runs_it():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "-m 'not extended and not export'" in pyproject
    assert "python -m pytest -m extended" in (ROOT / ".ci" / "run").read_text()
