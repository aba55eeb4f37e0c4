"""The (pp, dp, tp) device mesh of a plan, and the gradient reductions between replicas.

The mesh is torch's `DeviceMesh` over the plan's rank layout ([Note: rank layout] in plan.py), so
the dp and tp groups are the mesh's own groups. Gradients are reduced after the last backward of
a step:

- Tied parameters whose ends sit on different pipeline ranks (GPT's `output.weight` and
  `tok_embeddings.weight`) have one copy per rank; their gradients are summed over those ranks
  first (Megatron-LM's embedding group, Shoeybi et al. 2019, Sec 3), so both copies take the same
  optimizer step and stay equal.
- Then every gradient is averaged over the dp group (one all-reduce per dtype over a flat buffer,
  as DDP's buckets do), for zero 0 and 1. Under zero 2 and 3, FSDP2 shards the parameters and
  reduce-scatters the gradients itself over `ParallelLayout.fsdp_mesh` (fsdp.py).

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
  end to end, as [Note: tensor parallelism on an inlined graph] says; every parameter is a DTensor
  there, and sequence parallelism is not run.

The token embedding and the LM head are vocabulary-parallel (Megatron-LM's VocabParallelEmbedding
and column-parallel output layer): each tp rank holds 1/tp of the vocabulary rows; the embedding's
masked lookups are all-reduced, and the logits gathered so the loss is computed whole on every tp
rank (not Megatron's vocab-parallel cross entropy: the full logits exist on each rank). A tied head
shares the embedding's sharded weight. Norms and position embeddings stay replicated: their
gradients come out whole and equal on every tp rank (the column-parallel inputs all-reduce their
gradients in backward), so they need no tp reduction. Gradients of DTensor parameters are DTensors
laid out as their parameters (`grad_like_param`), and the dp all-reduce works on their local
shards. A model without a layout, or a tp that does not divide its heads, KV heads, MLP width or
vocabulary, is refused with tp > 1 (`tensor_parallel_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils._pytree import tree_flatten

from autoplan.graph.sharding import (
    TensorParallelLayout,
    find_layout,
    is_transposed_linear,
    sp_children,
    traced_layout,
)

__all__ = ["DP_BUCKET_BYTES", "DTensorStage", "ParallelLayout", "TensorParallelError", "all_reduce_grads", "apply_tensor_parallel", "build_layout",
           "grad_like_param", "local_tensor", "tensor_parallel_plan"]


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


def apply_tensor_parallel(module: nn.Module, tp_plan: Mapping[str, str], tp_mesh, *,
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
        return _apply_to_graph(module, tp_plan, tp_mesh, {} if shared is None else shared)
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
        elif sequence_parallel:  # reduce-scatter along the sequence instead of all-reduce
            parallel = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        else:
            parallel = RowwiseParallel()
        parallel.src_data_rank = None  # every rank builds the same weights: take the local slice, no scatter
        parallelize_module(target, tp_mesh, parallel)
        done.append(path)
    if sequence_parallel:
        _apply_sequence_parallel(module, tp_mesh, model_layers, tp_plan)
    for head, embedding in tied:  # both shard the vocabulary rows (Shard(0)): one DTensor serves both
        head.weight = embedding.weight
    return done


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
    - The model's first layer takes the whole sequence (the embedding output, replicated) and keeps
      its slice; its last layer gathers the sequence back for the final norm and the head, which
      stay replicated.

    The layers are those `graph/sharding.py` lists (`TensorParallelLayout.layers`): their direct
    children are the norms (LayerNorm / RMSNorm) and the sharded attention and MLP modules.
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
        norms, units = sp_children(layer, layout, path)
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
        parallelize_module(layer, tp_mesh, {**{n: SequenceParallel() for n in norms}, **{u: gather for u in units}})
        parallelize_module(layer, tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate() if path == first else Shard(1),), desired_input_layouts=(Shard(1),)))
        parallelize_module(layer, tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate() if path == last else Shard(1),),
            use_local_output=True))


# [Note: tensor parallelism on an inlined graph]
# A graph traced by torch.export inlines the attention and the MLP: no module hook fires, and the
# head counts of its reshapes are baked in at full width. Such a stage computes in DTensor end to
# end: the layout's parameters are Shard DTensors (column-parallel weights and biases on the output
# features, row-parallel weights on the input features, the vocabulary rows of the embedding and
# head), every other parameter and buffer a Replicate DTensor, the stage's inputs enter as
# Replicate DTensors and its outputs leave as whole local tensors (`dtensor_stage`). DTensor's
# sharding propagation follows the graph with global shapes, so the baked reshapes split a sharded
# feature dim into (heads, head_dim) with the heads sharded, and inserts the collectives Megatron
# places by hand: the partial sums of a row-parallel linear are all-reduced where the residual
# needs them, and the gradients of the replicated inputs of column-parallel linears in backward.
# The graph is rewritten in five places where DTensor would fail or be slow: a custom operator
# DTensor has no rule for (Mixtral's `transformers.grouped_mm_fallback`) runs replicated on whole
# local tensors (`_ReplicatedOp`); size checks (`_assert_tensor_metadata`, no sharding rule) are
# dropped; reshapes and views of a DTensor whose local shard is not contiguous copy it first
# (DTensor decides view-ability on global strides); attention runs on the local heads
# (`_local_attention`: DTensor's rule for CPU attention goes through a slow decomposition; a mask or
# bias per head, such as T5's relative position bias, is cut to the local heads too, a plain one the
# graph made as a replicated tensor); an embedding lookup of a vocabulary-sharded table is
# all-reduced at once (its masked partial result cannot wait). Constants the graph creates (masks,
# positions) are plain tensors: DTensor's implicit replication treats them as replicated. Every
# parameter is a DTensor, so an optimizer sees one kind of tensor. A parameter a stage holds only
# under another name of a sharded one (BERT's `cls.predictions.bias`, T5's
# `decoder.embed_tokens.weight`: `TensorParallelLayout.tied`) is sharded as that one, so the tie's
# gradient reduction between pipeline stages sums shards that line up.


def _apply_to_graph(module: nn.Module, layout: Mapping[str, str], tp_mesh, shared: dict) -> list[str]:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    # id of a parameter -> (it, its DTensor): one dict over the stages of a rank, so a parameter two
    # stages share (a tied table on one pipeline rank's two virtual stages) stays one parameter.
    converted: dict[int, tuple[nn.Parameter, nn.Parameter]] = shared
    done = []
    # The layout's modules first: a parameter they share with another module (a tied head's bias)
    # takes their placement.
    modules = sorted(module.named_modules(remove_duplicate=False), key=lambda item: item[0] not in layout)
    tied = getattr(layout, "tied", {})
    vocab_tables: set[int] = set()  # the token table under any of its names (a T5 stage reads lm_head.weight)
    for path, owner in modules:
        module_style = layout.get(path)
        for name, p in list(owner.named_parameters(recurse=False)):
            style, key = layout.get(path), name
            transposed = path in getattr(layout, "transposed", ()) or is_transposed_linear(owner)
            full = f"{path}.{name}" if path else name
            if style is None and full in tied and tied[full].rpartition(".")[0] in layout:
                # Another name of a sharded parameter (a stage may hold it only under this one):
                # the same placement, or the tie's gradient reduction across stages would not line up.
                target, _, key = tied[full].rpartition(".")
                style = layout.get(target)
                transposed = target in getattr(layout, "transposed", ())
            if id(p) not in converted:
                if style in ("colwise", "vocab-head"):
                    dim = 1 if transposed and key == "weight" else 0
                    placement = Shard(dim)
                elif style == "colwise-qkv":  # each of the q, k, v thirds sharded ([Note: fused q/k/v])
                    dim = 1 if transposed and key == "weight" else 0
                    placement = _StridedShard(dim, split_factor=3)
                elif style == "rowwise" and key == "weight":
                    placement = Shard(0 if transposed else 1)
                elif style == "vocab-embedding":
                    placement = Shard(0)
                else:
                    placement = Replicate()
                converted[id(p)] = (p, nn.Parameter(
                    distribute_tensor(p.detach(), tp_mesh, [placement], src_data_rank=None),
                    requires_grad=p.requires_grad))
            owner._parameters[name] = converted[id(p)][1]
            if style in ("vocab-embedding", "vocab-head") and key == "weight":  # a lookup may read a tied head's
                vocab_tables.add(id(converted[id(p)][1]))
        for name, b in list(owner.named_buffers(recurse=False)):
            if b is not None and not isinstance(b, DTensor):
                owner._buffers[name] = DTensor.from_local(b, tp_mesh, [Replicate()], run_check=False)
        if module_style is not None:
            done.append(path)
    vocab_tables |= {id(module.get_submodule(p).weight) for p, style in layout.items()
                     if style == "vocab-embedding" and _has_submodule(module, p)}
    for gm in module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            _rewrite_for_dtensor(gm, vocab_tables)
    return done


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _rewrite_for_dtensor(gm: torch.fx.GraphModule, vocab_tables: set[int]) -> None:
    """The graph rewrites of [Note: tensor parallelism on an inlined graph]."""
    import torch.nn.functional as F  # noqa: N812

    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
        elif node.target in _CONTIGUOUS_FIRST:
            node.target = _CONTIGUOUS_FIRST[node.target]
        elif node.target in (aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention):
            node.target = _local_attention
        elif node.target in _FUSED_QKV_OPS:
            weight = node.args[2] if node.target is aten.addmm.default else node.args[1]
            if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and _is_strided(_get_attr(gm, weight.target)):
                node.target = _FUSED_QKV_OPS[node.target]
        elif node.target in _SPLITS:
            node.target = _SPLITS[node.target]
        elif _no_sharding_rule(node.target):
            node.target = _ReplicatedOp(node.target)
        elif node.target in (aten.embedding.default, F.embedding):
            weight = node.args[0] if node.target is aten.embedding.default else node.args[1]
            if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and id(_get_attr(gm, weight.target)) in vocab_tables:
                node.target = _VOCAB_EMBEDDING[node.target]  # same node (its block and name stay): no new node
    gm.graph.lint()
    gm.recompile()


def _no_sharding_rule(target: Any) -> bool:
    """A custom operator (not aten's or prims') DTensor has no sharding rule for (transformers'
    `grouped_mm_fallback` of Mixtral's experts)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("aten", "prims"):
        return False
    prop = DTensor._op_dispatcher.sharding_propagator
    return not any(target in getattr(prop, table, {}) for table in
                   ("op_strategy_funcs", "op_to_rules", "op_single_dim_strategy_funcs"))


class _ReplicatedOp:
    """Runs an operator DTensor has no rule for on whole local tensors (its DTensor inputs made
    Replicate) and gives Replicate DTensors back: the same computation on every tp rank, as for a
    module the layout leaves replicated."""

    def __init__(self, op):
        self.op = op
        self.__name__ = f"replicated_{op.namespace}_{op._opname}"

    def __call__(self, *args, **kwargs):
        from torch.distributed.tensor import DTensor, Replicate
        from torch.utils._pytree import tree_map

        mesh = next((x.device_mesh for x in tree_flatten((args, kwargs))[0] if isinstance(x, DTensor)), None)
        if mesh is None:
            return self.op(*args, **kwargs)

        def local(x):
            if isinstance(x, DTensor):
                return x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
            return x

        def wrap(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
            return x

        return tree_map(wrap, self.op(*tree_map(local, args), **tree_map(local, kwargs)))


def _get_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _replicated(x: Any) -> Any:
    """`x` as a Replicate DTensor whose gradient is whole too (not the table's masked partial)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor):
        return x
    whole = x.redistribute(x.device_mesh, [Replicate()]).to_local()
    return DTensor.from_local(whole, x.device_mesh, [Replicate()], run_check=False)


def _vocab_embedding_aten(weight, ids, *args, **kwargs):
    return _replicated(torch.ops.aten.embedding.default(weight, ids, *args, **kwargs))


def _vocab_embedding_f(ids, weight, *args, **kwargs):
    return _replicated(torch.nn.functional.embedding(ids, weight, *args, **kwargs))


_VOCAB_EMBEDDING = {torch.ops.aten.embedding.default: _vocab_embedding_aten,
                    torch.nn.functional.embedding: _vocab_embedding_f}


# [Note: fused q/k/v]
# A fused projection laid out [q | k | v] along its output features (GPT-2's `c_attn`, split into
# three right after) is sharded by thirds: `_StridedShard(dim, split_factor=3)`, so rank r holds
# [q_r | k_r | v_r], each 1/tp of that block's heads, while the parameter's `full_tensor()` (state
# dicts, checkpoints) is the model's own [q | k | v]. DTensor has no rule for such a linear, so the
# graph's linear op runs on the local shards (`_qkv_linear`: the replicated input's gradient is a
# partial sum, all-reduced by DTensor), its following view keeps the placement (`_view`), and the
# split into q, k and v hands each rank its own thirds as Shard DTensors (`_split`); from there
# attention is head-parallel as with separate q, k and v projections.


def _is_strided(t: Any) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and isinstance(t.placements[0], _StridedShard)


def _local_input(x: Any, mesh) -> Any:
    """A replicated input's local tensor whose gradient is a partial sum (of this rank's columns)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(x, DTensor):
        return x
    return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _qkv_out(out: torch.Tensor, mesh) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return DTensor.from_local(out, mesh, [_StridedShard(out.dim() - 1, split_factor=3)], run_check=False)


def _qkv_addmm(bias, x, weight, *, beta=1, alpha=1):  # Conv1D: addmm(bias, x, weight (in, out))
    mesh = weight.device_mesh
    out = torch.addmm(bias.to_local(), _local_input(x, mesh), weight.to_local(), beta=beta, alpha=alpha)
    return _qkv_out(out, mesh)


def _qkv_linear(x, weight, bias=None):
    mesh = weight.device_mesh
    out = torch.nn.functional.linear(_local_input(x, mesh), weight.to_local(),
                                     None if bias is None else bias.to_local())
    return _qkv_out(out, mesh)


_FUSED_QKV_OPS = {torch.ops.aten.addmm.default: _qkv_addmm, torch.ops.aten.linear.default: _qkv_linear,
                  torch.nn.functional.linear: _qkv_linear}


def _strided_view(x, shape) -> Any:
    """A view of a [q_r | k_r | v_r] DTensor: one that keeps the last dim keeps the placement; one
    that splits it into (3, ...) gives Shard on the dim after the 3 (the heads); else None."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shape = list(shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = x.numel() // known
    mesh, n, last = x.device_mesh, x.device_mesh.size(), x.shape[-1]
    local = x.to_local()
    if shape[-1] == last:
        out = local.reshape(*shape[:-1], last // n)
        return DTensor.from_local(out, mesh, [_StridedShard(len(shape) - 1, split_factor=3)], run_check=False)
    k = next((i for i in range(len(shape)) if math.prod(shape[i:]) == last), None)
    if k is not None and shape[k] == 3 and k + 1 < len(shape) and shape[k + 1] % n == 0:
        out = local.reshape(*shape[:k], 3, shape[k + 1] // n, *shape[k + 2:])
        return DTensor.from_local(out, mesh, [Shard(k + 1)], run_check=False)
    return None


def _split(x, split_size, dim=0):
    from torch.distributed.tensor import DTensor, Shard

    if _is_strided(x) and x.placements[0].dim == dim % x.dim() and split_size * 3 == x.shape[dim]:
        mesh = x.device_mesh
        return tuple(DTensor.from_local(t, mesh, [Shard(dim % x.dim())], run_check=False)
                     for t in x.to_local().chunk(3, dim))
    return torch.ops.aten.split.Tensor(x, split_size, dim)


def _split_with_sizes(x, sizes, dim=0):
    if _is_strided(x) and len(sizes) == 3 and len(set(sizes)) == 1:
        return _split(x, sizes[0], dim)
    return torch.ops.aten.split_with_sizes.default(x, sizes, dim)


_SPLITS = {torch.ops.aten.split.Tensor: _split, torch.ops.aten.split_with_sizes.default: _split_with_sizes}


def _contiguous(x: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor) and not x._local_tensor.is_contiguous():
        return x.clone(memory_format=torch.contiguous_format)
    return x


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient's local shard contiguous (for the reshape of the
    gradient in a view's backward, which has the same problem as the forward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _contiguous(grad)


def _reshape(x, shape):
    out = _strided_view(x, shape) if _is_strided(x) else None
    if out is None:
        out = torch.ops.aten.reshape.default(_contiguous(x), shape)
    return _ContiguousGrad.apply(out) if out.requires_grad else out


def _view(x, shape):
    out = _strided_view(x, shape) if _is_strided(x) else None
    if out is None:
        out = torch.ops.aten.view.default(_contiguous(x), shape)
    return _ContiguousGrad.apply(out) if out.requires_grad else out


_CONTIGUOUS_FIRST = {torch.ops.aten.reshape.default: _reshape, torch.ops.aten.view.default: _view}


def _local_attention(q, k, v, attn_mask=None, *args, **kwargs):
    """Scaled dot-product attention on this rank's heads (dim 1) when q, k and v hold whole heads,
    else on the whole (replicated) tensors; the result is a DTensor of that placement."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(q, DTensor):
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, attn_mask, *args, **kwargs)
    mesh = q.device_mesh
    n = mesh.size()
    heads_split = q.dim() == 4 and q.shape[1] % n == 0 and k.shape[1] % n == 0
    placements = [Shard(1)] if heads_split else [Replicate()]

    def local(t):
        if not isinstance(t, torch.Tensor):
            return t
        per_head = t.dim() == 4 and t.shape[1] == q.shape[1]  # a mask or bias per head (T5's), else broadcast
        if not isinstance(t, DTensor):
            if not (heads_split and per_head):
                return t
            # A plain tensor the graph made (T5's zero position bias plus the mask) is replicated:
            # this rank's heads are a local slice.
            t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return t.redistribute(mesh, placements if per_head else [Replicate()]).to_local()

    out = torch.ops.aten.scaled_dot_product_attention.default(local(q), local(k), local(v), local(attn_mask),
                                                              *args, **kwargs)
    return DTensor.from_local(out, mesh, placements, run_check=False)


