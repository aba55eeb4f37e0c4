"""DeepSpeed export: one JSON file that `deepspeed.initialize(config=...)` reads as written, holding
also the `PipelineModule` keyword arguments and the layer list its cuts refer to.

DeepSpeed (0.19.8) reads a plan in two places. The JSON config carries the batch arithmetic, the
ZeRO stage, the precision and the pipeline's activation-checkpoint interval; `DeepSpeedConfig`
reads the keys it knows and ignores other top-level keys (runtime/config.py
`DeepSpeedConfig._initialize_params`; only sub-sections are strict pydantic models), so the same
file also carries, under `"autoplan_pipeline_module"`, what the user's script passes to
`PipelineModule(layers, topology=ProcessTopology(**topology), **kwargs)`: the stage count, the
partition method, the checkpoint interval and class list, the rank topology, the layer list (one
`LayerSpec` per plan block, with the class name the partition regex matches) and the `parts`
DeepSpeed will compute from them. The differences head the file as `"_autoplan_differences"`.

DeepSpeed takes no explicit stage cuts: `PipelineModule._partition_layers` (runtime/pipe/module.py)
knows "uniform", "parameters" and "type:REGEX" only. This module runs DeepSpeed's own partition
algorithms (`partition_uniform`, `partition_balanced`, runtime/utils.py) over the layer list it
describes, for every method whose result depends only on that list, and writes the one that
reproduces the plan's cuts; when none does, the closest one and a difference naming the layers per
stage the user gets. docs/export-deepspeed.md has the worked example and the full mapping.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Iterator

import numpy as np

from autoplan.plan import Plan
from autoplan.report.export.common import (
    Export,
    ExportError,
    Findings,
    Mismatch,
    TargetRefusal,
    TransformerShape,
    collect_mismatches,
    model_shape,
    plan_summary,
    stage_lines,
)
from autoplan.schedule import schedule_spec

__all__ = ["DEEPSPEED_VERSION", "mismatches", "partition_balanced", "partition_uniform", "placeable_cuts", "write"]

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed release the written file is checked against (tests/test_export_deepspeed.py)."""

# The layer-list class names. Megatron-DeepSpeed names its pipeline layers `EmbeddingPipe` and
# `ParallelTransformerLayerPipe` and partitions with "type:transformer"; these names follow it, and
# none is a substring of another, so a "type:" regex built from them selects exactly its kinds
# (DeepSpeed matches with `regex.search(..., IGNORECASE)`, module.py `_find_layer_type`).
EMBEDDING_CLASS = "EmbeddingPipe"
LAYER_CLASS = "TransformerLayerPipe"
NORM_CLASS = "NormPipe"
HEAD_CLASS = "HeadPipe"
TIED_KEY = "embed"
"""The `TiedLayerSpec` key of a tied embedding and head (the head is the embedding's class)."""

# A transformer layer block: "layers.3", "model.layers.3" (the pattern common.stage_layer_counts uses).
_LAYER_RE = re.compile(r"^(?:.*\.)?layers\.(\d+)(?:\..*)?$")
_NORM_NAMES = ("norm", "final_layernorm", "ln_f")
_HEAD_NAMES = ("output", "lm_head")


# ---- DeepSpeed's partition algorithms ----------------------------------------------------------

def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`deepspeed.runtime.utils.partition_uniform`: `num_items // num_parts` items per part, the
    remainder one each to the first parts; with no more items than parts, one item per part and
    the trailing parts empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """`deepspeed.runtime.utils.partition_balanced`: the contiguous split of `weights` into
    `num_parts` parts that minimises (largest part sum - smallest part sum), by dynamic programming
    over (items, parts). Ties go to the *last* split point tried (DeepSpeed compares with `>=`),
    which decides where zero-weight items land, so this keeps that order exactly; "type:" weights
    are 0/1, so the sums are exact integers here as in DeepSpeed's float64 arrays."""
    return list(_partition_balanced(tuple(weights), num_parts))


