"""`partition(model, plan)`: this rank's piece of a model, trained by the pipeline executor.

    pm = partition(model, plan, example_inputs=(ids,), loss_fn=loss)
    opt = torch.optim.AdamW(pm.parameters())
    loss = pm.step(ids, target=targets)   # the loss on the last pipeline stage, else None
    opt.step()

Only this rank's stages are materialized (see split.py); parameters keep their names in the model.
`step` takes either the global batch (every rank passes the same data; each dp replica takes its
slice) or this replica's batch (micro_batch_size * num_microbatches rows), splits it into
micro-batches, runs the plan's schedule, and reduces gradients (tied copies, then dp) before it
returns, so an optimizer step can follow at once. It zeroes gradients first unless told not to.

With tp > 1 the attention and MLP linears that the model's graph shows (graph/sharding.py: any
model, no table of classes) are sharded over the plan's "tp" mesh axis: with torch's
ColwiseParallel / RowwiseParallel where the traced graph calls those modules whole (fx leaves), or
by running the stage in DTensor where the graph inlines them (torch.export; see parallel.py).
Sharded parameters (and their gradients) are `DTensor`s under their usual names: `.to_local()` is
this rank's shard, `.full_tensor()` gathers the whole (a collective over the tp group). Every tp
rank of the last stage returns the loss.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan._checks import require, require_int, require_strings
from autoplan.graph.aux_loss import recording_aux_losses
from autoplan.graph.experts import expert_modules
from autoplan.graph.positions import POSITIONS_ATTRIBUTE, holding_positions
from autoplan.graph.profile import model_fingerprint
from autoplan.graph.trace import retarget_device
from autoplan.plan import Plan, PlanError, validate
from autoplan.runtime.comm import P2P
from autoplan.runtime.context import ContextParallelAttention, shard_sequence
from autoplan.runtime.executor import ActionRecord, PipelineExecutor, Stage
from autoplan.runtime.experts import reduce_expert_grads, shard_experts
from autoplan.runtime.fsdp import finish_step, fsdp_roots, shard_stage, start_step
from autoplan.runtime.parallel import (
    ParallelLayout,
    TensorParallelError,
    all_reduce_grads,
    apply_tensor_parallel,
    build_layout,
    grad_like_param,
    tensor_parallel_plan,
)
from autoplan.runtime.precision import LossScaler, MixedPrecision, cast_buffers
from autoplan.runtime.split import (
    build_stage_modules,
    materialize_stages,
    plan_stage_specs,
    propagate_values,
    tied_parameter_names,
)
from autoplan.schedule import make_schedule
from autoplan.sources import ModelSource, OutputTemplate, as_source, trace_with_target

__all__ = ["PartitionError", "PartitionedModel", "check_model", "default_device", "init_distributed", "partition"]

DEFAULT_TIMEOUT = timedelta(seconds=60)


class PartitionError(ValueError):
    """The plan cannot run on this model or in this process group (one-line message)."""


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(timeout: timedelta = DEFAULT_TIMEOUT, *, world_size: int | None = None) -> None:
    """Initialize the default process group from the torchrun environment (NCCL on CUDA, else gloo).

    Without RANK/WORLD_SIZE in the environment, a plan of one process (`world_size` 1) gets a
    process group of its own (an in-memory store: no port, no launcher), so a one-GPU plan runs in
    a plain Python process."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if world_size != 1:
            raise PartitionError("no process group and no RANK/WORLD_SIZE in the environment; launch with "
                                 "`torchrun --nproc-per-node N -m autoplan run plan.json` or `autoplan run --nproc N`")
        if backend == "nccl":
            torch.cuda.set_device(default_device())
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if backend == "nccl":
        torch.cuda.set_device(default_device())
    dist.init_process_group(backend, timeout=timeout)


def _check_fingerprint(model: nn.Module, plan: Plan) -> None:
    fingerprint = model_fingerprint(model)
    if fingerprint != plan.model_fingerprint:
        raise PartitionError(f"the plan was made for model {plan.model!r} (fingerprint {plan.model_fingerprint}) but this "
                             f"model's fingerprint is {fingerprint}; re-plan with `autoplan suggest` for this model")


