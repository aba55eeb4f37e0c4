"""Context parallelism: the ranks of a cp group split every sequence and share keys and values.

Each of the cp ranks holds 2 of the sequence's 2 * cp equal chunks, rank i chunks i and
2 * cp - 1 - i, so that under a causal mask every rank has the same attention work (Llama 3,
arXiv:2407.21783 Sec. 3.3.2; torchtitan's load-balanced context parallelism). Everything token-wise
(embeddings, norms, MLPs, the loss) runs on the local tokens unchanged; the model reads its tokens'
positions from `sequence_positions()` (graph/positions.py). Attention is what needs the whole
sequence: while the stages run (forward, and backward with its recomputation),
`ContextParallelAttention` replaces each `scaled_dot_product_attention(q, k, v)` by

- an all-gather of k and v over the cp group (torch's autograd all-gather, whose backward
  reduce-scatters their gradients: every rank's queries contribute to every key's gradient),
- the gathered chunks put back in sequence order, and
- attention of the local queries against all keys, with the causal mask written out from the
  queries' and keys' positions (a key at position j is visible to a query at position i iff j <= i).

This is Llama 3's all-gather context parallelism (the paper chose it over ring attention for its
flexibility with masks and its simplicity; the all-gather is exposed but small beside attention
at long context). torch's own `context_parallel` (torch.distributed.tensor.experimental) is not
used: it shards the model's buffers and dispatches attention to ring kernels built on the CUDA
flash / efficient SDPA, which gloo on CPU cannot run, so the numerics tests could not cover it
(docs/status.md). Grouped-query models gather their key/value heads before the kernel repeats
them (`enable_gqa`), as Llama 3 does.

Gradients: each rank's loss is the mean over its own tokens, and every rank of a cp group holds as
many tokens, so the gradient average over all dp ranks (cp folded in, as torchtitan's dp_shard x
cp mesh) is the gradient of the mean over all tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoplan.graph.experts import expert_modules
from autoplan.graph.positions import POSITIONS_ATTRIBUTE
from autoplan.runtime.errors import PartitionError

if TYPE_CHECKING:
    from autoplan.graph.trace import TracedModel
    from autoplan.plan import Plan
    from autoplan.runtime.mesh import ParallelLayout
    from autoplan.runtime.split import StageBuild

__all__ = ["ContextParallelAttention", "apply_context_parallel", "chunk_positions", "refuse_context_parallel",
           "shard_sequence"]

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def chunk_positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """Positions rank `index` of a cp group holds: chunks index and 2 cp - 1 - index of 2 cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: seq_len {seq_len} is not divisible by 2 * cp = {2 * cp}")
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(index * size, (index + 1) * size),
                      torch.arange((2 * cp - 1 - index) * size, (2 * cp - index) * size)])


def shard_sequence(value: torch.Tensor, positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """This rank's tokens of a (batch, seq_len, ...) tensor; other tensors unchanged."""
    if value.dim() >= 2 and value.shape[1] == seq_len:
        return value.index_select(1, positions.to(value.device))
    return value


class ContextParallelAttention:
    """See the module docstring. `seq_len` is the whole sequence; the local tokens are
    `chunk_positions(seq_len, cp, index)`."""

    def __init__(self, group: dist.ProcessGroup, cp: int, index: int, seq_len: int) -> None:
        super().__init__()
        self.group, self.cp, self.seq_len = group, cp, seq_len
        self.positions = chunk_positions(seq_len, cp, index)
        gathered = torch.cat([chunk_positions(seq_len, cp, i) for i in range(cp)])  # all-gather order
        self.order = torch.argsort(gathered)  # sequence position -> its row in the gathered tensor
        self._masks: dict[torch.device, torch.Tensor] = {}

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_gather_tensor_autograd, wait_tensor

        gathered = wait_tensor(all_gather_tensor_autograd(x.transpose(0, -2).contiguous(), 0, self.group))
        return gathered.index_select(0, self.order.to(x.device)).transpose(0, -2)

    def _causal_mask(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:
            keys = torch.arange(self.seq_len, device=device)
            self._masks[device] = keys.unsqueeze(0) <= self.positions.to(device).unsqueeze(1)
        return self._masks[device]

    def __enter__(self) -> ContextParallelAttention:
        # `torch.nn.functional.scaled_dot_product_attention` is replaced for the step, not
        # intercepted by a TorchFunctionMode: a mode is switched off while its handler runs, and the
        # backward (autograd.backward / grad reach the mode too) recomputes checkpointed layers
        # there, whose attention must gather again. Models call it as `F.scaled_dot_product_attention`.
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._attention
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._original

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
        k, v = self._gather(k), self._gather(v)
        mask = self._causal_mask(q.device) if options["is_causal"] else None
        return self._original(q, k, v, attn_mask=mask, dropout_p=options["dropout_p"], scale=options["scale"],
                              enable_gqa=options["enable_gqa"])


def refuse_context_parallel(model: nn.Module, traced: TracedModel, plan: Plan) -> None:
    """Refuse (one line, before any process group) a cp > 1 plan for a model that does not read its
    tokens' positions from `sequence_positions()`, or that has experts."""
    if plan.cp > 1 and not getattr(type(model), POSITIONS_ATTRIBUTE, False):
        raise PartitionError(f"the plan has cp {plan.cp} but {type(model).__name__} does not read token positions "
                             "from autoplan's sequence_positions() (graph/positions.py); re-plan it with "
                             "`autoplan suggest` (cp 1)")
    if plan.cp > 1 and expert_modules(traced.gm):
        raise PartitionError(f"the plan has cp {plan.cp} but the model has experts, whose capacity and balance loss "
                             "are per whole sequence; re-plan it with `autoplan suggest` (cp 1)")


def apply_context_parallel(build: StageBuild, plan: Plan, layout: ParallelLayout) -> None:
    """The context-parallel step: the attention that gathers keys and values over the cp group,
    entered around every step (`PartitionedModel.step`); the stages themselves are unchanged."""
    if plan.cp > 1:
        build.context = ContextParallelAttention(layout.cp_group, plan.cp, layout.cp_index, plan.job.seq_len)
