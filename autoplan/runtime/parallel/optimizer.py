"""ZeRO-1: the optimizer state sharded over the data-parallel group, at any tensor-parallel degree.

[Note: ZeRO-1 optimizer]
Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"),
Sec. 5.1, P_os: every data-parallel rank keeps the optimizer state of 1/dp of the parameters, steps
those, and the updated values reach the other ranks of its dp group. Megatron-LM's distributed
optimizer (docs: "Distributed Optimizer", megatron/core/optimizer/distrib_optimizer.py) and
torchtitan do this inside each tensor-parallel rank: the dp group of a tp rank holds the same tp
shard, so the shard's state is split over that group whatever tp is. torch's
`ZeroRedundancyOptimizer` cannot (it broadcasts plain tensors, not DTensor shards), so the runtime
has this one, for every zero = 1 plan with a dp group:

- What is sharded: this rank's parameters as `PartitionedModel.parameters()` lists them (the fp32
  masters of a bf16 plan, tensor-parallel DTensors whose `.to_local()` is this rank's 1/tp slice).
  Each parameter is owned whole by one rank of the dp group, as in `ZeroRedundancyOptimizer`, not
  cut at a flat-buffer boundary as in Megatron-LM: the state of a parameter lives on one rank, so a
  checkpoint keys it by the parameter's name (runtime/checkpoint/) and loads under any layout.
- Who owns what: the parameters by size (the global size, so that the tp ranks of one dp rank,
  which hold slices of the same tensors, own the same ones and a checkpoint gets every slice),
  largest first, each to the rank with the fewest elements so far (ZeroRedundancyOptimizer's
  greedy rule). A rank holds Adam's two moments for about 1/dp of the elements.
- A step: the inner optimizer (`optim`, the user's optimizer class) steps the owned parameters with
  the gradients every rank already holds (the runtime all-reduces them over dp, runtime/execution/partitioned.py);
  then each rank broadcasts its owned values, flattened into one buffer per dtype, over the dp group
  (DP_GRAD_SYNC's counterpart: Megatron-LM all-gathers the updated parameters here).
- The fp32 masters of a bf16 plan are sharded too, as Megatron-LM's distributed optimizer shards its
  fp32 "main params": `working` maps each master to its bf16 working parameter, and
  `PartitionedModel.make_optimizer` has the other ranks' masters released (runtime/parallel/precision.py
  `release_masters`: no fp32 values, the full fp32 gradient kept, as Megatron-LM's `main_grad`). An
  owner steps its masters, writes them into their working parameters (bf16 rounding, what
  `refresh` would write) and broadcasts those: 2 bytes an element on the wire, not 4, and the
  working copies of every rank are those of a replicated optimizer, bit for bit. Checkpoints write
  each master's fp32 values from its owner (runtime/checkpoint/).
- Not sharded: the gradients (all-reduced, not reduce-scattered) and the bf16 working parameters. A
  rank holds 2 + 4 + (4 + 8) / dp bytes per parameter in bf16, Megatron-LM's distributed
  optimizer's 2 + 4 + 12 / dp (4 + 4 + 8 / dp in fp32, where the parameter is the master), which
  the memory model counts (cost/memory.py [Note: bytes per parameter]).
- cp ranks are dp ranks here (runtime/parallel/mesh.py: the dp group spans them; they hold the same
  parameters and, after the all-reduce, the same gradients), so the state is sharded over them too.
- Expert parallelism (ep > 1): the ranks of an ep group hold different experts, so an expert's
  state cannot be owned by a rank that does not hold it. The expert parameters (runtime/parallel/experts.py,
  `PartitionedModel.expert_params`) are sharded over the expert-data-parallel group instead (the
  tp x dp / ep ranks holding the same experts, plan.py [Note: expert layout],
  `ParallelLayout.expert_dp_group`; none when that is one rank: it then owns its experts), the dense
  parameters over the whole dp group as above. This is
  Megatron-LM's layout: `get_megatron_optimizer` (megatron/core/optimizer/__init__.py) builds one
  distributed optimizer over the dense parameters with the data-parallel group and a second over
  the expert parameters with `parallel_state.get_expert_data_parallel_group()`, chained. Here they
  are two shards of one optimizer (`_Shard`), so the user still steps one object. The gradients
  are reduced as without ZeRO (`reduce_expert_grads`): every rank holds its experts' mean gradient.

The state lives in `optim` (torch's own optimizer over the owned parameters): `checkpoint.
local_optimizer` finds it there. This optimizer's `param_groups` list every parameter with the full
hyperparameters (an LR scheduler edits them; each step copies them to `optim`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ZeroOneOptimizer"]


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's values of a parameter: the tp shard of a DTensor, else the tensor."""
    return p.to_local() if hasattr(p, "to_local") else p


