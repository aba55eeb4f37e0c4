"""`autoplan calibrate`: measure what this machine's GPU (or CPU) achieves and write a calibration.

Microbenchmarks, each point timed by `_time_s` ([Note: calibration timing]):

- a GEMM sweep over (M, N, K) per dtype (`torch.matmul` of M x K by K x N);
- fused attention (`scaled_dot_product_attention`) forward and backward at a few
  (batch, heads, seq, head_dim), causal and not;
- memory-bound kernels (a copy and an add) from 64 KB to 1 GB;
- with `collectives=True`, all-reduce, all-gather, reduce-scatter and p2p over message sizes across
  local processes (or the torchrun world), timed the nccl-tests way.

The fits (`_fit`) turn the points into the parameters `cost/ops.py` reads; the file keeps every raw
point with its spread under `measurements` (format: `cost/calibration.py`).

[Note: calibration timing] On CUDA, CUDA events around `num_calls` back-to-back calls after warm-up
(the first call selects kernels and allocates); on CPU `time.perf_counter` around the same loop.
`num_calls` is chosen so that one repeat lasts about `target_s`, which keeps launch jitter small
against the measured span; the point's time is the median over `num_repeats` repeats, and its spread
is (max - min) / median of those repeats.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from autoplan.cluster import GPU, GPUS, cpu_device, dtype_key, get_gpu
from autoplan.cost.calibration import Calibration
from autoplan.cost.ops import gemm_time_s
from autoplan.runtime.preflight import MAX_TIMEOUT_S

__all__ = ["CalibrationRunError", "calibrate", "guess_gpu", "write_calibration"]

Progress = Callable[[str], None]


class CalibrationRunError(RuntimeError):
    """A benchmark that failed while running (a collective rank died or timed out)."""


# ---- settings ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sweep:
    """What to measure and how long to time each point."""

    gemm: tuple[tuple[int, int, int], ...]
    """(M, N, K) of each GEMM."""
    attention: tuple[tuple[int, int, int, int], ...]
    """(batch, heads, seq, head_dim) of each attention call."""
    memory_bytes: tuple[int, ...]
    """Bytes of each memory kernel's source tensor."""
    collective_bytes: tuple[int, ...]
    """Full-buffer size of each collective (nccl-tests' "size" column)."""
    target_s: float
    """About how long one timed repeat lasts."""
    num_repeats: int


_KB, _MB, _GB = 2**10, 2**20, 2**30


def _sweep(device: str, quick: bool) -> _Sweep:
    if device == "cuda" and not quick:
        return _Sweep(
            gemm=tuple((m, n, k) for m in (512, 2048, 4096, 8192, 16384) for n in (1024, 4096, 8192, 16384)
                       for k in (1024, 4096, 8192, 16384)),
            attention=((8, 16, 1024, 64), (4, 32, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)),
            memory_bytes=tuple(64 * _KB * 4**i for i in range(8)),  # 64 KB .. 1 GB
            collective_bytes=tuple(_KB * 4**i for i in range(11)),  # 1 KB .. 1 GB
            target_s=0.02, num_repeats=7)
    if device == "cuda":
        return _Sweep(gemm=((512, 1024, 1024), (2048, 4096, 4096), (4096, 8192, 8192)),
                      attention=((4, 16, 1024, 64), (2, 16, 2048, 128)),
                      memory_bytes=(64 * _KB, _MB, 16 * _MB, 256 * _MB),
                      collective_bytes=(4 * _KB, _MB, 64 * _MB), target_s=0.01, num_repeats=5)
    if not quick:
        return _Sweep(gemm=tuple((m, n, k) for m in (256, 1024) for n in (256, 1024) for k in (256, 1024)),
                      attention=((1, 4, 256, 64), (2, 8, 512, 64)),
                      memory_bytes=tuple(64 * _KB * 4**i for i in range(7)),  # 64 KB .. 256 MB
                      collective_bytes=tuple(4 * _KB * 4**i for i in range(7)), target_s=0.02, num_repeats=5)
    return _Sweep(gemm=((128, 128, 128), (256, 256, 256), (512, 256, 512), (512, 512, 512)),
                  attention=((1, 2, 128, 32), (2, 4, 256, 32)),
                  memory_bytes=(64 * _KB, 256 * _KB, 4 * _MB, 16 * _MB),
                  collective_bytes=(4 * _KB, 64 * _KB, _MB), target_s=0.005, num_repeats=5)


