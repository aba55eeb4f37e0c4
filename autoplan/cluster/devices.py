"""The GPU spec table: peak dense FLOP/s per dtype, memory, memory bandwidth.

Every number is the vendor's published peak for *dense* math (no 2:4 structured sparsity) and
carries its datasheet in `GPU.source`. Achievable throughput is lower; the cost model applies an
efficiency on top of `GPU.peak` (see `autoplan.cost`), this table never does.

Memory is the capacity the driver reports (`nvidia-smi` total in MiB) where that is known, which is
a little below the marketed figure on some parts (an "80 GB" H100 reports 81559 MiB); else the
marketed capacity in GiB.

`cpu` is this machine, so that plans can be made and run on a laptop or in CI with gloo: see
`cpu_device`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "CPU_GFLOPS_PER_CORE_DEFAULT",
    "CPU_GFLOPS_ENV",
    "DTYPE_KEYS",
    "GPU",
    "GPUS",
    "ClusterSpecError",
    "aliases",
    "cpu_device",
    "dtype_key",
    "get_gpu",
    "rank_device",
]


class ClusterSpecError(ValueError):
    """A mistake in a cluster or device specification; the message names the field and the fix."""


DTYPE_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""Keys of `GPU.peak_flops`. `fp32` is non-tensor-core FP32; `tf32` is FP32 inputs on tensor cores."""

_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "torch.float8_e4m3fn": "fp8", "torch.float8_e5m2": "fp8",
}  # fmt: skip


