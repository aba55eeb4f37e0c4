"""What the search rejected and why (`autoplan suggest --explain`, issue 29).

[Note: recording rejections]
Every configuration the search drops is counted under one reason: over memory (no cutting of its
most frugal memory option fits), batch (the global batch does not split into its replicas and
micro-batches), layout (the runtime or the model's sharding refuses it) or bound (a lower bound on
its step time already reaches the k-th plan kept). Counting costs one increment. With `detailed`
the best few of each reason are kept as well (fastest lower bound first; in enumeration order for
batch and layout), each as a closure that builds its description only if it is kept to the end, so
the search does no extra evaluation for them; `--explain` then measures how far over memory the kept
ones are and which change would make them fit (search/space.py `explain_memory`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass

__all__ = ["REASONS", "Rejection", "Rejections"]

REASONS = {
    "memory": "over memory",
    "batch": "batch not divisible",
    "layout": "layout refused",
    "bound": "pruned by a bound",
}
"""Reason -> how the report titles it, in the order the report lists them."""


@dataclass
class Rejection:
    """One rejected configuration: what it is, why it lost, and (over memory) what would fit."""

    reason: str
    """A key of REASONS."""
    config: str
    """The configuration, as `ParallelConfig.describe` writes it."""
    why: str
    """One line: what it lacks, with the figures."""
    step_bound_s: float | None = None
    """A lower bound on its step time (memory and bound rejections), else None."""
    need_bytes: float | None = None
    """Over memory: the bytes per GPU it needs (at least), when known."""
    capacity_bytes: float | None = None
    """Over memory: the GPU's bytes."""
    fix: str | None = None
    """Over memory: a change checked to fit under the model, with the plan it gives; None if none found."""
    pins: dict | None = None
    """The configuration as `suggest` pins (tp, pp, dp, micro_batch_size, ...), when it is one."""
    fix_pins: dict | None = None
    """The pins `fix` changes, to add to `pins`."""

    def to_dict(self) -> dict:
        return asdict(self)


class Rejections:
    """Counts per reason, and with `detailed` the best `keep` of each ([Note: recording rejections])."""

    def __init__(self, *, detailed: bool = False, keep: int = 3) -> None:
        self.detailed = detailed
        self.keep = keep
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._kept: dict[str, list[tuple[float, int, tuple, Callable[[], Rejection], object]]] = {r: [] for r in REASONS}
        self._order = itertools.count()

    def add(self, reason: str, rank: float, key: tuple, make: Callable[[], Rejection], payload: object = None) -> None:
        """Count a rejection; with `detailed`, keep it if it is among the best `keep` of its reason
        (lowest `rank`; one per `key`, the configuration without its rank layout). `payload` travels
        with it (the configuration, for `explain_memory`)."""
        self.counts[reason] += 1
        if not self.detailed:
            return
        kept = self._kept[reason]
        same = next((i for i, e in enumerate(kept) if e[2] == key), None)
        if same is not None:
            if rank >= kept[same][0]:
                return
            del kept[same]
        elif len(kept) >= self.keep and rank >= kept[-1][0]:
            return
        bisect.insort(kept, (rank, next(self._order), key, make, payload), key=lambda e: e[:2])
        del kept[self.keep:]

    def kept(self, reason: str) -> list[tuple[Rejection, object]]:
        """The kept rejections of one reason, best first, each with its payload."""
        return [(make(), payload) for _, _, _, make, payload in self._kept[reason]]

    @property
    def total(self) -> int:
        return sum(self.counts.values())
