"""The DeepSpeed export (autoplan/report/export/deepspeed.py): a JSON config DeepSpeed 0.19.8 reads as
written, plus the `PipelineModule` arguments whose partition reproduces the plan's cuts, or the
nearest config with every difference listed.

The default suite checks the file's structure, the refusals and the partition arithmetic without
DeepSpeed. The `export` tests (`pytest -m export`, needs the export-check extra) hand the file to
DeepSpeed itself: `DeepSpeedConfig` under a fake process group of the plan's world size, and a real
`PipelineModule` over stand-in layers on one rank of every pipeline stage."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from export_cases import CASES, GPT, case

from autoplan.report.export import ExportError, export_plan
from autoplan.report.export.deepspeed import (
    EMBEDDING_CLASS,
    HEAD_CLASS,
    LAYER_CLASS,
    NORM_CLASS,
    TIED_KEY,
    partition_balanced,
    partition_uniform,
    write,
)

# The differences each case must list, by their opening words, in order; [] = exact.
EXPECTED = {
    "default": [],
    "preset-llama3-8b": [],  # zero 2 with pp 1: DeepSpeed's ZeRO-2
    "interleaved-uneven": ["interleaved-1f1b with 3 stages per rank"],  # merged rank cuts [7, 8]: a type method
    "zb-h1": ["zb-h1: ", "stage cuts: "],
    "zero2": ["zero 2 with pipeline parallelism"],
    "selective-sp": ["recompute selective"],
    "empty-last-stage": [],  # norm and head together on the last stage: uniform [0, 3, 6, 9, 11]
    "pp1-many-microbatches": [],
    "tp-zero0": [],
    "gpt": [],
    "autotp": [],  # tensor parallelism without a pipeline: DeepSpeed's AutoTP
    "1f1b-few-microbatches": [],  # DeepSpeed's TrainSchedule runs any number of micro-batches
}
# The partition method written for each pp > 1 case, and the cuts DeepSpeed computes from it.
METHODS = {
    "interleaved-uneven": ("type:TransformerLayerPipe", [0, 7, 15]),
    "zero2": ("uniform", [0, 8, 15]),
    "selective-sp": ("uniform", [0, 8, 15]),
    "tp-zero0": ("uniform", [0, 8, 15]),
    "gpt": ("type:TransformerLayerPipe", [0, 5, 11]),  # 4 + 4 layers, embedding first, norm + head last
    "empty-last-stage": ("uniform", [0, 3, 6, 9, 11]),
    # the plan's [0, 5, 9, 13, 15] (4, 4, 4, 0 layers) is no method's; one block off: 4, 4, 3, 1 layers
    "zb-h1": ("type:TransformerLayerPipe|HeadPipe|NormPipe", [0, 5, 9, 12, 15]),
    "1f1b-few-microbatches": ("type:TransformerLayerPipe", [0, 4, 7, 10, 15]),  # 3 + 3 + 3 + 3 layers
}


@functools.cache
def _model_file_plan():
    """A model file's plan (a ResNet: no transformer layers to name) recomputing every block."""
    import autoplan

    return autoplan.suggest(str(Path(__file__).parent / "user_models" / "convnet.py") + ":build", "1x2xA100-80GB",
                            global_batch=8, pp=2, dp=1, tp=1, schedule="1f1b", recompute="full")[0]


def _approx(plan):
    export = export_plan(plan, "deepspeed", allow_approx=True)
    return export, json.loads(export.text)


def test_every_case_is_exact_or_refused_naming_its_differences():
    assert set(EXPECTED) == set(CASES)
    for name in CASES:
        plan = case(name)
        export, doc = _approx(plan)
        got = [next((p for p in EXPECTED[name] if d.startswith(p)), d) for d in export.differences]
        assert got == EXPECTED[name], (name, export.differences)
        assert next(iter(doc)) == "_autoplan_differences" and doc["_autoplan_differences"] == list(export.differences)
        if export.differences:
            with pytest.raises(ExportError) as refused:
                export_plan(plan, "deepspeed")
            message = str(refused.value)
            assert "\n" not in message and export.differences[0] in message and "--allow-approx" in message
        else:
            assert export_plan(plan, "deepspeed") == export


