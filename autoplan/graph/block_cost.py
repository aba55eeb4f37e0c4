"""What one block costs, recorded on fake tensors: FLOPs, saved-for-backward bytes, operators.

`measure_block` runs one block's forward and backward under `FlopCounterMode`, a saved-tensors hook
and the operator recorder (graph/operators.py); `cut_candidates` sizes what crosses each cut between
blocks. Apart from graph/profile.py, which decides which blocks to measure (each distinct one once,
at the batch and at twice it) and assembles the profile, and from graph/timing.py, which times
blocks on a real device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from autoplan.graph.blocks import CrossingTensor, CutCandidate
from autoplan.graph.fake_run import FakeRun, dtype_name, nbytes, tensors_in
from autoplan.graph.operators import Call, GpuKernels, OperatorRecorder, UnpricedOperator
from autoplan.graph.trace import TracedModel, crossing_values
from autoplan.graph.trace_errors import model_line

__all__ = ["BlockCost", "block_fingerprint", "block_params", "custom_flop_formulas", "cut_candidates", "flop_counter",
           "measure_block", "unpriced"]

_ATTENTION_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    torch.ops.aten._scaled_dot_product_flash_attention_backward,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
}


# --------------------------------------------------------------------------------------------
# FLOP counting


def _cpu_sdpa_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode that also counts the cpu fused attention kernel.

    torch registers FLOP formulas for the CUDA flash / memory-efficient kernels only; the cpu
    kernel computes the same math, so it gets the same formula (counting the full s x s score
    matrix, as FlopCounterMode does for the CUDA kernels and as Megatron's 4*b*s^2*h term does).
    """
    return FlopCounterMode(display=False, custom_mapping=custom_flop_formulas())


def custom_flop_formulas() -> dict:
    """FLOP formulas torch lacks, by operator packet (see `flop_counter`)."""
    mapping = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
    }
    # transformers' grouped GEMM of mixture-of-experts layers (its integrations/moe.py), when loaded.
    moe = getattr(torch.ops, "transformers", None)
    if moe is not None and hasattr(moe, "grouped_mm_fallback"):
        mapping[moe.grouped_mm_fallback] = _grouped_mm_flop
        mapping[moe.grouped_mm_fallback_backward] = _grouped_mm_backward_flop
    return mapping


def _grouped_mm_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """Rows (S, K) sorted by expert against expert matrices (E, K, N): each row meets one K x N
    matrix, 2 FLOPs per multiply-add (the convention of torch.utils.flop_counter)."""
    return 2 * input_shape[0] * input_shape[1] * weight_shape[-1]


def _grouped_mm_backward_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _grouped_mm_flop(input_shape, weight_shape)  # the input's gradient and the weights'


def _attention_flops(counter: FlopCounterMode) -> float:
    counts = counter.get_flop_counts().get("Global", {})
    return float(sum(v for op, v in counts.items() if op in _ATTENTION_OPS or _is_autoplan_attention(op)))


def _is_autoplan_attention(op) -> bool:
    """autoplan's attention operator and its backward (models/windowed_attention.py: soft-capping,
    windows, sinks), matched by name: it is registered where a model first calls it, never here."""
    return getattr(op, "_qualified_op_name", None) in ("autoplan::attention", "autoplan::attention_backward")


# --------------------------------------------------------------------------------------------
# Cuts


def cut_candidates(traced: TracedModel, run: FakeRun) -> list[CutCandidate]:
    cuts = []
    for index in range(traced.num_blocks - 1):
        tensors: list[CrossingTensor] = []
        reason = ""
        for node in crossing_values(traced, index):
            value = run.values.get(node.name)
            found = tensors_in(value)
            if found is None:
                reason = f"'{node.name}' ({type(value).__name__}) crosses the cut and is not a tensor"
                continue
            for i, t in enumerate(found):
                name = node.name if len(found) == 1 else f"{node.name}[{i}]"
                tensors.append(CrossingTensor(name, tuple(t.shape), dtype_name(t.dtype), nbytes(t)))
        cuts.append(CutCandidate(index, tuple(tensors), legal=not reason, reason=reason))
    return cuts


# --------------------------------------------------------------------------------------------
# One block


@dataclass(frozen=True)
class BlockCost:
    fwd_flops: float
    bwd_flops: float
    saved_bytes: int
    saved_bytes_hidden: int
    attention_fwd_flops: float
    attention_bwd_flops: float
    fwd_calls: list[Call]
    bwd_calls: list[Call]


def block_fingerprint(traced: TracedModel, index: int, sub: fx.GraphModule, inputs: list[Any]) -> str:
    """Structure + parameter shapes + input shapes, with the block's own path abstracted away."""
    prefix = traced.block_names[index]
    position: dict[str, int] = {}
    parts: list[str] = []

    def norm(arg: Any) -> Any:
        return fx.node.map_arg(arg, lambda n: f"%{position.get(n.name, n.name)}")

    for i, node in enumerate(sub.graph.nodes):
        position[node.name] = i
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        target = "input" if node.op == "placeholder" else str(target).replace(prefix, "@")
        parts.append(f"{node.op}|{target}|{norm(node.args)}|{norm(node.kwargs)}")
    for name, p in sub.named_parameters():
        parts.append(f"{name.replace(prefix, '@')}:{tuple(p.shape)}:{p.dtype}")
    for name, m in sub.named_modules():
        if name.startswith(prefix):
            parts.append(type(m).__name__)
    for value in inputs:
        found = tensors_in(value) or []
        parts.append(str([(tuple(t.shape), t.dtype) for t in found]))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def block_params(sub: fx.GraphModule, run: FakeRun) -> dict[str, torch.Tensor]:
    names = [n for n, _ in sub.named_parameters(remove_duplicate=False)] + [n for n, _ in sub.named_buffers()]
    return {n: run.params[n] for n in names}


