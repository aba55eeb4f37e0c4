"""Communication overlapped with compute: what of a collective the step still waits for.

[Note: DP buckets] Data-parallel gradient reduction as PyTorch DDP does it (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 13(12), Sec. 3.2.3; default
`bucket_cap_mb=25`): gradients are packed, in the order the backward produces them, into buckets
of `bucket_bytes`; a bucket's all-reduce is launched once all its gradients are ready, and
all-reduces run one after another on the communication stream. Here gradients become ready at an
even rate over the rank's last backward pass (its stages' backward of the last micro-batch, the
only one after which gradients are final), so full bucket j (1-based) is ready at
j * bucket_bytes / grad_bytes of the backward, and the last bucket (the remainder) at its end:

    end_j = max(ready_j, end_{j-1}) + t_bucket        (t_bucket: one bucket's all-reduce)
    exposed = end_last - backward_s

With equal buckets and evenly spaced ready times the recurrence has a closed form (max-plus:
end_k = max over j <= k of ready_j + (k - j + 1) t_bucket, and the maximum sits at j = 1 or j = k),
so the cost is two collective evaluations whatever the bucket count. Consequences: a reduction
that keeps up with the backward (t_bucket <= the gap between buckets) is hidden except the last
bucket's all-reduce; one that does not is exposed by about its total time minus the backward plus
the first bucket's wait; one bucket (gradients smaller than a bucket) is fully exposed. The
earlier model, max(0, all-reduce - backward), is the limit of many buckets on a link without
per-message latency.

[Note: FSDP communication]
Sharded data parallelism (zero 2 / 3) as FSDP2 runs it (Zhao et al. 2023, "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", VLDB 16(12), Sec. 3-4; ZeRO stages 2 and 3,
Rajbhandari et al. 2020, Sec. 5 and 7.2), one unit per block the graph calls whole:
- All-gather of a unit's parameters over its shard group, in the compute dtype (bf16: 2 bytes per
  parameter; fp32: 4). Zero 3 gathers every unit in every micro-batch's forward and again in its
  backward (`reshard_after_forward=True`); zero 2 once per step, in the first forward.
- Reduce-scatter of a unit's gradient over the shard group in the reduce dtype (fp32 by default,
  `reduce_dtype=fp32`; bf16 when the plan says so: `ParallelConfig.reduce_dtype`); with HSDP
  (dp_replicate > 1) it is followed by an all-reduce of the 1/dp_shard shard across the replicate
  group (Zhao et al. 2023, Sec. 3.2.2, hybrid sharding; torch's `foreach_reduce` runs the two one
  after the other). With pp = 1 this happens after every micro-batch's backward, unit by unit (FSDP's
  autograd hooks); with pp > 1 gradients accumulate unsharded and each unit is reduced once, after
  the stage's last backward, unoverlapped (torch's pipelining does the same).
- Prefetching (Zhao et al. 2023, Sec. 4.2): FSDP2 issues the next unit's all-gather while the
  current unit computes, forward and backward, and a unit's reduce-scatter runs while the next unit
  (in backward order) computes. One communication stream's worth of bandwidth is shared, so during
  unit j's compute c_j the link carries the next unit's all-gather a_{j+1} and the previous unit's
  reduce-scatter r_{j-1}; the pass is exposed by

      exposed = a_0 + r_{K-1} + sum_j max(0, a_{j+1} + r_{j-1} - c_j)          (`prefetch_exposed_s`)

  (units in execution order: the first unit's gather and the last unit's reduction cannot hide).
  It is the first gather plus max(0, gather - compute) per unit when there is no reduction, and the
  total communication minus all but one unit's compute when the link is the bottleneck.
[Note: overlap slowdown]
Communication that overlaps compute is not free: NCCL's kernels occupy streaming multiprocessors
and memory bandwidth beside the GEMMs (Rashidi et al. 2021, "Enabling Compute-Communication
Overlap in Distributed Deep Learning Training Platforms", ISCA, Sec. 3, measure 10-40% compute
slowdown under overlapped all-reduce; Jangda et al. 2022, CoCoNet, ASPLOS, Sec. 2). With the
calibration's `overlap_slowdown` s, each second of a collective that runs beside compute lengthens
that compute by s seconds: a unit whose compute c overlaps communication l adds
max(0, l - c) + s min(l, c). s is fitted to published runs (benchmarks/validate_published.py).

Ranks: the dp index is replicate index * dp_shard + shard index (torchtitan's mesh order, pp,
dp_replicate, dp_shard, tp; runtime/parallel/mesh.py `build_layout`), so a shard group is dp_shard
consecutive replicas: inside a node under rank order tp-dp-pp when tp * dp_shard divides it, and the
replicate group strides across nodes. Collective times come from cluster/collectives.py for the
actual ranks (intra-node, or the cheaper of a flat ring and the hierarchical scheme across nodes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autoplan.cluster import Cluster, allgather_time_s, allreduce_time_s, reduce_scatter_time_s

__all__ = ["DDP_BUCKET_BYTES", "dp_reduction_exposed_s", "fsdp_groups",
           "fsdp_unit_times_s", "prefetch_exposed_s", "priced_once"]

DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default bucket size, `bucket_cap_mb=25` (Li et al. 2020, Sec. 3.2.3)."""


