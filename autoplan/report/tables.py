"""Rich tables of profiles and plans (presentation only: every number comes from elsewhere)."""

from __future__ import annotations

from rich.table import Table

from autoplan.graph.blocks import ModelProfile

__all__ = ["fmt_bytes", "fmt_count", "profile_table"]


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
