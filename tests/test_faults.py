"""Faults an operator of a shared machine meets, through what users run (docs/reliability.md, "Faults"):
a killed or stopped launcher, a frozen rank, a NaN, two jobs on one checkpoint directory, who can
reach a job, and the run's bad arguments.

The CLI tests run `autoplan run` as a subprocess (a launcher that can be killed) on a plan written
by `autoplan suggest --out`; the others call `run_plan` with a forkserver that has torch preloaded.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import scaled_timeout_s

from autoplan.cli import main
from autoplan.runtime import run_plan
from autoplan.runtime.launcher.launch import FORKSERVER_PRELOAD

pytestmark = pytest.mark.multiproc

GPT = "gpt:num_layers=4,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"
FAST = dict(_start_method="forkserver")


@pytest.fixture(scope="module", autouse=True)
def _forkserver():
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    forkserver.ensure_running()


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """pp 2 x dp 2 on 4 CPU ranks, as a user writes it."""
    path = tmp_path_factory.mktemp("plan") / "p.json"
    code = main(["suggest", "--model", GPT, "--cluster", "1x4xA100-80GB", "--global-batch", "8", "--seq-len", "16",
                 "--pp", "2", "--dp", "2", "--tp", "1", "--zero", "0", "--schedule", "1f1b", "--out", str(path)])
    assert code == 0 and path.exists()
    return path


def _autoplan(*args: str, tmpdir: Path, env: dict | None = None, **popen) -> subprocess.Popen:
    environment = {**os.environ, "TMPDIR": str(tmpdir), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "autoplan", *args], env=environment, text=True, **popen)


def _beats(tmpdir: Path) -> dict[int, dict]:
    """The ranks' heartbeats of the one job under `tmpdir` (its run directory lives there)."""
    out = {}
    for path in tmpdir.glob("autoplan-rank-*/heartbeat-*.json"):
        with contextlib.suppress(OSError, ValueError):  # a beat being replaced
            out[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return out


def _wait_for_steps(tmpdir: Path, nproc: int, step: int, timeout_s: float = 90) -> dict[int, dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = _beats(tmpdir)
        if len(beats) == nproc and all((b.get("step") or 0) >= step for b in beats.values()):
            return beats
        time.sleep(0.2)
    raise AssertionError(f"the ranks did not reach step {step}: {_beats(tmpdir)}")


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a container's init may never reap one)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets `pid` listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                out.append(_address(fields[1].split(":")[0]))
    return out


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    if len(raw) == 4:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1].hex() for i in range(0, 16, 4)]  # four little-endian 32-bit words
    return ":".join(w[j:j + 4] for w in words for j in (0, 4))


def _loopback(address: str) -> bool:
    return (address.startswith("127.") or address == "0000:0000:0000:0000:0000:0000:0000:0001"
            or address.startswith("0000:0000:0000:0000:0000:ffff:7f"))


