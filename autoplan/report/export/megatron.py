"""Megatron-LM export: the plan as the full argument list of Megatron-LM's `pretrain_gpt.py`
(Megatron-LM core_v0.16.1, megatron-core 0.16.1), written as a bash file.

The file defines `MEGATRON_ARGS` (model shape, parallel layout, schedule, recompute, sharding, batch
and precision) and, when executed rather than sourced, runs `torchrun ... pretrain_gpt.py
"${MEGATRON_ARGS[@]}" ... "$@"`. Flag names and rules are those of Megatron-LM's
`megatron/training/arguments.py` at core_v0.16.1 (recorded in
tests/data/megatron_lm_core_v0.16.1_flags.json) and of megatron-core's `TransformerConfig`.

The stage cuts go into `--pipeline-model-parallel-layout` (megatron-core
`PipelineParallelLayerLayout`): one `|`-separated entry per (virtual) stage in stage order, `E`
for the embedding, `t` per transformer layer, `L` for the loss (output layer and final norm). It
states any cut autoplan makes, uneven middle stages and empty stages included, and sets the
virtual stages (entries / pp), which the older `--decoder-first/last-pipeline-num-layers` flags
cannot (validate_args / TransformerConfig refuse 0 layers and uneven middles).

docs/export-megatron.md has the mapping table and what does not translate.
"""

from __future__ import annotations

import math
import shlex

from autoplan.plan import Plan
from autoplan.report.export.common import (
    Export,
    ExportError,
    Findings,
    Mismatch,
    MoEShape,
    TargetRefusal,
    TransformerShape,
    collect_mismatches,
    model_kind,
    model_shape,
    moe_shape,
    plan_summary,
    stage_layer_counts,
    stage_lines,
)
from autoplan.report.export.megatron_moe import expert_layout_args, moe_model_args
from autoplan.schedule import schedule_spec

__all__ = ["MEGATRON_VERSION", "mismatches", "pipeline_layout", "placeable_cuts", "write"]

MEGATRON_VERSION = "core_v0.16.1"
"""The Megatron-LM release whose flags and rules this target writes."""

# Flags that choose the training data; the run defaults add --mock-data only when none is given,
# because validate_args allows a single data source.
_DATA_FLAGS = ("--mock-data", "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
               "--data-args-path", "--per-split-data-args-path")

# What a plan does not fix but pretrain_gpt.py needs to start: an iteration count and a learning
# rate (megatron/training/training.py builds the optimizer and the loop from them). They come before
# "$@", so a flag given on the command line overrides them (argparse keeps the last value).
_RUN_DEFAULTS = (("--train-iters", "100"), ("--lr", "1.0e-4"))


def pipeline_layout(plan: Plan) -> str:
    """The plan's stages as Megatron's `--pipeline-model-parallel-layout` string: per stage in
    stage order (stage s on pp rank s % pp, virtual stage s // pp: PipelineParallelLayerLayout's
    own order), `E` on the first stage, `t*N` for its N layers, `L` on the last stage."""
    counts = stage_layer_counts(plan)
    entries = []
    for index, count in enumerate(counts):
        entry = "E" if index == 0 else ""
        entry += "t" * count if count <= 1 else f"t*{count}"
        entry += "L" if index == len(counts) - 1 else ""
        entries.append(entry)
    return "|".join(entries)


def write(plan: Plan, *, filename: str | None = None) -> Export:
    """The plan as a bash file of Megatron-LM arguments; see the module docstring."""
    shape, moe = _shapes(plan)
    differences = Findings()
    notes: list[str] = []
    sections = _sections(plan, shape, moe, differences)
    notes += _notes(plan, shape)
    name = filename or "megatron_args.sh"
    command = f"MEGATRON_LM=/path/to/Megatron-LM bash {shlex.quote(name)}"
    nodes = _nodes(plan)[1]
    if nodes > 1:
        command = f"NODE_RANK=<0..{nodes - 1}> MASTER_ADDR=<first node> " + command
    text = _render(plan, sections, differences, notes, command, uses_fsdp=_uses_fsdp(sections))
    return Export("megatron", text, command, tuple(differences), tuple(notes))


