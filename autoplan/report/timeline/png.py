"""The PNG rendering of timelines, drawn with matplotlib (the optional `plot` extra): the same
picture as the SVG one (report/timeline/svg.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from autoplan.plan import Plan
from autoplan.report.timeline._drawing import (
    axis_spans,
    box_label,
    fmt_s,
    tick_labels,
    time_unit,
    wrapped_title,
)
from autoplan.report.timeline._kinds import COLORS, LEGEND, OTHER_COLOR, THIN_KINDS
from autoplan.report.timeline.model import Timeline, TimelineError

__all__ = ["PLOT_HINT", "to_png", "load_pyplot"]

PLOT_HINT = "pip install autoplan[plot]"


def load_pyplot():
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
    plt = load_pyplot()
    from matplotlib.patches import Patch

    num_rows = sum(t.num_ranks for t in timelines)
    spans, scale_note = axis_spans(timelines)  # one shared axis, or each timeline its own (svg.py's rule)
    own = scale_note is not None
    dpi, fig_w = 120, 14.0
    title_lines = wrapped_title(plan, (), int(fig_w * dpi / 10.5)) if plan is not None else []
    title_h = 0.3 * len(title_lines)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(fig_w, 1.2 + title_h + 0.55 * num_rows
                                                         + (0.8 if own else 0.4) * len(timelines)),
                             sharex=not own, squeeze=False, dpi=dpi)
    for ax, t, span in zip(axes[:, 0], timelines, spans):
        unit, per_s = time_unit(span)
        groups: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for b in t.boxes:
            groups.setdefault((b.rank, b.kind), []).append((b.start_s * per_s, b.duration_s * per_s))
        for (rank, kind), xranges in groups.items():
            y = t.num_ranks - 1 - rank  # rank 0 on top
            if kind in ("F", "B", "W"):
                y0, h = y - 0.4, 0.8
            elif kind in THIN_KINDS:
                y0, h = y - 0.48, 0.12
            else:
                y0, h = y - 0.2, 0.4
            ax.broken_barh(xranges, (y0, h), facecolors=COLORS.get(kind, OTHER_COLOR), edgecolor="white",
                           linewidth=0.4)
        ax.set_yticks(range(t.num_ranks), [f"rank {t.num_ranks - 1 - i}" for i in range(t.num_ranks)])
        ax.set_ylim(-0.6, t.num_ranks - 0.4)
        ax.set_xlim(0, span * per_s * 1.01)
        ax.set_title(f"{t.label}: step {fmt_s(t.step_time_s)}, bubble {t.bubble_fraction:.1%}", fontsize=10)
        ax.set_facecolor("#f4f4f4")
        if own or ax is axes[-1, 0]:  # shared: the bottom axis names the unit once
            ticks, labels, _ = tick_labels(span)
            ax.set_xticks([tick * per_s for tick in ticks], labels)
            ax.set_xlabel(f"{t.label} time ({unit})" if own else f"time ({unit})")
    handles = [Patch(color=COLORS[k], label=label) for k, label in LEGEND]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
               title=scale_note, title_fontsize=8)
    if title_lines:
        fig.suptitle("\n".join(title_lines), fontsize=11, y=1 - 0.1 / fig.get_figheight(), va="top")
    top = 1 - (0.15 + title_h) / fig.get_figheight() if title_lines else 1
    fig.tight_layout(rect=(0, 0.06, 1, top))
    # Labels go in after the layout, where a box's width in pixels is known: only those that fit.
    font_pt = 7
    font_px = font_pt * dpi / 72
    for ax, t, span in zip(axes[:, 0], timelines, spans):
        unit, per_s = time_unit(span)
        px_per_unit = ax.get_window_extent().width / (span * per_s * 1.01)
        for b in t.boxes:
            if not b.is_compute:
                continue
            label = box_label(b.action, b.duration_s * per_s * px_per_unit, font_px)
            if label is not None:
                ax.text((b.start_s + b.duration_s / 2) * per_s, t.num_ranks - 1 - b.rank, label, ha="center",
                        va="center", fontsize=font_pt, color="white")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
