"""`autoplan calibrate --collectives`: all-reduce, all-gather, reduce-scatter and p2p bandwidth
curves over local processes (or the torchrun world), timed the nccl-tests way.

Apart from the kernel microbenchmarks (calibrate_kernels.py): these spawn ranks and join a process
group.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from autoplan.calibrate.calibrate_kernels import MB, Progress, Sweep, fmt_size, stderr_progress

__all__ = ["COLLECTIVE_OPS", "CalibrationRunError"]


class CalibrationRunError(RuntimeError):
    """A benchmark that failed while running (a collective rank died or timed out)."""



COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def _bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth correction (doc/PERFORMANCE.md): busbw = algbw * factor."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 1.0)


def collectives_rank(device: str, sweep: Sweep, timeout_s: float, progress: Progress) -> dict[str, Any] | None:
    """One rank of the collective benchmark (RANK / WORLD_SIZE / MASTER_* in the environment);
    returns the curves on rank 0, None elsewhere."""
    import datetime as dt

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():  # under torchrun: from its environment; spawned locally: `_collectives_spawned`
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=dt.timedelta(seconds=timeout_s))
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    points = []
    try:
        for op in COLLECTIVE_OPS:
            for num_bytes in sweep.collective_bytes:
                numel = max(world, num_bytes // 4 // world * world)  # float32, divisible by the ranks
                full = torch.ones(numel, device=dev)
                part = torch.ones(numel // world, device=dev)
                if op == "p2p":  # rank 0 sends to rank 1; the others only join the barriers
                    fn = (partial(dist.send, full, 1) if rank == 0 else partial(dist.recv, full, 0) if rank == 1
                          else _nothing)
                else:
                    fn = {"all_reduce": partial(dist.all_reduce, full), "all_gather": partial(all_gather, full, part),
                          "reduce_scatter": partial(reduce_scatter, part, full)}[op]
                # nccl-tests: warm-up, then wall-clock around back-to-back calls and a stream sync,
                # per repeat; the slowest rank's time (all-reduce MAX) is the collective's.
                num_calls = max(2, min(50, 256 * MB // max(num_bytes, 1)))
                for _ in range(2):
                    fn()
                sync()
                times = []
                for _ in range(sweep.num_repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(num_calls):
                        fn()
                    sync()
                    times.append((time.perf_counter() - start) / num_calls)
                worst = torch.tensor(times, dtype=torch.float64, device=dev)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                times = worst.tolist()
                median = statistics.median(times)
                size = numel * 4
                bw = size / median * _bus_factor(op, world)
                points.append({"op": op, "bytes": size, "time_s": median, "bw_bytes_per_s": bw,
                               "spread": (max(times) - min(times)) / median})
                if rank == 0:
                    progress(f"{op} [{world} ranks] {fmt_size(size)}: {median * 1e6:.1f} us, "
                             f"{'busbw' if op != 'p2p' else 'bw'} {bw / 1e9:.2f} GB/s (spread {points[-1]['spread']:.1%})")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    link = "inter_node" if local_world < world else "intra_node"
    curves: dict[str, Any] = {"ranks": world}
    for op in COLLECTIVE_OPS:
        curves[op] = [[p["bytes"], p["bw_bytes_per_s"]] for p in points if p["op"] == op]
    return {"collectives": {link: curves}, "points": points, "link": link}


def _nothing() -> None:
    pass


def _collectives_spawned(rank: int, world: int, port: int, payload: dict, run_dir: str) -> None:
    """Entry of a locally spawned rank (`ranks.LocalJob` ties it to the launcher and records its failure);
    it joins the store `measure_collectives` holds ([Note: a port held from the start])."""
    from datetime import timedelta

    from autoplan.runtime.launcher.rendezvous import loopback_process_group, startup_timeout

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # RANK and the sizes for `collectives_rank`; the process group joins the store on `port`, not MASTER_PORT.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    loopback_process_group(rank, world, port, startup_timeout(timedelta(seconds=payload["timeout_s"])))
    result = collectives_rank(payload["device"], payload["sweep"], payload["timeout_s"], stderr_progress)
    if result is not None:
        (Path(run_dir) / "collectives.json").write_text(json.dumps(result))


def measure_collectives(device: str, nproc: int, sweep: Sweep, timeout_s: float) -> dict[str, Any]:
    """Spawn `nproc` local ranks (gloo on CPU, NCCL on CUDA) and return rank 0's curves; a rank
    that fails, or a run longer than `timeout_s` overall, raises CalibrationRunError."""
    from autoplan.runtime.launcher.ranks import LocalJob
    from autoplan.runtime.launcher.rendezvous import hosted_store

    payload = {"device": device, "sweep": sweep, "timeout_s": timeout_s}
    deadline = time.monotonic() + timeout_s

    def check_deadline() -> None:
        if time.monotonic() > deadline:
            raise CalibrationRunError(f"the collective benchmark did not finish in {timeout_s:g} s")

    with hosted_store() as port, LocalJob(nproc, name="autoplan-calibrate") as job:
        job.start(_collectives_spawned, (nproc, port, payload, job.run_dir))
        if job.supervise(grace_s=5.0, on_poll=check_deadline) != 0:
            raise CalibrationRunError("the collective benchmark failed (the line above names the rank)")
        return json.loads((Path(job.run_dir) / "collectives.json").read_text())
