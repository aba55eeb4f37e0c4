"""Pipeline stages for one rank: sub-graphs of the traced model, only their parameters materialized.

The model is traced once (on meta for zoo models); every stage is `extract_submodule` over its
block range, so parameters keep their names in the model. Values that cross a cut are found from
the graph, and their shapes and dtypes at the micro-batch size come from one fake-tensor run of the
whole graph, so receive buffers are allocated without per-step shape handshakes.

[Note: crossing values]
The values sent over cut c (after stage k) are every non-input value produced before the cut and
used after it (`crossing_values`). A value produced at stage k - 1 and used at stage k + 1 (a skip
connection) crosses cuts k - 1 and k, so stage k forwards it unchanged; its gradient at stage k is
the gradient received for it plus the gradient of stage k's own uses. Model inputs (token ids,
targets) never cross: every stage reads the ones it uses from the data. Non-tensor values (Python
ints computed from shapes) are constants at a fixed micro-batch shape and are taken from the fake
run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autoplan.graph.trace import TracedModel, crossing_values, extract_submodule, retarget_device
from autoplan.runtime.parallel.errors import PartitionError
from autoplan.sources import tied_parameter_names  # noqa: F401 - re-exported: the runtime's callers use it here

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout

__all__ = ["CrossingValue", "StageBuild", "StageSpec", "batch_size_of", "build_stage_modules", "materialize",
           "materialize_stages", "plan_stage_specs", "propagate_values", "split_stages", "stage_specs",
           "tied_parameter_names"]


@dataclass(frozen=True)
class CrossingValue:
    """One value sent over a cut: a tensor of known shape and dtype, or a constant."""

    name: str
    shape: tuple[int, ...] | None
    """None for a non-tensor constant."""
    dtype: torch.dtype | None
    requires_grad: bool
    constant: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class StageSpec:
    """What a stage computes and exchanges; identical on every rank (derived from the graph)."""

    index: int
    first_block: int
    end_block: int
    """Exclusive."""
    inputs: tuple[str, ...]
    """Placeholders of the stage's GraphModule, in order."""
    data_inputs: tuple[str, ...]
    """Model inputs (e.g. input_ids, target) the stage reads from the data."""
    outputs: tuple[str, ...]
    """Outputs of the stage's GraphModule, in order (the loss for the last stage)."""
    recv: tuple[CrossingValue, ...]
    """Values crossing the cut before this stage (received from stage index - 1)."""
    send: tuple[CrossingValue, ...]
    """Values crossing the cut after this stage (sent to stage index + 1); empty for the last."""


@dataclass
class StageBuild:
    """What `partition`'s steps build for this rank's stages, handed from one step to the next
    ([Note: the order of partition's steps] in api.py): each step reads and replaces fields here."""

    traced: TracedModel
    specs: list[StageSpec]
    """Every stage's spec (this rank's and the others'), by stage index; sequence parallelism cuts
    the values crossing a cut between two layers (tensor_parallel.py)."""
    modules: dict[int, nn.Module]
    """This rank's stage modules by stage index (the model's own modules and parameter names)."""
    tp_plan: Mapping[str, str]
    """The tensor-parallel layout as the traced graph runs it (tensor_parallel.py `check_tp_tracing`);
    empty for tp 1."""
    aliases: dict[str, str]
    """Every name of a tied parameter -> its first name in the model."""
    on_meta: bool
    """Whether the stage modules were built on meta (a model spec), not with real weights."""
    compute_dtype: torch.dtype = torch.float32
    """What the stages compute in (precision.py `compute_dtype`)."""
    precision: Any = None
    """precision.MixedPrecision: bf16 / fp16 working copies with fp32 masters, or None."""
    expert_params: list[nn.Parameter] = field(default_factory=list)
    """This rank's slices of the experts under expert parallelism (experts.py), else empty."""
    experts_of: dict[int, list[nn.Module]] = field(default_factory=dict)
    """Stage index -> its grouped-experts modules (ep > 1), found before they are sliced."""
    expert_hidden: dict[str, Any] = field(default_factory=dict)
    """Under expert tp: an experts parameter's name -> where its hidden units are (expert_tp.py)."""
    context: Any = None
    """context.ContextParallelAttention for cp > 1, else None."""
    model: nn.Module | None = None
    """The whole model as the source built it: the classes of the modules a graph traced by
    torch.export inlines (experts.py runs routed experts through them)."""
    stages: dict[int, Any] = field(default_factory=dict)
    """executor.Stage by stage index: the modules with their runners (made by recompute.py's step)."""


