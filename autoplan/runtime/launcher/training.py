"""One rank's training loop (`train_rank`): build the rank's stages, resume, run the steps with AdamW
(the settings, weight-decay groups and learning-rate schedule of `optim`: optim_config.py), check
the loss and gradients, clip the gradients' global norm (`clip_grad`: `PartitionedModel.
clip_grad_norm_`, a non-finite norm handled as a non-finite step), evaluate every `eval_every`
steps (`PartitionedModel.evaluate`), write metrics, traces and checkpoints.

Checkpoints and resume (docs/reliability.md): with `checkpoint_dir` and `checkpoint_every=K`,
every K steps (and after the last step) the ranks save their stages' parameters and AdamW state
under the model's own names through torch.distributed.checkpoint (`checkpoint.save_checkpoint`:
shards as shards, replicated tensors once); with `resume`, training continues from the newest
complete checkpoint, saved under this plan or any other plan of the same model. Synthetic data
comes from the model source (`ModelSource.batch`: inputs of the shapes, dtypes and value ranges of
the model's example inputs, and a target for its loss) and is a pure function of (seed, step), so
a resumed run sees exactly the batches a straight run would. So is real data (`data`): a token file
or a datasets directory (runtime/launcher/datasets.py `open_dataset`, whose `batch(step, global_batch)` is
step k's global batch), or the user's `file.py:function`. A checkpoint records the data's identity,
the samples consumed, the optimizer settings and the scheduler's state; a resume continues the
schedule at its step (optim_config.py [Note: the schedule]).

Apart from the launcher (launch.py), which spawns the processes that run it, and from the checks
before spawning (preflight.py): this is what runs inside a rank.
"""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from pathlib import Path

import torch

from autoplan.plan import Plan
from autoplan.runtime.launcher.faults import Fault, inject, poison, sigkill_self
from autoplan.runtime.launcher.optim_config import OptimizerConfig
from autoplan.runtime.launcher.ranks import current_heartbeat, one_line
from autoplan.runtime.launcher.rendezvous import bound_waits, startup_timeout

__all__ = ["NonFiniteError", "check_clip_grad", "is_data_function", "load_data_function", "synthetic_batch",
           "token_inputs", "train_rank"]


class NonFiniteError(RuntimeError):
    """A step's loss or gradients hold a NaN or an infinity (and --skip-nonfinite is used up)."""


def check_clip_grad(clip_grad: float | None) -> None:
    """`--clip-grad MAX_NORM` before any rank starts: a finite number above 0, else one line."""
    if clip_grad is None:
        return
    if isinstance(clip_grad, bool) or not isinstance(clip_grad, int | float) or not 0 < clip_grad < math.inf:
        raise ValueError(f"--clip-grad {clip_grad!r} must be a number above 0: the global gradient norm to clip to "
                         "(Megatron-LM and torchtitan use 1.0)")


def synthetic_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets) of training step `step` for a token model: `sources.base.token_batch`."""
    from autoplan.sources import token_batch

    return token_batch(seed, step, batch, seq_len, vocab)


def is_data_function(data: str) -> bool:
    """Whether `--data` names a Python function (`file.py:function`), not a dataset's path."""
    return ".py:" in data


