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
fingerprint, device name, shapes, dtype, torch version and timing method. The built-in models' analytic
profiles ship with the package, so their first profile runs nothing ([Note: shipped profiles] in
graph/profile_cache.py).

The recording lives apart, one concept a module: the fake run (graph/fake_run.py), one block's FLOPs,
bytes and operators (graph/block_cost.py), timing on a device (graph/timing.py), the cache
(graph/profile_cache.py) and the model-wide facts in `extra` (graph/profile_extra.py). This module
decides what to measure and assembles the profile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoplan.graph.block_cost import (
    BlockCost,
    block_fingerprint,
    block_params,
    cut_candidates,
    measure_block,
    unpriced,
)
from autoplan.graph.blocks import Block, ModelProfile
from autoplan.graph.fake_run import FakeRun, ProfileError, dtype_name, fake_like, nbytes, run_fake, tensors_in
from autoplan.graph.operators import UnpricedOperator, merge_batches
from autoplan.graph.positions import positions_refusal_of
from autoplan.graph.profile_cache import (
    analytic_key,
    profile_cache_dir,
    read_cached,
    read_shipped,
    timed_key,
    write_cached,
)
from autoplan.graph.profile_extra import (
    context_parallel_support,
    experts_summary,
    recording_expert_inputs,
    tensor_parallel_summary,
)
from autoplan.graph.timing import device_name, time_block, timing_dtype
from autoplan.graph.trace import TracedModel, extract_submodule, model_output, trace_with_loss

__all__ = ["Progress", "block_kind", "config_info", "fake_output", "model_fingerprint", "profile_model", "profile_module",
           "profile_traced"]

Progress = Callable[[int, int, str], None]


def fake_output(traced: TracedModel, example_inputs: Sequence[Any], dtype: torch.dtype | None = None) -> Any:
    """What the traced graph returns for `example_inputs` (fake tensors: shapes and dtypes only),
    structured as the model returns it (a ModelOutput, not its flattened tensors)."""
    run = run_fake(traced, example_inputs, dtype)
    output = next(n for n in traced.gm.graph.nodes if n.op == "output")
    return model_output(traced.gm, run.values[output.name])


# [Note: batch scaling]
# The cost model scales a profile to each micro-batch size. Linear scaling (docs/architecture.md, "Linear in the batch") holds for
# compute-bound blocks, not for a block whose weights dominate its traffic: a 256k-vocabulary
# embedding's backward writes its dense 262 MB weight gradient whatever the batch (186 ms at batch 1
# and 188 ms at batch 2 on this 2-core machine, one thread), so linear scaling counted it twice at
# micro-batch 2. Timed profiles therefore time each block at the profile's batch b and at 2b and fit
# t(b) = fixed + per_sample * b (the roofline's two terms, Williams et al. 2009: weight bytes are paid
# once per call, activation work per sample). A model that rejects a doubled batch keeps linear
# scaling, and the profile says so in `extra["batch_scaling"]`.


def _run_doubled(traced: TracedModel, example_inputs: Sequence[Any], dtype: torch.dtype | None,
                 batch_size: int) -> FakeRun | None:
    """The fake run at twice the batch (inputs whose first dimension is the batch, repeated), or None
    when the traced model rejects it (shapes baked in by torch.export, a batch-bound reshape)."""
    doubled = [torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch_size else x
               for x in example_inputs]
    try:
        return run_fake(traced, doubled, dtype)
    except ProfileError:
        return None


