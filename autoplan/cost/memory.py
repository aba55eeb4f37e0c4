"""Memory per GPU: weights, gradients, optimizer states, activations, buffers, allowance.

[Note: bytes per parameter]
Mixed precision as Megatron-LM keeps it and as autoplan's runtime runs it (runtime/parallel/precision.py):
2 bytes of bf16/fp16 working weights, 4 bytes of fp32 gradient (Megatron's `main_grad`, accumulated
and all-reduced in fp32), 4 bytes of fp32 master weights and 8 of Adam's two fp32 moments: 18 bytes
per parameter (Megatron-LM docs, "Distributed Optimizer", table of bytes per parameter: "bf16 param,
fp32 grads: 18"). ZeRO (Rajbhandari et al. 2020, Sec. 3.1) counts 16 with bf16 gradients, which is 2
bytes per parameter short of what either runtime allocates. In fp32 training: 4 + 4 + 8 = 16.
`MemoryBreakdown` files the master with the weights (2 + 4), so weights + gradients + optimizer are
what the runtime holds between steps at each ZeRO level (`persistent_bytes_per_param`):

    zero 0 (replicated):                    6 + 4 + 8             (fp32: 4 + 4 + 8)
    zero 1 (runtime/parallel/optimizer.py):          2 + 4/dp + 4 + 8 / dp (fp32: 4 + 4 + 8 / dp; at any tp:
                                                                   the fp32 masters and Adam's state
                                                                   of the rank's tp shards, split
                                                                   over its dp group)
    zero 2, 3 (FSDP2 over dp_shard ranks):  (4 + 4 + 8) / dp_shard

ZeRO-1 here is Megatron-LM's distributed optimizer's 2 + 4 + 12 / dp (its docs' table, "bf16 param,
fp32 grads": 4 + 16 / dp with bf16 gradients, here the gradients are fp32 `main_grad`s) and the
ZeRO paper's P_os (Rajbhandari et al. 2020, Fig. 1) with fp32 gradients: each dp rank keeps the
fp32 masters and Adam's moments of the parameters it owns (whole parameters, as torch's
ZeroRedundancyOptimizer assigns them, so a rank's share is 1/dp of the elements up to one
parameter), every rank the bf16 working weights and the fp32 gradients (all-reduced, not
reduce-scattered). In fp32 the parameter is its own master: 4 + 4 + 8 / dp. FSDP2 (`fully_shard`, Zhao et al. 2023, "PyTorch
FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 16(12), Sec. 3.2) keeps each
parameter as a 1/dp_shard fp32 shard (the master, `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`), its fp32 gradient shard and Adam's state of the shard: ZeRO-3's P_os+g+p
(Rajbhandari et al. 2020, Sec. 5) with fp32 gradients. HSDP shards over dp_shard = dp / dp_replicate
ranks and replicates across the dp_replicate groups (Zhao et al. 2023, Sec. 3.2.2, "hybrid
sharding"; torchtitan's `data_parallel_replicate_degree`), so its figures divide by dp_shard.

[Note: FSDP gathered bytes]
What FSDP unshards during a step (`MemoryBreakdown.gathered_bytes`). One FSDP unit per block the
traced graph calls whole (runtime/parallel/fsdp.py): the unit's parameters are all-gathered in the compute
dtype (2 bytes in bf16, 4 in fp32) before it runs.
- zero 2 (`reshard_after_forward=False`, ZeRO-2's P_os+g): the rank's stages stay gathered from the
  first forward to the end of the backward: 2 bytes per parameter of the rank.
- zero 3 (`reshard_after_forward=True`): the unit computing and the next one, prefetched (Zhao et
  al. 2023, Sec. 4.2, "backward / forward prefetching"): the two largest units of the rank. With
  pp > 1 a unit's backward leaves it gathered until the step's end (`reshard_after_backward=False`,
  torch's pipelining does the same, so the next micro-batch's backward gathers nothing), so by the
  last backward the rank's stages are gathered as under zero 2: 2 bytes per parameter of the rank.
- Gradients: with pp = 1 FSDP reduce-scatters each unit's fp32 gradient after every micro-batch's
  backward (its autograd hooks), so one unit's unsharded fp32 gradient is in flight; with pp > 1 the
  pipeline's micro-batches interleave, a stage's gradients accumulate unsharded in fp32 (4 bytes per
  parameter of the stage) from its first backward and are reduce-scattered, and its parameters
  resharded, right after its last backward (torch's pipelining: `backward_maybe_with_nosync`, later
  `perform_reduce_grad` placed after a stage's last backward by `_add_reduce_grad`; autoplan's
  executor the same, runtime/parallel/fsdp.py). With one stage a rank that is the whole step. A rank
  holding several stages (interleaved 1F1B) holds, at each moment of its schedule, the gathered
  parameters and gradients of the stages between their first forward (first backward, for the
  gradient and under zero 3 the parameters) and their last backward (`_fsdp_bytes_per_moment`,
  search/inflight.py `interleaved_moments`). At m = p every backward of chunk v - 1 precedes the
  first of chunk v - 2, so one stage's gradient is held at a time: torchtitan's Llama 3.1 405B at
  pp 8 x tp 8 x FSDP 8 measured 72.7 GiB under Interleaved1F1B against 82.5 under 1F1B
  (docs/published-memory.md); summing every stage's gradient over the step predicted 86.5 (1.19x),
  the moments 74.7 (1.03x).

[Note: tied parameters]
A block whose parameters are shared with an earlier block (`Block.tied_to_block`, a head tied to the
embedding) holds a copy of them (`Block.param_bytes`) only when the owner lives on another GPU;
on the same GPU the runtime keeps one tensor, one gradient and one optimizer state
(runtime/parallel/precision.py, "tied parameters share one"), so they count once (`held_params`).

[Note: activations]
A block's saved-for-backward bytes come from the profile (measured on fake tensors). Under tensor
parallelism, tensors of the layer's hidden shape (norm inputs, residuals) are replicated on every
TP rank and the rest is sharded; with sequence parallelism everything is sharded (Korthikanti et
al. 2022, Eqs. 2-4). Full recomputation keeps only each layer's input, plus one layer's full
activations while it is recomputed (the same paper, Sec. 5). A stage keeps the activations of
every micro-batch in flight: the schedule simulator counts them (GPipe m, 1F1B p - s, ...). A GPU
holding several virtual stages (interleaved 1F1B) holds, at its peak, what its chunks hold at one
moment, not the sum of each chunk's own peak: the chunks do not peak together. At the end of the
warm-up rank r holds 2 (p - r - 1) + (v - 1) p + 1 chunk-micro-batches (Megatron-LM's warm-up;
Narayanan et al. 2021, Sec. 2.2.2: the first stage holds L (1 + (p - 1) / (p v)) layers' worth);
the sum of the chunks' peaks was 23-30% more at v >= 4 (p 8, v 4: 48 against 39 on rank 0).
`rank_memory` takes the moments (search/inflight.py `interleaved_held`).
Another runtime runs the same layer with other saved tensors: under a named stack that describes
its own layer and loss (torchtitan, Megatron-Core), `block_act_bytes` counts them from the layer's
shapes instead of the profile, and the loss's backward holds what that stack's loss holds
(cost/memory_stacks.py [Note: memory per stack]; validated on published peaks by
benchmarks/validate_memory.py, docs/published-memory.md). With no stack, or the default one, the
profile's bytes stand: what autoplan's runtime holds.

[Note: ZB-H1's pending W]
Under ZB-H1 a stage that splits its backward (every stage but the first, runtime/execution/executor.py) runs B
with torch's `stage_backward_input` (torch/distributed/pipelining/_backward.py), which keeps the graph
and the gradients of the outputs of every op that uses a weight, for `stage_backward_weight` at W. So
a micro-batch between its B and its W holds its activations (counted among the p in flight,
search/inflight.py) and those intermediate gradients, which the in-flight count does not see. They
are fewer bytes than one micro-batch's activations (each weight's output gradient has the output's
shape: a Llama layer's linears' outputs are 3 h + 2 d_kv + 2 f a token, 0.62 of Megatron-Core's saved
6 h + 2 d_kv + 3 f at Llama 3 8B's shapes), so one micro-batch's activations are added. Measured on 2 gloo ranks
(benchmarks/memory_layouts_cpu.py, case pp2-zb-h1; autoplan's zb-h1 at pp 2 runs W0 after B1, so two
micro-batches wait for their W at the peak, each with about 0.6 of a micro-batch in gradients): without
this term the last stage's peak was predicted at 0.94 x measured in bf16 (0.96 in fp32), the only
layout kind under 0.95; with it 1.05 / 1.12. Not validated deeper: at pp 4 the last stage runs all p
B's before its first W (autoplan/schedule's zb-h1; Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", Sec. 3.1, Fig. 3), so up to p micro-batches keep their gradients, about 0.6 p
micro-batches' activations: more than this term adds from pp 3 on.

[Note: fused RMSNorm]
The profile runs on CPU (fake tensors), where nn.RMSNorm's `_fused_rms_norm` has no kernel and
runs its composite form (torch/_decomp/decompositions.py `_fused_rms_norm`): it saves the fp32
upcast input and the fp32 normalized input (8 bytes an element in bf16; 4 + 4 in fp32). On CUDA
`rms_norm` calls the fused kernel (ATen layer_norm.cpp `rms_norm_symint`, torch >= 2.8), whose
backward `_fused_rms_norm_backward(grad, input, normalized_shape, rstd, weight, mask)` needs only
the input in its own dtype and one fp32 rstd a row; torchtitan's Triton `fused_rmsnorm` (the
`norm_type` of its Llama 2 13B config when its performance table was taken, April 2024) saves the
same (x, weight, rstd). So on a GPU a norm keeps 2 bytes an element in bf16, not 8: the profile's
count is 6 bytes an element over per norm, two norms a layer (`fused_norm_surplus` takes it off;
a CPU rank keeps it). That is a model's own nn.RMSNorm. The zoo's norms are `autoplan::rms_norm`
(models/ops.py [Note: lean RMSNorm]), which keeps the fused kernel's set on every device, CPU ranks
and the profile's fake tensors included: its blocks record no `_fused_rms_norm`, so nothing is taken
off and a CPU rank counts what a GPU does. What is left is
Korthikanti et al. 2022's per-layer count (Sec. 4.1) adapted to a Llama layer with flash attention
(no s x s term) and no dropout (benchmarks/lean_layer.py `korthikanti_terms` names every term): norm
inputs 2 x 2sbh, the q/k/v projections' input 2sbh, q 2sbh, k and v 2sbh x num_kv_heads / num_heads
each (the zoo's attention passes them to the kernel at their own heads, `enable_gqa`; a model that
repeats them to the query heads keeps the repeats), the attention output 2sbh (flash attention's
saved output, also the output projection's input), the MLP's input 2sbh and SwiGLU's three tensors of
the FFN width 3 x 2sbf (gate and up, kept by the zoo's `autoplan::swiglu`, which recomputes silu as
Megatron-Core's fused SwiGLU does, [Note: lean SwiGLU] in models/ops.py; and their product, the down
projection's input), plus an fp32 rstd a token per norm and flash attention's fp32 log-sum-exp a head
and token: llama3-8b 34.0 sbh, llama3-70b 33.5 sbh, as the profile measures them
(benchmarks/results/lean_layer.json). An HF model's own RMSNorm module (fp32 arithmetic in
Python) saves what it saves on every device and is not touched.

Never under-predict (docs/architecture.md, "Never under-predict"): receive buffers and the backward's transient gradients are added,
and the allowance (CUDA context, NCCL, allocator fragmentation, and whatever the allocator holds
beyond the terms above) is fitted to be an upper bound on every GPU measurement ([Note: allowance]).

[Note: allowance]
Fitted on benchmarks/results/cuda_check_h100_run2..6.json (gpt3-1.3b, one H100 80GB, torch 2.11,
bf16 with fp32 masters; 15 trained plans). `torch.cuda.max_memory_allocated` minus the terms above
(18 bytes per parameter, activations, buffers with the head's backward transients):
  runs 5-6 (fused AdamW, today's runtime): -0.12 to +0.03 GiB, the terms match the allocator;
  runs 2-4 (foreach AdamW, whose step allocates temporaries): +1.27 to +1.63 GiB.
The fixed part is the largest residual, 1.63 GiB, plus what the allocator does not see: the CUDA
context and NCCL's communicator buffers (0.5-0.6 GiB on an H100 with lazy module loading; an
estimate, not measured in those runs), rounded up: 2.25 GiB. The allocator's cached but unused
blocks (fragmentation) were not recorded; 3% of the GPU is kept for them (estimate). On an 80 GiB
GPU the allowance is 4.65 GiB, above every measured gap. Run 1 is left out: its peak was taken
without subtracting what earlier parts of the script left allocated (fixed in commit 6b286f0).
tests/test_memory_model.py checks the bound against every recorded run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from autoplan.cluster import GPU
from autoplan.cost.config import ParallelConfig
from autoplan.cost.memory_stacks import (
    loss_backward_factor,
    pipeline_output_bytes,
    stack_keeps_profile,
    stack_saved_bytes,
)
from autoplan.cost.time import gathered_kv_bytes, tp_divisor, tp_sharded
from autoplan.graph.blocks import Block, ModelProfile
from autoplan.plan import MemoryBreakdown
from autoplan.schedule import schedule_spec

__all__ = ["ALLOWANCE_FIXED_BYTES", "ALLOWANCE_FRACTION", "BYTES_PER_PARAM", "MIN_BYTES_PER_PARAM",
           "allowance_bytes", "block_act_bytes", "block_static_bytes", "expert_shard_surplus", "surplus_bytes_per_param",
           "zb_pending_weight_bytes",
           "fsdp_transient_bytes", "fused_norm_surplus", "gathered_bytes_per_param", "head_backward_bytes",
           "reduced_bytes_per_param",
           "held_params", "param_counts", "persistent_bytes_per_param", "rank_memory",
           "reduction_buffer_bytes", "stage_is_one_unit"]

_RECOMPUTED_KINDS = {"layer", "attention", "mlp"}


def _fp32(dtype: str) -> bool:
    return dtype in ("float32", "fp32")


def BYTES_PER_PARAM(dtype: str) -> tuple[float, float, float]:  # noqa: N802 (a table, read like a constant)
    """(weights, gradients, optimizer states) bytes per parameter, replicated (zero 0): bf16 working
    weight + fp32 master, fp32 gradient, Adam's moments; see [Note: bytes per parameter]."""
    if _fp32(dtype):
        return 4.0, 4.0, 8.0
    return 6.0, 4.0, 8.0


