"""Timelines of a plan: what every pipeline rank does over one step, predicted or measured.

The predicted timeline re-simulates the plan's schedule with the plan's own stage times
(`StagePlan.fwd_time_s`, `bwd_time_s`), the way `search/evaluate.py` does when it makes the plan:
zb-h1 splits the backward into an input-gradient half B and a weight-gradient half W (Qi et al.
2024, Sec. 2: T_B ~ T_W), P2P transfers delay the consumer without occupying either rank, and the
exposed DP reduction plus the optimizer step run after each rank's last action. The measured
timeline comes from the Chrome trace that `autoplan run --trace` writes (ph "X", pid = global rank,
name = action string such as "1F3", ts/dur in microseconds, args.step).

Three renderings: SVG (no dependency; every box carries data-rank / data-action / data-kind so
tests and scripts can read it back), PNG (matplotlib, the optional `plot` extra) and a Chrome
trace (chrome://tracing, ui.perfetto.dev).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from autoplan._files import read_json
from autoplan.plan import Plan
from autoplan.schedule import Action, ActionKind, make_schedule, simulate

__all__ = [
    "Box",
    "Timeline",
    "TimelineError",
    "check_trace_matches",
    "load_trace",
    "measured_timeline",
    "plan_fingerprint",
    "plan_summary",
    "predicted_timeline",
    "to_chrome_trace",
    "to_png",
    "to_svg",
    "trace_metadata",
    "write_timeline",
]

PLOT_HINT = "pip install autoplan[plot]"

# Compute kinds are tall boxes; communication and the step's tail are drawn thin.
_COLORS = {
    "F": "#4e79a7",
    "B": "#59a14f",
    "W": "#edc948",
    "RECV_F": "#9c755f",
    "RECV_B": "#b07aa1",
    "SEND_F": "#9c755f",
    "SEND_B": "#b07aa1",
    "TIED": "#ff9da7",
    "DP": "#e15759",
    "OPT": "#f28e2b",
}
# Kinds in the legend of both renderings (SVG and PNG), in drawing order.
_LEGEND = (("F", "forward"), ("B", "backward"), ("W", "weight grad"), ("RECV_F", "P2P act"), ("RECV_B", "P2P grad"),
           ("TIED", "tied grads"), ("DP", "DP reduce"), ("OPT", "optimizer"))
_OTHER_COLOR = "#bab0ac"
_THIN_KINDS = frozenset({"RECV_F", "RECV_B", "SEND_F", "SEND_B"})


class TimelineError(ValueError):
    """A trace or output path that cannot be used (one line)."""


@dataclass(frozen=True)
class Box:
    """One interval on one pipeline rank: a compute action, a transfer or the step's tail."""

    rank: int
    """Pipeline rank (row)."""
    action: str
    """Action string ("2F5", "1RECV_F3") or a tail label ("DP", "OPT")."""
    kind: str
    """F, B, W, SEND_F, RECV_F, SEND_B, RECV_B, TIED (tied-gradient sum), DP (exposed gradient reduction),
    OPT (optimizer)."""
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def is_compute(self) -> bool:
        return self.kind in ("F", "B", "W")


@dataclass(frozen=True)
class Timeline:
    label: str
    """"predicted" or "measured" (shown beside each row group)."""
    num_ranks: int
    boxes: tuple[Box, ...]
    """Rank by rank, each rank's boxes in start order."""
    step_time_s: float
    bubble_fraction: float
    """Idle share of the ranks' compute span (see `SimResult.bubble_fraction`)."""

    def rank_boxes(self, rank: int, *, compute_only: bool = False) -> list[Box]:
        return [b for b in self.boxes if b.rank == rank and (b.is_compute or not compute_only)]


def _bubble(boxes: Sequence[Box], num_ranks: int) -> float:
    compute = [b for b in boxes if b.is_compute]
    if not compute or num_ranks < 1:
        return 0.0
    span = max(b.end_s for b in compute) - min(b.start_s for b in compute)
    busy = sum(b.duration_s for b in compute)
    return max(0.0, 1.0 - busy / (num_ranks * span)) if span > 0 else 0.0


