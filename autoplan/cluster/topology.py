"""Clusters: groups of identical nodes joined by two link classes, the rank layout, and the mapping
(YAML / JSON) form of a cluster.

A `Cluster` is one or more `NodeGroup`s (N nodes of G GPUs of one type; every group has the same G)
joined by two kinds of `Link` (cluster/links.py): `intra_node` (NVLink/NVSwitch, xGMI, PCIe, shared
memory) between GPUs of one node, and `inter_node` (InfiniBand, RoCE, Ethernet) between nodes.
Bandwidths are per GPU per direction, the way NVIDIA and nccl-tests quote them (one NIC rail per GPU
on DGX systems).

Ranks are numbered node-major, the torchrun convention: rank = node * gpus_per_node + local_rank,
nodes numbered group after group.

The mapping form, which `Cluster.from_dict` reads and a YAML cluster file holds (see `parse_cluster`
in cluster/spec.py for the other spec forms)::

    name: my-cluster            # optional
    groups:                     # or top-level nodes / gpus_per_node / gpu for a uniform cluster
      - {nodes: 2, gpus_per_node: 8, gpu: H100-SXM-80GB}
      - {nodes: 2, gpus_per_node: 8, gpu: A100-SXM4-80GB}
    intra_node: {bw_gbps: 450, latency_us: 3}   # optional; default: the slowest group's GPU family
    inter_node: {bw_gbps: 50, latency_us: 5}    # bw_gbps is GB/s (1e9 bytes) per GPU per direction

  A link may instead give `bw_bytes_per_s` / `latency_s` (exact; what `Cluster.to_dict` writes) and
  an optional `kind` label ("NVLink", "IB", ...). `gpu` may be a mapping with the `GPU` fields
  (name, peak_flops, mem_bytes, mem_bw_bytes_per_s) for a device not in the table.

`Cluster.from_dict` takes that mapping, so a cluster round-trips through JSON with `to_dict`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autoplan.cluster.devices import GPU, GPUS, ClusterSpecError, get_gpu, rank_device
from autoplan.cluster.link_defaults import default_links
from autoplan.cluster.links import GB, MAX_LINK_GBPS, MAX_LINK_LATENCY_S, Link, is_int, is_number

if TYPE_CHECKING:  # networkx costs 0.2-0.4 s to import and only `Cluster.graph` uses it (issue 29)
    import networkx as nx

__all__ = ["Cluster", "NodeGroup"]


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
        if not is_int(self.num_nodes) or self.num_nodes < 1:
            raise ClusterSpecError(f"nodes must be a positive integer, got {self.num_nodes!r}")
        if not is_int(self.gpus_per_node) or self.gpus_per_node < 1:
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
# The mapping (YAML / JSON) form, read by `Cluster.from_dict`
# --------------------------------------------------------------------------------------------------

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
        if not is_int(raw[key]) or raw[key] < 1:
            raise ClusterSpecError(f"{where}: {key} must be a positive integer, got {raw[key]!r}")
    gpu = _gpu(raw["gpu"], f"{where}: gpu")
    return NodeGroup(raw["nodes"], raw["gpus_per_node"], rank_device(gpu, raw["gpus_per_node"]))


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
        fields["mem_bytes"] = int(mem) if is_number(mem) and float(mem).is_integer() else mem
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
    for key, scale in (("bw_gbps", GB), ("bw_bytes_per_s", 1.0)):
        if key in raw:
            value = _yaml_number(raw[key])
            if not is_number(value) or not 0 < value <= MAX_LINK_GBPS * GB / scale:
                raise ClusterSpecError(f"{where}: {key} must be a positive number of at most "
                                       f"{MAX_LINK_GBPS * GB / scale:g}, got {raw[key]!r}")
            bw = value * scale
    for key, divisor in (("latency_us", 1e6), ("latency_s", 1.0)):
        if key in raw:
            value = _yaml_number(raw[key])
            if not is_number(value) or not 0 <= value <= MAX_LINK_LATENCY_S * divisor:
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
    if not is_number(value) or not math.isfinite(value) or not 0 < value <= MAX_LINK_GBPS:
        raise ClusterSpecError(f"{name} must be a finite number of GB/s above 0 and at most {MAX_LINK_GBPS:g}, "
                               f"got {value!r}")
    return float(value) * GB
