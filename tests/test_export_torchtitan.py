"""The torchtitan export (autoplan/report/export/torchtitan.py), on every plan of tests/export_cases.py.

* Without torchtitan (default suite): the written module is valid Python defining `autoplan_plan`,
  its literal settings (batch, degrees, stage FQNs) equal the plan, and refusals and differences are
  the documented ones.
* With torchtitan 0.3.0 (tests marked `export`): torchtitan's own `ConfigManager` parses the file
  (`--module STEM --config autoplan_plan`), the parsed values equal the plan, and torchtitan's own
  pipeline split (`_get_pp_rank_to_stage_indices_mapping` + `_split_module`, what
  `_pipeline_module_split` does per pp rank) of the model built on the meta device gives every pp rank
  the plan's layers. One test goes through the CLI (`autoplan suggest` then `autoplan export`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from export_cases import CASES, SMALL_LLAMA, case

from autoplan.report.export import ExportError, export_plan, model_shape, stage_blocks
from autoplan.report.export.torchtitan import CONFIG_FUNCTION, DEFAULT_MODULE

ROOT = Path(__file__).resolve().parent.parent

# Per case: a phrase of each difference, in order (empty: torchtitan states the plan exactly).
EXPECTED_DIFFERENCES: dict[str, tuple[str, ...]] = {
    "default": ("(ZeRO-1)",),
    "preset-llama3-8b": (),
    "interleaved-uneven": ("(ZeRO-1)",),
    "zb-h1": ("zb-h1 schedule", "fewer than torch's Schedule1F1B accepts"),  # 2 micro-batches on 4 stages
    "zero2": (),
    "selective-sp": ("(ZeRO-1)", "selective recompute"),
    "empty-last-stage": (),
    "pp1-many-microbatches": ("(ZeRO-1)",),
    "tp-zero0": (),
    "autotp": (),
    # torch's Schedule1F1B refuses 2 micro-batches on 4 stages: GPipe, which runs them, with the difference
    "1f1b-few-microbatches": ("fewer than torch's Schedule1F1B accepts",),
}
REFUSED = {"gpt": "torchtitan has no model for gpt:"}
assert set(EXPECTED_DIFFERENCES) | set(REFUSED) == set(CASES)

EXPORTABLE = list(EXPECTED_DIFFERENCES)


def _export(name: str, filename: str | None = None, plan=None):
    return export_plan(plan or case(name), "torchtitan", allow_approx=True, filename=filename)


def _with_microbatches(plan, count: int):
    """`plan` running `count` micro-batches (its global batch following)."""
    job = dataclasses.replace(plan.job, global_batch=plan.micro_batch_size * count * plan.replicas)
    return dataclasses.replace(plan, num_microbatches=count, job=job)


def _call_kwargs(tree: ast.Module, callee: str) -> dict[str, ast.expr]:
    """Keyword arguments of the first call to `callee` (e.g. TrainingConfig) in the module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == callee:
            return {k.arg: k.value for k in node.keywords}
    raise AssertionError(f"no call to {callee}")


def _literal_settings(text: str) -> tuple[dict, dict, list | None]:
    tree = ast.parse(text)
    training = {k: ast.literal_eval(v) for k, v in _call_kwargs(tree, "TrainingConfig").items()}
    parallelism = {k: ast.literal_eval(v) for k, v in _call_kwargs(tree, "ParallelismConfig").items()
                   if k != "module_fqns_per_model_part"}
    fqns = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "MODULE_FQNS_PER_MODEL_PART":
            fqns = ast.literal_eval(node.value)
    return training, parallelism, fqns


def _expected_fqns(plan) -> list[list[str]]:
    names = {"embedding": "tok_embeddings", "norm": "norm", "output": "lm_head", "lm_head": "lm_head"}
    return [[names.get(b.removeprefix("model."), b.removeprefix("model.")) for b in blocks]
            for blocks in stage_blocks(plan)]


# ---- default suite: structure, literal values, refusals ---------------------------------------