@pytest.mark.parametrize("name", CASES)
def test_the_batch_arithmetic_precision_and_zero_stage_are_deepspeeds(name):
    plan = case(name)
    _, doc = _approx(plan)
    # DeepSpeed's count: micro x gas x its world size, every rank under AutoTP (tp > 1, pp 1), whose
    # tensor-parallel ranks share each micro-batch; the pipeline grid's dp otherwise.
    world = plan.num_gpus if "tensor_parallel" in doc else plan.dp
    assert ("tensor_parallel" in doc) == (plan.tp > 1 and plan.pp == 1)
    assert doc["train_batch_size"] == doc["train_micro_batch_size_per_gpu"] * doc["gradient_accumulation_steps"] * world
    assert doc["train_batch_size"] * plan.dp // world == plan.job.global_batch  # distinct samples per step
    assert (doc["train_micro_batch_size_per_gpu"], doc["gradient_accumulation_steps"]) == (
        plan.micro_batch_size, plan.num_microbatches)
    assert doc["bf16"] == {"enabled": True} and "fp16" not in doc
    # PipelineEngine refuses ZeRO 2 / 3; without a pipeline the plan's stage is DeepSpeed's.
    assert doc["zero_optimization"] == {"stage": min(plan.zero, 1) if plan.pp > 1 else plan.zero}
    assert ("autoplan_pipeline_module" in doc) == (plan.pp > 1)


@pytest.mark.parametrize("name", [n for n in CASES if case(n).pp > 1])
def test_the_pipeline_module_arguments_reproduce_the_cuts_or_say_which_they_give(name):
    plan = case(name)
    export, doc = _approx(plan)
    pm = doc["autoplan_pipeline_module"]
    assert pm["kwargs"]["num_stages"] == plan.pp
    assert (pm["kwargs"]["partition_method"], pm["parts"]) == METHODS[name]
    assert [layer["block"] for layer in pm["layers"]] == list(plan.block_names)
    if not any(d.startswith(("stage cuts", "interleaved")) for d in export.differences):
        assert pm["parts"] == list(plan.boundaries)
    # The written method, run through DeepSpeed's algorithm over the written layer list, gives `parts`.
    method = pm["kwargs"]["partition_method"]
    if method == "uniform":
        assert partition_uniform(len(pm["layers"]), plan.pp) == pm["parts"]
    else:
        chosen = method.removeprefix("type:").split("|")
        assert partition_balanced([int(layer["class"] in chosen) for layer in pm["layers"]], plan.pp) == pm["parts"]


def test_the_nearest_cuts_are_stated_layer_by_layer():
    # The planner keeps the final norm with the head (search/context.py [Note: final norm with the
    # head]); cut by hand at [0, 3, 6, 10, 11], the plan is no partition_method's.
    plan = case("empty-last-stage")
    stages = tuple(dataclasses.replace(s, first_block=a, end_block=b)
                   for s, (a, b) in zip(plan.stages, itertools.pairwise([0, 3, 6, 10, 11]), strict=True))
    export, _ = _approx(dataclasses.replace(plan, stages=stages))
    (cuts,) = [d for d in export.differences if d.startswith("stage cuts")]
    assert "[0, 3, 6, 10, 11]" in cuts and 'partition_method="uniform"' in cuts and "[0, 3, 6, 9, 11]" in cuts
    assert "stage 2: 3 blocks, 3 transformer layers (layers.5 .. layers.7)" in cuts
    assert "stage 3: 2 blocks, 0 transformer layers (norm .. output)" in cuts


