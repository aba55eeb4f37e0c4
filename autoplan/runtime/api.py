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

With tp > 1 (built-in gpt / llama models only; see parallel.py) the attention and MLP linears of
this rank's stages are sharded with torch's ColwiseParallel / RowwiseParallel over the plan's "tp"
mesh axis; those parameters (and their gradients) are `DTensor`s under their usual names:
`.to_local()` is this rank's shard, `.full_tensor()` gathers the whole (a collective over the tp
group). Every other parameter (embeddings, norms, head) is a plain replicated tensor. Every tp rank
of the last stage returns the loss.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan.graph import zoo
from autoplan.graph.profile import model_fingerprint
from autoplan.graph.trace import retarget_device, trace_with_loss
from autoplan.plan import Plan
from autoplan.runtime.comm import P2P
from autoplan.runtime.executor import ActionRecord, PipelineExecutor, Stage
from autoplan.runtime.parallel import (
    TP_SUPPORTED,
    ParallelLayout,
    TensorParallelError,
    all_reduce_grads,
    apply_tensor_parallel,
    build_layout,
    grad_like_param,
    reduce_grads_to_owners,
    sequence_parallel_layers,
    tensor_parallel_plan,
)
from autoplan.runtime.precision import MixedPrecision
from autoplan.runtime.split import (
    build_stage_modules,
    materialize_stages,
    plan_stage_specs,
    propagate_values,
    tied_parameter_names,
)
from autoplan.schedule import make_schedule

__all__ = ["PartitionError", "PartitionedModel", "check_model", "default_device", "init_distributed", "partition"]

DEFAULT_TIMEOUT = timedelta(seconds=60)


class PartitionError(ValueError):
    """The plan cannot run on this model or in this process group (one-line message)."""


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialize the default process group from the torchrun environment (NCCL on CUDA, else gloo)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise PartitionError("no process group and no RANK/WORLD_SIZE in the environment; launch with "
                             "`torchrun --nproc-per-node N -m autoplan run plan.json` or `autoplan run --nproc N`")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(default_device())
    dist.init_process_group(backend, timeout=timeout)


def check_model(model: nn.Module, plan: Plan) -> dict[str, str]:
    """Refuse (one line) a model the plan was not made for, or a plan the runtime cannot run.

    Returns the tensor-parallel plan (linear path -> "colwise" / "rowwise"; empty for tp = 1)."""
    fingerprint = model_fingerprint(model)
    if fingerprint != plan.model_fingerprint:
        raise PartitionError(f"the plan was made for model {plan.model!r} (fingerprint {plan.model_fingerprint}) but this "
                             f"model's fingerprint is {fingerprint}; re-plan with `autoplan suggest` for this model")
    _compute_dtype(plan)
    if plan.tp == 1:
        return {}
    try:
        return tensor_parallel_plan(model, plan.tp)
    except TensorParallelError as exc:
        raise PartitionError(str(exc)) from None


def _check_tp_tracing(traced, tp_plan: Mapping[str, str]) -> None:
    """Sharded linears must run inside modules the graph calls whole (the zoo layers as fx leaf
    modules): torch's parallel styles work by module hooks, and a graph that inlines the attention
    would reshape sharded outputs with full-model head counts."""
    if not tp_plan:
        return
    called = [n.target for n in traced.gm.graph.nodes if n.op == "call_module"]
    for path, style in tp_plan.items():
        if style.startswith("vocab-"):  # the embedding and the head are called themselves
            if path not in called:
                raise PartitionError(f"vocabulary-parallel execution needs '{path}' called whole by the traced graph "
                                     f"(traced with {traced.tracer}); trace with the default fx tracer")
            continue
        parent = path.rpartition(".")[0]
        if not any(parent == t or parent.startswith(t + ".") for t in called):
            raise PartitionError(f"tensor parallelism needs '{parent}' called whole by the traced graph (traced with "
                                 f"{traced.tracer}); trace the {TP_SUPPORTED} with the default fx tracer and leaf modules")


