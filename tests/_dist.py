"""Spawn N gloo ranks on a free port with a hard timeout; the job runs in each rank."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

from autoplan.runtime.launcher.rendezvous import hosted_store

__all__ = ["free_port", "recorded_sends", "run_ranks"]


@contextlib.contextmanager
def recorded_sends():
    """Inside a rank: every tensor passed to torch.distributed.isend (the runtime's P2P sends) is
    appended to the yielded list before it is sent."""
    import torch.distributed as dist

    sent: list = []
    isend = dist.isend

    def recording_isend(tensor, *args, **kwargs):
        sent.append(tensor)
        return isend(tensor, *args, **kwargs)

    dist.isend = recording_isend
    try:
        yield sent
    finally:
        dist.isend = isend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, job: Callable, args: tuple, queue, pg_timeout_s: float) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    try:  # the store `run_ranks` holds: no port to lose between picking and binding it
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timedelta(seconds=pg_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        result = job(rank, world_size, *args)
        queue.put((rank, "ok", pickle.dumps(result)))  # plain pickle: no shared-memory tensors
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(job: Callable, world_size: int, *args: Any, timeout_s: float = 60.0, pg_timeout_s: float = 30.0,
              expect_failure: bool = False) -> dict[int, Any]:
    """Run `job(rank, world_size, *args)` in `world_size` processes; {rank: result}.

    Every process is killed after `timeout_s`. Unless `expect_failure`, a rank's exception fails
    the caller with its traceback. With `expect_failure`, returns {rank: (exitcode, status, msg)}.
    """
    from conftest import scaled_timeout_s  # [Note: timeouts under load]

    timeout_s, pg_timeout_s = scaled_timeout_s(timeout_s), scaled_timeout_s(pg_timeout_s)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "autoplan.runtime.api", "autoplan.runtime.launcher.launch"])
    queue = ctx.SimpleQueue()
    with hosted_store() as port:  # [Note: a port held from the start]
        return _run_ranks_on(port, ctx, queue, job, world_size, args, timeout_s, pg_timeout_s, expect_failure)


def _run_ranks_on(port: int, ctx, queue, job: Callable, world_size: int, args: tuple, timeout_s: float,
                  pg_timeout_s: float, expect_failure: bool) -> dict[int, Any]:
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, job, args, queue, pg_timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}

    def drain() -> None:  # read while the ranks run: a full pipe would block a rank's put
        while not queue.empty():
            rank, status, value = queue.get()
            results[rank] = (status, pickle.loads(value) if status == "ok" else value)

    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        drain()
        time.sleep(0.02)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    drain()
    if expect_failure:
        return {r: (p.exitcode, *results.get(r, (None, None))) for r, p in enumerate(procs)}
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {timeout_s} s; results: {results}")
    failed = {r: value for r, (status, value) in sorted(results.items()) if status != "ok"}
    if failed:
        # A peer's failure shows up on the others as a broken connection: name the cause first.
        def is_echo(text: str) -> bool:
            return any(k in text.splitlines()[0] for k in ("Connection", "P2PTimeout", "Read error", "timed out"))

        first = min(failed, key=lambda r: (is_echo(failed[r]), r))
        others = "; ".join(f"rank {r}: {failed[r].splitlines()[0][:200]}" for r in failed if r != first)
        raise AssertionError(f"rank {first} failed: {failed[first]}" + (f"\n(also {others})" if others else ""))
    missing = [r for r in range(world_size) if r not in results]
    assert not missing, f"ranks {missing} exited without a result (exit codes {[p.exitcode for p in procs]})"
    return {r: v for r, (_, v) in results.items()}


def make_plan(model_name: str, fingerprint: str, block_names, *, pp: int, dp: int = 1, tp: int = 1,
              cuts=None, schedule: str = "1f1b", virtual_stages: int = 1, micro_batch_size: int = 2,
              num_microbatches: int = 4, seq_len: int = 16, recompute: str = "none", zero: int = 0,
              dtype: str = "float32", dp_replicate: int = 1):
    """A Plan built by hand (no search): stages cut evenly unless `cuts` (end blocks) is given."""
    from autoplan.cluster import parse_cluster
    from autoplan.plan import Job, Plan, Predicted, StagePlan

    num_stages = pp * virtual_stages
    n = len(block_names)
    ends = list(cuts) if cuts is not None else [round(n * (k + 1) / num_stages) for k in range(num_stages)]
    starts = [0, *ends[:-1]]
    stages = tuple(StagePlan(index=k, pp_rank=k % pp, first_block=starts[k], end_block=ends[k]) for k in range(num_stages))
    nothing = Predicted(step_time_s=0.0, tokens_per_s=0.0, model_tflops_per_gpu=0.0, hardware_tflops_per_gpu=0.0,
                     mfu=0.0, hfu=0.0, peak_memory_bytes=0.0, bubble_fraction=0.0)
    return Plan(model=model_name, model_fingerprint=fingerprint,
                cluster=parse_cluster(f"1x{pp * dp * tp}xcpu").to_dict(),
                job=Job(global_batch=micro_batch_size * num_microbatches * dp, seq_len=seq_len, dtype=dtype),
                tp=tp, pp=pp, dp=dp, virtual_stages=virtual_stages, micro_batch_size=micro_batch_size,
                num_microbatches=num_microbatches, schedule=schedule, recompute=recompute, zero=zero,
                sequence_parallel=False, rank_order="tp-dp-pp", stages=stages, block_names=tuple(block_names),
                fits=False, predicted=nothing, dp_replicate=dp_replicate)
