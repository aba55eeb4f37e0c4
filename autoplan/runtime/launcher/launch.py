"""`run_plan`: train a plan (synthetic data, or `--data`), locally spawned or under torchrun.

Two ways in (docs/architecture.md, "Launch"):
- torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment): this process is one rank.
- `--nproc N`: spawn N local processes (gloo on CPU, NCCL with one GPU each) on a free loopback
  port (`ranks.LocalJob`: the ranks die with the launcher, log to files, beat). The launcher polls
  its children. When one fails (raises, exits non-zero, is killed by a signal, or stops beating),
  the others get a grace period to fail by themselves (every wait on a peer has a timeout, and a
  dead peer fails the wait at once), then are terminated (SIGTERM, then SIGKILL). The launcher
  prints one line naming the rank to blame and why (its error, exit code, signal, or where it
  stopped), how the others ended, and the rank logs, and returns 1. SIGTERM to the launcher kills
  the ranks and returns 143. A checkpoint directory is locked for the job (`preflight.CheckpointDirLock`).

Mistakes found before any process starts (missing plan, fingerprint mismatch, wrong world size,
bad numbers, unwritable outputs, a checkpoint of another model, a locked or unwritable checkpoint
directory, a machine that cannot hold the ranks: machine.py [Note: a GPU plan on a CPU machine])
raise ValueError with one line (preflight.py); `autoplan run` prints it and exits 2. While the ranks start, the
launcher says what they are doing (`_StartProgress`); a rank SIGKILLed while memory ran short is
reported as likely out of memory (`_OomWatch`).

The launcher is this module: spawning, the poll loop, what it says while the ranks start and when
one fails. The rest of a run lives beside it: the checks before anything is spawned
(preflight.py), one rank's training loop with its checkpoints and data (training.py), the process
group and its timeouts (rendezvous.py), and fault injection for tests (faults.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch

from autoplan.plan import Plan
from autoplan.runtime.execution.comm import P2PTimeout
from autoplan.runtime.launcher.machine import GIB, MachineFit, available_memory_bytes, oom_kills
from autoplan.runtime.launcher.optim_config import OptimizerConfig
from autoplan.runtime.launcher.preflight import check_run, print_note
from autoplan.runtime.launcher.ranks import LocalJob, one_line
from autoplan.runtime.launcher.rendezvous import (
    hosted_store,
    loopback_interface,
    loopback_process_group,
    startup_timeout,
)
from autoplan.runtime.launcher.training import check_clip_grad, train_rank

__all__ = ["run_plan"]

FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint",
                      "autoplan.runtime.api", "autoplan.runtime.launcher.launch", "autoplan.runtime.checkpoint")
"""Imported once by a forkserver (tests launching many short runs), not by every rank."""
DEFAULT_CHECKPOINT_EVERY = 500
"""Steps between checkpoints when only --checkpoint-dir is given: torchtitan's default interval
(`checkpoint.interval = 500`, torchtitan/config/job_config.py); a save also follows the last step."""


def _error(message: str) -> None:
    print(f"autoplan: error: {message}", file=sys.stderr, flush=True)


_PHASES = {"started": "ranks started (Python and torch imported)", "connected": "ranks joined the process group",
           "built": "ranks built their stages"}
"""What a spawned rank reports while it starts, in order; the launcher prints a line as all reach one."""
_DOING = {None: "importing torch", "started": "joining the process group", "connected": "building stages",
          "built": "at the first step"}
"""What a rank is doing after each phase (None: before the first), for the launcher's status line."""


def _mark_phase(run_dir: str, rank: int, phase: str) -> None:
    with contextlib.suppress(OSError):
        (Path(run_dir) / f"phase-{phase}-{rank}").touch()