def mismatches(plan) -> list[Mismatch]:
    """What Megatron-LM cannot run as planned in `plan`'s configuration, found by the code `write`
    runs, all but the stage cuts (the final norm's placement is checked on a plan's own cuts).
    `plan` is a Plan, or any object with a ParallelConfig's fields, `job` and `model` (the search's
    configurations: search/targets.py)."""

    def configure(found: Findings) -> None:
        shape, moe = _shapes(plan)
        _sections(plan, shape, moe, found, cuts=False)

    return collect_mismatches(configure)


def _shapes(plan: Plan) -> tuple[TransformerShape, MoEShape | None]:
    shape, moe = model_shape(plan), None
    if shape is None and (found := moe_shape(plan)) is not None:
        shape, moe = found
    if shape is None:
        # export_plan completes the message with the targets that do write this plan.
        raise TargetRefusal(
            f"Megatron-LM's pretrain_gpt.py builds only GPT and Llama-like decoders (dense, or with the zoo's "
            f"experts), and autoplan cannot read {plan.model!r} as one ({model_kind(plan)})", dims={"model"})
    return shape, moe


def _sections(plan: Plan, shape: TransformerShape, moe: MoEShape | None, differences: Findings, *,
              cuts: bool = True) -> list[tuple[str, list[Arg]]]:
    """The file's argument groups, in order; `cuts=False` leaves out the stage layout (the search's
    configurations have no cuts yet)."""
    return [
        ("model (the plan's model, as megatron-core's GPTModel builds it)", _model_args(plan, shape, differences)),
        *([("mixture of experts (megatron-core MoELayer)", moe_model_args(plan, moe, differences, shape.num_layers))] if moe else []),
        ("vocabulary (tokenizer.py build_tokenizer: --padded-vocab-size is the model's vocabulary)",
         _vocab_args(plan, shape, differences)),
        ("parallelism and pipeline stages", _parallel_args(plan, differences, cuts=cuts)
         + (expert_layout_args(plan, differences) if moe else [])),
        ("activation recompute", _recompute_args(plan)),
        ("data-parallel sharding", _sharding_args(plan, shape, differences)),
        ("batch and precision", _batch_args(plan, differences)),
    ]


# ---- model -----------------------------------------------------------------------------------

Arg = tuple[str, "str | None"]


def _model_args(plan: Plan, shape: TransformerShape, differences: Findings) -> list[Arg]:
    if plan.tp > 1 and shape.num_heads % plan.tp:
        # TransformerConfig.__post_init__: num_attention_heads must be a multiple of tp.
        raise ExportError(f"Megatron-LM needs the {shape.num_heads} attention heads divisible by tp {plan.tp}; "
                          "re-plan with a tp that divides them", dims={"model", "tp"})
    if shape.num_kv_heads % plan.tp and plan.tp % shape.num_kv_heads:
        # TransformerConfig.__post_init__: num_query_groups must be a multiple or a divisor of tp.
        raise ExportError(f"Megatron-LM needs the {shape.num_kv_heads} key/value heads to be a multiple or a "
                          f"divisor of tp {plan.tp}; re-plan with such a tp", dims={"model", "tp"})
    if plan.job.seq_len > shape.max_seq_len:
        # validate_args: max_position_embeddings >= seq_length.
        raise ExportError(f"sequence length {plan.job.seq_len} exceeds the model's {shape.max_seq_len} positions, "
                          "which Megatron-LM refuses; re-plan with a shorter --seq-len", dims={"model", "job"})
    args: list[Arg] = [
        ("--num-layers", str(shape.num_layers)),
        ("--hidden-size", str(shape.hidden_size)),
        ("--ffn-hidden-size", str(shape.ffn_hidden_size)),
        ("--num-attention-heads", str(shape.num_heads)),
    ]
    if shape.head_size is not None:
        # Some Llama-like checkpoints (e.g. Mistral NeMo) set head_dim apart from hidden / heads;
        # Megatron's --kv-channels is that size (validate_args defaults it to hidden / heads).
        args.append(("--kv-channels", str(shape.head_size)))
    if shape.num_kv_heads != shape.num_heads:
        args += [("--group-query-attention", None), ("--num-query-groups", str(shape.num_kv_heads))]
    if shape.qk_norm:
        # Qwen3's per-head q/k RMSNorm: --qk-layernorm, of the model's --normalization (RMSNorm).
        args.append(("--qk-layernorm", None))
    args += [
        ("--max-position-embeddings", str(shape.max_seq_len)),
        ("--seq-length", str(plan.job.seq_len)),
        ("--norm-epsilon", repr(float(shape.norm_eps))),
    ]
    if shape.family == "llama":
        # Llama: RMSNorm, SwiGLU (F.silu gated: core_transformer_config_from_args), no biases,
        # rotary positions applied to the whole head (--rotary-percent 1.0, the default), rotate-half
        # rather than interleaved pairs (the default), as the zoo and transformers' Llama do.
        args += [("--normalization", "RMSNorm"), ("--swiglu", None), ("--disable-bias-linear", None),
                 ("--position-embedding-type", "rope")]
        theta = float(shape.rope_theta if shape.rope_theta is not None else 10000.0)
        if theta != int(theta):
            differences.differ({"model"}, f"rotary base {theta:g} is not an integer and Megatron-LM's --rotary-base takes "
                               f"an int: written as {round(theta)}, so positions rotate slightly differently")
        args.append(("--rotary-base", str(round(theta))))
    else:
        # GPT: LayerNorm, GELU, biases and learned absolute positions are Megatron's defaults. The
        # zoo's tanh-approximated GELU is what Megatron runs too: with biases, MLP uses the fused
        # bias_gelu (megatron/core/fusions/fused_bias_gelu.py), a tanh approximation.
        args += [("--normalization", "LayerNorm"), ("--position-embedding-type", "learned_absolute")]
    if not shape.tie_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    # The zoo and Llama-like checkpoints train without dropout; Megatron's defaults are 0.1.
    args += [("--attention-dropout", "0.0"), ("--hidden-dropout", "0.0")]
    return args


