"""Clusters: groups of identical nodes, two link classes, rank layout, and parsing of cluster specs.

A `Cluster` is one or more `NodeGroup`s (N nodes of G GPUs of one type; every group has the same G)
joined by two kinds of `Link`: `intra_node` (NVLink/NVSwitch, xGMI, PCIe, shared memory) between
GPUs of one node, and `inter_node` (InfiniBand, RoCE, Ethernet) between nodes. Bandwidths are per
GPU per direction, the way NVIDIA and nccl-tests quote them (one NIC rail per GPU on DGX systems).

Ranks are numbered node-major, the torchrun convention: rank = node * gpus_per_node + local_rank,
nodes numbered group after group.

Spec forms accepted by `parse_cluster`:

- a preset: "dgx-h100" (one node) or "4xdgx-h100" (four nodes); see `PRESETS`;
- a compact string "NODESxGPUS_PER_NODExGPU": "128x8xA100-80GB", "2x8xH100", "1x4xcpu";
- a path to a YAML file (*.yaml / *.yml)::

    name: my-cluster            # optional
    groups:                     # or top-level nodes / gpus_per_node / gpu for a uniform cluster
      - {nodes: 2, gpus_per_node: 8, gpu: H100-SXM-80GB}
      - {nodes: 2, gpus_per_node: 8, gpu: A100-SXM4-80GB}
    intra_node: {bw_gbps: 450, latency_us: 3}   # optional; default: the slowest group's GPU family
    inter_node: {bw_gbps: 50, latency_us: 5}    # bw_gbps is GB/s (1e9 bytes) per GPU per direction

  A link may instead give `bw_bytes_per_s` / `latency_s` (exact; what `Cluster.to_dict` writes) and
  an optional `kind` label ("NVLink", "IB", ...). `gpu` may be a mapping with the `GPU` fields
  (name, peak_flops, mem_bytes, mem_bw_bytes_per_s) for a device not in the table.

`Cluster.from_dict` takes the same mapping, so a cluster round-trips through JSON with `to_dict`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplan._files import parse_yaml
from autoplan.cluster.devices import GPU, GPUS, ClusterSpecError, cpu_device, get_gpu

if TYPE_CHECKING:  # networkx costs 0.2-0.4 s to import and only `Cluster.graph` uses it (issue 29)
    import networkx as nx

__all__ = [
    "PRESETS",
    "Cluster",
    "ClusterSpecError",
    "Link",
    "NodeGroup",
    "default_links",
    "parse_cluster",
]

_GB = 1e9
MAX_LINK_GBPS = 1e5
"""No link is faster (NVLink 5: 900 GB/s per GPU per direction); a bigger figure is a typo."""
MAX_LINK_LATENCY_S = 1.0
"""No link is slower to start a message (InfiniBand and NVLink: microseconds; TCP across a WAN: tens
of milliseconds); a bigger figure is a typo, usually microseconds written as seconds."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
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
                    or not all(_is_number(v) and 0 < v <= sys.float_info.max for v in point)):
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
        if not _is_number(self.bw_bytes_per_s) or not 0 < self.bw_bytes_per_s <= MAX_LINK_GBPS * _GB:
            raise ClusterSpecError(f"link bandwidth must be > 0 and at most {MAX_LINK_GBPS:g} GB/s "
                                   f"({MAX_LINK_GBPS * _GB:g} bytes/s), got {self.bw_bytes_per_s!r} bytes/s")
        if not _is_number(self.latency_s) or not 0 <= self.latency_s <= MAX_LINK_LATENCY_S:
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
        return self.bw_bytes_per_s / _GB


