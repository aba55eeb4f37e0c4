"""autoplan.cluster: device table, cluster parsing, topology graph, collective costs (pure logic)."""

from __future__ import annotations

import json
import math

import networkx as nx
import pytest

from autoplan.cluster import (
    GPU,
    GPUS,
    PRESETS,
    Cluster,
    ClusterSpecError,
    Link,
    NodeGroup,
    allgather_time_s,
    allreduce_time_s,
    cpu_device,
    get_gpu,
    group_layout,
    p2p_time_s,
    parse_cluster,
    reduce_scatter_time_s,
)

# -- devices ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("A100", "A100-SXM4-80GB"),
        ("a100-80gb", "A100-SXM4-80GB"),
        ("A100-40GB", "A100-SXM4-40GB"),
        ("H100", "H100-SXM-80GB"),
        ("h100-80GB", "H100-SXM-80GB"),
        ("H200", "H200-SXM-141GB"),
        ("l40s", "L40S"),
        ("A10G", "A10G"),
        ("V100", "V100-SXM2-32GB"),
        ("mi300x", "MI300X"),
        ("H100-PCIe-80GB", "H100-PCIe-80GB"),
    ],
)
def test_get_gpu_aliases(alias: str, canonical: str) -> None:
    assert get_gpu(alias).name == canonical
    assert get_gpu(alias) is GPUS[canonical]


def test_get_gpu_unknown_lists_known_names() -> None:
    with pytest.raises(ClusterSpecError, match="unknown gpu 'B300'.*H100-SXM-80GB.*cpu"):
        get_gpu("B300")


def test_datasheet_numbers() -> None:
    a100 = GPUS["A100-SXM4-80GB"]
    assert a100.peak("bfloat16") == 312e12
    assert a100.peak("float32") == 19.5e12  # fp32, not tf32
    assert a100.peak("tf32") == 156e12
    assert a100.mem_bw_bytes_per_s == 2.039e12
    h100 = GPUS["H100-SXM-80GB"]
    assert h100.peak("bf16") == pytest.approx(989.4e12)
    assert h100.peak("float32") == 67e12
    assert h100.mem_bw_bytes_per_s == 3.35e12
    assert GPUS["V100-SXM2-32GB"].peak("float16") == 125e12
    for gpu in GPUS.values():
        assert gpu.source, gpu.name
        assert 10 * 2**30 < gpu.mem_bytes < 300 * 2**30  # MI325X: 256 GB
        # tensor-core dtypes are never slower than fp32
        assert all(v >= gpu.peak_flops["fp32"] for v in gpu.peak_flops.values())


def test_peak_unsupported_dtype() -> None:
    with pytest.raises(ValueError, match="V100-SXM2-32GB has no bf16"):
        GPUS["V100-SXM2-32GB"].peak("bfloat16")
    with pytest.raises(ValueError, match="unknown dtype"):
        GPUS["H100-SXM-80GB"].peak("int4")


def test_peak_accepts_torch_dtype() -> None:
    torch = pytest.importorskip("torch")
    assert GPUS["A100-SXM4-80GB"].peak(torch.bfloat16) == 312e12


def test_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("AUTOPLAN_CPU_GFLOPS_PER_CORE", raising=False)
    cpu = get_gpu("CPU")
    cores = os.cpu_count() or 1
    assert cpu.name == "cpu"
    assert cpu.peak("float32") == pytest.approx(cores * 50e9)
    assert cpu.peak("bfloat16") == cpu.peak("float32")
    # fp16 is planned on CPU ranks too (the runtime trains it with a loss scale): at the fp32 figure
    # with native fp16 matmul instructions, else at 1/16 of it (devices.py [Note: cpu fp16]).
    assert cpu.peak("float16") in (pytest.approx(cpu.peak("float32")), pytest.approx(cpu.peak("float32") / 16))
    assert cpu.mem_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setenv("AUTOPLAN_CPU_GFLOPS_PER_CORE", "10")
    assert get_gpu("cpu").peak("fp32") == pytest.approx(cores * 10e9)
    assert cpu_device(2).peak("fp32") == pytest.approx(cores * 10e9 / 2)
    monkeypatch.setenv("AUTOPLAN_CPU_GFLOPS_PER_CORE", "fast")
    with pytest.raises(ClusterSpecError, match="AUTOPLAN_CPU_GFLOPS_PER_CORE='fast'"):
        get_gpu("cpu")


