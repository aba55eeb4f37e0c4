"""Auxiliary losses computed inside a model (a mixture-of-experts router's load-balancing loss).

A pipeline stage computes its own layers' auxiliary losses, but only the last stage holds the
training loss, so an auxiliary loss cannot simply be added to it. `attach_aux_loss(output, aux)`
returns `output` unchanged and, in backward, gives `aux` the gradient it would have had if it had
been added to the loss (Megatron-LM's `MoEAuxLossAutoScaler`, megatron/core/transformer/moe/
moe_utils.py): the loss's own scale. The pipeline executor divides each micro-batch's loss by the
number of micro-batches and says so with `aux_loss_scale(1 / num_microbatches)` around its backward
passes; a plain `loss.backward()` outside any executor uses scale 1, so a single-process run and a
pipelined run of the same model get the same gradients.

Any model can call `attach_aux_loss` (it is re-exported as `autoplan.attach_aux_loss`); nothing in
the runtime knows which models do. To report the loss with its auxiliary terms, the runtime sums
what `recording_aux_losses` collects: each auxiliary loss times its scale, taken in backward (which
runs once per forward, with or without recomputation, where a recomputed forward runs twice).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator

import torch

__all__ = ["attach_aux_loss", "aux_loss_scale", "recording_aux_losses"]

# Process-wide, not thread-local: on CUDA the autograd engine runs backward passes, and the
# forwards that recomputation replays inside them, on its own device threads, which must see
# the scale and the record the step set (each rank is its own process).
_state = types.SimpleNamespace()


def _current_scale() -> float:
    return getattr(_state, "scale", 1.0)


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Backward passes inside this block scale auxiliary losses' gradients by `scale` (the factor
    the training loss was multiplied by before its backward)."""
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"aux_loss_scale: scale must be a finite number (the training loss's factor), got {scale!r}")
    previous = _current_scale()
    _state.scale = float(scale)
    try:
        yield
    finally:
        _state.scale = previous


@contextlib.contextmanager
def recording_aux_losses() -> Iterator[list[torch.Tensor]]:
    """Collect, into the yielded list, every auxiliary loss whose backward runs inside the block,
    times its scale (so their sum is what they added to the scaled training loss)."""
    previous = getattr(_state, "recorded", None)
    _state.recorded = recorded = []
    try:
        yield recorded
    finally:
        _state.recorded = previous


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors
        scale = _current_scale()
        recorded = getattr(_state, "recorded", None)
        if recorded is not None:
            recorded.append(aux.detach().float() * scale)
        return grad_output, torch.full_like(aux, scale)


def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`output`, with the scalar `aux` added to the training loss as far as gradients go."""
    # Type and rank checks only: they hold for the fake and functional tensors of torch.export, and an
    # fx Proxy (symbolic tracing through this call) is let through as before.
    for name, value in (("output", output), ("aux", aux)):
        if not isinstance(value, torch.Tensor | torch.fx.Proxy):
            raise TypeError(f"attach_aux_loss: {name} must be a torch.Tensor, got {type(value).__name__}; "
                            "pass the layer's output tensor and its auxiliary loss as a scalar tensor")
    if isinstance(aux, torch.Tensor) and aux.dim() != 0:
        raise ValueError(f"attach_aux_loss: aux must be a scalar (0-dim) tensor, got shape {list(aux.shape)}; "
                        "reduce it first (.sum() or .mean())")
    if not (torch.is_grad_enabled() and aux.requires_grad):
        return output
    return _AttachAuxLoss.apply(output, aux)
