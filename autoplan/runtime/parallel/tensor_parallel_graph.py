"""Tensor parallelism on an inlined graph: a stage that computes in DTensor end to end.

The path of tensor_parallel.py for graphs traced by torch.export (Hugging Face models), where the
attention and MLP are inlined and no module hook fires; apart from the hooks path because it is a
rewriting of the stage's graph (its operators swapped for DTensor-friendly ones), not a layout of
its modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autoplan.graph.data_flow import transposed_weight
from autoplan.graph.sharding import is_transposed_linear

__all__ = ["DTensorStage", "blocked_boxes", "shard_inlined_graph"]


# [Note: tensor parallelism on an inlined graph]
# A graph traced by torch.export inlines the attention and the MLP: no module hook fires, and the
# head counts of its reshapes are baked in at full width. Such a stage computes in DTensor end to
# end: the layout's parameters are Shard DTensors (column-parallel weights and biases on the output
# features, row-parallel weights on the input features, the vocabulary rows of the embedding and
# head), every other parameter and buffer a Replicate DTensor, the stage's inputs enter as
# Replicate DTensors and its outputs leave as whole local tensors (`dtensor_stage`). DTensor's
# sharding propagation follows the graph with global shapes, so the baked reshapes split a sharded
# feature dim into (heads, head_dim) with the heads sharded, and inserts the collectives Megatron
# places by hand: the gradients of the replicated inputs of column-parallel linears in backward,
# and the all-reduce of a row-parallel linear's partial sums, which the rewrite places right after
# the linear (`_RowParallel`: left to DTensor, the partial sums would flow on into the next layer's
# projections, computed whole). The graph is rewritten where DTensor would fail or be slow: a fused
# projection's linear and the split, chunk or slices that cut it ([Note: fused q/k/v]); a constant
# the forward lifts (`_lift_fresh_copy`, no sharding rule); a custom operator
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


def shard_inlined_graph(module: nn.Module, layout: Mapping[str, str], tp_mesh, shared: dict) -> list[str]:
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
    row_weights: set[int] = set()
    for path, owner in modules:
        module_style = layout.get(path)
        for name, p in list(owner.named_parameters(recurse=False)):
            style, key = layout.get(path), name
            transposed = path in getattr(layout, "transposed", ()) or is_transposed_linear(owner)
            full = f"{path}.{name}" if path else name
            styled = path  # the module whose style it takes
            if style is None and full in tied and tied[full].rpartition(".")[0] in layout:
                # Another name of a sharded parameter (a stage may hold it only under this one):
                # the same placement, or the tie's gradient reduction across stages would not line up.
                target, _, key = tied[full].rpartition(".")
                style, styled = layout.get(target), target
                transposed = target in getattr(layout, "transposed", ())
            if id(p) not in converted:
                if style in ("colwise", "vocab-head"):
                    dim = 1 if transposed and key == "weight" else 0
                    placement = Shard(dim)
                elif style == "colwise-qkv" and styled in getattr(layout, "blocks", {}):
                    placement = None  # unequal or whole parts ([Note: blocks of a fused projection])
                    dim = 1 if transposed and key == "weight" else 0
                    converted[id(p)] = (p, nn.Parameter(_blocked_parameter(p.detach(), tp_mesh, dim,
                                                                           layout.blocks[styled]),
                                                        requires_grad=p.requires_grad))
                elif style == "colwise-qkv":  # each part (q, k, v; gate, up) sharded ([Note: fused q/k/v])
                    dim = 1 if transposed and key == "weight" else 0
                    parts = getattr(layout, "parts", {}).get(styled, 3)
                    placement = _StridedShard(dim, split_factor=parts)
                elif style == "rowwise" and key == "weight":
                    placement = Shard(0 if transposed else 1)
                elif style == "vocab-embedding":
                    placement = Shard(0)
                else:
                    placement = Replicate()
                if placement is not None:
                    converted[id(p)] = (p, nn.Parameter(
                        distribute_tensor(p.detach(), tp_mesh, [placement], src_data_rank=None),
                        requires_grad=p.requires_grad))
            owner._parameters[name] = converted[id(p)][1]
            if style in ("vocab-embedding", "vocab-head") and key == "weight":  # a lookup may read a tied head's
                vocab_tables.add(id(converted[id(p)][1]))
            if style == "rowwise" and key == "weight":
                row_weights.add(id(converted[id(p)][1]))
        for name, b in list(owner.named_buffers(recurse=False)):
            if b is not None and not isinstance(b, DTensor):
                owner._buffers[name] = DTensor.from_local(b, tp_mesh, [Replicate()], run_check=False)
        if module_style is not None:
            done.append(path)
    vocab_tables |= {id(module.get_submodule(p).weight) for p, style in layout.items()
                     if style == "vocab-embedding" and _has_submodule(module, p)}
    for gm in module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            _rewrite_for_dtensor(gm, vocab_tables, row_weights)
    return done


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _rewrite_for_dtensor(gm: torch.fx.GraphModule, vocab_tables: set[int], row_weights: set[int]) -> None:
    """The graph rewrites of [Note: tensor parallelism on an inlined graph]."""
    import torch.nn.functional as F  # noqa: N812

    aten = torch.ops.aten
    attention = (aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)
    # read before the loop rewrites the ops `_comes_from` stops at
    whole_parts = _whole_part_linears(gm)
    whole_kv = {node for node in gm.graph.nodes if whole_parts and node.op == "call_function"
                and node.target in attention and any(_comes_from(a, whole_parts) for a in node.args[1:3])}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
        elif node.target in _CONTIGUOUS_FIRST:
            node.target = _CONTIGUOUS_FIRST[node.target]
        elif node.target in attention:
            node.target = _local_attention_whole_kv if node in whole_kv else _local_attention
        elif node.target in _FUSED_QKV_OPS or node.target is aten.matmul.default:
            weight = (transposed_weight(node.args[1]) if node.target is aten.matmul.default
                      else node.args[2] if node.target is aten.addmm.default else node.args[1])
            value = _get_attr(gm, weight.target) if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" else None
            if value is not None and _is_strided(value) and node.target in _FUSED_QKV_OPS:
                node.target = _FUSED_QKV_OPS[node.target]
            elif value is not None and _is_blocked(value) and node.target is aten.matmul.default:
                node.args = (node.args[0], weight)  # x @ w.T (FalconLinear) on the local rows
                node.target = _blocked_matmul_t
            elif value is not None and _is_blocked(value) and node.target in _FUSED_QKV_OPS:
                node.target = _FUSED_QKV_OPS[node.target]
            elif value is not None and id(value) in row_weights:
                node.target = _RowParallel(node.target)
        elif node.target in _PARTS:
            node.target = _PARTS[node.target]
        elif node.target is aten.unsqueeze.default:  # GPT-BigCode's `c_attn(x).unsqueeze(1)` before its split
            node.target = _unsqueeze
        elif node.target is aten.lift_fresh_copy.default:  # a constant of the forward (Falcon's index [-2])
            node.target = _lift_fresh_copy
        elif _no_sharding_rule(node.target):
            node.target = _ReplicatedOp(node.target)
        elif node.target in (aten.embedding.default, F.embedding):
            weight = node.args[0] if node.target is aten.embedding.default else node.args[1]
            if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and id(_get_attr(gm, weight.target)) in vocab_tables:
                node.target = _VOCAB_EMBEDDING[node.target]  # same node (its block and name stay): no new node
    for node in list(gm.graph.nodes):  # a blocked weight's transpose the matmul no longer reads
        if node.op == "call_function" and node.target in (aten.t.default, aten.numpy_T.default) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _whole_part_linears(gm: torch.fx.GraphModule) -> set:
    """The graph's linear nodes whose weight is blocked with parts left whole (a multi-query key and
    value head: [Note: repeated whole heads])."""
    aten = torch.ops.aten
    found = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not (node.target in _FUSED_QKV_OPS or node.target is aten.matmul.default):
            continue
        weight = (transposed_weight(node.args[1]) if node.target is aten.matmul.default
                  else node.args[2] if node.target is aten.addmm.default else node.args[1])
        value = _get_attr(gm, weight.target) if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" else None
        if value is not None and _is_blocked(value) and any(whole for _, whole in value.placements[0].blocks):
            found.add(node)
    return found


def _comes_from(arg: Any, sources: set, steps: int = 16) -> bool:
    """Whether graph value `arg` is computed from one of `sources` through at most `steps` ops that
    are neither linears nor attention (the cut, reshapes and repeat between a fused projection and
    the attention it feeds)."""
    aten = torch.ops.aten
    stops = {*_FUSED_QKV_OPS, aten.matmul.default, aten.bmm.default, aten.scaled_dot_product_attention.default,
             torch.nn.functional.scaled_dot_product_attention}
    frontier, seen = [arg], set()
    for _ in range(steps):
        nodes = [n for n in frontier if isinstance(n, torch.fx.Node) and n not in seen]
        if not nodes:
            return False
        if any(n in sources for n in nodes):
            return True
        seen.update(nodes)
        frontier = [a for n in nodes if n.op == "call_function" and n.target not in stops
                    for a in tree_flatten((n.args, n.kwargs))[0]]
    return False


class _RowParallel:
    """A row-parallel linear whose partial sums are all-reduced at once (Megatron-LM's g operator,
    Shoeybi et al. 2019, Fig. 3): left to DTensor, a Partial output would flow on through the
    residual add and the next norm's scaling (both linear in it) into the next layer's q, k and v
    projections, which would then all-gather their weights and compute every head on every rank."""

    def __init__(self, op):
        self.op = op
        self.__name__ = f"row_parallel_{getattr(op, '__name__', 'linear')}"

    def __call__(self, *args, **kwargs):
        from torch.distributed.tensor import DTensor, Replicate

        out = self.op(*args, **kwargs)
        if isinstance(out, DTensor) and any(p.is_partial() for p in out.placements):
            out = out.redistribute(out.device_mesh, [Replicate()] * out.device_mesh.ndim)
        return out


def _lift_fresh_copy(x):
    """A copy of a constant the forward made (held replicated): DTensor has no rule for the op."""
    from torch.distributed.tensor import DTensor

    return x.clone() if isinstance(x, DTensor) else torch.ops.aten.lift_fresh_copy.default(x)


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
# A fused projection laid out in k equal blocks along its output features ([q | k | v]: GPT-2's
# `c_attn`, Phi-3's `qkv_proj`; [gate | up]: Phi-3's `gate_up_proj`; [Note: fused projections] in
# graph/sharding.py) is sharded block by block: `_StridedShard(dim, split_factor=k)`, so rank r
# holds [q_r | k_r | v_r], each 1/tp of its block, while the parameter's `full_tensor()` (state
# dicts, checkpoints) is the model's own [q | k | v]. DTensor has no rule for such a linear, so the
# graph's linear op runs on the local shards (`_qkv_linear`: the replicated input's gradient is a
# partial sum, all-reduced by DTensor), its following view keeps the placement (`_view`), and the
# cut into its blocks (`split`, `chunk`, or one slice per block) hands each rank its own parts as
# Shard DTensors (`_split`, `_chunk`, `_slice`); from there attention is head-parallel as with
# separate q, k and v projections, and the gated product element-wise as with separate gate and up.


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


def _qkv_out(out: torch.Tensor, weight) -> Any:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if _is_blocked(weight):
        return _blocked(out, weight.device_mesh, out.dim() - 1, weight.placements[0].blocks)
    parts = weight.placements[0].split_factor
    return DTensor.from_local(out, weight.device_mesh, [_StridedShard(out.dim() - 1, split_factor=parts)],
                              run_check=False)


def _local_weight(t):
    """A fused projection's local weight or bias; for one with parts left whole, their gradient is
    summed over tp in backward ([Note: blocks of a fused projection])."""
    if _is_blocked(t) and any(whole for _, whole in t.placements[0].blocks):
        return _SumWholeParts.apply(t.to_local(), t.device_mesh, t.placements[0])
    return t.to_local()


def _qkv_addmm(bias, x, weight, *, beta=1, alpha=1):  # Conv1D: addmm(bias, x, weight (in, out))
    mesh = weight.device_mesh
    out = torch.addmm(_local_weight(bias), _local_input(x, mesh), _local_weight(weight), beta=beta, alpha=alpha)
    return _qkv_out(out, weight)


def _qkv_linear(x, weight, bias=None):
    mesh = weight.device_mesh
    out = torch.nn.functional.linear(_local_input(x, mesh), _local_weight(weight),
                                     None if bias is None else _local_weight(bias))
    return _qkv_out(out, weight)


def _blocked_matmul_t(x, weight):
    """`x @ weight.T` (FalconLinear) of a blocked weight, on this rank's rows."""
    return _qkv_out(torch.matmul(_local_input(x, weight.device_mesh), _local_weight(weight).t()), weight)


