"""Timelines of a plan: predicted from the schedule simulation, measured from a Chrome trace."""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET

import pytest

import autoplan
from autoplan.commands.plans import register
from autoplan.plan import PlanError
from autoplan.report import timeline
from autoplan.schedule import make_schedule

SMALL = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=1024,max_seq_len=256"
SVG = "{http://www.w3.org/2000/svg}"


def _plan(**pins):
    kw = dict(pp=4, tp=1, dp=1, schedule="1f1b", micro_batch_size=2) | pins
    return autoplan.suggest(SMALL, "1x4xA100-80GB", global_batch=16, seq_len=256, **kw)[0]


@pytest.fixture(scope="module")
def plan():
    return _plan()


def _boxes(svg_text: str, label: str = "predicted"):
    root = ET.fromstring(svg_text)
    return [r for r in root.iter(f"{SVG}rect") if r.get("class") == "box" and r.get("data-timeline") == label]


def test_svg_1f1b_rows_and_order(plan):
    assert (plan.pp, plan.num_microbatches) == (4, 8)
    svg = timeline.to_svg([timeline.predicted_timeline(plan)], plan)
    boxes = _boxes(svg)
    assert {b.get("data-rank") for b in boxes} == {"0", "1", "2", "3"}
    schedule = make_schedule("1f1b", 4, 8)
    for rank in range(4):
        mine = sorted((b for b in boxes if b.get("data-rank") == str(rank) and b.get("data-kind") in ("F", "B")),
                      key=lambda b: float(b.get("data-start-s")))
        assert sum(b.get("data-kind") == "F" for b in mine) == 8
        assert sum(b.get("data-kind") == "B" for b in mine) == 8
        assert [b.get("data-action") for b in mine] == [str(a) for a in schedule.actions[rank]]
        # Boxes on one rank never overlap, and idle gaps show as space between them.
        ends = [float(b.get("data-end-s")) for b in mine]
        starts = [float(b.get("data-start-s")) for b in mine]
        assert all(s >= e - 1e-12 for e, s in zip(ends, starts[1:]))
    title = ET.fromstring(svg).find(f"{SVG}title").text
    assert "bubble" in title and "step" in title


def test_predicted_matches_plan_prediction(plan):
    t = timeline.predicted_timeline(plan)
    assert t.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-6)
    assert t.bubble_fraction == pytest.approx(plan.predicted.bubble_fraction, rel=1e-6)
    assert any(b.kind == "RECV_F" for b in t.boxes) and any(b.kind == "OPT" for b in t.boxes)


def test_zb_h1_has_w_boxes():
    zb = _plan(schedule="zb-h1")
    t = timeline.predicted_timeline(zb)
    assert sum(b.kind == "W" for b in t.boxes) == 4 * 8
    # The plan keeps the largest rank's exposed DP reduction; the timeline draws it on every rank.
    assert t.step_time_s == pytest.approx(zb.predicted.step_time_s, rel=1e-3)


def _fake_trace(plan, slowdown: float = 1.25) -> dict:
    """What `autoplan run --trace` writes: pid = global rank, two steps, times in microseconds."""
    pred = timeline.predicted_timeline(plan)
    events = []
    for step, offset in ((0, 0.0), (1, 10.0)):
        for b in pred.boxes:
            if b.is_compute:
                events.append({"name": b.action, "ph": "X", "pid": plan.rank(b.rank, 0), "tid": 0,
                               "ts": (offset + b.start_s * slowdown) * 1e6, "dur": b.duration_s * slowdown * 1e6,
                               "args": {"step": step}})
    events.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}})
    return {"traceEvents": events}


