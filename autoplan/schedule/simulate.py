"""Event simulation of a schedule: makespan, per-rank busy/idle time, bubble, in-flight activations.

Semantics: each rank runs its compute actions strictly in list order; an action starts at
``max(rank free, end of each dependency + P2P time when the dependency is on another rank)``.
Dependencies are those of `compute_deps` (F(s) on F(s-1); B(s) on B(s+1), or on F(s) at the last
stage, and on F(s); W(s) on B(s)). Communication is asynchronous: it delays the consumer but does
not occupy either rank's compute. Ranks are advanced with a work list (a blocked rank is parked on
the one action it waits for and woken when that action is placed). Which action waits for which
does not depend on the durations, so the work list's order is found once per schedule (`_walk`)
and each simulation replays it: O(number of actions), with one ``compute_time_s`` call per action,
or none when the durations come as a per-stage table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

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
        raw = self._raw_timeline
        actions, starts, ends = raw.materialize() if isinstance(raw, _LazyTimeline) else raw
        return tuple(
            ActionTiming(a, r, st, en)
            for r in range(len(actions))
            for a, st, en in zip(actions[r], starts[r], ends[r])
        )

    def rank_end_s(self) -> tuple[float, ...]:
        """Per rank: when the rank finishes its step (last compute end plus its tail)."""
        return tuple(e + t for e, t in zip(self.compute_end_s, self.tail_s))


@dataclass(frozen=True, eq=False)
class _Compiled:
    """Schedule-only data the simulation needs, computed once per schedule."""

    # Per rank, per action: (key of its own end time, dep key, dep delay slot, dep key, dep delay
    # slot, index of its duration in a flat (kind, stage) table: F of stage s at s, B at
    # num_stages + s, W at 2 num_stages + s). Keys index a flat end-time list; key ``num_keys`` is a
    # sentinel always finished at 0.
    ops: tuple[tuple[tuple[int, int, int, int, int, int], ...], ...]
    num_keys: int
    cross_f_stages: tuple[int, ...]  # stages s >= 1 whose F input comes from another rank
    cross_b_stages: tuple[int, ...]  # stages s whose B input (from s + 1) comes from another rank
    peak_inflight: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    runs: tuple[tuple[int, int, int], ...]
    """The work-list walk (see `_walk`) as (rank, first op, end op) runs, in the order it visits them.
    Which op waits for which depends only on the schedule, never on the durations, so the walk is
    the same for every simulation of the schedule: it is found once here and replayed."""
    table_runs: tuple[tuple[int, tuple[tuple[int, int, int, int, int, int], ...]], ...]
    """`runs` as (rank, its ops in the run)."""
    stuck: dict[int, int]
    """rank -> index of the op it deadlocks at (empty for a schedule that finishes)."""


def _walk(ops: tuple, num_keys: int, num_ranks: int) -> tuple[tuple[tuple[int, int, int], ...], dict[int, int]]:
    """Ranks advanced with a work list: a rank runs ops until one waits for an op not yet placed,
    parks on it and is woken when that op is placed. Returns the runs and the deadlocked ranks."""
    placed = [False] * num_keys + [True]
    waiters: list[list[int] | None] = [None] * (num_keys + 1)
    ptr = [0] * num_ranks
    runs = []
    work = list(range(num_ranks - 1, -1, -1))
    while work:
        rank = work.pop()
        rank_ops = ops[rank]
        first = i = ptr[rank]
        n = len(rank_ops)
        while i < n:
            own, dep1, _, dep2, _, _ = rank_ops[i]
            blocked = dep1 if not placed[dep1] else dep2 if not placed[dep2] else -1
            if blocked >= 0:
                w = waiters[blocked]
                if w is None:
                    waiters[blocked] = [rank]
                else:
                    w.append(rank)
                break
            placed[own] = True
            w = waiters[own]
            if w is not None:
                work.extend(w)
                waiters[own] = None
            i += 1
        ptr[rank] = i
        runs.append((rank, first, i))
    stuck = {r: ptr[r] for r in range(num_ranks) if ptr[r] < len(ops[r])}
    return tuple(runs), stuck


_KIND_CODE = {ActionKind.F: 0, ActionKind.B: 1, ActionKind.W: 2}


def _raise_unsimulable(schedule: Schedule) -> None:
    """Raise for the first action (rank by rank, in list order) the simulator cannot run."""
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    for rank_actions in schedule.actions:
        for a in rank_actions:
            kind, s, mb = a
            if not (0 <= s < num_stages and 0 <= mb < num_mb) or kind not in _KIND_CODE:
                raise ScheduleError(f"cannot simulate {a} (num_stages={num_stages}, num_microbatches={num_mb})")
    raise AssertionError("no action to reject")  # pragma: no cover


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
    # Delay slots: 0 = no delay; 1 + s = F transfer into stage s; 1 + num_stages + s = B into s.
    # Built with numpy per rank (a schedule has O(m v p) actions; a Python loop over them cost
    # about 3 us each): code 0 = F, 1 = B, 2 = W.
    ops = []
    codes, stages = [], []
    for rank_actions in schedule.actions:
        if not rank_actions:
            ops.append(())
            continue
        kinds, st, mbs = zip(*rank_actions)
        try:
            code = np.array([_KIND_CODE[k] for k in kinds])
        except KeyError:
            _raise_unsimulable(schedule)
        st, mb = np.array(st), np.array(mbs)
        if not ((st >= 0) & (st < num_stages) & (mb >= 0) & (mb < num_mb)).all():
            _raise_unsimulable(schedule)
        f_key = st * num_mb + mb
        is_f, is_b = code == 0, code == 1
        first, at_last = st == 0, st == last
        own = f_key + code * sm
        dep1 = np.where(is_f, np.where(first, none, f_key - num_mb),
                        np.where(is_b, np.where(at_last, f_key, f_key + sm + num_mb), f_key + sm))
        if cross:
            slot1 = np.where(is_f & ~first, 1 + st, 0) + np.where(is_b & ~at_last, 1 + num_stages + st, 0)
        else:
            slot1 = np.zeros_like(st)
        dep2 = np.where(is_b & ~at_last, f_key, none)
        ops.append(tuple(zip(own.tolist(), dep1.tolist(), slot1.tolist(), dep2.tolist(), [0] * len(st),
                             (code * num_stages + st).tolist())))
        codes.append(code)
        stages.append(st)

    # Peak in flight per stage: a stage's actions all run on one rank in list order, so the running
    # count (+1 per F, -1 per releasing B or W) in list order is the count over time.
    peak = [0] * num_stages
    if codes:
        code, st = np.concatenate(codes), np.concatenate(stages)
        release = 2 if (code == 2).any() else 1
        delta = np.where(code == 0, 1, np.where(code == release, -1, 0))
        order = np.argsort(st, kind="stable")  # group by stage, list order kept within a stage
        st_sorted = st[order]
        running = np.cumsum(delta[order])
        starts = np.flatnonzero(np.r_[True, st_sorted[1:] != st_sorted[:-1]])
        before = np.where(starts > 0, running[starts - 1], 0)
        running -= np.repeat(before, np.diff(np.r_[starts, len(st_sorted)]))
        for stage, value in zip(st_sorted[starts].tolist(), np.maximum.reduceat(running, starts).tolist()):
            peak[stage] = max(0, value)
    runs, stuck = _walk(tuple(ops), num_keys, schedule.num_ranks)
    table_runs = tuple((rank, ops[rank][first:end]) for rank, first, end in runs)
    return _Compiled(
        ops=tuple(ops),
        num_keys=num_keys,
        cross_f_stages=tuple(range(1, num_stages)) if cross else (),
        cross_b_stages=tuple(range(last)) if cross else (),
        peak_inflight=tuple(peak),
        actions=schedule.actions,
        runs=runs,
        table_runs=table_runs,
        stuck=stuck,
    )


def simulate(
    schedule: Schedule,
    compute_time_s: Callable[[Action], float] | Mapping[ActionKind, Sequence[float]],
    comm_time_s: Callable[[int, int, ActionKind], float] | None = None,
    rank_tail_s: Sequence[float] | None = None,
) -> SimResult:
    """Simulate one step of ``schedule``.

    ``compute_time_s(action)``: seconds of an F, B or W action; or, when every action of a kind
    on a stage takes as long, a mapping kind -> per-stage seconds (faster: no call per action).
    ``comm_time_s(src_stage, dst_stage, kind)``: seconds to move the tensor of ``kind`` (F:
    activation, B: gradient) from ``src_stage`` to ``dst_stage``; asked only for stages on
    different ranks (once per stage pair); None means free. ``rank_tail_s[r]``: work after rank
    r's last compute action that does not overlap it (non-overlapped DP gradient reduction,
    optimizer step); the makespan is the max over ranks of compute end plus tail. All times must
    be >= 0. Raises `ScheduleError` (with the grid) on deadlock.
    """
    compiled = _compile(schedule)
    num_ranks, num_stages = schedule.num_ranks, schedule.num_stages
    if rank_tail_s is None:
        tails = (0.0,) * num_ranks
    else:
        tails = tuple(float(t) for t in rank_tail_s)
        if len(tails) != num_ranks:
            raise ValueError(f"rank_tail_s has {len(tails)} entries for num_ranks={num_ranks}")
    stuck = compiled.stuck
    if stuck:
        raise ScheduleError(
            "deadlock in simulation: "
            + ", ".join(f"rank {r} waits at step {i} ({compiled.actions[r][i]})" for r, i in stuck.items())
            + "\n"
            + schedule.format_grid(stuck)
        )

    delays = [0.0] * (1 + 2 * num_stages)
    if comm_time_s is not None:
        for s in compiled.cross_f_stages:
            delays[1 + s] = float(comm_time_s(s - 1, s, ActionKind.F))
        for s in compiled.cross_b_stages:
            delays[1 + num_stages + s] = float(comm_time_s(s + 1, s, ActionKind.B))

    if callable(compute_time_s):
        starts, end_lists, free, busy = _replay_calls(compiled, compute_time_s, delays, num_ranks)
        raw = (compiled.actions, starts, end_lists)

    else:
        table = [0.0] * (3 * num_stages)
        for kind, base in ((ActionKind.F, 0), (ActionKind.B, num_stages), (ActionKind.W, 2 * num_stages)):
            values = compute_time_s.get(kind)
            if values is not None:
                table[base:base + num_stages] = [float(v) for v in values]
        free, busy, ends = _replay_table(compiled, table, delays, num_ranks)
        raw = _LazyTimeline(compiled, table, delays, num_ranks)
        starts = [[_first_start(compiled.ops[r][0], ends, delays)] if compiled.ops[r] else [] for r in range(num_ranks)]
    return _result(compiled, free, busy, tails, starts, raw)


def _replay_calls(compiled: _Compiled, compute_time_s: Callable[[Action], float], delays: list[float],
                  num_ranks: int) -> tuple[list[list[float]], list[list[float]], list[float], list[float]]:
    """The event walk with one ``compute_time_s`` call per action, recording every start and end.

    Each action starts at max(rank free, end of each dependency + its transfer delay); the runs
    replay the work list's order, and busy time is summed per run as the work list did."""
    ends = [-1.0] * compiled.num_keys + [0.0]  # last slot: "no dependency", finished at 0
    free = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    end_lists: list[list[float]] = [[] for _ in range(num_ranks)]
    rank_ops, actions = compiled.ops, compiled.actions
    for rank, first, last in compiled.runs:
        t = free[rank]
        rank_starts, rank_ends = starts[rank], end_lists[rank]
        rank_busy = 0.0
        for (own, dep1, slot1, dep2, slot2, _), action in zip(rank_ops[rank][first:last], actions[rank][first:last]):
            start = ends[dep1] + delays[slot1]
            e2 = ends[dep2] + delays[slot2]
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
        free[rank] = t
        busy[rank] += rank_busy
    return starts, end_lists, free, busy


