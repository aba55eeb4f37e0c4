"""Time of each block on a GPU, and of the communication around it (seconds per micro-batch).

[Note: achievable throughput]
A block's compute time is the sum of its operators' times (cost/ops.py): GEMMs from their shapes,
fused attention from its FLOPs, memory-bound operators from their bytes, each at the rates the GPU's
calibration gives (cost/calibration.py: shipped per GPU, or written by `autoplan calibrate`). A
profile timed on the device (`--device cuda`) replaces this with measured times. A version-1
profile without an operator list falls back to FLOPs at the calibrated GEMM and attention shares.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from autoplan.cluster import GPU, Cluster, allgather_time_s, allreduce_time_s, p2p_time_s
from autoplan.cluster.devices import dtype_key
from autoplan.cost.calibration import Calibration, default_calibration
from autoplan.cost.comm import priced_once
from autoplan.cost.config import ParallelConfig
from autoplan.cost.experts import (
    expert_comm_times_s,
    expert_flops,
    sharded_but_experts,
)
from autoplan.cost.ops import memory_time_s, op_time_s
from autoplan.graph.blocks import Block, ModelProfile

__all__ = ["ADAM_BYTES_PER_PARAM", "BlockTimes", "block_times", "hidden_dropout_times_s", "op_pass_times", "cpu_sharing", "cut_transfer_time_s",
           "cut_transfer_times_s", "optimizer_time_s", "tied_sync_times_s", "tp_divisor", "tp_sharded"]

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
    """Everything in a profile is linear in the batch (docs/architecture.md, "Linear in the batch"): scale to the micro-batch size."""
    return cfg.batch_share(profile.batch_size)


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


def op_pass_times(block: Block, cal: Calibration, gpu: GPU, f: float, tp: int, sp: bool,
                   dtype: str, profile_dtype: str, ep: int = 1, expert_split: int = 1,
                   expert_tp: int = 1) -> tuple[float, float, float]:
    """(forward, backward, selective recompute) seconds of a block's operators at batch factor f on one
    of tp tensor-parallel and ep expert-parallel ranks, the experts' work split `expert_split` ways
    over tp and their weights `expert_tp` ways (cost/ops.py `scaled_op`). Operators recorded in the profile's dtype run
    in the job's. The third is what `recompute = selective` runs again under the calibration's stack
    (`Calibration.selective_recompute`): the attention core (Korthikanti et al. 2022, Sec. 5), or
    torchtitan's operator-level policy, which keeps every odd matmul's output and attention's and
    recomputes every even matmul and the memory-bound operators (torchtitan
    `distributed/activation_checkpoint.py`: half the forward GEMM time, all of its memory-bound time).
    A block of experts under ep > 1 prices each kernel at least at the stack's `host_sync_kernel_s`."""
    fwd = bwd = attention_fwd = gemm_fwd = memory_fwd = 0.0
    if ep > 1 and cal.host_sync_kernel_s > cal.kernel_floor_s and any(op.tp == "expert" for op in block.ops):
        # The forward's all-to-all brings the token counts to the host (so does its recompute): the
        # queue the host had issued ahead drains, and the kernels start at the host's pace. The
        # backward's exchanges reuse split sizes the host holds and wait on nothing; it is priced at
        # the same pace all the same, a simplification the fit prefers (calibration.py [Note:
        # software stacks], `host_sync_kernel_s`; forward only: docs/cost-model.md).
        cal = cal.replace(kernel_floor_s=cal.host_sync_kernel_s)
    for op in block.ops:
        if op.dtype == profile_dtype and op.dtype != dtype:
            op = dataclasses.replace(op, dtype=dtype)
        seconds = op.count * op_time_s(op, cal, gpu, f, tp, sp, ep, expert_split, expert_tp)
        if op.phase == "fwd":
            fwd += seconds
            if op.kind == "attention":
                attention_fwd += seconds
            elif op.kind == "gemm":
                gemm_fwd += seconds
            else:
                memory_fwd += seconds
        else:
            bwd += seconds
    if cal.hidden_dropout and block.kind in _RESIDUAL_DROPOUTS:
        drop_fwd, drop_bwd = hidden_dropout_times_s(block, cal, gpu, f, tp, sp, dtype, profile_dtype)
        fwd += drop_fwd
        memory_fwd += drop_fwd
        bwd += drop_bwd
    selective = attention_fwd if cal.selective_recompute == "attention" else gemm_fwd / 2 + memory_fwd
    return fwd, bwd, selective


