"""Calibrations: what one GPU type achieves, as numbers the operator-level time model reads.

A `Calibration` holds, for one GPU type, the parameters of `cost/ops.py`: the GEMM's achieved share
of peak per dtype, flash attention's forward and backward share, the achieved memory bandwidth and
the per-kernel floor of memory-bound operators, and optionally the measured collective curves of the
links (`cluster/collectives.py`). Every section says where its numbers come from (`source`): measured
by `autoplan calibrate` on that GPU, fitted by this project to published runs, or assumed.

The package ships one file per GPU it knows (`autoplan/cost/calibrations/*.json`); `autoplan
calibrate` writes the same format, and `autoplan suggest --calibration FILE` uses it in place of the
shipped one for that GPU type. A GPU type without a file gets `default_calibration(gpu)`, which
assumes and says so.

File format (JSON, `schema` 1):

    {"schema": 1, "gpu": "H100-SXM-80GB", "source": "...",
     "gemm": {"efficiency": {"bf16": 0.78, ...}, "source": "..."},
     "attention": {"fwd_efficiency": 0.5, "bwd_efficiency": 0.4, "causal_work_fraction": 0.5, "source": "..."},
     "memory": {"bandwidth_efficiency": 0.8, "kernel_floor_s": 4e-6, "source": "..."},
     "overlap": {"compute_slowdown": 0.1, "source": "..."},        # optional (default 0)
     "network": {"efficiency": 0.8, "source": "..."},              # optional (default 1)
     "stack": {"name": "flash", "attention_kernel": "flash2", "source": "..."},   # optional
     "stacks": {"megatron-lm-2021": {"attention_kernel": "unfused", "note": "..."}},  # optional
     "collectives": {...},           # optional, read by cluster/collectives.py
     "measurements": {...}}          # optional: the raw points `autoplan calibrate` measured, with spread

[Note: software stacks]
The same GPU trains at different speeds under different software: Megatron-LM in 2021 computed
attention unfused (a batched GEMM for the scores, a fused scale-mask-softmax kernel, dropout, a
second batched GEMM: every score of the s x s matrix is written to and read from memory), where
today's stacks run flash attention (Dao 2023), which keeps the scores on chip and skips masked
tiles. That is a property of the run, not of the GPU, so it is a named choice, never a per-run
knob: a calibration describes one stack (`stack`, by default today's: flash attention) and may
list named variants (`stacks`) that override a few fields (`STACK_FIELDS`). `Calibration.for_stack`
returns a variant; `autoplan suggest --stack NAME` selects it. Under `attention_kernel = "unfused"`
attention is priced from its parts with the GEMM and memory-bandwidth shares (cost/ops.py
`unfused_attention_time_s`), so no attention share is fitted for it. A fused kernel is named too
(FlashAttention-2 or -3, cuDNN, Triton: [Note: attention kernels]), and its share stays within what
that kernel's published benchmarks reach on the chip: the default stack's is FlashAttention-2, what
torch's SDPA runs for autoplan's runtime; llm-foundry's runs used a Triton kernel (stack
`llm-foundry`), Megatron-Core's Transformer Engine cuDNN's (stacks `megatron-core*`).

Two fields describe how a stack runs a mixture-of-experts layer under expert parallelism. How it
dispatches (`expert_dispatch`): one row per (token, expert) pair, as torch's all-to-all with the
tokens permuted by expert sends them (autoplan's runtime, Megatron-Core's `MoEAlltoAllTokenDispatcher`,
torchtitan), or each token once per destination rank, which combines the copies a rank's experts
share (DeepEP's intra-node kernels: deepseek-ai/DeepEP README, "normal kernels"; cost/experts.py
`dispatch_share`). And how fast the host issues kernels once it has waited on the device
(`host_sync_kernel_s`): an all-to-all of variable sizes needs each rank's token counts on the host
before it can size its buffers (`torch.distributed.all_to_all_single` takes host-side split lists;
DeepEP's dispatch waits on the host for its receive counts), so every MoE layer drains the queue of
kernels the host had issued ahead, and the layer's kernels then start no faster than the host's
Python and launch overhead per kernel issues them. 0 leaves the kernel floor alone (a host that
stays ahead).

One field counts how many bytes per parameter the stack's optimizer step moves
(`optimizer_bytes_per_param`; cost/time.py [Note: optimizer bytes]): 28 for a fused mixed-precision
Adam, 46 for Megatron-LM's 2021 step, which unscales, norms and copies in passes of their own. It is
read off the stack's code, never fitted: the published fit (benchmarks/validate_published.py
`--write`) writes the stacks back as the file has them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from autoplan._files import read_json
from autoplan.cluster import GPU, Cluster

__all__ = ["ATTENTION_KERNELS", "ATTENTION_SHARE_BOUNDS", "attention_share_bounds", "CALIBRATION_SCHEMA", "DEFAULT_STACK", "EXPERT_DISPATCH", "SELECTIVE_RECOMPUTE", "STACK_FIELDS", "Calibration",
           "CalibrationError", "Calibrations", "default_calibration", "load_calibration", "shipped_calibrations"]

CALIBRATION_SCHEMA = 1

ATTENTION_KERNELS = ("flash2", "flash3", "cudnn", "triton", "unfused")
"""How attention runs ([Note: attention kernels]): one fused kernel (FlashAttention-2, FlashAttention-3,
cuDNN's fused attention, a Triton flash attention), or GEMM + softmax + dropout + GEMM."""
_KERNEL_ALIASES = {"flash": "flash2"}
"""Names older calibration files use: `flash` was FlashAttention-2, what torch's SDPA calls."""

# [Note: attention kernels]
# A fused attention kernel's share of dense peak is a property of the kernel on a chip, so it is
# a named choice of the stack (`attention_kernel`) and every share of it, measured or fitted, lies
# within what that kernel's published benchmarks reach on that chip (`ATTENTION_SHARE_BOUNDS`:
# the lowest and highest TFLOP/s reported over sequence lengths 512-16k, head dimensions 64-256,
# causal and not, forward and backward, in BF16, divided by the datasheet's dense BF16 peak, 312
# TFLOP/s on an A100 and 989 on an H100 SXM: cluster/devices.py). The default stack's kernel is
# what autoplan's runtime calls: torch's `scaled_dot_product_attention`, whose flash backend runs
# FlashAttention-2's kernels on both chips (torch 2.2 release notes, "FlashAttention-2 in SDPA";
# aten/src/ATen/native/transformers/cuda/flash_attn). Sources:
# - A100, FlashAttention-2: Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism
#   and Work Partitioning", arXiv 2307.08691, abstract and Sec. 4.1 (Figs. 4-6): 50-73% of the
#   theoretical maximum FLOP/s.
# - A100, Triton (the FlashAttention Triton kernel of 2023 that llm-foundry ran): the same Sec. 4.1,
#   FlashAttention-2 is 1.3-2.5x faster than it, so 0.50 / 2.5 to 0.73 / 1.3.
# - H100, FlashAttention-2, FlashAttention-3 and cuDNN: Shah et al. 2024, "FlashAttention-3:
#   Fast and Accurate Attention with Asynchrony and Low-precision", arXiv 2407.08608, Sec. 4.1,
#   Fig. 5 (forward, BF16: FlashAttention-2 191-370 TFLOP/s, cuDNN 308-617, FlashAttention-3
#   292-756) and Fig. 6 (backward, BF16: FlashAttention-2 198-322, cuDNN 266-518, FlashAttention-3
#   272-561). FlashAttention-2's own H100 figure (Dao 2023, Fig. 7: up to 335 TFLOP/s forward and
#   backward) lies inside its range.
# - H100, Triton (the llm-foundry runs): the same 2023 kernel as on the A100, so the same relation to
#   FlashAttention-2, on the H100's FlashAttention-2 range: 0.19 / 2.5 to 0.37 / 1.3, the only
#   published comparison of that kernel. llm-foundry's `attn_impl: triton` is `flash_attn_triton.py`
#   compiled by the pre-MLIR Triton it requires (`triton-pre-mlir`, the vchiley/triton
#   `triton_pre_mlir*` branches its error message and install notes name), which predates Triton's
#   Hopper code generation (wgmma, TMA). The Triton kernel of Shah et al. 2024, Fig. 5 (146-403
#   TFLOP/s forward) is another, Hopper-aware kernel: it runs ahead of FlashAttention-2 in that
#   figure's head-dimension-64 panel (396 against 318 TFLOP/s at 2k), so it does not bound this one.
#   (Issue 40 had used it, 0.15-0.41; the fitted share, 0.189, lies in both ranges.)
# The unfused kernel has no share: it is priced from its GEMMs and its memory traffic (cost/ops.py).
ATTENTION_SHARE_BOUNDS: dict[tuple[str, str], tuple[float, float]] = {
    ("flash2", "A100"): (0.50, 0.73),
    ("triton", "A100"): (0.20, 0.56),
    ("flash2", "H100"): (0.19, 0.37),
    ("flash3", "H100"): (0.27, 0.76),
    ("cudnn", "H100"): (0.27, 0.62),
    ("triton", "H100"): (0.08, 0.28),
}
"""(lowest, highest) share of dense BF16 peak each fused kernel's published benchmarks reach on a
chip ([Note: attention kernels]), by (kernel, chip)."""


def attention_share_bounds(kernel: str, gpu_name: str) -> tuple[float, float] | None:
    """ATTENTION_SHARE_BOUNDS of `kernel` on the chip of `gpu_name` (an H200 is an H100's chip), or
    None where no benchmark of it on that chip is collected (or the kernel is unfused)."""
    family = gpu_name.split("-")[0]
    return ATTENTION_SHARE_BOUNDS.get((_KERNEL_ALIASES.get(kernel, kernel), _SAME_CHIP.get(family, family)))
DEFAULT_STACK = "flash"
"""The stack a calibration describes unless it names another: today's, with flash attention."""
SELECTIVE_RECOMPUTE = ("attention", "op")
"""What `recompute = selective` recomputes: the attention core (Korthikanti et al. 2022, Sec. 5;
autoplan's runtime and Megatron-LM), or torchtitan's operator-level policy ("op": every second
matmul and the cheap operators, keeping attention's output; torchtitan
`distributed/activation_checkpoint.py`, `_op_sac_save_list`)."""
EXPERT_DISPATCH = ("copies", "ranks")
"""How a stack's expert-parallel all-to-all sends a token routed to k experts ([Note: software
stacks]): one row per (token, expert) copy, or once per destination rank (DeepEP)."""
STACK_FIELDS = ("attention_kernel", "causal_work_fraction", "attention_fwd_efficiency", "attention_bwd_efficiency",
                "overlap_slowdown", "selective_recompute", "overlap_grad_reduce", "p2p_blocking", "expert_dispatch",
                "host_sync_kernel_s", "tp_comm_overlap", "hidden_dropout", "optimizer_bytes_per_param")
"""Fields a named stack may override ([Note: software stacks])."""


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class Calibration:
    """The achieved rates of one GPU type (see the module docstring and cost/ops.py)."""

    gpu: str
    """`GPU.name` this calibration describes."""
    gemm_efficiency: dict[str, float]
    """Achieved share of dense peak of a large GEMM, per dtype key (`cluster.DTYPE_KEYS`); a dtype
    missing here uses the largest one given."""
    attention_fwd_efficiency: float
    """Share of dense peak a fused attention forward reaches on the FLOPs it does."""
    attention_bwd_efficiency: float
    """The same for its backward (which recomputes the scores: Dao 2023, FlashAttention-2, Sec. 3.1)."""
    causal_work_fraction: float
    """Share of the full s x s score work a causal attention kernel does: about 1/2 for flash
    attention, which skips masked tiles (Dao 2023, Sec. 3.1.1); 1 for an unfused kernel that masks
    after computing every score."""
    memory_bandwidth_efficiency: float
    """Achieved share of `GPU.mem_bw_bytes_per_s` of a streaming (memory-bound) kernel."""
    kernel_floor_s: float
    """Shortest time any kernel takes (launch and tail), seconds."""
    overlap_slowdown: float = 0.0
    """Share by which compute slows while a collective runs beside it (NCCL's kernels take SMs and
    memory bandwidth: Rashidi et al. 2021, "Enabling Compute-Communication Overlap in Distributed
    Deep Learning Training Platforms", ISCA, Sec. 3; Jangda et al. 2022, CoCoNet, ASPLOS, Sec. 2):
    overlapped communication of c seconds costs the compute beside it `overlap_slowdown * c`
    (cost/comm.py [Note: overlap slowdown])."""
    network_efficiency: float = 1.0
    """Share of the inter-node link's nominal bandwidth that collectives achieve (NIC, PCIe and
    switch losses; nccl-tests busbw on InfiniBand/RoCE stays below line rate: NVIDIA, "NCCL tests
    PERFORMANCE.md"). Applied to links without measured curves (`Calibrations.effective_cluster`)."""
    fsdp_unit_overhead_s: float = 0.0
    """Time per FSDP unit, per forward and per backward, that a step waits for once (the first
    unit's lazy initialization and unsharded all-gather, the hooks' host work the GPU is not yet
    ahead of, the last reduce-scatter: Zhao et al. 2023, "PyTorch FSDP", VLDB 16(12), Sec. 4.3;
    cost/comm.py [Note: FSDP communication]); fitted to published runs, charged once per step
    (search/fsdp_exposed.py `fsdp_exposed`)."""
    attention_kernel: str = "flash2"
    """One of ATTENTION_KERNELS ([Note: software stacks], [Note: attention kernels])."""
    selective_recompute: str = "attention"
    """What selective recompute recomputes (`SELECTIVE_RECOMPUTE`, [Note: software stacks])."""
    p2p_blocking: bool = False
    """Whether a pipeline transfer blocks its sender and receiver: Megatron-LM's p2p_communication
    waited on every request and then synchronized the device ("to protect against race condition
    when using batch_isend_irecv()") until `--overlap-p2p-communication`; autoplan's executor and
    today's stacks overlap transfers with compute (search/assemble.py [Note: blocking P2P])."""
    overlap_grad_reduce: bool = True
    """Whether the data-parallel gradient all-reduce (zero 0 / 1) runs in buckets during the last
    backward (PyTorch DDP, Li et al. 2020, Sec. 3.2.3; Megatron-LM's `--overlap-grad-reduce` since
    September 2023, commit e801b2b) or after it, whole (Megatron-LM before then: its DDP reduced one
    contiguous gradient buffer once the backward had finished)."""
    tp_comm_overlap: bool = False
    """Whether a transformer layer's sequence-parallel all-gathers and reduce-scatters run inside the
    GEMMs that consume and produce them (Megatron-LM `--tp-comm-overlap`: Transformer Engine's
    userbuffers split each collective into chunks pipelined with the GEMM's, transformer_engine
    `initialize_ub` and its `ub_overlap_ag` / `ub_overlap_rs` layer options), so the layer does not
    wait for them (cost/time.py `block_times`); False: they are exposed, as torch's
    `parallelize_module` runs them."""
    hidden_dropout: bool = False
    """Whether the stack's transformer layers drop out their two residual branches (Megatron-LM's
    `--hidden-dropout`, 0.1 by default in megatron/arguments.py, through the fused
    bias-dropout-add of megatron/model/transformer.py): each writes a one-byte mask in the forward
    and runs a backward kernel over the hidden state (cost/time.py [Note: hidden dropout]). False:
    the profiled model's own operators only (autoplan's zoo models have no dropout)."""
    expert_dispatch: str = "copies"
    """How the expert-parallel all-to-all sends a token routed to k experts (`EXPERT_DISPATCH`,
    [Note: software stacks])."""
    host_sync_kernel_s: float = 0.0
    """Seconds the host takes to issue one kernel of a block whose pass waits on the device (the
    expert all-to-all's token counts, [Note: software stacks]): each of that block's kernels takes at
    least this long (cost/time.py `op_pass_times`); 0: only `kernel_floor_s`."""
    optimizer_bytes_per_param: float = 28.0
    """Bytes the stack's optimizer step reads and writes per parameter it updates (cost/time.py
    [Note: optimizer bytes]): 28 for a fused mixed-precision Adam (`ADAM_BYTES_PER_PARAM`), 46 for
    Megatron-LM's 2021 `Float16OptimizerWithFloat16Params.step` (megatron/optimizer/optimizer.py at
    b4bc51b1e7). A count read off the stack's code, not a fitted number."""
    stack: str = DEFAULT_STACK
    """Name of the software stack these numbers describe ([Note: software stacks])."""
    stacks: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)
    """Named variants: stack name -> {field in STACK_FIELDS: value, "note": why}."""
    collectives: dict[str, Any] = field(default_factory=dict)
    """Measured collective curves per link kind (cluster/collectives.py reads them); empty: the
    cluster's own link figures."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each section's numbers come from: keys `gemm`, `attention`, `memory`, `collectives`, and
    `file` for the whole file."""
    measurements: dict[str, Any] = field(default_factory=dict, compare=False)
    """Raw points behind a measured calibration (shapes, medians, spread), kept for the record."""

    def gemm(self, dtype_key: str) -> float:
        if dtype_key in self.gemm_efficiency:
            return self.gemm_efficiency[dtype_key]
        return max(self.gemm_efficiency.values())

    def for_stack(self, name: str | None) -> Calibration:
        """This calibration under the named stack ([Note: software stacks]); None or its own name:
        itself. An unknown name raises CalibrationError naming the stacks it has."""
        if name is None or name == self.stack:
            return self
        if name not in self.stacks:
            known = ", ".join([self.stack, *self.stacks])
            raise CalibrationError(f"no stack {name!r} in the {self.gpu} calibration; it has: {known}")
        changes = {k: v for k, v in self.stacks[name].items() if k in STACK_FIELDS}
        return self.replace(stack=name, **changes)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": CALIBRATION_SCHEMA,
            "gpu": self.gpu,
            "source": self.sources.get("file", ""),
            "gemm": {"efficiency": dict(self.gemm_efficiency), "source": self.sources.get("gemm", "")},
            "attention": {"fwd_efficiency": self.attention_fwd_efficiency,
                          "bwd_efficiency": self.attention_bwd_efficiency,
                          "causal_work_fraction": self.causal_work_fraction,
                          "source": self.sources.get("attention", "")},
            "memory": {"bandwidth_efficiency": self.memory_bandwidth_efficiency,
                       "kernel_floor_s": self.kernel_floor_s, "source": self.sources.get("memory", "")},
        }
        if self.overlap_slowdown:
            out["overlap"] = {"compute_slowdown": self.overlap_slowdown, "source": self.sources.get("overlap", "")}
        if self.fsdp_unit_overhead_s:
            out["fsdp"] = {"unit_overhead_s": self.fsdp_unit_overhead_s, "source": self.sources.get("fsdp", "")}
        if self.network_efficiency != 1.0:
            out["network"] = {"efficiency": self.network_efficiency, "source": self.sources.get("network", "")}
        out["stack"] = {"name": self.stack, "attention_kernel": self.attention_kernel,
                        "selective_recompute": self.selective_recompute,
                        "overlap_grad_reduce": self.overlap_grad_reduce, "p2p_blocking": self.p2p_blocking,
                        "expert_dispatch": self.expert_dispatch, "host_sync_kernel_s": self.host_sync_kernel_s,
                        "tp_comm_overlap": self.tp_comm_overlap, "hidden_dropout": self.hidden_dropout,
                        "source": self.sources.get("stack", "")}
        if self.optimizer_bytes_per_param != 28.0:
            out["stack"]["optimizer_bytes_per_param"] = self.optimizer_bytes_per_param
        if self.stacks:
            out["stacks"] = {k: dict(v) for k, v in self.stacks.items()}
        if self.collectives:
            out["collectives"] = {**self.collectives, "source": self.sources.get("collectives", "")}
        if self.measurements:
            out["measurements"] = self.measurements
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "calibration") -> Calibration:
        def section(name: str) -> dict[str, Any]:
            value = data.get(name)
            if not isinstance(value, dict):
                raise CalibrationError(f"{where}: missing section {name!r}; write one as `autoplan calibrate` does")
            return value

        def fraction(sec: str, key: str, value: Any, upper: float = 1.0) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= upper:
                raise CalibrationError(f"{where}: {sec}.{key} must be a number in (0, {upper:g}], got {value!r}")
            return float(value)

        if data.get("schema") != CALIBRATION_SCHEMA:
            raise CalibrationError(f"{where}: schema {data.get('schema')!r} is not {CALIBRATION_SCHEMA}; "
                                   "re-run `autoplan calibrate` with this version")
        if not isinstance(data.get("gpu"), str) or not data["gpu"]:
            raise CalibrationError(f"{where}: 'gpu' must name the GPU type (e.g. \"H100-SXM-80GB\")")
        gemm, attention, memory = section("gemm"), section("attention"), section("memory")
        efficiency = gemm.get("efficiency")
        if not isinstance(efficiency, dict) or not efficiency:
            raise CalibrationError(f"{where}: gemm.efficiency must map dtypes to fractions, e.g. {{\"bf16\": 0.7}}")
        floor = memory.get("kernel_floor_s")
        if not _below_one(floor):
            raise CalibrationError(f"{where}: memory.kernel_floor_s must be seconds in [0, 1), got {floor!r}")
        collectives = dict(data.get("collectives") or {})
        overlap = data.get("overlap") or {}
        network = data.get("network") or {}
        stack = data.get("stack") or {}
        fsdp = data.get("fsdp") or {}
        if not all(isinstance(x, dict) for x in (overlap, network, stack, fsdp)):
            raise CalibrationError(f"{where}: 'overlap', 'network', 'fsdp' and 'stack' must be objects")
        selective = stack.get("selective_recompute", "attention")
        if selective not in SELECTIVE_RECOMPUTE:
            raise CalibrationError(f"{where}: stack.selective_recompute must be one of {SELECTIVE_RECOMPUTE}, "
                                   f"got {selective!r}")
        unit_overhead = fsdp.get("unit_overhead_s", 0.0)
        if not _below_one(unit_overhead):
            raise CalibrationError(f"{where}: fsdp.unit_overhead_s must be seconds in [0, 1), got {unit_overhead!r}")
        for flag in ("overlap_grad_reduce", "p2p_blocking", "tp_comm_overlap", "hidden_dropout"):
            if not isinstance(stack.get(flag, False), bool):
                raise CalibrationError(f"{where}: stack.{flag} must be true or false, got {stack[flag]!r}")
        kernel = _KERNEL_ALIASES.get(stack.get("attention_kernel", "flash2"), stack.get("attention_kernel", "flash2"))
        if kernel not in ATTENTION_KERNELS:
            raise CalibrationError(f"{where}: stack.attention_kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}")
        stacks = data.get("stacks") or {}
        if not isinstance(stacks, dict) or not all(isinstance(v, dict) for v in stacks.values()):
            raise CalibrationError(f"{where}: 'stacks' must map stack names to objects of overrides")
        for name, variant in stacks.items():
            unknown = set(variant) - set(STACK_FIELDS) - {"note"}
            if unknown:
                raise CalibrationError(f"{where}: stack {name!r} overrides {sorted(unknown)}; a stack may set "
                                       f"{', '.join(STACK_FIELDS)} (and a note)")
            if "attention_kernel" in variant:
                variant = {**variant, "attention_kernel": _KERNEL_ALIASES.get(variant["attention_kernel"],
                                                                              variant["attention_kernel"])}
                stacks = {**stacks, name: variant}
            if variant.get("attention_kernel", "flash2") not in ATTENTION_KERNELS:
                raise CalibrationError(f"{where}: stack {name!r}: attention_kernel must be one of {ATTENTION_KERNELS}")
            for flag in ("overlap_grad_reduce", "p2p_blocking", "tp_comm_overlap", "hidden_dropout"):
                if not isinstance(variant.get(flag, True), bool):
                    raise CalibrationError(f"{where}: stack {name!r}: {flag} must be true or false, "
                                           f"got {variant[flag]!r}")
            slowdown_of_variant = variant.get("overlap_slowdown", 0.0)
            if not _below_one(slowdown_of_variant):
                raise CalibrationError(f"{where}: stack {name!r}: overlap_slowdown must be a number in [0, 1), "
                                       f"got {slowdown_of_variant!r}")
            if variant.get("selective_recompute", "attention") not in SELECTIVE_RECOMPUTE:
                raise CalibrationError(f"{where}: stack {name!r}: selective_recompute must be one of "
                                       f"{SELECTIVE_RECOMPUTE}")
            _check_stack_moe(variant, f"{where}: stack {name!r}")
            _check_optimizer_bytes(variant, f"{where}: stack {name!r}")
            for share in ("attention_fwd_efficiency", "attention_bwd_efficiency", "causal_work_fraction"):
                if share in variant:
                    fraction(f"stacks.{name}", share, variant[share])
        _check_stack_moe(stack, f"{where}: stack")
        _check_optimizer_bytes(stack, f"{where}: stack")
        slowdown = overlap.get("compute_slowdown", 0.0)
        if not _below_one(slowdown):
            raise CalibrationError(f"{where}: overlap.compute_slowdown must be a number in [0, 1), got {slowdown!r}")
        sources = {"file": str(data.get("source", "")), "gemm": str(gemm.get("source", "")),
                   "attention": str(attention.get("source", "")), "memory": str(memory.get("source", "")),
                   "collectives": str(collectives.pop("source", "")), "overlap": str(overlap.get("source", "")),
                   "network": str(network.get("source", "")), "stack": str(stack.get("source", "")),
                   "fsdp": str(fsdp.get("source", ""))}
        return cls(
            gpu=data["gpu"],
            gemm_efficiency={k: fraction("gemm.efficiency", k, v) for k, v in efficiency.items()},
            attention_fwd_efficiency=fraction("attention", "fwd_efficiency", attention.get("fwd_efficiency")),
            attention_bwd_efficiency=fraction("attention", "bwd_efficiency", attention.get("bwd_efficiency")),
            causal_work_fraction=fraction("attention", "causal_work_fraction",
                                          attention.get("causal_work_fraction", 1.0)),
            memory_bandwidth_efficiency=fraction("memory", "bandwidth_efficiency", memory.get("bandwidth_efficiency")),
            kernel_floor_s=float(floor),
            overlap_slowdown=float(slowdown),
            network_efficiency=fraction("network", "efficiency", network.get("efficiency", 1.0)),
            fsdp_unit_overhead_s=float(unit_overhead),
            attention_kernel=kernel,
            selective_recompute=selective,
            overlap_grad_reduce=bool(stack.get("overlap_grad_reduce", True)),
            p2p_blocking=bool(stack.get("p2p_blocking", False)),
            tp_comm_overlap=bool(stack.get("tp_comm_overlap", False)),
            hidden_dropout=bool(stack.get("hidden_dropout", False)),
            expert_dispatch=str(stack.get("expert_dispatch", "copies")),
            host_sync_kernel_s=float(stack.get("host_sync_kernel_s", 0.0)),
            optimizer_bytes_per_param=float(stack.get("optimizer_bytes_per_param", 28.0)),
            stack=str(stack.get("name", DEFAULT_STACK)),
            stacks={k: dict(v) for k, v in stacks.items()},
            collectives=collectives,
            sources=sources,
            measurements=dict(data.get("measurements") or {}),
        )

    def replace(self, **changes: Any) -> Calibration:
        return dataclasses.replace(self, **changes)


