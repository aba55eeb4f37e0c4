"""Rich tables of profiles and plans (presentation only: every number comes from elsewhere)."""

from __future__ import annotations

from rich.table import Table

from autoplan.graph.blocks import ModelProfile

__all__ = ["calibration_table", "fmt_bytes", "fmt_count", "profile_table"]


def fmt_bytes(n: float) -> str:
    """Binary units (GiB = 2**30 bytes), as GPU memory is quoted."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{int(n)}"


def _fmt_step(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f} ms"


def profile_table(profile: ModelProfile) -> Table:
    timed = profile.is_timed
    title = (f"{profile.model_name}: batch {profile.batch_size} x seq {profile.seq_len}, {profile.dtype}, "
             f"{'timed on ' + profile.device if timed else 'analytic (fake tensors)'}")
    table = Table(title=title, show_footer=True)
    table.add_column("#", justify="right", footer="")
    table.add_column("block", footer="total")
    table.add_column("kind")
    table.add_column("params", justify="right", footer=fmt_count(profile.num_params))
    table.add_column("fwd GFLOP", justify="right", footer=f"{profile.fwd_flops / 1e9:,.1f}")
    table.add_column("bwd GFLOP", justify="right", footer=f"{sum(b.bwd_flops for b in profile.blocks) / 1e9:,.1f}")
    table.add_column("output", justify="right")
    table.add_column("saved", justify="right", footer=fmt_bytes(sum(b.saved_bytes for b in profile.blocks)))
    if timed:
        table.add_column("fwd", justify="right", footer=_fmt_time(sum(b.fwd_time_s for b in profile.blocks)))
        table.add_column("bwd", justify="right", footer=_fmt_time(sum(b.bwd_time_s for b in profile.blocks)))
    for i, b in enumerate(profile.blocks):
        row = [str(i), b.name, b.kind, fmt_count(b.num_params), f"{b.fwd_flops / 1e9:,.2f}", f"{b.bwd_flops / 1e9:,.2f}",
               fmt_bytes(b.output_bytes), fmt_bytes(b.saved_bytes)]
        if timed:
            row += [_fmt_time(b.fwd_time_s), _fmt_time(b.bwd_time_s)]
        table.add_row(*row)
    return table


def _schedule_label(plan) -> str:
    return plan.schedule + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")


def plans_table(plans, title: str = "") -> Table:
    """One row per plan, best first (the columns `autoplan suggest` prints)."""
    table = Table(title=title or None)
    for name, justify in [("#", "right"), ("tp/pp/dp", "left"), ("micro-batch", "left"), ("schedule", "left"),
                          ("recompute", "left"), ("step", "right"), ("tokens/s", "right"), ("TFLOP/s/GPU", "right"),
                          ("MFU", "right"), ("mem/GPU", "right"), ("bubble", "right")]:
        table.add_column(name, justify=justify)
    for i, plan in enumerate(plans, 1):
        p = plan.predicted
        extras = []
        if plan.zero:
            extras.append(f"zero{plan.zero}")
        if getattr(plan, "dp_replicate", 1) > 1:
            extras.append(f"hsdp{plan.dp_replicate}x{plan.dp_shard}")
        if getattr(plan, "cp", 1) > 1:
            extras.append(f"cp{plan.cp}")
        if getattr(plan, "ep", 1) > 1:
            extras.append(f"ep{plan.ep}")
        if plan.sequence_parallel:
            extras.append("sp")
        recompute = plan.recompute + (" +" + ",".join(extras) if extras else "")
        memory = fmt_bytes(p.peak_memory_bytes) + ("" if plan.fits else " [red](does not fit)[/red]")
        table.add_row(str(i), f"{plan.tp}/{plan.pp}/{plan.dp}", f"{plan.micro_batch_size} x {plan.num_microbatches}",
                      _schedule_label(plan), recompute, _fmt_step(p.step_time_s), f"{p.tokens_per_s:,.0f}",
                      f"{p.model_tflops_per_gpu:.1f}", f"{p.mfu:.1%}", memory, f"{p.bubble_fraction:.1%}")
    return table


def stages_table(plan, max_rows: int = 12) -> Table:
    """The stages of one plan: block ranges, time per micro-batch and memory of their GPU."""
    table = Table(title=f"stages of the best plan ({plan.num_stages} stages on {plan.pp} pipeline ranks)")
    for name, justify in [("stage", "right"), ("rank", "right"), ("blocks", "left"), ("fwd", "right"),
                          ("bwd", "right"), ("params", "right"), ("weights+grads+optim", "right"),
                          ("activations", "right"), ("total mem", "right")]:
        table.add_column(name, justify=justify)
    shown = list(plan.stages)
    if len(shown) > max_rows:
        # First and last stages carry the embedding and the head: show both ends.
        shown = shown[: max_rows // 2] + [None] + shown[-(max_rows - max_rows // 2):]
    for s in shown:
        if s is None:
            table.add_row("...", "", f"({len(plan.stages) - max_rows} more stages)", "", "", "", "", "", "")
            continue
        m = s.memory
        span = (f"{s.first_block}-{s.end_block - 1} ({s.first_block_name} .. {s.last_block_name})"
                if s.end_block - s.first_block > 1 else f"{s.first_block} ({s.first_block_name})")
        table.add_row(str(s.index), str(s.pp_rank), span, f"{s.fwd_time_s * 1e3:.1f} ms", f"{s.bwd_time_s * 1e3:.1f} ms",
                      fmt_count(s.num_params), fmt_bytes(m.weights_bytes + m.grads_bytes + m.optimizer_bytes),
                      fmt_bytes(m.activations_bytes), fmt_bytes(m.total_bytes))
    return table


def calibration_table(cal) -> Table:
    """What `autoplan calibrate` fitted (`cal.measurements["fit"]["summary"]`): each number, how it
    was fitted, and the spread (max - min over median of repeats) of the points behind it."""
    table = Table(title=f"calibration of {cal.gpu} ({cal.measurements.get('device', '')})")
    for name, justify in [("quantity", "left"), ("value", "right"), ("points", "right"), ("spread median", "right"),
                          ("spread max", "right"), ("how", "left")]:
        table.add_column(name, justify=justify)
    for row in cal.measurements.get("fit", {}).get("summary", []):
        unit, value = row.get("unit"), row["value"]
        shown = (f"{value * 1e6:.2f} us" if unit == "s" else f"{value / 1e9:.2f} GB/s" if unit == "B/s"
                 else f"{value:.3f}")
        table.add_row(row["quantity"], shown, str(row["points"]), f"{row['spread_median']:.1%}",
                      f"{row['spread_max']:.1%}", row["detail"])
    return table
