"""Default links per GPU family: the vendors' bandwidths, estimated latencies and the measured-style
collective curves of the A100 / H100 node links, with where each figure comes from.

Apart from the `Link` model (cluster/links.py) and the `Cluster` (cluster/topology.py) because it is
data with citations, not logic: a cluster spec that names no links gets these, and YAML overrides them.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoplan.cluster.devices import GPU
from autoplan.cluster.links import GB, Curve, Link

__all__ = ["default_links"]

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
    Link(300 * GB, _NVLINK_LATENCY_S, "NVLink", _curves(_A100_NVLINK_COLL, _A100_NVLINK_P2P)),
    Link(25 * GB, _IB_LATENCY_S, "IB", _curves(_HDR_COLL, _HDR_P2P)),
)
# NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional -> 450 GB/s per direction.
# DGX H100 / H200 datasheets: 8x ConnectX-7 400 Gb/s NDR, one per GPU -> 50 GB/s per GPU.
_H100_LINKS = (
    Link(
        450 * GB,
        _NVLINK_LATENCY_S,
        "NVLink",
        _curves(_H100_NVLINK_AG_RS, _H100_NVLINK_P2P, all_reduce=_H100_NVLINK_AR),
    ),
    Link(50 * GB, _IB_LATENCY_S, "IB", _curves(_NDR_COLL, _NDR_P2P)),
)
# PCIe parts: PCIe Gen4 x16 32 GB/s / Gen5 x16 64 GB/s per direction (PCI-SIG PCIe 4.0 / 5.0 specs,
# 16 GT/s and 32 GT/s x 16 lanes, 128b/130b). Inter-node: an estimate of one 100 Gb/s NIC rail per
# GPU (12.5 GB/s); cloud instances often have less per GPU (AWS g5.48xlarge: 100 Gb/s for 8 GPUs,
# i.e. 1.5625 GB/s per GPU), so override inter_node_bw_gbps for them.
_PCIE4_LINKS = (Link(32 * GB, _PCIE_LATENCY_S, "PCIe"), Link(12.5 * GB, _IB_LATENCY_S, "Ethernet"))
_PCIE5_LINKS = (Link(64 * GB, _PCIE_LATENCY_S, "PCIe"), Link(12.5 * GB, _IB_LATENCY_S, "Ethernet"))
# NVIDIA V100 datasheet: NVLink 300 GB/s bidirectional -> 150 GB/s per direction.
# DGX-1V: 4x EDR 100 Gb/s InfiniBand for 8 GPUs -> 6.25 GB/s per GPU.
_V100_LINKS = (Link(150 * GB, _NVLINK_LATENCY_S, "NVLink"), Link(6.25 * GB, _IB_LATENCY_S, "IB"))
# AMD MI300X data sheet: 7 Infinity Fabric links, 128 GB/s bidirectional each (64 GB/s per direction)
# -> 448 GB/s per direction per GPU to its 7 peers in the fully connected 8-GPU platform (RCCL spreads
# rings over all links). Inter-node: 8x 400 Gb/s NICs per platform (typical), 50 GB/s per GPU.
_MI300X_LINKS = (Link(448 * GB, _NVLINK_LATENCY_S, "xGMI"), Link(50 * GB, _IB_LATENCY_S, "RoCE"))
# AMD Instinct MI325X data sheet: the MI300X's platform (7 Infinity Fabric links of 128 GB/s
# bidirectional to the 7 peers of the 8-GPU board), so the same links.
_MI325X_LINKS = _MI300X_LINKS
# NVIDIA Blackwell (DGX B200 and GB200 NVL72 datasheets, 2024): fifth-generation NVLink, 1.8 TB/s
# bidirectional per GPU -> 900 GB/s per direction, to every GPU of the NVLink domain (8 on a DGX
# B200's NVSwitch, 72 over a GB200 NVL72 rack's NVLink switch trays). Between domains: DGX B200 has 8x
# ConnectX-7 400 Gb/s, one per GPU -> 50 GB/s per GPU; a GB200 NVL72 compute tray has one 400 Gb/s
# ConnectX-7 per GPU as well (NVL72 reference architecture) -> 50 GB/s per GPU. No measured curves
# yet: alpha-beta until `autoplan calibrate` is run on one.
_BLACKWELL_LINKS = (Link(900 * GB, _NVLINK_LATENCY_S, "NVLink"), Link(50 * GB, _IB_LATENCY_S, "IB"))
# cpu (estimates): gloo over loopback / shared memory ~5 GB/s with ~20 us per message; between
# machines 10 Gb/s Ethernet = 1.25 GB/s with ~50 us TCP round-trip-scale latency.
_CPU_LINKS = (Link(5 * GB, 20e-6, "shm"), Link(1.25 * GB, 50e-6, "Ethernet"))

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
