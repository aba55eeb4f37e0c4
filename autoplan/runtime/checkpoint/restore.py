"""`restore`: a checkpoint into this rank's `PartitionedModel` under any plan of the same model,
reading only this rank's pieces (DCP reshards) and loading in place.
"""

from __future__ import annotations

from typing import Any

import torch

from autoplan.runtime.checkpoint.format import (
    EXTRA_KEY,
    OPTIMIZER_KEY,
    CheckpointError,
    checkpoint_fingerprint,
    rank_key,
)
from autoplan.runtime.checkpoint.integrity import Damaged, check_structure
from autoplan.runtime.checkpoint.planners import Pieces
from autoplan.runtime.checkpoint.reader import Checkpoint, dcp_load
from autoplan.runtime.checkpoint.state import (
    canonical_name,
    expert_slices,
    local_optimizer,
    model_state,
    param_names,
    unheld_names,
)

_KERNEL_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Optimizer group entries that pick a kernel, not the math: the reader's own choice is kept."""


def _target_like(param, md, experts=None, name: str = "") -> torch.Tensor | Pieces:
    """An empty tensor to load a saved optimizer-state entry into: laid out as `param` (a DTensor
    keeps its placements, so DCP reads only this rank's chunk) when it has the parameter's shape
    (for an expert slice, `experts`: the whole parameter's, read as the slice's box), else a plain
    tensor of the saved shape (AdamW's scalar step)."""
    if experts is not None and tuple(md.size) == experts.global_shape(param, name):
        return experts.pieces(torch.empty_like(param.detach(), dtype=md.properties.dtype), name)
    if tuple(md.size) == tuple(param.shape):
        return torch.empty_like(param.detach(), dtype=md.properties.dtype)
    device = param.to_local().device if hasattr(param, "to_local") else param.device
    return torch.empty(md.size, dtype=md.properties.dtype, device=device)


