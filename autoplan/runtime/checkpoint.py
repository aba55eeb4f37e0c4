"""Checkpoints through torch.distributed.checkpoint (DCP), atomic, under the model's own names
(docs/reliability.md).

Format "autoplan-checkpoint/2": a DCP checkpoint plus our manifest, in one directory per step.

    DIR/step-000123/__0_0.distcp, __1_0.distcp, ...   DCP data (one file per rank)
    DIR/step-000123/.metadata                         DCP metadata (every key's shape, chunks, files)
    DIR/step-000123/manifest.json                     ours, written LAST by rank 0: format, step,
                                                      every file's size and sha256, model
                                                      fingerprint, layout

The DCP state dict (keys as torchtitan writes them: model FQNs at the top level, the optimizer as
torch's `flatten_optimizer_state_dict` under "optimizer"):

    {fqn: tensor}                                      parameters and persistent buffers; a tied
                                                       parameter once, under its first name
    "optimizer": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq", ...}},
                  "param_groups": {fqn: {"lr", "betas", "weight_decay", ...}}}
    "autoplan": {"rank-00003": {"rng": {"torch": ...}, "extra": "<json>"}}   per-rank extras

Sharded tensors (tensor-parallel DTensors, FSDP2 shards) are saved as their shards, replicated
tensors once (DCP deduplicates a key every replica writes); the optimizer state is keyed by the
parameter's name, never by index, and a ZeRO-1 optimizer's owners (runtime/optimizer.py) each
write the states of the parameters they step, and in a bf16 plan their fp32 masters too (the other
dp ranks hold no fp32 values of those, runtime/precision.py `release_masters`; a restore rounds the
saved fp32 values into such a parameter's bf16 working copy, without a collective). Loading reads exactly the chunks a tensor needs (DCP reshards), so a
checkpoint saved under one plan loads under any other plan of the same model (pp, tp, dp, ZeRO
level, cuts) and into a plain single-process model (`load_full_state_dict`, `export_torch_save`).

Atomicity: rank 0 creates `DIR/.tmp-step-000123/`; `dcp.save` writes and fsyncs every rank's data
file, then rank 0 writes `.metadata` (DCP's own tmp-and-rename) once every rank has written; rank 0
then writes `manifest.json` (tmp, fsync, rename) with every file's size and sha256 ([Note:
checkpoint checksums]), renames the directory to `step-000123` and fsyncs DIR; a last barrier. A
checkpoint is *complete* when its directory is named `step-*` and holds a manifest; a directory
without one (a `.tmp-*` directory, a save that died before its manifest) is what a crash leaves and
is ignored, so a crash in the middle of a save leaves the previous checkpoint as the newest one. A
complete checkpoint is *damaged* when `verify_checkpoint` finds a reason (the manifest does not
parse, names a file outside the directory, a file's size or sha256 differs, ...):
`choose_checkpoint` / `latest_checkpoint` skip it (and say why) for the newest one that verifies,
and `load_checkpoint` refuses it. DIR must be visible to every rank (one node, or a shared
filesystem).

[Note: why not get_state_dict] torch's `get_state_dict` / `set_state_dict` want one nn.Module whose
parameters the optimizer steps. Here a bf16 plan's optimizer steps fp32 masters that are not the
stage modules' parameters (precision.py), a tied parameter has one copy per pipeline rank under
different names, and a ZeRO-1 optimizer holds only its shard in an inner optimizer that
`get_optimizer_state_dict` does not know. So the FQN-keyed state dicts are built here from
`PartitionedModel.named_parameters` / `state_dict` (the names of the full model) in the layout
`get_state_dict(..., flatten_optimizer_state_dict=True)` produces, and loaded in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import time
import warnings
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
    "checkpoint_fingerprint",
    "choose_checkpoint",
    "export_torch_save",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_full_optimizer_state",
    "load_full_state_dict",
    "local_optimizer",
    "other_format_checkpoints",
    "named_optimizer_state",
    "restore",
    "save_checkpoint",
    "verify_checkpoint",
]

CHECKPOINT_FORMAT = "autoplan-checkpoint/2"
MANIFEST = "manifest.json"
OPTIMIZER_KEY = "optimizer"
EXTRA_KEY = "autoplan"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_KERNEL_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Optimizer group entries that pick a kernel, not the math: the reader's own choice is kept."""


