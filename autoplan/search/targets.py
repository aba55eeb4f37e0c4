"""`autoplan suggest --target torchtitan|megatron|deepspeed`: search only the plans a trainer runs
as planned, so that `autoplan export --to` that trainer is exact.

[Note: searching for an export target]
What a target cannot run is said once, by its exporter (report/export/): each exporter's
`mismatches(config)` runs the very rules its `write` runs, minus the stage cuts, and returns every
difference or refusal with the plan fields it depends on (`Mismatch.dims`). The search asks it at
three points, cheapest first:

- a base configuration (degrees, micro-batches, schedule, rank order) with a mismatch that depends
  on none of the memory options (recompute, ZeRO / FSDP, HSDP, sequence parallelism, reduce dtype)
  is dropped before it is bounded or cut: a pin-like restriction of the space, counted under the
  "target" reason; one that depends on the model or the job alone ends the search at once, in one
  line naming it (no plan of that target can avoid it);
- a rung of the memory ladder with a mismatch is first moved to the nearest rung the target runs,
  changing only what the user did not pin and what the target's own advice names (sequence
  parallelism off, FSDP gradients reduced in bfloat16: the plan is then priced as it will run), else
  skipped (the ladder's next rung may be one the target runs);
- an assembled plan is exported, and kept only when the export is exact (`Export.differences`
  empty). Where the target cannot place the searched cuts, its own nearest cuttings
  (`placeable_cuts`: DeepSpeed's partition methods, Megatron-LM's final norm with the output layer)
  are priced in their place, and the fastest that fits and exports exactly is the plan.

So a plan `suggest --target X --out p.json` writes is one `autoplan export p.json --to X` writes
with no difference listed (tests/test_suggest_target.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from autoplan.cost.config import ParallelConfig
from autoplan.plan import Job, Plan
from autoplan.search.configs import NoPlanError, PlanningError
from autoplan.search.rejections import Rejection, Rejections

__all__ = ["TARGETS", "ExportRules", "TargetFilter", "check_target"]

TARGETS = ("torchtitan", "megatron", "deepspeed")
"""The trainers `--target` searches for, as `autoplan export --to` names them."""

RUNG_FIELDS = frozenset({"recompute", "zero", "dp_replicate", "sequence_parallel", "reduce_dtype"})
"""Fields the ladder chooses per rung (search/space.py): a mismatch naming one of them may be
avoided by another rung of the same base configuration."""
FIXED_FIELDS = frozenset({"model", "job"})
"""Fields no plan of this job chooses: a mismatch naming only these holds for every plan."""

_FIELD_WORDS = {
    "model": "the model", "job": "the job (dtype, sequence length)", "tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp",
    "ep": "ep", "expert_tp": "expert tp", "schedule": "schedule", "virtual_stages": "virtual stages",
    "num_microbatches": "micro-batch count", "micro_batch_size": "micro-batch size", "rank_order": "rank order",
    "recompute": "recompute", "zero": "zero", "dp_replicate": "HSDP", "sequence_parallel": "sequence parallelism",
    "reduce_dtype": "reduce dtype", "cuts": "stage cuts",
}


def check_target(target: str | None) -> str | None:
    """The target's name, or a one-line PlanningError naming the ones there are."""
    if target is None:
        return None
    if not isinstance(target, str) or target.lower() not in TARGETS:
        raise PlanningError(f"unknown --target {target!r}; use one of {', '.join(TARGETS)}")
    return target.lower()


@dataclasses.dataclass(frozen=True)
class ExportRules:
    """What the search asks of one trainer's exporter. The exporters (report/export/) sit on a layer
    above the search (docs/architecture.md, the import-linter contract), so the caller above both
    (autoplan/api.py, through `report.export.export_rules`) hands them down instead of the search
    importing them: the rules stay said once, by the exporter."""

    name: str
    mismatches: Callable[[Any], list]
    """The exporter's `mismatches(config)`: every difference or refusal, with the fields it depends on."""
    export: Callable[[Plan], Any]
    """Writes a plan; its result's `.differences` is empty when the export is exact."""
    refused: type[Exception]
    """What `export` raises when the target refuses the plan."""
    placeable_cuts: Callable[[Plan], Any] | None = None
    """The target's own nearest cuttings of a plan (DeepSpeed's partition methods...), or None."""


