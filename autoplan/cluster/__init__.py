"""Devices, cluster topology and collective communication costs (see docs/architecture.md, "cluster/")."""

from __future__ import annotations

from autoplan.cluster.collectives import (
    ALGORITHMS,
    allgather_time_s,
    allreduce_time_s,
    group_layout,
    p2p_time_s,
    reduce_scatter_time_s,
    with_collective_curves,
)
from autoplan.cluster.devices import (
    CPU_GFLOPS_ENV,
    CPU_GFLOPS_PER_CORE_DEFAULT,
    DTYPE_KEYS,
    GPU,
    GPUS,
    ClusterSpecError,
    cpu_device,
    dtype_key,
    get_gpu,
)
from autoplan.cluster.link_defaults import default_links
from autoplan.cluster.links import CURVE_OPS, Link
from autoplan.cluster.spec import PRESETS, parse_cluster
from autoplan.cluster.topology import Cluster, NodeGroup

__all__ = [
    "ALGORITHMS",
    "CPU_GFLOPS_ENV",
    "CPU_GFLOPS_PER_CORE_DEFAULT",
    "CURVE_OPS",
    "DTYPE_KEYS",
    "GPU",
    "GPUS",
    "PRESETS",
    "Cluster",
    "ClusterSpecError",
    "Link",
    "NodeGroup",
    "allgather_time_s",
    "allreduce_time_s",
    "cpu_device",
    "default_links",
    "dtype_key",
    "get_gpu",
    "group_layout",
    "p2p_time_s",
    "parse_cluster",
    "reduce_scatter_time_s",
    "with_collective_curves",
]
