"""`autoplan calibrate`'s sweeps and kernel microbenchmarks: GEMMs, fused attention forward and
backward, memory-bound copies and adds, each point timed by `_time_s`.

[Note: calibration timing] On CUDA, CUDA events around `num_calls` back-to-back calls after warm-up
(the first call selects kernels and allocates); on CPU `time.perf_counter` around the same loop.
`num_calls` is chosen so that one repeat lasts about `target_s`, which keeps launch jitter small
against the measured span; the point's time is the median over `num_repeats` repeats, and its spread
is (max - min) / median of those repeats.

Apart from the fits (calibrate_fit.py), which turn these points into a calibration, and from the
command (calibrate.py), which chooses the device and writes the file.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

Progress = Callable[[str], None]


# ---- settings ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sweep:
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


_KB, MB, GB = 2**10, 2**20, 2**30


def sweep_for(device: str, quick: bool) -> Sweep:
    if device == "cuda" and not quick:
        return Sweep(
            gemm=tuple((m, n, k) for m in (512, 2048, 4096, 8192, 16384) for n in (1024, 4096, 8192, 16384)
                       for k in (1024, 4096, 8192, 16384)),
            attention=((8, 16, 1024, 64), (4, 32, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)),
            memory_bytes=tuple(64 * _KB * 4**i for i in range(8)),  # 64 KB .. 1 GB
            collective_bytes=tuple(_KB * 4**i for i in range(11)),  # 1 KB .. 1 GB
            target_s=0.02, num_repeats=7)
    if device == "cuda":
        return Sweep(gemm=((512, 1024, 1024), (2048, 4096, 4096), (4096, 8192, 8192)),
                      attention=((4, 16, 1024, 64), (2, 16, 2048, 128)),
                      memory_bytes=(64 * _KB, MB, 16 * MB, 256 * MB),
                      collective_bytes=(4 * _KB, MB, 64 * MB), target_s=0.01, num_repeats=5)
    if not quick:
        return Sweep(gemm=tuple((m, n, k) for m in (256, 1024) for n in (256, 1024) for k in (256, 1024)),
                      attention=((1, 4, 256, 64), (2, 8, 512, 64)),
                      memory_bytes=tuple(64 * _KB * 4**i for i in range(7)),  # 64 KB .. 256 MB
                      collective_bytes=tuple(4 * _KB * 4**i for i in range(7)), target_s=0.02, num_repeats=5)
    return Sweep(gemm=((128, 128, 128), (256, 256, 256), (512, 256, 512), (512, 512, 512)),
                  attention=((1, 2, 128, 32), (2, 4, 256, 32)),
                  memory_bytes=(64 * _KB, 256 * _KB, 4 * MB, 16 * MB),
                  collective_bytes=(4 * _KB, 64 * _KB, MB), target_s=0.005, num_repeats=5)


TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}



# ---- timing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Timed:
    time_s: float
    """Median seconds of one call."""
    spread: float
    """(max - min) / median over the repeats."""


def _time_s(fn: Callable[[], object], device: str, sweep: Sweep) -> _Timed:
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


def bench_gemm(device: str, key: str, sweep: Sweep, progress: Progress) -> list[dict[str, Any]]:
    dtype = TORCH_DTYPES[key]
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


def bench_attention(device: str, key: str, sweep: Sweep, progress: Progress) -> list[dict[str, Any]]:
    dtype = TORCH_DTYPES[key]
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


def bench_memory(device: str, key: str, sweep: Sweep, progress: Progress) -> list[dict[str, Any]]:
    dtype = TORCH_DTYPES[key]
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
            progress(f"memory [{2 * i + j + 1}/{total}] {kernel} {fmt_size(num_bytes)}: {timed.time_s * 1e6:.1f} us, "
                     f"{moved / timed.time_s / 1e9:.1f} GB/s (spread {timed.spread:.1%})")
        del a, b, c
    return points


def fmt_size(num_bytes: float) -> str:
    for unit, scale in (("GB", GB), ("MB", MB), ("KB", _KB)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes:g} B"



def stderr_progress(line: str) -> None:
    print(f"autoplan calibrate: {line}", file=sys.stderr, flush=True)