def _record_calls(sub: fx.GraphModule, inputs: list[Any], params: dict[str, torch.Tensor], hidden: int | None,
                  run: FakeRun) -> tuple[list[Call], list[Call]]:
    """The operators of one forward and backward with the GPU's fused kernels ([Note: operators as
    a GPU runs them] in graph/operators.py)."""
    formulas = custom_flop_formulas()
    fwd_recorder = OperatorRecorder(list(params.values()), hidden, formulas)
    bwd_recorder = OperatorRecorder(list(params.values()), hidden, formulas)
    with run.mode:
        leaves = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                  for x in inputs]
        with GpuKernels((fwd_recorder, bwd_recorder)), fwd_recorder:
            outputs = torch.func.functional_call(sub, params, tuple(leaves), strict=False)
        outs = [o for o in (tensors_in(outputs) or []) if o.requires_grad]
        if outs:
            seeds = [torch.ones_like(o) for o in outs]
            with bwd_recorder:
                torch.autograd.backward(outs, seeds)
    return fwd_recorder.calls, bwd_recorder.calls


def measure_block(sub: fx.GraphModule, inputs: list[Any], params: dict[str, torch.Tensor], hidden: int | None,
                  run: FakeRun) -> BlockCost:
    """Forward and backward of one block on fake tensors, counting FLOPs and saved bytes."""
    param_storages = {p.untyped_storage()._cdata for p in params.values()}
    saved: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in param_storages and key not in saved:
            hidden_shaped = hidden is not None and t.dim() >= 2 and t.shape[-1] == hidden
            saved[key] = (storage.nbytes(), hidden_shaped)
        return t

    formulas = custom_flop_formulas()
    fwd_recorder = OperatorRecorder(list(params.values()), hidden, formulas)
    bwd_recorder = OperatorRecorder(list(params.values()), hidden, formulas)
    fused = GpuKernels()
    with run.mode:
        leaf_inputs = [
            x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in inputs
        ]
        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flop_counter() as fwd_counter,
              fwd_recorder, fused):
            outputs = torch.func.functional_call(sub, params, tuple(leaf_inputs), strict=False)
        outs = [o for o in (tensors_in(outputs) or []) if o.requires_grad]
        bwd_flops = attention_bwd = 0.0
        if outs:
            seeds = [torch.ones_like(o) for o in outs]  # the incoming gradient, not the block's work
            with flop_counter() as bwd_counter, bwd_recorder:
                torch.autograd.backward(outs, seeds)
            bwd_flops = float(bwd_counter.get_total_flops())
            attention_bwd = _attention_flops(bwd_counter)
    calls = (fwd_recorder.calls, bwd_recorder.calls)
    if fused.seen:  # recorded again as a GPU runs it ([Note: operators as a GPU runs them], operators.py)
        calls = _record_calls(sub, inputs, params, hidden, run)
    return BlockCost(
        fwd_flops=float(fwd_counter.get_total_flops()),
        bwd_flops=bwd_flops,
        saved_bytes=sum(b for b, _ in saved.values()),
        saved_bytes_hidden=sum(b for b, h in saved.values() if h),
        attention_fwd_flops=_attention_flops(fwd_counter),
        attention_bwd_flops=attention_bwd,
        fwd_calls=calls[0],
        bwd_calls=calls[1],
    )


def unpriced(exc: UnpricedOperator, sub: fx.GraphModule) -> str:
    """One line for a higher-order operator in the model ([Note: higher-order operators] in
    graph/operators.py): what it calls, where, and how to write it with ordinary operators. The
    line is the traceback's (a leaf module run by the profile), else the graph node's (export traces
    the operator into the graph; fx cannot trace it)."""
    node = next((n for n in sub.graph.nodes
                 if isinstance(n.target, torch._ops.HigherOrderOperator) and n.target.name() == exc.name), None)
    where = model_line(exc, node.meta.get("stack_trace") if node is not None else None)
    if exc.name == "cond":
        return (f"the model calls torch.cond {where}, which planning cannot price (the branch taken depends on a "
                "value, and torch cannot trace a cond's backward on fake tensors); compute both branches and pick "
                "with torch.where(pred, a, b), or choose the branch with a Python flag set when the model is built")
    return (f"the model calls the higher-order operator torch.ops.higher_order.{exc.name} {where}, which planning "
            "cannot price (it runs graphs of its own); write it with ordinary tensor operations (a Python loop for "
            "while_loop, scan or map; F.scaled_dot_product_attention for flex_attention)")