@functools.lru_cache(maxsize=256)
def _partition_balanced(weights: tuple[int, ...], num_parts: int) -> tuple[int, ...]:
    # Cached and vectorised over the split point: `suggest --target deepspeed` asks for the same
    # layer lists' partitions for every pipeline configuration (search/targets.py).
    n = len(weights)
    if n <= num_parts:
        return tuple(partition_uniform(n, num_parts))
    prefix = np.array([0, *itertools.accumulate(weights)], dtype=np.float64)
    # The first i items in j parts, best split: its largest and smallest part sums and where its
    # last part starts (split); a pair never reached is infinite, as DeepSpeed's arrays start.
    largest = np.full((n + 1, num_parts + 1), np.inf)
    smallest = np.full((n + 1, num_parts + 1), np.inf)
    largest[0, 0] = 0.0
    split = np.zeros((n + 1, num_parts + 1), dtype=np.int64)
    for i in range(1, n + 1):
        part = prefix[i] - prefix[:i]  # the last part starting at k = 0 .. i - 1
        for j in range(1, min(i, num_parts) + 1):
            big = np.maximum(largest[:i, j - 1], part)
            small = np.minimum(smallest[:i, j - 1], part)
            spread = big - small
            k = i - 1 - int(np.argmin(spread[::-1]))  # the last k of the least spread: `>=`, as in DeepSpeed
            largest[i, j], smallest[i, j], split[i, j] = big[k], small[k], k
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(int(split[parts[-1], j]))
    return tuple(parts[::-1])


# ---- the layer list ----------------------------------------------------------------------------

def _layer_classes(plan: Plan, shape: TransformerShape | None) -> list[str | None]:
    """The class name each plan block's `LayerSpec` carries in the written layer list, or None for a
    block of a kind this module cannot name (a model file's own modules): such a block must not
    match the written "type:" regex, which then counts it as weight 0."""
    names = plan.block_names
    layer_at = [i for i, name in enumerate(names) if _LAYER_RE.match(name)]
    last_layer = layer_at[-1] if layer_at else -1
    tied = bool(shape and shape.tie_embeddings)
    classes: list[str | None] = []
    for i, name in enumerate(names):
        if _LAYER_RE.match(name):
            classes.append(LAYER_CLASS)
        elif shape is None:
            # Not a decoder this module knows: its first block is autoplan's synthetic group of
            # everything before the layers, the rest are the model's own modules.
            classes.append(None)
        elif i == 0 and name == "embedding":
            classes.append(EMBEDDING_CLASS)
        elif i == len(names) - 1 and i > last_layer and name.rsplit(".", 1)[-1] in _HEAD_NAMES:
            # A tied head is `TiedLayerSpec(TIED_KEY, EmbeddingPipe, forward_fn=...)`, so its class
            # is the embedding's (module.py `TiedLayerSpec`, `_index_tied_modules`).
            classes.append(EMBEDDING_CLASS if tied else HEAD_CLASS)
        elif i > last_layer >= 0 and name.rsplit(".", 1)[-1] in _NORM_NAMES:
            classes.append(NORM_CLASS)
        else:
            classes.append(None)
    return classes


def _layer_list(plan: Plan, classes: list[str | None], tied: bool) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for index, (name, cls) in enumerate(zip(plan.block_names, classes, strict=True)):
        entry: dict[str, object] = {"index": index, "block": name, "class": cls}
        if tied and cls == EMBEDDING_CLASS:
            entry["tied_key"] = TIED_KEY
        out.append(entry)
    return out


# ---- choosing the partition method ---------------------------------------------------------------

