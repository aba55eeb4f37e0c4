"""What each pipeline schedule is, as data: one `ScheduleSpec` per name of `SCHEDULES`.

The search, its bounds, the memory count, the runtime and the exports ask a schedule's spec (does it
split the backward, is it looped, which micro-batches does a stage hold, can FSDP run it, what does
each export target call it) instead of comparing its name, so a schedule added to actions.py is
declared here once, every export target included (tests/test_schedule_specs.py fails until it is).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from autoplan.schedule.actions import SCHEDULES

__all__ = ["EXPORTED_TO", "SCHEDULE_SPECS", "ScheduleSpec", "TargetSchedule", "schedule_spec"]

EXPORTED_TO = ("megatron", "torchtitan", "deepspeed")
"""The export targets (report/export `EXPORT_TARGETS`) every spec names its schedule for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetSchedule:
    """What one export target runs for a schedule."""

    name: str
    """The target's schedule with one stage per rank."""
    looped_name: str | None = None
    """Its schedule with several stages per rank; None: the same as `name`."""
    difference: str | None = None
    """None where the target runs the schedule as planned; else the line the export lists at its top,
    what the target runs instead and how that moves the prediction (`{name}` is the target's name)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    name: str
    split_backward: bool
    """The backward runs as two actions, input gradients (B) and then weight gradients (W), so no
    backward of the last micro-batch trails the last rank's work and the bubble is about a third of
    1F1B's (zero-bubble H1, Qi et al. 2024, Sec. 3.1 and Table 2)."""
    looped: bool
    """Several model chunks per pipeline rank (virtual stages >= 2) and micro-batches a multiple of pp
    (Megatron-LM's interleaved schedule, Narayanan et al. 2021, Sec. 2.2.2)."""
    held: str
    """The micro-batches stage s of p holds at its peak, of m (search/inflight.py): "all" (m, GPipe,
    Huang et al. 2019), "depth" (p - s, 1F1B, Narayanan et al. 2021, Sec. 2.2.1), "pipeline" (p,
    ZB-H1 until its W passes, Qi et al. 2024, Sec. 3.1), "interleaved" (a scan of Megatron-LM's
    interleaved action order), or "simulate" (the schedule simulated at unit times)."""
    runs_fsdp: bool
    """Whether FSDP (zero 2 / 3) can run it: ZB-H1's weight-gradient pass runs outside autograd, where
    FSDP's gradient hooks do not see it (runtime/parallel/fsdp.py `check_sharding`)."""
    exports: Mapping[str, TargetSchedule] = field(default_factory=dict)
    """Per export target of `EXPORTED_TO`: what it runs."""


_MEGATRON_1F1B = "schedules.py forward_backward_pipelining_without_interleaving"

SCHEDULE_SPECS: Mapping[str, ScheduleSpec] = MappingProxyType({
    "gpipe": ScheduleSpec(
        name="gpipe", split_backward=False, looped=False, held="all", runs_fsdp=True, exports={
            "megatron": TargetSchedule(name="1F1B", difference=(
                "schedule gpipe: Megatron-LM has no all-forward-all-backward pipeline schedule; it runs 1F1B "
                f"({_MEGATRON_1F1B}), which has the same bubble but holds at most pp micro-batches of "
                "activations, so peak memory is lower than predicted")),
            # torch.distributed.pipelining schedules.py get_schedule_class names (torchtitan passes
            # parallelism.pipeline_parallel_schedule to it in pipeline_parallel.py).
            "torchtitan": TargetSchedule(name="GPipe", looped_name="LoopedBFS"),  # GPipe order over several stages
            "deepspeed": TargetSchedule(name="TrainSchedule", difference=(
                "gpipe: DeepSpeed's PipelineEngine runs its 1F1B TrainSchedule instead, same bubble with fewer "
                "micro-batches' activations held, so memory is lower than predicted")),
        }),
    "1f1b": ScheduleSpec(
        name="1f1b", split_backward=False, looped=False, held="depth", runs_fsdp=True, exports={
            "megatron": TargetSchedule(name="1F1B"),
            "torchtitan": TargetSchedule(name="1F1B"),
            "deepspeed": TargetSchedule(name="TrainSchedule"),
        }),
    "interleaved-1f1b": ScheduleSpec(
        name="interleaved-1f1b", split_backward=False, looped=True, held="interleaved", runs_fsdp=True, exports={
            "megatron": TargetSchedule(name="1F1B", looped_name="interleaved"),
            # One stage per rank: interleaving has nothing to interleave.
            "torchtitan": TargetSchedule(name="1F1B", looped_name="Interleaved1F1B"),
            "deepspeed": TargetSchedule(name="TrainSchedule"),
        }),
    "zb-h1": ScheduleSpec(
        name="zb-h1", split_backward=True, looped=False, held="pipeline", runs_fsdp=False, exports={
            "megatron": TargetSchedule(name="1F1B", difference=(
                "schedule zb-h1: megatron-core 0.16.1 has no zero-bubble pipeline schedule (no split of the "
                "backward into input and weight gradients in schedules.py); it runs 1F1B, so the pipeline bubble "
                "is larger and the step slower than predicted")),
            # torch.distributed.pipelining has zero-bubble schedules only for several stages per rank
            # (InterleavedZeroBubble, ZBVZeroBubble), so a one-stage-per-rank ZB-H1 runs as 1F1B.
            "torchtitan": TargetSchedule(name="1F1B", looped_name="Interleaved1F1B", difference=(
                "the plan's zb-h1 schedule (split backward, Qi et al. 2023) has no one-stage-per-rank schedule in "
                "torch.distributed.pipelining; written as {name}, whose larger bubble makes steps slower than "
                "predicted")),
            "deepspeed": TargetSchedule(name="TrainSchedule", difference=(
                "zb-h1: DeepSpeed's PipelineEngine has no zero-bubble schedule (it does not split the backward into "
                "input and weight gradients) and runs its 1F1B TrainSchedule, so the bubble is larger than "
                "predicted")),
        }),
})
assert tuple(SCHEDULE_SPECS) == SCHEDULES, "every schedule of actions.py has its spec here, in the same order"


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule `name` (one of `SCHEDULES`); ValueError names the known ones."""
    try:
        return SCHEDULE_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}") from None
