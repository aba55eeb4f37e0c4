"""`run_plan`: train a plan for a few steps (synthetic data, or `--data`), locally spawned or under torchrun.

Two ways in (DESIGN.md, "Launch"):
- torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment): this process is one rank.
- `--nproc N`: spawn N local processes (gloo on CPU, NCCL with one GPU each) on a free loopback
  port (`ranks.LocalJob`: the ranks die with the launcher, log to files, beat). The launcher polls
  its children. When one fails (raises, exits non-zero, is killed by a signal, or stops beating),
  the others get a grace period to fail by themselves (every wait on a peer has a timeout, and a
  dead peer fails the wait at once), then are terminated (SIGTERM, then SIGKILL). The launcher
  prints one line naming the rank to blame and why (its error, exit code, signal, or where it
  stopped), how the others ended, and the rank logs, and returns 1. SIGTERM to the launcher kills
  the ranks and returns 143. A checkpoint directory is locked for the job (`CheckpointDirLock`).

Mistakes found before any process starts (missing plan, fingerprint mismatch, wrong world size,
bad numbers, unwritable outputs, a checkpoint of another model, a locked or unwritable checkpoint
directory, a machine that cannot hold the ranks: machine.py [Note: a GPU plan on a CPU machine])
raise ValueError with one line; `autoplan run` prints it and exits 2. While the ranks start, the
launcher says what they are doing (`_StartProgress`); a rank SIGKILLed while memory ran short is
reported as likely out of memory (`_OomWatch`).

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
- `stop@R:S`             rank R SIGSTOPs itself before step S (frozen, heartbeat included)
- `nan@R:S`              rank R makes one gradient element of its stage NaN in step S
- `nan-weight@R:S`       rank R makes one weight element of its stage NaN before step S (NaN loss)
- `kill-mid-step@R:S:N`  rank R SIGKILLs itself at its N-th (1-based) P2P transfer of step S
                         (or after its pipeline work of that step, if it has fewer)
- `kill-in-checkpoint@R:S`  rank R SIGKILLs itself halfway through writing its DCP data file
                         (`__R_0.distcp`) of the checkpoint of step S (S = steps completed)
- `slow-start@R:T`       rank R sleeps T seconds before joining the process group (a rank that
                         starts late: [Note: start-up and step timeouts])
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from autoplan._files import check_output_file
from autoplan.plan import Plan, PlanError
from autoplan.runtime.machine import (
    GIB,
    MachineFit,
    available_memory_bytes,
    check_machine,
    oom_kills,
)
from autoplan.runtime.ranks import LocalJob, current_heartbeat, fail_rank, free_port, one_line, supervise

__all__ = ["CheckpointDirLock", "NonFiniteError", "check_output_file", "fail_rank", "free_port", "load_data_function",
           "run_plan", "supervise", "synthetic_batch"]

FAULT_ENV = "AUTOPLAN_FAULT"
_FAULT_KINDS = ("raise", "kill", "hang", "stop", "nan", "nan-weight", "kill-mid-step", "kill-in-checkpoint",
                "slow-start")
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint", "autoplan.runtime",
                      "autoplan.runtime.checkpoint")
"""Imported once by a forkserver (tests launching many short runs), not by every rank."""
DEFAULT_CHECKPOINT_EVERY = 500
"""Steps between checkpoints when only --checkpoint-dir is given: torchtitan's default interval
(`checkpoint.interval = 500`, torchtitan/config/job_config.py); a save also follows the last step."""
MAX_STEPS = 100_000_000
"""More steps than any published pre-training run (Llama 3 405B: about 1.2 M steps, arXiv:2407.21783)."""
MAX_TIMEOUT_S = 1e6
"""Longest --timeout accepted (11.6 days): longer is no timeout at all, and 1e30 s overflowed the
timedelta the process group is given (an OverflowError in every rank)."""
STARTUP_TIMEOUT_S = 300.0
"""How long a rank waits on its peers while the ranks start (joining the process group, building
their stages): at least this, whatever --timeout says. Ranks start seconds apart (each imports torch:
15-25 s on a loaded machine, issue 29) and trace the model apart, so `--timeout 1.5` failed every run
at start-up with DistNetworkError. A rank that dies meanwhile is seen by the launcher at once; only a
rank hung during start-up waits this long. See [Note: start-up and step timeouts]."""


class NonFiniteError(RuntimeError):
    """A step's loss or gradients hold a NaN or an infinity (and --skip-nonfinite is used up)."""