@pytest.mark.extended  # about 30 s: in `.ci/run`'s second pass, with the other long multi-process tests
@pytest.mark.timeout(180)
def test_a_killed_launcher_takes_its_ranks_along_and_a_job_listens_on_loopback_and_locks_its_checkpoints(
        plan_file, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    ckpt = tmp_path / "ckpt"
    job = _autoplan("run", str(plan_file), "--steps", "100000", "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                    "1000000", "--timeout", "30", tmpdir=tmpdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        beats = _wait_for_steps(tmpdir, 4, 2)
        ranks = [b["pid"] for b in beats.values()]
        # Who can reach the job: every listening socket of the launcher and the ranks is on loopback.
        listening = {pid: _listening_addresses(pid) for pid in [job.pid, *ranks]}
        assert sum(map(len, listening.values())) >= 1, listening  # the store, at least, listens
        assert all(_loopback(a) for addresses in listening.values() for a in addresses), listening

        # A second job on the same checkpoint directory is refused before it spawns anything.
        second = _autoplan("run", str(plan_file), "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume",
                           tmpdir=tmpdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = second.communicate(timeout=60)
        lines = err.strip().splitlines()
        assert second.returncode == 2 and lines[-1].startswith("autoplan: error: --checkpoint-dir"), err
        assert "in use by job pid" in lines[-1] and str(job.pid) in lines[-1], err
        assert not any("launching" in line for line in lines), err

        job.send_signal(signal.SIGKILL)
        job.wait(10)
        deadline = time.monotonic() + 15
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), [p for p in ranks if _alive(p)]
    finally:
        job.kill()
        job.wait(10)
    # The dead launcher's lock is stale: the next job takes it over and runs.
    third = _autoplan("run", str(plan_file), "--steps", "2", "--checkpoint-dir", str(ckpt), tmpdir=tmpdir,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0, err
    assert (ckpt / "step-000002" / "manifest.json").exists()  # --checkpoint-dir alone: saved after the last step


@pytest.mark.extended
@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_stops_every_rank(plan_file, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    job = _autoplan("run", str(plan_file), "--steps", "100000", tmpdir=tmpdir, stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE)
    try:
        ranks = [b["pid"] for b in _wait_for_steps(tmpdir, 4, 1).values()]
        start = time.monotonic()
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=30)
        assert job.returncode == 143, err
        assert err.strip().splitlines()[-1].startswith("autoplan: error: stopped by SIGTERM"), err
        assert not any(map(_alive, ranks)) and time.monotonic() - start < 15
    finally:
        job.kill()
        job.wait(10)


@pytest.mark.extended
@pytest.mark.timeout(150)
def test_a_frozen_rank_is_named_whichever_it_is(plan_file, capsys):
    """SIGSTOP (the `stop` fault: the rank stops itself, threads included, as `kill -STOP` does) of
    each of the 4 ranks in turn: the job exits non-zero within the timeout + 15 s, and the line
    names the frozen rank, not a peer that timed out waiting for it."""
    timeout_s = 4
    for rank in range(4):
        start = time.monotonic()
        code = run_plan(plan_file, steps=50, timeout_s=timeout_s, _fault=f"stop@{rank}:3", **FAST)
        elapsed = time.monotonic() - start
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 1 and elapsed < timeout_s + scaled_timeout_s(15), (rank, elapsed, line)
        assert line.startswith(f"autoplan: error: rank {rank} stopped making progress: no heartbeat"), (rank, line)
        assert "logs: " in line


@pytest.mark.timeout(120)
def test_a_hung_rank_is_named_by_how_far_it_got(plan_file, capsys):
    """Alive but stuck (sleeping in Python: its heartbeat thread still beats): the peers time out
    and the launcher names the rank that got least far."""
    code = run_plan(plan_file, steps=50, timeout_s=3, _fault="hang@1:2", _grace_s=2, **FAST)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and line.startswith("autoplan: error: rank 1 stopped making progress at step 2"), line


@pytest.mark.timeout(120)
def test_nonfinite_gradients_or_loss_stop_the_run_naming_step_and_stage(plan_file, tmp_path):
    env = {"AUTOPLAN_FAULT": "nan@2:1"}  # rank 2 holds stage 1 (pp 2 x dp 2)
    job = _autoplan("run", str(plan_file), "--steps", "4", tmpdir=tmp_path, env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE)
    out, err = job.communicate(timeout=100)
    line = err.strip().splitlines()[-1]
    assert job.returncode == 1 and "NonFiniteError: non-finite gradients in stage 1 at step 1" in line, err
    assert "inf" not in out and "nan" not in out, out  # no loss line with a non-finite value

    code = run_plan(plan_file, steps=4, _fault="nan-weight@0:2", **FAST)  # a NaN weight: the loss is NaN
    assert code == 1

    metrics = tmp_path / "m.jsonl"
    code = run_plan(plan_file, steps=4, metrics_path=str(metrics), skip_nonfinite=1, _fault="nan@2:1", **FAST)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert code == 0 and [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[1]["skipped"] == "non-finite gradients in stage 1" and records[1]["loss"] is None
    assert all(r["loss"] is not None and abs(r["loss"]) < 100 for r in records if r["step"] != 1)


@pytest.mark.timeout(120)
def test_the_metrics_file_keeps_the_history_of_a_resumed_run(plan_file, tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    assert run_plan(plan_file, steps=2, metrics_path=str(metrics), checkpoint_dir=ckpt, **FAST) == 0
    assert run_plan(plan_file, steps=4, metrics_path=str(metrics), checkpoint_dir=ckpt, resume=True, **FAST) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    runs = [r["run"] for r in records]
    assert runs[0] == runs[1] != runs[2] == runs[3]


@pytest.mark.parametrize("args, words", [
    (["--timeout", "0"], "--timeout 0.0 must be a finite number above 0"),
    (["--timeout", "nan"], "--timeout nan must be a finite number above 0"),
    (["--timeout", "inf"], "--timeout inf must be a finite number above 0"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--steps", "-1"], "--steps -1 must be at least 1"),
    (["--skip-nonfinite", "-1"], "--skip-nonfinite -1 must be at least 0"),
    (["--metrics", "{tmp}/missing/m.jsonl"], "does not exist; create it first"),
    (["--trace", "{tmp}"], "is a directory; name a file"),
    (["--metrics", ""], "--metrics is empty"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/f"], "exists and is not a directory"),
])
def test_bad_run_arguments_are_one_line_before_any_process_starts(plan_file, tmp_path, capsys, args, words):
    (tmp_path / "f").write_text("")
    argv = ["run", str(plan_file), *(a.format(tmp=tmp_path) for a in args)]
    start = time.monotonic()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoplan: error: ") and words in lines[0], lines
    assert time.monotonic() - start < 20  # refused before spawning (a launch takes longer)


def test_run_says_which_model_file_every_rank_imports_and_refuses_one_changed_since_planning(tmp_path, capsys):
    model = tmp_path / "model.py"
    model.write_text((Path(__file__).parents[1] / "examples" / "custom_model.py").read_text())
    plan = tmp_path / "p.json"
    assert main(["suggest", "--model", f"{model}:build", "--cluster", "1x2xA100-80GB", "--global-batch", "4",
                 "--seq-len", "16", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--nproc", "999"]) == 2  # checked, then refused before spawning
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith(f"autoplan: every rank imports {model.resolve()} (sha256 ") and "as planned" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("autoplan: error: --nproc 999"), lines
    model.write_text(model.read_text() + "\n# changed\n")
    assert main(["run", str(plan)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "changed since the plan was made" in lines[0], lines
