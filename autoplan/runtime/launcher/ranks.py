"""Local ranks owned by their launcher: `autoplan run --nproc N` and `autoplan calibrate --collectives`.

The launcher (`LocalJob`) spawns N processes and supervises them; each rank (`_rank_main`) first
ties itself to the launcher, then runs its target. What holds ([Note: who owns a local rank]):

- A rank dies with its launcher, however the launcher ends (SIGKILL included): the kernel sends it
  SIGKILL when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`), and a watchdog thread reads the
  launcher's end of a pipe (the "lifeline"), which reaches end-of-file only when the launcher is
  gone; the thread then SIGKILLs its own process. Two mechanisms because the first is Linux-only
  and follows the parent *process* that forked the rank (a forkserver, in tests), the second works
  everywhere but needs the rank's Python to run (a SIGSTOPped rank is still killed by the first).
- A rank's stderr (and, but for rank 0, its stdout) goes to `RUN_DIR/rank-R.log`; the terminal gets
  rank 0's step lines and the launcher's own lines, and a failed job prints one line naming the log
  directory, which is kept (it is removed after a clean run).
- A rank beats: a thread rewrites `RUN_DIR/heartbeat-R.json` every `HEARTBEAT_S` with the time and
  where the rank's main thread is (`Heartbeat.at`: the step and the pipeline action it is on). A
  frozen process (SIGSTOP, or stuck in native code holding the GIL) stops beating; a rank that only
  waits on a peer keeps beating, so the launcher can tell the rank that stopped from those waiting
  for it ([Note: blame]).
- Failures are recorded in `RUN_DIR/rank-R.json` (`fail_rank`) for the launcher's one line.

[Note: who owns a local rank]: torchrun's elastic agent does the same for the processes it starts
(it kills its workers when it exits, and names a failed worker's error file). A rank spawned by
`multiprocessing` has neither by default: `daemon=True` children are only terminated when the parent
exits *normally*, so a SIGKILLed launcher left its ranks training (issue "Faults and hostile input").
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["HEARTBEAT_S", "Heartbeat", "LocalJob", "current_heartbeat", "fail_rank", "logs_note", "one_line"]

HEARTBEAT_S = 0.5
"""How often a rank's heartbeat thread writes where the rank is."""
FROZEN_AFTER_S = 3.0
"""A live rank whose last heartbeat is older than this, when another rank fails, is frozen (six
beats missed; with a --timeout below this, a frozen rank is still named, as a stopped rank)."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_heartbeat: Heartbeat | None = None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def current_heartbeat() -> Heartbeat | None:
    """This rank's heartbeat when a `LocalJob` spawned it; None under torchrun or in one process."""
    return _heartbeat


# ---- the rank's side ------------------------------------------------------------------------------



def logs_note(run_dir: str | Path) -> str:
    """Where the ranks' logs are, or that there are none to read: ranks killed before their first line
    (while importing torch) leave empty files, and a folder of empty logs sends a user looking for
    nothing (issue 44)."""
    logs = sorted(Path(run_dir).glob("rank-*.log"))
    if any(p.stat().st_size > 0 for p in logs if p.exists()):
        return f"logs: {Path(run_dir) / 'rank-*.log'}"
    return "the ranks wrote no log (they were stopped before their first line, e.g. while importing torch)"