def test_gpu_validation() -> None:
    with pytest.raises(ClusterSpecError, match="peak_flops key 'int8'"):
        GPU(name="x", peak_flops={"int8": 1.0}, mem_bytes=1, mem_bw_bytes_per_s=1.0)
    with pytest.raises(ClusterSpecError, match="mem_bytes"):
        GPU(name="x", peak_flops={"fp32": 1.0}, mem_bytes=-1, mem_bw_bytes_per_s=1.0)


# -- parsing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "num_nodes", "gpus_per_node", "gpu", "intra_gbps", "inter_gbps"),
    [
        ("dgx-a100", 1, 8, "A100-SXM4-80GB", 300, 25),
        ("DGX-H100", 1, 8, "H100-SXM-80GB", 450, 50),
        ("4xdgx-h100", 4, 8, "H100-SXM-80GB", 450, 50),
        ("2xdgx-h200", 2, 8, "H200-SXM-141GB", 450, 50),
        ("128x8xA100-80GB", 128, 8, "A100-SXM4-80GB", 300, 25),
        ("2x8xH100", 2, 8, "H100-SXM-80GB", 450, 50),
        ("2 x 8 x H100", 2, 8, "H100-SXM-80GB", 450, 50),
        ("1x8xMI300X", 1, 8, "MI300X", 448, 50),
        ("1x4xL40S", 1, 4, "L40S", 32, 12.5),
        ("1x2xH100-PCIe-80GB", 1, 2, "H100-PCIe-80GB", 64, 12.5),
        ("1x4xcpu", 1, 4, "cpu", 5, 1.25),
        ("cpu", 1, 1, "cpu", 5, 1.25),
    ],
)
def test_parse_compact_and_presets(
    spec: str, num_nodes: int, gpus_per_node: int, gpu: str, intra_gbps: float, inter_gbps: float
) -> None:
    c = parse_cluster(spec)
    assert (c.num_nodes, c.gpus_per_node, c.num_gpus) == (num_nodes, gpus_per_node, num_nodes * gpus_per_node)
    assert c.gpu.name == gpu
    assert c.is_homogeneous
    assert c.intra_node.bw_bytes_per_s == pytest.approx(intra_gbps * 1e9)
    assert c.inter_node.bw_bytes_per_s == pytest.approx(inter_gbps * 1e9)


def test_every_preset_builds() -> None:
    for name, make in PRESETS.items():
        assert make(1) == parse_cluster(name)
        assert parse_cluster(f"3x{name}").num_nodes == 3


def test_cpu_ranks_share_the_machine() -> None:
    one, four = parse_cluster("1x1xcpu").gpu, parse_cluster("1x4xcpu").gpu
    assert four.peak("fp32") == pytest.approx(one.peak("fp32") / 4)
    assert four.mem_bytes == one.mem_bytes // 4


def test_bandwidth_overrides() -> None:
    c = parse_cluster("2x8xH100", intra_node_bw_gbps=400, inter_node_bw_gbps=25)
    assert c.intra_node.bw_bytes_per_s == 400e9
    assert c.inter_node.bw_bytes_per_s == 25e9
    assert c.inter_node.latency_s == parse_cluster("2x8xH100").inter_node.latency_s
    only_inter = parse_cluster("dgx-a100", inter_node_bw_gbps=12.5)
    assert only_inter.intra_node.bw_bytes_per_s == 300e9
    assert only_inter.inter_node.bw_bytes_per_s == 12.5e9
    with pytest.raises(ClusterSpecError, match="inter_node_bw_gbps"):
        parse_cluster("dgx-a100", inter_node_bw_gbps=-1)