@dataclass(frozen=True)
class NodeGroup:
    """`num_nodes` identical nodes of `gpus_per_node` GPUs of type `gpu`."""

    num_nodes: int
    """Number of nodes in the group."""
    gpus_per_node: int
    """GPUs (ranks) per node."""
    gpu: GPU
    """The device type of every GPU in the group."""

    def __post_init__(self) -> None:
        if not _is_int(self.num_nodes) or self.num_nodes < 1:
            raise ClusterSpecError(f"nodes must be a positive integer, got {self.num_nodes!r}")
        if not _is_int(self.gpus_per_node) or self.gpus_per_node < 1:
            raise ClusterSpecError(f"gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        if not isinstance(self.gpu, GPU):
            raise ClusterSpecError(f"gpu must be a GPU (see autoplan.cluster.get_gpu), got {self.gpu!r}")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class Cluster:
    """Nodes, GPUs and links. Ranks are node-major: rank = node * gpus_per_node + local_rank."""

    name: str
    """Free-form label (the spec it was parsed from, or the YAML `name`)."""
    groups: tuple[NodeGroup, ...]
    """Node groups in rank order; all share `gpus_per_node`."""
    intra_node: Link
    """Link between two GPUs of one node."""
    inter_node: Link
    """Link between GPUs of different nodes (per GPU: each GPU has its own NIC rail)."""
    _group_first_node: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ClusterSpecError(f"cluster name must be a string, got {self.name!r}")
        if isinstance(self.groups, str | bytes | Mapping) or not isinstance(self.groups, Sequence):
            raise ClusterSpecError(f"cluster {self.name!r}: groups must be a sequence of NodeGroup, got {self.groups!r}")
        for group in self.groups:
            if not isinstance(group, NodeGroup):
                raise ClusterSpecError(f"cluster {self.name!r}: groups must hold NodeGroup(num_nodes, gpus_per_node, "
                                       f"gpu), got {group!r}")
        for attr in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, attr), Link):
                raise ClusterSpecError(f"cluster {self.name!r}: {attr} must be a Link(bw_bytes_per_s, latency_s), "
                                       f"got {getattr(self, attr)!r}")
        groups = tuple(self.groups)
        object.__setattr__(self, "groups", groups)
        if not groups:
            raise ClusterSpecError(f"cluster {self.name!r}: groups is empty; give at least one node group")
        per_node = {g.gpus_per_node for g in groups}
        if len(per_node) > 1:
            raise ClusterSpecError(
                f"cluster {self.name!r}: groups have different gpus_per_node {sorted(per_node)}; "
                "all groups must have the same gpus_per_node"
            )
        firsts, total = [], 0
        for g in groups:
            firsts.append(total)
            total += g.num_nodes
        object.__setattr__(self, "_group_first_node", tuple(firsts))

    # -- sizes -------------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return sum(g.num_nodes for g in self.groups)

    @property
    def gpus_per_node(self) -> int:
        return self.groups[0].gpus_per_node

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def is_homogeneous(self) -> bool:
        """Whether every GPU is the same type."""
        return all(g.gpu == self.groups[0].gpu for g in self.groups)

    @property
    def gpu(self) -> GPU:
        """The single GPU type; ValueError on a mixed cluster (use `gpu_of_rank`)."""
        if not self.is_homogeneous:
            names = sorted({g.gpu.name for g in self.groups})
            raise ValueError(f"cluster {self.name!r} mixes GPU types {names}; use gpu_of_rank(rank)")
        return self.groups[0].gpu

    @property
    def gpu_types(self) -> tuple[GPU, ...]:
        """Distinct GPU types in group order."""
        return tuple(dict.fromkeys(g.gpu for g in self.groups))

    # -- rank layout -------------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_gpus:
            raise IndexError(f"rank {rank} out of range for {self.num_gpus} GPUs in cluster {self.name!r}")

    def node_of_rank(self, rank: int) -> int:
        """The node index of `rank` (node-major numbering)."""
        self._check_rank(rank)
        return rank // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        """`rank`'s index within its node."""
        self._check_rank(rank)
        return rank % self.gpus_per_node

    def group_of_node(self, node: int) -> int:
        """Index into `groups` of the group that holds `node`."""
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} out of range for {self.num_nodes} nodes in cluster {self.name!r}")
        return bisect.bisect_right(self._group_first_node, node) - 1

    def gpu_of_rank(self, rank: int) -> GPU:
        """The GPU type of `rank`."""
        return self.groups[self.group_of_node(self.node_of_rank(rank))].gpu

    def ranks_of_node(self, node: int) -> range:
        """The ranks on `node`."""
        self.group_of_node(node)  # range check
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def ranks_of_group(self, index: int) -> range:
        """The ranks of `groups[index]`."""
        first = self._group_first_node[index] * self.gpus_per_node
        return range(first, first + self.groups[index].num_gpus)

    def link(self, a: int, b: int) -> Link:
        """The link between ranks `a` and `b`: intra-node if they share a node, else inter-node."""
        return self.intra_node if self.node_of_rank(a) == self.node_of_rank(b) else self.inter_node

    # -- derived clusters and views ----------------------------------------------------------------

    def with_bandwidth(
        self, intra_node_bw_gbps: float | None = None, inter_node_bw_gbps: float | None = None
    ) -> Cluster:
        """A copy with the given link bandwidths (GB/s = 1e9 bytes/s, per GPU per direction).

        An overridden link drops its measured curves: the figure given is what the user wants used.
        """
        intra, inter = self.intra_node, self.inter_node
        if intra_node_bw_gbps is not None:
            intra = dataclasses.replace(
                intra, bw_bytes_per_s=_bw_arg("intra_node_bw_gbps", intra_node_bw_gbps), curves=()
            )
        if inter_node_bw_gbps is not None:
            inter = dataclasses.replace(
                inter, bw_bytes_per_s=_bw_arg("inter_node_bw_gbps", inter_node_bw_gbps), curves=()
            )
        return dataclasses.replace(self, intra_node=intra, inter_node=inter)

    def without_curves(self) -> Cluster:
        """A copy whose links use their alpha-beta figures only (no measured curves)."""
        return dataclasses.replace(
            self, intra_node=self.intra_node.without_curves(), inter_node=self.inter_node.without_curves()
        )

    def describe(self) -> str:
        """One line, e.g. "2 nodes x 8 H100-SXM-80GB, NVLink 450 GB/s, IB 50 GB/s per GPU per direction"."""
        parts = []
        for g in self.groups:
            plural = "node" if g.num_nodes == 1 else "nodes"
            parts.append(f"{g.num_nodes} {plural} x {g.gpus_per_node} {g.gpu.name}")
        intra = f"{self.intra_node.kind or 'intra-node'} {self.intra_node.bw_gbps:g} GB/s"
        inter = f"{self.inter_node.kind or 'inter-node'} {self.inter_node.bw_gbps:g} GB/s"
        return f"{' + '.join(parts)}, {intra}, {inter} per GPU per direction"

    def graph(self) -> nx.Graph:
        """The topology as an undirected networkx graph (for reports and placement checks, not costs).

        [Note: topology graph] Nodes: one per rank (int; attributes `node`, `local_rank`, `gpu` name,
        `kind="gpu"`), one switch per physical node (`("switch", node)`, `kind="switch"`: NVSwitch or
        the PCIe root) and one `"fabric"` node (`kind="fabric"`: the inter-node network, modelled as
        non-blocking, like a fat tree). Edges carry `bw_bytes_per_s`, `latency_s`, `kind`:
        rank-switch edges have the intra-node per-GPU bandwidth and half its latency, so a
        GPU-switch-GPU path has the intra-node link's latency; switch-fabric edges carry the node's
        aggregate NIC bandwidth (inter-node per-GPU bandwidth x gpus_per_node, one rail per GPU) and
        half the inter-node latency. A single-node cluster has no fabric node.
        """
        import networkx as nx

        g = nx.Graph(name=self.name)
        gpn = self.gpus_per_node
        multi_node = self.num_nodes > 1
        if multi_node:
            g.add_node("fabric", kind="fabric")
        for node in range(self.num_nodes):
            gpu = self.groups[self.group_of_node(node)].gpu
            switch = ("switch", node)
            g.add_node(switch, kind="switch", node=node)
            if multi_node:
                g.add_edge(
                    switch,
                    "fabric",
                    bw_bytes_per_s=self.inter_node.bw_bytes_per_s * gpn,
                    latency_s=self.inter_node.latency_s / 2,
                    kind=self.inter_node.kind or "inter-node",
                )
            for local in range(gpn):
                rank = node * gpn + local
                g.add_node(rank, kind="gpu", node=node, local_rank=local, gpu=gpu.name)
                g.add_edge(
                    rank,
                    switch,
                    bw_bytes_per_s=self.intra_node.bw_bytes_per_s,
                    latency_s=self.intra_node.latency_s / 2,
                    kind=self.intra_node.kind or "intra-node",
                )
        return g

    # -- serialization -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON/YAML-ready mapping that `Cluster.from_dict` (and `parse_cluster` via YAML) reads back."""

        def gpu_entry(gpu: GPU) -> str | dict[str, Any]:
            if (gpu.name in GPUS and GPUS[gpu.name] == gpu) or gpu.name == "cpu":
                return gpu.name
            return {
                "name": gpu.name,
                "peak_flops": dict(gpu.peak_flops),
                "mem_bytes": gpu.mem_bytes,
                "mem_bw_bytes_per_s": gpu.mem_bw_bytes_per_s,
                "source": gpu.source,
            }

        def link_entry(link: Link) -> dict[str, Any]:
            entry: dict[str, Any] = {
                "bw_bytes_per_s": link.bw_bytes_per_s,
                "latency_s": link.latency_s,
                "kind": link.kind,
            }
            if link.curves:
                entry["curves"] = {op: [list(p) for p in points] for op, points in link.curves}
            return entry

        return {
            "name": self.name,
            "groups": [
                {"nodes": g.num_nodes, "gpus_per_node": g.gpus_per_node, "gpu": gpu_entry(g.gpu)}
                for g in self.groups
            ],
            "intra_node": link_entry(self.intra_node),
            "inter_node": link_entry(self.inter_node),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "cluster") -> Cluster:
        """Build from the YAML schema in the module docstring; `where` prefixes error messages."""
        return _from_mapping(data, where)


