"""Tensor-parallel layouts found from a model's data flow, not from its class names.

[Note: finding the Megatron pattern]
Megatron-LM's tensor parallelism (Shoeybi et al. 2019, Sec. 3) pairs column-parallel linears with
one row-parallel linear: the column shards' outputs stay sharded through element-wise work (an
activation, a gated product) or attention (heads are independent), and the row-parallel linear's
partial sums are all-reduced once. `find_layout` finds those pairs by running the model (or its
traced graph, where a linear op on a parameter counts as a call of that linear) once on fake
tensors and following, for every activation, the set of linear layers whose outputs it was
computed from since the last linear (a `TorchDispatchMode` carries the sets through every aten op;
a linear's output starts a new set):

- a linear B whose input comes from linears P (and from nothing else: no residual, no other input),
  where every linear of P feeds B only, and nothing on the way normalizes over the features (a
  LayerNorm between P and B would need the whole width), is a row-parallel B with column-parallel P;
- it is attention when two activations met in a batched matmul (q k^T, then the weights times v)
  or an attention kernel on the way: the head size is the last dim of q there, and each
  column-parallel width / head size is that projection's head count (q: heads, k and v: KV heads).
  Otherwise it is an MLP (up/gate -> down), whose width tp must divide;
- a fused q/k/v projection (one column-parallel linear, three heads' worth per head) is sharded only
  when its output is first reshaped into (heads, ...) (the per-head layout of Megatron-LM and of
  autoplan's zoo); one first split along its features, or reshaped into (3, heads, ...), is laid
  out [q | k | v] (GPT-2's `c_attn`), where a contiguous column shard would not hold whole heads,
  so that attention stays replicated;
- the token embedding and the LM head are vocabulary-parallel when the head is a linear whose output
  is the model's output, of width `num_embeddings` of an `nn.Embedding` of the hidden width (or
  tied to it);
- `nn.MultiheadAttention` computes its fused in-projection in one functional call (no module to
  shard): it stays replicated, and the layout says so.

Linear layers are `nn.Linear` and Hugging Face's `Conv1D` (GPT-2; its weight is (in, out)). Head
and KV-head counts come from the shapes that flow, so a model needs no attribute naming them.

The profile (what `suggest` searches) and `partition` both take a model's layout from its traced
graph, run on the graph's own inputs (`traced_layout`), so a plan `suggest` returns is one the
runtime runs. The runtime (`runtime/tensor_parallel.py`) runs a layout either with torch's parallel styles (module hooks)
where the traced graph calls the attention / MLP modules whole, or with the whole stage in DTensor
where the graph inlines them (torch.export); sequence parallelism needs the former.

The layout as data is graph/tp_layout.py; the machinery that follows the flow through every op is
graph/data_flow.py; this module runs it on a model and reads the pattern from what it recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autoplan.graph.data_flow import (
    ATTN,
    INPUT,
    NORM,
    OUTPUT,
    Flow,
    FlowInterpreter,
    FlowMode,
    constants_device,
    tags_of,
)
from autoplan.graph.tp_layout import ShardGroup, TensorParallelLayout

__all__ = ["default_inputs", "find_layout", "for_graph", "is_transposed_linear", "linear_widths", "sp_children",
           "traced_layout"]


def linear_widths(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer (`nn.Linear`, or transformers' `Conv1D` whose weight is
    stored (in, out)), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
            and getattr(module, "nf", None) == weight.shape[1]:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def is_transposed_linear(module: nn.Module) -> bool:
    """True for a `Conv1D`: weight (in, out), so column-parallel shards dim 1, row-parallel dim 0."""
    return not isinstance(module, nn.Linear) and linear_widths(module) is not None


def _run_flow(model: nn.Module, example_inputs: Sequence[Any] | Mapping[str, Any]) -> Flow:
    linears = {path: m for path, m in model.named_modules() if linear_widths(m) is not None}
    flow = Flow(widths={p: linear_widths(m) for p, m in linears.items()},
                 transposed={p for p, m in linears.items() if is_transposed_linear(m)},
                 embeddings={p: (m.num_embeddings, m.embedding_dim, id(m.weight)) for p, m in model.named_modules()
                             if isinstance(m, nn.Embedding)},
                 head_weights={p: id(m.weight) for p, m in linears.items()},
                 sources={}, consumers={}, head_dim={}, first_op={}, order=[])
    params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}

    def pre(path, x):
        flow.sources.setdefault(path, tags_of(x))
        flow.order.append(path)

    def post(path, out):
        if isinstance(out, torch.Tensor):
            out._ap_tags = frozenset({path})
            out._ap_fresh = path

    handles = []
    for path, m in linears.items():
        handles.append(m.register_forward_pre_hook(
            lambda module, args, path=path: pre(path, next((a for a in args if isinstance(a, torch.Tensor)), None))))
        handles.append(m.register_forward_hook(lambda module, args, out, path=path: post(path, out)))
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FlowMode(params)
    param = next(iter(model.parameters()), None)
    graph_device = constants_device(model) if isinstance(model, torch.fx.GraphModule) else None
    device = graph_device or (param.device if param is not None else torch.device("cpu"))

    def fake(x):  # an empty of the input's shape on the model's device (a fake tensor: nothing allocated)
        if not isinstance(x, torch.Tensor):
            return x
        x = torch.empty(x.shape, dtype=x.dtype, device=device)
        x._ap_tags = frozenset({INPUT})  # a model input is a source of its own: it never pairs two linears
        return x

    # Fake tensors: nothing is allocated (real weights are not copied), and models that test values
    # (Hugging Face masks) see they are traced. A traced graph whose weights are all on meta has no
    # values to test: it runs on meta tensors, several times faster (a 96-layer GPT: 1.5 s -> 0.3 s).
    on_meta = (isinstance(model, torch.fx.GraphModule) and graph_device is None and param is not None
               and all(p.device.type == "meta" for p in model.parameters()))
    if on_meta:
        device = torch.device("meta")
    try:
        with torch.no_grad(), contextlib.nullcontext() if on_meta else FakeTensorMode(allow_non_fake_inputs=True):
            if isinstance(example_inputs, Mapping):
                args, kwargs = (), {k: fake(v) for k, v in example_inputs.items()}
            else:
                args, kwargs = tuple(fake(x) for x in example_inputs), {}
            with mode:
                if isinstance(model, torch.fx.GraphModule):
                    out = FlowInterpreter(model, flow, pre, post, graph_device, mode).run(*args, **kwargs)
                else:
                    out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    flow.head_dim, flow.first_op, flow.uses, flow.norms = mode.head_dim, mode.first_op, mode.uses, mode.norms
    flow.order = list(dict.fromkeys(flow.order))
    flow.consumers = {p: set() for p in flow.widths}
    for path, src in flow.sources.items():
        for s in src:
            if s in flow.consumers:
                flow.consumers[s].add(path)
    for t in tree_flatten(out)[0] if not hasattr(out, "to_tuple") else tree_flatten(out.to_tuple())[0]:
        for s in tags_of(t):
            if s in flow.consumers:
                flow.consumers[s].add(OUTPUT)
    return flow


def _common_parent(paths: Sequence[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common[:-1] if len(common) == len(parts[0]) else common)


# --------------------------------------------------------------------------------------------
# The layout


def default_inputs(model: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """Token ids (1, 8) on the model's device when its first parameterized module is an
    nn.Embedding (language models), else None."""
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Embedding):
        return (torch.zeros(1, 8, dtype=torch.long, device=first.weight.device),)
    return None


def find_layout(model: nn.Module, example_inputs: Sequence[Any] | None = None) -> TensorParallelLayout:
    """The tensor-parallel layout of `model` (an nn.Module or a traced GraphModule; [Note: finding
    the Megatron pattern]); runs it once on fake tensors shaped as `example_inputs` (a tuple, or a
    dict of keyword arguments; token ids (1, 8) for a language model when None)."""
    if example_inputs is None:
        example_inputs = default_inputs(model)
        if example_inputs is None:
            return TensorParallelLayout(note="the model was not run (no example inputs) to find its layers")
    total = sum(p.numel() for p in model.parameters())
    try:
        flow = _run_flow(model, example_inputs)
    except Exception as exc:  # noqa: BLE001 - any failure means: no layout, and why
        return TensorParallelLayout(note=f"the model did not run on fake tensors to find its layers "
                                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})", total_params=total)

    widths = flow.widths
    if not widths:
        return TensorParallelLayout(note="the model has no linear layers to shard", total_params=total)
    styles: dict[str, str] = {}
    groups: list[ShardGroup] = []
    replicated: dict[str, str] = {}
    for path, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            replicated[path] = ("nn.MultiheadAttention projects q, k and v in one functional call, which has no "
                                "linear module to shard")
    parts: dict[str, int] = {}
    skipped: dict[str, str] = {}  # attention module -> why its pair was not sharded
    for b in flow.order:
        src = flow.sources.get(b, frozenset())
        feeders = sorted(s for s in src if s in flow.widths)
        if not feeders or len(feeders) != len(src - {ATTN, NORM}):
            continue  # fed by something else too (a residual, an input)
        if any(flow.consumers[a] != {b} for a in feeders):
            continue
        b_in, b_out = flow.widths[b]
        if any(flow.widths[a][0] != b_out for a in feeders) or any(a in styles for a in feeders):
            continue  # not hidden -> ... -> hidden
        parent = _common_parent([*feeders, b])
        found = _attention_pair(flow, feeders, b_in, src) if ATTN in src else _mlp_pair(flow, feeders, b_in, src)
        if isinstance(found, str):
            if ATTN in src:
                skipped.setdefault(parent, found)
            continue
        kind, counts, fused_parts, norm = found
        groups.append(ShardGroup(kind, tuple(feeders), b, counts, parent, norm))
        for a in feeders:
            styles[a] = "colwise-qkv" if fused_parts else "colwise"  # [Note: fused projections]
            if fused_parts:
                parts[a] = fused_parts
        styles[b] = "rowwise"
    # An attention whose projections were not paired stays whole on every tp rank: say so, and why.
    for key in flow.head_dim:
        linears = sorted(t for t in key if t in flow.widths)
        if linears and not any(t in styles for t in linears):
            parent = _common_parent(linears) if len(linears) > 1 else linears[0].rpartition(".")[0]
            if not any(parent == r or parent.startswith(r + ".") for r in replicated):
                replicated[parent] = skipped.get(parent) or next(
                    (why for p, why in skipped.items() if p.startswith(parent + ".") or parent.startswith(p + ".")),
                    f"its projections {', '.join(repr(t) for t in linears)} are not a column- and row-parallel "
                    "pair autoplan can shard by heads")

    if not groups:
        reason = (f"none of its {len(widths)} linear layers feeds another through element-wise or attention "
                  "ops only (no column- and row-parallel pair)")
        if replicated:
            reason = next(iter(replicated.values())) + "; and " + reason
        return TensorParallelLayout(note=reason, replicated=replicated, total_params=total)

    divides = _divides(groups, {})
    _vocab_parallel(flow, styles, divides)
    sharded = sum(p.numel() for p in {id(p): p for path in styles
                                      for p in model.get_submodule(path).parameters(recurse=False)}.values())
    layout = TensorParallelLayout(styles=styles, groups=tuple(groups), divides=divides, replicated=replicated,
                                  sharded_params=sharded, total_params=total, parts=parts,
                                  transposed=frozenset(p for p in styles if p in flow.transposed),
                                  tied=_tied_names(model, styles))
    layout.layers = tuple(_sp_layers(model, layout))
    return layout


def _tied_names(model: nn.Module, styles: Mapping[str, str]) -> dict[str, str]:
    """`TensorParallelLayout.tied`: other names of the styled modules' parameters."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied: dict[str, str] = {}
    for path in styles:
        for pname, p in model.get_submodule(path).named_parameters(recurse=False):
            own = f"{path}.{pname}" if path else pname
            for name in names.get(id(p), []):
                if name != own and name.rpartition(".")[0] not in styles:
                    tied.setdefault(name, own)
    return tied


