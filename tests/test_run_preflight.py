"""`autoplan run` checks the machine before it spawns a rank (runtime/launcher/machine.py [Note: a GPU plan on a
CPU machine]), reports a SIGKILL with memory short as likely out of memory, shows what starting
ranks do, and its API raises ValueError where the CLI prints one line and exits 2.

All of these run in one process (no rank is spawned): the user-path run of a GPU plan that fits is
tests/test_fp16.py's (its note line is asserted there)."""

from __future__ import annotations

import dataclasses
import io
import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autoplan.cli import main
from autoplan.plan import Plan
from autoplan.runtime import run_plan
from autoplan.runtime.launcher import machine
from autoplan.runtime.launcher.launch import _mark_phase, _OomWatch, _StartProgress
from autoplan.runtime.launcher.machine import GIB, check_machine, host_memory_bytes
from autoplan.runtime.launcher.preflight import CheckpointDirLock

TINY = "gpt:num_layers=2,hidden_size=64,num_heads=4,vocab_size=256,max_seq_len=32"


@pytest.fixture(scope="module")
def gpt2_a100(tmp_path_factory) -> Path:
    """The issue's plan: GPT-2 small for 8 A100s (8 dp ranks of the whole model)."""
    path = tmp_path_factory.mktemp("plan") / "g.json"
    assert main(["suggest", "--model", "gpt2-small", "--cluster", "1x8xA100-80GB", "--global-batch", "64",
                 "--out", str(path)]) == 0
    return path


