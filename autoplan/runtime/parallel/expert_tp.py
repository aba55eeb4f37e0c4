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

Which axis of each parameter holds the hidden units, and the check that the slices' outputs sum to
the module's, are graph/expert_hidden.py's; a module it cannot read is refused before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from autoplan.graph.expert_hidden import HiddenAxis, slice_hidden

__all__ = ["CopyToExpertTP", "ReduceFromExpertTP", "expert_tp_forward", "split_hidden"]


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
