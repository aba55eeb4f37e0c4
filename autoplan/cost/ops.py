"""Operator-level time: what each recorded operator (graph/operators.py) takes on one GPU.

A block's time is the sum of its operators' times (docs/architecture.md, "Operator-level cost"). Three models,
each reading the GPU's datasheet (`cluster/devices.py`) and its calibration (`cost/calibration.py`):

- **GEMM** (m x k times k x n, `batch` of them): the roofline (Williams, Waterman & Patterson 2009,
  "Roofline", CACM 52(4)): the slower of the compute at the calibrated share of dense peak and the
  operands' and result's traffic at the achieved memory bandwidth,

      t = max(2 batch m n k / (e_gemm P),  bytes(A, B, C) / (e_mem B_mem)),

  so a skinny GEMM (k = 128, an attention score product) is priced by its bytes and a large one by
  its FLOPs. (Adding the two terms instead was tried: it charged large GEMMs 15-20% for traffic a
  tiled kernel hides, and the H100 fit pinned e_gemm at 1.)
- **Fused attention** (FlashAttention-2 or -3, cuDNN's, a Triton kernel: whichever the stack names,
  its share bounded by that kernel's published benchmarks, calibration.py [Note: attention kernels]):
  its FLOPs (torch's `sdpa_flop_count`, the full s x s score
  matrix) times the share of that work the kernel does (about 1/2 when causal: masked tiles are
  skipped, Dao 2023, FlashAttention-2, Sec. 3.1.1), at the calibrated forward and backward shares of
  peak (the backward recomputes the scores and does 2.5x the forward's FLOPs, Dao 2023, Sec. 3.1.2).
- **Unfused attention** (a calibration whose stack says `attention_kernel = "unfused"`, such as
  Megatron-LM in 2021; calibration.py [Note: software stacks]): priced from its parts, with no
  attention share of its own (`unfused_attention_time_s`): the score and value GEMMs (two forward,
  four backward) over the whole s x s matrix (the mask is applied after every score is computed),
  and the score matrix's traffic through the fused scale-mask-softmax kernel and attention dropout
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec.
  4.1, counts per score 2 bytes of softmax output, 1 of dropout mask and 2 of dropout output):
  forward 4 (softmax read + write) + 5 (dropout read, write, mask) bytes per score, backward 5
  (dropout) + 6 (softmax backward reads output and gradient, writes the gradient) bytes per score,
  at 2-byte elements.
- **Memory-bound operators** (norms, element-wise, softmax, copies, the embedding's gradient): the
  bytes they read and write at the achieved bandwidth, never under the per-kernel floor (launch and
  tail; Williams et al. 2009 for the bandwidth term).

Every operator is priced at least at the kernel floor.
"""

from __future__ import annotations

from autoplan.cluster import GPU
from autoplan.cluster.devices import dtype_key
from autoplan.cost.calibration import Calibration
from autoplan.graph.blocks import Op

__all__ = ["attention_time_s", "gemm_time_s", "memory_time_s", "op_time_s", "scaled_op", "unfused_attention_time_s"]


def _peak(gpu: GPU, dtype: str) -> float:
    try:
        return gpu.peak(dtype)
    except ValueError:  # a dtype the device lacks (int64 index math): the best it has
        return max(gpu.peak_flops.values())


def gemm_time_s(cal: Calibration, gpu: GPU, batch: float, m: float, n: float, k: float, dtype: str,
                element_bytes: float = 2.0) -> float:
    """One (batched) GEMM: see the module docstring."""
    key = _dtype_key(dtype)
    flops = 2.0 * batch * m * n * k
    traffic = element_bytes * batch * (m * k + k * n + m * n)
    compute = flops / (cal.gemm(key) * _peak(gpu, key))
    return max(cal.kernel_floor_s, compute, traffic / (cal.memory_bandwidth_efficiency * gpu.mem_bw_bytes_per_s))


def attention_time_s(cal: Calibration, gpu: GPU, flops: float, causal: bool, phase: str, dtype: str,
                     shape: tuple[float, ...] = ()) -> float:
    """One attention call of `flops` (counted over the full score matrix): fused, or from its parts
    under an unfused stack when its shape (batch, heads, q_len, kv_len, head_dim) is known."""
    if cal.attention_kernel == "unfused" and len(shape) == 5:
        return unfused_attention_time_s(cal, gpu, shape, phase, dtype)
    work = flops * (cal.causal_work_fraction if causal else 1.0)
    efficiency = cal.attention_fwd_efficiency if phase == "fwd" else cal.attention_bwd_efficiency
    return max(cal.kernel_floor_s, work / (efficiency * _peak(gpu, _dtype_key(dtype))))


_UNFUSED_SCORE_BYTES = {"fwd": 9.0, "bwd": 11.0}
"""Bytes per score an unfused attention moves outside its GEMMs at 2-byte elements (module docstring)."""


def unfused_attention_time_s(cal: Calibration, gpu: GPU, shape: tuple[float, ...], phase: str, dtype: str) -> float:
    """One unfused attention pass of `shape` = (batch, heads, q_len, kv_len, head_dim): see the module
    docstring. Forward: S = Q K^T and O = P V; backward: dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q."""
    batch, heads, q_len, kv_len, head_dim = shape
    bh = batch * heads
    size = _element_bytes(dtype)
    if phase == "fwd":
        gemms = (gemm_time_s(cal, gpu, bh, q_len, kv_len, head_dim, dtype, size)
                 + gemm_time_s(cal, gpu, bh, q_len, head_dim, kv_len, dtype, size))
    else:
        gemms = (gemm_time_s(cal, gpu, bh, q_len, kv_len, head_dim, dtype, size)
                 + gemm_time_s(cal, gpu, bh, kv_len, head_dim, q_len, dtype, size)
                 + gemm_time_s(cal, gpu, bh, q_len, head_dim, kv_len, dtype, size)
                 + gemm_time_s(cal, gpu, bh, kv_len, head_dim, q_len, dtype, size))
    scores = bh * q_len * kv_len
    return gemms + memory_time_s(cal, gpu, _UNFUSED_SCORE_BYTES[phase] * size / 2.0 * scores)