# --------------------------------------------------------------------------------------------------
# Default links per GPU family.
#
# Bandwidths are the vendor's per-GPU figures halved to one direction. Latencies are estimates of
# the per-step alpha of a ring collective: NCCL's own tuning model (src/graph/tuning.cc, hwLat /
# baseLat tables) puts a ring step at a few microseconds over NVLink and ~5-15 us over the network,
# consistent with the small-message all-reduce times nccl-tests reports. Override them in YAML.
# --------------------------------------------------------------------------------------------------

_NVLINK_LATENCY_S = 3e-6  # estimate, see above
_PCIE_LATENCY_S = 5e-6  # estimate: a PCIe hop through the host bridge
_IB_LATENCY_S = 6e-6  # estimate: IB/RoCE verbs ~2 us one-way plus NCCL proxy overhead

# Measured-style bus bandwidth curves of the A100 / H100 node links ([Note: measured curves] in
# cluster/collectives.py): (bytes, busbw bytes/s) at 8 KiB, 1 MiB, 32 MiB and 1 GiB. How each point was
# obtained:
# - the large-size busbw is a published NCCL figure where one was found, else the datasheet rate times
#   a stated efficiency ("assumed");
# - the 8 KiB point is a small-message time (latency-bound; "assumed" figures say so), written as busbw
#   for the group size the curve stands for (8 ranks in a node; 2 nodes x 1 rank across nodes);
# - the 1 MiB and 32 MiB points are assumed: the alpha-beta line through those two anchors,
#   t(N) = t_8KiB + factor * N / peak_busbw, as busbw.
# `autoplan calibrate` on the machine (calibration JSON, `collectives`) replaces all of them.
_KIB8, _MIB, _MIB32, _GIB = 8192, 2**20, 2**25, 2**30

