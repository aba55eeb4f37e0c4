"""Operators of the built-in models that keep less for backward than their composite form:
`swiglu`, SwiGLU's gate as one operator that saves its two inputs only; `rms_norm` (and the
`RMSNorm` module the zoo's layers use), RMSNorm saving its input and one fp32 rstd a row on every
device, as CUDA's fused kernel does ([Note: lean RMSNorm]).

[Note: lean SwiGLU]
`F.silu(gate) * up` as two autograd nodes saves three tensors of the FFN width: silu saves `gate`,
the product saves `silu(gate)` and `up` (and the down projection saves the product itself, a
fourth). Megatron-Core's fused SwiGLU (NVIDIA/Megatron-LM megatron/core/fusions/fused_bias_swiglu.py
at 00caa53, `SwiGLUFunction.forward`: `ctx.save_for_backward(input)`, the fc1 output [gate | up])
saves only its input and recomputes silu in backward (`swiglu_back`). `swiglu` does the same as
a custom operator (`autoplan::swiglu`), so that fake tensors, torch.fx, torch.export and the
profile's dispatch modes see one operator; its backward is an operator too
(`autoplan::swiglu_backward`). Eagerly a GPU runs the ATen kernels of their bodies (silu and mul
forward; silu, two mul and silu_backward backward: one kernel more than the composite form, the
recomputed silu), and that is what the profile's operator list records ([Note: composite
operators] in graph/operators.py). The backward calls the very kernels autograd runs for the
composite form (`mul`'s gradient, `aten.silu_backward`), so the gradients are bitwise those of
`F.silu(gate) * up`. An MLP of width f keeps 3 x 2f bytes a token in bf16 (gate, up, and the product
the down projection saves) instead of 4 x 2f.

A DTensor pair (tensor parallelism on an inlined graph) runs on its local shards: the operator is
elementwise, so a local result in the inputs' placements is the global one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoplan.graph.operators import record_as_composite

__all__ = ["RMSNorm", "rms_norm", "swiglu"]


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, saving gate and up only for backward ([Note: lean SwiGLU])."""
    from torch.distributed.tensor import DTensor

    if isinstance(gate, DTensor) or isinstance(up, DTensor):
        ref = gate if isinstance(gate, DTensor) else up
        local = torch.ops.autoplan.swiglu(*(t.to_local() if isinstance(t, DTensor) else t for t in (gate, up)))
        return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                                  stride=ref.stride())
    return torch.ops.autoplan.swiglu(gate, up)