def test_interleaved_stages_merge_per_rank_before_the_cuts_are_matched():
    plan = case("interleaved-uneven")  # cuts [0, 3, 6, 8, 11, 13, 15]: ranks hold 3+2+2 and 3+3+2 blocks
    assert [s.pp_rank for s in plan.stages] == [0, 1, 0, 1, 0, 1]
    export, doc = _approx(plan)
    assert "(rank 0: 7 blocks, rank 1: 8 blocks)" in export.differences[0]
    assert doc["autoplan_pipeline_module"]["parts"] == [0, 7, 15] and len(export.differences) == 1
    cuts = [0, 4, 5, 7, 10, 13, 15]  # ranks: 4+2+3 = 9 and 1+3+2 = 6 blocks, which no method gives
    stages = tuple(dataclasses.replace(s, first_block=a, end_block=b)
                   for s, (a, b) in zip(plan.stages, itertools.pairwise(cuts), strict=True))
    export, _ = _approx(dataclasses.replace(plan, stages=stages))
    assert export.differences[1].startswith("stage cuts: the plan's blocks merged per rank cut the 15 blocks at "
                                            "[0, 9, 15], which no DeepSpeed partition_method reproduces")


def test_the_layer_list_names_the_classes_the_regex_and_checkpointing_match():
    _, gpt = _approx(case("gpt"))  # tied embeddings: the head is a TiedLayerSpec of the embedding
    layers = gpt["autoplan_pipeline_module"]["layers"]
    assert layers[0] == {"index": 0, "block": "embedding", "class": EMBEDDING_CLASS, "tied_key": TIED_KEY}
    assert layers[-1] == {"index": 10, "block": "output", "class": EMBEDDING_CLASS, "tied_key": TIED_KEY}
    assert [layer["class"] for layer in layers[1:-1]] == [LAYER_CLASS] * 8 + [NORM_CLASS]
    _, llama = _approx(case("selective-sp"))
    pm = llama["autoplan_pipeline_module"]
    assert pm["layers"][-1]["class"] == HEAD_CLASS and "tied_key" not in pm["layers"][-1]
    # recompute: the interval in PipelineModule's arguments and in the JSON (PipelineEngine reads it),
    # checkpointing the transformer layers only
    assert pm["kwargs"]["activation_checkpoint_interval"] == 1 and pm["kwargs"]["checkpointable_layers"] == [LAYER_CLASS]
    assert llama["pipeline"] == {"activation_checkpoint_interval": 1}
    _, plain = _approx(case("tp-zero0"))
    assert plain["autoplan_pipeline_module"]["kwargs"]["activation_checkpoint_interval"] == 0 and "pipeline" not in plain


@pytest.mark.parametrize("name", ["tp-zero0", "zero2", "gpt"])
@pytest.mark.parametrize("rank_order", ["tp-dp-pp", "tp-pp-dp"])
def test_the_topology_numbers_ranks_as_the_plan_does(name, rank_order):
    """`ProcessTopology(axes, dims)` is row-major (the last axis fastest): rank -> coordinates must be
    the plan's (plan.coords)."""
    plan = dataclasses.replace(case(name), rank_order=rank_order)
    topology = json.loads(write(plan).text)["autoplan_pipeline_module"]["topology"]
    dims = dict(zip(topology["axes"], topology["dims"], strict=True))
    assert dims == {"pipe": plan.pp, "data": plan.dp, **({"model": plan.tp} if plan.tp > 1 else {})}
    for rank in range(plan.num_gpus):
        coords, rest = {}, rank
        for axis, size in reversed(list(zip(topology["axes"], topology["dims"], strict=True))):
            coords[axis], rest = rest % size, rest // size
        assert (coords["pipe"], coords["data"], coords.get("model", 0)) == plan.coords(rank)


