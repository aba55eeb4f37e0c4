"""The (pp, dp, tp) device mesh of a plan, and the gradient reductions between replicas.

The mesh is torch's `DeviceMesh` over the plan's rank layout ([Note: rank layout] in plan.py), so
the dp and tp groups are the mesh's own groups. Gradients are reduced after the last backward of
a step:

- Tied parameters whose ends sit on different pipeline ranks (GPT's `output.weight` and
  `tok_embeddings.weight`) have one copy per rank; their gradients are summed over those ranks
  first (Megatron-LM's embedding group, Shoeybi et al. 2019, Sec 3), so both copies take the same
  optimizer step and stay equal.
- Then every gradient is averaged over the dp group (one all-reduce per dtype over a flat buffer,
  as DDP's buckets do). Under ZeRO-2 (`PartitionedModel.make_optimizer`) each gradient is instead
  reduced to the one replica whose optimizer shard steps it (one reduce per owner over a flat
  buffer; together a reduce-scatter) and freed on the others (`reduce_grads_to_owners`).

Tensor parallelism (tp > 1) is torch's own `torch.distributed.tensor.parallel`, Megatron-style
(Shoeybi et al. 2019, Sec 3) on the built-in models' layers, over the mesh's "tp" axis:

- gpt: `attention.qkv` and `mlp.fc1` column-parallel, `attention.proj` and `mlp.fc2` row-parallel;
- llama: `attention.wq/wk/wv` and `mlp.w1/w3` column-parallel, `attention.wo` and `mlp.w2`
  row-parallel (num_kv_heads must be divisible by tp, so a shard holds whole KV heads).

The zoo's attention infers head counts from the weight shapes and lays the fused qkv out per head
([Note: tensor-parallel friendly shapes] in zoo.py), so a shard computes with num_heads / tp local
heads unchanged. Row-parallel outputs are all-reduced and returned as plain (replicated) tensors
(`use_local_output=True`), so everything between the sharded linears (norms, residuals, the
activations sent between pipeline stages) is a plain tensor, identical on the tp ranks of a stage.
The token embedding and the LM head are vocabulary-parallel (Megatron-LM's VocabParallelEmbedding
and column-parallel output layer): each tp rank holds 1/tp of the vocabulary rows; the embedding's
masked lookups are all-reduced, and the logits gathered so the loss is computed whole on every tp
rank (not Megatron's vocab-parallel cross entropy: the full logits exist on each rank). A tied head
shares the embedding's sharded weight. Norms and position embeddings stay replicated: their
gradients come out whole and equal on every tp rank (the column-parallel inputs all-reduce their
gradients in backward), so they need no tp reduction. Sharded parameters are `DTensor`s (`Shard(0)` for column-parallel weights and
biases, `Shard(1)` for row-parallel weights); their gradients are DTensors with the same
placement, and the dp all-reduce works on their local shards. Sequence parallelism (plans with
sequence_parallel) is run as [Note: sequence parallelism] in `_apply_sequence_parallel` says.
Other models (including Hugging Face ones) are refused with tp > 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["ParallelLayout", "TensorParallelError", "all_reduce_grads", "apply_tensor_parallel", "build_layout",
           "grad_like_param", "local_tensor", "reduce_grads_to_owners", "sequence_parallel_layers", "tensor_parallel_plan"]


class TensorParallelError(ValueError):
    """The model cannot be run tensor-parallel at this degree (one-line message)."""


# Layer class name (autoplan.graph.zoo) -> {sub-path: "colwise" | "rowwise"}.
_ZOO_TP_LAYOUT: dict[str, dict[str, str]] = {
    "GPTAttention": {"qkv": "colwise", "proj": "rowwise"},
    "GPTMLP": {"fc1": "colwise", "fc2": "rowwise"},
    "LlamaAttention": {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"},
    "LlamaMLP": {"w1": "colwise", "w3": "colwise", "w2": "rowwise"},
}
TP_SUPPORTED = "built-in gpt and llama models (autoplan.graph.zoo)"


def tensor_parallel_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """Module path of every linear to shard -> "colwise" / "rowwise"; raises TensorParallelError
    when the model has no layers torch's Megatron-style plan applies to, or tp does not divide
    the heads (KV heads included) or the MLP width. Works on a model on meta."""
    from autoplan.graph import zoo

    classes = {name: getattr(zoo, name) for name in _ZOO_TP_LAYOUT}
    out: dict[str, str] = {}
    for path, module in model.named_modules():
        kind = next((name for name, cls in classes.items() if type(module) is cls), None)
        if kind is None:
            continue
        prefix = f"{path}." if path else ""
        for sub, style in _ZOO_TP_LAYOUT[kind].items():
            out[prefix + sub] = style
        if kind == "GPTAttention":
            heads = module.qkv.out_features // (3 * module.head_dim)
            counts = {"num_heads": heads}
        elif kind == "LlamaAttention":
            counts = {"num_heads": module.wq.out_features // module.head_dim,
                      "num_kv_heads": module.wk.out_features // module.head_dim}
        else:
            first = module.fc1 if kind == "GPTMLP" else module.w1
            counts = {"ffn_hidden_size": first.out_features}
        for what, count in counts.items():
            if count % tp:
                raise TensorParallelError(f"tp = {tp} does not divide {what} = {count} of '{path}'; plan with a tp "
                                          f"that divides it")
    if not out:
        raise TensorParallelError(f"tensor-parallel execution (tp > 1) supports the {TP_SUPPORTED}; "
                                  f"{type(model).__name__} has none of their layers; plan with tp = 1")
    # Vocabulary-parallel embedding and head (Shoeybi et al. 2019, Sec. 3), as the cost model counts them.
    for path, module in model.named_modules():
        if type(module).__name__ not in ("GPTModel", "LlamaModel"):
            continue
        prefix = f"{path}." if path else ""
        vocab = module.tok_embeddings.num_embeddings
        if vocab % tp:
            raise TensorParallelError(f"tp = {tp} does not divide vocab_size = {vocab}; pad the vocabulary to a "
                                      f"multiple of tp (Megatron-LM pads to 128 * tp) or plan with another tp")
        out[prefix + "tok_embeddings"] = "vocab-embedding"
        out[prefix + "output"] = "vocab-head"
    return out


def apply_tensor_parallel(module: nn.Module, tp_plan: Mapping[str, str], tp_mesh, *,
                          sequence_parallel: bool = False, model_layers: Sequence[str] = ()) -> list[str]:
    """Shard the linears of `tp_plan` found in `module` (a stage; paths as in the model) over
    `tp_mesh` with torch's ColwiseParallel / RowwiseParallel; returns the paths sharded.

    With `sequence_parallel`, also lays the layers out as [Note: sequence parallelism] says;
    `model_layers` lists every transformer layer of the model in order (the first takes a whole
    sequence, the last gives one back). Works on meta (nothing is communicated: every rank keeps
    its own slice of what it holds)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # parallelize_module gives each module its own parameter, which would untie a head that shares
    # the embedding's weight; they are tied again afterwards.
    tied = []
    for path, style in tp_plan.items():
        if style == "vocab-head":
            embedding_path = path.removesuffix("output") + "tok_embeddings"  # same model prefix
            try:
                head, embedding = module.get_submodule(path), module.get_submodule(embedding_path)
            except AttributeError:
                continue
            if head.weight is embedding.weight:
                tied.append((head, embedding))
    done = []
    for path, style in tp_plan.items():
        try:
            target = module.get_submodule(path)
        except AttributeError:
            continue
        if style == "colwise":
            parallel = ColwiseParallel()
        elif style == "vocab-embedding":  # rows of the table; masked lookups, outputs all-reduced
            parallel = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif style == "vocab-head":  # columns of the logits, gathered for the (replicated) loss
            parallel = ColwiseParallel(output_layouts=Replicate())
        elif sequence_parallel:  # reduce-scatter along the sequence instead of all-reduce
            parallel = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        else:
            parallel = RowwiseParallel()
        parallel.src_data_rank = None  # every rank builds the same weights: take the local slice, no scatter
        parallelize_module(target, tp_mesh, parallel)
        done.append(path)
    if sequence_parallel:
        _apply_sequence_parallel(module, tp_mesh, model_layers)
    for head, embedding in tied:  # both shard the vocabulary rows (Shard(0)): one DTensor serves both
        head.weight = embedding.weight
    return done


