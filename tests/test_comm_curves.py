"""Measured collective curves (cluster/collectives.py) and DP buckets behind the backward (cost/comm.py)."""

from __future__ import annotations

import math

import pytest

import autoplan
from autoplan.cluster import (
    GPUS,
    Cluster,
    Link,
    NodeGroup,
    allgather_time_s,
    allreduce_time_s,
    p2p_time_s,
    parse_cluster,
    reduce_scatter_time_s,
    with_collective_curves,
)
from autoplan.cost.comm import DDP_BUCKET_BYTES, dp_reduction_exposed_s

H100 = GPUS["H100-SXM-80GB"]
POINTS = ((8192.0, 1e9), (2.0**20, 100e9), (2.0**25, 300e9), (2.0**30, 400e9))


def _cluster(intra_curves=(), inter_curves=(), nodes: int = 1, gpus_per_node: int = 8) -> Cluster:
    return Cluster(
        "t",
        (NodeGroup(nodes, gpus_per_node, H100),),
        Link(100e9, 2e-6, "NVLink", intra_curves),
        Link(10e9, 10e-6, "IB", inter_curves),
    )


def _all(points) -> tuple:
    return tuple((op, points) for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"))


# -- interpolation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
def test_curve_is_exact_at_its_points(n) -> None:
    c = _cluster(_all(POINTS))
    for size, busbw in POINTS:
        assert allreduce_time_s(c, range(n), size) == pytest.approx(2 * (n - 1) / n * size / busbw)
        assert allgather_time_s(c, range(n), size) == pytest.approx((n - 1) / n * size / busbw)
        assert reduce_scatter_time_s(c, range(n), size) == pytest.approx((n - 1) / n * size / busbw)
        assert p2p_time_s(c, 0, 1, size) == pytest.approx(size / busbw)


def test_curve_is_monotone_between_points_and_clamped_at_the_ends() -> None:
    c = _cluster(_all(POINTS))
    sizes = [2.0**k for k in range(13, 31)] + [2.0**k * 1.5 for k in range(13, 30)]
    sizes.sort()
    times = [allreduce_time_s(c, range(8), s) for s in sizes]
    assert all(a < b for a, b in zip(times, times[1:]))
    for (s0, b0), (s1, b1) in zip(POINTS, POINTS[1:]):
        mid = math.sqrt(s0 * s1)
        busbw = 1.75 * mid / allreduce_time_s(c, range(8), mid)
        assert b0 < busbw < b1
    # Below the smallest point: that point's time (latency-bound), whatever the size.
    floor = 1.75 * 8192 / 1e9
    assert allreduce_time_s(c, range(8), 1.0) == pytest.approx(floor)
    assert allreduce_time_s(c, range(8), 4096) == pytest.approx(floor)
    # Above the largest: the last busbw.
    assert allreduce_time_s(c, range(8), 2.0**33) == pytest.approx(1.75 * 2.0**33 / 400e9)


def test_a_curve_reproduces_an_nccl_tests_row() -> None:
    # all_reduce_perf on 8 ranks prints `size time(us) algbw busbw` with busbw = algbw * 2(n-1)/n
    # (nccl-tests doc/PERFORMANCE.md), e.g. "33554432 ... 195.40 171.72 300.51": a curve through that
    # busbw gives back the printed time.
    c = _cluster((("all_reduce", ((8192.0, 1.0e9), (33554432.0, 300.51e9))),))
    assert allreduce_time_s(c, range(8), 33554432) == pytest.approx(195.40e-6, rel=1e-3)
    # all_gather_perf: busbw = algbw * (n-1)/n; a collective without its own curve borrows all_reduce's.
    assert allgather_time_s(c, range(8), 33554432) == pytest.approx(195.40e-6 / 2, rel=1e-3)


def test_without_curves_alpha_beta_is_unchanged() -> None:
    c = _cluster()
    n, size = 8, 1e9
    assert allreduce_time_s(c, range(n), size) == pytest.approx(
        2 * ((n - 1) * 2e-6 + (n - 1) / n * size / 100e9)
    )
    assert p2p_time_s(c, 0, 1, size) == pytest.approx(2e-6 + size / 100e9)
    preset = parse_cluster("2x8xH100")
    plain = preset.without_curves()
    assert (
        plain.intra_node.curves == () and plain.intra_node.bw_bytes_per_s == preset.intra_node.bw_bytes_per_s
    )
    assert p2p_time_s(plain, 0, 8, 50e6) == pytest.approx(6e-6 + 1e-3)
    # p2p only uses a p2p curve: a link with only an all-reduce curve keeps alpha-beta for p2p.
    only_ar = _cluster((("all_reduce", POINTS),))
    assert p2p_time_s(only_ar, 0, 1, size) == pytest.approx(2e-6 + size / 100e9)


def test_groups_spanning_nodes_use_each_links_curve() -> None:
    inter = ((8192.0, 0.5e9), (2.0**30, 40e9))
    c = _cluster(_all(POINTS), _all(inter), nodes=4)
    size = 2.0**30
    hier = allreduce_time_s(c, range(32), size, algorithm="hierarchical")
    intra_s = 1.75 * size / 400e9
    inter_s = 1.5 * (size / 8) / c.inter_node.curve("all_reduce")[1][-1]
    # size / 8 lies between the inter curve's points: time from its interpolated busbw.
    assert hier > intra_s and hier == pytest.approx(intra_s + 1.5 * (size / 8) / _interp(inter, size / 8))
    assert inter_s < hier - intra_s  # the interpolated busbw is below the last point's
    flat = allreduce_time_s(c, range(32), size, algorithm="ring")
    assert flat == pytest.approx(2 * 31 / 32 * size / 40e9)  # the slower link's time
    assert allreduce_time_s(c, range(32), size) == pytest.approx(min(flat, hier))


def _interp(points, size) -> float:
    (s0, b0), (s1, b1) = points
    w = math.log(size / s0) / math.log(s1 / s0)
    return math.exp(math.log(b0) + w * (math.log(b1) - math.log(b0)))


def test_presets_carry_published_curves_and_overrides_drop_them() -> None:
    for spec in ("4x8xH100-80GB", "2xdgx-a100"):
        c = parse_cluster(spec)
        for link in (c.intra_node, c.inter_node):
            assert {op for op, _ in link.curves} == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
            # measured busbw never exceeds what the datasheet rate allows NVLS all-reduce (~1.1x) to show
            assert max(b for _, b in link.curves[0][1]) <= 1.1 * link.bw_bytes_per_s
    c = parse_cluster("2x8xH100", inter_node_bw_gbps=25)
    assert c.inter_node.curves == () and c.intra_node.curves != ()
    assert Cluster.from_dict(parse_cluster("2x8xH100").to_dict()) == parse_cluster("2x8xH100")


# -- calibration curves ------------------------------------------------------------------------------


def test_with_collective_curves_replaces_only_the_links_named() -> None:
    base = parse_cluster("2x8xA100-80GB")
    out = with_collective_curves(
        base,
        {
            "source": "measured",
            "intra_node": {"ranks": 8, "source": "x", "all_reduce": [[2**30, 200e9], [8192, 1e9]]},
        },
    )
    assert out.intra_node.curves == (("all_reduce", ((8192.0, 1e9), (2.0**30, 200e9))),)  # sorted
    assert out.inter_node == base.inter_node
    assert out.intra_node.bw_bytes_per_s == base.intra_node.bw_bytes_per_s
    assert allreduce_time_s(out, range(8), 2**30) == pytest.approx(1.75 * 2**30 / 200e9)


@pytest.mark.parametrize(
    "collectives, field",
    [
        ([], "collectives"),
        ({"intra": {}}, "collectives.intra"),
        ({"intra_node": [1, 2]}, "collectives.intra_node"),
        ({"intra_node": {"ranks": 8}}, "collectives.intra_node"),
        ({"intra_node": {"ranks": 0, "p2p": [[1, 1]]}}, "collectives.intra_node.ranks"),
        ({"intra_node": {"allreduce": [[1, 1]]}}, "collectives.intra_node"),
        ({"inter_node": {"all_reduce": []}}, "collectives.inter_node.all_reduce"),
        ({"inter_node": {"all_reduce": [[1, 1], [2]]}}, r"collectives.inter_node.all_reduce\[1\]"),
        ({"inter_node": {"all_reduce": [[1, -1]]}}, r"collectives.inter_node.all_reduce\[0\]"),
        ({"inter_node": {"all_reduce": [[1, "fast"]]}}, r"collectives.inter_node.all_reduce\[0\]"),
        ({"inter_node": {"all_gather": [[8, 1], [8, 2]]}}, "collectives.inter_node.all_gather"),
        ({"source": 3}, "collectives.source"),
    ],
)
def test_with_collective_curves_rejects_malformed_input(collectives, field) -> None:
    with pytest.raises(ValueError, match=field) as info:
        with_collective_curves(parse_cluster("2x8xA100-80GB"), collectives)
    assert "\n" not in str(info.value)


# -- DP buckets --------------------------------------------------------------------------------------


def test_a_reduction_that_keeps_up_is_hidden_except_the_last_bucket() -> None:
    c = _cluster()
    grad = 10 * DDP_BUCKET_BYTES
    bucket_s = allreduce_time_s(c, range(8), DDP_BUCKET_BYTES)
    backward = 10 * bucket_s * 3  # buckets come 3x slower than they reduce
    assert dp_reduction_exposed_s(c, range(8), grad, backward) == pytest.approx(bucket_s)
    # A partial last bucket (ready at the end, the full ones done by then): only its all-reduce shows.
    exposed = dp_reduction_exposed_s(c, range(8), grad + DDP_BUCKET_BYTES / 2, backward)
    assert exposed == pytest.approx(allreduce_time_s(c, range(8), DDP_BUCKET_BYTES / 2))


def test_a_reduction_longer_than_the_backward_is_exposed_by_the_difference() -> None:
    c = _cluster()
    grad = 10 * DDP_BUCKET_BYTES
    bucket_s = allreduce_time_s(c, range(8), DDP_BUCKET_BYTES)
    backward = 10 * bucket_s / 4
    gap = backward / 10  # the first bucket is ready a tenth into the backward
    exposed = dp_reduction_exposed_s(c, range(8), grad, backward)
    assert exposed == pytest.approx(10 * bucket_s - backward + gap)


def test_one_bucket_waits_for_the_backward_and_many_small_ones_approach_the_overlap_bound() -> None:
    c = _cluster()
    sync = allreduce_time_s(c, range(8), 1e6)
    assert dp_reduction_exposed_s(c, range(8), 1e6, backward_s=1.0) == pytest.approx(sync)
    # max(0, sync - backward), the model this replaces, is the limit of many buckets on a link
    # without per-message latency.
    free = Cluster("t", (NodeGroup(1, 8, H100),), Link(100e9, 0.0), Link(10e9, 0.0))
    grad = 1e9
    sync = allreduce_time_s(free, range(8), grad)
    for backward in (0.5 * sync, 2 * sync):
        exposed = dp_reduction_exposed_s(free, range(8), grad, backward, bucket_bytes=grad / 1000)
        # ... plus one bucket's worth: the first bucket's wait, or the last bucket's all-reduce
        assert exposed == pytest.approx(max(0.0, sync - backward) + min(sync, backward) / 1000, rel=1e-6)
    assert dp_reduction_exposed_s(c, [3], 1e9, 0.0) == 0.0
    assert dp_reduction_exposed_s(c, range(8), 0.0, 1.0) == 0.0


# -- through suggest ----------------------------------------------------------------------------------

SPEC = "gpt:num_layers=4,hidden_size=256,num_heads=4,vocab_size=32000,max_seq_len=128"


def test_suggest_reports_dp_exposure_from_the_clusters_curves() -> None:
    pins = dict(tp=1, pp=1, dp=16, micro_batch_size=1, schedule="1f1b", recompute="none", zero=0, top=1)
    cluster = parse_cluster("2x8xA100-80GB")
    shipped = autoplan.suggest(SPEC, cluster, global_batch=16, seq_len=128, **pins)[0]
    slow = with_collective_curves(
        cluster,
        {
            "intra_node": {"ranks": 8, "all_reduce": [[8192, 0.1e9], [2**30, 10e9]]},
            "inter_node": {"ranks": 2, "all_reduce": [[8192, 0.01e9], [2**30, 1e9]]},
        },
    )
    measured = autoplan.suggest(SPEC, slow, global_batch=16, seq_len=128, **pins)[0]
    before = shipped.predicted.breakdown["dp_comm_exposed_s"]
    after = measured.predicted.breakdown["dp_comm_exposed_s"]
    assert before >= 0 and after >= 0
    assert after > before
    assert measured.predicted.step_time_s > shipped.predicted.step_time_s
