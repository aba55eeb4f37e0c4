"""Profile a traced model: per block FLOPs, bytes, and (on a real device) times.

Analytic profiling runs every op on fake tensors (`torch._subclasses.FakeTensorMode`): shapes,
dtypes and strides propagate, kernels do not run, nothing is allocated, so a 405B model profiles
on a laptop. Fake tensors live on the *cpu* device rather than `meta` on purpose: on `meta`,
`scaled_dot_product_attention` falls back to the math path and saves the s x s attention matrix,
while every real device runs a fused (flash) kernel that does not. On a fake cpu tensor the
dispatcher picks the fused cpu kernel, whose saved tensors match what a GPU's flash attention
saves (q, k, v, output, log-sum-exp).

Per block (see `blocks.Block`):
- FLOPs: `torch.utils.flop_counter.FlopCounterMode` around forward and around backward.
- Saved-for-backward bytes: `torch.autograd.graph.saved_tensors_hooks` around forward; each
  storage counted once (a tensor saved by q, k and v projections is one tensor), parameters
  excluded (they are counted as weights).
- Identical repeated blocks (same fingerprint: structure, parameter shapes, input shapes) are
  profiled once.

Timed profiling (`device="cpu"` or `"cuda"`) materializes one block at a time with random
weights, times forward and backward (warm-up, repeats, median; CUDA events on GPUs; a repeated block
as a run of its copies, [Note: timing in context]) and caches the result as JSON keyed by model
fingerprint, device name, shapes, dtype, torch version and timing method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from autoplan.graph.blocks import Block, CrossingTensor, CutCandidate, ModelProfile
from autoplan.graph.experts import expert_modules
from autoplan.graph.operators import (
    RECORDER_VERSION,
    Call,
    FusedAttention,
    GpuKernels,
    OperatorRecorder,
    UnpricedOperator,
    merge_batches,
)
from autoplan.graph.positions import POSITIONS_ATTRIBUTE
from autoplan.graph.trace import (
    TracedModel,
    crossing_values,
    extract_submodule,
    model_line,
    trace_with_loss,
    value_dependence,
)

__all__ = ["ProfileError", "config_info", "fake_output", "flop_counter", "model_fingerprint", "profile_model", "profile_traced"]

Progress = Callable[[int, int, str], None]

_ATTENTION_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
    torch.ops.aten._scaled_dot_product_flash_attention_backward,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward,
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
}


class ProfileError(ValueError):
    """The model cannot be profiled on the given inputs."""


# --------------------------------------------------------------------------------------------
# FLOP counting


def _cpu_sdpa_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode that also counts the cpu fused attention kernel.

    torch registers FLOP formulas for the CUDA flash / memory-efficient kernels only; the cpu
    kernel computes the same math, so it gets the same formula (counting the full s x s score
    matrix, as FlopCounterMode does for the CUDA kernels and as Megatron's 4*b*s^2*h term does).
    """
    return FlopCounterMode(display=False, custom_mapping=custom_flop_formulas())


def custom_flop_formulas() -> dict:
    """FLOP formulas torch lacks, by operator packet (see `flop_counter`)."""
    mapping = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
    }
    # transformers' grouped GEMM of mixture-of-experts layers (its integrations/moe.py), when loaded.
    moe = getattr(torch.ops, "transformers", None)
    if moe is not None and hasattr(moe, "grouped_mm_fallback"):
        mapping[moe.grouped_mm_fallback] = _grouped_mm_flop
        mapping[moe.grouped_mm_fallback_backward] = _grouped_mm_backward_flop
    return mapping


def _grouped_mm_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """Rows (S, K) sorted by expert against expert matrices (E, K, N): each row meets one K x N
    matrix, 2 FLOPs per multiply-add (the convention of torch.utils.flop_counter)."""
    return 2 * input_shape[0] * input_shape[1] * weight_shape[-1]


def _grouped_mm_backward_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _grouped_mm_flop(input_shape, weight_shape)  # the input's gradient and the weights'


def _attention_flops(counter: FlopCounterMode) -> float:
    counts = counter.get_flop_counts().get("Global", {})
    return float(sum(v for op, v in counts.items() if op in _ATTENTION_OPS))