@pytest.mark.parametrize("name", EXPORTABLE)
def test_the_file_is_python_defining_the_config_function_with_the_plans_settings(name):
    plan, export = case(name), _export(name)
    tree = ast.parse(export.text)
    compile(tree, "autoplan_torchtitan.py", "exec")
    assert CONFIG_FUNCTION in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert f"--module {DEFAULT_MODULE} --config {CONFIG_FUNCTION}" in export.command
    assert f"--nproc-per-node {plan.num_gpus}" in export.command and "-m torchtitan.train" in export.command
    assert export.command in export.text

    training, parallelism, fqns = _literal_settings(export.text)
    micro, count = plan.micro_batch_size, plan.num_microbatches
    assert training["global_batch_size"] == plan.job.global_batch and training["seq_len"] == plan.job.seq_len
    if plan.pp > 1:  # one accumulation step of `count` pipeline micro-batches
        assert training["local_batch_size"] == micro * count
        assert parallelism["pipeline_parallel_microbatch_size"] == micro
        assert training["disable_cuda_graphs"] is True
        assert fqns == _expected_fqns(plan)
    else:  # `count` accumulation steps of one micro-batch
        assert training["local_batch_size"] == micro and fqns is None
        assert training["global_batch_size"] // (micro * plan.dp) == count
    degrees = (parallelism["tensor_parallel_degree"] * parallelism["pipeline_parallel_degree"]
               * parallelism["data_parallel_replicate_degree"] * parallelism["data_parallel_shard_degree"])
    assert degrees == plan.num_gpus
    assert parallelism["enable_sequence_parallel"] == plan.sequence_parallel
    assert training["mixed_precision_param"] == plan.job.dtype


@pytest.mark.parametrize("name", EXPORTABLE)
def test_differences_are_the_documented_ones_and_head_the_file(name):
    export, expected = _export(name), EXPECTED_DIFFERENCES[name]
    assert len(export.differences) == len(expected), export.differences
    for phrase, difference in zip(expected, export.differences):
        assert phrase in difference
        assert f"# - {difference}" in export.text.split('"""')[0]
    if expected:
        assert export.text.startswith("# DIFFERENCES FROM THE PLAN (written with --allow-approx):")
        with pytest.raises(ExportError, match="--allow-approx"):
            export_plan(case(name), "torchtitan")
    else:
        assert export_plan(case(name), "torchtitan").text == export.text
        assert "DIFFERENCES" not in export.text


def test_specific_mappings():
    # zero 0 with tp: plain replication over dp (FSDP2 with shard degree 1), not a refused DDP.
    _, p, _ = _literal_settings(_export("tp-zero0").text)
    assert (p["data_parallel_replicate_degree"], p["data_parallel_shard_degree"], p["tensor_parallel_degree"]) == (
        2, 1, 2)
    _, p, _ = _literal_settings(_export("zero2").text)
    assert (p["data_parallel_shard_degree"], p["fsdp_reshard_after_forward"]) == (4, "never")
    _, p, _ = _literal_settings(_export("interleaved-uneven").text)
    assert p["pipeline_parallel_schedule"] == "Interleaved1F1B"
    _, p, _ = _literal_settings(_export("zb-h1").text)  # 2 micro-batches on 4 stages: too few for 1F1B
    assert p["pipeline_parallel_schedule"] == "GPipe"
    _, p, _ = _literal_settings(_export("zb-h1", plan=_with_microbatches(case("zb-h1"), 4)).text)
    assert p["pipeline_parallel_schedule"] == "1F1B"
    # the preset is torchtitan's own 8B flavor; a custom shape is a Llama3Model of that exact shape
    assert "return model_registry('8B')" in _export("preset-llama3-8b").text
    text = _export("default").text
    assert "n_layers=12, dim=256, n_heads=4, n_kv_heads=2," in text and "hidden_dim=768" in text
    assert "activation_checkpoint=None" in text
    assert "activation_checkpoint=None" in _export("selective-sp").text


def test_models_torchtitan_lacks_are_refused_in_one_line():
    with pytest.raises(ExportError, match=r"torchtitan has no model for gpt:.*--to megatron or --to deepspeed"):
        export_plan(case("gpt"), "torchtitan", allow_approx=True)


def test_micro_batch_counts_torchs_interleaved_schedule_cannot_run_are_refused():
    plan = case("interleaved-uneven")  # pp 2: 9 micro-batches run in rounds of 4, which 9 does not fill
    plan = dataclasses.replace(plan, num_microbatches=9,
                               job=dataclasses.replace(plan.job, global_batch=plan.micro_batch_size * 9 * plan.dp))
    with pytest.raises(ExportError, match="Interleaved1F1B cannot run 9 micro-batches on pp 2"):
        export_plan(plan, "torchtitan", allow_approx=True)