def memory_time_s(cal: Calibration, gpu: GPU, num_bytes: float) -> float:
    """One memory-bound kernel moving `num_bytes` (read + written)."""
    return max(cal.kernel_floor_s, num_bytes / (cal.memory_bandwidth_efficiency * gpu.mem_bw_bytes_per_s))


_KEYS: dict[str, str] = {}


def _dtype_key(dtype: str) -> str:
    key = _KEYS.get(dtype)
    if key is None:
        try:
            key = dtype_key(dtype)
        except ValueError:  # integer and boolean operators: priced like the widest float
            key = "fp32"
        _KEYS[dtype] = key
    return key


def scaled_op(op: Op, batch_factor: float, tp: int, sequence_parallel: bool,
              ep: int = 1, expert_split: int = 1, expert_tp: int = 1) -> tuple[tuple[float, ...], float, float]:
    """(shape, flops, bytes) of `op` at `batch_factor` times the profile's batch on one of `tp`
    tensor-parallel ranks: the batch axis grows, the tp axis (or a memory op's bytes, unless they are
    hidden-shaped without sequence parallelism: Korthikanti et al. 2022, Sec. 4.2.2) shrinks.

    An operator of grouped experts (`op.tp == "expert"`, [Note: expert operators] in
    graph/operators.py) is whole on each tp rank (the layout shards no expert) and, on one of `ep`
    expert-parallel ranks, runs experts / ep of the experts on the tokens the ep group routes to
    them (GShard, arXiv:2006.16668, Sec. 3.2; runtime/parallel/experts.py: a rank computes (E/ep, ep * n, ...)
    in place of (E, n, ...)): the expert axis (a GEMM's first) divides by ep and its batch axis grows
    ep times, so the FLOPs and the per-batch bytes stay, and the weights' bytes (`fixed_bytes`: the
    weights a GEMM reads, their gradients and the gradients' accumulation) divide by ep.
    `expert_split` (`ParallelConfig.expert_token_split`): the ways a replica's tp ranks split the
    tokens that reach the experts under expert tp 1 (Megatron-Core MoE README, "MoE parallel
    folding": with ETP 1 each tp rank dispatches its own 1/tp of the tokens, so no expert GEMM is
    repeated on the tp ranks): an expert operator's tokens, and so its FLOPs and per-batch bytes,
    divide by it, its weights' bytes do not. Under expert tp (`expert_tp` = tp, `expert_split` then
    `ParallelConfig.expert_work_split`) a rank runs every token on 1/expert tp of each expert's hidden
    units: the same FLOPs and per-batch bytes as a 1/tp share of the tokens, which is how it is
    priced (the GEMM's narrower hidden axis, not its fewer rows, is not modelled), and the weights'
    bytes divide by ep x expert tp."""
    shape = list(op.shape)
    if op.tp == "expert":
        batch_factor /= expert_split
    if op.batch_axis is not None and shape:
        shape[op.batch_axis] *= batch_factor
    split = 1.0
    fixed = op.fixed_bytes
    if op.tp == "expert":
        fixed /= expert_tp
        if ep > 1:
            fixed /= ep
            if op.kind == "gemm" and len(shape) == 4 and op.batch_axis not in (None, 0):
                shape[0] /= ep
                shape[op.batch_axis] *= ep
    elif tp > 1:
        if op.kind == "memory":
            split = tp if (op.tp == "sharded" or sequence_parallel) else 1.0
        elif op.tp_axis is not None and shape:
            split = tp
            shape[op.tp_axis] /= tp
        else:
            split = tp
    flops = op.flops * batch_factor / split
    num_bytes = (op.bytes * batch_factor + fixed) / split
    return tuple(shape), flops, num_bytes


def op_time_s(op: Op, cal: Calibration, gpu: GPU, batch_factor: float, tp: int, sequence_parallel: bool,
              ep: int = 1, expert_split: int = 1, expert_tp: int = 1) -> float:
    """Seconds of one call of `op` (multiply by `op.count` for the pass) on one of `tp` tensor-parallel
    and `ep` expert-parallel ranks, the experts' work split `expert_split` ways, their weights
    `expert_tp` ways (`scaled_op`)."""
    shape, flops, num_bytes = scaled_op(op, batch_factor, tp, sequence_parallel, ep, expert_split, expert_tp)
    if op.kind == "gemm":
        if len(shape) == 4:
            return gemm_time_s(cal, gpu, *shape, op.dtype, element_bytes=_element_bytes(op.dtype))
        key = _dtype_key(op.dtype)  # a FLOP-counted operator without a GEMM shape: compute and bytes
        return max(cal.kernel_floor_s, flops / (cal.gemm(key) * _peak(gpu, key)),
                   num_bytes / (cal.memory_bandwidth_efficiency * gpu.mem_bw_bytes_per_s))
    if op.kind == "attention":
        return attention_time_s(cal, gpu, flops, op.causal, op.phase, op.dtype, shape)
    return memory_time_s(cal, gpu, num_bytes)


def _element_bytes(dtype: str) -> float:
    return {"fp32": 4.0, "tf32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}[_dtype_key(dtype)]
