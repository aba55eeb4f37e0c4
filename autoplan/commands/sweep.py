"""What-if sweep over GPU counts: the best plan at each count, its throughput, MFU and scaling.

Scaling efficiency is tokens/s per GPU relative to the smallest count that has a plan (1.0 =
linear scaling), the weak-scaling measure of Narayanan et al. SC'21 Sec. 5.1 with the global batch
held fixed (so it is strong scaling in the batch, and falls as the per-replica batch shrinks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoplan.plan import Plan

__all__ = ["SweepRow", "check_plot_path", "cluster_for_count", "no_plan_lines", "parse_gpu_counts", "plot_sweep", "sweep",
           "sweep_table"]


@dataclass(frozen=True)
class SweepRow:
    num_gpus: int
    cluster: str
    """Description of the cluster the count was planned on."""
    plan: Plan | None
    error: str | None = None
    """Why there is no plan at this count (one line)."""
    scaling_efficiency: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.plan.predicted.tokens_per_s if self.plan else None

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return self.plan.predicted.tokens_per_s / self.num_gpus if self.plan else None

    @property
    def mfu(self) -> float | None:
        return self.plan.predicted.mfu if self.plan else None


def parse_gpu_counts(text: str | Sequence[int]) -> list[int]:
    """"64,128" -> [64, 128] (sorted, unique); one-line ValueError otherwise."""
    if isinstance(text, str):
        try:
            counts = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--sweep-gpus {text!r} must be comma-separated GPU counts, e.g. 64,128") from None
    else:
        counts = [int(c) for c in text]
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"--sweep-gpus {text!r} must list positive GPU counts, e.g. 64,128")
    return sorted(set(counts))


def cluster_for_count(template, num_gpus: int):
    """The template cluster (spec string or Cluster) resized to `num_gpus`: whole nodes of the
    template's size, or one smaller node below that. Links and GPU type are kept."""
    from autoplan.cluster import Cluster, parse_cluster

    base = parse_cluster(template) if isinstance(template, str) else template
    if not base.is_homogeneous:
        raise ValueError(f"--sweep-gpus needs a cluster with one GPU type; {base.describe()} mixes types")
    per_node = base.gpus_per_node
    if num_gpus <= per_node:
        nodes, per_node = 1, num_gpus
    elif num_gpus % per_node:
        raise ValueError(f"{num_gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    else:
        nodes = num_gpus // per_node
    data = base.to_dict()
    group = dict(data["groups"][0])
    group.update(nodes=nodes, gpus_per_node=per_node)
    gpu = group["gpu"] if isinstance(group["gpu"], str) else group["gpu"].get("name", "gpu")
    data.update(groups=[group], name=f"{nodes}x{per_node}x{gpu}")
    return Cluster.from_dict(data, where="sweep cluster")


def sweep(model, cluster_template, gpu_counts: Sequence[int], *, global_batch: int, seq_len: int | None = None,
          dtype: str = "bf16", pins: Mapping[str, Any] | None = None,
          on_row: Callable[[int, int, SweepRow], None] | None = None, **kwargs: Any) -> list[SweepRow]:
    """The best plan at every GPU count (via `autoplan.api.suggest_with_stats`, top 1).

    A count without a plan (too few GPUs for the model, a batch that does not divide) becomes a
    row with `error` set, not an exception. `on_row(done, total, row)` is called as each count is
    planned (progress). `kwargs` go to `suggest_with_stats` (e.g. intra_node_bw_gbps).
    """
    from autoplan.api import suggest_with_stats

    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    rows: list[SweepRow] = []
    counts = parse_gpu_counts(list(gpu_counts))
    for n in counts:
        try:
            cluster = cluster_for_count(cluster_template, n)
        except ValueError as exc:
            rows.append(SweepRow(n, str(cluster_template), None, str(exc).splitlines()[0]))
        else:
            try:
                result, _ = suggest_with_stats(model, cluster, global_batch=global_batch, seq_len=seq_len,
                                               dtype=dtype, top=1, **kwargs, **pins)
                rows.append(SweepRow(n, cluster.describe(), result.plans[0]))
            except ValueError as exc:
                message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                rows.append(SweepRow(n, cluster.describe(), None, message))
        if on_row is not None:
            on_row(len(rows), len(counts), rows[-1])
    reference = next((r for r in rows if r.plan is not None), None)
    if reference is None:
        return rows
    ref = reference.tokens_per_s_per_gpu
    return [SweepRow(r.num_gpus, r.cluster, r.plan, r.error, r.tokens_per_s_per_gpu / ref if r.plan and ref else None)
            for r in rows]


def sweep_table(rows: Sequence[SweepRow]):
    """A rich table: GPUs, best plan, tokens/s, per GPU, MFU, scaling efficiency. A count without a
    plan says "no plan" in its row; `no_plan_lines` gives the reasons whole (a table cell wraps or
    truncates them)."""
    from rich.table import Table

    from autoplan.report.tables import fmt_step, layout_header, layout_label

    planned = [r.plan for r in rows if r.plan is not None]
    with_cp = any(p.cp > 1 for p in planned)
    table = Table(title="what-if: best plan per GPU count (scaling vs the smallest count)")
    for name, justify in [("GPUs", "right"), (layout_header(planned), "left"), ("micro-batch", "left"),
                          ("schedule", "left"), ("step", "right"), ("tokens/s", "right"), ("tokens/s/GPU", "right"),
                          ("MFU", "right"), ("scaling", "right")]:
        table.add_column(name, justify=justify)
    for r in rows:
        if r.plan is None:
            table.add_row(str(r.num_gpus), "[red]no plan[/red] (reason below)", "", "", "", "", "", "", "")
            continue
        p = r.plan
        sched = p.schedule + (f" v{p.virtual_stages}" if p.virtual_stages > 1 else "")
        table.add_row(str(r.num_gpus), layout_label(p, with_cp), f"{p.micro_batch_size} x {p.num_microbatches}", sched,
                      fmt_step(p.predicted.step_time_s), f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s_per_gpu:,.0f}",
                      f"{r.mfu:.1%}", f"{r.scaling_efficiency:.0%}" if r.scaling_efficiency is not None else "-")
    return table