def test_describe() -> None:
    assert parse_cluster("2x8xH100").describe() == (
        "2 nodes x 8 H100-SXM-80GB, NVLink 450 GB/s, IB 50 GB/s per GPU per direction"
    )
    assert parse_cluster("dgx-a100").describe().startswith("1 node x 8 A100-SXM4-80GB, NVLink 300 GB/s")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("8xH100", "'8xH100' has 2 fields"),
        ("0x8xH100", "nodes must be a positive integer, got '0'"),
        ("2x0xH100", "gpus_per_node must be a positive integer, got '0'"),
        ("2x8xFOO", "unknown gpu 'FOO'"),
        ("ax8xH100", "nodes must be a positive integer, got 'a'"),
        ("-1x8xH100", "nodes must be a positive integer, got '-1'"),
        ("2.5x8xH100", "nodes must be a positive integer, got '2.5'"),
        ("dgx-h10", "not a preset"),
        ("0xdgx-h100", "nodes must be a positive integer, got '0'"),
        ("", "cluster spec is empty"),
        ("missing.yaml", "cannot read cluster file"),
    ],
)
def test_malformed_compact(spec: str, match: str) -> None:
    with pytest.raises(ClusterSpecError, match=match) as info:
        parse_cluster(spec)
    assert "\n" not in str(info.value)


MIXED_YAML = """
name: mixed
groups:
  - {nodes: 2, gpus_per_node: 8, gpu: H100-SXM-80GB}
  - {nodes: 2, gpus_per_node: 8, gpu: A100-SXM4-80GB}
inter_node: {bw_gbps: 50, latency_us: 5}
"""


def test_yaml_mixed_groups(tmp_path) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text(MIXED_YAML)
    c = parse_cluster(str(path))
    assert c.name == "mixed"
    assert (c.num_nodes, c.num_gpus, c.gpus_per_node) == (4, 32, 8)
    assert not c.is_homogeneous
    assert c.gpu_of_rank(0).name == "H100-SXM-80GB"
    assert c.gpu_of_rank(15).name == "H100-SXM-80GB"
    assert c.gpu_of_rank(16).name == "A100-SXM4-80GB"
    assert c.gpu_of_rank(31).name == "A100-SXM4-80GB"
    assert [g.name for g in c.gpu_types] == ["H100-SXM-80GB", "A100-SXM4-80GB"]
    assert c.ranks_of_group(1) == range(16, 32)
    with pytest.raises(ValueError, match="mixes GPU types"):
        _ = c.gpu
    # intra default: the slowest group's NVLink (A100's 300 GB/s); inter from the file
    assert c.intra_node.bw_bytes_per_s == 300e9
    assert c.inter_node == Link(50e9, 5e-6, "IB")
    assert "2 nodes x 8 H100-SXM-80GB + 2 nodes x 8 A100-SXM4-80GB" in c.describe()


def test_yaml_uniform_and_path_object(tmp_path) -> None:
    path = tmp_path / "uniform.yml"
    path.write_text("nodes: 2\ngpus_per_node: 4\ngpu: a100\nintra_node: {bw_gbps: 100}\n")
    c = parse_cluster(path, inter_node_bw_gbps=10)
    assert c.name == "uniform"
    assert (c.num_nodes, c.gpus_per_node, c.gpu.name) == (2, 4, "A100-SXM4-80GB")
    assert c.intra_node.bw_bytes_per_s == 100e9
    assert c.intra_node.latency_s == parse_cluster("dgx-a100").intra_node.latency_s
    assert c.inter_node.bw_bytes_per_s == 10e9


