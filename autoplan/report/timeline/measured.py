"""The measured timeline: one step of the Chrome trace that `autoplan run --trace` writes (ph "X",
pid = global rank, name = action string such as "1F3", ts/dur in microseconds, args.step).

Apart from the predicted timeline (report/timeline/predicted.py): this one reads a trace file, and
the plan only to map global ranks to pipeline ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from autoplan._files import read_json
from autoplan.plan import Plan
from autoplan.report.timeline.model import Box, Timeline, TimelineError, bubble_share
from autoplan.schedule import Action

__all__ = ["load_trace", "measured_timeline"]

def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    """Read a Chrome trace JSON (an object with "traceEvents", or a bare event list)."""
    data = read_json(path, "trace file", TimelineError, f"write one with `autoplan run PLAN --trace {path}`")
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("traceEvents"), list):
        raise TimelineError(f"trace file {str(path)!r} has no traceEvents list (expected a Chrome trace)")
    return dict(data)


# The step's tail as `autoplan run --trace` names it (runtime/launcher/training.py) -> the timeline's kinds.
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
    return Timeline("measured", num_ranks, tuple(boxes), step_time, bubble_share(boxes, num_ranks))
