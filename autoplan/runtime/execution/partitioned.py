"""`PartitionedModel`: this rank's stages of a model under a plan, trained by the pipeline executor.

What `partition` (api.py) returns: the built stages and executor, with what a training loop calls
(`step`, `evaluate`, `parameters`, `make_optimizer`, `state_dict`). Apart from api.py because it is
the running model, while api.py builds it; see api.py's docstring for its use.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from autoplan.graph.aux_loss import recording_aux_losses
from autoplan.plan import Plan
from autoplan.runtime.execution.dimensions import Dimension, registry
from autoplan.runtime.execution.executor import ActionRecord, PipelineExecutor, Stage
from autoplan.runtime.parallel.context import ContextParallelAttention
from autoplan.runtime.parallel.errors import PartitionError
from autoplan.runtime.parallel.mesh import ParallelLayout
from autoplan.runtime.parallel.precision import LossScaler, MixedPrecision
from autoplan.sources import ModelSource, OutputTemplate

__all__ = ["PartitionedModel"]

# [Note: evaluation mode in traced graphs]
# `module.eval()` reaches the modules a stage's graph calls whole (fx keeps torch.nn modules and the
# repeated layers as `call_module`), but a graph traced by torch.export (transformers models) or an
# fx trace of a functional call has the mode fixed in its nodes: `aten.dropout(x, 0.1, True)`,
# `aten.scaled_dot_product_attention(..., dropout_p=0.1)`, `aten.batch_norm(..., training=True)`
# (measured on hf:gpt2 with resid_pdrop=0.1 and on a BatchNorm2d traced with export). `evaluate`
# runs the stages under `_EvalMode`, a TorchFunctionMode that calls these ops as eval mode would:
# dropout with training off, attention with dropout_p 0, and batch norm with its running statistics
# (where it has them) instead of the batch's, so an evaluation neither drops activations nor moves
# running statistics. What it cannot reach: a BatchNorm's `num_batches_tracked` counter, which an
# exported graph increments in a node of its own (it matters only with momentum=None).
_ATEN = torch.ops.aten
_F = torch.nn.functional
_TRAINING_ARG: dict[Any, tuple[int, str]] = {
    # op -> (position, keyword) of its training flag
    **{op: (2, "train") for op in (
        _ATEN.dropout.default, _ATEN.native_dropout.default, _ATEN.feature_dropout.default,
        _ATEN.alpha_dropout.default, _ATEN.feature_alpha_dropout.default, torch.dropout,
        torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout)},
    **{op: (2, "training") for op in (
        _F.dropout, _F.dropout1d, _F.dropout2d, _F.dropout3d, _F.alpha_dropout, _F.feature_alpha_dropout)},
}
_DROPOUT_P_ARG = {op: (4, "dropout_p") for op in (_F.scaled_dot_product_attention,
                                                   _ATEN.scaled_dot_product_attention.default)}
_BATCH_NORM_ARGS = {  # op -> (training flag, running mean): eval mode needs the running statistics
    _ATEN.batch_norm.default: ((5, "training"), (3, "running_mean")),
    torch.batch_norm: ((5, "training"), (3, "running_mean")),
    _F.batch_norm: ((5, "training"), (1, "running_mean")),
}


def _arg(args: tuple, kwargs: dict, where: tuple[int, str]) -> Any:
    position, keyword = where
    return args[position] if len(args) > position else kwargs.get(keyword)


def _with_arg(args: tuple, kwargs: dict, where: tuple[int, str], value: Any) -> tuple[tuple, dict]:
    position, keyword = where
    if len(args) > position:
        return (*args[:position], value, *args[position + 1:]), kwargs
    return args, {**kwargs, keyword: value}


class _EvalMode(TorchFunctionMode):
    """Runs the ops of [Note: evaluation mode in traced graphs] as eval mode does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TRAINING_ARG:
            args, kwargs = _with_arg(args, kwargs, _TRAINING_ARG[func], False)
        elif func in _DROPOUT_P_ARG:
            args, kwargs = _with_arg(args, kwargs, _DROPOUT_P_ARG[func], 0.0)
        elif func in _BATCH_NORM_ARGS:
            training, running_mean = _BATCH_NORM_ARGS[func]
            if _arg(args, kwargs, running_mean) is not None:
                args, kwargs = _with_arg(args, kwargs, training, False)
        return func(*args, **kwargs)


