"""Context and expert parallelism in the exports: torchtitan and Megatron-LM state cp (their own
context-parallel degree, data parallelism counted without it); DeepSpeed's config cannot and refuses;
mixture-of-experts plans are refused where the target has no such model, ep listed as a difference
where it exports any model. The `export` tests parse the torchtitan file with torchtitan itself."""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
from export_cases import case
from test_export_megatron import _parse as parse_megatron
from test_export_megatron import _sourced_args
from test_export_torchtitan import _literal_settings
from test_export_torchtitan import _parse as parse_torchtitan

import autoplan
from autoplan.report.export import EXPORT_TARGETS, ExportError, TargetRefusal, export_plan

LLAMA = "llama:num_layers=12,hidden_size=256,num_heads=4,num_kv_heads=2,vocab_size=32000,max_seq_len=2048"
MOE = ("moe:num_layers=4,hidden_size=64,num_heads=4,num_kv_heads=2,ffn_hidden_size=96,vocab_size=256,max_seq_len=64,"
       "num_experts=4,experts_per_token=2")


@functools.cache
def cp_plan():
    """tp 2 x pp 2 x dp 2 on 8 GPUs, the dp ranks one cp group: one replica, sequences split in two."""
    return autoplan.suggest(LLAMA, "1x8xA100-80GB", global_batch=16, seq_len=2048, tp=2, pp=2, dp=2, cp=2,
                            schedule="1f1b", zero=1, top=1)[0]


def test_the_cp_plan_is_what_the_tests_assume():
    plan = cp_plan()
    assert (plan.cp, plan.replicas, plan.num_gpus) == (2, 1, 8)


def test_torchtitan_states_cp_and_counts_data_parallelism_without_it():
    plan = cp_plan()
    training, p, _ = _literal_settings(export_plan(plan, "torchtitan", allow_approx=True).text)
    assert (p["context_parallel_degree"], p["context_parallel_load_balancer"]) == (2, "headtail")
    batch_degree = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
    assert batch_degree == plan.replicas
    assert batch_degree * p["context_parallel_degree"] * p["tensor_parallel_degree"] * p[
        "pipeline_parallel_degree"] == plan.num_gpus
    accumulation = training["global_batch_size"] // (training["local_batch_size"] * batch_degree)
    assert accumulation * training["local_batch_size"] // p["pipeline_parallel_microbatch_size"] == plan.num_microbatches


def test_megatron_states_cp_and_its_batch_arithmetic_holds(tmp_path):
    plan = cp_plan()
    ns = parse_megatron(_sourced_args(export_plan(plan, "megatron", allow_approx=True).text, tmp_path))
    assert ns.context_parallel_size == 2
    dp = plan.num_gpus // (ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size * ns.context_parallel_size)
    assert dp == plan.replicas
    assert ns.global_batch_size == ns.micro_batch_size * dp * plan.num_microbatches == plan.job.global_batch


def test_deepspeed_refuses_cp_in_one_line():
    with pytest.raises(ExportError, match="DeepSpeed's config has no context parallelism") as info:
        export_plan(cp_plan(), "deepspeed", allow_approx=True)
    assert "\n" not in str(info.value)


@functools.cache
def moe_plan():
    return autoplan.suggest(MOE, "1x4xcpu", global_batch=8, seq_len=32, ep=2, pp=1, top=1)[0]


def test_moe_plans():
    plan = moe_plan()
    for target in ("torchtitan", "megatron"):
        with pytest.raises(ExportError) as refused:
            export_plan(plan, target, allow_approx=True)
        # issue 29: each refusal once advised the other, which refuses a mixture of experts too
        message = str(refused.value)
        assert "(a mixture of experts)" in message and "\n" not in message
        assert "--to deepspeed --allow-approx (it differs: ep 2:" in message
        assert "--to megatron" not in message and "--to torchtitan" not in message
    export = export_plan(plan, "deepspeed", allow_approx=True)
    assert any(d.startswith("ep 2: DeepSpeed splits experts only inside its own deepspeed.moe") for d in
               export.differences)
    assert "(ep 2)" in export.text


@pytest.mark.export
def test_torchtitan_parses_the_cp_export(tmp_path):
    pytest.importorskip("torchtitan")
    plan = cp_plan()
    export = export_plan(plan, "torchtitan", allow_approx=True, filename=str(tmp_path / "cp_plan.py"))
    config = parse_torchtitan(export.text, tmp_path, "cp_plan")
    p = config.parallelism
    assert (p.context_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree) == (2, 2, 2)
    assert p.context_parallel_load_balancer == "headtail"
    assert p.data_parallel_replicate_degree * p.data_parallel_shard_degree * 2 * 2 * 2 == plan.num_gpus
    assert config.training.seq_len == 2048 and config.training.global_batch_size == 16


def _named_targets(message: str) -> list[str]:
    return re.findall(r"--to (\w+)", message)


@pytest.mark.parametrize("make", [moe_plan, cp_plan, lambda: case("gpt"), lambda: dataclasses.replace(moe_plan(), cp=2)],
                         ids=["moe-ep2", "cp", "gpt", "moe-cp2"])
def test_a_refusal_names_only_targets_that_write_the_plan(make):
    """Every target a refusal names exports the plan (exactly, or with --allow-approx where it says
    so), and a plan no target writes is said to be one."""
    plan = make()
    refusals = {}
    for target in EXPORT_TARGETS:
        try:
            export_plan(plan, target, allow_approx=True)
        except TargetRefusal as exc:
            refusals[target] = str(exc)
    assert refusals
    writers = [t for t in EXPORT_TARGETS if t not in refusals]
    exact = [t for t in writers if not export_plan(plan, t, allow_approx=True).differences]
    for target, message in refusals.items():
        named = _named_targets(message)
        # the targets that run it as planned; failing those, every target that writes it at all
        assert sorted(named) == sorted(exact or writers), (target, message)
        for other in named:
            exact = not export_plan(plan, other, allow_approx=True).differences
            assert (f"--to {other} --allow-approx" in message) == (not exact), message
        if not writers:
            assert "no export target runs this plan" in message and "re-plan" in message


def test_the_cli_refuses_a_moe_plan_naming_the_target_that_writes_it(tmp_path, capsys):
    """The user's path: `autoplan export moe.json --to megatron` exits 2 with one line that names
    DeepSpeed (the target that writes a mixture of experts), and that export then succeeds."""
    from autoplan.cli import main

    path = tmp_path / "moe.json"
    moe_plan().save(path)
    assert main(["export", str(path), "--to", "megatron", "--out", str(tmp_path / "m.sh")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autoplan: error: Megatron-LM's pretrain_gpt.py builds only")
    assert "--to deepspeed --allow-approx" in err[0] and not (tmp_path / "m.sh").exists()
    assert main(["export", str(path), "--to", "deepspeed", "--allow-approx", "--out", str(tmp_path / "d.json")]) == 0
    assert (tmp_path / "d.json").exists()
