"""Timing blocks on a real device: random weights, warm-up, repeats, a median, a chain of copies.

`time_block` materializes one block at a time on the cpu or a GPU and times its forward and
backward ([Note: timing in context]); `timing_dtype` says which dtype a CPU can time in;
`timing_warnings` says which timings of a profile not to trust ([Note: noisy timings]). Apart from
the fake-tensor recording (graph/block_cost.py), which needs no device, and from the cache
(graph/profile_cache.py), whose timed key names `TIMING_METHOD`.
"""

from __future__ import annotations

import copy
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoplan.graph.fake_run import dtype_name, tensors_in
from autoplan.graph.trace import TracedModel, extract_submodule

__all__ = ["NOISY_SPREAD", "TIMING_METHOD", "ZERO_TIME_S", "chain_length", "device_name", "last_level_cache_bytes",
           "noisy_blocks", "time_block", "timing_dtype", "timing_warnings"]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu} x{torch.get_num_threads()} threads"


def timing_dtype(device: str, dtype: torch.dtype | None) -> tuple[torch.dtype | None, str | None]:
    """The dtype blocks are timed in on `device`, and why it differs from `dtype` when it does.

    A CPU without bf16/fp16 matrix instructions (AVX512-BF16, AMX) runs those GEMMs through a
    conversion path: on a 2-core AVX2 EPYC a 1024 x 3072 x 768 bf16 input-gradient GEMM took 6.5 s against
    0.029 s in fp32 (`benchmarks/cpu_half_precision.py`), so a gpt2-small layer took minutes to
    time and its seconds described the emulation, not the model. There the blocks are timed in
    fp32, which the CPU runs natively; FLOPs, bytes and memory stay in the requested dtype."""
    if not device.startswith("cpu") or dtype not in (torch.bfloat16, torch.float16):
        return dtype, None
    native = (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
              if dtype == torch.bfloat16 else torch.cpu._is_amx_fp16_supported())
    if native:
        return dtype, None
    name = dtype_name(dtype)
    return torch.float32, (f"timed in fp32: this CPU has no {name} matrix instructions (AVX512-BF16 or AMX), so "
                           f"{name} GEMMs would time a slow conversion path; FLOPs, bytes and memory are {name}")


def _real_like(value: Any, device: str, generator: torch.Generator) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_real_like(v, device, generator) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return torch.randn(tuple(value.shape), dtype=value.dtype, generator=generator).to(device)
    # Index tensors (token ids, targets): zeros are valid for every embedding and loss.
    return torch.zeros(tuple(value.shape), dtype=value.dtype, device=device)


def _materialize_block(sub: fx.GraphModule, device: str, dtype: torch.dtype | None, generator: torch.Generator) -> None:
    """Give a block real random weights on `device` (values do not matter for timing)."""
    with torch.no_grad():
        for module in sub.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                data = torch.randn(tuple(p.shape), generator=generator) * 0.02
                target = dtype if dtype is not None else (p.dtype if p.is_floating_point() else torch.float32)
                setattr(module, name, nn.Parameter(data.to(device=device, dtype=target)))
            for name, b in list(module.named_buffers(recurse=False)):
                if b.device.type == "meta":
                    data = torch.randn(tuple(b.shape), generator=generator) if b.is_floating_point() else torch.zeros(
                        tuple(b.shape), dtype=b.dtype)
                    module.register_buffer(name, data.to(device), persistent=False)
                elif b.is_floating_point() and dtype is not None:
                    module.register_buffer(name, b.to(device=device, dtype=dtype), persistent=False)
                else:
                    module.register_buffer(name, b.to(device), persistent=False)


def _time_fn(fn: Callable[[], Any], device: str, warmup: int, repeats: int,
             spreads: list[float] | None = None) -> float:
    """Median seconds of `fn`; its spread ((max - min) / median of the rounds or samples) goes to
    `spreads`, which the profile reports (`extra["timing_spread"]`)."""
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        # Back to back, as the executor launches blocks: the CPU's kernel launches overlap the
        # GPU's work. Events around `repeats` calls (as Triton's do_bench does), median of three
        # rounds; a sync after every call would add the launch latency of small blocks, which a
        # running pipeline hides (measured on an H100: 1.3b-size layers' backward read 25% slow).
        rounds = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(end) / 1e3 / repeats)
        return _median_noting_spread(rounds, spreads)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return _median_noting_spread(samples, spreads)


