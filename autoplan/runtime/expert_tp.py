"""Expert tensor parallelism: each expert's hidden units split over the tp ranks of a replica
(`Plan.expert_tp` = tp; plan.py [Note: expert layout]).

[Note: expert tp]
An expert is an MLP, x -> down(act(gate(x)) * up(x)) (or without the gate): its hidden units are
independent until the down projection sums them, so a rank holding 1/etp of every expert's hidden
units (the gate's and up's output columns, the down's input rows) computes a partial output, and
the sum over the etp ranks is the expert's output: Megatron-LM's column-parallel then row-parallel
MLP (Shoeybi et al. 2019, "Megatron-LM", Sec. 3, Fig. 3a), which Megatron-Core applies to experts
with `--expert-tensor-parallel-size` (its TEGroupedMLP / SequentialMLP under the expert-tp group).
Around the experts (both contracts of graph/experts.py) this module puts Megatron's pair of
conjugate operators over the etp group (megatron/core/tensor_parallel/mappings.py): the inputs
(tokens, and a routed call's weights) go through `copy_to` (identity forward, all-reduce of the
gradient backward: each rank's gradient is partial) and the output through `reduce_from`
(all-reduce forward, identity backward). The tp ranks of a replica hold the same tokens (the MoE
input is replicated over tp, routed_experts.py [Note: expert tp 1]), so under etp = tp no token is
split over tp and expert parallelism, if any, exchanges all of a replica's tokens within the ranks of
one tp index.

Which axis of a stacked-experts parameter holds the hidden units is read from the shapes: every
stacked (E, a, b) parameter has the model's width on one axis and the hidden units on the other; a
fused [gate | up] projection has twice the hidden units there (transformers' `gate_up_proj`, chunked
in two by the experts' forward), and its slice is the same 1/etp of each half. A (E, hidden) bias is
sliced with its units; a (E, width) bias, added after the down projection, would be added etp times
and is refused, as is an expert as wide as the model (no axis tells). The shapes alone leave two
readings when gate and up are (E, H, F) and down (E, F, H): H or F could be the width. Each reading
is checked numerically, once per module class and shapes, and the one kept is the one whose etp
slices' outputs sum to the whole module's output on random tokens (`check_hidden_split`). An expert
whose forward mixes its hidden units otherwise (an interleaved fused layout, a norm over the hidden
units) passes no reading and is refused in one line before anything runs, rather than trained wrong.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CopyToExpertTP", "HiddenAxis", "ReduceFromExpertTP", "check_hidden_split", "expert_tp_forward",
           "hidden_axes", "slice_hidden", "split_hidden"]


@dataclass(frozen=True)
class HiddenAxis:
    """Where a stacked-experts parameter holds the experts' hidden units."""

    axis: int
    chunks: int = 1
    """2 for a fused [gate | up] projection: each half is sliced alike."""