# A100 NVLink3/NVSwitch, 8 GPUs, NCCL ring (A100 has no NVLink SHARP). Peak busbw: assumed 0.8 x 300 GB/s
# = 240 GB/s, the share of the NVLink line rate NCCL's protocol reaches per NVIDIA's NCCL maintainer
# ("450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink
# bandwidth of 370GB/s", H100; https://github.com/NVIDIA/nccl-tests/issues/212). 8 KiB: assumed 12 us
# per all-reduce (a 2-GPU A100-SXM4 all_reduce_perf bottoms out at 10.1 us,
# https://github.com/NVIDIA/nccl/issues/583; 8 ranks assumed a little slower), 6 us per all-gather /
# reduce-scatter (one ring pass), 8 us per p2p message.
_A100_NVLINK_COLL = ((_KIB8, 1.19e9), (_MIB, 93.4e9), (_MIB32, 229e9), (_GIB, 240e9))
_A100_NVLINK_P2P = ((_KIB8, 1.02e9), (_MIB, 84.8e9), (_MIB32, 227e9), (_GIB, 240e9))
# H100 NVLink4/NVSwitch, 8 GPUs. All-reduce runs NVLink SHARP (NVLS) by default: "On 8 GPUs, you should
# reach a peak busBw of ~480GB/s (algbw ~275GB/s). You need to run on larger sizes though; 256M is too
# small" (https://github.com/NVIDIA/nccl-tests/issues/212); 480 GB/s at 2-4 GB with NVLS and 365-370 GB/s
# with ring (https://github.com/NVIDIA/nccl/issues/1455). Points: 4 GiB 480 GB/s (published), 1 GiB
# 450 GB/s (assumed, below that peak). All-gather, reduce-scatter and p2p: 370 GB/s, the effective
# NVLink bandwidth "you can observe as BusBw when running non-allreduce operations" (nccl-tests#212,
# above). 8 KiB: assumed 12 us / 6 us / 8 us as for A100.
_H100_NVLINK_AR = ((_KIB8, 1.19e9), (_MIB, 114e9), (_MIB32, 412e9), (_GIB, 450e9), (4 * _GIB, 480e9))
_H100_NVLINK_AG_RS = ((_KIB8, 1.19e9), (_MIB, 108e9), (_MIB32, 344e9), (_GIB, 370e9))
_H100_NVLINK_P2P = ((_KIB8, 1.02e9), (_MIB, 96.8e9), (_MIB32, 340e9), (_GIB, 370e9))
# Inter-node, per GPU (one NIC rail; measured with one rank per node). NDR 400 Gb/s: "For NDR @ 400Gbps
# you should see 46-48GB/s per NIC" (NVIDIA, https://github.com/NVIDIA/nccl-tests/issues/290) -> 47 GB/s.
# HDR 200 Gb/s: assumed the same share of the 25 GB/s line rate (0.94) -> 23.5 GB/s. 8 KiB: assumed
# 20 us per 2-node all-reduce (IB verbs ~2 us plus NCCL's proxy and two ring steps), 10 us per
# all-gather / reduce-scatter and per p2p message.
_HDR_COLL = ((_KIB8, 0.403e9), (_MIB, 16.2e9), (_MIB32, 23.2e9), (_GIB, 23.5e9))
_HDR_P2P = ((_KIB8, 0.792e9), (_MIB, 19.2e9), (_MIB32, 23.3e9), (_GIB, 23.5e9))
_NDR_COLL = ((_KIB8, 0.406e9), (_MIB, 24.8e9), (_MIB32, 45.7e9), (_GIB, 47e9))
_NDR_P2P = ((_KIB8, 0.805e9), (_MIB, 32.5e9), (_MIB32, 46.4e9), (_GIB, 47e9))


def _curves(coll: Curve, p2p: Curve, all_reduce: Curve | None = None) -> tuple[tuple[str, Curve], ...]:
    return (("all_reduce", all_reduce or coll), ("all_gather", coll), ("reduce_scatter", coll), ("p2p", p2p))


# NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional per GPU -> 300 GB/s per direction.
# DGX A100 datasheet: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU -> 25 GB/s per GPU.
_A100_LINKS = (
    Link(300 * _GB, _NVLINK_LATENCY_S, "NVLink", _curves(_A100_NVLINK_COLL, _A100_NVLINK_P2P)),
    Link(25 * _GB, _IB_LATENCY_S, "IB", _curves(_HDR_COLL, _HDR_P2P)),
)
# NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional -> 450 GB/s per direction.
# DGX H100 / H200 datasheets: 8x ConnectX-7 400 Gb/s NDR, one per GPU -> 50 GB/s per GPU.
_H100_LINKS = (
    Link(
        450 * _GB,
        _NVLINK_LATENCY_S,
        "NVLink",
        _curves(_H100_NVLINK_AG_RS, _H100_NVLINK_P2P, all_reduce=_H100_NVLINK_AR),
    ),
    Link(50 * _GB, _IB_LATENCY_S, "IB", _curves(_NDR_COLL, _NDR_P2P)),
)
# PCIe parts: PCIe Gen4 x16 32 GB/s / Gen5 x16 64 GB/s per direction (PCI-SIG PCIe 4.0 / 5.0 specs,
# 16 GT/s and 32 GT/s x 16 lanes, 128b/130b). Inter-node: an estimate of one 100 Gb/s NIC rail per
# GPU (12.5 GB/s); cloud instances often have less per GPU (AWS g5.48xlarge: 100 Gb/s for 8 GPUs,
# i.e. 1.5625 GB/s per GPU), so override inter_node_bw_gbps for them.
_PCIE4_LINKS = (Link(32 * _GB, _PCIE_LATENCY_S, "PCIe"), Link(12.5 * _GB, _IB_LATENCY_S, "Ethernet"))
_PCIE5_LINKS = (Link(64 * _GB, _PCIE_LATENCY_S, "PCIe"), Link(12.5 * _GB, _IB_LATENCY_S, "Ethernet"))
# NVIDIA V100 datasheet: NVLink 300 GB/s bidirectional -> 150 GB/s per direction.
# DGX-1V: 4x EDR 100 Gb/s InfiniBand for 8 GPUs -> 6.25 GB/s per GPU.
_V100_LINKS = (Link(150 * _GB, _NVLINK_LATENCY_S, "NVLink"), Link(6.25 * _GB, _IB_LATENCY_S, "IB"))
# AMD MI300X data sheet: 7 Infinity Fabric links, 128 GB/s bidirectional each (64 GB/s per direction)
# -> 448 GB/s per direction per GPU to its 7 peers in the fully connected 8-GPU platform (RCCL spreads
# rings over all links). Inter-node: 8x 400 Gb/s NICs per platform (typical), 50 GB/s per GPU.
_MI300X_LINKS = (Link(448 * _GB, _NVLINK_LATENCY_S, "xGMI"), Link(50 * _GB, _IB_LATENCY_S, "RoCE"))
# AMD Instinct MI325X data sheet: the MI300X's platform (7 Infinity Fabric links of 128 GB/s
# bidirectional to the 7 peers of the 8-GPU board), so the same links.
_MI325X_LINKS = _MI300X_LINKS
# NVIDIA Blackwell (DGX B200 and GB200 NVL72 datasheets, 2024): fifth-generation NVLink, 1.8 TB/s
# bidirectional per GPU -> 900 GB/s per direction, to every GPU of the NVLink domain (8 on a DGX
# B200's NVSwitch, 72 over a GB200 NVL72 rack's NVLink switch trays). Between domains: DGX B200 has 8x
# ConnectX-7 400 Gb/s, one per GPU -> 50 GB/s per GPU; a GB200 NVL72 compute tray has one 400 Gb/s
# ConnectX-7 per GPU as well (NVL72 reference architecture) -> 50 GB/s per GPU. No measured curves
# yet: alpha-beta until `autoplan calibrate` is run on one.
_BLACKWELL_LINKS = (Link(900 * _GB, _NVLINK_LATENCY_S, "NVLink"), Link(50 * _GB, _IB_LATENCY_S, "IB"))
# cpu (estimates): gloo over loopback / shared memory ~5 GB/s with ~20 us per message; between
# machines 10 Gb/s Ethernet = 1.25 GB/s with ~50 us TCP round-trip-scale latency.
_CPU_LINKS = (Link(5 * _GB, 20e-6, "shm"), Link(1.25 * _GB, 50e-6, "Ethernet"))

_DEFAULT_LINKS: dict[str, tuple[Link, Link]] = {
    "A100-SXM4-40GB": _A100_LINKS,
    "A100-SXM4-80GB": _A100_LINKS,
    "H100-SXM-80GB": _H100_LINKS,
    "H200-SXM-141GB": _H100_LINKS,
    "H100-PCIe-80GB": _PCIE5_LINKS,
    "L40S": _PCIE4_LINKS,
    "A10G": _PCIE4_LINKS,
    "V100-SXM2-32GB": _V100_LINKS,
    "MI300X": _MI300X_LINKS,
    "MI325X": _MI325X_LINKS,
    "B200-SXM-180GB": _BLACKWELL_LINKS,
    "GB200": _BLACKWELL_LINKS,
    "cpu": _CPU_LINKS,
}


