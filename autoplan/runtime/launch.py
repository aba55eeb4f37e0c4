"""`run_plan`: train a plan for a few steps on synthetic data, locally spawned or under torchrun.

Two ways in (DESIGN.md, "Launch"):
- torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment): this process is one rank.
- `--nproc N`: spawn N local processes (gloo on CPU, NCCL with one GPU each) on a free port. If a
  rank raises, the others are terminated at once (a rank blocked on a dead peer would also fail
  by itself within the process-group timeout), and the launcher prints the failing rank and its
  error on one line and returns 1.

Mistakes found before any communication (missing plan, fingerprint mismatch, wrong world size,
TP plans) print one line and return 2.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from autoplan.plan import Plan, PlanError

__all__ = ["run_plan"]


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(plan: Plan, spec: str) -> None:
    from autoplan.graph import zoo
    from autoplan.runtime.api import check_model

    check_model(zoo.build_model(spec, device="meta"), plan)


def _train(plan: Plan, spec: str, steps: int, seed: int, timeout_s: float, trace_path: str | None,
           metrics_path: str | None, lr: float, fail_at: tuple[int, int] | None) -> None:
    import torch.distributed as dist

    from autoplan.graph import zoo
    from autoplan.runtime.api import default_device, init_distributed, partition

    timeout = timedelta(seconds=timeout_s)
    init_distributed(timeout)
    rank = dist.get_rank()
    device = default_device()
    pm = partition(spec, plan, device=device, seed=seed, timeout=timeout)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=lr)
    batch, seq_len = plan.job.global_batch, plan.job.seq_len
    gen = torch.Generator().manual_seed(seed)
    vocab = zoo.model_info(spec)["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    targets = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    loss_src = plan.rank(plan.pp - 1, 0, 0)
    clock_offset = time.time() - time.perf_counter()  # perf_counter -> epoch seconds, comparable across ranks
    events = []
    metrics = []
    for step in range(steps):
        if fail_at is not None and fail_at == (rank, step):
            raise RuntimeError(f"injected failure at step {step}")
        start = time.perf_counter()
        loss = pm.step(ids, target=targets)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_time_s = time.perf_counter() - start
        # One collective: the loss (only its owner contributes) and the slowest rank's step time.
        report = torch.tensor([float(loss) if rank == loss_src else -float("inf"), step_time_s], device=device)
        dist.all_reduce(report, op=dist.ReduceOp.MAX)
        loss_value, step_time_s = float(report[0]), float(report[1])
        events += [(str(r.action), r.start_s + clock_offset, r.end_s + clock_offset, step) for r in pm.last_trace]
        if rank == 0:
            print(f"step {step}  loss {loss_value:.4f}  step {step_time_s:.3f} s  "
                  f"predicted {plan.predicted.step_time_s:.3f} s", flush=True)
            metrics.append({"step": step, "loss": loss_value, "step_time_s": step_time_s,
                            "predicted_step_time_s": plan.predicted.step_time_s})
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


def _spawned(rank: int, world_size: int, port: int, payload: dict) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    plan = Plan.from_dict(payload.pop("plan"))
    _train(plan, **payload)


def run_plan(plan: str | os.PathLike | Plan, *, model: str | None = None, steps: int = 10, nproc: int | None = None,
             trace_path: str | None = None, metrics_path: str | None = None, seed: int = 0, timeout_s: float = 60.0,
             lr: float = 1e-3, _fail_at: tuple[int, int] | None = None) -> int:
    """Train `plan` for `steps` steps with AdamW on synthetic data; returns the exit code.

    `model` overrides the plan's model spec. Without RANK/WORLD_SIZE in the environment, spawns
    `nproc` (default: the plan's GPU count) local processes. `timeout_s` bounds every wait on a
    peer. `_fail_at=(rank, step)` makes that rank raise before that step (tests of the failure path).
    """
    try:
        plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        spec = model or plan.model
        _check(plan, spec)
    except (PlanError, ValueError) as exc:
        _error(str(exc).splitlines()[0])
        return 2
    payload = dict(spec=spec, steps=steps, seed=seed, timeout_s=timeout_s, trace_path=trace_path,
                   metrics_path=metrics_path, lr=lr, fail_at=_fail_at)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one rank
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != plan.num_gpus:
            _error(f"the plan needs {plan.num_gpus} ranks but WORLD_SIZE is {world_size}")
            return 2
        try:
            _train(plan, **payload)
        except Exception as exc:
            _error(f"rank {os.environ['RANK']} failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            return 1
        return 0
    nproc = plan.num_gpus if nproc is None else nproc
    if nproc != plan.num_gpus:
        _error(f"--nproc {nproc} but the plan needs {plan.num_gpus} processes (tp {plan.tp} * pp {plan.pp} * dp {plan.dp})")
        return 2
    import torch.multiprocessing as mp

    payload["plan"] = plan.to_dict()
    context = mp.start_processes(_spawned, args=(nproc, _free_port(), payload), nprocs=nproc, join=False,
                                 start_method="spawn")
    try:
        while not context.join(timeout=0.5):
            pass
    except mp.ProcessRaisedException as exc:  # the others were terminated by join
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        _error(f"rank {exc.error_index} failed: {lines[-1].strip() if lines else 'unknown error'}")
        return 1
    except mp.ProcessExitedException as exc:
        _error(f"rank {exc.error_index} exited with code {exc.exit_code}")
        return 1
    return 0