def test_yaml_custom_gpu(tmp_path) -> None:
    path = tmp_path / "custom.yaml"
    path.write_text(
        "nodes: 1\ngpus_per_node: 2\n"
        "gpu: {name: MyChip, peak_flops: {bf16: 1.0e14}, mem_bytes: 1000000000, mem_bw_bytes_per_s: 1.0e11}\n"
    )
    c = parse_cluster(str(path))
    assert c.gpu.name == "MyChip"
    assert c.gpu.peak("bf16") == 1e14
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("groups:\n  - {nodes: 2, gpu: H100}\n", r"groups\[0\]: missing field 'gpus_per_node'"),
        ("groups:\n  - {nodes: -2, gpus_per_node: 8, gpu: H100}\n", r"groups\[0\]: nodes must be a positive"),
        (
            "groups:\n  - {nodes: two, gpus_per_node: 8, gpu: H100}\n",
            r"nodes must be a positive integer, got 'two'",
        ),
        (
            "groups:\n  - {nodes: 1, gpus_per_node: 8.0, gpu: H100}\n",
            r"gpus_per_node must be a positive integer",
        ),
        ("groups:\n  - {nodes: 1, gpus_per_node: 8, gpu: FOO}\n", r"groups\[0\]: gpu: unknown gpu 'FOO'"),
        ("groups:\n  - {nodes: 1, gpus_per_node: 8, gpu: 7}\n", r"groups\[0\]: gpu must be a GPU name"),
        (
            "groups:\n  - {nodes: 1, gpus_per_node: 8, gpu: H100}\n  - {nodes: 1, gpus_per_node: 4, gpu: H100}\n",
            "different gpus_per_node",
        ),
        ("groups: []\n", "groups must be a non-empty list"),
        ("groups: {nodes: 1}\n", "groups must be a non-empty list"),
        ("name: x\n", "missing field 'groups'"),
        ("nodes: 1\ngpus_per_node: 8\n", "missing field 'gpu'"),
        ("nodes: 1\ngpus_per_node: 8\ngpu: H100\ngroups: []\n", "either groups or top-level"),
        ("nodes: 1\ngpus_per_node: 8\ngpu: H100\nnode: 2\n", "unknown field 'node'"),
        ("nodes: 1\ngpus_per_node: 8\ngpu: H100\nintra_node: {bw_gbps: -5}\n", "intra_node: bw_gbps must be"),
        (
            "nodes: 1\ngpus_per_node: 8\ngpu: H100\ninter_node: {latency_us: -1}\n",
            "inter_node: latency_us must",
        ),
        ("nodes: 1\ngpus_per_node: 8\ngpu: H100\ninter_node: {bw_gbps: fast}\n", "inter_node: bw_gbps must"),
        ("nodes: 1\ngpus_per_node: 8\ngpu: H100\ninter_node: 50\n", "inter_node must be a mapping"),
        ("nodes: 1\ngpus_per_node: 8\ngpu: H100\ninter_node: {bandwidth: 5}\n", "unknown field 'bandwidth'"),
        ("nodes: 1\ngpus_per_node: 8\ngpu: H100\nname: 3\n", "name must be a string"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("nodes: [1\n", r"is not valid YAML \(line 2\)"),
    ],
)
def test_malformed_yaml(tmp_path, text: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ClusterSpecError, match=match) as info:
        parse_cluster(str(path))
    assert "\n" not in str(info.value)
    assert "bad.yaml" in str(info.value)


def test_to_dict_round_trip() -> None:
    for spec in ["dgx-a100", "4x8xH100", "1x4xcpu"]:
        c = parse_cluster(spec, inter_node_bw_gbps=33.3)
        assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_cluster_validation() -> None:
    h100, a100 = GPUS["H100-SXM-80GB"], GPUS["A100-SXM4-80GB"]
    link = Link(1e9, 0.0)
    with pytest.raises(ClusterSpecError, match="different gpus_per_node"):
        Cluster("x", (NodeGroup(1, 8, h100), NodeGroup(1, 4, a100)), link, link)
    with pytest.raises(ClusterSpecError, match="groups is empty"):
        Cluster("x", (), link, link)
    with pytest.raises(ClusterSpecError, match="gpus_per_node must be a positive integer"):
        NodeGroup(1, 0, h100)
    with pytest.raises(ClusterSpecError, match="bandwidth must be > 0"):
        Link(0.0, 1e-6)


