"""Data parallelism: the gradient reductions between replicas, and the data-parallel step of `partition`.

Gradients are reduced after the last backward of a step (`PartitionedModel.step`):

- Tied parameters whose ends sit on different pipeline ranks (GPT's `output.weight` and
  `tok_embeddings.weight`) have one copy per rank; their gradients are summed over those ranks
  first (Megatron-LM's embedding group, Shoeybi et al. 2019, Sec 3), so both copies take the same
  optimizer step and stay equal.
- Then every gradient is averaged over the dp group (one all-reduce per dtype over a flat buffer,
  as DDP's buckets do), for zero 0 and 1. Under zero 2 and 3, FSDP2 shards the parameters and
  reduce-scatters the gradients itself over `ParallelLayout.fsdp_mesh` (fsdp.py).

ZeRO-1 shards the optimizer (optimizer.py), not the stages: at build time only FSDP (zero >= 2)
changes a stage (`apply_data_parallel`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from autoplan.runtime.parallel.fsdp import apply_fsdp

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["DP_BUCKET_BYTES", "all_reduce_grads", "apply_data_parallel", "local_tensor"]


def apply_data_parallel(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The data-parallel step: zero 0 (DDP-style) and zero 1 (ZeRO-1) leave the stages as they are
    (their gradients are averaged by `all_reduce_grads` after each step, ZeRO-1's optimizer is made by
    `PartitionedModel.make_optimizer`); zero >= 2 shards them with FSDP2 / HSDP (fsdp.py)."""
    if plan.zero >= 2:
        apply_fsdp(build, plan, layout)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writes go to it), or `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t



DP_BUCKET_BYTES = 25 * 2**20
"""Gradients all-reduced together: torch DDP's default `bucket_cap_mb` (Li et al. 2020, "PyTorch
Distributed", Sec. 3.2.3). The flat copy of one bucket is the reduction's only transient memory;
cost/comm.py prices the reduction in buckets of the same size."""


def all_reduce_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, *,
                     average: bool, bucket_bytes: int = DP_BUCKET_BYTES) -> None:
    """Sum (or average) the `.grad` of `params` over `group`, in flat buckets of at most
    `bucket_bytes` per dtype (a larger gradient is a bucket of its own).

    A DTensor gradient (a tensor-parallel shard) is reduced as its local shard: the group is a dp
    or tie group of ranks with the same tp index, so the shards line up."""
    if group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(local_tensor(p.grad))
    size = dist.get_world_size(group)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        filled = 0
        for g in [*grads, None]:
            if bucket and (g is None or filled + g.numel() * g.element_size() > bucket_bytes):
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                if average:
                    flat /= size
                for local, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    local.copy_(reduced)
                bucket, filled = [], 0
            if g is not None:
                bucket.append(g)
                filled += g.numel() * g.element_size()
