"""Memory per GPU: weights, gradients, optimizer states, activations, buffers, allowance.

[Note: bytes per parameter]
Mixed precision as Megatron-LM keeps it and as autoplan's runtime runs it (runtime/precision.py):
2 bytes of bf16/fp16 working weights, 4 bytes of fp32 gradient (Megatron's `main_grad`, accumulated
and all-reduced in fp32), 4 bytes of fp32 master weights and 8 of Adam's two fp32 moments: 18 bytes
per parameter (Megatron-LM docs, "Distributed Optimizer", table of bytes per parameter: "bf16 param,
fp32 grads: 18"). ZeRO (Rajbhandari et al. 2020, Sec. 3.1) counts 16 with bf16 gradients, which is 2
bytes per parameter short of what either runtime allocates. In fp32 training: 4 + 4 + 8 = 16.
ZeRO-1 divides the 12 optimizer bytes by dp, ZeRO-2 the gradients too (ZeRO, Fig. 1).

[Note: tied parameters]
A block whose parameters are shared with an earlier block (`Block.tied_to_block`, a head tied to the
embedding) holds a copy of them (`Block.param_bytes`) only when the owner lives on another GPU;
on the same GPU the runtime keeps one tensor, one gradient and one optimizer state
(runtime/precision.py, "tied parameters share one"), so they count once (`held_params`).

[Note: activations]
A block's saved-for-backward bytes come from the profile (measured on fake tensors). Under tensor
parallelism, tensors of the layer's hidden shape (norm inputs, residuals) are replicated on every
TP rank and the rest is sharded; with sequence parallelism everything is sharded (Korthikanti et
al. 2022, Eqs. 2-4). Full recomputation keeps only each layer's input, plus one layer's full
activations while it is recomputed (the same paper, Sec. 5). A stage keeps the activations of
every micro-batch in flight: the schedule simulator counts them (GPipe m, 1F1B p - s, ...).

Never under-predict (DESIGN.md): receive buffers and the backward's transient gradients are added,
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
from autoplan.cost.time import tp_divisor, tp_sharded
from autoplan.graph.blocks import ModelProfile
from autoplan.plan import MemoryBreakdown

__all__ = ["ALLOWANCE_FIXED_BYTES", "ALLOWANCE_FRACTION", "BYTES_PER_PARAM", "allowance_bytes", "block_act_bytes",
           "block_static_bytes", "head_backward_bytes", "held_params", "param_counts", "rank_memory"]

_RECOMPUTED_KINDS = {"layer", "attention", "mlp"}


def BYTES_PER_PARAM(dtype: str) -> tuple[float, float, float]:  # noqa: N802 (a table, read like a constant)
    """(weights, gradients, optimizer states) bytes per parameter; see [Note: bytes per parameter]."""
    if dtype in ("float32", "fp32"):
        return 4.0, 4.0, 8.0
    return 2.0, 4.0, 12.0


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
    """Parameters each block puts on one GPU (tied copies included; divided by `tp_divisor`)."""
    itemsize = 2 if profile.dtype in ("bfloat16", "float16") else 4
    return np.array([b.param_bytes / itemsize / tp_divisor(profile, i, cfg.tp) for i, b in enumerate(profile.blocks)])


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
    """Weights + gradients + optimizer states per block on one GPU. With one stage every tied block
    sits with its owner and adds no copy; with more, each is charged its copy (the cutting decides
    where it lands; `held_params` is exact once it has)."""
    weights, grads, optim = BYTES_PER_PARAM(dtype)
    if cfg.zero >= 1:
        optim /= cfg.dp
    if cfg.zero >= 2:
        grads /= cfg.dp
    params = param_counts(profile, cfg)
    if cfg.num_stages == 1:
        params = params - _tied_copies(profile, cfg)
    return params * (weights + grads + optim)


def block_act_bytes(profile: ModelProfile, cfg: ParallelConfig) -> np.ndarray:
    """Activation bytes each block keeps per micro-batch in flight on one GPU."""
    f = cfg.micro_batch_size / profile.batch_size
    out = np.zeros(profile.num_blocks)
    for i, b in enumerate(profile.blocks):
        if cfg.tp > 1 and tp_sharded(b.kind):
            if cfg.sequence_parallel:
                saved = b.saved_bytes / cfg.tp
            else:
                saved = b.saved_bytes_replicated_tp + (b.saved_bytes - b.saved_bytes_replicated_tp) / cfg.tp
        else:
            saved = float(b.saved_bytes)
        if b.kind in _RECOMPUTED_KINDS and cfg.recompute == "full":
            # Only the layer's input survives; it is the previous cut's tensors.
            previous = profile.cuts[i - 1].num_bytes if i > 0 else b.output_bytes
            saved = previous / (cfg.tp if cfg.sequence_parallel else 1)
        elif b.kind in _RECOMPUTED_KINDS and cfg.recompute == "selective":
            saved -= b.attention_core_saved_bytes / (cfg.tp if tp_sharded(b.kind) else 1)
        out[i] = saved * f
    return out


def head_backward_bytes(profile: ModelProfile, acts: np.ndarray, blocks: Sequence[int]) -> float:
    """Transient bytes of the head's backward: the loss's gradient with respect to the logits and
    the log-softmax's gradient coexist, each the size of the logits, which dominate what the head
    saves (`acts`, per micro-batch): 2 x its activations. Measured: it is the gap between
    max_memory_allocated and the other terms that grows with the micro-batch on the H100 runs
    ([Note: allowance]; 0.38 GiB at micro-batch 1, 1.50 GiB at 4 for gpt3-1.3b, predicted 0.41 and
    1.62)."""
    return max((2 * float(acts[i]) for i in blocks if profile.blocks[i].kind == "head"), default=0.0)


def _working_bytes(profile: ModelProfile, cfg: ParallelConfig, blocks: Sequence[int], acts: np.ndarray) -> float:
    """Transient memory of one backward: the gradient of the largest block output exists next to
    its activation; then the larger of one layer's full activations brought back by full recompute
    and the head's backward transients (`head_backward_bytes`): they do not coexist."""
    f = cfg.micro_batch_size / profile.batch_size
    largest_output = max((profile.blocks[i].output_bytes for i in blocks), default=0) * f
    recompute = 0.0
    if cfg.recompute == "full":
        full = block_act_bytes(profile, dataclasses.replace(cfg, recompute="none"))
        recompute = max((full[i] for i in blocks if profile.blocks[i].kind in _RECOMPUTED_KINDS), default=0.0)
    return 2 * largest_output + max(recompute, head_backward_bytes(profile, acts, blocks))