_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- GPU names -------------------------------------------------------------------------------------------


def guess_gpu(device_name: str, mem_bytes: int | None = None) -> str | None:
    """The autoplan GPU type of `torch.cuda.get_device_name()` ("NVIDIA H100 80GB HBM3" ->
    "H100-SXM-80GB"), or None when unsure."""
    name = device_name.upper()
    if "H100" in name:
        return "H100-PCIe-80GB" if ("PCIE" in name or "NVL" in name) else "H100-SXM-80GB"
    if "H200" in name:
        return "H200-SXM-141GB"
    if "A100" in name:
        if "PCIE" in name:
            return None  # no PCIe A100 in the table: its clocks and power limit differ from the SXM4
        large = "80G" in name or (mem_bytes is not None and mem_bytes > 48 * _GB)
        return "A100-SXM4-80GB" if large else "A100-SXM4-40GB"
    if "L40S" in name:
        return "L40S"
    if "A10G" in name:
        return "A10G"
    if "V100" in name and ("SXM2" in name and "32G" in name):
        return "V100-SXM2-32GB"
    if "GB200" in name:  # before B200: "NVIDIA GB200" contains "B200"
        return "GB200"
    if "B200" in name:
        return "B200-SXM-180GB"
    if "MI325X" in name:
        return "MI325X"
    if "MI300X" in name:
        return "MI300X"
    return None


def _resolve_gpu(device: str, gpu_name: str | None) -> GPU:
    if device == "cpu":
        gpu = get_gpu(gpu_name) if gpu_name else cpu_device()
        if gpu.name != "cpu":
            raise ValueError(f"--device cpu measures this machine's CPU; --gpu must be cpu or left out, got {gpu.name}")
        return gpu
    if gpu_name:
        return get_gpu(gpu_name)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    guessed = guess_gpu(props.name, props.total_memory)
    if guessed is None:
        raise ValueError(f"cannot tell which GPU type {props.name!r} is; name it with --gpu "
                         f"(one of {', '.join(GPUS)})")
    return GPUS[guessed]


