"""Checkpoints of a pipelined run under the model's own parameter names (see docs/reliability.md).

Format (plain per-rank `torch.save` files plus a JSON manifest; not torch.distributed.checkpoint):

    DIR/step-000123/manifest.json        written LAST, by rank 0, after every rank's file is durable
    DIR/step-000123/rank-00000.pt        {"params": {name: tensor}, "optimizer": {"state": {name: {...}},
    DIR/step-000123/rank-00001.pt         "param_groups": [...]}, "aliases": {...}, "rng": ..., "step": 123}

Each rank serializes its stages' parameters (and persistent buffers) and its AdamW state keyed by
the parameter's *name* in the model, never by optimizer index. Only ranks with dp index 0 (and
tp index 0) write: the other replicas hold identical copies. Under ZeRO (a ZeroRedundancyOptimizer)
every replica also writes the optimizer state of its shard, and replica 0 the parameters; loading
merges the files by name, so the shards need not line up with the reader's. Tensor-parallel shards
(DTensors) are gathered whole before writing and sliced again on restore, so files hold whole
tensors and a tp = 2 checkpoint loads under tp = 1 or 4. So a checkpoint saved under one plan
loads under any other plan of the same model (pp = 2 -> pp = 4, other cuts) and into a plain
single-process model (`load_full_state_dict`).

Atomicity: rank 0 creates `DIR/.tmp-step-000123/`; every writer writes `rank-R.pt.tmp`, fsyncs it and
renames it to `rank-R.pt`; a barrier; rank 0 writes `manifest.json` the same way (with every file's
size), renames the directory to `step-000123` and fsyncs DIR; a last barrier. A checkpoint is
*complete* when its directory is named `step-*` and its manifest parses and lists files that exist
with the recorded sizes; anything else (a `.tmp-*` directory, a missing manifest, a short file) is
ignored by `latest_checkpoint`, so a crash in the middle of a save leaves the previous complete
checkpoint as the newest one. DIR must be visible to every rank (one node, or a shared filesystem).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHECKPOINT_FORMAT",
    "Checkpoint",
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_full_optimizer_state",
    "load_full_state_dict",
    "restore",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = "autoplan-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """No usable checkpoint, or one that does not fit the model (one-line message)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


# ---- durable writes --------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, *, kill_midway: bool = False) -> None:
    """Write `data` to `path.tmp`, fsync, rename over `path`, fsync the directory.

    `kill_midway` (tests of crash safety) SIGKILLs this process after half the bytes are on disk.
    """
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if kill_midway:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ---- what one rank holds -----------------------------------------------------------------------


def _param_names(pm) -> dict[int, str]:
    return {id(p): name for name, p in pm.named_parameters()}


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state: a ZeroRedundancyOptimizer's local shard (ZeRO), or
    the optimizer itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _is_sharded(optimizer: torch.optim.Optimizer | None) -> bool:
    return optimizer is not None and local_optimizer(optimizer) is not optimizer