def check_model(model: nn.Module, plan: Plan, example_inputs: Sequence[Any] | None = None, *,
                source: ModelSource | None = None, traced=None, graph_inputs: Sequence[Any] | None = None
                ) -> Mapping[str, str]:
    """Refuse (one line) a model the plan was not made for, or a plan the runtime cannot run.

    Returns the tensor-parallel layout (graph/sharding.py: module path -> "colwise" / "rowwise" /
    "vocab-embedding" / "vocab-head"; empty for tp = 1). It is found on the traced graph as the
    profile finds it (`sharding.traced_layout`), so `suggest` and the runtime agree: on `traced`
    and its `graph_inputs` when given (partition), else on the model traced here as partition
    traces it (`_trace_for_plan`: the plan's tracer and leaf modules, `example_inputs` at the
    micro-batch size, token ids when None and the model starts with an embedding, and `source`'s
    loss and target when given)."""
    _check_fingerprint(model, plan)
    _compute_dtype(plan)
    _check_sharding(plan)
    if plan.tp == 1:
        return {}
    if traced is None:
        if example_inputs is None:
            from autoplan.graph.sharding import default_inputs

            example_inputs = default_inputs(model)
        if example_inputs is None:
            raise PartitionError("no tensor-parallel layout: the model was not run (no example inputs) to find its "
                                 "layers; plan with tp = 1")
        traced, graph_inputs, *_ = _trace_for_plan(model, plan, example_inputs, source=source)
    try:
        return tensor_parallel_plan(traced, plan.tp, graph_inputs)
    except TensorParallelError as exc:
        raise PartitionError(str(exc)) from None


def _trace_for_plan(model: nn.Module, plan: Plan, example_inputs: Sequence[Any], *, source: ModelSource | None = None,
                    loss_fn: Callable[..., torch.Tensor] | None = None, example_target: torch.Tensor | None = None,
                    leaf_modules: Sequence[str] | None = None, tracer: str | None = None):
    """Trace `model` as partition runs it: at the micro-batch size (torch.export specializes the
    batch it saw), with the plan's leaf modules and tracer, and the loss appended when there is one
    (`loss_fn`, else `source`'s). Returns (traced, graph inputs, output template or None, the example
    inputs and target at the micro-batch size, their original batch size)."""
    from autoplan.graph.trace import trace_model

    leaf_modules = plan.leaf_modules if leaf_modules is None else leaf_modules
    tracer = plan.tracer if tracer is None else tracer
    batch = _batch_size(tuple(example_inputs))
    example_inputs = tuple(_with_batch(t, batch, plan.micro_batch_size) for t in example_inputs)
    if example_target is not None:
        example_target = _with_batch(example_target, batch, plan.micro_batch_size)
    loss_fn = loss_fn or (source.loss_fn if source is not None else None)
    if loss_fn is None:
        traced = trace_model(model, example_inputs, leaf_modules=leaf_modules, tracer=tracer)
        return traced, list(example_inputs), None, example_inputs, example_target, batch

    def target_maker(out: OutputTemplate, rows: int) -> torch.Tensor:
        return source.target(out.shape, out.dtype, rows, device="meta")

    traced, graph_inputs, output_template = trace_with_target(
        model, example_inputs, loss_fn, target_maker=target_maker, example_target=example_target,
        leaf_modules=leaf_modules, tracer=tracer)
    return traced, graph_inputs, output_template, example_inputs, example_target, batch


def _check_tp_tracing(traced, tp_plan: Mapping[str, str], sequence_parallel: bool = False) -> Mapping[str, str]:
    """The layout as the traced graph runs it (`sharding.for_graph`): torch's parallel styles
    (module hooks) where the graph calls the sharded modules whole (fx leaf modules), else the
    stage in DTensor ([Note: tensor parallelism on an inlined graph] in parallel.py), where
    sequence parallelism is refused."""
    if not tp_plan:
        return tp_plan
    from autoplan.graph.sharding import for_graph

    layout = for_graph(tp_plan, traced)
    if layout.note:  # nothing the graph lets the runtime shard
        raise PartitionError(f"no tensor-parallel layout: {layout.note}; plan with tp = 1")
    if sequence_parallel and not layout.layers:
        raise PartitionError(f"sequence parallelism needs transformer layers (norms, sharded attention and MLP) "
                             f"that the traced graph calls whole (traced with {traced.tracer}); plan without "
                             "--sequence-parallel")
    return layout


