"""Which plan a trace was measured on: the fingerprint and one-line summary `autoplan run --trace`
records of its plan, and the check that refuses a trace of another plan before it is compared.

Apart from reading the trace (report/timeline/measured.py): this is the guard `autoplan show --trace`
runs first (issue 29), and the runtime's trace writer records what it checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoplan.plan import Plan
from autoplan.report.timeline.model import TimelineError
from autoplan.schedule import Action, ActionKind, make_schedule

__all__ = ["check_trace_matches", "plan_fingerprint", "plan_summary", "trace_metadata"]

def plan_fingerprint(plan: Plan) -> str:
    """The plan's run fingerprint (`Plan.run_fingerprint`), which `autoplan run --trace` records."""
    return plan.run_fingerprint


def plan_summary(plan: Plan) -> str:
    """One line naming a plan: model, degrees, schedule, micro-batches."""
    return (f"{plan.model}: {_layout(plan)}, {plan.schedule}"
            + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
            + f", {plan.num_microbatches} micro-batch{'es' if plan.num_microbatches != 1 else ''} "
              f"of {plan.micro_batch_size}")


def trace_metadata(plan: Plan) -> dict[str, Any]:
    """What `autoplan run --trace` records of its plan, under the trace's "otherData" (the Chrome
    trace format's free-form object), so `autoplan show` can tell whether a trace is the plan's."""
    return {"autoplan_plan_fingerprint": plan_fingerprint(plan), "autoplan_plan": plan_summary(plan),
            "num_ranks": plan.num_gpus}


def check_trace_matches(trace: Mapping[str, Any], plan: Plan, *, trace_name: str = "the trace",
                        plan_name: str = "the plan") -> None:
    """Refuse (TimelineError, one line) a trace measured on another plan.

    A trace with `trace_metadata` compares fingerprints. One without it (written before the
    runtime recorded them) is compared by what it shows: its ranks must be the plan's GPUs, and
    the compute actions of each pipeline rank of the (dp 0, tp 0) replica must be that rank's
    actions in the plan's schedule (stages, micro-batches and their order).
    """
    other = trace.get("otherData")
    recorded = other.get("autoplan_plan_fingerprint") if isinstance(other, Mapping) else None
    fix = f"show it with the plan it was measured on, or measure this one: `autoplan run {plan_name} --trace FILE`"
    if recorded is not None:
        if str(recorded) != plan_fingerprint(plan):
            theirs = other.get("autoplan_plan") or f"plan {recorded}"
            raise TimelineError(f"{trace_name} was measured on another plan ({theirs}), not {plan_name} "
                                f"({plan_summary(plan)}); {fix}")
        return
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, Mapping) and e.get("ph") == "X"]
    actions: dict[int, dict[Any, list[str]]] = {}
    for e in events:
        name = str(e.get("name", ""))
        try:
            action = Action.parse(name)
            pid = int(e["pid"])
        except (KeyError, TypeError, ValueError):
            continue
        if action.kind in (ActionKind.F, ActionKind.B, ActionKind.W):
            step = e.get("args", {}).get("step", 0) if isinstance(e.get("args"), Mapping) else 0
            actions.setdefault(pid, {}).setdefault(step, []).append((float(e.get("ts", 0.0)), name))
    if not actions:
        return  # measured_timeline says what is missing
    pids = sorted(actions)
    problem = None
    if pids[-1] >= plan.num_gpus or len(pids) != plan.num_gpus:
        problem = f"it has {len(pids)} rank{'s' if len(pids) != 1 else ''}, the plan {plan.num_gpus}"
    else:
        schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
        compute = (ActionKind.F, ActionKind.B, ActionKind.W)
        for pid in pids:
            pp_index = plan.coords(pid)[0]
            expected = [str(a) for a in schedule.actions[pp_index] if a.kind in compute]
            for timed in actions[pid].values():
                got = [name for _, name in sorted(timed)]
                if sorted(got) != sorted(expected):
                    problem = (f"rank {pid} ran {len(got)} compute actions ({', '.join(got[:4])}"
                               f"{', ...' if len(got) > 4 else ''}) where the plan's pipeline rank {pp_index} has "
                               f"{len(expected)} ({', '.join(expected[:4])}{', ...' if len(expected) > 4 else ''})")
                    break
            if problem:
                break
    if problem:
        raise TimelineError(f"{trace_name} was measured on another plan, not {plan_name} ({plan_summary(plan)}): "
                            f"{problem}; {fix}")


def _layout(plan: Plan) -> str:
    # dp as the plan means it: dp counts the cp ranks of a replica (plan.py), so show replicas and cp.
    if plan.cp > 1:
        return f"tp {plan.tp} / pp {plan.pp} / dp {plan.dp // plan.cp} / cp {plan.cp}"
    return f"tp {plan.tp} / pp {plan.pp} / dp {plan.dp}"