def _boundary_bytes(plan: Plan) -> float | None:
    """Bytes of one micro-batch's hidden state crossing a pipeline cut, for zoo models.

    The cut tensor of a transformer is the residual stream, mbs x seq x hidden in the compute
    dtype (Narayanan et al. SC'21 Sec. 3.1); None when the plan's model is not a zoo spec.
    """
    try:
        from autoplan import models as zoo

        info = zoo.model_info(zoo.parse_model_spec(plan.model))
    except Exception:  # a file model or an nn.Module class name: no shape facts to use
        return None
    hidden = info.get("hidden_size")
    if not hidden:
        return None
    dtype_bytes = 4 if plan.job.dtype in ("float32", "fp32") else 2
    return float(plan.micro_batch_size * plan.job.seq_len * hidden * dtype_bytes)


def predicted_timeline(plan: Plan, *, comm: bool = True) -> Timeline:
    """Simulate the plan's schedule with its stage times; one row per pipeline rank.

    With `comm`, zoo models get P2P transfer times from the cluster's links (the boundary tensor
    split over the TP ranks, as `cost/time.py` does); other models draw transfers as free.
    """
    schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    fwd = [s.fwd_time_s for s in plan.stages]
    bwd = [s.bwd_time_s for s in plan.stages]
    durations: dict[ActionKind, list[float]] = {ActionKind.F: fwd, ActionKind.B: bwd}
    if schedule.split_backward():
        # The plan stores the whole backward; halve it into B and W as evaluate.py does.
        durations[ActionKind.B] = [b / 2 for b in bwd]
        durations[ActionKind.W] = [b / 2 for b in bwd]

    comm_s: dict[tuple[int, int], float] = {}
    num_bytes = _boundary_bytes(plan) if comm and plan.pp > 1 else None
    cluster = plan.cluster_obj() if num_bytes is not None else None

    def comm_time(src: int, dst: int, kind: ActionKind) -> float:
        from autoplan.cluster.collectives import p2p_time_s

        key = (src, dst)
        if key not in comm_s:
            comm_s[key] = p2p_time_s(cluster, plan.rank(src % plan.pp, 0), plan.rank(dst % plan.pp, 0),
                                     num_bytes / plan.tp)
        return comm_s[key]

    breakdown = plan.predicted.breakdown or {}
    dp_s = float(breakdown.get("dp_comm_exposed_s", 0.0))
    opt_s = float(breakdown.get("optimizer_s", 0.0))
    # A tied head's gradient is summed with its embedding's: the first block is on the first rank and
    # the last block on the last rank (the plan keeps the slowest such sum; cost/time.py).
    tied_s = float(breakdown.get("tied_grad_sync_s", 0.0))
    tied = [tied_s if rank in (0, plan.pp - 1) else 0.0 for rank in range(plan.pp)]
    sim = simulate(schedule, lambda a: durations[a.kind][a.stage], comm_time if num_bytes is not None else None,
                   [tied[rank] + dp_s + opt_s for rank in range(plan.pp)])

    compute_end: dict[tuple[ActionKind, int, int], float] = {}
    boxes_by_rank: list[list[Box]] = [[] for _ in range(plan.pp)]
    for t in sim.timeline:
        compute_end[(t.action.kind, t.action.stage, t.action.microbatch)] = t.end_s
        boxes_by_rank[t.rank].append(Box(t.rank, str(t.action), t.action.kind.value, t.start_s, t.end_s))
    if num_bytes is not None:
        # A transfer starts when its producer ends and lands on the consumer's rank.
        last = plan.num_stages - 1
        for (kind, stage, mb), end in compute_end.items():
            if kind is ActionKind.F and stage < last:
                dst, recv = stage + 1, ActionKind.RECV_F
            elif kind is ActionKind.B and stage > 0:
                dst, recv = stage - 1, ActionKind.RECV_B
            else:
                continue
            if dst % plan.pp == stage % plan.pp:
                continue
            rank = dst % plan.pp
            boxes_by_rank[rank].append(Box(rank, str(Action(recv, dst, mb)), recv.value, end,
                                           end + comm_time(stage, dst, kind)))
    for rank, end in enumerate(sim.compute_end_s):
        if tied[rank] > 0:
            boxes_by_rank[rank].append(Box(rank, "TIED", "TIED", end, end + tied[rank]))
            end += tied[rank]
        if dp_s > 0:
            boxes_by_rank[rank].append(Box(rank, "DP", "DP", end, end + dp_s))
        if opt_s > 0:
            boxes_by_rank[rank].append(Box(rank, "OPT", "OPT", end + dp_s, end + dp_s + opt_s))
    boxes = tuple(b for rank_boxes in boxes_by_rank for b in sorted(rank_boxes, key=lambda b: (b.start_s, not b.is_compute)))
    return Timeline("predicted", plan.pp, boxes, sim.makespan_s, sim.bubble_fraction)


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    """Read a Chrome trace JSON (an object with "traceEvents", or a bare event list)."""
    data = read_json(path, "trace file", TimelineError, f"write one with `autoplan run PLAN --trace {path}`")
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("traceEvents"), list):
        raise TimelineError(f"trace file {str(path)!r} has no traceEvents list (expected a Chrome trace)")
    return dict(data)


