"""Export a plan as another framework's configuration: torchtitan TOML, Megatron-LM arguments,
DeepSpeed JSON.

Each target expresses only part of a plan. What it cannot say (a schedule it lacks, stage cuts it
cannot place, autoplan's ZeRO stage against the target's sharding) goes into comments: `#` lines
for TOML and the Megatron shell array, a "_comment" list for JSON. Nothing is dropped silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from autoplan.plan import Plan

__all__ = ["EXPORT_TARGETS", "ExportError", "export_plan", "stage_blocks", "stage_layer_counts"]


class ExportError(ValueError):
    """An export that cannot be made (unknown target); one line."""


_LAYER_RE = re.compile(r"^(?:.*\.)?layers\.(\d+)(?:\..*)?$")


def stage_blocks(plan: Plan) -> list[list[str]]:
    """The block names of every (virtual) stage, in stage order."""
    return [list(plan.block_names[s.first_block:s.end_block]) for s in plan.stages]


def stage_layer_counts(plan: Plan) -> list[int]:
    """Transformer layers per stage (distinct `layers.N` indices), as Megatron-LM counts them."""
    counts = []
    for blocks in stage_blocks(plan):
        counts.append(len({m.group(1) for b in blocks if (m := _LAYER_RE.match(b))}))
    return counts


def _embedding_fqns(plan: Plan) -> list[str] | None:
    """Module FQNs behind the synthetic `embedding` block, for zoo models (see graph/zoo.py)."""
    try:
        from autoplan.graph import zoo

        family = zoo.parse_model_spec(plan.model).family
    except Exception:  # a file model or a class name: unknown modules
        return None
    return {"gpt": ["tok_embeddings", "pos_embeddings"], "llama": ["tok_embeddings"]}.get(family)


def _header(plan: Plan) -> list[str]:
    return [f"autoplan plan for {plan.model} on {plan.cluster.get('name', '?')} ({plan.num_gpus} GPUs)",
            f"tp {plan.tp} x pp {plan.pp} x dp {plan.dp}; {plan.schedule}"
            + (f" with {plan.virtual_stages} virtual stages" if plan.virtual_stages > 1 else "")
            + f"; {plan.num_microbatches} micro-batches of {plan.micro_batch_size}; recompute {plan.recompute}; "
            f"zero {plan.zero}" + (f" (HSDP {plan.dp_replicate} x {plan.dp_shard})" if plan.dp_replicate > 1 else "")
            + ("; sequence parallel" if plan.sequence_parallel else ""),
            f"predicted: {plan.predicted.step_time_s:.4f} s/step, {plan.predicted.tokens_per_s:,.0f} tokens/s, "
            f"MFU {plan.predicted.mfu:.1%}, peak {plan.predicted.peak_memory_bytes / 2**30:.2f} GiB/GPU"]


def _stage_lines(plan: Plan) -> list[str]:
    return [f"stage {s.index} (pp rank {s.pp_rank}): blocks {s.first_block}..{s.end_block - 1} "
            f"({s.first_block_name} .. {s.last_block_name})" for s in plan.stages]


# ---- torchtitan ------------------------------------------------------------------------------

# torchtitan's `pipeline_parallel_schedule` takes torch.distributed.pipelining class names.
_TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _torchtitan(plan: Plan) -> str:
    comments = _header(plan)
    schedule = _TITAN_SCHEDULES.get(plan.schedule)
    if plan.schedule == "zb-h1":
        # torchtitan's zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble) are multi-stage
        # schedules that need at least 2 stages per rank; zb-h1 has one, so the closest schedule
        # torchtitan runs is 1F1B: the same F/B order without the split weight-gradient pass.
        schedule = "1F1B"
        comments.append("zb-h1 has no one-stage-per-rank equivalent in torchtitan: exported as 1F1B (same F/B "
                        "order, backward not split into B and W), so expect a larger bubble than predicted; for "
                        "zero bubble, re-plan with 2 stages per rank and use InterleavedZeroBubble or ZBVZeroBubble")
    reshard = None
    if plan.zero == 0:
        replicate, shard = plan.dp, 1
    elif plan.zero == 1:
        replicate, shard = 1, plan.dp
        comments.append(f"autoplan zero {plan.zero} is exported as FSDP (data_parallel_shard_degree = {plan.dp}); "
                        "torchtitan's FSDP2 also shards parameters (ZeRO-3-like), so memory is lower and "
                        "communication higher than predicted")
    else:
        # FSDP2 as autoplan runs it: shard over dp_shard ranks, replicate (HSDP) over dp_replicate;
        # zero 3 reshards after forward, zero 2 keeps the parameters gathered until the backward.
        replicate, shard = plan.dp_replicate, plan.dp_shard
        reshard = "always" if plan.zero == 3 else "never"
    if plan.sequence_parallel:
        comments.append("sequence parallelism: torchtitan applies it with tensor parallelism by default")
    embedding = _embedding_fqns(plan)
    parts = []
    for blocks in stage_blocks(plan):
        fqns = []
        for b in blocks:
            if b == "embedding" and embedding is not None:
                fqns += embedding
            else:
                fqns.append(b)
        parts.append(fqns)
    if "embedding" in plan.block_names and embedding is None:
        comments.append("the `embedding` block groups every module before the first layer; replace it by their FQNs")
    comments += _stage_lines(plan)
    parallelism = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": plan.tp,
        "pipeline_parallel_degree": plan.pp,
        "pipeline_parallel_schedule": schedule,
        "pipeline_parallel_microbatch_size": plan.micro_batch_size,
    }
    if reshard is not None:
        parallelism["fsdp_reshard_after_forward"] = reshard
    lines = [f"# {c}" for c in comments]
    lines += ["", "[training]", f"global_batch_size = {plan.job.global_batch}",
              f"local_batch_size = {plan.job.global_batch // plan.dp}", f"seq_len = {plan.job.seq_len}", "",
              "[parallelism]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in parallelism.items()]
    lines.append("module_fqns_per_model_part = [")
    lines += [f"    {_toml_value(fqns)},  # stage {i}" for i, fqns in enumerate(parts)]
    lines.append("]")
    lines += ["", "[activation_checkpoint]", f"mode = {_toml_value(plan.recompute)}"]
    if plan.recompute == "selective":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines) + "\n"


# ---- Megatron-LM -----------------------------------------------------------------------------

def _megatron(plan: Plan) -> str:
    comments = _header(plan)
    args: list[tuple[str, object]] = [
        ("--tensor-model-parallel-size", plan.tp),
        ("--pipeline-model-parallel-size", plan.pp),
        ("--micro-batch-size", plan.micro_batch_size),
        ("--global-batch-size", plan.job.global_batch),
        ("--seq-length", plan.job.seq_len),
    ]
    counts = stage_layer_counts(plan)
    num_layers = sum(counts)
    if num_layers:
        args.append(("--num-layers", num_layers))
    comments.append(f"launch on {plan.num_gpus} GPUs: Megatron-LM derives data-parallel size {plan.dp} "
                    f"= world size / (tp {plan.tp} x pp {plan.pp})")
    if plan.job.dtype in ("bfloat16", "bf16"):
        args.append(("--bf16", None))
    elif plan.job.dtype in ("float16", "fp16"):
        args.append(("--fp16", None))
    if plan.sequence_parallel:
        args.append(("--sequence-parallel", None))
    if plan.recompute == "full":
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    elif plan.recompute == "selective":
        args.append(("--recompute-granularity", "selective"))
    if plan.zero == 3 and plan.pp == 1:
        # Megatron-LM's torch FSDP2 wrapper (`--use-torch-fsdp2`, TorchFullyShardedDataParallel) shards
        # over the whole data-parallel group and reshards after forward (ZeRO-3); it does not run with pp > 1.
        args.append(("--use-torch-fsdp2", None))
    elif plan.zero >= 1:
        args.append(("--use-distributed-optimizer", None))
        if plan.zero == 2:
            comments.append("zero 2: Megatron's distributed optimizer shards optimizer states and reduce-scatters "
                            "gradients (ZeRO-1 with ZeRO-2-like gradient traffic); gradients stay full-size in memory")
        elif plan.zero == 3:
            comments.append("zero 3 with pipeline parallelism: Megatron-LM's ZeRO-3 (--use-torch-fsdp2) does not run "
                            "with pp > 1; exported as the distributed optimizer (ZeRO-1-like): parameters and "
                            "gradients stay full-size, so memory is higher than predicted")
    if plan.zero >= 2 and plan.dp_replicate > 1:
        comments.append(f"HSDP {plan.dp_replicate} x {plan.dp_shard}: Megatron-LM shards over all {plan.dp} "
                        "data-parallel ranks: less memory, more inter-node traffic than predicted")

    v = plan.virtual_stages
    if plan.schedule == "interleaved-1f1b":
        per_stage = set(counts)
        if len(per_stage) == 1:
            args.append(("--num-layers-per-virtual-pipeline-stage", counts[0]))
        else:
            comments.append(f"uneven virtual stages ({counts} layers) cannot be expressed with "
                            f"--num-layers-per-virtual-pipeline-stage; the exported run cuts evenly")
    elif plan.schedule == "gpipe":
        comments.append("gpipe: Megatron-LM runs 1F1B when pp > 1 (same step time without the bubble of "
                        "holding all activations; memory lower than predicted)")
    elif plan.schedule == "zb-h1":
        comments.append("zb-h1: Megatron-LM has no zero-bubble schedule; it runs 1F1B (larger bubble than predicted)")
    if plan.pp > 1 and v == 1 and num_layers and len(set(counts)) > 1:
        # Megatron splits the layers the first and last stages do not take evenly over the others.
        first, last, middle = counts[0], counts[-1], counts[1:-1]
        common = middle[0] if middle and len(set(middle)) == 1 else None
        if common is None or first != common:
            args.append(("--decoder-first-pipeline-num-layers", first))
        if common is None or last != common:
            args.append(("--decoder-last-pipeline-num-layers", last))
        if len(set(middle)) > 1:
            comments.append(f"middle stages hold {middle} layers; Megatron-LM splits them evenly, so the exported "
                            "run cuts them differently from the plan")
    if "embedding" in plan.block_names or "output" in plan.block_names:
        comments.append("embedding and head: Megatron-LM places them on the first and last pipeline stage, "
                        "as the plan does")
    comments.append("layers per stage: " + ", ".join(f"stage {i}: {c}" for i, c in enumerate(counts)))
    comments += _stage_lines(plan)
    lines = [f"# {c}" for c in comments]
    lines.append("MEGATRON_ARGS=(")
    for flag, value in args:
        lines.append(f"    {flag}" + ("" if value is None else f" {value}"))
    lines.append(")")
    lines.append('# torchrun --nproc-per-node ... pretrain_gpt.py "${MEGATRON_ARGS[@]}" ...')
    return "\n".join(lines) + "\n"


# ---- DeepSpeed -------------------------------------------------------------------------------

def _uniform_boundaries(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's `partition_uniform` (deepspeed/runtime/utils.py): equal parts, the remainder
    spread over the first parts."""
    base, extra = divmod(num_items, num_parts)
    out, at = [0], 0
    for i in range(num_parts):
        at += base + (1 if i < extra else 0)
        out.append(at)
    return out