def test_hugging_face_llamas_export_their_exact_shape_and_other_types_are_refused():
    pytest.importorskip("transformers")
    import autoplan

    hf = autoplan.suggest("hf:llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                          "intermediate_size=160,vocab_size=300,rms_norm_eps=1e-6", "1x2xA100-80GB", global_batch=4,
                          seq_len=64)[0]
    text = export_plan(hf, "torchtitan", allow_approx=True).text
    ast.parse(text)
    assert "n_layers=2, dim=64, n_heads=4, n_kv_heads=2," in text and "hidden_dim=160" in text
    assert "eps=1e-06" in text and "vocab_size=300" in text
    bert = autoplan.suggest("hf:bert:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,"
                            "vocab_size=300", "1x2xA100-80GB", global_batch=4, seq_len=64)[0]
    with pytest.raises(ExportError, match="torchtitan has no model for hf:bert"):
        export_plan(bert, "torchtitan", allow_approx=True)


def test_the_command_names_an_importable_module_for_any_out_path():
    command = export_plan(case("zero2"), "torchtitan", filename="out/my_plan.py").command
    assert command.startswith("PYTHONPATH=out torchrun") and "--module my_plan " in command
    # not importable as named (suffix, dots, a torchtitan short name): the command copies it first
    for out, module in [("plan.toml", "plan_toml"), ("out/my.plan.py", "my_plan_py"),
                        ("llama3.py", "llama3_py"), ("torchtitan.out", "torchtitan_out")]:
        command = export_plan(case("zero2"), "torchtitan", filename=out).command
        copy = str(Path(out).parent / f"{module}.py")
        assert command.startswith(f"cp {out} {copy} && PYTHONPATH={Path(out).parent} torchrun"), command
        assert f"--module {module} --config" in command


def test_hugging_face_block_names_map_to_torchtitan_modules():
    from autoplan.report.export.torchtitan import _fqn

    names = ["embedding", "model.layers.0", "model.layers.11", "model.norm", "lm_head", "layers.3", "norm", "output"]
    assert [_fqn(n) for n in names] == ["tok_embeddings", "layers.0", "layers.11", "norm", "lm_head", "layers.3",
                                        "norm", "lm_head"]
    with pytest.raises(ExportError, match="no torchtitan Llama module"):
        _fqn("model.rotary_emb")


# ---- torchtitan 0.3.0 itself ------------------------------------------------------------------

