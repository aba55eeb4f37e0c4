"""Time of each block on a GPU, and of the communication around it (seconds per micro-batch).

[Note: achievable throughput]
A block's compute time is its FLOPs over `peak x efficiency` (Narayanan et al. 2021, SC'21, Sec.
5.1 report 44-52% of peak end to end on A100s). Two efficiencies, because two kinds of work behave
differently:

- GEMMs (QKV, projections, MLP, logits) reach E_GEMM * w / (w + W_HALF) of peak, where w = hidden
  / tp is the per-GPU GEMM width: the element-wise work around them (norms, bias, activation,
  residual, replicated across TP ranks without sequence parallelism) grows like b*s*h while the
  GEMMs grow like b*s*h^2/tp, so its relative cost falls like 1/w.
- The attention core (Q K^T, mask, softmax, dropout, A V) runs at E_ATTENTION: its s x s
  intermediate is memory-bound, which is why the published small models (where attention is 13%
  of the FLOPs at h = 2304, s = 2048) reach fewer TFLOP/s than the large ones (1.3% at h = 25600).

The constants are fitted to the published Megatron-LM runs in
`../shared/data/megatron_sc21_table1.json` by `benchmarks/validate_published.py --fit` (procedure and
result in docs/calibration.md). Those runs predate fused flash attention, so E_ATTENTION is
pessimistic for a modern stack; a profile timed on the device (`--device cuda`) replaces all of
this with measured times. Blocks without matmuls (embedding lookups, norms) are memory-bound: their
time is the bytes they move over the GPU's memory bandwidth (roofline model, Williams et al. 2009).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import numpy as np

from autoplan.cluster import GPU, Cluster, allgather_time_s, allreduce_time_s, p2p_time_s
from autoplan.cost.config import ParallelConfig
from autoplan.graph.blocks import ModelProfile

__all__ = ["E_ATTENTION", "E_GEMM", "W_HALF", "BlockTimes", "block_times", "cpu_sharing", "cut_transfer_time_s", "cut_transfer_times_s", "dp_sync_time_s", "efficiency",
           "optimizer_time_s", "tied_sync_times_s", "tp_divisor", "tp_sharded"]

# Fitted by benchmarks/validate_published.py --fit (see docs/calibration.md).
E_GEMM = 0.60
W_HALF = 0.0
E_ATTENTION = 0.18125

# Blocks whose parameters and FLOPs Megatron tensor parallelism shards (Shoeybi et al. 2019, Sec. 3:
# attention and MLP column/row parallel; vocab-parallel embedding and output layer).
_TP_SHARDED_KINDS = {"layer", "attention", "mlp", "embedding", "head"}
_RECOMPUTED_KINDS = {"layer", "attention", "mlp"}


def tp_sharded(kind: str) -> bool:
    return kind in _TP_SHARDED_KINDS


def tp_divisor(profile: ModelProfile, index: int, tp: int) -> float:
    """How many ways tp splits block `index`'s weights and compute: tp for a kind Megatron shards
    (Shoeybi et al. 2019, Sec. 3), less for a block whose layout (graph/sharding.py) leaves part of
    it replicated (a layer with an unshardable attention, an embedding that is not vocabulary
    parallel): with a share s of its parameters sharded, 1 / (s / tp + 1 - s), Amdahl's law over the
    block (parameters standing in for FLOPs)."""
    block = profile.blocks[index]
    if tp == 1 or not tp_sharded(block.kind):
        return 1.0
    shares = (profile.extra.get("tensor_parallel") or {}).get("block_sharded_share")
    if not shares or index >= len(shares):  # a profile without a layout (older JSON): Megatron's split
        return float(tp)
    return 1.0 / (shares[index] / tp + 1.0 - shares[index])


def efficiency(width: float) -> float:
    """Fraction of dense peak GEMMs reach at per-GPU GEMM width `width`."""
    return E_GEMM * width / (width + W_HALF)


@dataclass(frozen=True)
class BlockTimes:
    """Per-block seconds for one micro-batch on one GPU (arrays of length num_blocks)."""

    fwd_s: np.ndarray
    """Forward compute."""
    bwd_s: np.ndarray
    """Backward compute, recompute included."""
    tp_fwd_s: np.ndarray
    """TP communication on the critical path during forward."""
    tp_bwd_s: np.ndarray
    """TP communication during backward (recompute's forward communication included)."""
    hw_flops: np.ndarray
    """FLOPs executed per micro-batch per GPU (recompute included): for HFU."""

    @property
    def total_s(self) -> np.ndarray:
        return self.fwd_s + self.bwd_s + self.tp_fwd_s + self.tp_bwd_s


def _scale(profile: ModelProfile, cfg: ParallelConfig) -> float:
    """Everything in a profile is linear in the batch (DESIGN.md): scale to the micro-batch size."""
    return cfg.micro_batch_size / profile.batch_size


def cpu_sharing(profile: ModelProfile, gpu: GPU, cluster: Cluster) -> tuple[float, float] | None:
    """(threads per rank, cores) when the cluster's ranks share this machine's CPU cores and the
    profile was timed here, else None; see cost/sharing.py. (An analytic `cpu` profile already gives
    each rank its share of the machine's peak: cluster/devices.py, `cpu_device`.)"""
    threads = profile.extra.get("threads")
    if gpu.name != "cpu" or not profile.is_timed or not threads:
        return None
    cores = float(os.cpu_count() or 1)
    if threads * cluster.gpus_per_node <= cores:
        return None
    return float(threads), cores


def block_times(profile: ModelProfile, gpu: GPU, cluster: Cluster, cfg: ParallelConfig, dtype: str) -> BlockTimes:
    """Seconds per micro-batch per block on `gpu` under `cfg` (see [Note: achievable throughput])."""
    f = _scale(profile, cfg)
    peak = gpu.peak(dtype)
    width = (profile.hidden_size or 4096) / cfg.tp
    eff = efficiency(width)
    n = profile.num_blocks
    fwd = np.zeros(n)
    bwd = np.zeros(n)
    hw = np.zeros(n)
    tp_fwd = np.zeros(n)
    tp_bwd = np.zeros(n)
    tp_ranks = list(range(cfg.tp))  # a TP group is tp consecutive ranks in one node
    for i, b in enumerate(profile.blocks):
        shard = tp_divisor(profile, i, cfg.tp)
        fwd_flops = b.fwd_flops * f / shard
        bwd_flops = b.bwd_flops * f / shard
        recompute_flops = 0.0
        if b.kind in _RECOMPUTED_KINDS:
            if cfg.recompute == "full":
                recompute_flops = fwd_flops  # Chen et al. 2016; Korthikanti et al. 2022, Sec. 5
            elif cfg.recompute == "selective":
                recompute_flops = b.attention_core_fwd_flops * f / shard  # Korthikanti et al. 2022, Sec. 5
        if profile.is_timed and b.fwd_time_s is not None:
            # Affine in the batch: a fixed part (weights read, weight gradients written) plus a part
            # per sample ([Note: batch scaling] in graph/profile.py).
            fwd[i] = (b.fwd_time_fixed_s + (b.fwd_time_s - b.fwd_time_fixed_s) * f) / shard
            bwd[i] = ((b.bwd_time_fixed_s + (b.bwd_time_s - b.bwd_time_fixed_s) * f) / shard
                      + (fwd[i] * recompute_flops / fwd_flops if fwd_flops else 0.0))
        else:
            # Memory-bound floor: a block reads its input and writes its output at least once per
            # pass (roofline, Williams et al. 2009); backward moves about twice as much.
            traffic = 2.0 * b.output_bytes * f / (cfg.tp if cfg.sequence_parallel else 1)
            attn_fwd = b.attention_core_fwd_flops * f / shard
            attn_bwd = b.attention_core_bwd_flops * f / shard
            attn_recompute = attn_fwd if recompute_flops else 0.0

            def seconds(flops: float, attention: float) -> float:
                return (flops - attention) / (peak * eff) + attention / (peak * E_ATTENTION)

            fwd[i] = max(seconds(fwd_flops, attn_fwd), traffic / gpu.mem_bw_bytes_per_s)
            bwd[i] = max(seconds(bwd_flops + recompute_flops, attn_bwd + attn_recompute),
                         2 * traffic / gpu.mem_bw_bytes_per_s)
        hw[i] = fwd_flops + bwd_flops + recompute_flops
        if cfg.tp > 1 and b.tp_comm_bytes:
            # Megatron: all-reduces in forward and as many in backward (Shoeybi et al. 2019, Fig. 3);
            # with sequence parallelism each is a reduce-scatter + all-gather of the same volume
            # (Korthikanti et al. 2022, Sec. 4.2.2), which a ring costs the same.
            ar = allreduce_time_s(cluster, tp_ranks, b.tp_comm_bytes * f)
            tp_fwd[i] = ar
            tp_bwd[i] = ar + (ar if cfg.recompute == "full" and b.kind in _RECOMPUTED_KINDS else 0.0)
    return BlockTimes(fwd, bwd, tp_fwd, tp_bwd, hw)


def cut_transfer_time_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig, cut_index: int,
                        src_rank: int, dst_rank: int) -> float:
    """P2P time of the tensors crossing the cut after block `cut_index`, for one micro-batch.

    With tp > 1 each TP rank sends 1/tp of the boundary and the receivers all-gather it over
    NVLink (Narayanan et al. 2021, Sec. 4.1, "scatter/gather optimization").
    """
    num_bytes = profile.cuts[cut_index].num_bytes * _scale(profile, cfg)
    if cfg.tp == 1:
        return p2p_time_s(cluster, src_rank, dst_rank, num_bytes)
    gather = allgather_time_s(cluster, list(range(dst_rank - dst_rank % cfg.tp, dst_rank - dst_rank % cfg.tp + cfg.tp)),
                              num_bytes)
    return p2p_time_s(cluster, src_rank, dst_rank, num_bytes / cfg.tp) + gather


