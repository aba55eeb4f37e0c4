"""Trace an `nn.Module` into an ordered fx graph whose nodes are grouped into blocks.

Three tracers, tried in order (docs/architecture.md, "graph.trace"):

1. `torch.fx` symbolic tracing, with the model's repeated layers (and any user-named modules) kept
   as leaf `call_module` nodes. Works on most hand-written models.
2. `torch.export` (non-strict), for models with Python control flow on shapes that defeats fx
   (Hugging Face models). The exported program is unlifted back into a `GraphModule` whose
   parameters keep their original names; nodes are grouped by their `nn_module_stack`.
3. Module boundaries: when both fail, the model's children are chained in registration order
   (embeddings, each repeated layer, norm, head), each taking the previous one's output. This
   assumes `forward` calls them in that order, so before the chain is used it is run against the
   model on one small real input (`check_chain`; a meta model is materialized on the CPU when it
   is small): a mismatch is a TraceError, and the tracer note says whether the check ran.

The result, `TracedModel`, is a `GraphModule` plus a block index for every node. Everything that
needs to run part of the model (profiling one block, building a pipeline stage) extracts a
sub-graph with `extract_submodule`, which keeps parameter names as they are in the model.

[Note: blocks] (graph/grouping.py) says how nodes are grouped into blocks. The tracers live apart:
torch.export in graph/export_trace.py, the module chain and its check in graph/module_chain.py, and
the one-line reports of what cannot be traced in graph/trace_errors.py.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoplan.graph.export_trace import trace_export
from autoplan.graph.grouping import (
    find_layer_containers,
    group_blocks,
    largest_stack,
    placeable_units,
    stateless_modules,
)
from autoplan.graph.module_chain import chain_modules, check_chain
from autoplan.graph.trace_errors import (
    TraceError,
    first_line,
    library_prefixes,
    outside_library,
    value_dependence,
)

__all__ = ["TracedModel", "append_loss", "crossing_values", "extract_submodule", "model_output", "retarget_device",
           "trace_model", "trace_with_loss"]


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
    """The repeated layer stack with the most layers (graph/grouping.py `find_layer_container`); kept for callers that
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
# Tracers


class _LeafTracer(fx.Tracer):
    def __init__(self, leaves: set[str]):
        super().__init__()
        self._leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # `fx_leaf`: a subclass of a torch.nn module that only changes how its forward computes (the
        # zoo's RMSNorm, models/ops.py [Note: lean RMSNorm]) stays one node, as its torch.nn base does.
        return (module_qualified_name in self._leaves or getattr(type(m), "fx_leaf", False)
                or super().is_leaf_module(m, module_qualified_name))

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        """Each node keeps the model's line that made it: a value read such as `.item()` is traced as
        a node and fails only when profiled, where that line is named ([Note: value-dependent control
        flow] in graph/trace_errors.py). One frame, found here, not fx's `record_stack_traces`: that formats the whole stack of
        every node and imports torch._inductor to filter it (0.6 s of CPU on every trace)."""
        node = super().create_node(*args, **kwargs)
        autoplan_dir = library_prefixes()[1]
        frame = sys._getframe(1)
        # Out through torch to the innermost frame of the model's; reaching autoplan first means the
        # node is not made by the model's code (placeholders, the output) or the model is autoplan's own.
        while frame is not None and not outside_library(frame.f_code.co_filename):
            frame = None if frame.f_code.co_filename.startswith(autoplan_dir) else frame.f_back
        if frame is not None and not node.stack_trace:  # a traceback line's format, which trace_errors' _STACK_FRAME reads
            node.stack_trace = f'File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}'
        return node


def _trace_fx(model: nn.Module, leaves: set[str], num_inputs: int) -> fx.GraphModule:
    tracer = _LeafTracer(leaves)
    graph = tracer.trace(model)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) < num_inputs:
        raise TraceError(f"model takes {len(placeholders)} inputs but {num_inputs} example inputs were given")
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
    units = placeable_units(model, containers, leaf_modules)
    order = ["fx", "export", "modules"] if tracer == "auto" else [tracer]
    failures: list[str] = []
    value_read: str | None = None  # the first tracer failure caused by value-dependent control flow
    for name in order:
        try:
            if name == "fx":
                gm = _trace_fx(model, set(units), len(example_inputs))
            elif name == "export":
                gm = trace_export(model, example_inputs)
                retarget_device(gm, "cpu")  # profiling runs on fake cpu tensors; the runtime retargets
            else:
                if not units:
                    raise TraceError("no repeated layer list (ModuleList/Sequential) to cut at")
                gm = chain_modules(model, units)
            block_names, node_block, block_modules = group_blocks(gm, name, containers, units,
                                                                  stateless_modules(model))
            if name == "modules":
                checked = check_chain(model, gm, example_inputs)
        except Exception as exc:  # each tracer fails in its own way; keep the first line of each
            failures.append(f"{name} failed ({first_line(exc)})")
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
        return TracedModel(gm, block_names, node_block, name, note, largest_stack(model, containers),
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


def _out_spec(gm: fx.GraphModule) -> Any:
    """The pytree spec an exported graph rebuilds its output with (None: fx returns it as it is)."""
    return getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)


def model_output(gm: fx.GraphModule, value: Any) -> Any:
    """`value`, what the output node of `gm`'s graph holds, as the model returns it. An exported
    graph's output node holds a ModelOutput's tensors flattened in field order (a transformers MoE
    model's `aux_loss` before its `logits`); rebuilt, the logits are found by name."""
    out_spec = _out_spec(gm)
    if out_spec is None:
        return value
    return _output_builder(out_spec)(*(value if isinstance(value, (tuple, list)) else [value]))


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
    out_spec = _out_spec(traced.gm)
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
