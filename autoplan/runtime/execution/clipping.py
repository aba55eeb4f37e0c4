"""Gradient clipping by the global norm, counting each parameter once over every rank of the plan.

[Note: the global gradient norm]
`torch.nn.utils.clip_grad_norm_` on one process takes the norm of every gradient of the model. A
partitioned model's gradients are spread over the ranks and partly repeated on several of them:

- pp: each pipeline rank holds its stages' parameters (summed over the ranks), except a tied
  parameter split over pipeline ranks (an embedding tied to the head), of which each holder keeps
  a copy with the same, all-reduced gradient (mesh.py `tie_groups`): counted once.
- tp: a sharded parameter (a DTensor with a Shard placement) holds 1/tp of the rows or columns on
  each tp rank (summed); a replicated one (a norm, a row-parallel bias, every plain tensor of a
  stage, sequence-parallel norms included once their gradients are reduced) holds the same whole
  gradient on every tp rank: counted once. A fused projection sharded part by part (grouped-query
  heads per key/value group, a multi-query key and value whole on every tp rank) counts part by
  part: its sharded parts summed, its whole parts once.
- dp (cp included): after the all-reduce every replica holds the same gradients (zero 0 and ZeRO-1,
  whose fp32 masters keep their full `.grad` even where released, precision.py): counted once.
  FSDP (zero >= 2) shards them over "dp_shard" (summed) and HSDP replicates them over
  "dp_replicate" (counted once): read from each DTensor's placements.
- ep: the ranks of an ep group hold different experts (summed); the ranks holding the same slice of
  the same experts (the expert-data-parallel group, plan.py [Note: expert layout]; under expert tp
  each tp index a slice of its own) hold the same gradient: counted once.

Rather than one rule per layout, the runtime names what each local gradient is: the parameter's
name in the model (a tied copy under its first name), the expert slice it holds (`ExpertSlot.
holding`), and where its local values sit in the whole tensor (a DTensor's local shape and global
offset, torch's `compute_local_shape_and_global_offset`). Two local gradients with the same key
are copies of the same values; the lowest rank holding a key counts it. The keys are exchanged once
(`all_gather_object`, the first call); each call after that is one all-reduce of one number over
the world: the sum of this rank's counted gradients' norms to the p-th power (the maximum for the
inf-norm), from which every rank takes the same total.

The clip itself is torch's: coefficient max_norm / (total + 1e-6), clamped to 1, multiplied into
every local gradient (counted or not: the copies stay equal). torchtitan's `clip_grad_norm_`
(torchtitan/distributed/utils.py) does the same with DTensors' own reductions plus an all-reduce
over the pp mesh; autoplan's stages mix plain tensors and DTensors and repeat tied and expert
parameters outside any one mesh, which the keys cover uniformly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist


class _Partitioned(Protocol):
    """What the norm reads of a runtime/execution/partitioned.py `PartitionedModel` (named by its interface, not
    imported: partitioned.py calls this module, and an import back would close a circle)."""

    layout: Any
    plan: Any
    expert_params: Sequence[torch.Tensor]
    aliases: Mapping[str, str]

    def named_masters(self) -> Iterator[tuple[str, torch.Tensor]]: ...

__all__ = ["GradNormCounter", "clip_grads_with_norm_"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _slice_key(param: torch.Tensor) -> tuple:
    """Where this rank's values of `param` sit in the whole tensor: (global shape, local shape,
    global offset) of a DTensor, else its shape (a plain tensor holds the whole parameter, or an
    expert slice the caller names)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return (tuple(param.shape),)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return (tuple(param.shape), tuple(shape), tuple(offset))


def _piece_keys(param: torch.Tensor) -> list[tuple[tuple, tuple[int, int, int] | None]]:
    """(where, part) per piece of this rank's values of `param`: one piece, all of it, for most
    tensors; a fused projection sharded part by part (tensor_parallel_graph.py [Note: fused
    projections]: grouped-query heads, a multi-query key and value whole on every tp rank) has one
    per part, `part` = (dim, local start, length), so a part every tp rank holds whole is counted once."""
    from autoplan.runtime.parallel.tensor_parallel_graph import blocked_boxes

    boxes = blocked_boxes(param)
    if boxes is None:
        return [(_slice_key(param), None)]
    dim = param.placements[0].dim
    out, start = [], 0
    for offsets, sizes, _ in boxes:
        out.append(((tuple(param.shape), tuple(sizes), tuple(offsets)), (dim, start, sizes[dim])))
        start += sizes[dim]
    return out


class GradNormCounter:
    """Which of a `PartitionedModel`'s local gradients this rank counts in the global norm
    ([Note: the global gradient norm]); built once, collective over the world."""

    def __init__(self, pm: _Partitioned):
        layout, plan = pm.layout, pm.plan
        experts = {id(p) for p in pm.expert_params}
        holding = plan.expert_slot(layout.dp_index, layout.tp_index).holding if pm.expert_params else None
        keys = []  # per parameter: [(key, (dim, local start, length) of its part, or None for all of it)]
        for name, p in pm.named_masters():
            canonical = pm.aliases.get(name, name)
            owner = holding if id(p) in experts else None
            keys.append([((canonical, owner, where), part) for where, part in _piece_keys(p)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, [[key for key, _ in pieces] for pieces in keys])
        else:
            gathered = [[[key for key, _ in pieces] for pieces in keys]]
        first_holder: dict[tuple, int] = {}
        for rank, rank_keys in enumerate(gathered):
            for pieces in rank_keys:
                for key in pieces:
                    first_holder.setdefault(key, rank)
        me = dist.get_rank() if dist.is_initialized() else 0
        seen: set[tuple] = set()
        self.counted: list[list[tuple[int, int, int] | None]] = []
        """Per parameter of `named_masters()`: the parts of its local gradient this rank counts (None:
        all of it; empty: none)."""
        for pieces in keys:
            self.counted.append([part for key, part in pieces if first_holder[key] == me and key not in seen])
            seen.update(key for key, _ in pieces)

    def total_norm(self, grads: Sequence[torch.Tensor | None], norm_type: float, device: torch.device
                   ) -> torch.Tensor:
        """The global norm of the gradients (one per parameter, None where it has none): collective."""
        counted = []
        for g, parts in zip(grads, self.counted):
            if g is None:
                continue
            local = _local(g)
            counted += [local if part is None else local.narrow(*part) for part in parts]
        counted = [g for g in counted if g.numel() > 0]
        inf = math.isinf(norm_type)
        if counted:
            norms = torch.stack([n.float() for n in torch._foreach_norm(counted, norm_type)])
            # float64 for the sum of p-th powers: one number, reduced over the world
            mine = norms.max() if inf else norms.double().pow(norm_type).sum()
        else:
            mine = torch.zeros((), device=device)
        report = mine.to(device=device, dtype=torch.float64).reshape(1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(report, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        total = report[0] if inf else report[0].pow(1.0 / norm_type)
        return total.float()


@torch.no_grad()
def clip_grads_with_norm_(grads: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by torch's coefficient (`torch.nn.utils.clip_grads_with_norm_`):
    max_norm / (total_norm + 1e-6), clamped to 1."""
    local = [_local(g) for g in grads if g is not None]
    if not local:
        return
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in local:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), tensors in by_device.items():
        torch._foreach_mul_(tensors, coefficient.to(device))