def no_plan_lines(rows: Sequence[SweepRow]) -> list[str]:
    """One line per count without a plan: "no plan at 1000000 GPUs: <why>"."""
    return [f"no plan at {r.num_gpus} GPUs: {r.error}" for r in rows if r.plan is None]


def check_plot_path(path: str | os.PathLike) -> None:
    """Refuse, before any planning, a plot `plot_sweep` could not draw: a suffix other than .png or
    .svg, or a .png without matplotlib (issue 43: `--plot x.bmp` was refused after the sweep ran)."""
    suffix = Path(path).suffix.lower()
    if suffix not in (".svg", ".png"):
        raise ValueError(f"cannot plot to {str(path)!r}: use a .png or .svg file")
    if suffix == ".png":
        from autoplan.report.timeline.png import load_pyplot

        load_pyplot()


def plot_sweep(rows: Sequence[SweepRow], path: str | os.PathLike) -> None:
    """Throughput and scaling efficiency against GPU count: .png (matplotlib) or .svg (built in)."""
    path = Path(path)
    ok = [r for r in rows if r.plan is not None]
    if not ok:
        raise ValueError("no GPU count has a plan; nothing to plot")
    check_plot_path(path)
    suffix = path.suffix.lower()
    if suffix == ".svg":
        text = _sweep_svg(ok)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        return
    if suffix != ".png":
        raise ValueError(f"cannot plot to {str(path)!r}: use a .png or .svg file")
    from autoplan.report.timeline.png import load_pyplot

    plt = load_pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [r.num_gpus for r in ok]
    ax.plot(xs, [r.tokens_per_s for r in ok], "o-", color="#4e79a7", label="tokens/s")
    ideal = [ok[0].tokens_per_s * n / ok[0].num_gpus for n in xs]
    ax.plot(xs, ideal, "--", color="#bab0ac", label="linear scaling")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # log-log: linear scaling is a straight line
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("predicted tokens/s")
    from autoplan.report.tables import layout_header, layout_label

    with_cp = any(r.plan.cp > 1 for r in ok)
    for i, r in enumerate(ok):
        # The end points' notes lean inwards, clear of the axes and their tick labels.
        ha = "center" if 0 < i < len(ok) - 1 or len(ok) == 1 else "left" if i == 0 else "right"
        ax.annotate(f"{layout_label(r.plan, with_cp)}\nMFU {r.mfu:.0%}, scaling {r.scaling_efficiency:.0%}",
                    (r.num_gpus, r.tokens_per_s), textcoords="offset points", xytext=(0, 8), ha=ha, fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{ok[0].plan.model}: best plan per GPU count ({layout_header([r.plan for r in ok])}, MFU, "
                 "scaling efficiency)", fontsize=10)
    ax.margins(x=0.1, y=0.25)  # room for the first and last points' annotations
    # Tick labels as the SVG writes them (22.2K, 1.4M), not 2 x 10^5.
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_tokens(v)))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: _fmt_tokens(v) if _leading_digit(v) in (2, 5) else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _leading_digit(value: float) -> int:
    import math

    return round(value / 10 ** math.floor(math.log10(value))) if value > 0 else 0


