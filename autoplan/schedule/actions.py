"""The schedule IR: actions, per-rank action lists, generators and a pure validator.

A schedule is data (see docs/architecture.md, "A schedule is data"): for every rank, the compute actions
(F, B, W) it runs, in order. The simulator walks these lists to predict time; the executor walks
the lowered lists from `Schedule.with_comms()` to run them.

[Note: stage placement]
Stage ``s`` lives on rank ``s % num_ranks`` (looped placement, as Megatron-LM's interleaved
schedule, Narayanan et al. SC'21 Sec 2.2.2). With one virtual stage per rank this is simply
stage ``s`` on rank ``s``.

[Note: communication actions]
``SEND_F(s, m)``: stage ``s`` sends its forward output of micro-batch ``m`` to stage ``s + 1``.
``RECV_F(s, m)``: stage ``s`` receives its forward input of ``m`` from stage ``s - 1``.
``SEND_B(s, m)``: stage ``s`` sends the gradient of its input to stage ``s - 1``.
``RECV_B(s, m)``: stage ``s`` receives the gradient of its output from stage ``s + 1``.
So ``SEND_F(s, m)`` pairs with ``RECV_F(s + 1, m)`` and ``SEND_B(s, m)`` with ``RECV_B(s - 1, m)``
(the stage of a comm action is always the stage on the rank that posts it, as in torch's
``torch/distributed/pipelining/schedules.py``).
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "compute_deps",
    "forward_only",
    "make_schedule",
    "validate",
]


class ActionKind(str, enum.Enum):
    """What an action does.

    ``B`` is the full backward in gpipe / 1f1b / interleaved-1f1b; in zb-h1 it is only the
    input-gradient half and ``W`` is the weight-gradient half (Qi et al. 2024, Sec 2).
    """

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})

# Longest kind names first so "SEND_F" is not read as a stray "F".
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)$")


class Action(NamedTuple):
    """One step of one rank: ``kind`` applied to ``stage`` for ``microbatch``; prints as ``2F5``."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, s: str) -> Action:
        """Inverse of ``str``: ``"3SEND_F2"`` -> ``Action(SEND_F, stage=3, microbatch=2)``."""
        match = _ACTION_RE.match(s.strip()) if isinstance(s, str) else None
        if match is None:
            raise ValueError(
                f"cannot parse action {s!r}: expected <stage><kind><microbatch> with kind in "
                f"{[k.value for k in ActionKind]}, e.g. '2F5' or '3SEND_F2'"
            )
        return cls(ActionKind(match.group(2)), int(match.group(1)), int(match.group(3)))


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


class ScheduleError(ValueError):
    """A schedule that breaks an invariant or cannot finish; the message carries the grid."""