def _below_one(value: Any) -> bool:
    """Whether `value` is a number (not a bool) in [0, 1): a share below one, or seconds under one."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < 1


def _check_stack_moe(fields: dict[str, Any], where: str) -> None:
    """The mixture-of-experts fields of a stack or stack variant, or CalibrationError (one line)."""
    if fields.get("expert_dispatch", "copies") not in EXPERT_DISPATCH:
        raise CalibrationError(f"{where}: expert_dispatch must be one of {EXPERT_DISPATCH}, "
                               f"got {fields.get('expert_dispatch')!r}")
    seconds = fields.get("host_sync_kernel_s", 0.0)
    if not _below_one(seconds):
        raise CalibrationError(f"{where}: host_sync_kernel_s must be seconds in [0, 1), got {seconds!r}")


def _check_optimizer_bytes(fields: dict[str, Any], where: str) -> None:
    """A stack's `optimizer_bytes_per_param`, or CalibrationError (one line)."""
    value = fields.get("optimizer_bytes_per_param", 28.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1000:
        raise CalibrationError(f"{where}: optimizer_bytes_per_param must be bytes per parameter in (0, 1000] "
                               f"(28 for a fused mixed-precision Adam), got {value!r}")


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file; a missing or malformed one raises CalibrationError (one line)."""
    path = Path(path)
    data = read_json(path, "calibration file", CalibrationError, f"write one with `autoplan calibrate --out {path}`")
    if not isinstance(data, dict):
        raise CalibrationError(f"calibration file {path}: expected a JSON object")
    return Calibration.from_dict(data, where=str(path))


def shipped_calibrations() -> dict[str, Calibration]:
    """The calibrations packaged with autoplan, by GPU name."""
    out = {}
    folder = resources.files("autoplan.cost") / "calibrations"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            cal = Calibration.from_dict(json.loads(entry.read_text()), where=f"autoplan/cost/calibrations/{entry.name}")
            out[cal.gpu] = cal
    return out


_SHIPPED: dict[str, Calibration] | None = None

_SAME_CHIP = {"H200": "H100"}
"""GPU families built on another's chip (H200: the H100's GH100 with more and faster HBM)."""


def default_calibration(gpu: GPU) -> Calibration:
    """The shipped calibration of `gpu`'s type, else one of the same chip (an A100-40GB uses the
    A100-80GB file, an H200 the H100's), else assumed figures, marked as such."""
    global _SHIPPED
    if _SHIPPED is None:
        _SHIPPED = shipped_calibrations()
    if gpu.name in _SHIPPED:
        return _SHIPPED[gpu.name]
    family = _SAME_CHIP.get(gpu.name.split("-")[0], gpu.name.split("-")[0])
    for name, cal in _SHIPPED.items():
        if name.split("-")[0] == family:
            return cal.replace(gpu=gpu.name, sources={**cal.sources, "file": f"{cal.sources.get('file', '')} "
                                                      f"(the {name} calibration, same chip)"})
    return _assumed(gpu)