class CheckpointError(ValueError):
    """No usable checkpoint, or one that does not fit the model (one-line message)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _rank_key(rank: int) -> str:
    return f"rank-{rank:05d}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


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


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path.tmp`, fsync, rename over `path`, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class _KillingStream:
    """A file stream that SIGKILLs this process once `limit` bytes are on disk (fault injection)."""

    def __init__(self, stream, limit: int):
        self._stream, self._limit, self._written = stream, limit, 0

    def write(self, data) -> int:
        n = self._stream.write(data)
        self._written += len(memoryview(data).cast("B"))
        if self._written >= self._limit:
            _die(self._stream)
        return n

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _die(stream) -> None:
    stream.flush()
    os.fsync(stream.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _data_filesystem(kill_after_bytes: int | None = None):
    """DCP's FileSystem, recording the data files this rank writes (`written`: hashed after the
    save, [Note: checkpoint checksums]). With `kill_after_bytes`, a data file SIGKILLs this process
    after that many bytes (or, if the file ends sooner, before it is closed): `kill-in-checkpoint`
    in launch.py."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class DataFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.written: list[Path] = []

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with super().create_stream(path, mode) as stream:
                if "w" not in mode or not str(path).endswith(".distcp"):
                    yield stream
                    return
                self.written.append(Path(path))
                if kill_after_bytes is None:
                    yield stream
                    return
                yield _KillingStream(stream, kill_after_bytes)
                _die(stream)

    return DataFileSystem()


# ---- what one rank holds -----------------------------------------------------------------------


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


# ---- shards DCP cannot describe as one chunk -------------------------------------------------------

# [Note: strided shards in DCP]
# DCP describes a rank's piece of a DTensor as one box (offsets, sizes) of the global tensor. A
# fused q/k/v projection sharded by thirds (`_StridedShard(dim, split_factor=3)`, [Note: fused
# q/k/v] in parallel.py) holds [q_r | k_r | v_r]: three boxes, which `dcp.save` rejects ("overlapping
# chunks"). Such a DTensor goes to DCP as `_Pieces`: its local boxes (found without communication
# by sharding an index vector per dimension as the tensor is sharded) as views of the local tensor;
# `_SavePlanner` writes each as a chunk of the global tensor and `_LoadPlanner` reads into each view
# in place. The checkpoint holds the tensor under its own name and shape, as any other.


@dataclass
class _Pieces:
    shape: torch.Size
    tensor: torch.Tensor  # the local tensor
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]  # (global offsets, sizes, local view)


def _needs_pieces(value: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements)


def _pieces(value) -> _Pieces:
    """The local boxes of a DTensor ([Note: strided shards in DCP])."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    local = value.to_local()
    runs_per_dim = []
    for d in range(value.dim()):
        placements = [p if isinstance(p, Shard | _StridedShard) and p.dim == d else Replicate()
                      for p in value.placements]
        shape = [1] * value.dim()
        shape[d] = value.shape[d]
        index = torch.arange(value.shape[d], device=local.device).view(shape)
        mine = distribute_tensor(index, value.device_mesh, placements, src_data_rank=None).to_local().flatten().tolist()
        runs = []  # (local start, global start, length)
        for j, g in enumerate(mine):
            if runs and g == runs[-1][1] + runs[-1][2] and j == runs[-1][0] + runs[-1][2]:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((j, g, 1))
        runs_per_dim.append(runs)
    boxes = []
    for combo in itertools.product(*runs_per_dim):
        view = local
        for d, (start, _, length) in enumerate(combo):
            view = view.narrow(d, start, length)
        boxes.append((tuple(g for _, g, _ in combo), tuple(n for _, _, n in combo), view))
    return _Pieces(value.shape, local, boxes)


def _with_pieces(tree: Any) -> Any:
    """`tree` with every DTensor DCP cannot describe replaced by its `_Pieces`."""
    if isinstance(tree, Mapping):
        return {k: _with_pieces(v) for k, v in tree.items()}
    return _pieces(tree) if _needs_pieces(tree) else tree


class _Placeholder(str):
    """Where a `_Pieces` was: a value DCP's set-up keeps as it is (it sets what it does not know
    to None) and flattens to the same key."""


def _take_pieces(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[str, _Pieces]:
    """Replace every `_Pieces` in `tree` by a `_Placeholder`; {its DCP key (the path joined by dots,
    as DCP's `flatten_state_dict` names it): it}."""
    found: dict[str, _Pieces] = {}
    for key, value in tree.items():
        if isinstance(value, _Pieces):
            found[".".join((*prefix, str(key)))] = value
            tree[key] = _Placeholder()
        elif isinstance(value, dict):
            found.update(_take_pieces(value, (*prefix, str(key))))
    return found


def _save_planner():
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class SavePlanner(DefaultSavePlanner):
        """DCP's default planner, plus `_Pieces` written box by box."""

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            self.pieces = _take_pieces(state_dict)
            super().set_up_planner(state_dict, storage_meta, is_coordinator)  # their keys stay in the mappings
            self.state_dict = {k: v for k, v in self.state_dict.items() if k not in self.pieces}

        def create_local_plan(self):
            plan = super().create_local_plan()
            items = [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(
                                   chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                                   properties=TensorProperties.create_from_tensor(pieces.tensor),
                                   size=torch.Size(pieces.shape)))
                     for fqn, pieces in self.pieces.items() for offsets, sizes, _ in pieces.boxes]
            self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
            return self.plan

        def resolve_data(self, write_item):
            pieces = self.pieces.get(write_item.index.fqn)
            if pieces is None:
                return super().resolve_data(write_item)
            offsets = tuple(write_item.index.offset)
            view = next(v for o, _, v in pieces.boxes if o == offsets)
            return view.detach().clone()  # a view would save its whole storage

    return SavePlanner()


def _load_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class LoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, plus `_Pieces` read box by box into views of the local tensor."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.pieces = _take_pieces(state_dict)
            super().set_up_planner(state_dict, metadata, is_coordinator)
            self.state_dict = {k: v for k, v in self.state_dict.items() if k not in self.pieces}

        def create_local_plan(self):
            # DCP's own planner, less its fallback for checkpoints of torch <= 2.3 (it re-flattens the
            # state dict, `_Pieces` included, when a key is missing; ours name every key they read).
            plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
            items = []
            for fqn, pieces in self.pieces.items():
                chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in pieces.boxes]
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
            return dataclasses.replace(plan, items=[*plan.items, *items])

        def resolve_tensor(self, read_item):
            pieces = self.pieces.get(read_item.dest_index.fqn)
            if pieces is None:
                return super().resolve_tensor(read_item)
            view = pieces.boxes[read_item.dest_index.index][2]
            for d, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                view = view.narrow(d, start, length)
            return view

    return LoadPlanner()