def MIN_BYTES_PER_PARAM(dtype: str) -> float:  # noqa: N802
    """The fewest bytes per parameter any plan keeps over all GPUs together: everything sharded
    (ZeRO-3 / FSDP, Rajbhandari et al. 2020, Sec. 5): fp32 shard, fp32 gradient, Adam's moments."""
    return 16.0


def persistent_bytes_per_param(dtype: str, zero: int, dp: int, dp_replicate: int = 1,
                               tp: int = 1) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes per parameter one GPU holds between steps at
    this ZeRO level; see [Note: bytes per parameter]. Per parameter of the GPU's own tp shards:
    zero 1 splits their optimizer state, and in bf16 their fp32 masters, over the dp group at any
    `tp` (runtime/parallel/optimizer.py)."""
    weights, grads, optim = BYTES_PER_PARAM(dtype)
    if zero >= 2:
        shard = dp // dp_replicate
        return 4.0 / shard, 4.0 / shard, 8.0 / shard
    if zero == 1:
        optim /= dp
        if not _fp32(dtype):  # the bf16 working weight whole, the fp32 master of the owned share
            weights = 2.0 + 4.0 / dp
    return weights, grads, optim


def reduction_buffer_bytes(cfg: ParallelConfig, num_params: float, unit_params: Sequence[float] | np.ndarray) -> float:
    """Transient bytes of the gradient reduction. zero 0 / 1 with dp > 1: the flat copy of one
    bucket of fp32 gradients (runtime/parallel/data_parallel.py `all_reduce_grads`, DDP's 25 MiB buckets, Li et
    al. 2020, Sec. 3.2.3), at most all of the rank's gradients. zero >= 2: FSDP2 copies one unit's
    fp32 gradient into the flat input of its reduce-scatter (`foreach_reduce`), beside the
    unsharded gradient it reduces. Measured on CPU ranks by tests/test_runtime_fsdp.py."""
    from autoplan.cost.comm import DDP_BUCKET_BYTES

    if cfg.zero >= 2:
        return reduced_bytes_per_param(cfg.reduce_dtype) * float(np.max(unit_params, initial=0.0))
    if cfg.dp > 1:
        return min(float(DDP_BUCKET_BYTES), 4.0 * num_params)
    return 0.0


def gathered_bytes_per_param(dtype: str) -> float:
    """Bytes of one unsharded FSDP parameter: the compute dtype (MixedPrecisionPolicy's param_dtype)."""
    return 4.0 if _fp32(dtype) else 2.0


def reduced_bytes_per_param(reduce_dtype: str) -> float:
    """Bytes of one gradient element as FSDP reduces it (and, with pp > 1, accumulates it unsharded):
    MixedPrecisionPolicy's reduce_dtype (`ParallelConfig.reduce_dtype`). The reduced shard is kept
    in fp32 either way (FSDP casts it to the fp32 master's dtype)."""
    return 2.0 if reduce_dtype == "bfloat16" else 4.0


def stage_is_one_unit(profile: ModelProfile) -> bool:
    """Whether FSDP runs each stage as one unit: a graph traced by torch.export calls no module
    whole, so the stage's root unit holds every parameter (runtime/parallel/fsdp.py `unit_paths`)."""
    return profile.tracer == "export"


def _fsdp_per_block_bytes_per_param(dtype: str, zero: int, pp: int, one_unit: bool = False,
                                    reduced: float = 4.0) -> float:
    """Bytes per parameter FSDP holds unsharded for every parameter of the rank's stages during the
    step ([Note: FSDP gathered bytes]): zero 2's gathered weights, and with pp > 1 the accumulated
    gradients and (zero 3 too) the weights, which stay gathered after each backward until the step's
    end (`reshard_after_backward=False`, as torch's pipelining sets it). A stage that is one unit
    (`stage_is_one_unit`) is gathered whole from its forward through its backward (FSDP does not
    reshard a root after forward) and its whole gradient exists before the reduce-scatter.
    `reduced`: bytes of a gradient element in the reduce dtype (`reduced_bytes_per_param`)."""
    out = 0.0
    if zero >= 2 and one_unit:
        return gathered_bytes_per_param(dtype) + reduced
    if zero == 2 or (zero == 3 and pp > 1):
        out += gathered_bytes_per_param(dtype)
    if zero >= 2 and pp > 1:
        out += reduced
    return out


def fsdp_transient_bytes(dtype: str, zero: int, pp: int, unit_params: Sequence[float] | np.ndarray,
                         one_unit: bool = False, reduced: float = 4.0) -> float:
    """Bytes FSDP holds unsharded for a few units at a time ([Note: FSDP gathered bytes]): zero 3's
    two units' gathered weights (the one computing, the one prefetched) and, with pp = 1, one
    unit's gradient in the reduce dtype (`reduced` bytes an element) before its reduce-scatter.
    `unit_params`: the units' parameter counts."""
    if zero < 2 or len(unit_params) == 0 or one_unit:  # one unit: counted per parameter
        return 0.0
    largest = np.sort(np.asarray(unit_params, dtype=float))[::-1]
    out = 0.0
    if zero == 3 and pp == 1:
        out += gathered_bytes_per_param(dtype) * float(largest[:2].sum())
    if pp == 1:
        out += reduced * float(largest[0])
    return out


ALLOWANCE_FIXED_BYTES = int(2.25 * 2**30)
"""Largest gap of max_memory_allocated over the other terms on the recorded H100 runs (1.63 GiB) plus
the CUDA context and NCCL, which the allocator does not see (estimate), rounded up; [Note: allowance]."""
ALLOWANCE_FRACTION = 0.03
"""Share of the GPU kept for allocator fragmentation (estimate; not recorded in the runs fitted)."""


def allowance_bytes(gpu: GPU) -> float:
    """Fixed allowance plus a share of the GPU ([Note: allowance]). A CPU rank (gloo, no CUDA
    context) gets 256 MiB."""
    if gpu.name == "cpu":
        return 256 * 2**20
    return ALLOWANCE_FIXED_BYTES + ALLOWANCE_FRACTION * gpu.mem_bytes


def param_counts(profile: ModelProfile, cfg: ParallelConfig) -> np.ndarray:
    """Parameters each block puts on one GPU (tied copies included; divided by `tp_divisor`). With
    expert parallelism a block's experts are split ep ways: they are part of what tp replicates
    (the layout shards no expert), so 1 - 1/ep of them leave the GPU; under expert tp each expert's
    hidden units are split too, and 1 - 1/(ep x expert tp) leave it."""
    itemsize = 2 if profile.dtype in ("bfloat16", "float16") else 4
    counts = np.array([b.param_bytes / itemsize / tp_divisor(profile, i, cfg.tp) for i, b in enumerate(profile.blocks)])
    if cfg.holds_expert_slices:  # 1/ep of the experts, 1/expert tp of each one's hidden units
        counts -= np.asarray(expert_params(profile), dtype=float) * (1 - 1 / (cfg.ep * cfg.expert_tp))
    return counts


def expert_params(profile: ModelProfile) -> list[int]:
    """Per block, the parameters of its grouped experts (graph/profile.py `extra["experts"]`)."""
    experts = profile.extra.get("experts") or {}
    return list(experts.get("block_params") or [0] * profile.num_blocks)


def expert_shard_surplus(profile: ModelProfile, cfg: ParallelConfig, ranges: Sequence[tuple[int, int]]) -> float:
    """Parameters one GPU keeps sharded beyond its 1/dp_shard (zero 1: 1/dp) share under ZeRO with
    expert parallelism: a GPU's 1/ep of the experts is sharded over the ranks holding the same
    experts, not over dp: over the expert-data-parallel group (`ParallelConfig.expert_dp`; FSDP's
    expert units, runtime/parallel/fsdp.py; with zero 1 Megatron-LM's distributed optimizer builds a second
    optimizer over the expert parameters on that group, megatron/core/optimizer
    `get_megatron_optimizer`). So it keeps dp / group times the share of its experts (negative when
    the group is larger than dp). What of a parameter that sharding covers:
    `surplus_bytes_per_param`. 0 without ep or ZeRO."""
    if cfg.zero < 1 or not cfg.holds_expert_slices:
        return 0.0
    experts = expert_params(profile)
    held = sum(sum(experts[a:b]) for a, b in ranges) / (cfg.ep * cfg.expert_tp)
    shards = cfg.dp if cfg.zero == 1 else cfg.dp_shard
    group = cfg.expert_dp if cfg.zero == 1 else cfg.expert_dp // cfg.dp_replicate  # HSDP: shards within a replica
    return held * (shards / max(group, 1) - 1)


def surplus_bytes_per_param(dtype: str, cfg: ParallelConfig) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes per parameter of `expert_shard_surplus`: what
    the ZeRO level shards of a parameter ([Note: bytes per parameter]): all of it under FSDP; with
    zero 1 the optimizer state and, in bf16, the fp32 master (the working weight and the gradient
    stay whole on every replica)."""
    weights, grads, optim = persistent_bytes_per_param(dtype, cfg.zero, cfg.dp, cfg.dp_replicate, cfg.tp)
    if cfg.zero == 1:
        whole_weights = BYTES_PER_PARAM(dtype)[0] if _fp32(dtype) else 2.0
        return weights - whole_weights, 0.0, optim
    return weights, grads, optim


def _tied_copies(profile: ModelProfile, cfg: ParallelConfig) -> np.ndarray:
    """Per block: the parameters of `param_counts` it shares with its `tied_to_block` (0 if none)."""
    return np.array([b.tied_params / tp_divisor(profile, i, cfg.tp) if b.tied_to_block is not None else 0.0
                     for i, b in enumerate(profile.blocks)])


def held_params(profile: ModelProfile, cfg: ParallelConfig, ranges: Sequence[tuple[int, int]],
                params: np.ndarray | None = None) -> float:
    """Parameters one GPU holds for the blocks of `ranges` (its stages): a tied block whose owner is
    on the same GPU adds no copy ([Note: tied parameters])."""
    params = param_counts(profile, cfg) if params is None else params
    total = float(sum(params[a:b].sum() for a, b in ranges))
    mine = {i for a, b in ranges for i in range(a, b)}
    for i in mine:
        owner = profile.blocks[i].tied_to_block
        if owner is not None and owner in mine:
            total -= profile.blocks[i].tied_params / tp_divisor(profile, i, cfg.tp)
    return total


def block_static_bytes(profile: ModelProfile, cfg: ParallelConfig, dtype: str) -> np.ndarray:
    """Weights + gradients + optimizer states per block on one GPU, and what FSDP holds unsharded
    for every parameter of a stage (zero 2's gathered weights, pp > 1's accumulated gradients; the
    few-units terms of `fsdp_transient_bytes` go to the search's reserve). With one stage every
    tied block sits with its owner and adds no copy; with more, each is charged its copy (the
    cutting decides where it lands; `held_params` is exact once it has)."""
    weights, grads, optim = persistent_bytes_per_param(dtype, cfg.zero, cfg.dp, cfg.dp_replicate, cfg.tp)
    per_param = weights + grads + optim + _fsdp_per_block_bytes_per_param(
        dtype, cfg.zero, cfg.pp, stage_is_one_unit(profile), reduced_bytes_per_param(cfg.reduce_dtype))
    params = param_counts(profile, cfg)
    if cfg.num_stages == 1:
        params = params - _tied_copies(profile, cfg)
    out = params * per_param
    if cfg.zero >= 1 and cfg.holds_expert_slices:
        out = out + np.array([expert_shard_surplus(profile, cfg, [(i, i + 1)]) for i in range(profile.num_blocks)]) \
            * sum(surplus_bytes_per_param(dtype, cfg))
    return out


_ITEMSIZE = {"float32": 4, "fp32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


_SURPLUS: dict[tuple[int, int | None], tuple[Block, tuple[float, float]]] = {}


def fused_norm_surplus(block: Block, hidden_size: int | None = None) -> tuple[float, float]:
    """`_fused_norm_surplus`, memoized by the block's identity: the search asks for every block of
    every configuration, and a key built from the block's operators cost more than the answer. A
    block is frozen, and the entry holds it, so its id is not reused while the entry lives."""
    entry = _SURPLUS.get((id(block), hidden_size))
    if entry is not None and entry[0] is block:
        return entry[1]
    if len(_SURPLUS) > 65536:
        _SURPLUS.clear()
    out = _fused_norm_surplus(block, hidden_size)
    _SURPLUS[(id(block), hidden_size)] = (block, out)
    return out


def _fused_norm_surplus(block: Block, hidden_size: int | None = None) -> tuple[float, float]:
    """Saved bytes the profile counts for a block's F.rms_norm calls beyond what CUDA's fused kernel
    keeps ([Note: fused RMSNorm]), per batch of the profile: (hidden-shaped, other). 0 where the
    block calls no F.rms_norm (its operators were recorded without `_fused_rms_norm`).

    From the recorded kernels (graph/operators.py `FusedRMSNorm`), per call: forward x + y + rstd
    (+ the weight), backward grad + x + rstd + grad_x (+ the weight and its gradient): the backward
    reads and writes one x more, so their difference is x's bytes (n elements of `item` bytes).
    The weight is in `fixed_bytes` when the two recorded batch sizes paired up; otherwise it is in
    the per-batch bytes, and (for hidden-shaped norms, rstd = n / hidden_size elements) the
    forward's bytes tell whether there is one."""
    out = []
    for key in ("hidden", "sharded"):
        fwd_ops = [op for op in block.ops if op.name == "_fused_rms_norm" and op.phase == "fwd" and op.tp == key]
        bwd_ops = [op for op in block.ops if op.name == "_fused_rms_norm_backward" and op.tp == key]
        if not fwd_ops or any(op.dtype not in _ITEMSIZE or _ITEMSIZE[op.dtype] > 4 for op in fwd_ops):
            out.append(0.0)
            continue
        item = _ITEMSIZE[fwd_ops[0].dtype]
        calls = sum(op.count for op in fwd_ops)
        forward = sum(op.count * op.bytes for op in fwd_ops)
        diff = sum(op.count * op.bytes for op in bwd_ops) - forward
        weighted = all(op.fixed_bytes > 0 for op in fwd_ops)
        n = diff / item
        if not weighted and key == "hidden" and hidden_size:
            # Unpaired: with a weight, diff = item (n + hidden) and forward - 2 diff = 4 n / hidden -
            # item hidden per call; without one, diff = item n and forward - 2 diff = 4 n / hidden.
            n_w = diff / item - calls * hidden_size
            with_weight = forward - 2 * diff - (4 * n_w / hidden_size - calls * item * hidden_size)
            without = forward - 2 * diff - 4 * n / hidden_size
            if abs(with_weight) < abs(without):
                weighted, n = True, n_w
        # The composite keeps the fp32 input and the fp32 normalized input (4 + 4 bytes an element)
        # with a weight, the fp32 input alone without one; the kernel keeps x (item bytes).
        out.append(max(0.0, n * ((8 if weighted else 4) - item)))
    return out[0], out[1]


def block_act_bytes(profile: ModelProfile, cfg: ParallelConfig, cpu: bool = False,
                    stack: str | None = None) -> np.ndarray:
    """Activation bytes each block keeps per micro-batch in flight on one GPU (`cpu`: on a CPU rank,
    where F.rms_norm runs its composite form, [Note: fused RMSNorm]). `stack`: the software stack
    whose runtime runs the model (cost/memory_stacks.py [Note: memory per stack]); None, autoplan's."""
    f = cfg.batch_share(profile.batch_size)
    out = np.zeros(profile.num_blocks)
    counts_own = not (stack is None or cpu or stack_keeps_profile(stack))  # asked once, not per block
    for i, b in enumerate(profile.blocks):
        total, hidden = float(b.saved_bytes), float(b.saved_bytes_replicated_tp)
        own = stack_saved_bytes(stack, profile, b, cfg) if counts_own else None
        if own is not None:
            # The stack's own count of the block on one GPU: its norms, its selective policy, its
            # tensor-parallel layout ([Note: memory per stack]).
            out[i] = own * f
            continue
        if not cpu:
            surplus_hidden, surplus_other = fused_norm_surplus(b, profile.hidden_size)
            total -= surplus_hidden + surplus_other
            hidden -= surplus_hidden
        if cfg.tp > 1 and tp_sharded(b.kind):
            if cfg.sequence_parallel:
                saved = total / cfg.tp
            else:
                saved = hidden + (total - hidden) / cfg.tp
        else:
            saved = total
        if b.kind in _RECOMPUTED_KINDS and cfg.recompute == "full":
            # Only the layer's input survives; it is the previous cut's tensors.
            previous = profile.cuts[i - 1].num_bytes if i > 0 else b.output_bytes
            saved = previous / (cfg.tp if cfg.sequence_parallel else 1)
        elif b.kind in _RECOMPUTED_KINDS and cfg.recompute == "selective":
            saved -= b.attention_core_saved_bytes / (cfg.tp if tp_sharded(b.kind) else 1)
        out[i] = saved * f
    if cfg.cp > 1 and cfg.recompute != "full":
        # Attention keeps the gathered keys and values of the whole sequence for its backward
        # (runtime/parallel/context.py); this GPU's own 1/cp of them is counted above. Selective recompute
        # checkpoints the kernel, whose inputs are the gathered keys and values, so they stay; full
        # recompute keeps only the layer's input and gathers them again.
        out += gathered_kv_bytes(profile, cfg) * (1 - 1 / cfg.cp)
    return out


def head_backward_bytes(profile: ModelProfile, acts: np.ndarray, blocks: Sequence[int], stack: str | None = None,
                        tp: int = 1) -> float:
    """Transient bytes of the head's backward: the loss's gradient with respect to the logits and
    the log-softmax's gradient coexist, each the size of the logits, which dominate what the head
    saves (`acts`, per micro-batch): 2 x its activations. Measured: it is the gap between
    max_memory_allocated and the other terms that grows with the micro-batch on the H100 runs
    ([Note: allowance]; 0.38 GiB at micro-batch 1, 1.50 GiB at 4 for gpt3-1.3b, predicted 0.41 and
    1.62). A stack whose loss holds more in its backward says how many times (cost/memory_stacks.py
    `loss_backward_factor`)."""
    factor = loss_backward_factor(stack, tp)
    return max((factor * float(acts[i]) for i in blocks if profile.blocks[i].kind == "head"), default=0.0)


def _working_bytes(profile: ModelProfile, cfg: ParallelConfig, blocks: Sequence[int], acts: np.ndarray,
                   cpu: bool = False, stack: str | None = None) -> float:
    """Transient memory of one backward: the gradient of the largest block output exists next to
    its activation; then the larger of one layer's full activations brought back by full recompute
    and the head's backward transients (`head_backward_bytes`): they do not coexist."""
    f = cfg.batch_share(profile.batch_size)
    largest_output = max((profile.blocks[i].output_bytes for i in blocks), default=0) * f
    recompute = 0.0
    if cfg.recompute == "full":
        full = block_act_bytes(profile, dataclasses.replace(cfg, recompute="none"), cpu, stack)
        recompute = max((full[i] for i in blocks if profile.blocks[i].kind in _RECOMPUTED_KINDS), default=0.0)
    return 2 * largest_output + max(recompute, head_backward_bytes(profile, acts, blocks, stack, cfg.tp))


def zb_pending_weight_bytes(cfg: ParallelConfig, stage_ranges: Sequence[tuple[int, int]],
                            stage_acts: np.ndarray) -> float:
    """What the micro-batch whose W is pending keeps beyond its activations, at most ([Note: ZB-H1's
    pending W]): one micro-batch's activations of the largest stage of the rank that splits its backward."""
    if not schedule_spec(cfg.schedule).split_backward or cfg.num_microbatches < 2:
        return 0.0
    split = [float(stage_acts[k]) for k, (a, _) in enumerate(stage_ranges) if a > 0]
    return max(split, default=0.0)


def _fsdp_bytes_per_moment(profile: ModelProfile, cfg: ParallelConfig, dtype: str,
                           stage_ranges: Sequence[tuple[int, int]], params: np.ndarray, num_params: float,
                           lifetimes: tuple[np.ndarray, np.ndarray], one_unit: bool, reduced: float) -> np.ndarray:
    """What FSDP holds unsharded at each moment of a rank's schedule (zero >= 2, pp > 1; [Note: FSDP
    gathered bytes]): the gathered parameters of each stage from its first forward (zero 2, or a stage
    that is one unit) or its first backward (zero 3, which reshards after forward but not after
    backward) until its last backward, and its gradient in the reduce dtype from its first backward
    until its last. `lifetimes`: (gathered, accumulating), moments x stages, 0 / 1."""
    gathered_span, accumulating = (np.asarray(x, dtype=float) for x in lifetimes)
    per_stage = np.array([held_params(profile, cfg, [r], params) for r in stage_ranges])
    if per_stage.sum() > 0:  # tied copies that share a GPU count once (`held_params` over the rank)
        per_stage = per_stage * (num_params / per_stage.sum())
    gathered_while = gathered_span if (cfg.zero == 2 or one_unit) else accumulating
    return (gathered_while @ (per_stage * gathered_bytes_per_param(dtype))
            + accumulating @ (per_stage * reduced))


def rank_memory(profile: ModelProfile, cfg: ParallelConfig, gpu: GPU, dtype: str,
                stage_ranges: Sequence[tuple[int, int]], stage_inflight: Sequence[float],
                static: np.ndarray | None = None, acts: np.ndarray | None = None,
                params: np.ndarray | None = None, held: np.ndarray | None = None,
                stack: str | None = None, lifetimes: tuple[np.ndarray, np.ndarray] | None = None) -> MemoryBreakdown:
    """Peak memory of one GPU holding the given stages (its virtual stages) with the given
    micro-batches in flight on each. `acts` and `params` (`block_act_bytes`, `param_counts`) may be
    passed when the caller has them. `held` (moments x stages): the micro-batches each stage holds
    at each moment its activations grow; the activations are then the largest moment's, not the
    sum of each stage's own peak ([Note: activations]; search/inflight.py `interleaved_held`).
    `stack`: whose runtime holds the activations (cost/memory_stacks.py [Note: memory per stack]).
    `lifetimes` (with `held`, the same rows: search/inflight.py `interleaved_moments`): at each
    moment, which stages have their FSDP parameters gathered and which their unsharded gradient;
    under zero >= 2 with pp > 1 the peak is then the largest moment's activations plus what FSDP
    holds at that moment ([Note: FSDP gathered bytes])."""
    weights_b, grads_b, optim_b = persistent_bytes_per_param(dtype, cfg.zero, cfg.dp, cfg.dp_replicate, cfg.tp)
    params = param_counts(profile, cfg) if params is None else params
    cpu = gpu.name == "cpu"
    acts = block_act_bytes(profile, cfg, cpu, stack) if acts is None else acts
    f = cfg.batch_share(profile.batch_size)
    num_params = held_params(profile, cfg, stage_ranges, params)
    surplus = expert_shard_surplus(profile, cfg, stage_ranges)
    surplus_w, surplus_g, surplus_o = surplus_bytes_per_param(dtype, cfg)
    stage_acts = np.array([acts[a:b].sum() for a, b in stage_ranges])
    one_unit = stage_is_one_unit(profile)
    reduced = reduced_bytes_per_param(cfg.reduce_dtype)
    blocks = [i for a, b in stage_ranges for i in range(a, b)]
    per_param = _fsdp_per_block_bytes_per_param(dtype, cfg.zero, cfg.pp, one_unit, reduced)
    gathered = num_params * per_param + fsdp_transient_bytes(dtype, cfg.zero, cfg.pp, params[blocks], one_unit, reduced)
    if held is not None and lifetimes is not None and cfg.zero >= 2 and cfg.pp > 1:
        # Each stage's gathered parameters and unsharded gradient live from its first forward /
        # backward to its last backward, not for the whole step: the peak is one moment's sum.
        per_moment = np.asarray(held, dtype=float) @ stage_acts
        per_moment = per_moment + _fsdp_bytes_per_moment(profile, cfg, dtype, stage_ranges, params, num_params,
                                                         lifetimes, one_unit, reduced)
        peak = int(np.argmax(per_moment))
        activations = float(np.asarray(held, dtype=float)[peak] @ stage_acts)
        gathered = float(per_moment[peak]) - activations
        if cfg.zero == 3 and not one_unit:  # a forward's unit and the prefetched next, gathered for it
            gathered += gathered_bytes_per_param(dtype) * float(np.sort(params[blocks])[::-1][:2].sum())
    elif held is not None:
        activations = float(np.max(np.asarray(held, dtype=float) @ stage_acts))
    else:
        activations = float(stage_acts @ np.asarray(stage_inflight, dtype=float))
    activations += zb_pending_weight_bytes(cfg, stage_ranges, stage_acts)
    # Forward outputs the stack's pipeline runtime keeps for the whole step (memory_stacks.py).
    activations += 0.0 if cpu else pipeline_output_bytes(stack, profile, cfg, stage_ranges)
    # Two receive buffers per boundary (activation in, gradient in), one micro-batch each.
    recv = sum(2 * profile.cuts[a - 1].num_bytes * f for a, _ in stage_ranges if a > 0)
    return MemoryBreakdown(
        weights_bytes=num_params * weights_b + surplus * surplus_w,
        grads_bytes=num_params * grads_b + surplus * surplus_g,
        optimizer_bytes=num_params * optim_b + surplus * surplus_o,
        gathered_bytes=float(gathered),
        activations_bytes=float(activations),
        buffers_bytes=float(recv + _working_bytes(profile, cfg, blocks, acts, cpu, stack)
                            + reduction_buffer_bytes(cfg, num_params, [num_params] if one_unit else params[blocks])),
        allowance_bytes=allowance_bytes(gpu),
    )
