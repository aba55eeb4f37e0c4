"""Processor sharing: ranks that share a machine's CPU cores slow each other down.

A `cpu` cluster runs several ranks on one machine (`autoplan run --nproc 4` on a laptop). A block
timed alone with T threads takes longer when k ranks compute at the same moment on C cores: each
gets min(1, C / (k T)) of the cores it was timed with (processor sharing, Kleinrock 1967). How many
ranks compute at once depends on the schedule (ramp-up and ramp-down phases have fewer), so a single
factor is wrong both ways. Instead: simulate with the unshared times, stretch each action by the
mean concurrency over its span, and simulate again, until the step time settles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from autoplan.schedule import Action, ActionKind, Schedule, SimResult, simulate

__all__ = ["simulate_shared_cores"]


def _mean_concurrency(result: SimResult) -> dict[tuple[Action, int], float]:
    """For each action, the mean number of ranks computing during its span (itself included)."""
    timeline = result.timeline
    edges = sorted({t for a in timeline for t in (a.start_s, a.end_s)})
    if len(edges) < 2:
        return {(a.action, a.rank): 1.0 for a in timeline}
    edges_arr = np.array(edges)
    busy = np.zeros(len(edges) - 1)
    for a in timeline:
        lo, hi = np.searchsorted(edges_arr, [a.start_s, a.end_s])
        busy[lo:hi] += 1
    widths = np.diff(edges_arr)
    out = {}
    for a in timeline:
        lo, hi = np.searchsorted(edges_arr, [a.start_s, a.end_s])
        span = widths[lo:hi].sum()
        out[(a.action, a.rank)] = float((busy[lo:hi] * widths[lo:hi]).sum() / span) if span > 0 else 1.0
    return out


def simulate_shared_cores(
    schedule: Schedule,
    compute_time_s: Callable[[Action], float],
    comm_time_s: Callable[[int, int, ActionKind], float] | None,
    rank_tail_s: Sequence[float] | None,
    threads_per_rank: float,
    cores: float,
    iterations: int = 4,
) -> SimResult:
    """`simulate`, with each compute action stretched by max(1, concurrency * threads / cores)."""
    result = simulate(schedule, compute_time_s, comm_time_s, rank_tail_s)
    for _ in range(iterations):
        concurrency = _mean_concurrency(result)
        rank_of = {a.action: a.rank for a in result.timeline}

        def stretched(action: Action, concurrency=concurrency, rank_of=rank_of) -> float:
            k = concurrency.get((action, rank_of.get(action)), 1.0)
            return compute_time_s(action) * max(1.0, k * threads_per_rank / cores)

        previous = result.makespan_s
        result = simulate(schedule, stretched, comm_time_s, rank_tail_s)
        if abs(result.makespan_s - previous) <= 1e-3 * previous:
            break
    return result
