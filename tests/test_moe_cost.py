"""What a mixture-of-experts layer costs on one GPU under expert and tensor parallelism: the recorded
operators of the experts ([Note: expert operators] in graph/operators.py), their prices under ep
(cost/ops.py `scaled_op`), the layer's time under tp ([Note: experts on a GPU] in cost/time.py) and
the all-to-all of the exchange (`all_to_all_time_s`), through the public path where it can be seen."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import autoplan
from autoplan.cluster import get_gpu, p2p_time_s, parse_cluster
from autoplan.cost.calibration import default_calibration
from autoplan.cost.config import ParallelConfig
from autoplan.cost.experts import all_to_all_time_s, expert_exchange_times_s, expert_group_ranks
from autoplan.cost.ops import op_time_s, scaled_op
from autoplan.cost.time import block_times, op_pass_times
from autoplan.graph.blocks import Op
from autoplan.graph.operators import Call, OperatorRecorder, merge_batches

E, H, F = 16, 1024, 1024
SPEC = (f"moe:num_layers=2,hidden_size={H},num_heads=8,num_kv_heads=8,ffn_hidden_size={F},vocab_size=512,"
        f"max_seq_len=1024,num_experts={E},experts_per_token=2")
# Many wide experts, few tokens each: the experts' GEMMs are bound by their weights' bytes.
WIDE = ("moe:num_layers=2,hidden_size=1024,num_heads=8,num_kv_heads=8,ffn_hidden_size=2048,vocab_size=1024,"
        "max_seq_len=64,num_experts=64,experts_per_token=2")


@pytest.fixture(scope="module")
def profile():
    return autoplan.profile(SPEC, seq_len=1024)


def _layer(profile):
    return next(b for b in profile.blocks if b.kind == "layer")


def test_the_experts_operators_are_marked_with_their_token_axes_and_fixed_weights(profile):
    layer = _layer(profile)
    experts = [op for op in layer.ops if op.tp == "expert"]
    gemms = [op for op in experts if op.kind == "gemm"]
    # Forward: three grouped GEMMs (w1, w3, w2); backward: an input and a weight gradient for each.
    assert sum(op.count for op in gemms if op.phase == "fwd") == 3
    assert sum(op.count for op in gemms if op.phase == "bwd") == 6
    for op in gemms:
        assert op.shape[0] == E and op.batch_axis not in (None, 0), op  # tokens grow, not experts
        assert op.tp_axis is None
        assert op.fixed_bytes == pytest.approx(E * H * F * 2), op  # one stacked bf16 weight (or its gradient)
    # The gradients' accumulation reads and writes the stacked weights' gradients: fixed bytes, not
    # the batch's (the defect of issue 28: 4.83e9 bytes scaled with the micro-batch).
    accumulate = [op for op in experts if op.name == "add_"]
    assert accumulate and all(op.bytes == 0 for op in accumulate)
    assert sum(op.count * op.fixed_bytes for op in accumulate) == pytest.approx(3 * 3 * E * H * F * 2)
    # The attention's GEMMs and the routing around the experts are not the experts'.
    assert all(op.tp != "expert" for op in layer.ops if op.kind == "attention")
    assert any(op.kind == "gemm" and op.tp == "sharded" and op.fixed_bytes == H * H * 2 for op in layer.ops)
    assert all(op.tp != "expert" for op in layer.ops if op.name in ("scatter_add", "gather", "topk", "_softmax"))


def test_an_expanded_index_is_read_once():
    """The zoo's dispatch scatters tokens with an int64 index expanded over the hidden dim (stride 0):
    its bytes are those of its distinct elements, not four times the tokens'."""
    recorder = OperatorRecorder([], hidden=None)
    x = torch.zeros(1, 8, 64)
    index = torch.zeros(1, 8, 1, dtype=torch.int64).expand(1, 8, 64)
    with recorder:
        torch.gather(x, 1, index)
    (call,) = [c for c in recorder.calls if c.name == "gather"]
    assert call.bytes == 2 * x.numel() * 4 + 8 * 8


