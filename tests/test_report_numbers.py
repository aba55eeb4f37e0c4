"""Pictures and numbers that read right (issue 29, item 6): wrapped titles, one time unit per axis,
labels that fit their boxes, an axis on the sweep, FLOP/s in a unit that shows them, stage memory
columns that add up, interleaved rows that say what they hold, dp as the plan means it, and a sweep
without a plan as one error line."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

import autoplan
from autoplan.cli import main
from autoplan.commands.sweep import SweepRow, plot_sweep
from autoplan.report import timeline
from autoplan.report.timeline import _drawing

SMALL = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=1024,max_seq_len=256"
TINY = "gpt:num_layers=2,hidden_size=32,num_heads=2,vocab_size=64,max_seq_len=16"
SVG = "{http://www.w3.org/2000/svg}"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@pytest.fixture(scope="module")
def zb_plan():
    return autoplan.suggest(SMALL, "1x4xA100-80GB", global_batch=32, seq_len=256, pp=4, tp=1, dp=1,
                            schedule="zb-h1", micro_batch_size=2)[0]


def _measured(plan, slowdown: float = 1.3):
    pred = timeline.predicted_timeline(plan)
    events = [{"name": b.action, "ph": "X", "pid": plan.rank(b.rank, 0), "ts": b.start_s * slowdown * 1e6,
               "dur": b.duration_s * slowdown * 1e6, "args": {"step": 0}} for b in pred.boxes if b.is_compute]
    return [pred, timeline.measured_timeline({"traceEvents": events}, plan)]


def _texts(root, cls):
    return [t for t in root.iter(f"{SVG}text") if t.get("class") == cls]


def test_timeline_svg_title_wraps_inside_the_picture(zb_plan):
    svg = ET.fromstring(timeline.to_svg(_measured(zb_plan), zb_plan))
    lines = [t.text for t in _texts(svg, "title")]
    whole = " ".join(lines)
    assert len(whole) > 150 and len(lines) >= 2  # the title: ~200 characters on one line
    assert "measured: step" in whole and "predicted: step" in whole and SMALL in whole.replace(" ", "")
    width = float(svg.get("width"))
    # Bold 13 px DejaVu Sans is at most ~9 px a character on average text: every line fits.
    assert all(len(line) * 9 <= width - 20 for line in lines)
    boxes = [r for r in svg.iter(f"{SVG}rect") if r.get("class") == "box"]
    title_bottom = max(float(t.get("y")) for t in _texts(svg, "title"))
    assert min(float(r.get("y")) for r in boxes) > title_bottom  # the rows start below the title


@pytest.mark.parametrize("span_s, unit", [(0.05, "ms"), (6.8, "s"), (0.0004, "us")])
def test_one_time_unit_per_axis(span_s, unit):
    ticks, labels, chosen = _drawing.tick_labels(span_s)
    assert chosen == unit
    assert labels[0] == "0" or float(labels[0]) == 0
    assert all(re.fullmatch(r"\d+(\.\d+)?", label) for label in labels)  # no unit mixed into a tick
    assert len({len(label.split(".")[1]) if "." in label else 0 for label in labels}) == 1  # one precision


def test_svg_axis_names_its_unit_once_and_labels_fit_their_boxes(zb_plan):
    svg = ET.fromstring(timeline.to_svg(_measured(zb_plan), zb_plan))
    ticks = [t.text for t in _texts(svg, "tick")]
    assert ticks and not any(u in " ".join(ticks) for u in ("us", "ms", " s"))
    assert [t.text for t in _texts(svg, "axis-label")] == ["time (ms)"]
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for g in svg.iter(f"{SVG}g"):
        if g.get("class") != "row":
            continue
        boxes = [r for r in g.iter(f"{SVG}rect") if r.get("class") == "box"]
        for label in g.iter(f"{SVG}text"):
            if label.get("class") != "label":
                continue
            cx = float(label.get("x"))
            box = next(r for r in boxes if abs(float(r.get("x")) + float(r.get("width")) / 2 - cx) < 0.02)
            text_w = _drawing._text_width_px(label.text, 10)
            assert text_w <= float(box.get("width")), (label.text, box.get("width"))
            # The label is the action or a shortening of it ("2W12" -> "W12" -> "12").
            assert box.get("data-action").endswith(label.text)
            rows.setdefault((g.get("data-timeline"), g.get("data-rank")), []).append((cx - text_w / 2, cx + text_w / 2))
    assert rows, "no box was labelled"
    for spans in rows.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no "2W12W14"


def test_png_timeline_draws_collections_not_one_patch_per_action(zb_plan, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    timelines = _measured(zb_plan)
    timeline.to_png(timelines, tmp_path / "t.png", zb_plan)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    for ax, t in zip(fig.axes, timelines):
        kinds = {(b.rank, b.kind) for b in t.boxes}
        assert len(ax.collections) == len(kinds) < len(t.boxes) / 4  # a 175B plan has 6,000 actions
        assert not ax.patches
    assert fig.axes[-1].get_xlabel() == "time (ms)"


def test_sweep_svg_has_a_y_axis(tmp_path):
    plan = autoplan.suggest(TINY, "1x2xcpu", global_batch=4, seq_len=16)[0]
    rows = [SweepRow(2, "c", plan, scaling_efficiency=1.0)]
    plot_sweep(rows, tmp_path / "s.svg")
    svg = ET.parse(tmp_path / "s.svg").getroot()
    ticks = [t.text for t in _texts(svg, "ytick")]
    assert len(ticks) >= 3 and ticks[0] == "0"
    assert [t.text for t in _texts(svg, "ylabel")] == ["predicted tokens/s"]


def _table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines()
            if line.startswith("│") and line.split("│")[1].strip() == first_cell]


def _header(text: str, name: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith("┃") and f" {name} " in line)
    return [c.strip() for c in line.split("┃")[1:-1]]


def _bytes(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * _UNITS[unit]


def test_cpu_plan_shows_gflops_and_memory_columns_that_add_up(tmp_path, capsys):
    assert main(["suggest", "--model", TINY, "--cluster", "1x2xcpu", "--global-batch", "4", "--seq-len", "16",
                 "--pp", "2", "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    header = _header(out, "MFU")
    assert "GFLOP/s/GPU" in header
    flops = _table_rows(out, "1")[0][header.index("GFLOP/s/GPU")]
    assert float(flops) > 0  # "0.0" TFLOP/s before
    plan = autoplan.Plan.load(tmp_path / "p.json")
    assert float(flops) == pytest.approx(plan.predicted.model_tflops_per_gpu * 1e3, rel=0.01)

    stages = _header(out, "total mem")
    assert stages[-2:] == ["other", "total mem"]
    for stage in plan.stages:
        row = _table_rows(out, str(stage.index))[-1]
        parts = [_bytes(row[stages.index(c)]) for c in ("weights+grads+optim", "activations", "other")]
        total = _bytes(row[stages.index("total mem")])
        assert sum(parts) == pytest.approx(total, rel=0.01)
        assert total == pytest.approx(stage.memory.total_bytes, rel=0.01)
    assert "other (autoplan/cost/memory.py): buffers" in out and "allowance 256.00 MiB (gloo" in out


def test_interleaved_rows_show_the_ranks_memory_once(capsys):
    plan = autoplan.suggest(SMALL, "1x2xA100-80GB", global_batch=16, seq_len=256, pp=2, tp=1, dp=1,
                            schedule="interleaved-1f1b", virtual_stages=2, micro_batch_size=2)[0]
    from rich.console import Console

    from autoplan.report.tables import stages_table

    console = Console(width=200, record=True)
    console.print(stages_table(plan))
    text = console.export_text()
    assert "2 per rank; memory is the rank's" in text
    header = _header(text, "total mem")
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    assert [int(r[header.index("rank")]) for r in rows] == [0, 0, 1, 1]  # grouped by rank
    for first, second in (rows[0:2], rows[2:4]):
        assert first[header.index("total mem")] and not second[header.index("total mem")]
        assert second[header.index("params")]  # each chunk's own figures stay
    ranks_total = sum(_bytes(r[header.index("total mem")]) for r in (rows[0], rows[2]))
    assert ranks_total == pytest.approx(sum(plan.stages[k].memory.total_bytes for k in range(2)), rel=0.01)


def test_cp_plan_shows_dp_as_the_replicas_the_batch_is_split_over(capsys, tmp_path):
    llama = "llama:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,vocab_size=256,max_seq_len=64"
    assert main(["suggest", "--model", llama, "--cluster", "1x8xA100-80GB", "--global-batch", "8", "--seq-len", "64",
                 "--cp", "2", "--out", str(tmp_path / "cp.json")]) == 0
    out = capsys.readouterr().out
    plan = autoplan.Plan.load(tmp_path / "cp.json")
    assert plan.cp == 2
    header = _header(out, "MFU")
    assert header[1] == "tp/pp/dp/cp"
    tp, pp, dp, cp = map(int, _table_rows(out, "1")[0][1].split("/"))
    assert (tp, pp, cp) == (plan.tp, plan.pp, 2) and tp * pp * dp * cp == plan.num_gpus
    assert dp * plan.micro_batch_size * plan.num_microbatches == 8  # the global batch, not dp 4096 for 128


def test_sweep_without_any_plan_is_one_error_line(capsys):
    code = main(["suggest", "--model", TINY, "--cluster", "1x2xcpu", "--global-batch", "4", "--seq-len", "16",
                 "--sweep-gpus", "1000000"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("autoplan: error: --sweep-gpus 1000000: no plan at 1000000 GPUs: ")
    assert "global batch 4" in err


def test_sweep_reports_each_count_and_every_reason_whole(capsys):
    code = main(["suggest", "--model", TINY, "--cluster", "1x2xcpu", "--global-batch", "4", "--seq-len", "16",
                 "--sweep-gpus", "1,2,3"])
    out, err = capsys.readouterr()
    assert code == 0
    assert [line.split(":")[1].strip() for line in err.splitlines()[1:]] == ["1/3", "2/3", "3/3"]
    reason = next(line for line in out.splitlines() if line.startswith("no plan at 3 GPUs: "))
    assert reason.endswith("3 GPUs is not a whole number of 2-GPU nodes")  # whole, not cut in a table cell