class Heartbeat:
    """Where this rank is, written by a daemon thread every HEARTBEAT_S (the main thread only
    assigns two attributes: nothing on the training path waits for a file)."""

    def __init__(self, run_dir: str, rank: int):
        self.path = Path(run_dir) / f"heartbeat-{rank}.json"
        self.step: int | None = None
        self.action: Any = "starting"
        self.count = 0
        """Calls of `at` since the step began: how far into its step the rank got."""
        self._thread = threading.Thread(target=self._beat, name="autoplan-heartbeat", daemon=True)
        self._thread.start()

    def at(self, step: int | None, action: Any) -> None:
        """`action`: a phrase ("in the optimizer step") or a pipeline `Action` (formatted by the
        thread, off the training path)."""
        self.count = self.count + 1 if step == self.step else 0
        self.step, self.action = step, action

    def _beat(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        while True:
            action = self.action
            text = action if isinstance(action, str) else f"pipeline action {action}"
            with contextlib.suppress(Exception):  # a beat that fails must not end the thread
                tmp.write_text(json.dumps({"time": time.time(), "pid": os.getpid(), "step": self.step,
                                           "count": self.count, "action": text}))
                os.replace(tmp, self.path)
            time.sleep(HEARTBEAT_S)


def _die_with_launcher(lifeline) -> None:
    """[Note: who owns a local rank]."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                lifeline.recv()  # the launcher never sends; recv returns only at its end
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="autoplan-lifeline", daemon=True).start()


def _log_to(path: Path, *, keep_stdout: bool) -> None:
    """Point this process's stderr (and stdout unless kept) at `path`, at the file-descriptor level so
    that native code (gloo, NCCL, C++ warnings) writes there too."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    if not keep_stdout:
        os.dup2(fd, 1)
    os.close(fd)


def _no_multiprocess_locks() -> None:
    """tqdm (imported by libraries the ranks load) makes a multiprocessing RLock for bars shared
    across child processes; a rank has no children, and the lock's semaphore, registered with the
    launcher's resource tracker, was reported as "leaked" after every failed run (a rank leaves with
    os._exit). A rank's bars need only the thread lock."""
    with contextlib.suppress(ImportError):
        import tqdm.std

        tqdm.std.TqdmDefaultWriteLock.mp_lock = None


def _rank_main(target: Callable[..., None], rank: int, run_dir: str, lifeline, args: tuple) -> None:
    """Entry of a spawned rank: tie it to the launcher, log and beat, run `target(rank, *args)`.
    Any failure is recorded and the rank leaves at once (`fail_rank`); a finished rank leaves with
    os._exit(0): every file is written and closed, and the interpreter's teardown, where C++
    destructors of torch's thread pools once aborted a finished rank ("terminate called without an
    active exception", SIGABRT, seen once in about a hundred CPU runs), is skipped."""
    global _heartbeat
    try:
        _die_with_launcher(lifeline)
        _log_to(Path(run_dir) / f"rank-{rank}.log", keep_stdout=rank == 0)
        _no_multiprocess_locks()
        # Stacks on demand: the launcher sends SIGUSR1 before it stops a rank that did not end by
        # itself, so the log says where every thread was waiting.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        _heartbeat = Heartbeat(run_dir, rank)
        target(rank, *args)
    except BaseException as exc:  # noqa: BLE001 - a rank reports everything, KeyboardInterrupt included
        fail_rank(rank, run_dir, exc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fail_rank(rank: int, run_dir: str, exc: BaseException) -> None:
    """Record a spawned rank's failure where the launcher reads it, log one line, exit 1 at once (no
    teardown that could wait on a dead peer)."""
    line = one_line(exc)
    with contextlib.suppress(OSError):
        tmp = Path(run_dir) / f"rank-{rank}.json.tmp"
        tmp.write_text(json.dumps({"time": time.time(), "error": line}))
        os.replace(tmp, Path(run_dir) / f"rank-{rank}.json")
    if not isinstance(exc, KeyboardInterrupt):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)  # into the rank's log
    print(f"autoplan: error: rank {rank} failed: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


# ---- the launcher's side --------------------------------------------------------------------------


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _error(message: str) -> None:
    print(f"autoplan: error: {message}", file=sys.stderr, flush=True)


def read_heartbeat(run_dir: str | Path, rank: int) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((Path(run_dir) / f"heartbeat-{rank}.json").read_text())
    return None


def _where(beat: dict[str, Any] | None) -> str:
    if beat is None:
        return "before it started"
    step = beat.get("step")
    return f"at step {step}, {beat['action']}" if step is not None else str(beat.get("action"))


def _progress(beat: dict[str, Any] | None) -> tuple[int, int]:
    """How far a rank got, by its last heartbeat: (step, actions into the step)."""
    if beat is None:
        return (-2, 0)
    return (-1 if beat.get("step") is None else beat["step"], beat.get("count", 0))


class LocalJob:
    """N local ranks of one job, owned by this process (module docstring). Use as a context manager:
    leaving it, however (a return, an exception, KeyboardInterrupt), kills every rank still alive."""

    def __init__(self, nproc: int, *, start_method: str = "spawn", name: str = "autoplan-rank",
                 preload: tuple[str, ...] = ()):
        self.nproc, self.name = nproc, name
        self.ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver" and preload:  # a no-op once the server runs
            self.ctx.set_forkserver_preload(list(preload))
        self.run_dir = tempfile.mkdtemp(prefix=f"{name}-")
        self.procs: list = []
        self._lifeline = None
        self.failed = False
        self.stopped: dict[int, str] = {}
        """Ranks the launcher stopped itself (rank -> how), filled by `supervise`: their SIGKILL is not a
        crash, nor the kernel's OOM killer."""

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
        for p in self.procs:
            if p.pid is not None:
                p.join(5)
        if self._lifeline is not None:
            self._lifeline.close()
        if not self.failed and exc[0] is None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def logs(self) -> str:
        return logs_note(self.run_dir)

    def start(self, target: Callable[..., None], args: tuple) -> None:
        """Start rank r as `target(r, *args)` (a module-level function: spawn pickles it)."""
        reader, self._lifeline = self.ctx.Pipe(duplex=False)
        self.procs = [self.ctx.Process(target=_rank_main, args=(target, r, self.run_dir, reader, args), daemon=True,
                                       name=f"{self.name}-{r}") for r in range(self.nproc)]
        for p in self.procs:
            p.start()
        reader.close()  # only the ranks hold the reading end: it sees EOF when this process is gone

    def supervise(self, grace_s: float, poll_s: float = 0.05, on_poll: Callable[[], None] | None = None) -> int:
        code = supervise(self.procs, self.run_dir, grace_s, poll_s, on_poll, stopped=self.stopped)
        self.failed = code != 0
        return code


def _frozen_ranks(procs: list, run_dir: str, now: float) -> dict[int, str]:
    """Live ranks whose heartbeat stopped: rank -> how long ago and where ([Note: blame])."""
    frozen = {}
    for r, p in enumerate(procs):
        beat = read_heartbeat(run_dir, r)
        if p.exitcode is None and beat is not None and now - beat["time"] > FROZEN_AFTER_S:
            frozen[r] = (f"stopped making progress: no heartbeat for {now - beat['time']:.0f} s (the last one: "
                         f"{_where(beat)})")
    return frozen


def supervise(procs: list, run_dir: str, grace_s: float, poll_s: float = 0.05,
              on_poll: Callable[[], None] | None = None, stopped: dict[int, str] | None = None) -> int:
    """Wait for the ranks; on the first failure give the rest `grace_s` to end, then stop them.

    Prints one line naming the rank to blame and why, and the log directory; returns 0 or 1.

    [Note: blame] When a rank fails, its peers fail after it, of P2P or collective timeouts or of
    "connection closed" errors, so the rank to name is not the first error: in order, (1) a rank
    killed by a signal (its peers fail because it died), (2) the earliest recorded error that is not
    a wait on a peer (a timeout, a closed connection), (3) a live rank whose heartbeat stopped
    (SIGSTOP, a native deadlock: its peers time out waiting for it, and it never fails by itself),
    (4) the live rank the launcher had to stop that got least far by its heartbeat (alive but not
    progressing: hung in Python, its heartbeat still beating), (5) the earliest recorded error.
    """
    from multiprocessing.connection import wait

    first_seen: dict[int, float] = {}  # rank -> when the launcher saw it end non-zero
    stopped = {} if stopped is None else stopped  # rank -> how the launcher stopped it (the caller may read it)
    frozen: dict[int, str] = {}  # rank -> its stalled heartbeat, seen at the first failure
    failure_at = term_at = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        now = time.monotonic()
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0) and r not in first_seen:
                first_seen[r] = now
        if not alive:
            break
        if on_poll is not None and not first_seen:
            on_poll()
        if first_seen and failure_at is None:
            failure_at = now
            frozen = _frozen_ranks(procs, run_dir, time.time())
            for r in frozen:  # nothing to wait for: it cannot fail by itself
                stopped[r] = "stopped by the launcher"
                procs[r].kill()
        if failure_at is not None and term_at is None and now - failure_at >= grace_s:
            term_at = now
            for p in alive:  # their stacks into their logs first ([Note: blame])
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGUSR1)
            wait([p.sentinel for p in alive], timeout=0.5)
            for r, p in enumerate(procs):
                if p.exitcode is None:
                    stopped[r] = f"stopped by the launcher {grace_s:.0f} s after the failure"
                    p.terminate()
        if term_at is not None and now - term_at >= 3.0:
            for p in alive:
                p.kill()
        wait([p.sentinel for p in alive], timeout=poll_s)
    for p in procs:
        p.join()
    if not first_seen:
        return 0

    errors: dict[int, dict] = {}
    for r in first_seen:
        with contextlib.suppress(OSError, ValueError):
            errors[r] = json.loads((Path(run_dir) / f"rank-{r}.json").read_text())
    primary, head = _blame(procs, first_seen, stopped, frozen, errors, run_dir)

    def reason(r: int) -> str:
        code = procs[r].exitcode
        if r in stopped:
            return stopped[r]
        if r in errors and code == 1:
            text = errors[r]["error"]
            if r != primary and primary in errors and text == errors[primary]["error"]:
                return "exit code 1, the same error"
            return f"exit code 1, {text[:160] + '...' if len(text) > 160 else text}"
        return _how(code)

    others = [f"rank {r}: {reason(r)}" for r in range(len(procs)) if r != primary and r in first_seen]
    ok = [r for r in range(len(procs)) if r not in first_seen]
    tail = "; ".join(others + ([f"ranks {', '.join(map(str, ok))} exited cleanly"] if ok else []))
    _error(head + (f" (then {tail})" if tail else "") + "; " + logs_note(run_dir))
    return 1


