"""Following a model's data flow on fake tensors: for every activation, the linear layers whose
outputs it was computed from since the last linear.

A `TorchDispatchMode` (`FlowMode`) carries the tags through every aten op and marks where
activations met in attention or were normalized over their features; `FlowInterpreter` runs a
traced graph, treating a linear op on a parameter as a call of that linear, and replays repeated
layers instead of running them ([Note: repeated layers]). graph/sharding.py reads the recorded
`Flow` to find the Megatron pattern ([Note: finding the Megatron pattern]); this module is the
machinery, apart from the pattern.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["ATTN", "INPUT", "NORM", "OUTPUT", "VIEWS", "Flow", "FlowInterpreter", "FlowMode", "constants_device",
           "tags_of", "transposed_weight"]

OUTPUT = "<output>"
INPUT = "<input>"
NORM = "<norm>"  # marks an activation normalized over its features since the last linear
ATTN = "<attn>"  # marks an activation on which two activations met in a batched matmul
_MARKS = frozenset({OUTPUT, INPUT, NORM, ATTN})

_BATCHED_MATMULS = {torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}
VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default}
_ATTENTION_KERNELS = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable") if hasattr(torch.ops.aten, name)}
_FEATURE_NORMS = {torch.ops.aten.native_layer_norm.default, torch.ops.aten.mean.dim, torch.ops.aten.var.correction,
                  torch.ops.aten.var_mean.correction}
if hasattr(torch.ops.aten, "_fused_rms_norm"):
    _FEATURE_NORMS.add(torch.ops.aten._fused_rms_norm.default)


def _is_attention_kernel(func) -> bool:
    """SDPA's kernels, or autoplan's attention operator (models/windowed_attention.py: soft-capping,
    windows, sinks), matched by name: it is registered where a model first calls it, never here."""
    return func in _ATTENTION_KERNELS or (getattr(func, "namespace", None) == "autoplan"
                                          and getattr(func, "__name__", None) == "attention.default")


def tags_of(t: Any) -> frozenset:
    return getattr(t, "_ap_tags", frozenset()) if isinstance(t, torch.Tensor) else frozenset()


class FlowMode(TorchDispatchMode):
    """Carries `_ap_tags` (linear paths, `NORM`, `ATTN`) from every op's inputs to its outputs."""

    def __init__(self, params: set[int], param_names: dict[int, str] | None = None):
        super().__init__()
        self.params = params
        self.param_names = param_names or {}
        self.param_inputs: dict[str, frozenset] = {}
        """Parameter name -> the linears whose outputs reached the ops that read it (a per-head
        norm's weight: the q or k projection's)."""
        self.head_dim: dict[frozenset, int] = {}
        """Linears an attention matmul read from -> head size."""
        self.uses: dict[str, list[Any]] = {}
        """Linear path -> every op applied to its output, in order, each as (op, input shape, output
        shape, non-tensor arguments): the view that splits heads, or the split, chunk or slices that
        cut a fused projection into its parts."""
        self.norms: dict[frozenset, set[int]] = {}
        """Linears a feature normalization read from -> the widths it normalized over: a per-head
        norm (Qwen3's q/k norm over head_dim) or one over a projection's whole width (OLMo2's)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        inputs = [t for t in flat if isinstance(t, torch.Tensor) and id(t) not in self.params]
        tags = frozenset().union(*(tags_of(t) for t in inputs))
        for t in flat:
            name = self.param_names.get(id(t)) if isinstance(t, torch.Tensor) else None
            if name is not None:
                self.param_inputs[name] = self.param_inputs.get(name, frozenset()) | (tags - _MARKS)
        for t in inputs:
            fresh = getattr(t, "_ap_fresh", None)
            if (fresh is not None and func in VIEWS and isinstance(out, torch.Tensor) and out.dim() and t.dim()
                    and out.shape[-1] == t.shape[-1]):
                out._ap_fresh = fresh  # (b * s, n) -> (b, s, n), as an inlined Conv1D ends: still its output
            elif (fresh is not None and func is torch.ops.aten.unsqueeze.default and isinstance(out, torch.Tensor)
                  and args[1] % out.dim() != out.dim() - 1):
                out._ap_fresh = fresh  # GPT-BigCode's `c_attn(x).unsqueeze(1)` before its split: still its output
            elif (fresh is not None and func is torch.ops.aten.add.Tensor and len(inputs) == 1
                  and isinstance(out, torch.Tensor) and out.shape == t.shape):
                out._ap_fresh = fresh  # `x @ w.T + bias` (FalconLinear): the bias is part of the linear
            elif fresh is not None and isinstance(out, (torch.Tensor, tuple, list)):
                shape = out.shape if isinstance(out, torch.Tensor) else None
                use = (func, tuple(t.shape), tuple(shape) if shape is not None else None,
                       tuple(a for a in args[1:] if not isinstance(a, torch.Tensor)))
                self.uses.setdefault(fresh, []).append(use)
        # Position ids given as an input reach q and k through rotary embeddings: the attention
        # weights depend on them, but what the attention passes on is v's, so INPUT stops at the
        # scores (as positions the model makes with `arange` carry no tag at all).
        if _is_attention_kernel(func):
            q, k = args[0], args[1]
            if tags_of(q) - {NORM, ATTN, INPUT} and tags_of(k) - {NORM, ATTN, INPUT}:
                self.head_dim.setdefault(frozenset((tags_of(q) | tags_of(k)) - {NORM, INPUT}), int(q.shape[-1]))
                tags = (tags - ({INPUT} - tags_of(args[2]))) | {ATTN}
        elif func in _BATCHED_MATMULS:
            a, b = args[-2], args[-1]
            if tags_of(a) - {NORM, ATTN, INPUT} and tags_of(b) - {NORM, ATTN, INPUT}:
                if ATTN not in tags:  # q k^T (the weights times v comes after): its inner dim is the head size
                    self.head_dim.setdefault(frozenset(tags - {NORM, INPUT}), int(a.shape[-1]))
                    tags = tags - {INPUT}
                tags = tags | {ATTN}
        elif inputs and _is_feature_norm(func, args):
            linears = frozenset(t for t in tags if t not in _MARKS)
            self.norms.setdefault(linears, set()).add(int(args[0].shape[-1]) if args[0].dim() else 1)
            tags = tags | {NORM}
        outs, _ = tree_flatten(out)
        for t in outs:
            if isinstance(t, torch.Tensor):
                with contextlib.suppress(AttributeError, RuntimeError):  # a tensor that takes no attributes
                    t._ap_tags = tags_of(t) | tags
        return out


def _is_feature_norm(func, args) -> bool:
    """A normalization over the last dim: LayerNorm, a reduction an RMSNorm's composite form makes, or
    the zoo's RMSNorm operator (models/ops.py `rms_norm`, over trailing dims; matched by name, as
    `_is_attention_kernel` matches autoplan's attention)."""
    if getattr(func, "namespace", None) == "autoplan" and getattr(func, "__name__", None) == "rms_norm.default":
        return True
    return func in _FEATURE_NORMS and _is_last_dim_reduction(func, args)


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
class Flow:
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
    order: list[str]
    uses: dict[str, list[Any]] = field(default_factory=dict)
    norms: dict[frozenset, set[int]] = field(default_factory=dict)
    param_inputs: dict[str, frozenset] = field(default_factory=dict)


