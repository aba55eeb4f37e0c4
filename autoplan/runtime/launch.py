"""`run_plan`: train a plan for a few steps (synthetic data, or `--data`), locally spawned or under torchrun.

Two ways in (DESIGN.md, "Launch"):
- torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment): this process is one rank.
- `--nproc N`: spawn N local processes (gloo on CPU, NCCL with one GPU each) on a free port. The
  launcher polls its children. When one fails (raises, exits non-zero, or is killed by a signal),
  the others get a grace period to fail by themselves (every wait on a peer has a timeout, and a
  dead peer fails the wait at once), then are terminated (SIGTERM, then SIGKILL). The launcher
  prints one line naming the rank that failed first and why (its error, exit code or signal), and
  how the others ended, and returns 1.

Mistakes found before any communication (missing plan, fingerprint mismatch, wrong world size,
TP plans, a checkpoint of another model) print one line and return 2.

Checkpoints and resume (docs/reliability.md): with `checkpoint_dir` and `checkpoint_every=K`,
every K steps (and after the last step) the ranks save their stages' parameters and AdamW state
under the model's own names through torch.distributed.checkpoint (`checkpoint.save_checkpoint`:
shards as shards, replicated tensors once); with `resume`, training continues from the newest
complete checkpoint, saved under this plan or any other plan of the same model. Synthetic data
comes from the model source (`ModelSource.batch`: inputs of the shapes, dtypes and value ranges of
the model's example inputs, and a target for its loss) and is a pure function of (seed, step), so
a resumed run sees exactly the batches a straight run would.

Fault injection for tests: `_fault` (or the environment variable AUTOPLAN_FAULT), entries
separated by ';', each `KIND@RANK:STEP[:N]` with RANK a number or '*' (every rank):
- `raise@R:S`            rank R raises RuntimeError before step S (0-based)
- `kill@R:S`             rank R SIGKILLs itself before step S
- `hang@R:S`             rank R sleeps forever before step S (its peers' timeouts must fire)
- `kill-mid-step@R:S:N`  rank R SIGKILLs itself at its N-th (1-based) P2P transfer of step S
                         (or after its pipeline work of that step, if it has fewer)
- `kill-in-checkpoint@R:S`  rank R SIGKILLs itself halfway through writing its DCP data file
                         (`__R_0.distcp`) of the checkpoint of step S (S = steps completed)
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from autoplan.plan import Plan, PlanError

__all__ = ["fail_rank", "free_port", "load_data_function", "run_plan", "supervise", "synthetic_batch"]

FAULT_ENV = "AUTOPLAN_FAULT"
_FAULT_KINDS = ("raise", "kill", "hang", "kill-mid-step", "kill-in-checkpoint")
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "autoplan.runtime",
                      "autoplan.runtime.checkpoint")
"""Imported once by a forkserver (tests launching many short runs), not by every rank."""


def _error(message: str) -> None:
    print(f"autoplan: error: {message}", file=sys.stderr, flush=True)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(plan: Plan, spec: str) -> None:
    """Everything that can be checked before a process is spawned: the model builds, is the one
    the plan was made for (structure, and the file it comes from), and takes the plan's inputs."""
    from autoplan.graph.source import parse_source
    from autoplan.runtime.api import check_model

    try:
        source = parse_source(spec)
    except ValueError:
        if spec == plan.model and ":" not in spec and not spec.endswith(".py"):
            raise ValueError(f"the plan was made for an nn.Module passed to the Python API ({spec!r}); run it with "
                             f"autoplan.partition(module, plan, example_inputs=...) or name a model with --model") from None
        raise
    digest = source.file_digest()
    if plan.model_digest and digest and digest != plan.model_digest and spec == plan.model:
        raise ValueError(f"{spec} changed since the plan was made (sha256 {digest[:12]}, the plan has "
                         f"{plan.model_digest[:12]}); re-plan with `autoplan suggest --model {spec} ... --out`")
    source.check_seq_len(plan.job.seq_len)
    # With tp > 1 this traces the model as partition does, for the layout the profile found.
    check_model(source.build("meta"), plan, source.example_inputs(plan.micro_batch_size, plan.job.seq_len,
                                                                  device="meta"), source=source)


