"""`autoplan show --trace` draws measured and predicted rows each on its own time scale when their steps
differ by more than SHARED_SCALE_MAX_RATIO (issue 44: a CPU run of a GPU-calibrated plan measured 54x
the prediction, and on one shared axis the predicted rows were a sliver at the left edge), and on one
shared axis when they are close (their widths then compare directly)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

import autoplan
from autoplan.plan import Plan
from autoplan.report import timeline
from autoplan.report.timeline._drawing import SHARED_SCALE_MAX_RATIO
from tests._cli import run_main

TINY = "gpt:num_layers=4,hidden_size=32,num_heads=2,vocab_size=64,max_seq_len=16"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    plan = autoplan.suggest(TINY, "1x2xA100-80GB", global_batch=8, seq_len=16, pp=2, micro_batch_size=2,
                            schedule="1f1b")[0]
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return path


def _trace(plan: Plan, slowdown: float) -> dict:
    """A trace as `autoplan run --trace` writes it, every action `slowdown` times the prediction."""
    events = [{"name": b.action, "ph": "X", "pid": plan.rank(b.rank, d, t), "tid": 0, "ts": b.start_s * slowdown * 1e6,
               "dur": b.duration_s * slowdown * 1e6, "args": {"step": 0}}
              for b in timeline.predicted_timeline(plan).boxes if b.is_compute
              for d in range(plan.dp) for t in range(plan.tp)]
    return {"traceEvents": events, "otherData": timeline.trace_metadata(plan)}


def _show_svg(plan_file, tmp_path, slowdown: float):
    trace, out = tmp_path / "t.json", tmp_path / "t.svg"
    trace.write_text(json.dumps(_trace(Plan.load(plan_file), slowdown)))
    result = run_main("show", str(plan_file), "--trace", str(trace), "--out", str(out))
    assert result.returncode == 0, result.stderr
    return result.stdout, ET.fromstring(out.read_text())


def _extent(svg, label: str) -> tuple[float, float]:
    """The left of the plot and the right end of `label`'s last compute box, in pixels."""
    boxes = [r for r in svg.iter(f"{SVG}rect") if r.get("class") == "box" and r.get("data-timeline") == label
             and r.get("data-kind") in ("F", "B", "W")]
    lane = next(r for r in svg.iter(f"{SVG}rect") if r.get("class") == "lane")
    right = max(float(r.get("x")) + float(r.get("width")) for r in boxes)
    return float(lane.get("x")), (right - float(lane.get("x"))) / float(lane.get("width"))


def _texts(svg, cls: str) -> list[str]:
    return [t.text for t in svg.iter(f"{SVG}text") if t.get("class") == cls]


def test_a_measured_step_54x_the_prediction_gets_its_own_scale(plan_file, tmp_path):
    out, svg = _show_svg(plan_file, tmp_path, slowdown=54.0)
    import re

    ratio = float(re.search(r"\((\d+\.\d+)x\)", out).group(1))  # show's own line
    assert ratio > 20, out
    for label in ("predicted", "measured"):
        _, fraction = _extent(svg, label)
        # Each timeline's step spans the plot (on one shared axis the predicted one took 1/54 of it).
        assert fraction > 0.9, (label, fraction)
    assert [t.split(" time (")[0] for t in _texts(svg, "axis-label")] == ["predicted", "measured"]
    (note,) = _texts(svg, "scale-note")
    assert "its own time scale" in note and f"measured {ratio:.3g}x predicted" in note, note
    for label in ("predicted", "measured"):  # each its own ticks
        ticks = [t for t in svg.iter(f"{SVG}text") if t.get("class") == "tick" and t.get("data-timeline") == label]
        assert len(ticks) >= 3, label


def test_steps_within_the_ratio_share_one_axis(plan_file, tmp_path):
    _, svg = _show_svg(plan_file, tmp_path, slowdown=SHARED_SCALE_MAX_RATIO * 0.9)
    assert len(_texts(svg, "axis-label")) == 1 and _texts(svg, "axis-label")[0].startswith("time (")
    assert not _texts(svg, "scale-note")
    _, predicted = _extent(svg, "predicted")
    _, measured = _extent(svg, "measured")
    # One axis: the widths compare (the predicted step is 1 / 1.8 of the measured one).
    assert measured > 0.9 and predicted == pytest.approx(measured / (SHARED_SCALE_MAX_RATIO * 0.9), rel=0.05)


def test_the_png_draws_each_timeline_on_its_own_axis(plan_file, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    plan = Plan.load(plan_file)
    pred = timeline.predicted_timeline(plan)
    measured = timeline.measured_timeline(_trace(plan, 54.0), plan)
    timeline.to_png([pred, measured], tmp_path / "t.png", plan)
    (fig,) = figures
    (ax_pred, ax_meas) = fig.axes[:2]
    assert ax_pred.get_xlabel().startswith("predicted time (") and ax_meas.get_xlabel().startswith("measured time (")
    for ax, t in ((ax_pred, pred), (ax_meas, measured)):
        unit = ax.get_xlabel().split("(")[1].rstrip(")")
        per_s = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
        assert ax.get_xlim()[1] == pytest.approx(t.step_time_s * per_s * 1.01, rel=1e-6)
    assert "its own time scale" in fig.legends[0].get_title().get_text()
