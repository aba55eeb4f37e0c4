"""`save_checkpoint`: this rank's part of the model and optimizer, written through DCP, durably
and atomically (the package docstring's "Atomicity"), with the manifest rank 0 writes last.

Also the fault `kill-in-checkpoint` (runtime/launcher/faults.py): `_data_filesystem` kills a rank in the
middle of its data file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from autoplan.runtime.checkpoint.format import CHECKPOINT_FORMAT, MANIFEST, CheckpointError, step_dir_name
from autoplan.runtime.checkpoint.identity import write_failure
from autoplan.runtime.checkpoint.integrity import file_entry
from autoplan.runtime.checkpoint.planners import Pieces, save_planner, with_pieces
from autoplan.runtime.checkpoint.state import rank_state

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
    in faults.py."""
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
    out = {k: getattr(plan, k) for k in ("pp", "dp", "tp", "zero", "virtual_stages", "dp_replicate", "ep")
           if isinstance(getattr(plan, k, None), int)}
    out["stage_end_blocks"] = [s.end_block for s in plan.stages]
    out["dtype"] = plan.job.dtype
    return out


def save_checkpoint(directory: str | os.PathLike, step: int, pm, optimizer: torch.optim.Optimizer | None = None, *,
                    extra: Mapping[str, Any] | None = None, timeout: timedelta = timedelta(seconds=60),
                    run: Mapping[str, Any] | None = None, _kill_midway: bool = False) -> Path:
    """Save this rank's part of the model and optimizer as checkpoint `step` (steps completed).

    Collective: every rank of the default process group calls it (a single process works too, with
    or without a process group). Returns the final directory `DIR/step-NNNNNN`. `extra` (JSON-able
    values) is stored in the manifest and with this rank's state. `run` (JSON-able: `job_id`,
    `run_id`, `run_fingerprint`) is the manifest's record of the job that saved it (identity.py
    [Note: one job per checkpoint directory]). A write that fails (a full disk, the file-size limit)
    raises CheckpointError naming its cause in one line (`identity.write_failure`), and the
    unfinished directory is removed. `_kill_midway` SIGKILLs this rank halfway through its DCP data
    file.
    """
    import torch.distributed as dist

    root = Path(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = step_dir_name(step)
    try:
        return _save(root, name, step, pm, optimizer, extra, timeout, run, _kill_midway)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit | CheckpointError) or not _is_write_failure(exc):
            raise
        if rank == 0:
            shutil.rmtree(root / f".tmp-{name}", ignore_errors=True)
        raise write_failure(exc, f"checkpoint {str(root / name)!r}") from exc


def _is_write_failure(exc: BaseException) -> bool:
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(exc, OSError | CheckpointException)


def _save(root: Path, name: str, step: int, pm, optimizer, extra, timeout: timedelta, run, _kill_midway: bool) -> Path:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    final = root / name
    tmp = root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # an interrupted save of this or an earlier run
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier(timeout)
    state = with_pieces(rank_state(pm, optimizer, rank, step, extra))
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
    kill_after_bytes = None
    if _kill_midway:
        kill_after_bytes = max(1, sum(t.numel() * t.element_size() for t in _tensors(state)) // 2)
    writer.fs = _data_filesystem(kill_after_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ..." in a single process
        dcp.save(state, storage_writer=writer, planner=save_planner())
    # dcp.save returned: every rank's data file and the metadata are durable.
    files = _gather_to_rank0({p.name: file_entry(p) for p in writer.fs.written})
    if rank == 0:
        _fsync_dir(tmp)
        for p in sorted(tmp.iterdir()):  # `.metadata` (rank 0 wrote it), and any file no rank reported
            if p.name != MANIFEST and p.name not in files:
                files[p.name] = file_entry(p)
        files = dict(sorted(files.items()))
        plan = getattr(pm, "plan", None)
        manifest = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": world_size, "files": files,
                    "time": time.time(), "model_fingerprint": getattr(plan, "model_fingerprint", None),
                    "model": getattr(plan, "model", None), "layout": _layout_of(pm),
                    "aliases": dict(getattr(pm, "aliases", {})), "extra": dict(extra or {}),
                    **({"run": dict(run)} if run else {})}
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
    elif isinstance(tree, Pieces):
        yield tree.tensor
    elif isinstance(tree, DTensor):
        yield tree.to_local()
    elif isinstance(tree, torch.Tensor):
        yield tree
