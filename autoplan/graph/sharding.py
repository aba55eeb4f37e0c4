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
  where every linear of P feeds B only, is a row-parallel B with column-parallel P; in an MLP
  nothing on the way may normalize over the features (a LayerNorm between P and B would need the
  whole width); in attention a q/k norm may: over each head (Qwen3's, after the per-head view) it
  shards with the heads as it is, over a projection's whole width (OLMo2's) its statistics need
  every rank's heads, which DTensor all-reduces on an inlined graph (`ShardGroup.norm`);
- it is attention when two activations met in a batched matmul (q k^T, then the weights times v)
  or an attention kernel on the way: the head size is the last dim of q there, and each
  column-parallel width / head size is that projection's head count (q: heads, k and v: KV heads).
  Otherwise it is an MLP (up/gate -> down), whose width tp must divide;
- a fused projection (q/k/v, gate/up: one column-parallel linear) is sharded per head or key/value
  group, or part by part (grouped-query parts of unequal sizes included), with a multi-query key and
  value head left whole on every rank, as [Note: fused projections] says; an attention it cannot
  shard stays replicated and the layout lists it (`replicated`), as every attention whose
  projections pair with no row-parallel output;
- an attention whose per-head projections read latents of down-projections (DeepSeek's multi-head
  latent attention) shards the per-head projections and leaves the down-projections whole
  (`ShardGroup.shared`, [Note: latent attention] in graph/tp_pairs.py);
- the token embedding and the LM head are vocabulary-parallel when the head is a linear whose output
  is the model's output, of width `num_embeddings` of an `nn.Embedding` of the hidden width (or
  tied to it);
- `nn.MultiheadAttention` computes its fused in-projection in one functional call (no module to
  shard): it stays replicated, and the layout says so.

Linear layers are `nn.Linear`, Hugging Face's `Conv1D` (GPT-2; its weight is (in, out)) and, in an
inlined graph, `x @ W.T` of a 2-D parameter (Falcon's `FalconLinear`). Head
and KV-head counts come from the shapes that flow, so a model needs no attribute naming them.

The profile (what `suggest` searches) and `partition` both take a model's layout from its traced
graph, run on the graph's own inputs (`traced_layout`), so a plan `suggest` returns is one the
runtime runs. The runtime (`runtime/parallel/tensor_parallel.py`) runs a layout either with torch's parallel styles (module hooks)
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
from autoplan.graph.tp_pairs import attention_pair, mlp_pair

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
                 sources={}, consumers={}, head_dim={}, order=[])
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

    mode = FlowMode(params, {id(p): name for name, p in model.named_parameters()})
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
    flow.head_dim, flow.uses, flow.norms = mode.head_dim, mode.uses, mode.norms
    flow.param_inputs = mode.param_inputs
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
    blocks: dict[str, tuple[tuple[int, bool], ...]] = {}
    for b in flow.order:
        src = flow.sources.get(b, frozenset())
        feeders = sorted(s for s in src if s in flow.widths)
        if not feeders or len(feeders) != len(src - {ATTN, NORM}):
            continue  # fed by something else too (a residual, an input)
        b_in, b_out = flow.widths[b]
        shared = _latent_projections(flow, feeders, b) if ATTN in src else []
        if shared is None:
            continue
        feeders = [a for a in feeders if a not in shared]
        if any(flow.consumers[a] != {b} for a in feeders):
            continue
        if (any(flow.widths[a][0] != b_out for a in feeders if not shared)
                or any(a in styles for a in [*feeders, *shared])):
            continue  # not hidden -> ... -> hidden
        parent = _common_parent([*feeders, *shared, b])
        found = (attention_pair(flow, feeders, b_in, src, shared) if ATTN in src
                 else mlp_pair(flow, feeders, b_in, src))
        if isinstance(found, str):
            if ATTN in src:
                skipped.setdefault(parent, found)
            continue
        kind, counts, fused_parts, norm, fused_blocks = found
        groups.append(ShardGroup(kind, tuple(feeders), b, counts, parent, norm, tuple(shared)))
        for a in feeders:
            styles[a] = "colwise-qkv" if fused_parts else "colwise"  # [Note: fused projections]
            if fused_parts:
                parts[a] = fused_parts
            if fused_blocks:
                blocks[a] = fused_blocks
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
    # The parts of a fused projection left whole (a multi-query key and value) are not sharded.
    for path, parts_of in blocks.items():
        whole = sum(n for n, kept in parts_of if kept)
        sharded -= sum(p.numel() // sum(n for n, _ in parts_of) * whole
                       for p in model.get_submodule(path).parameters(recurse=False))
    # Parameters read only on a sharded attention's heads (a per-head norm's weight): each tp rank's
    # gradient is of its own heads.
    inside = [set(g.colwise) for g in groups if g.kind == "attention" and g.norm]
    head_params = tuple(name for name, tags in flow.param_inputs.items()
                        if tags and name.rpartition(".")[0] not in styles and any(tags <= cols for cols in inside))
    layout = TensorParallelLayout(styles=styles, groups=tuple(groups), divides=divides, replicated=replicated,
                                  sharded_params=sharded, total_params=total, parts=parts, blocks=blocks,
                                  head_params=head_params,
                                  transposed=frozenset(p for p in styles if p in flow.transposed),
                                  tied=_tied_names(model, styles))
    layout.layers = tuple(_sp_layers(model, layout))
    return layout


