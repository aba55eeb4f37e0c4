"""`partition(model, plan)`: this rank's piece of a model, trained by the pipeline executor.

    pm = partition(model, plan, example_inputs=(ids,), loss_fn=loss)
    opt = pm.make_optimizer(torch.optim.AdamW, lr=3e-4)   # sharded as the plan's ZeRO stage says
    loss = pm.step(ids, target=targets)   # the loss on the last pipeline stage, else None
    norm = pm.clip_grad_norm_(1.0)        # optional: the global norm over every rank (clipping.py)
    opt.step()

Only this rank's stages are materialized (see split.py); parameters keep their names in the model.
`step` takes either the global batch (every rank passes the same data; each dp replica takes its
slice) or this replica's batch (micro_batch_size * num_microbatches rows), splits it into
micro-batches, runs the plan's schedule, and reduces gradients (tied copies, then dp) before it
returns, so an optimizer step can follow at once. It zeroes gradients first unless told not to.

With tp > 1 the attention and MLP linears that the model's graph shows (graph/sharding.py: any
model, no table of classes) are sharded over the plan's "tp" mesh axis: with torch's
ColwiseParallel / RowwiseParallel where the traced graph calls those modules whole (fx leaves), or
by running the stage in DTensor where the graph inlines them (torch.export; see tensor_parallel.py).
Sharded parameters (and their gradients) are `DTensor`s under their usual names: `.to_local()` is
this rank's shard, `.full_tensor()` gathers the whole (a collective over the tp group). Every tp
rank of the last stage returns the loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoplan._checks import require, require_int, require_strings
from autoplan.graph.profile import model_fingerprint
from autoplan.plan import Plan, PlanError, validate
from autoplan.runtime.execution.dimensions import Checked, registry
from autoplan.runtime.execution.executor import build_executor
from autoplan.runtime.execution.partitioned import PartitionedModel
from autoplan.runtime.parallel.context import whole_sequence_output
from autoplan.runtime.parallel.errors import PartitionError
from autoplan.runtime.parallel.fsdp import check_sharding
from autoplan.runtime.parallel.mesh import build_mesh
from autoplan.runtime.parallel.precision import compute_dtype
from autoplan.runtime.parallel.split import (
    batch_size_of,
    build_stage_modules,
    materialize,
    split_stages,
    stage_specs,
    tied_parameter_names,
)
from autoplan.runtime.parallel.tensor_parallel import (
    TensorParallelError,
    check_tp_tracing,
    tensor_parallel_plan,
)
from autoplan.sources import ModelSource, OutputTemplate, as_source, trace_with_target

__all__ = ["PartitionError", "PartitionedModel", "check_model", "default_device", "init_distributed", "partition"]

DEFAULT_TIMEOUT = timedelta(seconds=60)


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
    _check_plan_for(model, plan)
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
    batch = batch_size_of(tuple(example_inputs))
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


def _with_batch(value: Any, batch: int | None, size: int) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch or batch == size:
        return value
    reps = -(-size // batch)
    return value.repeat(reps, *([1] * (value.dim() - 1)))[:size]


# [Note: the order of partition's steps]
# `partition` builds a rank's stages in one step per concern, each a function of (the build, the plan,
# the layout) in its own module, in the order of their effects (as torchtitan's parallelize_llama).
# Between the split and the executor, the steps are the dimensions' of runtime/execution/dimensions/registry.py,
# in its order: each one's `apply` (on a model built on meta, tensor parallel's before `materialize`),
# then each one's `wrap` ([Note: a dimension's hooks] in runtime/execution/dimensions/base.py):
# - split: every later step works on this rank's stage modules only (split.py).
# - tensor parallel, before `materialize` on a model built on meta, so that only the shards are
#   allocated (each drawn as its slice of the full model's values); after it on real weights, once
#   the dp replicas hold dp rank 0's weights, so every tp rank slices the same tensors
#   (tensor_parallel.py). Sequence parallelism cuts the stage specs here too.
# - context parallel: the stages' attention calls routed to the name that the cp attention replaces
#   around each step (context.py); the model was traced at a rank's share of the sequence
#   (`_source_on_meta`), the shapes torch.export bakes in.
# - expert parallel, on initialized weights: the experts are found before they are sliced
#   (experts.py).
# - precision, after every step that replaces parameters: the fp32 masters are the final
#   parameters (precision.py).
# - recompute, after precision: the executor's stages collect their parameters, and the recompute
#   pieces refer to the stage modules as they are now (recompute.py).
# - an inlined graph's DTensor runner (tensor parallelism's second half) around the recompute
#   runner, so recomputation runs in DTensor too (tensor_parallel.py `run_in_dtensor`).
# - data parallel: FSDP wraps the finished runner and replaces every parameter by its shard (tp shards
#   become 2-D DTensors); DDP-style and ZeRO-1 change no stage (data_parallel.py, fsdp.py).
# - the executor and its p2p channels over the finished stages (executor.py).
# The refusals each step owns (cp and ep on this model, FSDP over a fused q/k/v: each dimension's
# `refuse`) run before the process group is made, so a plan that cannot run fails in one line
# without communicating.


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
    init: str | os.PathLike | None = None,
) -> PartitionedModel:
    """This rank's stages of `model` under `plan`: a spec string (a zoo model, `file.py:function`,
    `hf:...`; built here on meta), a `ModelSource`, an nn.Module with `example_inputs`, or a
    transformers model object (as its `hf:` spec, with the object's weights; `example_inputs`
    optional: without them `step` takes the spec's inputs, e.g. `(input_ids, None, position_ids)`
    where cp is offered, as `pm.input_names` lists them; sources/hf_object.py).

    A model on meta is materialized stage by stage, initialized by parameter name with `seed` (the
    values the whole model would get); a model with real weights has only this rank's parameters
    moved to `device`, and the dp replicas take dp rank 0's values. `example_inputs` fix the graph
    (their batch size does not matter). `loss_fn(output, target)` receives what the model returns;
    without one, the source's loss (the default: cross entropy on the logits, see
    [Note: the default loss] in sources/base.py). `example_target` is optional: the target's shape
    follows the model's output. The default process group is initialized from the torchrun
    environment when none exists. `init`: pretrained weights (a Hugging Face safetensors directory, a
    torch.save state dict or an autoplan checkpoint), each rank reading only its slices (weights.py).
    """
    _check_partition_arguments(example_inputs, loss_fn, example_target, device, seed, timeout, leaf_modules, tracer)
    plan = _load_plan(plan)
    leaf_modules = plan.leaf_modules if leaf_modules is None else leaf_modules  # traced as planned
    tracer = plan.tracer if tracer is None else tracer
    source, model, loss_fn, example_inputs = _source_on_meta(model, plan, example_inputs, loss_fn)
    _check_plan_for(model, plan)
    device = torch.device(device) if device is not None else default_device()
    # Traced at the micro-batch size (torch.export specializes, and asserts, the batch it saw).
    traced, graph_inputs, output_template, example_inputs, example_target, _ = _trace_for_plan(
        model, plan, example_inputs, source=source, loss_fn=loss_fn, example_target=example_target,
        leaf_modules=leaf_modules, tracer=tracer)
    # The layout from the traced graph, as the profile found it (check_model).
    tp_plan = check_tp_tracing(traced, check_model(model, plan, traced=traced, graph_inputs=graph_inputs),
                               plan.sequence_parallel)
    specs = stage_specs(traced, graph_inputs, plan, model, device)
    dimensions = registry.DIMENSIONS
    checked = Checked(plan=plan, source=source, model=model, traced=traced, tp_plan=tp_plan)
    for dimension in dimensions:
        dimension.refuse(checked)

    init_distributed(timeout, world_size=plan.num_gpus)
    modules, aliases = build_stage_modules(traced, specs), tied_parameter_names(model)
    layout = build_mesh(plan, modules, aliases, device, timeout)
    # The steps, in the order of [Note: the order of partition's steps].
    build = split_stages(modules, plan, layout, traced=traced, specs=specs, tp_plan=tp_plan, aliases=aliases,
                         model=model)
    on_meta = [d for d in dimensions if d.on_meta_first] if build.on_meta else []
    for dimension in on_meta:
        dimension.apply(build, plan, layout)
    materialize(build, plan, layout, device=device, seed=seed, init=source.init_weights)
    for dimension in dimensions:
        if dimension not in on_meta:
            dimension.apply(build, plan, layout)
    for dimension in dimensions:
        dimension.wrap(build, plan, layout)
    executor = build_executor(build, plan, layout, device=device, timeout=timeout)
    pm = PartitionedModel(plan=plan, layout=layout, stages=build.stages, executor=executor,
                          input_names=traced.input_names, aliases=aliases, device=device,
                          batch_size_of_example=batch_size_of(graph_inputs), precision=build.precision,
                          compute_dtype=build.compute_dtype, source=source, expert_params=build.expert_params,
                          context=build.context, output_template=whole_sequence_output(output_template, plan),
                          expert_hidden=build.expert_hidden, dimensions=dimensions)
    if init is not None:
        from autoplan.runtime.checkpoint.weights import load_weights

        load_weights(pm, init)
    return pm


def _check_plan_for(model: nn.Module, plan: Plan) -> None:
    """The checks of a plan against a model before anything is traced: the fingerprint, the
    compute dtype (precision.py) and the data-parallel sharding (fsdp.py)."""
    _check_fingerprint(model, plan)
    compute_dtype(plan)
    check_sharding(plan)


def _load_plan(plan: Plan | str | os.PathLike) -> Plan:
    if isinstance(plan, str | os.PathLike):  # a plan file, as `autoplan run` takes it (validated on load)
        return Plan.load(plan)
    if isinstance(plan, Plan):  # an object gets the checks a file gets on load
        problems = validate(plan)
        if problems:
            raise PlanError(f"the plan is inconsistent: {problems[0]}; re-create it with autoplan.suggest")
        return plan
    raise TypeError(f"plan must be a Plan (autoplan.suggest(...)[0]) or a plan file's path, got "
                    f"{type(plan).__name__}")


def _source_on_meta(model: nn.Module | str | ModelSource, plan: Plan, example_inputs: Sequence[Any] | None,
                    loss_fn: Callable[..., torch.Tensor] | None):
    """The model's source, the model built from it on meta, the loss (`loss_fn`, else the source's)
    and the example inputs (the source's at the micro-batch size and the plan's sequence length,
    unless given for that length; under cp, the length of a rank's share)."""
    try:
        source = as_source(model, example_inputs, loss_fn)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    model = source.build("meta")
    loss_fn = loss_fn or source.loss_fn
    seq_len = plan.job.seq_len if source.default_seq_len is not None else None
    if seq_len is not None and plan.cp > 1:
        # Traced at this rank's share of each sequence: the shapes torch.export bakes into a graph
        # are those the stages run at (runtime/parallel/context.py).
        seq_len //= plan.cp
    if example_inputs is None or (seq_len is not None and seq_len != source.default_seq_len):
        example_inputs = source.example_inputs(plan.micro_batch_size, seq_len, device="meta")
    return source, model, loss_fn, example_inputs


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
