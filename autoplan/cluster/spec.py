"""Cluster specs: the named presets and `parse_cluster`, which reads a preset, a compact
"NODESxGPUS_PER_NODExGPU" string or a YAML file into a `Cluster`.

Spec forms accepted by `parse_cluster`:

- a preset: "dgx-h100" (one node) or "4xdgx-h100" (four nodes); see `PRESETS`;
- a compact string "NODESxGPUS_PER_NODExGPU": "128x8xA100-80GB", "2x8xH100", "1x4xcpu";
- a path to a YAML file (*.yaml / *.yml) in the schema of `Cluster.from_dict` (cluster/topology.py).

Apart from the `Cluster` model (cluster/topology.py): this is how a user names a cluster on the
command line, the model is what the search and the runtime read.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path

from autoplan._files import parse_yaml
from autoplan.cluster.devices import GPU, ClusterSpecError, get_gpu, rank_device
from autoplan.cluster.link_defaults import default_links
from autoplan.cluster.topology import Cluster, NodeGroup

__all__ = ["PRESETS", "parse_cluster"]


def _uniform(name: str, gpu: GPU | str, num_nodes: int, gpus_per_node: int) -> Cluster:
    gpu = rank_device(gpu if isinstance(gpu, GPU) else get_gpu(gpu), gpus_per_node)
    intra, inter = default_links(gpu)
    return Cluster(name, (NodeGroup(num_nodes, gpus_per_node, gpu),), intra, inter)



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
    cluster = Cluster.from_dict(data, where=str(path))
    if not cluster.name:
        cluster = dataclasses.replace(cluster, name=path.stem)
    return cluster
