"""What a profile records about the model beside its blocks' costs (`ModelProfile.extra`): the
tensor-parallel layout the runtime would run, the grouped experts and the bytes they receive, and
whether context parallelism can split its sequences. Each is a property of the whole model that the
search reads to refuse or price a dimension; apart from the per-block recording (graph/block_cost.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoplan.graph.blocks import ModelProfile
from autoplan.graph.experts import expert_modules, inlined_expert_calls, routed_expert_modules
from autoplan.graph.fake_run import nbytes
from autoplan.graph.positions import sequence_split_note, sequence_split_refusal
from autoplan.graph.trace import TracedModel

__all__ = ["context_parallel_support", "experts_summary", "recording_expert_inputs", "tensor_parallel_summary"]


def tensor_parallel_summary(traced: TracedModel, example_inputs: Sequence[Any]) -> dict[str, Any]:
    """The tensor-parallel layout as the runtime would run this graph (graph/sharding.py), as JSON:
    the counts every tp must divide, whether sequence parallelism applies, why no tp is possible."""
    from autoplan.graph.sharding import traced_layout

    layout = traced_layout(traced, example_inputs)  # what partition runs (runtime/api.py check_model)
    summary = layout.summary()
    # Per block, the share of its parameters the layout shards (1/tp on each rank): 1 for a layer
    # whose attention and MLP are both sharded, about 2/3 for one whose attention stays replicated.
    shares = []
    for paths in traced.block_modules or [[] for _ in traced.block_names]:
        # a fused projection's parts left whole (a multi-query key and value) count as unsharded
        params = {id(p): (p.numel(), layout.sharded_share(owner)) for path in paths
                  for owner, m in _named_modules_under(traced.gm, path) for p in m.parameters(recurse=False)}
        total = sum(n for n, _ in params.values())
        shares.append(round(sum(n * share for n, share in params.values()) / total, 4) if total else 0.0)
    summary["block_sharded_share"] = shares
    return summary


@contextlib.contextmanager
def recording_expert_inputs(gm: nn.Module) -> Iterator[dict[str, int]]:
    """Bytes of the rows each experts module (graph/experts.py) receives in the forward run: what
    expert parallelism's all-to-all sends, per profile batch. Grouped experts: a call with one
    tensor of leading dimension num_experts (tokens grouped by expert). Routed experts: the T * k
    (token, expert) copies of their (T, H) tokens, from a hook where the graph calls the module and,
    where it inlines it (torch.export), from the call's first node that reads the tokens (its target
    wrapped while the run lasts; the fx interpreter reads it per node)."""
    recorded: dict[str, int] = {}
    handles = []
    for path, module in expert_modules(gm).items():
        def record(module, args, path=path):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if len(tensors) == 1 and tensors[0].dim() >= 2 and tensors[0].shape[0] == module.num_experts:
                recorded[path] = recorded.get(path, 0) + nbytes(tensors[0])
        handles.append(module.register_forward_pre_hook(record))
    for path, module in routed_expert_modules(gm).items():
        def record_routed(module, args, path=path):
            if len(args) >= 2 and all(isinstance(a, torch.Tensor) for a in args[:2]):
                recorded[path] = recorded.get(path, 0) + nbytes(args[0]) * args[1].shape[-1]
        handles.append(module.register_forward_pre_hook(record_routed))
    wrapped = []
    if isinstance(gm, fx.GraphModule):
        for path, (_, call) in inlined_expert_calls(gm).items():
            reader = next(n for n in call.nodes if call.tokens in n.args)
            wrapped.append((reader, reader.target))
            reader.target = _RecordingTarget(reader.target, reader.args.index(call.tokens),
                                             int(call.indices.meta["val"].shape[-1]), path, recorded)
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()
        for node, target in wrapped:
            node.target = target


class _RecordingTarget:
    """A graph node's target that records the bytes of k copies of one of its arguments."""

    def __init__(self, target, position: int, k: int, path: str, recorded: dict[str, int]):
        self.target, self.position, self.k, self.path, self.recorded = target, position, k, path, recorded
        self.__name__ = getattr(target, "__name__", "target")

    def __call__(self, *args, **kwargs):
        tokens = args[self.position]
        if isinstance(tokens, torch.Tensor):
            self.recorded[self.path] = self.recorded.get(self.path, 0) + nbytes(tokens) * self.k
        return self.target(*args, **kwargs)