def _parse(text: str, tmp_path: Path, stem: str):
    """torchtitan's ConfigManager on the written file, as `torchtitan.train` would run it."""
    from torchtitan.config.manager import ConfigManager

    (tmp_path / f"{stem}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.invalidate_caches()
        return ConfigManager().parse_args(["--module", stem, "--config", CONFIG_FUNCTION])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(stem, None)


def _layers_per_rank(config) -> list[list[str]]:
    """Every pp rank's module names after torchtitan's own split of the meta-built model."""
    import torch
    from torchtitan.distributed import pipeline_parallel as tt_pp

    model_config = config.model_spec.model
    model_config.update_from_config(config=config)  # what Trainer.__init__ does before building
    with torch.device("meta"):
        model = model_config.build()
    parallelism = config.parallelism
    parts = parallelism.module_fqns_per_model_part
    per_rank = []
    for rank in range(parallelism.pipeline_parallel_degree):
        stages = tt_pp._get_pp_rank_to_stage_indices_mapping(
            rank, parallelism.pipeline_parallel_degree, parallelism.pipeline_parallel_schedule, len(parts))
        names = []
        for index in stages:
            chunk = tt_pp._split_module(model, parts[index])
            names += [f"layers.{k}" for k in chunk.layers]
            names += [n for n in ("tok_embeddings", "norm", "lm_head") if getattr(chunk, n) is not None]
        per_rank.append(sorted(names))
    return per_rank


def _plan_layers_per_rank(plan) -> list[list[str]]:
    fqns = _expected_fqns(plan)
    return [sorted(n for s in plan.stages if s.pp_rank == rank for n in fqns[s.index]) for rank in range(plan.pp)]


@pytest.mark.export
@pytest.mark.parametrize("name", EXPORTABLE)
def test_torchtitan_parses_the_file_and_splits_the_model_as_planned(name, tmp_path):
    pytest.importorskip("torchtitan")
    plan = case(name)
    stem = f"autoplan_{name.replace('-', '_')}"
    export = _export(name, filename=str(tmp_path / f"{stem}.py"))
    config = _parse(export.text, tmp_path, stem)

    t, p = config.training, config.parallelism
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree) == (plan.tp, plan.pp)
    assert (p.data_parallel_replicate_degree * p.data_parallel_shard_degree * plan.tp * plan.pp) == plan.num_gpus
    assert (t.global_batch_size, t.seq_len, t.mixed_precision_param) == (
        plan.job.global_batch, plan.job.seq_len, plan.job.dtype)
    # torchtitan/trainer.py: gradient accumulation steps and pipeline micro-batches per step
    accumulation = t.global_batch_size // (t.local_batch_size * (p.data_parallel_replicate_degree
                                                                 * p.data_parallel_shard_degree))
    per_forward = p.pipeline_parallel_microbatch_size if plan.pp > 1 else t.local_batch_size
    assert per_forward == plan.micro_batch_size
    assert accumulation * (t.local_batch_size // per_forward) == plan.num_microbatches
    assert p.enable_sequence_parallel == plan.sequence_parallel
    assert (config.activation_checkpoint is None) == (plan.recompute != "full")

    model, shape = config.model_spec.model, model_shape(plan)
    attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
    assert (len(model.layers), model.dim, attention.n_heads, attention.n_kv_heads, ffn.w1.out_features,
            model.vocab_size, float(attention.rope.theta), model.norm.eps, model.enable_weight_tying) == (
        shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.ffn_hidden_size,
        shape.vocab_size, shape.rope_theta, shape.norm_eps, shape.tie_embeddings)
    if plan.pp > 1:
        assert t.disable_cuda_graphs
        assert p.module_fqns_per_model_part == _expected_fqns(plan)
        assert _layers_per_rank(config) == _plan_layers_per_rank(plan)


@pytest.mark.export
def test_the_flavor_table_matches_torchtitans_registry():
    pytest.importorskip("torchtitan")
    from torchtitan.models.llama3 import model_registry

    from autoplan.report.export.torchtitan import _FLAVORS

    for key, flavor in _FLAVORS.items():
        model = model_registry(flavor).model
        attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
        rope = attention.rope
        got = (len(model.layers), model.dim, attention.n_heads, attention.n_kv_heads, ffn.w1.out_features,
               model.vocab_size, float(rope.theta), model.norm.eps)
        assert got == key, flavor


@pytest.mark.export
def test_the_cli_path_suggest_then_export_then_torchtitan_parses(tmp_path):
    pytest.importorskip("torchtitan")

    def autoplan(*args):
        return subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)

    done = autoplan("suggest", "--model", SMALL_LLAMA, "--cluster", "1x8xA100-80GB", "--global-batch", "32", "--seq-len", "512",
                    "--pp", "2", "--zero", "2", "--out", "p.json")
    assert done.returncode == 0, done.stderr
    done = autoplan("export", "p.json", "--to", "torchtitan", "--out", "x.py")
    assert done.returncode == 0, done.stderr
    assert "run it: PYTHONPATH=. torchrun" in done.stderr and "--module x --config autoplan_plan" in done.stderr
    config = _parse((tmp_path / "x.py").read_text(), tmp_path, "x")
    assert config.parallelism.pipeline_parallel_degree == 2 and config.training.global_batch_size == 32
    # an --out torchtitan cannot import as named: the printed command copies it to one it can
    done = autoplan("export", "p.json", "--to", "torchtitan", "--out", "x.toml")
    assert done.returncode == 0 and "run it: cp x.toml x_toml.py && PYTHONPATH=. torchrun" in done.stderr
    subprocess.run(["cp", "x.toml", "x_toml.py"], cwd=tmp_path, check=True)
    assert _parse((tmp_path / "x_toml.py").read_text(), tmp_path, "x_toml").training.global_batch_size == 32


@pytest.mark.export
def test_torchtitan_builds_a_hugging_face_llama_with_its_norm_eps_and_stages(tmp_path):
    pytest.importorskip("torchtitan")
    pytest.importorskip("transformers")
    import autoplan

    plan = autoplan.suggest("hf:llama:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
                            "intermediate_size=160,vocab_size=300,rms_norm_eps=1e-6,tie_word_embeddings=true",
                            "1x2xA100-80GB", global_batch=4, seq_len=64, pp=2)[0]
    export = export_plan(plan, "torchtitan", allow_approx=True, filename=str(tmp_path / "hf_plan.py"))
    assert "ties its input and output embeddings" in export.differences[0]  # refused by torchtitan with pp > 1
    config = _parse(export.text, tmp_path, "hf_plan")
    model = config.model_spec.model
    assert {model.norm.eps, model.layers[0].attention_norm.eps, model.layers[1].ffn_norm.eps} == {1e-6}
    assert not model.enable_weight_tying
    assert _layers_per_rank(config) == _plan_layers_per_rank(plan)


