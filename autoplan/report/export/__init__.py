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
    TargetRefusal,
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
    "TargetRefusal",
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
    try:
        export = write(plan, filename=filename)
    except TargetRefusal as refusal:
        raise TargetRefusal(f"{refusal}; {_other_targets(plan, target.lower())}") from None
    if export.differences and not allow_approx:
        more = f" (and {len(export.differences) - 1} more)" if len(export.differences) > 1 else ""
        raise ExportError(f"{export.target} cannot run this plan as planned: {export.differences[0]}{more}; "
                          "re-plan with pins the target runs, or pass --allow-approx to write the nearest "
                          "config with every difference listed")
    return export


def _other_targets(plan: Plan, refused: str) -> str:
    """Which other targets write `plan`, found by writing it with each (a target's write is pure and
    fast), so the advice names only targets that take this very plan: exactly, or with --allow-approx
    and its differences; or that none does."""
    exact, approximate, refusals = [], [], []
    for name, write in EXPORT_TARGETS.items():
        if name == refused:
            continue
        try:
            export = write(plan)
        except ExportError as exc:
            refusals.append(f"{name}: {str(exc).split(';')[0]}")
            continue
        if export.differences:
            more = f" and {len(export.differences) - 1} more" if len(export.differences) > 1 else ""
            approximate.append(f"--to {name} --allow-approx (it differs: {export.differences[0]}{more})")
        else:
            exact.append(f"--to {name}")
    if exact:
        return f"export it with {' or '.join(exact)}, which " + ("runs" if len(exact) == 1 else "run") + " it as planned"
    if approximate:
        return "no other target runs it exactly; the nearest: " + "; or ".join(approximate)
    return f"no export target runs this plan ({'; '.join(refusals)}); re-plan it for the target you want"
