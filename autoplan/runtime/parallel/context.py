"""Context parallelism: the ranks of a cp group split every sequence and share keys and values.

Each of the cp ranks holds 2 of the sequence's 2 * cp equal chunks, rank i chunks i and
2 * cp - 1 - i, so that under a causal mask every rank has the same attention work (Llama 3,
arXiv:2407.21783 Sec. 3.3.2; torchtitan's load-balanced context parallelism). Everything token-wise
(embeddings, norms, MLPs, the loss) runs on the local tokens unchanged, in a graph traced at the
local length (runtime/api.py). What a model must offer is a contract of its source
(`ModelSource.context_parallel_refusal`): it is told its tokens' positions, through a
`position_ids` input the source feeds `arange(seq_len)` and the runtime cuts like the token ids
(transformers models, model files whose forward takes `position_ids`; sources/hf_context.py), or by
reading `sequence_positions()` (graph/positions.py: the zoo). Attention is what needs the whole
sequence: `route_attention` points the traced graphs' `scaled_dot_product_attention` calls
(torch.export's aten op, fx's kernel) at the name `F.scaled_dot_product_attention`, and while the
stages run (forward, and backward with its recomputation) `ContextParallelAttention` replaces that
name by

- an all-gather of k and v over the cp group (torch's autograd all-gather, whose backward
  reduce-scatters their gradients: every rank's queries contribute to every key's gradient),
- the gathered chunks put back in sequence order, and
- causal attention one call per local chunk, over the keys it sees (the sequence up to the
  chunk's end), with the causal mask aligned to the bottom right
  (`torch.nn.attention.bias.causal_lower_right`: query t of a chunk of L ending at key S sees keys
  up to S - L + t); the sequence's first chunk is plain `is_causal`. No (S/cp x S) mask is written
  out: on CPU the bias materializes an (L x keys) mask per chunk inside the call (half the old
  mask, benchmarks/cp_attention_cpu.py), on CUDA it dispatches to the flash / efficient kernel
  without one. Non-causal attention is one call over all keys.

Attention SDPA cannot compute (logit soft-capping, a sliding window, sinks: Gemma 2/3, GPT-OSS) is
autoplan's attention operator (models/windowed_attention.py), routed the same way
(`_windowed_by_hook`): the gathered keys, then one call per local chunk with the chunk's position in
the sequence as the query offset, over the keys from its window's first (or the sequence's first)
to its end, so the window and causality count true positions and a chunk computes over its
window only. Under tp (DTensor, [Note: tensor parallelism on an inlined graph]) it runs
on the rank's heads and their sinks.

This is Llama 3's all-gather context parallelism (the paper chose it over ring attention for its
flexibility with masks and its simplicity; the all-gather is exposed but small beside attention
at long context); the CUDA path is this same all-gather with the efficient kernel per chunk. Ring
attention (torch's `context_parallel`, torch.distributed.tensor.experimental, which shards the
model's buffers and rotates keys and values through ring kernels built on the CUDA flash /
efficient SDPA) is not built: gloo on CPU cannot run it, so the numerics tests could not cover it.
The CUDA path has not run in these tests (no GPU). The zoo's grouped-query models gather their
key/value heads before the kernel repeats them (`enable_gqa`), as Llama 3 does; transformers models
gather the heads their attention repeated (sources/hf_context.py says why).

Gradients: each rank's loss is the mean over its own tokens, and every rank of a cp group holds as
many tokens, so the gradient average over all dp ranks (cp folded in, as torchtitan's dp_shard x
cp mesh) is the gradient of the mean over all tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from autoplan.graph.experts import expert_modules
from autoplan.graph.positions import sequence_split_refusal
from autoplan.models import windowed_attention
from autoplan.runtime.parallel.errors import PartitionError

if TYPE_CHECKING:
    from autoplan.graph.trace import TracedModel
    from autoplan.plan import Plan
    from autoplan.runtime.parallel.mesh import ParallelLayout
    from autoplan.runtime.parallel.split import StageBuild
    from autoplan.sources import ModelSource, OutputTemplate

__all__ = ["ContextParallelAttention", "apply_context_parallel", "chunk_positions", "refuse_context_parallel",
           "route_attention", "shard_sequence", "whole_sequence_output"]

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def chunk_positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """Positions rank `index` of a cp group holds: chunks index and 2 cp - 1 - index of 2 cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: seq_len {seq_len} is not divisible by 2 * cp = {2 * cp}")
    return torch.cat([torch.arange(start, start + size) for _, start, size in _chunks(seq_len, cp, index)])