def dtype_key(dtype: object) -> str:
    """Map a dtype ("bfloat16", "bf16", `torch.bfloat16`, ...) to a `DTYPE_KEYS` entry.

    FP32 training maps to `fp32`, not `tf32`: PyTorch leaves TF32 matmuls off by default
    (`torch.backends.cuda.matmul.allow_tf32 = False` since 1.12), so FP32 runs at FP32 speed.
    """
    key = _DTYPE_ALIASES.get(str(dtype).strip().lower())
    if key is None:
        raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16, tf32, fp8")
    return key


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One accelerator type (or `cpu`, one rank's share of this machine)."""

    name: str
    """Canonical name, a key of `GPUS` (e.g. "H100-SXM-80GB")."""
    peak_flops: Mapping[str, float]
    """Peak dense FLOP/s per dtype key in `DTYPE_KEYS`; a missing key means unsupported."""
    mem_bytes: int
    """Device memory in bytes."""
    mem_bw_bytes_per_s: float
    """Peak device-memory bandwidth in bytes/s."""
    source: str = field(default="", compare=False)
    """Where the numbers come from (datasheet name and URL)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ClusterSpecError("gpu.name must be a non-empty string")
        for key, value in self.peak_flops.items():
            if key not in DTYPE_KEYS:
                raise ClusterSpecError(f"gpu {self.name}: peak_flops key {key!r} is not one of {DTYPE_KEYS}")
            if not _positive_number(value):
                raise ClusterSpecError(f"gpu {self.name}: peak_flops[{key!r}] must be > 0, got {value!r}")
        if not self.peak_flops:
            raise ClusterSpecError(f"gpu {self.name}: peak_flops is empty; give at least one of {DTYPE_KEYS}")
        if not (
            isinstance(self.mem_bytes, int) and not isinstance(self.mem_bytes, bool) and self.mem_bytes > 0
        ):
            raise ClusterSpecError(
                f"gpu {self.name}: mem_bytes must be a positive integer, got {self.mem_bytes!r}"
            )
        if not _positive_number(self.mem_bw_bytes_per_s):
            raise ClusterSpecError(
                f"gpu {self.name}: mem_bw_bytes_per_s must be > 0, got {self.mem_bw_bytes_per_s!r}"
            )
        # A plain dict keeps the dataclass printable and JSON-friendly; freeze by convention.
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))

    def __hash__(self) -> int:
        return hash(
            (self.name, tuple(sorted(self.peak_flops.items())), self.mem_bytes, self.mem_bw_bytes_per_s)
        )

    def supports(self, dtype: object) -> bool:
        """Whether the device has a peak for `dtype`."""
        return dtype_key(dtype) in self.peak_flops

    def peak(self, dtype: object) -> float:
        """Peak dense FLOP/s for `dtype` ("float32"->fp32, "bfloat16"->bf16, "float16"->fp16, ...).

        Raises ValueError when the device lacks that dtype (e.g. bf16 on V100).
        """
        key = dtype_key(dtype)
        try:
            return self.peak_flops[key]
        except KeyError:
            have = ", ".join(self.peak_flops)
            raise ValueError(
                f"{self.name} has no {key} support (it has {have}); choose another dtype"
            ) from None


def _positive_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


_T = 1e12
_MIB = 2**20
_GIB = 2**30

# fmt: off
_TABLE = (
    # NVIDIA A100 Tensor Core GPU datasheet (2021), "NVIDIA A100 for NVLink" column:
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    # FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS dense; 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s.
    GPU(name="A100-SXM4-40GB", peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
        mem_bytes=40960 * _MIB, mem_bw_bytes_per_s=1555e9,
        source="NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)"),
    GPU(name="A100-SXM4-80GB", peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
        mem_bytes=81920 * _MIB, mem_bw_bytes_per_s=2039e9,
        source="NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)"),
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column (sparse figures halved to dense):
    # https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
    # FP32 67, TF32 494.5, BF16/FP16 989.4, FP8 1,978.9 TFLOPS; 80GB HBM3 3.35 TB/s.
    GPU(name="H100-SXM-80GB",
        peak_flops={"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T},
        mem_bytes=81559 * _MIB, mem_bw_bytes_per_s=3.35e12,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM (resources.nvidia.com nvidia-tensor-core-gpu-datasheet)"),
    # Same datasheet, "H100 PCIe" column: FP32 51, TF32 378, BF16/FP16 756, FP8 1,513 TFLOPS dense; 2.0 TB/s.
    GPU(name="H100-PCIe-80GB",
        peak_flops={"fp32": 51 * _T, "tf32": 378 * _T, "bf16": 756 * _T, "fp16": 756 * _T, "fp8": 1513 * _T},
        mem_bytes=81559 * _MIB, mem_bw_bytes_per_s=2.0e12,
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe (resources.nvidia.com nvidia-tensor-core-gpu-datasheet)"),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM": H100 SXM compute; 141GB HBM3e at 4.8 TB/s.
    # https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446
    GPU(name="H200-SXM-141GB",
        peak_flops={"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T},
        mem_bytes=143771 * _MIB, mem_bw_bytes_per_s=4.8e12,
        source="NVIDIA H200 Tensor Core GPU datasheet (hpc-datasheet-sc23-h200-datasheet-3002446)"),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362.05, FP8 733 TFLOPS dense; 48GB GDDR6 864 GB/s.
    # https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413
    GPU(name="L40S", peak_flops={"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362.05 * _T, "fp16": 362.05 * _T,
                                 "fp8": 733 * _T},
        mem_bytes=46068 * _MIB, mem_bw_bytes_per_s=864e9,
        source="NVIDIA L40S datasheet (resources.nvidia.com/en-us-l40s/l40s-datasheet-28413)"),
    # A10G is an AWS-only variant (EC2 G5) with no NVIDIA datasheet; figures as compared with the A10 in
    # https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/ : FP32 35, TF32 35,
    # BF16/FP16 tensor 70 TFLOPS dense; 24GB GDDR6 600 GB/s (same memory system as the A10 datasheet).
    GPU(name="A10G", peak_flops={"fp32": 35 * _T, "tf32": 35 * _T, "bf16": 70 * _T, "fp16": 70 * _T},
        mem_bytes=23028 * _MIB, mem_bw_bytes_per_s=600e9,
        source="AWS EC2 G5 A10G; Baseten 'NVIDIA A10 vs A10G' spec comparison (no vendor datasheet)"),
    # NVIDIA V100 Tensor Core GPU datasheet, "V100 SXM2": FP32 15.7, FP16 tensor 125 TFLOPS; no BF16/TF32;
    # 32GB HBM2 900 GB/s. https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    GPU(name="V100-SXM2-32GB", peak_flops={"fp32": 15.7 * _T, "fp16": 125 * _T},
        mem_bytes=32768 * _MIB, mem_bw_bytes_per_s=900e9,
        source="NVIDIA V100 Tensor Core GPU datasheet, V100 SXM2 (volta-v100-datasheet-update-us-1165301-r5.pdf)"),
    # AMD Instinct MI300X accelerator datasheet: FP32 (matrix) 163.4, TF32 653.7, BF16/FP16 1,307.4,
    # FP8 2,614.9 TFLOPS dense; 192GB HBM3 at 5.3 TB/s.
    # https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf
    GPU(name="MI300X", peak_flops={"fp32": 163.4 * _T, "tf32": 653.7 * _T, "bf16": 1307.4 * _T, "fp16": 1307.4 * _T,
                                   "fp8": 2614.9 * _T},
        mem_bytes=192 * _GIB, mem_bw_bytes_per_s=5.3e12,
        source="AMD Instinct MI300X data sheet (amd-instinct-mi300x-data-sheet.pdf)"),
    # AMD Instinct MI325X accelerator data sheet (2024): the MI300X's CDNA 3 compute (FP32 matrix 163.4,
    # TF32 653.7, BF16/FP16 1,307.4, FP8 2,614.9 TFLOPS dense) with 256GB HBM3E at 6 TB/s.
    # https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/product-briefs/instinct-mi325x-datasheet.pdf
    GPU(name="MI325X", peak_flops={"fp32": 163.4 * _T, "tf32": 653.7 * _T, "bf16": 1307.4 * _T, "fp16": 1307.4 * _T,
                                   "fp8": 2614.9 * _T},
        mem_bytes=256 * _GIB, mem_bw_bytes_per_s=6.0e12,
        source="AMD Instinct MI325X accelerator data sheet, 2024 (instinct-mi325x-datasheet.pdf)"),
    # NVIDIA HGX B200 / DGX B200 datasheets (2024), per GPU of the 8-GPU board: the HGX table's sparse
    # totals (FP8 72, BF16/FP16 36, TF32 18 PFLOPS) halved to dense and divided by 8: FP8 4.5, BF16/FP16
    # 2.25, TF32 1.125 PFLOPS; FP32 600 / 8 = 75 TFLOPS; HBM3e 64 TB/s per DGX B200 -> 8 TB/s per GPU
    # (the memory bus the driver reports, 7680 bits at 3996 MHz, gives 7.67 TB/s: pytorch/ao#4002).
    # Memory: 180 GB marketed; nvidia-smi reports 183359 MiB.
    # https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet
    GPU(name="B200-SXM-180GB",
        peak_flops={"fp32": 75 * _T, "tf32": 1125 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T, "fp8": 4500 * _T},
        mem_bytes=183359 * _MIB, mem_bw_bytes_per_s=8.0e12,
        source="NVIDIA DGX B200 / HGX B200 datasheets, 2024 (resources.nvidia.com dgx-b200-datasheet), per GPU"),
    # NVIDIA GB200 NVL72 datasheet (2024), the rack's 72 Blackwell GPUs (1,200 W each, faster than the
    # HGX B200's): sparse totals FP8 720, BF16/FP16 360, TF32 180 PFLOPS halved to dense and divided by
    # 72: FP8 5, BF16/FP16 2.5, TF32 1.25 PFLOPS; FP32 5,760 / 72 = 80 TFLOPS; HBM3e 13.4 TB at 576 TB/s
    # -> 186 GB at 8 TB/s per GPU (nvidia-smi reports 189471 MiB).
    # https://www.nvidia.com/en-us/data-center/gb200-nvl72/
    GPU(name="GB200",
        peak_flops={"fp32": 80 * _T, "tf32": 1250 * _T, "bf16": 2500 * _T, "fp16": 2500 * _T, "fp8": 5000 * _T},
        mem_bytes=189471 * _MIB, mem_bw_bytes_per_s=8.0e12,
        source="NVIDIA GB200 NVL72 datasheet, 2024 (nvidia.com/en-us/data-center/gb200-nvl72), per GPU"),
)
# fmt: on

CPU_GFLOPS_ENV = "AUTOPLAN_CPU_GFLOPS_PER_CORE"
"""Environment variable that overrides `CPU_GFLOPS_PER_CORE_DEFAULT` (a number, GFLOP/s per core)."""

CPU_GFLOPS_PER_CORE_DEFAULT = 50.0
"""An estimate, not a measurement: an AVX2 core with 2 FMA units x 8 fp32 lanes x 2 FLOP per FMA at
~3 GHz peaks at 96 GFLOP/s; PyTorch GEMMs reach about half of that, so 50 GFLOP/s per core.
(Intel 64 and IA-32 Architectures Optimization Reference Manual, FMA throughput of Haswell and
later cores.) Set AUTOPLAN_CPU_GFLOPS_PER_CORE for your machine."""

# [Note: cpu memory bandwidth] ~10 GB/s per core of DRAM streaming bandwidth, capped at 100 GB/s per
# machine: an estimate in the range STREAM triad results report for desktop/server parts
# (https://www.cs.virginia.edu/stream/). Used only for memory-bound op estimates.
_CPU_MEM_BW_PER_CORE = 10e9
_CPU_MEM_BW_CAP = 100e9


def _total_ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a 16 GiB laptop
        return 16 * _GIB


def _cpu_gflops_per_core() -> float:
    raw = os.environ.get(CPU_GFLOPS_ENV)
    if raw is None or raw.strip() == "":
        return CPU_GFLOPS_PER_CORE_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ClusterSpecError(
            f"{CPU_GFLOPS_ENV}={raw!r} must be a positive number of GFLOP/s per core, e.g. 50"
        )
    return value


# [Note: cpu fp16] `autoplan run` trains an fp16 plan on CPU ranks (fp16 weights and activations,
# fp32 masters, the dynamic loss scale), so fp16 is planned there too (issue 44: "cpu has no fp16
# support" refused a job the runtime runs). A CPU without native fp16 matmul instructions
# (AVX512-FP16 or AMX-FP16 in /proc/cpuinfo's flags) runs torch's fp16 GEMM far slower than fp32:
# 2.29 s against 0.118 s for a 1024^3 matmul on this project's 2-core AMD EPYC test machine (19x;
# `python -c "import torch,time; a=torch.randn(1024,1024,dtype=torch.float16); t=time.time(); a@a;
# print(time.time()-t)"` and the same in float32). Such a CPU gets 1/16 of the fp32 figure, one
# with the instructions the fp32 figure.
_CPU_FP16_SLOWDOWN = 16.0


def _cpu_has_fp16_matmul() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:  # not Linux: assume the common case, no native fp16 matmul
        return False
    return "avx512_fp16" in flags or "amx_fp16" in flags


def cpu_device(num_ranks: int = 1) -> GPU:
    """This machine as a device, shared by `num_ranks` processes (each gets 1/num_ranks of it).

    Memory is total RAM (`os.sysconf`), compute is `os.cpu_count()` cores x the per-core estimate
    (`CPU_GFLOPS_PER_CORE_DEFAULT`, or AUTOPLAN_CPU_GFLOPS_PER_CORE). bf16 gets the fp32 figure: without
    AMX, CPU bf16 GEMMs run at roughly fp32 speed; fp16 see [Note: cpu fp16]. The name stays "cpu"
    whatever the share.
    """
    if not (isinstance(num_ranks, int) and num_ranks >= 1):
        raise ClusterSpecError(f"cpu ranks per node must be a positive integer, got {num_ranks!r}")
    cores = os.cpu_count() or 1
    flops = cores * _cpu_gflops_per_core() * 1e9 / num_ranks
    mem_bw = min(cores * _CPU_MEM_BW_PER_CORE, _CPU_MEM_BW_CAP) / num_ranks
    share = "" if num_ranks == 1 else f", shared by {num_ranks} ranks"
    return GPU(
        name="cpu",
        peak_flops={"fp32": flops, "bf16": flops,
                    "fp16": flops if _cpu_has_fp16_matmul() else flops / _CPU_FP16_SLOWDOWN},  # [Note: cpu fp16]
        mem_bytes=max(1, _total_ram_bytes() // num_ranks),
        mem_bw_bytes_per_s=mem_bw,
        source=f"this machine: {cores} cores x {flops * num_ranks / cores / 1e9:g} GFLOP/s per core (estimate){share}",
    )

def rank_device(gpu: GPU, gpus_per_node: int) -> GPU:
    """`cpu` ranks on one machine share it: each gets 1/gpus_per_node of its cores and memory."""
    return cpu_device(gpus_per_node) if gpu.name == "cpu" else gpu


GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in _TABLE}
"""The datasheet table by canonical name. `cpu` is not here because it depends on the machine: use
`get_gpu("cpu")` or `cpu_device`."""

_ALIASES = {
    "a100": "A100-SXM4-80GB",
    "a100-80gb": "A100-SXM4-80GB",
    "a100-sxm-80gb": "A100-SXM4-80GB",
    "a100-40gb": "A100-SXM4-40GB",
    "a100-sxm-40gb": "A100-SXM4-40GB",
    "h100": "H100-SXM-80GB",
    "h100-80gb": "H100-SXM-80GB",
    "h100-sxm": "H100-SXM-80GB",
    "h100-sxm5-80gb": "H100-SXM-80GB",
    "h100-pcie": "H100-PCIe-80GB",
    "h200": "H200-SXM-141GB",
    "h200-141gb": "H200-SXM-141GB",
    "v100": "V100-SXM2-32GB",
    "v100-32gb": "V100-SXM2-32GB",
    "mi300": "MI300X",
    "mi325": "MI325X",
    "b200": "B200-SXM-180GB",
    "b200-180gb": "B200-SXM-180GB",
    "gb200-186gb": "GB200",
}


def aliases(name: str) -> tuple[str, ...]:
    """The short names `get_gpu` also takes for the canonical GPU `name` (e.g. "h100", "h100-80gb")."""
    return tuple(alias for alias, canonical in _ALIASES.items() if canonical == name)


def get_gpu(name: str) -> GPU:
    """Look up a device by canonical name or alias, case-insensitively ("H100", "a100-40gb", "cpu")."""
    if not isinstance(name, str):
        raise ClusterSpecError(f"gpu must be a name string, got {name!r}")
    key = name.strip().lower()
    if key == "cpu":
        return cpu_device()
    canonical = _ALIASES.get(key)
    if canonical is not None:
        return GPUS[canonical]
    for gpu_name, gpu in GPUS.items():
        if gpu_name.lower() == key:
            return gpu
    known = ", ".join([*GPUS, "cpu"])
    raise ClusterSpecError(f"unknown gpu {name!r}; known: {known} (aliases like H100, A100-40GB also work)")