class PartitionedModel:
    """This rank's stages of a model under a plan; see the module docstrings here and in api.py."""

    def __init__(self, *, plan: Plan, layout: ParallelLayout, stages: dict[int, Stage], executor: PipelineExecutor,
                 input_names: Sequence[str], aliases: Mapping[str, str], device: torch.device,
                 batch_size_of_example: int | None, precision: MixedPrecision | None = None,
                 compute_dtype: torch.dtype = torch.float32,
                 source: ModelSource | None = None, output_template: OutputTemplate | None = None,
                 expert_params: Sequence[nn.Parameter] = (), context: ContextParallelAttention | None = None,
                 expert_hidden: Mapping[str, object] | None = None, dimensions: Sequence[Dimension] | None = None):
        self.plan = plan
        self.dimensions = tuple(registry.DIMENSIONS if dimensions is None else dimensions)
        """The dimensions whose hooks `step` and `evaluate` call, in order (runtime/execution/dimensions/:
        [Note: a dimension's hooks]); `partition` gives those it applied."""
        self.context = context
        """Context parallelism (cp > 1): this rank's positions of every sequence and the attention
        that gathers keys and values over the cp group (runtime/parallel/context.py), else None."""
        self.expert_params = list(expert_params)
        self.expert_hidden = dict(expert_hidden or {})
        """Under expert tp: an experts parameter's name -> where its hidden units are, of which this
        rank holds its tp index's 1/tp (runtime/parallel/expert_tp.py `HiddenAxis`; checkpoints place it)."""
        self._has_aux_losses: bool | None = None  # found on the first step (`_aux_loss`)
        """This rank's slices of the experts under expert parallelism (runtime/parallel/experts.py): their
        gradients are reduced over the replicas holding the same experts, not over all of dp."""
        self.source = source
        """The model source (sources/base.py): it makes batches and targets for `autoplan run`."""
        self.output_template = output_template
        """Shape (at one micro-batch) and dtype of the output the loss's target follows."""
        self.layout = layout
        self.stages = stages
        self.executor = executor
        self.input_names = list(input_names)
        self.aliases = dict(aliases)
        """Every name of a tied parameter -> its first name in the model."""
        self.device = device
        self.precision = precision
        """bf16 working copies with fp32 masters (precision.py), or None for an fp32 plan and under
        FSDP (zero >= 2), whose own mixed-precision policy keeps the fp32 masters sharded (fsdp.py)."""
        self.compute_dtype = compute_dtype
        """What the stages compute in (the plan's dtype): float inputs are cast to it."""
        self.last_reductions: list[tuple[str, float, float]] = []
        """(phase, start, end) of the last step's gradient reductions after the pipeline (perf_counter)."""
        self._params = self._collect_params()
        self._norm_counter = None  # clipping.py's GradNormCounter, made on the first clip_grad_norm_
        self.loss_scaler = LossScaler() if compute_dtype == torch.float16 else None
        """fp16 plans: the dynamic loss scale (precision.py [Note: fp16 loss scaling]); `step` scales
        the backward by it and unscales the gradients, the caller skips the optimizer step on an
        overflow on any rank and calls `loss_scaler.update(overflow)`. None otherwise."""

    # ---- parameters ----------------------------------------------------------------------------
    def _collect_params(self) -> list[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        out = []
        for index in sorted(self.stages):
            for name, p in self.stages[index].module.named_parameters():
                if self.precision is not None:  # the fp32 master: what users optimize and save
                    p = self.precision.master_of.get(id(p), p)
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the model (a tied copy under its own name):
        their values, never a placeholder.

        With tp > 1 a sharded parameter is a DTensor: `.to_local()` holds this rank's 1/tp slice
        (rows of a column-parallel weight and its bias, columns of a row-parallel weight). In a bf16
        plan these are the fp32 masters, with their fp32 gradients. Once `make_optimizer` has made a
        ZeRO-1 optimizer, a master another dp rank owns holds no values on this rank (runtime/
        precision.py `release_masters`): it is given as its bf16 working copy (`holds_values` is
        False), the values this rank computes with, whose gradient is on the master
        (`named_masters`). Under ZeRO-1 write weights with `load_state_dict` and step with the
        optimizer `make_optimizer` returned: a write in between is refused by the next `step`
        (precision.py [Note: writes under ZeRO-1])."""
        if self.precision is None:
            return iter(self._params)
        return ((name, self.precision.readable(p)) for name, p in self._params)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of `named_parameters`."""
        return (p for _, p in self.named_parameters())

    def named_masters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """What the optimizer steps, under the names of `named_parameters`: the parameters, or in a
        bf16 / fp16 plan the fp32 masters, which hold the gradients (`.grad`, fp32, reduced). Under a
        bf16 ZeRO-1 optimizer a master another dp rank owns holds no values here (a NaN placeholder;
        `holds_values` is False), only its gradient: read values from `named_parameters`."""
        return iter(self._params)

    def nonfinite_stages(self) -> list[int]:
        """This rank's stages whose gradients hold a NaN or an infinity (after `step`, before the
        optimizer): one norm per gradient, as Megatron-LM's and torchtitan's gradient-norm checks
        find them (a non-finite element makes its norm non-finite)."""
        bad = []
        for index in sorted(self.stages):
            grads = []
            for p in self.stages[index].module.parameters():
                p = self.precision.master_of.get(id(p), p) if self.precision is not None else p
                if p.grad is not None:
                    grad = p.grad
                    grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
            if grads and not torch.stack(torch._foreach_norm(grads)).isfinite().all():
                bad.append(index)
        return bad

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model by their global norm and return that norm (before
        clipping): what `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`
        returns and does on one process, counting each parameter once over every rank of the plan
        (tp shards, pipeline stages, dp replicas, ZeRO-1 and FSDP shards, experts, tied copies:
        clipping.py [Note: the global gradient norm]). Call it after `step` (fp16: the gradients are
        unscaled by then) and before the optimizer's step, on every rank: it is collective. A
        non-finite norm (a NaN or an infinity in any gradient) is returned as it is, the gradients
        are then multiplied by NaN as torch's would be: check `torch.isfinite(norm)` and skip the
        optimizer step (`autoplan run --clip-grad` does)."""
        from autoplan.runtime.execution.clipping import GradNormCounter, clip_grads_with_norm_

        if not (isinstance(max_norm, int | float) and not isinstance(max_norm, bool) and max_norm > 0):
            raise ValueError(f"max_norm must be a number above 0, got {max_norm!r}")
        if self._norm_counter is None:
            self._norm_counter = GradNormCounter(self)
        grads = [p.grad for _, p in self._params]
        total = self._norm_counter.total_norm(grads, float(norm_type), self.device)
        clip_grads_with_norm_(grads, float(max_norm), total)
        return total

    def zero_grad(self) -> None:
        for _, p in self._params:
            p.grad = None
        for stage in self.stages.values():
            for p in stage.params:
                p.grad = None

    def holds_values(self, param: torch.Tensor) -> bool:
        """Whether this rank holds the fp32 values of `param` (one of `parameters()` or
        `named_masters()`): False only for a parameter another dp rank owns under a bf16 ZeRO-1
        optimizer, given as its bf16 working copy by `parameters()` and as its NaN master by
        `named_masters()` (see `named_parameters`)."""
        if self.precision is None:
            return True
        master = self.precision.master_of.get(id(param), param)
        return self.precision.holds(master)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (as `named_parameters`) and persistent buffers by name. A master
        this rank does not hold (`holds_values`) is given as its bf16 working copy: the values this
        rank has, rounded to bf16; the owner's entry is the fp32 one."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self._params:
            if not self.holds_values(p):
                p = self.precision.working_of[id(p)]
            out[name] = p.detach()
        for index in sorted(self.stages):
            module = self.stages[index].module
            for name, buf in module.named_buffers():
                mod_name, _, local = name.rpartition(".")
                owner = module.get_submodule(mod_name) if mod_name else module
                if local not in owner._non_persistent_buffers_set:
                    out.setdefault(name, buf.detach())
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = False) -> list[str]:
        """Copy this rank's slices of a full-model state dict, in every layout (expert slices under ep
        and expert tp included: runtime/checkpoint/weights.py); returns the local names not found. With `strict`,
        a missing parameter or an entry the model has none for is a one-line WeightsError (a
        PartitionError); a tensor of another shape is one in any case."""
        from autoplan.runtime.checkpoint.weights import load_state_dict_slices

        return load_state_dict_slices(self, state_dict, strict=strict)

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                       param_groups: list[dict[str, Any]] | None = None, **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer over this rank's parameters, sharded as the plan's ZeRO stage says.

        zero = 0 (or dp = 1): `optimizer_class(self.parameters(), **kwargs)`, replicated on the dp
        replicas. zero = 1: `ZeroOneOptimizer` over the dp group (optimizer.py; Rajbhandari et al.
        2020, ZeRO P_os, as Megatron-LM's distributed optimizer shards it at any tp): each dp rank
        keeps `optimizer_class`'s state for its share of this rank's parameters (tensor-parallel
        shards included), steps those and broadcasts them to the other dp ranks. In a bf16 plan the
        fp32 masters are sharded too (Megatron-LM's distributed optimizer): each rank keeps the
        values of the masters it owns only (`holds_values`), and owners broadcast the bf16 working
        copies. Under expert parallelism the experts' state is split over the replicas holding the
        same experts (optimizer.py). zero >= 2: the parameters are FSDP shards (fsdp.py), so a plain
        optimizer over them holds and steps only this rank's shard. `param_groups`: this rank's
        parameters in groups of their own settings (weight decay: runtime/launcher/optim_config.py), each
        group holding plain tensors or DTensors of one mesh, as `_param_groups` splits them; default
        one group per kind."""
        groups = self._param_groups() if param_groups is None else param_groups
        if self.plan.zero != 1 or self.layout.dp_group is None:
            return optimizer_class(groups, **kwargs)
        from autoplan.runtime.parallel.optimizer import ZeroOneOptimizer

        working = self.precision.working_of if self.precision is not None else None
        optimizer = ZeroOneOptimizer(groups, optimizer_class, group=self.layout.dp_group,
                                     working=working, experts=self.expert_params,
                                     expert_group=self.layout.expert_dp_group, **kwargs)
        if self.precision is not None:  # the other dp ranks' masters: no fp32 values here
            self.precision.release_masters({id(p) for p in optimizer.owned_parameters()})
            optimizer.after_step = self.precision.mark_versions  # [Note: writes under ZeRO-1]
        return optimizer

    def _param_groups(self) -> list[dict[str, Any]]:
        """This rank's parameters as optimizer groups: tensor-parallel shards (DTensors) apart from
        plain tensors, since torch's fused and foreach optimizers run one kernel per group and
        refuse a group that mixes the two (`aten._fused_adamw_ got mixed torch.Tensor and DTensor`)."""
        from torch.distributed.tensor import DTensor

        groups: dict[Any, list[nn.Parameter]] = {}  # by mesh: one kernel's DTensors share one (FSDP x tp: 2-D)
        for _, p in self._params:
            key = (id(p.device_mesh), p.device_mesh.ndim) if isinstance(p, DTensor) else None
            groups.setdefault(key, []).append(p)
        return [{"params": group} for group in groups.values()]

    @property
    def last_trace(self) -> list[ActionRecord]:
        """(action, start, end) of every action of the last step, in this rank's order."""
        return self.executor.last_trace

    @property
    def is_last_stage(self) -> bool:
        return self.layout.pp_index == self.plan.pp - 1

    # ---- training --------------------------------------------------------------------------------
    def _microbatches(self, inputs: Sequence[Any], target: Any, caller: str = "step") -> list[dict[str, Any]]:
        plan = self.plan
        local = plan.micro_batch_size * plan.num_microbatches
        names = self.input_names
        values = dict(zip(names, inputs))
        if target is not None:
            values[names[-1]] = target
        needed = [n for n in names if n not in values]
        used = {n for s in self.stages.values() for n in s.spec.data_inputs}
        if any(n in used for n in needed):
            raise PartitionError(f"{caller}() needs inputs {names} (target=... for the loss), got {list(values)}")
        out: list[dict[str, Any]] = [{} for _ in range(plan.num_microbatches)]
        compute_dtype = None if self.compute_dtype == torch.float32 else self.compute_dtype
        for name, value in values.items():
            if (compute_dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point()
                    and name != names[-1]):  # a bf16 plan computes in bf16: float inputs too (not the target)
                value = value.to(compute_dtype)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                rows = value.shape[0]
                replica = self.layout.dp_index // plan.cp  # the ranks of a cp group share their sequences
                if rows == local * plan.replicas and plan.replicas > 1:
                    value = value[replica * local:(replica + 1) * local]
                elif rows != local:
                    raise PartitionError(
                        f"input {name!r} has {rows} rows; expected the global batch {local * plan.replicas} or this "
                        f"replica's {local} (micro_batch_size {plan.micro_batch_size} * num_microbatches "
                        f"{plan.num_microbatches})")
                for dimension in self.dimensions:  # cp: this rank's chunks of every sequence
                    value = dimension.split_input(self, value)
                for m, chunk in enumerate(value.to(self.device).chunk(plan.num_microbatches)):
                    out[m][name] = chunk
            else:
                for m in range(plan.num_microbatches):
                    out[m][name] = value
        return out

    def step(self, *inputs: Any, target: Any = None, zero_grad: bool = True) -> torch.Tensor | None:
        """Forward and backward of one batch through the pipeline, gradients reduced.

        Returns the mean loss over the global batch on ranks of the last pipeline stage, else None;
        a model's auxiliary losses (`autoplan.attach_aux_loss`: a router's load-balancing loss) are
        part of it, as they are of the gradients.

        fp16 plans: the backward is scaled by `loss_scaler.scale` and the gradients are unscaled before
        this returns; if any rank's gradients are not finite (an overflow: `nonfinite_stages`, agreed
        over the world), skip the optimizer step (`zero_grad`); either way call
        `loss_scaler.update(overflow)` (`autoplan run` does all this).
        """
        if zero_grad:
            self.zero_grad()
        # Each dimension's hooks (runtime/execution/dimensions/: [Note: a dimension's hooks]), in the
        # registry's order but `after_backward`, which unwinds in reverse. The step's tail after the
        # pipeline is timed by the hooks into `last_reductions`, for traces (the cost model's `tails`).
        self.last_reductions = []
        self._each("before_step")
        microbatches = self._microbatches(inputs, target)
        self._each("before_run")
        with recording_aux_losses() as aux_losses, self._run_contexts():
            loss = self.executor.run(microbatches)
        aux = self._aux_loss(aux_losses)
        if aux is not None and self.executor.grad_scale != 1.0:  # recorded with the loss scale's factor
            aux = aux / self.executor.grad_scale
        for dimension in reversed(self.dimensions):
            dimension.after_backward(self)
        self._each("reduce_grads")
        self._each("after_reduce")
        if loss is not None and aux is not None:
            loss = loss + aux
        return self._mean_over_replicas(loss)

    def _each(self, hook: str) -> None:
        """Call one per-step hook of every dimension, in the registry's order."""
        for dimension in self.dimensions:
            getattr(dimension, hook)(self)

    def _run_contexts(self) -> ExitStack:
        """The dimensions' contexts around the pipeline's run (cp: this rank's chunks of every sequence),
        entered in the registry's order."""
        stack = ExitStack()
        with stack:  # a context that fails to enter exits those entered before it
            for dimension in self.dimensions:
                context = dimension.run_context(self)
                if context is not None:
                    stack.enter_context(context)
            return stack.pop_all()

    def _mean_over_replicas(self, loss: torch.Tensor | None) -> torch.Tensor | None:
        """A last-stage rank's mean loss over its replica's micro-batches -> the global batch's
        (the mean over the dp group, whose ranks hold equal shares); None elsewhere."""
        if loss is not None and self.layout.dp_group is not None:
            dist.all_reduce(loss, group=self.layout.dp_group)
            loss /= self.plan.dp
        return loss

    # ---- evaluation ------------------------------------------------------------------------------
    def evaluate(self, *inputs: Any, target: Any = None) -> torch.Tensor:
        """The mean loss over one global batch, forward only: what `step` returns for it, without a
        backward and touching no gradient. Call it on every rank with the same arguments as `step`
        (the global batch, or this replica's rows, and `target=`); it is collective.

        Returns the loss on EVERY rank (fp32, 0-dim, on `self.device`): the last pipeline stage
        broadcasts it over its pipeline group, so a loop can log it from any rank (`step` returns
        it on the last stage only).

        - The pipeline runs this rank's training action list without its backward
          (runtime/execution/executor.py [Note: forward-only steps]) under `torch.no_grad()`: no activation
          is kept, no gradient is written, and FSDP units are resharded afterwards, so a following
          `step` computes what it would have without the evaluation (gradients accumulated by
          `step(..., zero_grad=False)` survive it too).
        - The stages run in eval mode, as Megatron-LM's and torchtitan's evaluation loops put the
          model: `module.eval()` (each submodule's mode restored after), and the dropout, attention
          dropout and batch norm a traced graph fixed in training mode run as in eval mode
          ([Note: evaluation mode in traced graphs]): no dropout, running statistics untouched.
        - The loss is the model's loss function's output: auxiliary losses attached with
          `autoplan.attach_aux_loss` (a router's load-balancing loss), which `step` adds, are not
          part of it (they exist only for gradients), as Megatron-LM's evaluation reports the LM
          loss; a loss function that adds an auxiliary term itself (a transformers MoE model's
          `router_aux_loss_coef * aux_loss`, sources/hf_loss.py) keeps it, as transformers does.
        - bf16 / fp16 plans compute in their dtype (working copies refreshed from the fp32 masters
          first, as `step` does); the loss is summed over micro-batches in fp32, unscaled.
        """
        self._each("before_step")
        microbatches = self._microbatches(inputs, target, "evaluate")
        modes = {m: m.training for stage in self.stages.values() for m in _stage_modules(stage)}
        for m in modes:
            m.training = False  # per module, so each one's own mode comes back below
        try:
            with torch.no_grad(), self._run_contexts(), _EvalMode():
                loss = self.executor.run(microbatches, forward_only=True)
        finally:
            for m, mode in modes.items():
                m.training = mode
            self._each("after_evaluate")
        loss = self._mean_over_replicas(loss)
        if self.layout.pp_group is None:
            assert loss is not None
            return loss
        if loss is None:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        last = self.layout.stage_rank[self.plan.num_stages - 1]  # this rank's dp and tp coordinates
        dist.broadcast(loss, src=last, group=self.layout.pp_group)
        return loss

    def _aux_loss(self, recorded: list[torch.Tensor]) -> torch.Tensor | None:
        """The auxiliary losses (graph/aux_loss.py) of this replica's step, summed over its pipeline
        ranks onto the last one, or None for a model without any. Whether the model has any is
        agreed by the pipeline ranks on the first step (a stage without MoE layers records none)."""
        mine = torch.stack(recorded).sum() if recorded else torch.zeros((), device=self.device)
        if self._has_aux_losses is None:
            flag = torch.tensor([1.0 if recorded else 0.0], device=self.device)
            if self.layout.pp_group is not None:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.layout.pp_group)
            self._has_aux_losses = bool(flag.item())
        if not self._has_aux_losses:
            return None
        if self.layout.pp_group is not None:
            dist.all_reduce(mine, group=self.layout.pp_group)
        return mine


def _stage_modules(stage: Stage) -> Iterator[nn.Module]:
    """Every module a stage runs: its module's and its runner's (an FSDP root wraps the module)."""
    yield from stage.module.modules()
    if isinstance(stage.runner, nn.Module):
        yield from stage.runner.modules()
