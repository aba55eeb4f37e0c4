"""The CI gate on the cost model (issue 28): predictions of every published run in benchmarks/data/
against the ones recorded in ci/published_predictions.json. It must pass as shipped and fail when a
change moves a prediction, as commit 1841fb7's zero-1 memory change did (optimizer state kept whole
at zero 1 with tp > 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "ci" / "published_predictions.json"
SCRIPT = ROOT / "benchmarks" / "validate_published.py"


def _script():
    return load_benchmark("validate_published")


@pytest.mark.timeout(300)
def test_gate_passes_as_shipped_through_the_script():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check", str(RECORD)], capture_output=True, text=True,
                            timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "published-run gate: passed" in result.stdout
    # Every run of both shared files is checked, none declared out of memory.
    from autoplan.published import load_runs

    assert f"{len(load_runs())} runs checked" in result.stdout
    # Progress goes to stderr, row by row (issue 44: a long run is not silent), and --help states how long.
    assert f"checking the published runs: {len(load_runs())}/{len(load_runs())} rows" in result.stderr
    usage = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "minutes" in usage.stdout and "progress on stderr" in usage.stdout
    # A false out-of-memory verdict fails the gate unless the record lists it as a known gap.
    import json

    recorded = json.loads(RECORD.read_text())["runs"]
    for line in result.stdout.splitlines():
        if "OUT OF MEMORY" in line:
            assert recorded[line.split()[0]]["fits"] is False, line


@pytest.mark.timeout(300)
def test_gate_fails_with_the_zero1_regression_reapplied(monkeypatch, capsys):
    """1841fb7 kept Adam's state whole at zero 1 with tp > 1; re-applied alone, the gate must fail."""
    from autoplan.cost import memory

    original = memory.persistent_bytes_per_param

    def replicated_with_tp(dtype, zero, dp, dp_replicate=1, tp=1):
        if zero == 1 and tp > 1:
            return memory.BYTES_PER_PARAM(dtype)
        return original(dtype, zero, dp, dp_replicate, tp)

    monkeypatch.setattr(memory, "persistent_bytes_per_param", replicated_with_tp)
    script = _script()
    from autoplan.published import load_runs

    assert script.check(RECORD, load_runs()) == 1
    out = capsys.readouterr().out
    assert "published-run gate: FAILED" in out
    assert "zoo_q235_tp4_ep8_pp8" in out.split("FAIL", 1)[1]


def test_gate_fails_on_a_moved_prediction(tmp_path, capsys):
    """A recorded prediction 10% away from today's is a failure that names the run and both figures."""
    import json

    data = json.loads(RECORD.read_text())
    first = next(iter(data["runs"]))
    data["runs"][first]["step_s"] *= 1.10
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(data))
    from autoplan.published import load_runs

    assert _script().check(moved, load_runs()) == 1
    out = capsys.readouterr().out
    assert f"FAIL {first}: predicted step" in out