def named_optimizer_state(pm, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name: {"state": {name: {...}}, "param_groups": [...]}.

    Of a ZeRO optimizer, this rank's shard: the files of all dp ranks together hold the whole."""
    optimizer = local_optimizer(optimizer)
    names = _param_names(pm)
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        group_names = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                raise CheckpointError("the optimizer holds a parameter the partitioned model does not name")
            group_names.append(name)
            if p in optimizer.state:
                state[name] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in optimizer.state[p].items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    return {"state": state, "param_groups": groups}


def _whole(value: Any) -> Any:
    """A tensor-parallel shard (DTensor) gathered whole on the CPU (a collective over its tp group:
    every tp rank calls it in the same order); any other tensor copied to the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _rank_payload(pm, optimizer, step: int, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """This rank's file. Called on every rank: tensor-parallel shards are gathered whole (so a
    checkpoint holds whole tensors under model names and loads under any tp), and only writers
    write the result."""
    params = {name: _whole(t) for name, t in pm.state_dict().items()}
    opt = None
    if optimizer is not None:
        opt = named_optimizer_state(pm, optimizer)
        opt["state"] = {name: {k: _whole(v) for k, v in state.items()} for name, state in opt["state"].items()}
    return {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        # A ZeRO shard writer of dp index > 0 adds its optimizer shard only: replica 0 has the params.
        "params": params if _dp_index(pm) == 0 else {},
        "optimizer": opt,
        "aliases": dict(getattr(pm, "aliases", {})),
        "rng": {"torch": torch.get_rng_state()},
        "extra": dict(extra or {}),
    }


def _dp_index(pm) -> int:
    return getattr(getattr(pm, "layout", None), "dp_index", 0)


def _is_writer(pm, optimizer: torch.optim.Optimizer | None = None) -> bool:
    """Replica 0 writes (tp index 0); under ZeRO every replica writes its optimizer shard."""
    layout = getattr(pm, "layout", None)
    return layout is None or ((_dp_index(pm) == 0 or _is_sharded(optimizer)) and getattr(layout, "tp_index", 0) == 0)


def _barrier(timeout: timedelta) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "gloo":
        # Names the rank that did not arrive (on rank 0), instead of a bare timeout.
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    else:
        dist.barrier()


# ---- save --------------------------------------------------------------------------------------


def save_checkpoint(directory: str | os.PathLike, step: int, pm, optimizer: torch.optim.Optimizer | None = None, *,
                    extra: Mapping[str, Any] | None = None, timeout: timedelta = timedelta(seconds=60),
                    _kill_midway: bool = False) -> Path:
    """Save this rank's part of the model and optimizer as checkpoint `step` (steps completed).

    Collective: every rank of the default process group calls it (a single process works too).
    Returns the final directory `DIR/step-NNNNNN`. `extra` is stored in every rank file and the
    manifest (JSON-able values). `_kill_midway` SIGKILLs this rank halfway through its file.
    """
    import torch.distributed as dist

    root = Path(directory)
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    name = step_dir_name(step)
    final = root / name
    tmp = root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # an interrupted save of this or an earlier run
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier(timeout)
    buf = io.BytesIO()
    writer = _is_writer(pm, optimizer)
    # A tp shard is gathered by a collective every rank of its tp group joins, writer or not.
    if writer or getattr(getattr(pm, "plan", None), "tp", 1) > 1:
        payload = _rank_payload(pm, optimizer, step, extra)
    if writer:
        torch.save(payload, buf)
        _atomic_write(tmp / rank_file_name(rank), buf.getvalue(), kill_midway=_kill_midway)
    _barrier(timeout)
    if rank == 0:
        files = {p.name: p.stat().st_size for p in sorted(tmp.glob("rank-*.pt"))}
        manifest = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": world_size, "files": files,
                    "time": time.time(), "extra": dict(extra or {})}
        _atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        if final.exists():  # saving the same step again: swap, never leave no complete copy behind
            old = root / f".tmp-old-{name}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
    _barrier(timeout)
    return final


# ---- find and read -------------------------------------------------------------------------------


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint directory, else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not files or not isinstance(manifest.get("step"), int):
        return None
    for fname, size in files.items():
        try:
            if (path / fname).stat().st_size != size:
                return None
        except OSError:
            return None
    return manifest


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            manifest = _read_manifest(entry)
            if manifest is not None and manifest["step"] == int(match.group(1)):
                found.append((manifest["step"], entry))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `directory` (incomplete ones ignored), or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def _resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory itself, or the newest complete one under a root directory."""
    path = Path(path)
    if _read_manifest(path) is not None:
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"no complete checkpoint in {str(path)!r} (a directory step-N/ with {MANIFEST})")
    return latest