def _fmt_tokens(value: float) -> str:
    for unit, scale in (("M", 1e6), ("K", 1e3)):
        if value >= scale:
            text = f"{value / scale:.1f}".removesuffix(".0")
            return text + unit
    return f"{value:.0f}" if value >= 1 else f"{value:.2g}"


def _sweep_svg(rows: Sequence[SweepRow]) -> str:
    """Bars of predicted tokens/s per GPU count, on a y axis with ticks and its label."""
    from xml.sax.saxutils import escape

    from autoplan.report.tables import layout_label
    from autoplan.report.timeline._drawing import nice_step

    w, h, left, bottom, top, right = 720, 430, 90, 56, 52, 30
    peak = max(r.tokens_per_s for r in rows)
    tick = nice_step(peak * 1.15)
    ymax = tick * (int(peak * 1.2 / tick) + 1)  # room above the tallest bar for its labels
    n = len(rows)
    with_cp = any(r.plan.cp > 1 for r in rows)

    def x(i: int) -> float:
        return left + (w - left - right) * (i + 0.5) / n

    def y(v: float) -> float:
        return h - bottom - (h - bottom - top) * v / ymax

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="11"><rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2}" y="20" text-anchor="middle" font-weight="bold">'
             f'{escape(rows[0].plan.model)}: predicted tokens/s per GPU count</text>',
             f'<text x="{w / 2}" y="36" text-anchor="middle" fill="#555" font-size="10">above each bar: tokens/s, '
             f'then MFU and scaling efficiency (tokens/s per GPU against {rows[0].num_gpus} GPUs)</text>']
    k = 0
    while k * tick <= ymax * (1 + 1e-9):
        ty = y(k * tick)
        parts.append(f'<line class="grid" x1="{left}" y1="{ty:.1f}" x2="{w - right}" y2="{ty:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<line x1="{left - 4}" y1="{ty:.1f}" x2="{left}" y2="{ty:.1f}" stroke="#333"/>')
        parts.append(f'<text class="ytick" x="{left - 7}" y="{ty + 4:.1f}" text-anchor="end">'
                     f'{_fmt_tokens(k * tick)}</text>')
        k += 1
    parts += [f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="#333"/>',
              f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#333"/>',
              f'<text class="ylabel" x="18" y="{(top + h - bottom) / 2:.1f}" text-anchor="middle" '
              f'transform="rotate(-90 18 {(top + h - bottom) / 2:.1f})">predicted tokens/s</text>',
              f'<text class="xlabel" x="{(left + w - right) / 2:.1f}" y="{h - 8}" text-anchor="middle">'
              f'GPUs ({"tp/pp/dp/cp" if with_cp else "tp/pp/dp"} of the best plan)</text>']
    slot = (w - left - right) / n
    bar_w = slot * 0.6
    for i, r in enumerate(rows):
        parts.append(f'<rect class="bar" data-gpus="{r.num_gpus}" data-tokens-per-s="{r.tokens_per_s:.6g}" '
                     f'x="{x(i) - bar_w / 2:.1f}" y="{y(r.tokens_per_s):.1f}" width="{bar_w:.1f}" '
                     f'height="{h - bottom - y(r.tokens_per_s):.1f}" fill="#4e79a7"/>')
        detail = f"MFU {r.mfu:.0%}, scaling {r.scaling_efficiency:.0%}"
        # Each bar's labels stay inside its slot (about 6.5 px a character at 11 px): shorter, or none.
        if len(detail) * 6.5 > slot:
            short = f"{r.mfu:.0%}, {r.scaling_efficiency:.0%}"
            detail = short if len(short) * 6.5 <= slot else ""
        parts.append(f'<text x="{x(i):.1f}" y="{y(r.tokens_per_s) - 20:.1f}" text-anchor="middle">'
                     f'{_fmt_tokens(r.tokens_per_s)}</text>')
        if detail:
            parts.append(f'<text x="{x(i):.1f}" y="{y(r.tokens_per_s) - 6:.1f}" text-anchor="middle" fill="#555">'
                         f'{escape(detail)}</text>')
        parts.append(f'<text x="{x(i):.1f}" y="{h - bottom + 16}" text-anchor="middle">{r.num_gpus}</text>')
        parts.append(f'<text x="{x(i):.1f}" y="{h - bottom + 30}" text-anchor="middle" fill="#555">'
                     f'{layout_label(r.plan, with_cp)}</text>')
    parts.append("</svg>\n")
    return "\n".join(parts)
