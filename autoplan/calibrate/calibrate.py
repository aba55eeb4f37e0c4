"""`autoplan calibrate`: measure what this machine's GPU (or CPU) achieves and write a calibration.

Microbenchmarks, each point timed by `_time_s` ([Note: calibration timing]):

- a GEMM sweep over (M, N, K) per dtype (`torch.matmul` of M x K by K x N);
- fused attention (`scaled_dot_product_attention`) forward and backward at a few
  (batch, heads, seq, head_dim), causal and not;
- memory-bound kernels (a copy and an add) from 64 KB to 1 GB;
- with `collectives=True`, all-reduce, all-gather, reduce-scatter and p2p over message sizes across
  local processes (or the torchrun world), timed the nccl-tests way.

The fits (`fit_calibration`) turn the points into the parameters `cost/ops.py` reads; the file keeps every raw
point with its spread under `measurements` (format: `cost/calibration.py`).

The command is this module: its arguments, the GPU type the numbers are for, and the file written.
The microbenchmarks and their timing are calibrate_kernels.py, the fits calibrate_fit.py, and the
collective curves calibrate_collectives.py.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from pathlib import Path
from typing import Any

import torch

from autoplan.calibrate.calibrate_collectives import COLLECTIVE_OPS, collectives_rank, measure_collectives
from autoplan.calibrate.calibrate_fit import (
    fit_calibration,
    noisy_point_note,
    spreads_of,
    unstable_message,
    unstable_rows,
)
from autoplan.calibrate.calibrate_kernels import (
    GB,
    TORCH_DTYPES,
    Progress,
    bench_attention,
    bench_gemm,
    bench_memory,
    fmt_size,
    stderr_progress,
    sweep_for,
)
from autoplan.cluster import GPU, GPUS, cpu_device, dtype_key, get_gpu
from autoplan.cost.calibration import Calibration
from autoplan.runtime.launcher.preflight import MAX_TIMEOUT_S

__all__ = ["calibrate", "guess_gpu", "write_calibration"]


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
        large = "80G" in name or (mem_bytes is not None and mem_bytes > 48 * GB)
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
              force: bool = False, timeout_s: float = 600.0, progress: Progress = stderr_progress) -> Calibration | None:
    """Measure this machine and write a calibration to `out` (see the module docstring).

    `device`: "cuda" or "cpu" (default cuda when available); `gpu`: the GPU type the numbers are
    for (default: guessed from the device name); `dtype`: comma-separated GEMM dtypes, the first
    also used for attention and memory (default bf16 on cuda, float32 on cpu); `quick`: a few
    small shapes; `collectives`: also measure collective curves over `nproc` local processes (default
    the visible GPUs, 2 on CPU) or, under torchrun, the launched world; `force`: overwrite `out`, and
    write a fit whose timings are unstable (calibrate_fit.py [Note: unstable calibrations]), which is
    otherwise refused with a ValueError after measuring. Returns the calibration written, or None on
    a rank other than 0 (only rank 0 writes). User mistakes raise ValueError before anything runs; a
    failed collective run raises CalibrationRunError.
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
        if key not in TORCH_DTYPES:
            raise ValueError(f"--dtype {name}: calibrate measures fp32, tf32, bf16 and fp16 GEMMs, not {key}")
        if not target.supports(key):
            raise ValueError(f"--dtype {name}: {target.name} has no {key} peak; choose another dtype")
        if key not in keys:
            keys.append(key)
    sweep = sweep_for(device, quick)
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
            measured_collectives = collectives_rank(device, sweep, timeout_s, progress)
            if measured_collectives is None:
                return None  # rank 0 measures the rest and writes the file
        else:
            measured_collectives = measure_collectives(device, world, sweep, timeout_s)
    elif launched and int(os.environ["RANK"]) != 0:
        return None

    described = _device_description(device)
    stamp = datetime.date.today().isoformat()
    source = f"measured by `autoplan calibrate` on {described}, torch {torch.__version__}, {stamp}"
    progress(f"calibrating {target.name} on {described} ({', '.join(keys)}{', quick' if quick else ''})")
    memory = bench_memory(device, keys[0], sweep, progress)
    gemm = [p for key in keys for p in bench_gemm(device, key, sweep, progress)]
    attention = bench_attention(device, keys[0], sweep, progress)
    fitted, rows, notes = fit_calibration(target, keys, gemm, attention, memory)

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
                         "detail": f"at {fmt_size(last['bytes'])}; curve of {len(pts)} sizes", **spreads_of(pts)})
    unstable = unstable_rows(rows)
    if unstable and not force:  # calibrate_fit.py [Note: unstable calibrations]
        raise ValueError(unstable_message(unstable))
    note = noisy_point_note(rows)
    if note is not None:
        notes.append(note)
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