def _divides(groups: Sequence[ShardGroup], previous: Mapping[str, tuple[int, str]]) -> dict[str, tuple[int, str]]:
    """What tp must divide: per count name, the gcd over the groups (tp divides every count iff it
    divides their gcd); the vocabulary entry of `previous` is kept."""
    divides: dict[str, tuple[int, str]] = {k: v for k, v in previous.items() if k == "vocab_size"}
    for g in groups:
        for name, count in g.counts:
            gcd, where = divides.get(name, (0, g.parent))
            divides[name] = (math.gcd(gcd, count), where)
    return divides


Pair = tuple[str, tuple[tuple[str, int], ...], int, str]
"""A column- and row-parallel pair found: (kind, counts, parts of a fused projection or 0, norm)."""


def _attention_pair(flow: Flow, feeders: Sequence[str], b_in: int, src: frozenset) -> Pair | str:
    """Column-parallel `feeders` of a row-parallel linear of width `b_in` through attention, or why
    not (one phrase): separate q, k and v projections, or one fused projection laid out per head
    (or per key/value group) or in equal blocks ([Note: fused projections])."""
    head_dim = next((d for k, d in flow.head_dim.items() if k <= set(feeders)), None)
    if not head_dim or any(flow.widths[a][1] % head_dim for a in feeders):
        return "its projections' widths are not whole heads"
    norm = ""
    if NORM in src:  # q/k norms: per head (Qwen3), or over the projection's whole width (OLMo2)
        normed = set().union(*(w for k, w in flow.norms.items() if k & set(feeders)))
        if normed == {head_dim}:
            norm = "head"
        elif normed and normed <= {flow.widths[a][1] for a in feeders}:
            norm = "full"
        else:
            return "a normalization between its projections and its output projection spans several heads"
    q = b_in // head_dim
    if len(feeders) > 1:
        kv = min(flow.widths[a][1] // head_dim for a in feeders)
        return "attention", (("num_heads", q),) + ((("num_kv_heads", kv),) if kv != q else ()), 0, norm
    fused, width = feeders[0], flow.widths[feeders[0]][1]
    groups = _groups(flow.first_op.get(fused), width, head_dim, q)
    if groups:  # per head or per key/value group: a contiguous shard holds whole groups
        return "attention", (("num_heads", q),) + ((("num_kv_heads", groups),) if groups != q else ()), 0, norm
    sizes = _parts(flow.uses.get(fused, ()), width)
    if sizes is None:
        first = flow.first_op.get(fused)
        shape = f" to {tuple(first[2][len(first[1]) - 1:])}" if first and first[2] else ""
        return (f"its fused q/k/v projection '{fused}' is reshaped{shape}, not into groups of whole query, key and "
                "value heads (multi-query: key/value heads every query head shares), so autoplan cannot shard it "
                "by heads")
    if len(set(sizes)) != 1 or sizes[0] % head_dim:
        return (f"its fused q/k/v projection '{fused}' is cut into unequal parts {sizes} (grouped-query heads): "
                "a strided shard holds equal parts only")
    return "attention", (("num_heads", sizes[0] // head_dim),), len(sizes), norm


def _mlp_pair(flow: Flow, feeders: Sequence[str], b_in: int, src: frozenset) -> Pair | str:
    """Column-parallel `feeders` of a row-parallel linear of width `b_in` through element-wise ops
    (up/gate -> down), a fused gate/up projection cut into equal parts included, or why not."""
    if NORM in src:
        return "a normalization over the features between them needs the whole width"
    counts = (("ffn_hidden_size", b_in),)
    if all(flow.widths[a][1] == b_in for a in feeders):
        return "mlp", counts, 0, ""
    if len(feeders) == 1:
        sizes = _parts(flow.uses.get(feeders[0], ()), flow.widths[feeders[0]][1])
        if sizes and len(sizes) > 1 and set(sizes) == {b_in}:
            return "mlp", counts, len(sizes), ""
    return "its projections' widths do not match"


# [Note: fused projections]
# A fused projection computes several column-parallel outputs in one linear (q, k and v; gate and
# up). How its output is cut decides how it shards:
# - reshaped at once into (groups, ...) where each group holds whole heads of q, k and v (Megatron-
#   LM's per-head layout, Falcon's `view(b, s, heads, 3, head_dim)` and, with key/value groups,
#   `new_decoder_architecture`'s `view(b, s, kv_heads, heads / kv_heads + 2, head_dim)`): a
#   contiguous shard of the output features holds whole groups, so it is a plain column-parallel
#   linear (`_groups`);
# - cut along its features into equal parts by `split` / `chunk` / slices, or reshaped into
#   (3, heads, ...) ([q | k | v]: GPT-2's `c_attn`, Phi-3's `qkv_proj` and `gate_up_proj`): each
#   part is sharded on its own, rank r holding [q_r | k_r | v_r] (the "colwise-qkv" style; the
#   number of parts in `TensorParallelLayout.parts`), as Megatron-LM's fused QKV holds each rank's
#   heads of all three (Shoeybi et al. 2019, Sec. 3; megatron/core/transformer/attention.py).
#   DTensor's `_StridedShard(dim, split_factor=parts)` is that placement (runtime/
#   tensor_parallel_graph.py [Note: fused q/k/v]); the split on each rank yields its own parts.
# - parts of unequal sizes ([q | k | v] with fewer key/value heads than query heads: Phi-3 with
#   grouped-query attention) have no such placement: the attention stays replicated and the layout
#   says so (`TensorParallelLayout.replicated`), as it does for a reshape into single heads shared
#   by all queries (Falcon's multi-query layout, one key/value head).


def _parts(uses: Sequence[Any], width: int) -> tuple[int, ...] | None:
    """The sizes of the blocks a fused projection's output (`width` features) is cut into along its
    last dim: by `split`, `split_with_sizes`, `chunk`, slices covering it, or a reshape into
    (3, ...); None when it is not cut so."""
    aten = torch.ops.aten
    slices = []
    for func, in_shape, out_shape, extra in uses:
        last = len(in_shape) - 1

        def on_last(dim: int) -> bool:
            return dim % len(in_shape) == last

        if func in (aten.split.Tensor, aten.chunk.default) and extra and on_last(extra[1] if len(extra) > 1 else 0):
            size = extra[0] if func is aten.split.Tensor else -(-width // extra[0])
            return (size,) * (width // size) + ((width % size,) if width % size else ())
        if func is aten.split_with_sizes.default and extra and on_last(extra[1] if len(extra) > 1 else 0):
            return tuple(extra[0])
        if func is aten.slice.Tensor:
            dim, start, end, step = (*extra, None, None, None, None)[:4]
            if on_last(dim or 0) and step in (None, 1):
                slices.append((start or 0, width if end is None else min(end, width)))
        elif (func in _VIEWS and not slices and out_shape is not None and len(out_shape) > last + 1
              and tuple(out_shape[:last]) == tuple(in_shape[:last]) and out_shape[last] == 3):
            return (width // 3,) * 3
    slices.sort()
    if not slices or slices[0][0] != 0 or slices[-1][1] != width:
        return None
    if any(a[1] != b[0] for a, b in zip(slices, slices[1:])):
        return None
    return tuple(end - start for start, end in slices)


def _groups(first_op, width: int, head_dim: int, num_heads: int) -> int:
    """The number of groups when a fused q/k/v output is first reshaped into (groups, ...) each of
    whole query heads and their key and value heads (per head: Megatron-LM's and the zoo's layout;
    per key/value group: Falcon's `new_decoder_architecture`), else 0."""
    if first_op is None:
        return 0
    func, in_shape, out_shape, _ = first_op
    if func not in _VIEWS:
        return 0
    lead = len(in_shape) - 1
    if out_shape is None or len(out_shape) <= lead + 1 or tuple(out_shape[:lead]) != tuple(in_shape[:lead]):
        return 0
    groups = out_shape[lead]
    if groups < 1 or width % groups or num_heads % groups:
        return 0
    per_group = width // groups  # its query heads, one key head and one value head
    return groups if per_group == (num_heads // groups + 2) * head_dim else 0


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _vocab_parallel(flow: Flow, styles: dict[str, str], divides: dict) -> None:
    """Mark the token embedding and LM head vocabulary-parallel (see the module note)."""
    heads = [p for p in flow.order if flow.consumers.get(p) == {OUTPUT} and p not in styles]
    if len(heads) != 1 or heads[0] in flow.transposed:
        return
    h, vocab = flow.widths[heads[0]]
    # The token table is the largest of the hidden width: a classifier with as many labels as some
    # small table has rows (BERT's 2 token types) is not a vocabulary head.
    largest = max((num for num, dim, _ in flow.embeddings.values() if dim == h), default=None)
    for path, (num, dim, weight) in flow.embeddings.items():
        if dim == h and num == largest and (num == vocab or flow.head_weights.get(heads[0]) == weight):
            styles[path] = "vocab-embedding"
            styles[heads[0]] = "vocab-head"
            divides["vocab_size"] = (vocab, "")
            return


def _sp_layers(model: nn.Module, layout: TensorParallelLayout) -> list[str]:
    """Layers whose direct children are feature norms (LayerNorm / RMSNorm) and the sharded
    attention and MLP modules, with nothing replicated inside: [Note: sequence parallelism] in
    runtime/tensor_parallel.py lays those out."""
    out = []
    by_parent = {g.parent: g for g in layout.groups}
    for path, layer in model.named_modules():
        children = dict(layer.named_children())
        prefix = f"{path}." if path else ""
        units = [name for name in children if prefix + name in by_parent]
        kinds = {by_parent[prefix + n].kind for n in units}
        norms = [name for name, c in children.items() if isinstance(c, (nn.LayerNorm, nn.RMSNorm))]
        inside = [p for p in layout.replicated if p.startswith(prefix)]
        if kinds == {"attention", "mlp"} and len(norms) >= 2 and not inside:
            out.append(path)
    return out


def for_graph(layout: TensorParallelLayout, traced) -> TensorParallelLayout:
    """`layout` as the traced graph runs it: module hooks where the graph calls every sharded
    attention / MLP module (and the vocabulary-parallel modules) whole, else `inlined`."""
    called = [n.target for n in traced.gm.graph.nodes if n.op == "call_module"]

    def whole(path: str) -> bool:
        return any(path == t or path.startswith(t + ".") for t in called)

    vocab = [p for p, style in layout.styles.items() if style.startswith("vocab-")]
    if not (all(whole(g.parent) for g in layout.groups) and all(p in called for p in vocab)):
        return dataclasses.replace(layout, inlined=True, layers=())
    # Module hooks run the attention's own code: its reshapes want whole [q | k | v] blocks, and a
    # norm over a projection's whole width would see this rank's part only.
    why = {}
    for g in layout.groups:
        if any(layout.styles[c] == "colwise-qkv" for c in g.colwise):
            why[g] = (f"its fused projection '{g.colwise[0]}' is cut into parts and the graph calls the "
                      f"{g.kind} whole: module hooks cannot shard each part")
        elif g.norm == "full":
            why[g] = ("it normalizes q / k over the whole projection width and the graph calls the attention "
                      "whole: module hooks would normalize this rank's part only")
    if not why:
        return dataclasses.replace(layout, inlined=False)
    styles = {p: s for p, s in layout.styles.items() if not any(p in (*g.colwise, g.rowwise) for g in why)}
    groups = tuple(g for g in layout.groups if g not in why)
    replicated = {**layout.replicated, **{g.parent: reason for g, reason in why.items()}}
    if not groups:
        return TensorParallelLayout(note=next(iter(replicated.values())), replicated=replicated,
                                    total_params=layout.total_params)
    return dataclasses.replace(layout, styles=styles, groups=groups, replicated=replicated, inlined=False,
                               divides=_divides(groups, layout.divides), layers=(),
                               parts={p: n for p, n in layout.parts.items() if p in styles})


def traced_layout(traced, graph_inputs: Sequence[Any] | Mapping[str, Any]) -> TensorParallelLayout:
    """The layout of a traced model as the runtime runs it: `find_layout` on its graph, run on
    `graph_inputs` (the graph's own inputs: the example inputs, plus the target when a loss was
    appended), then `for_graph`. The profile (what `suggest` searches) and `partition` both take
    the layout from here, so a plan `suggest` returns is one the runtime can run."""
    layout = find_layout(traced.gm, graph_inputs)
    return for_graph(layout, traced) if layout else layout


def sp_children(layer: nn.Module, layout: TensorParallelLayout, path: str) -> tuple[list[str], list[str]]:
    """(norm children, sharded attention / MLP children) of a sequence-parallel layer."""
    prefix = f"{path}." if path else ""
    parents = {g.parent for g in layout.groups}
    units = [name for name, _ in layer.named_children() if prefix + name in parents]
    norms = [name for name, c in layer.named_children() if isinstance(c, (nn.LayerNorm, nn.RMSNorm))]
    return norms, units
