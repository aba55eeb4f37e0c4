"""A grouped GEMM over variable token counts, as one torch operator: rows sorted by expert times
each expert's matrix, `autoplan::grouped_mm_fallback(input (N, K), weight (E, K, M), offs (E,))`
-> (N, M), rows [offs[e-1], offs[e]) times weight[e] (rows past offs[-1] give 0).

Apart from the experts' markers (experts.py) because it is an operator, with its own fake kernel
and FLOP formulas. torch's `torch._grouped_mm` computes this but, in torch 2.13, only on CUDA in
bf16 (on the CPU it refuses fp32 operands and strides that are not multiples of 16 bytes, and its
meta kernel asks for bf16), so the zoo's dropless routing, which must run on the CPU and be
profiled on fake tensors, uses this operator: a loop over the experts on real tensors, a fixed
output shape on fake ones (the counts are data, the shapes are not), FLOPs counted per row as
torch.utils.flop_counter counts a GEMM. The name mirrors transformers' operator of the same role
(`transformers.grouped_mm_fallback`, its integrations/moe.py), so graph/operators.py records both
as GEMMs.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

__all__ = ["grouped_mm"]


def _spans(offs: torch.Tensor):
    """(expert, first row, end row) of each expert that has rows; `offs` are the cumulative ends."""
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            yield e, start, end
        start = end


def _loop(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = input.new_zeros(input.shape[0], weight.shape[-1])
    for e, start, end in _spans(offs):
        out[start:end] = input[start:end] @ weight[e]
    return out


@torch.library.custom_op("autoplan::grouped_mm_fallback", mutates_args=())
def _grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _loop(input, weight, offs)


@_grouped_mm.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return input.new_empty(input.shape[0], weight.shape[-1])


@torch.library.custom_op("autoplan::grouped_mm_fallback_backward", mutates_args=())
def _grouped_mm_backward(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
                         offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_input = _loop(grad, weight.transpose(1, 2), offs)
    grad_weight = torch.zeros_like(weight)
    for e, start, end in _spans(offs):
        grad_weight[e] = input[start:end].T @ grad[start:end]
    return grad_input, grad_weight


@_grouped_mm_backward.register_fake
def _(grad, input, weight, offs):
    return input.new_empty(input.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:
    input, weight, offs = inputs
    ctx.save_for_backward(input, weight, offs)


def _backward(ctx, grad):
    input, weight, offs = ctx.saved_tensors
    grad_input, grad_weight = _grouped_mm_backward(grad.contiguous(), input, weight, offs)
    return grad_input, grad_weight, None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.autoplan.grouped_mm_fallback)
def _flops(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """Each row meets one K x M matrix: 2 FLOPs per multiply-add (torch.utils.flop_counter's
    convention)."""
    return 2 * input_shape[0] * input_shape[1] * weight_shape[-1]


@register_flop_formula(torch.ops.autoplan.grouped_mm_fallback_backward)
def _backward_flops(grad_shape, input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _flops(input_shape, weight_shape)  # the input's gradient and the weights'


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of `input` sorted by expert times their expert's matrix of `weight` (E, K, M); `offs`
    holds each expert's end row (int32 or int64 cumulative counts)."""
    return _grouped_mm(input, weight, offs)
