"""Whether a saved checkpoint directory can be used: its manifest, its files' names, sizes and
sha256s, DCP's metadata and every rank's own record of the step (`verify_checkpoint`).

Apart from save and load: save.py records what these checks compare against (`file_entry`), and
load.py and restore.py run them before they read a tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoplan.runtime.checkpoint.format import (
    CHECKPOINT_FORMAT,
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    one_line,
)
from autoplan.runtime.checkpoint.reader import Checkpoint, root_cause

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


def file_entry(path: Path) -> dict[str, Any]:
    """What the manifest records of one file ([Note: checkpoint checksums])."""
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


class Damaged(Exception):
    """Why a checkpoint directory cannot be used (one line naming the file)."""


def _parse_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, of the expected shape: format 2, a step count, a
    size and sha256 for every file (`.metadata` among them), a model fingerprint entry."""
    try:
        text = (path / MANIFEST).read_bytes()
    except OSError as exc:
        raise Damaged(f"cannot read {MANIFEST} ({one_line(exc)})") from None
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise Damaged(f"{MANIFEST} does not parse ({one_line(exc)})") from None
    if not isinstance(manifest, dict):
        raise Damaged(f"{MANIFEST} is not a JSON object")
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise Damaged(f"{MANIFEST} is of format {manifest.get('format')!r}; this version reads {CHECKPOINT_FORMAT}")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise Damaged(f"{MANIFEST} records step {step!r}, not a count of steps")
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise Damaged(f"{MANIFEST} does not list .metadata (DCP's metadata) among its files")
    for name, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if (not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str)
                or not _SHA256.fullmatch(digest)):
            raise Damaged(f"{MANIFEST} records no size and sha256 of {name!r} (saved before checksums?)")
    if "model_fingerprint" not in manifest:  # save_checkpoint writes the entry, null without a plan
        raise Damaged(f"{MANIFEST} records no model fingerprint")
    return manifest


def _check_name(name: str) -> None:
    """A manifest names files of its own directory only: plain names, no path."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name):
        raise Damaged(f"{MANIFEST} names {name!r}, not a file of the checkpoint's own directory")


def _check_files(path: Path, manifest: Mapping[str, Any]) -> None:
    """Every file the manifest lists is a regular file in `path` with the recorded size (stat only:
    no data is read)."""
    match = STEP_DIR.match(path.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise Damaged(f"{MANIFEST} records step {manifest['step']}, the directory's name step {int(match.group(1))}")
    home = path.resolve()
    for name, entry in manifest["files"].items():
        _check_name(name)
        file = path / name
        if file.resolve().parent != home:
            raise Damaged(f"{name} is a link to {str(file.resolve())!r}, outside the checkpoint's directory")
        try:
            st = file.stat()
        except FileNotFoundError:
            raise Damaged(f"{name} is missing") from None
        except OSError as exc:
            raise Damaged(f"{name} does not stat ({one_line(exc)})") from None
        if not stat.S_ISREG(st.st_mode):
            raise Damaged(f"{name} is not a regular file")
        if st.st_size != entry["size"]:
            raise Damaged(f"{name} has {st.st_size} bytes, {MANIFEST} records {entry['size']}")


def check_structure(path: Path) -> dict[str, Any]:
    """The manifest of `path` once it and the files' names, sizes and step check (no data read)."""
    manifest = _parse_manifest(path)
    _check_files(path, manifest)
    return manifest


def _check_checksums(path: Path, manifest: Mapping[str, Any]) -> None:
    """Every listed file's sha256 is the recorded one (reads every file once)."""
    for name in sorted(manifest["files"], key=lambda n: n != ".metadata"):  # .metadata first: it is unpickled next
        if _sha256(path / name) != manifest["files"][name]["sha256"]:
            raise Damaged(f"{name} does not match its sha256 in {MANIFEST} (one of them changed after the save)")


def _read_metadata(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise Damaged(f"DCP's .metadata does not read ({one_line(exc)})") from None


def _check_needed_files(metadata: Any, manifest: Mapping[str, Any]) -> None:
    """Every file DCP's metadata reads from is one the manifest lists (and so was checked)."""
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if name not in manifest["files"]:
            raise Damaged(f"DCP's .metadata reads from {name!r}, a file {MANIFEST} does not list")


def _check_saved_steps(checkpoint: Checkpoint) -> None:
    """Each rank's own record of the step (its `autoplan.rank-R` extra, inside its data file) is the
    manifest's: a manifest over another checkpoint's files is refused (a few bytes read per rank)."""
    keys = {r: entries[("extra",)] for r, entries in checkpoint.rank_keys.items() if ("extra",) in entries}
    try:
        extras = checkpoint._load_flat(keys)
    except CheckpointError as exc:
        raise Damaged(f"the ranks' records of their step do not read ({one_line(root_cause(exc.__cause__ or exc))})") from None
    for rank, text in sorted(extras.items()):
        try:
            step = json.loads(text).get("step")
        except (TypeError, ValueError, AttributeError):
            step = None
        if step != checkpoint.step:
            raise Damaged(f"rank {rank}'s data records step {step}, {MANIFEST} step {checkpoint.step} "
                           f"(the files of another checkpoint?)")


def open_checkpoint(path: Path, *, checksums: bool) -> Checkpoint:
    """The checkpoint at `path` once every check of `verify_checkpoint` passes, else Damaged."""
    manifest = check_structure(path)
    if checksums:
        _check_checksums(path, manifest)
    metadata = _read_metadata(path)
    _check_needed_files(metadata, manifest)
    try:
        checkpoint = Checkpoint(path, manifest["step"], manifest, metadata)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # checksums=False and a crafted .metadata
        raise Damaged(f"DCP's .metadata holds keys autoplan did not write ({one_line(exc)})") from None
    _check_saved_steps(checkpoint)
    return checkpoint


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = True) -> str | None:
    """Why the checkpoint directory `path` is damaged (one line naming the file), or None if it
    verifies: its manifest parses, is of format 2 and records a model fingerprint; it names plain
    files of `path` only (no `/`, `..`, absolute path, or link out of it), each present with its
    recorded size and (with `checksums`: reads every file) sha256; DCP's metadata reads from those
    files only; the manifest's step is the directory name's and every rank's own record of it."""
    try:
        open_checkpoint(Path(path), checksums=checksums)
    except Damaged as exc:
        return str(exc)
    return None