_GRAPH_LINEARS = {torch.ops.aten.linear.default: False, torch.nn.functional.linear: False,
                  torch.ops.aten.addmm.default: True}
"""Linear ops of an inlined graph -> whether the weight is (in, out) (Conv1D's addmm(bias, x, w))."""
_GRAPH_EMBEDDINGS = (torch.ops.aten.embedding.default, torch.nn.functional.embedding)
_TRANSPOSES = {torch.ops.aten.t.default, torch.ops.aten.numpy_T.default}
"""`x @ weight.T` (Falcon's `FalconLinear`) traces as matmul(x, numpy_T(weight)): a linear too."""


def transposed_weight(node: Any) -> Any:
    """The get_attr node of `weight` when `node` is `weight.T` (a 2-D parameter transposed), else None."""
    if (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _TRANSPOSES
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr"):
        return node.args[0]
    return None


class FlowInterpreter(torch.fx.Interpreter):
    """Runs a traced graph, treating a linear op on a parameter (an inlined nn.Linear or Conv1D,
    named by its weight's module) as a call of that linear."""

    def __init__(self, gm: torch.fx.GraphModule, flow: Flow, pre, post, device: torch.device | None,
                 mode: FlowMode | None = None):
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
            if path in mode.uses and mine not in mode.uses:
                mode.uses[mine] = list(mode.uses[path])
        for tags, dim in list(mode.head_dim.items()):
            if any(isinstance(t, str) and t.startswith(second + ".") for t in tags):
                mode.head_dim.setdefault(rename_set(tags), dim)
        for tags, widths in list(mode.norms.items()):
            if any(isinstance(t, str) and t.startswith(second + ".") for t in tags):
                mode.norms.setdefault(rename_set(tags), set()).update(widths)
        for name, tags in list(mode.param_inputs.items()):
            if name.startswith(second + "."):
                mode.param_inputs.setdefault(rename(name), rename_set(tags))
        runs.append((target, None, len(flow.order) - (template[3] - template[2]), len(flow.order)))

        def fresh(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
                copy._ap_tags = rename_set(tags_of(value))
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
        weight_arg, transposed = None, False
        if n.op == "call_function" and n.target in _GRAPH_LINEARS:
            weight_arg = n.args[2] if _GRAPH_LINEARS[n.target] else n.args[1]
            transposed = _GRAPH_LINEARS[n.target]
        elif n.op == "call_function" and n.target is torch.ops.aten.matmul.default:
            weight_arg = transposed_weight(n.args[1])
        elif n.op == "call_function" and n.target in _GRAPH_EMBEDDINGS:
            table = n.args[0]
            if isinstance(table, torch.fx.Node) and table.op == "get_attr":
                w = _attr(self.module, table.target)
                path = self._names(w)[0] if self._names(w) else table.target.rpartition(".")[0]
                self.flow.embeddings[path] = (int(w.shape[0]), int(w.shape[1]), id(w))
        if not (isinstance(weight_arg, torch.fx.Node) and weight_arg.op == "get_attr"):
            return super().run_node(n)
        w = _attr(self.module, weight_arg.target)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return super().run_node(n)
        # A head tied to the embedding reads the embedding's weight: name it by its own module, the
        # last of the weight's names (a head registers after the embeddings: T5's `lm_head` after
        # `shared`, `encoder.embed_tokens` and `decoder.embed_tokens`).
        names = [name for name in self._names(w) if name not in self.flow.embeddings]
        path = names[-1] if names else weight_arg.target.rpartition(".")[0]
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


def constants_device(gm: torch.fx.GraphModule) -> torch.device | None:
    """The device a graph's factory calls and moves name (torch.export records the one it traced on):
    `arange(..., device=cpu)`, or `aten.to.device(x, cpu)`, the only one in a transformers model
    given its position ids (the rotary table moved to the ids' device)."""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        for device in (n.kwargs.get("device"), *(a for a in n.args if isinstance(a, torch.device))):
            if isinstance(device, (str, torch.device)) and torch.device(device).type != "meta":
                return torch.device(device)
    return None


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