def test_rules_the_cases_do_not_reach():
    """Variants of the cases (dataclasses.replace) for the rules no case exercises."""
    base = case("preset-llama3-8b")  # pp 1, dp 8, zero 2
    hsdp = write(dataclasses.replace(base, zero=3, dp_replicate=2))
    assert len(hsdp.differences) == 1 and hsdp.differences[0].startswith("HSDP 2 x 4: DeepSpeed 0.19.8 has no hybrid")
    assert json.loads(hsdp.text)["zero_optimization"] == {"stage": 3}  # no mics_shard_size: 0.19.8 rejects it
    fp16 = json.loads(write(dataclasses.replace(base, job=dataclasses.replace(base.job, dtype="float16"))).text)
    assert fp16["fp16"] == {"enabled": True} and "bf16" not in fp16
    fp32 = json.loads(write(dataclasses.replace(base, job=dataclasses.replace(base.job, dtype="float32"))).text)
    assert "fp16" not in fp32 and "bf16" not in fp32
    autotp = write(dataclasses.replace(base, tp=2, dp=4, sequence_parallel=True,  # the same global batch over dp 4
                                        num_microbatches=base.job.global_batch // (4 * base.micro_batch_size)))
    assert json.loads(autotp.text)["tensor_parallel"] == {"autotp_size": 2}
    assert [d[:22] for d in autotp.differences] == ["sequence parallelism: "]
    full = write(dataclasses.replace(base, recompute="full"))  # pp 1: the user's model checkpoints
    assert not full.differences and any(n.startswith("recompute full") for n in full.notes)
    gpipe = write(dataclasses.replace(case("gpt"), schedule="gpipe"))
    assert [d[:7] for d in gpipe.differences] == ["gpipe: "]
    zero3 = write(dataclasses.replace(case("gpt"), zero=3))
    assert "gradients and parameters whole" in zero3.differences[0]
    assert json.loads(zero3.text)["zero_optimization"] == {"stage": 1}
    assert write(base, filename="out/ds.json").command == (
        "deepspeed --num_gpus 8 train.py --deepspeed --deepspeed_config out/ds.json")


def test_a_model_files_blocks_keep_their_own_classes_and_recompute_is_every_block():
    plan = _model_file_plan()
    export, doc = _approx(plan)
    pm = doc["autoplan_pipeline_module"]
    assert {layer["class"] for layer in pm["layers"]} == {None}  # the user's own modules
    assert pm["kwargs"]["partition_method"] == "uniform" and pm["parts"] == list(plan.boundaries)
    assert "checkpointable_layers" not in pm["kwargs"]
    assert doc["pipeline"] == {"activation_checkpoint_interval": 1, "use_reentrant": False}
    assert [d[:16] for d in export.differences] == ["recompute full: "]


def test_partitions_follow_deepspeeds_algorithms():
    """Values DeepSpeed 0.19.8's runtime/utils.py returns (the export suite compares at random too)."""
    assert partition_uniform(15, 4) == [0, 4, 8, 12, 15]
    assert partition_uniform(3, 4) == [0, 1, 2, 3, 3]
    assert partition_balanced([0] + [1] * 12 + [0, 0], 4) == [0, 4, 7, 10, 15]
    assert partition_balanced([0] + [1] * 8 + [0, 0], 2) == [0, 5, 11]
    assert partition_balanced([0, 1, 1, 1, 0, 0], 2) == [0, 3, 6]
    assert partition_balanced([3, 1, 4, 1, 5, 9, 2, 6], 3) == [0, 5, 6, 8]


# ---- DeepSpeed itself ----------------------------------------------------------------------------

@contextlib.contextmanager
def _fake_world(world_size: int, rank: int = 0):
    """A fake process group of the plan's world size (no communication) that deepspeed.comm wraps."""
    import torch.distributed as tdist
    from deepspeed import comm
    from deepspeed.utils import groups
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # deepspeed.initialize records the mpu and its groups in module globals; put them back after
    # each world so the next test's engine does not see this one's tensor parallelism.
    saved = {k: (v.copy() if isinstance(v, dict) else v) for k, v in vars(groups).items()
             if k in ("mpu", "mesh_device") or (k.startswith("_") and k[1:2].isupper())}
    tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        comm.init_distributed(dist_backend="gloo", verbose=False)
        yield
    finally:
        tdist.destroy_process_group()
        vars(groups).update(saved)


def _pipeline_module(pm: dict):
    """A real PipelineModule over stand-in layers whose classes carry the layer list's names."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import ProcessTopology

    class StandIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(2))  # TiedLayerSpec ties `weight`

        def forward(self, x):
            return x

    classes: dict[str, type] = {}

    def spec(layer: dict):
        cls = classes.setdefault(layer["class"] or "UserBlock", type(layer["class"] or "UserBlock", (StandIn,), {}))
        return TiedLayerSpec(layer["tied_key"], cls) if layer.get("tied_key") else LayerSpec(cls)

    return PipelineModule(layers=[spec(layer) for layer in pm["layers"]],
                          topology=ProcessTopology(**pm["topology"]), **pm["kwargs"])


def _hf_llama(plan):
    """A two-layer transformers Llama with the plan's attention and MLP widths (what AutoTP shards)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autoplan.report.export import model_shape

    shape = model_shape(plan)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=shape.hidden_size,
                                        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                                        intermediate_size=shape.ffn_hidden_size, vocab_size=256))