# ---- save --------------------------------------------------------------------------------------


def _barrier(timeout: timedelta) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "gloo":
        # Names the rank that did not arrive (on rank 0), instead of a bare timeout.
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    else:
        dist.barrier()


def _layout_of(pm) -> dict[str, Any]:
    """The plan's layout, for messages (a checkpoint loads under any layout)."""
    plan = getattr(pm, "plan", None)
    if plan is None:
        return {}
    out = {k: getattr(plan, k) for k in ("pp", "dp", "tp", "zero", "virtual_stages", "dp_replicate")
           if isinstance(getattr(plan, k, None), int)}
    out["stage_end_blocks"] = [s.end_block for s in plan.stages]
    out["dtype"] = plan.job.dtype
    return out


EXPERT_PARALLEL_REFUSAL = (
    "checkpoints of a plan with ep {ep} are not supported yet: each rank holds a slice of the experts under the "
    "same names, which torch.distributed.checkpoint would store once; run without --checkpoint-dir or re-plan "
    "with --ep 1")


def save_checkpoint(directory: str | os.PathLike, step: int, pm, optimizer: torch.optim.Optimizer | None = None, *,
                    extra: Mapping[str, Any] | None = None, timeout: timedelta = timedelta(seconds=60),
                    _kill_midway: bool = False) -> Path:
    """Save this rank's part of the model and optimizer as checkpoint `step` (steps completed).

    Collective: every rank of the default process group calls it (a single process works too, with
    or without a process group). Returns the final directory `DIR/step-NNNNNN`. `extra` (JSON-able
    values) is stored in the manifest and with this rank's state. `_kill_midway` SIGKILLs this rank
    halfway through its DCP data file.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if getattr(getattr(pm, "plan", None), "ep", 1) > 1:
        raise ValueError(EXPERT_PARALLEL_REFUSAL.format(ep=pm.plan.ep))
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
    state = _with_pieces(_rank_state(pm, optimizer, rank, step, extra))
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
    kill_after_bytes = None
    if _kill_midway:
        kill_after_bytes = max(1, sum(t.numel() * t.element_size() for t in _tensors(state)) // 2)
    writer.fs = _data_filesystem(kill_after_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ..." in a single process
        dcp.save(state, storage_writer=writer, planner=_save_planner())
    # dcp.save returned: every rank's data file and the metadata are durable.
    files = _gather_to_rank0({p.name: _file_entry(p) for p in writer.fs.written})
    if rank == 0:
        _fsync_dir(tmp)
        for p in sorted(tmp.iterdir()):  # `.metadata` (rank 0 wrote it), and any file no rank reported
            if p.name != MANIFEST and p.name not in files:
                files[p.name] = _file_entry(p)
        files = dict(sorted(files.items()))
        plan = getattr(pm, "plan", None)
        manifest = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": world_size, "files": files,
                    "time": time.time(), "model_fingerprint": getattr(plan, "model_fingerprint", None),
                    "model": getattr(plan, "model", None), "layout": _layout_of(pm),
                    "aliases": dict(getattr(pm, "aliases", {})), "extra": dict(extra or {})}
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


def _gather_to_rank0(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """On rank 0, every rank's `entries` merged (elsewhere {})."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(entries)
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(entries, gathered, dst=0)
    return {name: entry for part in gathered or [] for name, entry in part.items()}


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    if isinstance(tree, Mapping):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, _Pieces):
        yield tree.tensor
    elif isinstance(tree, DTensor):
        yield tree.to_local()
    elif isinstance(tree, torch.Tensor):
        yield tree