_FUSED_QKV_OPS = {torch.ops.aten.addmm.default: _qkv_addmm, torch.ops.aten.linear.default: _qkv_linear,
                  torch.nn.functional.linear: _qkv_linear}


def _strided_view(x, shape) -> Any:
    """A view of a [q_r | k_r | v_r] DTensor: one that keeps the last dim keeps the placement; one
    that splits it into (parts, ...) gives Shard on the dim after the parts (the heads); else None."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shape = list(shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = x.numel() // known
    mesh, n, last, parts = x.device_mesh, x.device_mesh.size(), x.shape[-1], x.placements[0].split_factor
    local = x.to_local()
    if shape[-1] == last:
        out = local.reshape(*shape[:-1], last // n)
        return DTensor.from_local(out, mesh, [_StridedShard(len(shape) - 1, split_factor=parts)], run_check=False)
    k = next((i for i in range(len(shape)) if math.prod(shape[i:]) == last), None)
    if k is not None and shape[k] == parts and k + 1 < len(shape) and shape[k + 1] % n == 0:
        out = local.reshape(*shape[:k], parts, shape[k + 1] // n, *shape[k + 2:])
        return DTensor.from_local(out, mesh, [Shard(k + 1)], run_check=False)
    return None


def _own_parts(x, dim: int) -> tuple | None:
    """This rank's parts of a strided DTensor cut into its blocks along `dim`, as Shard DTensors;
    None when `x` is not strided along `dim`."""
    from torch.distributed.tensor import DTensor, Shard

    if not _is_strided(x) or x.placements[0].dim != dim % x.dim():
        return None
    mesh, dim = x.device_mesh, dim % x.dim()
    return tuple(DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)
                 for t in x.to_local().chunk(x.placements[0].split_factor, dim))


def _split(x, split_size, dim=0):
    if _is_blocked(x):
        return _blocked_split(x, dim, [split_size] * -(-x.shape[dim] // split_size))
    own = _own_parts(x, dim)
    if own is not None and split_size * len(own) == x.shape[dim]:
        return own
    return torch.ops.aten.split.Tensor(x, split_size, dim)


def _split_with_sizes(x, sizes, dim=0):
    if _is_blocked(x):
        return _blocked_split(x, dim, sizes)
    own = _own_parts(x, dim)
    if own is not None and len(sizes) == len(own) and len(set(sizes)) == 1:
        return own
    return torch.ops.aten.split_with_sizes.default(x, sizes, dim)


def _chunk(x, chunks, dim=0):
    own = _own_parts(x, dim)
    if own is not None and chunks == len(own):
        return own
    return torch.ops.aten.chunk.default(x, chunks, dim)


def _slice(x, dim=0, start=None, end=None, step=1):
    """One block of a strided DTensor when the slice is exactly that block (Phi-3's
    `qkv[..., :q]`, `qkv[..., q:q + kv]`, `qkv[..., q + kv:]`), else the slice."""
    if _is_blocked(x):
        return _blocked_slice(x, dim, start, end, step)
    own = _own_parts(x, dim) if step == 1 else None
    if own is not None:
        width = x.shape[dim]
        size = width // len(own)
        begin = (start or 0) + (width if (start or 0) < 0 else 0)
        stop = width if end is None else min(end + (width if end < 0 else 0), width)
        if begin % size == 0 and stop - begin == size:
            return own[begin // size]
    return torch.ops.aten.slice.Tensor(x, dim, start, end, step)


def _index(x, indices):
    if _is_blocked(x):
        return _blocked_index(x, indices)
    return torch.ops.aten.index.Tensor(x, indices)


_PARTS = {torch.ops.aten.split.Tensor: _split, torch.ops.aten.split_with_sizes.default: _split_with_sizes,
          torch.ops.aten.chunk.default: _chunk, torch.ops.aten.slice.Tensor: _slice,
          torch.ops.aten.index.Tensor: _index}


# [Note: blocks of a fused projection]
# A fused [q | k | v] projection whose parts differ in size (grouped-query heads: Phi-3's
# `qkv_proj` with fewer key/value heads) or whose key and value parts are one head every query head
# shares (multi-query: Falcon's `query_key_value`) has no DTensor placement: rank r holds q_r, the
# query heads of its key/value groups, beside k_r and v_r (or beside the whole k and v), which is
# neither a contiguous nor a strided shard of [q | k | v] ([Note: fused projections] in
# graph/tp_pairs.py: Megatron-LM's fused QKV holds the same rows, laid out per query group). Such a
# weight is held as `_BlockShard(dim, blocks)`: each part's 1/tp (or all of a part left whole) side
# by side, while its `full_tensor()` (checkpoints, state dicts) is the model's own [q | k | v]
# (`_BlockShard._to_replicate_tensor` gathers and reorders the parts). To DTensor's sharding rules
# it is Shard(dim) (equal to it, so the optimizer's element-wise steps and the dp reductions work on
# the local rows); every op of the graph that reads it is rewritten: the linear runs on the local
# rows and its output is blocked the same way along its features (`_qkv_out`), a reshape of those
# features into (heads, head_dim) keeps the blocks in heads (`_blocked_view`), as an unsqueeze
# before the cut does (GPT-BigCode's `c_attn(x).unsqueeze(1)`: `_unsqueeze`), and the slices,
# splits or index that cut it hand each rank its parts: a sharded part as Shard, a whole part as a
# Replicate DTensor (`_blocked_part`). A whole key/value head is read by this rank's query heads
# only ([Note: repeated whole heads] where the graph repeats it to every query head), so its
# gradient on each rank is of those heads (a per-rank part of the sum, carried as
# Replicate the way DTensor hands back a to_local's gradient): the input's gradient, a partial sum
# over tp (`_local_input`), sums them, and the weight's whole rows are all-reduced over tp in
# backward (`_SumWholeParts`), as torch's SequenceParallel norms sum their replicated weights'
# gradients.


try:
    from torch.distributed.tensor import Shard as _Shard
except ImportError:  # pragma: no cover - torch without DTensor
    _Shard = object


class _BlockShard(_Shard):
    """Shard along `dim` in parts: `blocks` is (size, left whole) per part, in the global order; the
    local tensor is each part's 1/tp (this rank's) or the whole part, side by side."""

    def __init__(self, dim: int, blocks: tuple[tuple[int, bool], ...]):
        super().__init__(dim)
        self.blocks = tuple((int(n), bool(w)) for n, w in blocks)

    # Equal to Shard(dim) for DTensor's spec checks and caches: only the rewritten ops read its parts.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Shard) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(_Shard(self.dim))

    def __repr__(self) -> str:
        return f"_BlockShard(dim={self.dim}, blocks={self.blocks})"

    def local_sizes(self, n: int) -> list[int]:
        return [size if whole else size // n for size, whole in self.blocks]

    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        """This rank's parts of a whole tensor (a parameter initialized by copying its full value in)."""
        n = mesh.size(mesh_dim)
        pieces, offset = [], 0
        for size, whole in self.blocks:
            part = local_tensor.narrow(self.dim, offset, size)
            pieces.append(part if whole else part.chunk(n, self.dim)[shard_index])
            offset += size
        return torch.cat(pieces, self.dim).contiguous()

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        import torch.distributed._functional_collectives as funcol

        n = mesh.size(mesh_dim)
        gathered = funcol.all_gather_single(local_tensor.contiguous(), gather_dim=self.dim, group=(mesh, mesh_dim))
        ranks = gathered.chunk(n, self.dim)
        out, offset = [], 0
        for size, (_, whole) in zip(self.local_sizes(n), self.blocks):
            pieces = [ranks[0]] if whole else ranks
            out.extend(r.narrow(self.dim, offset, size) for r in pieces)
            offset += size
        return torch.cat(out, self.dim)