def _block_ops(sub: fx.GraphModule, cost: BlockCost, doubled_inputs: list[Any] | None, hidden: int | None,
               doubled: FakeRun | None, dtype: torch.dtype | None) -> tuple:
    """The block's operators (graph/operators.py), with batch axes learned from a pass at 2b."""
    twice = None
    if doubled is not None and doubled_inputs is not None:
        with doubled.mode:
            fakes = [fake_like(x, dtype) if isinstance(x, torch.Tensor) and not doubled.owns(x) else x
                     for x in doubled_inputs]
        try:
            twice = measure_block(sub, fakes, block_params(sub, doubled), hidden, doubled)
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
        "experts_per_token": ("experts_per_token", "num_experts_per_tok"),
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
        # The built-in models' shipped profiles first: equal to a fresh one, and nothing is executed
        # ([Note: shipped profiles] in graph/profile_cache.py).
        shipped = read_shipped(traced, example_inputs, model_name=model_name, fingerprint=fingerprint, dtype=dtype,
                               info=info, batch_size=batch_size, seq_len=seq_len)
        if shipped is not None:
            if progress is not None:
                progress(traced.num_blocks, traced.num_blocks, traced.block_names[-1])
            return shipped
        key = analytic_key(traced, example_inputs, model_name=model_name, fingerprint=fingerprint, dtype=dtype,
                           info=info, batch_size=batch_size, seq_len=seq_len)
        if key is not None:
            analytic_file = profile_cache_dir(cache_dir) / f"analytic-{key}.json"
            cached = read_cached(analytic_file, fingerprint, timed=False)
            if cached is not None:
                if progress is not None:
                    progress(traced.num_blocks, traced.num_blocks, traced.block_names[-1])
                return cached
    with recording_expert_inputs(traced.gm) as dispatched:
        run = run_fake(traced, example_inputs, dtype)
    cuts = cut_candidates(traced, run)
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
        key = timed_key(traced, fingerprint=fingerprint, device_name=device_name(device), batch_size=batch_size,
                        seq_len=seq_len, dtype=dtype, timed_dtype=timed_dtype)
        cache_file = profile_cache_dir(cache_dir) / f"{key}.json"
        cached = read_cached(cache_file, fingerprint, timed=True)
        if cached is not None:
            # Said where it came from: times measured earlier, perhaps on a busier machine, are not
            # re-measured unless the entry goes (`autoplan profile --refresh`; graph/timing.py
            # [Note: noisy timings]). Not written back: the file itself stays as it was measured.
            return dataclasses.replace(cached, extra={**cached.extra, "cached_from": str(cache_file)})

    # The same model at twice the batch, on fake tensors: which operator dimensions grow with the
    # batch ([Note: batch scaling]; graph/operators.py, `merge_batches`).
    doubled = _run_doubled(traced, example_inputs, dtype, batch_size)
    ops: dict[str, tuple] = {}
    costs: dict[str, BlockCost] = {}
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
                fake_inputs.append(fake_like(x, dtype) if isinstance(x, torch.Tensor) and not run.owns(x) else x)
        fp = block_fingerprint(traced, index, sub, fake_inputs)
        if fp not in costs:
            try:
                costs[fp] = measure_block(sub, fake_inputs, block_params(sub, run), hidden, run)
            except UnpricedOperator as exc:
                if os.environ.get("AUTOPLAN_DEBUG"):
                    raise
                # torch.cond runs through dynamo, which marks the wrapper it was compiling when the
                # refusal interrupted it as skipped: a later export of a cond in this process would fail.
                if "torch._dynamo" in sys.modules:
                    torch._dynamo.reset()
                raise ProfileError(unpriced(exc, sub)) from None
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
            output_bytes = sum(nbytes(t) for n in output_names for t in (tensors_in(run.values.get(n)) or []))
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
    spread_by_block: dict[str, float] = {}  # the worst of a block's (forward, forward + backward) spreads
    for done, (fp, (index, input_names, fake_inputs)) in enumerate(to_time.items()):
        if progress is not None:
            progress(traced.num_blocks + done, traced.num_blocks + len(to_time), f"timing {traced.block_names[index]}")
        block_spreads: list[float] = []
        timed[fp] = time_block(traced, index, fake_inputs, device, timed_dtype, warmup, repeats, occurrences[fp],
                               block_spreads)
        spreads.extend(block_spreads)
        if block_spreads:
            spread_by_block[traced.block_names[index]] = round(max(block_spreads), 4)
        if doubled is not None:
            twice = time_block(traced, index, [doubled.values[n] for n in input_names], device, timed_dtype, warmup,
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
        dtype=dtype_name(dtype) if dtype is not None else "mixed",
        tracer=traced.tracer,
        device=device if device == "meta" else device_name(device),
        num_heads=info.get("num_heads"),
        num_kv_heads=info.get("num_kv_heads"),
        hidden_size=info.get("hidden_size"),
        vocab_size=info.get("vocab_size"),
        num_layers=info.get("num_layers"),
        torch_version=torch.__version__,
        extra={"tracer_note": traced.note, "tensor_parallel": tensor_parallel_summary(traced, example_inputs),
               **experts_summary(traced, dispatched, [b.fingerprint for b in blocks], info.get("experts_per_token")),
               **({"threads": torch.get_num_threads()} if device == "cpu" else {}),
               **({"batch_scaling": "affine" if fixed else "linear (the model rejects a doubled batch)",
                   "timing_spread": {"median": round(statistics.median(spreads), 4) if spreads else None,
                                     "max": round(max(spreads), 4) if spreads else None,
                                     "of": "(max - min) / median of each block's repeats",
                                     "by_block": spread_by_block}}
                  if timed else {}),
               **({"timing_dtype_note": timed_dtype_note} if timed and timed_dtype_note else {})},
    )
    for path in (cache_file, analytic_file):
        if path is not None:
            write_cached(path, profile)
    return profile


def profile_module(model: nn.Module, traced: TracedModel, graph_inputs: Sequence[Any], *, model_name: str,
                   info: dict[str, int | None] | None = None, positions_refusal: str | None = "",
                   experts_route_tokens_alone: bool = False, **options: Any) -> ModelProfile:
    """`profile_traced` for `traced`, the graph of `model`, run on `graph_inputs`: with the model's
    config numbers (`config_info`, each overridden by `info` where that is set), its fingerprint, and
    whether context parallelism can split its sequences (`extra["context_parallel"]`: the source's
    `positions_refusal`, None when it tells the model its positions; by default whether the model
    reads `sequence_positions()`, graph/positions.py; `experts_route_tokens_alone`: the source's
    word that its experts count nothing over a sequence, `ModelSource.routes_tokens_alone`). `options` are
    `profile_traced`'s (dtype, device, batch_size, seq_len, warmup, repeats, cache_dir, progress). The
    one path from a built model to its profile, for `profile_model` and `autoplan.api.profile_with_graph`."""
    merged = config_info(model)
    merged.update({k: v for k, v in (info or {}).items() if v is not None})
    profile = profile_traced(traced, graph_inputs, model_name=model_name, fingerprint=model_fingerprint(model),
                             info=merged, **options)
    if positions_refusal == "":
        positions_refusal = positions_refusal_of(model)
    extra = {**profile.extra, "context_parallel": context_parallel_support(model, profile, positions_refusal,
                                                                           experts_route_tokens_alone)}
    return dataclasses.replace(profile, extra=extra)


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
    profile = profile_module(
        model, traced, inputs, model_name=model_name or type(model).__name__, info=info, dtype=dtype,
        device=device, warmup=warmup, repeats=repeats, cache_dir=cache_dir, progress=progress,
    )
    return profile, traced
