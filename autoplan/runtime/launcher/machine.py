"""Does this machine fit the plan? Checked by the launcher before it spawns a rank.

[Note: a GPU plan on a CPU machine]
Without CUDA every rank of `autoplan run --nproc N` is a CPU process talking gloo, whatever GPU the
plan was made for. That is useful (tests and laptops try 2- or 4-rank A100 plans of small models
that way) and harmful when the model is big: each rank materializes its own stages' parameters,
gradients, optimizer state and activations in host memory, so eight ranks of a GPT-2 small plan
for 8 A100s (5.5 GiB each by the plan's figures) ask for 45 GiB and the kernel's OOM killer ends the
job minutes later with a bare SIGKILL. So the rule: a local launch without CUDA is refused (one line,
before any process exists) only when the ranks' estimated host memory exceeds what is free, naming
both figures and the two ways on (re-plan for this machine's CPUs, or consent with
`--allow-oversubscribe`); a GPU plan that fits runs, with one note line saying it runs on CPU ranks.
With CUDA, a local launch needs one GPU per rank (NCCL refuses two ranks on one device).

The estimate is the plan's own per-GPU memory breakdown (cost/memory.py) without the CUDA allowance
(context, NCCL buffers, allocator slack: none of it exists on a CPU rank), per pipeline rank, times
the tp x dp ranks that hold that pipeline rank's stages, plus `RANK_BASE_BYTES` per process. What is
free is the kernel's MemAvailable (/proc/meminfo: what can be allocated without swapping), or a
smaller cgroup limit's headroom (a container sees the host's /proc/meminfo).

[Note: the refusal before torch]
This module imports no torch (nor does `autoplan.plan`): `autoplan run` calls `refuse_early` before
it imports the runtime, so a plan this machine cannot hold is refused in the ~2 s other refusals
take, not after the 15-20 s that importing torch, building the model and tracing it took on a
loaded 2-core machine (issue 44). Whether CUDA is present is torch's to say; without torch,
`cuda_impossible` only answers "certainly not" (no GPU driver or device node at all), and where a
driver exists the check waits for torch in `preflight.check_run`, which repeats it in any case.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from autoplan.plan import Plan

__all__ = ["GIB", "MachineFit", "RANK_BASE_BYTES", "available_memory_bytes", "check_machine", "cuda_impossible",
           "host_memory_bytes", "oom_kills", "refuse_early"]

GIB = 2**30
RANK_BASE_BYTES = 0.5 * GIB
"""Host memory of one CPU rank besides its stages: Python, torch, torch.distributed and dynamo
imported measured 0.29 GiB resident (`resource.getrusage` after a rank's imports, torch 2.13 on
x86-64); tracing the model and gloo's buffers take it to about half a GiB."""
_MEMORY_FIELDS = ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
                  "gathered_bytes")
"""The plan's per-GPU memory terms a CPU rank holds too (not `allowance_bytes`: CUDA's own)."""


