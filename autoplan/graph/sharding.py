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
runtime runs. The runtime (`runtime/parallel.py`) runs a layout either with torch's parallel styles (module hooks)
where the traced graph calls the attention / MLP modules whole, or with the whole stage in DTensor
where the graph inlines them (torch.export); sequence parallelism needs the former.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["ShardGroup", "TensorParallelLayout", "find_layout", "for_graph", "is_transposed_linear", "linear_widths",
           "sp_children", "traced_layout"]

_OUTPUT = "<output>"
_INPUT = "<input>"
_NORM = "<norm>"  # marks an activation normalized over its features since the last linear
_ATTN = "<attn>"  # marks an activation on which two activations met in a batched matmul


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


@dataclass(frozen=True)
class ShardGroup:
    """Column-parallel linears feeding one row-parallel linear."""

    kind: str
    """"attention" or "mlp"."""
    colwise: tuple[str, ...]
    rowwise: str
    counts: tuple[tuple[str, int], ...]
    """What tp must divide: ("num_heads", 32), ("num_kv_heads", 8) or ("ffn_hidden_size", 11008)."""
    parent: str
    """The innermost module holding all of them (the attention or MLP module)."""


@dataclass
class TensorParallelLayout(Mapping):
    """A model's tensor-parallel layout: module path -> style, read as a mapping.

    Styles: "colwise" / "rowwise" (Megatron's column- and row-parallel linears), "vocab-embedding"
    (rows of the token table) and "vocab-head" (columns of the logits); modules absent stay
    replicated."""

    styles: dict[str, str] = field(default_factory=dict)
    groups: tuple[ShardGroup, ...] = ()
    divides: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Count name ("num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size") -> (the gcd of that
    count over the model's layers, the first module that has it): tp must divide each gcd. KV heads
    are not replicated, so tp must divide them too."""
    layers: tuple[str, ...] = ()
    """Transformer layers sequence parallelism lays out (norms and sharded attention + MLP children)."""
    replicated: dict[str, str] = field(default_factory=dict)
    """Attention modules left whole on every tp rank -> why."""
    note: str = ""
    """Why no tp > 1 is possible (one line), or "" when the layout shards something."""
    sharded_params: int = 0
    """Parameters the layout shards (each tp rank holds 1/tp of them); the rest are replicated."""
    total_params: int = 0
    transposed: frozenset[str] = frozenset()
    """Sharded linears whose weight is stored (in, out) (transformers' `Conv1D`)."""
    tied: dict[str, str] = field(default_factory=dict)
    """Another name of a sharded parameter, under a module the layout does not style (BERT's
    `cls.predictions.bias` is `cls.predictions.decoder.bias`) -> the sharded parameter's name: a
    stage that holds the parameter only under that name must shard it the same way."""
    inlined: bool = False
    """The traced graph inlines the sharded modules (torch.export): the runtime runs such stages in
    DTensor ([Note: tensor parallelism on an inlined graph] in runtime/parallel.py), without
    sequence parallelism. Set by `for_graph`."""

    def __getitem__(self, key: str) -> str:
        return self.styles[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.styles)

    def __len__(self) -> int:
        return len(self.styles)

    def refusal(self, tp: int) -> str | None:
        """One line saying why this model cannot run at `tp`, or None when it can."""
        if tp == 1:
            return None
        if self.note:
            return f"no tensor-parallel layout: {self.note}; plan with tp = 1"
        for name, (count, path) in self.divides.items():
            if count % tp:
                where = f" of '{path}'" if path else ""
                hint = ("pad the vocabulary to a multiple of tp (Megatron-LM pads to 128 * tp) or plan with another tp"
                        if name == "vocab_size" else "plan with a tp that divides it")
                return f"tp = {tp} does not divide {name} = {count}{where}; {hint}"
        return None

    def degrees(self, max_tp: int) -> list[int]:
        """Every tp in 1..max_tp this layout can run."""
        return [t for t in range(1, max_tp + 1) if self.refusal(t) is None]

    def summary(self) -> dict[str, Any]:
        """What the profile records (`ModelProfile.extra["tensor_parallel"]`): JSON only."""
        return {"divides": {k: c for k, (c, _) in self.divides.items()}, "sequence_parallel": bool(self.layers),
                "note": self.note, "replicated": dict(self.replicated),
                # FSDP cannot shard a [q | k | v] projection's bias again along its one dim (fsdp.py)
                "fused_qkv": any(style == "colwise-qkv" for style in self.values()),
                "sharded_params": self.sharded_params, "total_params": self.total_params}


# --------------------------------------------------------------------------------------------
# The data-flow run

_BATCHED_MATMULS = {torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}
_ATTENTION_KERNELS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(torch.ops.aten, name)}
_FEATURE_NORMS = {torch.ops.aten.native_layer_norm.default, torch.ops.aten.mean.dim, torch.ops.aten.var.correction,
                  torch.ops.aten.var_mean.correction}
if hasattr(torch.ops.aten, "_fused_rms_norm"):
    _FEATURE_NORMS.add(torch.ops.aten._fused_rms_norm.default)


def _tags(t: Any) -> frozenset:
    return getattr(t, "_ap_tags", frozenset()) if isinstance(t, torch.Tensor) else frozenset()


class _FlowMode(TorchDispatchMode):
    """Carries `_ap_tags` (linear paths, `_NORM`, `_ATTN`) from every op's inputs to its outputs."""

    def __init__(self, params: set[int]):
        super().__init__()
        self.params = params
        self.head_dim: dict[frozenset, int] = {}
        """Linears an attention matmul read from -> head size."""
        self.first_op: dict[str, Any] = {}
        """Linear path -> the first op applied to its output."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        inputs = [t for t in flat if isinstance(t, torch.Tensor) and id(t) not in self.params]
        tags = frozenset().union(*(_tags(t) for t in inputs))
        for t in inputs:
            fresh = getattr(t, "_ap_fresh", None)
            if (fresh is not None and func in _VIEWS and isinstance(out, torch.Tensor) and out.dim() and t.dim()
                    and out.shape[-1] == t.shape[-1]):
                out._ap_fresh = fresh  # (b * s, n) -> (b, s, n), as an inlined Conv1D ends: still its output
            elif fresh is not None and fresh not in self.first_op and isinstance(out, (torch.Tensor, tuple, list)):
                shape = out.shape if isinstance(out, torch.Tensor) else None
                self.first_op[fresh] = (func, tuple(t.shape), tuple(shape) if shape is not None else None,
                                        tuple(a for a in args[1:] if not isinstance(a, torch.Tensor)))
        if func in _ATTENTION_KERNELS:
            q, k = args[0], args[1]
            if _tags(q) - {_NORM, _ATTN, _INPUT} and _tags(k) - {_NORM, _ATTN, _INPUT}:
                self.head_dim.setdefault(frozenset((_tags(q) | _tags(k)) - {_NORM}), int(q.shape[-1]))
                tags = tags | {_ATTN}
        elif func in _BATCHED_MATMULS:
            a, b = args[-2], args[-1]
            if _tags(a) - {_NORM, _ATTN, _INPUT} and _tags(b) - {_NORM, _ATTN, _INPUT}:
                if _ATTN not in tags:  # q k^T (the weights times v comes after): its inner dim is the head size
                    self.head_dim.setdefault(frozenset(tags - {_NORM}), int(a.shape[-1]))
                tags = tags | {_ATTN}
        elif func in _FEATURE_NORMS and inputs and _is_last_dim_reduction(func, args):
            tags = tags | {_NORM}
        outs, _ = tree_flatten(out)
        for t in outs:
            if isinstance(t, torch.Tensor):
                with contextlib.suppress(AttributeError, RuntimeError):  # a tensor that takes no attributes
                    t._ap_tags = _tags(t) | tags
        return out


def _is_last_dim_reduction(func, args) -> bool:
    if func is torch.ops.aten.native_layer_norm.default:
        return True
    x = args[0]
    dims = args[1] if len(args) > 1 else None
    if dims is None:
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    return any(d % x.dim() == x.dim() - 1 for d in dims)


@dataclass
class _Flow:
    widths: dict[str, tuple[int, int]]
    """Linear path -> (in, out) features."""
    transposed: set[str]
    """Linears whose weight is stored (in, out) (`Conv1D`)."""
    embeddings: dict[str, tuple[int, int, int]]
    """Embedding path -> (num_embeddings, dim, id of its weight)."""
    head_weights: dict[str, int]
    """Linear path -> id of its weight (to see a head tied to an embedding)."""
    sources: dict[str, frozenset]
    """Linear path -> tags of its input when it ran."""
    consumers: dict[str, set[str]]
    head_dim: dict[frozenset, int]
    first_op: dict[str, Any]
    order: list[str]


_GRAPH_LINEARS = {torch.ops.aten.linear.default: False, torch.nn.functional.linear: False,
                  torch.ops.aten.addmm.default: True}
"""Linear ops of an inlined graph -> whether the weight is (in, out) (Conv1D's addmm(bias, x, w))."""
_GRAPH_EMBEDDINGS = (torch.ops.aten.embedding.default, torch.nn.functional.embedding)


class _FlowInterpreter(torch.fx.Interpreter):
    """Runs a traced graph, treating a linear op on a parameter (an inlined nn.Linear or Conv1D,
    named by its weight's module) as a call of that linear."""

    def __init__(self, gm: torch.fx.GraphModule, flow: _Flow, pre, post, device: torch.device | None,
                 mode: _FlowMode | None = None):
        super().__init__(gm)
        self.flow, self.pre, self.post, self.device, self.mode = flow, pre, post, device, mode
        self.fakes: dict[str, torch.Tensor] = {}
        self.runs: dict[tuple, list[tuple[str, Any, int, int]]] = {}
        """[Note: repeated layers] structure -> (path, output, first order index, end) of each run."""

    def call_module(self, target: str, args: Any, kwargs: Any) -> Any:
        """[Note: repeated layers]: the third and later calls of a module whose structure and input
        shapes repeat an earlier one are not run: what the data flow would record is the second
        call's record, renamed."""
        module = self.fetch_attr(target)
        key = _structure(module, args, kwargs)
        runs = self.runs.setdefault(key, []) if key is not None and self.mode is not None else None
        if runs is not None and len(runs) >= 2:
            return self._replay(target, runs)
        start = len(self.flow.order)
        out = super().call_module(target, args, kwargs)
        if runs is not None:
            runs.append((target, out, start, len(self.flow.order)))
        return out

    def _replay(self, target: str, runs: list) -> Any:
        first, second, previous = runs[0][0], runs[1][0], runs[-1][0]
        # The second run's own linears become this module's; its inputs' (the first run's) the
        # previous run's. Other tags (earlier layers, the embedding) stay as they were.
        renames = ((second + ".", target + "."), (first + ".", previous + "."))

        def rename(tag: Any) -> Any:
            if not isinstance(tag, str):
                return tag
            for old, new in renames:
                if tag.startswith(old):
                    return new + tag[len(old):]
            return tag

        def rename_set(tags: frozenset) -> frozenset:
            return frozenset(rename(t) for t in tags)

        template = runs[1]
        flow, mode = self.flow, self.mode
        for path in flow.order[template[2]:template[3]]:
            mine = rename(path)
            flow.sources.setdefault(mine, rename_set(flow.sources.get(path, frozenset())))
            flow.order.append(mine)
            if path in mode.first_op and mine not in mode.first_op:
                mode.first_op[mine] = mode.first_op[path]
        for tags, dim in list(mode.head_dim.items()):
            if any(isinstance(t, str) and t.startswith(second + ".") for t in tags):
                mode.head_dim.setdefault(rename_set(tags), dim)
        runs.append((target, None, len(flow.order) - (template[3] - template[2]), len(flow.order)))

        def fresh(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
                copy._ap_tags = rename_set(_tags(value))
                return copy
            if isinstance(value, (tuple, list)):
                return type(value)(fresh(v) for v in value)
            return value

        return fresh(template[1])

    def _names(self, weight: torch.Tensor) -> list[str]:
        """Every module path holding `weight` (tied parameters have several), in registration order."""
        return [n.rpartition(".")[0] for n, p in self.module.named_parameters(remove_duplicate=False) if p is weight]

    def get_attr(self, target: str, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if self.device is None or not isinstance(value, torch.Tensor) or value.device == self.device:
            return value
        if target not in self.fakes:  # on the device of the graph's constants (export bakes it in)
            self.fakes[target] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=self.device)
        return self.fakes[target]

    def run_node(self, n: torch.fx.Node) -> Any:
        weight_arg = None
        if n.op == "call_function" and n.target in _GRAPH_LINEARS:
            weight_arg = n.args[2] if _GRAPH_LINEARS[n.target] else n.args[1]
        elif n.op == "call_function" and n.target in _GRAPH_EMBEDDINGS:
            table = n.args[0]
            if isinstance(table, torch.fx.Node) and table.op == "get_attr":
                w = _attr(self.module, table.target)
                path = self._names(w)[0] if self._names(w) else table.target.rpartition(".")[0]
                self.flow.embeddings[path] = (int(w.shape[0]), int(w.shape[1]), id(w))
        if not (isinstance(weight_arg, torch.fx.Node) and weight_arg.op == "get_attr"):
            return super().run_node(n)
        w = _attr(self.module, weight_arg.target)
        # A head tied to the embedding reads the embedding's weight: name it by its own module, the
        # last of the weight's names (a head registers after the embeddings: T5's `lm_head` after
        # `shared`, `encoder.embed_tokens` and `decoder.embed_tokens`).
        names = [name for name in self._names(w) if name not in self.flow.embeddings]
        path = names[-1] if names else weight_arg.target.rpartition(".")[0]
        transposed = _GRAPH_LINEARS[n.target]
        self.flow.widths[path] = (int(w.shape[0]), int(w.shape[1])) if transposed else (int(w.shape[1]), int(w.shape[0]))
        self.flow.head_weights[path] = id(w)
        if transposed:
            self.flow.transposed.add(path)
        x = self.env[n.args[1] if transposed else n.args[0]]
        self.pre(path, x)
        out = super().run_node(n)
        self.post(path, out)
        return out


# [Note: repeated layers]
# A 96-layer model runs its layer 96 times through the data flow, about 50 operators each: most of
# the cost of finding a layout. Layers of one structure (class, parameter shapes, input shapes) record
# the same flow up to names: the third and later are not run; the second's record is copied with its
# paths renamed to the layer's, and the first's (its input's producer) to the previous layer's. A
# tag from further back (an earlier layer's output reaching a later one through the residual stream)
# is not carried forward; it only ever adds consumers to a layer's output projection, which no pair
# reads (a pair's feeders have one consumer). tests/test_sharding.py checks the layouts are equal.


def _structure(module: nn.Module, args: Any, kwargs: Any) -> tuple | None:
    """What makes two calls of a module record the same flow: its class, parameter shapes and
    input shapes; None when an input is not a tensor, a scalar or None (run it)."""
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype)
        if isinstance(value, (tuple, list)):
            return tuple(describe(v) for v in value)
        if value is None or isinstance(value, (int, float, bool, str)):
            return value
        raise TypeError

    try:
        inputs = (describe(list(args)), describe(sorted(kwargs.items())))
    except TypeError:
        return None
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return (type(module).__qualname__, params, inputs)


def _constants_device(gm: torch.fx.GraphModule) -> torch.device | None:
    """The device a graph's factory calls name (torch.export records the one it traced on)."""
    for n in gm.graph.nodes:
        device = n.kwargs.get("device") if n.op == "call_function" else None
        if isinstance(device, (str, torch.device)) and torch.device(device).type != "meta":
            return torch.device(device)
    return None


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _run_flow(model: nn.Module, example_inputs: Sequence[Any] | Mapping[str, Any]) -> _Flow:
    linears = {path: m for path, m in model.named_modules() if linear_widths(m) is not None}
    flow = _Flow(widths={p: linear_widths(m) for p, m in linears.items()},
                 transposed={p for p, m in linears.items() if is_transposed_linear(m)},
                 embeddings={p: (m.num_embeddings, m.embedding_dim, id(m.weight)) for p, m in model.named_modules()
                             if isinstance(m, nn.Embedding)},
                 head_weights={p: id(m.weight) for p, m in linears.items()},
                 sources={}, consumers={}, head_dim={}, first_op={}, order=[])
    params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}

    def pre(path, x):
        flow.sources.setdefault(path, _tags(x))
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

    mode = _FlowMode(params)
    param = next(iter(model.parameters()), None)
    graph_device = _constants_device(model) if isinstance(model, torch.fx.GraphModule) else None
    device = graph_device or (param.device if param is not None else torch.device("cpu"))

    def fake(x):  # an empty of the input's shape on the model's device (a fake tensor: nothing allocated)
        if not isinstance(x, torch.Tensor):
            return x
        x = torch.empty(x.shape, dtype=x.dtype, device=device)
        x._ap_tags = frozenset({_INPUT})  # a model input is a source of its own: it never pairs two linears
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
                    out = _FlowInterpreter(model, flow, pre, post, graph_device, mode).run(*args, **kwargs)
                else:
                    out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    flow.head_dim, flow.first_op = mode.head_dim, mode.first_op
    flow.order = list(dict.fromkeys(flow.order))
    flow.consumers = {p: set() for p in flow.widths}
    for path, src in flow.sources.items():
        for s in src:
            if s in flow.consumers:
                flow.consumers[s].add(path)
    for t in tree_flatten(out)[0] if not hasattr(out, "to_tuple") else tree_flatten(out.to_tuple())[0]:
        for s in _tags(t):
            if s in flow.consumers:
                flow.consumers[s].add(_OUTPUT)
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
    for b in flow.order:
        src = flow.sources.get(b, frozenset())
        feeders = sorted(s for s in src if s in flow.widths)
        if not feeders or _NORM in src or len(feeders) != len(src - {_ATTN}):
            continue  # fed by something else too (a residual, an input, a normalization)
        if any(flow.consumers[a] != {b} for a in feeders):
            continue
        b_in, b_out = flow.widths[b]
        if any(flow.widths[a][0] != b_out for a in feeders) or any(a in styles for a in feeders):
            continue  # not hidden -> ... -> hidden
        parent = _common_parent([*feeders, b])
        if _ATTN in src:
            head_dim = next((d for k, d in flow.head_dim.items() if k <= set(feeders)), None)
            if not head_dim or any(flow.widths[a][1] % head_dim for a in feeders):
                continue
            heads = [flow.widths[a][1] // head_dim for a in feeders]
            fused_style = "colwise"
            if len(feeders) == 1:  # fused q/k/v
                if heads[0] % 3:
                    continue
                if not _per_head(flow.first_op.get(feeders[0]), heads[0] // 3):
                    if not _qkv_blocks(flow.first_op.get(feeders[0]), flow.widths[feeders[0]][1]):
                        replicated[parent] = (f"its fused q/k/v projection '{feeders[0]}' is reshaped in a way "
                                              "autoplan cannot shard by heads")
                        continue
                    fused_style = "colwise-qkv"  # [q | k | v]: each third sharded ([Note: fused q/k/v])
                counts = (("num_heads", heads[0] // 3),)
            else:
                q = b_in // head_dim
                kv = min(heads)
                counts = (("num_heads", q),) + ((("num_kv_heads", kv),) if kv != q else ())
            kind = "attention"
        else:
            if any(flow.widths[a][1] != b_in for a in feeders):
                continue
            kind, counts, fused_style = "mlp", (("ffn_hidden_size", b_in),), "colwise"
        groups.append(ShardGroup(kind, tuple(feeders), b, counts, parent))
        for a in feeders:
            styles[a] = fused_style if kind == "attention" else "colwise"
        styles[b] = "rowwise"

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
                                  sharded_params=sharded, total_params=total,
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


def _qkv_blocks(first_op, width: int) -> bool:
    """Whether a fused q/k/v output laid out [q | k | v] is first split into its three blocks, or
    reshaped into (3, ...) (`_per_head` is False)."""
    if first_op is None:
        return False
    func, in_shape, out_shape, extra = first_op
    last = len(in_shape) - 1
    if func is torch.ops.aten.split.Tensor and extra:
        dim = extra[1] if len(extra) > 1 else 0
        return extra[0] * 3 == width and dim % len(in_shape) == last
    if func is torch.ops.aten.split_with_sizes.default and extra:
        dim = extra[1] if len(extra) > 1 else 0
        return list(extra[0]) == [width // 3] * 3 and dim % len(in_shape) == last
    if func in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default):
        return (out_shape is not None and len(out_shape) > last and tuple(out_shape[:last]) == tuple(in_shape[:last])
                and out_shape[last] == 3)
    return False


def _per_head(first_op, num_heads: int) -> bool:
    """Whether a fused q/k/v output is laid out per head: its first use reshapes the features into
    (heads, ...) (Megatron-LM's and the zoo's layout), not into (3, heads, ...) nor splits them."""
    if first_op is None:
        return False
    func, in_shape, out_shape, _ = first_op
    if func not in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default):
        return False
    lead = len(in_shape) - 1
    if out_shape is None or len(out_shape) <= lead or tuple(out_shape[:lead]) != tuple(in_shape[:lead]):
        return False
    return out_shape[lead] == num_heads


def _vocab_parallel(flow: _Flow, styles: dict[str, str], divides: dict) -> None:
    """Mark the token embedding and LM head vocabulary-parallel (see the module note)."""
    heads = [p for p in flow.order if flow.consumers.get(p) == {_OUTPUT} and p not in styles]
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
    runtime/parallel.py lays those out."""
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
    blocked = [g for g in layout.groups if any(layout.styles[c] == "colwise-qkv" for c in g.colwise)]
    if not blocked:
        return dataclasses.replace(layout, inlined=False)
    # Module hooks run the attention's own code, whose reshapes want whole [q | k | v] blocks.
    styles = {p: s for p, s in layout.styles.items() if not any(p in (*g.colwise, g.rowwise) for g in blocked)}
    groups = tuple(g for g in layout.groups if g not in blocked)
    replicated = {**layout.replicated, **{g.parent: f"its fused q/k/v projection '{g.colwise[0]}' is laid out [q | k | v] "
                                          "and the graph calls the attention whole: module hooks cannot split it by heads"
                                          for g in blocked}}
    if not groups:
        return TensorParallelLayout(note=next(iter(replicated.values())), replicated=replicated,
                                    total_params=layout.total_params)
    return dataclasses.replace(layout, styles=styles, groups=groups, replicated=replicated, inlined=False,
                               divides=_divides(groups, layout.divides), layers=())


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