def token_inputs(templates, ids: torch.Tensor) -> tuple:
    """The model's forward arguments for a batch of token ids from a dataset: the ids as its first
    input, each position input (`InputTemplate.positions`: what context parallelism cuts with the
    ids) the positions of the sequence, the arguments in between as the source makes them (None).
    Raises ValueError where the model takes another tensor input (a dataset has none to give)."""
    rows, seq_len = ids.shape
    inputs = []
    for index, template in enumerate(templates):
        if index == 0:
            if template.dtype is None or template.dtype.is_floating_point or template.seq_dim is None:
                raise ValueError("its first input is not token ids; a token dataset feeds language models "
                                 "(use --data FILE.py:FUNCTION for other inputs)")
            inputs.append(ids)
        elif template.positions:
            inputs.append(torch.arange(seq_len).unsqueeze(0).expand(rows, seq_len).contiguous())
        elif template.shape is None:
            inputs.append(template.constant)
        else:
            raise ValueError(f"it takes a tensor input ({index + 1} of {len(templates)}) besides its token ids "
                             "and positions, which a token dataset cannot give; use --data FILE.py:FUNCTION")
    return tuple(inputs)


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
    """step -> (inputs tuple, target) of the global batch: a dataset's, the user's function's, else
    the source's (synthetic)."""
    if data is not None and not is_data_function(data):
        from autoplan.runtime.launcher.datasets import open_dataset

        dataset = open_dataset(data, seq_len=plan.job.seq_len, seed=seed)  # the launcher checked it
        templates = pm.source.input_templates()

        def dataset_batch(step: int):
            ids, targets = dataset.batch(step, plan.job.global_batch)
            return token_inputs(templates, ids), targets

        return dataset_batch
    if data is not None:
        fn = load_data_function(data, plan, check=False)  # the launcher checked it

        def user_batch(step: int):
            inputs, target = fn(step, plan.job.global_batch, plan.job.seq_len)
            return (tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)), target

        return user_batch
    out = pm.output_template  # None where the source knows its target without the output's shape
    shape, dtype = (out.shape, out.dtype) if out is not None else ((), torch.float32)
    return lambda step: pm.source.batch(seed, step, plan.job.global_batch, plan.job.seq_len, shape, dtype)