# ---- integrity -----------------------------------------------------------------------------------

# [Note: checkpoint checksums]
# The manifest records every file's size and sha256: `"files": {"__0_0.distcp": {"size": 123,
# "sha256": "9f86..."}, ".metadata": {...}}`. sha256 rather than zlib.crc32: hashlib's sha256 runs on
# the SHA extensions of current x86 CPUs, 1.5 GB/s against crc32's 2.2 GB/s (256 MiB in memory, a
# 2-core x86 VM), so the read costs more than either; `sha256sum FILE` checks a file by hand; and no
# damaged or swapped file matches by chance (a 32-bit crc misses one random damage in 4e9).
# Who hashes: each rank the data file it wrote, right after `dcp.save` fsynced it (a re-read, from
# the page cache, of 1/world-size of the checkpoint per rank, in parallel: about 0.7 s per GB of a
# rank's file, added to each save), and rank 0 `.metadata`; one gather_object (the collective
# `dcp.save` itself uses) brings the digests to rank 0, which writes the manifest. Verifying reads the
# whole checkpoint once: `choose_checkpoint` does it for the checkpoints it tries (newest first, up
# to the first that verifies), `load_checkpoint` for a path it is given (`checksums=False` where the
# caller has just verified it, as each rank of a resume after rank 0 chose).

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_entry(path: Path) -> dict[str, Any]:
    """What the manifest records of one file ([Note: checkpoint checksums])."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


class _Damaged(Exception):
    """Why a checkpoint directory cannot be used (one line naming the file)."""


def _parse_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, of the expected shape: format 2, a step count, a
    size and sha256 for every file (`.metadata` among them), a model fingerprint entry."""
    try:
        text = (path / MANIFEST).read_bytes()
    except OSError as exc:
        raise _Damaged(f"cannot read {MANIFEST} ({_one_line(exc)})") from None
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise _Damaged(f"{MANIFEST} does not parse ({_one_line(exc)})") from None
    if not isinstance(manifest, dict):
        raise _Damaged(f"{MANIFEST} is not a JSON object")
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise _Damaged(f"{MANIFEST} is of format {manifest.get('format')!r}; this version reads {CHECKPOINT_FORMAT}")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _Damaged(f"{MANIFEST} records step {step!r}, not a count of steps")
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise _Damaged(f"{MANIFEST} does not list .metadata (DCP's metadata) among its files")
    for name, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if (not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str)
                or not _SHA256.fullmatch(digest)):
            raise _Damaged(f"{MANIFEST} records no size and sha256 of {name!r} (saved before checksums?)")
    if "model_fingerprint" not in manifest:  # save_checkpoint writes the entry, null without a plan
        raise _Damaged(f"{MANIFEST} records no model fingerprint")
    return manifest


def _check_name(name: str) -> None:
    """A manifest names files of its own directory only: plain names, no path."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        raise _Damaged(f"{MANIFEST} names {name!r}, not a file of the checkpoint's own directory")


def _check_files(path: Path, manifest: Mapping[str, Any]) -> None:
    """Every file the manifest lists is a regular file in `path` with the recorded size (stat only:
    no data is read)."""
    match = _STEP_DIR.match(path.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise _Damaged(f"{MANIFEST} records step {manifest['step']}, the directory's name step {int(match.group(1))}")
    home = path.resolve()
    for name, entry in manifest["files"].items():
        _check_name(name)
        file = path / name
        if file.resolve().parent != home:
            raise _Damaged(f"{name} is a link to {str(file.resolve())!r}, outside the checkpoint's directory")
        try:
            st = file.stat()
        except FileNotFoundError:
            raise _Damaged(f"{name} is missing") from None
        except OSError as exc:
            raise _Damaged(f"{name} does not stat ({_one_line(exc)})") from None
        if not stat.S_ISREG(st.st_mode):
            raise _Damaged(f"{name} is not a regular file")
        if st.st_size != entry["size"]:
            raise _Damaged(f"{name} has {st.st_size} bytes, {MANIFEST} records {entry['size']}")


def _check_structure(path: Path) -> dict[str, Any]:
    """The manifest of `path` once it and the files' names, sizes and step check (no data read)."""
    manifest = _parse_manifest(path)
    _check_files(path, manifest)
    return manifest


