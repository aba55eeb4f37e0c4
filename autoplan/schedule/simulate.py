"""Event simulation of a schedule: makespan, per-rank busy/idle time, bubble, in-flight activations.

Semantics: each rank runs its compute actions strictly in list order; an action starts at
``max(rank free, end of each dependency + P2P time when the dependency is on another rank)``.
Dependencies are those of `compute_deps` (F(s) on F(s-1); B(s) on B(s+1), or on F(s) at the last
stage, and on F(s); W(s) on B(s)). Communication is asynchronous: it delays the consumer but does
not occupy either rank's compute. Ranks are advanced with a work list (a blocked rank is parked on
the one action it waits for and woken when that action is placed), so the cost is O(number of
actions) plus one ``compute_time_s`` call per action.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autoplan.schedule.actions import Action, ActionKind, Schedule, ScheduleError

__all__ = ["ActionTiming", "SimResult", "simulate"]


@dataclass(frozen=True)
class ActionTiming:
    """When ``action`` ran on ``rank``."""

    action: Action
    rank: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated step looks like.

    ``bubble_fraction`` is the pipeline bubble of the compute phase alone: with ``T`` the span
    from the earliest compute start to the latest compute end over all ranks (tails excluded),
    ``bubble_fraction = sum_r (T - busy_s[r]) / (num_ranks * T)``, i.e. the share of the ranks'
    time inside the pipelined phase spent idle (warm-up, cool-down and any stall). With equal
    stages and free communication, 1F1B and GPipe give (p - 1)/(m + p - 1) (Narayanan et al.
    SC'21 Sec 2.2, Huang et al. 2019 Sec 2.3).
    """

    makespan_s: float
    """max over ranks of (end of the rank's last compute action + its tail)."""
    busy_s: tuple[float, ...]
    """Per rank: total compute time."""
    idle_s: tuple[float, ...]
    """Per rank: makespan_s - busy_s (includes the tails and the wait for the slowest rank)."""
    bubble_fraction: float
    peak_inflight: tuple[int, ...]
    """Per stage: max micro-batches whose forward ran and whose activations are still held
    (released by B, or by W when the backward is split, since W still reads them)."""
    compute_end_s: tuple[float, ...]
    """Per rank: end of its last compute action."""
    tail_s: tuple[float, ...]
    """Per rank: the ``rank_tail_s`` the simulation was given (zeros if none)."""
    _raw_timeline: tuple = field(default=(), repr=False, compare=False)
    # (per-rank compute actions, per-rank start times, per-rank end times). ActionTiming objects
    # are built only when `timeline` is read: building them eagerly would double the cost of
    # simulate(), which the search calls thousands of times and which only needs the totals.

    @functools.cached_property
    def timeline(self) -> tuple[ActionTiming, ...]:
        """Every compute action, rank by rank in execution order (not sorted by time)."""
        if not self._raw_timeline:
            return ()
        actions, starts, ends = self._raw_timeline
        return tuple(
            ActionTiming(a, r, st, en)
            for r in range(len(actions))
            for a, st, en in zip(actions[r], starts[r], ends[r])
        )

    def rank_end_s(self) -> tuple[float, ...]:
        """Per rank: when the rank finishes its step (last compute end plus its tail)."""
        return tuple(e + t for e, t in zip(self.compute_end_s, self.tail_s))


@dataclass(frozen=True)
class _Compiled:
    """Schedule-only data the simulation needs, computed once per schedule."""

    # Per rank: (action, key of its own end time, dep key, dep delay slot, dep key, dep delay slot).
    # Keys index a flat end-time list; key ``num_keys`` is a sentinel always finished at 0.
    ops: tuple[tuple[tuple[Action, int, int, int, int, int], ...], ...]
    num_keys: int
    cross_f_stages: tuple[int, ...]  # stages s >= 1 whose F input comes from another rank
    cross_b_stages: tuple[int, ...]  # stages s whose B input (from s + 1) comes from another rank
    peak_inflight: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]


# Small: a compiled 64-rank x 256-micro-batch schedule is a few MB, and a search reuses few shapes.
@functools.lru_cache(maxsize=32)
def _compile(schedule: Schedule) -> _Compiled:
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    last = num_stages - 1
    num_keys = 3 * num_stages * num_mb
    none = num_keys

    # Key of (kind, stage, mb) = (kind_index * num_stages + stage) * num_mb + mb, so the B key is
    # the F key + sm, the W key the F key + 2 sm, and stage s +- 1 is +- num_mb.
    sm = num_stages * num_mb
    # Under looped placement neighbouring stages share a rank only when there is one rank.
    cross = schedule.num_ranks > 1
    F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
    # Delay slots: 0 = no delay; 1 + s = F transfer into stage s; 1 + num_stages + s = B into s.
    ops = []
    for rank_actions in schedule.actions:
        rank_ops = []
        for a in rank_actions:
            kind, s, mb = a
            if not (0 <= s < num_stages and 0 <= mb < num_mb) or kind not in (F, B, W):
                raise ScheduleError(
                    f"cannot simulate {a} (num_stages={num_stages}, num_microbatches={num_mb})"
                )
            f_key = s * num_mb + mb
            if kind is F:
                if s == 0:
                    rank_ops.append((a, f_key, none, 0, none, 0))
                else:
                    rank_ops.append((a, f_key, f_key - num_mb, (1 + s) if cross else 0, none, 0))
            elif kind is B:
                if s == last:
                    rank_ops.append((a, f_key + sm, f_key, 0, none, 0))
                else:
                    slot = (1 + num_stages + s) if cross else 0
                    rank_ops.append((a, f_key + sm, f_key + sm + num_mb, slot, f_key, 0))
            else:
                rank_ops.append((a, f_key + 2 * sm, f_key + sm, 0, none, 0))
        ops.append(tuple(rank_ops))

    split = schedule.split_backward()
    release = ActionKind.W if split else ActionKind.B
    peak = [0] * num_stages
    inflight = [0] * num_stages
    for rank_actions in schedule.actions:
        # A stage's actions all run on one rank in list order, so the running count in list order
        # is the count over time.
        for a in rank_actions:
            if a.kind is ActionKind.F:
                inflight[a.stage] += 1
                if inflight[a.stage] > peak[a.stage]:
                    peak[a.stage] = inflight[a.stage]
            elif a.kind is release:
                inflight[a.stage] -= 1
    return _Compiled(
        ops=tuple(ops),
        num_keys=num_keys,
        cross_f_stages=tuple(range(1, num_stages)) if cross else (),
        cross_b_stages=tuple(range(last)) if cross else (),
        peak_inflight=tuple(peak),
        actions=schedule.actions,
    )