def _candidates(classes: list[str | None], num_stages: int) -> Iterator[tuple[str, list[int]]]:
    """(partition_method, parts) for every method whose cuts depend only on the layer list, in order
    of preference: "uniform" (no class names involved), then "type:" regexes over the written class
    names, the transformer layers alone first (Megatron-DeepSpeed's choice), then by size.
    "parameters" is left out: its cuts depend on the user's layers' parameter counts (vocabulary
    padding, tensor-parallel shards, tied copies), which the plan cannot promise."""
    yield "uniform", partition_uniform(len(classes), num_stages)
    kinds = sorted({c for c in classes if c is not None}, key=lambda c: (c != LAYER_CLASS, c))
    for size in range(1, len(kinds) + 1):
        for subset in itertools.combinations(kinds, size):
            weights = [int(c in subset) for c in classes]
            yield "type:" + "|".join(subset), partition_balanced(weights, num_stages)


def _nearest(candidates: Iterator[tuple[str, list[int]]], target: list[int]) -> tuple[str, list[int]]:
    """The first candidate with the target's cuts, else the one whose cuts move the fewest blocks
    (sum of |cut - planned cut|), the earlier on a tie."""
    best, best_distance = None, math.inf
    for method, parts in candidates:
        distance = sum(abs(a - b) for a, b in zip(parts, target, strict=True))
        if distance < best_distance:
            best, best_distance = (method, parts), distance
        if distance == 0:
            break
    assert best is not None  # "uniform" always comes first
    return best


def _rank_cuts(plan: Plan) -> list[int]:
    """The block cuts with one stage per pp rank: each rank's (virtual) stages' blocks merged, ranks
    in order. Stage 0 is on rank 0 and the last stage on rank pp - 1, so the embedding and the head
    keep their ranks."""
    counts = [0] * plan.pp
    for stage in plan.stages:
        counts[stage.pp_rank] += stage.end_block - stage.first_block
    return [0, *itertools.accumulate(counts)]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _describe_parts(parts: list[int], classes: list[str | None], names: tuple[str, ...]) -> str:
    out = []
    for stage, (a, b) in enumerate(itertools.pairwise(parts)):
        layers = sum(1 for c in classes[a:b] if c == LAYER_CLASS)
        span = f"{names[a]} .. {names[b - 1]}" if b > a else "empty"
        out.append(f"stage {stage}: {_count(b - a, 'block')}, {_count(layers, 'transformer layer')} ({span})")
    return "; ".join(out)


# ---- the file ------------------------------------------------------------------------------------

def _topology(plan: Plan) -> dict[str, list]:
    """`ProcessTopology(axes, dims)` (runtime/pipe/topology.py) numbering ranks as the plan does
    (plan.py [Note: rank layout]): the last axis varies fastest. "tp-dp-pp" is DeepSpeed's own
    `PipeModelDataParallelTopology` (axes pipe, data, model); "tp-pp-dp" swaps pipe and data."""
    axes, dims = (["pipe", "data"], [plan.pp, plan.dp]) if plan.rank_order == "tp-dp-pp" else (
        ["data", "pipe"], [plan.dp, plan.pp])
    if plan.tp > 1:
        axes, dims = [*axes, "model"], [*dims, plan.tp]
    return {"axes": axes, "dims": dims}


def _command(plan: Plan, filename: str | None) -> str:
    cluster = plan.cluster_obj()
    per_node = max(1, min(plan.num_gpus, cluster.gpus_per_node))
    nodes = -(-plan.num_gpus // per_node)
    config = filename or "ds_config.json"  # as the user named it, relative to where they exported
    launch = f"deepspeed --num_gpus {per_node}" if nodes == 1 else (
        f"deepspeed --hostfile hostfile --num_nodes {nodes} --num_gpus {per_node}")
    return f"{launch} train.py --deepspeed --deepspeed_config {config}"


def _dumps(value: object, indent: str = "") -> str:
    """JSON with one line per short object or list (a layer entry, a topology), so a long layer list
    stays readable; `json.loads` of the result equals `value`."""
    flat = json.dumps(value)
    if not isinstance(value, (dict, list)) or not value or len(indent) + len(flat) <= 100:
        return flat
    inner = indent + "  "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in value) + "\n" + indent + "]"


