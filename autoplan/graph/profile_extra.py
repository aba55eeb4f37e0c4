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
from torch import nn

from autoplan.graph.blocks import ModelProfile
from autoplan.graph.experts import expert_modules
from autoplan.graph.fake_run import nbytes
from autoplan.graph.positions import sequence_split_refusal
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
        params = {id(p): (p.numel(), owner in layout) for path in paths
                  for owner, m in _named_modules_under(traced.gm, path) for p in m.parameters(recurse=False)}
        total = sum(n for n, _ in params.values())
        shares.append(round(sum(n for n, sharded in params.values() if sharded) / total, 4) if total else 0.0)
    summary["block_sharded_share"] = shares
    return summary


@contextlib.contextmanager
def recording_expert_inputs(gm: nn.Module) -> Iterator[dict[str, int]]:
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
                recorded[path] = recorded.get(path, 0) + nbytes(tensors[0])
        handles.append(module.register_forward_pre_hook(record))
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def experts_summary(traced: TracedModel, dispatched: dict[str, int], fingerprints: Sequence[str]) -> dict[str, Any]:
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


def context_parallel_support(model: nn.Module, profile: ModelProfile, positions_refusal: str | None) -> dict[str, Any]:
    """Whether the runtime can split this model's sequences over ranks (runtime/context.py), and
    why not: the model must be told its tokens' positions (`positions_refusal`, the model source's
    verdict: `ModelSource.context_parallel_refusal`), compute attention with
    `scaled_dot_product_attention` (which the runtime routes through the cp group; the profile lists
    it as a fused attention operator), and hold no per-sequence state across tokens other than
    attention unless it sums it over the sequence (graph/positions.py `sequence_split_refusal`: a
    mixture of experts' capacity and balance loss)."""
    split = sequence_split_refusal(model, bool(profile.extra.get("experts")))
    if positions_refusal is not None:
        why = positions_refusal
    elif not any(op.kind == "attention" for b in profile.blocks for op in b.ops):
        why = "it calls no scaled_dot_product_attention, the attention context parallelism splits"
    elif split is not None:
        why = split
    else:
        return {"allowed": True, "note": ""}
    return {"allowed": False, "note": why}