def _candidate_axes(module: nn.Module, path: str) -> list[dict[str, HiddenAxis]] | str:
    """Every assignment of hidden axes the shapes allow, one per candidate model width (a size every
    stacked parameter has on one of its axes past the experts'), or a one-line reason there is none."""
    params = dict(module.named_parameters(recurse=False))
    stacks = [p for p in params.values() if p.dim() == 3]
    shapes = ", ".join(f"{name} {tuple(p.shape)}" for name, p in params.items())
    widths = sorted(set.intersection(*(set(p.shape[1:]) for p in stacks))) if stacks else []
    out, reason = [], f"expert tp cannot tell the model width of '{path}' from its parameters ({shapes})"
    for width in widths:
        axes: dict[str, int] = {}
        for name, p in params.items():
            others = [a for a in range(1, p.dim()) if p.shape[a] != width]
            if p.dim() not in (2, 3) or len(others) != 1:
                if p.dim() == 3:
                    reason = (f"expert tp cannot tell which axis of '{path}.{name}' {tuple(p.shape)} holds the "
                              f"experts' hidden units (as many as the model's width, {width})")
                elif p.dim() == 2:
                    reason = (f"'{path}.{name}' {tuple(p.shape)} is a bias added after the experts' down projection, "
                              "which expert tp would add once per rank")
                else:
                    reason = f"expert tp cannot split '{path}.{name}' {tuple(p.shape)}"
                break
            axes[name] = others[0]
        else:
            hidden = min(params[name].shape[a] for name, a in axes.items())
            sizes = {params[name].shape[a] for name, a in axes.items()}
            if sizes <= {hidden, 2 * hidden}:
                out.append({name: HiddenAxis(a, params[name].shape[a] // hidden) for name, a in axes.items()})
            else:
                reason = f"expert tp cannot split '{path}' ({shapes}): hidden sizes {sorted(sizes)}"
    return out or reason


_RESOLVED: dict[tuple, dict[str, HiddenAxis] | str] = {}


def hidden_axes(module: nn.Module, path: str, etp: int, routed: bool) -> dict[str, HiddenAxis] | str:
    """Name -> `HiddenAxis` for every own parameter of the stacked-experts module at `path`: the
    assignment the shapes allow whose etp slices' outputs sum to the module's output
    (`check_hidden_split`), or a one-line reason there is none ([Note: expert tp]). Found once per
    module class and shapes (past the experts' axis, which ep slices)."""
    key = (type(module), etp, routed, tuple((n, tuple(p.shape[1:])) for n, p in module.named_parameters(recurse=False)))
    if key not in _RESOLVED:
        candidates = _candidate_axes(module, path)
        if isinstance(candidates, str):
            _RESOLVED[key] = candidates
        else:
            reasons = [check_hidden_split(module, path, axes, etp, routed) for axes in candidates]
            _RESOLVED[key] = next((axes for axes, why in zip(candidates, reasons) if why is None), reasons[0])
    return _RESOLVED[key]


def slice_hidden(tensor: torch.Tensor, where: HiddenAxis, index: int, etp: int) -> torch.Tensor:
    """Slice `index` of `etp` of the hidden units of `tensor` (of each half of a fused projection)."""
    parts = [part.chunk(etp, where.axis)[index] for part in tensor.chunk(where.chunks, where.axis)]
    return torch.cat(parts, where.axis) if len(parts) > 1 else parts[0]


def split_hidden(module: nn.Module, axes: dict[str, HiddenAxis], index: int, etp: int) -> list[nn.Parameter]:
    """Replace every own parameter of `module` by its slice `index` of `etp` (plain tensors: the tp
    ranks hold different slices, which no DTensor replicated over tp describes)."""
    from torch.distributed.tensor import DTensor

    kept = []
    for name, param in list(module.named_parameters(recurse=False)):
        whole = param.to_local() if isinstance(param, DTensor) else param
        piece = slice_hidden(whole.detach(), axes[name], index, etp).clone()
        replacement = nn.Parameter(piece, requires_grad=param.requires_grad)
        setattr(module, name, replacement)
        kept.append(replacement)
    return kept


_PROBE_EXPERTS = 2
"""Experts in the module the split is checked on: its parameters random, of the module's shapes but
for the experts' axis (the model's own may be on the meta device, or too large to copy)."""


def check_hidden_split(module: nn.Module, path: str, axes: dict[str, HiddenAxis], etp: int, routed: bool) -> str | None:
    """None when the module's output is the sum of its etp hidden slices' outputs on random tokens and
    random parameters of its shapes (in float32 on the CPU, with
    `_PROBE_EXPERTS` experts: a shallow copy whose `num_experts` says so, the contract of
    graph/experts.py, parameters substituted with `torch.func.functional_call`); else a one-line
    reason ([Note: expert tp])."""
    generator = torch.Generator().manual_seed(0)
    named = dict(module.named_parameters(recurse=False))
    params = {name: 0.1 * torch.randn(_PROBE_EXPERTS, *p.shape[1:], generator=generator, dtype=torch.float32)
              for name, p in named.items()}
    buffers = {name: torch.zeros(b.shape, dtype=b.dtype) if b.is_meta else b.detach().cpu()
               for name, b in module.named_buffers(recurse=False)}
    name, where = next((n, a) for n, a in axes.items() if named[n].dim() == 3)
    width = named[name].shape[3 - where.axis]
    probe = copy.copy(module)
    probe.num_experts = _PROBE_EXPERTS
    if routed:
        tokens = torch.randn(4, width, generator=generator, dtype=torch.float32)
        indices = torch.stack([torch.randperm(_PROBE_EXPERTS, generator=generator) for _ in range(4)])
        inputs = (tokens, indices, torch.rand(4, _PROBE_EXPERTS, generator=generator, dtype=torch.float32))
    else:
        inputs = (torch.randn(_PROBE_EXPERTS, 3, width, generator=generator, dtype=torch.float32),)
    try:
        whole = torch.func.functional_call(probe, {**params, **buffers}, inputs)
        summed = sum(torch.func.functional_call(
            probe, {**{n: slice_hidden(p, axes[n], i, etp) for n, p in params.items()}, **buffers}, inputs)
            for i in range(etp))
    except Exception as exc:  # the module's own code on slices: any failure is the refusal's reason
        return f"'{path}' does not run on 1/{etp} of its hidden units ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    # float32 (the experts' kernels may take nothing wider, e.g. grouped_mm): a sum of etp partial
    # products rounds differently, by about 1e-6 of the largest output; a wrong reading is off by O(1).
    if not torch.allclose(summed, whole, rtol=1e-3, atol=1e-4 * float(whole.abs().max())):
        return (f"the outputs of '{path}' on 1/{etp} of its hidden units do not sum to its output (its forward mixes "
                "hidden units, or a fused projection is not [gate | up])")
    return None


class CopyToExpertTP(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over the expert-tp group backward (Megatron-LM's
    `_CopyToModelParallelRegion`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromExpertTP(torch.autograd.Function):
    """All-reduce over the expert-tp group forward; identity backward (Megatron-LM's
    `_ReduceFromModelParallelRegion`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def expert_tp_forward(inner: Callable, group: dist.ProcessGroup) -> Callable:
    """The forward of an experts module holding 1/etp of every expert's hidden units: the float
    inputs (a routed call's tokens and weights; a grouped call's token groups) copied to the etp
    group, the output summed over it ([Note: expert tp]). A stage of an inlined graph under tp
    computes in DTensor: whole tensors in, a replicated DTensor out."""

    def forward(*args: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        mesh = next((a.device_mesh for a in args if isinstance(a, DTensor)), None)
        if mesh is not None:
            args = tuple(a.full_tensor() if isinstance(a, DTensor) else a for a in args)
        args = tuple(CopyToExpertTP.apply(a, group) if a.is_floating_point() else a for a in args)
        out = ReduceFromExpertTP.apply(inner(*args), group)
        if mesh is not None:
            out = DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return out

    return forward
