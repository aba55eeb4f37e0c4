"""Tracing a source's model with its loss appended: the graph the profiler and the runtime share.

Apart from the sources because it reaches into graph analysis (graph/trace.py, graph/profile.py),
which the sources otherwise do not need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from autoplan.sources.base import first_tensor

__all__ = ["OutputTemplate", "trace_with_target"]



@dataclass(frozen=True)
class OutputTemplate:
    """Shape (at the traced batch) and dtype of the tensor the loss's target follows (the logits)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def trace_with_target(module: nn.Module, inputs: Sequence[Any], loss_fn: Callable[..., Tensor], *,
                      target_maker: Callable[[OutputTemplate, int], Tensor], example_target: Tensor | None = None,
                      leaf_modules: Sequence[str] = (), tracer: str = "auto"):
    """Trace `module` on `inputs` and append `loss_fn(output, target)`; returns (traced, graph inputs,
    output template). Without `example_target` the target is made by `target_maker(template,
    batch rows)` from the output's shape, found by one fake-tensor forward of the traced graph;
    with one, the template is None."""
    from autoplan.graph.profile import fake_output
    from autoplan.graph.trace import append_loss, trace_model

    traced = trace_model(module, inputs, leaf_modules=leaf_modules, tracer=tracer)
    template = None  # with a target given, no forward is needed (a cached profile runs none)
    if example_target is None:
        logits = first_tensor(fake_output(traced, inputs))
        template = OutputTemplate(tuple(int(d) for d in logits.shape), logits.dtype)
        rows = next((t.shape[0] for t in inputs if isinstance(t, Tensor) and t.dim() > 0), 1)
        example_target = target_maker(template, rows)
    traced = append_loss(traced, loss_fn)
    return traced, [*inputs, example_target], template