def _deepspeed(plan: Plan) -> str:
    comments = _header(plan)
    boundaries = list(plan.boundaries)
    config: dict[str, object] = {
        "train_batch_size": plan.job.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        "zero_optimization": {"stage": plan.zero},
    }
    if plan.job.dtype in ("bfloat16", "bf16"):
        config["bf16"] = {"enabled": True}
    elif plan.job.dtype in ("float16", "fp16"):
        config["fp16"] = {"enabled": True}
    if plan.recompute != "none":
        config["activation_checkpointing"] = {"partition_activations": plan.sequence_parallel or plan.tp > 1,
                                              "contiguous_memory_optimization": False}
        comments.append(f"recompute {plan.recompute}: pass activation_checkpoint_interval=1 to PipelineModule "
                        "(DeepSpeed checkpoints whole layers; 'selective' recomputes more than planned)")
    if plan.pp > 1:
        if plan.virtual_stages > 1 or plan.schedule != "1f1b":
            comments.append(f"{plan.schedule}: DeepSpeed's PipelineEngine runs only its own 1F1B-style TrainSchedule "
                            "with one stage per rank; the step time will differ from the prediction")
        if boundaries == _uniform_boundaries(len(plan.block_names), plan.num_stages):
            method = "uniform"
            comments.append('the plan\'s cuts equal PipelineModule(partition_method="uniform") over these blocks')
        else:
            method = None
            comments.append("DeepSpeed's PipelineModule has no partition_method for explicit cuts (it accepts "
                            "'uniform', 'parameters' and 'type:REGEX'); the plan's layer boundaries are in "
                            "_autoplan_pipeline.layer_boundaries: build the PipelineModule layer list so that "
                            "'uniform' reproduces them, or override PipelineModule._partition_layers to set "
                            "self.parts to them")
        config["_autoplan_pipeline"] = {
            "num_stages": plan.pp,
            "partition_method": method,
            "layer_boundaries": boundaries,
            "stage_blocks": stage_blocks(plan),
        }
    if plan.tp > 1:
        comments.append(f"tensor parallelism {plan.tp}: DeepSpeed takes it from the model's mpu (e.g. Megatron-DeepSpeed "
                        f"--tensor-model-parallel-size {plan.tp})")
    if plan.zero >= 2 and plan.pp > 1:
        comments.append("DeepSpeed's pipeline engine supports only ZeRO stage 0 or 1")
    if plan.dp_replicate > 1 and plan.zero == 3:
        # MiCS: ZeRO-3 sharded inside groups of mics_shard_size ranks, replicated across them (HSDP).
        config["zero_optimization"] |= {"mics_shard_size": plan.dp_shard, "mics_hierarchical_params_gather": False}
        comments.append(f"HSDP {plan.dp_replicate} x {plan.dp_shard} as DeepSpeed MiCS (mics_shard_size = "
                        f"{plan.dp_shard}): build the model under deepspeed.zero.MiCS_Init")
    elif plan.dp_replicate > 1:
        comments.append(f"HSDP {plan.dp_replicate} x {plan.dp_shard}: DeepSpeed's ZeRO-2 shards over all {plan.dp} "
                        "data-parallel ranks (MiCS needs stage 3): less memory, more inter-node traffic than predicted")
    comments += _stage_lines(plan)
    return json.dumps({"_comment": comments, **config}, indent=2) + "\n"


EXPORT_TARGETS: dict[str, Callable[[Plan], str]] = {
    "torchtitan": _torchtitan,
    "megatron": _megatron,
    "deepspeed": _deepspeed,
}


def export_plan(plan: Plan, target: str) -> str:
    """The plan as `target`'s configuration text: torchtitan (TOML), megatron (shell args) or
    deepspeed (JSON)."""
    try:
        make = EXPORT_TARGETS[target.lower()]
    except (KeyError, AttributeError):
        raise ExportError(f"unknown export target {target!r}; use one of {', '.join(EXPORT_TARGETS)}") from None
    return make(plan)