def _call(name: str, nbytes: float, shape: tuple[int, ...] = (), kind: str = "memory") -> Call:
    return Call(kind, name, "bfloat16", 0.0, nbytes, shape, False, False, False, ())


def test_passes_that_differ_at_twice_the_batch_still_pair_their_common_calls():
    """At batch 2 the zoo's dispatch copies a transposed buffer that is a view at batch 1: the two
    recordings differ by that call, and the rest still pair (the weight gradient's accumulation stays
    fixed, the GEMM's token axis is found)."""
    once = [_call("mm", 100.0, (1, 8, 4, 4), "gemm"), _call("add_", 30.0), _call("mul", 10.0)]
    twice = [_call("mm", 132.0, (1, 16, 4, 4), "gemm"), _call("clone", 64.0), _call("add_", 30.0),
             _call("mul", 20.0)]
    ops = {op.name: op for op in merge_batches(once, twice, "bwd")}
    assert set(ops) == {"mm", "add_", "mul"}  # the copy at 2b alone is not added
    assert ops["mm"].batch_axis == 1 and (ops["mm"].bytes, ops["mm"].fixed_bytes) == (32.0, 68.0)
    assert (ops["add_"].bytes, ops["add_"].fixed_bytes) == (0.0, 30.0)
    assert (ops["mul"].bytes, ops["mul"].fixed_bytes) == (10.0, 0.0)


def test_scaled_op_divides_the_experts_weights_by_ep_and_keeps_their_flops():
    gemm = Op(kind="gemm", phase="fwd", name="bmm", dtype="bfloat16", count=1, flops=2.0 * 8 * 32 * 64 * 16,
              bytes=1000.0, fixed_bytes=8 * 16 * 64 * 2.0, shape=(8, 32, 64, 16), batch_axis=1, tp="expert")
    shape, flops, num_bytes = scaled_op(gemm, 2.0, 1, False, ep=4)
    assert shape == (2, 256, 64, 16)  # experts / ep, each for the tokens of the ep group
    assert flops == gemm.flops * 2.0
    assert num_bytes == 1000.0 * 2.0 + gemm.fixed_bytes / 4
    # Tensor parallelism leaves the experts whole (the layout shards no expert).
    assert scaled_op(gemm, 1.0, 4, True) == ((8, 32, 64, 16), gemm.flops, 1000.0 + gemm.fixed_bytes)
    accumulate = Op(kind="memory", phase="bwd", name="add_", dtype="bfloat16", count=3, fixed_bytes=3e9, tp="expert")
    assert scaled_op(accumulate, 4.0, 2, True, ep=8)[2] == pytest.approx(3e9 / 8)
    # Other operators do not see ep.
    dense = dataclasses.replace(gemm, tp="sharded", tp_axis=2)
    assert scaled_op(dense, 1.0, 1, False, ep=4) == scaled_op(dense, 1.0, 1, False)
    gpu = get_gpu("H100-80GB")
    cal = default_calibration(gpu)
    # A weight-bound expert GEMM: the time falls with the weights' bytes.
    wide = dataclasses.replace(gemm, shape=(64, 4, 2048, 1024), flops=2.0 * 64 * 4 * 2048 * 1024,
                               fixed_bytes=64 * 2048 * 1024 * 2.0, bytes=0.0)
    assert op_time_s(wide, cal, gpu, 1.0, 1, False, ep=8) < op_time_s(wide, cal, gpu, 1.0, 1, False) / 4


