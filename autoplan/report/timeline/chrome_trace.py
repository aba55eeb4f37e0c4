"""Timelines as a Chrome trace (chrome://tracing, ui.perfetto.dev): one process per timeline, one
thread per pipeline rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autoplan.report.timeline.model import Timeline

__all__ = ["to_chrome_trace"]

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