@pytest.mark.export
@pytest.mark.parametrize("name", [*CASES, "model-file"])
def test_deepspeed_reads_the_config_and_partitions_as_written(name, tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.setenv("LOCAL_RANK", "0")
    plan = _model_file_plan() if name == "model-file" else case(name)
    export, doc = _approx(plan)
    path = tmp_path / "ds.json"
    path.write_text(export.text)
    pm = doc.get("autoplan_pipeline_module")
    if pm is None:  # pp 1: a plain module, no mpu: DeepSpeed's batch world is the whole world (AutoTP too)
        with _fake_world(plan.num_gpus):
            config = DeepSpeedConfig(str(path))
        assert config.world_size == plan.num_gpus == plan.dp * plan.tp
        assert config.train_batch_size == plan.job.global_batch * plan.tp  # each tp rank counts its shared batch
    else:
        for stage in range(plan.pp):
            rank = plan.rank(stage, 0, 0)
            with _fake_world(plan.num_gpus, rank):
                module = _pipeline_module(pm)
                assert module.stage_id == stage and [int(p) for p in module.parts] == pm["parts"]
                start, stop = pm["parts"][stage], pm["parts"][stage + 1]
                assert [type(f).__name__ for f in module.forward_funcs] == [
                    layer["class"] or "UserBlock" for layer in pm["layers"][start:stop]]
                if pm["kwargs"]["activation_checkpoint_interval"]:
                    # which layers DeepSpeed checkpoints: the transformer layers, or (no names) all of them
                    assert module.activation_checkpoint_interval == 1
                    named = "checkpointable_layers" in pm["kwargs"]
                    assert [module._is_checkpointable([f]) for f in module.forward_funcs] == [
                        type(f).__name__ == LAYER_CLASS or not named for f in module.forward_funcs]
                # the engine's mpu is the module's grid: dp world size = plan.dp
                config = DeepSpeedConfig(str(path), mpu=module.mpu())
        if not any(d.startswith(("stage cuts", "interleaved")) for d in export.differences):
            assert pm["parts"] == list(plan.boundaries)
        assert config.world_size == plan.dp and config.train_batch_size == plan.job.global_batch
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (
        plan.micro_batch_size, plan.num_microbatches)
    assert config.zero_optimization_stage == doc["zero_optimization"]["stage"]
    assert config.bfloat16_config.enabled and not config.float16_config.enabled
    # the pipeline section PipelineEngine reads: the checkpoint interval (and reentrancy) as written
    assert config.pipeline["activation_checkpoint_interval"] == (plan.recompute != "none" and plan.pp > 1)
    assert {k: config.pipeline[k] for k in doc.get("pipeline", {})} == doc.get("pipeline", {})


@pytest.mark.export
@pytest.mark.parametrize("name", CASES)
def test_deepspeed_initialize_builds_the_engine_the_file_describes(name, tmp_path, monkeypatch):
    """`deepspeed.initialize(model, optimizer, config=ds.json)` on rank 0 of a fake world (CPU): the
    PipelineEngine over the PipelineModule built from the file (pp > 1), or a plain engine; the
    plan's own ZeRO 2 is what PipelineEngine refuses, which is why the file says stage 1."""
    pytest.importorskip("deepspeed")
    import deepspeed
    import torch

    monkeypatch.setenv("LOCAL_RANK", "0")
    plan = case(name)
    export, doc = _approx(plan)
    path = tmp_path / "ds.json"
    path.write_text(export.text)
    pm = doc.get("autoplan_pipeline_module")
    with _fake_world(plan.num_gpus):
        if pm:
            model = _pipeline_module(pm)
        elif "tensor_parallel" in doc:
            model = _hf_llama(plan)  # AutoTP shards a Hugging Face-style model's linear layers
        else:
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                          config=str(path))
        assert type(engine).__name__ == ("PipelineEngine" if pm else "DeepSpeedEngine")
        assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), engine.dp_world_size,
                engine.zero_optimization_stage()) == (plan.micro_batch_size, plan.num_microbatches, plan.dp,
                                                      doc["zero_optimization"]["stage"])
        if "tensor_parallel" in doc:
            # AutoTP: the engine's data-parallel world is the plan's dp (world / tp), each of its ranks
            # holding 1/tp of every attention projection
            assert (engine.dp_world_size, engine.mp_world_size) == (plan.dp, plan.tp)
            attention = model.model.layers[0].self_attn
            assert attention.q_proj.weight.shape[0] == attention.config.hidden_size // plan.tp
        if pm:
            assert engine.module.activation_checkpoint_interval == pm["kwargs"]["activation_checkpoint_interval"]
            if plan.zero >= 2:
                as_planned = {**doc, "zero_optimization": {"stage": plan.zero}}
                again = _pipeline_module(pm)
                with pytest.raises(AssertionError, match="ZeRO-2 and ZeRO-3 are incompatible"):
                    deepspeed.initialize(model=again, optimizer=torch.optim.AdamW(again.parameters()), config=as_planned)