def experts_summary(traced: TracedModel, dispatched: dict[str, int], fingerprints: Sequence[str],
                    experts_per_token: int | None = None) -> dict[str, Any]:
    """`extra["experts"]` for a model whose experts expert parallelism can split (else nothing):
    grouped experts that took tokens grouped by expert, and routed experts (graph/experts.py). Per
    block, the parameters its experts hold and the bytes of rows they receive per profile batch
    (sent by one all-to-all to dispatch and one to combine, forward and backward: cost/time.py),
    and the smallest expert count (what the expert-parallel degree must divide), with the experts
    each token is routed to where the model's config says (cost/experts.py `dispatch_share`). The fake run
    computes a repeated block once, so its copies (same fingerprint) are counted as the one that ran."""
    grouped = expert_modules(traced.gm)
    grouped_types = {type(grouped[name]) for name in dispatched if name in grouped}
    counts = {name: m.num_experts for name, m in grouped.items() if type(m) in grouped_types}
    counts.update({name: m.num_experts for name, m in routed_expert_modules(traced.gm).items()})
    if isinstance(traced.gm, fx.GraphModule):
        counts.update({name: count for name, (count, _) in inlined_expert_calls(traced.gm).items()})
    if not counts:
        return {}
    params, sent, used = [], [], set()
    for paths in traced.block_modules or [[] for _ in traced.block_names]:
        inside = {name: m for path in paths for name, m in _named_modules_under(traced.gm, path) if name in counts}
        params.append(sum(p.numel() for m in inside.values() for p in m.parameters(recurse=False)))
        sent.append(sum(dispatched.get(name, 0) for name in inside))
        used.update(counts[name] for name in inside)
    if not any(params):
        return {}
    by_fingerprint = {fp: n for fp, n in zip(fingerprints, sent) if n}
    sent = [n or by_fingerprint.get(fp, 0) for fp, n in zip(fingerprints, sent)]
    summary = {"num_experts": min(used), "block_params": params, "block_dispatch_bytes": sent}
    if experts_per_token:
        summary["experts_per_token"] = int(experts_per_token)
    return {"experts": summary}


def _named_modules_under(gm: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    try:
        module = gm.get_submodule(path)
    except AttributeError:
        return []
    return [(f"{path}.{name}" if name else path, m) for name, m in module.named_modules()]


def context_parallel_support(model: nn.Module, profile: ModelProfile, positions_refusal: str | None,
                             experts_route_tokens_alone: bool = False) -> dict[str, Any]:
    """Whether the runtime can split this model's sequences over ranks (runtime/parallel/context.py), and
    why not: the model must be told its tokens' positions (`positions_refusal`, the model source's
    verdict: `ModelSource.context_parallel_refusal`), compute attention with
    `scaled_dot_product_attention` (which the runtime routes through the cp group; the profile lists
    it as a fused attention operator), and hold no per-sequence state across tokens other than
    attention unless it sums it over the sequence (graph/positions.py `sequence_split_refusal`: a
    mixture of experts' capacity and balance loss), unless its source says its experts route each token
    by itself (`experts_route_tokens_alone`, `ModelSource.routes_tokens_alone`). Allowed, the note
    says what a cp plan computes differently from one process, or is empty (graph/positions.py
    `sequence_split_note`: a capacity that drops tokens, counted over each rank's tokens as
    Megatron-LM counts it)."""
    split = sequence_split_refusal(model, bool(profile.extra.get("experts")) and not experts_route_tokens_alone)
    if positions_refusal is not None:
        why = positions_refusal
    elif not any(op.kind == "attention" for b in profile.blocks for op in b.ops):
        why = "it calls no scaled_dot_product_attention, the attention context parallelism splits"
    elif split is not None:
        why = split
    else:
        return {"allowed": True, "note": sequence_split_note(model) or ""}
    return {"allowed": False, "note": why}