class _Probe:
    """A configuration as the exporters read a plan: its fields, plus the job, the model spec and
    the block names (what `mismatches` and `placeable_cuts` use; never the stages)."""

    def __init__(self, cfg: ParallelConfig, job: Job, model: str, block_names: tuple[str, ...]) -> None:
        self._cfg, self.job, self.model, self.block_names = cfg, job, model, block_names

    def __getattr__(self, name: str):
        return getattr(self._cfg, name)


@dataclasses.dataclass
class TargetFilter:
    """One search's view of one target ([Note: searching for an export target])."""

    rules: ExportRules
    job: Job
    model: str
    block_names: tuple[str, ...]
    pins: dict
    rejections: Rejections
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Why configurations were dropped: dims label -> count (for the no-plan line)."""
    examples: dict[str, str] = dataclasses.field(default_factory=dict)
    """dims label -> the first mismatch's text."""
    _rungs_dropped: int = 0

    @classmethod
    def make(cls, rules: ExportRules | None, profile, job: Job, model_spec: str, pins: dict,
             rejections: Rejections) -> TargetFilter | None:
        if rules is None:
            return None
        # The "target" reason beside search/rejections.py's own (its counts start at 0 for every REASON).
        rejections.counts.setdefault("target", 0)
        rejections._kept.setdefault("target", [])
        return cls(rules, job, model_spec, tuple(b.name for b in profile.blocks), pins, rejections)

    @property
    def target(self) -> str:
        return self.rules.name

    @property
    def reason(self) -> str:
        """How the summary titles what this filter dropped."""
        return f"not run by {self.target} as planned"

    def _mismatches(self, cfg: ParallelConfig) -> list:
        return _cached_mismatches(self.rules, cfg, self.job, self.model, self.block_names)

    def _record(self, mismatch) -> None:
        label = _dims_label(mismatch.dims)
        self.dropped[label] += 1
        self.examples.setdefault(label, mismatch.text)

    # ---- base configurations -------------------------------------------------------------------

    def drops_base(self, cfg: ParallelConfig, rank: float, result_so_far) -> bool:
        """Whether no rung of base configuration `cfg` can be run as planned (then counted); raises
        NoPlanError when what the target refuses is the model or the job itself."""
        for mismatch in self._mismatches(cfg):
            if mismatch.dims & RUNG_FIELDS:
                continue
            if mismatch.dims <= FIXED_FIELDS:
                raise NoPlanError(self._unavoidable(mismatch), result_so_far())
            self._record(mismatch)
            self._reject(cfg, rank, mismatch.text)
            return True
        return False

    def _reject(self, cfg: ParallelConfig, rank: float, why: str) -> None:
        from autoplan.search.configs import config_pins

        # The rejection's key: every layout field (a new one enters by itself) and the micro-batching.
        key = (cfg.micro_batch_size, cfg.schedule, *cfg.layout_key(("rank_order",)))
        self.rejections.add("target", rank, key, functools.partial(
            Rejection, "target", cfg.describe(), f"{self.target}: {why}", pins=config_pins(cfg)))

    def _unavoidable(self, mismatch) -> str:
        fix = ("choose another --target" if mismatch.error is not None else
               "choose another --target, or plan without --target and export with --allow-approx")
        return (f"no plan of {self.model} runs on {self.target} as planned: {mismatch.text} (it depends on "
                f"{_dims_label(mismatch.dims)}, which no plan of this job changes); {fix}")

    # ---- rungs ---------------------------------------------------------------------------------

    def adjust(self, variant: ParallelConfig) -> ParallelConfig | None:
        """`variant`, or the nearest rung the target runs (only unpinned sequence parallelism or
        reduce dtype changed), or None when neither is."""
        found = self._mismatches(variant)
        if not found:
            return variant
        for change in self._changes(variant, found):
            if not self._mismatches(change):
                return change
        self._record(found[0])
        self._rungs_dropped += 1
        return None

    def _changes(self, cfg: ParallelConfig, found: list) -> list[ParallelConfig]:
        named = frozenset().union(*(m.dims for m in found))
        out = []
        if "sequence_parallel" in named and self.pins.get("sequence_parallel") is None and cfg.sequence_parallel:
            out.append(dataclasses.replace(cfg, sequence_parallel=False))
        if "reduce_dtype" in named and "reduce_dtype" not in self.pins and cfg.zero >= 2:
            other = "bfloat16" if cfg.reduce_dtype == "float32" else "float32"
            out += [dataclasses.replace(c, reduce_dtype=other) for c in [cfg, *out]]
        return out

    def outcome(self, outcome: str | None, cfg: ParallelConfig, rank: float) -> str | None:
        """The ladder's outcome for a base configuration, "target" when the target dropped rungs and
        nothing else kept a plan from it (counted; kept with --explain)."""
        dropped, self._rungs_dropped = self._rungs_dropped, 0
        if outcome in (None, "bound") or not dropped:
            return outcome
        if self.rejections.detailed:
            label = self.dropped.most_common(1)[0][0]
            self._reject(cfg, rank, self.examples[label])
        return "target"

    # ---- plans ---------------------------------------------------------------------------------

    def accept(self, ctx, result):
        """`result` (an Evaluation) when its plan exports exactly; else the fastest of the target's
        own cuttings (`placeable_cuts`) that fits and exports exactly, as an Evaluation; else None."""
        from autoplan.search.evaluate import Evaluation, evaluate_cuts

        why = self.exact(result.plan)
        if why is None:
            return result
        placeable = self.rules.placeable_cuts
        best = None
        for cuts in placeable(result.plan) if placeable is not None and result.plan.pp > 1 else []:
            if list(cuts) == list(result.plan.boundaries) or len(cuts) != len(result.plan.boundaries):
                continue
            plan = evaluate_cuts(ctx, result.config, cuts)
            if not plan.fits or self.exact(plan) is not None:
                continue
            if best is None or plan.predicted.step_time_s < best.predicted.step_time_s:
                best = plan
        if best is not None:
            return Evaluation(result.config, best)
        self.dropped[_dims_label(frozenset({"cuts"}))] += 1
        self.examples.setdefault(_dims_label(frozenset({"cuts"})), why)
        self._rungs_dropped += 1
        return None

    def exact(self, plan: Plan) -> str | None:
        """None when `autoplan export --to target` writes `plan` with no difference, else the first
        difference (or the refusal)."""
        try:
            export = self.rules.export(plan)
        except self.rules.refused as exc:
            return str(exc)
        return export.differences[0] if export.differences else None

    # ---- nothing left ----------------------------------------------------------------------------

    def no_plan_message(self) -> str | None:
        """When the target dropped configurations and none gave a plan: one line naming what it
        refused most often (the dimension no plan of this target avoided), else None."""
        if not self.dropped:
            return None
        label, count = self.dropped.most_common(1)[0]
        total = sum(self.dropped.values())
        return (f"no plan runs on {self.target} as planned: {total:,} configurations or plans were dropped, "
                f"{count:,} of them for {label} ({self.examples[label]}); `autoplan suggest` without --target "
                f"finds the fastest plans, and `autoplan export --allow-approx` writes one with the differences")


def _dims_label(dims: frozenset[str]) -> str:
    return " x ".join(_FIELD_WORDS.get(d, d) for d in sorted(dims, key=lambda d: list(_FIELD_WORDS).index(d)
                                                               if d in _FIELD_WORDS else 99))


@functools.lru_cache(maxsize=4096)
def _cached_mismatches(rules: ExportRules, cfg: ParallelConfig, job: Job, model: str,
                       block_names: tuple[str, ...]) -> list:
    # ParallelConfig and Job are frozen dataclasses, so a configuration's answer is reused by value.
    return rules.mismatches(_Probe(cfg, job, model, block_names))