def _replay_table(compiled: _Compiled, table: list[float], delays: list[float], num_ranks: int,
                  record: tuple[list[list[float]], list[list[float]]] | None = None
                  ) -> tuple[list[float], list[float], list[float]]:
    """`_replay_calls` with durations from a flat (kind, stage) table; records starts and ends only
    when asked (the search needs just the totals; `SimResult.timeline` replays with recording)."""
    ends = [-1.0] * compiled.num_keys + [0.0]
    free = [0.0] * num_ranks
    busy = [0.0] * num_ranks
    for rank, rank_ops in compiled.table_runs:
        t = free[rank]
        rank_busy = 0.0
        # The loop is written twice on purpose: the search runs the first, with no per-action
        # branch on recording; only timelines (reports) take the second.
        if record is None:
            for own, dep1, slot1, dep2, slot2, d in rank_ops:
                start = ends[dep1] + delays[slot1]
                e2 = ends[dep2] + delays[slot2]
                if e2 > start:
                    start = e2
                if t > start:
                    start = t
                dur = table[d]
                t = start + dur
                ends[own] = t
                rank_busy += dur
        else:
            rank_starts, rank_ends = record[0][rank], record[1][rank]
            for own, dep1, slot1, dep2, slot2, d in rank_ops:
                start = ends[dep1] + delays[slot1]
                e2 = ends[dep2] + delays[slot2]
                if e2 > start:
                    start = e2
                if t > start:
                    start = t
                dur = table[d]
                t = start + dur
                ends[own] = t
                rank_starts.append(start)
                rank_ends.append(t)
                rank_busy += dur
        free[rank] = t
        busy[rank] += rank_busy
    return free, busy, ends


