"""Exports of a plan to torchtitan (TOML), Megatron-LM (arguments) and DeepSpeed (JSON)."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import tomllib

import autoplan
from autoplan.report.export import ExportError, export_plan, stage_layer_counts

SMALL = "gpt:num_layers=8,hidden_size=256,num_heads=4,vocab_size=1024,max_seq_len=256"

# Real Megatron-LM flags (megatron/training/arguments.py); every exported flag must be one of them.
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--micro-batch-size", "--global-batch-size", "--seq-length", "--num-layers", "--sequence-parallel",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--use-distributed-optimizer",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--bf16", "--fp16", "--use-torch-fsdp2",
}


def _plan(**pins):
    kw = dict(pp=4, tp=1, dp=1, schedule="1f1b", micro_batch_size=2) | pins
    return autoplan.suggest(SMALL, "1x4xA100-80GB", global_batch=16, seq_len=256, **kw)[0]


@pytest.fixture(scope="module")
def plan():
    return _plan()


@pytest.fixture(scope="module")
def interleaved():
    return _plan(pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2, zero=1)


def _megatron_args(text: str) -> dict[str, str | None]:
    body = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    start, end = body.index("MEGATRON_ARGS=("), body.index(")")
    tokens = shlex.split(" ".join(body[start + 1:end]))
    args: dict[str, str | None] = {}
    for tok in tokens:
        if tok.startswith("--"):
            args[tok] = None
            last = tok
        else:
            args[last] = tok
    return args


def test_torchtitan(plan):
    cfg = tomllib.loads(export_plan(plan, "torchtitan"))
    par = cfg["parallelism"]
    assert (par["pipeline_parallel_degree"], par["tensor_parallel_degree"]) == (4, 1)
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == plan.dp
    assert par["pipeline_parallel_schedule"] == "1F1B"
    assert par["pipeline_parallel_microbatch_size"] == plan.micro_batch_size
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == plan.num_stages
    assert parts[0][:2] == ["tok_embeddings", "pos_embeddings"]
    expected = [list(plan.block_names[s.first_block:s.end_block]) for s in plan.stages]
    expected[0] = ["tok_embeddings", "pos_embeddings"] + expected[0][1:]
    assert parts == expected
    assert cfg["activation_checkpoint"]["mode"] == plan.recompute
    assert cfg["training"]["global_batch_size"] == 16


def test_torchtitan_interleaved_and_zb(interleaved):
    text = export_plan(interleaved, "torchtitan")
    par = tomllib.loads(text)["parallelism"]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert len(par["module_fqns_per_model_part"]) == 4
    assert par["data_parallel_shard_degree"] == 2 and "FSDP" in text
    zb = export_plan(_plan(schedule="zb-h1"), "torchtitan")
    assert tomllib.loads(zb)["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
    assert "# zb-h1" in zb and "ZeroBubble" in zb


def test_megatron(plan, interleaved):
    args = _megatron_args(export_plan(plan, "megatron"))
    assert set(args) <= MEGATRON_FLAGS
    assert args["--tensor-model-parallel-size"] == "1" and args["--pipeline-model-parallel-size"] == "4"
    assert args["--micro-batch-size"] == "2" and args["--global-batch-size"] == "16"
    assert args["--num-layers"] == "8"
    iargs = _megatron_args(export_plan(interleaved, "megatron"))
    assert set(iargs) <= MEGATRON_FLAGS
    assert iargs["--num-layers-per-virtual-pipeline-stage"] == "2"
    assert "--use-distributed-optimizer" in iargs


def test_megatron_uneven_cuts(plan):
    # Stages of 1, 3, 3, 1 layers: the first and last stage counts must be passed explicitly.
    cuts = (0, 2, 5, 8, 11)
    stages = tuple(dataclasses.replace(s, first_block=a, end_block=b)
                   for s, a, b in zip(plan.stages, cuts[:-1], cuts[1:]))
    uneven = dataclasses.replace(plan, stages=stages)
    assert stage_layer_counts(uneven) == [1, 3, 3, 1]
    text = export_plan(uneven, "megatron")
    args = _megatron_args(text)
    assert set(args) <= MEGATRON_FLAGS
    assert args["--decoder-first-pipeline-num-layers"] == "1"
    assert args["--decoder-last-pipeline-num-layers"] == "1"
    ds = json.loads(export_plan(uneven, "deepspeed"))
    assert ds["_autoplan_pipeline"]["layer_boundaries"] == list(cuts)


def test_deepspeed(plan):
    cfg = json.loads(export_plan(plan, "deepspeed"))
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * plan.dp
    assert cfg["gradient_accumulation_steps"] == plan.num_microbatches
    assert cfg["zero_optimization"]["stage"] == plan.zero
    pipe = cfg["_autoplan_pipeline"]
    assert pipe["num_stages"] == 4 and pipe["layer_boundaries"] == list(plan.boundaries)
    assert isinstance(cfg["_comment"], list) and any("partition_method" in c for c in cfg["_comment"])
    assert "custom" not in json.dumps(pipe)


def test_unknown_target(plan):
    with pytest.raises(ExportError, match="unknown export target 'jax'.*torchtitan, megatron, deepspeed"):
        export_plan(plan, "jax")


def test_export_command_writes_file(plan, tmp_path, capsys):
    import argparse

    from rich.console import Console

    from autoplan.report.commands import register

    plan.save(tmp_path / "plan.json")
    parser = argparse.ArgumentParser(prog="autoplan")
    register(parser.add_subparsers(dest="command"), lambda stderr=False: Console(stderr=stderr))
    args = parser.parse_args(["export", str(tmp_path / "plan.json"), "--to", "deepspeed", "--out", str(tmp_path / "ds.json")])
    assert args.func(args) == 0
    assert json.loads((tmp_path / "ds.json").read_text())["train_batch_size"] == 16
    args = parser.parse_args(["export", str(tmp_path / "plan.json"), "--to", "megatron"])
    assert args.func(args) == 0
    assert "--pipeline-model-parallel-size 4" in capsys.readouterr().out