@pytest.fixture(scope="module")
def tiny_a100(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "t.json"
    assert main(["suggest", "--model", TINY, "--cluster", "1x2xA100-80GB", "--global-batch", "4", "--seq-len", "32",
                 "--pp", "2", "--out", str(path)]) == 0
    return path


@pytest.fixture
def small_cpu_machine(monkeypatch):
    """A machine without CUDA and 3 GiB free of 4 GiB, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(machine, "available_memory_bytes", lambda: (3.0 * GIB, 4.0 * GIB))


def test_a_gpu_plan_too_big_for_this_machine_is_refused_in_one_line_before_spawning(gpt2_a100, small_cpu_machine,
                                                                                    capsys):
    plan = Plan.load(gpt2_a100)
    estimate = host_memory_bytes(plan)
    # The plan's own figures: 8 copies of GPT-2 small's 124M parameters (18 bytes each in bf16 with
    # fp32 masters and Adam) and their activations, far above 3 GiB.
    assert estimate > 8 * 124e6 * 6 and estimate > 3 * GIB
    capsys.readouterr()
    assert main(["run", str(gpt2_a100), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autoplan: error: "), err
    line = err[0]
    assert f"about {estimate / GIB:.1f} GiB" in line and "3.0 GiB free of 4.0 GiB" in line, line
    assert "--cluster 1x8xcpu" in line and "--out p.json" in line and "--allow-oversubscribe" in line, line
    assert "launching" not in line
    with pytest.raises(ValueError, match="--allow-oversubscribe"):  # the API raises the same line
        run_plan(gpt2_a100, steps=1)


def test_consent_lets_the_too_big_plan_through_the_check_with_a_warning(gpt2_a100, small_cpu_machine):
    fit = check_machine(Plan.load(gpt2_a100), 8, allow_oversubscribe=True)
    assert "--allow-oversubscribe" in fit.note and "OOM killer" in fit.note and fit.estimate_bytes > fit.free_bytes


def test_a_small_gpu_plan_that_fits_runs_on_cpu_ranks_with_a_note(tiny_a100, small_cpu_machine):
    fit = check_machine(Plan.load(tiny_a100), 2)
    assert fit.estimate_bytes < 3 * GIB
    assert fit.note.startswith("no CUDA here: the A100-SXM4-80GB plan runs as 2 CPU ranks with gloo"), fit.note
    good = Plan.load(tiny_a100)
    first = dataclasses.replace(good.stages[0], memory=dataclasses.replace(good.stages[0].memory,
                                                                           activations_bytes=-1e9))
    bad = dataclasses.replace(good, stages=(first, *good.stages[1:]))  # Plan.from_dict would refuse it itself
    with pytest.raises(ValueError, match="activations_bytes = -1000000000.0 must be a finite number of bytes"):
        run_plan(bad, nproc=2)  # a Plan object is validated before any estimate


def test_under_cuda_each_local_rank_needs_its_own_gpu(tiny_a100):
    plan = Plan.load(tiny_a100)
    with pytest.raises(ValueError, match="2 ranks on this machine, one GPU each, but it has 1 GPU; run it under "
                                         "torchrun"):
        check_machine(plan, 2, cuda=True, num_cuda_devices=1)
    assert check_machine(plan, 2, cuda=True, num_cuda_devices=2).note == ""


def test_memory_is_read_from_the_kernel():
    memory = machine.available_memory_bytes()
    if not Path("/proc/meminfo").exists():
        assert memory is None
        return
    free, total = memory
    assert 0 < free <= total


def test_run_plan_raises_valueerror_instead_of_returning_an_exit_code(tiny_a100, capsys):
    for kwargs, words in ((dict(steps="x"), "--steps must be an integer, got 'x'"),
                          (dict(steps=0), "--steps 0 must be at least 1"),
                          (dict(timeout_s=float("nan")), "--timeout nan"),
                          (dict(allow_oversubscribe="yes"), "allow_oversubscribe must be True or False")):
        with pytest.raises(ValueError) as info:
            run_plan(tiny_a100, **kwargs)
        assert words in str(info.value) and "\n" not in str(info.value), info.value
    assert capsys.readouterr().err == ""  # the API prints nothing: the CLI does
    assert main(["run", str(tiny_a100), "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "autoplan: error: --steps 0 must be at least 1"


def test_a_plan_with_negative_memory_figures_is_refused_by_run(tiny_a100, tmp_path, capsys):
    data = json.loads(tiny_a100.read_text())
    data["stages"][1]["memory"]["weights_bytes"] = -5.0
    bad = tmp_path / "negative.json"
    bad.write_text(json.dumps(data))
    assert main(["run", str(bad), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "weights_bytes" in err[0] and "-5.0" in err[0], err


def test_an_unwritable_checkpoint_directory_is_one_line_naming_it(tiny_a100, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("")
    assert main(["run", str(tiny_a100), "--steps", "1", "--checkpoint-dir", str(tmp_path / "file" / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--checkpoint-dir '{tmp_path / 'file' / 'ckpt'}' cannot be written" in err[0], err
    assert "choose a directory you can write" in err[0]

    # A read-only directory (tests run as root, where chmod stops nothing): open() refuses as it would.
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    read_only = tmp_path / "ro"
    read_only.mkdir()
    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(ValueError) as info:
        CheckpointDirLock(str(read_only)).acquire()
    monkeypatch.undo()
    assert str(info.value).startswith(f"--checkpoint-dir '{read_only}' cannot be written (Permission denied: "), info
    assert "[Errno 13]" not in str(info.value)


def _procs(*exitcodes):
    return [SimpleNamespace(exitcode=code) for code in exitcodes]


def test_a_sigkill_with_memory_short_is_reported_as_likely_out_of_memory(monkeypatch):
    fit = machine.MachineFit(estimate_bytes=45 * GIB, free_bytes=21 * GIB, total_bytes=23 * GIB)
    monkeypatch.setattr("autoplan.runtime.launcher.launch.oom_kills", lambda: 0)
    watch = _OomWatch(fit)
    monkeypatch.setattr("autoplan.runtime.launcher.launch.available_memory_bytes", lambda: (0.2 * GIB, 23 * GIB))
    watch.sample()
    line = watch.report(_procs(-signal.SIGTERM, 0, 0, 0, 0, -signal.SIGKILL, 0, 0))
    assert line.startswith("rank 5 was likely killed for lack of memory by the kernel's OOM killer"), line
    assert "estimated at 45.0 GiB" in line and "MemAvailable fell to 0.2 GiB of 23.0 GiB" in line
    # Memory never short and no OOM kill counted: a SIGKILL is only a SIGKILL (a user's kill -9).
    calm = _OomWatch(fit)
    monkeypatch.setattr("autoplan.runtime.launcher.launch.available_memory_bytes", lambda: (20 * GIB, 23 * GIB))
    calm.sample()
    assert calm.report(_procs(0, -signal.SIGKILL)) == ""
    # The kernel's own count rose: out of memory whatever was sampled.
    monkeypatch.setattr("autoplan.runtime.launcher.launch.oom_kills", lambda: 1)
    assert "likely killed for lack of memory" in calm.report(_procs(0, -signal.SIGKILL))
    assert calm.report(_procs(0, 1)) == ""  # no SIGKILL: nothing to add
    # A rank the launcher killed itself (frozen, or alive after the grace period) is not blamed on memory.
    both = calm.report(_procs(-signal.SIGKILL, -signal.SIGKILL), stopped_by_launcher={1: "stopped by the launcher"})
    assert both.startswith("rank 0 was likely killed"), both
    assert calm.report(_procs(0, -signal.SIGKILL), stopped_by_launcher={1: "stopped by the launcher"}) == ""


def test_start_up_shows_what_each_rank_is_doing(tmp_path):
    stream = io.StringIO()
    progress = _StartProgress(str(tmp_path), 3, stream=stream)
    progress.STATUS_EVERY_S = 0.0
    progress._next_status = 0.0
    _mark_phase(str(tmp_path), 0, "started")
    _mark_phase(str(tmp_path), 0, "connected")
    _mark_phase(str(tmp_path), 1, "started")
    progress()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("autoplan: launching 3 ranks")
    assert lines[-1].startswith("autoplan: starting 3 ranks, 0 s: "), lines
    assert "1 building stages" in lines[-1] and "1 joining the process group" in lines[-1]
    assert "1 importing torch" in lines[-1]
    for rank in range(3):
        for phase in ("started", "connected"):
            _mark_phase(str(tmp_path), rank, phase)
    progress._next_scan = 0.0
    progress()
    assert "3/3 ranks started (Python and torch imported)" in stream.getvalue()
    assert "3/3 ranks joined the process group" in stream.getvalue()


def test_on_a_terminal_the_status_is_one_line_rewritten_in_place(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = _StartProgress(str(tmp_path), 2, stream=stream)
    progress._next_status = 0.0
    progress()
    assert stream.getvalue().endswith("\r\033[Kautoplan: starting 2 ranks, 0 s: 2 importing torch")
    for rank in range(2):
        _mark_phase(str(tmp_path), rank, "started")
    progress._next_scan = 0.0
    progress()  # the line of a phase reached replaces the status line instead of following it
    assert "importing torch\r\033[Kautoplan: 2/2 ranks started" in stream.getvalue()
