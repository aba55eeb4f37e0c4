"""Rich tables of profiles and plans (presentation only: every number comes from elsewhere)."""

from __future__ import annotations

from rich.table import Table

from autoplan.graph.blocks import ModelProfile

__all__ = ["calibration_table", "flops_unit", "fmt_bytes", "fmt_count", "layout_label", "plans_table",
           "profile_table", "stages_table"]


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


def fmt_step(seconds: float) -> str:
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


def layout_header(plans) -> str:
    """"tp/pp/dp", or "tp/pp/dp/cp" when a plan has context parallelism (`layout_label`)."""
    return "tp/pp/dp/cp" if any(getattr(p, "cp", 1) > 1 for p in plans) else "tp/pp/dp"


def layout_label(plan, with_cp: bool | None = None) -> str:
    """The plan's degrees as a user reads them. A plan's `dp` counts the cp ranks of each replica
    (plan.py: dp / cp replicas take distinct batches), so dp is shown as `plan.replicas`, the
    replicas the global batch is split over, and cp as its own degree: tp x pp x dp x cp GPUs."""
    cp = getattr(plan, "cp", 1)
    if with_cp is None:
        with_cp = cp > 1
    dp = plan.dp // cp if cp > 1 else plan.dp
    return f"{plan.tp}/{plan.pp}/{dp}" + (f"/{cp}" if with_cp else "")


_FLOPS_UNITS = (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6), ("kFLOP/s", 1e3))


def flops_unit(flops_per_s: float) -> tuple[str, float]:
    """The unit a rate of `flops_per_s` reads best in (at least 1 of it): ("TFLOP/s", 1e12) for a GPU,
    ("GFLOP/s", 1e9) for a CPU rank. One unit per table column: pass the column's largest value."""
    for unit, scale in _FLOPS_UNITS[1:]:
        if abs(flops_per_s) >= scale:
            return unit, scale
    return "FLOP/s", 1.0


def plans_table(plans, title: str = "") -> Table:
    """One row per plan, best first (the columns `autoplan suggest` prints)."""
    table = Table(title=title or None)
    # One FLOP/s unit for the column, chosen by its largest value (GFLOP/s on CPU ranks, not "0.0").
    unit, scale = flops_unit(max((p.predicted.model_tflops_per_gpu * 1e12 for p in plans), default=1e12))
    with_cp = any(getattr(p, "cp", 1) > 1 for p in plans)
    for name, justify in [("#", "right"), (layout_header(plans), "left"), ("micro-batch", "left"),
                          ("schedule", "left"), ("recompute", "left"), ("step", "right"), ("tokens/s", "right"),
                          (f"{unit}/GPU", "right"), ("MFU", "right"), ("mem/GPU", "right"), ("bubble", "right")]:
        table.add_column(name, justify=justify)
    for i, plan in enumerate(plans, 1):
        p = plan.predicted
        extras = []
        if plan.zero:
            extras.append(f"zero{plan.zero}")
        if getattr(plan, "dp_replicate", 1) > 1:
            extras.append(f"hsdp{plan.dp_replicate}x{plan.dp_shard}")
        if getattr(plan, "ep", 1) > 1:
            extras.append(f"ep{plan.ep}")
        if getattr(plan, "expert_tp", 1) > 1:
            extras.append(f"etp{plan.expert_tp}")
        if plan.sequence_parallel:
            extras.append("sp")
        recompute = plan.recompute + (" +" + ",".join(extras) if extras else "")
        memory = fmt_bytes(p.peak_memory_bytes) + ("" if plan.fits else " [red](does not fit)[/red]")
        flops = p.model_tflops_per_gpu * 1e12 / scale
        table.add_row(str(i), layout_label(plan, with_cp), f"{plan.micro_batch_size} x {plan.num_microbatches}",
                      _schedule_label(plan), recompute, fmt_step(p.step_time_s), f"{p.tokens_per_s:,.0f}",
                      f"{flops:.1f}" if flops >= 10 else f"{flops:.2f}", f"{p.mfu:.1%}", memory,
                      f"{p.bubble_fraction:.1%}")
    return table