# The step's tail as `autoplan run --trace` names it (runtime/training.py) -> the timeline's kinds.
_TAIL_EVENTS = {"TIED_GRAD_SYNC": "TIED", "DP_GRAD_SYNC": "DP", "OPTIMIZER": "OPT"}


def _action_kind(name: str) -> str | None:
    if name in _TAIL_EVENTS:
        return _TAIL_EVENTS[name]
    try:
        return Action.parse(name).kind.value
    except ValueError:
        return None


def measured_timeline(trace: Mapping[str, Any], plan: Plan | None = None, *, step: int | None = None) -> Timeline:
    """One step of a measured trace, one row per pipeline rank, times from the step's first action.

    With `plan`, global ranks are mapped to pipeline ranks and only the (dp 0, tp 0) replica is
    kept; without it every pid is a row. `step` picks the step (default: the last one, past the
    warm-up). Events whose name is not an action string are ignored.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, Mapping) and e.get("ph") == "X"]
    parsed = []
    for e in events:
        kind = _action_kind(str(e.get("name", "")))
        try:
            pid, ts, dur = int(e["pid"]), float(e["ts"]), float(e["dur"])
        except (KeyError, TypeError, ValueError):
            raise TimelineError(f"trace event {dict(e)!r} lacks a numeric pid, ts or dur") from None
        if kind is None:
            continue
        args = e.get("args") if isinstance(e.get("args"), Mapping) else {}
        parsed.append((pid, str(e["name"]), kind, ts * 1e-6, (ts + dur) * 1e-6, args.get("step", 0)))
    if not parsed:
        raise TimelineError("the trace has no action events (ph 'X' named like '1F3')")
    steps = sorted({p[5] for p in parsed}, key=lambda s: (isinstance(s, str), s))
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise TimelineError(f"step {step} is not in the trace (it has steps {steps[0]}..{steps[-1]})")
    parsed = [p for p in parsed if p[5] == chosen]

    rows: dict[int, int] = {}
    if plan is not None:
        for pid in {p[0] for p in parsed}:
            if pid >= plan.num_gpus:
                raise TimelineError(f"trace has rank {pid} but the plan has {plan.num_gpus} GPUs; is it the plan's trace?")
            pp_index, dp_index, tp_index = plan.coords(pid)
            if dp_index == 0 and tp_index == 0:
                rows[pid] = pp_index
        num_ranks = plan.pp
    else:
        for i, pid in enumerate(sorted({p[0] for p in parsed})):
            rows[pid] = i
        num_ranks = len(rows)
    parsed = [p for p in parsed if p[0] in rows]
    t0 = min(p[3] for p in parsed)
    boxes = sorted((Box(rows[p[0]], p[1], p[2], p[3] - t0, p[4] - t0) for p in parsed),
                   key=lambda b: (b.rank, b.start_s, not b.is_compute))
    step_time = max(b.end_s for b in boxes)
    return Timeline("measured", num_ranks, tuple(boxes), step_time, _bubble(boxes, num_ranks))


# ---- which plan a trace was measured on ----------------------------------------------------

def plan_fingerprint(plan: Plan) -> str:
    """The plan's run fingerprint (`Plan.run_fingerprint`), which `autoplan run --trace` records."""
    return plan.run_fingerprint