class _LazyTimeline:
    """What `SimResult.timeline` needs to replay a table simulation with recording."""

    def __init__(self, compiled: _Compiled, table: list[float], delays: list[float], num_ranks: int) -> None:
        self.args = (compiled, table, delays, num_ranks)

    def __bool__(self) -> bool:
        return True

    def materialize(self) -> tuple:
        compiled, table, delays, num_ranks = self.args
        record: tuple[list[list[float]], list[list[float]]] = ([[] for _ in range(num_ranks)],
                                                                [[] for _ in range(num_ranks)])
        _replay_table(compiled, table, delays, num_ranks, record)
        return compiled.actions, record[0], record[1]


def _first_start(op: tuple, ends: list[float], delays: list[float]) -> float:
    """Start of a rank's first op (the rank is free at 0), by the replays' own arithmetic."""
    _, dep1, slot1, dep2, slot2, _ = op
    start = ends[dep1] + delays[slot1]
    e2 = ends[dep2] + delays[slot2]
    if e2 > start:
        start = e2
    if start < 0.0:
        start = 0.0
    return start


def _result(compiled: _Compiled, free: list[float], busy: list[float], tails: tuple[float, ...],
            starts: list[list[float]], raw) -> SimResult:
    """Totals of a replay; ``starts[r]`` holds at least rank r's first start when it has actions."""
    num_ranks = len(free)
    first_start = [-1.0] * num_ranks
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
        _raw_timeline=raw,
    )
