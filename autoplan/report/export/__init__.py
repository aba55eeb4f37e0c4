"""Export a plan as the configuration another trainer runs: torchtitan (a config-registry Python
file and its command line), Megatron-LM (the full argument list) and DeepSpeed (a JSON config and
the `PipelineModule` arguments).

`export_plan(plan, target)` returns an `Export` or raises `ExportError` (one line). A plan the
target cannot state exactly is refused unless `allow_approx=True` (CLI `--allow-approx`), which
writes the nearest config with every difference listed at the top of the file (common.py).
docs/export-torchtitan.md, docs/export-megatron.md and docs/export-deepspeed.md say what each
target takes and what does not translate.

Each target module also has `mismatches(config)`: the differences and refusals its `write` finds
without the stage cuts, each with the plan fields it depends on (common.py `Mismatch`), and
`autoplan suggest --target` searches only the configurations it finds none in, so what a target
cannot run is said in one place (search/targets.py [Note: searching for an export target]).
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
from autoplan.search.targets import ExportRules, check_target

__all__ = [
    "EXPORT_TARGETS",
    "Export",
    "ExportError",
    "TargetRefusal",
    "TransformerShape",
    "export_plan",
    "export_rules",
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


def export_rules(target: str) -> ExportRules:
    """What `autoplan suggest --target` asks of `target`'s exporter: its own `mismatches`, `write`
    and `placeable_cuts`, handed down to the search (search/targets.py [Note: searching for an
    export target]); an unknown name is a one-line PlanningError."""
    name = check_target(target)
    module = {"torchtitan": torchtitan, "megatron": megatron, "deepspeed": deepspeed}[name]
    return ExportRules(name, module.mismatches, module.write, ExportError, getattr(module, "placeable_cuts", None))


def export_plan(plan: Plan, target: str, *, allow_approx: bool = False, filename: str | None = None) -> Export:
    """`plan` as `target`'s configuration. Raises ExportError when the target lacks the model, or
    when it cannot state the plan exactly and `allow_approx` is False."""
    if not isinstance(plan, Plan):
        raise ExportError(f"export_plan takes a Plan (autoplan.suggest or Plan.load), not {type(plan).__name__}")
    try:
        write = EXPORT_TARGETS[target.lower()]
    except (KeyError, AttributeError):
        raise ExportError(f"unknown export target {target!r}; use one of {', '.join(EXPORT_TARGETS)}") from None
    name = target.lower()
    try:
        export = write(plan, filename=filename)
    except TargetRefusal as refusal:
        raise TargetRefusal(f"{refusal}; {_other_targets(plan, name)}") from None
    except ExportError as exc:
        if exc.dims - {"model", "job"}:  # a configuration the target refuses: another plan avoids it
            raise ExportError(f"{exc}; {_search_for(name)}", dims=exc.dims) from None
        raise
    if export.differences and not allow_approx:
        more = f" (and {len(export.differences) - 1} more)" if len(export.differences) > 1 else ""
        raise ExportError(f"{export.target} cannot run this plan as planned: {export.differences[0]}{more}; "
                          f"{_search_for(name)}, or pass --allow-approx to write the nearest config with every "
                          "difference listed")
    return export


def _search_for(target: str) -> str:
    """The advice every refusal of a plan's configuration ends with: the search that avoids it
    (search/targets.py)."""
    return f"`autoplan suggest --target {target}` searches only plans {target} runs as planned"


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
