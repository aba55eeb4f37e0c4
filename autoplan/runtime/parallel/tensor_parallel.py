"""Tensor parallelism: the layout a plan's tp runs, and the tensor-parallel steps of `partition`.

Tensor parallelism (tp > 1) is Megatron-style (Shoeybi et al. 2019, Sec 3) over the mesh's "tp"
axis, on the layout `graph/sharding.py` finds from the model's data flow (column-parallel q/k/v,
up/gate projections, row-parallel output and down projections, vocabulary-parallel embedding and
head; no table of model classes). It runs one of two ways, chosen from the traced graph
(`sharding.for_graph`):

- Where the graph calls the attention and MLP modules whole (fx with the layers as leaf modules:
  the zoo models, most hand-written ones), with torch's own `torch.distributed.tensor.parallel`
  styles, which work by module hooks. The module's code must take head counts from shapes (the
  zoo's attention does, [Note: tensor-parallel friendly shapes] in zoo.py), so a shard computes
  with num_heads / tp local heads unchanged. Row-parallel outputs are all-reduced and returned as
  plain (replicated) tensors (`use_local_output=True`), so everything between the sharded linears
  (norms, residuals, the activations sent between pipeline stages) is a plain tensor, identical on
  the tp ranks of a stage. Sharded parameters are `DTensor`s (`Shard(0)` for column-parallel
  weights and biases, `Shard(1)` for row-parallel weights), the row-parallel bias a Replicate
  DTensor, every other parameter a plain tensor. Sequence parallelism (plans with
  sequence_parallel) is run as [Note: sequence parallelism] in `_apply_sequence_parallel` says.
- Where the graph inlines them (torch.export: Hugging Face models), the stage computes in DTensor
  end to end, as [Note: tensor parallelism on an inlined graph] in tensor_parallel_graph.py says; every parameter is a DTensor
  there, and sequence parallelism is not run.

The token embedding and the LM head are vocabulary-parallel (Megatron-LM's VocabParallelEmbedding
and column-parallel output layer): each tp rank holds 1/tp of the vocabulary rows; the embedding's
masked lookups are all-reduced, and the logits gathered so the loss is computed whole on every tp
rank (not Megatron's vocab-parallel cross entropy: the full logits exist on each rank). A tied head
shares the embedding's sharded weight. Norms and position embeddings stay replicated: their
gradients come out whole and equal on every tp rank (the column-parallel inputs all-reduce their
gradients in backward), so they need no tp reduction; but a per-head q/k norm (Qwen3's) runs on
this rank's heads only, so its weight's gradient is summed over tp (`_sum_head_grads`); so is the
key/value head of a multi-query fused projection, held whole on every tp rank beside this rank's
query heads ([Note: blocks of a fused projection] in tensor_parallel_graph.py). Latent attention's
down-projections (DeepSeek's) are Replicate DTensors on an inlined graph: DTensor makes their
gradients whole where the per-head projections read them. Gradients of DTensor parameters are DTensors
laid out as their parameters (`grad_like_param`), and the dp all-reduce works on their local
shards. A model without a layout, or a tp that does not divide its heads, KV heads, MLP width or
vocabulary, is refused with tp > 1 (`tensor_parallel_plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoplan.graph.sharding import TensorParallelLayout, find_layout, sp_children, traced_layout
from autoplan.runtime.parallel.errors import PartitionError
from autoplan.runtime.parallel.tensor_parallel_graph import DTensorStage, shard_inlined_graph

if TYPE_CHECKING:
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild

__all__ = ["TensorParallelError", "apply_tensor_parallel", "check_tp_tracing", "grad_like_param", "run_in_dtensor",
           "shard_module", "tensor_parallel_plan"]


class TensorParallelError(ValueError):
    """The model cannot be run tensor-parallel at this degree (one-line message)."""


def tensor_parallel_plan(model: Any, tp: int, example_inputs: Sequence[Any] | None = None
                         ) -> TensorParallelLayout:
    """The model's tensor-parallel layout (`graph/sharding.py`: module path -> "colwise" /
    "rowwise" / "vocab-embedding" / "vocab-head", read as a mapping); raises TensorParallelError
    (one line) when it has none or `tp` does not divide its heads, KV heads, MLP width or
    vocabulary. Works on a model on meta. `model` is an nn.Module, or a traced model
    (graph/trace.py `TracedModel`) with its graph's inputs as `example_inputs`: then the layout is
    `sharding.traced_layout`'s, the one the profile records and the runtime runs."""
    if isinstance(model, nn.Module):
        layout = find_layout(model, example_inputs)
    elif example_inputs is None:
        layout = TensorParallelLayout(note="the traced model was not run (no example inputs) to find its layers")
    else:
        layout = traced_layout(model, example_inputs)
    refusal = layout.refusal(tp)
    if refusal is not None:
        raise TensorParallelError(refusal)
    return layout