def rank_memory(profile: ModelProfile, cfg: ParallelConfig, gpu: GPU, dtype: str,
                stage_ranges: Sequence[tuple[int, int]], stage_inflight: Sequence[float],
                static: np.ndarray | None = None, acts: np.ndarray | None = None,
                params: np.ndarray | None = None) -> MemoryBreakdown:
    """Peak memory of one GPU holding the given stages (its virtual stages) with the given
    micro-batches in flight on each. `acts` and `params` (`block_act_bytes`, `param_counts`) may be
    passed when the caller has them."""
    weights_b, grads_b, optim_b = BYTES_PER_PARAM(dtype)
    params = param_counts(profile, cfg) if params is None else params
    acts = block_act_bytes(profile, cfg) if acts is None else acts
    f = cfg.micro_batch_size / profile.batch_size
    num_params = held_params(profile, cfg, stage_ranges, params)
    activations = sum(acts[a:b].sum() * inflight for (a, b), inflight in zip(stage_ranges, stage_inflight, strict=True))
    blocks = [i for a, b in stage_ranges for i in range(a, b)]
    # Two receive buffers per boundary (activation in, gradient in), one micro-batch each.
    recv = sum(2 * profile.cuts[a - 1].num_bytes * f for a, _ in stage_ranges if a > 0)
    return MemoryBreakdown(
        weights_bytes=num_params * weights_b,
        grads_bytes=num_params * grads_b / (cfg.dp if cfg.zero >= 2 else 1),
        optimizer_bytes=num_params * optim_b / (cfg.dp if cfg.zero >= 1 else 1),
        activations_bytes=float(activations),
        buffers_bytes=float(recv + _working_bytes(profile, cfg, blocks, acts)),
        allowance_bytes=allowance_bytes(gpu),
    )
