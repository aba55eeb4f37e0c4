"""Every code block of the README runs as written: the Python blocks in a fresh interpreter, every
`autoplan` command of the shell blocks in order (later commands read what earlier ones wrote), in a
scratch directory holding the files the README names.

Not run here, and why: the two set-up commands (they create a virtual environment; checked by hand in
a fresh venv, see docs/status.md) and the multi-node `torchrun` line (it needs `$HEAD` and 16 nodes).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)


def _commands(block: str) -> list[str]:
    """The block's commands with continuation lines joined and trailing comments dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("autoplan "):
            out.append(re.sub(r"\s+#.*$", "", line))
    return out


SHELL = [c for lang, block in BLOCKS if lang == "bash" for c in _commands(block)]
PYTHON = [block for lang, block in BLOCKS if lang == "python"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("readme")
    for folder in ("examples", "ci"):
        shutil.copytree(ROOT / folder, work / folder)
    return work


def test_the_readme_has_the_blocks_this_test_runs():
    assert len(SHELL) >= 15 and len(PYTHON) >= 1
    assert any(c.startswith("autoplan run ") for c in SHELL)
    assert "torchrun" in README  # the one multi-node line, not run here


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_readme_command_runs(workdir):
    autoplan = [sys.executable, "-m", "autoplan"]
    for command in SHELL:
        args = shlex.split(command)[1:]
        if args[0] == "calibrate" and "--force" not in args:
            # A busy machine's unstable fit is refused (tested in test_newcomer_timing.py); here the
            # README's command must run whatever the load.
            args.append("--force")
        proc = subprocess.run([*autoplan, *args], cwd=workdir, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"`{command}` exited {proc.returncode}: {proc.stderr.strip()[-600:]}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_every_readme_python_block_runs(workdir, index):
    proc = subprocess.run([sys.executable, "-c", PYTHON[index]], cwd=workdir, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr.strip()[-800:]
    assert "step 2: loss" in proc.stdout or index > 0