def plan_summary(plan: Plan) -> str:
    """One line naming a plan: model, degrees, schedule, micro-batches."""
    return (f"{plan.model}: {_layout(plan)}, {plan.schedule}"
            + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
            + f", {plan.num_microbatches} micro-batch{'es' if plan.num_microbatches != 1 else ''} "
              f"of {plan.micro_batch_size}")


def trace_metadata(plan: Plan) -> dict[str, Any]:
    """What `autoplan run --trace` records of its plan, under the trace's "otherData" (the Chrome
    trace format's free-form object), so `autoplan show` can tell whether a trace is the plan's."""
    return {"autoplan_plan_fingerprint": plan_fingerprint(plan), "autoplan_plan": plan_summary(plan),
            "num_ranks": plan.num_gpus}


def check_trace_matches(trace: Mapping[str, Any], plan: Plan, *, trace_name: str = "the trace",
                        plan_name: str = "the plan") -> None:
    """Refuse (TimelineError, one line) a trace measured on another plan.

    A trace with `trace_metadata` compares fingerprints. One without it (written before the
    runtime recorded them) is compared by what it shows: its ranks must be the plan's GPUs, and
    the compute actions of each pipeline rank of the (dp 0, tp 0) replica must be that rank's
    actions in the plan's schedule (stages, micro-batches and their order).
    """
    other = trace.get("otherData")
    recorded = other.get("autoplan_plan_fingerprint") if isinstance(other, Mapping) else None
    fix = f"show it with the plan it was measured on, or measure this one: `autoplan run {plan_name} --trace FILE`"
    if recorded is not None:
        if str(recorded) != plan_fingerprint(plan):
            theirs = other.get("autoplan_plan") or f"plan {recorded}"
            raise TimelineError(f"{trace_name} was measured on another plan ({theirs}), not {plan_name} "
                                f"({plan_summary(plan)}); {fix}")
        return
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, Mapping) and e.get("ph") == "X"]
    actions: dict[int, dict[Any, list[str]]] = {}
    for e in events:
        name = str(e.get("name", ""))
        try:
            action = Action.parse(name)
            pid = int(e["pid"])
        except (KeyError, TypeError, ValueError):
            continue
        if action.kind in (ActionKind.F, ActionKind.B, ActionKind.W):
            step = e.get("args", {}).get("step", 0) if isinstance(e.get("args"), Mapping) else 0
            actions.setdefault(pid, {}).setdefault(step, []).append((float(e.get("ts", 0.0)), name))
    if not actions:
        return  # measured_timeline says what is missing
    pids = sorted(actions)
    problem = None
    if pids[-1] >= plan.num_gpus or len(pids) != plan.num_gpus:
        problem = f"it has {len(pids)} rank{'s' if len(pids) != 1 else ''}, the plan {plan.num_gpus}"
    else:
        schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
        compute = (ActionKind.F, ActionKind.B, ActionKind.W)
        for pid in pids:
            pp_index = plan.coords(pid)[0]
            expected = [str(a) for a in schedule.actions[pp_index] if a.kind in compute]
            for timed in actions[pid].values():
                got = [name for _, name in sorted(timed)]
                if sorted(got) != sorted(expected):
                    problem = (f"rank {pid} ran {len(got)} compute actions ({', '.join(got[:4])}"
                               f"{', ...' if len(got) > 4 else ''}) where the plan's pipeline rank {pp_index} has "
                               f"{len(expected)} ({', '.join(expected[:4])}{', ...' if len(expected) > 4 else ''})")
                    break
            if problem:
                break
    if problem:
        raise TimelineError(f"{trace_name} was measured on another plan, not {plan_name} ({plan_summary(plan)}): "
                            f"{problem}; {fix}")


# ---- rendering -------------------------------------------------------------------------------