def cut_transfer_times_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig, src_rank: int,
                         dst_rank: int) -> np.ndarray:
    """`cut_transfer_time_s` for every cut at once (length num_blocks - 1). Alpha-beta costs are
    affine in the bytes, so two evaluations give the line."""
    num_bytes = np.array([c.num_bytes for c in profile.cuts], dtype=float) * _scale(profile, cfg)
    if cfg.tp == 1:
        alpha = p2p_time_s(cluster, src_rank, dst_rank, 0.0)
        per_byte = p2p_time_s(cluster, src_rank, dst_rank, 1e9) / 1e9 - alpha / 1e9
    else:
        group = list(range(dst_rank - dst_rank % cfg.tp, dst_rank - dst_rank % cfg.tp + cfg.tp))
        alpha = p2p_time_s(cluster, src_rank, dst_rank, 0.0) + allgather_time_s(cluster, group, 0.0)
        line = p2p_time_s(cluster, src_rank, dst_rank, 1e9 / cfg.tp) + allgather_time_s(cluster, group, 1e9)
        per_byte = (line - alpha) / 1e9
    return np.where(num_bytes > 0, alpha + per_byte * num_bytes, 0.0)


def dp_sync_time_s(cluster: Cluster, cfg: ParallelConfig, pp_index: int, grad_bytes: float) -> float:
    """Gradient reduction over the dp group of one pipeline rank (ring all-reduce; ZeRO's
    reduce-scatter + all-gather moves the same volume, Rajbhandari et al. 2020, Sec. 7)."""
    if cfg.dp == 1:
        return 0.0
    ranks = [cfg.rank(pp_index, d, 0) for d in range(cfg.dp)]
    return allreduce_time_s(cluster, ranks, grad_bytes)