def _device_description(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"{platform.processor() or platform.machine()} CPU ({os.cpu_count()} cores)"


# ---- timing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Timed:
    time_s: float
    """Median seconds of one call."""
    spread: float
    """(max - min) / median over the repeats."""


def _time_s(fn: Callable[[], object], device: str, sweep: _Sweep) -> _Timed:
    """See [Note: calibration timing]."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    once_s = math.inf
    for _ in range(3):  # the fastest of a few calls: one preempted call must not set num_calls
        start = time.perf_counter()
        fn()
        sync()
        once_s = min(once_s, time.perf_counter() - start)
    num_calls = max(1, min(1000, int(sweep.target_s / max(once_s, 1e-7))))
    times = []
    for _ in range(sweep.num_repeats):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(num_calls):
                fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3 / num_calls)
        else:
            start = time.perf_counter()
            for _ in range(num_calls):
                fn()
            times.append((time.perf_counter() - start) / num_calls)
    median = statistics.median(times)
    return _Timed(median, (max(times) - min(times)) / median if median > 0 else 0.0)


@contextlib.contextmanager
def _matmul_precision(key: str):
    """TF32 on for a `tf32` sweep only (torch leaves it off by default), restored after."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


# ---- microbenchmarks ------------------------------------------------------------------------------------


def _bench_gemm(device: str, key: str, sweep: _Sweep, progress: Progress) -> list[dict[str, Any]]:
    dtype = _TORCH_DTYPES[key]
    points = []
    with _matmul_precision(key):
        for i, (m, n, k) in enumerate(sweep.gemm, 1):
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            out = torch.empty(m, n, device=device, dtype=dtype)
            timed = _time_s(partial(torch.matmul, a, b, out=out), device, sweep)
            tflops = 2 * m * n * k / timed.time_s / 1e12
            points.append({"dtype": key, "m": m, "n": n, "k": k, "time_s": timed.time_s, "spread": timed.spread})
            progress(f"gemm {key} [{i}/{len(sweep.gemm)}] {m}x{n}x{k}: {timed.time_s * 1e3:.3f} ms, "
                     f"{tflops:.2f} TFLOP/s (spread {timed.spread:.1%})")
            del a, b, out
    return points


def _bench_attention(device: str, key: str, sweep: _Sweep, progress: Progress) -> list[dict[str, Any]]:
    dtype = _TORCH_DTYPES[key]
    points = []
    total = len(sweep.attention) * 2
    for i, (batch, heads, seq, head_dim) in enumerate(sweep.attention):
        shape = (batch, heads, seq, head_dim)
        for j, causal in enumerate((False, True)):
            q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            grad_out = torch.randn(*shape, device=device, dtype=dtype)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            with torch.no_grad():
                fwd = _time_s(partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal), device, sweep)
            bwd = _time_s(partial(torch.autograd.grad, out, (q, k, v), grad_out, retain_graph=True), device, sweep)
            # The profile counts attention FLOPs with torch's flop counter (full s x s scores).
            flops = {"fwd": sdpa_flop_count(shape, shape, shape), "bwd": sdpa_backward_flop_count(shape, shape, shape, shape)}
            for phase, timed in (("fwd", fwd), ("bwd", bwd)):
                points.append({"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal,
                               "phase": phase, "flops": flops[phase], "time_s": timed.time_s, "spread": timed.spread})
            progress(f"attention [{2 * i + j + 1}/{total}] b{batch} h{heads} s{seq} d{head_dim} "
                     f"{'causal' if causal else 'full'}: fwd {fwd.time_s * 1e3:.3f} ms (spread {fwd.spread:.1%}), "
                     f"bwd {bwd.time_s * 1e3:.3f} ms (spread {bwd.spread:.1%})")
            del q, k, v, grad_out, out
    return points