def _error(message: str) -> None:
    print(f"autoplan: error: {message}", file=sys.stderr, flush=True)


def _note(message: str) -> None:
    print(f"autoplan: {message}", file=sys.stderr, flush=True)


def _check(plan: Plan, spec: str) -> None:
    """Everything that can be checked before a process is spawned: the model builds, is the one
    the plan was made for (structure, and the file it comes from), and takes the plan's inputs."""
    from autoplan.runtime.api import check_model
    from autoplan.sources import FileSource, parse_source

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
    if isinstance(source, FileSource):  # a model file is code every rank runs: say which, before importing it
        _note(f"every rank imports {Path(source.path).resolve()} (sha256 {digest[:12]}"
              f"{', as planned' if digest == plan.model_digest else ''})")
    source.check_seq_len(plan.job.seq_len)
    # With tp > 1 this traces the model as partition does, for the layout the profile found.
    check_model(source.build("meta"), plan, source.example_inputs(plan.micro_batch_size, plan.job.seq_len,
                                                                  device="meta"), source=source)


def synthetic_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) of training step `step` for a token model: `graph.source.token_batch`."""
    from autoplan.sources import token_batch

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
    from autoplan import models as zoo

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
                         f"{one_line(exc)}") from None
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
           faults: tuple[_Fault, ...] = (), skip_nonfinite: int = 0, run_id: str = "", resume_from: str | None = None,
           on_phase=None) -> None:
    import torch.distributed as dist

    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime.api import default_device, init_distributed, partition

    timeout = timedelta(seconds=timeout_s)
    startup = startup_timeout(timeout)
    init_distributed(startup)
    rank = dist.get_rank()
    device = default_device()
    beat = current_heartbeat()
    where = beat.at if beat is not None else (lambda step, action: None)
    where(None, "building its stages")
    pm = partition(spec, plan, device=device, seed=seed, timeout=startup)
    bound_waits(pm, timeout)
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
        where(None, "loading a checkpoint")
        start_step = _resume(ckpt, checkpoint_dir, resume_from, pm, optimizer, rank)

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
    if beat is not None:
        pm.executor.on_action = lambda action: where(step_box[0], action)

    clock_offset = time.time() - time.perf_counter()  # perf_counter -> epoch seconds, comparable across ranks
    events = []
    skipped = 0
    for step in range(start_step, steps):
        step_box[0] = step
        where(step, "starting the step")
        _inject(faults, fail_at, rank, step)
        if any(f.hits("nan-weight", rank, step) for f in faults):
            _poison(pm, "weight")
        inputs, targets = make_batch(step)
        start = time.perf_counter()
        loss = pm.step(*inputs, target=targets)
        if any(f.hits("kill-mid-step", rank, step) for f in faults):
            _sigkill_self()  # fewer P2P transfers than asked for: die before the collectives
        if any(f.hits("nan", rank, step) for f in faults):
            _poison(pm, "grad")
        where(step, "checking the loss and gradients")
        loss_value, nonfinite = _loss_and_nonfinite(pm, loss if rank == loss_src else None, device)
        optimizer_start = time.perf_counter()
        scaler = pm.loss_scaler
        step_scale = scaler.scale if scaler is not None else None  # the scale this step's backward used
        # fp16: gradients that overflowed at a finite loss are the scale's fault, not the model's
        # (precision.py [Note: fp16 loss scaling]); every rank read the same flags, so all skip.
        overflow = (scaler is not None and nonfinite.startswith("non-finite gradients") and not scaler.at_minimum)
        if overflow:
            if rank == 0:
                print(f"step {step}  skipped: gradient overflow at loss scale {scaler.scale:g}; the scale is now "
                      f"{max(scaler.scale * scaler.backoff_factor, scaler.min_scale):g}", flush=True)
            scaler.update(overflow=True)
            pm.zero_grad()
        elif nonfinite:
            skipped += 1
            message = f"{nonfinite} at step {step}"
            if skipped > skip_nonfinite:
                raise NonFiniteError(f"{message}; stopped (--skip-nonfinite N skips up to N such steps)")
            if rank == 0:
                print(f"step {step}  skipped: {message} ({skipped} of --skip-nonfinite {skip_nonfinite})", flush=True)
            pm.zero_grad()
        else:
            where(step, "in the optimizer step")
            optimizer.step()
            if scaler is not None:
                scaler.update(overflow=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time_s = time.perf_counter() - start
        tail = [*pm.last_reductions, ("OPTIMIZER", optimizer_start, start + step_time_s)]
        where(step, "reporting the step time")
        step_time_s = _slowest(step_time_s, device)
        events += [(str(r.action), r.start_s + clock_offset, r.end_s + clock_offset, step) for r in pm.last_trace]
        events += [(phase, a + clock_offset, b + clock_offset, step) for phase, a, b in tail]
        if rank == 0 and not nonfinite:
            print(f"step {step}  loss {loss_value:.4f}  step {step_time_s:.3f} s  "
                  f"predicted {plan.predicted.step_time_s:.3f} s" +
                  (f"  loss scale {step_scale:g}" if scaler is not None else ""), flush=True)
        if rank == 0 and metrics_path:  # appended per step: a run that dies later keeps what it measured
            record = {"run": run_id, "step": step, "loss": loss_value if not nonfinite else None,
                      "step_time_s": step_time_s, "predicted_step_time_s": plan.predicted.step_time_s}
            if nonfinite:
                record["skipped"] = "gradient overflow" if overflow else nonfinite
            if scaler is not None:
                record["loss_scale"] = step_scale
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        done = step + 1
        if checkpoint_dir and checkpoint_every and (done % checkpoint_every == 0 or done == steps):
            where(step, f"saving the checkpoint of step {done}")
            path = ckpt.save_checkpoint(
                checkpoint_dir, done, pm, optimizer, timeout=timeout,
                extra={"seed": seed, "model": spec, "model_fingerprint": plan.model_fingerprint, "pp": plan.pp,
                       "dp": plan.dp, "tp": plan.tp,
                       **({"loss_scale": pm.loss_scaler.state_dict()} if pm.loss_scaler is not None else {})},
                _kill_midway=any(f.hits("kill-in-checkpoint", rank, done) for f in faults))
            if rank == 0:
                print(f"checkpoint {path}", flush=True)
    where(steps, "finishing")
    if trace_path:
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(events, gathered, dst=0)
        if rank == 0:
            _write_trace(trace_path, gathered, plan)
    dist.barrier()
    dist.destroy_process_group()


def _resume(ckpt, checkpoint_dir: str, chosen_by_launcher: str | None, pm, optimizer, rank: int) -> int:
    """Restore the checkpoint the launcher verified (`_check_resumable`; rank 0 chooses where no
    launcher did, and shares the choice so every rank resumes from the same one); returns the step
    to start at."""
    import torch.distributed as dist

    chosen = [chosen_by_launcher]
    if rank == 0 and chosen[0] is None:
        path, skipped = ckpt.choose_checkpoint(checkpoint_dir)
        for damaged, reason in skipped:
            print(f"checkpoint {damaged} is damaged ({reason}); resuming from {path or 'step 0'}", flush=True)
        chosen = [str(path or "")]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    if not chosen[0]:
        if rank == 0:
            print(f"no complete checkpoint in {checkpoint_dir}; starting from step 0", flush=True)
        return 0
    loaded = ckpt.load_checkpoint(chosen[0], checksums=False)  # every file's sha256 was just checked
    same_layout = loaded.manifest.get("world_size") == dist.get_world_size()
    start_step = ckpt.restore(loaded, pm, optimizer, strict=True, rank=rank if same_layout else None)
    scale = (loaded.manifest.get("extra") or {}).get("loss_scale")
    if pm.loss_scaler is not None and scale:  # fp16: the scale goes on where it was (the same on every rank)
        pm.loss_scaler.load_state_dict(scale)
    if rank == 0:
        print(f"resumed from {chosen[0]} (step {start_step})", flush=True)
    return start_step


def _inject(faults: tuple[_Fault, ...], fail_at: tuple[int, int] | None, rank: int, step: int) -> None:
    """The faults that strike before a step (module docstring)."""
    if (fail_at is not None and fail_at == (rank, step)) or any(f.hits("raise", rank, step) for f in faults):
        raise RuntimeError(f"injected failure at step {step}")
    if any(f.hits("kill", rank, step) for f in faults):
        _sigkill_self()
    if any(f.hits("stop", rank, step) for f in faults):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, threads included, until SIGCONT or SIGKILL
    if any(f.hits("hang", rank, step) for f in faults):
        while True:
            time.sleep(3600)


def _poison(pm, what: str) -> None:
    """Faults `nan` and `nan-weight`: one element of a gradient (or a weight) of this rank's first
    stage becomes NaN."""
    for _, p in pm.named_parameters():
        tensor = p.grad if what == "grad" else p.data
        if tensor is not None:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            with torch.no_grad():
                local.view(-1)[0] = float("nan")
            return


def _loss_and_nonfinite(pm, loss: torch.Tensor | None, device: torch.device) -> tuple[float, str]:
    """One MAX all-reduce before the optimizer step: the loss (only its owner contributes a value)
    and whether any stage's loss or gradients hold a NaN or an infinity. Returns the loss and "" or
    what is not finite ("non-finite loss (stage 3) and gradients in stages 0, 3").

    Why flags, not the loss itself: gloo's MAX of -inf and NaN is -inf, so a NaN loss reduced as a
    value read as -inf (issue "Faults and hostile input")."""
    import torch.distributed as dist

    num_stages = pm.plan.num_stages
    report = torch.zeros(2 + num_stages, device=device)
    report[0] = -float("inf")
    if loss is not None:
        value = float(loss)
        if math.isfinite(value):
            report[0] = value
        else:
            report[1] = 1.0
    for stage in pm.nonfinite_stages():
        report[2 + stage] = 1.0
    dist.all_reduce(report, op=dist.ReduceOp.MAX)
    values = report.tolist()
    bad_stages = [s for s in range(num_stages) if values[2 + s] > 0]
    parts = []
    if values[1] > 0:
        parts.append(f"loss (stage {num_stages - 1})")
    if bad_stages:
        parts.append(f"gradients in stage{'s' if len(bad_stages) > 1 else ''} {', '.join(map(str, bad_stages))}")
    return values[0], ("non-finite " + " and ".join(parts)) if parts else ""


def _slowest(step_time_s: float, device: torch.device) -> float:
    """The slowest rank's step time (what the step took for the job)."""
    import torch.distributed as dist

    report = torch.tensor([step_time_s], device=device)
    dist.all_reduce(report, op=dist.ReduceOp.MAX)
    return float(report[0])


