"""What `autoplan run` checks before it spawns a process (`check_run`): the arguments' types and
ranges, the plan, the model it was made for, the data (a function, or a dataset: its files and its
token ids against the model's vocabulary; `check_data`) and the evaluation data, the outputs, the
checkpoint directory (locked for the job: `CheckpointDirLock`; on resume, the checkpoint to resume
from, of the same data), and whether this machine holds the ranks (machine.py [Note: a GPU plan on a
CPU machine]).

Each mistake raises ValueError (or TypeError) with one line; `autoplan run` prints it and exits 2.
Apart from the launcher (launch.py) so that what is validated reads in one place, before anything
is spawned.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from autoplan._files import check_output_file
from autoplan.plan import Plan, PlanError
from autoplan.runtime.launcher.faults import FAULT_ENV, Fault, parse_faults
from autoplan.runtime.launcher.machine import MachineFit, check_machine
from autoplan.runtime.launcher.training import is_data_function, load_data_function, token_inputs

__all__ = ["MAX_STEPS", "MAX_TIMEOUT_S", "CheckpointDirLock", "RunChecks", "check_data", "check_run",
           "print_note"]

MAX_STEPS = 100_000_000
"""More steps than any published pre-training run (Llama 3 405B: about 1.2 M steps, arXiv:2407.21783)."""
MAX_TIMEOUT_S = 1e6
"""Longest --timeout accepted (11.6 days): longer is no timeout at all, and 1e30 s overflowed the
timedelta the process group is given (an OverflowError in every rank)."""


def print_note(message: str) -> None:
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
        print_note(f"every rank imports {Path(source.path).resolve()} (sha256 {digest[:12]}"
              f"{', as planned' if digest == plan.model_digest else ''})")
    source.check_seq_len(plan.job.seq_len)
    # With tp > 1 this traces the model as partition does, for the layout the profile found.
    model = source.build("meta")
    if plan.cp > 1 and int(os.environ.get("RANK", "0")) == 0:  # what a cp run computes otherwise than one process
        from autoplan.graph.positions import sequence_split_note

        note = sequence_split_note(model)
        if note is not None:
            print_note(f"warning: cp {plan.cp}: {note}")
    check_model(model, plan, source.example_inputs(plan.micro_batch_size, plan.job.seq_len, device="meta"),
                source=source)
    if getattr(plan, "expert_tp", 1) > 1:
        from autoplan.runtime.parallel.experts import refuse_expert_tp

        refuse_expert_tp(model, plan)


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


# ---- the checks of a run ------------------------------------------------------------------------


@dataclass
class RunChecks:
    """What `check_run` found and decided before any process is spawned."""

    plan: Plan
    spec: str
    """The model spec the ranks build (--model, else the plan's)."""
    nproc: int | None
    """Local processes to spawn (None under torchrun)."""
    faults: tuple[Fault, ...]
    fit: MachineFit | None
    """Whether this machine holds the ranks (None under torchrun)."""
    checkpoint_dir: str | None
    lock: CheckpointDirLock | None
    """Held by the launcher (or torchrun's rank 0) for the job; the caller releases it."""
    resume_from: str | None
    """The launcher's (or torchrun rank 0's) verified choice; "": none."""
    data_identity: dict | None = None
    """What the data is (`data_identity`), recorded in checkpoints and compared on resume."""


def check_run(plan: str | os.PathLike | Plan, *, model: str | None, steps: int, nproc: int | None,
              trace_path: str | None, metrics_path: str | None, seed: int, timeout_s: float, lr: float,
              checkpoint_dir: str | os.PathLike | None, checkpoint_every: int | None, resume: bool,
              data: str | None, skip_nonfinite: int, allow_oversubscribe: bool, fault: str | None,
              torchrun: bool, overwrite: bool = False, init: str | os.PathLike | None = None,
              eval_every: int | None = None, eval_data: str | None = None, eval_batches: int = 10) -> RunChecks:
    """Every check of `run_plan` before a process is spawned (module docstring); the arguments are
    `run_plan`'s (`fault`: its `_fault`). A mistake raises ValueError with one line, after releasing
    the checkpoint directory's lock if it was taken."""
    from autoplan.plan import validate
    from autoplan.runtime.checkpoint.identity import check_fresh_directory, remove_checkpoints

    lock = None
    resume_from: str | None = None  # the launcher's (or torchrun rank 0's) verified choice; "": none
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
        for flag, value in (("allow_oversubscribe", allow_oversubscribe), ("resume", resume), ("overwrite", overwrite)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be True or False, got {value!r}")
        for flag, value in (("--metrics", metrics_path), ("--trace", trace_path), ("--checkpoint-dir", checkpoint_dir)):
            if value is not None and not isinstance(value, str | os.PathLike):
                raise TypeError(f"{flag} must be a path, got {type(value).__name__}")
        for flag, value in (("--data", data), ("--eval-data", eval_data)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise TypeError(f"{flag} must be a dataset's path or FILE.py:FUNCTION, got {value!r}")
        _check_eval_arguments(eval_every, eval_data, eval_batches)
        for flag, path in (("--metrics", metrics_path), ("--trace", trace_path)):
            if path is not None:
                check_output_file(flag, path)
        _check(plan, spec)
        if init is not None:  # every tensor's name and shape, from the files' headers (weights.py)
            from autoplan.runtime.checkpoint.weights import check_weights
            from autoplan.sources import parse_source

            if not isinstance(init, str | os.PathLike) or not str(init).strip():
                raise ValueError(f"--init {init!r} must be a path: a Hugging Face directory, a torch.save file or a "
                                 "checkpoint")
            check_weights(parse_source(spec), init)
        data_identity = check_data(data, plan, spec, seed)
        if eval_data is not None:
            check_data(eval_data, plan, spec, seed, flag="--eval-data")
        faults = parse_faults(os.environ.get(FAULT_ENV) if fault is None else fault)
        if resume and not checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir DIR")
        if checkpoint_every is not None and not checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
        if overwrite and not checkpoint_dir:
            raise ValueError("--overwrite needs --checkpoint-dir DIR (it deletes that directory's checkpoints)")
        if overwrite and resume:
            raise ValueError("--overwrite deletes the checkpoints --resume would continue; give one of them")
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
                resume_from = str(_check_resumable(plan, checkpoint_dir, data_identity) or "")
            # One job per directory (checkpoint/identity.py [Note: one job per checkpoint directory]):
            # a fresh run neither overwrites nor mixes with another job's steps.
            if not resume and overwrite and torchrun_rank == 0:  # under the lock: no job is using them
                removed = remove_checkpoints(checkpoint_dir)
                if removed:
                    print_note(f"--overwrite: deleted {removed} checkpoint{'s' if removed > 1 else ''} in {checkpoint_dir}")
            elif not resume and not overwrite:
                check_fresh_directory(checkpoint_dir)
    except (ValueError, TypeError) as exc:  # PlanError and PartitionError are ValueErrors
        if lock is not None:
            lock.release()
        raise ValueError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    return RunChecks(plan=plan, spec=spec, nproc=nproc, faults=faults, fit=fit, checkpoint_dir=checkpoint_dir,
                     lock=lock, resume_from=resume_from, data_identity=data_identity)


def _check_eval_arguments(eval_every, eval_data, eval_batches) -> None:
    for flag, value in (("--eval-every", eval_every), ("--eval-batches", eval_batches)):
        if value is not None and not _is_int(value):
            raise TypeError(f"{flag} must be an integer, got {value!r}")
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be at least 1")
    if eval_every is not None and eval_data is None:
        raise ValueError("--eval-every needs --eval-data PATH (a token file, a datasets directory or FILE.py:FUNCTION)")
    if eval_data is not None and eval_every is None:
        raise ValueError("--eval-data needs --eval-every N (evaluate every N steps)")


def check_data(data: str | None, plan: Plan, spec: str, seed: int, *, flag: str = "--data") -> dict:
    """`--data` (or `--eval-data`) before any rank starts, and what it is (its identity, for
    checkpoints): synthetic (None), a `file.py:function` (`load_data_function` calls it for step
    0), or a dataset (runtime/launcher/datasets.py `open_dataset`: the files, then every token id below the
    model's vocabulary, and a model fed by token ids: `training.token_inputs`)."""
    if data is None:
        return {"format": "synthetic", "seed": seed}
    if is_data_function(data):
        load_data_function(data, plan)
        return {"format": "function", "function": data}
    from autoplan.runtime.launcher.datasets import open_dataset
    from autoplan.sources import parse_source

    def named(exc: Exception) -> ValueError:  # the dataset's own line, naming the flag it came from
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if text.startswith(flag):
            return ValueError(text)
        return ValueError(f"{flag} {text}" if text.startswith(data) else f"{flag} {data}: {text}")

    try:
        dataset = open_dataset(data, seq_len=plan.job.seq_len, seed=seed)
    except (ValueError, OSError) as exc:
        raise named(exc) from None
    source = parse_source(spec)
    templates = source.input_templates()
    try:
        token_inputs(templates, torch.zeros(1, 1, dtype=torch.int64))
    except ValueError as exc:
        raise ValueError(f"{flag} {data!r} is a token dataset but the model {spec} cannot take one: {exc}") from None
    vocab = (getattr(source, "info", None) or {}).get("vocab_size") or templates[0].high
    try:
        dataset.check_vocab(int(vocab))
    except ValueError as exc:
        raise named(exc) from None
    return dict(dataset.identity)


def _same_data(saved: dict | None, current: dict | None) -> bool:
    """Whether a checkpoint's data is this run's: a dataset by everything but where it lies (a moved
    file is the same data); synthetic data and functions as before (a resume may change their seed)."""
    def dataset(identity) -> bool:
        return isinstance(identity, dict) and identity.get("format") not in (None, "synthetic", "function")

    if not dataset(saved) and not dataset(current):
        return True
    strip = lambda identity: {k: v for k, v in (identity or {}).items() if k != "path"}  # noqa: E731
    return strip(saved) == strip(current)


def _describe_data(identity: dict | None) -> str:
    if not isinstance(identity, dict):
        return "no recorded data"
    if identity.get("format") == "synthetic":
        return "synthetic data"
    if identity.get("format") == "function":
        return f"--data {identity.get('function')}"
    details = ", ".join(f"{k} {str(identity[k])[:12] if k == 'fingerprint' else identity[k]}"
                        for k in ("tokens", "seq_len", "seed", "fingerprint") if k in identity)
    return f"{identity.get('path', 'a dataset')} ({details})"


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


def _check_resumable(plan: Plan, checkpoint_dir: str, data_identity: dict | None = None) -> Path | None:
    """The checkpoint to resume from: the newest that verifies (`checkpoint.choose_checkpoint`: sizes,
    sha256s, names, step; a damaged newer one is named on stderr and skipped), or None to start at
    step 0. Refuses, before spawning (one line, exit 2), a checkpoint of another model, a directory
    whose every checkpoint is damaged, one holding only checkpoints of an older format, or one of
    other data (a dataset's identity: `_same_data`; the data position is the step)."""
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
        print_note(f"checkpoint {path} is damaged ({reason}); resuming from {chosen}")
    manifest = load_checkpoint(chosen, checksums=False).manifest  # just verified
    fingerprint = checkpoint_fingerprint(manifest)
    if fingerprint != plan.model_fingerprint:  # None included: a manifest without a fingerprint is refused
        raise ValueError(f"checkpoint {str(chosen)!r} is of model fingerprint {fingerprint}, the plan's model is "
                         f"{plan.model_fingerprint}; use another --checkpoint-dir or drop --resume")
    extra = manifest.get("extra") or {}
    if "data" in extra and not _same_data(extra["data"], data_identity):
        raise ValueError(f"checkpoint {str(chosen)!r} was trained on {_describe_data(extra['data'])}, this run "
                         f"reads {_describe_data(data_identity)}; resume with the same --data (and --seed), or "
                         "start a new --checkpoint-dir")
    return chosen