def dp_reduction_exposed_s(
    cluster: Cluster,
    ranks: Sequence[int],
    grad_bytes: float,
    backward_s: float,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    slowdown: float = 0.0,
    overlap: bool = True,
) -> float:
    """Seconds of the bucketed gradient all-reduce over `ranks` left after the backward ends
    ([Note: DP buckets]), plus what the part hidden behind the backward costs it ([Note: overlap
    slowdown]). `backward_s` is the last backward pass on the rank, during which the `grad_bytes`
    of gradients become ready. `overlap=False`: a stack that reduces after the backward, whole."""
    if len(ranks) <= 1 or grad_bytes <= 0:
        return 0.0
    if not overlap:  # one all-reduce of the whole buffer after the backward (calibration `overlap_grad_reduce`)
        return allreduce_time_s(cluster, ranks, grad_bytes)
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes!r}")
    backward_s = max(0.0, backward_s)
    num_full = math.floor(grad_bytes / bucket_bytes)
    remainder = grad_bytes - num_full * bucket_bytes
    if remainder <= 0:  # the last full bucket is the last bucket
        num_full, remainder = num_full - 1, bucket_bytes
    last_s = allreduce_time_s(cluster, ranks, remainder)
    if num_full <= 0:
        return last_s
    bucket_s = allreduce_time_s(cluster, ranks, bucket_bytes)
    gap_s = backward_s * bucket_bytes / grad_bytes  # between the ready times of two full buckets
    chain_end = max(gap_s + num_full * bucket_s, num_full * gap_s + bucket_s)
    exposed = max(backward_s, chain_end) + last_s - backward_s
    hidden = min(backward_s, max(0.0, num_full * bucket_s + last_s - exposed))
    return exposed + slowdown * hidden


def fsdp_groups(first_rank: int, dp_stride: int, dp: int, dp_replicate: int) -> tuple[range, range]:
    """(shard group, replicate group) of the replica with dp index 0, as global ranks: `first_rank`
    is its rank, `dp_stride` the rank distance between neighbouring dp indices ([Note: FSDP
    communication]: dp index = replicate index * dp_shard + shard index)."""
    shard = dp // dp_replicate
    return (range(first_rank, first_rank + dp_stride * shard, dp_stride),
            range(first_rank, first_rank + dp_stride * dp, dp_stride * shard))


def fsdp_unit_times_s(cluster: Cluster, shard_ranks: Sequence[int], replicate_ranks: Sequence[int],
                      unit_params: np.ndarray, gather_bytes_per_param: float,
                      reduce_bytes_per_param: float = 4.0) -> tuple[np.ndarray, np.ndarray]:
    """Per unit: seconds of its parameters' all-gather and of its gradient's reduction (reduce-scatter
    over the shard group, then with HSDP the all-reduce of the shard over the replicate group), in
    `reduce_bytes_per_param` bytes an element (4: fp32); see [Note: FSDP communication]. Units of
    equal size are priced once."""
    params = np.asarray(unit_params, dtype=float)
    gather = np.zeros(len(params))
    reduce = np.zeros(len(params))
    shard = len(shard_ranks)
    sizes, inverse = np.unique(params, return_inverse=True)
    for j, n in enumerate(sizes):
        if n <= 0:
            continue
        grad_bytes = n * reduce_bytes_per_param
        g = allgather_time_s(cluster, shard_ranks, n * gather_bytes_per_param)
        r = reduce_scatter_time_s(cluster, shard_ranks, grad_bytes)
        if len(replicate_ranks) > 1:
            r += allreduce_time_s(cluster, replicate_ranks, grad_bytes / shard)
        gather[inverse == j] = g
        reduce[inverse == j] = r
    return gather, reduce


def prefetch_exposed_s(compute_s: np.ndarray, ahead_s: np.ndarray | None = None,
                       behind_s: np.ndarray | None = None, slowdown: float = 0.0) -> float:
    """Seconds a pass over units (in execution order) waits for communication that FSDP overlaps
    with it ([Note: FSDP communication]): `ahead_s[j]`, unit j's all-gather, prefetched during unit
    j - 1's compute; `behind_s[j]`, unit j's reduction, run during unit j + 1's compute; plus the
    slowdown of the compute it overlaps ([Note: overlap slowdown])."""
    compute = np.asarray(compute_s, dtype=float)
    n = len(compute)
    if n == 0:
        return 0.0
    load = np.zeros(n)
    exposed = 0.0
    if ahead_s is not None:
        ahead = np.asarray(ahead_s, dtype=float)
        load[:-1] += ahead[1:]
        exposed += float(ahead[0])
    if behind_s is not None:
        behind = np.asarray(behind_s, dtype=float)
        load[1:] += behind[:-1]
        exposed += float(behind[-1])
    return (exposed + float(np.maximum(load - compute, 0.0).sum())
            + slowdown * float(np.minimum(load, compute).sum()))


def priced_once(num_bytes: np.ndarray, price) -> np.ndarray:
    """`price(n)` for every positive entry of `num_bytes` (0 elsewhere), each distinct size priced once
    (a transformer's layers all move the same bytes)."""
    priced: dict[float, float] = {}
    out = np.zeros(len(num_bytes))
    for i, n in enumerate(num_bytes):
        if n > 0:
            if n not in priced:
                priced[n] = price(float(n))
            out[i] = priced[n]
    return out
