"""Memory per GPU: weights, gradients, optimizer states, activations, buffers, allowance.

[Note: bytes per parameter]
Mixed-precision Adam (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1): 2 bytes of bf16/fp16 weights,
2 bytes of gradients, and 12 bytes of optimizer state (fp32 master weights, momentum, variance):
16 bytes per parameter. In fp32 training: 4 + 4 + 8 (Adam's two moments) = 16 as well. ZeRO-1
divides the optimizer states by dp, ZeRO-2 the gradients too (ZeRO, Fig. 1).

[Note: activations]
A block's saved-for-backward bytes come from the profile (measured on fake tensors). Under tensor
parallelism, tensors of the layer's hidden shape (norm inputs, residuals) are replicated on every
TP rank and the rest is sharded; with sequence parallelism everything is sharded (Korthikanti et
al. 2022, Eqs. 2-4). Full recomputation keeps only each layer's input, plus one layer's full
activations while it is recomputed (the same paper, Sec. 5). A stage keeps the activations of
every micro-batch in flight: the schedule simulator counts them (GPipe m, 1F1B p - s, ...).

Never under-predict (DESIGN.md): the allowance for the CUDA context, NCCL buffers and allocator
fragmentation is generous, and receive buffers and the backward's transient gradients are added.
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

__all__ = ["BYTES_PER_PARAM", "allowance_bytes", "block_act_bytes", "block_static_bytes", "param_counts",
           "rank_memory"]

_RECOMPUTED_KINDS = {"layer", "attention", "mlp"}


def BYTES_PER_PARAM(dtype: str) -> tuple[float, float, float]:  # noqa: N802 (a table, read like a constant)
    """(weights, gradients, optimizer states) bytes per parameter; see [Note: bytes per parameter]."""
    if dtype in ("float32", "fp32"):
        return 4.0, 4.0, 8.0
    return 2.0, 2.0, 12.0


def allowance_bytes(gpu: GPU) -> float:
    """CUDA context and cuBLAS/NCCL workspaces (about 1 GiB; estimate) plus 5% of the GPU for
    allocator fragmentation (estimate). A CPU rank (gloo, no context) gets 256 MiB."""
    if gpu.name == "cpu":
        return 256 * 2**20
    return 2**30 + 0.05 * gpu.mem_bytes


def param_counts(profile: ModelProfile, cfg: ParallelConfig) -> np.ndarray:
    """Parameters each block puts on one GPU (tied copies included; divided by `tp_divisor`)."""
    itemsize = 2 if profile.dtype in ("bfloat16", "float16") else 4
    return np.array([b.param_bytes / itemsize / tp_divisor(profile, i, cfg.tp) for i, b in enumerate(profile.blocks)])


def block_static_bytes(profile: ModelProfile, cfg: ParallelConfig, dtype: str) -> np.ndarray:
    """Weights + gradients + optimizer states per block on one GPU."""
    weights, grads, optim = BYTES_PER_PARAM(dtype)
    if cfg.zero >= 1:
        optim /= cfg.dp
    if cfg.zero >= 2:
        grads /= cfg.dp
    return param_counts(profile, cfg) * (weights + grads + optim)


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


def _working_bytes(profile: ModelProfile, cfg: ParallelConfig, blocks: Sequence[int]) -> float:
    """Transient memory of one backward: with full recompute one layer's full activations come
    back; in any case the gradient of the largest block output exists next to its activation."""
    f = cfg.micro_batch_size / profile.batch_size
    largest_output = max((profile.blocks[i].output_bytes for i in blocks), default=0) * f
    recompute = 0.0
    if cfg.recompute == "full":
        full = dataclasses.replace(cfg, recompute="none")
        acts = block_act_bytes(profile, full)
        recompute = max((acts[i] for i in blocks if profile.blocks[i].kind in _RECOMPUTED_KINDS), default=0.0)
    return 2 * largest_output + recompute


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
    num_params = sum(params[a:b].sum() for a, b in stage_ranges)
    activations = sum(acts[a:b].sum() * inflight for (a, b), inflight in zip(stage_ranges, stage_inflight, strict=True))
    blocks = [i for a, b in stage_ranges for i in range(a, b)]
    # Two receive buffers per boundary (activation in, gradient in), one micro-batch each.
    recv = sum(2 * profile.cuts[a - 1].num_bytes * f for a, _ in stage_ranges if a > 0)
    return MemoryBreakdown(
        weights_bytes=num_params * weights_b,
        grads_bytes=num_params * grads_b / (cfg.dp if cfg.zero >= 2 else 1),
        optimizer_bytes=num_params * optim_b / (cfg.dp if cfg.zero >= 1 else 1),
        activations_bytes=float(activations),
        buffers_bytes=float(recv + _working_bytes(profile, cfg, blocks)),
        allowance_bytes=allowance_bytes(gpu),
    )