def _compute_dtype(plan: Plan) -> torch.dtype:
    """The plan's compute dtype: fp32, or bf16 with fp32 masters ([Note: mixed precision] in precision.py)."""
    dtype = getattr(torch, plan.job.dtype, None)
    if dtype not in (torch.float32, torch.bfloat16):
        hint = " (fp16 needs loss scaling, which the runtime does not do)" if dtype == torch.float16 else ""
        raise PartitionError(f"the runtime runs plans in bfloat16 or float32, not {plan.job.dtype}{hint}; "
                             f"re-plan with --dtype bf16")
    return dtype


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
                 batch_size_of_example: int | None, precision: MixedPrecision | None = None):
        self.plan = plan
        self.layout = layout
        self.stages = stages
        self.executor = executor
        self.input_names = list(input_names)
        self.aliases = dict(aliases)
        """Every name of a tied parameter -> its first name in the model."""
        self.device = device
        self.precision = precision
        """bf16 working copies with fp32 masters (precision.py), or None for an fp32 plan."""
        self._grad_owner: dict[int, int] | None = None
        """ZeRO-2 (set by `make_optimizer`): id(parameter) -> dp index of the rank that steps it."""
        self.last_reductions: list[tuple[str, float, float]] = []
        """(phase, start, end) of the last step's gradient reductions after the pipeline (perf_counter)."""
        self._params = self._collect_params()

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
        (rows of a column-parallel weight and its bias, columns of a row-parallel weight)."""
        return iter(self._params)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self._params)

    def zero_grad(self) -> None:
        for _, p in self._params:
            p.grad = None
        for stage in self.stages.values():
            for p in stage.params:
                p.grad = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {name: p.detach() for name, p in self._params}
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
        replicas. zero >= 1: torch's `ZeroRedundancyOptimizer` over the dp group (Rajbhandari et
        al. 2020, ZeRO stage 1): each replica keeps the optimizer state of its share of the
        parameters, steps those and broadcasts them to the other replicas. zero = 2 also shards
        the gradients: `step` reduces each gradient to the replica that owns it (instead of an
        all-reduce) and frees it elsewhere, so between steps only the owned gradients are held
        (during the pipelined backward every gradient still exists in full: the reduction runs
        after the last micro-batch, not bucket by bucket as DeepSpeed's does)."""
        if self.plan.zero == 0 or self.layout.dp_group is None:
            return optimizer_class(self.parameters(), **kwargs)
        if self.plan.tp > 1:  # torch's ZeroRedundancyOptimizer broadcasts plain tensors, not DTensor shards
            if dist.get_rank() == 0:
                print(f"warning: the plan has zero = {self.plan.zero} with tp = {self.plan.tp}; the runtime keeps a "
                      "replicated optimizer there: same numerics, more optimizer memory than planned",
                      file=sys.stderr, flush=True)
            return optimizer_class(self.parameters(), **kwargs)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(list(self.parameters()), optimizer_class=optimizer_class,
                                            process_group=self.layout.dp_group, **kwargs)
        if self.plan.zero >= 2:
            shards = optimizer._partition_parameters()  # the shard each dp rank steps, per param group
            self._grad_owner = {id(p): r for r, groups in enumerate(shards) for g in groups for p in g["params"]}
        return optimizer

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
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                rows = value.shape[0]
                if rows == local * plan.dp and plan.dp > 1:
                    value = value[self.layout.dp_index * local:(self.layout.dp_index + 1) * local]
                elif rows != local:
                    raise PartitionError(
                        f"input {name!r} has {rows} rows; expected the global batch {local * plan.dp} or this replica's "
                        f"{local} (micro_batch_size {plan.micro_batch_size} * num_microbatches {plan.num_microbatches})")
                for m, chunk in enumerate(value.to(self.device).chunk(plan.num_microbatches)):
                    out[m][name] = chunk
            else:
                for m in range(plan.num_microbatches):
                    out[m][name] = value
        return out

    def step(self, *inputs: Any, target: Any = None, zero_grad: bool = True) -> torch.Tensor | None:
        """Forward and backward of one batch through the pipeline, gradients reduced.

        Returns the mean loss over the global batch on ranks of the last pipeline stage, else None.
        """
        if zero_grad:
            self.zero_grad()
        if self.precision is not None:
            self.precision.refresh()  # the optimizer stepped the fp32 masters since the last step
        loss = self.executor.run(self._microbatches(inputs, target))
        if self.precision is not None:
            self.precision.flush_grads()
        if self.plan.tp > 1:  # DTensor gradients laid out as their parameters (see grad_like_param)
            for _, p in self._params:
                if p.grad is not None:
                    p.grad = grad_like_param(p, p.grad)
        params = dict(self._params)
        tie_start = time.perf_counter()
        for name, group in self.layout.tie_groups.items():
            local = [p for n, p in self._params if self.aliases.get(n) == name]
            all_reduce_grads(local, group, average=False)
        dp_start = time.perf_counter()
        if self._grad_owner is not None:  # ZeRO-2: each gradient only where its optimizer shard is
            reduce_grads_to_owners(params.values(), self._grad_owner, self.layout.dp_group)
        else:
            all_reduce_grads(params.values(), self.layout.dp_group, average=True)
        dp_end = time.perf_counter()
        # The step's tail after the pipeline, for traces (the cost model's `tails`).
        self.last_reductions = []
        if self.layout.tie_groups:
            self.last_reductions.append(("TIED_GRAD_SYNC", tie_start, dp_start))
        if self.layout.dp_group is not None:
            self.last_reductions.append(("DP_GRAD_SYNC", dp_start, dp_end))
        if loss is not None and self.layout.dp_group is not None:
            dist.all_reduce(loss, group=self.layout.dp_group)
            loss /= self.plan.dp
        return loss


