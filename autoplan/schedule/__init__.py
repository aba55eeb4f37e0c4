"""Pipeline schedules as data (actions.py) and their event simulation (simulate.py)."""

from __future__ import annotations

from autoplan.schedule.actions import (
    SCHEDULES,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    compute_deps,
    make_schedule,
    validate,
)
from autoplan.schedule.simulate import ActionTiming, SimResult, simulate
from autoplan.schedule.specs import SCHEDULE_SPECS, ScheduleSpec, TargetSchedule, schedule_spec

__all__ = [
    "SCHEDULES",
    "SCHEDULE_SPECS",
    "Action",
    "ActionKind",
    "ActionTiming",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "SimResult",
    "TargetSchedule",
    "compute_deps",
    "make_schedule",
    "schedule_spec",
    "simulate",
    "validate",
]
