"""Expert parallelism for routed experts (graph/experts.py: forward(tokens (T, H), expert indices
(T, k), weights (T, k)) -> (T, H)): dropless all-to-all dispatch with variable split sizes, and
expert tensor parallelism 1 under attention tp. Apart from runtime/parallel/experts.py (the step, and the
equal exchange of grouped experts) because it is the token exchange of one call, not a layout.

[Note: dropless dispatch]
Each rank of an ep group keeps experts [i * E/ep, (i + 1) * E/ep) of its ep index i. Around a call:
- the T * k (token, expert) copies are sorted by expert (a stable sort keeps token order inside an
  expert), and the per-expert counts are exchanged first with one all-to-all of E integers, so each
  rank knows how many rows it receives from every other;
- the rows go to the rank holding their expert with `all_to_all_single` of variable split sizes;
  the receiver runs its local experts on them with local indices (row j of source r belongs to
  local expert e for the counts r sent), weight 1;
- the inverse all-to-all returns every row to its origin, which puts it back in (token, k) order
  and sums each token's k rows with the router's weights.
This is torchtitan's `ExpertParallel` (torchtitan/distributed/expert_parallel.py: `_token_dispatch`
exchanges `num_tokens_per_expert` with `all_to_all_single` before the tokens, `_token_combine`
returns them) and Megatron-LM's `MoEAlltoAllTokenDispatcher`
(megatron/core/transformer/moe/token_dispatcher.py: `preprocess` computes the input and output
splits, `token_permutation` / `token_unpermutation`). torch's autograd all-to-all with split sizes
(`_functional_collectives.all_to_all_single_autograd`) runs the inverse exchange in backward, so
the router's weights and the tokens get their gradients through the same two exchanges. No token
is dropped: every copy reaches its expert whatever the load (torchtitan's and Megatron-LM's default).

[Note: expert tp 1]
Under attention tp > 1 the MoE input is the whole hidden state on every tp rank (replicated). With
expert tp 1 (Plan.expert_tp) each tp rank keeps whole experts and sends only rows
[t * T/tp, (t + 1) * T/tp) of the tokens to them, then all-gathers the outputs over tp: Megatron-LM's
layout with `--expert-tensor-parallel-size 1` (megatron/core/transformer/moe/moe_layer.py and
token_dispatcher.py: the tokens are split over the tp ranks before the expert all-to-all and
gathered after it). The split is Megatron's scatter-to-sequence-parallel-region pair: forward takes
this rank's rows, backward all-gathers their gradients; the gather's backward takes this rank's
rows, so the replicated activations keep gradients equal on every tp rank. The experts of a tp rank
see only its rows, so their gradients are summed over tp before the mean over dp
(runtime/parallel/experts.py: `reduce_expert_grads` over `ParallelLayout.expert_dp_group`, the ranks holding
the same experts, plan.py [Note: expert layout]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GatherRows", "RoutedDispatch", "TakeRows", "exchange"]


def exchange(x: torch.Tensor, group: dist.ProcessGroup, output_splits: list[int] | None = None,
             input_splits: list[int] | None = None) -> torch.Tensor:
    """All-to-all along dim 0 (equal parts without split sizes), with autograd: the backward is the
    inverse exchange."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group))


class TakeRows(torch.autograd.Function):
    """This tp rank's part along `dim` of a replicated tensor; backward all-gathers the parts'
    gradients (Megatron-LM's `_ScatterToSequenceParallelRegion`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, index: int, size: int, dim: int = 0) -> torch.Tensor:
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return x.chunk(size, dim)[index].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group, ctx.size, ctx.dim), None, None, None, None


class GatherRows(torch.autograd.Function):
    """Every tp rank's part along `dim`, concatenated; backward takes this rank's part of the
    (equal) gradient (Megatron-LM's `_GatherFromSequenceParallelRegion` without the output-grad
    reduction)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, index: int, size: int, dim: int = 0) -> torch.Tensor:
        ctx.index, ctx.size, ctx.dim = index, size, dim
        return _all_gather(x, group, size, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size, ctx.dim)[ctx.index].contiguous(), None, None, None, None


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, size: int, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


@contextlib.contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters (an inlined graph's stage under tp computes in DTensor,
    tensor_parallel_graph.py) as their local tensors while it runs: whole experts on each tp rank,
    whose gradients flow back to the DTensors as they are."""
    from torch.distributed.tensor import DTensor

    swapped = {}
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if isinstance(p, DTensor):
                swapped[(owner, name)] = p
                owner._parameters[name] = p.to_local()
    try:
        yield
    finally:
        for (owner, name), p in swapped.items():
            owner._parameters[name] = p


class RoutedDispatch:
    """The forward of a routed-experts module holding this rank's E/ep experts: [Note: dropless
    dispatch] around `inner` (the module's own forward), with [Note: expert tp 1] under tp."""

    def __init__(self, module: nn.Module, inner: Callable, num_experts: int, ep: int, group: dist.ProcessGroup,
                 tp: int = 1, tp_group: dist.ProcessGroup | None = None, tp_index: int = 0, path: str = ""):
        self.module, self.inner, self.num_experts, self.ep, self.group = module, inner, num_experts, ep, group
        self.tp, self.tp_group, self.tp_index, self.path = tp, tp_group, tp_index, path

    def __call__(self, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        mesh = tokens.device_mesh if isinstance(tokens, DTensor) else None
        if mesh is not None:  # a stage of an inlined graph under tp: whole tensors in (a row-parallel
            # linear's output may still be partial sums), Replicate out
            tokens, indices, weights = (x.full_tensor() if isinstance(x, DTensor) else x for x in (tokens, indices, weights))
        if self.tp > 1:
            if tokens.shape[0] % self.tp:
                raise RuntimeError(f"expert parallelism: tp {self.tp} does not divide the {tokens.shape[0]} tokens "
                                   f"reaching '{self.path}'; re-plan with a micro-batch whose tokens tp divides")
            take = (self.tp_group, self.tp_index, self.tp)
            tokens, weights = TakeRows.apply(tokens, *take), TakeRows.apply(weights, *take)
            indices = indices.chunk(self.tp)[self.tp_index]
        with _local_parameters(self.module):
            out = self._dispatch_and_combine(tokens, indices, weights)
        if self.tp > 1:
            out = GatherRows.apply(out, self.tp_group, self.tp_index, self.tp)
        if mesh is not None:
            out = DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return out

    def _dispatch_and_combine(self, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        num_tokens, k = indices.shape
        local = self.num_experts // self.ep
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, k) copies grouped by expert
        rows = tokens.index_select(0, order // k)
        counts = torch.bincount(flat, minlength=self.num_experts)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)  # E/ep counts from each rank
        # rows to and from each rank, read to the host in one sync
        sent, received = torch.stack([counts, received_counts]).view(2, self.ep, local).sum(2).tolist()
        mine = exchange(rows, self.group, received, sent)
        expert_ids = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(self.ep), received_counts)
        if mine.shape[0]:
            done = self.inner(mine, expert_ids.unsqueeze(1), torch.ones(mine.shape[0], 1, dtype=weights.dtype,
                                                                        device=weights.device))
        else:  # no rows for this rank's experts: an empty result that still carries the backward exchange
            done = mine * 0
        back = exchange(done, self.group, sent, received)
        ordered = back.index_select(0, torch.argsort(order))  # back in (token, k) order
        return (ordered.view(num_tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1).to(tokens.dtype)