class DTensorStage:
    """Runs a stage of an inlined graph in DTensor ([Note: tensor parallelism on an inlined graph]):
    tensor inputs enter as Replicate DTensors, outputs leave as whole local tensors."""

    def __init__(self, run, tp_mesh):
        self.run = run
        self.tp_mesh = tp_mesh

    def __call__(self, *args: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate
        from torch.utils._pytree import tree_map

        # Plain tensors the graph makes (masks, positions) are replicated; the switch is
        # process-wide because backward (and recomputation inside it) runs outside this call.
        DTensor._op_dispatcher._allow_implicit_replication = True

        def enter(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
            return x

        def leave(x):
            if isinstance(x, DTensor):
                return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
            return x

        return tree_map(leave, self.run(*tree_map(enter, args)))


def grad_like_param(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`grad` laid out as `param`: DTensor's embedding backward returns a Replicate gradient for a
    row-sharded (vocabulary-parallel) table; the optimizer and the reductions need the param's own
    placement (Replicate -> Shard is a local slice, no communication)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writes go to it), or `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class ParallelLayout:
    """Where this rank sits in the plan's mesh and the groups it reduces over."""

    rank: int
    world_size: int
    pp_index: int
    dp_index: int
    tp_index: int
    pp: int
    dp: int
    tp: int
    stage_rank: dict[int, int]
    """Virtual stage -> global rank that runs it with this rank's dp and tp coordinates."""
    mesh: object | None
    """torch DeviceMesh with axes ("pp", "dp_replicate", "dp_shard", "tp") (torchtitan's order), or
    None for a single rank. The dp index is replicate index * dp_shard + shard index, so a shard
    group is dp_shard consecutive replicas (inside a node when tp * dp_shard fits one)."""
    dp_group: dist.ProcessGroup | None
    tie_groups: dict[str, dist.ProcessGroup]
    """Canonical name of a tied parameter split over pipeline ranks -> the group of its holders."""
    tp_mesh: object | None = None
    """The 1-D "tp" sub-mesh this rank shards over (ranks plan.rank(pp, dp, 0..tp-1)), or None."""
    fsdp_mesh: object | None = None
    """The mesh FSDP shards over (zero >= 2): 1-D "dp_shard", or 2-D ("dp_replicate", "dp_shard")
    for HSDP; None otherwise."""
    ep_index: int = 0
    """This rank's place in its expert-parallel group (dp_index % ep): which slice of the experts
    it holds (runtime/experts.py)."""
    ep_group: dist.ProcessGroup | None = None
    """The ep consecutive dp replicas (same pp and tp index) that exchange tokens, or None (ep 1)."""
    pp_group: dist.ProcessGroup | None = None
    """The pipeline ranks with this rank's dp and tp index (the mesh's "pp" axis), or None (pp 1)."""
    cp_index: int = 0
    """This rank's place in its context-parallel group (dp_index % cp): which chunks of every
    sequence it holds (runtime/context.py)."""
    cp_group: dist.ProcessGroup | None = None
    """The cp consecutive dp ranks (same pp and tp index) that split each sequence, or None (cp 1)."""
    expert_dp_group: dist.ProcessGroup | None = None
    """The dp replicas holding the same experts (dp_index % ep equal), over which expert gradients
    are summed; None when there is one (ep = dp) or ep is 1."""
    expert_fsdp_mesh: object | None = None
    """With ep > 1 and zero >= 2: the 1-D mesh of those same replicas ("edp"), over which FSDP
    shards the experts (fsdp.py); None otherwise."""


def build_layout(plan, rank: int, world_size: int, device_type: str,
                 tied_holders: Mapping[str, Sequence[int]], *, timeout: timedelta | None = None) -> ParallelLayout:
    """Mesh and groups for `rank`; collective: every rank calls it with the same arguments.

    `tied_holders` maps a tied parameter's canonical name to the pipeline indices that hold a copy.
    `timeout` bounds every collective of every group made here: torch gives a subgroup its own
    default (30 minutes on gloo, 10 on NCCL), not the world group's, so a dp peer that hung made its
    partner wait half an hour in the gradient all-reduce (issue "Faults and hostile input").
    """
    pp_index, dp_index, tp_index = plan.coords(rank)
    stage_rank = {s.index: plan.rank(s.pp_rank, dp_index, tp_index) for s in plan.stages}
    mesh = dp_group = tp_mesh = fsdp_mesh = expert_fsdp_mesh = None
    replicate = getattr(plan, "dp_replicate", 1)
    shard = plan.dp // replicate
    if world_size > 1 or plan.zero >= 2:
        from torch.distributed.device_mesh import DeviceMesh

        layout = torch.tensor([[[[plan.rank(p, r * shard + s, t) for t in range(plan.tp)] for s in range(shard)]
                                for r in range(replicate)] for p in range(plan.pp)])
        override = _group_options(device_type, timeout)
        mesh = DeviceMesh(device_type, layout, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
                          backend_override=(override,) * 4)
        # torchtitan flattens the dp dimensions the same way
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=override)
        dp_group = dp_mesh.get_group() if plan.dp > 1 else None
        tp_mesh = mesh["tp"] if plan.tp > 1 else None
        if plan.zero >= 2:
            fsdp_mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
        if plan.zero >= 2 and getattr(plan, "ep", 1) > 1:
            # The dp index read as (dp / ep, ep): the first axis holds the replicas with the same
            # experts, torchtitan's "dp_shard_mod_ep" (torchtitan/distributed/parallel_dims.py).
            ep = plan.ep
            expert_layout = torch.tensor([[[[plan.rank(p, o * ep + i, t) for t in range(plan.tp)] for i in range(ep)]
                                           for o in range(plan.dp // ep)] for p in range(plan.pp)])
            expert_fsdp_mesh = DeviceMesh(device_type, expert_layout, mesh_dim_names=("pp", "edp", "ep", "tp"),
                                          backend_override=(override,) * 4)["edp"]
    tie_groups: dict[str, dist.ProcessGroup] = {}
    for name in sorted(tied_holders):
        holders = sorted(set(tied_holders[name]))
        if len(holders) < 2:
            continue
        for d in range(plan.dp):  # new_group is collective: every rank creates every group
            for t in range(plan.tp):
                ranks = [plan.rank(p, d, t) for p in holders]
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    tie_groups[name] = group
    ep, cp = getattr(plan, "ep", 1), getattr(plan, "cp", 1)
    # Expert and context parallelism fold over dp: groups of ep (cp) consecutive dp ranks, and for
    # ep the dp ranks holding the same experts (one per ep group).
    ep_group = _dp_subgroup(plan, rank, lambda d: d // ep, timeout) if ep > 1 else None
    expert_dp_group = _dp_subgroup(plan, rank, lambda d: d % ep, timeout) if 1 < ep < plan.dp else None
    cp_group = _dp_subgroup(plan, rank, lambda d: d // cp, timeout) if cp > 1 else None
    return ParallelLayout(rank, world_size, pp_index, dp_index, tp_index, plan.pp, plan.dp, plan.tp,
                          stage_rank, mesh, dp_group, tie_groups, tp_mesh, fsdp_mesh,
                          pp_group=mesh["pp"].get_group() if mesh is not None and plan.pp > 1 else None,
                          ep_index=dp_index % ep, ep_group=ep_group, cp_index=dp_index % cp, cp_group=cp_group,
                          expert_dp_group=expert_dp_group, expert_fsdp_mesh=expert_fsdp_mesh)


def _dp_subgroup(plan, rank: int, key, timeout: timedelta | None) -> dist.ProcessGroup:
    """The group of this rank among those that split each (pp, tp) coordinate's dp ranks by
    `key(dp_index)`. new_group is collective: every rank creates every group, in the same order."""
    mine = None
    for p in range(plan.pp):
        for t in range(plan.tp):
            parts: dict[int, list[int]] = {}
            for d in range(plan.dp):
                parts.setdefault(key(d), []).append(plan.rank(p, d, t))
            for ranks in parts.values():
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine = group
    return mine


def _group_options(device_type: str, timeout: timedelta | None) -> tuple[str | None, object | None]:
    """DeviceMesh's (backend, options) for groups whose collectives time out after `timeout`."""
    if timeout is None:
        return (None, None)
    options = dist.ProcessGroupNCCL.Options() if device_type == "cuda" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return (None, options)


DP_BUCKET_BYTES = 25 * 2**20
"""Gradients all-reduced together: torch DDP's default `bucket_cap_mb` (Li et al. 2020, "PyTorch
Distributed", Sec. 3.2.3). The flat copy of one bucket is the reduction's only transient memory;
cost/comm.py prices the reduction in buckets of the same size."""


def all_reduce_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, *,
                     average: bool, bucket_bytes: int = DP_BUCKET_BYTES) -> None:
    """Sum (or average) the `.grad` of `params` over `group`, in flat buckets of at most
    `bucket_bytes` per dtype (a larger gradient is a bucket of its own).

    A DTensor gradient (a tensor-parallel shard) is reduced as its local shard: the group is a dp
    or tie group of ranks with the same tp index, so the shards line up."""
    if group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(local_tensor(p.grad))
    size = dist.get_world_size(group)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        filled = 0
        for g in [*grads, None]:
            if bucket and (g is None or filled + g.numel() * g.element_size() > bucket_bytes):
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, group=group)
                if average:
                    flat /= size
                for local, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    local.copy_(reduced)
                bucket, filled = [], 0
            if g is not None:
                bucket.append(g)
                filled += g.numel() * g.element_size()