# --------------------------------------------------------------------------------------------
# Fake execution


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fake_like(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """An empty tensor with t's shape (cast to dtype when t is floating point) on the default device:
    a fake cpu tensor under FakeTensorMode, a meta tensor in a meta run ([Note: meta or fake])."""
    target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
    return torch.empty(tuple(t.shape), dtype=target)


class _LazyFakes(dict):
    """Fake parameters and buffers by name, each made on first use.

    A 96-layer model has about a thousand parameters, but identical layers are run once
    (`_run_fake`) and measured once (`profile_traced`), so most fakes would never be read; making
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

    def __missing__(self, name: str) -> torch.Tensor:
        if name in self.alias:
            value = self[self.alias[name]]
        else:
            original, is_param = self.sources[name]  # KeyError for a name that is neither
            with self.mode:
                if is_param:
                    value = _fake_like(original, self.dtype).requires_grad_(original.requires_grad)
                else:
                    value = _fake_like(original, self.dtype if original.is_floating_point() else None)
        self[name] = value
        return value

    def nbytes(self, name: str) -> int:
        """Bytes of the fake for `name`, without making it."""
        original, _ = self.sources[name]
        target = self.dtype if (self.dtype is not None and original.is_floating_point()) else original.dtype
        return original.numel() * target.itemsize


@dataclass
class _FakeRun:
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


def _run_fake(traced: TracedModel, example_inputs: Sequence[Any], dtype: torch.dtype | None) -> _FakeRun:
    gm = traced.gm
    on_meta = traced.tracer != "export" and all(t.device.type == "meta" for t in [*gm.parameters(), *gm.buffers()])
    if on_meta:
        try:
            return _run_in(_MetaMode(), traced, example_inputs, dtype, meta=True)
        except ProfileError:
            pass
    return _run_in(FakeTensorMode(allow_non_fake_inputs=False), traced, example_inputs, dtype, meta=False)


def _run_in(mode: Any, traced: TracedModel, example_inputs: Sequence[Any], dtype: torch.dtype | None, *,
            meta: bool) -> _FakeRun:
    gm = traced.gm
    params = _LazyFakes(mode, gm, dtype)
    owner = params.owner
    with mode:
        inputs = [_fake_like(x, dtype) if isinstance(x, torch.Tensor) else x for x in example_inputs]

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
    return _FakeRun(mode, params, values, owner, meta)


def fake_output(traced: TracedModel, example_inputs: Sequence[Any], dtype: torch.dtype | None = None) -> Any:
    """What the traced graph returns for `example_inputs` (fake tensors: shapes and dtypes only)."""
    run = _run_fake(traced, example_inputs, dtype)
    output = next(n for n in traced.gm.graph.nodes if n.op == "output")
    return run.values[output.name]


def _tensors_in(value: Any) -> list[torch.Tensor] | None:
    """Tensors in a value, or None when it holds something that is not a tensor."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        out: list[torch.Tensor] = []
        for v in value:
            inner = _tensors_in(v)
            if inner is None:
                return None
            out += inner
        return out
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------
# Cuts


def _cut_candidates(traced: TracedModel, run: _FakeRun) -> list[CutCandidate]:
    cuts = []
    for index in range(traced.num_blocks - 1):
        tensors: list[CrossingTensor] = []
        reason = ""
        for node in crossing_values(traced, index):
            value = run.values.get(node.name)
            found = _tensors_in(value)
            if found is None:
                reason = f"'{node.name}' ({type(value).__name__}) crosses the cut and is not a tensor"
                continue
            for i, t in enumerate(found):
                name = node.name if len(found) == 1 else f"{node.name}[{i}]"
                tensors.append(CrossingTensor(name, tuple(t.shape), _dtype_name(t.dtype), _nbytes(t)))
        cuts.append(CutCandidate(index, tuple(tensors), legal=not reason, reason=reason))
    return cuts


# --------------------------------------------------------------------------------------------
# One block


@dataclass(frozen=True)
class _BlockCost:
    fwd_flops: float
    bwd_flops: float
    saved_bytes: int
    saved_bytes_hidden: int
    attention_fwd_flops: float
    attention_bwd_flops: float
    fwd_calls: list[Call]
    bwd_calls: list[Call]


def _block_fingerprint(traced: TracedModel, index: int, sub: fx.GraphModule, inputs: list[Any]) -> str:
    """Structure + parameter shapes + input shapes, with the block's own path abstracted away."""
    prefix = traced.block_names[index]
    position: dict[str, int] = {}
    parts: list[str] = []

    def norm(arg: Any) -> Any:
        return fx.node.map_arg(arg, lambda n: f"%{position.get(n.name, n.name)}")

    for i, node in enumerate(sub.graph.nodes):
        position[node.name] = i
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        target = "input" if node.op == "placeholder" else str(target).replace(prefix, "@")
        parts.append(f"{node.op}|{target}|{norm(node.args)}|{norm(node.kwargs)}")
    for name, p in sub.named_parameters():
        parts.append(f"{name.replace(prefix, '@')}:{tuple(p.shape)}:{p.dtype}")
    for name, m in sub.named_modules():
        if name.startswith(prefix):
            parts.append(type(m).__name__)
    for value in inputs:
        found = _tensors_in(value) or []
        parts.append(str([(tuple(t.shape), t.dtype) for t in found]))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def _block_params(sub: fx.GraphModule, run: _FakeRun) -> dict[str, torch.Tensor]:
    names = [n for n, _ in sub.named_parameters(remove_duplicate=False)] + [n for n, _ in sub.named_buffers()]
    return {n: run.params[n] for n in names}


def _record_calls(sub: fx.GraphModule, inputs: list[Any], params: dict[str, torch.Tensor], hidden: int | None,
                  run: _FakeRun) -> tuple[list[Call], list[Call]]:
    """The operators of one forward and backward with the GPU's fused kernels ([Note: operators as
    a GPU runs them] in graph/operators.py)."""
    formulas = custom_flop_formulas()
    fwd_recorder = OperatorRecorder(list(params.values()), hidden, formulas)
    bwd_recorder = OperatorRecorder(list(params.values()), hidden, formulas)
    with run.mode:
        leaves = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                  for x in inputs]
        with GpuKernels((fwd_recorder, bwd_recorder)), fwd_recorder:
            outputs = torch.func.functional_call(sub, params, tuple(leaves), strict=False)
        outs = [o for o in (_tensors_in(outputs) or []) if o.requires_grad]
        if outs:
            seeds = [torch.ones_like(o) for o in outs]
            with bwd_recorder:
                torch.autograd.backward(outs, seeds)
    return fwd_recorder.calls, bwd_recorder.calls


