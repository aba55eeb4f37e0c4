"""Timelines of a plan: what every pipeline rank does over one step, predicted or measured.

The predicted timeline re-simulates the plan's schedule with the plan's own stage times
(`StagePlan.fwd_time_s`, `bwd_time_s`), the way `search/assemble.py` does when it makes the plan:
zb-h1 splits the backward into an input-gradient half B and a weight-gradient half W (Qi et al.
2024, Sec. 2: T_B ~ T_W), P2P transfers delay the consumer without occupying either rank, and the
exposed DP reduction plus the optimizer step run after each rank's last action. The measured
timeline comes from the Chrome trace that `autoplan run --trace` writes (ph "X", pid = global rank,
name = action string such as "1F3", ts/dur in microseconds, args.step).

Three renderings: SVG (no dependency; every box carries data-rank / data-action / data-kind so
tests and scripts can read it back), PNG (matplotlib, the optional `plot` extra) and a Chrome
trace (chrome://tracing, ui.perfetto.dev).

The package's modules, one concept each: model.py (`Box`, `Timeline`), predicted.py and measured.py
(the two ways a timeline is made), trace_match.py (which plan a trace was measured on), svg.py,
png.py and chrome_trace.py (the three renderings; svg and png share _kinds.py and _drawing.py) and
write.py (a file by its suffix).
"""

from __future__ import annotations

from autoplan.report.timeline.chrome_trace import to_chrome_trace
from autoplan.report.timeline.measured import load_trace, measured_timeline
from autoplan.report.timeline.model import Box, Timeline, TimelineError
from autoplan.report.timeline.png import to_png
from autoplan.report.timeline.predicted import predicted_timeline
from autoplan.report.timeline.svg import to_svg
from autoplan.report.timeline.trace_match import (
    check_trace_matches,
    plan_fingerprint,
    plan_summary,
    trace_metadata,
)
from autoplan.report.timeline.write import write_timeline

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
