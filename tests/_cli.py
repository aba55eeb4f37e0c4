"""`autoplan ARGS` through the CLI's entry point in the test's own process."""

from __future__ import annotations

import io
import subprocess
from contextlib import redirect_stderr, redirect_stdout

from autoplan.cli import main


def run_main(*args: str) -> subprocess.CompletedProcess:
    """What `python -m autoplan ARGS` prints and returns, without a new interpreter: each one costs
    torch's import (about 1.5 s of CPU, 3-5 s on a loaded machine) before any planning starts. For
    tests of what a command computes; the console script itself is tested in tests/test_cli.py."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["autoplan", *args], code, out.getvalue(), err.getvalue())