def simulate(
    schedule: Schedule,
    compute_time_s: Callable[[Action], float],
    comm_time_s: Callable[[int, int, ActionKind], float] | None = None,
    rank_tail_s: Sequence[float] | None = None,
) -> SimResult:
    """Simulate one step of ``schedule``.

    ``compute_time_s(action)``: seconds of an F, B or W action. ``comm_time_s(src_stage,
    dst_stage, kind)``: seconds to move the tensor of ``kind`` (F: activation, B: gradient) from
    ``src_stage`` to ``dst_stage``; asked only for stages on different ranks (once per stage
    pair); None means free. ``rank_tail_s[r]``: work after rank r's last compute action that does
    not overlap it (non-overlapped DP gradient reduction, optimizer step); the makespan is the
    max over ranks of compute end plus tail. All times must be >= 0. Raises `ScheduleError`
    (with the grid) on deadlock.
    """
    compiled = _compile(schedule)
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    if rank_tail_s is None:
        tails = (0.0,) * num_ranks
    else:
        tails = tuple(float(t) for t in rank_tail_s)
        if len(tails) != num_ranks:
            raise ValueError(f"rank_tail_s has {len(tails)} entries for num_ranks={num_ranks}")

    delays = [0.0] * (1 + 2 * num_stages)
    if comm_time_s is not None:
        for s in compiled.cross_f_stages:
            delays[1 + s] = float(comm_time_s(s - 1, s, ActionKind.F))
        for s in compiled.cross_b_stages:
            delays[1 + num_stages + s] = float(comm_time_s(s + 1, s, ActionKind.B))

    num_keys = compiled.num_keys
    ends = [-1.0] * num_keys + [0.0]  # -1: not placed yet; last slot: "no dependency"
    waiters: list[list[int] | None] = [None] * (num_keys + 1)
    rank_ops = compiled.ops
    ptr = [0] * num_ranks
    free = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    first_start = [-1.0] * num_ranks
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    end_lists: list[list[float]] = [[] for _ in range(num_ranks)]

    work = list(range(num_ranks - 1, -1, -1))
    while work:
        rank = work.pop()
        ops = rank_ops[rank]
        i, n, t = ptr[rank], len(ops), free[rank]
        rank_starts, rank_ends = starts[rank], end_lists[rank]
        rank_busy = 0.0
        while i < n:
            action, own, dep1, slot1, dep2, slot2 = ops[i]
            e1 = ends[dep1]
            if e1 < 0.0:
                w = waiters[dep1]
                if w is None:
                    waiters[dep1] = [rank]
                else:
                    w.append(rank)
                break
            e2 = ends[dep2]
            if e2 < 0.0:
                w = waiters[dep2]
                if w is None:
                    waiters[dep2] = [rank]
                else:
                    w.append(rank)
                break
            start = e1 + delays[slot1]
            e2 += delays[slot2]
            if e2 > start:
                start = e2
            if t > start:
                start = t
            dur = compute_time_s(action)
            t = start + dur
            ends[own] = t
            rank_starts.append(start)
            rank_ends.append(t)
            rank_busy += dur
            w = waiters[own]
            if w is not None:
                work.extend(w)
                waiters[own] = None
            i += 1
        ptr[rank] = i
        free[rank] = t
        busy[rank] += rank_busy

    stuck = {r: ptr[r] for r in range(num_ranks) if ptr[r] < len(rank_ops[r])}
    if stuck:
        raise ScheduleError(
            "deadlock in simulation: "
            + ", ".join(f"rank {r} waits at step {i} ({rank_ops[r][i][0]})" for r, i in stuck.items())
            + "\n"
            + schedule.format_grid(stuck)
        )

    for r in range(num_ranks):
        if starts[r]:
            first_start[r] = starts[r][0]
    compute_end = tuple(free)
    makespan = max(e + tail for e, tail in zip(compute_end, tails))
    active = [r for r in range(num_ranks) if starts[r]]
    span = max(compute_end[r] for r in active) - min(first_start[r] for r in active) if active else 0.0
    bubble = 1.0 - sum(busy) / (num_ranks * span) if span > 0.0 else 0.0
    return SimResult(
        makespan_s=makespan,
        busy_s=tuple(busy),
        idle_s=tuple(makespan - b for b in busy),
        bubble_fraction=bubble,
        peak_inflight=compiled.peak_inflight,
        compute_end_s=compute_end,
        tail_s=tails,
        _raw_timeline=(compiled.actions, starts, end_lists),
    )