@torch.no_grad()
def restore(ckpt: Checkpoint, pm, optimizer: torch.optim.Optimizer | None = None, *, strict: bool = True,
            restore_rng: bool = True, rank: int | None = None) -> int:
    """Load `ckpt` into this rank's `PartitionedModel` (any plan of the same model) and optimizer.

    Reads only this rank's pieces (DCP reshards; no collective: each rank may call it alone).
    Uses `pm`'s public `state_dict` / `named_parameters` / `aliases` and loads in place. Returns the
    checkpoint's step. A checkpoint of another model (fingerprint), a local tensor missing from it
    (with `strict`) or of another shape: one-line CheckpointError before anything is loaded.
    `rank` (with `restore_rng`): restore that rank's saved RNG state. `ckpt` was verified by
    `load_checkpoint`; its files' names and sizes are checked again here (no data read), in case
    they changed since.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = f"checkpoint {str(ckpt.path)!r}"
    try:
        check_structure(ckpt.path)
    except Damaged as exc:
        raise CheckpointError(f"{where} changed after it was opened: {exc}; open it again (load_checkpoint)") from None
    plan = getattr(pm, "plan", None)
    saved_fp, fp = checkpoint_fingerprint(ckpt.manifest), getattr(plan, "model_fingerprint", None)
    if fp and not saved_fp:
        raise CheckpointError(f"{where} records no model fingerprint, so it may be of another model (this "
                              f"model's is {fp}); resume from a checkpoint saved by a plan of this model")
    if saved_fp and fp and saved_fp != fp:
        layout = ", ".join(f"{k} {v}" for k, v in (ckpt.manifest.get("layout") or {}).items()
                           if k in ("pp", "dp", "tp", "zero"))
        raise CheckpointError(f"{where} is of model {ckpt.manifest.get('model')!r} (fingerprint {saved_fp}"
                              f"{f', saved under {layout}' if layout else ''}); this model's fingerprint is {fp}")
    targets: dict[str, Any] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loaded, another local tensor of the same key)
    missing: list[str] = []
    unheld = unheld_names(pm)
    experts = expert_slices(pm)  # read as their boxes of the whole tensors ([Note: experts in a checkpoint])
    for key, local in model_state(pm).items():
        saved = ckpt.saved_name(key, ckpt.model_keys)
        if saved is None:
            missing.append(local[0][0])
            continue
        local = sorted(local, key=lambda entry: entry[0] in unheld)  # a held copy first
        name, tensor = local[0]
        md = ckpt.model_keys[saved]
        shape = experts.global_shape(tensor, key) if key in experts.names else tuple(tensor.shape)
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != shape:
            raise CheckpointError(f"{where} entry {saved!r} has shape {tuple(getattr(md, 'size', ()))}, the model's "
                                  f"{name!r} {shape}; is it of another model?")
        others = [other for _, other in local[1:]]
        if name in unheld:  # read the saved (fp32) values aside, then round them into the working copy
            others.insert(0, tensor)
            tensor = torch.empty_like(tensor, dtype=md.properties.dtype)
        targets[saved] = experts.pieces(tensor, key) if key in experts.names else tensor
        copies += [(tensor, other) for other in others]
    if strict and missing:
        raise CheckpointError(f"{where} has no entry for {len(missing)} parameters of this rank, e.g. "
                              f"{missing[0]!r}; is it of another model?")

    opt_state: dict[str, dict[str, Any]] = {}
    opt_tensors: dict[str, dict[str, torch.Tensor]] = {}  # the tensors an expert's `Pieces` read into
    hyper: dict[str, dict[str, Any]] = {}
    inner = None
    if optimizer is not None:
        inner = local_optimizer(optimizer)  # under ZeRO: the shard this rank steps, found by name
        names = param_names(pm)
        for group in inner.param_groups:
            for p in group["params"]:
                name = canonical_name(pm, names[id(p)])
                saved = ckpt.saved_name(name, ckpt.optimizer_keys)
                if saved is None:
                    if strict and ckpt.optimizer_keys:
                        raise CheckpointError(f"{where} has no optimizer state for {name!r}")
                    continue
                entries = {}
                for k, key in ckpt.optimizer_keys[saved].items():
                    md = ckpt.metadata.state_dict_metadata[key]
                    entries[k] = (_target_like(p, md, experts if name in experts.names else None, name)
                                  if isinstance(md, TensorStorageMetadata) else None)
                    if isinstance(entries[k], Pieces):
                        opt_tensors.setdefault(saved, {})[k] = entries[k].whole
                opt_state[saved] = entries
        for group in optimizer.param_groups:
            for p in group["params"]:
                saved = ckpt.saved_name(canonical_name(pm, names[id(p)]), ckpt.hyperparameter_keys)
                if saved is not None:
                    hyper[saved] = dict.fromkeys(ckpt.hyperparameter_keys[saved])
    per_rank: dict[str, Any] = {}
    if restore_rng and rank is not None and rank in ckpt.rank_keys:
        per_rank = {rank_key(rank): {"rng": {path[1]: torch.empty(ckpt.metadata.state_dict_metadata[key].size,
                                                                    dtype=torch.uint8)
                                              for path, key in ckpt.rank_keys[rank].items() if path[0] == "rng"}}}

    state: dict[str, Any] = dict(targets)
    if opt_state or hyper:
        state[OPTIMIZER_KEY] = {"state": opt_state, "param_groups": hyper}
    if per_rank:
        state[EXTRA_KEY] = per_rank
    dcp_load(ckpt.path, state)

    with torch.no_grad():
        for loaded, other in copies:
            if hasattr(other, "to_local") and hasattr(loaded, "to_local"):  # tp shards, one layout
                other.to_local().copy_(loaded.to_local())
            else:
                other.copy_(loaded)
    precision = getattr(pm, "precision", None)
    if precision is not None:  # the bf16 working copies follow the restored fp32 masters (those held)
        precision.refresh()

    if inner is not None:
        loaded_state = state.get(OPTIMIZER_KEY, {}).get("state", {})
        loaded_hyper = state.get(OPTIMIZER_KEY, {}).get("param_groups", {})
        names = param_names(pm)
        sd = inner.state_dict()
        by_index: dict[int, Any] = {}
        index = 0
        for group in inner.param_groups:
            for p in group["params"]:
                saved = ckpt.saved_name(canonical_name(pm, names[id(p)]), loaded_state)
                if saved is not None:
                    by_index[index] = {**loaded_state[saved], **opt_tensors.get(saved, {})}
                index += 1
        sd["state"] = by_index

        def saved_group(group) -> dict[str, Any] | None:
            for p in group["params"]:
                saved = ckpt.saved_name(canonical_name(pm, names[id(p)]), loaded_hyper)
                if saved is not None:
                    return {k: v for k, v in loaded_hyper[saved].items() if k not in _KERNEL_FLAGS and k != "params"}
            return None

        for sd_group, group in zip(sd["param_groups"], inner.param_groups):
            sd_group.update(saved_group(group) or {})
        inner.load_state_dict(sd)
        if optimizer is not inner:  # ZeRO copies the outer groups' hyperparameters into its shard each step
            for group in optimizer.param_groups:
                group.update(saved_group(group) or {})

    if per_rank:
        rng = per_rank[rank_key(rank)]["rng"]
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return ckpt.step