def write(plan: Plan, *, filename: str | None = None) -> Export:
    """`plan` as a DeepSpeed JSON config plus `PipelineModule` arguments (pp > 1); every way the
    written file differs from the plan is one sentence in `Export.differences`."""
    differences = Findings()
    notes: list[str] = []
    shape = model_shape(plan)
    config, pipeline, autotp = _configure(plan, shape, differences, notes)
    notes.append("optimizer: pass yours to deepspeed.initialize(optimizer=...) or add an \"optimizer\" section; "
                 "autoplan's prediction assumes Adam with fp32 states")
    notes.append(f"data: each data-parallel rank's loader yields micro-batches of {plan.micro_batch_size} samples"
                 + (f" of {plan.job.seq_len} tokens" if shape is not None else "")
                 + (", the same ones on every rank of a tensor-parallel group" if autotp else ""))

    command = _command(plan, filename)
    doc: dict[str, object] = {
        "_autoplan_differences": list(differences),
        "_autoplan": {
            "plan": plan_summary(plan),
            "run": command,
            "deepspeed": DEEPSPEED_VERSION,
            "notes": notes,
            "stages": stage_lines(plan),
        },
        **config,
    }
    if pipeline is not None:
        doc["autoplan_pipeline_module"] = pipeline
    return Export(target="deepspeed", text=_dumps(doc) + "\n", command=command,
                  differences=tuple(differences), notes=tuple(notes))


def mismatches(plan) -> list[Mismatch]:
    """What DeepSpeed cannot run as planned in `plan`'s configuration, found by the code `write`
    runs, all but the stage cuts (whether a partition_method reproduces them is checked on a plan's
    own cuts). `plan` is a Plan, or any object with a ParallelConfig's fields, `job`, `model` and
    `block_names` (the search's configurations: search/targets.py)."""
    return collect_mismatches(lambda found: _configure(plan, model_shape(plan), found, [], cuts=False))