_WAITS = ("timeout", "timed out", "connection closed", "connection reset", "broken pipe", "monitoredbarrier")
"""Words (lower case) of the errors a rank raises because a peer died or stopped: never the cause."""


def _waited(error: dict) -> bool:
    text = error["error"].lower()
    return any(w in text for w in _WAITS)


def _blame(procs: list, first_seen: dict[int, float], stopped: dict[int, str], frozen: dict[int, str],
           errors: dict[int, dict], run_dir: str) -> tuple[int, str]:
    """The rank to name and the head of the line ([Note: blame] in `supervise`)."""
    signalled = [r for r in first_seen if r not in stopped and procs[r].exitcode < 0]
    if signalled:
        r = min(signalled, key=lambda r: (first_seen[r], r))
        return r, f"rank {r} was {_how(procs[r].exitcode)}"
    failed = {r: e for r, e in errors.items() if r not in stopped and procs[r].exitcode == 1}
    causes = [r for r, e in failed.items() if not _waited(e)]
    if causes:
        r = min(causes, key=lambda r: (failed[r]["time"], r))
        return r, f"rank {r} failed: {failed[r]['error']}"
    if frozen:
        r = min(frozen)
        return r, f"rank {r} {frozen[r]}"
    hung = [r for r in stopped if r not in frozen]
    if failed and hung:  # the one that got least far, by its heartbeat
        beats = {r: read_heartbeat(run_dir, r) for r in hung}
        r = min(hung, key=lambda r: (_progress(beats[r]), r))
        return r, f"rank {r} stopped making progress {_where(beats[r])} (alive, its peers timed out)"
    if failed:
        r = min(failed, key=lambda r: (failed[r]["time"], r))
        return r, f"rank {r} failed: {failed[r]['error']}"
    r = min(first_seen, key=lambda r: (first_seen[r], r))
    code = procs[r].exitcode
    return r, f"rank {r} was {_how(code)}" if code < 0 else f"rank {r} exited with code {code}"
