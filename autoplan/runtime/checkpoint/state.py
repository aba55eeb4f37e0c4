"""What one rank holds, as the state dicts DCP saves: parameters and buffers under the model's own
names (a tied parameter once), the optimizer's state keyed by parameter name, and the rank's
extras. Used by save.py to write and by restore.py to find where each saved key goes.

[Note: why not get_state_dict] torch's `get_state_dict` / `set_state_dict` want one nn.Module whose
parameters the optimizer steps. Here a bf16 plan's optimizer steps fp32 masters that are not the
stage modules' parameters (precision.py), a tied parameter has one copy per pipeline rank under
different names, and a ZeRO-1 optimizer holds only its shard in an inner optimizer that
`get_optimizer_state_dict` does not know. So the FQN-keyed state dicts are built here from
`PartitionedModel.named_parameters` / `state_dict` (the names of the full model) in the layout
`get_state_dict(..., flatten_optimizer_state_dict=True)` produces, and loaded in place.

[Note: experts in a checkpoint]
Under expert parallelism (ep > 1) a rank holds experts [i * E/ep, (i + 1) * E/ep) of each experts
parameter (runtime/parallel/experts.py, i its ep index) under the parameter's full name, as a plain tensor
or, under FSDP, as a DTensor sharded over the ranks holding the same experts. Neither says where it
sits in the (E, ...) tensor, so DCP would store one rank's slice as the whole. Each such parameter
(and its optimizer state) goes to DCP as `Pieces` (planners.py): the global (E, ...) shape and one
box at dim-0 offset i * E/ep plus the FSDP shard's own offset. The checkpoint then holds every
expert once, under the model's own names and shapes, like any other tensor: it loads under another
ep, without ep and into a plain model (DCP reshards), and replicas that hold the same experts write
the same box, which DCP keeps once. Under expert tp a rank holds 1/etp of each expert's hidden units
too (runtime/parallel/expert_tp.py): its box is offset along the hidden axis by its tp index, and a fused
[gate | up] projection gives two boxes, one in each half of the whole (`PartitionedModel.expert_hidden`
says which axis).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autoplan.runtime.checkpoint.format import EXTRA_KEY, OPTIMIZER_KEY, CheckpointError, rank_key
from autoplan.runtime.checkpoint.planners import Pieces


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: the inner optimizer over this rank's share of a
    ZeRO-1 optimizer (runtime/parallel/optimizer.py, or torch's ZeroRedundancyOptimizer), or the optimizer
    itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from autoplan.runtime.parallel.optimizer import ZeroOneOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer | ZeroOneOptimizer) else optimizer


def canonical_name(pm, name: str) -> str:
    """The name a (tied) parameter is saved under: its first name in the model."""
    return getattr(pm, "aliases", {}).get(name, name)


def _named_masters(pm):
    """(name, tensor the optimizer steps) of `pm`: its fp32 masters in a bf16 plan, which its
    optimizer's groups hold (`PartitionedModel.named_masters`; a model without it: its parameters)."""
    named = getattr(pm, "named_masters", None)
    return named() if named is not None else pm.named_parameters()


def param_names(pm) -> dict[int, str]:
    return {id(p): name for name, p in _named_masters(pm)}