def test_a_moe_layer_under_tp_is_priced_operator_by_operator(profile):
    """tp shards the attention of a MoE layer and leaves its experts whole: the layer is priced by its
    operators at tp, not whole over the parameters' Amdahl share (3% sharded here: the experts are
    most of the parameters and a token uses 2 of 16)."""
    gpu = get_gpu("H100-80GB")
    cluster = parse_cluster("1x8xH100-80GB")
    cal = default_calibration(gpu)
    index = next(i for i, b in enumerate(profile.blocks) if b.kind == "layer")
    layer = profile.blocks[index]
    base = dict(pp=1, dp=4, micro_batch_size=16, num_microbatches=1, zero=0, schedule="1f1b", recompute="none")
    one = block_times(profile, gpu, cluster, ParallelConfig(tp=1, **base), "bf16", cal)
    two = block_times(profile, gpu, cluster, ParallelConfig(tp=2, **base), "bf16", cal)
    f = 16 / profile.batch_size
    fwd_two, bwd_two, _ = op_pass_times(layer, cal, gpu, f, 2, False, "bf16", profile.dtype)
    assert two.fwd_s[index] == pytest.approx(fwd_two) and two.bwd_s[index] == pytest.approx(bwd_two)
    expert_fwd = sum(op.count * op_time_s(op, cal, gpu, f, 1, False) for op in layer.ops
                     if op.phase == "fwd" and op.tp == "expert")
    assert expert_fwd > 0
    # The experts' part is the same at tp 2; the rest falls.
    assert expert_fwd < two.fwd_s[index] < one.fwd_s[index] * 0.95


def test_the_exchange_takes_each_peer_over_its_own_link():
    """An ep group of 8 ranks 2 apart (tp 2) on nodes of 8 GPUs: 4 in each node, so each rank sends
    4/8 of its buffer over its network rail (and 3/8 over NVLink at the same time), not 7/8 of it at
    the network's speed."""
    cluster = parse_cluster("2x8xH100-80GB")
    num_bytes = 1e9
    ranks = list(range(0, 16, 2))
    network = p2p_time_s(cluster, 0, 8, num_bytes * 4 / 8) + 3 * cluster.inter_node.latency_s
    assert all_to_all_time_s(cluster, ranks, num_bytes) == pytest.approx(network)
    nvlink = p2p_time_s(cluster, 0, 1, num_bytes * 7 / 8) + 6 * cluster.intra_node.latency_s
    assert all_to_all_time_s(cluster, list(range(8)), num_bytes) == pytest.approx(nvlink)
    assert all_to_all_time_s(cluster, [0], num_bytes) == 0.0


def test_each_tp_rank_exchanges_its_share_of_the_tokens(profile):
    """Under expert tp 1 each tp rank sends only its 1/tp of the micro-batch's tokens to the experts
    (Megatron-LM's ETP 1), over an ep group of ep consecutive ranks over tp x dp (MoE parallel
    folding); without ep every tp rank keeps every token (and exchanges nothing)."""
    cluster = parse_cluster("4x8xH100-80GB")
    base = dict(pp=1, dp=8, micro_batch_size=2, num_microbatches=1, zero=0, schedule="1f1b", recompute="none", ep=4)
    sent = np.asarray(profile.extra["experts"]["block_dispatch_bytes"], dtype=float) * 2 / profile.batch_size
    for tp in (1, 2, 4):
        cfg = ParallelConfig(tp=tp, **base)
        assert cfg.expert_token_split == tp
        ranks = [0, 1, 2, 3]
        assert expert_group_ranks(cfg) == ranks
        expected = np.array([2 * all_to_all_time_s(cluster, ranks, s / tp) if s else 0.0 for s in sent])
        assert expert_exchange_times_s(profile, cluster, cfg) == pytest.approx(expected)
    assert ParallelConfig(tp=4, **{**base, "ep": 1}).expert_token_split == 1


def test_scaled_op_splits_the_experts_tokens_over_tp_under_expert_tp_1():
    gemm = Op(kind="gemm", phase="fwd", name="bmm", dtype="bfloat16", count=1, flops=2.0 * 8 * 32 * 64 * 16,
              bytes=1000.0, fixed_bytes=8 * 16 * 64 * 2.0, shape=(8, 32, 64, 16), batch_axis=1, tp="expert")
    shape, flops, num_bytes = scaled_op(gemm, 2.0, 2, False, ep=4, expert_split=2)
    assert shape == (2, 128, 64, 16)  # experts / ep, each for half of the tokens the ep group sends
    assert flops == gemm.flops
    assert num_bytes == 1000.0 + gemm.fixed_bytes / 4  # the weights are read whole
    dense = dataclasses.replace(gemm, tp="sharded", tp_axis=2)
    assert scaled_op(dense, 2.0, 2, False, ep=4, expert_split=2) == scaled_op(dense, 2.0, 2, False, ep=4)