def test_measured_timeline_takes_last_step(plan):
    m = timeline.measured_timeline(_fake_trace(plan), plan)
    assert m.num_ranks == 4
    assert min(b.start_s for b in m.boxes) == pytest.approx(0.0)
    compute_end = max(b.end_s for b in timeline.predicted_timeline(plan).boxes if b.is_compute)
    assert m.step_time_s == pytest.approx(compute_end * 1.25, rel=1e-6)
    assert sum(b.kind == "F" for b in m.rank_boxes(2)) == 8


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="autoplan")
    from rich.console import Console

    register(parser.add_subparsers(dest="command"), lambda stderr=False: Console(stderr=stderr, width=200))
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as exc:
        print(f"autoplan: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        code = 2
    out = capsys.readouterr()
    return code, out.out, out.err


def test_show_with_trace_svg_and_chrome_json(plan, tmp_path, capsys):
    plan.save(tmp_path / "plan.json")
    (tmp_path / "measured.json").write_text(json.dumps(_fake_trace(plan)))
    code, out, _ = _run(["show", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "measured.json"),
                         "--out", str(tmp_path / "t.svg")], capsys)
    assert code == 0
    assert "stages of the best plan" in out and "measured step" in out
    svg = (tmp_path / "t.svg").read_text()
    assert len(_boxes(svg, "predicted")) > 0 and len(_boxes(svg, "measured")) == 4 * 16
    code, _, _ = _run(["show", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "measured.json"),
                       "--out", str(tmp_path / "t.json")], capsys)
    assert code == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1}
    assert sum(e["name"].endswith("F0") and "SEND" not in e["name"] and "RECV" not in e["name"] for e in xs
               if e["pid"] == 0) == 4


def test_show_png(plan, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    timeline.write_timeline([timeline.predicted_timeline(plan)], out, plan)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_one_line(plan, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(timeline.TimelineError, match=r"pip install autoplan\[plot\]"):
        timeline.write_timeline([timeline.predicted_timeline(plan)], tmp_path / "t.png", plan)


def test_show_rejects_other_schema_and_bad_suffix(plan, tmp_path, capsys):
    data = plan.to_dict() | {"schema_version": 99}
    (tmp_path / "old.json").write_text(json.dumps(data, default=float))
    code, _, err = _run(["show", str(tmp_path / "old.json")], capsys)
    assert code == 2 and "schema version 99" in err and err.count("\n") == 1
    with pytest.raises(PlanError):
        autoplan.Plan.load(tmp_path / "old.json")
    plan.save(tmp_path / "plan.json")
    code, _, err = _run(["show", str(tmp_path / "plan.json"), "--out", str(tmp_path / "t.bmp")], capsys)
    assert code == 2 and ".svg, .png or .json" in err
    code, _, err = _run(["show", str(tmp_path / "plan.json"), "--trace", str(tmp_path / "none.json")], capsys)
    assert code == 2 and "does not exist" in err


def test_sweep_rows_and_plot(tmp_path, capsys):
    from autoplan.commands.plans import run_sweep
    from autoplan.commands.sweep import cluster_for_count, parse_gpu_counts, sweep

    assert parse_gpu_counts("4,1,2,2") == [1, 2, 4]
    assert cluster_for_count("2x8xH100-80GB", 32).num_gpus == 32
    assert cluster_for_count("2x8xH100-80GB", 4).gpus_per_node == 4
    rows = sweep(SMALL, "1x4xA100-80GB", [1, 2, 4, 3], global_batch=16, seq_len=256)
    assert [r.num_gpus for r in rows] == [1, 2, 3, 4]
    assert rows[0].scaling_efficiency == pytest.approx(1.0)
    assert all(r.plan is not None and r.plan.num_gpus == r.num_gpus for r in rows)
    assert run_sweep(model=SMALL, cluster="1x4xA100-80GB", gpu_counts="1,2", global_batch=16, seq_len=256,
                     plot=str(tmp_path / "s.svg")) == 0
    assert "scaling" in capsys.readouterr().out
    bars = [r for r in ET.parse(tmp_path / "s.svg").getroot().iter(f"{SVG}rect") if r.get("class") == "bar"]
    assert [b.get("data-gpus") for b in bars] == ["1", "2"]
    with pytest.raises(ValueError, match="comma-separated"):
        parse_gpu_counts("a,b")