@dataclass(frozen=True)
class ExpertSlices:
    """This rank's expert slices ([Note: experts in a checkpoint])."""

    names: frozenset[str]
    """Saved names of the experts parameters this rank holds a slice of."""
    ep_index: int
    """This rank's ep index: its slice is experts [ep_index * E/ep, (ep_index + 1) * E/ep)."""
    ep: int
    """The plan's expert-parallel degree (1: no slices along the experts)."""
    hidden: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Under expert tp: saved name -> where its hidden units are (runtime/parallel/expert_tp.py `HiddenAxis`)."""
    etp_index: int = 0
    """This rank's slice of every expert's hidden units (its tp index under expert tp)."""
    etp: int = 1

    def global_shape(self, tensor, name: str) -> tuple[int, ...]:
        """The whole parameter's shape, of which `tensor` (a slice, or its FSDP DTensor) is 1/ep along
        the experts and, under expert tp, 1/etp along the hidden units."""
        shape = [tensor.shape[0] * self.ep, *tensor.shape[1:]]
        if name in self.hidden:
            shape[self.hidden[name].axis] *= self.etp
        return tuple(shape)

    def pieces(self, tensor, name: str) -> Pieces:
        """`tensor` (this rank's slice of an experts parameter, or a state of its shape) as its boxes
        of the whole parameter: one, or under expert tp one per half of a fused [gate | up]
        projection (each half's slice sits in that half of the whole)."""
        from torch.distributed.tensor import DTensor

        offset = (0,) * tensor.dim()
        local = tensor
        if isinstance(tensor, DTensor):  # an FSDP shard of the slice: where it sits in the slice
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local = tensor.to_local()
            _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        start = [self.ep_index * tensor.shape[0] + offset[0], *offset[1:]]
        boxes = []
        if local.numel() and name in self.hidden:
            where = self.hidden[name]
            size = local.shape[where.axis] // where.chunks
            for j in range(where.chunks):  # chunk j of the slice: in chunk j of the whole, at this rank's part
                at = list(start)
                at[where.axis] = j * size * self.etp + self.etp_index * size
                view = local.narrow(where.axis, j * size, size)
                boxes.append((tuple(at), tuple(view.shape), view))
        elif local.numel():
            boxes = [(tuple(start), tuple(local.shape), local)]
        return Pieces(torch.Size(self.global_shape(tensor, name)), local, boxes, whole=tensor)


def expert_slices(pm) -> ExpertSlices:
    """This rank's expert slices under `pm`'s plan (none without ep or expert tp)."""
    plan = getattr(pm, "plan", None)
    ep, etp = getattr(plan, "ep", 1), getattr(plan, "expert_tp", 1)
    held = {id(p) for p in getattr(pm, "expert_params", ())}
    if ep * etp == 1 or not held:
        return ExpertSlices(frozenset(), 0, 1)
    names = frozenset(canonical_name(pm, name) for name, p in _named_masters(pm) if id(p) in held)
    hidden = {canonical_name(pm, name): where for name, where in getattr(pm, "expert_hidden", {}).items()}
    return ExpertSlices(names, pm.layout.ep_index, ep, hidden, pm.layout.tp_index if etp > 1 else 0, etp)


def model_state(pm) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Saved key -> this rank's (local name, tensor) under it; tied copies share a key."""
    out: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in pm.state_dict().items():
        out.setdefault(canonical_name(pm, name), []).append((name, tensor))
    return out


def unheld_names(pm) -> set[str]:
    """Names of the parameters whose fp32 values this rank does not hold: the masters other dp
    ranks own under a bf16 ZeRO-1 optimizer (runtime/parallel/optimizer.py; `state_dict` gives their bf16
    working copies). Their owners save them; a restore loads them into their working copies."""
    holds = getattr(pm, "holds_values", None)
    if holds is None:
        return set()
    return {name for name, p in _named_masters(pm) if not holds(p)}


def named_optimizer_state(pm, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state as DCP saves it: {"state": {name: {...}}, "param_groups": {name:
    {hyperparameters}}} (torch's flattened optimizer state dict; names are the model's).

    Of a ZeRO optimizer, the state of this rank's shard (every owner saves its own) and the
    hyperparameters of every local parameter."""
    names = param_names(pm)
    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}

    def name_of(p) -> str:
        name = names.get(id(p))
        if name is None:
            raise CheckpointError("the optimizer holds a parameter the partitioned model does not name")
        return canonical_name(pm, name)

    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            groups.setdefault(name_of(p), hyper)
    inner = local_optimizer(optimizer)
    for group in inner.param_groups:
        for p in group["params"]:
            if p in inner.state and inner.state[p]:
                state.setdefault(name_of(p), {k: (v.detach() if isinstance(v, torch.Tensor) else v)
                                              for k, v in inner.state[p].items()})
    return {"state": state, "param_groups": groups}


def _expert_state(experts: ExpertSlices, name: str, key: str, value: Any, shape: tuple[int, ...]) -> Any:
    """An optimizer-state entry of an expert slice as DCP saves it: of the slice's shape, its box of
    the whole; a scalar as it is. Another shape (a factored second moment) would be saved by every ep
    index under one key, so it is refused."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if tuple(value.shape) != shape:
        raise CheckpointError(f"the optimizer's state {key!r} of the expert parameter {name!r} has shape "
                              f"{tuple(value.shape)}, not the parameter's {shape}: checkpoints of ep plans hold "
                              "parameter-shaped state (Adam, AdamW, SGD); use one of those or --ep 1")
    return experts.pieces(value, name)


def rank_state(pm, optimizer, rank: int, step: int, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """What this rank hands `dcp.save` (module docstring)."""
    unheld = unheld_names(pm)
    experts = expert_slices(pm)
    state: dict[str, Any] = {}
    for key, copies in model_state(pm).items():
        held = [tensor for name, tensor in copies if name not in unheld]
        if held:  # a master another dp rank owns: that rank writes its fp32 values
            state[key] = experts.pieces(held[0], key) if key in experts.names else held[0]
    if optimizer is not None:
        state[OPTIMIZER_KEY] = named_optimizer_state(pm, optimizer)
        shapes = {canonical_name(pm, name): tuple(p.shape) for name, p in _named_masters(pm)}
        for name, entries in state[OPTIMIZER_KEY]["state"].items():
            if name in experts.names:  # the moments have the slice's shape; the step count is a scalar
                state[OPTIMIZER_KEY]["state"][name] = {k: _expert_state(experts, name, k, v, shapes[name])
                                                       for k, v in entries.items()}
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    state[EXTRA_KEY] = {rank_key(rank): {"rng": rng, "extra": json.dumps({"step": step, **dict(extra or {})})}}
    return state