def _vocab_args(plan: Plan, shape: TransformerShape, differences: Findings) -> list[Arg]:
    vocab = shape.vocab_size
    # The output layer and embedding are split over tp (tensor_parallel/layers.py divide), so the
    # vocabulary must be a multiple of tp; Megatron pads it to one.
    padded = math.ceil(vocab / plan.tp) * plan.tp
    if padded != vocab:
        differences.differ({"model", "tp"}, f"the vocabulary of {vocab} is not divisible by tp {plan.tp}, which Megatron's "
                           f"vocab-parallel embedding and output layer need: padded to {padded} "
                           f"({padded - vocab} unused rows of embedding and logits)")
    # _NullTokenizer(vocab_size) holds vocab_size + 1 tokens (its EOD id is vocab_size), so
    # --vocab-size V - 1 gives the plan's V; --padded-vocab-size keeps Megatron from padding it to a
    # multiple of 128 * tp (its default --make-vocab-size-divisible-by).
    return [("--tokenizer-type", "NullTokenizer"), ("--vocab-size", str(vocab - 1)),
            ("--padded-vocab-size", str(padded))]


# ---- parallelism -----------------------------------------------------------------------------

def _parallel_args(plan: Plan, differences: Findings, *, cuts: bool = True) -> list[Arg]:
    if plan.num_gpus != plan.tp * plan.pp * plan.dp:
        raise ExportError(f"the plan's {plan.num_gpus} GPUs are not tp x pp x dp = {plan.tp * plan.pp * plan.dp}; "
                          "re-plan (the plan file is inconsistent)", dims={"tp", "pp", "dp"})
    args: list[Arg] = [("--tensor-model-parallel-size", str(plan.tp)),
                       ("--pipeline-model-parallel-size", str(plan.pp))]
    if plan.cp > 1:
        # Megatron's rank order is tp-cp-ep-dp-pp (parallel_state): cp inside dp, as autoplan's cp
        # groups are consecutive dp ranks. Its default exchange is a ring of p2p (--cp-comm-type p2p)
        # where autoplan prices an all-gather; each rank moves the same (cp - 1) / cp of the keys and
        # values either way (docs/export-megatron.md).
        args.append(("--context-parallel-size", str(plan.cp)))
    if plan.rank_order == "tp-pp-dp":
        # Megatron's default rank order is tp-cp-ep-dp-pp (parallel_state), autoplan's "tp-dp-pp".
        args.append(("--use-tp-pp-dp-mapping", None))
    if plan.sequence_parallel and plan.tp > 1:
        # validate_args switches sequence parallelism off with tp == 1 (as autoplan's is a no-op then).
        args.append(("--sequence-parallel", None))
    if plan.pp > 1:
        if cuts:
            args.append(("--pipeline-model-parallel-layout", pipeline_layout(plan)))
            _check_final_norm(plan, differences)
        spec = schedule_spec(plan.schedule)  # what Megatron-LM runs for it (schedule/specs.py)
        if spec.exports["megatron"].difference is not None:
            differences.differ({"schedule", "pp"}, spec.exports["megatron"].difference)
        elif spec.looped and plan.num_microbatches % plan.pp:
            # schedules.py forward_backward_pipelining_with_interleaving, default group size pp.
            raise ExportError(f"Megatron's interleaved schedule needs the {plan.num_microbatches} micro-batches "
                              f"divisible by pp {plan.pp}; re-plan", dims={"schedule", "num_microbatches", "pp"})
    elif plan.num_stages > 1:
        # validate_args: virtual stages need pp > 1.
        differences.differ({"virtual_stages", "pp"}, f"{plan.num_stages} stages on one pipeline rank: Megatron-LM's virtual stages need "
                           "pp > 1, so the model runs as one stage (same work, no stage boundaries)")
    return args