class _StartProgress:
    """The seconds before the first step, on stderr: one line as all ranks reach each start-up phase
    (`_PHASES`), and, while they have not, what the ranks are doing ("3 importing torch, 5 building
    stages") with the seconds since launch: rewritten in place every second on a terminal, a new
    line every `STATUS_EVERY_S` elsewhere (a log gets a few lines, not one per poll)."""

    STATUS_EVERY_S = 5.0

    def __init__(self, run_dir: str, nproc: int, *, stream=None):
        self.run_dir, self.nproc = Path(run_dir), nproc
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self.pending = list(_PHASES)
        self._next_scan = 0.0
        self._next_status = self.start + (1.0 if self.tty else self.STATUS_EVERY_S)
        self._status_shown = False
        self._print(f"autoplan: launching {nproc} ranks ({'NCCL' if torch.cuda.is_available() else 'gloo'})")

    def _print(self, line: str) -> None:
        if self._status_shown:  # a terminal's status line is overwritten, not left above
            self.stream.write("\r\033[K")
            self._status_shown = False
        print(line, file=self.stream, flush=True)

    def phases(self) -> list[str | None]:
        """Each rank's latest phase (None: none reached yet)."""
        reached: list[str | None] = [None] * self.nproc
        names = {p.name for p in self.run_dir.glob("phase-*")}
        for phase in _PHASES:
            for rank in range(self.nproc):
                if f"phase-{phase}-{rank}" in names:
                    reached[rank] = phase
        return reached

    def status(self, reached: list[str | None]) -> str:
        counts: dict[str, int] = {}
        for phase in reached:
            counts[_DOING[phase]] = counts.get(_DOING[phase], 0) + 1
        doing = ", ".join(f"{n} {what}" for what, n in counts.items())
        return f"autoplan: starting {self.nproc} ranks, {time.monotonic() - self.start:.0f} s: {doing}"

    def __call__(self) -> None:
        now = time.monotonic()
        if not self.pending or now < self._next_scan:
            return
        self._next_scan = now + 0.25  # a glob of the run directory, not one per 50 ms poll
        reached = self.phases()
        order = list(_PHASES)
        while self.pending:
            phase = self.pending[0]
            if sum(1 for r in reached if r is not None and order.index(r) >= order.index(phase)) < self.nproc:
                break
            self.pending.pop(0)
            self._print(f"autoplan: {self.nproc}/{self.nproc} {_PHASES[phase]} after {now - self.start:.1f} s")
        if self.pending and now >= self._next_status:
            self._next_status = now + (1.0 if self.tty else self.STATUS_EVERY_S)
            if self.tty:
                self.stream.write("\r\033[K" + self.status(reached))
                self.stream.flush()
                self._status_shown = True
            else:
                self._print(self.status(reached))

    def finish(self) -> None:
        """End a terminal's status line (the ranks ended before all were built)."""
        if self._status_shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._status_shown = False


class _OomWatch:
    """Whether a rank killed by SIGKILL was likely killed for lack of memory: the launcher samples
    the free host memory while the ranks run (every 0.5 s) and reads the kernel's OOM-kill count
    before and after (machine.py `oom_kills`). Either a count that rose or free memory that fell
    under 5 % of the total (or half a GiB) says so, with the figures, on one line after the
    launcher's line naming the rank."""

    def __init__(self, fit: MachineFit | None):
        self.fit = fit
        self.kills_before = oom_kills()
        self.lowest_free: float | None = None
        self.total: float | None = None
        self._next = 0.0

    def sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if now < self._next and not force:
            return
        self._next = now + 0.5
        memory = available_memory_bytes()
        if memory is not None:
            free, self.total = memory
            self.lowest_free = free if self.lowest_free is None else min(self.lowest_free, free)

    def likely_oom(self) -> bool:
        kills = oom_kills()
        if kills is not None and self.kills_before is not None and kills > self.kills_before:
            return True
        return (self.lowest_free is not None and self.total is not None
                and self.lowest_free < max(0.05 * self.total, 0.5 * GIB))

    def report(self, procs: list, stopped_by_launcher: Mapping[int, str] = {}) -> str:  # noqa: B006 (read only)
        """The line printed for a job whose rank was SIGKILLed with memory short, else "". Ranks the
        launcher killed itself (frozen, or still alive after the grace period) are not counted."""
        killed = [r for r, p in enumerate(procs) if p.exitcode == -signal.SIGKILL and r not in stopped_by_launcher]
        if not killed or not self.likely_oom():
            return ""
        estimate = self.fit.estimate_bytes if self.fit is not None else None
        figures = []
        if estimate is not None:
            figures.append(f"the ranks were estimated at {estimate / GIB:.1f} GiB of host memory")
        if self.lowest_free is not None:
            figures.append(f"MemAvailable fell to {self.lowest_free / GIB:.1f} GiB of {self.total / GIB:.1f} GiB")
        ranks = ", ".join(map(str, killed))
        line = (f"rank{'s' if len(killed) > 1 else ''} {ranks} {'were' if len(killed) > 1 else 'was'} likely killed "
                f"for lack of memory by the kernel's OOM killer ({'; '.join(figures) or 'the kernel counted an OOM kill'}"
                f"); re-plan for this machine (`autoplan suggest ... --cluster 1xNxcpu --out p.json`) or run on GPUs")
        print_note(line)
        return line


