"""Trace an `nn.Module` into an ordered fx graph whose nodes are grouped into blocks.

Three tracers, tried in order (DESIGN.md, "graph.trace"):

1. `torch.fx` symbolic tracing, with the model's repeated layers (and any user-named modules) kept
   as leaf `call_module` nodes. Works on most hand-written models.
2. `torch.export` (non-strict), for models with Python control flow on shapes that defeats fx
   (Hugging Face models). The exported program is unlifted back into a `GraphModule` whose
   parameters keep their original names; nodes are grouped by their `nn_module_stack`.
3. Module boundaries: when both fail, the model's children are chained in registration order
   (embeddings, each repeated layer, norm, head), each taking the previous one's output. This
   assumes `forward` calls them in that order and is said so in the tracer note.

The result, `TracedModel`, is a `GraphModule` plus a block index for every node. Everything that
needs to run part of the model (profiling one block, building a pipeline stage) extracts a
sub-graph with `extract_submodule`, which keeps parameter names as they are in the model.

[Note: blocks]
A block is a contiguous run of graph nodes. The default granularity is the model's repeated
layer unit: the largest `ModuleList`/`Sequential` of same-class children is found, and each of its
children is one block. Everything before the first layer is one `embedding` block; after the last
layer every distinct top-level module (final norm, head) starts a block of its own. Functional ops
between modules belong to the block of the module before them, so a loss appended after the head
lands in the head block. Modules named in `leaf_modules` become blocks of their own too.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = [
    "TraceError", "TracedModel", "extract_submodule", "find_layer_container", "retarget_device", "trace_model",
    "trace_with_loss",
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
    """One line: which tracer was used and why the ones before it failed."""
    layer_container: str | None
    input_names: list[str]
    block_modules: list[list[str]] = field(default_factory=list)
    """Module paths called in each block (leaf modules for fx, innermost modules for export)."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    def nodes_of_block(self, index: int) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if self.node_block[n.name] == index and n.op not in ("placeholder", "output")]


# --------------------------------------------------------------------------------------------
# The repeated layer list


def find_layer_container(model: nn.Module) -> str | None:
    """Path of the largest ModuleList/Sequential whose children (at least 2) share one class."""
    best: tuple[int, str] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2:
            continue
        most_common_class, count = Counter(type(c) for c in children).most_common(1)[0]
        # Require the repeated class to be a composite layer, not e.g. a Sequential of Linears+ReLUs.
        if count < 2 or count < len(children) * 0.5 or not any(True for _ in children[0].children()):
            continue
        if best is None or count > best[0]:
            best = (count, path)
    return best[1] if best else None


def _placeable_units(model: nn.Module, container: str | None, leaf_modules: Sequence[str]) -> list[str]:
    """Module paths that become blocks of their own (layers plus user-named leaves)."""
    units: list[str] = []
    if container is not None:
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


def _trace_fx(model: nn.Module, leaves: set[str], num_inputs: int) -> fx.GraphModule:
    tracer = _LeafTracer(leaves)
    graph = tracer.trace(model)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) < num_inputs:
        raise TraceError(f"model takes {len(placeholders)} inputs but {num_inputs} example inputs were given")
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


def _trace_export(model: nn.Module, example_inputs: tuple) -> fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(model, example_inputs, strict=False)
        return program.module()


def _chain_modules(model: nn.Module, container: str | None, units: list[str]) -> fx.GraphModule:
    """Module-boundary fallback: children in registration order, each fed the previous output."""
    order: list[str] = []
    layer_units = set(units)
    container_prefix = f"{container}." if container else None

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path in layer_units:
                order.append(path)
            elif container is not None and (path == container or container.startswith(path + ".")):
                visit(child, path + ".")
            elif container_prefix and path.startswith(container_prefix):
                continue
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


def _unit_of(path: str, units: list[str], container: str | None) -> str | None:
    for unit in units:
        if path == unit or path.startswith(unit + "."):
            return unit
    return None


def _owner_outside_layers(path: str, container: str | None) -> str:
    """The shortest prefix of `path` that is not an ancestor of the layer container."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if container is None or not (container == prefix or container.startswith(prefix + ".")):
            return prefix
    return path


def _group_blocks(gm: fx.GraphModule, tracer: str, container: str | None, units: list[str]):
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
        if container is None or not path.startswith(container + "."):
            return None
        return ".".join(path.split(".")[: container.count(".") + 2])

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            deferred.append(node)
            continue
        path = _node_module_path(node, tracer)
        if path is not None and container is not None and (container == path or container.startswith(path + ".")):
            path = None  # glue code in the layers' parent module (reshapes, masks): stays in the current block
        unit = _unit_of(path, units, container) if path else None
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
            owner = _owner_outside_layers(path, container)
            if current_owner != owner:
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
    container = find_layer_container(model)
    units = _placeable_units(model, container, leaf_modules)
    order = ["fx", "export", "modules"] if tracer == "auto" else [tracer]
    failures: list[str] = []
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
                gm = _chain_modules(model, container, units)
            block_names, node_block, block_modules = _group_blocks(gm, name, container, units)
        except Exception as exc:  # each tracer fails in its own way; keep the first line of each
            failures.append(f"{name} failed ({_first_line(exc)})")
            continue
        note = f"traced with {name}"
        if failures:
            note += "; " + "; ".join(failures)
        if name == "modules":
            note += "; assumes forward calls the children in registration order, each on the previous output"
        input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        return TracedModel(gm, block_names, node_block, name, note, container, input_names, block_modules)
    raise TraceError(
        "no tracer could handle the model (" + "; ".join(failures) + "); name leaf modules with "
        "--leaf-modules (e.g. 'layers.*'), or wrap the repeated layers in an nn.ModuleList called in a plain loop"
    )


def append_loss(traced: TracedModel, loss_fn: Any, target_name: str = "target") -> TracedModel:
    """Append `loss_fn(output, target)` to the graph (in the last block), with a new input."""
    graph = traced.gm.graph
    output_node = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        target = graph.placeholder(target_name)
    (out_value,) = output_node.args
    if isinstance(out_value, (tuple, list)):
        out_value = out_value[0]
    with graph.inserting_before(output_node):
        loss = graph.call_function(loss_fn, (out_value, target))
    output_node.args = (loss,)
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
