"""Operators of the built-in models that keep less for backward than their composite form:
`swiglu`, SwiGLU's gate as one operator that saves its two inputs only.

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
from torch import Tensor

from autoplan.graph.operators import record_as_composite

__all__ = ["swiglu"]


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
