"""The (pp, dp, tp) device mesh of a plan, and the gradient reductions between replicas.

The mesh is torch's `DeviceMesh` over the plan's rank layout ([Note: rank layout] in plan.py), so
the dp and tp groups are the mesh's own groups. Gradients are reduced after the last backward of
a step:

- Tied parameters whose ends sit on different pipeline ranks (GPT's `output.weight` and
  `tok_embeddings.weight`) have one copy per rank; their gradients are summed over those ranks
  first (Megatron-LM's embedding group, Shoeybi et al. 2019, Sec 3), so both copies take the same
  optimizer step and stay equal.
- Then every gradient is averaged over the dp group (one all-reduce per dtype over a flat buffer,
  as DDP's buckets do). ZeRO plans (zero = 1 or 2) are run the same way for now: a plain
  all-reduce of full gradients with a replicated optimizer, not reduce-scatter + all-gather with
  sharded optimizer state, so their memory saving is not realized (the numerics are identical).

Tensor parallelism is not executed yet; `partition` refuses tp > 1 plans.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["ParallelLayout", "all_reduce_grads", "build_layout"]


@dataclass
class ParallelLayout:
    """Where this rank sits in the plan's mesh and the groups it reduces over."""

    rank: int
    world_size: int
    pp_index: int
    dp_index: int
    tp_index: int
    pp: int
    dp: int
    tp: int
    stage_rank: dict[int, int]
    """Virtual stage -> global rank that runs it with this rank's dp and tp coordinates."""
    mesh: object | None
    """torch DeviceMesh with axes ("pp", "dp", "tp"), or None for a single rank."""
    dp_group: dist.ProcessGroup | None
    tie_groups: dict[str, dist.ProcessGroup]
    """Canonical name of a tied parameter split over pipeline ranks -> the group of its holders."""


def build_layout(plan, rank: int, world_size: int, device_type: str,
                 tied_holders: Mapping[str, Sequence[int]]) -> ParallelLayout:
    """Mesh and groups for `rank`; collective: every rank calls it with the same arguments.

    `tied_holders` maps a tied parameter's canonical name to the pipeline indices that hold a copy.
    """
    pp_index, dp_index, tp_index = plan.coords(rank)
    stage_rank = {s.index: plan.rank(s.pp_rank, dp_index, tp_index) for s in plan.stages}
    mesh = dp_group = None
    if world_size > 1:
        from torch.distributed.device_mesh import DeviceMesh

        layout = torch.tensor([[[plan.rank(p, d, t) for t in range(plan.tp)] for d in range(plan.dp)]
                               for p in range(plan.pp)])
        mesh = DeviceMesh(device_type, layout, mesh_dim_names=("pp", "dp", "tp"))
        dp_group = mesh.get_group("dp") if plan.dp > 1 else None
    tie_groups: dict[str, dist.ProcessGroup] = {}
    for name in sorted(tied_holders):
        holders = sorted(set(tied_holders[name]))
        if len(holders) < 2:
            continue
        for d in range(plan.dp):  # new_group is collective: every rank creates every group
            for t in range(plan.tp):
                ranks = [plan.rank(p, d, t) for p in holders]
                group = dist.new_group(ranks)
                if rank in ranks:
                    tie_groups[name] = group
    return ParallelLayout(rank, world_size, pp_index, dp_index, tp_index, plan.pp, plan.dp, plan.tp,
                          stage_rank, mesh, dp_group, tie_groups)


def all_reduce_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, *,
                     average: bool) -> None:
    """Sum (or average) the `.grad` of `params` over `group`, one flat buffer per dtype."""
    if group is None:
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    size = dist.get_world_size(group)
    for plist in by_dtype.values():
        grads = [p.grad for p in plist]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        for p, g in zip(plist, _unflatten_dense_tensors(flat, grads)):
            p.grad.copy_(g)