# [Note: hidden dropout]
# Megatron-LM drops out each residual branch of a transformer layer (`--hidden-dropout`, 0.1 by
# default: megatron/arguments.py) in a fused bias-dropout-add kernel (megatron/model/transformer.py,
# `bias_dropout_add_fused_train`), two per layer (after attention and after the MLP). Beside the
# residual add the profiled model already has, each one costs
# - forward: its mask, one byte an element written by the same kernel (Korthikanti et al. 2022,
#   "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1, counts the dropout
#   mask at one byte an element);
# - backward: a kernel that reads the gradient and the mask and writes the gradient (2 + 1 + 2 bytes
#   an element at 2-byte elements, the gradient at the job's element size), where the plain add's
#   backward passes the gradient through.
# The elements are the layer's hidden state, s b h: whole on every tp rank, since the dropout acts
# on the tensor the row-parallel all-reduce made whole, and 1/tp of it under sequence parallelism
# (Korthikanti et al. 2022, Sec. 4.2.2). Full recompute runs the forward again (`block_times`).
# Only a stack that says so (`Calibration.hidden_dropout`: Megatron-LM as its 2021 runs ran it).
_RESIDUAL_DROPOUTS = {"layer": 2, "attention": 1, "mlp": 1}
"""Residual dropouts per block kind ([Note: hidden dropout])."""
_DROPOUT_MASK_BYTES = 1.0
"""Bytes of a dropout mask an element (a bool tensor)."""