def _bench_memory(device: str, key: str, sweep: _Sweep, progress: Progress) -> list[dict[str, Any]]:
    dtype = _TORCH_DTYPES[key]
    size = torch.tensor([], dtype=dtype).element_size()
    points = []
    total = len(sweep.memory_bytes) * 2
    for i, num_bytes in enumerate(sweep.memory_bytes):
        a = torch.randn(num_bytes // size, device=device, dtype=dtype)
        b, c = torch.empty_like(a), torch.randn_like(a)
        # bytes moved: a copy reads and writes n, an add reads 2n and writes n.
        kernels = (("copy", partial(b.copy_, a), 2), ("add", partial(torch.add, a, c, out=b), 3))
        for j, (kernel, fn, factor) in enumerate(kernels):
            timed = _time_s(fn, device, sweep)
            moved = factor * num_bytes
            points.append({"kernel": kernel, "bytes": num_bytes, "moved_bytes": moved, "time_s": timed.time_s,
                           "spread": timed.spread, "bw_bytes_per_s": moved / timed.time_s})
            progress(f"memory [{2 * i + j + 1}/{total}] {kernel} {_fmt_size(num_bytes)}: {timed.time_s * 1e6:.1f} us, "
                     f"{moved / timed.time_s / 1e9:.1f} GB/s (spread {timed.spread:.1%})")
        del a, b, c
    return points


def _fmt_size(num_bytes: float) -> str:
    for unit, scale in (("GB", _GB), ("MB", _MB), ("KB", _KB)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes:g} B"


# ---- fitting --------------------------------------------------------------------------------------------


def _golden_min(f: Callable[[float], float], lo: float, hi: float, steps: int = 80) -> float:
    """Minimum of a unimodal f on [lo, hi] (golden-section search)."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    for _ in range(steps):
        if f(c) < f(d):
            b, d = d, c
            c = b - ratio * (b - a)
        else:
            a, c = c, d
            d = a + ratio * (b - a)
    return (a + b) / 2


def _fit_gemm(points: list[dict[str, Any]], base: Calibration, gpu: GPU, key: str) -> float:
    """The GEMM share of peak that makes `gemm_time_s` fit the sweep best: least squares on log
    time over every point. Log time weighs every shape by its relative error, as the planner's
    ranking does; fitting through `gemm_time_s` itself (traffic term and floor included, with the
    measured bandwidth and floor) keeps the share from absorbing the memory time of the skinny
    shapes, which a median of per-point shares would have to drop by a compute-bound cut-off.
    Unclamped: a share above 1 means the datasheet peak is below what this device did."""
    element_bytes = torch.tensor([], dtype=_TORCH_DTYPES[key]).element_size()

    def loss(log_share: float) -> float:
        cal = base.replace(gemm_efficiency={key: math.exp(log_share)})
        return sum((math.log(gemm_time_s(cal, gpu, 1, p["m"], p["n"], p["k"], key, element_bytes))
                    - math.log(p["time_s"])) ** 2 for p in points)

    return math.exp(_golden_min(loss, math.log(1e-4), math.log(100.0)))


def _spreads(points: Sequence[dict[str, Any]]) -> dict[str, float]:
    values = [p["spread"] for p in points]
    return {"points": len(values), "spread_median": statistics.median(values), "spread_max": max(values)}


def _clamp(name: str, value: float, notes: list[str], why: str) -> float:
    """Calibration shares live in (0, 1]; a measured share above 1 is kept in the record and capped."""
    if value > 1.0:
        notes.append(f"{name} measured {value:.3g} > 1 ({why}); capped at 1")
        return 1.0
    return value


def _fit(gpu: GPU, keys: Sequence[str], gemm: list[dict], attention: list[dict], memory: list[dict],
         ) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """(fitted numbers, summary rows, notes) from the raw points."""
    notes: list[str] = []
    peak_why = ("the CPU peak is an estimate: set AUTOPLAN_CPU_GFLOPS_PER_CORE" if gpu.name == "cpu"
                else "the datasheet peak is below what was measured; check --gpu")
    rows: list[dict[str, Any]] = []

    # Memory: the largest kernels stream (bandwidth); the smallest are all launch and tail (floor).
    # Copies and adds alike: ops.py prices every memory-bound kernel by bytes moved.
    sizes = sorted({p["bytes"] for p in memory})
    large = [p for p in memory if p["bytes"] in sizes[-2:]]
    small = [p for p in memory if p["bytes"] == sizes[0]]
    bw_bytes_per_s = statistics.median(p["bw_bytes_per_s"] for p in large)
    bw_share_raw = bw_bytes_per_s / gpu.mem_bw_bytes_per_s
    bw_share = _clamp("memory bandwidth share", bw_share_raw, notes,
                      "the CPU bandwidth is an estimate, and small sizes stay in cache" if gpu.name == "cpu"
                      else "the datasheet bandwidth is below what was measured; check --gpu")
    floor_s = statistics.median(p["time_s"] for p in small)
    rows.append({"quantity": "memory bandwidth share", "value": bw_share,
                 "detail": f"{bw_bytes_per_s / 1e9:.1f} GB/s of {gpu.mem_bw_bytes_per_s / 1e9:g}; median of the "
                           f"{_fmt_size(sizes[-2])}+ kernels", **_spreads(large)})
    rows.append({"quantity": "kernel floor", "value": floor_s, "unit": "s",
                 "detail": f"median time of the {_fmt_size(sizes[0])} kernels", **_spreads(small)})

    base = Calibration(gpu=gpu.name, gemm_efficiency={keys[0]: 1.0}, attention_fwd_efficiency=1.0,
                       attention_bwd_efficiency=1.0, causal_work_fraction=1.0,
                       memory_bandwidth_efficiency=bw_share_raw, kernel_floor_s=floor_s)
    gemm_raw, gemm_share = {}, {}
    for key in keys:
        pts = [p for p in gemm if p["dtype"] == key]
        gemm_raw[key] = _fit_gemm(pts, base, gpu, key)
        gemm_share[key] = _clamp(f"GEMM share ({key})", gemm_raw[key], notes, peak_why)
        best = max(2 * p["m"] * p["n"] * p["k"] / p["time_s"] for p in pts)
        rows.append({"quantity": f"GEMM share ({key})", "value": gemm_share[key],
                     "detail": f"least squares on log time; best {best / 1e12:.2f} of "
                               f"{gpu.peak(key) / 1e12:.3g} TFLOP/s", **_spreads(pts)})

    # Attention: the share from the full (non-causal) calls, whose work the FLOP count describes
    # exactly; the causal fraction is then how much of that time a causal call takes.
    peak = gpu.peak(keys[0])
    attention_raw: dict[str, float] = {}
    for phase in ("fwd", "bwd"):
        full = [p for p in attention if p["phase"] == phase and not p["causal"]]
        attention_raw[phase] = statistics.median(p["flops"] / (p["time_s"] * peak) for p in full)
        rows.append({"quantity": f"attention {phase} share", "value": 0.0,
                     "detail": "median over the non-causal shapes", **_spreads(full)})
    shares = {phase: _clamp(f"attention {phase} share", attention_raw[phase], notes, peak_why)
              for phase in ("fwd", "bwd")}
    rows[-2]["value"], rows[-1]["value"] = shares["fwd"], shares["bwd"]
    ratios = []
    for p in attention:
        if p["causal"]:
            twin = next(q for q in attention if not q["causal"] and q["phase"] == p["phase"]
                        and all(q[f] == p[f] for f in ("batch", "heads", "seq", "head_dim")))
            ratios.append(p["time_s"] / twin["time_s"])
    causal_raw = statistics.median(ratios)
    causal = _clamp("causal work fraction", causal_raw, notes,
                    "this causal kernel takes longer than the full one: it masks rather than skips")
    rows.append({"quantity": "causal work fraction", "value": causal,
                 "detail": "median causal / non-causal time", **_spreads([p for p in attention if p["causal"]])})

    fitted = {"gemm_efficiency": gemm_share, "attention_fwd_efficiency": shares["fwd"],
              "attention_bwd_efficiency": shares["bwd"], "causal_work_fraction": causal,
              "memory_bandwidth_efficiency": bw_share, "kernel_floor_s": floor_s,
              "unclamped": {"gemm_efficiency": gemm_raw, "attention_fwd_efficiency": attention_raw["fwd"],
                            "attention_bwd_efficiency": attention_raw["bwd"], "causal_work_fraction": causal_raw,
                            "memory_bandwidth_efficiency": bw_share_raw}}
    return fitted, rows, notes


# ---- collectives ----------------------------------------------------------------------------------------

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


def _bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth correction (doc/PERFORMANCE.md): busbw = algbw * factor."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 1.0)


def _collectives_rank(device: str, sweep: _Sweep, timeout_s: float, progress: Progress) -> dict[str, Any] | None:
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
                num_calls = max(2, min(50, 256 * _MB // max(num_bytes, 1)))
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
                    progress(f"{op} [{world} ranks] {_fmt_size(size)}: {median * 1e6:.1f} us, "
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


def _stderr_progress(line: str) -> None:
    print(f"autoplan calibrate: {line}", file=sys.stderr, flush=True)


def _collectives_spawned(rank: int, world: int, port: int, payload: dict, run_dir: str) -> None:
    """Entry of a locally spawned rank (`ranks.LocalJob` ties it to the launcher and records its failure)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    result = _collectives_rank(payload["device"], payload["sweep"], payload["timeout_s"], _stderr_progress)
    if result is not None:
        (Path(run_dir) / "collectives.json").write_text(json.dumps(result))


def _measure_collectives(device: str, nproc: int, sweep: _Sweep, timeout_s: float) -> dict[str, Any]:
    """Spawn `nproc` local ranks (gloo on CPU, NCCL on CUDA) and return rank 0's curves; a rank
    that fails, or a run longer than `timeout_s` overall, raises CalibrationRunError."""
    from autoplan.runtime.ranks import LocalJob, free_port

    payload = {"device": device, "sweep": sweep, "timeout_s": timeout_s}
    deadline = time.monotonic() + timeout_s

    def check_deadline() -> None:
        if time.monotonic() > deadline:
            raise CalibrationRunError(f"the collective benchmark did not finish in {timeout_s:g} s")

    with LocalJob(nproc, name="autoplan-calibrate") as job:
        job.start(_collectives_spawned, (nproc, free_port(), payload, job.run_dir))
        if job.supervise(grace_s=5.0, on_poll=check_deadline) != 0:
            raise CalibrationRunError("the collective benchmark failed (the line above names the rank)")
        return json.loads((Path(job.run_dir) / "collectives.json").read_text())


# ---- the command ----------------------------------------------------------------------------------------


def _check_out(out: str | os.PathLike, force: bool) -> Path:
    path = Path(out)
    if path.exists() and not force:
        raise ValueError(f"{path} exists; pass --force to overwrite it")
    if path.exists() and path.is_dir():
        raise ValueError(f"--out {path} is a directory; name a file")
    if not path.parent.exists():
        raise ValueError(f"--out {path}: directory {path.parent} does not exist")
    return path


def _check_arguments(out, device, gpu, dtype, quick, collectives, nproc, force, timeout_s, progress) -> None:
    """The arguments' types and ranges, one line each, before anything is measured (a wrong type
    was an AttributeError traceback; `--timeout -1` was accepted)."""
    if not isinstance(out, str | os.PathLike):
        raise TypeError(f"--out must be a file path, got {type(out).__name__}")
    if not str(out).strip():
        raise ValueError("--out is empty; name the calibration JSON file to write")
    for flag, value in (("--device", device), ("--gpu", gpu), ("--dtype", dtype)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{flag} must be a string, got {value!r}")
        if value is not None and not value.strip():
            raise ValueError(f"{flag} is empty; name one, or leave it out for the default")
    for flag, value in (("--quick", quick), ("--collectives", collectives), ("--force", force)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be True or False, got {value!r}")
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool)):
        raise TypeError(f"--nproc must be an integer, got {nproc!r}")
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool):
        raise TypeError(f"--timeout must be a number of seconds, got {timeout_s!r}")
    if not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"--timeout {timeout_s:g} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g} "
                         "(default 600)")
    if not callable(progress):
        raise TypeError(f"progress must be a function of one string, got {type(progress).__name__}")