def propagate_values(traced: TracedModel, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Run the whole graph on fake tensors shaped like `inputs`; node name -> fake value.

    Parameters may be real or on meta; nothing is allocated. Inputs on meta are run on meta.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    values: dict[str, Any] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            values[n.name] = result
            return result

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        args = [mode.from_tensor(inputs[n]) if isinstance(inputs[n], torch.Tensor) else inputs[n]
                for n in traced.input_names]
        _Recorder(traced.gm).run(*args)
    return values


def _crossing(traced: TracedModel, cut_after: int, values: Mapping[str, Any]) -> tuple[CrossingValue, ...]:
    out = []
    for node in crossing_values(traced, cut_after):
        v = values[node.name]
        if isinstance(v, torch.Tensor):
            out.append(CrossingValue(node.name, tuple(int(d) for d in v.shape), v.dtype,
                                     bool(v.requires_grad and v.dtype.is_floating_point)))
        elif isinstance(v, (int, float, bool, torch.SymInt)) or v is None:
            out.append(CrossingValue(node.name, None, None, False, int(v) if isinstance(v, torch.SymInt) else v))
        else:
            raise ValueError(f"value '{node.name}' crosses the cut after block {cut_after} but is a "
                             f"{type(v).__name__}, not a tensor or a number; move the cut")
    return tuple(out)


def plan_stage_specs(traced: TracedModel, boundaries: Sequence[int], values: Mapping[str, Any]) -> list[StageSpec]:
    """A `StageSpec` for every stage; `boundaries` = (0, end_block of stage 0, ..., num_blocks)."""
    num_stages = len(boundaries) - 1
    placeholders = set(traced.input_names)
    cuts = [_crossing(traced, boundaries[k + 1] - 1, values) for k in range(num_stages - 1)]
    specs = []
    for k in range(num_stages):
        first, end = boundaries[k], boundaries[k + 1]
        _, inputs, outputs = extract_submodule(traced, first, end - 1)
        recv = cuts[k - 1] if k > 0 else ()
        recv_names = {c.name for c in recv}
        missing = [n for n in inputs if n not in placeholders and n not in recv_names]
        assert not missing, f"stage {k} uses {missing} that no cut carries"
        specs.append(StageSpec(
            index=k, first_block=first, end_block=end, inputs=tuple(inputs),
            data_inputs=tuple(n for n in inputs if n in placeholders), outputs=tuple(outputs),
            recv=recv, send=cuts[k] if k < num_stages - 1 else (),
        ))
    return specs


def batch_size_of(values: Sequence[Any]) -> int | None:
    """The batch size of the first tensor with a dimension in `values`, or None."""
    return next((t.shape[0] for t in values if isinstance(t, torch.Tensor) and t.dim() > 0), None)


def stage_specs(traced: TracedModel, graph_inputs: Sequence[Any], plan: Plan, model: nn.Module,
                device: torch.device) -> list[StageSpec]:
    """Every stage's `StageSpec` under `plan`, with the shapes of everything at the micro-batch size
    found on fake tensors (see [Note: crossing values]); refuses (one line) a model that traces into
    other blocks than the plan names. A graph traced by torch.export is retargeted to `device`."""
    if tuple(traced.block_names) != tuple(plan.block_names):
        raise PartitionError(f"the model traces into {len(traced.block_names)} blocks but the plan names "
                             f"{len(plan.block_names)}; trace with the same leaf_modules and tracer as the plan")
    param = next(model.parameters(), None)
    prop_device = param.device if param is not None else torch.device("cpu")
    if traced.tracer == "export":
        retarget_device(traced.gm, prop_device)
    batch = batch_size_of(graph_inputs)
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
    return specs


def build_stage_modules(traced: TracedModel, specs: Sequence[StageSpec]) -> dict[int, fx.GraphModule]:
    """stage index -> GraphModule of its blocks (over the model's own modules and parameters)."""
    return {s.index: extract_submodule(traced, s.first_block, s.end_block - 1)[0] for s in specs}


def materialize_stages(modules: Sequence[nn.Module], device: torch.device, *, seed: int = 0,
                       aliases: Mapping[str, str] | None = None,
                       init: Callable[[nn.Module, int, Mapping[str, str] | None], None] | None = None) -> None:
    """Give the stage modules real storage on `device`, leaving every other parameter alone.

    Tensors on meta are allocated (as `to_empty` does) and initialized by name with `init(module,
    seed, aliases)` (default `zoo.init_weights`; the model source's own, so a stage gets the values
    the full model would; tied copies on other stages use `aliases`); real tensors (parameters, and
    buffers a source computed on the CPU) are moved. Parameters shared between the modules stay shared.
    Tensor-parallel shards (DTensors made on meta by `tensor_parallel.shard_module`) get their
    slice of the full model's values: the full value is drawn by name as usual and copied into the
    shard as an implicitly replicated tensor (only the local slice is written).
    """
    from autoplan import models as zoo

    holder = nn.ModuleList(modules)
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in holder.modules():
        for local, p in mod.named_parameters(recurse=False):
            slots.setdefault(id(p), []).append((mod, local))
    on_meta = any(p.device.type == "meta" for p in holder.parameters())
    if on_meta:
        holder._apply(lambda t: torch.empty_like(t, device=device) if t.device.type == "meta" else t.to(device))
    else:
        holder.to(device)
    for group in slots.values():  # `to_empty` / `to` may untie parameters shared between modules
        owner, local = group[0]
        shared = owner._parameters[local]
        for mod, name in group[1:]:
            mod._parameters[name] = shared
    if on_meta:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.experimental import implicit_replication

        sharded = any(isinstance(p, DTensor) for p in holder.parameters())
        with implicit_replication() if sharded else contextlib.nullcontext():
            for module in modules:
                if init is None:
                    zoo.init_weights(module, seed=seed, aliases=aliases)
                else:
                    init(module, seed, aliases)


def split_stages(modules: Mapping[int, nn.Module], plan: Plan, layout: ParallelLayout, *, traced: TracedModel,
                 specs: Sequence[StageSpec], tp_plan: Mapping[str, str], aliases: Mapping[str, str],
                 model: nn.Module | None = None) -> StageBuild:
    """The split step: this rank's stages of every stage's module (`build_stage_modules`), those
    the plan puts on its pipeline index, as they were built (on meta, or with real weights)."""
    mine = {s.index: modules[s.index] for s in plan.stages if s.pp_rank == layout.pp_index}
    on_meta = any(p.device.type == "meta" for m in mine.values() for p in m.parameters())
    return StageBuild(traced=traced, specs=list(specs), modules=mine, tp_plan=tp_plan, aliases=dict(aliases),
                      on_meta=on_meta, model=model)


def materialize(build: StageBuild, plan: Plan, layout: ParallelLayout, *, device: torch.device, seed: int,
                init: Callable[[nn.Module, int, Mapping[str, str] | None], None] | None) -> None:
    """This rank's stage modules on `device` (`materialize_stages`); replicas of a model with real
    weights, built apart, then start from dp rank 0's weights (as DDP)."""
    modules = list(build.modules.values())
    materialize_stages(modules, device, seed=seed, aliases=build.aliases, init=init)
    if not build.on_meta and layout.dp_group is not None:
        _broadcast_from_first_replica(modules, layout, plan)


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
