"""Sharded data parallelism for the pipeline's stages: torch's FSDP2 (`fully_shard`) for zero 2 and 3.

[Note: FSDP under the pipeline executor]
A plan with zero >= 2 runs its data parallelism with FSDP2 (Zhao et al. 2023, "PyTorch FSDP",
VLDB; the per-parameter DTensor sharding of `torch.distributed.fsdp.fully_shard`), as torchtitan
does, over the plan's mesh (mesh.py `ParallelLayout.fsdp_mesh`: the "dp_shard" axis, or
("dp_replicate", "dp_shard") for HSDP, where FSDP shards inside a group and all-reduces the shards
across groups). Composed with tensor parallelism, a tp-sharded parameter becomes a 2-D DTensor.

- Units: every module the stage's graph calls whole and that owns parameters (the blocks of an
  fx-traced model: embedding, each transformer layer, norm, head) is its own unit, so only the
  unit computing (and the prefetched next one) is gathered under ZeRO-3. What is left (the
  parameters a graph traced by torch.export reads directly, or modules that share a parameter with
  another module: a tied embedding and head) belongs to the stage's root unit, a `ShardedStage`
  wrapped around the stage's runner so that FSDP's hooks fire however the stage is run (whole,
  block by block under recomputation, or in DTensor).
- zero 3 reshards each unit after its forward (`reshard_after_forward=True`, gathered again for the
  backward); zero 2 keeps the gathered parameters from forward to backward (`False`). Between steps
  each rank holds 1/dp_shard of every parameter, its gradient and its optimizer state.
- Gradients: with one pipeline stage per rank and no pipelining (pp = 1), FSDP reduce-scatters
  each unit's gradient at the end of every micro-batch's backward (its autograd hooks). With pp > 1
  the executor's micro-batches interleave, so a stage's gradients accumulate unsharded (in the
  reduce dtype) and are reduce-scattered once, right after that stage's last backward of the step
  (`finish_step` on its root, called by the executor's `on_stage_backward_done`), which is what
  torch's own pipelining does (`torch.distributed.pipelining.stage`: `backward_maybe_with_nosync`,
  and `perform_reduce_grad`, which its schedules place right after a stage's last backward). A rank
  with several stages (interleaved 1F1B) thus frees a stage's gradient and gathered parameters
  before its other stages finish (cost/memory.py [Note: FSDP gathered bytes]).
- Mixed precision (bf16 plans): FSDP's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`
  in place of precision.py's working copies: the sharded parameters are the fp32 masters, gathered
  in bf16, and gradients are reduced and kept in fp32: 4 + 4 + 8 bytes per parameter, sharded
  (cost/memory.py). A plan with `reduce_dtype` bfloat16 reduces them in bf16 (`reduce_dtype=bf16`,
  Megatron-LM's `--grad-reduce-in-bf16`): half the bytes on the wire, a bf16 sum; FSDP casts the
  reduced shard back to the fp32 master's dtype, so what is kept is unchanged.
- Expert parallelism (ep > 1): a rank's slice of the experts (runtime/parallel/experts.py) differs across
  its ep group, so each experts module is a unit of its own sharded over the ranks holding the
  same experts (`ParallelLayout.expert_fsdp_mesh`: tp * dp / ep ranks, plan.py [Note: expert
  layout]; under HSDP a 2-D mesh that shards within a replica group and replicates across them),
  as torchtitan shards experts over its
  "dp_shard_mod_ep" mesh (torchtitan/models/llama4/infra/parallelize.py). Its
  gradient already sums the tokens of the ep group, so FSDP divides the reduced sum by dp, not by
  the mesh's size (`set_gradient_divide_factor`), which gives the mean over all dp replicas, as
  every other parameter gets.
- zb-h1 is refused: its weight-gradient pass runs outside autograd's accumulation, where FSDP's
  gradient hooks do not see it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoplan.runtime.parallel.errors import PartitionError
from autoplan.schedule import schedule_spec

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["ShardedStage", "apply_fsdp", "check_sharding", "finish_step", "fsdp_roots", "refuse_fused_qkv",
           "shard_stage", "start_step", "unit_paths"]


def check_sharding(plan: Plan) -> None:
    """Refuse (one line) a data-parallel sharding the runtime cannot run."""
    if plan.zero >= 2 and not schedule_spec(plan.schedule).runs_fsdp:
        raise PartitionError(f"zero {plan.zero} (FSDP) cannot run the {plan.schedule} schedule: its weight-gradient pass "
                             "runs outside autograd, where FSDP reduces gradients; re-plan with --schedule 1f1b "
                             "or --zero 1")


def refuse_fused_qkv(tp_plan: Mapping[str, str], plan: Plan) -> None:
    """Refuse (one line, before any process group) FSDP over a tensor-parallel fused q/k/v projection."""
    fused = [path for path, style in tp_plan.items() if style == "colwise-qkv"]
    if fused and plan.zero >= 2:
        raise PartitionError(f"zero {plan.zero} (FSDP) with tp {plan.tp} cannot shard the fused q/k/v projection "
                             f"'{fused[0]}' (FSDP would split its tensor-parallel [q | k | v] thirds again along the "
                             "same dim); re-plan with --zero 1 or --tp 1")


def apply_fsdp(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The data-parallel step under zero >= 2: every stage of this rank sharded with `shard_stage`
    (FSDP2, or HSDP over a 2-D mesh) around its runner, its experts over the expert mesh."""
    _check_unshared(build.modules, plan)
    for index, stage in build.stages.items():
        stage.runner = shard_stage(stage.module, stage.runner, mesh=layout.fsdp_mesh, zero=plan.zero,
                                   compute_dtype=build.compute_dtype, experts=build.experts_of.get(index, ()),
                                   expert_mesh=layout.expert_fsdp_mesh, dp=plan.dp,
                                   reduce_dtype=getattr(torch, plan.reduce_dtype))
        stage.params = [p for p in stage.module.parameters() if p.requires_grad]
    # fully_shard replaced the expert slices by sharded parameters
    build.expert_params = [p for units in build.experts_of.values() for unit in units for p in unit.parameters()]


