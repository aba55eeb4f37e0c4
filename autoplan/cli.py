"""`autoplan` console script: thin argument parsing over `autoplan.api`.

Every user mistake (bad spec, bad cluster, impossible pin, missing file) ends as one line on
stderr and exit code 2; nothing here computes anything itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

# Only what parsing the command line needs is imported here: `autoplan --help` and `--version` stay
# under a second (issue 29); torch, rich and the planner load inside the command that uses them.
from autoplan._files import check_output_file
from autoplan._version import __version__

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["main"]

EXIT_USAGE = 2


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # Piped output has no terminal width; rich would squeeze tables to 80 columns.
    width = None if stream.isatty() else 160
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=width)


def _progress_callback(enabled: bool):
    """A rich progress bar as a (done, total, description) callback, or None when disabled."""
    if not enabled:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=_console(stderr=True), transient=True)
    task = None

    def update(done: int, total: int, description: str) -> None:
        nonlocal task
        if task is None:
            task = progress.add_task("profiling", total=total)
        progress.update(task, completed=done, total=total, description=f"profiling {description}")

    return progress, update


def _add_model_args(p: argparse.ArgumentParser, default_model: str | None) -> None:
    p.add_argument("--model", default=default_model, required=default_model is None,
                   help="model spec: NAME[:key=value,...] (gpt, llama or a preset such as llama3-8b), path/to/file.py:function, "
                        "hf:PATH (a Hugging Face config.json or its directory) or hf:MODEL_TYPE:key=value,...")
    p.add_argument("--leaf-modules", default="", help="comma-separated module paths that become blocks, e.g. 'layers.*.attention,layers.*.mlp'")
    p.add_argument("--tracer", default="auto", choices=["auto", "fx", "export", "modules"], help="force a tracer (default: try fx, export, module boundaries)")
    p.add_argument("--dtype", default="bf16", help="compute dtype of activations and weights: bf16, fp16 or fp32 (default bf16)")


def cmd_profile(args: argparse.Namespace) -> int:
    from autoplan import api
    from autoplan.graph.profile_cache import cached_from, forget_cached
    from autoplan.graph.timing import timing_warnings
    from autoplan.report.tables import profile_table

    progress, callback = _progress_callback(not args.json and sys.stderr.isatty())
    leaf = [s for s in args.leaf_modules.split(",") if s]
    if progress is not None:
        progress.start()
    try:
        def profile():
            return api.profile_with_graph(args.model, batch_size=args.batch, seq_len=args.seq_len, dtype=args.dtype,
                                          device=args.device, leaf_modules=leaf, tracer=args.tracer, progress=callback)

        result = profile()
        if args.refresh and forget_cached(result.profile):  # timed earlier: drop that entry and time again
            result = profile()
    finally:
        if progress is not None:
            progress.stop()
    cache_file = cached_from(result.profile)
    cached = " (cached: timed earlier; --refresh times it again)" if cache_file else ""
    spread = result.profile.extra.get("timing_spread") or {}
    # graph/timing.py [Note: noisy timings]; on stderr, so that --json output stays one JSON document.
    for warning in timing_warnings(result.profile.blocks, spread.get("by_block") or {},
                                   rerun="rerun it on an idle machine with --refresh"):
        print(f"autoplan: warning: {warning}", file=sys.stderr)
    if args.json:
        if cached:
            print(f"autoplan: profile{cached}", file=sys.stderr)
        print(result.profile.to_json())
        return 0
    console = _console()
    console.print(f"[dim]{result.traced.note}[/dim]")
    console.print(profile_table(result.profile))
    if result.profile.extra.get("timing_dtype_note"):
        console.print(f"note: {result.profile.extra['timing_dtype_note']}")
    if spread.get("median") is not None:  # a timed profile: how far each block's repeats disagreed
        console.print(f"timing spread ((max - min) / median of each block's repeats): median {spread['median']:.1%}, "
                      f"worst {spread['max']:.1%}{cached}")
    elif cached:
        console.print(f"timings{cached}")
    return 0


DEFAULT_SUGGEST = {"model": "llama3-8b", "cluster": "2x8xH100-80GB", "global_batch": 512, "seq_len": 4096}


_PIN_OPTIONS = ("tp", "pp", "dp", "micro_batch_size", "schedule", "virtual_stages", "recompute", "zero", "dp_replicate",
                "ep", "cp", "sequence_parallel", "reduce_dtype", "expert_tp")


def _pins(args: argparse.Namespace) -> dict:
    """The options given that pin the search: the choices and every layout field that has an option
    (layout.py `LAYOUT_FIELDS`; the rank order has none)."""
    from autoplan.layout import LAYOUT_FIELDS

    names = (*_PIN_OPTIONS, *(name for name in LAYOUT_FIELDS if name not in _PIN_OPTIONS))
    return {k: getattr(args, k, None) for k in names if getattr(args, k, None) is not None}


def _no_plan_output(args: argparse.Namespace, exc: Exception) -> None:
    """When nothing fits, what --json and --explain still owe (issue 44: both were dropped for the
    one-line error): a JSON document on stdout ({"plans": [], "error", "search"}: the counts, and with
    --explain the closest rejected configurations and why), or the --explain table."""
    from autoplan.report.explain import rejections_table, search_summary

    result = getattr(exc, "result", None)
    message = str(exc).strip().splitlines()[0]
    if args.json:
        search = result.to_dict()["search"] if result is not None else {}
        print(dump_json({"plans": [], "error": message, "search": search}))
    elif args.explain and result is not None:
        console = _console()
        console.print(rejections_table(result))
        console.print(f"[dim]{search_summary(result)}[/dim]")


def cmd_suggest(args: argparse.Namespace) -> int:
    from autoplan import api
    from autoplan.report.explain import rejections_table, search_summary
    from autoplan.report.tables import fmt_count, plans_table, stages_table
    from autoplan.search.configs import NoPlanError

    if args.seq_len is None and args.model == DEFAULT_SUGGEST["model"]:
        args.seq_len = DEFAULT_SUGGEST["seq_len"]  # the default job (README): llama3-8b at 4096 tokens
    if args.sweep_gpus and args.target:
        raise ValueError(f"--target plans one search; drop --sweep-gpus, or --target {args.target}")
    if args.sweep_gpus and args.explain:
        raise ValueError("--explain lists what one search rejected; drop --sweep-gpus, or --explain")
    if args.sweep_gpus:
        from autoplan.commands.plans import run_sweep

        return run_sweep(model=args.model, cluster=args.cluster, gpu_counts=args.sweep_gpus,
                         global_batch=args.global_batch, seq_len=args.seq_len, dtype=args.dtype, pins=_pins(args),
                         plot=args.plot, json_out=args.json, console=_console(),
                         intra_node_bw_gbps=args.intra_node_bw, inter_node_bw_gbps=args.inter_node_bw)
    if args.plot:
        raise ValueError("--plot draws a sweep; add --sweep-gpus, e.g. --sweep-gpus 64,128,256")
    interactive = not args.json and sys.stderr.isatty()
    progress, callback = _progress_callback(interactive)
    search_progress, search_callback = _progress_callback(interactive)
    leaf = [s for s in args.leaf_modules.split(",") if s]
    if progress is not None:
        progress.start()
    try:
        result, profiled = api.suggest_with_stats(
            args.model, args.cluster, global_batch=args.global_batch, seq_len=args.seq_len, top=args.top,
            dtype=args.dtype, intra_node_bw_gbps=args.intra_node_bw, inter_node_bw_gbps=args.inter_node_bw,
            leaf_modules=leaf, tracer=args.tracer, progress=callback, search_progress=search_callback,
            calibration=args.calibration or None, stack=args.stack, explain=args.explain, target=args.target,
            **_pins(args))
    except NoPlanError as exc:
        if progress is not None:
            progress.stop()  # before anything is printed (stopping twice is harmless)
        _no_plan_output(args, exc)
        raise  # main() prints the one-line error, exit 2
    finally:
        if progress is not None:
            progress.stop()
    if args.out:
        result.plans[0].save(args.out)
    if args.json:
        print(dump_json(result.to_dict()))
        return 0
    console = _console()
    best = result.plans[0]
    cluster = best.cluster_obj()
    console.print(f"[bold]{profiled.profile.model_name}[/bold] ({fmt_count(profiled.profile.num_params)} parameters, "
                  f"{profiled.profile.num_blocks} blocks) on {cluster.describe()}; global batch {args.global_batch} x "
                  f"seq {best.job.seq_len}, {best.job.dtype}")
    console.print(plans_table(result.plans))
    console.print(stages_table(best))
    console.print(f"best plan is bound by: {best.predicted.bound}")
    for note in result.notes:  # e.g. why tensor parallelism was not considered
        console.print(f"note: {note}")
    if args.explain:
        console.print(rejections_table(result))
        kept = result.rejections.kept("target") if args.target else []  # beside search/rejections.py's REASONS
        if kept:
            console.print(f"not run by {args.target} as planned ({result.rejections.counts['target']:,}), the first "
                          "few:")
        for rejection, _ in kept:
            console.print(f"  {rejection.config}: {rejection.why.removeprefix(args.target + ': ')}")
    if args.target:
        console.print(f"[dim]--target {args.target}: {result.rejections.counts.get('target', 0):,} "
                      f"configurations not run by {args.target} as planned were left out; the plans listed export "
                      f"with `autoplan export --to {args.target}` as planned[/dim]")
    console.print(f"[dim]{search_summary(result)}; MFU counts model FLOPs without recompute (PaLM, Chowdhery et al. "
                  "2022, App. B)[/dim]")
    if args.out:
        console.print(f"wrote the best plan to {args.out}; run it with `autoplan run {args.out}`")
    return 0


def cmd_export_checkpoint(args: argparse.Namespace) -> int:
    if args.format == "hf":
        from autoplan.runtime.checkpoint.hf_export import export_hf

        if args.everything:
            raise ValueError("--everything writes a torch.save file; --format hf writes the model's weights only")
        out = export_hf(args.checkpoint, args.out)
    else:
        from autoplan.runtime.checkpoint import export_torch_save

        out = export_torch_save(args.checkpoint, args.out, model_only=not args.everything)
    print(f"wrote {out}")
    return 0


def _betas(text: str) -> tuple[float, float]:
    """--betas B1,B2."""
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return float(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be two numbers B1,B2, e.g. 0.9,0.95") from None


def cmd_run(args: argparse.Namespace) -> int:
    from autoplan.plan import Plan
    from autoplan.runtime.launcher.job_file import merge_run_args

    # The command line over the job file (--config) over the defaults (job_file.py), before torch loads.
    args = merge_run_args(args)
    for flag in ("metrics", "trace"):  # outputs a job file names are checked as the flags are
        if getattr(args, flag) is not None:
            check_output_file(f"--{flag}", getattr(args, flag))
    # A file that is not a usable plan is refused before torch loads (one line in under 2 s, issue 43);
    # `suggest --json` output gives its best plan, or the one --plan-index names (issue 44).
    plan = Plan.load(args.plan, plan_index=args.plan_index)
    from autoplan.runtime.launcher.machine import refuse_early

    # A plan this machine cannot hold is refused before torch loads (machine.py [Note: the refusal before torch]).
    refuse_early(plan, args.nproc, allow_oversubscribe=args.allow_oversubscribe)
    from autoplan.runtime import run_plan
    from autoplan.runtime.launcher.optim_config import OptimizerConfig

    optimizer = OptimizerConfig(lr=args.lr, betas=args.betas, eps=args.eps, weight_decay=args.weight_decay,
                                no_decay_embeddings=args.no_decay_embeddings, warmup_steps=args.warmup_steps,
                                lr_schedule=args.lr_schedule, min_lr=args.min_lr, decay_steps=args.decay_steps)
    return run_plan(plan, model=args.model, steps=args.steps, nproc=args.nproc, trace_path=args.trace,
                    metrics_path=args.metrics, seed=args.seed, timeout_s=args.timeout,
                    checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
                    skip_nonfinite=args.skip_nonfinite,
                    data=args.data, allow_oversubscribe=args.allow_oversubscribe,
                    clip_grad=args.clip_grad, overwrite=args.overwrite, init=args.init, optimizer=optimizer,
                    eval_every=args.eval_every, eval_data=args.eval_data, eval_batches=args.eval_batches)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autoplan.calibrate.calibrate import calibrate
    from autoplan.calibrate.calibrate_collectives import CalibrationRunError
    from autoplan.report.tables import calibration_table

    try:
        cal = calibrate(args.out, device=args.device, gpu=args.gpu, dtype=args.dtype, quick=args.quick,
                        collectives=args.collectives, nproc=args.nproc, force=args.force, timeout_s=args.timeout)
    except CalibrationRunError as exc:
        print(f"autoplan: error: {exc}", file=sys.stderr)
        return 1
    if cal is None:  # a rank other than 0 under torchrun
        return 0
    console = _console()
    console.print(calibration_table(cal))
    for note in cal.measurements["fit"]["notes"]:
        console.print(f"note: {note}")
    console.print(f"wrote {args.out}; use it with `autoplan suggest --calibration {args.out}`")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoplan", description="Plan and run pipeline/tensor/data-parallel training of PyTorch models.")
    parser.add_argument("--version", action="version", version=f"autoplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("profile", help="trace a model and print what each block costs")
    _add_model_args(p, default_model=None)
    p.add_argument("--batch", type=int, default=1, help="micro-batch size to profile at (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's own length)")
    p.add_argument("--device", default="meta", help="meta (analytic, no memory), cpu or cuda (time every block)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--refresh", action="store_true",
                   help="with --device cpu or cuda: time the blocks again instead of reusing the cached timings "
                        "(taken on this machine earlier, perhaps while it was busy)")
    p.set_defaults(func=cmd_profile)
    p = sub.add_parser("suggest", help="search parallel plans for a model on a cluster and rank them",
                       description="With no arguments, plans llama3-8b on 2x8xH100-80GB (global batch 512, seq 4096).")
    _add_model_args(p, default_model=DEFAULT_SUGGEST["model"])
    p.add_argument("--cluster", default=DEFAULT_SUGGEST["cluster"],
                   help="preset (dgx-h100, 4xdgx-a100), NODESxGPUSxGPU (128x8xA100-80GB) or a YAML file")
    p.add_argument("--global-batch", type=int, default=DEFAULT_SUGGEST["global_batch"], help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: the model's own length, e.g. its max_seq_len / "
                        "max_position_embeddings or its example inputs'; 4096 for the default llama3-8b job)")
    p.add_argument("--top", type=int, default=5, help="how many plans to list (default 5)")
    p.add_argument("--json", action="store_true", help="print {plans, search} as JSON")
    p.add_argument("--explain", action="store_true",
                   help="also list the best rejected configurations per reason (over memory by how much and what "
                        "would fit, batch not divisible, layout refused, pruned by a bound); in --json under "
                        "search.rejections")
    p.add_argument("--out", help="write the best plan to this JSON file (for `autoplan run`)")
    p.add_argument("--target", choices=["torchtitan", "megatron", "deepspeed"],
                   help="search only plans this trainer runs as planned, so that `autoplan export --to` it writes "
                        "the plan with no difference (search/targets.py)")
    p.add_argument("--sweep-gpus", help="what-if: best plan per GPU count, e.g. 64,128,256 (nodes of the --cluster GPU)")
    p.add_argument("--plot", help="with --sweep-gpus: write the sweep as a picture (.svg, or .png with matplotlib)")
    p.add_argument("--intra-node-bw", type=float, help="override intra-node bandwidth, GB/s per GPU per direction")
    p.add_argument("--inter-node-bw", type=float, help="override inter-node bandwidth, GB/s per GPU per direction")
    p.add_argument("--calibration", action="append", metavar="FILE",
                   help="a calibration `autoplan calibrate` wrote, used in place of the shipped one for its GPU type "
                        "(repeat for several GPU types)")
    p.add_argument("--stack", metavar="NAME",
                   help="the software stack to price (default: today's, flash attention); the shipped A100 and H100 "
                        "calibrations also describe 'megatron-lm-2021' (unfused attention, as Megatron-LM ran in 2021), "
                        "the H100's 'megatron-core' and 'megatron-core-deepep' (Megatron-Core's MoE stack: "
                        "docs/cost-model.md)")
    pins = p.add_argument_group("pins (fix a dimension; the rest is searched)")
    pins.add_argument("--tp", type=int)
    pins.add_argument("--pp", type=int)
    pins.add_argument("--dp", type=int, metavar="N",
                      help="data-parallel ranks, the context-parallel ranks of --cp included (as the plan counts "
                           "them: tp x pp x dp GPUs); tables show such a plan as dp N/cp and cp, the replicas the "
                           "batch is split over")
    pins.add_argument("--micro-batch-size", type=int)
    pins.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
    pins.add_argument("--virtual-stages", type=int)
    pins.add_argument("--recompute", choices=["none", "selective", "full"])
    pins.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                      help="0 replicated, 1 optimizer states sharded, 2 / 3 FSDP (3 reshards after forward)")
    pins.add_argument("--dp-replicate", type=int, metavar="N",
                      help="HSDP with --zero 2/3: FSDP shards over dp / N ranks and replicates N times (1: plain FSDP)")
    pins.add_argument("--ep", type=int, metavar="N",
                      help="expert parallelism (mixture-of-experts models): split each layer's experts over N "
                           "ranks of tp x dp (N divides tp x dp), tokens sent by all-to-all (any zero, HSDP)")
    pins.add_argument("--expert-tp", type=int, metavar="N",
                      help="expert tensor parallelism (mixture-of-experts models), 1 or --tp: the tp ranks split each "
                           "expert's hidden units and share their tokens (default 1: every expert whole, each tp rank "
                           "sending its own tokens)")
    pins.add_argument("--cp", type=int, metavar="N",
                      help="context parallelism (long sequences): N data-parallel ranks split each sequence into "
                           "2N load-balanced chunks and all-gather keys and values; dp counts them")
    pins.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                      help="with tp > 1: shard the activations tp leaves whole (norms, dropout) along the sequence, "
                           "with reduce-scatter + all-gather in place of tp's all-reduce (Korthikanti et al. 2022); "
                           "--no-sequence-parallel keeps them whole (default: searched)")
    pins.add_argument("--reduce-dtype", choices=["float32", "bfloat16"],
                      help="the dtype FSDP reduces gradients in (default float32); bfloat16 with --zero 2/3 halves the "
                           "reduce-scatter's bytes (FSDP2's MixedPrecisionPolicy reduce_dtype, Megatron-LM's "
                           "--grad-reduce-in-bf16)")
    p.set_defaults(func=cmd_suggest)

    p = sub.add_parser("run", help="train N steps of a plan through autoplan's pipeline executor",
                       description="Trains on synthetic data (fixed seed; --data for yours) with AdamW and prints the loss and the "
                                   "measured and predicted step time. --nproc N spawns N local processes (gloo on CPU); under "
                                   "`torchrun ... -m autoplan run plan.json` each process runs one rank. Every setting can "
                                   "come from a job file (--config job.toml, docs/training.md); flags override it.")
    # Every default is None here and applied after the job file (job_file.py RUN_DEFAULTS): a flag
    # given on the command line, even at its default value, overrides the file.
    p.add_argument("plan", nargs="?",
                   help="plan JSON written by `autoplan suggest --out` (or `suggest --json` output: its best plan); "
                        "or a job file (.toml), as --config")
    p.add_argument("--config", metavar="JOB.toml",
                   help="a job file recording the plan, data, optimizer, schedule, steps, checkpoints and evaluation "
                        "(docs/training.md); flags given here override it")
    p.add_argument("--plan-index", type=int, metavar="N",
                   help="with `autoplan suggest --json` output: run its N-th plan (0, the default, is the best)")
    p.add_argument("--model", help="model spec to build (default: the one the plan names)")
    p.add_argument("--steps", type=int, help="training steps (default 10)")
    p.add_argument("--data", metavar="PATH",
                   help="real data (docs/training.md): a token file (nanoGPT's uint16 train.bin; train.bin:uint32 for "
                        "larger vocabularies; .npy), a Megatron-LM PREFIX.bin/.idx, a Hugging Face datasets directory "
                        "(save_to_disk, an input_ids column), or FILE.py:FUNCTION, FUNCTION(step, batch_size, seq_len) "
                        "returning (inputs, target) of the global batch (default: synthetic batches shaped like the "
                        "model's example inputs)")
    p.add_argument("--nproc", type=int, help="spawn this many local processes (must equal the plan's GPU count)")
    p.add_argument("--trace", help="write the measured per-action timeline (Chrome trace JSON)")
    p.add_argument("--metrics", help="append one JSON object per step (run, step, loss, lr, step_time_s, "
                                     "predicted_step_time_s; eval_loss records with --eval-every)")
    p.add_argument("--seed", type=int, help="seed of the weights, the synthetic data and a dataset's order (default 0)")
    p.add_argument("--timeout", type=float,
                   help="seconds any rank waits on another before failing, once the ranks run steps (default 60; "
                        "while they start: importing torch, tracing the model, at least 300)")
    opt = p.add_argument_group("optimizer and schedule (AdamW; docs/training.md)")
    opt.add_argument("--lr", type=float, help="peak learning rate (default 1e-3)")
    opt.add_argument("--betas", type=_betas, metavar="B1,B2", help="AdamW's betas (default 0.9,0.999)")
    opt.add_argument("--eps", type=float, help="AdamW's epsilon (default 1e-8)")
    opt.add_argument("--weight-decay", type=float, metavar="WD",
                     help="decoupled weight decay of the matrices (default 0.01, torch's AdamW default); norms, biases "
                          "and other 1-D parameters are never decayed (nanoGPT, Megatron-LM)")
    opt.add_argument("--no-decay-embeddings", action="store_true", default=None,
                     help="do not decay the embeddings either (nor a head tied to them)")
    opt.add_argument("--warmup-steps", type=int, metavar="W",
                     help="linear warmup: step k < W uses lr * (k+1)/(W+1) (default 0)")
    opt.add_argument("--lr-schedule", choices=["constant", "cosine", "linear"],
                     help="after the warmup: constant (default), or a cosine or linear decay to --min-lr")
    opt.add_argument("--min-lr", type=float, help="the learning rate the decay ends at (default 0)")
    opt.add_argument("--decay-steps", type=int, metavar="D",
                     help="the step the decay reaches --min-lr at, counted from step 0 (default --steps); after it "
                          "the rate stays at --min-lr")
    p.add_argument("--eval-every", type=int, metavar="N",
                   help="every N steps, print and record the mean loss of --eval-batches batches of --eval-data "
                        "(forward only)")
    p.add_argument("--eval-data", metavar="PATH", help="evaluation data: as --data (a token file, a datasets directory "
                                                        "or FILE.py:FUNCTION, called with the batch's index)")
    p.add_argument("--eval-batches", type=int, metavar="K", help="global batches per evaluation (default 10)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here (step-N/ dirs; shared by all ranks)")
    p.add_argument("--checkpoint-every", type=int, metavar="K", help="checkpoint every K steps (and after the last; default 500 "
                   "with --checkpoint-dir)")
    p.add_argument("--resume", action="store_true", default=None,
                   help="continue from the newest good checkpoint in --checkpoint-dir (the schedule and the data "
                        "position too)")
    p.add_argument("--overwrite", action="store_true", default=None,
                   help="delete the checkpoints already in --checkpoint-dir before training (without it, or --resume, "
                        "a directory holding checkpoints is refused: one job per directory)")
    p.add_argument("--init", metavar="PATH",
                   help="start from pretrained weights: a Hugging Face directory (config.json + safetensors, one file "
                        "or shards), a torch.save state dict or an autoplan checkpoint; each rank reads only its slices "
                        "(a resumed checkpoint takes precedence)")
    p.add_argument("--clip-grad", type=float, metavar="MAX_NORM",
                   help="clip the gradients' global norm (over every rank: tp, pp, dp, shards, experts) to MAX_NORM "
                        "each step, as torch.nn.utils.clip_grad_norm_ on one process; the norm goes to --metrics "
                        "(grad_norm). Megatron-LM and torchtitan use 1.0 (default: no clipping)")
    p.add_argument("--skip-nonfinite", type=int, metavar="N",
                   help="skip the optimizer step of up to N steps whose loss or gradients are not finite (default 0: "
                        "the first such step stops the run)")
    p.add_argument("--allow-oversubscribe", action="store_true", default=None,
                   help="run even when the ranks' estimated host memory (CPU ranks, no CUDA) exceeds what is free")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("export-checkpoint", help="write a checkpoint as one torch.save file or a Hugging Face "
                                                 "directory (one process)",
                       description="Reads a checkpoint of `autoplan run --checkpoint-dir` (a step-N directory, or the "
                                   "newest complete one under DIR; torch.distributed.checkpoint format) and writes the "
                                   "full model's state dict: `model.load_state_dict(torch.load(FILE))`.")
    p.add_argument("checkpoint", help="a step-N directory or a --checkpoint-dir")
    p.add_argument("--out", required=True, metavar="FILE|DIR", help="torch.save file (or, with --format hf, directory) "
                                                                   "to write")
    p.add_argument("--format", choices=("torch", "hf"), default="torch",
                   help="torch: one torch.save file; hf: a directory transformers loads with from_pretrained "
                        "(config.json + safetensors, sharded past 5 GB with an index), for hf: models")
    p.add_argument("--everything", action="store_true",
                   help="also the optimizer state and per-rank extras (torch's dcp_to_torch_save)")
    p.set_defaults(func=cmd_export_checkpoint)

    p = sub.add_parser("calibrate", help="measure this machine's GPU (or CPU) and write a calibration file",
                       description="Times a GEMM sweep, fused attention and memory-bound kernels (and with "
                                   "--collectives all-reduce, all-gather, reduce-scatter and p2p), fits the cost "
                                   "model's numbers and writes them for `autoplan suggest --calibration FILE`.")
    p.add_argument("--out", required=True, metavar="FILE", help="calibration JSON to write")
    p.add_argument("--force", action="store_true",
                   help="overwrite --out if it exists, and write the fit even when its timings are unstable (a busy "
                        "machine: the median point's repeats disagree by more than 100%%)")
    p.add_argument("--device", choices=["cuda", "cpu"], help="what to measure (default cuda when available, else cpu)")
    p.add_argument("--gpu", help="the GPU type the numbers are for, e.g. H100-SXM-80GB (default: guessed from the "
                                 "device name; cpu for --device cpu)")
    p.add_argument("--dtype", help="GEMM dtypes, comma-separated, e.g. bf16,fp32; the first also times attention and "
                                   "memory kernels (default bf16 on cuda, float32 on cpu)")
    p.add_argument("--quick", action="store_true", help="a few small shapes (seconds; for tests and CPUs)")
    p.add_argument("--collectives", action="store_true",
                   help="also measure collective bandwidth curves (local processes, or the torchrun world)")
    p.add_argument("--nproc", type=int, help="with --collectives: local processes to spawn (default the visible GPUs, "
                                             "2 on CPU)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the collective benchmark may take (default 600)")
    p.set_defaults(func=cmd_calibrate)

    from autoplan.commands.plans import register

    register(sub, _console)
    from autoplan.commands.listing import register as register_list
    register_list(sub, _console)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        for flag in ("out", "plot"):  # an output nobody could write is refused before any work
            if flag == "out" and getattr(args, "format", None) == "hf":
                continue  # a directory: hf_export.py checks it
            if getattr(args, flag, None) is not None:
                check_output_file(f"--{flag}", getattr(args, flag))
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("autoplan: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"autoplan: error: {message}", file=sys.stderr)
        return EXIT_USAGE


# Commands that plan and print (no ranks, no checkpoints, no files left open): their process ends
# without the interpreter's teardown, which frees the ~600,000 objects torch and a traced model leave
# one by one: 0.5 s of CPU after `import torch` alone, about 1 s after a cold `suggest` (issue 29: a
# cold suggest within 1.5x of `python -c "import torch"`; benchmarks/search_speed.py --ratio-only).
FAST_EXIT_COMMANDS = frozenset({"suggest", "profile", "show", "export", "check", "list"})


def console_main() -> None:
    """The `autoplan` console script and `python -m autoplan`: `main()` on sys.argv, then exit."""
    planning = len(sys.argv) > 1 and sys.argv[1] in FAST_EXIT_COMMANDS
    if planning:
        import gc

        # torch and a traced model leave ~600,000 long-lived objects, which the default thresholds
        # (700, 10, 10) walk in a full collection every ~70,000 allocations: 5% of a cold suggest's CPU.
        # Collections stay (memory as before), 14x less often.
        gc.set_threshold(10_000, 10, 10)
    code = main()
    if planning:
        import atexit
        import contextlib
        import os

        atexit._run_exitfuncs()  # what a normal exit runs (logging, temporary directories), then no teardown
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`): nothing to write to
                stream.flush()
        os._exit(code)
    sys.exit(code)


def _json_default(obj: object) -> object:
    return str(obj)


def dump_json(data: object) -> str:
    return json.dumps(data, indent=2, default=_json_default)


if __name__ == "__main__":
    console_main()
