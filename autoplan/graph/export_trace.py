"""The torch.export tracer: a non-strict export, unlifted back into a `GraphModule` over the
model's own parameters, made to run on any device and in any compute dtype ([Note: exporting for
any device and dtype], [Note: dtype-following graphs]).

Apart from graph/trace.py, which tries the tracers in order, because undoing what export bakes in
(devices, dtypes, metadata asserts, fake constants) is a concern of its own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoplan.graph.trace_errors import TraceError

__all__ = ["trace_export"]


def trace_export(model: nn.Module, example_inputs: tuple, dtype: torch.dtype | None = None) -> fx.GraphModule:
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
    profile run every floating tensor in one compute dtype (runtime/parallel/precision.py), so each constant
    equal to the traced dtype becomes `_dtype_of(ref)`, where `ref` is a floating tensor argument of
    the op, else the nearest floating value computed before it (never a parameter, which would pull
    a weight into another block). In float32 the graph computes exactly what it traced; in bf16 the
    upcasts inside norms and rotary tables run in bf16, as everything else does (positions past
    256 then round: trace with the compute dtype, `trace_export(dtype=)`, to keep them in fp32).
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
