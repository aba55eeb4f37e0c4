"""Trace an `nn.Module` into an ordered fx graph whose nodes are grouped into blocks.

Three tracers, tried in order (DESIGN.md, "graph.trace"):

1. `torch.fx` symbolic tracing, with the model's repeated layers (and any user-named modules) kept
   as leaf `call_module` nodes. Works on most hand-written models.
2. `torch.export` (non-strict), for models with Python control flow on shapes that defeats fx
   (Hugging Face models). The exported program is unlifted back into a `GraphModule` whose
   parameters keep their original names; nodes are grouped by their `nn_module_stack`.
3. Module boundaries: when both fail, the model's children are chained in registration order
   (embeddings, each repeated layer, norm, head), each taking the previous one's output. This
   assumes `forward` calls them in that order, so before the chain is used it is run against the
   model on one small real input (`_check_chain`; a meta model is materialized on the CPU when it
   is small): a mismatch is a TraceError, and the tracer note says whether the check ran.

The result, `TracedModel`, is a `GraphModule` plus a block index for every node. Everything that
needs to run part of the model (profiling one block, building a pipeline stage) extracts a
sub-graph with `extract_submodule`, which keeps parameter names as they are in the model.

[Note: blocks]
A block is a contiguous run of graph nodes. The default granularity is the model's repeated
layer unit. Every layer stack is found (`find_layer_containers`: a `ModuleList`/`Sequential` whose
children, at least 2 and most of them, share one composite class), and each child of each stack
is one block: `layers.0`.. for a GPT, `encoder.block.*` and `decoder.block.*` for T5, the
bottlenecks `layer1.0`..`layer4.2` of a ResNet. The outermost stack wins (an MoE layer's `experts`
stay inside their layer), except that a stack of pure wrappers around stacks (HF ResNet's
`stages`, each holding only its `layers`) gives way to the stacks inside.
Everything before the first layer is one `embedding` block (a ResNet's stem). After it, every
distinct module outside the layers (final norm, head, T5's `decoder.embed_tokens`) starts a block
of its own, named by its shortest path that does not hold a stack (`encoder.final_layer_norm`).
Glue stays in the block before it: functional ops, code in a stack's ancestors (T5's mask
building in `decoder`), stateless modules (dropout, pooling) and modules called a second time
(T5's `decoder.dropout`); so a loss appended after the head lands in the head block. Modules
named in `leaf_modules` become blocks of their own too; one inside a layer replaces that layer
(finer units).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import os
import re
import sys
import sysconfig
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

__all__ = [
    "TraceError", "TracedModel", "extract_submodule", "find_layer_container", "find_layer_containers",
    "model_line", "retarget_device", "trace_model",
    "trace_with_loss", "value_dependence",
]


class TraceError(ValueError):
    """No tracer could turn the model into a graph (or the inputs do not fit the model)."""


@dataclass
class TracedModel:
    """A traced model: a graph over the original parameters, its nodes grouped into blocks."""

    gm: fx.GraphModule
    block_names: list[str]
    node_block: dict[str, int]
    """fx node name -> block index (placeholders and outputs included)."""
    tracer: str
    """`fx`, `export` or `modules`."""
    note: str
    """One line: which tracer was used, why the ones before it failed and, for `modules`, whether the
    chain was checked against the model on a real input (`checked: ...` or `NOT checked ...`)."""
    layer_container: str | None
    """The repeated layer stack with the most layers (`find_layer_container`); kept for callers that
    know one stack. `layer_containers` lists every stack whose layers are blocks."""
    input_names: list[str]
    block_modules: list[list[str]] = field(default_factory=list)
    """Module paths called in each block (leaf modules for fx, innermost modules for export)."""
    layer_containers: list[str] = field(default_factory=list)
    """Every repeated layer stack, in registration order (`find_layer_containers`): T5's
    `encoder.block` and `decoder.block`, a ResNet's `layer1`..`layer4`."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    def nodes_of_block(self, index: int) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if self.node_block[n.name] == index and n.op not in ("placeholder", "output")]


# --------------------------------------------------------------------------------------------
# The repeated layer list