_SP_LAYER_CLASSES = ("GPTLayer", "LlamaLayer")


def _apply_sequence_parallel(module: nn.Module, tp_mesh, model_layers: Sequence[str]) -> None:
    """[Note: sequence parallelism] (Korthikanti et al. 2022, Sec. 4.2.2), with torch's parallel styles
    as torchtitan applies them to its Llama:

    - Between layers the residual stream is this rank's 1/tp of the sequence, a plain tensor of
      shape (b, s/tp, h): that is also what crosses a pipeline cut between two layers.
    - Inside a layer it is a DTensor Shard(1); the norms run on it (`SequenceParallel`: their
      weights are replicated DTensors, whose gradients DTensor sums over the tp group); the
      attention and MLP take the whole sequence (`PrepareModuleInput`: an all-gather, a
      reduce-scatter in backward), and their row-parallel projections reduce-scatter back to
      Shard(1) (`RowwiseParallel(output_layouts=Shard(1))`), where plain tp all-reduces.
    - The model's first layer takes the whole sequence (the embedding output, replicated) and keeps
      its slice; its last layer gathers the sequence back for the final norm and the head, which
      stay replicated.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    first, last = (model_layers[0], model_layers[-1]) if model_layers else (None, None)
    for path, layer in module.named_modules():
        if type(layer).__name__ not in _SP_LAYER_CLASSES:
            continue
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True)
        parallelize_module(layer, tp_mesh, {"attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                                            "attention": gather, "mlp": gather})
        parallelize_module(layer, tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate() if path == first else Shard(1),), desired_input_layouts=(Shard(1),)))
        parallelize_module(layer, tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate() if path == last else Shard(1),),
            use_local_output=True))


def sequence_parallel_layers(model: nn.Module) -> list[str]:
    """Paths of the model's transformer layers that sequence parallelism lays out, in order."""
    return [path for path, m in model.named_modules() if type(m).__name__ in _SP_LAYER_CLASSES]