def _swiglu_composite(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _swiglu_backward_composite(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    # What autograd runs for F.silu(gate) * up: mul's backward (grad * other, grad * self), then
    # silu's (aten.silu_backward) on the gate's share, silu(gate) recomputed.
    grad_up = grad * F.silu(gate)
    grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
    return grad_gate, grad_up


@torch.library.custom_op("autoplan::swiglu", mutates_args=())
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    return _swiglu_composite(gate, up)


@_swiglu.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    torch._check(gate.shape == up.shape, lambda: "swiglu: gate and up must have one shape")
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("autoplan::swiglu_backward", mutates_args=())
def _swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return _swiglu_backward_composite(grad, gate, up)


@_swiglu_backward.register_fake
def _(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(up, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = ctx.saved_tensors
    grad_gate, grad_up = torch.ops.autoplan.swiglu_backward(grad, gate, up)
    return grad_gate, grad_up


_swiglu.register_autograd(_backward, setup_context=_setup_context)
record_as_composite(torch.ops.autoplan.swiglu.default, _swiglu_composite)
record_as_composite(torch.ops.autoplan.swiglu_backward.default, _swiglu_backward_composite)


# [Note: lean RMSNorm]
# nn.RMSNorm calls F.rms_norm. On CUDA (torch >= 2.8) that is one fused kernel, `_fused_rms_norm`,
# whose backward `_fused_rms_norm_backward(grad, input, normalized_shape, rstd, weight, mask)` needs
# the input in its own dtype and one fp32 rstd a row: 2 bytes an element in bf16. Everywhere else
# (the CPU, the profile's fake tensors) it is the composite form (torch/_decomp/decompositions.py
# `_fused_rms_norm`), under which autograd keeps the fp32 upcast input and the fp32 normalized input,
# 8 bytes an element: a zoo Llama layer kept 46 s*b*h bytes on a CPU rank against 34 on a GPU.
# `rms_norm` is one operator (`autoplan::rms_norm`, forward (y, rstd)) whose autograd saves what the
# fused kernel saves, on every device. Its bodies call the fused kernels where the device has them
# (CUDA: the same kernels nn.RMSNorm runs, so the GPU runtime is unchanged) and otherwise compute
# forward with torch's composite (the values F.rms_norm gives) and backward from x and rstd
# (`_rms_norm_backward_composite`, the fused kernel's formula; gradients within rounding of
# autograd's through the composite form, not bitwise). The profile records each as one
# memory-bound call, as a GPU runs it; no `_fused_rms_norm` is recorded, so the memory model takes
# no surplus off (cost/memory.py [Note: fused RMSNorm]): the profile's saved bytes are already the
# kernel's. A DTensor input (a sequence-parallel norm, a per-head q/k norm under tp) runs on its
# local rows, each rank's weight gradient a Partial sum over the mesh dims that split the rows, as
# DTensor's own rms_norm rule gives it.


def rms_norm(x: Tensor, normalized_shape: tuple[int, ...] | list[int], weight: Tensor | None = None,
             eps: float | None = None) -> Tensor:
    """F.rms_norm, keeping x and one fp32 rstd a row for backward on every device ([Note: lean RMSNorm])."""
    from torch.distributed.tensor import DTensor

    shape = [int(n) for n in normalized_shape]
    if isinstance(x, DTensor) or isinstance(weight, DTensor):
        local = _rms_norm_local(x, shape, weight, eps)
        if local is not None:
            return local
        return F.rms_norm(x, shape, weight, eps)  # a layout the local form does not cover
    return torch.ops.autoplan.rms_norm(x, shape, weight, eps)[0]


def _rms_norm_local(x, shape: list[int], weight, eps: float | None):
    """rms_norm of a DTensor on its local rows, or None where x's rows are not what a rank holds
    whole (a Partial input, or a shard of the normalized dims)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not isinstance(x, DTensor) or (weight is not None and not isinstance(weight, DTensor)):
        return None
    rows = x.dim() - len(shape)
    if any(isinstance(p, Partial) or (isinstance(p, Shard) and p.dim >= rows) for p in x.placements):
        return None
    local_weight = None
    if weight is not None:
        if weight.device_mesh != x.device_mesh or any(not isinstance(p, Replicate) for p in weight.placements):
            return None
        # Each rank's rows give a share of the weight's gradient: Partial where x is split.
        grads = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in x.placements)
        local_weight = weight.to_local(grad_placements=grads)
    y = torch.ops.autoplan.rms_norm(x.to_local(), shape, local_weight, eps)[0]
    return DTensor.from_local(y, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm through `rms_norm` ([Note: lean RMSNorm]): same parameters, state dict and values."""

    fx_leaf = True
    """Traced as one module, as nn.RMSNorm is (graph/trace.py): a model's blocks are unchanged."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


def _rms_norm_backward_composite(grad: Tensor, x: Tensor, shape: list[int], rstd: Tensor,
                                 weight: Tensor | None) -> tuple[Tensor, Tensor | None]:
    # y = x * rstd * w with rstd = (mean(x^2) + eps)^-1/2 over the normalized dims, so with
    # x_hat = x * rstd and g = grad * w: dx = rstd * (g - x_hat * mean(g * x_hat)), dw = sum(grad * x_hat)
    # over the rows (ATen's layer_norm_kernel.cu `_fused_rms_norm_backward` computes the same, in fp32).
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    x_hat = x.float() * rstd
    g = grad.float() * weight.float() if weight is not None else grad.float()
    grad_x = (rstd * (g - x_hat * (g * x_hat).mean(dim=dims, keepdim=True))).to(x.dtype)
    grad_w = None
    if weight is not None:
        rows = tuple(range(x.dim() - len(shape)))
        grad_w = (grad.float() * x_hat).sum(dim=rows).to(weight.dtype) if rows else (grad.float() * x_hat).to(weight.dtype)
    return grad_x, grad_w


@torch.library.custom_op("autoplan::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, normalized_shape: list[int], weight: Tensor | None, eps: float | None) -> tuple[Tensor, Tensor]:
    y, rstd = torch._fused_rms_norm(x, normalized_shape, weight, eps)  # CUDA's kernel, else torch's composite
    return y, rstd


@_rms_norm.register_fake
def _(x: Tensor, normalized_shape: list[int], weight: Tensor | None, eps: float | None) -> tuple[Tensor, Tensor]:
    rows = x.shape[: x.dim() - len(normalized_shape)]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((*rows, *([1] * len(normalized_shape))), dtype=torch.float32))


@torch.library.custom_op("autoplan::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad: Tensor, x: Tensor, normalized_shape: list[int], rstd: Tensor,
                       weight: Tensor | None) -> tuple[Tensor, Tensor]:
    if grad.device.type == "cuda":
        grad_x, grad_w = torch.ops.aten._fused_rms_norm_backward(grad, x, normalized_shape, rstd, weight,
                                                                [True, weight is not None])
    else:
        grad_x, grad_w = _rms_norm_backward_composite(grad, x, normalized_shape, rstd, weight)
    # A custom operator returns tensors only: no weight, an empty gradient that backward drops.
    return grad_x, grad_w if grad_w is not None else x.new_empty(0)


@_rms_norm_backward.register_fake
def _(grad: Tensor, x: Tensor, normalized_shape: list[int], rstd: Tensor,
      weight: Tensor | None) -> tuple[Tensor, Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if weight is not None else x.new_empty(0))


def _rms_norm_setup_context(ctx, inputs, output) -> None:
    x, normalized_shape, weight, _ = inputs
    ctx.normalized_shape = list(normalized_shape)
    ctx.save_for_backward(x, output[1], weight)
    # rstd is an output only for the backward: no zero gradient is made for it (a kernel that a GPU
    # does not run, which the profile would record).
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _rms_norm_autograd_backward(ctx, grad: Tensor | None, _grad_rstd: Tensor | None):
    x, rstd, weight = ctx.saved_tensors
    if grad is None:
        return None, None, None, None
    grad_x, grad_w = torch.ops.autoplan.rms_norm_backward(grad, x, ctx.normalized_shape, rstd, weight)
    return grad_x, None, grad_w if weight is not None else None, None


_rms_norm.register_autograd(_rms_norm_autograd_backward, setup_context=_rms_norm_setup_context)