def _measure_block(sub: fx.GraphModule, inputs: list[Any], params: dict[str, torch.Tensor], hidden: int | None,
                   run: _FakeRun) -> _BlockCost:
    """Forward and backward of one block on fake tensors, counting FLOPs and saved bytes."""
    param_storages = {p.untyped_storage()._cdata for p in params.values()}
    saved: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in param_storages and key not in saved:
            hidden_shaped = hidden is not None and t.dim() >= 2 and t.shape[-1] == hidden
            saved[key] = (storage.nbytes(), hidden_shaped)
        return t

    formulas = custom_flop_formulas()
    fwd_recorder = OperatorRecorder(list(params.values()), hidden, formulas)
    bwd_recorder = OperatorRecorder(list(params.values()), hidden, formulas)
    fused = GpuKernels()
    with run.mode:
        leaf_inputs = [
            x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in inputs
        ]
        with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flop_counter() as fwd_counter,
              fwd_recorder, fused):
            outputs = torch.func.functional_call(sub, params, tuple(leaf_inputs), strict=False)
        outs = [o for o in (_tensors_in(outputs) or []) if o.requires_grad]
        bwd_flops = attention_bwd = 0.0
        if outs:
            seeds = [torch.ones_like(o) for o in outs]  # the incoming gradient, not the block's work
            with flop_counter() as bwd_counter, bwd_recorder:
                torch.autograd.backward(outs, seeds)
            bwd_flops = float(bwd_counter.get_total_flops())
            attention_bwd = _attention_flops(bwd_counter)
    calls = (fwd_recorder.calls, bwd_recorder.calls)
    if fused.seen:  # recorded again as a GPU runs it ([Note: operators as a GPU runs them], operators.py)
        calls = _record_calls(sub, inputs, params, hidden, run)
    return _BlockCost(
        fwd_flops=float(fwd_counter.get_total_flops()),
        bwd_flops=bwd_flops,
        saved_bytes=sum(b for b, _ in saved.values()),
        saved_bytes_hidden=sum(b for b, h in saved.values() if h),
        attention_fwd_flops=_attention_flops(fwd_counter),
        attention_bwd_flops=attention_bwd,
        fwd_calls=calls[0],
        bwd_calls=calls[1],
    )


def _unpriced(exc: UnpricedOperator, sub: fx.GraphModule) -> str:
    """One line for a higher-order operator in the model ([Note: higher-order operators] in
    graph/operators.py): what it calls, where, and how to write it with ordinary operators. The
    line is the traceback's (a leaf module run by the profile), else the graph node's (export traces
    the operator into the graph; fx cannot trace it)."""
    node = next((n for n in sub.graph.nodes
                 if isinstance(n.target, torch._ops.HigherOrderOperator) and n.target.name() == exc.name), None)
    where = model_line(exc, node.meta.get("stack_trace") if node is not None else None)
    if exc.name == "cond":
        return (f"the model calls torch.cond {where}, which planning cannot price (the branch taken depends on a "
                "value, and torch cannot trace a cond's backward on fake tensors); compute both branches and pick "
                "with torch.where(pred, a, b), or choose the branch with a Python flag set when the model is built")
    return (f"the model calls the higher-order operator torch.ops.higher_order.{exc.name} {where}, which planning "
            "cannot price (it runs graphs of its own); write it with ordinary tensor operations (a Python loop for "
            "while_loop, scan or map; F.scaled_dot_product_attention for flex_attention)")


def _block_ops(sub: fx.GraphModule, cost: _BlockCost, doubled_inputs: list[Any] | None, hidden: int | None,
               doubled: _FakeRun | None, dtype: torch.dtype | None) -> tuple:
    """The block's operators (graph/operators.py), with batch axes learned from a pass at 2b."""
    twice = None
    if doubled is not None and doubled_inputs is not None:
        with doubled.mode:
            fakes = [_fake_like(x, dtype) if isinstance(x, torch.Tensor) and not doubled.owns(x) else x
                     for x in doubled_inputs]
        try:
            twice = _measure_block(sub, fakes, _block_params(sub, doubled), hidden, doubled)
        except Exception:  # a block that rejects the doubled batch keeps the shape-based guess
            twice = None
    return (merge_batches(cost.fwd_calls, twice.fwd_calls if twice else None, "fwd")
            + merge_batches(cost.bwd_calls, twice.bwd_calls if twice else None, "bwd"))


def block_kind(traced: TracedModel, index: int, sub: fx.GraphModule) -> str:
    """Classify a block by its position, its modules' classes and (for export graphs, which have no
    submodules) the ATen ops it calls."""
    name = traced.block_names[index].lower()
    leaf_name = name.rsplit(".", 1)[-1]
    module_types = [type(m).__name__.lower() for _, m in sub.named_modules()]
    op_names = [str(getattr(n.target, "__name__", n.target)).lower() for n in sub.graph.nodes if n.op == "call_function"]
    words = module_types + op_names

    def has(*keys: str) -> bool:
        return any(k in w for w in words for k in keys)

    if any(k in leaf_name for k in ("attn", "attention")):
        return "attention"
    if any(k in leaf_name for k in ("mlp", "ffn", "feed_forward", "feedforward")):
        return "mlp"
    containers = traced.layer_containers or ([traced.layer_container] if traced.layer_container is not None else [])
    if any(name.startswith(c.lower() + ".") for c in containers):
        return "layer"
    if index == 0:
        return "embedding"
    if has("linear", "addmm", "matmul", "mm") and (index == traced.num_blocks - 1 or "head" in leaf_name):
        return "head"
    if has("norm") or "norm" in leaf_name or leaf_name.startswith("ln"):
        return "norm"
    return "other"


def _tp_allreduces(kind: str) -> int:
    """Activation all-reduces per forward under Megatron tensor parallelism (Shoeybi et al. 2019,
    Sec. 3: one after the attention block's row-parallel output projection, one after the MLP's;
    the vocab-parallel embedding needs one; the vocab-parallel head needs one on its input
    gradient in backward, counted here as one)."""
    return {"layer": 2, "attention": 1, "mlp": 1, "embedding": 1, "head": 1}.get(kind, 0)


# --------------------------------------------------------------------------------------------
# Timing on a real device


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu} x{torch.get_num_threads()} threads"