def _check_final_norm(plan: Plan, differences: Findings) -> None:
    # Without MTP, megatron-core builds the final norm on the post-process stage, the one holding
    # the loss (TransformerBlock.has_final_layernorm_in_this_stage); autoplan may cut before it.
    names = plan.block_names
    if len(names) >= 2 and names[-2].rsplit(".", 1)[-1] == "norm" and plan.stages[-1].first_block > len(names) - 2:
        differences.append(f"the plan puts the final norm ({names[-2]}) on stage {_stage_of(plan, len(names) - 2)} "
                           f"and the output layer on stage {plan.num_stages - 1}; Megatron builds the final norm "
                           "with the output layer on the last stage (a negligible shift of work)")


def placeable_cuts(plan: Plan) -> list[list[int]]:
    """The cutting nearest the plan's that Megatron-LM builds as cut: where the plan puts the final
    norm on another stage than the output layer (`_check_final_norm`), the same cuts with the norm
    moved to the last stage; else none. `autoplan suggest --target megatron` prices it in place of
    the searched cutting (search/targets.py)."""
    names, cuts = plan.block_names, list(plan.boundaries)
    if (len(names) >= 2 and names[-2].rsplit(".", 1)[-1] == "norm" and len(cuts) >= 3
            and cuts[-2] == len(names) - 1 and cuts[-3] < len(names) - 2):
        return [[*cuts[:-2], len(names) - 2, cuts[-1]]]
    return []


def _stage_of(plan: Plan, block: int) -> int:
    return next(s.index for s in plan.stages if s.first_block <= block < s.end_block)


def _recompute_args(plan: Plan) -> list[Arg]:
    if plan.recompute == "full":
        # Every layer recomputed whole: uniform chunks of one layer (TransformerBlock._checkpointed_forward).
        return [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                ("--recompute-num-layers", "1")]
    if plan.recompute == "selective":
        # Megatron's selective recompute is Korthikanti et al.'s attention-core recompute; its
        # recompute_modules default is ["core_attn"] (TransformerConfig.__post_init__).
        return [("--recompute-granularity", "selective")]
    return []