def _configure(plan: Plan, shape: TransformerShape | None, differences: Findings, notes: list[str], *,
               cuts: bool = True) -> tuple[dict[str, object], dict[str, object] | None, bool]:
    """The JSON config, the PipelineModule arguments (pp > 1, else None; `cuts=False`: without the
    partition, for a configuration with no cuts yet) and whether tensor parallelism is AutoTP."""
    config: dict[str, object] = {}
    if plan.cp > 1:
        # No nearest config: DeepSpeed's data-parallel ranks take whole sequences, so a cp group's
        # shared sequences cannot be stated without changing the batch per rank.
        # export_plan completes the message with the targets that do write this plan.
        raise TargetRefusal(f"DeepSpeed's config has no context parallelism (the plan splits each sequence over cp "
                            f"{plan.cp} ranks); re-plan with --cp 1 for DeepSpeed", dims={"cp"})

    # Batch: DeepSpeed asserts train_batch_size == micro * gas * world_size (runtime/config.py
    # `DeepSpeedConfig._batch_assertion`). world_size is the mpu's data-parallel size when there is an
    # mpu (a PipelineModule's grid: the plan's dp), else every rank (`dist.get_world_size()`):
    # deepspeed.initialize builds a plain module's DeepSpeedConfig before AutoTP makes its tensor-
    # parallel groups (engine.py `_configure_tensor_parallel_states`), so under AutoTP the count
    # includes the tp ranks, which all read the same micro-batch (the engine checks that they do,
    # `check_dataloader_inputs_same_across_ranks`; its dp_world_size is then world / tp).
    batch = plan.micro_batch_size * plan.num_microbatches * plan.dp
    if batch != plan.job.global_batch:
        differences.differ({"micro_batch_size", "num_microbatches", "dp"}, f"the plan's global batch {plan.job.global_batch} is not micro-batch "
                           f"{plan.micro_batch_size} x {plan.num_microbatches} micro-batches x dp {plan.dp}; "
                           f"DeepSpeed asserts that product, so train_batch_size is written as {batch}")
    autotp = plan.tp > 1 and plan.pp == 1
    config["train_batch_size"] = batch * plan.tp if autotp else batch
    if autotp:
        notes.append(f"train_batch_size {batch * plan.tp} is DeepSpeed's count under AutoTP: micro-batch "
                     f"{plan.micro_batch_size} x {plan.num_microbatches} accumulation steps x all {plan.num_gpus} "
                     f"ranks, each of the {plan.tp} ranks of a tensor-parallel group counting the micro-batch they "
                     f"share; a step trains on {batch} distinct samples (x dp {plan.dp}), the plan's global batch")
    config["train_micro_batch_size_per_gpu"] = plan.micro_batch_size
    config["gradient_accumulation_steps"] = plan.num_microbatches

    # Precision: mixed precision in bf16 / fp16 with fp32 optimizer state, or fp32 with neither
    # section (runtime/config.py `get_bfloat16_config`, `get_float16_config`).
    if plan.job.dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif plan.job.dtype == "float16":
        config["fp16"] = {"enabled": True}
    elif plan.job.dtype != "float32":
        raise ExportError(f"the plan's dtype {plan.job.dtype!r} has no DeepSpeed precision section; "
                          "re-plan with --dtype bf16, fp16 or fp32", dims={"job"})

    config["zero_optimization"] = {"stage": _zero_stage(plan, differences)}
    if plan.job.dtype == "bfloat16":
        # The dtype gradients are reduced in (runtime/config.py `communication_data_type`), which
        # DeepSpeed otherwise takes from the bf16 section (the engine's communication_data_type:
        # bf16): the plan's reduce dtype, fp32 unless it says bfloat16.
        config["communication_data_type"] = "bf16" if plan.reduce_dtype == "bfloat16" else "fp32"

    if autotp:
        # DeepSpeed's own tensor parallelism for a plain module: AutoTP training shards the model's
        # linear layers (runtime/tensor_parallel/config.py `TPTrainingConfig.autotp_size`). It has no
        # sequence parallelism: activations stay whole along the sequence.
        config["tensor_parallel"] = {"autotp_size": plan.tp}
        notes.append(f"tensor parallelism {plan.tp}: DeepSpeed's AutoTP shards the model's nn.Linear layers "
                     "(a Hugging Face-style model); pass the model to deepspeed.initialize unsharded")
        if plan.sequence_parallel:
            differences.differ({"sequence_parallel", "tp", "pp"}, "sequence parallelism: DeepSpeed's AutoTP does not shard activations along the "
                               "sequence; written without it, so activation memory is higher than predicted")
    if plan.pp == 1 and plan.recompute != "none":
        # A plain module recomputes what its own forward checkpoints; DeepSpeed's JSON has no switch
        # for it (the `activation_checkpointing` section only configures deepspeed.checkpointing).
        notes.append(f"recompute {plan.recompute}: checkpoint "
                     + ("every transformer layer" if plan.recompute == "full" else "each layer's attention core")
                     + " in your model's forward (deepspeed.checkpointing.checkpoint or torch.utils.checkpoint); "
                     "DeepSpeed's config cannot switch it on for a model that is not a PipelineModule")

    pipeline = _pipeline_module(plan, shape, config, differences, notes, cuts=cuts) if plan.pp > 1 else None
    return config, pipeline, autotp