def _layout(plan: Plan) -> str:
    # dp as the plan means it: dp counts the cp ranks of a replica (plan.py), so show replicas and cp.
    if plan.cp > 1:
        return f"tp {plan.tp} / pp {plan.pp} / dp {plan.dp // plan.cp} / cp {plan.cp}"
    return f"tp {plan.tp} / pp {plan.pp} / dp {plan.dp}"


def _title_lines(plan: Plan | None, timelines: Sequence[Timeline], max_chars: int) -> list[str]:
    """The picture's title, wrapped to `max_chars` a line: the plan, then each timeline's summary."""
    import textwrap

    lines = textwrap.wrap(plan_summary(plan), max_chars) if plan is not None else []
    summaries = " | ".join(f"{t.label}: step {_fmt_s(t.step_time_s)}, bubble {t.bubble_fraction:.1%}"
                           for t in timelines)
    return lines + (textwrap.wrap(summaries, max_chars) if summaries else [])


def _title(plan: Plan | None, timelines: Sequence[Timeline]) -> str:
    return " | ".join(_title_lines(plan, timelines, 10**6))


def _fmt_s(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def _time_unit(span_s: float) -> tuple[str, float]:
    """One unit for a whole axis, chosen by its span: (name, units per second)."""
    if span_s >= 1.0:
        return "s", 1.0
    if span_s >= 1e-3:
        return "ms", 1e3
    return "us", 1e6


def _nice_step(span: float) -> float:
    raw = span / 8 if span > 0 else 1.0
    import math

    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _tick_labels(span_s: float) -> tuple[list[float], list[str], str]:
    """Tick positions (seconds) and their labels, every label in the one unit `_time_unit` picks,
    with as many decimals as the tick spacing needs."""
    import math

    unit, per_s = _time_unit(span_s)
    tick = _nice_step(span_s)
    decimals = max(0, -math.floor(math.log10(tick * per_s) + 1e-9))
    ticks, labels = [], []
    k = 0
    while k * tick <= span_s * (1 + 1e-9):
        ticks.append(k * tick)
        labels.append(f"{k * tick * per_s:.{decimals}f}")
        k += 1
    return ticks, labels, unit


# Advance widths in em of DejaVu Sans (rsvg's and matplotlib's default sans-serif), rounded up;
# other fonts of the sans-serif family are narrower, so a label that fits here fits there.
_WIDE_EM = {"W": 1.0, "M": 0.87, "_": 0.5}


def _text_width_px(text: str, font_px: float) -> float:
    return font_px * sum(_WIDE_EM.get(ch, 0.7 if ch.isupper() else 0.64) for ch in text)


def _box_label(action: str, width_px: float, font_px: float) -> str | None:
    """The longest of "2W12", "W12", "12" (stage, kind, micro-batch) that fits a box `width_px`
    wide with a little margin; None when none does (the box's tooltip still names it)."""
    try:
        a = Action.parse(action)
        candidates = [action, f"{a.kind.value}{a.microbatch}", str(a.microbatch)]
    except ValueError:
        candidates = [action]
    for label in candidates:
        if _text_width_px(label, font_px) + 4 <= width_px:
            return label
    return None


def to_svg(timelines: Sequence[Timeline], plan: Plan | None = None, *, width: int = 1200) -> str:
    """An SVG picture: per timeline a group of rows (one per pipeline rank), one rect per box.

    Every box is `<rect class="box" data-timeline=... data-rank=... data-action=... data-kind=...
    data-start-s=... data-end-s=...>` with a `<title>` tooltip; compute boxes are full height,
    transfers a thin bar at the bottom of the receiving row, the tail (DP, OPT) half height.
    Compute boxes carry the label that fits them (`_box_label`); the time axis has one unit.
    """
    title_px = 13
    # Bold 13 px sans-serif averages under 8.5 px a character: wrap to what the width holds.
    title_lines = _title_lines(plan, timelines, max(20, int((width - 40) / 8.5)))
    left, right, row_h, gap = 110, 20, 28, 6
    top = 14 + 18 * len(title_lines)
    span = max((t.step_time_s for t in timelines), default=0.0) or 1.0
    plot_w = width - left - right
    scale = plot_w / span
    y = top
    parts: list[str] = []
    for t in timelines:
        parts.append(f'<g class="timeline" data-timeline={quoteattr(t.label)}>')
        parts.append(f'<text x="4" y="{y + 12}" font-weight="bold">{escape(t.label)}</text>')
        y += 18
        for rank in range(t.num_ranks):
            ry = y + rank * (row_h + gap)
            parts.append(f'<g class="row" data-timeline={quoteattr(t.label)} data-rank="{rank}">')
            parts.append(f'<rect class="lane" x="{left}" y="{ry}" width="{plot_w}" height="{row_h}" fill="#f4f4f4"/>')
            parts.append(f'<text x="{left - 8}" y="{ry + row_h / 2 + 4}" text-anchor="end">rank {rank}</text>')
            for b in t.rank_boxes(rank):
                x, w = left + b.start_s * scale, max(b.duration_s * scale, 0.5)
                if b.is_compute:
                    by, bh = ry, row_h
                elif b.kind in _THIN_KINDS:
                    by, bh = ry + row_h - 4, 4
                else:
                    by, bh = ry + row_h / 4, row_h / 2
                color = _COLORS.get(b.kind, _OTHER_COLOR)
                parts.append(
                    f'<rect class="box" x="{x:.2f}" y="{by:.2f}" width="{w:.2f}" height="{bh:.2f}" fill="{color}" '
                    f'stroke="white" stroke-width="0.5" data-timeline={quoteattr(t.label)} data-rank="{rank}" '
                    f'data-action={quoteattr(b.action)} data-kind="{b.kind}" data-start-s="{b.start_s:.9g}" '
                    f'data-end-s="{b.end_s:.9g}"><title>{escape(b.action)}: {_fmt_s(b.start_s)} .. '
                    f'{_fmt_s(b.end_s)} ({_fmt_s(b.duration_s)})</title></rect>')
                label = _box_label(b.action, w, 10) if b.is_compute else None
                if label is not None:
                    parts.append(f'<text class="label" x="{x + w / 2:.2f}" y="{ry + row_h / 2 + 4}" '
                                 f'text-anchor="middle" fill="white" font-size="10">{escape(label)}</text>')
            parts.append("</g>")
        y += t.num_ranks * (row_h + gap) + 12
        parts.append("</g>")
    # Time axis: one unit for every tick, named once under it.
    ticks, labels, unit = _tick_labels(span)
    axis = [f'<line class="axis" x1="{left}" y1="{y}" x2="{left + plot_w}" y2="{y}" stroke="#333"/>']
    for tick_s, label in zip(ticks, labels):
        x = left + tick_s * scale
        axis.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 4}" stroke="#333"/>')
        axis.append(f'<text class="tick" x="{x:.2f}" y="{y + 16}" text-anchor="middle" font-size="10">{label}</text>')
    axis.append(f'<text class="axis-label" x="{left + plot_w / 2:.2f}" y="{y + 30}" text-anchor="middle" '
                f'font-size="11">time ({unit})</text>')
    y += 40
    legend = []
    lx = left
    for kind, label in _LEGEND:
        legend.append(f'<rect x="{lx}" y="{y}" width="12" height="12" fill="{_COLORS[kind]}"/>'
                      f'<text x="{lx + 16}" y="{y + 10}" font-size="11">{label}</text>')
        lx += 110
    height = y + 24
    heading = [f'<text class="title" x="{width / 2}" y="{22 + 18 * k}" text-anchor="middle" font-size="{title_px}" '
               f'font-weight="bold">{escape(line)}</text>' for k, line in enumerate(title_lines)]
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f"<title>{escape(_title(plan, timelines))}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
        *heading, *parts, *axis, *legend, "</svg>", ""])