def _write_trace(path: str, per_rank: list, plan: Plan) -> None:
    """Chrome trace (chrome://tracing, Perfetto): one row per rank, one box per action. Its
    "otherData" (the format's free-form object) names the plan, so `autoplan show --trace` can
    refuse a trace measured on another one (report/timeline.py check_trace_matches)."""
    t0 = min((e[1] for events in per_rank for e in events), default=0.0)
    trace = [{"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": (start - t0) * 1e6,
              "dur": (end - start) * 1e6, "args": {"step": step}}
             for rank, events in enumerate(per_rank) for name, start, end, step in events]
    trace += [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in range(len(per_rank))]
    named = {"autoplan_plan_fingerprint": plan.run_fingerprint, "autoplan_plan": f"{plan.model}, tp {plan.tp} pp "
             f"{plan.pp} dp {plan.dp}, {plan.schedule}", "num_ranks": plan.num_gpus}
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": named}))


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
        _note(line)
        return line


def _loopback_process_group(rank: int, world_size: int, port: int, timeout: timedelta) -> None:
    """The process group of a local job, reachable from this machine only ([Note: loopback only]).

    [Note: loopback only] `init_process_group` from MASTER_ADDR/MASTER_PORT makes rank 0's TCPStore
    listen on every interface (`[::]`), whatever MASTER_ADDR says: any host that reaches the machine
    could connect to a local job. Rank 0 binds the listening socket to 127.0.0.1 itself and hands it
    to the store (`master_listen_fd`, as torchrun's agent hands over its own socket); gloo and NCCL
    pick their interfaces from GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, which the launcher sets to
    the loopback interface unless the user set them."""
    import torch.distributed as dist

    from autoplan.runtime.api import default_device

    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(max(128, world_size))
        store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(default_device())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def startup_timeout(timeout: timedelta) -> timedelta:
    """The wait allowed while the ranks start: `timeout`, or STARTUP_TIMEOUT_S if that is longer.

    [Note: start-up and step timeouts] `--timeout` is "seconds any rank waits on another" once the
    ranks run steps. Start-up waits are on peers that are still importing torch or tracing the
    model, which takes seconds to minutes whatever the run's timeout: the process group, its
    subgroups and the pipeline's transfers are made with this allowance (`_loopback_process_group`,
    `partition`), then `bound_waits` sets every one of them to `timeout` before the first step."""
    return max(timeout, timedelta(seconds=STARTUP_TIMEOUT_S))