def default_links(gpus: GPU | Sequence[GPU]) -> tuple[Link, Link]:
    """(intra_node, inter_node) defaults for a GPU type; for several types, the slowest of each.

    An unknown device (custom GPU from YAML) gets PCIe Gen4 links.
    """
    if isinstance(gpus, GPU):
        gpus = [gpus]
    pairs = [_DEFAULT_LINKS.get(g.name, _PCIE4_LINKS) for g in gpus]
    intra = min((p[0] for p in pairs), key=lambda link: (link.bw_bytes_per_s, -link.latency_s))
    inter = min((p[1] for p in pairs), key=lambda link: (link.bw_bytes_per_s, -link.latency_s))
    return intra, inter


def _uniform(name: str, gpu: GPU | str, num_nodes: int, gpus_per_node: int) -> Cluster:
    gpu = _device(gpu if isinstance(gpu, GPU) else get_gpu(gpu), gpus_per_node)
    intra, inter = default_links(gpu)
    return Cluster(name, (NodeGroup(num_nodes, gpus_per_node, gpu),), intra, inter)


def _device(gpu: GPU, gpus_per_node: int) -> GPU:
    """`cpu` ranks on one machine share it: each gets 1/gpus_per_node of its cores and memory."""
    return cpu_device(gpus_per_node) if gpu.name == "cpu" else gpu


def _preset(display: str, gpu: str, gpus_per_node: int) -> Callable[[int], Cluster]:
    def make(num_nodes: int = 1) -> Cluster:
        name = display if num_nodes == 1 else f"{num_nodes}x{display}"
        return _uniform(name, gpu, num_nodes, gpus_per_node)

    make.__doc__ = f"`num_nodes` x {display}: {gpus_per_node} x {gpu} per node, default links."
    return make


PRESETS: dict[str, Callable[[int], Cluster]] = {
    # NVIDIA DGX A100 / H100 / H200 system datasheets: 8 GPUs on NVSwitch, one IB NIC per GPU.
    "dgx-a100": _preset("dgx-a100", "A100-SXM4-80GB", 8),
    "dgx-a100-40gb": _preset("dgx-a100-40gb", "A100-SXM4-40GB", 8),
    "dgx-h100": _preset("dgx-h100", "H100-SXM-80GB", 8),
    "dgx-h200": _preset("dgx-h200", "H200-SXM-141GB", 8),
    # DGX-1 with V100: 8 GPUs in an NVLink hybrid cube mesh (modelled as uniform NVLink).
    "dgx-v100": _preset("dgx-v100", "V100-SXM2-32GB", 8),
    # NVIDIA DGX B200 datasheet: 8 B200 on NVSwitch, one 400 Gb/s NIC per GPU.
    "dgx-b200": _preset("dgx-b200", "B200-SXM-180GB", 8),
    # NVIDIA GB200 NVL72: one NVLink domain of 72 GPUs (18 compute trays of 2 Grace + 4 Blackwell),
    # modelled as one "node" of 72 GPUs, since a node here is the domain the fast link spans. The
    # launchers (`autoplan run`, the exports' torchrun lines) also read a node as one host, which an
    # NVL72 rack is not: run them with 4 processes per tray.
    "gb200-nvl72": _preset("gb200-nvl72", "GB200", 72),
    # AMD Instinct MI300X / MI325X platforms: 8 GPUs, fully connected Infinity Fabric.
    "mi300x-8": _preset("mi300x-8", "MI300X", 8),
    "mi325x-8": _preset("mi325x-8", "MI325X", 8),
    # AWS EC2 instances (per the EC2 instance-type pages): g5.48xlarge 8x A10G, g6e.48xlarge 8x L40S.
    "g5-48xlarge": _preset("g5-48xlarge", "A10G", 8),
    "g6e-48xlarge": _preset("g6e-48xlarge", "L40S", 8),
    # This machine as one rank; "1x4xcpu" gives four ranks sharing it.
    "cpu": _preset("cpu", "cpu", 1),
    "laptop": _preset("laptop", "cpu", 1),
}
"""Named node types; each maps a node count to a `Cluster` ("dgx-h100" is 1 node, "4xdgx-h100" 4)."""


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------

_SPLIT = re.compile(r"\s*([^xX]*?)\s*[xX]\s*(.+?)\s*")
_FORMS = "a preset (e.g. dgx-h100, 4xdgx-h100), 'NODESxGPUS_PER_NODExGPU' (e.g. 2x8xH100) or a .yaml file"


def parse_cluster(
    spec: str | os.PathLike[str] | Cluster,
    *,
    intra_node_bw_gbps: float | None = None,
    inter_node_bw_gbps: float | None = None,
) -> Cluster:
    """Parse a preset name, a compact "NODESxGPUS_PER_NODExGPU" string or a YAML file path.

    Bandwidth overrides are GB/s (1e9 bytes/s) per GPU per direction and replace the spec's (or its
    defaults). A `Cluster` passes through (with the overrides applied).
    """
    if isinstance(spec, Cluster):
        cluster = spec
    elif isinstance(spec, os.PathLike) or (
        isinstance(spec, str) and spec.strip().lower().endswith((".yaml", ".yml"))
    ):
        cluster = _load_yaml(Path(spec).expanduser())
    elif isinstance(spec, str):
        cluster = _parse_string(spec)
    else:
        raise ClusterSpecError(
            f"cluster spec must be a string or path, got {type(spec).__name__}; use {_FORMS}"
        )
    if intra_node_bw_gbps is not None or inter_node_bw_gbps is not None:
        cluster = cluster.with_bandwidth(intra_node_bw_gbps, inter_node_bw_gbps)
    return cluster