def synthetic_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) of training step `step` for a token model: `graph.source.token_batch`."""
    from autoplan.graph.source import token_batch

    return token_batch(seed, step, batch, seq_len, vocab)


# ---- fault injection (tests) ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Fault:
    kind: str
    rank: int | None  # None: every rank
    step: int
    n: int = 1

    def hits(self, kind: str, rank: int, step: int) -> bool:
        return self.kind == kind and self.step == step and (self.rank is None or self.rank == rank)


def _parse_faults(text: str | None) -> tuple[_Fault, ...]:
    faults = []
    for entry in (text or "").replace(",", ";").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        try:
            kind, _, where = entry.partition("@")
            parts = where.split(":")
            if kind not in _FAULT_KINDS or len(parts) not in (2, 3):
                raise ValueError
            rank = None if parts[0] == "*" else int(parts[0])
            faults.append(_Fault(kind, rank, int(parts[1]), int(parts[2]) if len(parts) == 3 else 1))
        except ValueError:
            raise ValueError(f"bad fault {entry!r} in {FAULT_ENV}; expected KIND@RANK:STEP[:N] with KIND one of "
                             f"{', '.join(_FAULT_KINDS)}") from None
    return tuple(faults)


def _sigkill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# ---- one rank --------------------------------------------------------------------------------------


def load_data_function(data: str, plan: Plan, *, check: bool = True):
    """The user's `file.py:function` that makes step k's global batch: `function(step, batch_size,
    seq_len) -> (inputs, target)`, inputs a tensor or a tuple of the model's forward arguments.
    With `check` (the launcher, before any process is spawned) it is called for step 0 and its
    batch is checked: two parts, and every tensor of the global batch's rows."""
    from autoplan.graph import zoo

    if ".py:" not in data:
        raise ValueError(f"--data {data!r} must name path/to/file.py:FUNCTION")
    spec = zoo.parse_model_spec(data)
    fn = zoo.load_function(spec)
    if not check:
        return fn
    rows = plan.job.global_batch
    try:
        result = fn(0, rows, plan.job.seq_len)
    except Exception as exc:
        raise ValueError(f"--data {data}: {spec.function}(0, {rows}, {plan.job.seq_len}) raised "
                         f"{_one_line(exc)}") from None
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise ValueError(f"--data {data}: {spec.function}(step, batch_size, seq_len) must return (inputs, target), "
                         f"got {type(result).__name__}")
    inputs, target = result
    tensors = [*(inputs if isinstance(inputs, tuple | list) else (inputs,)), target]
    wrong = [t.shape[0] for t in tensors if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] != rows]
    if wrong:
        raise ValueError(f"--data {data}: step 0's batch has {wrong[0]} rows; it must be the global batch of "
                         f"{rows} (each dp replica takes its rows)")
    return fn


def _batch_fn(pm, data: str | None, plan: Plan, seed: int):
    """step -> (inputs tuple, target) of the global batch: the user's data, else the source's."""
    if data is not None:
        fn = load_data_function(data, plan, check=False)  # the launcher checked it

        def user_batch(step: int):
            inputs, target = fn(step, plan.job.global_batch, plan.job.seq_len)
            return (tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)), target

        return user_batch
    out = pm.output_template  # None where the source knows its target without the output's shape
    shape, dtype = (out.shape, out.dtype) if out is not None else ((), torch.float32)
    return lambda step: pm.source.batch(seed, step, plan.job.global_batch, plan.job.seq_len, shape, dtype)


