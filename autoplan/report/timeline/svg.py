"""The SVG rendering of timelines (no dependency): every box carries data-rank / data-action /
data-kind so tests and scripts can read it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from autoplan.plan import Plan
from autoplan.report.timeline._drawing import (
    axis_spans,
    box_label,
    fmt_s,
    tick_labels,
    title_text,
    wrapped_title,
)
from autoplan.report.timeline._kinds import COLORS, LEGEND, OTHER_COLOR, THIN_KINDS
from autoplan.report.timeline.model import Timeline

__all__ = ["to_svg"]

def to_svg(timelines: Sequence[Timeline], plan: Plan | None = None, *, width: int = 1200) -> str:
    """An SVG picture: per timeline a group of rows (one per pipeline rank), one rect per box.

    Every box is `<rect class="box" data-timeline=... data-rank=... data-action=... data-kind=...
    data-start-s=... data-end-s=...>` with a `<title>` tooltip; compute boxes are full height,
    transfers a thin bar at the bottom of the receiving row, the tail (DP, OPT) half height.
    Compute boxes carry the label that fits them (`box_label`); the time axis has one unit. Steps
    within `SHARED_SCALE_MAX_RATIO` of each other share one axis; otherwise each timeline has its own
    under its rows, and the legend says so (`axis_spans`).
    """
    title_px = 13
    # Bold 13 px sans-serif averages under 8.5 px a character: wrap to what the width holds.
    title_lines = wrapped_title(plan, timelines, max(20, int((width - 40) / 8.5)))
    left, right, row_h, gap = 110, 20, 28, 6
    top = 14 + 18 * len(title_lines)
    spans, scale_note = axis_spans(timelines)
    plot_w = width - left - right
    y = top
    parts: list[str] = []
    for t, span in zip(timelines, spans):
        scale = plot_w / span
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
                elif b.kind in THIN_KINDS:
                    by, bh = ry + row_h - 4, 4
                else:
                    by, bh = ry + row_h / 4, row_h / 2
                color = COLORS.get(b.kind, OTHER_COLOR)
                parts.append(
                    f'<rect class="box" x="{x:.2f}" y="{by:.2f}" width="{w:.2f}" height="{bh:.2f}" fill="{color}" '
                    f'stroke="white" stroke-width="0.5" data-timeline={quoteattr(t.label)} data-rank="{rank}" '
                    f'data-action={quoteattr(b.action)} data-kind="{b.kind}" data-start-s="{b.start_s:.9g}" '
                    f'data-end-s="{b.end_s:.9g}"><title>{escape(b.action)}: {fmt_s(b.start_s)} .. '
                    f'{fmt_s(b.end_s)} ({fmt_s(b.duration_s)})</title></rect>')
                label = box_label(b.action, w, 10) if b.is_compute else None
                if label is not None:
                    parts.append(f'<text class="label" x="{x + w / 2:.2f}" y="{ry + row_h / 2 + 4}" '
                                 f'text-anchor="middle" fill="white" font-size="10">{escape(label)}</text>')
            parts.append("</g>")
        y += t.num_ranks * (row_h + gap) + 12
        if scale_note is not None:  # its own axis, under its rows
            parts += _axis(left, plot_w, y, span, f"{t.label} time", t.label)
            y += 44
        parts.append("</g>")
    # One shared time axis: one unit for every tick, named once under it.
    axis = _axis(left, plot_w, y, spans[0], "time", None) if scale_note is None else []
    y += 40 if scale_note is None else 0
    legend = []
    lx = left
    for kind, label in LEGEND:
        legend.append(f'<rect x="{lx}" y="{y}" width="12" height="12" fill="{COLORS[kind]}"/>'
                      f'<text x="{lx + 16}" y="{y + 10}" font-size="11">{label}</text>')
        lx += 110
    if scale_note is not None:
        y += 20
        legend.append(f'<text class="scale-note" x="{left}" y="{y + 10}" font-size="11">{escape(scale_note)}</text>')
    height = y + 24
    heading = [f'<text class="title" x="{width / 2}" y="{22 + 18 * k}" text-anchor="middle" font-size="{title_px}" '
               f'font-weight="bold">{escape(line)}</text>' for k, line in enumerate(title_lines)]
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f"<title>{escape(title_text(plan, timelines))}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
        *heading, *parts, *axis, *legend, "</svg>", ""])


def _axis(left: float, plot_w: float, y: float, span_s: float, name: str, timeline: str | None) -> list[str]:
    """A time axis `plot_w` wide for `span_s` seconds at height `y`: ticks in one unit, named once."""
    ticks, labels, unit = tick_labels(span_s)
    scale = plot_w / span_s
    of = f" data-timeline={quoteattr(timeline)}" if timeline is not None else ""
    axis = [f'<line class="axis"{of} x1="{left}" y1="{y}" x2="{left + plot_w}" y2="{y}" stroke="#333"/>']
    for tick_s, label in zip(ticks, labels):
        x = left + tick_s * scale
        axis.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 4}" stroke="#333"/>')
        axis.append(f'<text class="tick"{of} x="{x:.2f}" y="{y + 16}" text-anchor="middle" font-size="10">{label}</text>')
    axis.append(f'<text class="axis-label"{of} x="{left + plot_w / 2:.2f}" y="{y + 30}" text-anchor="middle" '
                f'font-size="11">{escape(name)} ({unit})</text>')
    return axis