def _spawned(rank: int, world_size: int, port: int, payload: dict, run_dir: str) -> None:
    """Entry of a rank the launcher spawned (through `ranks.LocalJob`, which ties it to the launcher,
    logs it and records its failure)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, loopback_interface())
    payload = dict(payload)
    plan = Plan.from_dict(payload.pop("plan"))
    _mark_phase(run_dir, rank, "started")
    for fault in payload["faults"]:
        if fault.kind == "slow-start" and fault.rank in (None, rank):
            time.sleep(fault.step)
    loopback_process_group(rank, world_size, port, startup_timeout(timedelta(seconds=payload["timeout_s"])))
    _mark_phase(run_dir, rank, "connected")
    train_rank(plan, **payload, on_phase=lambda phase: _mark_phase(run_dir, rank, phase))


class _Terminated(Exception):
    """The launcher got SIGTERM (a scheduler's stop, `kill`): handled as Ctrl-C is."""


@contextlib.contextmanager
def _sigterm_stops_the_job():
    """SIGTERM raises in the launcher's main thread, so that `LocalJob` kills the ranks on the way out
    (a process ended by SIGTERM's default action runs no cleanup)."""
    def handler(signum, frame):
        raise _Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: the caller owns signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_plan(plan: str | os.PathLike | Plan, *, model: str | None = None, steps: int = 10, nproc: int | None = None,
             trace_path: str | None = None, metrics_path: str | None = None, seed: int = 0, timeout_s: float = 60.0,
             lr: float = 1e-3, checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
             resume: bool = False, data: str | None = None, skip_nonfinite: int = 0, clip_grad: float | None = None,
             overwrite: bool = False, init: str | os.PathLike | None = None,
             allow_oversubscribe: bool = False, optimizer: OptimizerConfig | None = None,
             eval_every: int | None = None, eval_data: str | None = None, eval_batches: int = 10,
             _fail_at: tuple[int, int] | None = None, _fault: str | None = None,
             _grace_s: float = 10.0, _start_method: str = "spawn") -> int:
    """Train `plan` for `steps` steps with AdamW; returns the exit code (0, or 1 when a rank failed).

    A mistake found before any process starts (preflight.py) raises ValueError with one line;
    `autoplan run` prints it and exits 2.

    Data: synthetic batches from the model source (training.py), or `data`: a token file or a
    Hugging Face datasets directory (runtime/launcher/datasets.py `open_dataset`, checked against the model's
    vocabulary here), or a `file.py:function` with function(step, batch_size, seq_len) -> (inputs,
    target) of the global batch (`load_data_function`).

    The optimizer: AdamW with `optimizer`'s settings, weight-decay groups and learning-rate schedule
    (optim_config.py `OptimizerConfig`; default: `OptimizerConfig(lr=lr)`). `eval_every`: every N
    steps, the mean loss of `eval_batches` batches of `eval_data` (a dataset path or a function, as
    `data`), forward only, printed and written to the metrics as eval_loss.

    `model` overrides the plan's model spec. Without RANK/WORLD_SIZE in the environment, spawns
    `nproc` (default: the plan's GPU count) local processes, after checking that this machine holds
    them (machine.py [Note: a GPU plan on a CPU machine]: without CUDA, ranks whose estimated host
    memory exceeds what is free are refused unless `allow_oversubscribe`). `timeout_s` bounds every
    wait on a peer once the ranks run steps (while they start: at least STARTUP_TIMEOUT_S, see
    [Note: start-up and step timeouts]). `checkpoint_dir` saves a checkpoint every `checkpoint_every` steps (default
    DEFAULT_CHECKPOINT_EVERY) and after the last; `resume` continues from the newest good checkpoint
    in `checkpoint_dir` (`steps` is the total, so a run resumed at step 3 with steps=6 trains steps
    3, 4, 5); without it, a `checkpoint_dir` that holds checkpoints is refused, unless `overwrite`
    deletes them first (checkpoint/identity.py [Note: one job per checkpoint directory]). A step
    whose loss or gradients are not finite stops the run (exit 1, naming the step and the stages),
    unless fewer than `skip_nonfinite` such steps were skipped so far: then its
    optimizer step is skipped. An fp16 plan scales its loss (precision.py [Note: fp16 loss
    scaling]): a step whose gradients overflow is skipped and the scale halved, which is not counted
    against `skip_nonfinite`. `clip_grad`: clip the gradients' global norm to it every step
    (`PartitionedModel.clip_grad_norm_`; the norm goes to the metrics as grad_norm, and a non-finite
    norm is a non-finite step). `init`: pretrained weights to start from (a Hugging Face safetensors
    directory, a torch.save state dict or an autoplan checkpoint; each rank reads its slices,
    weights.py), checked against the model before any rank starts; a resumed checkpoint takes
    precedence. `metrics_path` is appended to, one JSON record per step tagged with
    this run's id. `_fail_at=(rank, step)` makes that rank raise before that step; `_fault`
    (default: $AUTOPLAN_FAULT) injects other faults (faults.py). `_grace_s`: how long the
    launcher lets the other ranks fail by themselves before it terminates them. `_start_method`:
    "spawn" (default) or "forkserver".
    """
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_clip_grad(clip_grad)
    if optimizer is None:
        optimizer = OptimizerConfig(lr=lr)
    elif not isinstance(optimizer, OptimizerConfig):
        raise TypeError(f"optimizer must be an OptimizerConfig, got {type(optimizer).__name__}")
    optimizer = optimizer.for_steps(steps) if _is_count(steps) else optimizer  # a bad --steps: check_run says so
    checked = check_run(plan, model=model, steps=steps, nproc=nproc, trace_path=trace_path, metrics_path=metrics_path,
                        seed=seed, timeout_s=timeout_s, lr=lr, checkpoint_dir=checkpoint_dir,
                        checkpoint_every=checkpoint_every, resume=resume, data=data, skip_nonfinite=skip_nonfinite,
                        allow_oversubscribe=allow_oversubscribe, fault=_fault, torchrun=torchrun, overwrite=overwrite,
                        init=init, eval_every=eval_every, eval_data=eval_data, eval_batches=eval_batches)
    plan, spec, nproc, faults, fit = checked.plan, checked.spec, checked.nproc, checked.faults, checked.fit
    checkpoint_dir, lock, resume_from = checked.checkpoint_dir, checked.lock, checked.resume_from
    if checkpoint_dir is not None and checkpoint_every is None:
        checkpoint_every = DEFAULT_CHECKPOINT_EVERY
        if int(os.environ.get("RANK", "0")) == 0:
            print_note(f"checkpoints into {checkpoint_dir} every {checkpoint_every} steps and after the last "
                  f"(--checkpoint-every K to change)")
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    payload = dict(spec=spec, steps=steps, seed=seed, timeout_s=float(timeout_s), trace_path=trace_path, data=data,
                   metrics_path=metrics_path, lr=lr, fail_at=_fail_at, checkpoint_dir=checkpoint_dir,
                   checkpoint_every=checkpoint_every, resume=resume, faults=faults, skip_nonfinite=skip_nonfinite,
                   run_id=run_id, resume_from=resume_from, clip_grad=clip_grad,
                   init=None if init is None else str(init), optim=optimizer, data_identity=checked.data_identity,
                   eval_every=eval_every, eval_data=eval_data, eval_batches=eval_batches)
    try:
        if torchrun:  # this process is one rank
            return _run_this_rank(plan, payload)
        if fit.note:
            print_note(fit.note)
        payload["plan"] = plan.to_dict()
        with _sigterm_stops_the_job(), hosted_store() as port, \
                LocalJob(nproc, start_method=_start_method, preload=FORKSERVER_PRELOAD) as job:
            try:
                progress = _StartProgress(job.run_dir, nproc)
                oom = _OomWatch(fit)
                job.start(_spawned, (nproc, port, payload, job.run_dir))
                code = job.supervise(grace_s=_grace_s, on_poll=lambda: (progress(), oom.sample()))
                progress.finish()
                if code:
                    oom.report(job.procs, stopped_by_launcher=job.stopped)
                return code
            except _Terminated:
                job.failed = True
                _error(f"stopped by SIGTERM; every rank was killed ({job.logs})")
                return 143
    finally:
        if lock is not None:
            lock.release()


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _run_this_rank(plan: Plan, payload: dict) -> int:
    """Under torchrun: train as the rank the environment names; one line on failure, naming the rank
    to blame ([Note: blame under torchrun])."""
    try:
        train_rank(plan, **payload)
    except Exception as exc:
        _error(_torchrun_failure(exc, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])))
        return 1
    return 0