def _is_blocked(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and isinstance(t.placements[0], _BlockShard)


def blocked_boxes(value: Any) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]] | None:
    """The boxes of the whole tensor a blocked DTensor's local tensor holds: (global offsets, sizes,
    local view) per part (a part left whole is the same box on every tp rank); None for any other
    tensor. For the checkpoint's and the weight loader's boxes (checkpoint/planners.py `_pieces`)."""
    if not _is_blocked(value):
        return None
    placement, mesh, local = value.placements[0], value.device_mesh, value.to_local()
    n, rank, dim = mesh.size(), mesh.get_local_rank(), placement.dim
    boxes, offset, local_offset = [], 0, 0
    for (size, whole), local_size in zip(placement.blocks, placement.local_sizes(n)):
        start = [0] * value.dim()
        start[dim] = offset + (0 if whole else rank * local_size)
        sizes = list(value.shape)
        sizes[dim] = local_size
        boxes.append((tuple(start), tuple(sizes), local.narrow(dim, local_offset, local_size)))
        offset, local_offset = offset + size, local_offset + local_size
    return boxes


def _blocked(local: torch.Tensor, mesh, dim: int, blocks) -> Any:
    """A DTensor of `local` held as `_BlockShard(dim, blocks)`."""
    from torch.distributed.tensor import DTensor

    shape = list(local.shape)
    shape[dim] = sum(n for n, _ in blocks)
    stride = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return DTensor.from_local(local, mesh, [_BlockShard(dim, blocks)], run_check=False, shape=torch.Size(shape),
                              stride=tuple(stride))


