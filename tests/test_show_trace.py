"""`autoplan show PLAN --trace T` refuses a trace measured on another plan (issue 29: a trace of one
plan shown against another read "measured 166.53 ms vs predicted 53.56 ms (3.11x)")."""

from __future__ import annotations

import json

import pytest

from autoplan.cli import main
from autoplan.plan import Plan
from autoplan.report import timeline

TINY = "gpt:num_layers=2,hidden_size=32,num_heads=2,vocab_size=64,max_seq_len=16"
JOB = ["--model", TINY, "--cluster", "1x2xcpu", "--global-batch", "4", "--seq-len", "16"]


def _suggest(path, *pins: str) -> Plan:
    assert main(["suggest", *JOB, *pins, "--out", str(path)]) == 0
    return Plan.load(path)


def test_show_refuses_the_trace_of_another_plan_through_the_cli(tmp_path, capsys):
    """The user's path: two plans, one run with --trace, each plan shown with that trace."""
    a, b, trace = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "t.json"
    plan_a = _suggest(a, "--pp", "2")
    plan_b = _suggest(b, "--dp", "2")
    assert (plan_a.pp, plan_b.dp) == (2, 2)
    capsys.readouterr()
    assert main(["run", str(a), "--steps", "1", "--trace", str(trace)]) == 0
    capsys.readouterr()

    assert main(["show", str(b), "--trace", str(trace)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the plan's tables
    assert err.count("\n") == 1 and err.startswith("autoplan: error: ")
    assert f"trace {trace}" in err and "another plan" in err and str(b) in err and "dp 2" in err
    recorded = json.loads(trace.read_text())["otherData"]  # the run names the plan it ran
    assert recorded["autoplan_plan_fingerprint"] == plan_a.run_fingerprint != plan_b.run_fingerprint
    assert "pp 2" in err  # the refusal names the plan the trace was measured on

    assert main(["show", str(a), "--trace", str(trace), "--out", str(tmp_path / "t.svg")]) == 0
    out, err = capsys.readouterr()
    assert "measured step" in out and err == ""
    assert 'data-timeline="measured"' in (tmp_path / "t.svg").read_text()


def _trace_of(plan: Plan, metadata: dict | None = None) -> dict:
    """A trace as `autoplan run --trace` writes it: every rank, its compute actions, one step."""
    pred = timeline.predicted_timeline(plan)
    events = []
    for b in pred.boxes:
        if b.is_compute:
            for dp_index in range(plan.dp):
                for tp_index in range(plan.tp):
                    events.append({"name": b.action, "ph": "X", "pid": plan.rank(b.rank, dp_index, tp_index),
                                   "tid": 0, "ts": b.start_s * 1e6, "dur": b.duration_s * 1e6, "args": {"step": 0}})
    trace = {"traceEvents": events}
    if metadata is not None:
        trace["otherData"] = metadata
    return trace


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plans of one layout (pp 2, one micro-batch of 4) that differ only in their model."""
    import autoplan

    kw = dict(global_batch=4, seq_len=16, pp=2, micro_batch_size=4, schedule="1f1b")
    one = autoplan.suggest(TINY, "1x2xcpu", **kw)[0]
    two = autoplan.suggest(TINY.replace("hidden_size=32", "hidden_size=64"), "1x2xcpu", **kw)[0]
    return one, two


def test_the_recorded_fingerprint_tells_plans_of_one_layout_apart(plans, tmp_path, capsys):
    one, two = plans
    assert timeline.plan_fingerprint(one) != timeline.plan_fingerprint(two)
    one.save(tmp_path / "one.json")
    # The fingerprint survives a save and a load (a trace is compared with the plan file).
    assert timeline.plan_fingerprint(Plan.load(tmp_path / "one.json")) == timeline.plan_fingerprint(one)
    two.save(tmp_path / "two.json")
    (tmp_path / "t.json").write_text(json.dumps(_trace_of(one, timeline.trace_metadata(one))))
    assert main(["show", str(tmp_path / "two.json"), "--trace", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hidden_size=32" in err and "hidden_size=64" in err
    assert main(["show", str(tmp_path / "one.json"), "--trace", str(tmp_path / "t.json")]) == 0
    assert "measured step" in capsys.readouterr().out


def test_a_trace_without_a_fingerprint_is_compared_by_its_ranks_and_actions(plans):
    one, _ = plans
    timeline.check_trace_matches(_trace_of(one), one)  # its own trace passes
    events = _trace_of(one)["traceEvents"]
    with pytest.raises(timeline.TimelineError, match="it has 1 rank, the plan 2"):
        timeline.check_trace_matches({"traceEvents": [e for e in events if e["pid"] == 0]}, one)
    renamed = [dict(e, name=e["name"].replace("F0", "F1")) for e in events]
    with pytest.raises(timeline.TimelineError, match="another plan.*compute actions"):
        timeline.check_trace_matches({"traceEvents": renamed}, one)