def _rank0_schedule(config, plan):
    """torchtitan's own `_build_pipeline_schedule` for pp rank 0 of the parsed config, over stand-in
    stages on a fake process group of the pipeline's size: the schedule class torch validates at
    startup, with the micro-batch count torchtitan derives (local batch // micro-batch size)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed import pipeline_parallel as tt_pp

    p = config.parallelism
    indices = tt_pp._get_pp_rank_to_stage_indices_mapping(0, p.pipeline_parallel_degree, p.pipeline_parallel_schedule,
                                                          plan.num_stages)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.pp)
    try:
        stages = [PipelineStage(torch.nn.Linear(2, 2), i, plan.num_stages, torch.device("cpu")) for i in indices]
        return tt_pp._build_pipeline_schedule(parallelism=p, local_batch_size=config.training.local_batch_size,
                                              stages=stages, loss_fn=lambda *args: (None, None))
    finally:
        dist.destroy_process_group()


@pytest.mark.export
@pytest.mark.parametrize("name", [n for n in EXPORTABLE if case(n).pp > 1])
def test_torchtitan_builds_the_pipeline_schedule_with_the_plans_micro_batches(name, tmp_path):
    """torch's schedules check the micro-batch count when they are built (Schedule1F1B refuses fewer
    than the stages, Interleaved1F1B counts that do not fill its rounds): every written schedule is
    built, and the plan's own 1F1B with 2 micro-batches on 4 stages is what torch refuses."""
    pytest.importorskip("torchtitan")
    plan = case(name)
    stem = f"autoplan_{name.replace('-', '_')}"
    config = _parse(_export(name, filename=str(tmp_path / f"{stem}.py")).text, tmp_path, stem)
    schedule = _rank0_schedule(config, plan)
    assert schedule._n_microbatches == plan.num_microbatches
    if name == "1f1b-few-microbatches":
        assert type(schedule).__name__ == "ScheduleGPipe"
        config.parallelism.pipeline_parallel_schedule = "1F1B"  # what the export wrote before issue 29
        with pytest.raises(ValueError, match=r"Number of microbatches \(2\) must be greater than or equal"):
            _rank0_schedule(config, plan)


_HEAD_DIM_LLAMA = ("hf:llama:num_hidden_layers=2,hidden_size=256,num_attention_heads=4,num_key_value_heads=2,"
                   "head_dim=128,intermediate_size=512,vocab_size=300")


def test_a_hugging_face_head_dim_is_written_and_never_a_flavor():
    pytest.importorskip("transformers")
    plan = dataclasses.replace(case("default"), model=_HEAD_DIM_LLAMA)
    text = export_plan(plan, "torchtitan", allow_approx=True).text
    ast.parse(text)
    assert "head_dim=128, fuse_qkv=True" in text and "ComplexRoPE.Config(dim=128," in text
    assert "model_registry('" not in text.split("dataclasses.replace(model_registry")[0]
    plain = dataclasses.replace(plan, model=_HEAD_DIM_LLAMA.replace("head_dim=128", "head_dim=64"))  # = 256 / 4
    assert "make_gqa_config" not in export_plan(plain, "torchtitan", allow_approx=True).text


@pytest.mark.export
@pytest.mark.parametrize("pp", [1, 2])
def test_torchtitan_builds_the_hugging_face_model_with_its_head_dim(pp, tmp_path):
    """A Llama whose config sets head_dim (128 beside 256 / 4 = 64): torchtitan's model, built on the
    meta device from the parsed file, has the Hugging Face model's parameter count (before issue 29
    it was built 64 wide, silently smaller), and its projections and rotary tables are 128 wide."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("transformers")
    import torch

    import autoplan
    from autoplan.sources.hf import HFSource

    pins = dict(zero=2) if pp == 1 else dict(zero=0, schedule="1f1b", micro_batch_size=1)
    plan = autoplan.suggest(_HEAD_DIM_LLAMA, "1x2xA100-80GB", global_batch=4, seq_len=64, pp=pp, tp=1, **pins)[0]
    export = export_plan(plan, "torchtitan", filename=str(tmp_path / "head_dim.py"))
    assert not export.differences
    config = _parse(export.text, tmp_path, "head_dim")
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
        reference = HFSource.from_spec(_HEAD_DIM_LLAMA).build()
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in reference.parameters())
    attention = model_config.layers[0].attention
    assert attention.head_dim == 128 and attention.qkv_linear.wqkv.out_features == (4 + 2 * 2) * 128
    assert attention.rope.dim == 128
    if pp > 1:
        assert _layers_per_rank(config) == _plan_layers_per_rank(plan)