def _blocked_parameter(full: torch.Tensor, mesh, dim: int, blocks) -> Any:
    """This rank's parts of a fused projection's weight or bias (`full`, the model's own)."""
    from torch.distributed.tensor import DTensor

    # A parameter made on meta is initialized by copying its full value in (runtime/parallel/split.py
    # `materialize_stages`); DTensor's own copy_ would write a plain Shard's rows. A view of the
    # whole parameter (`view_as`, as torch's pipelining takes a parameter's gradient accumulator)
    # would compute a plain Shard's local shape.
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[torch.ops.aten.copy_.default] = _copy_into_blocks
    handlers[torch.ops.aten.view.default] = _view_of_blocks
    placement = _BlockShard(dim, blocks)
    return _blocked(placement._replicate_to_shard(full, mesh, 0, mesh.get_local_rank()), mesh, dim, blocks)


def _default_dtensor_op(op, handler, args, kwargs):
    """`op` through DTensor's own dispatch, `handler` (a custom handler of it) set aside meanwhile."""
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    del handlers[op]
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = handler


def _view_of_blocks(op, args, kwargs):
    """A view of a blocked DTensor to its own shape: the same blocks over a view of its local tensor."""
    x, shape = args[0], args[1]
    if _is_blocked(x) and tuple(shape) == tuple(x.shape):
        placement = x.placements[0]
        local = x.to_local()
        return _blocked(local.view(local.shape), x.device_mesh, placement.dim, placement.blocks)
    return _default_dtensor_op(op, _view_of_blocks, args, kwargs)