def hidden_dropout_times_s(block: Block, cal: Calibration, gpu: GPU, f: float, tp: int, sp: bool, dtype: str,
                           profile_dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of `block`'s residual dropouts at batch factor f on one of tp ranks
    ([Note: hidden dropout]); the forward is the masks' bytes inside the add's kernel (no floor of
    its own), the backward one kernel per dropout."""
    count = _RESIDUAL_DROPOUTS.get(block.kind, 0)
    if count == 0 or block.output_bytes <= 0:
        return 0.0, 0.0
    itemsize = float(_ITEMSIZE.get(dtype_key(profile_dtype), 2))
    elements = block.output_bytes / itemsize * f / (tp if sp and tp > 1 else 1)
    backward_bytes = 2 * float(_ITEMSIZE.get(dtype_key(dtype), 2)) + _DROPOUT_MASK_BYTES  # gradient in and out, mask
    bandwidth = cal.memory_bandwidth_efficiency * gpu.mem_bw_bytes_per_s
    fwd = count * elements * _DROPOUT_MASK_BYTES / bandwidth
    bwd = count * memory_time_s(cal, gpu, elements * backward_bytes)
    return fwd, bwd


_ITEMSIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def _flops_seconds(cal: Calibration, gpu: GPU, dtype: str, flops: float, attention: float, phase: str) -> float:
    """FLOPs at the calibrated GEMM share, the attention part at the attention share (profiles
    without an operator list)."""
    peak = gpu.peak(dtype)
    attention_share = cal.attention_fwd_efficiency if phase == "fwd" else cal.attention_bwd_efficiency
    seconds = (flops - attention) / (peak * cal.gemm(dtype_key(dtype))) + attention / (peak * attention_share)
    return max(seconds, cal.kernel_floor_s)


def block_times(profile: ModelProfile, gpu: GPU, cluster: Cluster, cfg: ParallelConfig, dtype: str,
                calibration: Calibration | None = None) -> BlockTimes:
    """Seconds per micro-batch per block on `gpu` under `cfg` (see [Note: achievable throughput])."""
    cal = calibration or default_calibration(gpu)
    f = _scale(profile, cfg)
    n = profile.num_blocks
    fwd = np.zeros(n)
    bwd = np.zeros(n)
    hw = np.zeros(n)
    tp_fwd = np.zeros(n)
    tp_bwd = np.zeros(n)
    tp_ranks = list(range(cfg.tp))  # a TP group is tp consecutive ranks in one node
    by_fingerprint: dict[tuple, tuple[float, float, float]] = {}
    for i, b in enumerate(profile.blocks):
        shard = tp_divisor(profile, i, cfg.tp)
        whole = False  # priced whole over its Amdahl share (operator profiles only, below)
        fwd_flops = b.fwd_flops * f / shard
        bwd_flops = b.bwd_flops * f / shard
        recompute_flops = 0.0
        if b.kind in _RECOMPUTED_KINDS:
            if cfg.recompute == "full":
                recompute_flops = fwd_flops  # Chen et al. 2016; Korthikanti et al. 2022, Sec. 5
            elif cfg.recompute == "selective" and cal.selective_recompute == "op":
                # torchtitan's operator-level policy: every second matmul ([Note: software stacks]).
                recompute_flops = (fwd_flops - b.attention_core_fwd_flops * f / shard) / 2
            elif cfg.recompute == "selective":
                recompute_flops = b.attention_core_fwd_flops * f / shard  # Korthikanti et al. 2022, Sec. 5
        if profile.is_timed and b.fwd_time_s is not None:
            # Affine in the batch: a fixed part (weights read, weight gradients written) plus a part
            # per sample ([Note: batch scaling] in graph/profile.py).
            fwd[i] = (b.fwd_time_fixed_s + (b.fwd_time_s - b.fwd_time_fixed_s) * f) / shard
            bwd[i] = ((b.bwd_time_fixed_s + (b.bwd_time_s - b.bwd_time_fixed_s) * f) / shard
                      + (fwd[i] * recompute_flops / fwd_flops if fwd_flops else 0.0))
        elif b.ops:
            # Operator by operator (cost/ops.py). A block tensor parallelism shards only in part
            # (tp_divisor < tp) is priced whole and divided by its Amdahl share, unless what it leaves
            # whole is its experts, whose operators say so (cost/experts.py [Note: experts on a GPU]).
            whole = (cfg.tp > 1 and tp_sharded(b.kind) and shard < cfg.tp * 0.99
                     and not sharded_but_experts(profile, i))
            op_tp = 1 if whole or not tp_sharded(b.kind) else cfg.tp
            key = (b.fingerprint or i, op_tp)
            if key not in by_fingerprint:
                by_fingerprint[key] = op_pass_times(b, cal, gpu, f, op_tp, cfg.sequence_parallel, dtype, profile.dtype,
                                                    cfg.ep, 1 if whole else cfg.expert_work_split,
                                                    1 if whole else cfg.expert_tp)
            f_s, b_s, selective_s = by_fingerprint[key]
            divide = shard if whole else 1.0
            fwd[i] = f_s / divide
            recompute_s = 0.0
            if b.kind in _RECOMPUTED_KINDS:
                recompute_s = {"full": f_s, "selective": selective_s}.get(cfg.recompute, 0.0)
            bwd[i] = (b_s + recompute_s) / divide
        else:
            # A profile without operators (schema 1): FLOPs at the calibrated shares.
            attn_fwd = b.attention_core_fwd_flops * f / shard
            attn_bwd = b.attention_core_bwd_flops * f / shard
            attn_recompute = attn_fwd if recompute_flops else 0.0
            fwd[i] = _flops_seconds(cal, gpu, dtype, fwd_flops, attn_fwd, "fwd")
            bwd[i] = _flops_seconds(cal, gpu, dtype, bwd_flops + recompute_flops, attn_bwd + attn_recompute, "bwd")
        hw[i] = fwd_flops + bwd_flops + recompute_flops
        if cfg.expert_work_split > 1 and not whole:
            # The experts' FLOPs a tp rank leaves to its peers: their tokens under expert tp 1, their
            # hidden units under expert tp tp (`scaled_op`).
            hw[i] -= expert_flops(b, f, cfg.recompute == "full" and b.kind in _RECOMPUTED_KINDS) \
                * (1 - 1 / cfg.expert_work_split)
        overlapped = cal.tp_comm_overlap and cfg.sequence_parallel and b.kind in _RECOMPUTED_KINDS
        if cfg.tp > 1 and b.tp_comm_bytes and not overlapped:
            # Megatron: all-reduces in forward and as many in backward (Shoeybi et al. 2019, Fig. 3);
            # with sequence parallelism each is a reduce-scatter + all-gather of the same volume
            # (Korthikanti et al. 2022, Sec. 4.2.2), which a ring costs the same. A stack that runs
            # a layer's inside its GEMMs (`Calibration.tp_comm_overlap`) leaves none exposed; the
            # embedding's and the head's are not Transformer Engine GEMMs and stay exposed.
            ar = allreduce_time_s(cluster, tp_ranks, b.tp_comm_bytes * f)
            tp_fwd[i] = ar
            tp_bwd[i] = ar + (ar if cfg.recompute == "full" and b.kind in _RECOMPUTED_KINDS else 0.0)
    if cfg.cp > 1:
        gather = kv_exchange_times_s(profile, cluster, cfg)
        tp_fwd += gather
        # The backward reduce-scatters the keys' and values' gradients (the same volume); full
        # recompute gathers them again.
        tp_bwd += gather * np.array([2.0 if cfg.recompute == "full" and b.kind in _RECOMPUTED_KINDS else 1.0
                                     for b in profile.blocks])
    if cfg.holds_expert_slices:
        exchange = expert_comm_times_s(profile, cluster, cfg, cal.expert_dispatch)
        tp_fwd += exchange
        # Backward sends the gradients of both exchanges back (and gathers the tokens' gradients
        # over tp); full recompute repeats the forward's.
        tp_bwd += exchange * np.array([2.0 if cfg.recompute == "full" and b.kind in _RECOMPUTED_KINDS else 1.0
                                       for b in profile.blocks])
    return BlockTimes(fwd, bwd, tp_fwd, tp_bwd, hw)


def gathered_kv_bytes(profile: ModelProfile, cfg: ParallelConfig) -> np.ndarray:
    """Per block, the bytes of keys and values its attention reads for one micro-batch on one GPU,
    whole sequences: what context parallelism all-gathers (from the profile's fused attention
    operators, shape (batch, heads, q_len, kv_len, head_dim), at the model's key/value heads; tp
    divides the heads)."""
    rows = cfg.micro_batch_size / profile.batch_size
    # The operator lists query heads; grouped-query attention gathers its key/value heads only.
    kv_share = profile.num_kv_heads / profile.num_heads if profile.num_kv_heads and profile.num_heads else 1.0
    out = np.zeros(profile.num_blocks)
    for i, b in enumerate(profile.blocks):
        for op in b.ops:
            if op.kind == "attention" and op.phase == "fwd" and len(op.shape) == 5:
                batch, heads, _, kv_len, head_dim = op.shape
                heads *= kv_share
                itemsize = {"fp32": 4, "fp8": 1}.get(dtype_key(op.dtype), 2)
                out[i] += 2 * batch * heads * kv_len * head_dim * itemsize * op.count * rows
        if cfg.tp > 1 and tp_sharded(b.kind):
            out[i] /= cfg.tp
    return out


def kv_exchange_times_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig) -> np.ndarray:
    """Per block, seconds of context parallelism's key/value all-gather in one forward of one
    micro-batch: each of the cp ranks contributes its 1/cp of the sequence's keys and values and
    receives the rest (Llama 3's all-gather context parallelism, arXiv:2407.21783 Sec. 3.3.2; a ring
    all-gather of N bytes over n ranks costs (n - 1) alpha + (n - 1)/n N / beta, Thakur et al. 2005,
    `allgather_time_s`). Not overlapped with compute (Llama 3 notes the all-gather is exposed but
    small beside long-context attention). The cp group is cp consecutive dp ranks."""
    ranks = [cfg.rank(0, d, 0) for d in range(cfg.cp)]
    return priced_once(gathered_kv_bytes(profile, cfg), lambda n: allgather_time_s(cluster, ranks, n))


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
    """`cut_transfer_time_s` for every cut at once (length num_blocks - 1); equal byte counts are
    priced once (a transformer's cuts between layers all carry the same hidden state)."""
    priced: dict[int, float] = {}
    out = np.zeros(len(profile.cuts))
    for i, cut in enumerate(profile.cuts):
        if cut.num_bytes not in priced:
            priced[cut.num_bytes] = cut_transfer_time_s(profile, cluster, cfg, i, src_rank, dst_rank)
        out[i] = priced[cut.num_bytes]
    return out


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


# [Note: optimizer bytes]
# The optimizer step is memory-bound (a few FLOPs per byte), so it is priced by the bytes it moves
# per parameter. A fused mixed-precision Adam (today's stacks: torch's fused AdamW) reads and writes
# the fp32 master weight, momentum and variance (3 x 4 x 2), reads the 2-byte gradient and writes the
# 2-byte model weight: 28 bytes, `ADAM_BYTES_PER_PARAM`. A stack whose step makes more passes over
# memory says so in its calibration (`Calibration.optimizer_bytes_per_param`, a count, never fitted):
# Megatron-LM in 2021 (megatron/optimizer/optimizer.py at b4bc51b1e7,
# `Float16OptimizerWithFloat16Params.step`) unscales the fp32 main gradients and checks them for
# inf in place (`torch._amp_foreach_non_finite_check_and_unscale_`: read 4 + write 4), reads them for
# the clip norm (clip_grads.py `clip_grad_norm_fp32`, apex `multi_tensor_l2norm`: 4; the rescale
# that follows only when the norm exceeds the clip is left out), steps apex's FusedAdam over the
# fp32 masters alone (master, momentum and variance read and written, the 4-byte fp32 gradient read,
# no model weight written: 28), and copies the masters to the fp16 model weights in a pass of its
# own (`_copy_main_params_to_model_params`, apex `multi_tensor_scale`: read 4 + write 2):
# 8 + 4 + 28 + 6 = 46. (Its fp32 gradients are the DDP buffer's `main_grad`, accumulated in fp32,
# so `_copy_model_grads_to_main_grads` moves no bytes.)
ADAM_BYTES_PER_PARAM = 28.0


def optimizer_time_s(gpu: GPU, num_params: float, bytes_per_param: float = ADAM_BYTES_PER_PARAM) -> float:
    """Seconds an optimizer step over `num_params` takes on `gpu`, moving `bytes_per_param` bytes
    per parameter at the GPU's memory bandwidth ([Note: optimizer bytes])."""
    return num_params * bytes_per_param / gpu.mem_bw_bytes_per_s