@dataclass
class Checkpoint:
    """Every rank file of one checkpoint, merged by name."""

    path: Path
    step: int
    manifest: dict[str, Any]
    params: dict[str, torch.Tensor]
    """Parameters and persistent buffers under every name the model uses (tied aliases filled in)."""
    optimizer_state: dict[str, dict[str, Any]]
    """Per-parameter optimizer state (AdamW: step, exp_avg, exp_avg_sq) by name."""
    param_groups: list[dict[str, Any]]
    """Hyperparameters of the optimizer's groups (of the first rank file; "params" removed)."""
    aliases: dict[str, str]
    rng: dict[int, Any]
    """Rank -> its saved RNG states."""

    def lookup(self, name: str, table: Mapping[str, Any] | None = None) -> Any:
        table = self.params if table is None else table
        if name in table:
            return table[name]
        canonical = self.aliases.get(name)
        if canonical is not None and canonical in table:
            return table[canonical]
        for other, c in self.aliases.items():  # `name` is canonical here, saved under an alias
            if c == name and other in table:
                return table[other]
        return None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint (a `step-N` directory, or the newest complete one under a root)."""
    path = _resolve(path)
    manifest = _read_manifest(path)
    assert manifest is not None
    params: dict[str, torch.Tensor] = {}
    opt_state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    aliases: dict[str, str] = {}
    rng: dict[int, Any] = {}
    for fname in sorted(manifest["files"]):
        try:
            payload = torch.load(path / fname, map_location="cpu", weights_only=True)
        except Exception as exc:  # a corrupt file in a directory whose manifest says complete
            raise CheckpointError(f"cannot read {str(path / fname)!r}: {type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
        params.update(payload["params"])
        aliases.update(payload.get("aliases") or {})
        optimizer = payload.get("optimizer")
        if optimizer:
            opt_state.update(optimizer["state"])
            if not groups:
                groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
        match = re.match(r"rank-(\d+)\.pt$", fname)
        if match:
            rng[int(match.group(1))] = payload.get("rng")
    for name, canonical in aliases.items():  # a plain model's state_dict names every tied alias
        if name not in params and canonical in params:
            params[name] = params[canonical]
    return Checkpoint(path, manifest["step"], manifest, params, opt_state, groups, aliases, rng)


def load_full_state_dict(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every rank's parameters merged into one full-model state dict (CPU tensors).

    `checkpoint_dir` is a `step-N` directory or a root holding several (the newest complete one is
    read). The result loads into the plain model: `model.load_state_dict(load_full_state_dict(d))`.
    """
    return load_checkpoint(checkpoint_dir).params


def load_full_optimizer_state(checkpoint_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Every rank's optimizer state merged, by parameter name."""
    return load_checkpoint(checkpoint_dir).optimizer_state


# ---- restore into a (differently) partitioned model ---------------------------------------------


@torch.no_grad()
def restore(ckpt: Checkpoint, pm, optimizer: torch.optim.Optimizer | None = None, *, strict: bool = True,
            restore_rng: bool = True, rank: int | None = None) -> int:
    """Load `ckpt` into this rank's `PartitionedModel` (any plan of the same model) and optimizer.

    Uses only `pm`'s public `state_dict` / `load_state_dict` / `named_parameters`. Returns the
    checkpoint's step (the number of steps completed). With `strict`, a local parameter or its
    optimizer state missing from the checkpoint raises CheckpointError.
    """
    missing = pm.load_state_dict(ckpt.params, strict=False)
    if strict and missing:
        raise CheckpointError(f"checkpoint {str(ckpt.path)!r} has no entry for {len(missing)} parameters of this "
                              f"rank, e.g. {missing[0]!r}; is it of another model?")
    local = dict(pm.state_dict())
    for name, tensor in local.items():
        source = ckpt.lookup(name)
        if source is not None and tuple(source.shape) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint entry {name!r} has shape {tuple(source.shape)}, the model "
                                  f"{tuple(tensor.shape)}; is it of another model?")
    if optimizer is not None:
        optimizer = local_optimizer(optimizer)  # under ZeRO: the shard this rank steps, found by name
        sd = optimizer.state_dict()
        names = _param_names(pm)
        index = 0
        state: dict[int, Any] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                source = ckpt.lookup(name, ckpt.optimizer_state)
                if source is None:
                    if strict and ckpt.optimizer_state:
                        raise CheckpointError(f"checkpoint {str(ckpt.path)!r} has no optimizer state for {name!r}")
                else:
                    state[index] = {k: _like_param(p, v) for k, v in source.items()}
                index += 1
        sd["state"] = state
        if len(ckpt.param_groups) == len(sd["param_groups"]):
            sd["param_groups"] = [{**saved, "params": g["params"]}
                                  for saved, g in zip(ckpt.param_groups, sd["param_groups"])]
        optimizer.load_state_dict(sd)
    if restore_rng and rank is not None and ckpt.manifest.get("world_size") is not None:
        saved = ckpt.rng.get(rank)
        if saved and "torch" in saved:
            torch.set_rng_state(saved["torch"])
    return ckpt.step


def _like_param(param: torch.Tensor, value: Any) -> Any:
    """A whole optimizer-state tensor from a checkpoint, as this rank's piece of `param`'s state: a
    tensor of the parameter's shape becomes a DTensor laid out as a sharded parameter (each rank
    keeps its own slice; no communication); anything else is copied as is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(param, DTensor) and tuple(value.shape) == tuple(param.shape):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value.clone()


def iter_rank_files(path: str | os.PathLike) -> Iterator[Path]:
    path = _resolve(path)
    manifest = _read_manifest(path) or {}
    for fname in sorted(manifest.get("files", {})):
        yield path / fname