@dataclass(frozen=True)
class Schedule:
    """Per-rank compute actions (F/B/W only) in execution order; see [Note: stage placement]."""

    name: str
    num_ranks: int
    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    """``actions[r]`` is what rank ``r`` runs, in order."""

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_stages < 1 or self.num_microbatches < 1:
            raise ValueError(
                f"schedule {self.name!r}: need num_ranks, num_stages, num_microbatches >= 1, got "
                f"{self.num_ranks}, {self.num_stages}, {self.num_microbatches}"
            )
        if self.num_stages % self.num_ranks:
            raise ValueError(
                f"schedule {self.name!r}: num_stages={self.num_stages} is not a multiple of "
                f"num_ranks={self.num_ranks}"
            )
        if len(self.actions) != self.num_ranks:
            raise ValueError(
                f"schedule {self.name!r}: {len(self.actions)} action lists for num_ranks={self.num_ranks}"
            )

    def rank_of_stage(self, stage: int) -> int:
        return stage % self.num_ranks

    def stages_of_rank(self, rank: int) -> list[int]:
        return list(range(rank, self.num_stages, self.num_ranks))

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks

    def split_backward(self) -> bool:
        """True iff the backward is split into B (input grad) and W (weight grad)."""
        return any(a.kind is ActionKind.W for rank_actions in self.actions for a in rank_actions)

    def with_comms(self) -> tuple[tuple[Action, ...], ...]:
        """Per-rank lists with P2P actions inserted; see [Note: communication actions].

        Sends are posted right after the compute that produces the tensor and receives right
        before the compute that consumes it, and only where the two stages sit on different ranks.
        With buffered (non-blocking) sends and blocking receives this order cannot deadlock if the
        compute schedule passes `validate`: a receive waits only on its producer's compute, which
        is immediately followed by the matching send.
        """
        last = self.num_stages - 1
        rank_of = self.rank_of_stage
        lowered: list[tuple[Action, ...]] = []
        for rank, rank_actions in enumerate(self.actions):
            out: list[Action] = []
            for a in rank_actions:
                s, mb = a.stage, a.microbatch
                if a.kind is ActionKind.F:
                    if s > 0 and rank_of(s - 1) != rank:
                        out.append(Action(ActionKind.RECV_F, s, mb))
                    out.append(a)
                    if s < last and rank_of(s + 1) != rank:
                        out.append(Action(ActionKind.SEND_F, s, mb))
                elif a.kind is ActionKind.B:
                    if s < last and rank_of(s + 1) != rank:
                        out.append(Action(ActionKind.RECV_B, s, mb))
                    out.append(a)
                    if s > 0 and rank_of(s - 1) != rank:
                        out.append(Action(ActionKind.SEND_B, s, mb))
                else:
                    out.append(a)
            lowered.append(tuple(out))
        return tuple(lowered)

    def format_grid(self, marks: Mapping[int, int] | None = None, *, lowered: bool = False) -> str:
        """Step x rank grid (rows = position in each rank's list, columns = ranks).

        ``marks`` maps rank -> step to flag (validation failures); flagged cells read ``>1B3<``
        and their row ends with ``<-- here``. ``lowered=True`` prints `with_comms()` instead.
        """
        lists = self.with_comms() if lowered else self.actions
        marks = dict(marks or {})
        num_steps = max((len(x) for x in lists), default=0)
        cells = [
            [
                (f">{lists[r][i]}<" if marks.get(r) == i else str(lists[r][i])) if i < len(lists[r]) else ""
                for r in range(self.num_ranks)
            ]
            for i in range(num_steps)
        ]
        headers = [f"rank{r}" for r in range(self.num_ranks)]
        widths = [max([len(headers[r])] + [len(row[r]) for row in cells]) for r in range(self.num_ranks)]
        step_w = max(4, len(str(max(num_steps - 1, 0))))
        lines = [
            f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} micro-batches",
            " ".join(["step".rjust(step_w)] + [h.ljust(w) for h, w in zip(headers, widths)]).rstrip(),
        ]
        marked_steps = set(marks.values())
        for i, row in enumerate(cells):
            line = " ".join([str(i).rjust(step_w)] + [c.ljust(w) for c, w in zip(row, widths)]).rstrip()
            if i in marked_steps:
                line += "  <-- here"
            lines.append(line)
        return "\n".join(lines)

    def to_str(self) -> str:
        return self.format_grid()

    def __str__(self) -> str:
        return self.format_grid()


# ---------------------------------------------------------------------------------------------
# Generators. Each returns, per stage or per rank, the compute order; stage s = rank s for v = 1.