def _median_noting_spread(samples: list[float], spreads: list[float] | None) -> float:
    median = statistics.median(samples)
    if spreads is not None and median > 0:
        spreads.append((max(samples) - min(samples)) / median)
    return median


def last_level_cache_bytes(device: str) -> int:
    """Size of the device's last-level cache: the CPU's highest cache level from sysfs (Linux), a
    GPU's L2 from its properties; 32 MiB when unknown."""
    fallback = 32 * 2**20
    if device.startswith("cuda"):
        try:
            return int(torch.cuda.get_device_properties(torch.device(device)).L2_cache_size) or fallback
        except (RuntimeError, AttributeError, AssertionError):
            return fallback
    best = 0
    units = {"K": 2**10, "M": 2**20, "G": 2**30}  # sysfs writes sizes like "32768K"
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        number = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size or 0)
        if level >= 3 and number > best:
            best = number
    return best or fallback


def chain_length(block_weight_bytes: int, occurrences: int, cache_bytes: int) -> int:
    """How many copies of a repeated block to time back to back (see [Note: timing in context])."""
    needed = -(-2 * cache_bytes // max(block_weight_bytes, 1))  # ceil(2 x LLC / weights)
    return int(max(1, min(occurrences, needed, _MAX_CHAIN)))


# [Note: timing in context]
# A block timed alone, call after call, keeps its weights in the last-level cache; inside a stage
# its neighbours evict them, so every micro-batch reads them from memory again. On this 2-core
# machine one h = 256 gpt layer (3 MB) took 8.2 ms warm and 11.5 ms flushed, while the 262 MB head
# took the same either way (`benchmarks/cache_effect_cpu.py`): isolated timing made the head look
# 1.4x heavier in layers than it runs, and the cutting put too few layers beside it. So a block
# that repeats is timed as a run of distinct copies, as a stage runs it: all forwards, then the
# backwards in reverse order, seconds divided by the copies. The run is as long as the repeats,
# up to the copies whose weights fill twice the last-level cache (twice, because adaptive
# replacement policies keep part of a working set only just larger than the cache). A model whose
# repeated blocks fit in cache all together is therefore timed warm, as it runs.
_MAX_CHAIN = 256
TIMING_METHOD = "chain-affine-v1"  # in the timed cache key: a new method re-times


def time_block(traced: TracedModel, index: int, inputs: list[Any], device: str, dtype: torch.dtype | None,
               warmup: int, repeats: int, occurrences: int = 1,
               spreads: list[float] | None = None) -> tuple[float, float]:
    """Median forward and backward seconds of block `index` on a real device, run as a chain of up
    to `occurrences` copies ([Note: timing in context])."""
    sub, _, _ = extract_submodule(traced, index, index)
    sub = copy.deepcopy(sub) if not any(p.device.type == "meta" for p in sub.parameters()) else sub
    generator = torch.Generator().manual_seed(index)
    _materialize_block(sub, device, dtype, generator)
    weight_bytes = sum(p.numel() * p.element_size() for p in sub.parameters())
    copies = [sub] + [copy.deepcopy(sub) for _ in range(chain_length(weight_bytes, occurrences,
                                                                      last_level_cache_bytes(device)) - 1)]
    real_inputs = [_real_like(x, device, generator) for x in inputs]
    for x in real_inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and dtype is not None and x.dtype != dtype:
            x.data = x.data.to(dtype)

    def leaves() -> list[Any]:
        return [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for x in real_inputs]

    # Gradients are left to accumulate between repeats: in training every micro-batch after the
    # first adds into existing .grad (read, add, write), which costs more than the first write.
    def forward_backward() -> None:
        outs = [o for c in copies for o in (tensors_in(c(*leaves())) or []) if o.requires_grad]
        if outs:  # autograd runs the copies' backwards newest first, as a stage's backward does
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    # Forward as training runs it (recording autograd); backward = (forward + backward) - forward.
    def forward_autograd() -> Any:
        return [c(*leaves()) for c in copies]

    fwd_s = _time_fn(forward_autograd, device, warmup, repeats, spreads) / len(copies)
    total_s = _time_fn(forward_backward, device, warmup, repeats, spreads) / len(copies)
    return fwd_s, max(total_s - fwd_s, 0.0)


# [Note: noisy timings]
# A block's spread is (max - min) / median of its repeats. On a quiet machine it stays within tens of
# percent (CPU) or a few percent (GPU); on a loaded one a repeat that lost its core to another process
# takes many times the median: `autoplan profile --device cpu` at a load of 70 on 2 cores printed a
# spread of 1,275,107% and a backward of 0.00 ms (issue 44). A backward is timed as (forward +
# backward) - forward, kept at 0 or above, so when the forward's repeats were the slowed ones it
# reads 0: a figure no kernel takes. Such a profile ranks plans by the machine's other load, and it
# is cached, so it is not timed again unless asked (`autoplan profile --refresh`). It is kept (the
# numbers may still be what the user wants) but every reading of it says which blocks and by how much.
NOISY_SPREAD = 0.5
"""A block whose repeats spread by more than this (50%) is named as noisy."""
ZERO_TIME_S = 5e-6
"""Below this a time prints as 0.00 ms: no forward or backward of a block with FLOPs takes so little."""


def noisy_blocks(spread_by_block: Mapping[str, float], threshold: float = NOISY_SPREAD) -> list[tuple[str, float]]:
    """(block, spread) of the blocks whose spread is over `threshold`, worst first."""
    return sorted(((name, spread) for name, spread in spread_by_block.items() if spread > threshold),
                  key=lambda item: -item[1])


def _percent(fraction: float) -> str:
    return f"{fraction:,.0%}"


def timing_warnings(blocks: Sequence[Any], spread_by_block: Mapping[str, float], *,
                    threshold: float = NOISY_SPREAD, rerun: str = "rerun it on an idle machine") -> list[str]:
    """One line per kind of untrustworthy timing in a timed profile ([Note: noisy timings]): blocks
    whose repeats spread over `threshold` (named, worst first, with their spread) and forward or
    backward times that read 0.00 ms; each says what to do (`rerun`). `blocks` are the profile's
    (`name`, `fwd_time_s`, `bwd_time_s`, `fwd_flops`, `bwd_flops`); `spread_by_block` its
    `extra["timing_spread"]["by_block"]`."""
    warnings = []
    noisy = noisy_blocks(spread_by_block, threshold)
    if noisy:
        shown = ", ".join(f"{name} {_percent(spread)}" for name, spread in noisy[:5])
        more = f" and {len(noisy) - 5} more" if len(noisy) > 5 else ""
        warnings.append(f"noisy timings: the repeats of {len(noisy)} block{'s' if len(noisy) != 1 else ''} disagree by "
                        f"more than {_percent(threshold)} ((max - min) / median: {shown}{more}), so this machine was "
                        f"busy while timing; {rerun}, or with more repeats")
    zero = [f"{b.name} {phase}" for b in blocks
            for phase, time_s, flops in (("fwd", b.fwd_time_s, b.fwd_flops), ("bwd", b.bwd_time_s, b.bwd_flops))
            if time_s is not None and flops > 0 and time_s < ZERO_TIME_S]
    if zero:
        shown = ", ".join(zero[:5]) + (f" and {len(zero) - 5} more" if len(zero) > 5 else "")
        warnings.append(f"timed 0.00 ms: {shown} ({'it does' if len(zero) == 1 else 'they do'} FLOPs, so the time "
                        f"is noise: a backward is (forward + backward) - forward, 0 when the forward's repeats were "
                        f"slowed); {rerun}")
    return warnings
