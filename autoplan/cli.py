"""`autoplan` console script: thin argument parsing over `autoplan.api`.

Every user mistake (bad spec, bad cluster, impossible pin, missing file) ends as one line on
stderr and exit code 2; nothing here computes anything itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console

from autoplan import __version__

__all__ = ["main"]

EXIT_USAGE = 2


def _console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


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
                   help="model spec: NAME[:key=value,...] (gpt, llama or a preset such as llama3-8b) or path/to/file.py:function")
    p.add_argument("--leaf-modules", default="", help="comma-separated module paths that become blocks, e.g. 'layers.*.attention,layers.*.mlp'")
    p.add_argument("--tracer", default="auto", choices=["auto", "fx", "export", "modules"], help="force a tracer (default: try fx, export, module boundaries)")
    p.add_argument("--dtype", default="bf16", help="compute dtype of activations and weights: bf16, fp16 or fp32 (default bf16)")


def cmd_profile(args: argparse.Namespace) -> int:
    from autoplan import api
    from autoplan.report.tables import profile_table

    progress, callback = _progress_callback(not args.json and sys.stderr.isatty())
    leaf = [s for s in args.leaf_modules.split(",") if s]
    if progress is not None:
        progress.start()
    try:
        result = api.profile_with_graph(args.model, batch_size=args.batch, seq_len=args.seq_len, dtype=args.dtype,
                                        device=args.device, leaf_modules=leaf, tracer=args.tracer,
                                        progress=callback)
    finally:
        if progress is not None:
            progress.stop()
    if args.json:
        print(result.profile.to_json())
        return 0
    console = _console()
    console.print(f"[dim]{result.traced.note}[/dim]")
    console.print(profile_table(result.profile))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoplan", description="Plan and run pipeline/tensor/data-parallel training of PyTorch models.")
    parser.add_argument("--version", action="version", version=f"autoplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("profile", help="trace a model and print what each block costs")
    _add_model_args(p, default_model=None)
    p.add_argument("--batch", type=int, default=1, help="micro-batch size to profile at (default 1)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's max_seq_len)")
    p.add_argument("--device", default="meta", help="meta (analytic, no memory), cpu or cuda (time every block)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("autoplan: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"autoplan: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _json_default(obj: object) -> object:
    return str(obj)


def dump_json(data: object) -> str:
    return json.dumps(data, indent=2, default=_json_default)


if __name__ == "__main__":
    sys.exit(main())
