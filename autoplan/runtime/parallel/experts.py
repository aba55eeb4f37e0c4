"""Expert parallelism: the experts of each mixture-of-experts layer split over ep ranks of tp x dp
(plan.py [Note: expert layout]), tokens sent to them and back by all-to-all. Both expert contracts
of graph/experts.py:

- grouped experts (stacked expert weights with the expert first, taking tokens grouped by expert,
  (num_experts, tokens, ...)) keep on each rank of an ep group the experts [i * E/ep, (i + 1) * E/ep)
  of its ep index i. Around their forward: dispatch (a forward pre-hook) splits the (E, n, ...)
  token groups along the expert dimension into ep equal parts, part j to rank j
  (`all_to_all_single`, one call, equal splits because the zoo's capacity routing gives every
  expert the same capacity, [Note: static dispatch] in models/moe.py); rank i receives, from each of
  the ep ranks, the tokens for its own E/ep experts and runs them as (E/ep, ep * n, ...); combine (a
  forward hook) returns each token group to the rank it came from, which continues with
  (E, n, ...) as if it held every expert. GShard's layout (Lepikhin et al. 2020, arXiv:2006.16668,
  Sec. 3.2) and torchtitan's `ExpertParallel` style with equal splits.
- routed experts (forward(tokens, expert indices, weights): transformers' Mixtral, Qwen2/3-MoE,
  DeepSeek-V3 experts, the zoo's dropless routing) keep the same slice and exchange each
  (token, expert) copy in variable numbers ([Note: dropless dispatch] in routed_experts.py). Where
  the traced graph inlines the module (torch.export), its nodes are replaced by one call of the
  module, rebuilt from the model's own class (`StageBuild.model`) over the stage's parameters.

Under attention tp > 1 each tp rank sends 1/tp of the tokens to the experts and gathers the
outputs over tp ([Note: expert tp 1] in routed_experts.py), for both contracts.

Gradients: a rank's expert weights see the tokens of every rank of its ep group (and, under tp, only
its tp rank's share of them), so after backward they hold the sum over that group of the
per-replica gradients; `reduce_expert_grads` sums them over the ranks holding the same experts
(`ParallelLayout.expert_dp_group`, Megatron-Core's expert-data-parallel group) and divides by dp,
which gives the mean over all dp replicas, as the dp all-reduce gives the other parameters. The groups are the plan's expert layout (plan.py [Note: expert layout]): ep
consecutive positions over tp x dp (Megatron-Core's MoE parallel folding), so the all-to-all stays
inside a node when ep GPUs fit one.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autoplan.graph.expert_hidden import hidden_axes, hidden_split_refusal
from autoplan.graph.experts import (
    InlinedCall,
    expert_modules,
    inlined_call,
    is_routed_experts,
    routed_expert_modules,
)
from autoplan.runtime.parallel.data_parallel import all_reduce_grads
from autoplan.runtime.parallel.errors import PartitionError
from autoplan.runtime.parallel.expert_tp import expert_tp_forward, split_hidden
from autoplan.runtime.parallel.routed_experts import GatherRows, RoutedDispatch, TakeRows, exchange

if TYPE_CHECKING:
    from autoplan.graph.trace import TracedModel
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["apply_expert_parallel", "reduce_expert_grads", "refuse_expert_parallel", "refuse_expert_tp", "shard_experts"]


def _dispatch(group: dist.ProcessGroup, ep: int, num_experts: int, path: str, tp: tuple, module: nn.Module,
              args: tuple):
    tokens = args[0] if args else None
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2 or tokens.shape[0] != num_experts:
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise RuntimeError(f"expert parallelism: '{path}' must take tokens grouped by expert, shape "
                           f"({num_experts}, tokens, ...), got {got}; plan this model with --ep 1")
    if tp:  # this tp rank's share of every expert's tokens ([Note: expert tp 1] in routed_experts.py)
        tp_group, tp_index, size = tp
        if tokens.shape[1] % size:
            raise RuntimeError(f"expert parallelism: tp {size} does not divide the {tokens.shape[1]} token slots of "
                               f"each expert of '{path}'; re-plan with another micro-batch size or tp")
        tokens = TakeRows.apply(tokens, tp_group, tp_index, size, 1)
    local = num_experts // ep
    received = exchange(tokens, group)  # (ep * local, n, ...): part j came from rank j
    rest = tuple(received.shape[1:])
    mine = received.reshape(ep, local, *rest).transpose(0, 1).reshape(local, ep * rest[0], *rest[1:])
    return (mine, *args[1:])


def _combine(group: dist.ProcessGroup, ep: int, num_experts: int, tp: tuple, module: nn.Module, args: tuple,
             output: torch.Tensor) -> torch.Tensor:
    local = num_experts // ep
    rest = tuple(output.shape[2:])
    parts = output.reshape(local, ep, -1, *rest).transpose(0, 1).reshape(num_experts, -1, *rest)
    back = exchange(parts, group)  # (E, n, ...): this rank's tokens, back from every expert
    return GatherRows.apply(back, tp[0], tp[1], tp[2], 1) if tp else back


def _slice_parameters(module: nn.Module, ep_index: int, local: int, per_tp_rank: bool = False) -> list[nn.Parameter]:
    """Replace every own parameter of `module` by its experts [ep_index * local, (ep_index + 1) *
    local) (a DTensor's, of an inlined graph's stage under tp, as a DTensor of the same placement;
    as a plain tensor when `per_tp_rank`: the tp ranks hold different experts, which no DTensor
    replicated over tp describes, and FSDP shards them over a mesh of their own, fsdp.py)."""
    from torch.distributed.tensor import DTensor

    kept = []
    for name, param in list(module.named_parameters(recurse=False)):
        if isinstance(param, DTensor) and not per_tp_rank:
            piece = param.to_local().detach()[ep_index * local:(ep_index + 1) * local].clone()
            piece = DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False)
        else:
            whole = param.to_local() if isinstance(param, DTensor) else param
            piece = whole.detach()[ep_index * local:(ep_index + 1) * local].clone()
        replacement = nn.Parameter(piece, requires_grad=param.requires_grad)
        setattr(module, name, replacement)
        kept.append(replacement)
    return kept


def _check_divides(count: int, ep: int, path: str) -> None:
    if count % ep:
        raise ValueError(f"expert parallelism: ep {ep} does not divide the {count} experts of '{path}'; "
                         "re-plan with an ep that divides them")


def _split_hidden_units(module: nn.Module, path: str, etp: tuple, routed: bool) -> list[nn.Parameter]:
    """Keep this rank's 1/etp of the hidden units of every expert of `module` and sum the outputs
    over the expert-tp group ([Note: expert tp] in expert_tp.py); `etp` = (group, index, size)."""
    group, index, size = etp
    axes = hidden_axes(module, path, size, routed)
    if isinstance(axes, str):
        raise PartitionError(f"{axes}; re-plan with --expert-tp 1")
    kept = split_hidden(module, axes, index, size)
    module.forward = expert_tp_forward(module.forward, group)
    module.expert_hidden_axes = axes  # read back by `apply_expert_parallel` for checkpoints
    return kept


def shard_experts(modules: Iterable[nn.Module], group: dist.ProcessGroup | None, ep_index: int, ep: int,
                  tp: tuple = (), etp: tuple = ()) -> list[nn.Parameter]:
    """Keep this rank's 1/ep of the experts of every grouped-experts module in `modules` (whole,
    initialized parameters; the slices replace them) and exchange tokens around their forward;
    `tp` = (tp group, tp index, tp) splits the tokens over tp first ([Note: expert tp 1]); `etp` =
    (expert-tp group, index, expert tp) keeps 1/etp of each expert's hidden units (expert_tp.py).
    Returns the new expert parameters (for `reduce_expert_grads`)."""
    kept: list[nn.Parameter] = []
    for module in modules:
        for path, experts in expert_modules(module).items():
            count = experts.num_experts
            if ep > 1:
                _check_divides(count, ep, path)
                _slice_parameters(experts, ep_index, count // ep, per_tp_rank=bool(tp) or bool(etp))
                experts.register_forward_pre_hook(functools.partial(_dispatch, group, ep, count, path, tp))
                experts.register_forward_hook(functools.partial(_combine, group, ep, count, tp))
            if etp:
                _split_hidden_units(experts, path, etp, routed=False)
            kept += list(experts.parameters(recurse=False))
    return kept


class _ModuleCall:
    """A graph node's target that calls a module: the routed experts an inlined graph calls again
    (`_call_as_module`). A function node, not `call_module`: FSDP makes every module a graph calls
    whole a unit over dp (fsdp.py `unit_paths`), where the experts are units over their own replicas."""

    def __init__(self, module: nn.Module, path: str):
        self.module = module
        self.__name__ = "experts_" + path.replace(".", "_")

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.module(*args)


def _call_as_module(gm: fx.GraphModule, path: str, call: InlinedCall) -> None:
    """Replace the inlined nodes of a routed-experts call by one call of the module at `path`
    (named as the call's output was, so what refers to it by name still finds it)."""
    graph = gm.graph
    name = call.output.name
    with graph.inserting_after(call.output):
        node = graph.call_function(_ModuleCall(gm.get_submodule(path), path), (call.tokens, call.indices, call.weights))
    node.meta = dict(call.output.meta)
    call.output.replace_all_uses_with(node)
    for old in reversed(call.nodes):
        graph.erase_node(old)
    for old in [n for n in graph.nodes if n.op == "get_attr" and str(n.target).startswith(path + ".") and not n.users]:
        graph.erase_node(old)
    node._rename(name)
    graph.lint()
    gm.recompile()


def _routed_module(stage: nn.Module, path: str, model: nn.Module | None) -> nn.Module:
    """The routed-experts module at `path` of `stage`, as a module of its own class: the stage's
    own where it kept it (a graph that calls it), else the model's class (copied) over the stage's
    parameters and buffers, put at `path` (a graph traced by torch.export keeps only its tensors)."""
    held = stage.get_submodule(path)
    if is_routed_experts(held):
        return held
    if model is None:
        raise PartitionError(f"expert parallelism: the stage inlines the experts '{path}' and the model's modules are "
                             "not at hand to run them; partition a model source or module")
    module = copy.deepcopy(model.get_submodule(path))
    for name, tensor in [*held.named_parameters(), *held.named_buffers()]:
        owner, _, leaf = name.rpartition(".")
        target = module.get_submodule(owner)
        (target._parameters if isinstance(tensor, nn.Parameter) else target._buffers)[leaf] = tensor
    parent, _, leaf = path.rpartition(".")
    setattr(stage.get_submodule(parent), leaf, module)
    return module


def shard_routed_experts(stage: nn.Module, model: nn.Module | None, group: dist.ProcessGroup | None, ep_index: int,
                         ep: int, tp: tuple = (), etp: tuple = ()) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """Keep this rank's 1/ep of the experts of every routed-experts module `stage` runs (graph/
    experts.py; found on the model, as the stage may have inlined them) and run them through
    `RoutedDispatch` (ep > 1), with 1/etp of each expert's hidden units under `etp` (as
    `shard_experts`). Returns the modules and their new parameters."""
    found = routed_expert_modules(model if model is not None else stage)
    modules, kept = [], []
    for path, original in found.items():
        try:
            stage.get_submodule(path)
        except AttributeError:
            continue  # on another stage
        count = original.num_experts
        _check_divides(count, ep, path)
        call = inlined_call(stage, path) if isinstance(stage, fx.GraphModule) else None
        module = _routed_module(stage, path, model)
        if isinstance(call, InlinedCall):
            _call_as_module(stage, path, call)
        if ep > 1:
            _slice_parameters(module, ep_index, count // ep, per_tp_rank=bool(tp) or bool(etp))
            module.num_experts = count // ep  # the local experts, indexed 0 .. E/ep - 1
            tp_group, tp_index, size = tp or (None, 0, 1)
            module.forward = RoutedDispatch(module, module.forward, count, ep, group, tp=size, tp_group=tp_group,
                                            tp_index=tp_index, path=path)
        if etp:
            _split_hidden_units(module, path, etp, routed=True)
        kept += list(module.parameters(recurse=False))
        modules.append(module)
    return modules, kept


def reduce_expert_grads(params: Iterable[nn.Parameter], expert_dp_group: dist.ProcessGroup | None, dp: int) -> None:
    """Mean over all dp replicas of the expert gradients (see the module docstring)."""
    params = list(params)
    if expert_dp_group is not None:
        all_reduce_grads(params, expert_dp_group, average=False)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.div_(dp)


def refuse_expert_parallel(model: nn.Module, traced: TracedModel, plan: Plan) -> None:
    """Refuse (one line, before any process group) an ep > 1 plan for a model without experts of
    either contract (graph/experts.py), or whose routed experts the traced graph does not call as
    one call of (tokens, expert indices, weights)."""
    if plan.ep == 1 and getattr(plan, "expert_tp", 1) == 1:
        return
    routed = routed_expert_modules(model)
    grouped = expert_modules(traced.gm)
    what = f"ep {plan.ep}" if plan.ep > 1 else f"expert tp {plan.expert_tp}"
    if not grouped and not routed:
        raise PartitionError(f"the plan has {what} but the model has no experts (graph/experts.py: grouped, or "
                             "routed by (tokens, expert indices, weights)) to split; re-plan it with `autoplan "
                             "suggest`")
    refuse_expert_tp(model, plan, grouped)
    for path, module in routed.items():
        call = inlined_call(traced.gm, path)
        if isinstance(call, str):
            raise PartitionError(f"the plan has {what} but {call}; re-plan it with `autoplan suggest` "
                                 f"({'ep 1' if plan.ep > 1 else 'expert tp 1'})")
        if module.num_experts % plan.ep:
            raise PartitionError(f"the plan has ep {plan.ep}, which does not divide the {module.num_experts} experts "
                                 f"of '{path}'; re-plan it with `autoplan suggest`")


def refuse_expert_tp(model: nn.Module, plan: Plan, grouped: dict[str, nn.Module] | None = None) -> None:
    """Refuse (one line, before any process is spawned: `autoplan run` checks it on the model built on
    the meta device) expert tp where the experts' hidden units cannot be split (graph/expert_hidden.py
    `hidden_split_refusal`). `grouped`: the grouped-experts modules of the traced graph, else the
    model's."""
    etp = getattr(plan, "expert_tp", 1)
    if etp == 1:
        return
    reason = hidden_split_refusal(model, etp, grouped)
    if reason is not None:
        raise PartitionError(f"the plan has expert tp {etp} but {reason}; re-plan with --expert-tp 1")


def apply_expert_parallel(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The expert-parallel step (ep > 1): each rank keeps its 1/ep of the experts of both contracts
    (`shard_experts`, `shard_routed_experts`). The grouped-experts modules are found before slicing:
    a slice no longer has num_experts experts (graph/experts.py); FSDP shards them apart (fsdp.py).
    Under tp with expert tp 1 (`Plan.expert_tp`) each tp rank sends its 1/tp of the tokens
    ([Note: expert tp 1] in routed_experts.py) over an ep group folded over tp x dp (plan.py [Note:
    expert layout]), so the tp ranks of a replica hold different experts: their slices are plain
    tensors, not DTensors replicated over tp (`_slice_parameters`). Under expert tp = tp each tp rank
    keeps 1/tp of every expert's hidden units instead, over an ep group of replicas at its tp index
    (expert_tp.py [Note: expert tp]); with ep 1 it is the only split."""
    if plan.ep == 1 and plan.expert_tp == 1:
        return
    tp = (layout.tp_mesh.get_group(), layout.tp_index, plan.tp) if plan.expert_token_split > 1 else ()
    # expert tp is 1 or the attention's tp (plan.py [Note: expert layout]): its group is the tp group
    etp = (layout.tp_mesh.get_group(), layout.tp_index, plan.expert_tp) if plan.expert_tp > 1 else ()
    model = build.model
    build.experts_of = {i: list(expert_modules(module).values()) for i, module in build.modules.items()}
    build.expert_params = shard_experts(list(build.modules.values()), layout.ep_group, layout.ep_index, plan.ep, tp,
                                        etp)
    for i, stage in build.modules.items():
        modules, params = shard_routed_experts(stage, model, layout.ep_group, layout.ep_index, plan.ep, tp, etp)
        build.expert_hidden.update({f"{path}.{name}": where for path, module in stage.named_modules()
                                    for name, where in getattr(module, "expert_hidden_axes", {}).items()})
        build.experts_of[i] += modules
        build.expert_params += params