def _copy_into_blocks(op, args, kwargs):
    """DTensor's copy_ with a blocked destination: a whole value (a plain tensor, a Replicate or
    another blocked DTensor of the same parts) is written as this rank's parts; any other copy_ goes
    to DTensor's own."""
    from torch.distributed.tensor import DTensor

    dst, src = args[0], args[1]
    if _is_blocked(dst):
        if _is_blocked(src) and src.placements[0].blocks == dst.placements[0].blocks:
            dst.to_local().copy_(src.to_local(), *args[2:], **kwargs)
            return dst
        if not isinstance(src, DTensor) or all(p.is_replicate() for p in src.placements):
            whole = src.to_local() if isinstance(src, DTensor) else src
            mesh = dst.device_mesh
            mine = dst.placements[0]._replicate_to_shard(whole.expand(dst.shape), mesh, 0, mesh.get_local_rank())
            dst.to_local().copy_(mine, *args[2:], **kwargs)
            return dst
    return _default_dtensor_op(op, _copy_into_blocks, args, kwargs)


class _SumWholeParts(torch.autograd.Function):
    """Identity on a blocked weight's local rows whose backward all-reduces the gradient of the
    parts left whole over tp (each rank's covers its own query heads)."""

    @staticmethod
    def forward(ctx, local, mesh, placement):
        ctx.group, ctx.placement, ctx.n = mesh.get_group(), placement, mesh.size()
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        offset, dim = 0, ctx.placement.dim
        for size, (_, whole) in zip(ctx.placement.local_sizes(ctx.n), ctx.placement.blocks):
            if whole:
                part = grad.narrow(dim, offset, size).contiguous()
                dist.all_reduce(part, group=ctx.group)
                grad.narrow(dim, offset, size).copy_(part)
            offset += size
        return grad, None, None