def _assumed(gpu: GPU) -> Calibration:
    """No measurement for this GPU type: the A100 fit's GEMM share and typical streaming and
    launch figures. Run `autoplan calibrate` on the device to replace them."""
    note = f"assumed for {gpu.name} (no calibration shipped; run `autoplan calibrate` on one)"
    base = (_SHIPPED or {}).get("A100-SXM4-80GB")
    gemm = dict(base.gemm_efficiency) if base is not None else {"bf16": 0.6}
    attention = (base.attention_fwd_efficiency, base.attention_bwd_efficiency) if base is not None else (0.3, 0.3)
    return Calibration(
        gpu=gpu.name, gemm_efficiency=gemm, attention_fwd_efficiency=attention[0],
        attention_bwd_efficiency=attention[1], causal_work_fraction=1.0,
        memory_bandwidth_efficiency=0.8, kernel_floor_s=5e-6,
        sources={"file": note, "gemm": note, "attention": note, "memory": note},
    )


@dataclass
class Calibrations:
    """The calibration to use for each GPU type of a search: user files first, then shipped ones,
    under the named software stack (`stack`, None: each calibration's own)."""

    overrides: dict[str, Calibration] = field(default_factory=dict)
    stack: str | None = None

    @classmethod
    def from_files(cls, paths: list[str | Path] | tuple[str | Path, ...] = ()) -> Calibrations:
        overrides: dict[str, Calibration] = {}
        for path in paths:
            cal = load_calibration(path)
            overrides[cal.gpu] = cal
        return cls(overrides)

    def for_gpu(self, gpu: GPU) -> Calibration:
        cal = self.overrides[gpu.name] if gpu.name in self.overrides else default_calibration(gpu)
        if self.stack is not None and self.stack != cal.stack and self.stack not in cal.stacks:
            return cal  # a stack this GPU's calibration does not describe: its own numbers (checked by `check_stack`)
        return cal.for_stack(self.stack)

    def check_stack(self, gpus: list[GPU]) -> None:
        """Raise CalibrationError when the chosen stack is described by none of `gpus`' calibrations."""
        if self.stack is None:
            return
        cals = [self.overrides.get(g.name) or default_calibration(g) for g in gpus]
        if not any(self.stack == c.stack or self.stack in c.stacks for c in cals):
            known = sorted({n for c in cals for n in (c.stack, *c.stacks)})
            raise CalibrationError(f"--stack {self.stack!r}: no calibration of this cluster's GPUs describes it; "
                                   f"choose one of {', '.join(known)}")

    def effective_cluster(self, cluster: Cluster) -> Cluster:
        """`cluster` with its inter-node link at the bandwidth collectives achieve on it (the lowest
        `network_efficiency` of its GPU types' calibrations); a link with measured curves is kept."""
        efficiency = min(self.for_gpu(g).network_efficiency for g in cluster.gpu_types)
        link = cluster.inter_node
        if efficiency >= 1.0 or link.curves:
            return cluster
        return dataclasses.replace(cluster, inter_node=dataclasses.replace(
            link, bw_bytes_per_s=link.bw_bytes_per_s * efficiency))