def timing_dtype(device: str, dtype: torch.dtype | None) -> tuple[torch.dtype | None, str | None]:
    """The dtype blocks are timed in on `device`, and why it differs from `dtype` when it does.

    A CPU without bf16/fp16 matrix instructions (AVX512-BF16, AMX) runs those GEMMs through a
    conversion path: on a 2-core AVX2 EPYC a 1024 x 3072 x 768 bf16 input-gradient GEMM took 6.5 s against
    0.029 s in fp32 (`benchmarks/cpu_half_precision.py`), so a gpt2-small layer took minutes to
    time and its seconds described the emulation, not the model. There the blocks are timed in
    fp32, which the CPU runs natively; FLOPs, bytes and memory stay in the requested dtype."""
    if not device.startswith("cpu") or dtype not in (torch.bfloat16, torch.float16):
        return dtype, None
    native = (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
              if dtype == torch.bfloat16 else torch.cpu._is_amx_fp16_supported())
    if native:
        return dtype, None
    name = _dtype_name(dtype)
    return torch.float32, (f"timed in fp32: this CPU has no {name} matrix instructions (AVX512-BF16 or AMX), so "
                           f"{name} GEMMs would time a slow conversion path; FLOPs, bytes and memory are {name}")


def _real_like(value: Any, device: str, generator: torch.Generator) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_real_like(v, device, generator) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return torch.randn(tuple(value.shape), dtype=value.dtype, generator=generator).to(device)
    # Index tensors (token ids, targets): zeros are valid for every embedding and loss.
    return torch.zeros(tuple(value.shape), dtype=value.dtype, device=device)


def _materialize_block(sub: fx.GraphModule, device: str, dtype: torch.dtype | None, generator: torch.Generator) -> None:
    """Give a block real random weights on `device` (values do not matter for timing)."""
    with torch.no_grad():
        for module in sub.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                data = torch.randn(tuple(p.shape), generator=generator) * 0.02
                target = dtype if dtype is not None else (p.dtype if p.is_floating_point() else torch.float32)
                setattr(module, name, nn.Parameter(data.to(device=device, dtype=target)))
            for name, b in list(module.named_buffers(recurse=False)):
                if b.device.type == "meta":
                    data = torch.randn(tuple(b.shape), generator=generator) if b.is_floating_point() else torch.zeros(
                        tuple(b.shape), dtype=b.dtype)
                    module.register_buffer(name, data.to(device), persistent=False)
                elif b.is_floating_point() and dtype is not None:
                    module.register_buffer(name, b.to(device=device, dtype=dtype), persistent=False)
                else:
                    module.register_buffer(name, b.to(device), persistent=False)


def _time_fn(fn: Callable[[], Any], device: str, warmup: int, repeats: int,
             spreads: list[float] | None = None) -> float:
    """Median seconds of `fn`; its spread ((max - min) / median of the rounds or samples) goes to
    `spreads`, which the profile reports (`extra["timing_spread"]`)."""
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        # Back to back, as the executor launches blocks: the CPU's kernel launches overlap the
        # GPU's work. Events around `repeats` calls (as Triton's do_bench does), median of three
        # rounds; a sync after every call would add the launch latency of small blocks, which a
        # running pipeline hides (measured on an H100: 1.3b-size layers' backward read 25% slow).
        rounds = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(end) / 1e3 / repeats)
        return _median_noting_spread(rounds, spreads)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return _median_noting_spread(samples, spreads)


def _median_noting_spread(samples: list[float], spreads: list[float] | None) -> float:
    median = statistics.median(samples)
    if spreads is not None and median > 0:
        spreads.append((max(samples) - min(samples)) / median)
    return median


def last_level_cache_bytes(device: str) -> int:
    """Size of the device's last-level cache: the CPU's highest cache level from sysfs (Linux), a
    GPU's L2 from its properties; 32 MiB when unknown."""
    fallback = 32 * 2**20
    if device.startswith("cuda"):
        try:
            return int(torch.cuda.get_device_properties(torch.device(device)).L2_cache_size) or fallback
        except (RuntimeError, AttributeError, AssertionError):
            return fallback
    best = 0
    units = {"K": 2**10, "M": 2**20, "G": 2**30}  # sysfs writes sizes like "32768K"
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        number = int(size[:-1]) * units[size[-1]] if size[-1:] in units else int(size or 0)
        if level >= 3 and number > best:
            best = number
    return best or fallback


