"""One job per checkpoint directory (issue 41 item 9; runtime/checkpoint/identity.py [Note: one job
per checkpoint directory]), through `autoplan suggest --out` / `autoplan run` / `autoplan
export-checkpoint`:

- a fresh run into a directory holding checkpoints is refused in one line before any rank starts
  (exit 2), and `--overwrite` deletes them first;
- every manifest records the job, the launch and the plan's run fingerprint, and a resumed run keeps
  the job;
- `--resume` and `export-checkpoint` refuse a directory holding two jobs' steps;
- a write that fails names its cause: the file-size limit (RLIMIT_FSIZE in the run's processes,
  EFBIG) through the CLI, a full disk (the writer raising ENOSPC) through `save_checkpoint`.
"""

from __future__ import annotations

import errno
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.plan import Plan

SPEC = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"


def _cli(*args: str, timeout: int = 300, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _steps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("step-"))


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "p.json"
    made = _cli("suggest", "--model", SPEC, "--cluster", "1x1xcpu", "--global-batch", "4", "--seq-len", "16",
                "--dtype", "fp32", "--out", str(path))
    assert made.returncode == 0, made.stderr
    return path


def _run(plan_file: Path, directory: Path, steps: int, *extra: str, **kwargs) -> subprocess.CompletedProcess:
    return _cli("run", str(plan_file), "--steps", str(steps), "--checkpoint-dir", str(directory), "--checkpoint-every",
                "1", *extra, **kwargs)


@pytest.mark.timeout(600)
def test_a_checkpoint_directory_holds_one_job(plan_file, tmp_path):
    d = tmp_path / "ckpt"
    first = _run(plan_file, d, 3)
    assert first.returncode == 0, first.stderr
    job_a = _manifest(d / "step-000003")["run"]
    assert job_a["run_fingerprint"] == Plan.load(plan_file).run_fingerprint and job_a["job_id"] == job_a["run_id"]
    shutil.copytree(d / "step-000003", tmp_path / "a-step-3")

    # A second job without --resume: refused before any rank starts, in one line; nothing written.
    again = _run(plan_file, d, 1)
    line = again.stderr.strip().splitlines()[-1]
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert "already holds checkpoints (steps 1-3 of job" in line and "--resume" in line and "--overwrite" in line, line
    assert "step 0" not in again.stdout and _steps(d) == ["step-000001", "step-000002", "step-000003"]

    # --overwrite deletes them first: the directory then holds the new job's steps only.
    fresh = _run(plan_file, d, 1, "--overwrite")
    assert fresh.returncode == 0, fresh.stderr
    assert _steps(d) == ["step-000001"]
    job_b = _manifest(d / "step-000001")["run"]
    assert job_b["job_id"] != job_a["job_id"]
    bad = _run(plan_file, d, 2, "--overwrite", "--resume")
    assert bad.returncode == 2 and "give one of them" in bad.stderr, bad.stderr

    # A resume continues the job: same job id, a launch of its own.
    resumed = _run(plan_file, d, 2, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    step_2 = _manifest(d / "step-000002")["run"]
    assert step_2["job_id"] == job_b["job_id"] and step_2["run_id"] != job_b["run_id"]

    # Another job's newer step in the directory: resume and export refuse it, naming both jobs.
    shutil.copytree(tmp_path / "a-step-3", d / "step-000003")
    mixed = _run(plan_file, d, 4, "--resume")
    line = mixed.stderr.strip().splitlines()[-1]
    assert mixed.returncode == 2 and "holds checkpoints of 2 jobs" in line, mixed.stderr
    assert job_a["job_id"] in line and job_b["job_id"] in line, line
    export = _cli("export-checkpoint", str(d), "--out", str(tmp_path / "x.pt"))
    assert export.returncode == 2 and "holds checkpoints of 2 jobs" in export.stderr, export.stderr
    assert not (tmp_path / "x.pt").exists()
    # naming one step directory is explicit: it exports
    one = _cli("export-checkpoint", str(d / "step-000002"), "--out", str(tmp_path / "y.pt"))
    assert one.returncode == 0, one.stderr


def _small_file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (96 * 1024, resource.RLIM_INFINITY))  # below one rank's data file


@pytest.mark.timeout(300)
def test_a_checkpoint_over_the_file_size_limit_names_the_limit(plan_file, tmp_path):
    d = tmp_path / "ckpt"
    ran = _run(plan_file, d, 1, preexec_fn=_small_file_limit)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    line = ran.stderr.strip().splitlines()[-1]
    assert "cannot write checkpoint" in line and "file too large" in line and "RLIMIT_FSIZE" in line, ran.stderr
    assert "CheckpointException ranks" not in ran.stderr, ran.stderr
    assert _steps(d) == [] and not list(d.glob(".tmp-*")), list(d.iterdir())


def test_a_full_disk_during_a_save_names_it(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime.checkpoint import save

    plan = autoplan.suggest(SPEC, "1x1xcpu", global_batch=4, seq_len=16, dtype="fp32", top=1)[0]
    pm = autoplan.partition(SPEC, plan, device="cpu")
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-3)

    class FullDisk(FileSystem):
        def create_stream(self, path, mode):
            if "w" in mode and str(path).endswith(".distcp"):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return super().create_stream(path, mode)

    monkeypatch.setattr(save, "_data_filesystem", lambda kill_after_bytes=None: FullDisk())
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_checkpoint(tmp_path / "ckpt", 1, pm, optimizer)
    message = str(raised.value)
    assert "no space left on device (ENOSPC)" in message and "step-000001" in message, message
    assert "\n" not in message and "CheckpointException" not in message, message
    assert not list((tmp_path / "ckpt").iterdir())  # the unfinished save is removed