def _zero_stage(plan: Plan, differences: Findings) -> int:
    """autoplan's zero as DeepSpeed's ZeRO stage: 0 DDP, 1 optimizer states, 2 + gradients (autoplan's
    zero 2 is FSDP2 without resharding after forward, ZeRO-2's P_os+g: cost/memory.py), 3 + parameters."""
    stage = plan.zero
    if plan.pp > 1 and plan.zero >= 2:
        # runtime/pipe/engine.py `PipelineEngine.__init__` asserts stage < 2 ("ZeRO-2 and ZeRO-3 are
        # incompatible with pipeline parallelism"): stage 1 is the most DeepSpeed shards there.
        stage = 1
        differences.differ({"zero", "pp"}, f"zero {plan.zero} with pipeline parallelism: DeepSpeed's PipelineEngine refuses ZeRO "
                           f"stages 2 and 3, so ZeRO stage 1 is written (optimizer states sharded over the "
                           f"{plan.dp} data-parallel ranks; gradients"
                           + (" and parameters" if plan.zero == 3 else "")
                           + " whole on every rank), so memory per GPU is higher than predicted")
    if plan.dp_replicate > 1:
        # MiCS, DeepSpeed's hybrid sharding, is gone in 0.19.8 (runtime/config.py
        # `_REMOVED_ZERO_CONFIG_KEYS` rejects mics_shard_size); ZeRO shards over the whole dp group.
        differences.differ({"dp_replicate"}, f"HSDP {plan.dp_replicate} x {plan.dp_shard}: DeepSpeed {DEEPSPEED_VERSION} has no "
                           f"hybrid sharding (MiCS was removed), so ZeRO stage {stage} shards over all {plan.dp} "
                           "data-parallel ranks: less memory, more inter-node traffic than predicted")
    if plan.ep > 1:
        # DeepSpeed's expert parallelism is a model-side layer (deepspeed.moe.layer.MoE(ep_size=...)),
        # not a config key: the JSON cannot split the model's own experts.
        differences.differ({"ep"}, f"ep {plan.ep}: DeepSpeed splits experts only inside its own deepspeed.moe.layer.MoE "
                           "(ep_size is an argument of that layer, not of the config), so this config keeps every "
                           "expert on every rank: more memory, no all-to-all")
    if plan.expert_tp > 1:
        differences.differ({"expert_tp"}, f"expert tp {plan.expert_tp}: DeepSpeed's JSON has no expert tensor parallelism, so each "
                           "expert stays whole on every rank: more memory than planned")
    return stage


def placeable_cuts(plan) -> list[list[int]]:
    """Every stage cutting DeepSpeed can make of `plan`'s blocks for its pp ranks: the parts of each
    partition_method whose cuts depend only on the layer list (`_candidates`), in its order of
    preference, without repeats. `autoplan suggest --target deepspeed` prices these cuttings in
    place of the searched one (search/targets.py); `plan` needs `block_names`, `model` and `pp`."""
    out: list[list[int]] = []
    for _, parts in _candidates(_layer_classes(plan, model_shape(plan)), plan.pp):
        if parts not in out:
            out.append(parts)
    return out