def chain_length(block_weight_bytes: int, occurrences: int, cache_bytes: int) -> int:
    """How many copies of a repeated block to time back to back (see [Note: timing in context])."""
    needed = -(-2 * cache_bytes // max(block_weight_bytes, 1))  # ceil(2 x LLC / weights)
    return int(max(1, min(occurrences, needed, _MAX_CHAIN)))


# [Note: timing in context]
# A block timed alone, call after call, keeps its weights in the last-level cache; inside a stage
# its neighbours evict them, so every micro-batch reads them from memory again. On this 2-core
# machine one h = 256 gpt layer (3 MB) took 8.2 ms warm and 11.5 ms flushed, while the 262 MB head
# took the same either way (`benchmarks/cache_effect_cpu.py`): isolated timing made the head look
# 1.4x heavier in layers than it runs, and the cutting put too few layers beside it. So a block
# that repeats is timed as a run of distinct copies, as a stage runs it: all forwards, then the
# backwards in reverse order, seconds divided by the copies. The run is as long as the repeats,
# up to the copies whose weights fill twice the last-level cache (twice, because adaptive
# replacement policies keep part of a working set only just larger than the cache). A model whose
# repeated blocks fit in cache all together is therefore timed warm, as it runs.
_MAX_CHAIN = 256
_TIMING_METHOD = "chain-affine-v1"  # in the timed cache key: a new method re-times
_CACHED_FIELDS = f"ops-v{RECORDER_VERSION}-tp2"  # in both cache keys: profiles cached before a field existed are redone (tp2: fused_qkv)


# [Note: batch scaling]
# The cost model scales a profile to each micro-batch size. Linear scaling (DESIGN.md) holds for
# compute-bound blocks, not for a block whose weights dominate its traffic: a 256k-vocabulary
# embedding's backward writes its dense 262 MB weight gradient whatever the batch (186 ms at batch 1
# and 188 ms at batch 2 on this 2-core machine, one thread), so linear scaling counted it twice at
# micro-batch 2. Timed profiles therefore time each block at the profile's batch b and at 2b and fit
# t(b) = fixed + per_sample * b (the roofline's two terms, Williams et al. 2009: weight bytes are paid
# once per call, activation work per sample). A model that rejects a doubled batch keeps linear
# scaling, and the profile says so in `extra["batch_scaling"]`.


def _run_doubled(traced: TracedModel, example_inputs: Sequence[Any], dtype: torch.dtype | None,
                 batch_size: int) -> _FakeRun | None:
    """The fake run at twice the batch (inputs whose first dimension is the batch, repeated), or None
    when the traced model rejects it (shapes baked in by torch.export, a batch-bound reshape)."""
    doubled = [torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch_size else x
               for x in example_inputs]
    try:
        return _run_fake(traced, doubled, dtype)
    except ProfileError:
        return None


def _time_block(traced: TracedModel, index: int, inputs: list[Any], device: str, dtype: torch.dtype | None,
                warmup: int, repeats: int, occurrences: int = 1,
                spreads: list[float] | None = None) -> tuple[float, float]:
    """Median forward and backward seconds of block `index` on a real device, run as a chain of up
    to `occurrences` copies ([Note: timing in context])."""
    import copy

    sub, _, _ = extract_submodule(traced, index, index)
    sub = copy.deepcopy(sub) if not any(p.device.type == "meta" for p in sub.parameters()) else sub
    generator = torch.Generator().manual_seed(index)
    _materialize_block(sub, device, dtype, generator)
    weight_bytes = sum(p.numel() * p.element_size() for p in sub.parameters())
    copies = [sub] + [copy.deepcopy(sub) for _ in range(chain_length(weight_bytes, occurrences,
                                                                      last_level_cache_bytes(device)) - 1)]
    real_inputs = [_real_like(x, device, generator) for x in inputs]
    for x in real_inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and dtype is not None and x.dtype != dtype:
            x.data = x.data.to(dtype)

    def leaves() -> list[Any]:
        return [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for x in real_inputs]

    # Gradients are left to accumulate between repeats: in training every micro-batch after the
    # first adds into existing .grad (read, add, write), which costs more than the first write.
    def forward_backward() -> None:
        outs = [o for c in copies for o in (_tensors_in(c(*leaves())) or []) if o.requires_grad]
        if outs:  # autograd runs the copies' backwards newest first, as a stage's backward does
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    # Forward as training runs it (recording autograd); backward = (forward + backward) - forward.
    def forward_autograd() -> Any:
        return [c(*leaves()) for c in copies]

    fwd_s = _time_fn(forward_autograd, device, warmup, repeats, spreads) / len(copies)
    total_s = _time_fn(forward_backward, device, warmup, repeats, spreads) / len(copies)
    return fwd_s, max(total_s - fwd_s, 0.0)


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("AUTOPLAN_CACHE_DIR", Path.home() / ".cache" / "autoplan")) / "profiles"


def _read_cached(path: Path, fingerprint: str, *, timed: bool) -> ModelProfile | None:
    if not path.exists():
        return None
    try:
        cached = ModelProfile.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None  # a stale or damaged cache entry is re-measured and rewritten
    if cached.fingerprint != fingerprint or (timed and not cached.is_timed):
        return None
    if "tensor_parallel" not in cached.extra:  # cached before layouts were recorded
        return None
    return cached


def _tensor_parallel(traced: TracedModel, example_inputs: Sequence[Any]) -> dict[str, Any]:
    """The tensor-parallel layout as the runtime would run this graph (graph/sharding.py), as JSON:
    the counts every tp must divide, whether sequence parallelism applies, why no tp is possible."""
    from autoplan.graph.sharding import traced_layout

    layout = traced_layout(traced, example_inputs)  # what partition runs (runtime/api.py check_model)
    summary = layout.summary()
    # Per block, the share of its parameters the layout shards (1/tp on each rank): 1 for a layer
    # whose attention and MLP are both sharded, about 2/3 for one whose attention stays replicated.
    shares = []
    for paths in traced.block_modules or [[] for _ in traced.block_names]:
        params = {id(p): (p.numel(), owner in layout) for path in paths
                  for owner, m in _named_modules_under(traced.gm, path) for p in m.parameters(recurse=False)}
        total = sum(n for n, _ in params.values())
        shares.append(round(sum(n for n, sharded in params.values() if sharded) / total, 4) if total else 0.0)
    summary["block_sharded_share"] = shares
    return summary


@contextlib.contextmanager
def _recording_expert_inputs(gm: nn.Module) -> Iterator[dict[str, int]]:
    """Bytes of the token groups each grouped-experts module (graph/experts.py) receives in the
    forward run: what expert parallelism's all-to-all sends, per profile batch. Only a call with
    one tensor of leading dimension num_experts counts (tokens grouped by expert); a module with
    stacked expert weights that takes ungrouped tokens (transformers' MixtralExperts, which
    routes inside) records nothing and is not offered expert parallelism."""
    recorded: dict[str, int] = {}
    handles = []
    for path, module in expert_modules(gm).items():
        def record(module, args, path=path):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if len(tensors) == 1 and tensors[0].dim() >= 2 and tensors[0].shape[0] == module.num_experts:
                recorded[path] = recorded.get(path, 0) + _nbytes(tensors[0])
        handles.append(module.register_forward_pre_hook(record))
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def _experts(traced: TracedModel, dispatched: dict[str, int], fingerprints: Sequence[str]) -> dict[str, Any]:
    """`extra["experts"]` for a model whose grouped experts take tokens grouped by expert (else
    nothing): per block, the parameters its experts hold and the bytes of tokens they receive per
    profile batch (sent by one all-to-all to dispatch and one to combine, forward and backward:
    cost/time.py), and the smallest expert count (what the expert-parallel degree must divide).
    The fake run computes a repeated block once, so its copies (same fingerprint) are counted as
    the one that ran."""
    found = expert_modules(traced.gm)
    grouped_types = {type(found[name]) for name in dispatched if name in found}
    found = {name: m for name, m in found.items() if type(m) in grouped_types}
    if not found:
        return {}
    params, sent, counts = [], [], set()
    for paths in traced.block_modules or [[] for _ in traced.block_names]:
        inside = {name: m for path in paths for name, m in _named_modules_under(traced.gm, path) if name in found}
        params.append(sum(p.numel() for m in inside.values() for p in m.parameters(recurse=False)))
        sent.append(sum(dispatched.get(name, 0) for name in inside))
        counts.update(m.num_experts for m in inside.values())
    if not any(params):
        return {}
    by_fingerprint = {fp: n for fp, n in zip(fingerprints, sent) if n}
    sent = [n or by_fingerprint.get(fp, 0) for fp, n in zip(fingerprints, sent)]
    return {"experts": {"num_experts": min(counts), "block_params": params, "block_dispatch_bytes": sent}}