def _sharding_args(plan: Plan, shape: TransformerShape, differences: Findings) -> list[Arg]:
    if plan.zero == 0:
        return []  # DistributedDataParallel all-reduces gradients: autoplan's zero 0.
    if plan.zero == 1:
        # The distributed optimizer shards optimizer states and fp32 main weights over dp and
        # reduce-scatters gradients into full-size buffers: ZeRO-1 (distrib_optimizer.py).
        return [("--use-distributed-optimizer", None)]
    # zero 2 / 3 are FSDP2 (reshard_after_forward False / True), which Megatron runs as
    # --use-torch-fsdp2 (TorchFullyShardedDataParallel, fully_shard over the dp group) when
    # validate_args allows it.
    blockers = []
    if plan.pp > 1:
        blockers.append("pipeline parallelism")
    if plan.ep > 1:
        blockers.append("expert parallelism")
    if shape.tie_embeddings:
        blockers.append("tied embeddings (it requires --untie-embeddings-and-output-weights)")
    if plan.job.dtype in ("float16", "fp16"):
        blockers.append("fp16")
    if not blockers:
        args: list[Arg] = [("--use-torch-fsdp2", None)]
        if plan.zero == 2:
            args.append(("--torch-fsdp2-no-reshard-after-forward", None))
        # validate_args: FSDP2 refuses gradient-accumulation fusion (on by default).
        args.append(("--no-gradient-accumulation-fusion", None))
        if plan.job.dtype in ("bfloat16", "bf16") and plan.reduce_dtype != "bfloat16":
            # TorchFullyShardedDataParallel calls fully_shard without a MixedPrecisionPolicy over
            # Float16Module's bf16 parameters (core_v0.16.1), so FSDP2 reduces in their dtype.
            differences.differ({"zero", "reduce_dtype", "pp", "ep"}, "gradients reduced in fp32 (the plan's reduce dtype): Megatron's torch FSDP2 wrapper "
                               "shards the bf16 parameters without a mixed-precision policy, so it reduce-scatters "
                               "bf16 gradients, half the bytes predicted and a bf16 sum; re-plan with "
                               "--reduce-dtype bfloat16 to plan what it runs")
        if plan.dp_replicate > 1:
            differences.differ({"zero", "dp_replicate", "pp", "ep"}, f"HSDP {plan.dp_replicate} x {plan.dp_shard}: Megatron's torch FSDP2 wrapper shards "
                               f"over the whole data-parallel group (a 1-D DeviceMesh), i.e. over all {plan.dp} "
                               "ranks: less memory, more cross-node all-gather / reduce-scatter traffic than "
                               "predicted")
        return args
    args = [("--use-distributed-optimizer", None)]
    if plan.reduce_dtype == "bfloat16":
        # validate_args: --grad-reduce-in-bf16 turns off accumulate_allreduce_grads_in_fp32, which
        # --bf16 otherwise turns on (the distributed optimizer's gradients reduced in fp32).
        args.append(("--grad-reduce-in-bf16", None))
    if plan.dp_replicate > 1:
        # Optimizer-state sharding inside groups of dp_shard ranks, replicated across them.
        args.append(("--num-distributed-optimizer-instances", str(plan.dp_replicate)))
    kept = "gradients" if plan.zero == 2 else "gradients and parameters"
    differences.differ({"zero", "pp", "ep", "model", "job"}, f"zero {plan.zero} (FSDP2, reshard after forward {'on' if plan.zero == 3 else 'off'}): "
                       f"Megatron-LM's --use-torch-fsdp2 does not run with {' or '.join(blockers)} "
                       f"(validate_args); written as the distributed optimizer (ZeRO-1), so every GPU keeps full "
                       f"{kept} and memory per GPU is higher than predicted")
    return args


def _batch_args(plan: Plan, differences: Findings) -> list[Arg]:
    # ConstantNumMicroBatchesCalculator: num_microbatches = global / (micro * dp).
    # Megatron's data-parallel size excludes context parallelism (world / (tp * pp * cp)): the
    # plan's dp / cp replicas.
    per_step = plan.micro_batch_size * plan.replicas * plan.num_microbatches
    if per_step != plan.job.global_batch:
        differences.differ({"micro_batch_size", "num_microbatches", "dp", "cp"}, f"global batch {plan.job.global_batch} is not micro-batch {plan.micro_batch_size} x dp "
                           f"{plan.replicas} x {plan.num_microbatches} micro-batches; written as {per_step}, which "
                           "Megatron needs to be that product")
    args: list[Arg] = [("--micro-batch-size", str(plan.micro_batch_size)), ("--global-batch-size", str(per_step))]
    if plan.job.dtype in ("bfloat16", "bf16"):
        args.append(("--bf16", None))
    elif plan.job.dtype in ("float16", "fp16"):
        args.append(("--fp16", None))  # dynamic loss scaling, Megatron's default without --loss-scale
    return args


# ---- the file --------------------------------------------------------------------------------