def _pipeline_module(plan: Plan, shape: TransformerShape | None, config: dict[str, object],
                     differences: Findings, notes: list[str], *, cuts: bool = True) -> dict[str, object] | None:
    """The `PipelineModule` arguments and layer list, recording the schedule, cut and recompute
    differences; with `cuts=False` (a configuration without cuts) the schedule and recompute ones
    only, and None."""
    classes = _layer_classes(plan, shape)
    runs = schedule_spec(plan.schedule).exports["deepspeed"]  # what DeepSpeed runs for it (schedule/specs.py)
    one_f_one_b = plan.virtual_stages == 1 and runs.difference is None
    target = list(plan.boundaries) if cuts and one_f_one_b else _rank_cuts(plan) if cuts else []
    if not one_f_one_b:
        # runtime/pipe/engine.py `PipelineEngine.train_batch` runs `schedule.TrainSchedule`, a 1F1B
        # schedule over one stage per rank (`PipelineModule` builds parts[stage_id]..parts[stage_id+1]).
        if plan.virtual_stages > 1:
            merged = ", ".join(f"rank {r}: {b - a} blocks" for r, (a, b) in enumerate(itertools.pairwise(target)))
            differences.differ({"schedule", "virtual_stages"},
                               f"{plan.schedule} with {plan.virtual_stages} stages per rank: DeepSpeed's "
                               "PipelineEngine runs one stage per rank (its 1F1B TrainSchedule), so each rank's "
                               f"blocks are merged into one stage{f' ({merged})' if merged else ''} and the bubble "
                               "is larger than predicted")
        else:
            differences.differ({"schedule"}, runs.difference)
    if cuts:
        method, parts = _nearest(_candidates(classes, plan.pp), target)
    else:
        method, parts = "uniform", target
    if parts != target:
        planned = "the plan's blocks merged per rank cut" if target != list(plan.boundaries) else "the plan cuts"
        differences.append(
            f"stage cuts: {planned} the {len(classes)} blocks at {target}, which no DeepSpeed partition_method "
            "reproduces (PipelineModule takes 'uniform', 'parameters' or 'type:REGEX', not explicit cuts); "
            f"written partition_method=\"{method}\", the closest, which cuts at {parts} "
            f"({_describe_parts(parts, classes, plan.block_names)}), so stage times differ from the prediction")

    interval = 0
    named = LAYER_CLASS in classes
    if plan.recompute != "none":
        # The pipeline's recompute: `activation_checkpoint_interval` layers per checkpoint
        # (module.py `PipelineModule.forward`), read from the JSON too (engine.py reads
        # pipeline.activation_checkpoint_interval and sets it on the module).
        interval = 1
        config["pipeline"] = {"activation_checkpoint_interval": interval}
        if plan.recompute == "selective" and named:
            differences.differ({"recompute"}, "recompute selective: DeepSpeed's PipelineModule checkpoints whole layers "
                               "(activation_checkpoint_interval), not the attention core alone; written as "
                               "activation_checkpoint_interval=1 on every transformer layer (full recompute), so "
                               "the step is slower and memory lower than predicted")
    kwargs: dict[str, object] = {"num_stages": plan.pp, "partition_method": method,
                                 "activation_checkpoint_interval": interval}
    if interval and named:
        # Without a list DeepSpeed checkpoints every layer holding parameters, the embedding too
        # (module.py `_is_checkpointable`); the plan recomputes the transformer layers only
        # (runtime/execution/recompute.py RECOMPUTED_KINDS).
        kwargs["checkpointable_layers"] = [LAYER_CLASS]
    elif interval:
        # No block is a transformer layer this module can name, so DeepSpeed's default stands: every
        # layer with parameters is checkpointed. Non-reentrant checkpointing lets the first layer,
        # whose input needs no gradient, still get its weights' gradients (engine.py use_reentrant).
        config["pipeline"] = {"activation_checkpoint_interval": interval, "use_reentrant": False}
        differences.differ({"recompute", "model"}, f"recompute {plan.recompute}: the layer list cannot say which of this model's blocks are "
                           "its layers, so DeepSpeed checkpoints every block with parameters, whole (the first and "
                           "last too), so the step is slower than predicted")
    if plan.tp > 1:
        notes.append(f"tensor parallelism {plan.tp}: your layers must be tensor-parallel over the topology's "
                     "'model' axis (PipelineModule's grid is the engine's mpu), e.g. Megatron-DeepSpeed's "
                     "ParallelTransformerLayerPipe"
                     + (" with its sequence parallelism on" if plan.sequence_parallel else ""))
    if not cuts:
        return None
    if None in classes and method.startswith("type:"):
        notes.append("layers with \"class\": null are your model's own modules: their class names must not "
                     f"match the partition regex {method!r}")
    return {
        "usage": "deepspeed.pipe.PipelineModule(layers=[one LayerSpec(<class>) per entry of 'layers', in order; "
                 "TiedLayerSpec(tied_key, <class>) where tied_key is set], topology=deepspeed.runtime.pipe.topology."
                 "ProcessTopology(**topology), **kwargs); DeepSpeed then computes 'parts'",
        "kwargs": kwargs,
        "topology": _topology(plan),
        "parts": parts,
        "layers": _layer_list(plan, classes, bool(shape and shape.tie_embeddings)),
    }