def _named_modules_under(gm: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    try:
        module = gm.get_submodule(path)
    except AttributeError:
        return []
    return [(f"{path}.{name}" if name else path, m) for name, m in module.named_modules()]


def _write_cached(path: Path, profile: ModelProfile) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # one writer per file name; replace is atomic
        tmp.write_text(profile.to_json(indent=None))  # json's C encoder runs only without indent: 5x faster
        tmp.replace(path)
    except OSError:
        pass  # a read-only or full cache directory costs the next run a re-profile, nothing else


def _source_digest(paths: set[str]) -> str | None:
    h = hashlib.sha1()
    for path in sorted(paths):
        try:
            h.update(path.encode() + b"\0" + Path(path).read_bytes())
        except OSError:
            return None
    return h.hexdigest()


def _code_files(traced: TracedModel) -> set[str] | None:
    """Source files whose code decides what the traced graph computes, besides torch itself (whose
    version is in the key): autoplan's graph package (the profiler, the tracer, the zoo) and the
    file of every module class and called function outside torch. None when some code has no file
    (defined in a REPL or generated): then the profile is not cached, since an edit could not be seen."""
    import sys

    files = {str(Path(__file__).resolve().parent / name) for name in ("profile.py", "trace.py", "blocks.py")}
    objects: list[Any] = [type(m) for m in {type(m): m for m in traced.gm.modules()}.values()]
    objects += [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    for obj in objects:
        module_name = getattr(obj, "__module__", None) or ""
        if module_name == "torch" or module_name.startswith(("torch.", "_operator", "operator", "builtins")):
            continue
        if type(obj).__name__ == "OpOverload" or isinstance(obj, type) and issubclass(obj, fx.GraphModule):
            continue
        module = sys.modules.get(module_name)
        path = getattr(module, "__file__", None)
        if not path:
            return None
        files.add(path)
    return files


def _analytic_key(traced: TracedModel, example_inputs: Sequence[Any], *, model_name: str, fingerprint: str,
                  dtype: torch.dtype | None, info: dict[str, int | None], batch_size: int | None,
                  seq_len: int | None) -> str | None:
    """Cache key of an analytic (fake-tensor) profile, or None when it cannot be cached safely.

    The result depends on the graph (its code, blocks and the parameter shapes in the model
    fingerprint), the code it calls (`_code_files`), the input shapes and dtypes, the dtype, the
    config numbers in `info`, torch (kernel choice, FLOP formulas) and autoplan."""
    from autoplan._version import __version__

    files = _code_files(traced)
    digest = _source_digest(files) if files is not None else None
    if digest is None:
        return None
    inputs = [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
    parts = ["analytic", fingerprint, model_name, traced.tracer, traced.note, traced.block_names, traced.gm.code,
             inputs, str(dtype), sorted((k, v) for k, v in info.items()), batch_size, seq_len, torch.__version__,
             __version__, digest, _CACHED_FIELDS]
    return hashlib.sha1(json.dumps(parts, default=str).encode()).hexdigest()[:20]


# --------------------------------------------------------------------------------------------
# Entry points


def config_info(model: nn.Module) -> dict[str, int | None]:
    """Heads, hidden size, ... from a zoo model's or a transformers model's config, if any."""
    config = getattr(model, "config", None)
    info: dict[str, int | None] = {}
    for key, names in {
        "num_heads": ("num_heads", "num_attention_heads", "n_head"),
        "num_kv_heads": ("num_kv_heads", "num_key_value_heads"),
        "hidden_size": ("hidden_size", "n_embd"),
        "vocab_size": ("vocab_size",),
        "num_layers": ("num_layers", "num_hidden_layers", "n_layer"),
    }.items():
        for n in names:
            value = getattr(config, n, None) if config is not None else None
            if isinstance(value, int):
                info[key] = value
                break
    return info


def model_fingerprint(model: nn.Module) -> str:
    """Hash of a model's structure: its class and every parameter's and buffer's name and shape.

    Batch size, sequence length and dtype are not in it: a plan made for one micro-batch size
    still names the same model, and the runtime checks a plan against the model it builds.
    """
    h = hashlib.sha1()
    h.update(type(model).__qualname__.encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}".encode())
    for name, b in model.named_buffers():
        h.update(f"{name}:{tuple(b.shape)}".encode())
    return h.hexdigest()[:16]


def _check_device(device: str) -> None:
    if device not in ("meta", "cpu") and not device.startswith("cuda"):
        raise ProfileError(f"unknown device '{device}'; use meta, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ProfileError("--device cuda was asked for but torch sees no CUDA device; use --device meta or cpu")


def profile_traced(
    traced: TracedModel,
    example_inputs: Sequence[Any],
    *,
    model_name: str,
    fingerprint: str,
    dtype: torch.dtype | None = torch.bfloat16,
    device: str = "meta",
    info: dict[str, int | None] | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    warmup: int = 2,
    repeats: int = 5,
    cache_dir: str | os.PathLike | None = None,
    progress: Progress | None = None,
) -> ModelProfile:
    """Profile a traced model (see the module docstring). `dtype=None` keeps the model's dtypes."""
    _check_device(device)
    info = dict(info or {})
    analytic_file = None
    if device == "meta":
        key = _analytic_key(traced, example_inputs, model_name=model_name, fingerprint=fingerprint, dtype=dtype,
                            info=info, batch_size=batch_size, seq_len=seq_len)
        if key is not None:
            analytic_file = _cache_dir(cache_dir) / f"analytic-{key}.json"
            cached = _read_cached(analytic_file, fingerprint, timed=False)
            if cached is not None:
                if progress is not None:
                    progress(traced.num_blocks, traced.num_blocks, traced.block_names[-1])
                return cached
    with _recording_expert_inputs(traced.gm) as dispatched:
        run = _run_fake(traced, example_inputs, dtype)
    cuts = _cut_candidates(traced, run)
    first_input = next((x for x in example_inputs if isinstance(x, torch.Tensor)), None)
    if batch_size is None:
        batch_size = int(first_input.shape[0]) if first_input is not None and first_input.dim() >= 1 else 1
    if seq_len is None:
        seq_len = int(first_input.shape[1]) if first_input is not None and first_input.dim() >= 2 else 1

    # Hidden size: from the config, else the last dim of the first layer block's output.
    hidden = info.get("hidden_size")
    if hidden is None and cuts and cuts[0].tensors:
        hidden = cuts[0].tensors[-1].shape[-1] if cuts[0].tensors[-1].shape else None
        info["hidden_size"] = hidden

    cache_file = None
    timed: dict[str, tuple[float, float]] = {}
    timed_dtype, timed_dtype_note = timing_dtype(device, dtype)
    if device != "meta":
        device_name = _device_name(device)
        key = hashlib.sha1(
            json.dumps([fingerprint, traced.block_names, device_name, batch_size, seq_len, str(dtype), str(timed_dtype),
                        torch.__version__, _TIMING_METHOD, _CACHED_FIELDS]).encode()
        ).hexdigest()[:20]
        cache_file = _cache_dir(cache_dir) / f"{key}.json"
        cached = _read_cached(cache_file, fingerprint, timed=True)
        if cached is not None:
            return cached

    # The same model at twice the batch, on fake tensors: which operator dimensions grow with the
    # batch ([Note: batch scaling]; graph/operators.py, `merge_batches`).
    doubled = _run_doubled(traced, example_inputs, dtype, batch_size)
    ops: dict[str, tuple] = {}
    costs: dict[str, _BlockCost] = {}
    to_time: dict[str, tuple[int, list[str], list[Any]]] = {}  # fingerprint -> first block, its input names, inputs
    occurrences: dict[str, int] = {}
    seen_params: set[str] = set()
    owner_block: dict[str, int] = {}  # a parameter's first name -> the block that owns it
    blocks: list[Block] = []
    for index in range(traced.num_blocks):
        sub, input_names, output_names = extract_submodule(traced, index, index, defer_code=True)
        inputs = [run.values[n] for n in input_names]
        fake_inputs = []
        with run.mode:
            for x in inputs:
                fake_inputs.append(_fake_like(x, dtype) if isinstance(x, torch.Tensor) and not run.owns(x) else x)
        fp = _block_fingerprint(traced, index, sub, fake_inputs)
        if fp not in costs:
            try:
                costs[fp] = _measure_block(sub, fake_inputs, _block_params(sub, run), hidden, run)
            except UnpricedOperator as exc:
                if os.environ.get("AUTOPLAN_DEBUG"):
                    raise
                # torch.cond runs through dynamo, which marks the wrapper it was compiling when the
                # refusal interrupted it as skipped: a later export of a cond in this process would fail.
                if "torch._dynamo" in sys.modules:
                    torch._dynamo.reset()
                raise ProfileError(_unpriced(exc, sub)) from None
            ops[fp] = _block_ops(sub, costs[fp], [doubled.values[n] for n in input_names] if doubled else None,
                                 hidden, doubled, dtype)
            if device != "meta":
                to_time[fp] = (index, input_names, fake_inputs)
        occurrences[fp] = occurrences.get(fp, 0) + 1
        cost = costs[fp]

        num_params = 0
        param_bytes = 0
        tied_params = 0
        tied_to: int | None = None
        for name, p in sub.named_parameters(remove_duplicate=True):
            param_bytes += run.params.nbytes(name)
            first = run.params.alias.get(name, name)  # tied parameters share one identity
            if first not in seen_params:
                seen_params.add(first)
                owner_block[first] = index
                num_params += p.numel()
            elif owner_block[first] != index:  # a copy of an earlier block's parameter (a tied head)
                tied_params += p.numel()
                tied_to = owner_block[first] if tied_to is None else tied_to
        kind = block_kind(traced, index, sub)
        if index < len(cuts):
            output_bytes = cuts[index].num_bytes
        else:
            output_bytes = sum(_nbytes(t) for n in output_names for t in (_tensors_in(run.values.get(n)) or []))
        hidden_bytes = batch_size * seq_len * (hidden or 0) * (torch.tensor([], dtype=dtype or torch.float32).element_size())
        blocks.append(Block(
            name=traced.block_names[index],
            kind=kind,
            fwd_flops=cost.fwd_flops,
            bwd_flops=cost.bwd_flops,
            num_params=num_params,
            param_bytes=param_bytes,
            output_bytes=output_bytes,
            saved_bytes=cost.saved_bytes,
            saved_bytes_replicated_tp=cost.saved_bytes_hidden,
            tp_comm_bytes=_tp_allreduces(kind) * hidden_bytes,
            attention_core_fwd_flops=cost.attention_fwd_flops,
            attention_core_bwd_flops=cost.attention_bwd_flops,
            # Flash attention keeps no s x s tensor, so selective recompute frees only its
            # output and log-sum-exp, which the next projection keeps anyway: we count none.
            attention_core_saved_bytes=0,
            fingerprint=fp,
            tied_params=tied_params,
            tied_to_block=tied_to,
            ops=ops[fp],
        ))
        if progress is not None:
            progress(index + 1, traced.num_blocks + len(to_time), traced.block_names[index])
    # Timed after the pass over all blocks, which counts how often each one repeats.
    fixed: dict[str, tuple[float, float]] = {}
    spreads: list[float] = []  # of every timing at the profile's batch: how far its repeats disagree
    for done, (fp, (index, input_names, fake_inputs)) in enumerate(to_time.items()):
        if progress is not None:
            progress(traced.num_blocks + done, traced.num_blocks + len(to_time), f"timing {traced.block_names[index]}")
        timed[fp] = _time_block(traced, index, fake_inputs, device, timed_dtype, warmup, repeats, occurrences[fp],
                                spreads)
        if doubled is not None:
            twice = _time_block(traced, index, [doubled.values[n] for n in input_names], device, timed_dtype, warmup,
                                repeats, occurrences[fp])
            # t(b) = fixed + per_sample * b, from b and 2b: fixed = 2 t(b) - t(2b), kept in [0, t(b)].
            fixed[fp] = tuple(min(max(2 * t1 - t2, 0.0), t1) for t1, t2 in zip(timed[fp], twice))
    if timed:
        blocks = [dataclasses.replace(b, fwd_time_s=timed[b.fingerprint][0], bwd_time_s=timed[b.fingerprint][1],
                                      fwd_time_fixed_s=fixed.get(b.fingerprint, (0.0, 0.0))[0],
                                      bwd_time_fixed_s=fixed.get(b.fingerprint, (0.0, 0.0))[1])
                  for b in blocks]
        if progress is not None:
            progress(traced.num_blocks + len(to_time), traced.num_blocks + len(to_time), "timed")

    profile = ModelProfile(
        model_name=model_name,
        fingerprint=fingerprint,
        blocks=tuple(blocks),
        cuts=tuple(cuts),
        batch_size=batch_size,
        seq_len=seq_len,
        dtype=_dtype_name(dtype) if dtype is not None else "mixed",
        tracer=traced.tracer,
        device=device if device == "meta" else _device_name(device),
        num_heads=info.get("num_heads"),
        num_kv_heads=info.get("num_kv_heads"),
        hidden_size=info.get("hidden_size"),
        vocab_size=info.get("vocab_size"),
        num_layers=info.get("num_layers"),
        torch_version=torch.__version__,
        extra={"tracer_note": traced.note, "tensor_parallel": _tensor_parallel(traced, example_inputs),
               **_experts(traced, dispatched, [b.fingerprint for b in blocks]),
               **({"threads": torch.get_num_threads()} if device == "cpu" else {}),
               **({"batch_scaling": "affine" if fixed else "linear (the model rejects a doubled batch)",
                   "timing_spread": {"median": round(statistics.median(spreads), 4) if spreads else None,
                                     "max": round(max(spreads), 4) if spreads else None,
                                     "of": "(max - min) / median of each block's repeats"}}
                  if timed else {}),
               **({"timing_dtype_note": timed_dtype_note} if timed and timed_dtype_note else {})},
    )
    for path in (cache_file, analytic_file):
        if path is not None:
            _write_cached(path, profile)
    return profile


def profile_model(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_target: torch.Tensor | None = None,
    model_name: str | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    device: str = "meta",
    leaf_modules: Sequence[str] = (),
    tracer: str = "auto",
    info: dict[str, int | None] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    cache_dir: str | os.PathLike | None = None,
    progress: Progress | None = None,
) -> tuple[ModelProfile, TracedModel]:
    """Trace and profile `model` on `example_inputs` (meta, cpu or cuda tensors alike).

    With `loss_fn` and `example_target`, the loss is appended to the graph (in the last block), so
    its FLOPs and saved tensors (e.g. the fp32 log-softmax of a large vocabulary) are counted.
    """
    _check_device(device)
    traced, inputs = trace_with_loss(model, example_inputs, loss_fn=loss_fn, example_target=example_target,
                                     leaf_modules=leaf_modules, tracer=tracer)
    merged = config_info(model)
    merged.update({k: v for k, v in (info or {}).items() if v is not None})
    fingerprint = model_fingerprint(model)
    profile = profile_traced(
        traced, inputs, model_name=model_name or type(model).__name__, fingerprint=fingerprint, dtype=dtype,
        device=device, info=merged, warmup=warmup, repeats=repeats, cache_dir=cache_dir, progress=progress,
    )
    extra = {**profile.extra, "context_parallel": context_parallel_support(model, profile)}
    return dataclasses.replace(profile, extra=extra), traced


def context_parallel_support(model: nn.Module, profile: ModelProfile) -> dict[str, Any]:
    """Whether the runtime can split this model's sequences over ranks (runtime/context.py), and
    why not: the model must read its positions from `sequence_positions()` (graph/positions.py),
    compute attention with `scaled_dot_product_attention` (which the runtime intercepts; the
    profile lists it as a fused attention operator), and hold no per-sequence state across tokens
    other than attention (a mixture of experts' per-sequence capacity and balance loss)."""
    if not getattr(type(model), POSITIONS_ATTRIBUTE, False):
        why = (f"{type(model).__name__} does not read token positions from autoplan's sequence_positions() "
               "(graph/positions.py; the zoo's llama does)")
    elif not any(op.kind == "attention" for b in profile.blocks for op in b.ops):
        why = "it calls no scaled_dot_product_attention, the attention context parallelism intercepts"
    elif profile.extra.get("experts"):
        why = "its experts take a capacity and a balance loss per whole sequence"
    else:
        return {"allowed": True, "note": ""}
    return {"allowed": False, "note": why}