def _train(plan: Plan, spec: str, steps: int, seed: int, timeout_s: float, trace_path: str | None,
           metrics_path: str | None, lr: float, fail_at: tuple[int, int] | None = None, data: str | None = None,
           checkpoint_dir: str | None = None, checkpoint_every: int | None = None, resume: bool = False,
           faults: tuple[_Fault, ...] = (), on_phase=None) -> None:
    import torch.distributed as dist

    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime.api import default_device, init_distributed, partition

    timeout = timedelta(seconds=timeout_s)
    init_distributed(timeout)
    rank = dist.get_rank()
    device = default_device()
    pm = partition(spec, plan, device=device, seed=seed, timeout=timeout)
    if on_phase is not None:
        on_phase("built")
    # torch's fused AdamW: one pass over each parameter (as Megatron's fused Adam). The default
    # foreach version measured 3.5x the memory-bound time on an H100 (docs/status.md); on CPU the
    # default per-tensor loop took 8-9x the fused step for 65M parameters on one thread (0.56-0.63 s
    # against 0.062-0.075 s, `python benchmarks/optimizer_cpu.py`): the step's tail, on the critical path.
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=lr, fused=True)
    make_batch = _batch_fn(pm, data, plan, seed)
    loss_src = plan.rank(plan.pp - 1, 0, 0)

    start_step = 0
    if resume and checkpoint_dir:
        # Rank 0 picks the checkpoint so every rank resumes from the same one.
        chosen = [str(ckpt.latest_checkpoint(checkpoint_dir) or "") if rank == 0 else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(chosen, src=0)
        if chosen[0]:
            loaded = ckpt.load_checkpoint(chosen[0])
            same_layout = loaded.manifest.get("world_size") == dist.get_world_size()
            start_step = ckpt.restore(loaded, pm, optimizer, strict=True, rank=rank if same_layout else None)
            if rank == 0:
                print(f"resumed from {chosen[0]} (step {start_step})", flush=True)
        elif rank == 0:
            print(f"no complete checkpoint in {checkpoint_dir}; starting from step 0", flush=True)

    step_box = [start_step]
    mid_step = [f for f in faults if f.kind == "kill-mid-step" and (f.rank is None or f.rank == rank)]
    if mid_step:
        ops = [0]

        def hook(*_args) -> None:
            for f in mid_step:
                if f.step == step_box[0]:
                    ops[0] += 1
                    if ops[0] >= f.n:
                        _sigkill_self()

        pm.executor.comm.op_hook = hook

    clock_offset = time.time() - time.perf_counter()  # perf_counter -> epoch seconds, comparable across ranks
    events = []
    metrics = []
    for step in range(start_step, steps):
        step_box[0] = step
        if (fail_at is not None and fail_at == (rank, step)) or any(f.hits("raise", rank, step) for f in faults):
            raise RuntimeError(f"injected failure at step {step}")
        if any(f.hits("kill", rank, step) for f in faults):
            _sigkill_self()
        if any(f.hits("hang", rank, step) for f in faults):
            while True:
                time.sleep(3600)
        inputs, targets = make_batch(step)
        start = time.perf_counter()
        loss = pm.step(*inputs, target=targets)
        if any(f.hits("kill-mid-step", rank, step) for f in faults):
            _sigkill_self()  # fewer P2P transfers than asked for: die before the collectives
        optimizer_start = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time_s = time.perf_counter() - start
        tail = [*pm.last_reductions, ("OPTIMIZER", optimizer_start, start + step_time_s)]
        # One collective: the loss (only its owner contributes) and the slowest rank's step time.
        report = torch.tensor([float(loss) if rank == loss_src else -float("inf"), step_time_s], device=device)
        dist.all_reduce(report, op=dist.ReduceOp.MAX)
        loss_value, step_time_s = float(report[0]), float(report[1])
        events += [(str(r.action), r.start_s + clock_offset, r.end_s + clock_offset, step) for r in pm.last_trace]
        events += [(phase, a + clock_offset, b + clock_offset, step) for phase, a, b in tail]
        if rank == 0:
            print(f"step {step}  loss {loss_value:.4f}  step {step_time_s:.3f} s  "
                  f"predicted {plan.predicted.step_time_s:.3f} s", flush=True)
            metrics.append({"step": step, "loss": loss_value, "step_time_s": step_time_s,
                            "predicted_step_time_s": plan.predicted.step_time_s})
            if metrics_path:  # rewritten every step: a run that dies later keeps what it measured
                Path(metrics_path).write_text("".join(json.dumps(m) + "\n" for m in metrics))
        done = step + 1
        if checkpoint_dir and checkpoint_every and (done % checkpoint_every == 0 or done == steps):
            path = ckpt.save_checkpoint(
                checkpoint_dir, done, pm, optimizer, timeout=timeout,
                extra={"seed": seed, "model": spec, "model_fingerprint": plan.model_fingerprint, "pp": plan.pp,
                       "dp": plan.dp, "tp": plan.tp},
                _kill_midway=any(f.hits("kill-in-checkpoint", rank, done) for f in faults))
            if rank == 0:
                print(f"checkpoint {path}", flush=True)
    if trace_path:
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(events, gathered, dst=0)
        if rank == 0:
            _write_trace(trace_path, gathered)
    if rank == 0 and metrics_path:
        Path(metrics_path).write_text("".join(json.dumps(m) + "\n" for m in metrics))
    dist.barrier()
    dist.destroy_process_group()


def _write_trace(path: str, per_rank: list) -> None:
    """Chrome trace (chrome://tracing, Perfetto): one row per rank, one box per action."""
    t0 = min((e[1] for events in per_rank for e in events), default=0.0)
    trace = [{"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": (start - t0) * 1e6,
              "dur": (end - start) * 1e6, "args": {"step": step}}
             for rank, events in enumerate(per_rank) for name, start, end, step in events]
    trace += [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in range(len(per_rank))]
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))