def bound_waits(pm, timeout: timedelta) -> None:
    """After start-up: every process group this rank belongs to (the world, the meshes' and
    partition's subgroups) and the pipeline's sends and receives time out after `timeout`."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            c10d._set_pg_timeout(timeout, group)
    pm.executor.comm.timeout = timeout


def _spawned(rank: int, world_size: int, port: int, payload: dict, run_dir: str) -> None:
    """Entry of a rank the launcher spawned (through `ranks.LocalJob`, which ties it to the launcher,
    logs it and records its failure)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, _loopback_interface())
    payload = dict(payload)
    plan = Plan.from_dict(payload.pop("plan"))
    _mark_phase(run_dir, rank, "started")
    for fault in payload["faults"]:
        if fault.kind == "slow-start" and fault.rank in (None, rank):
            time.sleep(fault.step)
    _loopback_process_group(rank, world_size, port, startup_timeout(timedelta(seconds=payload["timeout_s"])))
    _mark_phase(run_dir, rank, "connected")
    _train(plan, **payload, on_phase=lambda phase: _mark_phase(run_dir, rank, phase))


def _loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS and the BSDs)."""
    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return "lo"


# ---- the checkpoint directory's lock ------------------------------------------------------------


LOCK_NAME = ".autoplan.lock"


class CheckpointDirLock:
    """One job per checkpoint directory: an exclusive `flock` on DIR/.autoplan.lock, held by the
    launcher (or torchrun's rank 0) for the whole run. The file names its holder (host, pid, start
    time, command) for the refusal's line. A lock left by a job that died is stale by construction:
    the kernel releases a flock with its holder's last descriptor, so the next job simply takes it
    (no pid guessing, which fails across hosts). On NFS, `flock` maps to byte-range locks, which
    NFSv4 servers honour (docs/reliability.md)."""

    def __init__(self, directory: str):
        self.path = Path(directory) / LOCK_NAME
        self._file = None

    def acquire(self) -> None:
        import fcntl

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path, "a+")  # noqa: SIM115 - held open for the run: the lock lives with it
        except OSError as exc:  # read-only, not ours, a file on the way: the directory, not the lock, is named
            raise ValueError(f"--checkpoint-dir {str(self.path.parent)!r} cannot be written ({exc.strerror or exc}: "
                             f"{exc.filename or self.path}); choose a directory you can write, or fix its "
                             f"permissions") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ValueError(f"--checkpoint-dir {str(self.path.parent)!r} is in use by {holder}; wait for that "
                             f"job to end, stop it, or use another --checkpoint-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"job pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')} ({' '.join(sys.argv[:4])[:120]})\n")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # releases the flock; the file stays (removing it would race a taker)
            self._file = None

    def __enter__(self) -> CheckpointDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


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
             resume: bool = False, data: str | None = None, skip_nonfinite: int = 0,
             allow_oversubscribe: bool = False,
             _fail_at: tuple[int, int] | None = None, _fault: str | None = None,
             _grace_s: float = 10.0, _start_method: str = "spawn") -> int:
    """Train `plan` for `steps` steps with AdamW; returns the exit code (0, or 1 when a rank failed).

    A mistake found before any process starts (module docstring) raises ValueError with one line;
    `autoplan run` prints it and exits 2.

    Data: synthetic batches from the model source (module docstring), or `data`, a
    `file.py:function` with function(step, batch_size, seq_len) -> (inputs, target) of the global
    batch (`load_data_function`).

    `model` overrides the plan's model spec. Without RANK/WORLD_SIZE in the environment, spawns
    `nproc` (default: the plan's GPU count) local processes, after checking that this machine holds
    them (machine.py [Note: a GPU plan on a CPU machine]: without CUDA, ranks whose estimated host
    memory exceeds what is free are refused unless `allow_oversubscribe`). `timeout_s` bounds every
    wait on a peer once the ranks run steps (while they start: at least STARTUP_TIMEOUT_S, see
    [Note: start-up and step timeouts]). `checkpoint_dir` saves a checkpoint every `checkpoint_every` steps (default
    DEFAULT_CHECKPOINT_EVERY) and after the last; `resume` continues from the newest good checkpoint
    in `checkpoint_dir` (`steps` is the total, so a run resumed at step 3 with steps=6 trains steps
    3, 4, 5). A step whose loss or gradients are not finite stops the run (exit 1, naming the step
    and the stages), unless fewer than `skip_nonfinite` such steps were skipped so far: then its
    optimizer step is skipped. An fp16 plan scales its loss (precision.py [Note: fp16 loss
    scaling]): a step whose gradients overflow is skipped and the scale halved, which is not counted
    against `skip_nonfinite`. `metrics_path` is appended to, one JSON record per step tagged with
    this run's id. `_fail_at=(rank, step)` makes that rank raise before that step; `_fault`
    (default: $AUTOPLAN_FAULT) injects other faults (module docstring). `_grace_s`: how long the
    launcher lets the other ranks fail by themselves before it terminates them. `_start_method`:
    "spawn" (default) or "forkserver".
    """
    from autoplan.plan import validate

    lock = None
    resume_from: str | None = None  # the launcher's (or torchrun rank 0's) verified choice; "": none
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    fit = None
    try:
        if isinstance(plan, Plan):
            problems = validate(plan)
            if problems:
                raise PlanError(f"the plan is inconsistent: {problems[0]}")
        elif isinstance(plan, str | os.PathLike):
            plan = Plan.load(plan)
        else:
            raise ValueError(f"plan must be a Plan or a plan file's path, got {type(plan).__name__}")
        if model is not None and not isinstance(model, str):
            raise TypeError(f"model must be a model spec string, got {type(model).__name__}")
        if model is not None and not model.strip():  # '' once ran the plan's model silently
            raise ValueError(f"--model {model!r} is empty; give a model spec, or leave --model out to build the "
                             f"plan's ({plan.model})")
        spec = model or plan.model
        _check_run_arguments(steps, timeout_s, lr, seed, skip_nonfinite, checkpoint_every, nproc)
        for flag, value in (("allow_oversubscribe", allow_oversubscribe), ("resume", resume)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be True or False, got {value!r}")
        for flag, value in (("--metrics", metrics_path), ("--trace", trace_path), ("--checkpoint-dir", checkpoint_dir)):
            if value is not None and not isinstance(value, str | os.PathLike):
                raise TypeError(f"{flag} must be a path, got {type(value).__name__}")
        if data is not None and not isinstance(data, str):
            raise TypeError(f"--data must be FILE.py:FUNCTION, got {type(data).__name__}")
        for flag, path in (("--metrics", metrics_path), ("--trace", trace_path)):
            if path is not None:
                check_output_file(flag, path)
        _check(plan, spec)
        if data is not None:
            load_data_function(data, plan)
        faults = _parse_faults(os.environ.get(FAULT_ENV) if _fault is None else _fault)
        if resume and not checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir DIR")
        if checkpoint_every is not None and not checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
        if torchrun:
            world_size = os.environ["WORLD_SIZE"]
            if world_size != str(plan.num_gpus):
                raise ValueError(f"the plan needs {plan.num_gpus} ranks but WORLD_SIZE is {world_size}; launch "
                                 f"torchrun with {plan.num_gpus} processes in all")
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            if torch.cuda.is_available() and local.isdigit():  # one GPU per local rank, as under --nproc
                check_machine(plan, int(local), cuda=True, num_cuda_devices=torch.cuda.device_count())
        else:
            nproc = plan.num_gpus if nproc is None else nproc
            if nproc != plan.num_gpus:
                raise ValueError(f"--nproc {nproc} but the plan needs {plan.num_gpus} processes (tp {plan.tp} * "
                                 f"pp {plan.pp} * dp {plan.dp})")
            fit = check_machine(plan, nproc, allow_oversubscribe=allow_oversubscribe)
        if checkpoint_dir is not None:
            if plan.ep > 1:
                from autoplan.runtime.checkpoint import EXPERT_PARALLEL_REFUSAL

                raise ValueError(EXPERT_PARALLEL_REFUSAL.format(ep=plan.ep))
            checkpoint_dir = str(checkpoint_dir)
            if not checkpoint_dir.strip():
                raise ValueError("--checkpoint-dir is empty; name a directory")
            if Path(checkpoint_dir).exists() and not Path(checkpoint_dir).is_dir():
                raise ValueError(f"--checkpoint-dir {checkpoint_dir!r} exists and is not a directory")
            torchrun_rank = int(os.environ.get("RANK", "0")) if torchrun else 0
            if torchrun_rank == 0:  # the launcher, or torchrun's rank 0, holds it for the job
                lock = CheckpointDirLock(checkpoint_dir)
                lock.acquire()
            if resume and torchrun_rank == 0:  # verified once (a full read); rank 0 shares the choice
                resume_from = str(_check_resumable(plan, checkpoint_dir) or "")
    except (ValueError, TypeError) as exc:  # PlanError and PartitionError are ValueErrors
        if lock is not None:
            lock.release()
        raise ValueError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    if checkpoint_dir is not None and checkpoint_every is None:
        checkpoint_every = DEFAULT_CHECKPOINT_EVERY
        if int(os.environ.get("RANK", "0")) == 0:
            _note(f"checkpoints into {checkpoint_dir} every {checkpoint_every} steps and after the last "
                  f"(--checkpoint-every K to change)")
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    payload = dict(spec=spec, steps=steps, seed=seed, timeout_s=float(timeout_s), trace_path=trace_path, data=data,
                   metrics_path=metrics_path, lr=lr, fail_at=_fail_at, checkpoint_dir=checkpoint_dir,
                   checkpoint_every=checkpoint_every, resume=resume, faults=faults, skip_nonfinite=skip_nonfinite,
                   run_id=run_id, resume_from=resume_from)
    try:
        if torchrun:  # this process is one rank
            return _run_this_rank(plan, payload)
        if fit.note:
            _note(fit.note)
        payload["plan"] = plan.to_dict()
        with _sigterm_stops_the_job(), LocalJob(nproc, start_method=_start_method, preload=FORKSERVER_PRELOAD) as job:
            try:
                progress = _StartProgress(job.run_dir, nproc)
                oom = _OomWatch(fit)
                job.start(_spawned, (nproc, free_port(), payload, job.run_dir))
                code = job.supervise(grace_s=_grace_s, on_poll=lambda: (progress(), oom.sample()))
                progress.finish()
                if code:
                    oom.report(job.procs, stopped_by_launcher=job.stopped)
                return code
            except _Terminated:
                job.failed = True
                _error(f"stopped by SIGTERM; every rank was killed (logs: {job.logs})")
                return 143
    finally:
        if lock is not None:
            lock.release()


def _run_this_rank(plan: Plan, payload: dict) -> int:
    """Under torchrun: train as the rank the environment names; one line on failure."""
    try:
        _train(plan, **payload)
    except Exception as exc:
        _error(f"rank {os.environ['RANK']} failed: {one_line(exc)}")
        return 1
    return 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_run_arguments(steps, timeout_s, lr, seed, skip_nonfinite, checkpoint_every, nproc) -> None:
    """The numbers of a run, before anything is built (one line each: ValueError or TypeError)."""
    for flag, value, low in (("--steps", steps, 1), ("--seed", seed, 0), ("--skip-nonfinite", skip_nonfinite, 0)):
        if not _is_int(value):
            raise TypeError(f"{flag} must be an integer, got {value!r}")
        if value < low:
            raise ValueError(f"{flag} {value} must be at least {low}")
    for flag, value in (("--checkpoint-every", checkpoint_every), ("--nproc", nproc)):
        if value is not None and not _is_int(value):
            raise TypeError(f"{flag} must be an integer, got {value!r}")
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be at least 1")
    if steps > MAX_STEPS:
        raise ValueError(f"--steps {steps} is more than {MAX_STEPS:,}; train in runs of at most that and --resume")
    for flag, value in (("--timeout", timeout_s), ("lr", lr)):
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise TypeError(f"{flag} must be a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{flag} {value} must be a finite number above 0")
    if timeout_s > MAX_TIMEOUT_S:
        raise ValueError(f"--timeout {timeout_s:g} is more than {MAX_TIMEOUT_S:g} s (11 days); give at most that")


def _check_resumable(plan: Plan, checkpoint_dir: str) -> Path | None:
    """The checkpoint to resume from: the newest that verifies (`checkpoint.choose_checkpoint`: sizes,
    sha256s, names, step; a damaged newer one is named on stderr and skipped), or None to start at
    step 0. Refuses, before spawning (one line, exit 2), a checkpoint of another model, a directory
    whose every checkpoint is damaged, or one holding only checkpoints of an older format."""
    from autoplan.runtime.checkpoint import (
        CHECKPOINT_FORMAT,
        checkpoint_fingerprint,
        choose_checkpoint,
        load_checkpoint,
        other_format_checkpoints,
    )

    chosen, skipped = choose_checkpoint(checkpoint_dir)
    if chosen is None:
        other = other_format_checkpoints(checkpoint_dir)
        if other:  # never restart silently from step 0 over checkpoints this version cannot read
            raise ValueError(f"checkpoint {str(other[-1][0])!r} is of format {other[-1][1]}; this version reads "
                             f"{CHECKPOINT_FORMAT} only; use another --checkpoint-dir or drop --resume")
        if skipped:  # nor over damaged ones
            newest, reason = skipped[0]
            raise ValueError(f"no checkpoint in {checkpoint_dir!r} verifies ({len(skipped)} damaged; the newest, "
                             f"{str(newest)!r}: {reason}); move them away to start from step 0, or drop --resume")
        return None
    for path, reason in skipped:
        _note(f"checkpoint {path} is damaged ({reason}); resuming from {chosen}")
    fingerprint = checkpoint_fingerprint(load_checkpoint(chosen, checksums=False).manifest)  # just verified
    if fingerprint != plan.model_fingerprint:  # None included: a manifest without a fingerprint is refused
        raise ValueError(f"checkpoint {str(chosen)!r} is of model fingerprint {fingerprint}, the plan's model is "
                         f"{plan.model_fingerprint}; use another --checkpoint-dir or drop --resume")
    return chosen
