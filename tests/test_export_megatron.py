"""The Megatron-LM export (autoplan/report/export/megatron.py), on every plan of tests/export_cases.py.

What checks what:

* Megatron's own code (tests marked `export`, run where megatron-core 0.16.1 is installed, e.g.
  `.ci/run`): megatron-core's `TransformerConfig` is built from the exported arguments (the way
  Megatron-LM's `core_transformer_config_from_args` copies them, by field name) on the CPU, without a
  process group. Its `__post_init__` parses `--pipeline-model-parallel-layout` with
  `PipelineParallelLayerLayout`, validates it against `--num-layers` (`validate_layer_layout`) and
  checks heads / query groups against tp, sequence parallelism, recompute options and bf16/fp16.
  The layers per (pp rank, virtual stage) are then read from megatron-core's own
  `transformer_block.get_num_layers_to_build` and `transformer_layer.get_transformer_layer_offset`
  (with the pipeline rank and virtual size set through `parallel_state`'s setters) and must equal
  the plan's cuts, layer for layer.
* The recorded flag list (all tests, no Megatron needed): Megatron-LM's `megatron/training/arguments.py`
  is not in the megatron-core wheel, so its flags (name, action, type, nargs, choices, default) are
  recorded in tests/data/megatron_lm_core_v0.16.1_flags.json, read at tag core_v0.16.1 (commit
  55ac7082). The exported `MEGATRON_ARGS` (read back by bash itself, by sourcing the file) are parsed
  by an argparse parser built from that list: an unknown flag, a value of the wrong type or outside
  the choices fails. The `validate_args` rules recorded beside the flags (world size, layout
  divisibility, virtual stages, batch arithmetic, distributed optimizer / FSDP2 preconditions,
  recompute, sequence parallelism, max positions, vocabulary) are re-checked here in Python, each
  under the rule's key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.report.export import ExportError, export_plan, stage_layer_counts, stage_layer_ranges
from autoplan.report.export.megatron import pipeline_layout
from tests.export_cases import CASES, case

DATA = Path(__file__).parent / "data" / "megatron_lm_core_v0.16.1_flags.json"
RECORD = json.loads(DATA.read_text())

# How each case exports: the differences it must list (by a phrase of each); empty = exact.
EXPECTED_DIFFERENCES: dict[str, tuple[str, ...]] = {
    "default": (),
    # FSDP2 in Megatron reduces the bf16 parameters' gradients in bf16 (no mixed-precision policy).
    "preset-llama3-8b": ("gradients reduced in fp32",),
    "interleaved-uneven": (),
    "zb-h1": ("schedule zb-h1",),
    "zero2": ("zero 2",),
    "selective-sp": (),
    "empty-last-stage": (),
    "pp1-many-microbatches": (),
    "tp-zero0": (),
    "gpt": (),
    "autotp": (),
    "1f1b-few-microbatches": (),  # Megatron's 1F1B warms up min(pp - rank - 1, m) micro-batches: any count runs
}


def test_every_case_has_an_expectation():
    assert set(EXPECTED_DIFFERENCES) == set(CASES)


@pytest.fixture(scope="module")
def exports():
    return {name: export_plan(case(name), "megatron", allow_approx=True) for name in CASES}


def _sourced_args(text: str, tmp_path: Path) -> list[str]:
    """MEGATRON_ARGS as bash reads them, by sourcing the file (which must not run torchrun then)."""
    path = tmp_path / "args.sh"
    path.write_text(text)
    out = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\n" "${MEGATRON_ARGS[@]}"', "_", str(path)],
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.splitlines()


def _recorded_parser() -> argparse.ArgumentParser:
    """An argparse parser with exactly the recorded flags, their types, nargs and choices."""
    types = {"int": int, "float": float, "str": str, None: None}
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag, spec in RECORD["flags"].items():
        if spec["action"] in ("store_true", "store_false"):
            parser.add_argument(flag, dest=spec["dest"], action=spec["action"])
        else:
            kwargs = {k: spec[k] for k in ("nargs", "choices") if k in spec}
            parser.add_argument(flag, dest=spec["dest"], type=types[spec["type"]], default=spec["default"], **kwargs)
    return parser


def _parse(args: list[str]) -> argparse.Namespace:
    try:
        return _recorded_parser().parse_args(args)
    except (argparse.ArgumentError, SystemExit) as exc:  # pragma: no cover - the failure message
        raise AssertionError(f"Megatron-LM {RECORD['source']} would refuse {args}: {exc}") from None


def _virtual_size(ns: argparse.Namespace) -> int | None:
    """validate_args "layout-stages": virtual stages = layout entries / pp, None when 1."""
    if ns.pipeline_model_parallel_layout is None:
        return None
    stages = len(ns.pipeline_model_parallel_layout.split("|"))
    assert stages % ns.pipeline_model_parallel_size == 0, RECORD["validate_args_rules"]["layout-stages"]
    v = stages // ns.pipeline_model_parallel_size
    return None if v == 1 else v


def _check_validate_args_rules(ns: argparse.Namespace, plan) -> None:
    """The validate_args rules recorded in the data file, on the parsed arguments."""
    rules = RECORD["validate_args_rules"]
    tp, pp, cp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size
    world = plan.num_gpus
    assert world % (tp * pp * cp) == 0, rules["world-size"]
    dp = world // (tp * pp * cp)
    assert dp == plan.dp, rules["world-size"]
    splits = [ns.num_layers_per_virtual_pipeline_stage, ns.num_virtual_stages_per_pipeline_rank,
              ns.pipeline_model_parallel_layout]
    assert sum(s is not None for s in splits) <= 1, rules["one-pipeline-split"]
    v = _virtual_size(ns)
    if v is not None:
        assert pp > (1 if ns.overlap_p2p_comm else 2), rules["interleaved-pp"]
    if ns.pipeline_model_parallel_layout is None and ns.decoder_first_pipeline_num_layers is None \
            and ns.decoder_last_pipeline_num_layers is None:
        assert ns.num_layers % pp == 0, rules["num-layers-divisible"]
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        assert getattr(ns, name) is not None, rules["required"]
    assert ns.max_position_embeddings >= ns.seq_length, rules["max-positions"]
    assert ns.kv_channels is not None or ns.hidden_size % ns.num_attention_heads == 0, rules["kv-channels"]
    if ns.recompute_granularity == "selective":
        assert ns.recompute_method is None and ns.recompute_num_layers is None, rules["recompute"]
    elif ns.recompute_granularity == "full":
        assert ns.recompute_method in ("uniform", "block") and ns.recompute_num_layers, rules["recompute"]
    assert not (ns.sequence_parallel and tp == 1), rules["sequence-parallel"]
    if ns.use_torch_fsdp2:
        assert pp == 1 and not ns.use_distributed_optimizer and not ns.gradient_accumulation_fusion, \
            rules["torch-fsdp2"]
        assert ns.ckpt_format in ("torch_dist", "torch_dcp") and ns.untie_embeddings_and_output_weights, \
            rules["torch-fsdp2"]
        assert not ns.fp16, rules["torch-fsdp2"]
    assert not (ns.bf16 and ns.fp16), rules["precision"]
    micro_times_dp = ns.micro_batch_size * dp
    assert ns.global_batch_size % micro_times_dp == 0, rules["batch"]
    num_microbatches = ns.global_batch_size // micro_times_dp
    assert num_microbatches == plan.num_microbatches, rules["batch"]
    if v is not None:
        group = ns.microbatch_group_size_per_vp_stage or pp
        assert pp <= group <= num_microbatches and num_microbatches % group == 0, rules["interleaved-microbatches"]
    assert dp % ns.num_distributed_optimizer_instances == 0, rules["distributed-optimizer-instances"]
    assert ns.tokenizer_type == "NullTokenizer" and ns.vocab_size + 1 <= ns.padded_vocab_size, rules["vocab"]
    assert ns.padded_vocab_size % tp == 0, rules["vocab"]


def _expected_flags(plan) -> dict[str, object]:
    """What the plan says, as the parsed arguments must hold it."""
    return {
        "tensor_model_parallel_size": plan.tp,
        "pipeline_model_parallel_size": plan.pp,
        "micro_batch_size": plan.micro_batch_size,
        "global_batch_size": plan.job.global_batch,
        "seq_length": plan.job.seq_len,
        "sequence_parallel": plan.sequence_parallel and plan.tp > 1,
        "recompute_granularity": None if plan.recompute == "none" else plan.recompute,
        "bf16": plan.job.dtype == "bfloat16",
        "fp16": plan.job.dtype == "float16",
        "num_layers": sum(stage_layer_counts(plan)),
    }


# ---- the recorded flag list and validate_args rules (default suite) ----------------------------

@pytest.mark.parametrize("name", CASES)
def test_flags_and_rules(name, exports, tmp_path):
    plan, export = case(name), exports[name]
    ns = _parse(_sourced_args(export.text, tmp_path))
    for key, value in _expected_flags(plan).items():
        assert getattr(ns, key) == value, key
    _check_validate_args_rules(ns, plan)
    if plan.pp > 1:
        assert ns.pipeline_model_parallel_layout == pipeline_layout(plan)
        assert (_virtual_size(ns) or 1) == plan.virtual_stages
    if plan.recompute == "full":
        assert (ns.recompute_method, ns.recompute_num_layers) == ("uniform", 1)
    assert ns.use_distributed_optimizer == (plan.zero == 1 or (plan.zero >= 2 and not ns.use_torch_fsdp2))
    if ns.use_torch_fsdp2:
        assert ns.torch_fsdp2_reshard_after_forward == (plan.zero == 3)


@pytest.mark.parametrize("name", CASES)
def test_differences(name, exports):
    export, expected = exports[name], EXPECTED_DIFFERENCES[name]
    assert len(export.differences) == len(expected), export.differences
    for phrase, difference in zip(expected, export.differences):
        assert phrase in difference
    head = export.text.split("MEGATRON_ARGS=(")[0]
    assert ("# DIFFERENCES FROM THE PLAN (written with --allow-approx):" in head) == bool(expected)
    for difference in export.differences:
        assert f"#   - {difference}" in head
    if expected:  # refused without --allow-approx, naming the first difference
        with pytest.raises(ExportError, match="cannot run this plan as planned") as err:
            export_plan(case(name), "megatron")
        assert expected[0] in str(err.value) and "\n" not in str(err.value)
    else:
        assert export_plan(case(name), "megatron").text == export.text


def test_layout_strings():
    assert pipeline_layout(case("interleaved-uneven")) == "Et*2|t*3|t*2|t*3|t*2|L"
    assert pipeline_layout(case("empty-last-stage")) == "Et*2|t*3|t*3|L"


def test_model_shape_flags(exports, tmp_path):
    llama = _parse(_sourced_args(exports["preset-llama3-8b"].text, tmp_path))
    assert (llama.num_layers, llama.hidden_size, llama.ffn_hidden_size, llama.num_attention_heads) == \
        (32, 4096, 14336, 32)
    assert llama.group_query_attention and llama.num_query_groups == 8
    assert (llama.normalization, llama.position_embedding_type, llama.rotary_base) == ("RMSNorm", "rope", 500000)
    assert llama.swiglu and not llama.add_bias_linear and llama.untie_embeddings_and_output_weights
    assert (llama.vocab_size, llama.padded_vocab_size, llama.max_position_embeddings) == (128255, 128256, 8192)
    assert (llama.attention_dropout, llama.hidden_dropout) == (0.0, 0.0)
    gpt = _parse(_sourced_args(exports["gpt"].text, tmp_path))
    assert (gpt.normalization, gpt.position_embedding_type) == ("LayerNorm", "learned_absolute")
    assert gpt.add_bias_linear and not gpt.swiglu and not gpt.untie_embeddings_and_output_weights
    assert not gpt.group_query_attention and gpt.ffn_hidden_size == 4 * gpt.hidden_size


def test_run_block_is_not_run_when_sourced(exports, tmp_path):
    text = exports["tp-zero0"].text
    assert 'if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then' in text
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text  # tp 2 without FSDP: validate_args
    assert "pretrain_gpt.py" in text and '"$@"' in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in exports["preset-llama3-8b"].text  # FSDP2 wants > 1
    assert _sourced_args(text, tmp_path)  # sourcing prints the array and runs nothing
    assert exports["tp-zero0"].command.startswith("MEGATRON_LM=")


def test_refuses_models_megatron_cannot_build():
    file_model = str(Path(__file__).parent / "user_models" / "convnet.py") + ":build"
    plan = dataclasses.replace(case("default"), model=file_model)
    with pytest.raises(ExportError, match="builds only GPT and Llama-like") as err:
        export_plan(plan, "megatron", allow_approx=True)
    assert "\n" not in str(err.value)
    odd_tp = dataclasses.replace(case("tp-zero0"), tp=3)  # 4 heads over 3 tensor-parallel ranks
    with pytest.raises(ExportError, match="attention heads divisible by tp 3"):
        export_plan(odd_tp, "megatron", allow_approx=True)


def test_gpipe_and_hsdp_differences():
    gpipe = dataclasses.replace(case("zb-h1"), schedule="gpipe")
    assert any(d.startswith("schedule gpipe") for d in export_plan(gpipe, "megatron", allow_approx=True).differences)
    base = case("preset-llama3-8b")  # pp 1, zero 2 over 8: torch FSDP2
    hsdp = dataclasses.replace(base, dp_replicate=2)
    assert any(d.startswith("HSDP 2 x 4") for d in export_plan(hsdp, "megatron", allow_approx=True).differences)


# ---- megatron-core's own code (export suite) -----------------------------------------------------

def _transformer_config(ns: argparse.Namespace):
    """megatron-core's TransformerConfig from the parsed flags, copied by field name as Megatron-LM's
    core_transformer_config_from_args does (plus the fields it sets from flags of other names)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = vars(ns)
    kwargs = {f.name: values[f.name] for f in dataclasses.fields(TransformerConfig)
              if f.name in values and f.name != "virtual_pipeline_model_parallel_size"}
    params_dtype = torch.bfloat16 if ns.bf16 else torch.float16 if ns.fp16 else torch.float32
    kwargs |= dict(params_dtype=params_dtype, pipeline_dtype=params_dtype,
                   num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
                   batch_p2p_comm=not ns.overlap_p2p_comm,
                   num_layers_in_first_pipeline_stage=ns.decoder_first_pipeline_num_layers,
                   num_layers_in_last_pipeline_stage=ns.decoder_last_pipeline_num_layers,
                   virtual_pipeline_model_parallel_size=_virtual_size(ns))
    if ns.swiglu:
        kwargs |= dict(activation_func=F.silu, gated_linear_unit=True)
    return TransformerConfig(**kwargs)