def _gpipe(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    # GPipe (Huang et al. 2019, Fig. 2c): all forwards, then all backwards; every stage holds
    # all m micro-batches' activations at the peak.
    return [
        [Action(ActionKind.F, s, i) for i in range(num_microbatches)]
        + [Action(ActionKind.B, s, i) for i in range(num_microbatches)]
        for s in range(num_ranks)
    ]


def _one_f_one_b(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    # 1F1B (PipeDream-Flush: Narayanan et al. 2021 "Memory-Efficient Pipeline-Parallel DNN
    # Training"; Megatron-LM, Narayanan et al. SC'21 Sec 2.2.1): stage s runs p - s - 1 warmup
    # forwards, then alternates one forward and one backward, then drains the backwards. At most
    # min(p - s, m) micro-batches are in flight on stage s.
    p, m = num_ranks, num_microbatches
    out = []
    for s in range(p):
        num_warmup = min(p - s - 1, m)
        seq = [Action(ActionKind.F, s, i) for i in range(num_warmup)]
        for i in range(m - num_warmup):
            seq += [Action(ActionKind.F, s, num_warmup + i), Action(ActionKind.B, s, i)]
        seq += [Action(ActionKind.B, s, i) for i in range(m - num_warmup, m)]
        out.append(seq)
    return out


def _zb_h1(num_ranks: int, num_microbatches: int) -> list[list[Action]]:
    # ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR'24, Sec 2.1, Fig. 3 top):
    # 1F1B order for F and B (B = input gradient only), with the weight-gradient pass W of
    # micro-batch i delayed until after B of micro-batch i + s on stage s. Every stage then keeps
    # the same number of micro-batches in flight (p, as stage 0 in 1F1B); as W holds less than B
    # (Table 1) the peak memory is 1F1B's, and the later W passes fill the cool-down bubble. Table 2
    # gives the bubble
    # (p - 1)(T_F + T_B - T_W) versus (p - 1)(T_F + T_B + T_W) for 1F1B. The W passes still owed
    # after the last B run at the end.
    p, m = num_ranks, num_microbatches
    out = []
    for s in range(p):
        num_warmup = min(p - s - 1, m)
        seq = [Action(ActionKind.F, s, i) for i in range(num_warmup)]
        for i in range(m):
            if num_warmup + i < m:  # steady state: one forward before each backward
                seq.append(Action(ActionKind.F, s, num_warmup + i))
            seq.append(Action(ActionKind.B, s, i))
            if i >= s:
                seq.append(Action(ActionKind.W, s, i - s))
        seq += [Action(ActionKind.W, s, i) for i in range(max(m - s, 0), m)]
        out.append(seq)
    return out


def _interleaved_one_f_one_b(
    num_ranks: int, num_microbatches: int, virtual_stages: int
) -> list[list[Action]]:
    # Interleaved 1F1B (Narayanan et al. SC'21 Sec 2.2.2, Fig. 4; the order of Megatron-LM's
    # forward_backward_pipelining_with_interleaving): rank r holds stages r, r + p, ...; it walks
    # micro-batches in groups of p, running each group through chunk 0, then chunk 1, ... for
    # forwards and through the chunks in reverse for backwards. Warmup is
    # (p - r - 1) * 2 + (v - 1) * p forwards, then 1F1B over the (chunk, micro-batch) sequence.
    # The bubble shrinks by v: (1/v)(p - 1)/m of the ideal time (SC'21 Sec 2.2.2).
    p, m, v = num_ranks, num_microbatches, virtual_stages
    total = m * v
    # The k-th forward (backward) of every rank visits the same (chunk, micro-batch) pair; only the
    # stage, chunk * p + r, depends on the rank. So the pairs are listed once, not per rank.
    fwd_cm = []
    bwd_cm = []
    for k in range(total):
        group, within = divmod(k, p * v)
        chunk, mb = within // p, group * p + within % p
        fwd_cm.append((chunk * p, mb))
        bwd_cm.append(((v - 1 - chunk) * p, mb))
    new = tuple.__new__
    F, B = ActionKind.F, ActionKind.B

    out = []
    for r in range(p):
        num_warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        fwds = [new(Action, (F, base + r, mb)) for base, mb in fwd_cm]
        bwds = [new(Action, (B, base + r, mb)) for base, mb in bwd_cm]
        seq = fwds[:num_warmup]
        steady = total - num_warmup
        pairs: list[Action] = [None] * (2 * steady)  # type: ignore[list-item]
        pairs[0::2] = fwds[num_warmup:]
        pairs[1::2] = bwds[:steady]
        seq += pairs
        seq += bwds[steady:]
        out.append(seq)
    return out


def make_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build one of `SCHEDULES` for ``num_ranks`` ranks and ``num_microbatches`` micro-batches.

    ``virtual_stages`` is the number of model chunks per rank: 1 for gpipe, 1f1b and zb-h1,
    >= 2 for interleaved-1f1b (which also needs ``num_microbatches % num_ranks == 0``, as
    Megatron-LM's interleaved schedule does). Raises ValueError naming the offending numbers.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")
    if name == "interleaved-1f1b":
        if virtual_stages < 2:
            raise ValueError(
                f"interleaved-1f1b needs virtual_stages >= 2, got {virtual_stages}; use '1f1b' for one"
            )
        if num_microbatches % num_ranks:
            raise ValueError(
                f"interleaved-1f1b needs num_microbatches divisible by num_ranks (Megatron-LM's "
                f"requirement), got num_microbatches={num_microbatches}, num_ranks={num_ranks}"
            )
    elif virtual_stages != 1:
        raise ValueError(f"{name} supports only virtual_stages=1, got {virtual_stages}")
    return _build_schedule(name, num_ranks, num_microbatches, virtual_stages)


# Schedules are immutable, so the search can share them; returning the same object also lets the
# simulator's per-schedule cache hit on identity instead of comparing every action.
@functools.lru_cache(maxsize=64)
def _build_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    if name == "interleaved-1f1b":
        per_rank = _interleaved_one_f_one_b(num_ranks, num_microbatches, virtual_stages)
    else:
        generators: dict[str, Callable[[int, int], list[list[Action]]]] = {
            "gpipe": _gpipe,
            "1f1b": _one_f_one_b,
            "zb-h1": _zb_h1,
        }
        per_rank = generators[name](num_ranks, num_microbatches)
    return Schedule(
        name=name,
        num_ranks=num_ranks,
        num_stages=num_ranks * virtual_stages,
        num_microbatches=num_microbatches,
        actions=tuple(tuple(seq) for seq in per_rank),
    )


# ---------------------------------------------------------------------------------------------
# Validation


def _fail(schedule: Schedule, reason: str, marks: Mapping[int, int]) -> ScheduleError:
    return ScheduleError(f"{reason}\n{schedule.format_grid(marks)}")


def compute_deps(action: Action, num_stages: int) -> tuple[Action, ...]:
    """What ``action`` waits for: F(s) on F(s-1); B(s) on B(s+1) (last stage: F) and F(s); W on B."""
    s, mb = action.stage, action.microbatch
    if action.kind is ActionKind.F:
        return (Action(ActionKind.F, s - 1, mb),) if s > 0 else ()
    if action.kind is ActionKind.B:
        if s == num_stages - 1:
            return (Action(ActionKind.F, s, mb),)
        return (Action(ActionKind.B, s + 1, mb), Action(ActionKind.F, s, mb))
    if action.kind is ActionKind.W:
        return (Action(ActionKind.B, s, mb),)
    raise ValueError(f"{action} is not a compute action")


FORWARD_KINDS = frozenset({ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F})


def forward_only(actions: Sequence[Action]) -> tuple[Action, ...]:
    """One rank's lowered list (`Schedule.with_comms()[rank]`) without its backward: the F, SEND_F
    and RECV_F actions, in their order. What an evaluation runs (runtime/execution/executor.py `run(...,
    forward_only=True)`): the training schedule's forward order, so no second schedule is needed.

    It cannot deadlock when the full lists cannot: every blocking wait left is a RECV_F, and the
    actions before any action in the filtered list are a subset of those before it in the full one.
    Were the filtered run stuck, take the stuck RECV_F that finished first in the full run; its
    SEND_F was posted before that in the full run, so the peer is stuck at a RECV_F that precedes
    the send in its list, which finished even earlier in the full run: a contradiction. Peers'
    messages keep their relative order (B messages leave both sides), so posting-order matching
    (NCCL) pairs them as before.
    """
    return tuple(a for a in actions if a.kind in FORWARD_KINDS)


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` (message includes the grid, offending step marked) unless:

    every action is a compute action on the rank owning its stage; every (stage, micro-batch)
    has exactly one F and one B, and exactly one W (after its B) iff the backward is split; and
    the dependencies can all be met: running the ranks in lock-step with unit durations, each
    rank executing its next action once that action's dependencies finished, finishes.
    """
    num_stages, num_mb = schedule.num_stages, schedule.num_microbatches
    split = schedule.split_backward()
    expected_kinds = (ActionKind.F, ActionKind.B, ActionKind.W) if split else (ActionKind.F, ActionKind.B)
    seen: dict[Action, tuple[int, int]] = {}
    for rank, rank_actions in enumerate(schedule.actions):
        for step, a in enumerate(rank_actions):
            if not isinstance(a, Action) or a.kind not in COMPUTE_KINDS:
                raise _fail(schedule, f"rank {rank} step {step}: {a!s} is not a compute action", {rank: step})
            if not (0 <= a.stage < num_stages and 0 <= a.microbatch < num_mb):
                raise _fail(
                    schedule,
                    f"rank {rank} step {step}: {a} out of range (num_stages={num_stages}, "
                    f"num_microbatches={num_mb})",
                    {rank: step},
                )
            owner = schedule.rank_of_stage(a.stage)
            if owner != rank:
                raise _fail(schedule, f"rank {rank} step {step}: {a} belongs on rank {owner}", {rank: step})
            if a in seen:
                raise _fail(
                    schedule,
                    f"rank {rank} step {step}: {a} appears twice (first at step {seen[a][1]})",
                    {rank: step},
                )
            if a.kind is ActionKind.W:
                b = Action(ActionKind.B, a.stage, a.microbatch)
                if b not in seen:
                    raise _fail(schedule, f"rank {rank} step {step}: {a} runs before {b}", {rank: step})
            seen[a] = (rank, step)
    for stage in range(num_stages):
        for mb in range(num_mb):
            for kind in expected_kinds:
                if Action(kind, stage, mb) not in seen:
                    raise _fail(schedule, f"missing {Action(kind, stage, mb)}", {})

    # Lock-step run with unit durations: in each round every rank whose next action has all
    # dependencies finished (in earlier rounds) runs it. No progress in a round = deadlock.
    done: set[Action] = set()
    ptr = [0] * schedule.num_ranks
    remaining = sum(len(x) for x in schedule.actions)
    while remaining:
        ran = []
        for rank, rank_actions in enumerate(schedule.actions):
            if ptr[rank] < len(rank_actions):
                a = rank_actions[ptr[rank]]
                if all(d in done for d in compute_deps(a, num_stages)):
                    ran.append(a)
                    ptr[rank] += 1
        if not ran:
            stuck = {r: ptr[r] for r in range(schedule.num_ranks) if ptr[r] < len(schedule.actions[r])}
            waits = ", ".join(
                f"rank {r} at step {i} ({schedule.actions[r][i]} waits for "
                f"{' and '.join(str(d) for d in compute_deps(schedule.actions[r][i], num_stages) if d not in done)})"
                for r, i in stuck.items()
            )
            raise _fail(schedule, f"deadlock: {waits}", stuck)
        done.update(ran)
        remaining -= len(ran)
