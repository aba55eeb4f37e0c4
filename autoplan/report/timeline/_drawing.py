"""What the SVG and the PNG rendering of a timeline share besides the kinds' look (_kinds.py): the
title, the time axis's unit and ticks, and which label fits a box.

A private module: both renderings (report/timeline/svg.py, report/timeline/png.py) draw the same
picture from these, so the two stay alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.plan import Plan
from autoplan.report.timeline.model import Timeline
from autoplan.report.timeline.trace_match import plan_summary
from autoplan.schedule import Action


def wrapped_title(plan: Plan | None, timelines: Sequence[Timeline], max_chars: int) -> list[str]:
    """The picture's title, wrapped to `max_chars` a line: the plan, then each timeline's summary."""
    import textwrap

    lines = textwrap.wrap(plan_summary(plan), max_chars) if plan is not None else []
    summaries = " | ".join(f"{t.label}: step {fmt_s(t.step_time_s)}, bubble {t.bubble_fraction:.1%}"
                           for t in timelines)
    return lines + (textwrap.wrap(summaries, max_chars) if summaries else [])


def title_text(plan: Plan | None, timelines: Sequence[Timeline]) -> str:
    return " | ".join(wrapped_title(plan, timelines, 10**6))


def fmt_s(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


SHARED_SCALE_MAX_RATIO = 2.0
"""Timelines whose steps differ by at most this factor share one time axis (their widths compare
directly); beyond it each is drawn on its own axis, its step over the full width, or the shorter one
is a sliver at the left edge (issue 44: a CPU run of a GPU-calibrated plan measured 54x the
prediction, whose rows were then 2% of the picture)."""


def axis_spans(timelines: Sequence[Timeline]) -> tuple[list[float], str | None]:
    """The time each timeline's rows span (seconds), and, when they are not one shared axis, the line
    the legend says it with (each timeline's step against the first's)."""
    steps = [t.step_time_s if t.step_time_s > 0 else 0.0 for t in timelines]
    longest = max(steps, default=0.0) or 1.0
    shortest = min((s for s in steps if s > 0), default=longest)
    if len(timelines) < 2 or longest <= SHARED_SCALE_MAX_RATIO * shortest:
        return [longest] * len(timelines), None
    first = timelines[0]
    ratios = ", ".join(f"{t.label} {t.step_time_s / first.step_time_s:.3g}x {first.label}" for t in timelines[1:]
                       if first.step_time_s > 0)
    note = "each timeline on its own time scale (its step is the full width)" + (f": {ratios}" if ratios else "")
    return [s or longest for s in steps], note


def time_unit(span_s: float) -> tuple[str, float]:
    """One unit for a whole axis, chosen by its span: (name, units per second)."""
    if span_s >= 1.0:
        return "s", 1.0
    if span_s >= 1e-3:
        return "ms", 1e3
    return "us", 1e6


def nice_step(span: float) -> float:
    raw = span / 8 if span > 0 else 1.0
    import math

    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def tick_labels(span_s: float) -> tuple[list[float], list[str], str]:
    """Tick positions (seconds) and their labels, every label in the one unit `time_unit` picks,
    with as many decimals as the tick spacing needs."""
    import math

    unit, per_s = time_unit(span_s)
    tick = nice_step(span_s)
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


def box_label(action: str, width_px: float, font_px: float) -> str | None:
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