def _nodes(plan: Plan) -> tuple[int, int]:
    """(processes per node, nodes) for torchrun."""
    groups = plan.cluster.get("groups") or [{}]
    per_node = int(groups[0].get("gpus_per_node", plan.num_gpus) or plan.num_gpus)
    per_node = max(1, min(per_node, plan.num_gpus))
    return per_node, math.ceil(plan.num_gpus / per_node)


def _uses_fsdp(sections: list[tuple[str, list[Arg]]]) -> bool:
    return any(flag == "--use-torch-fsdp2" for _, args in sections for flag, _ in args)


def _notes(plan: Plan, shape: TransformerShape) -> list[str]:
    notes = [
        f"needs a Megatron-LM {MEGATRON_VERSION} checkout (set MEGATRON_LM) with Transformer Engine installed "
        "(the default --transformer-impl transformer_engine)",
        "data: without a data flag the run uses --mock-data and a NullTokenizer of the plan's vocabulary; pass "
        "--data-path ... (and --tokenizer-type / --tokenizer-model) after the file name to train on data, "
        f"keeping token ids below the {shape.vocab_size} of --padded-vocab-size",
        "--train-iters and --lr are placeholders for a short run; pass your own after the file name",
    ]
    per_node, nodes = _nodes(plan)
    if nodes > 1:
        notes.append(f"{nodes} nodes x {per_node} GPUs: run the file on every node with NODE_RANK=0..{nodes - 1} "
                     "and MASTER_ADDR set to the first node")
    return notes


def _render(plan: Plan, sections: list[tuple[str, list[Arg]]], differences: list[str], notes: list[str],
            command: str, *, uses_fsdp: bool) -> str:
    lines = ["#!/usr/bin/env bash",
             f"# Megatron-LM {MEGATRON_VERSION} arguments for pretrain_gpt.py, written by `autoplan export --to megatron`."]
    if differences:
        lines.append("#")
        lines.append("# DIFFERENCES FROM THE PLAN (written with --allow-approx):")
        lines += [f"#   - {d}" for d in differences]
    lines.append("#")
    lines += [f"# {line}" for line in plan_summary(plan)]
    counts = stage_layer_counts(plan)
    lines.append("# layers per stage: " + ", ".join(f"stage {i}: {c}" for i, c in enumerate(counts)))
    lines += [f"# {line}" for line in stage_lines(plan)]
    lines.append("#")
    lines += [f"# note: {n}" for n in notes]
    lines.append(f"# run it: {command} [more Megatron-LM flags]")
    lines.append("# source it (. file) to get MEGATRON_ARGS without running anything.")
    lines.append("")
    lines.append("MEGATRON_ARGS=(")
    for title, args in sections:
        if not args:
            continue
        lines.append(f"    # {title}")
        for flag, value in args:
            lines.append(f"    {flag}" + ("" if value is None else f" {shlex.quote(value)}"))
    lines.append(")")
    lines.append("")
    lines.append("# Not part of the plan; flags given after the file name come later and override them.")
    lines.append("RUN_DEFAULTS=(" + " ".join(f"{f} {v}" for f, v in _RUN_DEFAULTS) + ")")
    lines.append("")
    per_node, nodes = _nodes(plan)
    lines.append('if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then')
    lines.append("    set -eo pipefail")
    lines.append("    # validate_args allows one data source: mock data unless a data flag is given.")
    lines.append("    DATA_ARGS=(--mock-data)")
    lines.append('    for arg in "$@"; do')
    lines.append(f'        case "$arg" in {"|".join(_DATA_FLAGS)}) DATA_ARGS=() ;; esac')
    lines.append("    done")
    if plan.tp > 1 and not uses_fsdp:
        lines.append("    # validate_args: tensor parallelism before Blackwell needs one CUDA connection.")
        lines.append("    export CUDA_DEVICE_MAX_CONNECTIONS=1")
    lines.append(f"    exec torchrun --nproc-per-node {per_node} --nnodes \"${{NNODES:-{nodes}}}\" "
                 '--node-rank "${NODE_RANK:-0}" \\')
    lines.append('        --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" \\')
    lines.append('        "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM ' + MEGATRON_VERSION
                 + ' checkout}/pretrain_gpt.py" \\')
    lines.append('        "${MEGATRON_ARGS[@]}" "${RUN_DEFAULTS[@]}" ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} "$@"')
    lines.append("fi")
    return "\n".join(lines) + "\n"