@pytest.mark.export
def test_deepspeed_keeps_the_rules_the_exporter_cites():
    """The restrictions behind the differences, in the installed DeepSpeed: PipelineEngine refuses
    ZeRO 2 / 3, MiCS (hybrid sharding) is gone, and the partition algorithms are the ones mirrored."""
    pytest.importorskip("deepspeed")
    import inspect

    from deepspeed.runtime import utils
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from deepspeed.runtime.pipe.engine import PipelineEngine

    assert "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in inspect.getsource(PipelineEngine.__init__)
    with pytest.raises(DeepSpeedConfigError, match="MiCS"):
        DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    rng = random.Random(0)
    for _ in range(200):
        n, parts = rng.randint(1, 24), rng.randint(1, 6)
        weights = [rng.choice([0, 1]) if rng.random() < 0.7 else rng.randint(0, 9) for _ in range(n)]
        assert [int(p) for p in utils.partition_balanced(weights, parts)] == partition_balanced(weights, parts)
        assert [int(p) for p in utils.partition_uniform(n, parts)] == partition_uniform(n, parts)


@pytest.mark.export
def test_the_cli_writes_a_file_deepspeed_reads(tmp_path):
    """The user's path: `autoplan suggest --out p.json`, `autoplan export p.json --to deepspeed
    --out ds.json`, then DeepSpeed's own config reader on ds.json."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    def autoplan(*args):
        done = subprocess.run([sys.executable, "-m", "autoplan", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "AUTOPLAN_CACHE_DIR": str(tmp_path / "cache")})
        assert done.returncode == 0, done.stderr
        return done

    autoplan("suggest", "--model", GPT, "--cluster", "1x2xA100-80GB", "--global-batch", "16", "--seq-len", "256",
             "--pp", "1", "--tp", "1", "--dp", "2", "--micro-batch-size", "4", "--zero", "1", "--out", "p.json")
    done = autoplan("export", "p.json", "--to", "deepspeed", "--out", "ds.json")
    assert "run it: deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json" in done.stderr
    assert "approximate:" not in done.stderr
    with _fake_world(2):
        config = DeepSpeedConfig(str(tmp_path / "ds.json"))
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.zero_optimization_stage, config.world_size) == (16, 4, 2, 1, 2)
