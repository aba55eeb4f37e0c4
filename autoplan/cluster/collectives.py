"""Alpha-beta costs of point-to-point and collective communication over a `Cluster`.

Message-size convention (NCCL's, nccl-tests doc/PERFORMANCE.md): `num_bytes` is the size of the
buffer each rank passes to the call: for all-reduce the N-byte buffer every rank holds; for
all-gather and reduce-scatter the *full* (gathered / pre-scatter) N-byte buffer, each rank owning
N/n of it.

[Note: ring costs] With n ranks, per-step latency alpha and per-rank bandwidth B, the ring
algorithms cost (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 19(1), sections 3-4; reduction arithmetic ignored):

    all-gather, reduce-scatter:  (n-1) alpha +  (n-1)/n * N / B
    all-reduce (RS then AG):    2(n-1) alpha + 2(n-1)/n * N / B

The ring all-reduce's bandwidth term is optimal (Patarasuk & Yuan 2009, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 69(2)), and the factors 2(n-1)/n and
(n-1)/n are exactly nccl-tests' "bus bandwidth" corrections (PERFORMANCE.md), so B is comparable
with the busbw nccl-tests prints.

[Note: groups spanning nodes] A flat ring over ranks on several nodes moves every byte through
every hop, so it runs at the slowest link it uses (the inter-node link, per GPU) with the slowest
latency per step. The hierarchical (2D) alternative, used by NCCL's tree/ring split and by Jia et
al. 2018 ("Highly Scalable Deep Learning Training System with Mixed-Precision", arXiv:1807.11205,
hierarchical all-reduce): reduce-scatter inside each node over its g ranks, all-reduce across the k
nodes over N/g bytes (g concurrent rings, one per local rank, each on its own NIC rail), then
all-gather inside the node. All-gather / reduce-scatter decompose the same way (inter-node phase
over N/g, intra-node phase over N). We take the cheaper of the two, which is what NCCL's tuner
does among its algorithms. Uneven groups (different ranks per node) use the largest per-node
count for the intra-node phases and the smallest for the inter-node data share (the slowest node
sets the pace).

[Note: measured curves] A `Link` may carry measured curves (`Link.curves`): per operation, bus
bandwidth against message size as nccl-tests prints it (`all_reduce_perf` etc., column busbw). Bus
bandwidth is defined to be independent of the rank count (PERFORMANCE.md), so a curve measured on
one group size serves every group: the time of an N-byte collective over n ranks on that link is

    all-reduce:                  2(n-1)/n * N / busbw(N)
    all-gather, reduce-scatter:   (n-1)/n * N / busbw(N)
    p2p:                                N / bw(N)

with busbw interpolated linearly in log(N) between the points (log busbw against log N: a power
law per segment, so the time is monotone between two points whose times are; a linear busbw
against log N would dip below the latency floor between sparse points), the last point's busbw
above the largest size, and below the smallest size the smallest point's time (latency-bound). This replaces
both alpha and B of [Note: ring costs]; the ring factors stay. Known limit: a ring's latency grows
with n (the (n-1) alpha term), which one busbw curve per link cannot express; measure at the group
size that matters most. A collective without its own curve borrows another collective's of the same
link (all-reduce first); p2p only uses a p2p curve; a link without curves keeps alpha-beta. Groups
spanning nodes keep [Note: groups spanning nodes]: each phase is timed on its own link's curve, and
the flat ring takes the slower of its two links' times.

Calibration file format (the `collectives` field of a calibration JSON, cost/calibration.py;
applied with `with_collective_curves`):

    "collectives": {
      "intra_node": {"ranks": 8,
                     "all_reduce":     [[bytes, busbw_bytes_per_s], ...],
                     "all_gather":     [[bytes, busbw_bytes_per_s], ...],
                     "reduce_scatter": [[bytes, busbw_bytes_per_s], ...],
                     "p2p":            [[bytes, bw_bytes_per_s], ...]},
      "inter_node": {"ranks": 2, ...same keys...}
    }

Either link is optional, and so is each operation and `ranks` (how many ranks the curves were
measured on, kept for the record). Points are sorted by size when read. Sizes are the nccl-tests
"size" column (the full buffer, see the convention above). Intra-node curves are measured within
one node; inter-node curves with one rank per node (e.g. 2 nodes x 1 GPU), so that they describe
one GPU's NIC rail, as `Link.bw_bytes_per_s` does; a run over full nodes measures the whole node's
NICs and would overstate the per-rail figure about gpus_per_node times. A `source` string may sit at
the top level or in either link's entry.

These functions are called ~1e5 times in a search: they are pure, use no networkx, and cache the
per-group layout (distinct nodes, ranks per node) by the tuple of ranks and the curve lookups by
(curve, size).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from autoplan.cluster.links import CURVE_OPS, Link
from autoplan.cluster.topology import Cluster

__all__ = [
    "ALGORITHMS",
    "allgather_time_s",
    "allreduce_time_s",
    "group_layout",
    "p2p_time_s",
    "reduce_scatter_time_s",
    "with_collective_curves",
]

ALGORITHMS = ("auto", "ring", "hierarchical")
"""`algorithm=` values: the cheaper of the two, a flat ring, or the 2D intra/inter-node scheme."""


def p2p_time_s(cluster: Cluster, src: int, dst: int, num_bytes: float) -> float:
    """One message of `num_bytes` from `src` to `dst`: latency + bytes / bandwidth over their link.

    (Hockney's alpha-beta model; Thakur et al. 2005, section 2.) Zero when src == dst.
    """
    if src == dst or num_bytes <= 0:
        return 0.0
    link = cluster.link(src, dst)
    curve = link.curve("p2p") if link.curves else None
    if curve is not None:
        return _curve_time(curve, 1.0, num_bytes)  # [Note: measured curves]
    return link.latency_s + num_bytes / link.bw_bytes_per_s


def allreduce_time_s(
    cluster: Cluster, ranks: Sequence[int], num_bytes: float, *, algorithm: str = "auto"
) -> float:
    """All-reduce of an N-byte buffer over `ranks` (see [Note: ring costs], [Note: groups spanning nodes])."""
    return _collective(cluster, ranks, num_bytes, algorithm, 2.0, "all_reduce")


def allgather_time_s(
    cluster: Cluster, ranks: Sequence[int], num_bytes: float, *, algorithm: str = "auto"
) -> float:
    """All-gather producing an N-byte buffer on each rank (each contributes N/n)."""
    return _collective(cluster, ranks, num_bytes, algorithm, 1.0, "all_gather")


def reduce_scatter_time_s(
    cluster: Cluster, ranks: Sequence[int], num_bytes: float, *, algorithm: str = "auto"
) -> float:
    """Reduce-scatter of an N-byte buffer (each rank ends with N/n); same cost as all-gather."""
    return _collective(cluster, ranks, num_bytes, algorithm, 1.0, "reduce_scatter")


def group_layout(cluster: Cluster, ranks: Sequence[int]) -> tuple[int, int, int, int]:
    """(ranks, distinct nodes, fewest ranks on a node, most ranks on a node) of a rank group."""
    return _layout(cluster.gpus_per_node, cluster.num_gpus, tuple(ranks))


@lru_cache(maxsize=65536)
def _layout(gpus_per_node: int, num_gpus: int, ranks: tuple[int, ...]) -> tuple[int, int, int, int]:
    counts: dict[int, int] = {}
    for r in ranks:
        if not 0 <= r < num_gpus:
            raise IndexError(f"rank {r} out of range for a cluster of {num_gpus} GPUs")
        node = r // gpus_per_node
        counts[node] = counts.get(node, 0) + 1
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"rank group {list(ranks)} has duplicate ranks")
    if not counts:
        return 0, 0, 0, 0
    per_node = counts.values()
    return len(ranks), len(counts), min(per_node), max(per_node)


def _collective(
    cluster: Cluster, ranks: Sequence[int], num_bytes: float, algorithm: str, phases: float, op: str
) -> float:
    """Ring cost with `phases` = 2 for all-reduce (RS + AG) and 1 for all-gather / reduce-scatter."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    n, num_nodes, g_min, g_max = _layout(cluster.gpus_per_node, cluster.num_gpus, tuple(ranks))
    if n <= 1 or num_bytes <= 0:
        return 0.0
    intra, inter = cluster.intra_node, cluster.inter_node
    if intra.curves or inter.curves:
        return _measured(intra, inter, n, num_nodes, g_min, g_max, num_bytes, algorithm, phases, op)
    if num_nodes == 1:
        return phases * ((n - 1) * intra.latency_s + (n - 1) / n * num_bytes / intra.bw_bytes_per_s)

    # Flat ring: every step waits for its slowest hop ([Note: groups spanning nodes]).
    if g_max > 1:
        bw = min(intra.bw_bytes_per_s, inter.bw_bytes_per_s)
        alpha = max(intra.latency_s, inter.latency_s)
    else:
        bw, alpha = inter.bw_bytes_per_s, inter.latency_s
    flat = phases * ((n - 1) * alpha + (n - 1) / n * num_bytes / bw)
    if algorithm == "ring" or (algorithm == "auto" and g_max == 1):
        return flat

    # Hierarchical: intra-node RS (and AG for all-reduce) over N, inter-node phase over N / g.
    intra_phase = (g_max - 1) * intra.latency_s + (g_max - 1) / g_max * num_bytes / intra.bw_bytes_per_s
    k = num_nodes
    inter_phase = (k - 1) * inter.latency_s + (k - 1) / k * (num_bytes / g_min) / inter.bw_bytes_per_s
    hierarchical = phases * (intra_phase + inter_phase)
    if algorithm == "hierarchical":
        return hierarchical
    return min(flat, hierarchical)


# --------------------------------------------------------------------------------------------------
# Measured curves ([Note: measured curves])
# --------------------------------------------------------------------------------------------------


def _ring_s(link: Link, op: str, phases: float, n: int, num_bytes: float) -> float:
    """One ring over n ranks on `link`: its curve when it has one, else alpha-beta."""
    curve = link.curve(op)
    if curve is None:
        return phases * ((n - 1) * link.latency_s + (n - 1) / n * num_bytes / link.bw_bytes_per_s)
    return _curve_time(curve, phases * (n - 1) / n, num_bytes)


def _measured(
    intra: Link,
    inter: Link,
    n: int,
    num_nodes: int,
    g_min: int,
    g_max: int,
    num_bytes: float,
    algorithm: str,
    phases: float,
    op: str,
) -> float:
    """`_collective` when a link has curves: the same flat / hierarchical choice, each phase timed
    on its own link ([Note: groups spanning nodes])."""
    if num_nodes == 1:
        return _ring_s(intra, op, phases, n, num_bytes)
    flat = _ring_s(inter, op, phases, n, num_bytes)
    if g_max > 1:
        flat = max(flat, _ring_s(intra, op, phases, n, num_bytes))
    if algorithm == "ring" or (algorithm == "auto" and g_max == 1):
        return flat
    hierarchical = _ring_s(intra, op, phases, g_max, num_bytes) + _ring_s(
        inter, op, phases, num_nodes, num_bytes / g_min
    )
    if algorithm == "hierarchical":
        return hierarchical
    return min(flat, hierarchical)


def _curve_time(curve: tuple[tuple[float, ...], ...], factor: float, num_bytes: float) -> float:
    """factor * N / busbw(N); below the smallest point, the smallest point's time."""
    size = max(num_bytes, curve[0][0])
    return factor * size / _busbw(curve, size)


@lru_cache(maxsize=65536)
def _busbw(curve: tuple[tuple[float, ...], ...], num_bytes: float) -> float:
    """Bus bandwidth at `num_bytes`: linear in (log size, log busbw) between points (a power law per
    segment, so time is monotone between points whose times are), clamped at both ends."""
    sizes, bws, log_sizes, log_bws = curve
    if num_bytes <= sizes[0]:
        return bws[0]
    if num_bytes >= sizes[-1]:
        return bws[-1]
    i = bisect.bisect_right(sizes, num_bytes)
    w = (math.log(num_bytes) - log_sizes[i - 1]) / (log_sizes[i] - log_sizes[i - 1])
    return math.exp(log_bws[i - 1] + w * (log_bws[i] - log_bws[i - 1]))


_LINK_FIELDS = ("intra_node", "inter_node")


def with_collective_curves(cluster: Cluster, collectives: Mapping[str, Any]) -> Cluster:
    """`cluster` with the measured curves of a calibration's `collectives` field (format in the
    module docstring) in place of its links' curves; a link the mapping does not name keeps its own.
    Malformed input raises a one-line ValueError naming the field."""
    if not isinstance(collectives, Mapping):
        raise ValueError(
            f"collectives must be a mapping with 'intra_node' and/or 'inter_node', got "
            f"{type(collectives).__name__}"
        )
    links = {"intra_node": cluster.intra_node, "inter_node": cluster.inter_node}
    for key, entry in collectives.items():
        where = f"collectives.{key}"
        if key == "source":
            if not isinstance(entry, str):
                raise ValueError(f"{where} must be a string, got {entry!r}")
            continue
        if key not in _LINK_FIELDS:
            raise ValueError(f"{where}: unknown field; allowed: {', '.join(_LINK_FIELDS)}, source")
        links[key] = dataclasses.replace(links[key], curves=_parse_link_curves(entry, where))
    return dataclasses.replace(cluster, intra_node=links["intra_node"], inter_node=links["inter_node"])


def _parse_link_curves(entry: Any, where: str) -> tuple[tuple[str, tuple[tuple[float, float], ...]], ...]:
    if not isinstance(entry, Mapping):
        raise ValueError(
            f'{where} must be a mapping like {{"ranks": 8, "all_reduce": [[bytes, busbw], ...]}}, '
            f"got {type(entry).__name__}"
        )
    curves = []
    for key, value in entry.items():
        if key == "ranks":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}.ranks must be a positive integer, got {value!r}")
            continue
        if key == "source":
            if not isinstance(value, str):
                raise ValueError(f"{where}.source must be a string, got {value!r}")
            continue
        if key not in CURVE_OPS:
            raise ValueError(
                f"{where}: unknown field {key!r}; allowed: {', '.join(CURVE_OPS)}, ranks, source"
            )
        curves.append((key, _parse_points(value, f"{where}.{key}")))
    if not curves:
        raise ValueError(f"{where} has no curve; give at least one of {', '.join(CURVE_OPS)}")
    return tuple(curves)


def _parse_points(value: Any, where: str) -> tuple[tuple[float, float], ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where} must be a non-empty list of [bytes, bytes_per_s] pairs")
    points = []
    for i, pair in enumerate(value):
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair)
            or not all(math.isfinite(v) and v > 0 for v in pair)
        ):
            raise ValueError(f"{where}[{i}] must be [bytes, bytes_per_s] with both numbers > 0, got {pair!r}")
        points.append((float(pair[0]), float(pair[1])))
    points.sort()
    for (a, _), (b, _) in zip(points, points[1:]):
        if a == b:
            raise ValueError(f"{where} gives size {a:g} twice; give one bandwidth per size")
    return tuple(points)
