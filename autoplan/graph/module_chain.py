"""The module-boundary fallback tracer: the model's children chained in registration order, and
the check that the chain reproduces the model on one small real input.

Apart from graph/trace.py because the check is most of it: a chain only assumes how `forward`
calls the children, so it is run against the model before it is used (`check_chain`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from autoplan.graph.trace_errors import TraceError, first_line

__all__ = ["chain_modules", "check_chain"]


def chain_modules(model: nn.Module, units: list[str]) -> fx.GraphModule:
    """Module-boundary fallback: children in registration order, each fed the previous output.

    Modules holding units (the layer stacks and their ancestors, a layer holding user leaves) are
    descended into; every other child is called whole. `check_chain` tests the result."""
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


_CHECK_MAX_PARAMS = 50_000_000
"""Largest model whose module chain is checked: it is copied and run twice on the CPU."""

_CHECK_BATCH = 2
"""Batch size of the check input (the example batch is cut down to it)."""

_NOT_THE_MODEL = "the module chain (registration order) does not reproduce the model"


def check_chain(model: nn.Module, gm: fx.GraphModule, example_inputs: tuple) -> str:
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
        return f"NOT checked against the model (copying it failed: {first_line(exc)})"
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
                return f"NOT checked against the model (it fails on a synthesized input: {first_line(exc)})"
            raise TraceError(f"the model itself fails on the example inputs ({first_line(exc)})") from exc
    if expected is None or not expected.is_floating_point() or not torch.isfinite(expected).all():
        return "NOT checked against the model (its output is not a finite floating-point tensor)"
    try:
        actual = _first_tensor(_run_seeded(chain, inputs[:num_chain_inputs]))
    except Exception as exc:
        raise TraceError(f"{_NOT_THE_MODEL}: it fails on a real input ({first_line(exc)})") from exc
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
