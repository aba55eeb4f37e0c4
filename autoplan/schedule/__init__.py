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

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "ActionTiming",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "compute_deps",
    "make_schedule",
    "simulate",
    "validate",
]
