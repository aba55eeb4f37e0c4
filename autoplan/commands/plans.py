"""CLI wiring for `autoplan check`, `autoplan show`, `autoplan export` and the `suggest --sweep-gpus`
what-if sweep. `autoplan/cli.py` calls `register(subparsers, console_factory)` and `run_sweep(...)`;
everything here is argument plumbing over `autoplan.check` and `autoplan.report.*`.

Errors are ValueErrors with one line; `cli.main` prints them as `autoplan: error: ...`, exit 2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["cmd_check", "cmd_export", "cmd_show", "register", "run_sweep"]

_PLAN_INDEX_HELP = "with `autoplan suggest --json` output: its N-th plan (0, the default, is the best)"
ConsoleFactory = Callable[..., Any]
"""`console_factory(stderr: bool = False) -> rich.console.Console` (cli.py's `_console`)."""


def register(subparsers: argparse._SubParsersAction, console_factory: ConsoleFactory) -> None:
    """Add the `check`, `show` and `export` subcommands; each sets `func(args) -> int`."""
    p = subparsers.add_parser(
        "check", help="plan a suite of models and clusters and fail on plan-quality regressions (CI gate)",
        description="Plan every case of SUITE.yaml (best plan, top 1) and compare with the baseline: exit 1 when "
                    "predicted tokens/s drops or peak memory per GPU grows by more than the tolerance, a plan no "
                    "longer fits or is not found, or a search exceeds its time budget.")
    p.add_argument("suite", help="suite YAML: tolerance {throughput, memory, search_time_s} and a list of cases")
    p.add_argument("--baseline", help="baseline JSON to compare with (and to rewrite with --update)")
    p.add_argument("--update", action="store_true", help="rewrite the baseline with the current results")
    p.add_argument("--strict", action="store_true", help="a case missing from the baseline fails")
    p.add_argument("--junit", metavar="OUT.xml", help="write a JUnit XML report (one testcase per case)")
    p.add_argument("--json", metavar="OUT.json", dest="json_out", help="write the results as JSON")
    p.set_defaults(func=lambda args: cmd_check(args, console_factory))

    p = subparsers.add_parser("show", help="summarize a plan and draw its timeline (SVG, PNG or Chrome trace)")
    p.add_argument("plan", help="plan JSON written by `autoplan suggest --out` (or `suggest --json` output: its best plan)")
    p.add_argument("--plan-index", type=int, metavar="N", help=_PLAN_INDEX_HELP)
    p.add_argument("--trace", help="measured Chrome trace from `autoplan run --trace`, drawn under the prediction")
    p.add_argument("--step", type=int, help="which step of --trace to draw (default: the last)")
    p.add_argument("--out", help="timeline file: .svg, .png (needs autoplan[plot]) or .json (Chrome trace)")
    p.set_defaults(func=lambda args: cmd_show(args, console_factory))

    p = subparsers.add_parser("export", help="write a plan as a torchtitan, Megatron-LM or DeepSpeed configuration")
    p.add_argument("plan", help="plan JSON written by `autoplan suggest --out` (or `suggest --json` output: its best plan)")
    p.add_argument("--plan-index", type=int, metavar="N", help=_PLAN_INDEX_HELP)
    p.add_argument("--to", required=True, dest="target", metavar="{torchtitan,megatron,deepspeed}",
                   help="torchtitan (config-registry Python file, 0.3), megatron (Megatron-LM arguments, "
                        "core 0.16), deepspeed (JSON config and PipelineModule arguments, 0.19)")
    p.add_argument("--out", help="write to this file instead of stdout (torchtitan: a .py file; its stem is the "
                                 "--module its command line names)")
    p.add_argument("--allow-approx", action="store_true",
                   help="where the target cannot state the plan exactly, write the nearest config with every "
                        "difference listed at its top and on stderr (default: refuse, exit 2)")
    p.set_defaults(func=lambda args: cmd_export(args, console_factory))


def cmd_check(args: argparse.Namespace, console_factory: ConsoleFactory) -> int:
    from autoplan import check

    return check.run_command(args, console_factory())


def cmd_show(args: argparse.Namespace, console_factory: ConsoleFactory) -> int:
    from autoplan.plan import Plan
    from autoplan.report import timeline
    from autoplan.report.tables import plans_table, stages_table

    plan = Plan.load(args.plan, plan_index=args.plan_index)
    timelines = [timeline.predicted_timeline(plan)]
    if args.trace:
        # Checked before anything is printed: a trace of another plan would compare two unrelated
        # steps (issue 29: "measured ... 3.11x" against a plan that never ran).
        trace = timeline.load_trace(args.trace)
        timeline.check_trace_matches(trace, plan, trace_name=f"trace {args.trace}", plan_name=args.plan)
        timelines.append(timeline.measured_timeline(trace, plan, step=args.step))
    console = console_factory()
    cluster = plan.cluster_obj()
    console.print(f"[bold]{plan.model}[/bold] on {cluster.describe()}; global batch {plan.job.global_batch} x seq "
                  f"{plan.job.seq_len}, {plan.job.dtype}; {'fits' if plan.fits else '[red]does not fit[/red]'}")
    console.print(plans_table([plan], title="plan"))
    console.print(stages_table(plan))
    console.print(f"bound by: {plan.predicted.bound}")
    if plan.predicted.breakdown:
        # One unit for the line, the step's own (s for a 7 s step, ms for a 50 ms one).
        unit, per_s = ("s", 1.0) if plan.predicted.step_time_s >= 1 else ("ms", 1e3)
        console.print("per step: " + ", ".join(f"{k.removesuffix('_s')} {v * per_s:.{3 if unit == 's' else 2}f} {unit}"
                                               for k, v in plan.predicted.breakdown.items()))
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if len(timelines) > 1:
        predicted, measured = timelines
        ratio = measured.step_time_s / predicted.step_time_s if predicted.step_time_s else float("nan")
        console.print(f"measured step {measured.step_time_s * 1e3:.2f} ms vs predicted "
                      f"{predicted.step_time_s * 1e3:.2f} ms ({ratio:.2f}x); bubble {measured.bubble_fraction:.1%} "
                      f"vs {predicted.bubble_fraction:.1%}")
    if args.out:
        timeline.write_timeline(timelines, args.out, plan)
        console.print(f"wrote the timeline to {args.out}")
    return 0


def cmd_export(args: argparse.Namespace, console_factory: ConsoleFactory) -> int:
    from pathlib import Path

    from autoplan.plan import Plan
    from autoplan.report.export import export_plan

    plan = Plan.load(args.plan, plan_index=args.plan_index)
    export = export_plan(plan, args.target, allow_approx=args.allow_approx, filename=args.out)
    err = console_factory(stderr=True)
    for difference in export.differences:
        err.print(f"approximate: {difference}", markup=False, highlight=False, soft_wrap=True)
    if args.out:
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(export.text)
        tmp.replace(out)
        err.print(f"wrote the {export.target} configuration to {args.out}"
                  + (f" ({len(export.differences)} difference{'s' if len(export.differences) > 1 else ''} from the "
                     "plan, listed at its top)" if export.differences else ""), markup=False, highlight=False,
                  soft_wrap=True)
        err.print(f"run it: {export.command}", markup=False, highlight=False, soft_wrap=True)
    else:
        print(export.text, end="")
    return 0


def run_sweep(*, model: str, cluster: str, gpu_counts: str | Sequence[int], global_batch: int,
              seq_len: int | None = None, dtype: str = "bf16", pins: Mapping[str, Any] | None = None,
              plot: str | None = None, json_out: bool = False, console=None, **kwargs: Any) -> int:
    """`autoplan suggest --sweep-gpus 64,128 [--plot out.png]`: best plan per GPU count, a table of
    throughput, MFU and scaling efficiency, and optionally a plot (.png or .svg). `kwargs` go to
    `suggest_with_stats` (intra_node_bw_gbps, inter_node_bw_gbps, leaf_modules). Returns 0; a
    sweep where no count has a plan is a ValueError (one line, each count's reason). Progress goes
    to stderr: a bar on a terminal, else one line per count."""
    import sys
    import time

    from autoplan.commands.sweep import (
        check_plot_path,
        no_plan_lines,
        parse_gpu_counts,
        plot_sweep,
        sweep,
        sweep_table,
    )
    from autoplan.report.tables import layout_label

    counts = parse_gpu_counts(gpu_counts)
    if plot:
        check_plot_path(plot)  # before minutes of planning, not after
    start = time.monotonic()
    progress = task = None
    # One count is one `suggest`, which prints no progress off a terminal: its stderr stays the error alone.
    print_lines = len(counts) > 1
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True)
        task = progress.add_task(f"planning {counts[0]} GPUs", total=len(counts))
        progress.start()
    elif print_lines:
        print(f"autoplan: sweeping {len(counts)} GPU counts: "
              f"{', '.join(map(str, counts))}", file=sys.stderr, flush=True)

    def on_row(done: int, total: int, row) -> None:
        if progress is not None:
            following = f"planning {counts[done]} GPUs" if done < total else "done"
            progress.update(task, completed=done, description=following)
        elif print_lines:
            best = f"best {layout_label(row.plan)}" if row.plan is not None else "no plan"
            print(f"autoplan: {done}/{total}: {row.num_gpus} GPUs, {best} ({time.monotonic() - start:.1f} s)",
                  file=sys.stderr, flush=True)

    try:
        rows = sweep(model, cluster, counts, global_batch=global_batch, seq_len=seq_len, dtype=dtype, pins=pins,
                     on_row=on_row, **kwargs)
    finally:
        if progress is not None:
            progress.stop()
    if not any(r.plan for r in rows):
        # Nothing to tabulate or plot: the reasons are the answer (issue 29: they were in a cut table cell).
        raise ValueError(f"--sweep-gpus {','.join(map(str, counts))}: " + "; ".join(no_plan_lines(rows)))
    if json_out:
        print(json.dumps([{"num_gpus": r.num_gpus, "cluster": r.cluster, "error": r.error,
                           "tokens_per_s": r.tokens_per_s, "mfu": r.mfu, "scaling_efficiency": r.scaling_efficiency,
                           "plan": r.plan.to_dict() if r.plan else None} for r in rows], indent=2, default=str))
    else:
        if console is None:
            from rich.console import Console

            console = Console()
        console.print(sweep_table(rows))
        for line in no_plan_lines(rows):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if plot:
        plot_sweep(rows, plot)
        if console is not None and not json_out:
            console.print(f"wrote the sweep plot to {plot}")
    return 0