def calibrate(out: str | os.PathLike, *, device: str | None = None, gpu: str | None = None,
              dtype: str | None = None, quick: bool = False, collectives: bool = False, nproc: int | None = None,
              force: bool = False, timeout_s: float = 600.0, progress: Progress = _stderr_progress) -> Calibration | None:
    """Measure this machine and write a calibration to `out` (see the module docstring).

    `device`: "cuda" or "cpu" (default cuda when available); `gpu`: the GPU type the numbers are
    for (default: guessed from the device name); `dtype`: comma-separated GEMM dtypes, the first
    also used for attention and memory (default bf16 on cuda, float32 on cpu); `quick`: a few
    small shapes; `collectives`: also measure collective curves over `nproc` local processes (default
    the visible GPUs, 2 on CPU) or, under torchrun, the launched world. Returns the calibration
    written, or None on a rank other than 0 (only rank 0 writes). User mistakes raise ValueError
    before anything runs; a failed collective run raises CalibrationRunError.
    """
    _check_arguments(out, device, gpu, dtype, quick, collectives, nproc, force, timeout_s, progress)
    path = _check_out(out, force)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device {device!r}: use cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; use --device cpu")
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if device == "cuda" and launched:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    target = _resolve_gpu(device, gpu)
    keys = []
    for name in (dtype or ("bf16" if device == "cuda" else "float32")).split(","):
        key = dtype_key(name)
        if key not in _TORCH_DTYPES:
            raise ValueError(f"--dtype {name}: calibrate measures fp32, tf32, bf16 and fp16 GEMMs, not {key}")
        if not target.supports(key):
            raise ValueError(f"--dtype {name}: {target.name} has no {key} peak; choose another dtype")
        if key not in keys:
            keys.append(key)
    sweep = _sweep(device, quick)
    if collectives:
        if launched:
            world = int(os.environ["WORLD_SIZE"])
        else:
            world = nproc if nproc is not None else (torch.cuda.device_count() if device == "cuda" else 2)
        if world < 2:
            raise ValueError(f"--collectives needs at least 2 ranks, got {world}; pass --nproc 2 or more")
        if device == "cuda" and not launched and world > torch.cuda.device_count():
            raise ValueError(f"--nproc {world} but only {torch.cuda.device_count()} GPUs are visible")
        cores = os.cpu_count() or 1
        if device == "cpu" and not launched and world > max(2, cores):
            # Ranks beyond the cores time the scheduler, not the link (and 1e30 tried to spawn 1e30).
            raise ValueError(f"--nproc {world} is more than this machine's {cores} CPU cores; pass --nproc "
                             f"{max(2, cores)} or fewer")
    elif nproc is not None:
        raise ValueError("--nproc only applies with --collectives")

    measured_collectives = None
    if collectives:
        progress(f"collectives over {world} ranks ({'nccl' if device == 'cuda' else 'gloo'})")
        if launched:
            measured_collectives = _collectives_rank(device, sweep, timeout_s, progress)
            if measured_collectives is None:
                return None  # rank 0 measures the rest and writes the file
        else:
            measured_collectives = _measure_collectives(device, world, sweep, timeout_s)
    elif launched and int(os.environ["RANK"]) != 0:
        return None

    described = _device_description(device)
    stamp = datetime.date.today().isoformat()
    source = f"measured by `autoplan calibrate` on {described}, torch {torch.__version__}, {stamp}"
    progress(f"calibrating {target.name} on {described} ({', '.join(keys)}{', quick' if quick else ''})")
    memory = _bench_memory(device, keys[0], sweep, progress)
    gemm = [p for key in keys for p in _bench_gemm(device, key, sweep, progress)]
    attention = _bench_attention(device, keys[0], sweep, progress)
    fitted, rows, notes = _fit(target, keys, gemm, attention, memory)

    sources = {"file": source,
               "gemm": f"{source}; least squares on log time over {len(gemm)} GEMMs ({', '.join(keys)})",
               "attention": f"{source}; scaled_dot_product_attention {keys[0]}, {len(attention)} points",
               "memory": f"{source}; copy and add kernels, {len(memory)} points"}
    measurements: dict[str, Any] = {"device": described, "torch": torch.__version__, "date": stamp,
                                    "gpu": target.name, "quick": quick, "gemm": gemm, "attention": attention,
                                    "memory": memory, "fit": {**fitted, "summary": rows, "notes": notes}}
    curves: dict[str, Any] = {}
    if measured_collectives is not None:
        curves = measured_collectives["collectives"]
        link = measured_collectives["link"]
        sources["collectives"] = (f"{source}; {curves[link]['ranks']} ranks, "
                                  f"{'nccl' if device == 'cuda' else 'gloo'}, nccl-tests bus bandwidth")
        measurements["collectives"] = measured_collectives["points"]
        for op in COLLECTIVE_OPS:
            pts = [p for p in measured_collectives["points"] if p["op"] == op]
            last = max(pts, key=lambda p: p["bytes"])
            rows.append({"quantity": f"{op} {'busbw' if op != 'p2p' else 'bw'} ({link})",
                         "value": last["bw_bytes_per_s"], "unit": "B/s",
                         "detail": f"at {_fmt_size(last['bytes'])}; curve of {len(pts)} sizes", **_spreads(pts)})
    cal = Calibration(gpu=target.name, gemm_efficiency=fitted["gemm_efficiency"],
                      attention_fwd_efficiency=fitted["attention_fwd_efficiency"],
                      attention_bwd_efficiency=fitted["attention_bwd_efficiency"],
                      causal_work_fraction=fitted["causal_work_fraction"],
                      memory_bandwidth_efficiency=fitted["memory_bandwidth_efficiency"],
                      kernel_floor_s=fitted["kernel_floor_s"], collectives=curves, sources=sources,
                      measurements=measurements)
    write_calibration(cal, path)
    return cal


def write_calibration(cal: Calibration, path: str | os.PathLike) -> None:
    """Write `cal` as JSON (atomically: a partial file never replaces a good one)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)
