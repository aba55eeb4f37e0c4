"""One job per checkpoint directory: which job wrote a checkpoint, and the checks that keep two jobs'
checkpoints apart (a fresh run into a used directory, a directory that holds two jobs).

[Note: one job per checkpoint directory]
Checkpoints are named by step only (`step-000123`), so a second job started in the directory of a
first would overwrite the first job's steps as it reaches them and leave the newer ones, which
`--resume` and `export-checkpoint` then take as the newest: the other job's weights. So:

- every manifest records the run that wrote it (`"run"`: `job_id`, `run_id`, `run_fingerprint`):
  `run_id` is the launch (training.py), `job_id` the job it continues (its own `run_id` for a fresh
  start, the resumed checkpoint's `job_id` after `--resume`, so one job keeps one id over any
  number of resumes, under any plan of the same model), `run_fingerprint` the plan's
  (`Plan.run_fingerprint`: a resume under another layout records its own);
- a fresh run (no `--resume`) into a directory holding a checkpoint is refused before any rank
  starts (`check_fresh_directory`), unless asked to delete them first (`--overwrite`,
  `remove_checkpoints`);
- choosing a checkpoint under a directory (resume, export, `load_checkpoint(DIR)`) refuses a
  directory whose checkpoints record two jobs (`mixed_jobs`). A manifest without a `"run"` entry
  (saved before it was recorded, or by `save_checkpoint` without `run=`) is of no known job and
  conflicts with none.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoplan.runtime.checkpoint.format import MANIFEST, STEP_DIR, CheckpointError

__all__ = ["check_fresh_directory", "job_id_of", "mixed_jobs", "remove_checkpoints", "write_failure"]


def _step_entries(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), e) for e in root.iterdir() if (m := STEP_DIR.match(e.name)) and e.is_dir())


def _manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def job_id_of(manifest: Mapping[str, Any]) -> str | None:
    """The job a checkpoint's manifest records, or None (none recorded)."""
    run = manifest.get("run")
    job = run.get("job_id") if isinstance(run, Mapping) else None
    return job if isinstance(job, str) and job else None


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}" if steps == list(
        range(steps[0], steps[-1] + 1)) else "steps " + ", ".join(map(str, steps))


def mixed_jobs(directory: str | os.PathLike) -> str | None:
    """Why the checkpoints under `directory` are of more than one job (one line), or None. Reads
    the manifests only."""
    jobs: dict[str, list[int]] = {}
    for step, entry in _step_entries(directory):
        manifest = _manifest(entry)
        job = job_id_of(manifest) if manifest is not None else None
        if job is not None:
            jobs.setdefault(job, []).append(step)
    if len(jobs) < 2:
        return None
    parts = [f"{_steps_text(steps)} of job {job}" for job, steps in sorted(jobs.items(), key=lambda kv: kv[1][-1])]
    return f"{str(directory)!r} holds checkpoints of {len(jobs)} jobs ({'; '.join(parts)})"


def refuse_mixed(directory: str | os.PathLike) -> None:
    """CheckpointError (one line) if `directory` holds checkpoints of more than one job."""
    reason = mixed_jobs(directory)
    if reason is not None:
        raise CheckpointError(f"{reason}: the newest step may not be this job's; move the other job's step-N "
                              f"directories away, or name one step-N directory")


def check_fresh_directory(directory: str | os.PathLike) -> None:
    """A fresh run (no --resume) may not save into a directory that holds checkpoints: ValueError
    (one line) naming them and the three ways on ([Note: one job per checkpoint directory])."""
    found = _step_entries(directory)
    if not found:
        return
    steps = [step for step, _ in found]
    jobs = sorted({job for _, e in found if (m := _manifest(e)) is not None and (job := job_id_of(m)) is not None})
    of = f" of job {', '.join(jobs)}" if jobs else ""
    raise ValueError(f"--checkpoint-dir {str(directory)!r} already holds checkpoints ({_steps_text(steps)}{of}); "
                     f"continue that job with --resume, use a new directory, or add --overwrite to delete them first")


def remove_checkpoints(directory: str | os.PathLike) -> int:
    """Delete every checkpoint under `directory` (`step-N` directories and unfinished `.tmp-step-*`
    ones; nothing else): `--overwrite`. Returns how many `step-N` directories went."""
    root = Path(directory)
    found = _step_entries(root)
    for _, entry in found:
        shutil.rmtree(entry)
    if root.is_dir():
        for stale in root.glob(".tmp-*step-*"):
            shutil.rmtree(stale, ignore_errors=True)
    return len(found)


_CAUSES = {
    errno.ENOSPC: "no space left on device (ENOSPC); free space or use another --checkpoint-dir",
    errno.EFBIG: "file too large: the file-size limit (EFBIG, `ulimit -f` / RLIMIT_FSIZE) is below the checkpoint's "
                 "size; raise it or save fewer bytes per file",
    errno.EDQUOT: "disk quota exceeded (EDQUOT); free space or use another --checkpoint-dir",
    errno.EROFS: "read-only file system (EROFS); use another --checkpoint-dir",
    errno.EACCES: "permission denied (EACCES); use a directory this user may write",
}


def _os_errors(exc: BaseException | None, seen: set[int] | None = None):
    """The OSErrors in `exc`, its causes and, for DCP's CheckpointException, every rank's failure."""
    seen = set() if seen is None else seen
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            yield exc
        for failure in (getattr(exc, "failures", None) or {}).values():  # {rank: (exception, traceback)}
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                yield from _os_errors(inner, seen)
        exc = exc.__cause__ or exc.__context__


def write_failure(exc: BaseException, where: str) -> CheckpointError:
    """The one-line error of a checkpoint write that failed with `exc` (DCP's CheckpointException,
    whose text is a traceback per rank, or an OSError): its cause by errno where one is found."""
    from autoplan.runtime.checkpoint.format import one_line

    for error in _os_errors(exc):
        cause = _CAUSES.get(error.errno) or f"{os.strerror(error.errno).lower()} ({errno.errorcode.get(error.errno, error.errno)})"
        return CheckpointError(f"cannot write {where}: {cause}")
    failures = getattr(exc, "failures", None)
    if failures:
        rank, failure = next(iter(failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return CheckpointError(f"cannot write {where}: rank {rank}: {one_line(inner)}")
    return CheckpointError(f"cannot write {where}: {one_line(exc)}")