def _is_layer_stack(module: nn.Module) -> bool:
    """A ModuleList/Sequential whose children (at least 2, most of them) share one composite class."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(module.children())
    if len(children) < 2:
        return False
    layer_class, count = Counter(type(c) for c in children).most_common(1)[0]
    # Require the repeated class to be a composite layer, not e.g. a Sequential of Linears+ReLUs.
    layer = next(c for c in children if type(c) is layer_class)
    return count >= 2 and count >= len(children) * 0.5 and any(True for _ in layer.children())


def find_layer_containers(model: nn.Module) -> list[str]:
    """Paths of the model's repeated layer stacks, in registration order (see [Note: blocks]).

    The outermost stack wins: stacks inside a layer (an MoE layer's experts) are not descended
    into. A stack of pure wrappers around stacks (HF ResNet's `stages`, each holding nothing but
    its `layers`) gives way to the stacks inside it."""
    stacks = {path for path, module in model.named_modules() if _is_layer_stack(module)}
    selected: list[str] = []

    def join(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    def wraps_stacks(module: nn.Module, path: str) -> bool:
        for name, child in module.named_children():
            child_path = join(path, name)
            inner = [s for s in stacks if s == child_path or s.startswith(child_path + ".")]
            if not inner or not _params_inside(child, child_path, inner):
                return False
        return True

    def visit(module: nn.Module, path: str) -> None:
        if path in stacks and not wraps_stacks(module, path):
            selected.append(path)
            return
        for name, child in module.named_children():
            visit(child, join(path, name))

    visit(model, "")
    return selected


def _params_inside(module: nn.Module, path: str, stacks: list[str]) -> bool:
    """Every parameter of `module` (at `path`) lies inside one of `stacks`."""
    return all(any(f"{path}.{name}".startswith(s + ".") for s in stacks)
               for name, _ in module.named_parameters(remove_duplicate=False))


def find_layer_container(model: nn.Module) -> str | None:
    """The repeated layer stack with the most layers (the first on ties), or None.

    Kept for callers that want one stack; `find_layer_containers` lists all of them."""
    return _largest_stack(model, find_layer_containers(model))


def _largest_stack(model: nn.Module, containers: Sequence[str]) -> str | None:
    return max(containers, key=lambda path: len(model.get_submodule(path)), default=None)


def _placeable_units(model: nn.Module, containers: Sequence[str], leaf_modules: Sequence[str]) -> list[str]:
    """Module paths that become blocks of their own (every stack's layers plus user-named leaves)."""
    units: list[str] = []
    for container in containers:
        prefix = f"{container}." if container else ""
        units += [f"{prefix}{name}" for name, _ in model.get_submodule(container).named_children()]
    for pattern in leaf_modules:
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")
        matched = [path for path, _ in model.named_modules() if path and regex.match(path)]
        if not matched:
            raise TraceError(f"leaf module '{pattern}' matches no module of the model; use a path such as 'layers.*.attention'")
        units += matched
    # A user leaf inside a layer replaces that layer as the unit (finer granularity).
    finer = set(units)
    return [u for u in units if not any(other != u and other.startswith(u + ".") for other in finer)]


# --------------------------------------------------------------------------------------------
# Tracers


class _LeafTracer(fx.Tracer):
    def __init__(self, leaves: set[str]):
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self._leaves or super().is_leaf_module(m, module_qualified_name)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        """Each node keeps the model's line that made it: a value read such as `.item()` is traced as
        a node and fails only when profiled, where that line is named ([Note: value-dependent control
        flow]). One frame, found here, not fx's `record_stack_traces`: that formats the whole stack of
        every node and imports torch._inductor to filter it (0.6 s of CPU on every trace)."""
        node = super().create_node(*args, **kwargs)
        autoplan_dir = _library_prefixes()[1]
        frame = sys._getframe(1)
        # Out through torch to the innermost frame of the model's; reaching autoplan first means the
        # node is not made by the model's code (placeholders, the output) or the model is autoplan's own.
        while frame is not None and not _outside_library(frame.f_code.co_filename):
            frame = None if frame.f_code.co_filename.startswith(autoplan_dir) else frame.f_back
        if frame is not None and not node.stack_trace:  # a traceback line's format, which _STACK_FRAME reads
            node.stack_trace = f'File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}'
        return node


def _trace_fx(model: nn.Module, leaves: set[str], num_inputs: int) -> fx.GraphModule:
    tracer = _LeafTracer(leaves)
    graph = tracer.trace(model)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) < num_inputs:
        raise TraceError(f"model takes {len(placeholders)} inputs but {num_inputs} example inputs were given")
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


def _trace_export(model: nn.Module, example_inputs: tuple, dtype: torch.dtype | None = None) -> fx.GraphModule:
    """`torch.export` (non-strict), unlifted to a GraphModule over the model's own parameters.

    [Note: exporting for any device and dtype]
    The graph is traced once and run on fake cpu tensors (profile), on the runtime's device and in
    its compute dtype, so what export bakes in for the traced device and dtype is undone here:
    - A model on meta is exported as if on the cpu (fake tensors, nothing allocated): libraries
      branch on the device type (transformers' MoE routing counts tokens with `histc` on int32
      off the cpu, which no cpu kernel runs) and the cpu branch runs everywhere.
    - `_assert_tensor_metadata` checks (dtype float32, device) are dropped.
    - With `dtype` (the compute dtype the graph will run in, e.g. bf16 for a model built in fp32),
      the model is exported on fake tensors of that dtype, so the graph holds the model's own casts
      for it (transformers' fp32 upcasts in norms and rotary tables, and the casts back). Without
      it, every constant of the dtype the model was traced in (float32) is replaced by the dtype of
      a tensor it computes with, so any compute dtype runs ([Note: dtype-following graphs]).
    - A `config.use_cache` flag (Hugging Face models) is off while exporting: a training step keeps
      no KV cache, and a cache object is not a tensor the graph can return."""
    # Submodules may hold configs of their own (T5's encoder and decoder stacks hold copies).
    caching = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    cast = dtype if dtype is not None and dtype != model_dtype else None
    on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    try:
        for config in caching.values():
            config.use_cache = False
        with warnings.catch_warnings(), _quiet_export():
            warnings.simplefilter("ignore")
            gm = _export_on_fake(model, example_inputs, cast) if on_meta or cast is not None else \
                torch.export.export(model, example_inputs, strict=False).module()
    finally:
        for config in caching.values():
            config.use_cache = True
    _follow_traced_dtype(gm, model_dtype if dtype is None else None)
    return gm


_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export")


@contextlib.contextmanager
def _quiet_export() -> Any:
    """Silence what a failing export writes to stderr (a warning per unbacked symbol, then the partial
    graph, printed): the failure is reported in one line by the caller (`value_dependence`)."""
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _export_on_fake(model: nn.Module, example_inputs: tuple, dtype: torch.dtype | None) -> fx.GraphModule:
    """Export on fake tensors: parameters and buffers on meta as if on the cpu, and with `dtype`
    every floating one (and floating input) in that dtype. They are swapped in while exporting, and
    the originals put back in the graph module (their names and identities unchanged)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def needs_fake(t: torch.Tensor) -> bool:
        return t.device.type == "meta" or (dtype is not None and t.is_floating_point() and t.dtype != dtype)

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:  # tied parameters stay tied
            device = "cpu" if t.device.type == "meta" else t.device
            with mode:
                fake = torch.empty_strided(tuple(t.shape), t.stride(), device=device,
                                           dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
            fakes[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
        return fakes[id(t)]

    originals: dict[str, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for slots in (module._parameters, module._buffers):
            for name, t in slots.items():
                if t is not None:
                    originals[f"{prefix}.{name}" if prefix else name] = t
                    if needs_fake(t):
                        swapped.append((slots, name, t))
    inputs = tuple(fake_of(x) if isinstance(x, torch.Tensor) and needs_fake(x) else x for x in example_inputs)
    try:
        for slots, name, t in swapped:
            slots[name] = fake_of(t)
        gm = torch.export.export(model, inputs, strict=False).module()
    finally:
        for slots, name, t in swapped:
            slots[name] = t
    for prefix, module in gm.named_modules(remove_duplicate=False):
        for slots in (module._parameters, module._buffers):
            for name in list(slots):
                original = originals.get(f"{prefix}.{name}" if prefix else name)
                if original is not None:
                    slots[name] = original
    # Tensors the forward made from literals are lifted as constants: fake here, so keep their values.
    from torch._subclasses.fake_tensor import FakeTensor

    for module in gm.modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, FakeTensor):
                if value.constant is None:
                    raise TraceError(f"the forward makes a tensor constant '{attr}' whose value a model on meta "
                                     "cannot give; build the model on the cpu to trace it")
                setattr(module, attr, value.constant)
    return gm


def _dtype_of(tensor: torch.Tensor) -> torch.dtype:
    """Graph helper: the dtype a rewritten dtype constant follows ([Note: dtype-following graphs])."""
    return tensor.dtype


def _follow_traced_dtype(gm: fx.GraphModule, traced_dtype: torch.dtype | None) -> None:
    """[Note: dtype-following graphs]
    Export records dtypes as constants: RMSNorm's `h.to(float32)` and its cast back to the input's
    dtype, rotary tables' `.float()` and `.to(x.dtype)` all read `float32` in a float32 trace, and a
    bf16 run then mixes float32 and bf16 tensors (a matmul refuses them). The runtime and the
    profile run every floating tensor in one compute dtype (runtime/precision.py), so each constant
    equal to the traced dtype becomes `_dtype_of(ref)`, where `ref` is a floating tensor argument of
    the op, else the nearest floating value computed before it (never a parameter, which would pull
    a weight into another block). In float32 the graph computes exactly what it traced; in bf16 the
    upcasts inside norms and rotary tables run in bf16, as everything else does (positions past
    256 then round: trace with the compute dtype, `_trace_export(dtype=)`, to keep them in fp32).
    With `traced_dtype` None only the metadata asserts go."""

    def floating(node: Any) -> bool:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        return isinstance(value, torch.Tensor) and value.is_floating_point() and node.op != "get_attr"

    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        graph = module.graph
        last_floating: fx.Node | None = None
        for node in list(graph.nodes):
            if node.target is torch.ops.aten._assert_tensor_metadata.default:
                graph.erase_node(node)
                continue
            if traced_dtype is not None and node.op == "call_function" and \
                    any(v is traced_dtype for v in (*node.args, *node.kwargs.values())):
                ref = next((a for a in node.args if floating(a)), last_floating)
                if ref is not None:
                    with graph.inserting_before(node):
                        dtype = graph.call_function(_dtype_of, (ref,))
                    dtype.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
                    node.args = tuple(dtype if v is traced_dtype else v for v in node.args)
                    node.kwargs = {k: dtype if v is traced_dtype else v for k, v in node.kwargs.items()}
            if floating(node):
                last_floating = node
        graph.lint()
        module.recompile()


def _chain_modules(model: nn.Module, units: list[str]) -> fx.GraphModule:
    """Module-boundary fallback: children in registration order, each fed the previous output.

    Modules holding units (the layer stacks and their ancestors, a layer holding user leaves) are
    descended into; every other child is called whole. `_check_chain` tests the result."""
    order: list[str] = []
    unit_set = set(units)

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path in unit_set:
                order.append(path)
            elif any(unit.startswith(path + ".") for unit in unit_set):
                visit(child, path + ".")
            else:
                order.append(path)

    visit(model, "")
    graph = fx.Graph()
    value = graph.placeholder("input")
    for path in order:
        value = graph.call_module(path, (value,))
    graph.output(value)
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


def retarget_device(gm: fx.GraphModule, device: str | torch.device) -> None:
    """Rewrite device constants baked into the graph (export records e.g. `arange(device=meta)`)."""
    device = torch.device(device)

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device):
            return device
        if isinstance(value, (tuple, list)):
            return type(value)(swap(v) for v in value)
        return value

    # Higher-order ops (e.g. wrap_with_set_grad_enabled) keep their bodies in nested GraphModules.
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                node.args = swap(node.args)
                node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
            module.recompile()


# [Note: value-dependent control flow]
# Planning runs the model on shapes only (fx proxies, export's fake tensors, the profile's meta or
# fake tensors), so a forward that reads a tensor's value (`.item()`, `bool(t)`, `if x.sum() > 0`,
# `.tolist()`) or makes a tensor whose shape depends on values (`nonzero`, boolean masks) cannot be
# followed. Each tracer fails in its own words (fx: "symbolically traced variables cannot be used as
# inputs to control flow"; export: GuardOnDataDependentSymNode; a fake run:
# DataDependentOutputException naming aten._local_scalar_dense); `value_dependence` turns any of them
# into one line: what the model does, where (the innermost frame of the traceback outside torch and
# autoplan: the user's line), and the fix. `--leaf-modules` is no fix: a leaf's forward still runs on
# fake tensors when it is profiled. `torch.where` computes both sides and is traced as one operator.
_READS_VALUE = ("DataDependentOutputException", "GuardOnDataDependentSymNode", "UnsupportedOperatorException")
_FX_BRANCH = "symbolically traced variables cannot be used as inputs to control flow"
_READS_VALUE_TEXT = ("Tensor.item() cannot be called on meta tensors", "data-dependent", "_local_scalar_dense",
                     "Cannot copy out of meta tensor")
_SHAPE_FROM_VALUES = ("DynamicOutputShapeException",)
_VALUE_FIX = ("keep the value a tensor (a branch: compute both sides and pick with torch.where(cond, a, b)), or decide "
              "with a Python flag set when the model is built")
_SHAPE_FIX = "keep the shape fixed (torch.where(mask, x, 0) instead of x[mask]), or decide with a Python flag set when the model is built"


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while exc is not None and exc not in chain and len(chain) < 16:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return chain


_STACK_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


@functools.cache
def _library_prefixes() -> tuple[str, ...]:
    """Where torch, autoplan and the standard library live: frames there are not the model's."""
    return tuple(os.path.join(str(path), "") for path in  # a trailing separator: torchvision is not torch
                 (Path(torch.__file__).parent, Path(__file__).resolve().parents[1], sysconfig.get_paths()["stdlib"]))


def _outside_library(filename: str) -> bool:
    """Whether a frame's file is the model's own (not torch, autoplan, the standard library or generated code)."""
    return not filename.startswith("<") and not filename.startswith(_library_prefixes())


def _user_frame(chain: Sequence[BaseException], stack_trace: str | None) -> tuple[str, int, str, str] | None:
    """(file, line, function, source line) of the innermost frame outside torch, autoplan, the
    standard library and generated code: the model's own line that read the value. Looked for in the
    exception's traceback, then in `stack_trace` (the failing graph node's, recorded when traced)."""
    import linecache
    import traceback

    outside = _outside_library
    for exc in chain:
        frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
        for frame in reversed(frames):
            if outside(frame.filename):
                code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
                return frame.filename, frame.lineno or 0, frame.name, code
    for name, line, function in reversed(_STACK_FRAME.findall(stack_trace or "")):
        if outside(name):
            return name, int(line), function, linecache.getline(name, int(line)).strip()
    return None


def value_dependence(exc: BaseException, stack_trace: str | None = None) -> str | None:
    """One line for an exception raised because the model branches on a tensor's value, or makes a
    tensor whose shape depends on values ([Note: value-dependent control flow]); None for any other.
    `stack_trace`: the failing graph node's (`node.meta["stack_trace"]`), when the traceback has no
    frame of the model's own (a node traced by fx, run by an interpreter)."""
    chain = _exception_chain(exc)
    names = {type(e).__name__ for e in chain}
    text = " ".join(str(e).split("\n", 1)[0] for e in chain)
    if _FX_BRANCH in text:  # fx cannot tell a branch on a value from one on a shape; export can
        what, fix = ("branches on a traced tensor (its value, or its shape, which only --tracer export follows)",
                     "for a shape, use --tracer export; for a value, " + _VALUE_FIX)
    elif names & set(_SHAPE_FROM_VALUES):
        what, fix = "makes a tensor whose shape depends on its values (nonzero, a boolean mask, unique)", _SHAPE_FIX
    elif names & set(_READS_VALUE) or any(t in text for t in _READS_VALUE_TEXT):
        if "UnsupportedOperatorException" in names and "_local_scalar_dense" not in text:
            return None
        what, fix = "reads a tensor's value (.item(), bool(t), `if x.sum() > 0`, .tolist())", _VALUE_FIX
    else:
        return None
    where = model_line(exc, stack_trace)
    return f"the model {what} {where}, which planning cannot follow (it runs the model on shapes, not values); {fix}"


def model_line(exc: BaseException, stack_trace: str | None = None) -> str:
    """Where in the model's own code `exc` was raised: "at file:line in function (`code`)" (the
    file relative to the working directory when under it), from the exception's traceback or the
    failing node's `stack_trace`; or a clause saying the line is unknown."""
    frame = _user_frame(_exception_chain(exc), stack_trace)
    if frame is None:
        return "in its forward (the line is unknown: AUTOPLAN_DEBUG=1 shows the full traceback)"
    file, line, function, code = frame
    with contextlib.suppress(ValueError):  # another drive (Windows): keep the absolute path
        relative = os.path.relpath(file)
        file = file if relative.startswith("..") else relative
    return f"at {file}:{line} in {function}" + (f" (`{code[:80]}`)" if code else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


# --------------------------------------------------------------------------------------------
# Grouping nodes into blocks


def _node_module_path(node: fx.Node, tracer: str) -> str | None:
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0] or str(node.target)
    if tracer == "export":
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            return path or None
    return None


def _unit_of(path: str, units: list[str]) -> str | None:
    for unit in units:
        if path == unit or path.startswith(unit + "."):
            return unit
    return None


def _holds_stack(path: str, containers: Sequence[str]) -> bool:
    """`path` is a layer stack or an ancestor of one (its own code is glue between layers)."""
    return any(c == path or c.startswith(path + ".") for c in containers)


def _layer_of(path: str, containers: Sequence[str]) -> str | None:
    """The layer (a child of a stack) that `path` is in, or None."""
    for container in containers:
        prefix = f"{container}." if container else ""
        if path.startswith(prefix) and len(path) > len(prefix):
            return prefix + path[len(prefix):].split(".")[0]
    return None


def _owner_outside_layers(path: str, containers: Sequence[str]) -> str:
    """The shortest prefix of `path` that neither is a layer stack nor holds one."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if not _holds_stack(prefix, containers):
            return prefix
    return path


def _stateless_modules(model: nn.Module) -> set[str]:
    """Paths of modules with no parameters and no buffers (dropout, activations, pooling)."""
    return {path for path, module in model.named_modules(remove_duplicate=False)
            if path and next(module.parameters(), None) is None and next(module.buffers(), None) is None}


def _group_blocks(gm: fx.GraphModule, tracer: str, containers: Sequence[str], units: list[str],
                  stateless: set[str] = frozenset()):
    """Assign every node a block (see [Note: blocks]); returns (names, node_block, modules)."""
    names: list[str] = []
    modules: list[list[str]] = []
    node_block: dict[str, int] = {}
    seen_layer = False
    current: int | None = None
    current_owner: str | None = None
    deferred: list[fx.Node] = []  # get_attr nodes: they go with their first user

    def start(name: str) -> int:
        names.append(name)
        modules.append([])
        return len(names) - 1

    # Nodes inside a layer but outside the user's finer leaves (a pre-norm before `attention`) wait
    # here and join the next leaf if it is in the same layer, else the current block.
    pending: list[tuple[fx.Node, str | None]] = []

    def assign(node: fx.Node, block: int, path: str | None) -> None:
        node_block[node.name] = block
        if path is not None and (not modules[block] or modules[block][-1] != path):
            modules[block].append(path)

    def flush(block: int) -> None:
        for waiting, waiting_path in pending:
            assign(waiting, block, waiting_path)
        pending.clear()

    def layer_of(path: str) -> str | None:
        return _layer_of(path, containers)

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            deferred.append(node)
            continue
        path = _node_module_path(node, tracer)
        if path is not None and _holds_stack(path, containers):
            path = None  # glue code in the layers' parent module (reshapes, masks): stays in the current block
        unit = _unit_of(path, units) if path else None
        if unit is not None:
            seen_layer = True
            if current_owner != unit:
                pending_layer = layer_of(pending[0][1]) if pending and pending[0][1] else None
                new_block = start(unit)
                flush(new_block if pending_layer is not None and pending_layer == layer_of(unit) else current)
                current, current_owner = new_block, unit
            else:
                flush(current)
        elif path is not None and seen_layer and layer_of(path) is not None and units and layer_of(path) not in units:
            pending.append((node, path))
            continue
        elif pending:
            if path is None:
                pending.append((node, path))
                continue
            flush(current)
        if unit is None and path is not None and seen_layer:
            owner = _owner_outside_layers(path, containers)
            # A stateless module (dropout, pooling) or one called again (T5's `decoder.dropout`,
            # after the embedding and after the final norm) is glue: it stays in the current block.
            if current_owner != owner and owner not in stateless and owner not in names:
                current, current_owner = start(owner), owner
        elif unit is None and current is None:
            current, current_owner = start("embedding"), "embedding"
        assign(node, current, path)
    if pending:
        flush(current)

    if not names:
        raise TraceError("the traced graph has no operations")
    for node in deferred:
        users = [node_block[u.name] for u in node.users if u.name in node_block]
        node_block[node.name] = min(users) if users else 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node_block[node.name] = 0
        elif node.op == "output":
            node_block[node.name] = len(names) - 1
    _check_contiguous(gm, node_block)
    return names, node_block, modules


def _check_contiguous(gm: fx.GraphModule, node_block: dict[str, int]) -> None:
    last = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        block = node_block[node.name]
        if block < last:
            raise TraceError(
                f"graph node '{node.name}' belongs to an earlier block than the one before it; the model "
                "re-enters a layer after a later one ran, so blocks are not contiguous (name leaf modules to fix)"
            )
        last = block


# --------------------------------------------------------------------------------------------
# Checking the module-chain fallback against the model

_CHECK_MAX_PARAMS = 50_000_000
"""Largest model whose module chain is checked: it is copied and run twice on the CPU."""

_CHECK_BATCH = 2
"""Batch size of the check input (the example batch is cut down to it)."""

_NOT_THE_MODEL = "the module chain (registration order) does not reproduce the model"


def _check_chain(model: nn.Module, gm: fx.GraphModule, example_inputs: tuple) -> str:
    """Run the model and the module chain `gm` on one small real input and compare their outputs.

    Why: the chain only assumes that `forward` calls its children in registration order, each on
    the previous output. A forward that branches on values, calls children in another order or
    applies functional ops between them would silently train a different model. Returns the
    clause for the tracer note; raises TraceError when the chain does not reproduce the model."""
    num_params = sum(p.numel() for p in model.parameters())
    if num_params > _CHECK_MAX_PARAMS:
        return (f"NOT checked against the model ({num_params / 1e6:,.0f}M parameters, over the "
                f"{_CHECK_MAX_PARAMS / 1e6:.0f}M that are run on the CPU to check)")
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    input_tensors = [x for x in pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor)]
    on_meta = on_meta or any(x.is_meta for x in input_tensors)
    try:
        real = copy.deepcopy(model)
        if on_meta:
            real = real.to_empty(device="cpu")
            _deterministic_init(real)
        else:
            real = real.to("cpu")
    except Exception as exc:  # deepcopy or to_empty of an exotic module
        return f"NOT checked against the model (copying it failed: {_first_line(exc)})"
    chain = fx.GraphModule(real, gm.graph, class_name=type(model).__name__)
    num_chain_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")

    attempts = [_check_inputs(example_inputs, _CHECK_BATCH), _check_inputs(example_inputs, None)]
    for i, inputs in enumerate(attempts):
        try:
            expected = _first_tensor(_run_seeded(real, inputs))
            break
        except Exception as exc:  # the model itself fails on this input
            if i + 1 < len(attempts):
                continue
            if on_meta:
                return f"NOT checked against the model (it fails on a synthesized input: {_first_line(exc)})"
            raise TraceError(f"the model itself fails on the example inputs ({_first_line(exc)})") from exc
    if expected is None or not expected.is_floating_point() or not torch.isfinite(expected).all():
        return "NOT checked against the model (its output is not a finite floating-point tensor)"
    try:
        actual = _first_tensor(_run_seeded(chain, inputs[:num_chain_inputs]))
    except Exception as exc:
        raise TraceError(f"{_NOT_THE_MODEL}: it fails on a real input ({_first_line(exc)})") from exc
    if actual is None or actual.shape != expected.shape:
        got = "no tensor" if actual is None else tuple(actual.shape)
        raise TraceError(f"{_NOT_THE_MODEL}: output {got} instead of {tuple(expected.shape)}")
    tolerance = 1e-4 if expected.dtype in (torch.float32, torch.float64) else 1e-2
    if not torch.allclose(actual.float(), expected.float(), rtol=tolerance, atol=tolerance):
        diff = (actual.float() - expected.float()).abs().max().item()
        raise TraceError(f"{_NOT_THE_MODEL}: max abs difference {diff:.3g} on a real input")
    where = "a CPU copy materialized from meta" if on_meta else "a copy of the model"
    return f"checked: the chain reproduces the model's output on a real input ({where})"


def _check_inputs(example_inputs: tuple, batch: int | None) -> tuple:
    """Real CPU inputs shaped like the examples: the examples themselves (integer ids stay in
    their range), cut to `batch` rows when every tensor shares its first dimension; on meta,
    seeded normal floats and ones for integers and masks (a valid id and `attend`)."""
    tensors = [x for x in pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor)]
    first_dims = {x.shape[0] if x.dim() > 0 else None for x in tensors}
    (first_dim,) = first_dims if len(first_dims) == 1 else (None,)
    cut = batch is not None and first_dim is not None and first_dim > batch
    generator = torch.Generator().manual_seed(0)

    def real(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if cut:
            x = x[:batch]
        if not x.is_meta:
            return x.detach().to("cpu").clone()
        if x.is_floating_point():
            return torch.randn(x.shape, generator=generator).to(x.dtype)
        return torch.ones(x.shape, dtype=x.dtype)

    return tuple(pytree.tree_map(real, example_inputs))


def _deterministic_init(model: nn.Module) -> None:
    """Fill a materialized (to_empty) model deterministically: seeded uniform values, then each
    module's own `reset_parameters` (so norms start at 1 and batch-norm statistics are valid)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        for module in model.modules():
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if tensor.is_floating_point():
                    tensor.uniform_(-0.1, 0.1)
                else:
                    tensor.zero_()
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


def _run_seeded(module: nn.Module, inputs: tuple) -> Any:
    """Run `module` without gradients, the CPU generator seeded the same for every run (dropout)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        return module(*inputs)


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a (nested) output: what `append_loss` puts the loss on."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    for item in value if isinstance(value, (tuple, list)) else ():
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


# --------------------------------------------------------------------------------------------
# Entry point


def trace_model(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    leaf_modules: Sequence[str] = (),
    tracer: str = "auto",
) -> TracedModel:
    """Trace `model` called on `example_inputs` and group its graph into blocks.

    `tracer` is `auto` (fx, then export, then module boundaries), or one of `fx`, `export`,
    `modules` to force one. `leaf_modules` are module paths (`*` matches one path component)
    that become blocks of their own, e.g. `layers.*.attention`.
    """
    if tracer not in ("auto", "fx", "export", "modules"):
        raise TraceError(f"unknown tracer '{tracer}'; use auto, fx, export or modules")
    example_inputs = tuple(example_inputs)
    containers = find_layer_containers(model)
    units = _placeable_units(model, containers, leaf_modules)
    order = ["fx", "export", "modules"] if tracer == "auto" else [tracer]
    failures: list[str] = []
    value_read: str | None = None  # the first tracer failure caused by value-dependent control flow
    for name in order:
        try:
            if name == "fx":
                gm = _trace_fx(model, set(units), len(example_inputs))
            elif name == "export":
                gm = _trace_export(model, example_inputs)
                retarget_device(gm, "cpu")  # profiling runs on fake cpu tensors; the runtime retargets
            else:
                if not units:
                    raise TraceError("no repeated layer list (ModuleList/Sequential) to cut at")
                gm = _chain_modules(model, units)
            block_names, node_block, block_modules = _group_blocks(gm, name, containers, units,
                                                                   _stateless_modules(model))
            if name == "modules":
                checked = _check_chain(model, gm, example_inputs)
        except Exception as exc:  # each tracer fails in its own way; keep the first line of each
            failures.append(f"{name} failed ({_first_line(exc)})")
            # export's word wins over fx's: only export tells a branch on a value from one on a shape
            found = value_dependence(exc)
            value_read = (found or value_read) if name == "export" else (value_read or found)
            continue
        note = f"traced with {name}"
        if failures:
            note += "; " + "; ".join(failures)
        if name == "modules":
            note += ("; assumes forward calls the children in registration order, each on the previous output; "
                     + checked)
        input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        return TracedModel(gm, block_names, node_block, name, note, _largest_stack(model, containers),
                           input_names, block_modules, containers)
    if value_read is not None:
        raise TraceError(value_read)
    raise TraceError(
        "no tracer could handle the model (" + "; ".join(failures) + "); name leaf modules with "
        "--leaf-modules (e.g. 'layers.*') so fx keeps the ones with value-dependent branches opaque, or make "
        "forward traceable, e.g. the repeated layers in an nn.ModuleList called in a plain loop"
    )


def _output_builder(out_spec: Any) -> Any:
    """A graph function rebuilding an exported model's output (e.g. a ModelOutput) from its tensors."""
    import torch.utils._pytree as pytree

    def model_output(*leaves: Any) -> Any:
        return pytree.tree_unflatten(list(leaves), out_spec)

    return model_output


def append_loss(traced: TracedModel, loss_fn: Any, target_name: str = "target") -> TracedModel:
    """Append `loss_fn(output, target)` to the graph (in the last block), with a new input.

    An exported graph returns its output flattened (a ModelOutput's tensors in field order); the
    loss receives it rebuilt as the model returns it (the ModelOutput itself, e.g. T5's logits and
    encoder states), and the graph then returns the loss alone. A tuple or list output gives the
    loss its first element, with either tracer (only that element's tensors reach the last block)."""
    graph = traced.gm.graph
    output_node = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        target = graph.placeholder(target_name)
    (out_value,) = output_node.args
    codegen = graph._codegen
    out_spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    rebuild = None
    if out_spec is not None:
        leaves = list(out_value) if isinstance(out_value, (tuple, list)) else [out_value]
        codegen.pytree_info = codegen.pytree_info._replace(out_spec=None)  # the graph now returns the loss
        if out_spec.type in (tuple, list) and out_spec.num_children:  # as fx: the loss takes element 0
            out_spec = out_spec.child(0)
            leaves = leaves[:out_spec.num_leaves]
        if out_spec.is_leaf():
            out_value = leaves[0]
        else:
            with graph.inserting_before(output_node):
                rebuild = out_value = graph.call_function(_output_builder(out_spec), tuple(leaves))
    elif isinstance(out_value, (tuple, list)):
        out_value = out_value[0]
    with graph.inserting_before(output_node):
        loss = graph.call_function(loss_fn, (out_value, target))
    output_node.args = (loss,)
    if rebuild is not None:
        traced.node_block[rebuild.name] = traced.num_blocks - 1
    graph.lint()
    traced.gm.recompile()
    traced.node_block[target.name] = 0
    traced.node_block[loss.name] = traced.num_blocks - 1
    traced.input_names = [n.name for n in graph.nodes if n.op == "placeholder"]
    return traced


def trace_with_loss(model: nn.Module, example_inputs: Sequence[Any], *, loss_fn: Any = None,
                    example_target: Any = None, leaf_modules: Sequence[str] = (),
                    tracer: str = "auto") -> tuple[TracedModel, list[Any]]:
    """`trace_model`, then `append_loss` when a loss is given; returns the traced model and the
    graph's inputs (the example inputs, plus the target when a loss was appended)."""
    traced = trace_model(model, example_inputs, leaf_modules=leaf_modules, tracer=tracer)
    inputs = list(example_inputs)
    if loss_fn is not None:
        if example_target is None:
            raise TraceError("a loss_fn needs example_target (a target for the example batch)")
        traced = append_loss(traced, loss_fn)
        inputs.append(example_target)
    return traced, inputs


# --------------------------------------------------------------------------------------------
# Sub-graphs


def crossing_values(traced: TracedModel, cut_after: int) -> list[fx.Node]:
    """Nodes produced in blocks <= cut_after (placeholders excluded) and used in a later block."""
    result = []
    for node in traced.gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or traced.node_block[node.name] > cut_after:
            continue
        if any(traced.node_block[u.name] > cut_after for u in node.users):
            result.append(node)
    return result


class _DeferredCodeGraphModule(fx.GraphModule):
    """A GraphModule that generates its Python code on first use instead of when built.

    Why: code generation (torch.fx's `recompile`) is half the cost of extracting a block, and
    analytic profiling extracts every block (99 for gpt3-175b) to read its graph, fingerprint and
    parameters but runs only the distinct ones (a handful)."""

    def recompile(self):  # type: ignore[override]
        if getattr(self, "_code_ready", False):
            return super().recompile()
        return None  # generated by `_ensure_code` on first use

    def _ensure_code(self) -> None:
        if not getattr(self, "_code_ready", False):
            self._code_ready = True
            fx.GraphModule.recompile(self)  # sets this instance's class forward / __call__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ensure_code()
        return self.forward(*args, **kwargs)  # the generated forward now

    @property
    def code(self) -> str:  # type: ignore[override]
        self._ensure_code()
        return super().code


def extract_submodule(traced: TracedModel, first_block: int, last_block: int, *,
                      defer_code: bool = False) -> tuple[fx.GraphModule, list[str], list[str]]:
    """Blocks first_block..last_block (inclusive) as a GraphModule over the original modules.

    Returns (module, input node names, output node names). Inputs are every value the range uses
    but does not produce (model inputs and tensors from earlier blocks, skip connections
    included), in graph order; outputs are every value it produces that a later block (or the
    model output) uses, in graph order. Parameters keep their names in the model. With
    `defer_code`, the module's Python code is generated when it is first called (see
    `_DeferredCodeGraphModule`).
    """
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    inside = {n.name for n in traced.gm.graph.nodes if first_block <= traced.node_block[n.name] <= last_block
              and n.op not in ("placeholder", "output")}
    inputs: list[str] = []
    for node in traced.gm.graph.nodes:
        if node.name in inside:
            continue
        if node.op == "output":
            continue
        if any(u.name in inside for u in node.users) and node.op != "get_attr":
            env[node.name] = graph.placeholder(node.name)
            env[node.name].meta = dict(node.meta)
            inputs.append(node.name)
    for node in traced.gm.graph.nodes:
        if node.name not in inside and node.op == "get_attr" and any(u.name in inside for u in node.users):
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    outputs: list[str] = []
    for node in traced.gm.graph.nodes:
        if node.name in inside:
            env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    for node in traced.gm.graph.nodes:
        if node.name in inside and any(u.name not in inside for u in node.users) and node.op != "get_attr":
            outputs.append(node.name)
    graph.output(tuple(env[name] for name in outputs))
    cls = _DeferredCodeGraphModule if defer_code else fx.GraphModule
    module = cls(traced.gm, graph, class_name=f"Blocks{first_block}to{last_block}")
    return module, inputs, outputs