def check_tp_tracing(traced, tp_plan: Mapping[str, str], sequence_parallel: bool = False) -> Mapping[str, str]:
    """The layout as the traced graph runs it (`sharding.for_graph`): torch's parallel styles
    (module hooks) where the graph calls the sharded modules whole (fx leaf modules), else the
    stage in DTensor ([Note: tensor parallelism on an inlined graph] in tensor_parallel_graph.py),
    where sequence parallelism is refused."""
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


def apply_tensor_parallel(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The tensor-parallel step: shard this rank's stage modules over the "tp" axis as `build.tp_plan`
    says (`shard_module`; nothing for tp 1), and with sequence parallelism cut the values that cross
    a pipeline cut between two layers to this rank's 1/tp of the sequence (`_sequence_sharded`).
    Works on meta or on real weights ([Note: the order of partition's steps] in api.py)."""
    if not build.tp_plan:
        return
    sequence_parallel = plan.sequence_parallel
    layers = list(build.tp_plan.layers) if sequence_parallel else []
    shared: dict = {}  # a parameter two of this rank's stages share stays one (shard_module)
    for module in build.modules.values():
        shard_module(module, build.tp_plan, layout.tp_mesh, sequence_parallel=sequence_parallel,
                     model_layers=layers, shared=shared)
    if sequence_parallel:  # between two layers only this rank's 1/tp of the sequence crosses a cut
        layer_blocks = {i for i, name in enumerate(build.traced.block_names) if name in set(layers)}
        build.specs = [_sequence_sharded(spec, layer_blocks, plan.tp) for spec in build.specs]


def run_in_dtensor(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The tensor-parallel step's second half, for a layout over an inlined graph: each stage runs in
    DTensor around its runner (see [Note: tensor parallelism on an inlined graph] in
    tensor_parallel_graph.py); nothing otherwise."""
    if getattr(build.tp_plan, "inlined", False):
        for stage in build.stages.values():
            stage.runner = DTensorStage(stage.runner or stage.module, layout.tp_mesh)


def _sequence_sharded(spec, layer_blocks: set[int], tp: int):
    """`spec` with the values that cross a cut between two transformer layers split along the
    sequence (dim 1) over tp ([Note: sequence parallelism] in tensor_parallel.py)."""

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


def shard_module(module: nn.Module, tp_plan: Mapping[str, str], tp_mesh, *,
                 sequence_parallel: bool = False, model_layers: Sequence[str] = (),
                 shared: dict | None = None) -> list[str]:
    """Shard the linears of `tp_plan` found in `module` (a stage; paths as in the model) over
    `tp_mesh`; returns the paths sharded.

    A layout whose graph calls the attention and MLP modules whole (not `inlined`) is applied
    with torch's ColwiseParallel / RowwiseParallel; with `sequence_parallel`, the layers are also
    laid out as [Note: sequence parallelism] says, `model_layers` listing every transformer layer of
    the model in order (the first takes a whole sequence, the last gives one back). A layout over an
    inlined graph is applied as [Note: tensor parallelism on an inlined graph] says; pass one
    `shared` dict to the calls for every stage of a rank, so that a parameter two of its stages
    share stays one. Works on meta (nothing is communicated: every rank keeps its own slice of what
    it holds)."""
    if getattr(tp_plan, "inlined", False):
        return shard_inlined_graph(module, tp_plan, tp_mesh, {} if shared is None else shared)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # parallelize_module gives each module its own parameter, which would untie a head that shares
    # the embedding's weight; they are tied again afterwards.
    tied = []
    heads = [p for p, style in tp_plan.items() if style == "vocab-head"]
    embeddings = [p for p, style in tp_plan.items() if style == "vocab-embedding"]
    for head_path in heads:
        for embedding_path in embeddings:
            try:
                head, embedding = module.get_submodule(head_path), module.get_submodule(embedding_path)
            except AttributeError:
                continue
            if head.weight is embedding.weight:
                tied.append((head, embedding))
    # Under sequence parallelism the output projections of a layer's sharded attention and MLP
    # reduce-scatter to the sequence slice; one inside a unit computed whole (an MoE block's shared
    # experts) all-reduces as under plain tp ([Note: sequence parallelism]).
    layers = set(model_layers)
    scatter = {g.rowwise for g in getattr(tp_plan, "groups", ()) if g.parent.rpartition(".")[0] in layers}
    done = []
    for path, style in tp_plan.items():
        try:
            target = module.get_submodule(path)
        except AttributeError:
            continue
        if style == "colwise":
            parallel = ColwiseParallel()
        elif style == "vocab-embedding":  # rows of the table; masked lookups, outputs all-reduced
            parallel = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif style == "vocab-head":  # columns of the logits, gathered for the (replicated) loss
            parallel = ColwiseParallel(output_layouts=Replicate())
        elif sequence_parallel and path in scatter:  # reduce-scatter along the sequence instead of all-reduce
            parallel = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        else:
            parallel = RowwiseParallel()
        parallel.src_data_rank = None  # every rank builds the same weights: take the local slice, no scatter
        parallelize_module(target, tp_mesh, parallel)
        done.append(path)
    _sum_head_grads(module, tp_plan, tp_mesh)
    if sequence_parallel:
        _apply_sequence_parallel(module, tp_mesh, model_layers, tp_plan)
    for head, embedding in tied:  # both shard the vocabulary rows (Shard(0)): one DTensor serves both
        head.weight = embedding.weight
    return done


def _sum_head_grads(module: nn.Module, layout: Mapping[str, str], tp_mesh) -> None:
    """Under module hooks, a module only a sharded attention's heads run (a per-head q/k norm:
    `TensorParallelLayout.head_params`) normalizes this rank's heads with a weight every tp rank
    holds whole, so each rank's gradient of it covers its own heads. Its weight becomes a Replicate
    DTensor and its input this rank's rows of a Shard(0) DTensor (torch's `SequenceParallel` over
    dim 0: the ranks hold different rows of one normalization); DTensor sums the weight's gradient
    over tp, as it does for sequence-parallel norms."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    owners = {name.rpartition(".")[0] for name in getattr(layout, "head_params", ())}
    if owners:  # a constant the norm makes (its eps as a tensor) is replicated, as in DTensorStage
        DTensor._op_dispatcher._allow_implicit_replication = True
    for path in sorted(owners):
        try:
            owner = module.get_submodule(path)
        except AttributeError:
            continue
        parallelize_module(owner, tp_mesh, SequenceParallel(sequence_dim=0, use_local_output=True))


def _apply_sequence_parallel(module: nn.Module, tp_mesh, model_layers: Sequence[str],
                             layout: Mapping[str, str]) -> None:
    """[Note: sequence parallelism] (Korthikanti et al. 2022, Sec. 4.2.2), with torch's parallel styles
    as torchtitan applies them to its Llama:

    - Between layers the residual stream is this rank's 1/tp of the sequence, a plain tensor of
      shape (b, s/tp, h): that is also what crosses a pipeline cut between two layers.
    - Inside a layer it is a DTensor Shard(1); the norms run on it (`SequenceParallel`: their
      weights are replicated DTensors, whose gradients DTensor sums over the tp group); the
      attention and MLP take the whole sequence (`PrepareModuleInput`: an all-gather, a
      reduce-scatter in backward), and their row-parallel projections reduce-scatter back to
      Shard(1) (`RowwiseParallel(output_layouts=Shard(1))`), where plain tp all-reduces.
    - A unit of the layer the layout does not shard as a whole (a mixture-of-experts block: its
      router and experts replicated, its shared experts an MLP group inside) takes the whole
      sequence too, computes as under plain tp (its inner row-parallel projections all-reduce, so
      its output is the same on every tp rank) and keeps this rank's slice of its output
      (`PrepareModuleOutput` Replicate -> Shard(1): a local slice, an all-gather in backward).
      Megatron-LM instead routes each tp rank's own tokens under sequence parallelism; here the
      block sees what it sees under plain tp, so its routing (capacity and load-balancing loss per
      sequence, [Note: static dispatch] in models/moe.py) is the single process's, and how the
      experts' work is split over tp is the dispatch's concern (runtime/parallel/experts.py).
    - The model's first layer takes the whole sequence (the embedding output, replicated) and keeps
      its slice; its last layer gathers the sequence back for the final norm and the head, which
      stay replicated.

    The layers are those `graph/sharding.py` lists (`TensorParallelLayout.layers`): their direct
    children are the norms (LayerNorm / RMSNorm), the sharded attention and MLP modules and the
    units computed whole (`sp_children`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    first, last = (model_layers[0], model_layers[-1]) if model_layers else (None, None)
    for path in model_layers:
        try:
            layer = module.get_submodule(path)
        except AttributeError:
            continue
        norms, units, whole = sp_children(layer, layout, path)
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
        keep_slice = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                                         use_local_output=False)
        parallelize_module(layer, tp_mesh, {**{n: SequenceParallel() for n in norms},
                                            **{u: gather for u in [*units, *whole]}})
        for name in whole:
            parallelize_module(layer.get_submodule(name), tp_mesh, keep_slice)
        parallelize_module(layer, tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate() if path == first else Shard(1),), desired_input_layouts=(Shard(1),)))
        parallelize_module(layer, tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate() if path == last else Shard(1),),
            use_local_output=True))


def grad_like_param(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`grad` laid out as `param`: DTensor's embedding backward returns a Replicate gradient for a
    row-sharded (vocabulary-parallel) table; the optimizer and the reductions need the param's own
    placement (Replicate -> Shard is a local slice, no communication)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad
