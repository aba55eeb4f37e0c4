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

These functions are called ~1e5 times in a search: they are pure, use no networkx, and cache the
per-group layout (distinct nodes, ranks per node) by the tuple of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from autoplan.cluster.topology import Cluster

__all__ = [
    "ALGORITHMS",
    "allgather_time_s",
    "allreduce_time_s",
    "group_layout",
    "p2p_time_s",
    "reduce_scatter_time_s",
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
    return link.latency_s + num_bytes / link.bw_bytes_per_s


def allreduce_time_s(
    cluster: Cluster, ranks: Sequence[int], num_bytes: float, *, algorithm: str = "auto"
) -> float:
    """All-reduce of an N-byte buffer over `ranks` (see [Note: ring costs], [Note: groups spanning nodes])."""
    return _collective(cluster, ranks, num_bytes, algorithm, 2.0)


def allgather_time_s(
    cluster: Cluster, ranks: Sequence[int], num_bytes: float, *, algorithm: str = "auto"
) -> float:
    """All-gather producing an N-byte buffer on each rank (each contributes N/n)."""
    return _collective(cluster, ranks, num_bytes, algorithm, 1.0)


def reduce_scatter_time_s(
    cluster: Cluster, ranks: Sequence[int], num_bytes: float, *, algorithm: str = "auto"
) -> float:
    """Reduce-scatter of an N-byte buffer (each rank ends with N/n); same cost as all-gather."""
    return _collective(cluster, ranks, num_bytes, algorithm, 1.0)


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
    cluster: Cluster, ranks: Sequence[int], num_bytes: float, algorithm: str, phases: float
) -> float:
    """Ring cost with `phases` = 2 for all-reduce (RS + AG) and 1 for all-gather / reduce-scatter."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    n, num_nodes, g_min, g_max = _layout(cluster.gpus_per_node, cluster.num_gpus, tuple(ranks))
    if n <= 1 or num_bytes <= 0:
        return 0.0
    intra, inter = cluster.intra_node, cluster.inter_node
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