def assign_owners(sizes: list[int], num_ranks: int) -> list[int]:
    """Owner (0 .. num_ranks - 1) of each parameter of `sizes` elements: largest first, each to the
    rank with the fewest elements so far, ties to the lower rank and the earlier parameter
    ([Note: ZeRO-1 optimizer])."""
    load = [0] * num_ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(num_ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += sizes[i]
    return owners


class _Shard:
    """One group's share of the parameters: who owns each, and the broadcast of the updated values."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup | None):
        self.group = group
        """The ranks that hold these parameters and split their state; None: this rank alone."""
        self.group_rank = dist.get_rank(group) if group is not None else 0
        self.num_ranks = dist.get_world_size(group) if group is not None else 1
        owners = assign_owners([p.numel() for p in params], self.num_ranks)  # DTensor: the global size
        self.owned: list[list[torch.Tensor]] = [[] for _ in range(self.num_ranks)]
        """Rank in `group` -> the parameters it steps and keeps state for."""
        for p, r in zip(params, owners):
            self.owned[r].append(p)

    def broadcast(self, working: Mapping[int, torch.Tensor]) -> None:
        """Every owner's updated values (a master's working copy where it has one) to the other
        ranks of the group: one flat buffer per owner and (dtype, device)."""
        if self.group is None:
            return
        for owner, params in enumerate(self.owned):
            by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in params:
                t = _local(working.get(id(p), p))
                by_kind.setdefault((t.dtype, t.device), []).append(t)
            src = dist.get_global_rank(self.group, owner)
            for (dtype, device), tensors in by_kind.items():
                if owner == self.group_rank:
                    buffer = torch.cat([t.reshape(-1) for t in tensors])
                else:
                    buffer = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
                dist.broadcast(buffer, src=src, group=self.group)
                if owner != self.group_rank:
                    for t, chunk in zip(tensors, buffer.split([t.numel() for t in tensors])):
                        t.copy_(chunk.view_as(t))


class ZeroOneOptimizer(torch.optim.Optimizer):
    """`optimizer_class` over this rank's share of `params`, sharded over `group` ([Note: ZeRO-1
    optimizer]); the parameters in `experts` (ep > 1) over `expert_group` instead (None: this
    rank alone holds them). Collective: every rank of `group` builds it with the same parameters
    (by size and order, experts apart) and calls `step` together."""

    _autoplan_zero_one = True
    """The optimizer of the released masters (runtime/parallel/precision.py [Note: writes under ZeRO-1])."""

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup, working: Mapping[int, torch.Tensor] | None = None,
                 experts: Iterable[torch.Tensor] = (), expert_group: dist.ProcessGroup | None = None,
                 **defaults: Any):
        super().__init__(params, defaults)
        self.working = dict(working or {})
        """id(fp32 master) -> its bf16 working parameter (a bf16 plan): owners write and broadcast those."""
        flat = [p for g in self.param_groups for p in g["params"]]
        expert_ids = {id(p) for p in experts}
        self._shards = [_Shard([p for p in flat if id(p) not in expert_ids], group)]
        if expert_ids:
            self._shards.append(_Shard([p for p in flat if id(p) in expert_ids], expert_group))
        mine = {id(p) for p in self.owned_parameters()}
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [p for p in g["params"] if id(p) in mine]}
                        for g in self.param_groups]
        self.optim = optimizer_class(inner_groups, **defaults)
        self.optim._autoplan_zero_one = True  # steps the masters this rank owns (precision.py [Note: writes under ZeRO-1])
        """torch's optimizer over the parameters this rank owns: it holds their state."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):  # the full hyperparameters
            for k, v in inner.items():
                if k != "params":
                    outer.setdefault(k, v)
        self.defaults = {**self.optim.defaults, **defaults}
        self.after_step: Callable[[], None] | None = None
        """Called after each step's broadcast (`PartitionedModel.make_optimizer` records the versions
        of the values it wrote: runtime/parallel/precision.py [Note: writes under ZeRO-1])."""

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters this rank steps and keeps state for."""
        return [p for shard in self._shards for p in shard.owned[shard.group_rank]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.optim.param_groups):  # an LR scheduler's edits
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
        self.optim.step()
        for p in self.owned_parameters():  # the stepped masters into their working copies
            working = self.working.get(id(p))
            if working is not None:
                _local(working).copy_(_local(p))
        for shard in self._shards:
            shard.broadcast(self.working)
        if self.after_step is not None:
            self.after_step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(_NO_STATE_DICT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError(_NO_STATE_DICT)


_NO_STATE_DICT = ("a ZeRO-1 optimizer holds 1/dp of the state on each rank; save and load it with "
                  "autoplan.runtime.checkpoint (save_checkpoint / restore), which keys it by parameter name")