def _blocked_part(x, index: int) -> Any:
    """Part `index` of a blocked DTensor: Shard along its dim, or Replicate when left whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placement, mesh = x.placements[0], x.device_mesh
    sizes = placement.local_sizes(mesh.size())
    local = x.to_local().narrow(placement.dim, sum(sizes[:index]), sizes[index])
    whole = placement.blocks[index][1]
    return DTensor.from_local(local, mesh, [Replicate() if whole else Shard(placement.dim)], run_check=False)


def _block_at(x, start: int, stop: int) -> int:
    """The part of a blocked DTensor that is exactly [start, stop) of its dim (global)."""
    offset = 0
    for i, (size, _) in enumerate(x.placements[0].blocks):
        if (offset, offset + size) == (start, stop):
            return i
        offset += size
    raise RuntimeError(f"autoplan cannot cut [{start}:{stop}] out of a fused projection held in parts "
                       f"{x.placements[0].blocks}: only whole parts ([Note: blocks of a fused projection])")


def _blocked_slice(x, dim, start, end, step):
    placement = x.placements[0]
    dim = dim % x.dim()
    if dim != placement.dim:  # along another dim: local, the blocks kept
        local = torch.ops.aten.slice.Tensor(x.to_local(), dim, start, end, step)
        return _blocked(local, x.device_mesh, placement.dim, placement.blocks)
    width = x.shape[dim]
    begin = (start or 0) + (width if (start or 0) < 0 else 0)
    stop = width if end is None else min(end + (width if end < 0 else 0), width)
    if step != 1:
        raise RuntimeError("autoplan cannot slice a fused projection held in parts with a step")
    return _blocked_part(x, _block_at(x, begin, stop))


def _blocked_split(x, dim, sizes) -> tuple:
    placement, dim = x.placements[0], dim % x.dim()
    if dim != placement.dim or tuple(sizes) != tuple(n for n, _ in placement.blocks):
        raise RuntimeError(f"autoplan cannot split a fused projection held in parts {placement.blocks} into {sizes}")
    return tuple(_blocked_part(x, i) for i in range(len(sizes)))


def _blocked_index(x, indices):
    """`x[..., [i], ...]` of one position along the blocked dim (Falcon's key head `[-2]`)."""
    from torch.distributed.tensor import DTensor

    placement = x.placements[0]
    others = [i for i, t in enumerate(indices) if t is not None]
    idx = indices[others[0]] if others == [placement.dim] else None
    if isinstance(idx, DTensor):
        idx = idx.to_local()
    if idx is None or idx.numel() != 1 or idx.dtype not in (torch.long, torch.int):
        raise RuntimeError("autoplan cannot index a fused projection held in parts other than by one position")
    i = int(idx.reshape(())) % x.shape[placement.dim]
    return _blocked_part(x, _block_at(x, i, i + 1))


def _blocked_view(x, shape) -> Any:
    """A view of a blocked DTensor along its last dim: one keeping the last dim keeps the blocks, one
    splitting it into (heads, head_dim) gives blocks of heads."""
    shape = list(shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape[shape.index(-1)] = x.numel() // known
    placement, mesh, last = x.placements[0], x.device_mesh, x.shape[-1]
    local = x.to_local()
    if placement.dim == x.dim() - 1 and shape[-1] == last:
        return _blocked(local.reshape(*shape[:-1], local.shape[-1]), mesh, len(shape) - 1, placement.blocks)
    if (placement.dim == x.dim() - 1 and len(shape) >= 2 and shape[-2] * shape[-1] == last
            and all(n % shape[-1] == 0 for n, _ in placement.blocks)):
        head = shape[-1]
        return _blocked(local.reshape(*shape[:-2], local.shape[-1] // head, head), mesh, len(shape) - 2,
                        tuple((n // head, whole) for n, whole in placement.blocks))
    raise RuntimeError(f"autoplan cannot reshape a fused projection held in parts {placement.blocks} to {shape} "
                       "([Note: blocks of a fused projection])")


def _unsqueeze(x, dim):
    """`x.unsqueeze(dim)`; of a fused projection's output held in parts (blocked or strided), on its
    local parts with the parts kept (DTensor would take a blocked one for a plain Shard)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not (_is_blocked(x) or _is_strided(x)):
        return torch.ops.aten.unsqueeze.default(x, dim)
    placement = x.placements[0]
    dim = dim % (x.dim() + 1)
    local, shard_dim = x.to_local().unsqueeze(dim), placement.dim + (dim <= placement.dim)
    if _is_blocked(x):
        return _blocked(local, x.device_mesh, shard_dim, placement.blocks)
    return DTensor.from_local(local, x.device_mesh, [_StridedShard(shard_dim, split_factor=placement.split_factor)],
                              run_check=False)


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
    if _is_blocked(x):  # local reshapes of this rank's parts (their gradients too)
        return _blocked_view(x, shape)
    out = _strided_view(x, shape) if _is_strided(x) else None
    if out is None:
        out = torch.ops.aten.reshape.default(_contiguous(x), shape)
    return _ContiguousGrad.apply(out) if out.requires_grad else out


def _view(x, shape):
    if _is_blocked(x):  # local reshapes of this rank's parts (their gradients too)
        return _blocked_view(x, shape)
    out = _strided_view(x, shape) if _is_strided(x) else None
    if out is None:
        out = torch.ops.aten.view.default(_contiguous(x), shape)
    return _ContiguousGrad.apply(out) if out.requires_grad else out


_CONTIGUOUS_FIRST = {torch.ops.aten.reshape.default: _reshape, torch.ops.aten.view.default: _view}


# [Note: repeated whole heads]
# A multi-query key and value head left whole on every rank ([Note: blocks of a fused projection])
# may reach the attention repeated to every query head (GPT-BigCode's `c_attn(x).unsqueeze(1).split(
# ...)`, through transformers' `repeat_kv` in the SDPA forward autoplan traces with): a Replicate
# DTensor with as many heads as q. DTensor's redistribution of it to this rank's heads (Shard) all-
# gathers its gradient in backward, so each rank's would cover every query head and the all-reduce
# of the whole parts (`_SumWholeParts`) would count it tp times. An attention whose key or value is
# computed from such a projection (`_comes_from` at rewrite time) takes this rank's heads of a
# Replicate key or value as a local slice (`_local_attention_whole_kv`): its gradient is of this
# rank's query heads, as when the one head is broadcast (Falcon's), and the whole parts' all-reduce
# sums them once. A per-head tensor the model computes replicated otherwise (T5's position bias)
# keeps DTensor's redistribution, whose gathered gradient its replicated parameter needs.


def _local_attention_whole_kv(q, k, v, attn_mask=None, *args, **kwargs):
    """`_local_attention` of a key or value computed from a whole multi-query head ([Note: repeated
    whole heads]): this rank's heads of a Replicate key or value are a local slice."""
    return _attention_on_local_heads(q, k, v, attn_mask, args, kwargs, slice_replicated=True)


def _local_attention(q, k, v, attn_mask=None, *args, **kwargs):
    """Scaled dot-product attention on this rank's heads (dim 1) when q, k and v hold whole heads,
    else on the whole (replicated) tensors; the result is a DTensor of that placement."""
    return _attention_on_local_heads(q, k, v, attn_mask, args, kwargs, slice_replicated=False)


def _attention_on_local_heads(q, k, v, attn_mask, args, kwargs, *, slice_replicated: bool):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    # The kernel by its name, looked up when called: context parallelism replaces it for the step
    # (runtime/parallel/context.py).
    if not isinstance(q, DTensor):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask, *args, **kwargs)
    mesh = q.device_mesh
    n = mesh.size()
    # one key/value head every query head shares (multi-query, held whole: [Note: blocks of a
    # fused projection]) broadcasts over this rank's query heads
    heads_split = q.dim() == 4 and q.shape[1] % n == 0 and (k.shape[1] % n == 0 or k.shape[1] == 1 < q.shape[1])
    placements = [Shard(1)] if heads_split else [Replicate()]

    def local(t, key_or_value: bool = False):
        if not isinstance(t, torch.Tensor):
            return t
        per_head = t.dim() == 4 and t.shape[1] == q.shape[1]  # a mask or bias per head (T5's), else broadcast
        if not isinstance(t, DTensor):
            if not (heads_split and per_head):
                return t
            # A plain tensor the graph made (T5's zero position bias plus the mask) is replicated:
            # this rank's heads are a local slice.
            t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        if (slice_replicated and key_or_value and heads_split and per_head
                and all(p.is_replicate() for p in t.placements)):
            heads = t.shape[1] // n  # this rank's, with a gradient of them only ([Note: repeated whole heads])
            return t.to_local().narrow(1, mesh.get_local_rank() * heads, heads)
        return t.redistribute(mesh, placements if per_head else [Replicate()]).to_local()

    out = torch.nn.functional.scaled_dot_product_attention(local(q), local(k, True), local(v, True), local(attn_mask),
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