def test_an_ep_by_tp_plan_computes_no_expert_twice_through_suggest():
    """Through `suggest`: at a fixed global batch, tp 2 x dp 4 gives each GPU the tokens of tp 1 x
    dp 8, and with expert tp 1 the experts' share too, so the compute per GPU is about the same
    (tp divides the attention and the experts alike; what is left is the smaller GEMMs' efficiency and
    the unsharded norms) and each rank's all-to-all carries the same bytes. Before expert tp 1 was
    priced, every tp rank computed and exchanged every token: 1.67x the compute, 2x the exchange
    (1.4x now, with the outputs' all-gather)."""
    spec = ("moe:num_layers=2,hidden_size=4096,num_heads=32,num_kv_heads=8,ffn_hidden_size=4096,vocab_size=512,"
            "max_seq_len=2048,num_experts=8,experts_per_token=2")
    common = dict(global_batch=64, seq_len=2048, pp=1, micro_batch_size=4, zero=0, schedule="1f1b",
                  recompute="none", ep=2, top=1)
    one, two = (autoplan.suggest(spec, "1x8xH100-80GB", tp=tp, dp=8 // tp, **common)[0] for tp in (1, 2))
    assert (one.tp, one.ep, two.tp, two.ep, two.expert_tp) == (1, 2, 2, 2, 1)
    compute = two.predicted.breakdown["compute_s"] / one.predicted.breakdown["compute_s"]
    assert 1.0 < compute < 1.25
    # The same all-to-all bytes per rank (`test_each_tp_rank_exchanges_its_share_of_the_tokens`) plus
    # the tp all-gather of the experts' outputs over NVLink.
    assert two.predicted.breakdown["ep_comm_s"] < 1.6 * one.predicted.breakdown["ep_comm_s"]


def _compute(ep: int, **pins) -> float:
    common = dict(global_batch=8, seq_len=64, tp=1, pp=1, dp=8, micro_batch_size=1, zero=0, schedule="1f1b",
                  recompute="none", top=1)
    plan = autoplan.suggest(WIDE, "1x8xH100-80GB", ep=ep, **{**common, **pins})[0]
    assert plan.ep == ep
    return plan.predicted.breakdown["compute_s"]


def test_expert_weight_traffic_divides_by_ep_through_suggest():
    """Weight-bound experts (64 experts of 1024 x 2048, 3 tokens each per sequence): a GPU's compute
    is R + W / ep, W the experts' weight traffic (their GEMMs' weights, the gradients and their
    accumulation), so each doubling of ep saves half what the previous one did."""
    times = {ep: _compute(ep) for ep in (1, 2, 4, 8)}
    assert times[1] > times[2] > times[4] > times[8]
    assert (times[1] - times[2]) / (times[2] - times[4]) == pytest.approx(2.0, rel=0.05)
    assert (times[2] - times[4]) / (times[4] - times[8]) == pytest.approx(2.0, rel=0.05)
    # Most of the layer's time is the experts' weights: ep 8 saves 7/8 of them.
    assert times[8] < 0.6 * times[1]


def test_suggest_says_the_expert_layout_and_the_links_its_all_to_all_crosses(profile):
    """`suggest`'s note on expert parallelism (what `--explain` and the CLI print): expert tp 1 with the
    tokens split over tp, the ep group's ranks and the links they cross. At tp 2 x ep 8 on nodes of 8
    the group is folded over tp x dp, 8 consecutive ranks in one node (Megatron-Core's MoE parallel
    folding), under FSDP too; before the fold it was 8 replicas at one tp index, 2 ranks apart over
    two nodes (3 peers over NVLink and 4 over the network per rank)."""
    common = dict(global_batch=64, seq_len=1024, tp=2, ep=8, pp=1, top=1)
    plan = autoplan.suggest(SPEC, "2x8xH100-80GB", zero=0, **common)[0]
    (note,) = [n for n in plan.notes if n.startswith("ep 8")]
    assert "for the tokens of 8 ranks over tp x dp, each bringing 1/2 of a replica's" in note
    assert ("expert tp 1, tokens split over tp 2: all-to-all over ranks 0, 1, ..., 7 (1 node: 7 peers over NVLink); "
            "expert gradients over 2 ranks holding the same experts") in note
    fsdp = autoplan.suggest(SPEC, "2x8xH100-80GB", zero=3, **common)[0]
    (note,) = [n for n in fsdp.notes if n.startswith("ep 8")]
    assert ("expert tp 1, tokens split over tp 2: all-to-all over ranks 0, 1, ..., 7 (1 node: 7 peers over NVLink); "
            "expert gradients over 2 ranks holding the same experts") in note
    assert "FSDP shards those experts over the 2 ranks holding the same ones" in note


def test_a_pinned_zero_1_still_searches_expert_parallelism(profile):
    """ZeRO-1 shards the experts' optimizer state over the ranks holding them (issue 31), so pinning
    `--zero 1` no longer takes ep out of the search, nor does pinned HSDP (each replica group holds
    every expert: `shardings` keeps the replicate degrees ep allows)."""
    from autoplan.search.configs import _expert_degrees

    assert _expert_degrees(profile, 1, 8, {"zero": 1}) == [1, 2, 4, 8]
    assert _expert_degrees(profile, 1, 8, {"dp_replicate": 2}) == [1, 2, 4, 8]
    # ... and `shardings` keeps HSDP only where each replica group holds every expert (ep | tp x dp_shard)
    from autoplan.search.configs import shardings

    base = dict(tp=1, pp=1, dp=8, micro_batch_size=1, num_microbatches=1, schedule="1f1b")
    pinned = {"zero": 3, "dp_replicate": 2}
    assert shardings(ParallelConfig(ep=4, **base), pinned, 8, profile) == [(3, 2)]
    assert shardings(ParallelConfig(ep=8, **base), pinned, 8, profile) == []


def test_the_experts_fsdp_groups_and_memory_under_hsdp():
    """Under HSDP the ranks holding the same experts split by replica: FSDP shards within a replica
    group and replicates across (plan.py [Note: expert layout]); what a GPU keeps of its experts is
    1 / (their shard group), so against the 1 / dp_shard of the other parameters it keeps
    dp_shard / (expert_dp / dp_replicate) - 1 times its experts more."""
    from autoplan.cost.memory import expert_shard_surplus

    cfg = ParallelConfig(tp=2, pp=1, dp=8, micro_batch_size=1, num_microbatches=1, schedule="1f1b", ep=4, zero=3,
                         dp_replicate=2)
    assert cfg.expert_dp == 4 and cfg.expert_dp_ranks(0) == [0, 4, 8, 12]
    assert cfg.expert_fsdp_groups(0) == ([0, 4], [0, 8])  # shard within replica group 0, replicated over 2
    assert cfg.expert_group_ranks(0) == [0, 1, 2, 3]

    class _Profile:  # two blocks, the second with 8e6 expert parameters
        num_blocks = 2
        extra = {"experts": {"block_params": [0, 8e6]}}

    held = 8e6 / cfg.ep
    assert expert_shard_surplus(_Profile(), cfg, [(0, 2)]) == pytest.approx(held * (cfg.dp_shard / 2 - 1))

def test_ep_may_fold_over_tp_beyond_dp(profile):
    """ep divides tp x dp, not only dp (Megatron-Core's EP x EDP = TP x DP under expert tp 1): at tp 2
    x dp 4 the search tries ep 8, and a plan pinned to it puts each rank's eighth of the experts in
    one node's ep group with no expert replica (expert-data-parallel group of 1)."""
    from autoplan.search.configs import _expert_degrees

    assert _expert_degrees(profile, 2, 4, {}) == [1, 2, 4, 8]
    plan = autoplan.suggest(SPEC, "2x8xH100-80GB", global_batch=64, seq_len=1024, tp=2, dp=4, pp=2, ep=8, top=1)[0]
    assert (plan.tp, plan.dp, plan.ep) == (2, 4, 8) and plan.fits
    cfg = ParallelConfig.of_plan(plan)
    assert cfg.expert_dp == 1 and expert_group_ranks(cfg) == list(range(8))