def train_rank(plan: Plan, spec: str, steps: int, seed: int, timeout_s: float, trace_path: str | None,
           metrics_path: str | None, lr: float, fail_at: tuple[int, int] | None = None, data: str | None = None,
           checkpoint_dir: str | None = None, checkpoint_every: int | None = None, resume: bool = False,
           faults: tuple[Fault, ...] = (), skip_nonfinite: int = 0, run_id: str = "", resume_from: str | None = None,
           on_phase=None, clip_grad: float | None = None, init: str | None = None,
           optim: OptimizerConfig | None = None, data_identity: dict | None = None, eval_every: int | None = None,
           eval_data: str | None = None, eval_batches: int = 10) -> None:
    import torch.distributed as dist

    from autoplan.runtime import checkpoint as ckpt
    from autoplan.runtime.api import default_device, init_distributed, partition
    from autoplan.runtime.launcher.optim_config import make_optimizer, make_scheduler, restore_scheduler

    optim = (optim or OptimizerConfig(lr=lr)).for_steps(steps)

    timeout = timedelta(seconds=timeout_s)
    startup = startup_timeout(timeout)
    init_distributed(startup)
    rank = dist.get_rank()
    device = default_device()
    beat = current_heartbeat()
    where = beat.at if beat is not None else (lambda step, action: None)
    where(None, "building its stages")
    # Pretrained weights (`init`), each rank reading its slices; a checkpoint resumed below replaces them.
    pm = partition(spec, plan, device=device, seed=seed, timeout=startup, init=init)
    if on_phase is not None:
        on_phase("built")
    # torch's fused AdamW: one pass over each parameter (as Megatron's fused Adam). The default
    # foreach version measured 3.5x the memory-bound time on an H100 (docs/status.md); on CPU the
    # default per-tensor loop took 8-9x the fused step for 65M parameters on one thread (0.56-0.63 s
    # against 0.062-0.075 s, `python benchmarks/optimizer_cpu.py`): the step's tail, on the critical path.
    # The groups (optim_config.py [Note: weight-decay groups]) by the whole model's names, on meta.
    optimizer = make_optimizer(pm, optim, fused=True)
    scheduler = make_scheduler(optimizer, optim)
    make_batch = _batch_fn(pm, data, plan, seed)
    make_eval_batch = _batch_fn(pm, eval_data, plan, seed) if eval_every else None
    loss_src = plan.rank(plan.pp - 1, 0, 0)

    start_step, job_id = 0, run_id  # a fresh start is a job of its own (checkpoint/identity.py)
    if resume and checkpoint_dir:
        where(None, "loading a checkpoint")
        settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        start_step, resumed_job, saved = _resume(ckpt, checkpoint_dir, resume_from, pm, optimizer, rank)
        job_id = resumed_job or run_id
        # This run's settings, not the checkpoint's hyperparameters; the schedule at the resumed step.
        for group, values in zip(optimizer.param_groups, settings):
            group.update(values)
        restore_scheduler(scheduler, saved.get("lr_scheduler"), start_step)
        changed = _changed_settings(saved.get("optimizer"), optim.to_dict())
        if changed and rank == 0:
            print(f"resumed with other optimizer settings than the checkpoint's ({changed}); this run's apply "
                  f"from step {start_step}", flush=True)
    run_identity = {"job_id": job_id, "run_id": run_id, "run_fingerprint": plan.run_fingerprint}

    step_box = [start_step]
    mid_step = [f for f in faults if f.kind == "kill-mid-step" and (f.rank is None or f.rank == rank)]
    if mid_step:
        ops = [0]

        def hook(*_args) -> None:
            for f in mid_step:
                if f.step == step_box[0]:
                    ops[0] += 1
                    if ops[0] >= f.n:
                        sigkill_self()

        pm.executor.comm.op_hook = hook
    if beat is not None:
        pm.executor.on_action = lambda action: where(step_box[0], action)

    # The steps' timeout from here on: what comes before the first step (the optimizer's groups from
    # the model built on meta, the data opened, a checkpoint read) takes each rank its own time, and
    # a rank done early waits on the others under the start-up timeout, not the steps' (--timeout).
    bound_waits(pm, timeout)
    clock_offset = time.time() - time.perf_counter()  # perf_counter -> epoch seconds, comparable across ranks
    events = []
    skipped = 0
    for step in range(start_step, steps):
        step_box[0] = step
        where(step, "starting the step")
        inject(faults, fail_at, rank, step)
        if any(f.hits("nan-weight", rank, step) for f in faults):
            poison(pm, "weight")
        inputs, targets = make_batch(step)
        start = time.perf_counter()
        loss = pm.step(*inputs, target=targets)
        if any(f.hits("kill-mid-step", rank, step) for f in faults):
            sigkill_self()  # fewer P2P transfers than asked for: die before the collectives
        if any(f.hits("nan", rank, step) for f in faults):
            poison(pm, "grad")
        where(step, "checking the loss and gradients")
        loss_value, nonfinite = _loss_and_nonfinite(pm, loss if rank == loss_src else None, device)
        grad_norm = None
        if clip_grad is not None and not nonfinite:
            # The global norm over every rank (clipping.py [Note: the global gradient norm]); every
            # rank reads the same value, so all skip a non-finite one together.
            where(step, "clipping the gradients")
            grad_norm = float(pm.clip_grad_norm_(clip_grad))
            if not math.isfinite(grad_norm):
                nonfinite = f"non-finite gradient norm ({grad_norm})"
        step_lr = optimizer.param_groups[0]["lr"]  # the learning rate of this step (the schedule's)
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
        # The schedule is a function of the step (torchtitan's too): a skipped step advances it as
        # it advances the data.
        scheduler.step()
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
                  (f"  grad norm {grad_norm:.4g}" if grad_norm is not None else "") +
                  (f"  lr {step_lr:.3g}" if optim.lr_schedule != "constant" or optim.warmup_steps else "") +
                  (f"  loss scale {step_scale:g}" if scaler is not None else ""), flush=True)
        if rank == 0 and metrics_path:  # appended per step: a run that dies later keeps what it measured
            record = {"run": run_id, "step": step, "loss": loss_value if not nonfinite else None,
                      "step_time_s": step_time_s, "predicted_step_time_s": plan.predicted.step_time_s, "lr": step_lr}
            if nonfinite:
                record["skipped"] = "gradient overflow" if overflow else nonfinite
            if scaler is not None:
                record["loss_scale"] = step_scale
            if clip_grad is not None:  # the norm before clipping, as torch's clip_grad_norm_ returns it
                record["grad_norm"] = grad_norm if grad_norm is None or math.isfinite(grad_norm) else str(grad_norm)
                record["clip_grad"] = clip_grad
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        done = step + 1
        if make_eval_batch is not None and done % eval_every == 0:
            where(step, "evaluating")
            eval_loss = _evaluate(pm, make_eval_batch, eval_batches, device)
            if rank == 0:
                print(f"eval step {step}  loss {eval_loss:.4f}", flush=True)
                if metrics_path:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps({"run": run_id, "step": step, "eval_loss": eval_loss,
                                            "eval_batches": eval_batches}) + "\n")
        if checkpoint_dir and checkpoint_every and (done % checkpoint_every == 0 or done == steps):
            where(step, f"saving the checkpoint of step {done}")
            path = ckpt.save_checkpoint(
                checkpoint_dir, done, pm, optimizer, timeout=timeout,
                extra={"seed": seed, "model": spec, "model_fingerprint": plan.model_fingerprint, "pp": plan.pp,
                       "dp": plan.dp, "tp": plan.tp, "optimizer": optim.to_dict(),
                       "lr_scheduler": scheduler.state_dict(), "data": data_identity,
                       "samples_seen": done * plan.job.global_batch,
                       **({"loss_scale": pm.loss_scaler.state_dict()} if pm.loss_scaler is not None else {})},
                run=run_identity,
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


def _resume(ckpt, checkpoint_dir: str, chosen_by_launcher: str | None, pm, optimizer,
            rank: int) -> tuple[int, str | None, dict]:
    """Restore the checkpoint the launcher verified (`_check_resumable`; rank 0 chooses where no
    launcher did, and shares the choice so every rank resumes from the same one); returns the step
    to start at, the job the checkpoint records (None: none, or no checkpoint) and its extras."""
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
        return 0, None, {}
    loaded = ckpt.load_checkpoint(chosen[0], checksums=False)  # every file's sha256 was just checked
    same_layout = loaded.manifest.get("world_size") == dist.get_world_size()
    start_step = ckpt.restore(loaded, pm, optimizer, strict=True, rank=rank if same_layout else None)
    scale = (loaded.manifest.get("extra") or {}).get("loss_scale")
    if pm.loss_scaler is not None and scale:  # fp16: the scale goes on where it was (the same on every rank)
        pm.loss_scaler.load_state_dict(scale)
    if rank == 0:
        print(f"resumed from {chosen[0]} (step {start_step})", flush=True)
    return start_step, ckpt.job_id_of(loaded.manifest), dict(loaded.manifest.get("extra") or {})


def _changed_settings(saved: dict | None, current: dict) -> str:
    """"lr 0.001 -> 0.0003, ..." for each optimizer setting a resumed run changes ("" if none, or
    a checkpoint that records none)."""
    if not isinstance(saved, dict):
        return ""
    return ", ".join(f"{k} {saved[k]} -> {v}" for k, v in current.items() if k in saved and saved[k] != v)


def _evaluate(pm, make_batch, num_batches: int, device: torch.device) -> float:
    """The mean loss of batches 0..num_batches-1 of the evaluation data, forward only
    (`PartitionedModel.evaluate`, collective: every rank calls it); every rank returns it. The ranks
    holding a loss (the last stage's) sum theirs; one MAX all-reduce gives it to all (as
    `_loss_and_nonfinite`: flags, since gloo's MAX of -inf and NaN is -inf)."""
    import torch.distributed as dist

    total, held = 0.0, False
    for k in range(num_batches):
        inputs, targets = make_batch(k)
        loss = pm.evaluate(*inputs, target=targets)
        if loss is not None:
            total, held = total + float(loss), True
    report = torch.tensor([total if held and math.isfinite(total) else -float("inf"),
                           1.0 if held and not math.isfinite(total) else 0.0], device=device)
    dist.all_reduce(report, op=dist.ReduceOp.MAX)
    return float("nan") if report[1] > 0 else float(report[0]) / num_batches


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
    refuse a trace measured on another one (report/timeline/trace_match.py check_trace_matches)."""
    t0 = min((e[1] for events in per_rank for e in events), default=0.0)
    trace = [{"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": (start - t0) * 1e6,
              "dur": (end - start) * 1e6, "args": {"step": step}}
             for rank, events in enumerate(per_rank) for name, start, end, step in events]
    trace += [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in range(len(per_rank))]
    named = {"autoplan_plan_fingerprint": plan.run_fingerprint, "autoplan_plan": f"{plan.model}, tp {plan.tp} pp "
             f"{plan.pp} dp {plan.dp}, {plan.schedule}", "num_ranks": plan.num_gpus}
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms", "otherData": named}))