_PHASES = {"started": "ranks started (Python and torch imported)", "built": "ranks built their stages"}
"""What a spawned rank reports while it starts, in order; the launcher prints a line as all reach one."""


def _mark_phase(run_dir: str, rank: int, phase: str) -> None:
    with contextlib.suppress(OSError):
        (Path(run_dir) / f"phase-{phase}-{rank}").touch()


class _StartProgress:
    """Prints one line to stderr as all ranks reach each start-up phase (`_PHASES`), so the seconds
    before the first step are not silent."""

    def __init__(self, run_dir: str, nproc: int):
        self.run_dir, self.nproc = Path(run_dir), nproc
        self.start = time.monotonic()
        self.pending = list(_PHASES)
        print(f"autoplan: launching {nproc} ranks ({'NCCL' if torch.cuda.is_available() else 'gloo'})",
              file=sys.stderr, flush=True)

    def __call__(self) -> None:
        while self.pending:
            phase = self.pending[0]
            done = sum(1 for _ in self.run_dir.glob(f"phase-{phase}-*"))
            if done < self.nproc:
                return
            self.pending.pop(0)
            print(f"autoplan: {self.nproc}/{self.nproc} {_PHASES[phase]} after {time.monotonic() - self.start:.1f} s",
                  file=sys.stderr, flush=True)


def _spawned(rank: int, world_size: int, port: int, payload: dict, error_dir: str) -> None:
    """Entry of a spawned rank: on any failure, record it, print one line, and exit 1 at once
    (os._exit: no interpreter teardown that could wait on a dead peer)."""
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        payload = dict(payload)
        plan = Plan.from_dict(payload.pop("plan"))
        _mark_phase(error_dir, rank, "started")
        _train(plan, **payload, on_phase=lambda phase: _mark_phase(error_dir, rank, phase))
    except BaseException as exc:  # noqa: BLE001 - a rank reports everything, KeyboardInterrupt included
        fail_rank(rank, error_dir, exc)
    sys.stdout.flush()
    sys.stderr.flush()
    # Done (the process group is destroyed, every file written and closed): leave without the
    # interpreter's teardown, where C++ destructors of torch's thread pools occasionally abort a
    # finished rank ("terminate called without an active exception", SIGABRT; seen once in about
    # a hundred CPU runs).
    os._exit(0)


