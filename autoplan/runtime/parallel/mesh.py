"""The (pp, dp, tp) device mesh of a plan: where this rank sits and the groups it reduces over.

The mesh is torch's `DeviceMesh` over the plan's rank layout ([Note: rank layout] in plan.py), so
the dp and tp groups are the mesh's own groups. It is apart from what runs over it (the gradient
reductions in data_parallel.py, tensor parallelism in tensor_parallel.py, FSDP in fsdp.py) because
every step of `partition` reads it and none of them owns it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from autoplan.plan import expert_positions
from autoplan.runtime.parallel.errors import PartitionError

__all__ = ["ParallelLayout", "build_layout", "build_mesh"]


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
    """torch DeviceMesh with axes ("pp", "dp_replicate", "dp_shard", "tp") (torchtitan's order), or
    None for a single rank. The dp index is replicate index * dp_shard + shard index, so a shard
    group is dp_shard consecutive replicas (inside a node when tp * dp_shard fits one)."""
    dp_group: dist.ProcessGroup | None
    tie_groups: dict[str, dist.ProcessGroup]
    """Canonical name of a tied parameter split over pipeline ranks -> the group of its holders."""
    tp_mesh: object | None = None
    """The 1-D "tp" sub-mesh this rank shards over (ranks plan.rank(pp, dp, 0..tp-1)), or None."""
    fsdp_mesh: object | None = None
    """The mesh FSDP shards over (zero >= 2): 1-D "dp_shard", or 2-D ("dp_replicate", "dp_shard")
    for HSDP; None otherwise."""
    ep_index: int = 0
    """This rank's place in its expert-parallel group (`Plan.expert_slot`): which slice of the
    experts it holds (runtime/parallel/experts.py)."""
    ep_group: dist.ProcessGroup | None = None
    """The ranks that exchange tokens (same pp index; plan.py [Note: expert layout]): ep consecutive
    positions over tp x dp; None (ep 1)."""
    pp_group: dist.ProcessGroup | None = None
    """The pipeline ranks with this rank's dp and tp index (the mesh's "pp" axis), or None (pp 1)."""
    cp_index: int = 0
    """This rank's place in its context-parallel group (dp_index % cp): which chunks of every
    sequence it holds (runtime/parallel/context.py)."""
    cp_group: dist.ProcessGroup | None = None
    """The cp consecutive dp ranks (same pp and tp index) that split each sequence, or None (cp 1)."""
    expert_dp_group: dist.ProcessGroup | None = None
    """The ranks holding the same experts (same pp index and expert slot's `index`), over which
    expert gradients are summed and ZeRO-1 splits the experts' optimizer state (optimizer.py); None
    when there is one or ep is 1. Megatron-Core's expert-data-parallel group: tp * dp / ep ranks."""
    expert_fsdp_mesh: object | None = None
    """With ep > 1 and zero >= 2: the mesh of those same ranks, over which FSDP shards the experts
    (fsdp.py): 1-D "edp", or under HSDP 2-D ("edp_replicate", "edp"); None otherwise."""


def build_layout(plan, rank: int, world_size: int, device_type: str,
                 tied_holders: Mapping[str, Sequence[int]], *, timeout: timedelta | None = None) -> ParallelLayout:
    """Mesh and groups for `rank`; collective: every rank calls it with the same arguments.

    `tied_holders` maps a tied parameter's canonical name to the pipeline indices that hold a copy.
    `timeout` bounds every collective of every group made here: torch gives a subgroup its own
    default (30 minutes on gloo, 10 on NCCL), not the world group's, so a dp peer that hung made its
    partner wait half an hour in the gradient all-reduce (issue "Faults and hostile input").
    """
    pp_index, dp_index, tp_index = plan.coords(rank)
    stage_rank = {s.index: plan.rank(s.pp_rank, dp_index, tp_index) for s in plan.stages}
    mesh = dp_group = tp_mesh = fsdp_mesh = expert_fsdp_mesh = None
    replicate = getattr(plan, "dp_replicate", 1)
    shard = plan.dp // replicate
    if world_size > 1 or plan.zero >= 2:
        from torch.distributed.device_mesh import DeviceMesh

        layout = torch.tensor([[[[plan.rank(p, r * shard + s, t) for t in range(plan.tp)] for s in range(shard)]
                                for r in range(replicate)] for p in range(plan.pp)])
        override = _group_options(device_type, timeout)
        mesh = DeviceMesh(device_type, layout, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
                          backend_override=(override,) * 4)
        # torchtitan flattens the dp dimensions the same way
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=override)
        dp_group = dp_mesh.get_group() if plan.dp > 1 else None
        tp_mesh = mesh["tp"] if plan.tp > 1 else None
        if plan.zero >= 2:
            fsdp_mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
        if plan.zero >= 2 and (getattr(plan, "ep", 1) > 1 or getattr(plan, "expert_tp", 1) > 1):
            # Each pipeline rank's ranks by the experts they hold (plan.py [Note: expert layout]):
            # the "edp" axis holds the ranks with the same experts, torchtitan's "dp_shard_mod_ep"
            # (torchtitan/distributed/parallel_dims.py) and, folded over tp, Megatron-Core's
            # expert-data-parallel group.
            # Under HSDP each such group is (replica, shard): its ranks in rank order are replica-major.
            # Under expert tp each (ep index, expert-tp index) is a slice of its own.
            etp = plan.expert_tp
            holding = [[[plan.rank(p, d, t) for d, t in expert_positions(plan.ep, plan.tp, plan.dp, index, etp, e)]
                        for index in range(plan.ep) for e in range(etp)] for p in range(plan.pp)]
            expert_layout = torch.tensor(holding).unflatten(-1, (replicate, -1))
            expert_mesh = DeviceMesh(device_type, expert_layout,
                                     mesh_dim_names=("pp", "experts", "edp_replicate", "edp"),
                                     backend_override=(override,) * 4)
            expert_fsdp_mesh = expert_mesh["edp_replicate", "edp"] if replicate > 1 else expert_mesh["edp"]
    tie_groups: dict[str, dist.ProcessGroup] = {}
    for name in sorted(tied_holders):
        holders = sorted(set(tied_holders[name]))
        if len(holders) < 2:
            continue
        for d in range(plan.dp):  # new_group is collective: every rank creates every group
            for t in range(plan.tp):
                ranks = [plan.rank(p, d, t) for p in holders]
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    tie_groups[name] = group
    ep, cp = getattr(plan, "ep", 1), getattr(plan, "cp", 1)
    ep_index, ep_group, expert_dp_group = 0, None, None
    etp = getattr(plan, "expert_tp", 1)
    if ep > 1 or etp > 1:  # plan.py [Note: expert layout]
        ep_index = plan.expert_slot(dp_index, tp_index).index
        if ep > 1:
            ep_group = _subgroup(plan, rank, lambda d, t: plan.expert_slot(d, t).group, timeout)
        if plan.tp * plan.dp > ep * etp:
            expert_dp_group = _subgroup(plan, rank, lambda d, t: plan.expert_slot(d, t).holding, timeout)
    # Context parallelism folds over dp: groups of cp consecutive dp ranks at each tp index.
    cp_group = _subgroup(plan, rank, lambda d, t: (d // cp, t), timeout) if cp > 1 else None
    return ParallelLayout(rank, world_size, pp_index, dp_index, tp_index, plan.pp, plan.dp, plan.tp,
                          stage_rank, mesh, dp_group, tie_groups, tp_mesh, fsdp_mesh,
                          pp_group=mesh["pp"].get_group() if mesh is not None and plan.pp > 1 else None,
                          ep_index=ep_index, ep_group=ep_group, cp_index=dp_index % cp, cp_group=cp_group,
                          expert_dp_group=expert_dp_group, expert_fsdp_mesh=expert_fsdp_mesh)


def _subgroup(plan, rank: int, key, timeout: timedelta | None) -> dist.ProcessGroup:
    """The group of this rank among those that split each pipeline rank's (dp, tp) coordinates by
    `key(dp_index, tp_index)`. new_group is collective: every rank creates every group, in the same
    order."""
    mine = None
    for p in range(plan.pp):
        parts: dict[object, list[int]] = {}
        for d in range(plan.dp):
            for t in range(plan.tp):
                parts.setdefault(key(d, t), []).append(plan.rank(p, d, t))
        for ranks in parts.values():
            group = dist.new_group(sorted(ranks), timeout=timeout)
            if rank in ranks:
                mine = group
    return mine


def _group_options(device_type: str, timeout: timedelta | None) -> tuple[str | None, object | None]:
    """DeviceMesh's (backend, options) for groups whose collectives time out after `timeout`."""
    if timeout is None:
        return (None, None)
    options = dist.ProcessGroupNCCL.Options() if device_type == "cuda" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return (None, options)


def build_mesh(plan, modules: Mapping[int, nn.Module], aliases: Mapping[str, str], device: torch.device,
               timeout: timedelta) -> ParallelLayout:
    """This rank's `ParallelLayout` under `plan`, in the default process group (collective).

    `modules` are every stage's module (this rank's and the others'), `aliases` every name of a tied
    parameter -> its first name: which pipeline ranks hold a copy of each tied parameter comes from
    the graph, the same on every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != plan.num_gpus:
        raise PartitionError(f"the plan needs {plan.num_gpus} ranks (tp {plan.tp} * pp {plan.pp} * dp {plan.dp}) "
                             f"but the process group has {world_size}")
    holders: dict[str, list[int]] = {}
    for index, module in modules.items():
        for name, _ in module.named_parameters(remove_duplicate=False):
            if name in aliases:
                holders.setdefault(aliases[name], []).append(plan.stages[index].pp_rank)
    return build_layout(plan, rank, world_size, device.type, holders, timeout=timeout)
