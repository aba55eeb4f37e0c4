"""The timeline data: a `Box` per interval a pipeline rank spends on an action, a transfer or the
step's tail, and a `Timeline` of them, whichever way it was made (predicted from a plan or measured
from a trace) and whichever way it is drawn (SVG, PNG, Chrome trace).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Box", "Timeline", "TimelineError", "bubble_share"]

class TimelineError(ValueError):
    """A trace or output path that cannot be used (one line)."""


@dataclass(frozen=True)
class Box:
    """One interval on one pipeline rank: a compute action, a transfer or the step's tail."""

    rank: int
    """Pipeline rank (row)."""
    action: str
    """Action string ("2F5", "1RECV_F3") or a tail label ("DP", "OPT")."""
    kind: str
    """F, B, W, SEND_F, RECV_F, SEND_B, RECV_B, TIED (tied-gradient sum), DP (exposed gradient reduction),
    OPT (optimizer)."""
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def is_compute(self) -> bool:
        return self.kind in ("F", "B", "W")


@dataclass(frozen=True)
class Timeline:
    label: str
    """"predicted" or "measured" (shown beside each row group)."""
    num_ranks: int
    boxes: tuple[Box, ...]
    """Rank by rank, each rank's boxes in start order."""
    step_time_s: float
    bubble_fraction: float
    """Idle share of the ranks' compute span (see `SimResult.bubble_fraction`)."""

    def rank_boxes(self, rank: int, *, compute_only: bool = False) -> list[Box]:
        return [b for b in self.boxes if b.rank == rank and (b.is_compute or not compute_only)]


def bubble_share(boxes: Sequence[Box], num_ranks: int) -> float:
    compute = [b for b in boxes if b.is_compute]
    if not compute or num_ranks < 1:
        return 0.0
    span = max(b.end_s for b in compute) - min(b.start_s for b in compute)
    busy = sum(b.duration_s for b in compute)
    return max(0.0, 1.0 - busy / (num_ranks * span)) if span > 0 else 0.0
