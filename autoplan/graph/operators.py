"""The operator list of a block: every kernel its forward and backward launch, with shapes and bytes.

`OperatorRecorder` is a dispatch mode that sits above the fake-tensor mode while a block runs (the
profile's `_measure_block`) and writes down each ATen call that reaches a kernel: GEMMs with their
(batch, m, n, k), fused attention with (batch, heads, q_len, kv_len, head_dim) and whether it is
causal, and everything else as bytes read plus written. Views, metadata and allocations launch no
kernel and are skipped. `merge_batches` pairs the calls of two recordings at batch b and 2b to learn
which GEMM axis grows with the batch and which bytes do not (a weight's gradient), and folds equal
calls into one `Op` with a count.

The cost model (cost/ops.py) prices the list; nothing here knows about a GPU.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, shape_wrapper

from autoplan.graph.blocks import Op

__all__ = ["RECORDER_VERSION", "Call", "FusedAttention", "FusedRMSNorm", "GpuKernels", "OperatorRecorder", "UnpricedOperator",
           "merge_batches", "record_as_composite"]

RECORDER_VERSION = 9
"""In the profile cache's key: a change to what is recorded re-profiles (8: the zoo's SwiGLU operator,
[Note: lean SwiGLU] in models/ops.py, recorded as its eager kernels; 9: the zoo's RMSNorm operator,
[Note: lean RMSNorm], recorded as one kernel each way and saving what the fused kernel saves)."""

_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "grouped_mm_fallback", "grouped_mm_fallback_backward"}
# Kernels with no memory traffic worth a time: allocations, metadata, shape queries.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
              "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
              "_unsafe_view", "alias", "set_", "resize_", "_to_copy_meta", "scalar_tensor", "_has_compatible_shallow_copy_type"}


@dataclass(frozen=True)
class Call:
    """One recorded call (before merging)."""

    kind: str
    name: str
    dtype: str
    flops: float
    bytes: float
    shape: tuple[int, ...]
    causal: bool
    touches_param: bool
    hidden_shaped: bool
    weight_dims: tuple[int, ...]
    """gemm: the dims of a parameter-shaped operand or result (the weight's out and in), else ()."""
    expert: bool = False
    """An operator of grouped experts ([Note: expert operators])."""


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# [Note: higher-order operators]
# torch.cond, while_loop, scan, map and flex_attention are higher-order operators: one call that runs
# graphs of its own. None is priced. torch.cond runs one branch chosen by a value, which planning
# (on shapes) never sees; pricing the more expensive branch would be an upper bound, but torch 2.13
# cannot run a cond's backward on fake tensors under a FLOP counter (its joint-graph capture fails
# in aot_autograd) and runs the forward through dynamo, which rejects dispatch modes it meets.
# So the recorder takes every higher-order operator (`supports_higher_order_operators`) only to
# refuse it by name (`UnpricedOperator`), and the profile says in one line where the model calls it
# and how to write it with ordinary operators (graph/block_cost.py, `unpriced`). Before, torch's own
# NotImplementedError ("no rule registered for HigherOrderOperator cond") came out as a traceback.


_COMPOSITES: dict = {}
"""Custom operator -> the Python function of ATen calls its eager kernel runs ([Note: composite operators])."""


def record_as_composite(op, composite) -> None:
    """Record calls of the custom operator `op` as the ATen calls of `composite` (same arguments)."""
    _COMPOSITES[op] = composite


# [Note: composite operators]
# A custom operator (torch.library.custom_op) reaches the recorder as one call, and below it the
# fake mode runs its fake kernel: its own ATen calls are never seen. Where the operator exists to
# change what autograd saves, not to fuse kernels (the zoo's SwiGLU, models/ops.py), a GPU runs
# eagerly the ATen kernels its Python body calls, one launch each: the recorder records those
# (`record_as_composite`), re-entering itself around the body, so the operator list prices what runs.


class UnpricedOperator(RuntimeError):
    """A higher-order operator reached the recorder ([Note: higher-order operators])."""

    def __init__(self, name: str) -> None:
        super().__init__(f"higher-order operator {name} cannot be priced")
        self.name = name


class OperatorRecorder(TorchDispatchMode):
    """Records the calls of whatever runs under it (see the module docstring). Enter it inside the
    fake mode, so that it sees every call first and passes it on."""

    supports_higher_order_operators = True
    """Higher-order operators come to `__torch_dispatch__`, to be refused by name ([Note: higher-order operators])."""

    def __init__(self, params: list[torch.Tensor], hidden: int | None, custom_flops: dict | None = None) -> None:
        super().__init__()
        # A weight reaches a GEMM as a view of its storage (`t()`); its gradient leaves one with its
        # shape (or transposed).
        self.param_storages = {p.untyped_storage()._cdata for p in params}
        self.param_shapes = {tuple(p.shape) for p in params if p.dim() >= 2}
        # Stacked expert weights ([Note: expert operators]): the leading dims of 3-D parameters.
        self.expert_counts = {int(p.shape[0]) for p in params if p.dim() >= 3 and p.shape[0] >= 2}
        self.hidden = hidden
        # FLOP formulas by operator packet: torch's registry and the profile's own (the cpu fused
        # attention, grouped GEMMs), which take shapes like torch's do.
        self.formulas = {**flop_registry, **{k: shape_wrapper(v) for k, v in (custom_flops or {}).items()}}
        self.calls: list[Call] = []
        self.paused = 0
        """While > 0, calls are passed on and not recorded (a fused kernel's composite parts)."""

    def add_fused(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Record one fused memory-bound kernel that reads or writes each of `tensors` once."""
        first = tensors[0]
        hidden = self.hidden is not None and first.dim() >= 2 and first.shape[-1] == self.hidden
        self.calls.append(Call("memory", name, str(first.dtype).removeprefix("torch."), 0.0,
                               float(sum(_nbytes(t) for t in tensors if t is not None)), (), False, False,
                               hidden, ()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            raise UnpricedOperator(func.name())
        kwargs = kwargs or {}
        composite = _COMPOSITES.get(func)
        if composite is not None and not self.paused:
            with self:  # [Note: composite operators]: record the kernels of its body
                return composite(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.paused:
            return out
        try:
            call = self._describe(func, args, kwargs, out)
        except Exception:  # recording is best effort: an odd operator must not break profiling
            call = None
        if call is not None:
            self.calls.append(call)
        return out

    def _describe(self, func, args, kwargs, out) -> Call | None:
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if getattr(func, "is_view", False) or name in _NO_KERNEL or name.startswith("empty"):
            return None
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        if not outputs:
            return None
        if name == "embedding":  # a gather: it reads the rows it writes, not the whole table
            moved = 2.0 * sum(_nbytes(t) for t in outputs) + sum(_nbytes(t) for t in inputs[1:])
            hidden = self.hidden is not None and outputs[0].shape[-1] == self.hidden
            return Call("memory", name, str(outputs[0].dtype).removeprefix("torch."), 0.0, moved, (), False,
                        False, hidden, ())
        floating = [t for t in inputs + outputs if t.is_floating_point()]
        dtype = str((floating or outputs)[0].dtype).removeprefix("torch.")
        moved = _gather_scatter_bytes(name, inputs, outputs)
        if moved is None:
            moved = float(sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs))
        weight_inputs = [t for t in inputs if t.dim() >= 2 and t.untyped_storage()._cdata in self.param_storages]
        weight_outputs = [t for t in outputs if (t.dim() == 2 and (tuple(t.shape) in self.param_shapes
                                                                  or tuple(t.shape)[::-1] in self.param_shapes))
                          or (t.dim() >= 3 and tuple(t.shape) in self.param_shapes)]
        touches_param = bool(weight_inputs or weight_outputs)
        expert = self._is_expert(inputs, outputs)
        hidden_shaped = self.hidden is not None and any(t.dim() >= 2 and t.shape[-1] == self.hidden for t in outputs)
        flops = 0.0
        formula = self.formulas.get(func.overloadpacket)
        if formula is not None:
            flops = float(formula(*args, out_val=out, **kwargs))
        if "attention" in name and flops:
            q, k = inputs[0], inputs[1]
            if "backward" in name:  # (grad_out, query, key, value, ...)
                q, k = inputs[1], inputs[2]
            causal = bool(kwargs.get("is_causal", False)) or any(a is True for a in args if isinstance(a, bool))
            shape = (int(q.shape[0]), int(q.shape[1]), int(q.shape[-2]), int(k.shape[-2]), int(q.shape[-1]))
            return Call("attention", name, dtype, flops, moved, shape, causal, False, False, ())
        if name in _GEMMS or (flops and name in ("convolution", "convolution_backward", "_convolution")):
            shape = _gemm_shape(name, inputs, outputs, flops)
            weights = tuple((weight_inputs or weight_outputs)[0].shape[-2:]) if touches_param else ()
            return Call("gemm", name, dtype, flops, moved, shape, False, touches_param, False, weights, expert)
        if flops:  # a FLOP-counted operator we have no shape model for: priced as a GEMM of its FLOPs
            return Call("gemm", name, dtype, flops, moved, (), False, touches_param, False, (), expert)
        return Call("memory", name, dtype, 0.0, moved, (), False, touches_param, hidden_shaped, (), expert)

    def _is_expert(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
        """Whether a call is one of grouped experts' ([Note: expert operators]): every tensor of two
        or more dims it reads or writes is grouped by expert (leading dim an expert count), and one
        of them has three dims (token groups, stacked weights or their gradients)."""
        if not self.expert_counts:
            return False
        shaped = [t for t in inputs + outputs if t.dim() >= 2]
        return (any(t.dim() >= 3 for t in shaped)
                and all(t.dim() >= 3 and int(t.shape[0]) in self.expert_counts for t in shaped))


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of `t`: an expanded (stride-0) dim counts once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _gather_scatter_bytes(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> float | None:
    """Bytes of the operators whose traffic is not their operands' size, else None:

    - `nll_loss_forward` gathers one log-probability per token (reads the targets and those entries);
    - `nll_loss_backward` writes a zeroed (tokens x vocabulary) gradient and one entry per token;
    - `embedding_dense_backward` accumulates a half-precision table's gradient in fp32 (torch's CUDA
      kernel uses the accumulate type, `acc_type<half>` = float, aten/src/ATen/native/cuda/Embedding.cu):
      zero-fill and write the fp32 table (4 + 4 bytes an element), read it and write the cast (4 + 2),
      plus the incoming gradient;
    - `gather` / `scatter` / `scatter_add` read an index broadcast by `expand` (stride 0: the zoo's
      MoE dispatch and combine expand one slot per token over the hidden dim, an int64 index four
      times the bf16 tokens' size) once from memory, not once per element it stands for: each input
      counts its distinct elements (`_distinct_bytes`).
    """
    if name == "nll_loss_forward":
        return float(sum(_nbytes(t) for t in outputs) + 2 * sum(_nbytes(t) for t in inputs[1:2]))
    if name == "nll_loss_backward":
        return float(2 * sum(_nbytes(t) for t in outputs))
    if name in ("gather", "scatter", "scatter_add", "scatter_reduce") and len(inputs) >= 2:
        return float(sum(_distinct_bytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs))
    if name == "embedding_dense_backward":
        table = outputs[0]
        per_element = 14.0 if table.element_size() == 2 else 2.0 * table.element_size()
        return float(table.numel() * per_element + _nbytes(inputs[0]))
    return None


def _gemm_shape(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], flops: float) -> tuple[int, ...]:
    """(batch, m, n, k) of a GEMM call: m x k times k x n, `batch` of them."""
    out = outputs[0]
    if name in ("mm", "addmm"):
        a = inputs[-2]
        return 1, int(a.shape[0]), int(out.shape[-1]), int(a.shape[1])
    if name in ("bmm", "baddbmm"):
        a = inputs[-2]
        return int(a.shape[0]), int(a.shape[1]), int(out.shape[-1]), int(a.shape[2])
    # Grouped and convolution GEMMs: rows of the output by its last (channel) dim, k from the FLOPs.
    rows = max(1, out.numel() // max(1, int(out.shape[-1] if out.dim() else 1)))
    n = int(out.shape[-1]) if out.dim() else 1
    k = max(1, round(flops / (2 * rows * n))) if flops else 1
    return 1, rows, n, k


def merge_batches(once: list[Call], twice: list[Call] | None, phase: str) -> tuple[Op, ...]:
    """Fold the calls of one pass into Ops with counts. With `twice` (the same pass at double the
    batch, call for call), learn the batch axis of each GEMM and attention call and split a memory
    call's bytes into a part that grows with the batch and a fixed part; without it (or when the two
    passes differ), everything but the weight dims is taken to grow with the batch."""
    paired = _pair_calls(once, twice) if twice is not None else [None] * len(once)
    counts: Counter = Counter()
    for i, call in enumerate(once):
        other = paired[i]
        batch_axis = None
        fixed = 0.0
        per_batch = call.bytes
        if call.kind in ("gemm", "attention") and call.shape:
            if other is not None and other.shape and len(other.shape) == len(call.shape):
                grown = [a for a, (x, y) in enumerate(zip(call.shape, other.shape, strict=True)) if y == 2 * x]
                batch_axis = grown[0] if grown else None
            else:
                batch_axis = 0 if call.kind == "attention" or call.shape[0] > 1 else 1
        if call.kind == "memory" or call.kind == "gemm":
            if other is not None:
                per_batch = max(0.0, other.bytes - call.bytes)
                fixed = max(0.0, call.bytes - per_batch)
            elif call.touches_param:
                per_batch, fixed = 0.0, call.bytes
        tp_axis = _tp_axis(call, batch_axis)
        tp = "hidden" if call.kind == "memory" and call.hidden_shaped and not call.touches_param else "sharded"
        if call.expert and call.kind in ("gemm", "memory"):
            tp, tp_axis = "expert", None
        key = Op(kind=call.kind, phase=phase, name=call.name, dtype=call.dtype, count=1, flops=call.flops,
                 bytes=per_batch, fixed_bytes=fixed, shape=call.shape, batch_axis=batch_axis, tp_axis=tp_axis,
                 tp=tp, causal=call.causal)
        counts[key] += 1
    return tuple(Op(**{**{f: getattr(op, f) for f in Op.__slots__}, "count": n}) for op, n in counts.items())


def _pair_calls(once: list[Call], twice: list[Call]) -> list[Call | None]:
    """For each call of `once`, its counterpart in `twice` (the same pass at double the batch), or
    None. Equal lists pair call for call. A pass that launches other kernels at the larger batch
    (the zoo's MoE dispatch: `transpose(0, 1).reshape(...)` of a (batch, experts, ...) buffer is a
    view at batch 1 and a copy at 2) pairs by aligning the operator names (the longest matching runs,
    difflib's Ratcliff-Obershelp matching); a call left without a counterpart keeps the
    single-recording guess. The extra kernels of the larger batch are not added (the profile's batch
    does not launch them)."""
    if len(twice) == len(once) and all(a.name == b.name for a, b in zip(once, twice, strict=True)):
        return list(twice)
    out: list[Call | None] = [None] * len(once)
    matcher = difflib.SequenceMatcher(a=[c.name for c in once], b=[c.name for c in twice], autojunk=False)
    for block in matcher.get_matching_blocks():
        for j in range(block.size):
            out[block.a + j] = twice[block.b + j]
    return out


def _tp_axis(call: Call, batch_axis: int | None) -> int | None:
    """The axis tensor parallelism divides: attention's heads; a batched GEMM's batch (heads of an
    unfused attention); else the wider of a GEMM's weight dims (Megatron's column split divides a
    layer's output features, the row split its input features, and in a transformer the split one
    is the wider: 3h or 4h against h; Shoeybi et al. 2019, Sec. 3)."""
    if call.kind == "attention":
        return 1
    if call.kind != "gemm" or not call.shape:
        return None
    if call.shape[0] > 1 and batch_axis != 0:
        return 0
    candidates = [a for a in (1, 2, 3) if a != batch_axis]
    if call.weight_dims:
        wide = max(call.weight_dims)
        matching = [a for a in candidates if call.shape[a] == wide]
        if matching:
            return matching[0]
    return max(candidates, key=lambda a: call.shape[a]) if candidates else None


# [Note: expert operators]
# A grouped-experts module (graph/experts.py) stacks its experts' weights with the expert first and
# takes tokens grouped by expert, (experts, tokens, ...). The recorder marks as the experts' every
# GEMM and memory-bound call whose tensors of two or more dims are all grouped by expert (leading dim
# the leading dim of a 3-D parameter) and one of which has three: the grouped GEMMs, their weight
# gradients and the gradients' accumulation, the activation between them. Such an Op has
# `tp = "expert"`: tensor parallelism leaves it whole (the layout shards no expert: autoplan's
# runtime keeps every tp rank's experts whole, cost/memory.py `param_counts`) and expert
# parallelism splits its experts (cost/ops.py `scaled_op`: a GPU holds experts / ep of them and
# computes them for the tokens of its ep group, so the weights' bytes divide by ep and the FLOPs do
# not). The routing around the experts (router, top-k, the scatter into and gather from the token
# groups) works on (batch, tokens, ...) tensors and stays the block's.


# [Note: operators as a GPU runs them]
# The operator list prices a block on a GPU, but it is recorded where the profile runs (CPU dispatch,
# fake or meta tensors). Where the two differ in a way that matters, the recording follows the GPU:
# nn.RMSNorm (F.rms_norm) is one fused kernel forward and one backward on CUDA (torch >= 2.8,
# `_fused_rms_norm`) but eight fp32 operators on the CPU, which priced a llama layer 17-34% slow on an
# H100. Such a block's operators are recorded in a second pass with the fused kernel (graph/block_cost.py,
# `_record_calls`); its FLOPs and saved bytes stay those of the first (the composite form saves more: an upper bound on a GPU, exact
# on a CPU run).


class GpuKernels(torch.overrides.TorchFunctionMode):
    """Notes calls of functions a GPU runs as one fused kernel; with recorders, records each such
    call as that one kernel (`FusedRMSNorm`)."""

    def __init__(self, recorders: tuple[OperatorRecorder, OperatorRecorder] | None = None) -> None:
        super().__init__()
        self.recorders = recorders
        self.seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "_qualified_op_name", None) == "autoplan::rms_norm":
            # The zoo's RMSNorm (models/ops.py [Note: lean RMSNorm]) is already one operator each way:
            # recorded as it is, in the same pass as the blocks whose norms are F.rms_norm's.
            self.seen = True
        elif func is torch.nn.functional.rms_norm:
            self.seen = True
            if self.recorders is not None:
                names = ("input", "normalized_shape", "weight", "eps")
                call = dict(zip(names, args, strict=False)) | kwargs
                return FusedRMSNorm.apply(call["input"], call.get("weight"), tuple(call["normalized_shape"]),
                                           call.get("eps"), self.recorders)
        return func(*args, **kwargs)


class FusedRMSNorm(torch.autograd.Function):
    """F.rms_norm as CUDA's `_fused_rms_norm` runs it: one kernel reading x (and the weight) and
    writing y forward; one reading the gradient, x and the saved 1/rms and writing both gradients
    backward. The values come from the composite form, unrecorded (shapes are all a profile needs)."""

    @staticmethod
    def forward(ctx, x, weight, shape, eps, recorders):
        forward_recorder, backward_recorder = recorders
        forward_recorder.paused += 1
        try:
            y = torch.nn.functional.rms_norm(x, shape, weight, eps)
            rstd = x.new_empty(x.shape[: x.dim() - len(shape)], dtype=torch.float32)
        finally:
            forward_recorder.paused -= 1
        forward_recorder.add_fused("_fused_rms_norm", [x, y, weight, rstd])
        ctx.save_for_backward(x, weight, rstd)
        ctx.backward_recorder = backward_recorder
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        recorder = ctx.backward_recorder
        recorder.paused += 1
        try:
            grad_x = torch.empty_like(x)
            grad_w = torch.empty_like(weight) if weight is not None else None
        finally:
            recorder.paused -= 1
        recorder.add_fused("_fused_rms_norm_backward", [grad, x, rstd, grad_x, weight, grad_w])
        return grad_x, grad_w, None, None, None


class FusedAttention(torch.overrides.TorchFunctionMode):
    """scaled_dot_product_attention as the fused kernel a CPU (and a GPU) runs, also on meta tensors,
    where torch would take its unfused math path ([Note: meta or fake] in graph/fake_run.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and len(args) >= 3:
            q, k, v = args[:3]
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            options = dict(zip(names, (None, 0.0, False, None, False), strict=True))
            options.update(zip(names, args[3:], strict=False))
            options.update(kwargs)
            same_heads = q.dim() == 4 and q.shape[1] == k.shape[1] == v.shape[1]
            grouped = options["enable_gqa"] and q.dim() == 4 and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
            if same_heads or grouped:  # the cpu kernel reads grouped key/value heads itself
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, options["dropout_p"], options["is_causal"], attn_mask=options["attn_mask"],
                    scale=options["scale"])[0]
        return func(*args, **kwargs)