def to_chrome_trace(timelines: Sequence[Timeline]) -> dict[str, Any]:
    """Chrome trace events: one process per timeline, one thread per pipeline rank, us units."""
    events: list[dict[str, Any]] = []
    for pid, t in enumerate(timelines):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": t.label}})
        for rank in range(t.num_ranks):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank,
                           "args": {"name": f"pp rank {rank}"}})
        for b in t.boxes:
            events.append({"name": b.action, "cat": b.kind, "ph": "X", "pid": pid, "tid": b.rank,
                           "ts": b.start_s * 1e6, "dur": b.duration_s * 1e6, "args": {"kind": b.kind}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TimelineError(f"PNG output needs matplotlib: {PLOT_HINT} (or write .svg)") from None
    return plt


def to_png(timelines: Sequence[Timeline], path: str | os.PathLike, plan: Plan | None = None) -> None:
    """The same picture as `to_svg`, drawn with matplotlib (needs the `plot` extra).

    Boxes of one row, kind and height are one `broken_barh` collection (a single artist), not one
    patch per action: a 175B plan's 6,000 actions draw in about a second instead of minutes.
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    num_rows = sum(t.num_ranks for t in timelines)
    span = max((t.step_time_s for t in timelines), default=0.0) or 1.0
    unit, per_s = _time_unit(span)
    dpi, fig_w = 120, 14.0
    title_lines = _title_lines(plan, (), int(fig_w * dpi / 10.5)) if plan is not None else []
    title_h = 0.3 * len(title_lines)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(fig_w, 1.2 + title_h + 0.55 * num_rows + 0.4 * len(timelines)),
                             sharex=True, squeeze=False, dpi=dpi)
    for ax, t in zip(axes[:, 0], timelines):
        groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for b in t.boxes:
            groups.setdefault((b.rank, b.kind), []).append((b.start_s * per_s, b.duration_s * per_s))
        for (rank, kind), xranges in groups.items():
            y = t.num_ranks - 1 - rank  # rank 0 on top
            if kind in ("F", "B", "W"):
                y0, h = y - 0.4, 0.8
            elif kind in _THIN_KINDS:
                y0, h = y - 0.48, 0.12
            else:
                y0, h = y - 0.2, 0.4
            ax.broken_barh(xranges, (y0, h), facecolors=_COLORS.get(kind, _OTHER_COLOR), edgecolor="white",
                           linewidth=0.4)
        ax.set_yticks(range(t.num_ranks), [f"rank {t.num_ranks - 1 - i}" for i in range(t.num_ranks)])
        ax.set_ylim(-0.6, t.num_ranks - 0.4)
        ax.set_xlim(0, span * per_s * 1.01)
        ax.set_title(f"{t.label}: step {_fmt_s(t.step_time_s)}, bubble {t.bubble_fraction:.1%}", fontsize=10)
        ax.set_facecolor("#f4f4f4")
    ticks, labels, _ = _tick_labels(span)
    axes[-1, 0].set_xticks([tick * per_s for tick in ticks], labels)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    handles = [Patch(color=_COLORS[k], label=label) for k, label in _LEGEND]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    if title_lines:
        fig.suptitle("\n".join(title_lines), fontsize=11, y=1 - 0.1 / fig.get_figheight(), va="top")
    top = 1 - (0.15 + title_h) / fig.get_figheight() if title_lines else 1
    fig.tight_layout(rect=(0, 0.06, 1, top))
    # Labels go in after the layout, where a box's width in pixels is known: only those that fit.
    font_pt = 7
    font_px = font_pt * dpi / 72
    for ax, t in zip(axes[:, 0], timelines):
        px_per_unit = ax.get_window_extent().width / (span * per_s * 1.01)
        for b in t.boxes:
            if not b.is_compute:
                continue
            label = _box_label(b.action, b.duration_s * per_s * px_per_unit, font_px)
            if label is not None:
                ax.text((b.start_s + b.duration_s / 2) * per_s, t.num_ranks - 1 - b.rank, label, ha="center",
                        va="center", fontsize=font_pt, color="white")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_timeline(timelines: Sequence[Timeline], path: str | os.PathLike, plan: Plan | None = None) -> None:
    """Write by suffix: .svg, .png (matplotlib) or .json (Chrome trace)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".svg":
        text = to_svg(timelines, plan)
    elif suffix == ".json":
        text = json.dumps(to_chrome_trace(timelines))
    elif suffix == ".png":
        to_png(timelines, path, plan)
        return
    else:
        raise TimelineError(f"cannot write a timeline to {str(path)!r}: use a .svg, .png or .json file")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