@pytest.fixture
def pipeline_state():
    """parallel_state's pipeline rank / virtual size, set without process groups, and reset."""
    from megatron.core import parallel_state

    yield parallel_state
    parallel_state.set_pipeline_model_parallel_rank(None)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    parallel_state.set_pipeline_model_parallel_world_size(None)


@pytest.mark.export
@pytest.mark.parametrize("name", CASES)
def test_megatron_core_builds_the_plans_stages(name, exports, tmp_path, pipeline_state):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    plan = case(name)
    ns = _parse(_sourced_args(exports[name].text, tmp_path))
    config = _transformer_config(ns)  # __post_init__ validates heads, groups, recompute, layout
    assert config.num_layers == sum(stage_layer_counts(plan))
    if plan.pp == 1:
        assert config.pipeline_model_parallel_layout is None and plan.num_stages == 1
        return
    layout = config.pipeline_model_parallel_layout
    assert isinstance(layout, PipelineParallelLayerLayout)
    assert layout.virtual_pipeline_model_parallel_size == plan.virtual_stages
    assert (config.virtual_pipeline_model_parallel_size or 1) == plan.virtual_stages
    pipeline_state.set_pipeline_model_parallel_world_size(plan.pp)
    if plan.virtual_stages > 1:
        pipeline_state.set_virtual_pipeline_model_parallel_world_size(plan.virtual_stages)
    for stage, layers in zip(plan.stages, stage_layer_ranges(plan)):
        vp_stage = stage.index // plan.pp
        assert stage.pp_rank == stage.index % plan.pp
        pipeline_state.set_pipeline_model_parallel_rank(stage.pp_rank)
        built = get_num_layers_to_build(config, vp_stage=vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        assert built == len(layers), f"stage {stage.index}"
        if built:
            assert range(offset, offset + built) == layers, f"stage {stage.index}"
        ids = layout.get_layer_id_list(vp_stage=vp_stage, pp_rank=stage.pp_rank)
        assert ids == list(layers)


# ---- through the CLI ---------------------------------------------------------------------------

def _autoplan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cli_suggest_then_export(tmp_path):
    from tests.export_cases import CASE_PINS

    model, cluster, global_batch, seq_len, _ = CASE_PINS["interleaved-uneven"]
    run = _autoplan("suggest", "--model", model, "--cluster", cluster, "--global-batch", str(global_batch), "--seq-len",
                    str(seq_len), "--pp", "2", "--tp", "1", "--dp", "2", "--schedule", "interleaved-1f1b",
                    "--virtual-stages", "3", "--zero", "1", "--out", "p.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    run = _autoplan("export", "p.json", "--to", "megatron", "--out", "args.sh", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "run it: MEGATRON_LM=/path/to/Megatron-LM bash args.sh" in run.stderr
    from autoplan.plan import Plan

    plan = Plan.load(tmp_path / "p.json")
    ns = _parse(_sourced_args((tmp_path / "args.sh").read_text(), tmp_path))
    _check_validate_args_rules(ns, plan)
    assert ns.pipeline_model_parallel_layout == pipeline_layout(plan)
    assert len(ns.pipeline_model_parallel_layout.split("|")) == 6  # pp 2 x 3 virtual stages
    assert ns.use_distributed_optimizer


def test_cli_refuses_without_allow_approx(tmp_path):
    case("zb-h1").save(tmp_path / "zb.json")
    run = _autoplan("export", "zb.json", "--to", "megatron", "--out", "args.sh", cwd=tmp_path)
    assert run.returncode == 2 and "schedule zb-h1" in run.stderr and not (tmp_path / "args.sh").exists()
    run = _autoplan("export", "zb.json", "--to", "megatron", "--out", "args.sh", "--allow-approx", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "approximate: schedule zb-h1" in run.stderr
    assert (tmp_path / "args.sh").read_text().count("DIFFERENCES FROM THE PLAN") == 1


@pytest.mark.hf
def test_hf_models(tmp_path):
    pytest.importorskip("transformers")
    decoder = ("num_hidden_layers=12,hidden_size=256,num_attention_heads=4,num_key_value_heads=2,"
               "intermediate_size=768,vocab_size=32000,max_position_embeddings=512")
    plan = dataclasses.replace(case("default"), model=f"hf:llama:{decoder},head_dim=128")
    ns = _parse(_sourced_args(export_plan(plan, "megatron").text, tmp_path))
    assert ns.kv_channels == 128 and ns.num_query_groups == 2 and ns.normalization == "RMSNorm"
    plain = dataclasses.replace(case("default"), model=f"hf:llama:{decoder}")
    assert _parse(_sourced_args(export_plan(plain, "megatron").text, tmp_path)).kv_channels is None
    gpt2 = dataclasses.replace(case("default"), model="hf:gpt2:n_layer=12,n_embd=256,n_head=4,vocab_size=256")
    with pytest.raises(ExportError, match="builds only GPT and Llama-like"):
        export_plan(gpt2, "megatron", allow_approx=True)


def test_executed_file_runs_torchrun(exports, tmp_path):
    """Executed (not sourced), the file runs torchrun on pretrain_gpt.py with MEGATRON_ARGS, the run
    defaults, --mock-data unless a data flag is given, and the extra flags last."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    script = tmp_path / "args.sh"
    script.write_text(exports["tp-zero0"].text)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", MEGATRON_LM="/opt/Megatron-LM")

    def run(*extra: str) -> list[str]:
        out = subprocess.run(["bash", str(script), *extra], env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    argv = run("--train-iters", "5")
    assert argv[:2] == ["--nproc-per-node", "8"] and "/opt/Megatron-LM/pretrain_gpt.py" in argv
    assert argv.count("--mock-data") == 1 and argv[-2:] == ["--train-iters", "5"]
    assert argv[argv.index("/opt/Megatron-LM/pretrain_gpt.py") + 1:][:len(_sourced_args(script.read_text(), tmp_path))] \
        == _sourced_args(script.read_text(), tmp_path)
    assert "--mock-data" not in run("--data-path", "/data/x_text_document")


def test_a_final_norm_cut_from_the_head_is_a_listed_difference():
    """The planner keeps the final norm with the head (search/context.py [Note: final norm with the
    head]); a plan cut between them by hand still exports only with the difference listed."""
    plan = case("empty-last-stage")
    *head, before, last = plan.stages
    moved = (*head, dataclasses.replace(before, end_block=before.end_block + 1),
             dataclasses.replace(last, first_block=last.first_block + 1))
    split = dataclasses.replace(plan, stages=moved)
    with pytest.raises(ExportError, match="final norm"):
        export_plan(split, "megatron")
    assert any("final norm" in d for d in export_plan(split, "megatron", allow_approx=True).differences)