def _check_checksums(path: Path, manifest: Mapping[str, Any]) -> None:
    """Every listed file's sha256 is the recorded one (reads every file once)."""
    for name in sorted(manifest["files"], key=lambda n: n != ".metadata"):  # .metadata first: it is unpickled next
        if _sha256(path / name) != manifest["files"][name]["sha256"]:
            raise _Damaged(f"{name} does not match its sha256 in {MANIFEST} (one of them changed after the save)")


def _read_metadata(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise _Damaged(f"DCP's .metadata does not read ({_one_line(exc)})") from None


def _check_needed_files(metadata: Any, manifest: Mapping[str, Any]) -> None:
    """Every file DCP's metadata reads from is one the manifest lists (and so was checked)."""
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name not in manifest["files"]:
            raise _Damaged(f"DCP's .metadata reads from {name!r}, a file {MANIFEST} does not list")


def _check_saved_steps(checkpoint: Checkpoint) -> None:
    """Each rank's own record of the step (its `autoplan.rank-R` extra, inside its data file) is the
    manifest's: a manifest over another checkpoint's files is refused (a few bytes read per rank)."""
    keys = {r: entries[("extra",)] for r, entries in checkpoint.rank_keys.items() if ("extra",) in entries}
    try:
        extras = checkpoint._load_flat(keys)
    except CheckpointError as exc:
        raise _Damaged(f"the ranks' records of their step do not read ({_one_line(_cause(exc.__cause__ or exc))})") from None
    for rank, text in sorted(extras.items()):
        try:
            step = json.loads(text).get("step")
        except (TypeError, ValueError, AttributeError):
            step = None
        if step != checkpoint.step:
            raise _Damaged(f"rank {rank}'s data records step {step}, {MANIFEST} step {checkpoint.step} "
                           f"(the files of another checkpoint?)")


def _open(path: Path, *, checksums: bool) -> Checkpoint:
    """The checkpoint at `path` once every check of `verify_checkpoint` passes, else _Damaged."""
    manifest = _check_structure(path)
    if checksums:
        _check_checksums(path, manifest)
    metadata = _read_metadata(path)
    _check_needed_files(metadata, manifest)
    try:
        checkpoint = Checkpoint(path, manifest["step"], manifest, metadata)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # checksums=False and a crafted .metadata
        raise _Damaged(f"DCP's .metadata holds keys autoplan did not write ({_one_line(exc)})") from None
    _check_saved_steps(checkpoint)
    return checkpoint


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """Why the checkpoint directory `path` is damaged (one line naming the file), or None if it
    verifies: its manifest parses, is of format 2 and records a model fingerprint; it names plain
    files of `path` only (no `/`, `..`, absolute path, or link out of it), each present with its
    recorded size and (with `checksums`: reads every file) sha256; DCP's metadata reads from those
    files only; the manifest's step is the directory name's and every rank's own record of it."""
    try:
        _open(Path(path), checksums=checksums)
    except _Damaged as exc:
        return str(exc)
    return None


# ---- find and read -------------------------------------------------------------------------------


def _step_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step in the name, path) of every `step-N` directory under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `directory` whose manifest, file names,
    sizes and step check, oldest first (no data read: `choose_checkpoint` checks the sha256s)."""
    found = []
    for step, entry in _step_dirs(directory):
        try:
            _check_structure(entry)
        except _Damaged:
            continue
        found.append((step, entry))
    return found


def choose_checkpoint(directory: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `directory` that verifies (`verify_checkpoint`), or None; and
    (path, reason) of each newer one that does not, newest first.

    A `step-N` directory without a manifest (a save that did not finish) is skipped silently, as
    `.tmp-*` directories are. Reads the files of the checkpoints it tries, newest first, up to the
    first that verifies; older ones are not read."""
    skipped: list[tuple[Path, str]] = []
    for _, entry in reversed(_step_dirs(directory)):
        if not os.path.lexists(entry / MANIFEST):
            continue
        reason = verify_checkpoint(entry)
        if reason is None:
            return entry, skipped
        skipped.append((entry, reason))
    return None, skipped


def latest_checkpoint(directory: str | os.PathLike, skipped: list[tuple[Path, str]] | None = None) -> Path | None:
    """The newest checkpoint under `directory` that verifies, or None (`choose_checkpoint`);
    (path, reason) of each newer damaged one is appended to `skipped`."""
    chosen, damaged = choose_checkpoint(directory)
    if skipped is not None:
        skipped.extend(damaged)
    return chosen