def _latent_projections(flow: Flow, feeders: Sequence[str], b: str) -> list[str] | None:
    """The projections of an attention left whole on every tp rank, for output projection `b` fed
    by `feeders` ([Note: latent attention] in graph/tp_pairs.py): the down-projections (hidden ->
    latent) that the per-head projections read, and any of them the attention reads too. [] when
    every feeder reads the hidden state (no latent); None when the pattern is broken (a projection
    read by something else)."""
    b_out = flow.widths[b][1]
    down = {s for a in feeders if flow.widths[a][0] != b_out
            for s in flow.sources.get(a, frozenset()) if s in flow.widths}
    down |= {a for a in feeders if flow.consumers[a] != {b}}
    if not down:
        return []
    ups = set(feeders) - down
    if (not ups or any(flow.widths[d][0] != b_out or not flow.consumers[d] <= {b, *ups} for d in down)
            or any(flow.widths[a][0] != b_out and not (flow.sources.get(a, frozenset()) & down) for a in ups)):
        return None
    return sorted(down)


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
    """Layers whose direct children are feature norms (LayerNorm / RMSNorm), a sharded attention,
    and other units (a sharded MLP, or a block the layout shards only inside or not at all, as a
    mixture-of-experts block): [Note: sequence parallelism] in runtime/parallel/tensor_parallel.py lays those
    out (`sp_children`)."""
    out = []
    kind_of = {g.parent: g.kind for g in layout.groups}
    for path, layer in model.named_modules():
        prefix = f"{path}." if path else ""
        norms, sharded, whole = sp_children(layer, layout, path)
        kinds = sorted(kind_of[prefix + n] for n in sharded)
        # One self-attention: a second one (cross-attention) takes another input than the layer's
        # stream. A sharded linear called by the layer itself (not by a unit) has no unit to gather.
        if (len(norms) >= 2 and kinds.count("attention") == 1 and set(kinds) <= {"attention", "mlp"}
                and len(sharded) + len(whole) >= 2 and not any(prefix + n in layout.styles for n in whole)):
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
            what = "q/k/v" if g.kind == "attention" else "gate/up"
            why[g] = (f"its fused {what} projection '{g.colwise[0]}' is cut into parts and the graph calls the "
                      f"{g.kind} whole: module hooks cannot shard each part")
        elif g.shared:
            why[g] = (f"its per-head projections read projections left whole ({', '.join(repr(p) for p in g.shared)}) "
                      "and the graph calls the attention whole: module hooks cannot mix whole and sharded heads")
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
                               parts={p: n for p, n in layout.parts.items() if p in styles},
                               blocks={p: n for p, n in layout.blocks.items() if p in styles},
                               head_params=tuple(p for p in layout.head_params
                                                 if not any(p.startswith(g.parent + ".") for g in why)))


def traced_layout(traced, graph_inputs: Sequence[Any] | Mapping[str, Any]) -> TensorParallelLayout:
    """The layout of a traced model as the runtime runs it: `find_layout` on its graph, run on
    `graph_inputs` (the graph's own inputs: the example inputs, plus the target when a loss was
    appended), then `for_graph`. The profile (what `suggest` searches) and `partition` both take
    the layout from here, so a plan `suggest` returns is one the runtime can run."""
    layout = find_layout(traced.gm, graph_inputs)
    return for_graph(layout, traced) if layout else layout


def sp_children(layer: nn.Module, layout: TensorParallelLayout, path: str) -> tuple[list[str], list[str], list[str]]:
    """(norm children, sharded attention / MLP children, children computed whole) of a
    sequence-parallel layer. A child computed whole is one with parameters that is neither a norm
    nor a sharded attention / MLP: a block the layout shards only inside (a mixture-of-experts block
    whose shared experts are an MLP group) or not at all (its router and experts)."""
    prefix = f"{path}." if path else ""
    parents = {g.parent for g in layout.groups}
    norms, sharded, whole = [], [], []
    for name, child in layer.named_children():
        if isinstance(child, (nn.LayerNorm, nn.RMSNorm)):
            norms.append(name)
        elif prefix + name in parents:
            sharded.append(name)
        elif any(True for _ in child.parameters()):
            whole.append(name)
    return norms, sharded, whole
