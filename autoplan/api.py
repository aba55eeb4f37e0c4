"""The public Python API: turn a model (a spec string or an nn.Module) into a profile, plans, a
partitioned model. The CLI calls these functions and nothing else."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoplan import models as zoo
from autoplan._checks import require, require_int, require_paths, require_strings
from autoplan.cluster import Cluster, parse_cluster, with_collective_curves
from autoplan.cost.calibration import Calibrations
from autoplan.graph.blocks import ModelProfile
from autoplan.graph.profile import Progress, profile_module
from autoplan.graph.tp_layout import replicated_note
from autoplan.graph.trace import TracedModel, trace_model
from autoplan.plan import MAX_JOB_SIZE, Job, Plan
from autoplan.search._gc import gc_paused
from autoplan.search.space import SearchResult, search_plans
from autoplan.sources import ModelSource, ModuleSource, as_source, trace_with_target

__all__ = ["ProfiledModel", "parse_dtype", "profile", "profile_with_graph", "suggest", "suggest_with_stats"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} cannot be a compute dtype; use one of bf16, fp16, fp32")
        return dtype
    require("dtype", dtype, str, "a string (bf16, fp16 or fp32) or a torch.dtype")
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype '{dtype}'; use one of bf16, fp16, fp32") from None


@dataclass
class ProfiledModel:
    """A model with its graph and profile, and the source that rebuilds it (used by the runtime)."""

    model: nn.Module
    traced: TracedModel
    profile: ModelProfile
    example_inputs: tuple
    source: ModelSource
    loss_fn: Callable[..., torch.Tensor] | None

    @property
    def spec(self) -> zoo.ModelSpec | None:
        """The zoo / file spec, for callers of the first wave."""
        return getattr(self.source, "model_spec", None)


def profile_with_graph(
    model: str | nn.Module | ModelSource,
    *,
    batch_size: int = 1,
    seq_len: int | None = None,
    example_inputs: Sequence[Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: torch.Tensor | None = None,
    dtype: str | torch.dtype = "bf16",
    device: str = "meta",
    leaf_modules: Sequence[str] = (),
    tracer: str = "auto",
    cache_dir: str | os.PathLike | None = None,
    progress: Progress | None = None,
) -> ProfiledModel:
    """Build (for a spec), trace and profile a model; see `profile`."""
    # Analytic profiling builds on meta and runs on fake tensors (no memory to reclaim) and
    # allocates heavily, torch._dynamo's import included; see search/_gc.py. Timed profiling
    # allocates real tensors, so the collector stays on there.
    with gc_paused() if device == "meta" else contextlib.nullcontext():
        return _profile_with_graph(model, batch_size=batch_size, seq_len=seq_len, example_inputs=example_inputs,
                                   loss_fn=loss_fn, example_target=example_target, dtype=dtype, device=device,
                                   leaf_modules=leaf_modules, tracer=tracer, cache_dir=cache_dir, progress=progress)


def _profile_with_graph(model, *, batch_size, seq_len, example_inputs, loss_fn, example_target, dtype, device,
                        leaf_modules, tracer, cache_dir, progress) -> ProfiledModel:
    torch_dtype = parse_dtype(dtype)
    require_int("batch_size", batch_size, high=MAX_JOB_SIZE)
    require_int("seq_len", seq_len, high=MAX_JOB_SIZE, optional=True)
    require("device", device, str, "a string (meta, cpu or cuda)")
    require("tracer", tracer, str, "a string (auto, fx, export or modules)")
    require_strings("leaf_modules", leaf_modules)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function loss_fn(output, target), got {type(loss_fn).__name__}")
    require("example_target", example_target, torch.Tensor, "a tensor (the loss's target)", optional=True)
    if example_inputs is not None:
        require("example_inputs", example_inputs, (tuple, list), "a tuple or list of the model's inputs")
    source = as_source(model, example_inputs, loss_fn)
    module = source.build("meta")
    if example_inputs is None:
        seq_len = seq_len or source.default_seq_len
        source.check_seq_len(seq_len)
        inputs = source.example_inputs(batch_size, seq_len, device="meta")
    else:  # the caller's inputs: their batch dimension is the profiled batch; re-made at another length
        given = tuple(example_inputs)
        inputs = given
        if seq_len is not None and seq_len != source.default_seq_len:
            source.check_seq_len(seq_len)
            rows = next((t.shape[0] for t in given if isinstance(t, torch.Tensor) and t.dim() > 0), batch_size)
            where = next((t.device for t in given if isinstance(t, torch.Tensor)), torch.device("meta"))
            inputs = source.example_inputs(rows, seq_len, device=where)
        seq_len = seq_len or source.default_seq_len
    loss = loss_fn or source.loss_fn
    if isinstance(source, ModuleSource) and loss_fn is None:
        loss = None  # an API model without a loss is profiled as given (its head's cost only)
    if loss is None:
        traced = trace_model(module, inputs, leaf_modules=leaf_modules, tracer=tracer)
        graph_inputs = list(inputs)
    else:
        rows = next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), batch_size)
        if example_target is None and example_inputs is None:
            example_target = source.static_target(rows, seq_len)
        traced, graph_inputs, _ = trace_with_target(
            module, inputs, loss, example_target=example_target, leaf_modules=leaf_modules, tracer=tracer,
            target_maker=lambda out, rows: source.target(out.shape, out.dtype, rows, device="meta"))
    rows = next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), batch_size)
    prof = profile_module(module, traced, graph_inputs, model_name=source.name, info=source.info,
                          positions_refusal=source.context_parallel_refusal(module),
                          experts_route_tokens_alone=source.routes_tokens_alone(module), dtype=torch_dtype,
                          device=device, batch_size=rows,
                          seq_len=seq_len or 1,  # a model without a sequence counts samples
                          cache_dir=cache_dir, progress=progress)
    return ProfiledModel(module, traced, prof, tuple(inputs), source, loss)


def profile(model: str | nn.Module, **kwargs: Any) -> ModelProfile:
    """Profile a model: a zoo spec (`"llama3-8b:num_layers=4"`, `"path/to/file.py:function"`), an
    nn.Module with `example_inputs`, or a transformers model object (as its `hf:` spec). Keyword
    arguments: `batch_size`, `seq_len`, `dtype` (bf16/fp16/fp32), `device` (meta/cpu/cuda: cpu and cuda time every block), `leaf_modules`,
    `tracer` (auto/fx/export/modules), `loss_fn` and `example_target` (append a loss), `cache_dir`,
    `progress` (a callback (done, total, block name))."""
    return profile_with_graph(model, **kwargs).profile


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _calibrations(calibration: Any) -> Calibrations:
    if calibration is None:
        return Calibrations()
    if isinstance(calibration, Calibrations):
        return calibration
    require_paths("calibration", calibration)
    if isinstance(calibration, (str, os.PathLike)):
        calibration = [calibration]
    return Calibrations.from_files(list(calibration))


def suggest_with_stats(
    model: str | nn.Module,
    cluster: str | Cluster,
    *,
    global_batch: int,
    seq_len: int | None = None,
    example_inputs: Sequence[Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: torch.Tensor | None = None,
    top: int = 5,
    dtype: str | torch.dtype = "bf16",
    intra_node_bw_gbps: float | None = None,
    inter_node_bw_gbps: float | None = None,
    profile_device: str = "meta",
    leaf_modules: Sequence[str] = (),
    tracer: str = "auto",
    progress: Progress | None = None,
    search_progress: Progress | None = None,
    calibration: str | os.PathLike | Sequence[str | os.PathLike] | Calibrations | None = None,
    stack: str | None = None,
    explain: bool = False,
    target: str | None = None,
    **pins: Any,
) -> tuple[SearchResult, ProfiledModel]:
    """`suggest`, also returning the search statistics and the profiled model. `calibration`: a file
    `autoplan calibrate` wrote (or several, one per GPU type) to use in place of the shipped ones.
    `stack`: a software stack the calibrations name (cost/calibration.py [Note: software stacks];
    None: today's, with flash attention). `explain`: also keep the best rejected configurations per
    reason, with figures and a change checked to fit (`SearchResult.rejections`; the CLI's --explain).
    `target`: "torchtitan", "megatron" or "deepspeed": only plans that trainer runs as planned, so
    `autoplan export --to` it is exact (search/targets.py; the CLI's --target).
    When no configuration gives a plan it raises `NoPlanError` (search/configs.py, a ValueError) whose
    `result` is the SearchResult of what the search did (no plans; the rejections, kept with `explain`)."""
    require_int("global_batch", global_batch, high=MAX_JOB_SIZE)
    rules = _export_rules(target)  # an unknown --target is refused before the model is profiled
    require_int("seq_len", seq_len, high=MAX_JOB_SIZE, optional=True)  # None: the model's own length
    require("top", top, int, "an integer")
    require("explain", explain, bool, "True or False")  # its range is the search's to refuse (after the cluster is parsed)
    require("sequence_parallel", pins.get("sequence_parallel"), bool, "True, False or None", optional=True)
    for name, value in (("intra_node_bw_gbps", intra_node_bw_gbps), ("inter_node_bw_gbps", inter_node_bw_gbps)):
        require(name, value, (int, float), "a number of GB/s", optional=True)
    if isinstance(cluster, str):
        cluster_obj = parse_cluster(cluster, intra_node_bw_gbps=intra_node_bw_gbps, inter_node_bw_gbps=inter_node_bw_gbps)
    elif isinstance(cluster, Cluster):
        cluster_obj = cluster.with_bandwidth(intra_node_bw_gbps, inter_node_bw_gbps)
    else:
        raise ValueError(f"cluster must be a spec string or a Cluster, got {type(cluster).__name__}")
    calibrations = _calibrations(calibration)
    require("stack", stack, str, "a stack name such as 'megatron-lm-2021'", optional=True)
    if stack is not None:
        calibrations = dataclasses.replace(calibrations, stack=stack)
        calibrations.check_stack(cluster_obj.gpu_types)
    for gpu in cluster_obj.gpu_types:  # measured collective curves replace the shipped link figures
        measured = calibrations.overrides.get(gpu.name)
        if measured is not None and measured.collectives:
            cluster_obj = with_collective_curves(cluster_obj, measured.collectives)
    torch_dtype = parse_dtype(dtype)
    # Profile one sequence; every analytic per-micro-batch quantity scales linearly with the batch.
    # Timed blocks do not ([Note: batch scaling] in graph/profile.py): with the micro-batch size
    # pinned, a zoo model is timed at that size, so the plan's block times are measured, not scaled.
    batch = 1
    pinned_mbs = pins.get("micro_batch_size")
    if profile_device != "meta" and example_inputs is None and isinstance(pinned_mbs, int) and pinned_mbs > 1:
        batch = pinned_mbs
    profiled = profile_with_graph(model, batch_size=batch, seq_len=seq_len, example_inputs=example_inputs,
                                  loss_fn=loss_fn, example_target=example_target, dtype=torch_dtype,
                                  device=profile_device, leaf_modules=leaf_modules, tracer=tracer, progress=progress)
    prof = profiled.profile
    job = Job(global_batch=global_batch, seq_len=seq_len or prof.seq_len, dtype=_dtype_name(torch_dtype))
    source = profiled.source
    if isinstance(pins.get("expert_tp"), int) and pins["expert_tp"] > 1 and prof.extra.get("experts"):
        # What `run` would refuse about the experts' hidden units (graph/expert_hidden.py), said here.
        from autoplan.graph.expert_hidden import hidden_split_refusal
        from autoplan.search.configs import PlanningError

        reason = hidden_split_refusal(profiled.model, pins["expert_tp"])
        if reason is not None:
            raise PlanningError(f"--expert-tp {pins['expert_tp']}: {reason}; use --expert-tp 1")
    result = search_plans(prof, cluster_obj, job, model_spec=source.spec, top=top, pins=pins, progress=search_progress,
                          calibrations=calibrations, explain=explain, target=rules)
    # What `run` needs to rebuild and trace the model as planned; it refuses a file changed since.
    recorded = dict(model_digest=source.file_digest() or "", leaf_modules=tuple(leaf_modules), tracer=tracer)
    result = dataclasses.replace(result, plans=[dataclasses.replace(p, **recorded) for p in result.plans])
    plans = []
    for plan in result.plans:  # what tp leaves unsharded, on the plan too (`autoplan show`)
        note = replicated_note(prof.extra.get("tensor_parallel") or {}, plan.tp)
        plans.append(dataclasses.replace(plan, notes=(*plan.notes, note)) if note else plan)
        if note and note not in result.notes:
            result.notes.append(note)
    result = dataclasses.replace(result, plans=plans)
    if profiled.traced.tracer == "modules":  # the fallback graph: say whether it was checked against the model
        result.notes.append(profiled.traced.note)
    if not prof.is_timed:  # which achieved rates priced the plans, and where they come from
        for gpu in cluster_obj.gpu_types:
            cal = calibrations.for_gpu(gpu)
            result.notes.append(f"{gpu.name} priced with: {cal.sources.get('file', '')}; stack {cal.stack}")
    return result, profiled


def suggest(model: str | nn.Module, cluster: str | Cluster, *, global_batch: int, **kwargs: Any) -> list[Plan]:
    """The fastest plans that fit, best first.

    `model` is a zoo spec (`"llama3-8b"`, `"gpt:num_layers=4,..."`, `"file.py:fn"`), an nn.Module
    with `example_inputs` (its batch dimension is taken as the profiled batch), or a transformers
    model object, planned as its `hf:` spec is (cp, ep, expert tp and their checks; no example inputs
    needed: sources/hf_object.py). `cluster` is a
    preset, a compact string (`"2x8xH100-80GB"`) or a YAML path. Keyword arguments: `seq_len`
    (None: the model's own length, as the CLI without --seq-len), `top`, `dtype`, `intra_node_bw_gbps`, `inter_node_bw_gbps`, and pins that fix a dimension:
    `tp, pp, dp, micro_batch_size, schedule, virtual_stages, recompute, zero` (0-3; 2 and 3 are FSDP),
    `dp_replicate` (HSDP replicate degree, with zero 2 / 3), `ep` (expert parallelism over tp x dp
    ranks, for mixture-of-experts models), `expert_tp` (1 or tp: the tp ranks split each expert's hidden
    units), `cp` (context parallelism: dp ranks splitting each
    sequence; dp counts them), `sequence_parallel`, `reduce_dtype` ("float32" or, with zero 2 / 3,
    "bfloat16": the dtype FSDP reduces gradients in). `target` ("torchtitan", "megatron" or
    "deepspeed"): only plans that trainer runs as planned (`autoplan export --to` it is exact).
    When every dimension is pinned the plan is returned even if it does not fit (`plan.fits`).
    """
    result, _ = suggest_with_stats(model, cluster, global_batch=global_batch, **kwargs)
    return result.plans


def _export_rules(target: str | None):
    """`--target`'s exporter rules for the search (the exporters sit on a layer above it)."""
    if target is None:
        return None
    from autoplan.report.export import export_rules

    return export_rules(target)
