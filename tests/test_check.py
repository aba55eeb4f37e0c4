"""`autoplan check`: the plan-quality regression gate (suite/baseline parsing, comparison, reports)."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET

import pytest

from autoplan import check
from autoplan.commands.plans import register

SMALL = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=1024,max_seq_len=256"
SUITE = f"""
tolerance: {{throughput: 0.02, memory: 0.02, search_time_s: 60}}
cases:
  - name: small-pp4
    model: "{SMALL}"
    cluster: 1x4xA100-80GB
    global_batch: 16
    seq_len: 256
    pins: {{pp: 4, tp: 1, dp: 1, schedule: 1f1b, micro_batch_size: 2}}
"""


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, width=200, highlight=False)


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """The subcommand as cli.main runs it: a ValueError becomes one line and exit 2."""
    parser = argparse.ArgumentParser(prog="autoplan")
    register(parser.add_subparsers(dest="command"), _console)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as exc:
        print(f"autoplan: error: {str(exc).splitlines()[0]}", file=__import__("sys").stderr)
        code = 2
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory):
    """A suite and a baseline generated from it with --update (planned once for the module)."""
    d = tmp_path_factory.mktemp("check")
    (d / "suite.yaml").write_text(SUITE)
    parser = argparse.ArgumentParser(prog="autoplan")
    register(parser.add_subparsers(dest="command"), _console)
    args = parser.parse_args(["check", str(d / "suite.yaml"), "--baseline", str(d / "base.json"), "--update"])
    assert args.func(args) == 0
    return d


def test_update_writes_baseline(baseline_dir):
    data = json.loads((baseline_dir / "base.json").read_text())
    entry = data["cases"]["small-pp4"]
    assert data["schema_version"] == check.BASELINE_SCHEMA_VERSION
    assert entry["fits"] is True and entry["tokens_per_s"] > 0 and entry["peak_memory_bytes"] > 0
    assert "tp1 pp4 dp1" in entry["config"]
    assert not (baseline_dir / "base.json.tmp").exists()


def test_unchanged_passes_with_junit_and_json(baseline_dir, tmp_path, capsys):
    junit, js = tmp_path / "out.xml", tmp_path / "out.json"
    code, out, _ = _run(["check", str(baseline_dir / "suite.yaml"), "--baseline", str(baseline_dir / "base.json"),
                         "--junit", str(junit), "--json", str(js)], capsys)
    assert code == 0, out
    assert "PASS" in out
    root = ET.parse(junit).getroot()
    cases = root.findall(".//testcase")
    assert [c.get("name") for c in cases] == ["small-pp4"]
    assert cases[0].find("failure") is None
    report = json.loads(js.read_text())
    assert report["passed"] is True and report["cases"][0]["status"] == "pass"


@pytest.mark.parametrize("field,factor,word", [("tokens_per_s", 1.5, "tokens/s dropped"),
                                               ("peak_memory_bytes", 0.5, "peak memory grew")])
def test_better_baseline_fails(baseline_dir, tmp_path, capsys, field, factor, word):
    data = json.loads((baseline_dir / "base.json").read_text())
    data["cases"]["small-pp4"][field] *= factor
    better = tmp_path / "better.json"
    better.write_text(json.dumps(data))
    junit = tmp_path / "out.xml"
    code, out, _ = _run(["check", str(baseline_dir / "suite.yaml"), "--baseline", str(better), "--junit", str(junit)],
                        capsys)
    assert code == 1
    assert "FAIL" in out and word in out
    root = ET.parse(junit).getroot()
    failure = root.find(".//testcase[@name='small-pp4']/failure")
    assert failure is not None and word in failure.get("message")
    assert root.find("testsuite").get("failures") == "1"


def test_case_missing_from_baseline_is_new_unless_strict(baseline_dir, tmp_path, capsys):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"schema_version": check.BASELINE_SCHEMA_VERSION, "cases": {}}))
    suite = str(baseline_dir / "suite.yaml")
    code, out, _ = _run(["check", suite, "--baseline", str(empty)], capsys)
    assert code == 0 and "NEW" in out
    code, out, _ = _run(["check", suite, "--baseline", str(empty), "--strict"], capsys)
    assert code == 1


# ---- comparison rules, with a fake runner (no planning) ------------------------------------------

def _metrics(tps=100.0, mem=1e9, fits=True):
    return {"tokens_per_s": tps, "peak_memory_bytes": mem, "fits": fits, "config": "tp1 pp1 dp1"}


def _suite(**tol):
    return check.Suite((check.Case(name="a", model=SMALL, cluster="1x4xA100-80GB", global_batch=16),),
                       check.Tolerance(**tol))


@pytest.mark.parametrize("current,error,seconds,status", [
    (_metrics(99.0), None, 1.0, "pass"),          # within 2%
    (_metrics(97.0), None, 1.0, "fail"),          # 3% slower
    (_metrics(mem=1.01e9), None, 1.0, "pass"),
    (_metrics(mem=1.05e9), None, 1.0, "fail"),
    (_metrics(fits=False), None, 1.0, "fail"),    # no longer fits
    (None, "no plan fits", 1.0, "fail"),
    (_metrics(), None, 31.0, "fail"),             # over the time budget
    (_metrics(101.0, 0.99e9), None, 1.0, "pass"),  # better, within the tolerance
    (_metrics(150.0, 0.5e9), None, 1.0, "improved"),  # better past it: the baseline is stale (issue 44)
    (_metrics(mem=0.9e9), None, 1.0, "improved"),
    (_metrics(150.0, 1.05e9), None, 1.0, "fail"),     # a regression is named first, whatever else improved
])
def test_compare_rules(current, error, seconds, status):
    report = check.run_check(_suite(), {"a": _metrics()}, runner=lambda case: (current, error, seconds))
    assert report.results[0].status == status, report.results[0].reasons
    assert report.passed == (status == "pass")


# ---- bad input: one line naming the case and the field -------------------------------------------

@pytest.mark.parametrize("text,words", [
    ("cases: [\n  - name: x\n    model: [", ["not valid YAML"]),
    ("cases:\n  - name: x\n    model: gpt2-small\n    cluster: 1x4xA100-80GB\n", ["'x'", "global_batch"]),
    ("cases:\n  - name: x\n    model: gpt2-small\n    cluster: 1x4xA100-80GB\n    global_batch: '16'\n",
     ["'x'", "global_batch", "positive integer"]),
    ("cases:\n  - name: x\n    model: gpt2-small\n    cluster: 1x4xA100-80GB\n    global_batch: 16\n    pins: {tpp: 2}\n",
     ["'x'", "pins", "tpp"]),
    ("cases:\n  - name: x\n    model: gpt2-small\n    cluster: 1x4xA100-80GB\n    global_batch: 16\n    pins: {tp: two}\n",
     ["'x'", "pins.tp"]),
    ("cases:\n  - name: x\n    cluster: 1x4xA100-80GB\n    global_batch: 16\n", ["'x'", "model"]),
    ("cases:\n  - model: gpt2-small\n", ["case #1", "name"]),
    ("tolerance: {throughput: -1}\ncases: []\n", ["tolerance.throughput"]),
    ("cases:\n  - name: x\n    model: nosuchmodel\n    cluster: 1x4xA100-80GB\n    global_batch: 16\n", ["'x'", "'model'"]),
    ("cases:\n  - name: x\n    model: gpt2-small\n    cluster: 3xZZZ\n    global_batch: 16\n", ["'x'", "'cluster'"]),
])
def test_malformed_suite_is_one_line(tmp_path, capsys, text, words):
    suite = tmp_path / "bad.yaml"
    suite.write_text(text)
    code, _, err = _run(["check", str(suite)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("autoplan: error: ")
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("content,words", [
    (None, ["does not exist", "--update"]),
    ("{not json", ["not valid JSON"]),
    (json.dumps({"schema_version": 1, "cases": {"small-pp4": {"tokens_per_s": 1.0, "fits": True}}}),
     ["'small-pp4'", "peak_memory_bytes"]),
    (json.dumps({"schema_version": 1, "cases": {"small-pp4": {"tokens_per_s": "fast", "peak_memory_bytes": 1,
                                                              "fits": True}}}), ["'small-pp4'", "tokens_per_s"]),
    (json.dumps({"schema_version": 99, "cases": {}}), ["schema_version", "--update"]),
])
def test_malformed_baseline_is_one_line(tmp_path, capsys, content, words):
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    base = tmp_path / "base.json"
    if content is not None:
        base.write_text(content)
    code, _, err = _run(["check", str(suite), "--baseline", str(base)], capsys)
    assert code == 2
    assert err.count("\n") == 1
    for word in words:
        assert word in err, err


def test_project_suite_is_valid():
    """ci/plan_quality.yaml parses and its baseline names every case."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    suite = check.load_suite(root / "ci" / "plan_quality.yaml")
    check.validate_case_specs(suite)
    baseline = check.load_baseline(root / "ci" / "plan_quality_baseline.json")
    assert {c.name for c in suite.cases} == set(baseline)
    assert any(c.pins for c in suite.cases)
