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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autoplan.cluster import Cluster, allreduce_time_s

__all__ = ["DDP_BUCKET_BYTES", "dp_reduction_exposed_s"]

DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default bucket size, `bucket_cap_mb=25` (Li et al. 2020, Sec. 3.2.3)."""


def dp_reduction_exposed_s(
    cluster: Cluster,
    ranks: Sequence[int],
    grad_bytes: float,
    backward_s: float,
    bucket_bytes: float = DDP_BUCKET_BYTES,
) -> float:
    """Seconds of the bucketed gradient all-reduce over `ranks` left after the backward ends
    ([Note: DP buckets]). `backward_s` is the last backward pass on the rank, during which the
    `grad_bytes` of gradients become ready."""
    if len(ranks) <= 1 or grad_bytes <= 0:
        return 0.0
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
    return max(backward_s, chain_end) + last_s - backward_s
