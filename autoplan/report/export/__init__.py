"""Export a plan as the configuration another trainer runs: torchtitan (a config-registry Python
file and its command line), Megatron-LM (the full argument list) and DeepSpeed (a JSON config and
the `PipelineModule` arguments).

`export_plan(plan, target)` returns an `Export` or raises `ExportError` (one line). A plan the
target cannot state exactly is refused unless `allow_approx=True` (CLI `--allow-approx`), which
writes the nearest config with every difference listed at the top of the file (common.py).
docs/export-torchtitan.md, docs/export-megatron.md and docs/export-deepspeed.md say what each
target takes and what does not translate.
"""

from __future__ import annotations

from collections.abc import Callable

from autoplan.plan import Plan
from autoplan.report.export import deepspeed, megatron, torchtitan
from autoplan.report.export.common import (
    Export,
    ExportError,
    TransformerShape,
    model_shape,
    stage_blocks,
    stage_layer_counts,
    stage_layer_ranges,
)

__all__ = [
    "EXPORT_TARGETS",
    "Export",
    "ExportError",
    "TransformerShape",
    "export_plan",
    "model_shape",
    "stage_blocks",
    "stage_layer_counts",
    "stage_layer_ranges",
]

EXPORT_TARGETS: dict[str, Callable[..., Export]] = {
    "torchtitan": torchtitan.write,
    "megatron": megatron.write,
    "deepspeed": deepspeed.write,
}
"""Target name -> `write(plan, *, filename=None) -> Export`. `filename` is where the file will be
written (torchtitan imports it as a module, so its command line names the file's stem)."""


def export_plan(plan: Plan, target: str, *, allow_approx: bool = False, filename: str | None = None) -> Export:
    """`plan` as `target`'s configuration. Raises ExportError when the target lacks the model, or
    when it cannot state the plan exactly and `allow_approx` is False."""
    if not isinstance(plan, Plan):
        raise ExportError(f"export_plan takes a Plan (autoplan.suggest or Plan.load), not {type(plan).__name__}")
    try:
        write = EXPORT_TARGETS[target.lower()]
    except (KeyError, AttributeError):
        raise ExportError(f"unknown export target {target!r}; use one of {', '.join(EXPORT_TARGETS)}") from None
    export = write(plan, filename=filename)
    if export.differences and not allow_approx:
        more = f" (and {len(export.differences) - 1} more)" if len(export.differences) > 1 else ""
        raise ExportError(f"{export.target} cannot run this plan as planned: {export.differences[0]}{more}; "
                          "re-plan with pins the target runs, or pass --allow-approx to write the nearest "
                          "config with every difference listed")
    return export
