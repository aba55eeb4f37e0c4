"""Expert parallelism: the experts of each mixture-of-experts layer split over ep data-parallel
replicas, tokens sent to them and back by all-to-all.

A grouped-experts module (graph/experts.py: stacked expert weights with the expert first, taking
tokens grouped by expert, (num_experts, tokens, ...)) keeps on each rank of an ep group the
experts [i * E/ep, (i + 1) * E/ep) of its ep index i. Around its forward:

- dispatch (a forward pre-hook): the (E, n, ...) token groups are split along the expert dimension
  into ep equal parts, part j to rank j (`all_to_all_single`, one call, equal splits because the
  zoo's dispatch gives every expert the same capacity, [Note: static dispatch] in models/moe.py);
  rank i receives, from each of the ep ranks, the tokens for its own E/ep experts and runs them as
  (E/ep, ep * n, ...);
- combine (a forward hook): the inverse all-to-all returns each token group to the rank it came
  from, which continues with (E, n, ...) as if it held every expert.

This is the layout of GShard (Lepikhin et al. 2020, arXiv:2006.16668, Sec. 3.2) and of
torchtitan's `ExpertParallel` style (torchtitan/distributed/expert_parallel.py), with equal splits
in place of torchtitan's token-count exchange. torch's autograd all-to-all
(`torch.distributed.nn.functional.all_to_all_single`) carries gradients back the same way.

Gradients: a rank's expert weights see the tokens of every rank of its ep group, so after
backward they hold the sum over that group of the per-replica gradients; `reduce_expert_grads`
sums them over the replicas holding the same experts (the expert-data-parallel group) and divides
by dp, which gives the mean over all dp replicas, as the dp all-reduce gives the other parameters.
The ep group is ep consecutive dp replicas (inside a node when tp * ep GPUs fit one).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from autoplan.graph.experts import expert_modules
from autoplan.runtime.data_parallel import all_reduce_grads
from autoplan.runtime.errors import PartitionError

if TYPE_CHECKING:
    from autoplan.graph.trace import TracedModel
    from autoplan.plan import Plan
    from autoplan.runtime.mesh import ParallelLayout
    from autoplan.runtime.split import StageBuild

__all__ = ["apply_expert_parallel", "reduce_expert_grads", "refuse_expert_parallel", "shard_experts"]


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-to-all of equal parts along dim 0, with autograd (the backward is the inverse exchange)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


def _dispatch(group: dist.ProcessGroup, ep: int, num_experts: int, path: str, module: nn.Module, args: tuple):
    tokens = args[0] if args else None
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2 or tokens.shape[0] != num_experts:
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise RuntimeError(f"expert parallelism: '{path}' must take tokens grouped by expert, shape "
                           f"({num_experts}, tokens, ...), got {got}; plan this model with --ep 1")
    local = num_experts // ep
    received = _exchange(tokens, group)  # (ep * local, n, ...): part j came from rank j
    rest = tuple(received.shape[1:])
    mine = received.reshape(ep, local, *rest).transpose(0, 1).reshape(local, ep * rest[0], *rest[1:])
    return (mine, *args[1:])


def _combine(group: dist.ProcessGroup, ep: int, num_experts: int, module: nn.Module, args: tuple,
             output: torch.Tensor) -> torch.Tensor:
    local = num_experts // ep
    rest = tuple(output.shape[2:])
    parts = output.reshape(local, ep, -1, *rest).transpose(0, 1).reshape(num_experts, -1, *rest)
    return _exchange(parts, group)  # (E, n, ...): this rank's tokens, back from every expert


def shard_experts(modules: Iterable[nn.Module], group: dist.ProcessGroup, ep_index: int, ep: int) -> list[nn.Parameter]:
    """Keep this rank's 1/ep of the experts of every grouped-experts module in `modules` (whole,
    initialized parameters; the slices replace them) and exchange tokens around their forward.
    Returns the new expert parameters (for `reduce_expert_grads`)."""
    kept: list[nn.Parameter] = []
    for module in modules:
        for path, experts in expert_modules(module).items():
            count = experts.num_experts
            if count % ep:
                raise ValueError(f"expert parallelism: ep {ep} does not divide the {count} experts of '{path}'; "
                                 "re-plan with an ep that divides them")
            local = count // ep
            for name, param in list(experts.named_parameters(recurse=False)):
                piece = param.detach()[ep_index * local:(ep_index + 1) * local].clone()
                replacement = nn.Parameter(piece, requires_grad=param.requires_grad)
                setattr(experts, name, replacement)
                kept.append(replacement)
            experts.register_forward_pre_hook(functools.partial(_dispatch, group, ep, count, path))
            experts.register_forward_hook(functools.partial(_combine, group, ep, count))
    return kept


def reduce_expert_grads(params: Iterable[nn.Parameter], expert_dp_group: dist.ProcessGroup | None, dp: int) -> None:
    """Mean over all dp replicas of the expert gradients (see the module docstring)."""
    params = list(params)
    if expert_dp_group is not None:
        all_reduce_grads(params, expert_dp_group, average=False)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.div_(dp)


def refuse_expert_parallel(traced: TracedModel, plan: Plan) -> None:
    """Refuse (one line, before any process group) an ep > 1 plan for a model without grouped experts."""
    if plan.ep > 1 and not expert_modules(traced.gm):
        raise PartitionError(f"the plan has ep {plan.ep} but the model has no grouped experts (graph/experts.py) to "
                             "split; re-plan it with `autoplan suggest` (ep 1)")


def apply_expert_parallel(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The expert-parallel step (ep > 1): each rank keeps its 1/ep of the experts (`shard_experts`).
    The grouped-experts modules are found before slicing: a slice no longer has num_experts experts
    (graph/experts.py); FSDP shards them apart (fsdp.py)."""
    if plan.ep == 1:
        return
    build.experts_of = {i: list(expert_modules(module).values()) for i, module in build.modules.items()}
    build.expert_params = shard_experts(list(build.modules.values()), layout.ep_group, layout.ep_index, plan.ep)