_PEER_GONE = ("connection reset", "connection closed", "broken pipe", "connection refused", "end of file")
"""Words (lower case) of the errors a wait raises when the rank at the other end died."""
_PEER_SILENT = ("timed out", "timeout")
"""... and when it is alive but does not answer (hung, stopped, or far slower)."""
_PEER_RANK = re.compile(r"\b(?:from|to) rank (\d+)\b")
"""The peer a P2P wait names (runtime/execution/comm.py: "receive of F values ... from rank 1 failed: ...")."""


def _torchrun_failure(exc: BaseException, rank: int, world_size: int) -> str:
    """The line a rank prints under torchrun when its training failed.

    [Note: blame under torchrun] Under `--nproc` the launcher sees every rank end and names the one to
    blame (ranks.py [Note: blame]); under torchrun each rank only knows its own error. When a rank
    dies, its peers fail in their next wait on it ("Connection reset by peer"), and a peer that said
    "rank 0 failed: P2PTimeout ... Connection reset by peer" blamed itself while torchrun's summary
    named the dead rank (issue 43). A wait on a peer is never the cause: the line names the peer (the
    rank a P2P wait names, or the other rank of a world of 2) as the rank that failed first, and this
    rank as stopped because of it. A rank killed by a signal prints nothing; torchrun's summary gives
    its exit."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:  # the P2P error and what it was raised from
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(e).lower() for e in chain)
    # Only a wait on a peer: the runtime's P2P errors, torch.distributed's (DistBackendError, ...),
    # gloo's and NCCL's; a TimeoutError of the user's --data function is this rank's own failure.
    on_peer = any(isinstance(e, P2PTimeout) or type(e).__name__.startswith("Dist") for e in chain) or \
        any(word in text for word in ("gloo", "nccl", "by peer"))
    gone = on_peer and any(word in text for word in _PEER_GONE)
    if not gone and not (on_peer and any(word in text for word in _PEER_SILENT)):
        return f"rank {rank} failed: {one_line(exc)}"
    named = _PEER_RANK.search(str(exc))
    peer = int(named.group(1)) if named else (1 - rank if world_size == 2 else None)
    what = ("its connection was reset: it crashed or was killed, torchrun's summary gives how" if gone
            else "it did not answer in time: hung, stopped or slow")
    who = f"rank {peer}" if peer is not None and peer != rank else f"a peer of rank {rank}"
    return f"{who} failed first ({what}); rank {rank} stopped waiting on it: {one_line(exc)}"
