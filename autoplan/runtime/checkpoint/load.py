"""Find the checkpoints under a directory (the newest that verifies, the damaged ones skipped and
named, those of another format) and open one (`load_checkpoint`), or read a whole model from one
in a single process (`load_full_state_dict`).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from autoplan.runtime.checkpoint.format import CHECKPOINT_FORMAT, MANIFEST, STEP_DIR, CheckpointError
from autoplan.runtime.checkpoint.identity import refuse_mixed
from autoplan.runtime.checkpoint.integrity import Damaged, check_structure, open_checkpoint, verify_checkpoint
from autoplan.runtime.checkpoint.reader import Checkpoint


def _step_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step in the name, path) of every `step-N` directory under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `directory` whose manifest, file names,
    sizes and step check, oldest first (no data read: `choose_checkpoint` checks the sha256s)."""
    found = []
    for step, entry in _step_dirs(directory):
        try:
            check_structure(entry)
        except Damaged:
            continue
        found.append((step, entry))
    return found


def choose_checkpoint(directory: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `directory` that verifies (`verify_checkpoint`), or None; and
    (path, reason) of each newer one that does not, newest first.

    A `step-N` directory without a manifest (a save that did not finish) is skipped silently, as
    `.tmp-*` directories are. Reads the files of the checkpoints it tries, newest first, up to the
    first that verifies; older ones are not read. A directory whose checkpoints record more than
    one job is refused (CheckpointError, one line: identity.py [Note: one job per checkpoint
    directory]): its newest step may be another job's."""
    refuse_mixed(directory)
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
    candidates = [root] + (sorted(e for e in root.iterdir() if STEP_DIR.match(e.name)) if root.is_dir() else [])
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
        return open_checkpoint(path, checksums=checksums)
    except Damaged as exc:
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