def shard_sequence(value: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """This rank's tokens of a (batch, seq_len, ...) tensor; other tensors unchanged."""
    if value.dim() >= 2 and value.shape[1] == seq_len:
        return value.index_select(1, positions.to(value.device))
    return value


def _chunks(seq_len: int, cp: int, index: int) -> list[tuple[int, int, int]]:
    """(row of the local tokens, position in the sequence, size) of each chunk rank `index` holds."""
    size = seq_len // (2 * cp)
    return [(0, index * size, size), (size, (2 * cp - 1 - index) * size, size)]


class ContextParallelAttention:
    """See the module docstring. `seq_len` is the whole sequence; the local tokens are
    `chunk_positions(seq_len, cp, index)`."""

    def __init__(self, group: dist.ProcessGroup, cp: int, index: int, seq_len: int) -> None:
        super().__init__()
        self.group, self.cp, self.seq_len = group, cp, seq_len
        self.positions = chunk_positions(seq_len, cp, index)
        self.chunks = _chunks(seq_len, cp, index)
        # Each later chunk's bottom-right causal mask, made once here rather than in every call: a
        # CausalBias is a tensor subclass, which cannot be created while a TorchDispatchMode runs (the
        # memory measurements' `LiveBytes` wraps the step), and its sizes are fixed by the plan.
        self.masks = {(size, start + size): causal_lower_right(size, start + size)
                      for _, start, size in self.chunks if start > 0}
        gathered = torch.cat([chunk_positions(seq_len, cp, i) for i in range(cp)])  # all-gather order
        self.order = torch.argsort(gathered)  # sequence position -> its row in the gathered tensor

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        # torch renamed the differentiable all-gather (the old name warns on every call since); the
        # supported range (pyproject.toml) includes releases with only the old one.
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        gathered = funcol.wait_tensor(gather(x.transpose(0, -2).contiguous(), 0, self.group))
        return gathered.index_select(0, self.order.to(x.device)).transpose(0, -2)

    def __enter__(self) -> ContextParallelAttention:
        # `torch.nn.functional.scaled_dot_product_attention` is replaced for the step, not
        # intercepted by a TorchFunctionMode: a mode is switched off while its handler runs, and the
        # backward (autograd.backward / grad reach the mode too) recomputes checkpointed layers
        # there, whose attention must gather again. Models call it as `F.scaled_dot_product_attention`;
        # traced graphs that call the kernel itself are routed to the name (`route_attention`).
        # autoplan's attention operator is routed the same way (`_windowed_by_hook`).
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._attention
        _WINDOWED_HOOK[0] = self._windowed
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._original
        _WINDOWED_HOOK[0] = None

    def _attention(self, *args, **kwargs):
        if len(args) < 3:
            return self._original(*args, **kwargs)
        q, k, v = args[:3]
        options = dict(zip(_SDPA_ARGS, (None, 0.0, False, None, False), strict=True))
        options.update(zip(_SDPA_ARGS, args[3:], strict=False))
        options.update(kwargs)
        local = self.positions.numel()
        if options["attn_mask"] is not None or q.shape[-2] != local or k.shape[-2] != local:
            raise RuntimeError(f"context parallelism: attention over {q.shape[-2]} queries and {k.shape[-2]} keys "
                               f"{'with an explicit mask ' if options['attn_mask'] is not None else ''}on a rank "
                               f"holding {local} tokens of {self.seq_len}; only self-attention over the sequence, "
                               "causal or not, can be split; plan this model with --cp 1")
        # The name back for the call: CausalBias calls the kernel by it.
        F.scaled_dot_product_attention = self._original
        try:
            return self._attend(q, self._gather(k), self._gather(v), options)
        finally:
            F.scaled_dot_product_attention = self._attention

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict):
        """The local queries against the whole sequence's keys: causal, one call per local chunk
        over the keys it sees (the sequence up to its end), bottom-right aligned (see the module
        docstring); not causal, one call over all keys."""
        common = dict(dropout_p=options["dropout_p"], scale=options["scale"], enable_gqa=options["enable_gqa"])
        if not options["is_causal"]:
            return self._original(q, k, v, **common)
        out = []
        for row, start, size in self.chunks:
            keys = start + size
            args = (q[..., row:row + size, :], k[..., :keys, :], v[..., :keys, :])
            if keys == size:  # the sequence's first chunk: plain causal attention
                out.append(self._original(*args, is_causal=True, **common))
                continue
            # CausalBias's own dispatch, not the kernel called with the bias: the bias answers only
            # calls by the name `F.scaled_dot_product_attention`, which is ours during the step, and
            # a recomputation in the backward (recompute.py checkpoints the kernel) would call the
            # kernel with the bias as a plain mask.
            out.append(CausalBias._dispatch(*args, self.masks[size, keys], common["dropout_p"], False, common["scale"],
                                            common["enable_gqa"]))
        return torch.cat(out, dim=-2)

    def _windowed(self, q, k, v, sinks, scale, causal, window, softcap, offset):
        """autoplan's attention operator (models/windowed_attention.py) over the gathered keys: per
        local chunk, the keys from the window's first (or the sequence's first) to the chunk's end,
        with the chunk's offset in the sequence, so causality and the window count true positions.
        Returns the operator's (output, log-sum-exp) as one call over the local tokens would."""
        local = self.positions.numel()
        if offset or q.shape[-2] != local or k.shape[-2] != local:
            raise RuntimeError(f"context parallelism: attention over {q.shape[-2]} queries and {k.shape[-2]} keys "
                               f"on a rank holding {local} tokens of {self.seq_len}; only self-attention over the "
                               "sequence can be split; plan this model with --cp 1")
        k, v = self._gather(k), self._gather(v)
        if not causal:
            return torch.ops.autoplan.attention.default(q, k, v, sinks, scale, causal, window, softcap, 0)
        outs, lses = [], []
        for row, start, size in self.chunks:
            first = max(0, start - window + 1) if window > 0 else 0
            out, lse = torch.ops.autoplan.attention.default(
                q[..., row:row + size, :], k[..., first:start + size, :], v[..., first:start + size, :], sinks, scale,
                causal, window, softcap, start - first)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