def _parse_string(spec: str) -> Cluster:
    text = spec.strip()
    if not text:
        raise ClusterSpecError(f"cluster spec is empty; use {_FORMS}")
    if text.lower() in PRESETS:
        return PRESETS[text.lower()](1)
    m = _SPLIT.fullmatch(text)
    if m is None:
        raise ClusterSpecError(f"cluster spec {spec!r} is not {_FORMS}; presets: {', '.join(PRESETS)}")
    first, rest = m.group(1), m.group(2)
    if rest.lower() in PRESETS:
        return PRESETS[rest.lower()](_count(first, "nodes", spec))
    m2 = _SPLIT.fullmatch(rest)
    if m2 is None and not first.isdigit():
        raise ClusterSpecError(f"cluster spec {spec!r} is not {_FORMS}; presets: {', '.join(PRESETS)}")
    if m2 is None:
        raise ClusterSpecError(
            f"cluster spec {spec!r} has 2 fields; use NODESxGPUS_PER_NODExGPU (e.g. 1x{first}x{rest}) "
            f"or NODESxPRESET with a preset in {', '.join(PRESETS)}"
        )
    num_nodes = _count(first, "nodes", spec)
    gpus_per_node = _count(m2.group(1), "gpus_per_node", spec)
    gpu_name = m2.group(2)
    try:
        gpu = get_gpu(gpu_name)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"cluster spec {spec!r}: {e}") from None
    return _uniform(text, gpu, num_nodes, gpus_per_node)


