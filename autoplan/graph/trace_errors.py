"""How tracing and profiling fail: `TraceError`, and one-line reports that name the model's own line.

A model that reads a tensor's value fails differently in every tracer and in the profile's fake run
([Note: value-dependent control flow]); `value_dependence` and `model_line` turn any of those
failures into one line with the user's file and line and the fix. Apart from the tracers because the
tracers (graph/trace.py, graph/module_chain.py, graph/export_trace.py) and the profile
(graph/fake_run.py, graph/block_cost.py) all report through it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["TraceError", "first_line", "library_prefixes", "model_line", "outside_library", "value_dependence"]


class TraceError(ValueError):
    """No tracer could turn the model into a graph (or the inputs do not fit the model)."""


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
def library_prefixes() -> tuple[str, ...]:
    """Where torch, autoplan and the standard library live: frames there are not the model's."""
    return tuple(os.path.join(str(path), "") for path in  # a trailing separator: torchvision is not torch
                 (Path(torch.__file__).parent, Path(__file__).resolve().parents[1], sysconfig.get_paths()["stdlib"]))


def outside_library(filename: str) -> bool:
    """Whether a frame's file is the model's own (not torch, autoplan, the standard library or generated code)."""
    return not filename.startswith("<") and not filename.startswith(library_prefixes())


def _user_frame(chain: Sequence[BaseException], stack_trace: str | None) -> tuple[str, int, str, str] | None:
    """(file, line, function, source line) of the innermost frame outside torch, autoplan, the
    standard library and generated code: the model's own line that read the value. Looked for in the
    exception's traceback, then in `stack_trace` (the failing graph node's, recorded when traced)."""
    import linecache
    import traceback

    outside = outside_library
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"