def stages_table(plan, max_rows: int = 12) -> Table:
    """The stages of one plan: block ranges, time per micro-batch and the memory of their GPU.

    The memory columns add up to "total mem": weights + gradients + optimizer states, activations,
    FSDP's gathered parameters and gradients (a column only when the plan has any), and "other"
    (buffers and the allowance, `MemoryBreakdown`). A GPU holding several stages (interleaved
    schedules) has one memory figure for all of them: its rows are grouped under the rank, each
    row's blocks, times and params are the stage's own, and the rank's memory is shown once, on
    its first row.
    """
    v = plan.virtual_stages
    title = (f"stages of the best plan ({plan.num_stages} stage{'s' if plan.num_stages > 1 else ''} on {plan.pp} "
             f"pipeline rank{'s' if plan.pp > 1 else ''}")
    title += (f", {v} per rank; memory is the rank's, all its stages, on its first row)" if v > 1 else ")")
    gathered = any(s.memory.gathered_bytes > 0 for s in plan.stages)
    allowance = max(s.memory.allowance_bytes for s in plan.stages)
    # The source first: a caption wider than its table wraps at the end, which left the path alone on
    # a line (issue 44). A CPU rank's allowance holds no CUDA context or NCCL (cost/memory.py
    # `allowance_bytes`), so it is not labelled with them (issue 43).
    held = "gloo buffers, allocator slack" if _on_cpu(plan) else "CUDA context, NCCL, fragmentation"
    caption = (f"other (autoplan/cost/memory.py): buffers (P2P receives, the backward's working set, the gradient "
               f"bucket) + allowance {fmt_bytes(allowance)} ({held})")
    table = Table(title=title, caption=caption, caption_justify="left")
    columns = [("stage", "right"), ("rank", "right"), ("blocks", "left"), ("fwd", "right"), ("bwd", "right"),
               ("params", "right"), ("weights+grads+optim", "right"), ("activations", "right")]
    columns += [("FSDP gathered", "right")] if gathered else []
    columns += [("other", "right"), ("total mem", "right")]
    for name, justify in columns:
        table.add_column(name, justify=justify)
    stages = sorted(plan.stages, key=lambda s: (s.pp_rank, s.index)) if v > 1 else list(plan.stages)
    shown = list(stages)
    if len(shown) > max_rows:
        # First and last stages carry the embedding and the head: show both ends.
        shown = shown[: max_rows // 2] + [None] + shown[-(max_rows - max_rows // 2):]
    seen_ranks: set[int] = set()
    for s in shown:
        if s is None:
            table.add_row("...", "", f"({len(plan.stages) - max_rows} more stages)", *[""] * (len(columns) - 3))
            continue
        m = s.memory
        span = (f"{s.first_block}-{s.end_block - 1} ({s.first_block_name} .. {s.last_block_name})"
                if s.end_block - s.first_block > 1 else f"{s.first_block} ({s.first_block_name})")
        row = [str(s.index), str(s.pp_rank), span, f"{s.fwd_time_s * 1e3:.1f} ms", f"{s.bwd_time_s * 1e3:.1f} ms",
               fmt_count(s.num_params)]
        if v > 1 and s.pp_rank in seen_ranks:
            memory = [""] * (len(columns) - len(row))
        else:
            memory = [fmt_bytes(m.weights_bytes + m.grads_bytes + m.optimizer_bytes), fmt_bytes(m.activations_bytes)]
            memory += [fmt_bytes(m.gathered_bytes)] if gathered else []
            other = m.buffers_bytes + m.allowance_bytes + (0.0 if gathered else m.gathered_bytes)
            memory += [fmt_bytes(other), fmt_bytes(m.total_bytes)]
        seen_ranks.add(s.pp_rank)
        table.add_row(*row, *memory)
    return table


def _on_cpu(plan) -> bool:
    """Whether every rank of the plan's cluster is a CPU (`1x4xcpu`)."""
    try:
        return all(g.name == "cpu" for g in plan.cluster_obj().gpu_types)
    except (AttributeError, ValueError):  # a plan-like object without a cluster: GPU wording
        return False


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
