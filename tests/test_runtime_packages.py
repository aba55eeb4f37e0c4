"""The runtime's packages (issue 42 item 4): launcher/ > api.py > execution/ > checkpoint/ > parallel/, an
import-linter contract that an import upward between them breaks; and the launcher's machine check still
imports no torch, so `autoplan run` refuses a plan this machine cannot hold before torch loads."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.test_import_layers import ROOT, _lint_imports


@pytest.mark.parametrize("module, line, broken", [
    # a parallelizing step reaching up to the executor that runs it
    ("runtime/parallel/split.py", "from autoplan.runtime.execution import executor",
     "autoplan.runtime.parallel.split -> autoplan.runtime.execution.executor"),
    # the checkpoint code reaching up to the training loop
    ("runtime/checkpoint/format.py", "from autoplan.runtime.launcher import training",
     "autoplan.runtime.checkpoint.format -> autoplan.runtime.launcher.training"),
])
def test_an_upward_import_between_the_runtimes_packages_breaks_the_contract(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "autoplan", tmp_path / "autoplan", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "autoplan" / module, "a") as f:
        f.write(f"\n{line}  # noqa: E402,F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-1000:]
    assert "the runtime's packages" in proc.stdout and broken in proc.stdout, proc.stdout[-2000:]


def test_the_machine_check_and_the_runtime_package_import_no_torch():
    code = ("import sys, autoplan.runtime, autoplan.runtime.launcher.machine, autoplan.calibrate; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('autoplan'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