def other_format_checkpoints(directory: str | os.PathLike) -> list[tuple[Path, str]]:
    """(path, format) of the `step-N` directories under `directory` (or `directory` itself) whose
    manifest names another format (format 1: per-rank torch.save files, before DCP)."""
    root = Path(directory)
    candidates = [root] + (sorted(e for e in root.iterdir() if _STEP_DIR.match(e.name)) if root.is_dir() else [])
    found = []
    for entry in candidates:
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("format") not in (None, CHECKPOINT_FORMAT):
            found.append((entry, str(manifest.get("format"))))
    return found


def _open_or_refuse(path: Path, *, checksums: bool) -> Checkpoint:
    try:
        return _open(path, checksums=checksums)
    except _Damaged as exc:
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {exc}; resume from an older checkpoint "
                              f"(move this one away) or save it again") from None


def _refuse_empty(root: Path, skipped: list[tuple[Path, str]]) -> None:
    """No checkpoint under `root` verifies: say why in one line."""
    other = other_format_checkpoints(root)
    if other:
        raise CheckpointError(f"{str(other[-1][0])!r} is a checkpoint of format {other[-1][1]}; this version reads "
                              f"{CHECKPOINT_FORMAT} (torch.distributed.checkpoint) only")
    if skipped:
        newest, reason = skipped[0]
        raise CheckpointError(f"no usable checkpoint in {str(root)!r}: {len(skipped)} damaged, the newest "
                              f"{newest.name}: {reason}; restore them from a copy or move them away")
    raise CheckpointError(f"no complete checkpoint in {str(root)!r} (a directory step-N/ with {MANIFEST})")