def _read_int(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(Path(path).read_text().split()[0])
    return None


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none: not Linux)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def available_memory_bytes() -> tuple[float, float] | None:
    """(free, total) host memory in bytes: MemAvailable and MemTotal, or a cgroup's limit and its
    headroom where they are smaller (cgroup v2 memory.max / memory.current, v1 limit_in_bytes /
    usage_in_bytes); None where the kernel does not say (not Linux)."""
    info = _meminfo()
    if "MemAvailable" not in info or "MemTotal" not in info:
        return None
    free, total = float(info["MemAvailable"]), float(info["MemTotal"])
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_path), _read_int(usage_path)  # "max" (no limit) reads as None
        if limit is not None and usage is not None and limit < total:
            total, free = float(limit), min(free, float(max(0, limit - usage)))
            break
    return free, total


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed (/proc/vmstat `oom_kill`, Linux 4.13+,
    plus a cgroup v2 `memory.events` count), or None where neither is readable."""
    counts = []
    for path, key in (("/proc/vmstat", "oom_kill"), ("/sys/fs/cgroup/memory.events", "oom_kill")):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    counts.append(int(value))
    return sum(counts) if counts else None


def host_memory_bytes(plan: Plan) -> float:
    """Estimated host memory of all the plan's ranks run as CPU processes on one machine (module
    docstring). The plan's memory figures were checked finite and not negative when it was loaded
    or passed in (plan.py `validate`)."""
    by_pp_rank: dict[int, float] = {}
    params_by_pp_rank: dict[int, int] = {}
    for stage in plan.stages:  # `num_params` is per GPU already (tp-sharded); a rank's chunks add up
        params_by_pp_rank[stage.pp_rank] = params_by_pp_rank.get(stage.pp_rank, 0) + stage.num_params
    bytes_per_param = 4 + 4 + 8 + (2 if plan.job.dtype != "float32" else 0)  # master, grad, Adam, working copy
    for stage in plan.stages:
        memory = stage.memory
        held = sum(getattr(memory, name) for name in _MEMORY_FIELDS)
        if held == 0:  # a plan without memory figures: its parameters at least (Adam, mixed precision)
            held = params_by_pp_rank[stage.pp_rank] * bytes_per_param
        # Every stage of one pipeline rank carries that rank's whole memory (plan.py, StagePlan.memory).
        by_pp_rank[stage.pp_rank] = max(by_pp_rank.get(stage.pp_rank, 0.0), held)
    return sum(by_pp_rank.values()) * plan.tp * plan.dp + plan.num_gpus * RANK_BASE_BYTES


@dataclass(frozen=True)
class MachineFit:
    """What `check_machine` found: the note to print before launching (or "")."""

    estimate_bytes: float | None
    """Estimated host memory of the ranks (CPU ranks only), else None."""
    free_bytes: float | None
    total_bytes: float | None
    note: str = ""


def _gpu_name(plan: Plan) -> str:
    with contextlib.suppress(ValueError, AttributeError):
        return plan.cluster_obj().gpu.name
    return "cpu"


def check_machine(plan: Plan, nproc: int, *, allow_oversubscribe: bool = False, cuda: bool | None = None,
                  num_cuda_devices: int | None = None, memory: tuple[float, float] | None = None) -> MachineFit:
    """Refuse (ValueError, one line) a local launch of `nproc` ranks this machine cannot hold
    ([Note: a GPU plan on a CPU machine]); else what to tell the user before launching. `cuda`,
    `num_cuda_devices` and `memory` ((free, total) bytes) default to this machine's (tests pass them)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
        if cuda and num_cuda_devices is None:
            num_cuda_devices = torch.cuda.device_count()
    gpu = _gpu_name(plan)
    if cuda:
        if num_cuda_devices is not None and nproc > num_cuda_devices:
            raise ValueError(f"the plan runs {nproc} ranks on this machine, one GPU each, but it has "
                             f"{num_cuda_devices} GPU{'s' if num_cuda_devices != 1 else ''}; run it under torchrun on "
                             f"enough nodes, or re-plan for this machine (`autoplan suggest --model {plan.model} "
                             f"--cluster 1x{num_cuda_devices}x{gpu} ... --out p.json`)")
        return MachineFit(None, None, None)
    estimate = host_memory_bytes(plan)
    memory = available_memory_bytes() if memory is None else memory
    free, total = memory if memory is not None else (None, None)
    where = f"{gpu} plan" if gpu != "cpu" else "plan"
    figures = (f"about {estimate / GIB:.1f} GiB of host memory" +
               (f", {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB" if free is not None else ""))
    if free is not None and estimate > free:
        replan = (f"autoplan suggest --model {plan.model} --cluster 1x{nproc}xcpu --global-batch "
                  f"{plan.job.global_batch} --seq-len {plan.job.seq_len} --out p.json")
        if not allow_oversubscribe:
            raise ValueError(f"the {where}'s {nproc} ranks would need {figures} (no CUDA here: each rank is a CPU "
                             f"process holding its stages' weights, gradients, optimizer state and activations); "
                             f"re-plan for this machine's CPUs (`{replan}`) or pass --allow-oversubscribe to run "
                             f"anyway")
        return MachineFit(estimate, free, total, f"running the {where}'s {nproc} ranks on CPU with gloo although they "
                                                 f"need {figures} (--allow-oversubscribe): expect swapping or the "
                                                 f"kernel's OOM killer")
    note = ""
    if gpu != "cpu":
        note = f"no CUDA here: the {where} runs as {nproc} CPU ranks with gloo ({figures})"
    return MachineFit(estimate, free, total, note)


_GPU_DEVICE_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
"""What a GPU torch could use leaves on Linux: the NVIDIA driver's /proc entry and device nodes, ROCm's
kernel fusion driver (/dev/kfd) and WSL2's GPU paravirtualization (/dev/dxg)."""


def cuda_impossible(device_paths: tuple[str, ...] = _GPU_DEVICE_PATHS) -> bool:
    """True when torch certainly sees no GPU here: Linux with none of `device_paths` ([Note: the
    refusal before torch]). False means "ask torch", not "there is a GPU"."""
    return sys.platform.startswith("linux") and not any(Path(p).exists() for p in device_paths)


def refuse_early(plan: Plan | str | os.PathLike, nproc: int | None, *, allow_oversubscribe: bool = False,
                 memory: tuple[float, float] | None = None) -> None:
    """`check_machine`'s refusal of a local CPU launch of `plan` (a Plan, or a plan file's path),
    before torch is imported ([Note: the refusal before torch]): raises its one-line ValueError,
    else returns. Anything it cannot decide without torch (CUDA may be present, torchrun, --nproc
    not the plan's, a plan that does not load) is left to `preflight.check_run`, which reports it
    in its own order."""
    if ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or not cuda_impossible():
        return
    if not isinstance(plan, Plan):
        try:
            plan = Plan.load(plan)
        except Exception:  # noqa: BLE001 - every problem of the plan file is check_run's to name
            return
    if nproc is not None and nproc != plan.num_gpus:
        return
    check_machine(plan, plan.num_gpus, allow_oversubscribe=allow_oversubscribe, cuda=False, memory=memory)