_WINDOWED_HOOK: list = [None]
"""The cp attention of the step running now (`ContextParallelAttention._windowed`), or None."""


def _windowed_by_hook(q, k, v, sinks, scale, causal, window, softcap, offset):
    """autoplan's attention operator, or the step's cp attention while one runs. A tensor-parallel
    graph hands it DTensors (the operator's sharding rule: its heads); the cp attention runs on this
    rank's heads, as `_local_attention` (runtime/parallel/tensor_parallel_graph.py) runs SDPA."""
    hook = _WINDOWED_HOOK[0]
    if hook is None:
        return torch.ops.autoplan.attention.default(q, k, v, sinks, scale, causal, window, softcap, offset)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(q, DTensor):
        return hook(q, k, v, sinks, scale, causal, window, softcap, offset)
    mesh = q.device_mesh
    heads = q.shape[1] % mesh.size() == 0 and k.shape[1] == q.shape[1]
    placement = Shard(1) if heads else Replicate()

    def local(t, placement):
        if t is None or (not isinstance(t, DTensor) and not heads):
            return t
        if not isinstance(t, DTensor):  # a plain tensor every tp rank holds whole: its heads are a slice
            t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return t.redistribute(mesh, [placement]).to_local()

    out, lse = hook(local(q, placement), local(k, placement), local(v, placement),
                    local(sinks, Shard(0) if heads else Replicate()), scale, causal, window, softcap, offset)
    return (DTensor.from_local(out, mesh, [placement], run_check=False),
            DTensor.from_local(lse, mesh, [placement], run_check=False))


_SDPA_TARGETS = (torch.ops.aten.scaled_dot_product_attention.default, torch._C._nn.scaled_dot_product_attention,
                 F.scaled_dot_product_attention)


def _sdpa_by_name(*args, **kwargs):
    """`scaled_dot_product_attention` looked up when called, so the step's cp attention answers."""
    return F.scaled_dot_product_attention(*args, **kwargs)


def route_attention(modules: Iterable[nn.Module]) -> None:
    """Point every attention call of these stages' traced graphs (torch.export's
    `aten.scaled_dot_product_attention`, fx's `torch._C._nn.scaled_dot_product_attention`) at the
    name `F.scaled_dot_product_attention`, which the cp attention replaces for each step; modules
    the graph calls whole (fx leaves) call the name already."""
    for module in modules:
        for gm in module.modules():
            if not isinstance(gm, fx.GraphModule):
                continue
            nodes = [n for n in gm.graph.nodes if n.op == "call_function"
                     and (n.target in _SDPA_TARGETS or windowed_attention.is_attention_op(n.target))]
            for node in nodes:
                node.target = _sdpa_by_name if node.target in _SDPA_TARGETS else _windowed_by_hook
            if nodes:
                gm.recompile()


def whole_sequence_output(template: OutputTemplate | None, plan: Plan) -> OutputTemplate | None:
    """The output template of a graph traced at a rank's share of the sequence (runtime/api.py traces
    so under cp), at the whole sequence: what a training batch's target follows, before the runtime
    cuts it like the inputs."""
    local = plan.job.seq_len // plan.cp
    if plan.cp == 1 or template is None or len(template.shape) < 2 or template.shape[1] != local:
        return template
    return dataclasses.replace(template, shape=(template.shape[0], plan.job.seq_len, *template.shape[2:]))


def refuse_context_parallel(source: ModelSource, model: nn.Module, traced: TracedModel, plan: Plan) -> None:
    """Refuse (one line, before any process group) a cp > 1 plan for a model its source cannot tell
    its tokens' positions (`ModelSource.context_parallel_refusal`), or whose modules keep sequences
    whole (graph/positions.py `sequence_split_refusal`: experts routed by capacity)."""
    if plan.cp <= 1:
        return
    has_experts = bool(expert_modules(traced.gm)) and not source.routes_tokens_alone(model)
    why = source.context_parallel_refusal(model) or sequence_split_refusal(model, has_experts)
    if why is not None:
        raise PartitionError(f"the plan has cp {plan.cp} but {why}; re-plan it with `autoplan suggest` (cp 1)")


def apply_context_parallel(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The context-parallel step: the attention that gathers keys and values over the cp group,
    entered around every step (`PartitionedModel.step`); the stages themselves are unchanged."""
    if plan.cp > 1:
        route_attention(build.modules.values())
        build.context = ContextParallelAttention(layout.cp_group, plan.cp, layout.cp_index, plan.job.seq_len)