def grad_like_param(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """`grad` laid out as `param`: DTensor's embedding backward returns a Replicate gradient for a
    row-sharded (vocabulary-parallel) table; the optimizer and the reductions need the param's own
    placement (Replicate -> Shard is a local slice, no communication)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writes go to it), or `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class ParallelLayout:
    """Where this rank sits in the plan's mesh and the groups it reduces over."""

    rank: int
    world_size: int
    pp_index: int
    dp_index: int
    tp_index: int
    pp: int
    dp: int
    tp: int
    stage_rank: dict[int, int]
    """Virtual stage -> global rank that runs it with this rank's dp and tp coordinates."""
    mesh: object | None
    """torch DeviceMesh with axes ("pp", "dp", "tp"), or None for a single rank."""
    dp_group: dist.ProcessGroup | None
    tie_groups: dict[str, dist.ProcessGroup]
    """Canonical name of a tied parameter split over pipeline ranks -> the group of its holders."""
    tp_mesh: object | None = None
    """The 1-D "tp" sub-mesh this rank shards over (ranks plan.rank(pp, dp, 0..tp-1)), or None."""


def build_layout(plan, rank: int, world_size: int, device_type: str,
                 tied_holders: Mapping[str, Sequence[int]]) -> ParallelLayout:
    """Mesh and groups for `rank`; collective: every rank calls it with the same arguments.

    `tied_holders` maps a tied parameter's canonical name to the pipeline indices that hold a copy.
    """
    pp_index, dp_index, tp_index = plan.coords(rank)
    stage_rank = {s.index: plan.rank(s.pp_rank, dp_index, tp_index) for s in plan.stages}
    mesh = dp_group = tp_mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import DeviceMesh

        layout = torch.tensor([[[plan.rank(p, d, t) for t in range(plan.tp)] for d in range(plan.dp)]
                               for p in range(plan.pp)])
        mesh = DeviceMesh(device_type, layout, mesh_dim_names=("pp", "dp", "tp"))
        dp_group = mesh.get_group("dp") if plan.dp > 1 else None
        tp_mesh = mesh["tp"] if plan.tp > 1 else None
    tie_groups: dict[str, dist.ProcessGroup] = {}
    for name in sorted(tied_holders):
        holders = sorted(set(tied_holders[name]))
        if len(holders) < 2:
            continue
        for d in range(plan.dp):  # new_group is collective: every rank creates every group
            for t in range(plan.tp):
                ranks = [plan.rank(p, d, t) for p in holders]
                group = dist.new_group(ranks)
                if rank in ranks:
                    tie_groups[name] = group
    return ParallelLayout(rank, world_size, pp_index, dp_index, tp_index, plan.pp, plan.dp, plan.tp,
                          stage_rank, mesh, dp_group, tie_groups, tp_mesh)


def all_reduce_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup | None, *,
                     average: bool) -> None:
    """Sum (or average) the `.grad` of `params` over `group`, one flat buffer per dtype.

    A DTensor gradient (a tensor-parallel shard) is reduced as its local shard: the group is a dp
    or tie group of ranks with the same tp index, so the shards line up."""
    if group is None:
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    size = dist.get_world_size(group)
    for plist in by_dtype.values():
        grads = [local_tensor(p.grad) for p in plist]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        if average:
            flat /= size
        for local, g in zip(grads, _unflatten_dense_tensors(flat, grads)):
            local.copy_(g)


def reduce_grads_to_owners(params: Iterable[nn.Parameter], owner: Mapping[int, int],
                           group: dist.ProcessGroup | None) -> None:
    """ZeRO-2: average each `.grad` over `group` onto the rank (index in the group) that owns the
    parameter (`owner[id(p)]`) and free it on the others. One reduce per (owner, dtype) over a
    flat buffer: together the reduce-scatter of ZeRO (Rajbhandari et al. 2020, Sec. 5.2)."""
    if group is None:
        return
    me = dist.get_rank(group)
    size = dist.get_world_size(group)
    buckets: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((owner[id(p)], p.grad.dtype), []).append(p)
    for (dst, _), plist in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        grads = [p.grad for p in plist]
        flat = _flatten_dense_tensors(grads)
        dist.reduce(flat, dst=dist.get_global_rank(group, dst), group=group)
        if me == dst:
            flat /= size
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        else:
            for p in plist:
                p.grad = None