# -- layout and graph ---------------------------------------------------------------------------------


def test_rank_layout() -> None:
    c = parse_cluster("3x4xH100")
    assert [c.node_of_rank(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert c.local_rank(6) == 2
    assert c.ranks_of_node(1) == range(4, 8)
    assert c.link(0, 3) is c.intra_node
    assert c.link(3, 4) is c.inter_node
    with pytest.raises(IndexError):
        c.node_of_rank(12)
    assert group_layout(c, [0, 1, 4, 8, 9, 10]) == (6, 3, 1, 3)


@pytest.mark.parametrize("spec", ["dgx-a100", "3x4xH100", "1x1xcpu"])
def test_graph(spec: str) -> None:
    c = parse_cluster(spec)
    g = c.graph()
    ranks = [n for n, d in g.nodes(data=True) if d["kind"] == "gpu"]
    assert sorted(ranks) == list(range(c.num_gpus))
    assert sum(1 for _, d in g.nodes(data=True) if d["kind"] == "switch") == c.num_nodes
    assert nx.is_connected(g)
    assert g.nodes[c.num_gpus - 1]["node"] == c.num_nodes - 1
    assert g.nodes[0]["gpu"] == c.gpu_of_rank(0).name
    for _, _, d in g.edges(data=True):
        assert d["bw_bytes_per_s"] > 0 and d["latency_s"] >= 0
    if c.num_nodes > 1:
        # a cross-node path goes GPU - switch - fabric - switch - GPU
        assert nx.shortest_path_length(g, 0, c.num_gpus - 1) == 4
        latency = nx.shortest_path_length(g, 0, c.num_gpus - 1, weight="latency_s")
        assert latency == pytest.approx(c.intra_node.latency_s + c.inter_node.latency_s)


# -- collectives --------------------------------------------------------------------------------------

COLLECTIVES = [allreduce_time_s, allgather_time_s, reduce_scatter_time_s]


@pytest.mark.parametrize("fn", COLLECTIVES)
def test_single_rank_and_empty_are_free(fn) -> None:
    c = parse_cluster("2x8xH100")
    assert fn(c, [3], 1e9) == 0.0
    assert fn(c, [], 1e9) == 0.0
    assert fn(c, range(16), 0) == 0.0


def test_p2p() -> None:
    c = parse_cluster("2x8xH100").without_curves()  # alpha-beta; the measured curves: test_comm_curves.py
    assert p2p_time_s(c, 1, 1, 1e9) == 0.0
    assert p2p_time_s(c, 0, 1, 450e6) == pytest.approx(3e-6 + 1e-3)
    assert p2p_time_s(c, 0, 8, 50e6) == pytest.approx(6e-6 + 1e-3)


def _two_node_cluster() -> Cluster:
    """2 nodes x 4 GPUs, intra 100 GB/s / 2 us, inter 10 GB/s / 10 us: easy numbers by hand."""
    return Cluster("t", (NodeGroup(2, 4, GPUS["H100-SXM-80GB"]),), Link(100e9, 2e-6), Link(10e9, 10e-6))


def test_ring_numbers_by_hand() -> None:
    c = _two_node_cluster()
    n_bytes = 1e9
    # inside one node, 4 ranks: 2*(3/4)*1e9/100e9 + 2*3*2e-6
    assert allreduce_time_s(c, range(4), n_bytes) == pytest.approx(0.015 + 12e-6)
    assert allgather_time_s(c, range(4), n_bytes) == pytest.approx(0.0075 + 6e-6)
    # one rank per node, 2 ranks: ring over the inter-node link, 2*(1/2)*1e9/10e9 + 2*1*10e-6
    assert allreduce_time_s(c, [0, 4], n_bytes) == pytest.approx(0.1 + 20e-6)
    assert reduce_scatter_time_s(c, [1, 5], n_bytes) == pytest.approx(0.05 + 10e-6)
    # all 8 ranks, flat ring: 2*(7/8)*1e9/10e9 + 2*7*10e-6
    flat = allreduce_time_s(c, range(8), n_bytes, algorithm="ring")
    assert flat == pytest.approx(0.175 + 140e-6)
    # hierarchical: intra RS+AG over 4 ranks 2*(3/4*1e9/100e9 + 3*2e-6), inter AR over 2 nodes of 1e9/4 bytes
    # 2*(1/2*0.25e9/10e9 + 1*10e-6)
    hier = allreduce_time_s(c, range(8), n_bytes, algorithm="hierarchical")
    assert hier == pytest.approx(2 * (0.0075 + 6e-6) + 2 * (0.0125 + 10e-6))
    assert allreduce_time_s(c, range(8), n_bytes) == pytest.approx(min(flat, hier)) == pytest.approx(hier)
    # all-gather hierarchical: inter AG of 1e9/4 over 2 nodes + intra AG of 1e9 over 4
    assert allgather_time_s(c, range(8), n_bytes, algorithm="hierarchical") == pytest.approx(
        (0.0125 + 10e-6) + (0.0075 + 6e-6)
    )


def test_uneven_group_uses_slowest_node() -> None:
    c = _two_node_cluster()
    # 3 ranks on node 0, 1 on node 1: intra phase over 3, inter share N/1
    hier = allgather_time_s(c, [0, 1, 2, 4], 1e9, algorithm="hierarchical")
    assert hier == pytest.approx((2 / 3 * 1e9 / 100e9 + 2 * 2e-6) + (0.5 * 1e9 / 10e9 + 10e-6))


@pytest.mark.parametrize("fn", COLLECTIVES)
@pytest.mark.parametrize("spec", ["4x8xH100", "2x8xA100", "3x4xcpu", "2x8xL40S"])
@pytest.mark.parametrize("ranks", [range(0, 32, 1), range(0, 32, 4), range(0, 32, 2), [0, 1, 2, 8, 9]])
def test_auto_is_min_and_monotone(fn, spec: str, ranks) -> None:
    c = parse_cluster(spec)
    ranks = [r for r in ranks if r < c.num_gpus]
    sizes = [0, 1, 1e3, 1e6, 1e8, 1e10]
    times = [fn(c, ranks, s) for s in sizes]
    assert times == sorted(times)
    for s, t in zip(sizes, times):
        assert t <= fn(c, ranks, s, algorithm="ring") + 1e-15
        assert t <= fn(c, ranks, s, algorithm="hierarchical") + 1e-15
    # all-reduce = reduce-scatter + all-gather, so it costs at least an all-gather
    assert allreduce_time_s(c, ranks, 1e9) >= allgather_time_s(c, ranks, 1e9)


def test_large_allreduce_hierarchical_beats_flat_on_dgx() -> None:
    c = parse_cluster("4xdgx-h100")
    flat = allreduce_time_s(c, range(32), 1e9, algorithm="ring")
    auto = allreduce_time_s(c, range(32), 1e9)
    assert auto < flat / 4  # 8 NIC rails in parallel instead of one


def test_collective_bad_inputs() -> None:
    c = parse_cluster("dgx-a100")
    with pytest.raises(IndexError):
        allreduce_time_s(c, [0, 8], 1e6)
    with pytest.raises(ValueError, match="duplicate"):
        allreduce_time_s(c, [0, 0], 1e6)
    with pytest.raises(ValueError, match="algorithm"):
        allreduce_time_s(c, [0, 1], 1e6, algorithm="tree")


def test_collective_is_fast() -> None:
    import time

    c = parse_cluster("128x8xA100")
    groups = [range(i, 1024, 8) for i in range(8)] + [range(i * 8, i * 8 + 8) for i in range(128)]
    start = time.perf_counter()
    for _ in range(100):
        for grp in groups:
            allreduce_time_s(c, grp, 1e8)
    per_call_s = (time.perf_counter() - start) / (100 * len(groups))
    assert math.isfinite(per_call_s)  # timing is informative only (never pass/fail)
