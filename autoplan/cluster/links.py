"""A link class between two GPUs: the alpha-beta figures and the measured bandwidth curves it carries.

`Link` is apart from `Cluster` (cluster/topology.py) because it is the unit everything below the
cluster prices a message with: the collective costs (cluster/collectives.py) read its figures and
curves, and the default figures per GPU family (cluster/link_defaults.py) are built from it. It
checks its own figures, so a YAML typo fails where the link is made.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from autoplan.cluster.devices import ClusterSpecError

__all__ = ["CURVE_OPS", "MAX_LINK_GBPS", "MAX_LINK_LATENCY_S", "Curve", "Link"]

GB = 1e9
"""Bytes in a GB (the unit of link bandwidths: GB/s per GPU per direction)."""
MAX_LINK_GBPS = 1e5
"""No link is faster (NVLink 5: 900 GB/s per GPU per direction); a bigger figure is a typo."""
MAX_LINK_LATENCY_S = 1.0
"""No link is slower to start a message (InfiniBand and NVLink: microseconds; TCP across a WAN: tens
of milliseconds); a bigger figure is a typo, usually microseconds written as seconds."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


CURVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
"""Operations a `Link` may carry a measured bandwidth curve for (nccl-tests' `*_perf` binaries)."""

Curve = tuple[tuple[float, float], ...]
"""(message bytes, bus bandwidth bytes/s) points, strictly increasing in bytes (see `Link.curves`)."""


def _curves_of(raw: Any) -> tuple[tuple[str, Curve], ...]:
    """`Link.curves` as tuples of floats, or a ClusterSpecError naming the first wrong operation or
    point (a YAML `[[null, 1]]` was a TypeError traceback from `float(None)`, issue 29)."""
    if isinstance(raw, Mapping):
        raw = tuple(raw.items())
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise ClusterSpecError(f"link curves must be ((operation, ((bytes, bytes_per_s), ...)), ...), got {raw!r}")
    curves = []
    for entry in raw:
        if isinstance(entry, str | bytes) or not isinstance(entry, Sequence) or len(entry) != 2:
            raise ClusterSpecError(f"link curves must be (operation, points) pairs, got {entry!r}")
        op, points = entry
        if op not in CURVE_OPS:
            raise ClusterSpecError(f"link curve {op!r} is not one of {CURVE_OPS}")
        if isinstance(points, str | bytes) or not isinstance(points, Sequence):
            raise ClusterSpecError(f"link curve {op!r} must be a list of [bytes, bytes_per_s] points, got {points!r}")
        if not points:
            raise ClusterSpecError(f"link curve {op!r} has no points")
        converted = []
        for i, point in enumerate(points):
            if (isinstance(point, str | bytes) or not isinstance(point, Sequence) or len(point) != 2
                    or not all(is_number(v) and 0 < v <= sys.float_info.max for v in point)):
                raise ClusterSpecError(
                    f"link curve {op!r}: point {i} must be [bytes, bytes_per_s], two finite numbers > 0, got "
                    f"{list(point) if isinstance(point, Sequence) and not isinstance(point, str | bytes) else point!r}"
                )
            converted.append((float(point[0]), float(point[1])))
        curves.append((op, tuple(converted)))
    return tuple(curves)


@dataclass(frozen=True)
class Link:
    """A class of connection between two GPUs: alpha-beta (time = latency_s + bytes / bw), or the
    measured bandwidth curves in `curves` where it has them (cluster/collectives.py)."""

    bw_bytes_per_s: float
    """Bandwidth per GPU per direction, bytes/s."""
    latency_s: float
    """Per-message (per collective step) latency, seconds: the alpha of the alpha-beta model."""
    kind: str = ""
    """Label for reports, e.g. "NVLink", "IB", "PCIe"."""
    curves: tuple[tuple[str, Curve], ...] = ()
    """Measured bus bandwidth against message size, per operation in `CURVE_OPS`: ((op, ((bytes,
    busbw_bytes_per_s), ...)), ...), points sorted by size, busbw as nccl-tests defines it (for p2p
    the plain bandwidth). Empty: the alpha-beta figures above. See [Note: measured curves] in
    cluster/collectives.py."""
    _curve: dict[str, tuple[tuple[float, ...], ...]] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        # Upper bounds: an infinite or 1e300 GB/s link (a typo in a YAML file) was priced as free.
        if not is_number(self.bw_bytes_per_s) or not 0 < self.bw_bytes_per_s <= MAX_LINK_GBPS * GB:
            raise ClusterSpecError(f"link bandwidth must be > 0 and at most {MAX_LINK_GBPS:g} GB/s "
                                   f"({MAX_LINK_GBPS * GB:g} bytes/s), got {self.bw_bytes_per_s!r} bytes/s")
        if not is_number(self.latency_s) or not 0 <= self.latency_s <= MAX_LINK_LATENCY_S:
            raise ClusterSpecError(f"link latency must be >= 0 and at most {MAX_LINK_LATENCY_S:g} s, got "
                                   f"{self.latency_s!r} s")
        if not isinstance(self.kind, str):
            raise ClusterSpecError(f"link kind must be a label string such as 'NVLink', got {self.kind!r}")
        table: dict[str, tuple[tuple[float, ...], ...]] = {}
        curves = _curves_of(self.curves)
        for op, points in curves:
            if op in table:
                raise ClusterSpecError(f"link has two curves for {op!r}")
            sizes = tuple(b for b, _ in points)
            bws = tuple(bw for _, bw in points)
            if any(a >= b for a, b in zip(sizes, sizes[1:])):
                raise ClusterSpecError(
                    f"link curve {op!r}: sizes must be strictly increasing, got {list(sizes)}"
                )
            table[op] = (sizes, bws, tuple(math.log(v) for v in sizes), tuple(math.log(v) for v in bws))
        object.__setattr__(self, "curves", curves)
        object.__setattr__(self, "_curve", table)

    def curve(self, op: str) -> tuple[tuple[float, ...], ...] | None:
        """(sizes, busbws, log sizes, log busbws) of `op`'s curve. A collective without its own
        curve borrows another collective's (busbw is normalised to be comparable across them,
        nccl-tests PERFORMANCE.md); None when there is none (alpha-beta)."""
        found = self._curve.get(op)
        if found is None and op != "p2p":
            for other in ("all_reduce", "reduce_scatter", "all_gather"):
                found = self._curve.get(other)
                if found is not None:
                    break
        return found

    def without_curves(self) -> Link:
        """The same link with its alpha-beta figures only."""
        return dataclasses.replace(self, curves=())

    @property
    def bw_gbps(self) -> float:
        """Bandwidth in GB/s (1e9 bytes/s)."""
        return self.bw_bytes_per_s / GB