def fail_rank(rank: int, error_dir: str, exc: BaseException) -> None:
    """Record a spawned rank's failure where `supervise` reads it, print one line, exit 1 at once."""
    line = _one_line(exc)
    try:
        record = json.dumps({"time": time.time(), "error": line})
        tmp = Path(error_dir) / f"rank-{rank}.json.tmp"
        tmp.write_text(record)
        os.replace(tmp, Path(error_dir) / f"rank-{rank}.json")
    except OSError:
        pass
    print(f"autoplan: error: rank {rank} failed: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


# ---- the launcher ----------------------------------------------------------------------------------


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def supervise(procs: list, error_dir: str, grace_s: float, poll_s: float = 0.05, on_poll=None) -> int:
    """Wait for the ranks; on the first failure give the rest `grace_s` to end, then stop them.

    Prints one line naming the first failing rank and its reason; returns 0 or 1.
    """
    from multiprocessing.connection import wait

    first_seen: dict[int, float] = {}  # rank -> when the launcher saw it end non-zero
    stopped: dict[int, str] = {}  # rank -> how the launcher stopped it
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
        if failure_at is not None and term_at is None and now - failure_at >= grace_s:
            term_at = now
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
            errors[r] = json.loads((Path(error_dir) / f"rank-{r}.json").read_text())
    failed = [r for r in first_seen if r not in stopped]
    if not failed:
        failed = list(first_seen)
    # The rank that failed first: one killed by a signal (its peers fail *because* it died), else
    # the earliest recorded error, else the first the launcher saw.
    signalled = [r for r in failed if procs[r].exitcode < 0]
    if signalled:
        primary = min(signalled, key=lambda r: (first_seen[r], r))
    elif any(r in errors for r in failed):
        primary = min((r for r in failed if r in errors), key=lambda r: (errors[r]["time"], r))
    else:
        primary = min(failed, key=lambda r: (first_seen[r], r))

    def reason(r: int) -> str:
        code = procs[r].exitcode
        if r in stopped:
            return stopped[r]
        if r in errors and code == 1:
            text = errors[r]["error"]
            return f"exit code 1, {text[:160] + '...' if len(text) > 160 else text}"
        return _how(code)

    code = procs[primary].exitcode
    if primary in errors and code == 1:
        head = f"rank {primary} failed: {errors[primary]['error']}"
    elif code < 0:
        head = f"rank {primary} was {_how(code)}"
    else:
        head = f"rank {primary} exited with code {code}"
    others = [f"rank {r}: {reason(r)}" for r in range(len(procs)) if r != primary and r in first_seen]
    ok = [r for r in range(len(procs)) if r not in first_seen]
    tail = "; ".join(others + ([f"ranks {', '.join(map(str, ok))} exited cleanly"] if ok else []))
    _error(f"{head}" + (f" (then {tail})" if tail else ""))
    return 1


def run_plan(plan: str | os.PathLike | Plan, *, model: str | None = None, steps: int = 10, nproc: int | None = None,
             trace_path: str | None = None, metrics_path: str | None = None, seed: int = 0, timeout_s: float = 60.0,
             lr: float = 1e-3, checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
             resume: bool = False, data: str | None = None, _fail_at: tuple[int, int] | None = None,
             _fault: str | None = None,
             _grace_s: float = 10.0, _start_method: str = "spawn") -> int:
    """Train `plan` for `steps` steps with AdamW; returns the exit code.

    Data: synthetic batches from the model source (module docstring), or `data`, a
    `file.py:function` with function(step, batch_size, seq_len) -> (inputs, target) of the global
    batch (`load_data_function`).

    `model` overrides the plan's model spec. Without RANK/WORLD_SIZE in the environment, spawns
    `nproc` (default: the plan's GPU count) local processes. `timeout_s` bounds every wait on a
    peer. `checkpoint_dir` + `checkpoint_every=K` save a checkpoint every K steps and after the
    last; `resume` continues from the newest complete checkpoint in `checkpoint_dir` (`steps` is
    the total, so a run resumed at step 3 with steps=6 trains steps 3, 4, 5). `_fail_at=(rank,
    step)` makes that rank raise before that step; `_fault` (default: $AUTOPLAN_FAULT) injects
    other faults (module docstring). `_grace_s`: how long the launcher lets the other ranks fail by
    themselves before it terminates them. `_start_method`: "spawn" (default) or "forkserver".
    """
    try:
        plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        spec = model or plan.model
        if steps < 1:
            raise ValueError(f"--steps {steps} must be at least 1")
        _check(plan, spec)
        if data is not None:
            load_data_function(data, plan)
        faults = _parse_faults(os.environ.get(FAULT_ENV) if _fault is None else _fault)
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every {checkpoint_every} must be at least 1")
        if (checkpoint_every is not None or resume) and not checkpoint_dir:
            raise ValueError("--checkpoint-every and --resume need --checkpoint-dir DIR")
        if checkpoint_dir is not None:
            checkpoint_dir = str(checkpoint_dir)
            if Path(checkpoint_dir).exists() and not Path(checkpoint_dir).is_dir():
                raise ValueError(f"--checkpoint-dir {checkpoint_dir!r} exists and is not a directory")
            if resume:
                _check_resumable(plan, checkpoint_dir)
    except (PlanError, ValueError) as exc:
        _error(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        return 2
    payload = dict(spec=spec, steps=steps, seed=seed, timeout_s=timeout_s, trace_path=trace_path, data=data,
                   metrics_path=metrics_path, lr=lr, fail_at=_fail_at, checkpoint_dir=checkpoint_dir,
                   checkpoint_every=checkpoint_every, resume=resume, faults=faults)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != plan.num_gpus:
            _error(f"the plan needs {plan.num_gpus} ranks but WORLD_SIZE is {world_size}")
            return 2
        try:
            _train(plan, **payload)
        except Exception as exc:
            _error(f"rank {os.environ['RANK']} failed: {_one_line(exc)}")
            return 1
        return 0
    nproc = plan.num_gpus if nproc is None else nproc
    if nproc != plan.num_gpus:
        _error(f"--nproc {nproc} but the plan needs {plan.num_gpus} processes (tp {plan.tp} * pp {plan.pp} * dp {plan.dp})")
        return 2
    ctx = multiprocessing.get_context(_start_method)
    if _start_method == "forkserver":  # a no-op once the server runs; it then keeps its own list
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    payload["plan"] = plan.to_dict()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="autoplan-run-") as error_dir:
        procs = [ctx.Process(target=_spawned, args=(r, nproc, port, payload, error_dir), daemon=True,
                             name=f"autoplan-rank-{r}") for r in range(nproc)]
        try:
            progress = _StartProgress(error_dir, nproc)
            for p in procs:
                p.start()
            return supervise(procs, error_dir, grace_s=_grace_s, on_poll=progress)
        finally:  # KeyboardInterrupt or a launcher bug: never leave ranks behind
            for p in procs:
                if p.pid is not None and p.exitcode is None:
                    p.kill()
                    p.join(5)


def _check_resumable(plan: Plan, checkpoint_dir: str) -> None:
    """Refuse (before spawning) to resume from a checkpoint of another model, or one whose DCP
    metadata does not read (CheckpointError is a ValueError: one line, exit 2)."""
    from autoplan.runtime.checkpoint import (
        CHECKPOINT_FORMAT,
        checkpoint_fingerprint,
        latest_checkpoint,
        load_checkpoint,
        other_format_checkpoints,
    )

    latest = latest_checkpoint(checkpoint_dir)
    if latest is None:
        other = other_format_checkpoints(checkpoint_dir)
        if other:  # never restart silently from step 0 over checkpoints this version cannot read
            raise ValueError(f"checkpoint {str(other[-1][0])!r} is of format {other[-1][1]}; this version reads "
                             f"{CHECKPOINT_FORMAT} only; use another --checkpoint-dir or drop --resume")
        return
    fingerprint = checkpoint_fingerprint(load_checkpoint(latest).manifest)
    if fingerprint is not None and fingerprint != plan.model_fingerprint:
        raise ValueError(f"checkpoint {str(latest)!r} is of model fingerprint {fingerprint}, the plan's model is "
                         f"{plan.model_fingerprint}; use another --checkpoint-dir or drop --resume")
