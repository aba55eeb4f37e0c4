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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from autoplan.runtime.checkpoint.format import EXTRA_KEY, OPTIMIZER_KEY, CheckpointError, _rank_key


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: the inner optimizer over this rank's share of a
    ZeRO-1 optimizer (runtime/optimizer.py, or torch's ZeroRedundancyOptimizer), or the optimizer
    itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from autoplan.runtime.optimizer import ZeroOneOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer | ZeroOneOptimizer) else optimizer


def _canonical(pm, name: str) -> str:
    """The name a (tied) parameter is saved under: its first name in the model."""
    return getattr(pm, "aliases", {}).get(name, name)


def _param_names(pm) -> dict[int, str]:
    return {id(p): name for name, p in pm.named_parameters()}


def _model_state(pm) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Saved key -> this rank's (local name, tensor) under it; tied copies share a key."""
    out: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in pm.state_dict().items():
        out.setdefault(_canonical(pm, name), []).append((name, tensor))
    return out


def _unheld_names(pm) -> set[str]:
    """Names of the parameters whose fp32 values this rank does not hold: the masters other dp
    ranks own under a bf16 ZeRO-1 optimizer (runtime/optimizer.py; `state_dict` gives their bf16
    working copies). Their owners save them; a restore loads them into their working copies."""
    holds = getattr(pm, "holds_values", None)
    if holds is None:
        return set()
    return {name for name, p in pm.named_parameters() if not holds(p)}


def named_optimizer_state(pm, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state as DCP saves it: {"state": {name: {...}}, "param_groups": {name:
    {hyperparameters}}} (torch's flattened optimizer state dict; names are the model's).

    Of a ZeRO optimizer, the state of this rank's shard (every owner saves its own) and the
    hyperparameters of every local parameter."""
    names = _param_names(pm)
    state: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}

    def name_of(p) -> str:
        name = names.get(id(p))
        if name is None:
            raise CheckpointError("the optimizer holds a parameter the partitioned model does not name")
        return _canonical(pm, name)

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


def _rank_state(pm, optimizer, rank: int, step: int, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """What this rank hands `dcp.save` (module docstring)."""
    unheld = _unheld_names(pm)
    state: dict[str, Any] = {}
    for key, copies in _model_state(pm).items():
        held = [tensor for name, tensor in copies if name not in unheld]
        if held:  # a master another dp rank owns: that rank writes its fp32 values
            state[key] = held[0]
    if optimizer is not None:
        state[OPTIMIZER_KEY] = named_optimizer_state(pm, optimizer)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    state[EXTRA_KEY] = {_rank_key(rank): {"rng": rng, "extra": json.dumps({"step": step, **dict(extra or {})})}}
    return state