def _compute_dtype(plan: Plan) -> torch.dtype:
    """The plan's compute dtype: fp32, or bf16 / fp16 with fp32 masters ([Note: mixed precision] in
    precision.py; fp16 with a loss scale, [Note: fp16 loss scaling])."""
    dtype = getattr(torch, plan.job.dtype, None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise PartitionError(f"the runtime runs plans in bfloat16, float16 or float32, not {plan.job.dtype}; "
                             f"re-plan with --dtype bf16")
    return dtype


def _check_sharding(plan: Plan) -> None:
    """Refuse (one line) a data-parallel sharding the runtime cannot run."""
    if plan.zero >= 2 and plan.schedule == "zb-h1":
        raise PartitionError(f"zero {plan.zero} (FSDP) cannot run the zb-h1 schedule: its weight-gradient pass "
                             "runs outside autograd, where FSDP reduces gradients; re-plan with --schedule 1f1b "
                             "or --zero 1")


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


def _sequence_sharded(spec, layer_blocks: set[int], tp: int):
    """`spec` with the values that cross a cut between two transformer layers split along the
    sequence (dim 1) over tp ([Note: sequence parallelism] in parallel.py)."""
    import dataclasses

    def split(values, block_before: int):
        if block_before not in layer_blocks or block_before + 1 not in layer_blocks:
            return values
        out = []
        for cv in values:
            if cv.is_tensor and len(cv.shape) >= 2:
                if cv.shape[1] % tp:
                    raise PartitionError(f"sequence parallelism needs tp = {tp} to divide the sequence length "
                                         f"{cv.shape[1]}; plan without --sequence-parallel or with another tp")
                cv = dataclasses.replace(cv, shape=(cv.shape[0], cv.shape[1] // tp, *cv.shape[2:]))
            out.append(cv)
        return tuple(out)

    return dataclasses.replace(spec, recv=split(spec.recv, spec.first_block - 1),
                               send=split(spec.send, spec.end_block - 1))


def _recompute_runner(traced, plan: Plan, spec, module):
    """The stage's runner for plan.recompute (recompute.py), or None to run the module whole."""
    if plan.recompute == "none":
        return None
    from autoplan.runtime.recompute import recompute_runner

    return recompute_runner(traced, module, spec.first_block, spec.end_block, spec.inputs, spec.outputs,
                            plan.recompute)


def _with_batch(value: Any, batch: int | None, size: int) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch or batch == size:
        return value
    reps = -(-size // batch)
    return value.repeat(reps, *([1] * (value.dim() - 1)))[:size]


def _batch_size(example_inputs: Sequence[Any]) -> int | None:
    return next((t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)


class PartitionedModel:
    """This rank's stages of a model under a plan; see the module docstring."""

    def __init__(self, *, plan: Plan, layout: ParallelLayout, stages: dict[int, Stage], executor: PipelineExecutor,
                 input_names: Sequence[str], aliases: Mapping[str, str], device: torch.device,
                 batch_size_of_example: int | None, precision: MixedPrecision | None = None,
                 compute_dtype: torch.dtype = torch.float32,
                 source: ModelSource | None = None, output_template: OutputTemplate | None = None,
                 expert_params: Sequence[nn.Parameter] = (), context: ContextParallelAttention | None = None):
        self.plan = plan
        self.context = context
        """Context parallelism (cp > 1): this rank's positions of every sequence and the attention
        that gathers keys and values over the cp group (runtime/context.py), else None."""
        self.expert_params = list(expert_params)
        self._has_aux_losses: bool | None = None  # found on the first step (`_aux_loss`)
        """This rank's slices of the experts under expert parallelism (runtime/experts.py): their
        gradients are reduced over the replicas holding the same experts, not over all of dp."""
        self.source = source
        """The model source (graph/source.py): it makes batches and targets for `autoplan run`."""
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
        self._fsdp_roots = fsdp_roots(stages)
        """The stages' root FSDP units (zero >= 2), else empty."""
        self.last_reductions: list[tuple[str, float, float]] = []
        """(phase, start, end) of the last step's gradient reductions after the pipeline (perf_counter)."""
        self._params = self._collect_params()
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
        """This rank's parameters under their names in the model (a tied copy under its own name).

        With tp > 1 a sharded parameter is a DTensor: `.to_local()` holds this rank's 1/tp slice
        (rows of a column-parallel weight and its bias, columns of a row-parallel weight). In a bf16
        plan these are the fp32 masters; once `make_optimizer` has made a ZeRO-1 optimizer, a master
        another dp rank owns holds no values here (NaN; `holds_values` is False), only its fp32
        gradient: this rank's values of it are the bf16 working copy, which `state_dict` returns
        (runtime/precision.py `release_masters`)."""
        return iter(self._params)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self._params)

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

    def zero_grad(self) -> None:
        for _, p in self._params:
            p.grad = None
        for stage in self.stages.values():
            for p in stage.params:
                p.grad = None

    def holds_values(self, param: torch.Tensor) -> bool:
        """Whether this rank holds the values of `param` (one of `parameters()`): False only for an
        fp32 master another dp rank owns under a bf16 ZeRO-1 optimizer (see `named_parameters`)."""
        return self.precision is None or self.precision.holds(param)

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

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = False) -> list[str]:
        """Copy this rank's part of a full-model state dict; returns the local names not found
        (raises on any when `strict`)."""
        missing = []
        local = self.state_dict()
        from torch.distributed.tensor import DTensor, distribute_tensor

        for name, tensor in local.items():
            source = state_dict.get(name)
            if source is None and name in self.aliases:
                source = state_dict.get(self.aliases[name])
            if source is None:
                missing.append(name)
                continue
            if isinstance(source, DTensor):
                source = source.full_tensor()
            source = source.to(tensor.device, tensor.dtype)
            if isinstance(tensor, DTensor):  # a tp shard: this rank's slice of the full tensor
                source = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
                tensor = tensor.to_local()
            tensor.copy_(source)
        if self.precision is not None:
            self.precision.refresh()
        if strict and missing:
            raise KeyError(f"state dict has no entry for {len(missing)} local tensors, e.g. {missing[0]!r}")
        return missing

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer over this rank's parameters, sharded as the plan's ZeRO stage says.

        zero = 0 (or dp = 1): `optimizer_class(self.parameters(), **kwargs)`, replicated on the dp
        replicas. zero = 1: `ZeroOneOptimizer` over the dp group (optimizer.py; Rajbhandari et al.
        2020, ZeRO P_os, as Megatron-LM's distributed optimizer shards it at any tp): each dp rank
        keeps `optimizer_class`'s state for its share of this rank's parameters (tensor-parallel
        shards included), steps those and broadcasts them to the other dp ranks. In a bf16 plan the
        fp32 masters are sharded too (Megatron-LM's distributed optimizer): each rank keeps the
        values of the masters it owns only (`holds_values`), and owners broadcast the bf16 working
        copies. zero >= 2: the parameters are FSDP shards (fsdp.py), so a plain optimizer over them
        holds and steps only this rank's shard."""
        if self.plan.zero != 1 or self.layout.dp_group is None:
            return optimizer_class(self._param_groups(), **kwargs)
        from autoplan.runtime.optimizer import ZeroOneOptimizer

        working = self.precision.working_of if self.precision is not None else None
        optimizer = ZeroOneOptimizer(self._param_groups(), optimizer_class, group=self.layout.dp_group,
                                     working=working, **kwargs)
        if self.precision is not None:  # the other dp ranks' masters: no fp32 values here
            self.precision.release_masters({id(p) for p in optimizer.owned_parameters()})
        return optimizer

    def _param_groups(self) -> list[dict[str, Any]]:
        """This rank's parameters as optimizer groups: tensor-parallel shards (DTensors) apart from
        plain tensors, since torch's fused and foreach optimizers run one kernel per group and
        refuse a group that mixes the two (`aten._fused_adamw_ got mixed torch.Tensor and DTensor`)."""
        from torch.distributed.tensor import DTensor

        groups: dict[Any, list[nn.Parameter]] = {}  # by mesh: one kernel's DTensors share one (FSDP x tp: 2-D)
        for p in self.parameters():
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
    def _microbatches(self, inputs: Sequence[Any], target: Any) -> list[dict[str, Any]]:
        plan = self.plan
        local = plan.micro_batch_size * plan.num_microbatches
        names = self.input_names
        values = dict(zip(names, inputs))
        if target is not None:
            values[names[-1]] = target
        needed = [n for n in names if n not in values]
        used = {n for s in self.stages.values() for n in s.spec.data_inputs}
        if any(n in used for n in needed):
            raise PartitionError(f"step() needs inputs {names} (target=... for the loss), got {list(values)}")
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
                if self.context is not None:
                    value = shard_sequence(value, self.context.positions, plan.job.seq_len)
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
        if self.precision is not None:
            self.precision.refresh()  # the optimizer stepped the fp32 masters since the last step
        microbatches = self._microbatches(inputs, target)
        self.executor.grad_scale = 1.0 if self.loss_scaler is None else self.loss_scaler.scale
        start_step(self._fsdp_roots, self.plan.pp)
        with recording_aux_losses() as aux_losses:
            if self.context is not None:  # this rank's chunks of every sequence (runtime/context.py)
                with holding_positions(self.context.positions), self.context:
                    loss = self.executor.run(microbatches)
            else:
                loss = self.executor.run(microbatches)
        aux = self._aux_loss(aux_losses)
        if aux is not None and self.executor.grad_scale != 1.0:  # recorded with the loss scale's factor
            aux = aux / self.executor.grad_scale
        fsdp_start = time.perf_counter()
        finish_step(self._fsdp_roots, self.plan.pp)  # FSDP's reduce-scatter under pp > 1 (fsdp.py)
        fsdp_end = time.perf_counter()
        if self.precision is not None:
            self.precision.flush_grads()
        if self.plan.tp > 1:  # DTensor gradients laid out as their parameters (see grad_like_param)
            for _, p in self._params:
                if p.grad is not None:
                    p.grad = grad_like_param(p, p.grad)
        # The step's tail after the pipeline, for traces (the cost model's `tails`).
        self.last_reductions = []
        if self._fsdp_roots and self.plan.pp > 1 and self.layout.dp_group is not None:
            self.last_reductions.append(("DP_GRAD_SYNC", fsdp_start, fsdp_end))
        tie_start = time.perf_counter()
        for name, group in self.layout.tie_groups.items():
            local = [p for n, p in self._params if self.aliases.get(n) == name]
            all_reduce_grads(local, group, average=False)
        if self.layout.tie_groups:
            self.last_reductions.append(("TIED_GRAD_SYNC", tie_start, time.perf_counter()))
        if not self._fsdp_roots and self.layout.dp_group is not None:  # FSDP reduced its gradients itself
            dp_start = time.perf_counter()
            experts = {id(p) for p in self.expert_params}
            all_reduce_grads([p for _, p in self._params if id(p) not in experts], self.layout.dp_group, average=True)
            if self.expert_params:
                reduce_expert_grads(self.expert_params, self.layout.expert_dp_group, self.plan.dp)
            self.last_reductions.append(("DP_GRAD_SYNC", dp_start, time.perf_counter()))
        if self.loss_scaler is not None:  # the fp32 gradients, accumulated and reduced, at their true size
            self.loss_scaler.unscale_([p.grad for _, p in self._params if p.grad is not None])
        if loss is not None and aux is not None:
            loss = loss + aux
        if loss is not None and self.layout.dp_group is not None:
            dist.all_reduce(loss, group=self.layout.dp_group)
            loss /= self.plan.dp
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


def partition(
    model: nn.Module | str | ModelSource,
    plan: Plan | str | os.PathLike,
    *,
    example_inputs: Sequence[Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    timeout: timedelta = DEFAULT_TIMEOUT,
    leaf_modules: Sequence[str] | None = None,
    tracer: str | None = None,
) -> PartitionedModel:
    """This rank's stages of `model` under `plan`: a spec string (a zoo model, `file.py:function`,
    `hf:...`; built here on meta), a `ModelSource`, or an nn.Module with `example_inputs`.

    A model on meta is materialized stage by stage, initialized by parameter name with `seed` (the
    values the whole model would get); a model with real weights has only this rank's parameters
    moved to `device`, and the dp replicas take dp rank 0's values. `example_inputs` fix the graph
    (their batch size does not matter). `loss_fn(output, target)` receives what the model returns;
    without one, the source's loss (the default: cross entropy on the logits, see
    [Note: the default loss] in graph/source.py). `example_target` is optional: the target's shape
    follows the model's output. The default process group is initialized from the torchrun
    environment when none exists.
    """
    _check_partition_arguments(example_inputs, loss_fn, example_target, device, seed, timeout, leaf_modules, tracer)
    if isinstance(plan, str | os.PathLike):  # a plan file, as `autoplan run` takes it (validated on load)
        plan = Plan.load(plan)
    elif isinstance(plan, Plan):  # an object gets the checks a file gets on load
        problems = validate(plan)
        if problems:
            raise PlanError(f"the plan is inconsistent: {problems[0]}; re-create it with autoplan.suggest")
    else:
        raise TypeError(f"plan must be a Plan (autoplan.suggest(...)[0]) or a plan file's path, got "
                        f"{type(plan).__name__}")
    leaf_modules = plan.leaf_modules if leaf_modules is None else leaf_modules  # traced as planned
    tracer = plan.tracer if tracer is None else tracer
    try:
        source = as_source(model, example_inputs, loss_fn)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    model = source.build("meta")
    loss_fn = loss_fn or source.loss_fn
    seq_len = plan.job.seq_len if source.default_seq_len is not None else None
    if example_inputs is None or (seq_len is not None and seq_len != source.default_seq_len):
        example_inputs = source.example_inputs(plan.micro_batch_size, seq_len, device="meta")
    _check_fingerprint(model, plan)
    _compute_dtype(plan)
    _check_sharding(plan)
    device = torch.device(device) if device is not None else default_device()
    # Traced at the micro-batch size (torch.export specializes, and asserts, the batch it saw).
    traced, graph_inputs, output_template, example_inputs, example_target, batch = _trace_for_plan(
        model, plan, example_inputs, source=source, loss_fn=loss_fn, example_target=example_target,
        leaf_modules=leaf_modules, tracer=tracer)
    # The layout from the traced graph, as the profile found it (check_model).
    tp_plan = check_model(model, plan, traced=traced, graph_inputs=graph_inputs)
    tp_plan = _check_tp_tracing(traced, tp_plan, plan.sequence_parallel)
    fused = [path for path, style in tp_plan.items() if style == "colwise-qkv"]
    if fused and plan.zero >= 2:
        raise PartitionError(f"zero {plan.zero} (FSDP) with tp {plan.tp} cannot shard the fused q/k/v projection "
                             f"'{fused[0]}' (FSDP would split its tensor-parallel [q | k | v] thirds again along the "
                             "same dim); re-plan with --zero 1 or --tp 1")
    if tuple(traced.block_names) != tuple(plan.block_names):
        raise PartitionError(f"the model traces into {len(traced.block_names)} blocks but the plan names "
                             f"{len(plan.block_names)}; trace with the same leaf_modules and tracer as the plan")

    # Shapes of everything at the micro-batch size, on fake tensors (see [Note: crossing values]).
    param = next(model.parameters(), None)
    prop_device = param.device if param is not None else torch.device("cpu")
    if traced.tracer == "export":
        retarget_device(traced.gm, prop_device)
    batch = _batch_size(graph_inputs)
    fake_inputs = {}
    for name, value in zip(traced.input_names, graph_inputs):
        if isinstance(value, torch.Tensor):
            shape = list(value.shape)
            if value.dim() > 0 and shape[0] == batch:
                shape[0] = plan.micro_batch_size
            if plan.cp > 1 and value.dim() > 1 and shape[1] == plan.job.seq_len:  # this rank's share of it
                shape[1] = plan.job.seq_len // plan.cp
            value = torch.empty(shape, dtype=value.dtype, device=prop_device)
        fake_inputs[name] = value
    values = propagate_values(traced, fake_inputs)
    specs = plan_stage_specs(traced, plan.boundaries, values)
    if traced.tracer == "export":
        retarget_device(traced.gm, device)

    if plan.cp > 1 and not getattr(type(model), POSITIONS_ATTRIBUTE, False):
        raise PartitionError(f"the plan has cp {plan.cp} but {type(model).__name__} does not read token positions "
                             "from autoplan's sequence_positions() (graph/positions.py); re-plan it with "
                             "`autoplan suggest` (cp 1)")
    if plan.cp > 1 and expert_modules(traced.gm):
        raise PartitionError(f"the plan has cp {plan.cp} but the model has experts, whose capacity and balance loss "
                             "are per whole sequence; re-plan it with `autoplan suggest` (cp 1)")
    if plan.ep > 1 and not expert_modules(traced.gm):
        raise PartitionError(f"the plan has ep {plan.ep} but the model has no grouped experts (graph/experts.py) to "
                             "split; re-plan it with `autoplan suggest` (ep 1)")
    init_distributed(timeout, world_size=plan.num_gpus)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != plan.num_gpus:
        raise PartitionError(f"the plan needs {plan.num_gpus} ranks (tp {plan.tp} * pp {plan.pp} * dp {plan.dp}) "
                             f"but the process group has {world_size}")

    # Which pipeline ranks hold a copy of each tied parameter (from the graph: the same on every rank).
    all_modules = build_stage_modules(traced, specs)
    aliases = tied_parameter_names(model)
    holders: dict[str, list[int]] = {}
    for index, module in all_modules.items():
        for name, _ in module.named_parameters(remove_duplicate=False):
            if name in aliases:
                holders.setdefault(aliases[name], []).append(plan.stages[index].pp_rank)
    layout = build_layout(plan, rank, world_size, device.type, holders, timeout=timeout)

    mine = {s.index: all_modules[s.index] for s in plan.stages if s.pp_rank == layout.pp_index}
    on_meta = any(p.device.type == "meta" for m in mine.values() for p in m.parameters())
    sequence_parallel = bool(tp_plan) and plan.sequence_parallel
    layers = list(tp_plan.layers) if sequence_parallel else []

    shared: dict = {}  # a parameter two of this rank's stages share stays one (apply_tensor_parallel)

    def shard(module: nn.Module) -> None:
        apply_tensor_parallel(module, tp_plan, layout.tp_mesh, sequence_parallel=sequence_parallel,
                              model_layers=layers, shared=shared)

    if tp_plan and on_meta:  # shard on meta, then allocate only the shards (see materialize_stages)
        for module in mine.values():
            shard(module)
    materialize_stages(list(mine.values()), device, seed=seed, aliases=aliases, init=source.init_weights)
    if not on_meta and layout.dp_group is not None:  # replicas built apart start from dp rank 0's weights (as DDP)
        _broadcast_from_first_replica(list(mine.values()), layout, plan)
    if tp_plan and not on_meta:  # real weights: each rank keeps its slice of the moved tensors
        for module in mine.values():
            shard(module)
    expert_params: list[nn.Parameter] = []
    # Found before slicing: a slice no longer has num_experts experts (graph/experts.py).
    experts_of = {i: list(expert_modules(module).values()) for i, module in mine.items()} if plan.ep > 1 else {}
    if plan.ep > 1:  # each rank keeps its 1/ep of the experts (runtime/experts.py)
        expert_params = shard_experts(list(mine.values()), layout.ep_group, layout.ep_index, plan.ep)
    if sequence_parallel:  # between two layers only this rank's 1/tp of the sequence crosses a cut
        layer_blocks = {i for i, name in enumerate(traced.block_names) if name in set(layers)}
        specs = [_sequence_sharded(spec, layer_blocks, plan.tp) for spec in specs]
    compute_dtype = _compute_dtype(plan)
    fsdp = plan.zero >= 2  # FSDP2 ([Note: FSDP under the pipeline executor] in fsdp.py)
    precision = None
    if compute_dtype != torch.float32 and not fsdp:
        precision = MixedPrecision(list(mine.values()), compute_dtype)
    elif compute_dtype != torch.float32:  # FSDP's policy casts the parameters; buffers are cast here
        cast_buffers(list(mine.values()), compute_dtype)
    stages = {i: Stage(specs[i], module, runner=_recompute_runner(traced, plan, specs[i], module))
              for i, module in mine.items()}
    if getattr(tp_plan, "inlined", False):  # see [Note: tensor parallelism on an inlined graph] in parallel.py
        from autoplan.runtime.parallel import DTensorStage

        for stage in stages.values():
            stage.runner = DTensorStage(stage.runner or stage.module, layout.tp_mesh)
    if fsdp:
        _check_unshared(mine, plan)
        for index, stage in stages.items():
            stage.runner = shard_stage(stage.module, stage.runner, mesh=layout.fsdp_mesh, zero=plan.zero,
                                       compute_dtype=compute_dtype, experts=experts_of.get(index, ()),
                                       expert_mesh=layout.expert_fsdp_mesh, dp=plan.dp)
            stage.params = [p for p in stage.module.parameters() if p.requires_grad]
        # fully_shard replaced the expert slices by sharded parameters
        expert_params = [p for units in experts_of.values() for unit in units for p in unit.parameters()]
    schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    executor = PipelineExecutor(
        stages, schedule.with_comms()[layout.pp_index], num_stages=plan.num_stages,
        num_microbatches=plan.num_microbatches, rank_of_stage=lambda s: layout.stage_rank[s],
        comm=P2P(device, plan.num_stages, plan.num_microbatches, timeout,
                 wire_dtype=None if compute_dtype == torch.float32 else compute_dtype),
        split_backward=schedule.split_backward(),
        on_weight_grads=None if precision is None else precision.flush_grads,
    )
    return PartitionedModel(plan=plan, layout=layout, stages=stages, executor=executor,
                            input_names=traced.input_names, aliases=aliases, device=device,
                            batch_size_of_example=batch, precision=precision, compute_dtype=compute_dtype,
                            source=source, expert_params=expert_params,
                            context=ContextParallelAttention(layout.cp_group, plan.cp, layout.cp_index, plan.job.seq_len)
                            if plan.cp > 1 else None,
                            output_template=output_template)


def _check_partition_arguments(example_inputs, loss_fn, example_target, device, seed, timeout, leaf_modules,
                               tracer) -> None:
    """`partition`'s keyword arguments, one line each before anything is traced (a float device was a
    multi-line TypeError from torch.device, a non-tensor target an AttributeError from the loss)."""
    require("example_inputs", example_inputs, (tuple, list), "a tuple or list of the model's inputs", optional=True)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function loss_fn(output, target), got {type(loss_fn).__name__}")
    require("example_target", example_target, torch.Tensor, "a tensor (the loss's target)", optional=True)
    require("device", device, (str, torch.device), "a device such as 'cpu' or 'cuda:0'", optional=True)
    if isinstance(device, str):
        try:
            torch.device(device)
        except RuntimeError:
            raise ValueError(f"device {device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'") from None
    require_int("seed", seed, low=0)
    require("timeout", timeout, timedelta, "a datetime.timedelta (how long a rank waits on another)")
    if not timedelta(0) < timeout <= timedelta(seconds=1e6):
        raise ValueError(f"timeout {timeout} must be above 0 and at most 1e6 s (how long a rank waits on another)")
    if leaf_modules is not None:
        require_strings("leaf_modules", leaf_modules)
    require("tracer", tracer, str, "one of auto, fx, export or modules", optional=True)


@torch.no_grad()
def _broadcast_from_first_replica(modules: Sequence[nn.Module], layout: ParallelLayout, plan: Plan) -> None:
    """Copy dp rank 0's parameters and buffers to the other replicas of this stage."""
    src = plan.rank(layout.pp_index, 0, layout.tp_index)
    seen: set[int] = set()
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                dist.broadcast(tensor.data, src=src, group=layout.dp_group)