def _count(text: str, what: str, spec: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ClusterSpecError(f"cluster spec {spec!r}: {what} must be a positive integer, got {text!r}")
    return int(text)


def _load_yaml(path: Path) -> Cluster:
    try:
        text = path.read_text()
    except OSError as e:
        raise ClusterSpecError(
            f"cannot read cluster file {str(path)!r}: {e.strerror or e}; check the path"
        ) from None
    data = parse_yaml(text, f"cluster file {str(path)!r}", ClusterSpecError)
    cluster = _from_mapping(data, str(path))
    if not cluster.name:
        cluster = dataclasses.replace(cluster, name=path.stem)
    return cluster


_TOP_KEYS = {"name", "groups", "nodes", "gpus_per_node", "gpu", "intra_node", "inter_node"}
_GROUP_KEYS = {"nodes", "gpus_per_node", "gpu"}
_LINK_KEYS = {"bw_gbps", "bw_bytes_per_s", "latency_us", "latency_s", "kind", "curves"}
_GPU_KEYS = {"name", "peak_flops", "mem_bytes", "mem_bw_bytes_per_s", "source"}


def _from_mapping(data: Any, where: str) -> Cluster:
    if not isinstance(data, Mapping):
        raise ClusterSpecError(
            f"{where}: expected a mapping with 'groups' (or nodes/gpus_per_node/gpu), got "
            f"{type(data).__name__}"
        )
    _no_unknown(data, _TOP_KEYS, where)
    name = data.get("name", "")
    if not isinstance(name, str):
        raise ClusterSpecError(f"{where}: name must be a string, got {name!r}")
    uniform_keys = [k for k in ("nodes", "gpus_per_node", "gpu") if k in data]
    if "groups" in data:
        if uniform_keys:
            raise ClusterSpecError(f"{where}: give either groups or top-level {uniform_keys}, not both")
        raw_groups = data["groups"]
        if not isinstance(raw_groups, list) or not raw_groups:
            raise ClusterSpecError(
                f"{where}: groups must be a non-empty list of {{nodes, gpus_per_node, gpu}}"
            )
        groups = tuple(_group(g, f"{where}: groups[{i}]") for i, g in enumerate(raw_groups))
    elif uniform_keys:
        groups = (_group({k: data[k] for k in uniform_keys}, where),)
    else:
        raise ClusterSpecError(f"{where}: missing field 'groups' (or top-level nodes, gpus_per_node, gpu)")
    per_node = {g.gpus_per_node for g in groups}
    if len(per_node) > 1:
        raise ClusterSpecError(
            f"{where}: groups have different gpus_per_node {sorted(per_node)}; all groups must have the same"
        )
    intra_default, inter_default = default_links([g.gpu for g in groups])
    intra = _link(data.get("intra_node"), intra_default, f"{where}: intra_node")
    inter = _link(data.get("inter_node"), inter_default, f"{where}: inter_node")
    return Cluster(name, groups, intra, inter)


def _group(raw: Any, where: str) -> NodeGroup:
    if not isinstance(raw, Mapping):
        raise ClusterSpecError(f"{where} must be a mapping {{nodes, gpus_per_node, gpu}}, got {raw!r}")
    _no_unknown(raw, _GROUP_KEYS, where)
    for key in ("nodes", "gpus_per_node", "gpu"):
        if key not in raw:
            raise ClusterSpecError(f"{where}: missing field '{key}'")
    for key in ("nodes", "gpus_per_node"):
        if not _is_int(raw[key]) or raw[key] < 1:
            raise ClusterSpecError(f"{where}: {key} must be a positive integer, got {raw[key]!r}")
    gpu = _gpu(raw["gpu"], f"{where}: gpu")
    return NodeGroup(raw["nodes"], raw["gpus_per_node"], _device(gpu, raw["gpus_per_node"]))


def _gpu(raw: Any, where: str) -> GPU:
    if isinstance(raw, str):
        try:
            return get_gpu(raw)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{where}: {e}") from None
    if isinstance(raw, Mapping):
        _no_unknown(raw, _GPU_KEYS, where)
        missing = [k for k in ("name", "peak_flops", "mem_bytes", "mem_bw_bytes_per_s") if k not in raw]
        if missing:
            raise ClusterSpecError(f"{where}: missing field '{missing[0]}'")
        if not isinstance(raw["peak_flops"], Mapping):
            raise ClusterSpecError(f"{where}: peak_flops must be a mapping like {{bf16: 3.12e14}}")
        fields = dict(raw)
        fields["peak_flops"] = {k: _yaml_number(v) for k, v in raw["peak_flops"].items()}
        fields["mem_bw_bytes_per_s"] = _yaml_number(raw["mem_bw_bytes_per_s"])
        mem = _yaml_number(raw["mem_bytes"])
        fields["mem_bytes"] = int(mem) if _is_number(mem) and float(mem).is_integer() else mem
        try:
            return GPU(**fields)
        except ClusterSpecError as e:
            raise ClusterSpecError(f"{where}: {e}") from None
    raise ClusterSpecError(f"{where} must be a GPU name (e.g. H100) or a mapping of GPU fields, got {raw!r}")


def _link(raw: Any, default: Link, where: str) -> Link:
    if raw is None:
        return default
    if not isinstance(raw, Mapping):
        raise ClusterSpecError(f"{where} must be a mapping like {{bw_gbps: 450, latency_us: 3}}, got {raw!r}")
    _no_unknown(raw, _LINK_KEYS, where)
    for a, b in (("bw_gbps", "bw_bytes_per_s"), ("latency_us", "latency_s")):
        if a in raw and b in raw:
            raise ClusterSpecError(f"{where}: give {a} or {b}, not both")
    bw, latency = default.bw_bytes_per_s, default.latency_s
    for key, scale in (("bw_gbps", _GB), ("bw_bytes_per_s", 1.0)):
        if key in raw:
            value = _yaml_number(raw[key])
            if not _is_number(value) or not 0 < value <= MAX_LINK_GBPS * _GB / scale:
                raise ClusterSpecError(f"{where}: {key} must be a positive number of at most "
                                       f"{MAX_LINK_GBPS * _GB / scale:g}, got {raw[key]!r}")
            bw = value * scale
    for key, divisor in (("latency_us", 1e6), ("latency_s", 1.0)):
        if key in raw:
            value = _yaml_number(raw[key])
            if not _is_number(value) or not 0 <= value <= MAX_LINK_LATENCY_S * divisor:
                raise ClusterSpecError(f"{where}: {key} must be a number >= 0 and at most "
                                       f"{MAX_LINK_LATENCY_S * divisor:g}, got {raw[key]!r}")
            latency = value / divisor
    kind = raw.get("kind", default.kind)
    if not isinstance(kind, str):
        raise ClusterSpecError(f"{where}: kind must be a string, got {kind!r}")
    # A link given by its own figures drops the default's measured curves unless it brings its own.
    own_figures = any(k in raw for k in ("bw_gbps", "bw_bytes_per_s", "latency_us", "latency_s"))
    curves = () if own_figures else default.curves
    if "curves" in raw:
        raw_curves = raw["curves"]
        if not isinstance(raw_curves, Mapping):
            raise ClusterSpecError(f"{where}: curves must map an operation to [[bytes, bytes_per_s], ...]")
        # Numeric strings become numbers (`_yaml_number`); Link checks the shape and names a wrong point.
        curves = tuple(
            (op, [[_yaml_number(v) for v in p] if isinstance(p, list) else p for p in points]
             if isinstance(points, list) else points)
            for op, points in raw_curves.items()
        )
    try:
        return Link(float(bw), float(latency), kind, curves)
    except ClusterSpecError as e:
        raise ClusterSpecError(f"{where}: {e}") from None


def _no_unknown(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        raise ClusterSpecError(
            f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(sorted(allowed))}"
        )


def _yaml_number(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads `1.0e14` as a string (it wants `1.0e+14`): accept numeric strings."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value




def _bw_arg(name: str, value: float) -> float:
    if not _is_number(value) or not math.isfinite(value) or not 0 < value <= MAX_LINK_GBPS:
        raise ClusterSpecError(f"{name} must be a finite number of GB/s above 0 and at most {MAX_LINK_GBPS:g}, "
                               f"got {value!r}")
    return float(value) * _GB
