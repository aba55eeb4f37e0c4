"""Running a traced model on fake tensors: shapes, dtypes and strides propagate, no kernel runs.

The profile (graph/profile.py) measures every block on the values this run gives its inputs, and
`fake_output` reads the graph's output from it. It is apart from the measuring because it is the one
place that decides how a graph runs without memory: on meta tensors when the graph holds no values,
else on fake cpu tensors ([Note: meta or fake]), with identical repeated layers run once.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.graph.operators import FusedAttention
from autoplan.graph.trace import TracedModel
from autoplan.graph.trace_errors import value_dependence

__all__ = ["FakeRun", "ProfileError", "dtype_name", "fake_like", "nbytes", "run_fake", "tensors_in"]


class ProfileError(ValueError):
    """The model cannot be profiled on the given inputs."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fake_like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """An empty tensor with t's shape (cast to dtype when t is floating point) on the default device:
    a fake cpu tensor under FakeTensorMode, a meta tensor in a meta run ([Note: meta or fake])."""
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    return torch.empty(tuple(t.shape), dtype=target)


class _LazyFakes(dict):
    """Fake parameters and buffers by name, each made on first use.

    A 96-layer model has about a thousand parameters, but identical layers are run once
    (`run_fake`) and measured once (`profile_traced`), so most fakes would never be read; making
    one costs a FakeTensorMode dispatch (about 0.1 ms). Tied parameters (one object under several
    names) get one fake, as in the module; every buffer name gets its own."""

    def __init__(self, mode: Any, gm: fx.GraphModule, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.mode = mode
        self.dtype = dtype
        self.owner: dict[int, str] = {}
        """id(original parameter) -> first name it has in the traced module (to spot sharing)."""
        self.sources: dict[str, tuple[torch.Tensor, bool]] = {}  # name -> (original, is a parameter)
        self.alias: dict[str, str] = {}  # tied parameter name -> its first name
        for name, p in gm.named_parameters(remove_duplicate=False):
            if id(p) in self.owner:
                self.alias[name] = self.owner[id(p)]
            else:
                self.owner[id(p)] = name
            self.sources[name] = (p, True)
        for name, b in gm.named_buffers(remove_duplicate=False):
            self.sources[name] = (b, False)
        # Tensors export lifted from the forward's literals (Falcon's attention indexes with a list,
        # `x[..., [-2], :]`) are plain attributes of the graph, neither parameters nor buffers, and a
        # block extracted from the graph holds them as buffers: they are sources like buffers.
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target not in self.sources:
                value = operator.attrgetter(node.target)(gm)
                if isinstance(value, torch.Tensor):
                    self.sources[node.target] = (value, False)

    def __missing__(self, name: str) -> torch.Tensor:
        if name in self.alias:
            value = self[self.alias[name]]
        else:
            original, is_param = self.sources[name]  # KeyError for a name that is neither
            with self.mode:
                if is_param:
                    value = fake_like(original, self.dtype).requires_grad_(original.requires_grad)
                else:
                    value = fake_like(original, self.dtype if original.is_floating_point() else None)
        self[name] = value
        return value

    def nbytes(self, name: str) -> int:
        """Bytes of the fake for `name`, without making it."""
        original, _ = self.sources[name]
        target = self.dtype if (self.dtype is not None and original.is_floating_point()) else original.dtype
        return original.numel() * target.itemsize


@dataclass
class FakeRun:
    mode: Any
    """FakeTensorMode, or a `_MetaMode` ([Note: meta or fake])."""
    params: _LazyFakes
    """Fake parameters and buffers by (duplicate-free) name in the traced module, made on first use."""
    values: dict[str, Any]
    """Fake value of every graph node, after a forward of the whole model."""
    param_owner: dict[int, str]
    """id(original parameter) -> first name it has in the traced module (to spot sharing)."""
    meta: bool = False

    def owns(self, value: Any) -> bool:
        """Whether `value` is a tensor of this run (else it is made anew, shaped like it)."""
        if isinstance(value, torch._subclasses.FakeTensor):
            return not self.meta
        return self.meta and isinstance(value, torch.Tensor) and value.device.type == "meta"


# [Note: meta or fake]
# A graph traced by torch.fx from a model built on the meta device (every zoo model, a model file
# built on meta) holds no values: it runs on meta tensors, whose shape functions need none of
# FakeTensorMode's bookkeeping; creating the first FakeTensorMode imports torch._dynamo, 0.85 s of the
# 2 s search-speed budget. On meta, scaled_dot_product_attention would take its unfused math path
# (the device has no fused kernel), so `_MetaMode` routes it to the fused kernel the CPU runs on fake
# tensors (and a GPU runs), so that both list the same operators. Anything else (an export graph,
# real weights, a meta run that fails) runs on fake tensors.


class _MetaMode:
    """Factory calls on meta, fused attention ([Note: meta or fake]); enterable again, also while
    entered (a lazily made parameter inside a run)."""

    def __init__(self) -> None:
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(FusedAttention())
        self._stacks.append(stack)

    def __exit__(self, *exc: Any) -> None:
        self._stacks.pop().close()


def run_fake(traced: TracedModel, example_inputs: Sequence[Any], dtype: torch.dtype | None) -> FakeRun:
    gm = traced.gm
    on_meta = traced.tracer != "export" and all(t.device.type == "meta" for t in [*gm.parameters(), *gm.buffers()])
    if on_meta:
        try:
            return _run_in(_MetaMode(), traced, example_inputs, dtype, meta=True)
        except ProfileError:
            pass
    return _run_in(FakeTensorMode(allow_non_fake_inputs=False), traced, example_inputs, dtype, meta=False)


def _run_in(mode: Any, traced: TracedModel, example_inputs: Sequence[Any], dtype: torch.dtype | None, *,
            meta: bool) -> FakeRun:
    gm = traced.gm
    params = _LazyFakes(mode, gm, dtype)
    owner = params.owner
    with mode:
        inputs = [fake_like(x, dtype) if isinstance(x, torch.Tensor) else x for x in example_inputs]

    values: dict[str, Any] = {}
    # Identical repeated layers produce outputs of identical shapes: run the first one of each kind
    # and give the others fresh fake tensors of the same shapes (96 layers run as 1). The key is the
    # module's class and parameter shapes plus the shapes of its inputs.
    structure: dict[str, tuple] = {}
    shape_cache: dict[tuple, Any] = {}

    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("T", tuple(value.shape), value.dtype, value.requires_grad)
        if isinstance(value, (tuple, list)):
            return tuple(describe(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, describe(v)) for k, v in value.items())
        return ("V", repr(value))

    def fresh(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
        if isinstance(value, (tuple, list)):
            return type(value)(fresh(v) for v in value)
        return value

    running: list[fx.Node | None] = [None]  # the node being run: its stack trace names a failing line

    class Recorder(fx.Interpreter):
        def call_module(self, target: str, args: Any, kwargs: Any) -> Any:
            module = self.fetch_attr(target)
            if target not in structure:
                structure[target] = (type(module).__qualname__,
                                     tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))
            key = (structure[target], describe(args), describe(kwargs))
            if key not in shape_cache:
                own = [n for n, _ in module.named_parameters(remove_duplicate=False)]
                own += [n for n, _ in module.named_buffers(remove_duplicate=False)]
                local = {n: params[f"{target}.{n}"] for n in own}
                shape_cache[key] = torch.func.functional_call(module, local, tuple(args), dict(kwargs), strict=False)
                return shape_cache[key]
            return fresh(shape_cache[key])

        def get_attr(self, target: str, args: Any, kwargs: Any) -> Any:
            if target in params.sources:
                return params[target]
            return super().get_attr(target, args, kwargs)

        def run_node(self, n: fx.Node) -> Any:
            running[0] = n
            result = super().run_node(n)
            values[n.name] = result
            return result

    with mode, torch.no_grad():
        try:
            Recorder(gm).run(*inputs)
        except Exception as exc:
            if os.environ.get("AUTOPLAN_DEBUG"):  # show the full traceback when debugging a model
                raise
            value_read = value_dependence(exc, running[0].meta.get("stack_trace") if running[0] else None)
            if value_read is not None:
                raise ProfileError(value_read) from None
            raise ProfileError(f"the model rejects the example inputs: {type(exc).__name__}: "
                               f"{str(exc).strip().splitlines()[0][:200]}") from None
    return FakeRun(mode, params, values, owner, meta)


def tensors_in(value: Any) -> list[torch.Tensor] | None:
    """Tensors in a value, or None when it holds something that is not a tensor."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        out: list[torch.Tensor] = []
        for v in value:
            inner = tensors_in(v)
            if inner is None:
                return None
            out += inner
        return out
    return None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