def _check_unshared(stage_modules: Mapping[int, nn.Module], plan: Plan) -> None:
    """FSDP manages a parameter in one unit: refuse (one line) a rank whose stages share one (a
    tied weight whose two ends land on one pipeline rank in two virtual stages, as T5's decoder
    embedding and head can)."""
    holder: dict[int, tuple[int, str]] = {}
    for index, module in sorted(stage_modules.items()):
        for name, p in module.named_parameters():
            first = holder.setdefault(id(p), (index, name))
            if first[0] != index:
                raise PartitionError(f"zero {plan.zero} (FSDP) cannot shard '{name}', which stages {first[0]} and "
                                     f"{index} of one pipeline rank share (a tied weight); re-plan with --zero 1 or "
                                     "--virtual-stages 1")


class ShardedStage(nn.Module):
    """The root FSDP unit of a stage: holds the stage module as a child and calls `runner` (the
    module itself, a recomputation runner or a DTensor runner) in its forward, so FSDP's root hooks
    run on every call."""

    def __init__(self, module: nn.Module, runner: Callable[..., Any] | None):
        super().__init__()
        self.stage = module
        self._runner = runner

    def forward(self, *args: Any) -> Any:
        return (self._runner or self.stage)(*args)


def unit_paths(module: nn.Module) -> list[str]:
    """Submodules of a stage that become FSDP units of their own: the ones its graph calls whole
    (`call_module`) that own parameters, outermost first, leaving out any that shares a parameter
    with a module outside it (that parameter would belong to two units) and any inside another unit."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return []
    called = [str(n.target) for n in graph.nodes if n.op == "call_module"]
    owners: dict[int, set[str]] = {}  # id(parameter) -> module paths that own it directly
    for path, sub in module.named_modules(remove_duplicate=False):
        for p in sub.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(path)
    units: list[str] = []
    for path in sorted(set(called), key=lambda p: (p.count("."), p)):
        if any(path == u or path.startswith(u + ".") for u in units):
            continue
        sub = module.get_submodule(path)
        params = list(sub.parameters())
        if not params:
            continue
        inside = {path} | {f"{path}.{name}" if name else path for name, _ in sub.named_modules(remove_duplicate=False)}
        if any(owners.get(id(p), set()) - inside for p in params):
            continue
        units.append(path)
    return units


def shard_stage(module: nn.Module, runner: Callable[..., Any] | None, *, mesh, zero: int,
                compute_dtype: torch.dtype, experts: Sequence[nn.Module] = (), expert_mesh=None,
                dp: int = 1, reduce_dtype: torch.dtype = torch.float32) -> ShardedStage:
    """`module` (a stage, already tensor-parallel and materialized) sharded with `fully_shard`
    over `mesh` as [Note: FSDP under the pipeline executor] says; returns the root unit to call in
    its place. Its parameters are replaced by sharded DTensor parameters: collect them afterwards.
    `experts` (ep > 1): its grouped-experts modules, already sliced (runtime/parallel/experts.py), which
    shard over `expert_mesh`; `dp`: the replicas in all; `reduce_dtype`: the plan's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    if compute_dtype == torch.float32:
        policy = MixedPrecisionPolicy()
    reshard = zero >= 3
    for unit in experts:  # innermost first: an outer unit leaves their parameters to them
        fully_shard(unit, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy)
        unit.set_gradient_divide_factor(float(dp))
        # A custom factor reduces with PREMUL_SUM, which gloo lacks; a sum divided afterwards is the
        # same mean. Not where the shard axis is one rank (under HSDP too): torch's single-rank path
        # skips the reduce-scatter and divides by the factor itself, then sums over the replicas
        # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce).
        unit.set_force_sum_reduction_for_comms(expert_mesh.size(expert_mesh.ndim - 1) > 1)
    for path in unit_paths(module):
        fully_shard(module.get_submodule(path), mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    root = ShardedStage(module, runner)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return root


def start_step(roots: Sequence[nn.Module], pp: int) -> None:
    """Before a step's first forward: with pp > 1 gradients accumulate unsharded and the gathered
    parameters stay through the backward until `finish_step` (see the note)."""
    if pp == 1:
        return
    for root in roots:
        root.set_is_last_backward(False)
        root.set_reshard_after_backward(False)
        root.set_requires_gradient_sync(False)


def finish_step(roots: Sequence[nn.Module], pp: int) -> None:
    """After the last backward of the stages of `roots` (pp > 1): reduce-scatter every unit's
    accumulated gradient and reshard its parameters, as torch's pipelining does
    (`_PipelineStageBase.perform_reduce_grad`)."""
    if pp == 1:
        return
    from torch.distributed.fsdp import fully_shard

    for root in roots:
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        state = fully_shard.state(root)
        for unit_state in state._state_ctx.all_states:
            for group in unit_state._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


def fsdp_roots(stages: Mapping[int, Any]) -> list[nn.Module]:
    """The root units of a rank's stages (those `shard_stage` made)."""
    return [s.runner for s in stages.values() if isinstance(s.runner, ShardedStage)]