def tied_sync_times_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig, ranges: list[tuple[int, int]],
                      grad_bytes_per_param: float) -> list[float]:
    """Seconds each pipeline rank spends summing the gradients of tied parameters with the other rank
    that holds a copy, per step: a tied head on the last stage and its embedding on the first
    all-reduce the shared weight's gradient, as Megatron-LM's embedding group does (Shoeybi et al.
    2019, Sec. 3; Narayanan et al. 2021). Nothing when both copies sit on one rank."""
    times = [0.0] * cfg.pp
    starts = [a for a, _ in ranges]

    def rank_of(block_index: int) -> int:
        return (bisect.bisect_right(starts, block_index) - 1) % cfg.pp

    for i, block in enumerate(profile.blocks):
        if not block.tied_params or block.tied_to_block is None:
            continue
        mine, theirs = rank_of(i), rank_of(block.tied_to_block)
        if mine == theirs:
            continue
        shard = tp_divisor(profile, i, cfg.tp)
        seconds = allreduce_time_s(cluster, [cfg.rank(mine, 0, 0), cfg.rank(theirs, 0, 0)],
                                   block.tied_params * grad_bytes_per_param / shard)
        times[mine] += seconds
        times[theirs] += seconds
    return times


# Bytes an Adam step reads and writes per parameter with mixed precision: fp32 master weight,
# momentum and variance read and written (3 x 4 x 2), the 2-byte gradient read and the 2-byte
# model weight written. The step is memory-bound (a few FLOPs per byte).
_ADAM_BYTES_PER_PARAM = 28.0


def optimizer_time_s(gpu: GPU, num_params: float) -> float:
    return num_params * _ADAM_BYTES_PER_PARAM / gpu.mem_bw_bytes_per_s