def _dcp_load(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` (tensors in place, other values replaced) from the checkpoint at `path`, in this
    process alone: a rank reads the chunks its tensors cover, no collective (so `restore` and the
    full loads run on any subset of ranks, or without a process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tree = _with_pieces(state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ..."
            dcp.load(tree, storage_reader=dcp.FileSystemReader(path), planner=_load_planner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # a corrupt file in a directory whose manifest says complete
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {_one_line(_cause(exc))}") from exc
    _merge_back(state, tree)


def _cause(exc: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (a BaseException holding each rank's failure)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        first = next(iter(failures.values()))  # (exception, traceback) per failed rank
        first = first[0] if isinstance(first, tuple) and first else first
        if isinstance(first, BaseException):
            return first
    return exc


def _merge_back(state: dict[str, Any], tree: Mapping[str, Any]) -> None:
    """Values DCP replaced in `tree` (non-tensors) into `state`; tensors were loaded in place."""
    for key, value in tree.items():
        if isinstance(value, Mapping) and isinstance(state.get(key), dict):
            _merge_back(state[key], value)
        elif not isinstance(value, _Pieces | _Placeholder):  # those were loaded in place
            state[key] = value


@dataclass
class Checkpoint:
    """One complete checkpoint: its manifest and DCP metadata; tensors are read when asked for."""

    path: Path
    step: int
    manifest: dict[str, Any]
    metadata: Any
    """DCP's `Metadata`: every key's shape, dtype and chunks."""

    def __post_init__(self) -> None:
        self.aliases: dict[str, str] = dict(self.manifest.get("aliases") or {})
        """Every name of a tied parameter -> the name it is saved under."""
        self.model_keys: dict[str, Any] = {}
        """Saved parameter / buffer name -> its DCP storage metadata."""
        self.optimizer_keys: dict[str, dict[str, str]] = {}
        """Parameter name -> {state entry -> DCP key}."""
        self.hyperparameter_keys: dict[str, dict[str, str]] = {}
        """Parameter name -> {hyperparameter -> DCP key}."""
        self.rank_keys: dict[int, dict[tuple[str, ...], str]] = {}
        """Rank -> {path under "autoplan.rank-R" -> DCP key}."""
        paths = getattr(self.metadata, "planner_data", None) or {}
        for key, md in self.metadata.state_dict_metadata.items():
            path = tuple(paths.get(key, (key,)))
            if len(path) == 4 and path[0] == OPTIMIZER_KEY and path[1] == "state":
                self.optimizer_keys.setdefault(path[2], {})[path[3]] = key
            elif len(path) == 4 and path[0] == OPTIMIZER_KEY and path[1] == "param_groups":
                self.hyperparameter_keys.setdefault(path[2], {})[path[3]] = key
            elif len(path) >= 3 and path[0] == EXTRA_KEY and path[1].startswith("rank-"):
                self.rank_keys.setdefault(int(path[1][5:]), {})[path[2:]] = key
            elif len(path) == 1:
                self.model_keys[key] = md

    def saved_name(self, name: str, table: Mapping[str, Any]) -> str | None:
        """The key `name` (any name of a tied parameter) is saved under in `table`, or None."""
        if name in table:
            return name
        canonical = self.aliases.get(name)
        if canonical is not None and canonical in table:
            return canonical
        return next((other for other, c in self.aliases.items() if c == name and other in table), None)

    def lookup(self, name: str, table: Mapping[str, Any] | None = None) -> Any:
        table = self.params if table is None else table
        key = self.saved_name(name, table)
        return None if key is None else table[key]

    def _load_flat(self, keys: Mapping[str, str]) -> dict[str, Any]:
        """{label: value} of the DCP keys {label: key}, whole, in this process."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        state: dict[str, Any] = {}
        for key in keys.values():
            md = self.metadata.state_dict_metadata[key]
            state[key] = (torch.empty(md.size, dtype=md.properties.dtype)
                          if isinstance(md, TensorStorageMetadata) else None)
        # Keys are flat strings here: DCP's flattening maps each back to itself.
        _dcp_load(self.path, state)
        return {label: state[key] for label, key in keys.items()}

    @functools.cached_property
    def params(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers, whole, under every name the model uses (tied aliases
        filled in)."""
        params = self._load_flat({k: k for k in self.model_keys})
        for name, canonical in self.aliases.items():  # a plain model's state_dict names every tied alias
            if name not in params and canonical in params:
                params[name] = params[canonical]
        return params

    @functools.cached_property
    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """Per-parameter optimizer state (AdamW: step, exp_avg, exp_avg_sq), whole, by name."""
        out = self._load_by_name(self.optimizer_keys)
        for name, canonical in self.aliases.items():
            if name not in out and canonical in out:
                out[name] = out[canonical]
        return out

    @functools.cached_property
    def hyperparameters(self) -> dict[str, dict[str, Any]]:
        """Each parameter's optimizer group hyperparameters (lr, betas, ...), by name."""
        return self._load_by_name(self.hyperparameter_keys)

    def _load_by_name(self, keys: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, Any]]:
        """{parameter name: {entry: value}} for `keys` ({parameter name: {entry: DCP key}})."""
        flat = self._load_flat({(n, k): key for n, entries in keys.items() for k, key in entries.items()})
        out: dict[str, dict[str, Any]] = {}
        for (name, k), value in flat.items():
            out.setdefault(name, {})[k] = value
        return out

    @functools.cached_property
    def rank_state(self) -> dict[int, dict[str, Any]]:
        """Rank -> what it saved of its own: {"rng": {"torch": ByteTensor, ...}, "extra": {...}}."""
        flat = self._load_flat({(r, path): key for r, entries in self.rank_keys.items()
                                for path, key in entries.items()})
        out: dict[int, dict[str, Any]] = {}
        for (r, path), value in flat.items():
            node = out.setdefault(r, {})
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = json.loads(value) if path == ("extra",) else value
        return out

    @property
    def rng(self) -> dict[int, Any]:
        """Rank -> its saved RNG states."""
        return {r: s.get("rng") for r, s in self.rank_state.items()}


def load_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> Checkpoint:
    """Open a checkpoint (a `step-N` directory, or the newest one that verifies under a root): its
    manifest and DCP metadata; tensors are read by `restore` or on first use of `params` etc.

    A damaged checkpoint (`verify_checkpoint`; with `checksums`, every file is read once) is refused
    with a one-line CheckpointError before anything is loaded. Under a root, damaged newer ones are
    skipped with a warning each (`choose_checkpoint` names them)."""
    path = Path(path)
    if os.path.lexists(path / MANIFEST):  # a checkpoint directory itself
        return _open_or_refuse(path, checksums=checksums)
    chosen, skipped = choose_checkpoint(path)
    if chosen is None:
        _refuse_empty(path, skipped)
    for damaged, reason in skipped:
        warnings.warn(f"skipping checkpoint {str(damaged)!r}: {reason}", stacklevel=2)
    return _open_or_refuse(chosen, checksums=False)  # choose_checkpoint has just read every file


def load_full_state_dict(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model's state dict (CPU tensors), in one process (no process group needed).

    `checkpoint_dir` is a `step-N` directory or a root holding several (the newest complete one is
    read). The result loads into the plain model: `model.load_state_dict(load_full_state_dict(d))`.
    """
    return load_checkpoint(checkpoint_dir).params


def load_full_optimizer_state(checkpoint_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Every parameter's optimizer state, whole, by name, in one process."""
    return load_checkpoint(checkpoint_dir).optimizer_state


def export_torch_save(checkpoint_dir: str | os.PathLike, out_file: str | os.PathLike, *,
                      model_only: bool = True) -> Path:
    """Write a checkpoint as one `torch.save` file, in one process.

    `model_only`: the full model's state dict (`load_full_state_dict`; `model.load_state_dict(
    torch.load(out_file))`). Otherwise everything DCP holds, as torch's `dcp_to_torch_save` writes
    it (model FQNs at the top level, "optimizer", "autoplan")."""
    loaded = load_checkpoint(checkpoint_dir)
    path, out = loaded.path, Path(out_file)
    if model_only:
        torch.save(loaded.params, out)
        return out
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(path, out)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"cannot export {str(path)!r}: {_one_line(_cause(exc))}") from exc
    return out


def checkpoint_fingerprint(manifest: Mapping[str, Any]) -> str | None:
    """The model fingerprint a checkpoint's manifest records (None if it records none)."""
    return manifest.get("model_fingerprint") or (manifest.get("extra") or {}).get("model_fingerprint")


# ---- restore into a (differently) partitioned model ---------------------------------------------


def _target_like(param, md) -> torch.Tensor:
    """An empty tensor to load a saved optimizer-state entry into: laid out as `param` (a DTensor
    keeps its placements, so DCP reads only this rank's chunk) when it has the parameter's shape,
    else a plain tensor of the saved shape (AdamW's scalar step)."""
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
        _check_structure(ckpt.path)
    except _Damaged as exc:
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
    unheld = _unheld_names(pm)
    for key, local in _model_state(pm).items():
        saved = ckpt.saved_name(key, ckpt.model_keys)
        if saved is None:
            missing.append(local[0][0])
            continue
        local = sorted(local, key=lambda entry: entry[0] in unheld)  # a held copy first
        name, tensor = local[0]
        md = ckpt.model_keys[saved]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(tensor.shape):
            raise CheckpointError(f"{where} entry {saved!r} has shape {tuple(getattr(md, 'size', ()))}, the model's "
                                  f"{name!r} {tuple(tensor.shape)}; is it of another model?")
        others = [other for _, other in local[1:]]
        if name in unheld:  # read the saved (fp32) values aside, then round them into the working copy
            others.insert(0, tensor)
            tensor = torch.empty_like(tensor, dtype=md.properties.dtype)
        targets[saved] = tensor
        copies += [(tensor, other) for other in others]
    if strict and missing:
        raise CheckpointError(f"{where} has no entry for {len(missing)} parameters of this rank, e.g. "
                              f"{missing[0]!r}; is it of another model?")

    opt_state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    inner = None
    if optimizer is not None:
        inner = local_optimizer(optimizer)  # under ZeRO: the shard this rank steps, found by name
        names = _param_names(pm)
        for group in inner.param_groups:
            for p in group["params"]:
                name = _canonical(pm, names[id(p)])
                saved = ckpt.saved_name(name, ckpt.optimizer_keys)
                if saved is None:
                    if strict and ckpt.optimizer_keys:
                        raise CheckpointError(f"{where} has no optimizer state for {name!r}")
                    continue
                entries = {}
                for k, key in ckpt.optimizer_keys[saved].items():
                    md = ckpt.metadata.state_dict_metadata[key]
                    entries[k] = _target_like(p, md) if isinstance(md, TensorStorageMetadata) else None
                opt_state[saved] = entries
        for group in optimizer.param_groups:
            for p in group["params"]:
                saved = ckpt.saved_name(_canonical(pm, names[id(p)]), ckpt.hyperparameter_keys)
                if saved is not None:
                    hyper[saved] = dict.fromkeys(ckpt.hyperparameter_keys[saved])
    per_rank: dict[str, Any] = {}
    if restore_rng and rank is not None and rank in ckpt.rank_keys:
        per_rank = {_rank_key(rank): {"rng": {path[1]: torch.empty(ckpt.metadata.state_dict_metadata[key].size,
                                                                    dtype=torch.uint8)
                                              for path, key in ckpt.rank_keys[rank].items() if path[0] == "rng"}}}

    state: dict[str, Any] = dict(targets)
    if opt_state or hyper:
        state[OPTIMIZER_KEY] = {"state": opt_state, "param_groups": hyper}
    if per_rank:
        state[EXTRA_KEY] = per_rank
    _dcp_load(ckpt.path, state)

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
        names = _param_names(pm)
        sd = inner.state_dict()
        by_index: dict[int, Any] = {}
        index = 0
        for group in inner.param_groups:
            for p in group["params"]:
                saved = ckpt.saved_name(_canonical(pm, names[id(p)]), loaded_state)
                if saved is not None:
                    by_index[index] = dict(loaded_state[saved])
                index += 1
        sd["state"] = by_index

        def saved_group(group) -> dict[str, Any] | None:
            for p in group["params"]:
                saved = ckpt.saved_name(_canonical(pm, names[id(p)]), loaded_hyper)
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
        rng = per_rank[_rank_key(rank)]["rng"]
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return ckpt.step
