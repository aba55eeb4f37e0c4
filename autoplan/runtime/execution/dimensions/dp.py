"""Data parallelism's steps and hooks (data_parallel.py, fsdp.py): DDP-style averaging and ZeRO-1
after each step; FSDP2 / HSDP (zero >= 2) wrapping the finished runners, its reduce-scatter driven
by hand under pp > 1. The experts' gradients are reduced here too, over the replicas holding the
same experts (experts.py), inside the same reduction."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from autoplan.runtime.execution.dimensions.base import Checked, Dimension
from autoplan.runtime.parallel.data_parallel import all_reduce_grads, apply_data_parallel
from autoplan.runtime.parallel.experts import reduce_expert_grads
from autoplan.runtime.parallel.fsdp import finish_step, fsdp_roots, refuse_fused_qkv, start_step

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["DataParallel"]


class DataParallel(Dimension):
    name: ClassVar[str] = "dp"
    fields: ClassVar[tuple[str, ...]] = ("dp", "dp_replicate")

    def refuse(self, checked: Checked) -> None:
        refuse_fused_qkv(checked.tp_plan, checked.plan)

    def wrap(self, build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
        # FSDP wraps the finished runner and replaces every parameter by its shard (tp shards become
        # 2-D DTensors): the last step before the executor.
        apply_data_parallel(build, plan, layout)

    def before_run(self, pm: Any) -> None:
        roots = fsdp_roots(pm.stages)
        start_step(roots, pm.plan.pp)
        # With pp > 1, each stage's reduce-scatter runs right after its last backward, which the
        # executor calls back (fsdp.py [Note: FSDP under the pipeline executor]): its unsharded
        # gradient and gathered parameters go then, not at the step's end.
        sharded = pm.plan.pp > 1 and bool(roots)
        pm.executor.on_stage_backward_done = (lambda stage: _finish_stage(pm, stage)) if sharded else None

    def reduce_grads(self, pm: Any) -> None:
        if fsdp_roots(pm.stages) or pm.layout.dp_group is None:  # FSDP reduced its gradients itself
            return
        start = time.perf_counter()
        experts = {id(p) for p in pm.expert_params}
        all_reduce_grads([p for _, p in pm.named_masters() if id(p) not in experts], pm.layout.dp_group,
                         average=True)
        if pm.expert_params:
            reduce_expert_grads(pm.expert_params, pm.layout.expert_dp_group, pm.plan.dp)
        pm.last_reductions.append(("DP_GRAD_SYNC", start, time.perf_counter()))

    def after_evaluate(self, pm: Any) -> None:
        _reshard_after_forward_only(fsdp_roots(pm.stages))


def _finish_stage(pm: Any, stage: int) -> None:
    """FSDP's reduce-scatter of one stage's accumulated gradient (pp > 1), timed into the step's tail."""
    roots = fsdp_roots({stage: pm.stages[stage]})
    start = time.perf_counter()
    finish_step(roots, pm.plan.pp)
    if roots and pm.layout.dp_group is not None:
        pm.last_reductions.append(("DP_GRAD_SYNC", start, time.perf_counter()))


def _reshard_after_forward_only(roots: Sequence[nn.Module]) -> None:
    """After forwards with no backward (an evaluation), put FSDP units back as a step leaves them:
    each unit resharded (zero 2 keeps its parameters gathered after a forward, for the backward that
    does not come) and the forward order FSDP records for the backward's prefetching cleared (it is
    cleared at the end of a backward, so an evaluation's records would precede the next step's and
    prefetch a wrong unit). `FSDPModule.reset_iter_state`, where torch has it, does both (after a
    whole `step` no reduction is in flight, so it discards nothing); older torch: the same by hand."""
    for root in roots:
        reset = getattr(root, "reset_iter_state", None)
        if reset is not None:
            reset()
            continue
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        state = fully_shard.state(root)
        state._comm_ctx.post_forward_order.clear()
        for unit_state in state._state_ctx.all_states:
            for group in unit_state._fsdp_param_groups:
                group._post_forward_indices.clear()