def partition(
    model: nn.Module | str,
    plan: Plan,
    *,
    example_inputs: Sequence[Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    timeout: timedelta = DEFAULT_TIMEOUT,
    leaf_modules: Sequence[str] = (),
    tracer: str = "auto",
) -> PartitionedModel:
    """This rank's stages of `model` (an nn.Module, or a zoo spec built here on meta) under `plan`.

    A model on meta is materialized stage by stage (`zoo.init_weights` with `seed`); a model with
    real weights has only this rank's parameters moved to `device`. `example_inputs` (and
    `example_target` with `loss_fn`) fix the graph; their batch size does not matter. The default
    process group is initialized from the torchrun environment when none exists.
    """
    if isinstance(model, str):
        spec = zoo.parse_model_spec(model)
        model = zoo.build_model(spec, device="meta")
        if example_inputs is None and spec.family != "file":
            example_inputs = zoo.example_inputs(spec, plan.micro_batch_size, plan.job.seq_len, device="meta")
            example_target = zoo.example_targets(spec, plan.micro_batch_size, plan.job.seq_len, device="meta")
            loss_fn = loss_fn or zoo.lm_loss
    if example_inputs is None:
        raise PartitionError("partition() needs example_inputs for an nn.Module, e.g. (torch.randint(0, V, (1, 128)),)")
    tp_plan = check_model(model, plan)
    device = torch.device(device) if device is not None else default_device()
    # Trace at the micro-batch size: torch.export specializes (and asserts) the batch it saw.
    batch = _batch_size(tuple(example_inputs))
    example_inputs = tuple(_with_batch(t, batch, plan.micro_batch_size) for t in example_inputs)
    if example_target is not None:
        example_target = _with_batch(example_target, batch, plan.micro_batch_size)

    traced, graph_inputs = trace_with_loss(model, example_inputs, loss_fn=loss_fn, example_target=example_target,
                                           leaf_modules=leaf_modules, tracer=tracer)
    _check_tp_tracing(traced, tp_plan)
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
            value = torch.empty(shape, dtype=value.dtype, device=prop_device)
        fake_inputs[name] = value
    values = propagate_values(traced, fake_inputs)
    specs = plan_stage_specs(traced, plan.boundaries, values)
    if traced.tracer == "export":
        retarget_device(traced.gm, device)

    init_distributed(timeout)
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
    layout = build_layout(plan, rank, world_size, device.type, holders)

    mine = {s.index: all_modules[s.index] for s in plan.stages if s.pp_rank == layout.pp_index}
    on_meta = any(p.device.type == "meta" for m in mine.values() for p in m.parameters())
    sequence_parallel = bool(tp_plan) and plan.sequence_parallel
    layers = sequence_parallel_layers(model) if sequence_parallel else []

    def shard(module: nn.Module) -> None:
        apply_tensor_parallel(module, tp_plan, layout.tp_mesh, sequence_parallel=sequence_parallel,
                              model_layers=layers)

    if tp_plan and on_meta:  # shard on meta, then allocate only the shards (see materialize_stages)
        for module in mine.values():
            shard(module)
    materialize_stages(list(mine.values()), device, seed=seed, aliases=aliases)
    if tp_plan and not on_meta:  # real weights: each rank keeps its slice of the moved tensors
        for module in mine.values():
            shard(module)
    if sequence_parallel:  # between two layers only this rank's 1/tp of the sequence crosses a cut
        layer_blocks = {i for i, name in enumerate(traced.block_names) if name in set(layers)}
        specs = [_sequence_sharded(spec, layer_blocks, plan.tp) for spec in specs]
    compute_dtype = _compute_dtype(plan)
    precision = MixedPrecision(list(mine.values()), compute_dtype) if compute_dtype != torch.float32 else None
    stages = {i: Stage(specs[i], module, runner=_recompute_runner(traced, plan, specs[i], module))
              for i, module in mine.items()}
    schedule = make_schedule(plan.schedule, plan.pp, plan.num_microbatches, plan.virtual_stages)
    executor = PipelineExecutor(
        stages, schedule.with_comms()[layout.pp_index], num_stages=plan.num_stages,
        num_microbatches=plan.num_microbatches, rank_of_stage=lambda s: layout.stage_rank[s],
        comm=P2P(device, plan.num_stages, plan.num_microbatches, timeout,
                 wire_dtype=None if precision is None else compute_dtype),
        split_backward=schedule.split_backward(),
        on_weight_grads=None if precision is None else precision.flush_grads,
    )
    return PartitionedModel(plan=plan, layout=layout, stages=stages, executor=executor,
                            input_names=traced.input_names, aliases=aliases, device=device,
                            batch_size_of_example=batch, precision=precision)
